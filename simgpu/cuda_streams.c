/* cuda_streams.c — simgpu's streams, stream memory operations (wait/write value, batches) and
 * events.
 */
#include "cuda_internal.h"

/* === streams === */

static __thread struct vgpu_stream *tls_pt_stream[SIMGPU_MAX_DEVICES];

static int stream_in_ctx(void *s, void *ctx) { return ((struct vgpu_stream *)s)->ctx == ctx; }
static int stream_in_ctx_not_null(void *s, void *ctx)
{
    return stream_in_ctx(s, ctx) && s != ((struct vgpu_ctx *)ctx)->null_stream;
}
static void memq_detach(struct vgpu_stream *s);
static int memops_pending(struct vgpu_stream *s);
static int ctx_memops_pending(struct vgpu_ctx *c);
static void memops_wait(struct vgpu_stream *s, struct vgpu_ctx *c);

static void stream_release(void *s)
{
    memq_detach(s);   /* its pending memory operations still complete */
    free(((struct vgpu_stream *)s)->pending);
}

void free_streams_of(struct vgpu_ctx *ctx, int keep_null_stream)
{
    handles_drop(K_STREAM, keep_null_stream ? stream_in_ctx_not_null : stream_in_ctx, ctx, stream_release);
}

static unsigned long long stream_ids;   /* the last stream id handed out */

struct vgpu_stream *stream_new(struct vgpu_ctx *ctx, unsigned flags, int priority)
{
    struct vgpu_stream *s = handle_new(K_STREAM);
    if (!s)
        return NULL;
    s->id = __atomic_add_fetch(&stream_ids, 1, __ATOMIC_RELAXED);
    s->pending = calloc(SIMGPU_QUEUE_DEPTH, sizeof *s->pending);
    if (!s->pending) {
        handle_free(s);
        return NULL;
    }
    s->ctx = ctx;
    s->flags = flags;
    s->priority = priority;
    pthread_mutex_init(&s->lock, NULL);
    return s;
}

/* NULL and CU_STREAM_LEGACY name the context's default stream; CU_STREAM_PER_THREAD (and
 * NULL in a _ptds/_ptsz entry point) this thread's own default stream. */
struct vgpu_stream *resolve_stream(CUstream h, CUresult *err)
{
    *err = CUDA_ERROR_INVALID_HANDLE;
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        struct vgpu_ctx *c = current_ctx();
        if (!c) {
            *err = CUDA_ERROR_INVALID_CONTEXT;
            return NULL;
        }
        if ((*err = ctx_use(c)) != CUDA_SUCCESS)
            return NULL;
        if (h == CU_STREAM_PER_THREAD || (h == NULL && tls_per_thread)) {
            struct vgpu_stream **pt = &tls_pt_stream[c->dev];
            if (!*pt || !handle_ok(*pt, K_STREAM) || (*pt)->ctx != c)
                *pt = stream_new(c, 0, 0);
            return *pt;
        }
        return c->null_stream;
    }
    if (!handle_ok(h, K_STREAM))
        return NULL;
    if (ctx_gpu_lost(((struct vgpu_stream *)h)->ctx)) {
        *err = CUDA_ERROR_UNKNOWN;
        return NULL;
    }
    return h;
}

SIMGPU_EXPORT CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    REQUIRE_CTX(c);
    if (!phStream || flags > 1)
        return CUDA_ERROR_INVALID_VALUE;
    struct vgpu_stream *s = stream_new(c, flags, priority);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *phStream = s;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int flags)
{
    return cuStreamCreateWithPriority(phStream, flags, 0);
}

SIMGPU_EXPORT CUresult cuStreamDestroy_v2(CUstream h)
{
    REQUIRE_INIT();
    if (!handle_ok(h, K_STREAM) || h == h->ctx->null_stream)
        return CUDA_ERROR_INVALID_HANDLE;
    stream_release(h);
    handle_free(h);   /* pending work still completes on the device timeline */
    return CUDA_SUCCESS;
}

static uint64_t stream_last_end(struct vgpu_stream *s)
{
    return __atomic_load_n(&s->last_end, __ATOMIC_ACQUIRE);
}

