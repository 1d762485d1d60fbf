/* compute.c — the compute share: cost estimates, pacing, and the launch hooks. */
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* === compute share ===
 * Each launch is charged its estimated GPU time, and the container's processes draw on
 * one bucket per device kept in the usage file as a virtual clock (GCRA): a launch moves
 * the clock cost / sm.max ahead and waits (sleeping, never spinning, never failing)
 * until the clock is at most SM_BURST_NS ahead of real time.  A launch that comes late
 * keeps up to SM_BURST_NS of the time it did not use (the clock is never more than that
 * behind): a program that synchronises after each kernel spends the time its kernel
 * waited behind a neighbour's late, and a kernel costing more than a burst would
 * otherwise sleep the difference after every such wait (a 70% slice got 58%).  The share it moves at is
 * the slice's allowance (board.c): in ceiling mode sm.max; in burst mode its guarantee
 * (sm.request) plus what the device's other slices leave idle, up to sm.max.
 *   estimate: per (function, grid) the lower envelope of sampled CUDA event timings
 *             (one launch in SAMPLE_EVERY, a bounded number of samples in flight);
 *             graph launches likewise per executable graph;
 *   correction: every SM_CHECK_NS one of its processes sets a cost scale to the ratio
 *             of the GPU time NVML measured for the container to the estimates of
 *             what it launched, both summed over the last few seconds (event timings
 *             also count time spent waiting behind other tenants' kernels; NVML does
 *             not).
 * Unpaced (sm.max = 100%, and in burst mode sm.request = 100% too) a launch costs a
 * generation check and a branch. */

#define SM_FULL 10000u
#define SM_BURST_NS 20000000ull        /* how far the virtual clock may run ahead */
#define SM_CHECK_NS 500000000ull       /* correction period */
#define SAMPLE_EVERY 64
#define SAMPLE_AGE_NS 50000000ull      /* ... or when the last sample is older than this */
#define YOUNG_SAMPLES 8                /* ... or at the next launch, until it has this many */
#define MAX_SAMPLES 16
#define ESTIMATE_BITS 12
#define CORR_ONE 65536ull
#define BACKLOG_NS 40000000ull        /* bound_backlog: a queue this far behind its launches waits */
#define BACKLOG_POLL_NS 500000ull
#define BACKLOG_WAIT_MAX 2000          /* polls: 1 s, never for ever */
#define SAMPLE_WAIT_MAX_NS 1000000000ull   /* await_sample: never for ever either */

struct estimate { uint64_t key, ns, sampled_at; uint32_t launches; uint16_t sampling, learned; };
static struct estimate estimates[1u << ESTIMATE_BITS];   /* per process; races only blur an average */
static uint64_t typical_ns;                    /* for launches not measured yet */

/* busy: 0 free, 1 being started, 2 in flight, 3 being read.  A slot keeps its two events
 * (created once per context: creating events is not cheap on a real driver). */
struct sample { int busy; uint64_t key, launched_ns; CUcontext ctx; CUevent start, end; };
static struct sample samples[MAX_SAMPLES];
static int in_flight;   /* samples with busy == 2 */

static uint64_t first_paced_ns;   /* this process's first paced launch (the correction's) */

/* The allowance and the cost scale as a paced launch uses them, per device and process:
 * looked up once per board period (without a board, as often), and at the correction's
 * check (maybe_correct is asked then), with the wall time's factor worked out, so that a
 * launch neither calls into the board nor divides.  wall = corr * SM_FULL / allowance in
 * 32.32 fixed point, rounded up (a wall time a few nanoseconds long at most, never short).  Written by
 * whichever thread finds it stale (expired, or reset: a new quota generation, a fork): corr,
 * wall and allowed first, then expires (release), read in the other order; a race only has
 * two threads look it up. */
static struct lane {
    uint64_t expires;   /* CLOCK_MONOTONIC: the board's period's end, the correction's next check */
    uint64_t corr;      /* the cost scale (usage file: sm_correction), 16.16 */
    uint64_t wall;      /* corr * SM_FULL / allowance, 32.32: an estimate's wall time on the clock */
    uint32_t allowed;
} lanes[VGPU_MAX_DEVICES];

/* When bound_backlog next needs to look (CLOCK_MONOTONIC): the oldest sample in flight
 * comes of age then; 0: look now.  Lowered by every sample sent, raised only by a look. */
static uint64_t backlog_due;


void compute_atfork_child(void)   /* the samples' events are the parent's; NVML sees a new pid */
{
    memset(samples, 0, sizeof samples);
    in_flight = 0;
    first_paced_ns = 0;
    memset(lanes, 0, sizeof lanes);
    backlog_due = 0;
}

/* Derived from the quota, recomputed only when its generation moves. */
static uint32_t sm_gen_seen = 1;             /* (odd: never computed) */
static int sm_any_limited;
static int sm_pacing[VGPU_MAX_DEVICES];     /* SM_FREE, SM_PACED or SM_DENIED */
enum { SM_FREE, SM_PACED, SM_DENIED };    /* SM_DENIED: a device the slice was not given (sm.max 0) */
static uint32_t sm_guarantee[VGPU_MAX_DEVICES], sm_ceiling[VGPU_MAX_DEVICES];
static int sm_only_device = -1;              /* the device, when the process sees just one */
#define SM_FLOOR 100u   /* the least a paced slice is allowed (1%): a launch never waits for ever */

/* Any device paced?  While the quota does not change: its generation, compared with the one
 * last seen, and one load (inline: the unpaced launch is a handful of instructions).  A
 * device is paced when its ceiling (sm.max) is below the device, or, in burst mode, its
 * guarantee (sm.request) is below its ceiling: then it bursts only into time nobody
 * guaranteed wants, and must yield the moment they do. */