SIMGPU_EXPORT CUresult cuStreamSynchronize(CUstream h)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (s->capture)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    memops_wait(s, NULL);
    simgpu_sleep_until(stream_last_end(s));
    pools_release_over_threshold();
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream h) { PER_THREAD(cuStreamSynchronize(h)); }

SIMGPU_EXPORT CUresult cuStreamQuery(CUstream h)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (memops_pending(s))
        return CUDA_ERROR_NOT_READY;   /* a memory operation is still waiting */
    return simgpu_now_ns() >= stream_last_end(s) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIMGPU_EXPORT CUresult cuStreamQuery_ptsz(CUstream h) { PER_THREAD(cuStreamQuery(h)); }

SIMGPU_EXPORT CUresult cuStreamWaitEvent(CUstream h, CUevent ev, unsigned int flags)
{
    REQUIRE_INIT();
    (void)flags;
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!handle_ok(ev, K_EVENT))
        return CUDA_ERROR_INVALID_HANDLE;
    /* later work on s starts after the event: the device timeline is serial already,
     * so only the stream's notion of "done" moves */
    pthread_mutex_lock(&s->lock);
    if (ev->recorded && ev->t > s->last_end)
        __atomic_store_n(&s->last_end, ev->t, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&s->lock);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamWaitEvent_ptsz(CUstream h, CUevent ev, unsigned int flags)
{
    PER_THREAD(cuStreamWaitEvent(h, ev, flags));
}

SIMGPU_EXPORT CUresult cuStreamGetPriority(CUstream h, int *priority)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!priority)
        return CUDA_ERROR_INVALID_VALUE;
    *priority = s->priority;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamGetPriority_ptsz(CUstream h, int *priority)
{
    PER_THREAD(cuStreamGetPriority(h, priority));
}

SIMGPU_EXPORT CUresult cuStreamGetFlags(CUstream h, unsigned int *flags)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    *flags = s->flags;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamGetFlags_ptsz(CUstream h, unsigned int *flags)
{
    PER_THREAD(cuStreamGetFlags(h, flags));
}

SIMGPU_EXPORT CUresult cuStreamGetCtx(CUstream h, CUcontext *pctx)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = s->ctx;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamGetCtx_ptsz(CUstream h, CUcontext *pctx) { PER_THREAD(cuStreamGetCtx(h, pctx)); }

/* cuda.h, cuStreamGetId: "the unique Id which is associated with the given stream handle.
 * The Id is unique for the life of the program"; the special streams (NULL,
 * CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) have theirs.  Ids are never reused, though
 * handles are. */
SIMGPU_EXPORT CUresult cuStreamGetId(CUstream h, unsigned long long *streamId)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!streamId)
        return CUDA_ERROR_INVALID_VALUE;
    *streamId = s->id;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamGetId_ptsz(CUstream h, unsigned long long *streamId)
{
    PER_THREAD(cuStreamGetId(h, streamId));
}

/* cuda.h, cuStreamGetDevice: "the device to which a stream belongs" (its context's). */
SIMGPU_EXPORT CUresult cuStreamGetDevice(CUstream h, CUdevice *device)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    *device = s->ctx->dev;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamGetDevice_ptsz(CUstream h, CUdevice *device)
{
    PER_THREAD(cuStreamGetDevice(h, device));
}

SIMGPU_EXPORT CUresult cuLaunchHostFunc(CUstream h, host_fn fn, void *userData)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!fn)
        return CUDA_ERROR_INVALID_VALUE;
    /* runs once the stream's earlier work is done; simgpu runs it on the caller's thread */
    simgpu_sleep_until(stream_last_end(s));
    fn(userData);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuLaunchHostFunc_ptsz(CUstream h, host_fn fn, void *userData)
{
    PER_THREAD(cuLaunchHostFunc(h, fn, userData));
}