static __attribute__((noinline, cold)) int sm_recompute(uint64_t g)
{
    int any = 0, count = 0, burst = !(LOAD(&S.quota->flags) & VGPU_QUOTA_SM_CEILING);
    /* devices the process cannot see take no launch: only the visible ones decide whether
     * any launch is paced (all of them when the driver cannot say how many there are) */
    if (!real_cuDeviceGetCount || real_cuDeviceGetCount(&count) != CUDA_SUCCESS || count <= 0 ||
        count > VGPU_MAX_DEVICES)
        count = VGPU_MAX_DEVICES;
    for (uint32_t d = 0; d < VGPU_MAX_DEVICES; d++) {
        uint32_t sm = d < S.quota->device_count ? LOAD(&S.quota->devices[d].sm_max) : 0;
        uint32_t req = d < S.quota->device_count ? LOAD(&S.quota->devices[d].sm_request) : 0;
        uint32_t floor = burst && req < sm ? req : sm;
        sm = sm > SM_FULL ? SM_FULL : sm;
        floor = floor < SM_FLOOR ? SM_FLOOR : floor > sm ? sm : floor;
        STORE(&sm_ceiling[d], sm);
        STORE(&sm_guarantee[d], floor);
        int pacing = sm == 0 ? SM_DENIED : sm < SM_FULL || floor < sm ? SM_PACED : SM_FREE;
        STORE(&sm_pacing[d], pacing);
        any |= d < (uint32_t)count && pacing != SM_FREE;
    }
    /* with one visible device (the usual container), launches need not ask which */
    STORE(&sm_only_device, count == 1 ? 0 : -1);
    STORE(&sm_any_limited, any);
    __atomic_store_n(&sm_gen_seen, (uint32_t)g, __ATOMIC_SEQ_CST);
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)   /* allowances looked up under the old quota */
        __atomic_store_n(&lanes[d].expires, 0, __ATOMIC_SEQ_CST);
    return any;
}

static inline int sm_limited(void)
{
    if (S.mode != MODE_ENFORCE)
        return 0;
    uint64_t g = LOAD(&S.quota->generation);
    if (UNLIKELY((uint32_t)g != LOAD(&sm_gen_seen)))
        return sm_recompute(g);
    return LOAD(&sm_any_limited);
}

/* The share a paced device runs at now: the board's allowance (burst: guarantee ..
 * ceiling; ceiling mode: the ceiling, published so burst neighbours leave it alone), or
 * without a board the guarantee (time is lent only when it is seen to be idle). */
static uint32_t allowance(int dev, int board, uint64_t now)
{
    uint32_t floor = LOAD(&sm_guarantee[dev]), cap = LOAD(&sm_ceiling[dev]);
    uint32_t a = board ? board_update(dev, floor, cap, now, &S.usage->devices[dev]) : floor;
    return a < floor ? floor : a > cap ? cap : a;
}

static inline int launch_device(void)
{
    int d = LOAD(&sm_only_device);
    return d >= 0 ? d : current_device();
}

/* Counters are added to the usage file in batches: one shared atomic per launch would
 * cost more than the pacing itself.  Each thread batches in a block of its own, and every
 * block is on one list, so that what is still batched is flushed at exit (a destructor),
 * before fork (a prepare handler: the child starts with nothing batched) and when a thread
 * ends (a key destructor; its block is then reused by a later thread).  The owner alone
 * writes its block's running totals (plain stores, no locked instruction); a flusher moves
 * a total's flushed mark up to it with a compare-and-swap and adds the difference: a launch
 * is counted once, whichever thread flushes it. */
#define BATCH 64
struct pending {
    uint64_t launches[VGPU_MAX_DEVICES], gpu_time_ns[VGPU_MAX_DEVICES];   /* totals (owner) */
    uint64_t launches_flushed[VGPU_MAX_DEVICES], gpu_time_flushed[VGPU_MAX_DEVICES];
    int in_use;                   /* owned by a live thread */
    struct pending *next;         /* never unlinked: blocks are reused, not freed */
} __attribute__((aligned(64)));
static struct pending *pending_list;
static TLS struct pending *my_pending;
static pthread_key_t pending_key;
static pthread_once_t pending_once = PTHREAD_ONCE_INIT;

/* what `total` holds beyond `flushed`, taken (the flushed mark moved up to it) */
static uint64_t take_unflushed(const uint64_t *total, uint64_t *flushed)
{
    uint64_t t = LOAD(total), f = LOAD(flushed);
    while (f < t && !__atomic_compare_exchange_n(flushed, &f, t, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        ;
    return f < t ? t - f : 0;
}

static void flush_block(struct pending *p)
{
    if (!S.usage)
        return;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        if (LOAD(&p->launches[d]) == LOAD(&p->launches_flushed[d]) &&
            LOAD(&p->gpu_time_ns[d]) == LOAD(&p->gpu_time_flushed[d]))
            continue;
        uint64_t n = take_unflushed(&p->launches[d], &p->launches_flushed[d]);
        uint64_t ns = take_unflushed(&p->gpu_time_ns[d], &p->gpu_time_flushed[d]);
        if (n)
            __atomic_add_fetch(&S.usage->devices[d].launches, n, __ATOMIC_RELAXED);
        if (ns)
            __atomic_add_fetch(&S.usage->devices[d].gpu_time_ns, ns, __ATOMIC_RELAXED);
    }
}

/* The owner's flush of one device, its batch full */
static __attribute__((noinline)) void flush_device(struct pending *p, int d)
{
    uint64_t n = take_unflushed(&p->launches[d], &p->launches_flushed[d]);
    uint64_t ns = take_unflushed(&p->gpu_time_ns[d], &p->gpu_time_flushed[d]);
    if (!S.usage)
        return;
    if (n)
        __atomic_add_fetch(&S.usage->devices[d].launches, n, __ATOMIC_RELAXED);
    if (ns)
        __atomic_add_fetch(&S.usage->devices[d].gpu_time_ns, ns, __ATOMIC_RELAXED);
}

static void flush_all(void)
{
    for (struct pending *p = LOAD(&pending_list); p; p = p->next)
        flush_block(p);
}

static void thread_ends(void *block)
{
    struct pending *p = block;
    flush_block(p);
    STORE(&p->in_use, 0);
}

/* In the child only the forking thread lives on: every other block is free again, and
 * whatever reached them after the prepare handler's flush is the parent's to count. */
static void pending_atfork_child(void)
{
    for (struct pending *p = LOAD(&pending_list); p; p = p->next) {
        memset(p->launches, 0, sizeof p->launches);
        memset(p->gpu_time_ns, 0, sizeof p->gpu_time_ns);
        memset(p->launches_flushed, 0, sizeof p->launches_flushed);
        memset(p->gpu_time_flushed, 0, sizeof p->gpu_time_flushed);
        p->in_use = p == my_pending;
    }
}

static void pending_setup(void)
{
    pthread_key_create(&pending_key, thread_ends);
    pthread_atfork(flush_all, NULL, pending_atfork_child);
}

__attribute__((destructor)) static void flush_at_exit(void) { flush_all(); }

static __attribute__((noinline)) struct pending *pending_claim(void)
{
    struct pending *p;
    pthread_once(&pending_once, pending_setup);
    for (p = LOAD(&pending_list); p; p = p->next) {
        int idle = 0;
        if (__atomic_compare_exchange_n(&p->in_use, &idle, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            break;
    }
    if (!p) {
        void *m = NULL;
        if (posix_memalign(&m, 64, sizeof *p))
            return NULL;   /* not counted rather than a crash */
        p = memset(m, 0, sizeof *p);
        p->in_use = 1;
        p->next = LOAD(&pending_list);
        while (!__atomic_compare_exchange_n(&pending_list, &p->next, p, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            ;
    }
    pthread_setspecific(pending_key, p);
    return my_pending = p;
}

/* Count one launch on `dev` in the thread's block p.  The caller flushes the device's
 * batch when it is full (BATCH launches), or every device's before it sleeps. */
static inline void count_launch(struct pending *p, int dev, uint64_t cost)
{
    __atomic_store_n(&p->launches[dev], p->launches[dev] + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&p->gpu_time_ns[dev], p->gpu_time_ns[dev] + cost, __ATOMIC_RELAXED);
}

static struct estimate *estimate_for(uint64_t key)
{
    return &estimates[(key * 0x9E3779B97F4A7C15ull) >> (64 - ESTIMATE_BITS)];
}

/* The kernel's estimate, 0 while it has none (its bucket another kernel's, or unmeasured). */
static inline uint64_t known_ns(const struct estimate *e, uint64_t key)
{
    return LOAD(&e->key) == key ? LOAD(&e->ns) : 0;
}

/* Is sample sp still in flight, its kernel not done?  (end: its event, read once by the caller) */
static inline int sample_pending(struct sample *sp, CUevent end)
{
    return LOAD(&sp->busy) == 2 && real_cuEventQuery(end) == CUDA_ERROR_NOT_READY;
}

static void learn(uint64_t key, uint64_t ns)
{
    struct estimate *e = estimate_for(key);
    uint64_t old = LOAD(&e->ns);
    uint16_t learned = LOAD(&e->learned);
    if (LOAD(&e->key) != key || old == 0) {
        STORE(&e->key, key);
        STORE(&e->ns, ns);
        learned = 1;
    } else {
        /* follow the lower envelope: a sample is the kernel's time plus any wait behind
         * other tenants' work, so the shortest samples are the truest; rise slowly.
         * Where the device is shared most samples are such (tenants' kernels alternate
         * in its queue): rising by 1/64 of each, the estimates of four tenants of a full
         * GPU ran 1-2% high and each got up to 1.4 points less than its share; by 1/256
         * under 1 (docs/benchmarks.md).  A kernel that really got longer is followed by
         * the cost scale (the device time NVML measured) within seconds. */
        STORE(&e->ns, ns < old ? ns : old + (ns - old) / 256);
        learned += learned < YOUNG_SAMPLES;
    }
    STORE(&e->learned, learned);
    /* a young estimate is sampled again at the next launch: a kernel's first sample counts
     * the queue it waited behind (a woken 70% slice's first read 12.3 ms of a 2 ms kernel,
     * its neighbour's work queued before it yielded), and until a lower one came it ran at
     * a sixth of its share (SAMPLE_AGE_NS, and a harvest every 8 launches of 17 ms each:
     * 220 ms) */
    if (learned < YOUNG_SAMPLES)
        STORE(&e->sampled_at, 0);
    DEBUG("kernel %llx: sampled %.3f ms, estimate %.3f ms", (unsigned long long)key, ns / 1e6, LOAD(&e->ns) / 1e6);
    uint64_t t = LOAD(&typical_ns);
    STORE(&typical_ns, t ? (t * 7 + ns) / 8 : ns);
    STORE(&e->sampling, 0);
}

/* A sample pace() asked for and the launch did not take (every slot in flight, no
 * context, no event, a launch that failed), or one dropped unread: the next launch of its
 * kernel may take one.  Left set, a kernel whose first sample was not taken was never
 * sampled: charged the typical launch's time for good (a 16 ms kernel next to 2 ms ones
 * got 100% of a 30% slice), every launch of it through pace() (its sample stayed due). */
static __attribute__((noinline, cold)) void allow_next_sample(uint64_t key)
{
    STORE(&estimate_for(key)->sampling, 0);
}

/* Collect finished samples (bounded work: MAX_SAMPLES queries at most). */
static __attribute__((noinline, cold)) void harvest(void)
{
    for (int i = 0; i < MAX_SAMPLES; i++) {
        struct sample *sp = &samples[i];
        int flying = 2;
        if (LOAD(&sp->busy) != 2 ||
            !__atomic_compare_exchange_n(&sp->busy, &flying, 3, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        CUresult done = real_cuEventQuery(sp->end);
        if (done == CUDA_ERROR_NOT_READY) {
            STORE(&sp->busy, 2);   /* not done yet */
            continue;
        }
        /* any other answer drops the sample: an event recorded in a capturing stream
         * (a launch captured into a graph) is never to be queried (CUDA_ERROR_CAPTURED_EVENT),
         * and kept, such samples held every slot for good */
        float ms = 0;
        if (done == CUDA_SUCCESS && real_cuEventElapsedTime(&ms, sp->start, sp->end) == CUDA_SUCCESS && ms >= 0)
            learn(sp->key, ms > 0 ? (uint64_t)((double)ms * 1e6) : 1);   /* 0 means "not measured" */
        else
            allow_next_sample(sp->key);
        __atomic_sub_fetch(&in_flight, 1, __ATOMIC_RELAXED);
        STORE(&sp->busy, 0);
    }
}

/* Wait for sample sp to finish (its event polled, sleeping 20 us at first and up to
 * BACKLOG_POLL_NS), then collect what finished.  At most SAMPLE_WAIT_MAX_NS: a kernel can
 * wait on what its program has not done yet (a stream memory wait on a flag the host
 * sets after this launch), and the program's launch must not hang on the shim's wait. */
static void await_sample(struct sample *sp)
{
    CUevent end = sp->end;
    for (uint64_t waited = 0, step = 20000; waited < SAMPLE_WAIT_MAX_NS && sample_pending(sp, end);
         waited += step, step = step * 2 < BACKLOG_POLL_NS ? step * 2 : BACKLOG_POLL_NS) {
        struct timespec ts = {0, (long)step};
        nanosleep(&ts, NULL);
    }
    harvest();
}

/* A kernel never measured yet: wait for its first sample rather than queue unknown
 * amounts of work for free (once per kernel and grid). */
static __attribute__((noinline, cold)) void await_first_sample(uint64_t key)
{
    for (int i = 0; i < MAX_SAMPLES; i++) {
        struct sample *sp = &samples[i];
        if (LOAD(&sp->busy) == 2 && sp->key == key) {
            await_sample(sp);
            return;
        }
    }
}

/* Wait for the oldest sample in flight and collect it: a slot for a kernel never
 * measured yet.  0 when none was in flight to wait for. */
static __attribute__((noinline, cold)) int await_oldest_sample(void)
{
    struct sample *oldest = NULL;
    for (int i = 0; i < MAX_SAMPLES; i++)
        if (LOAD(&samples[i].busy) == 2 && (!oldest || LOAD(&samples[i].launched_ns) < LOAD(&oldest->launched_ns)))
            oldest = &samples[i];
    if (!oldest)
        return 0;
    await_sample(oldest);
    return 1;
}

/* A sample slot taken (busy 1), its events made anew when they are another context's;
 * NULL when every slot is in flight. */
static struct sample *take_sample(CUcontext ctx)
{
    for (int i = 0; i < MAX_SAMPLES; i++) {
        int idle = 0;
        struct sample *sp = &samples[i];
        if (!__atomic_compare_exchange_n(&sp->busy, &idle, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        if (sp->ctx != ctx) {   /* events belong to a context: make this slot's anew */
            if (sp->ctx && real_cuEventDestroy_v2) {
                real_cuEventDestroy_v2(sp->start);
                real_cuEventDestroy_v2(sp->end);
            }
            sp->ctx = NULL;
            if (real_cuEventCreate(&sp->start, 0) == CUDA_SUCCESS) {
                if (real_cuEventCreate(&sp->end, 0) == CUDA_SUCCESS)
                    sp->ctx = ctx;
                else if (real_cuEventDestroy_v2)
                    real_cuEventDestroy_v2(sp->start);
            }
        }
        return sp;
    }
    return NULL;
}

/* Start measuring this launch: returns the sample to finish after it, or NULL (the
 * sample is then not taken).  With every slot in flight a kernel never measured waits
 * for the oldest (at most MAX_SAMPLES unknown kernels run ahead of their measurement); a
 * known one's sample is skipped.  A launch captured into a graph runs nothing now: not
 * sampled (its events could never be read, and a wait on them is not the shim's to make
 * inside someone's capture). */
static struct sample *sample_begin(uint64_t key, CUstream stream, int per_thread)
{
    CUresult (*record)(CUevent, CUstream) = per_thread ? real_cuEventRecord_ptsz : real_cuEventRecord;
    CUresult (*capturing)(CUstream, CUstreamCaptureStatus *) =
        per_thread ? real_cuStreamIsCapturing_ptsz : real_cuStreamIsCapturing;
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    CUcontext ctx = NULL;
    if (record && real_cuEventCreate && real_cuEventQuery && real_cuEventElapsedTime && real_cuCtxGetCurrent &&
        (!capturing || (capturing(stream, &status) == CUDA_SUCCESS && status == CU_STREAM_CAPTURE_STATUS_NONE)) &&
        real_cuCtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx) {
        if (LOAD(&in_flight))
            harvest();
        struct sample *sp = take_sample(ctx);
        if (!sp && !known_ns(estimate_for(key), key) && await_oldest_sample())
            sp = take_sample(ctx);
        if (sp) {
            sp->key = key;
            if (sp->ctx && record(sp->start, stream) == CUDA_SUCCESS)
                return sp;
            STORE(&sp->busy, 0);
        }
    }
    allow_next_sample(key);
    return NULL;
}

static void sample_end(struct sample *sp, CUstream stream, int per_thread, CUresult launched)
{
    CUresult (*record)(CUevent, CUstream) = per_thread ? real_cuEventRecord_ptsz : real_cuEventRecord;
    if (launched == CUDA_SUCCESS && record(sp->end, stream) == CUDA_SUCCESS) {
        uint64_t t = now_ns(), due = LOAD(&backlog_due);
        sp->launched_ns = t;
        __atomic_add_fetch(&in_flight, 1, __ATOMIC_RELAXED);
        STORE(&sp->busy, 2);
        while (t + BACKLOG_NS < due &&   /* (after busy: a look that sees this due sees the sample) */
               !__atomic_compare_exchange_n(&backlog_due, &due, t + BACKLOG_NS, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            ;
    } else {
        STORE(&sp->busy, 0);
        allow_next_sample(sp->key);
    }
}

/* The device's queue, bounded: a sample launched more than BACKLOG_NS ago and still not
 * finished means this process's work runs that far behind its launches (its costs are
 * underestimated, or the device is oversubscribed), and more work queued now would only
 * sit in front of the neighbours'.  Wait (sleeping) until it is done.  Estimates do not
 * enter into it: it holds while the correction is still learning. */
static __attribute__((noinline, cold)) uint64_t bound_backlog(int dev, uint64_t now)
{
    uint64_t waited = 0, due = LOAD(&backlog_due), next = UINT64_MAX;
    int b = board_entry(dev);
    for (int i = 0; i < MAX_SAMPLES; i++) {
        struct sample *sp = &samples[i];
        if (LOAD(&sp->busy) != 2 || now - LOAD(&sp->launched_ns) < BACKLOG_NS || now < LOAD(&sp->launched_ns))
            continue;
        CUevent end = sp->end;
        for (int n = 0; n < BACKLOG_WAIT_MAX && sample_pending(sp, end); n++) {
            struct timespec ts = {0, (long)BACKLOG_POLL_NS};
            nanosleep(&ts, NULL);
            waited += BACKLOG_POLL_NS;
            if (b) {   /* kept from launching is wanting more, not idle: the board must see it */
                board_note_wait(dev, BACKLOG_POLL_NS);
                if (n % 40 == 39)
                    allowance(dev, b, now_ns());
            }
        }
    }
    for (int i = 0; i < MAX_SAMPLES; i++)   /* when to look again: the oldest still in flight comes of age */
        if (LOAD(&samples[i].busy) == 2 && LOAD(&samples[i].launched_ns) + BACKLOG_NS < next)
            next = LOAD(&samples[i].launched_ns) + BACKLOG_NS;
    /* (a sample sent since lowered it: that stays) */
    __atomic_compare_exchange_n(&backlog_due, &due, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    return waited;
}

static uint64_t wall_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000u;
}

/* What NVML saw the container's processes use on `dev` over the last `window_ns`: the
 * sum of their per-process SM and memory utilization (percent of the device).  Returns
 * how many samples of theirs NVML had (0: none of them ran, or none was sampled in the
 * window); -1 when NVML cannot say. */
static int own_utilization(int dev, uint64_t window_ns, uint64_t *sm_pct, uint64_t *mem_pct)
{
    *sm_pct = *mem_pct = 0;
    if (nvml_start() || !real_nvmlDeviceGetProcessUtilization || !real_nvmlDeviceGetHandleByIndex_v2)
        return -1;
    nvmlDevice_t h;
    nvmlProcessUtilizationSample_t smp[VGPU_MAX_PROCS * 2];
    unsigned int n = VGPU_MAX_PROCS * 2;
    if (nvml_handle(dev, &h))
        return -1;
    nvmlReturn_t r = real_nvmlDeviceGetProcessUtilization(h, smp, &n, wall_us() - window_ns / 1000);
    if (r == NVML_ERROR_NOT_FOUND)
        return 0;   /* no process ran a kernel in the window, or none was sampled in it */
    if (r != NVML_SUCCESS)
        return -1;
    /* Each slot's process as NVML names it, by its host pid: the node agent writes that in
     * the slot (state).  Before it has, only a process of the root pid namespace is known by
     * its own: a container's pid may be a neighbour's host pid.  A free slot keeps its last
     * process's state (drain_slot clears only the pid): none.  (A tenant writing another's
     * pid there misleads only its own cost scale, which its usage file holds anyway.) */
    uint32_t nvml_pid[VGPU_MAX_PROCS];
    for (int p = 0; p < VGPU_MAX_PROCS; p++) {
        const struct vgpu_usage_proc *slot = &S.usage->procs[p];
        uint32_t host = LOAD(&slot->state);
        if (!host && LOAD(&slot->pid_ns) == ROOT_PID_NS_INODE)
            host = (uint32_t)LOAD(&slot->pid);
        nvml_pid[p] = LOAD(&slot->pid) > 0 && !(LOAD(&slot->flags) & VGPU_PROC_SHARED) ? host : 0;
    }
    int own = 0;
    for (unsigned int i = 0; i < n; i++)
        for (int p = 0; p < VGPU_MAX_PROCS; p++)
            if (nvml_pid[p] && nvml_pid[p] == smp[i].pid) {
                *sm_pct += smp[i].smUtil;
                *mem_pct += smp[i].memUtil;
                own++;
            }
    return own;
}

/* GPU time NVML saw the container's processes use on `dev` over the last `window_ns`;
 * NOT_MEASURED when NVML cannot say -- or has no sample of theirs in the window.  It is
 * only asked after the container launched work in the window, and a driver samples each
 * process at its own pace (1/6 s to 1 s by product, nvidia-smi(1)): no sample in a window
 * shorter than that is no news, not idleness.  Read as idle, every other half-second
 * window of a 1 s pace halved the cost scale's measure: a 30/70% pair ran 50/50 (simgpu's
 * SIMGPU_PROCESS_SAMPLE_MS=1000). */
#define NOT_MEASURED UINT64_MAX
static uint64_t measured_ns(int dev, uint64_t window_ns)
{
    uint64_t sm, mem;
    if (own_utilization(dev, window_ns, &sm, &mem) <= 0)
        return NOT_MEASURED;
    return sm * window_ns / 100;
}

/* Every SM_CHECK_NS, one process of the container (whoever moves sm_check_ns first)
 * adds the GPU time NVML measured for the container's processes, and the estimates of
 * what they launched, to two sums that lose an eighth each check (about four
 * seconds of memory), and sets the cost scale to their ratio: what the device really spent per
 * estimated nanosecond.  Over a few windows the integer percentages NVML reports and the
 * few long kernels of a half-second window average out (a single window of 20 ms
 * kernels is a handful of them).  Whenever the container launched something: one held
 * back by the device (its queue full) rather than by its share is mis-estimated just
 * the same, and would queue work in front of its neighbours. */
static void maybe_correct(int dev, struct vgpu_usage_device *u, uint64_t now)
{
    uint64_t last = LOAD(&u->sm_check_ns);
    if (now - last < SM_CHECK_NS ||
        !__atomic_compare_exchange_n(&u->sm_check_ns, &last, now, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return;
    uint64_t raw_total = LOAD(&u->sm_raw_ns);
    uint64_t raw = raw_total - __atomic_exchange_n(&u->sm_check_raw_ns, raw_total, __ATOMIC_ACQ_REL);
    uint64_t window = now - last;
    uint64_t mine = LOAD(&first_paced_ns);
    if (!mine || last < mine) {   /* the sums are another process's (its estimates, its pids) */
        STORE(&u->sm_measured_sum, 0);
        STORE(&u->sm_raw_sum, 0);
        return;
    }
    if (!last || window > 4 * SM_CHECK_NS || raw < window / 100 || last < mine + 2 * SM_CHECK_NS)
        return;   /* first period, a long pause, too little launched to judge, or the process's
                   * first second (its first kernels queue and wait to be measured) */
    uint64_t actual = measured_ns(dev, window);
    if (actual == NOT_MEASURED)
        return;
    uint64_t m = LOAD(&u->sm_measured_sum), r = LOAD(&u->sm_raw_sum);
    m = m - m / 8 + actual;
    r = r - r / 8 + raw;
    STORE(&u->sm_measured_sum, m);
    STORE(&u->sm_raw_sum, r);
    uint64_t old = LOAD(&u->sm_correction), corr = (uint64_t)((double)CORR_ONE * m / r);
    old = old ? old : CORR_ONE;
    corr = corr > old * 2 ? old * 2 : corr < old / 2 ? old / 2 : corr;   /* one window moves it at most 2x */
    if (corr < CORR_ONE / 16)
        corr = CORR_ONE / 16;
    if (corr > CORR_ONE * 16)
        corr = CORR_ONE * 16;
    STORE(&u->sm_correction, corr);
    DEBUG("device %d: measured %.1f%%, estimated %.1f%%: cost scale %.3f", dev, 100.0 * actual / window,
          100.0 * raw / window, (double)corr / CORR_ONE);
}

static __attribute__((noinline, cold)) void lane_refresh(int dev, struct vgpu_usage_device *u, uint64_t now)
{
    struct lane *l = &lanes[dev];
    uint32_t gen = __atomic_load_n(&sm_gen_seen, __ATOMIC_SEQ_CST);
    if (UNLIKELY(!LOAD(&first_paced_ns)))   /* (lanes start expired, and again in a forked child) */
        STORE(&first_paced_ns, now);
    if (now - LOAD(&u->sm_check_ns) >= SM_CHECK_NS)
        maybe_correct(dev, u, now);
    int b = board_entry(dev);
    uint32_t a = allowance(dev, b, now);
    uint64_t corr = LOAD(&u->sm_correction), check = LOAD(&u->sm_check_ns) + SM_CHECK_NS;
    corr = corr ? corr : CORR_ONE;
    uint64_t expires = b ? board_period(dev) + BOARD_PERIOD_NS : now + BOARD_PERIOD_NS;
    STORE(&l->allowed, a);
    STORE(&l->corr, corr);
    STORE(&l->wall, ((corr * SM_FULL << 16) + a - 1) / a);
    __atomic_store_n(&l->expires, check > now && check < expires ? check : expires, __ATOMIC_SEQ_CST);
    /* a quota that moved meanwhile (sm_recompute: generation, then every lane reset) may
     * have been read half old: look again at the next launch */
    if (__atomic_load_n(&sm_gen_seen, __ATOMIC_SEQ_CST) != gen)
        __atomic_store_n(&l->expires, 0, __ATOMIC_SEQ_CST);
}

/* The charge: the device's virtual clock moved by the launch's wall time (waiting is the
 * caller's), its estimate added to the correction's sum, the thread's counters (p: its
 * block).  Returns where the clock is now. */
static inline __attribute__((always_inline)) uint64_t charge(int dev, struct pending *p, uint64_t raw, uint64_t now)
{
    struct lane *l = &lanes[dev];
    struct vgpu_usage_device *u = &S.usage->devices[dev];
    uint64_t cost = raw * LOAD(&l->corr) >> 16;
    uint64_t wall = (uint64_t)(((unsigned __int128)raw * LOAD(&l->wall)) >> 32);   /* cost * SM_FULL / allowance */
    uint64_t t = LOAD(&u->sm_vtime_ns), next, floor = now - SM_BURST_NS;   /* late: keeps a burst */
    do
        next = (t > floor ? t : floor) + wall;
    while (!__atomic_compare_exchange_n(&u->sm_vtime_ns, &t, next, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    __atomic_add_fetch(&u->sm_raw_ns, raw, __ATOMIC_RELAXED);
    if (LIKELY(p))
        count_launch(p, dev, cost);
    return next;
}

/* A launch whose virtual clock ran more than a burst ahead: its thread's batch flushed
 * (it sleeps anyway), then it sleeps until the clock is a burst ahead.  Returns the time then. */
static __attribute__((noinline, cold)) uint64_t throttle(int dev, uint64_t next, uint64_t now)
{
    struct vgpu_usage_device *u = &S.usage->devices[dev];
    if (my_pending)
        flush_block(my_pending);
    struct timespec ts = {.tv_sec = (time_t)((next - SM_BURST_NS) / 1000000000ull),
                          .tv_nsec = (long)((next - SM_BURST_NS) % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
    if (LOAD(&in_flight))
        harvest();   /* a sample finished while it slept counts at once, not 8 launches on */
    /* held at its own ceiling (what the autoscaler can raise), or below it for the
     * neighbours' guarantees (what it cannot) */
    __atomic_add_fetch(LOAD(&lanes[dev].allowed) < LOAD(&sm_ceiling[dev]) ? &u->yielded_ns : &u->throttled_ns,
                       next - SM_BURST_NS - now, __ATOMIC_RELAXED);
    return next - SM_BURST_NS;
}

/* Wait for the container's share, charge the launch, and say whether to sample it
 * (1), not (0), or that the launch is refused (-1: a device the slice was not given). */
static __attribute__((noinline)) int pace(uint64_t key)
{
    int dev = launch_device();
    int pacing = (unsigned)dev < VGPU_MAX_DEVICES ? LOAD(&sm_pacing[dev]) : SM_FREE;
    if (pacing == SM_FREE)
        return 0;
    if (pacing == SM_DENIED)
        return -1;   /* fail closed, like its memory; never a wait */
    struct estimate *e = estimate_for(key);
    uint64_t raw = known_ns(e, key);
    if (!raw && LOAD(&e->sampling)) {
        await_first_sample(key);
        raw = known_ns(e, key);
    }
    uint32_t n = __atomic_load_n(&e->launches, __ATOMIC_RELAXED) + 1;   /* (a race loses one: a blur) */
    __atomic_store_n(&e->launches, n, __ATOMIC_RELAXED);
    uint64_t now = now_ns();
    if (now >= LOAD(&backlog_due) && bound_backlog(dev, now))   /* (none in flight: it puts the look off) */
        now = now_ns();
    /* sample the unknown, one launch in SAMPLE_EVERY, and any kernel whose estimate has
     * aged (a rare, expensive-looking kernel must get the chance to look cheaper) */
    int sample = (raw == 0 || n % SAMPLE_EVERY == 0 || now - LOAD(&e->sampled_at) > SAMPLE_AGE_NS) &&
                 !LOAD(&e->sampling);
    if (!raw)
        raw = LOAD(&typical_ns);
    if (now >= LOAD(&lanes[dev].expires))
        lane_refresh(dev, &S.usage->devices[dev], now);
    struct pending *p = my_pending ? my_pending : pending_claim();
    uint64_t next = charge(dev, p, raw, now);
    if (p && p->launches[dev] - LOAD(&p->launches_flushed[dev]) >= BATCH)
        flush_device(p, dev);
    if (next > now + SM_BURST_NS)
        now = throttle(dev, next, now);
    if (!sample && LOAD(&in_flight) && n % 8 == 0)
        harvest();   /* finished samples are collected every few launches, not each */
    if (sample) {
        STORE(&e->sampling, 1);
        STORE(&e->sampled_at, now);
    }
    return sample;
}

/* After a fast-path charge: its clock over a burst ahead, or the thread's eighth launch
 * (its batch may be full; finished samples are collected). */
static __attribute__((noinline, cold)) void charged(struct pending *p, uint64_t next, uint64_t now)
{
    if (p->launches[0] - LOAD(&p->launches_flushed[0]) >= BATCH)
        flush_device(p, 0);
    if (next > now + SM_BURST_NS)
        throttle(0, next, now);
    if (LOAD(&in_flight) && p->launches[0] % 8 == 0)
        harvest();
}

/* pace() for the usual launch: one device (device 0), paced, an estimate known and no
 * sample due, the allowance current, no backlog look due.  Either charges it as pace()
 * would (0: launch) or leaves everything to pace() (1), having charged nothing.  Out of
 * line: the hook saves its arguments around one call, and this saves only the key around
 * its clock read (inline, the hook's arguments crowded out its registers: 20 more). */
static __attribute__((noinline)) int pace_fast(uint64_t key)
{
    if (UNLIKELY(LOAD(&sm_only_device) != 0) || UNLIKELY(LOAD(&sm_pacing[0]) != SM_PACED))
        return 1;
    uint64_t now = now_ns();
    struct estimate *e = estimate_for(key);
    struct pending *p = my_pending;
    uint32_t n = __atomic_load_n(&e->launches, __ATOMIC_RELAXED) + 1;
    if (UNLIKELY(LOAD(&e->key) != key))
        return 1;
    uint64_t raw = LOAD(&e->ns);
    if (UNLIKELY(!raw || n % SAMPLE_EVERY == 0 || now - LOAD(&e->sampled_at) > SAMPLE_AGE_NS ||
                 now >= LOAD(&backlog_due) || now >= LOAD(&lanes[0].expires) || !p))
        return 1;
    __atomic_store_n(&e->launches, n, __ATOMIC_RELAXED);
    uint64_t next = charge(0, p, raw, now);
    if (UNLIKELY(next > now + SM_BURST_NS || p->launches[0] % 8 == 0))
        charged(p, next, now);
    return 0;
}

/* Every launch hook: unpaced, straight on to the driver (a tail call); paced, pace_fast,
 * then the driver (a tail call too); whatever pace_fast leaves (a sample, a refusal, a
 * period's look-ups) paced_<sym>, out of line.  Before init, or when the quota moved since
 * it was last read, ENTER's way (unready_<sym>).  `linkage name`: the hook (SHIM_EXPORT
 * and the symbol), or a static helper (the graph launches, wrapped by graph_launch). */
#define UNPAREN(...) __VA_ARGS__
#define LAUNCH_HOOK(linkage, name, sym, per_thread, key, stream, params, args)              \
    static __attribute__((noinline)) CUresult paced_##sym params                            \
    {                                                                                       \
        int p_ = pace(key);                                                                 \
        if (LIKELY(!p_))                                                                    \
            return real_##sym args;                                                         \
        if (p_ < 0)                                                                         \
            return CUDA_ERROR_NOT_PERMITTED;                                                \
        struct sample *sp_ = sample_begin((key), (stream), (per_thread));                   \
        CUresult r_ = real_##sym args;                                                      \
        if (sp_)                                                                            \
            sample_end(sp_, (stream), (per_thread), r_);                                    \
        return r_;                                                                          \
    }                                                                                       \
    static __attribute__((noinline)) CUresult unready_##sym params                          \
    {                                                                                       \
        ENTER(sym, UNPAREN args);                                                           \
        if (!sm_limited())                                                                  \
            return real_##sym args;                                                         \
        return paced_##sym args;                                                            \
    }                                                                                       \
    linkage CUresult name params                                                            \
    {                                                                                       \
        /* ready: init is done and no thread is in it (in_init is set only before) */       \
        if (UNLIKELY(!LOAD(&S.ready) || !real_##sym))                                       \
            return unready_##sym args;                                                      \
        if (S.mode != MODE_ENFORCE)                                                         \
            return real_##sym args;                                                         \
        if (UNLIKELY((uint32_t)LOAD(&S.quota->generation) != LOAD(&sm_gen_seen)))          \
            return unready_##sym args;                                                      \
        if (LIKELY(!LOAD(&sm_any_limited)) || LIKELY(!pace_fast(key)))                      \
            return real_##sym args;                                                         \
        return paced_##sym args;                                                            \
    }

static inline uint64_t kernel_key(CUfunction f, uint64_t blocks) { return (uint64_t)(uintptr_t)f * 1000003ull ^ blocks; }

#define GRID_KEY kernel_key(f, (uint64_t)gridDimX * gridDimY * gridDimZ)
#define KERNEL_PARAMS                                                                                       \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX, \
     unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,             \
     void **kernelParams, void **extra)
#define KERNEL_ARGS \
    (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra)
#define COOPERATIVE_PARAMS                                                                                  \
    (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ, unsigned int blockDimX, \
     unsigned int blockDimY, unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,             \
     void **kernelParams)
#define COOPERATIVE_ARGS \
    (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams)

LAUNCH_HOOK(SHIM_EXPORT, cuLaunchKernel, cuLaunchKernel, 0, GRID_KEY, hStream, KERNEL_PARAMS, KERNEL_ARGS)
LAUNCH_HOOK(SHIM_EXPORT, cuLaunchKernel_ptsz, cuLaunchKernel_ptsz, 1, GRID_KEY, hStream, KERNEL_PARAMS, KERNEL_ARGS)

static inline uint64_t config_key(const CUlaunchConfig *c, CUfunction f)
{
    return c ? kernel_key(f, (uint64_t)c->gridDimX * c->gridDimY * c->gridDimZ) : kernel_key(f, 0);
}

#define EX_PARAMS (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
#define EX_ARGS (config, f, kernelParams, extra)
LAUNCH_HOOK(SHIM_EXPORT, cuLaunchKernelEx, cuLaunchKernelEx, 0, config_key(config, f),
            config ? config->hStream : NULL, EX_PARAMS, EX_ARGS)
LAUNCH_HOOK(SHIM_EXPORT, cuLaunchKernelEx_ptsz, cuLaunchKernelEx_ptsz, 1, config_key(config, f),
            config ? config->hStream : NULL, EX_PARAMS, EX_ARGS)
LAUNCH_HOOK(SHIM_EXPORT, cuLaunchCooperativeKernel, cuLaunchCooperativeKernel, 0, GRID_KEY, hStream,
            COOPERATIVE_PARAMS, COOPERATIVE_ARGS)
LAUNCH_HOOK(SHIM_EXPORT, cuLaunchCooperativeKernel_ptsz, cuLaunchCooperativeKernel_ptsz, 1, GRID_KEY, hStream,
            COOPERATIVE_PARAMS, COOPERATIVE_ARGS)

/* A graph costs its measured duration, learnt per executable graph like a kernel. */
#define GRAPH_KEY kernel_key((CUfunction)(void *)hGraphExec, 1ull << 40)
LAUNCH_HOOK(static, paced_graph_launch, cuGraphLaunch, 0, GRAPH_KEY, hStream, (CUgraphExec hGraphExec, CUstream hStream),
            (hGraphExec, hStream))
LAUNCH_HOOK(static, paced_graph_launch_ptsz, cuGraphLaunch_ptsz, 1, GRAPH_KEY, hStream,
            (CUgraphExec hGraphExec, CUstream hStream), (hGraphExec, hStream))

/* A graph's memory nodes allocate at launch: admitted before it (what its allocation nodes
 * need), then the charge follows the graph reserve. */
static CUresult graph_launch(CUresult (*paced)(CUgraphExec, CUstream), CUgraphExec hGraphExec, CUstream hStream)
{
    ensure_init();
    if (S.mode != MODE_ENFORCE || in_init)
        return paced(hGraphExec, hStream);
    uint64_t taken[VGPU_MAX_DEVICES];
    CUresult r = graph_memory_admit(hGraphExec, taken);
    if (r != CUDA_SUCCESS)
        return r;
    r = paced(hGraphExec, hStream);
    graph_memory_launched(taken);
    if (r == CUDA_SUCCESS)
        graph_memory_settle(stream_device(hStream));
    return r;
}

SHIM_EXPORT CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(paced_graph_launch, hGraphExec, hStream);
}

SHIM_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    return graph_launch(paced_graph_launch_ptsz, hGraphExec, hStream);
}


/* === utilization inside a slice ===
 * nvmlDeviceGetUtilizationRates shows the slice, as the memory view does (total = the
 * cap): gpu = the GPU time the container's own processes used over the last second as a
 * share of what its sm.max allows (100% = its whole share is in use); with no SM limit,
 * their share of the whole device.  A neighbour's work is not in it.  memory = the
 * container's processes' memory-bandwidth use, as a share of the whole device (bandwidth
 * is not divided).  The figures are NVML's per-process utilization of the container's
 * processes (by the pids they see, as in the cost correction above); where NVML cannot
 * give it, the usage file's GPU-time counter since this process last asked, against
 * sm.max (limited slices only: an unlimited slice's launches are not counted), and else
 * the device's figure unchanged. */
#define UTIL_WINDOW_NS 1000000000ull

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    NVML_ENTER(nvmlDeviceGetUtilizationRates, device, utilization);
    nvmlReturn_t r = real_nvmlDeviceGetUtilizationRates(device, utilization);
    int dev = nvml_index(device);
    if (r != NVML_SUCCESS || dev < 0 || S.mode != MODE_ENFORCE)
        return r;
    uint32_t sm_max = (uint32_t)dev < S.quota->device_count ? LOAD(&S.quota->devices[dev].sm_max) : 0;
    uint64_t sm, mem, gpu;
    if (!sm_max) {
        utilization->gpu = utilization->memory = 0;   /* a device the slice was not given */
        return r;
    }
    if (own_utilization(dev, UTIL_WINDOW_NS, &sm, &mem) >= 0) {
        gpu = sm_max >= SM_FULL ? sm : sm * SM_FULL / sm_max;
        utilization->memory = (unsigned int)(mem > 100 ? 100 : mem);
    } else if (sm_max < SM_FULL) {
        static uint64_t last_at[VGPU_MAX_DEVICES], last_gpu[VGPU_MAX_DEVICES];
        uint64_t now = now_ns(), used = LOAD(&S.usage->devices[dev].gpu_time_ns);
        uint64_t at = __atomic_exchange_n(&last_at[dev], now, __ATOMIC_ACQ_REL);
        uint64_t before = __atomic_exchange_n(&last_gpu[dev], used, __ATOMIC_ACQ_REL);
        uint64_t allowed = at && now > at ? (now - at) * sm_max / SM_FULL : 0;
        gpu = allowed && used >= before ? (used - before) * 100 / allowed : 0;
        utilization->memory = 0;
    } else {
        return r;   /* nothing better than the device's figure */
    }
    utilization->gpu = (unsigned int)(gpu > 100 ? 100 : gpu);
    return r;
}