SIMGPU_EXPORT CUresult cuCtxSynchronize(void)
{
    REQUIRE_CTX(c);
    memops_wait(NULL, c);
    simgpu_sleep_until(__atomic_load_n(&c->last_end, __ATOMIC_ACQUIRE));
    pools_release_over_threshold();
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    REQUIRE_INIT();
    if (!ctx)
        return cuCtxSynchronize();
    if (!handle_ok(ctx, K_CTX) || !ctx->active)
        return CUDA_ERROR_INVALID_CONTEXT;
    memops_wait(NULL, ctx);
    simgpu_sleep_until(__atomic_load_n(&ctx->last_end, __ATOMIC_ACQUIRE));
    pools_release_over_threshold();
    return CUDA_SUCCESS;
}

/* === stream memory operations (cuStreamWaitValue32, cuStreamWriteValue32, cuStreamBatchMemOp) ===
 * cuda.h: a wait "enqueues a synchronization of the stream on the given memory location.
 * Work ordered after the operation will block until the given condition on the memory
 * is satisfied" (default: (int32_t)(*addr - value) >= 0; EQ; AND: (*addr & value) != 0);
 * a write stores a value once the stream's earlier work is done.  Addresses are device
 * pointers (device memory, or page-locked host memory's device pointer); "None of the
 * operations accepts pointers to managed memory buffers".
 *
 * The model: each stream keeps its memory operations in order.  What can complete when it
 * is enqueued completes then (a wait whose condition holds; a write whose stream has no
 * unfinished work); the rest wait in the stream's queue, which a helper thread works
 * through (a write once the work queued before it has run, a wait once its condition
 * holds), and the stream is not done until its queue is empty: cuStreamQuery answers
 * CUDA_ERROR_NOT_READY, cuStreamSynchronize and cuCtxSynchronize wait (for ever, for a
 * condition nothing satisfies: "Improper use of this API may deadlock the application").
 * Kernels, copies and events queued after a waiting operation are not held back by it
 * (simgpu's kernels touch no memory and its copies are done when called).
 * The device attributes say what is supported: 32-bit operations and barriers of the v2
 * API; not CU_STREAM_WAIT_VALUE_NOR (CAN_USE_STREAM_WAIT_VALUE_NOR reads 0), 64-bit
 * operations (CAN_USE_64_BIT_STREAM_MEM_OPS reads 0), flushes of remote writes
 * (CAN_FLUSH_REMOTE_WRITES reads 0), nor the v1 API (CAN_USE_STREAM_MEM_OPS_V1 reads 0,
 * as on a driver loaded without NVreg_EnableStreamMemOPs=1, the default): those are
 * CUDA_ERROR_NOT_SUPPORTED. */

struct memop {
    int write;                  /* else a wait */
    uint32_t *addr;
    uint32_t value;
    unsigned flags;             /* a wait's condition */
    uint64_t due;               /* a write: the end of the work queued before it */
};

struct memq {
    struct memq *next;          /* every queue of the process */
    struct vgpu_stream *stream; /* NULL once the stream is destroyed */
    struct vgpu_ctx *ctx;
    struct memop *ops;
    size_t head, count, cap;
};

static pthread_mutex_t memop_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t memop_cond = PTHREAD_COND_INITIALIZER;   /* a queue got an operation */
static struct memq *memqs;
static int memop_thread_started;

#define MEMOP_POLL_NS 50000ull   /* how often the helper looks at waiting operations */

static int memop_wait_holds(const struct memop *op)
{
    uint32_t v = __atomic_load_n(op->addr, __ATOMIC_SEQ_CST);
    switch (op->flags) {
    case CU_STREAM_WAIT_VALUE_EQ: return v == op->value;
    case CU_STREAM_WAIT_VALUE_AND: return (v & op->value) != 0;
    default: return (int32_t)(v - op->value) >= 0;   /* GEQ, a cyclic comparison */
    }
}

/* Complete op if it can complete now; 1 if it did. */
static int memop_try(const struct memop *op)
{
    if (!op->write)
        return memop_wait_holds(op);
    if (simgpu_now_ns() < op->due)
        return 0;
    __atomic_store_n(op->addr, op->value, __ATOMIC_SEQ_CST);   /* with the fence the doc promises */
    return 1;
}

static uint32_t *memop_word(CUdeviceptr addr);

/* Under memop_lock: complete what can be completed of q; 1 if it is empty.  An operation
 * whose memory was freed meanwhile (a program error: the driver leaves it undefined) is
 * dropped rather than done. */
static int memq_run_locked(struct memq *q)
{
    while (q->count) {
        const struct memop *op = &q->ops[q->head];
        if (memop_word((CUdeviceptr)(uintptr_t)op->addr) && !memop_try(op))
            break;
        q->head = (q->head + 1) % q->cap;
        q->count--;
    }
    return q->count == 0;
}

static void memq_unlink_locked(struct memq *q)
{
    for (struct memq **p = &memqs; *p; p = &(*p)->next)
        if (*p == q) {
            __atomic_store_n(p, q->next, __ATOMIC_RELEASE);   /* (memops_pending reads memqs unlocked) */
            break;
        }
    free(q->ops);
    free(q);
}

static void *memop_thread(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&memop_lock);
    for (;;) {
        int waiting = 0;
        for (struct memq *q = memqs, *next; q; q = next) {
            next = q->next;
            if (!memq_run_locked(q))
                waiting = 1;
            else if (!q->stream)
                memq_unlink_locked(q);   /* its stream is gone and its work done */
        }
        if (!waiting) {
            pthread_cond_wait(&memop_cond, &memop_lock);
            continue;
        }
        pthread_mutex_unlock(&memop_lock);
        struct timespec ts = {0, (long)MEMOP_POLL_NS};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&memop_lock);
    }
    return NULL;
}

/* Under memop_lock: append op to s's queue (made on first use); 0, or -1 out of memory. */
static int memq_push_locked(struct vgpu_stream *s, const struct memop *op)
{
    struct memq *q = s->memq;
    if (!q) {
        if (!(q = calloc(1, sizeof *q)))
            return -1;
        q->stream = s;
        q->ctx = s->ctx;
        q->next = memqs;
        __atomic_store_n(&memqs, q, __ATOMIC_RELEASE);
        s->memq = q;
    }
    if (q->count == q->cap) {
        size_t cap = q->cap ? q->cap * 2 : 16;
        struct memop *ops = malloc(cap * sizeof *ops);
        if (!ops)
            return -1;
        for (size_t i = 0; i < q->count; i++)
            ops[i] = q->ops[(q->head + i) % q->cap];
        free(q->ops);
        q->ops = ops;
        q->cap = cap;
        q->head = 0;
    }
    q->ops[(q->head + q->count++) % q->cap] = *op;
    if (!memop_thread_started) {
        pthread_t t;
        pthread_attr_t attr;
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);   /* the helper takes none of the program's signals */
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        memop_thread_started = pthread_create(&t, &attr, memop_thread, NULL) == 0;
        pthread_attr_destroy(&attr);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (!memop_thread_started) {
            q->count--;
            return -1;
        }
    }
    pthread_cond_signal(&memop_cond);
    return 0;
}

/* Enqueue n operations on s, in order: each completes now if it can and nothing before it
 * waits, else it waits in the stream's queue. */
static CUresult memops_enqueue(struct vgpu_stream *s, const struct memop *ops, unsigned n)
{
    uint64_t due = stream_last_end(s);
    pthread_mutex_lock(&memop_lock);
    int queued = s->memq && !memq_run_locked(s->memq);
    CUresult r = CUDA_SUCCESS;
    for (unsigned i = 0; i < n && r == CUDA_SUCCESS; i++) {
        struct memop op = ops[i];
        op.due = due;
        if (!queued && memop_try(&op))
            continue;
        queued = 1;
        if (memq_push_locked(s, &op))
            r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&memop_lock);
    return r;
}

/* Does s still have memory operations to complete? */
static int memops_pending(struct vgpu_stream *s)
{
    if (!__atomic_load_n(&memqs, __ATOMIC_ACQUIRE))
        return 0;   /* no stream ever queued one: every sync call of every other program */
    pthread_mutex_lock(&memop_lock);
    int pending = s->memq && !memq_run_locked(s->memq);
    pthread_mutex_unlock(&memop_lock);
    return pending;
}

static int ctx_memops_pending(struct vgpu_ctx *c)
{
    if (!__atomic_load_n(&memqs, __ATOMIC_ACQUIRE))
        return 0;
    int pending = 0;
    pthread_mutex_lock(&memop_lock);
    for (struct memq *q = memqs; q && !pending; q = q->next)
        pending = q->ctx == c && !memq_run_locked(q);
    pthread_mutex_unlock(&memop_lock);
    return pending;
}

/* Wait until the memory operations of stream s (or of every stream of context c) are done. */
static void memops_wait(struct vgpu_stream *s, struct vgpu_ctx *c)
{
    while (s ? memops_pending(s) : ctx_memops_pending(c)) {
        struct timespec ts = {0, (long)MEMOP_POLL_NS};
        nanosleep(&ts, NULL);
    }
}

/* A stream that goes (cuStreamDestroy, its context destroyed): operations it still has
 * complete all the same ("resources associated with hStream will be released
 * automatically once the device has completed all work"). */
static void memq_detach(struct vgpu_stream *s)
{
    pthread_mutex_lock(&memop_lock);
    struct memq *q = s->memq;
    s->memq = NULL;
    if (q) {
        q->stream = NULL;
        if (memq_run_locked(q))
            memq_unlink_locked(q);
    }
    pthread_mutex_unlock(&memop_lock);
}

/* A context reset or destroyed: "reset all state" (cuDevicePrimaryCtxReset), its memory
 * is freed: the operations still pending on its streams are dropped, not done. */
void memops_drop_ctx(struct vgpu_ctx *c)
{
    pthread_mutex_lock(&memop_lock);
    for (struct memq *q = memqs, *next; q; q = next) {
        next = q->next;
        if (q->ctx != c)
            continue;
        q->count = 0;
        if (!q->stream)
            memq_unlink_locked(q);
    }
    pthread_mutex_unlock(&memop_lock);
}

/* In a forked child: the parent's queues and helper thread are the parent's. */
void forget_memops(void)
{
    pthread_mutex_init(&memop_lock, NULL);
    pthread_cond_init(&memop_cond, NULL);
    memqs = NULL;
    memop_thread_started = 0;
}

/* The 32-bit word at device pointer addr, if a memory operation may use it: 4-byte aligned,
 * in device memory or page-locked host memory, not managed memory. */
static uint32_t *memop_word(CUdeviceptr addr)
{
    struct ptr_info pi = ptr_info(addr);
    if (!pi.known || pi.a.kind == A_MANAGED || addr % 4)
        return NULL;
    uint64_t base = pi.a.kind == A_RESERVED ? pi.map_base : pi.a.base;
    uint64_t size = pi.a.kind == A_RESERVED ? pi.map_size : pi.a.size;
    return size >= 4 && addr - base <= size - 4 ? (uint32_t *)(uintptr_t)addr : NULL;
}

/* One operation of the v2 API, checked: CUDA_SUCCESS with *op filled, or why not. */
static CUresult memop_of(const CUstreamBatchMemOpParams *p, struct memop *op, int *skip)
{
    *skip = 0;
    switch (p->operation) {
    case CU_STREAM_MEM_OP_WAIT_VALUE_32:
        if (p->waitValue.flags & ~(3u | (unsigned)CU_STREAM_WAIT_VALUE_FLUSH))
            return CUDA_ERROR_INVALID_VALUE;
        if ((p->waitValue.flags & 3u) == CU_STREAM_WAIT_VALUE_NOR || (p->waitValue.flags & CU_STREAM_WAIT_VALUE_FLUSH))
            return CUDA_ERROR_NOT_SUPPORTED;
        if (!(op->addr = memop_word(p->waitValue.address)))
            return CUDA_ERROR_INVALID_VALUE;
        op->write = 0;
        op->value = p->waitValue.value;
        op->flags = p->waitValue.flags;
        return CUDA_SUCCESS;
    case CU_STREAM_MEM_OP_WRITE_VALUE_32:
        if (p->writeValue.flags)   /* NO_MEMORY_BARRIER "is not supported in the v2 API" */
            return CUDA_ERROR_INVALID_VALUE;
        if (!(op->addr = memop_word(p->writeValue.address)))
            return CUDA_ERROR_INVALID_VALUE;
        op->write = 1;
        op->value = p->writeValue.value;
        op->flags = 0;
        return CUDA_SUCCESS;
    case CU_STREAM_MEM_OP_BARRIER:   /* the operations are done in order, sequentially consistent */
        *skip = 1;
        return p->memoryBarrier.flags <= CU_STREAM_MEMORY_BARRIER_TYPE_GPU ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_STREAM_MEM_OP_WAIT_VALUE_64:
    case CU_STREAM_MEM_OP_WRITE_VALUE_64:
    case CU_STREAM_MEM_OP_FLUSH_REMOTE_WRITES:
        return CUDA_ERROR_NOT_SUPPORTED;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

/* cuda.h, cuStreamBatchMemOp: the operations "are enqueued in the order they appear in
 * the array"; count "Must be less than 256"; flags "must be 0".  All are checked before
 * any is enqueued. */
SIMGPU_EXPORT CUresult cuStreamBatchMemOp_v2(CUstream h, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                             unsigned int flags)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (count >= 256 || (count && !paramArray) || flags)
        return CUDA_ERROR_INVALID_VALUE;
    if (s->capture)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;   /* no memory-operation nodes in simgpu's graphs */
    struct memop ops[256];
    unsigned n = 0;
    for (unsigned i = 0; i < count; i++) {
        int skip;
        if ((err = memop_of(&paramArray[i], &ops[n], &skip)) != CUDA_SUCCESS)
            return err;
        n += !skip;
    }
    return memops_enqueue(s, ops, n);
}

/* cuda.h, cuStreamWaitValue32 (v2): the batch of one CU_STREAM_MEM_OP_WAIT_VALUE_32. */
SIMGPU_EXPORT CUresult cuStreamWaitValue32_v2(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    CUstreamBatchMemOpParams p = {.waitValue = {CU_STREAM_MEM_OP_WAIT_VALUE_32, addr, {value}, flags, 0}};
    return cuStreamBatchMemOp_v2(h, 1, &p, 0);
}

/* cuda.h, cuStreamWriteValue32 (v2): the batch of one CU_STREAM_MEM_OP_WRITE_VALUE_32. */
SIMGPU_EXPORT CUresult cuStreamWriteValue32_v2(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    CUstreamBatchMemOpParams p = {.writeValue = {CU_STREAM_MEM_OP_WRITE_VALUE_32, addr, {value}, flags, 0}};
    return cuStreamBatchMemOp_v2(h, 1, &p, 0);
}

SIMGPU_EXPORT CUresult cuStreamBatchMemOp_v2_ptsz(CUstream h, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                                  unsigned int flags)
{
    PER_THREAD(cuStreamBatchMemOp_v2(h, count, paramArray, flags));
}
SIMGPU_EXPORT CUresult cuStreamWaitValue32_v2_ptsz(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    PER_THREAD(cuStreamWaitValue32_v2(h, addr, value, flags));
}
SIMGPU_EXPORT CUresult cuStreamWriteValue32_v2_ptsz(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    PER_THREAD(cuStreamWriteValue32_v2(h, addr, value, flags));
}

/* The v1 API (the unversioned names, CUDA 8.0): CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1
 * reads 0 ("Deprecated, along with v1 MemOps API"), so after the stream is checked these
 * are CUDA_ERROR_NOT_SUPPORTED, as on a driver without NVreg_EnableStreamMemOPs=1. */
static CUresult memops_v1(CUstream h)
{
    REQUIRE_INIT();
    CUresult err;
    return resolve_stream(h, &err) ? CUDA_ERROR_NOT_SUPPORTED : err;
}

SIMGPU_EXPORT CUresult cuStreamBatchMemOp(CUstream h, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                          unsigned int flags)
{
    (void)count, (void)paramArray, (void)flags;
    return memops_v1(h);
}
SIMGPU_EXPORT CUresult cuStreamWaitValue32(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    (void)addr, (void)value, (void)flags;
    return memops_v1(h);
}
SIMGPU_EXPORT CUresult cuStreamWriteValue32(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    (void)addr, (void)value, (void)flags;
    return memops_v1(h);
}
SIMGPU_EXPORT CUresult cuStreamBatchMemOp_ptsz(CUstream h, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                               unsigned int flags)
{
    PER_THREAD(cuStreamBatchMemOp(h, count, paramArray, flags));
}
SIMGPU_EXPORT CUresult cuStreamWaitValue32_ptsz(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    PER_THREAD(cuStreamWaitValue32(h, addr, value, flags));
}
SIMGPU_EXPORT CUresult cuStreamWriteValue32_ptsz(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    PER_THREAD(cuStreamWriteValue32(h, addr, value, flags));
}

/* === events === */

#define CU_EVENT_DISABLE_TIMING 0x2

SIMGPU_EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    REQUIRE_CTX(c);
    (void)c;
    if (!phEvent || Flags > 0xf)
        return CUDA_ERROR_INVALID_VALUE;
    struct vgpu_event *e = handle_new(K_EVENT);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->flags = Flags;
    *phEvent = e;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuEventDestroy_v2(CUevent e)
{
    REQUIRE_INIT();
    if (!handle_ok(e, K_EVENT))
        return CUDA_ERROR_INVALID_HANDLE;
    handle_free(e);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuEventRecord(CUevent e, CUstream h)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!handle_ok(e, K_EVENT))
        return CUDA_ERROR_INVALID_HANDLE;
    /* recorded into a capture sequence, the event stands for work that has not run and
     * "the operation is not permitted on an event which was last recorded in a capturing
     * stream" (cuda.h, CUDA_ERROR_CAPTURED_EVENT; cuThreadExchangeStreamCaptureMode names
     * cuEventQuery on one): query, synchronize and elapsed time refuse it until it is
     * recorded again outside a capture */
    e->captured = s->capture != NULL;
    uint64_t now = simgpu_now_ns(), end = stream_last_end(s);
    e->t = end > now ? end : now;   /* completes when the stream's earlier work has */
    e->recorded = 1;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuEventRecord_ptsz(CUevent e, CUstream h) { PER_THREAD(cuEventRecord(e, h)); }

SIMGPU_EXPORT CUresult cuEventRecordWithFlags(CUevent e, CUstream h, unsigned int flags)
{
    (void)flags;
    return cuEventRecord(e, h);
}

SIMGPU_EXPORT CUresult cuEventRecordWithFlags_ptsz(CUevent e, CUstream h, unsigned int flags)
{
    PER_THREAD(cuEventRecordWithFlags(e, h, flags));
}

SIMGPU_EXPORT CUresult cuEventQuery(CUevent e)
{
    REQUIRE_INIT();
    if (!handle_ok(e, K_EVENT))
        return CUDA_ERROR_INVALID_HANDLE;
    if (e->captured)
        return CUDA_ERROR_CAPTURED_EVENT;
    return !e->recorded || simgpu_now_ns() >= e->t ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIMGPU_EXPORT CUresult cuEventSynchronize(CUevent e)
{
    REQUIRE_INIT();
    if (!handle_ok(e, K_EVENT))
        return CUDA_ERROR_INVALID_HANDLE;
    if (e->captured)
        return CUDA_ERROR_CAPTURED_EVENT;
    if (e->recorded)
        simgpu_sleep_until(e->t);
    pools_release_over_threshold();
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end)
{
    REQUIRE_INIT();
    if (!ms)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(start, K_EVENT) || !handle_ok(end, K_EVENT) || !start->recorded || !end->recorded ||
        ((start->flags | end->flags) & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_HANDLE;
    if (start->captured || end->captured)
        return CUDA_ERROR_CAPTURED_EVENT;
    uint64_t now = simgpu_now_ns();
    if (now < start->t || now < end->t)
        return CUDA_ERROR_NOT_READY;
    *ms = (float)(((double)end->t - (double)start->t) / 1e6);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end)
{
    return cuEventElapsedTime_v2(ms, start, end);
}
