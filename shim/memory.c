/* memory.c — the memory cap: accounting, contexts, the allocate and free hooks, the CUDA view.
 *
 * Hot path (an allocation under quota): no lock, no syscall, no log call — an add to
 * this process's charge, a sum over the container's slots, and a lock-free table insert.
 * Stream-ordered pools and graph memory are in pools.c, VMM handles in vmm.c, memory
 * shared between processes in shared_memory.c, NVML's memory view in view.c.
 */
#include "internal.h"
#include "footprint.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* === memory accounting === */

#define TABLE_BITS 20
#define TABLE_SIZE (1u << TABLE_BITS)
#define TOMBSTONE 1ull
#define ADMIT_TRIES 4
#define CLAIM_RETRY_NS 100000000ull   /* no free slot: try again after this */

/* The container's bytes on dev: the sum of its slots' charges (seq_cst loads: the
 * admission below relies on them).  A row whose sum passes 2^64 was written by hand (a
 * tenant writing a negative charge into a slot to make room): UINT64_MAX, so that nothing
 * more is admitted against it -- it never wraps around to a small figure.  Inline: the
 * allocation's path sums twice. */
static inline __attribute__((always_inline)) uint64_t row_sum(int dev)
{
    uint32_t n = LOAD(&S.usage->slots_used);
    if (UNLIKELY(n > VGPU_MAX_PROCS))
        n = VGPU_MAX_PROCS;   /* the file is the container's to scribble on */
    const uint64_t *row = S.usage->charge[dev];
    uint64_t used = 0;
    for (uint32_t i = 0; i < n; i++)
        if (UNLIKELY(__builtin_add_overflow(used, __atomic_load_n(&row[i], __ATOMIC_SEQ_CST), &used)))
            return UINT64_MAX;
    return used;
}

uint64_t memory_used(int dev)
{
    return row_sum(dev);
}

/* This process's slot, claimed on its first allocation after a fork (forked helpers
 * that never touch the GPU cost no slot) or, when all were taken, retried now and
 * then: slots come free as processes exit. */
static int have_slot(void)
{
    if (LIKELY(S.slot >= 0))
        return 1;
    if (S.mode != MODE_ENFORCE || S.usage_fd < 0 || now_ns() < LOAD(&S.next_claim_ns))
        return 0;
    pthread_mutex_lock(&S.lock);
    if (S.slot < 0 && claim_slot() < 0) {
        reap_dead_locked();
        if (claim_slot() < 0)
            STORE(&S.next_claim_ns, now_ns() + CLAIM_RETRY_NS);
    }
    pthread_mutex_unlock(&S.lock);
    return S.slot >= 0;
}

static inline void peak_at_least(struct vgpu_usage_device *u, uint64_t now)
{
    uint64_t peak = LOAD(&u->memory_peak);
    while (peak < now &&
           !__atomic_compare_exchange_n(&u->memory_peak, &peak, now, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        ;
}

void note_peak(struct vgpu_usage_device *u, uint64_t now)
{
    peak_at_least(u, now);
}

/* === context overhead ===
 * A context costs device memory of its own (hundreds of MiB per process on a real
 * card), which no allocation call shows.  On its first allocation on a device a process
 * is charged that overhead: VGPU_CONTEXT_OVERHEAD when set, else the node's measured
 * figure its quota carries, else what NVML says the process holds there beyond its charge
 * (the driver's own figure), else nothing.  NVML
 * names processes by their pid in the root pid namespace, so the figure is taken only
 * there, only from the one row under getpid() (two: a gone process's pid, reused, whose
 * memory a forked child keeps) and only up to what a context can cost: anything else is
 * another process's memory.  It is already spent, so it is charged without a cap check;
 * it comes back with the process's last context there. */

static pthread_mutex_t overhead_lock = PTHREAD_MUTEX_INITIALIZER;
static uint32_t overhead_devices;            /* bit d: charged on device d (overhead_lock) */
static uint64_t overhead_bytes[VGPU_MAX_DEVICES];

/* a context's own memory, at most (hundreds of MiB on today's cards, with its modules) */
#define CONTEXT_OVERHEAD_MAX (2ull << 30)

/* The rows NVML lists on device dev: their count, or -1 when NVML cannot say.  Read at
 * not_before or later: a list read since serves (a reap asks about every dead process's
 * slot, and asking NVML each time cost 28k instructions a slot: 880k for the first
 * allocation in a slice that 31 processes had left charged).  A reaper passes when it took
 * the slot's lock: its process was done with its files by then, so what the list shows
 * under its pid is what the driver still keeps for it. */
#define ROWS_MAX (VGPU_MAX_PROCS * 4)
static pthread_mutex_t rows_lock = PTHREAD_MUTEX_INITIALIZER;
/* The rows, 6 KiB, are allocated when first read: in the shim's .bss they came between
 * variables every process touches at start-up, and cost it a page fault of their own. */
static struct { uint64_t read_ns; int has, dev, n; nvmlProcessInfo_t *rows; } last_rows;

static int nvml_rows(int dev, nvmlProcessInfo_t *infos, unsigned int room, uint64_t not_before)
{
    int up = nvml_start() == 0;
    pthread_mutex_lock(&rows_lock);
    uint64_t now = now_ns();
    int n = -1;
    if (!last_rows.rows && !(last_rows.rows = malloc(ROWS_MAX * sizeof *last_rows.rows))) {
        pthread_mutex_unlock(&rows_lock);
        return -1;   /* as when NVML cannot say */
    }
    if (!last_rows.has || last_rows.dev != dev || last_rows.read_ns < not_before) {
        nvmlDevice_t h;
        unsigned int got = ROWS_MAX;
        last_rows.has = 0;
        if (up && !nvml_handle(dev, &h) && real_nvmlDeviceGetComputeRunningProcesses_v3 &&
            real_nvmlDeviceGetComputeRunningProcesses_v3(h, &got, last_rows.rows) == NVML_SUCCESS) {
            last_rows.has = 1;
            last_rows.dev = dev;
            last_rows.n = (int)got;
            last_rows.read_ns = now;   /* (read before the call: the list is at least this new) */
        }
    }
    if (last_rows.has && last_rows.dev == dev) {
        n = last_rows.n < (int)room ? last_rows.n : (int)room;
        memcpy(infos, last_rows.rows, (size_t)n * sizeof *infos);
    }
    pthread_mutex_unlock(&rows_lock);
    return n;
}

int driver_holds(int32_t pid, uint64_t pid_ns, uint32_t devices, uint64_t not_before)
{
    if (pid <= 0 || pid_ns != ROOT_PID_NS_INODE)
        return -1;   /* NVML's pids are the root namespace's: this one cannot be found there */
    nvmlProcessInfo_t infos[VGPU_MAX_PROCS * 4];
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        if (!(devices & 1u << d))
            continue;
        int n = nvml_rows(d, infos, sizeof infos / sizeof infos[0], not_before);
        for (int i = 0; i < n; i++)
            if (infos[i].pid == (unsigned int)pid && infos[i].usedGpuMemory &&
                infos[i].usedGpuMemory != NVML_VALUE_NOT_AVAILABLE_ULL)
                return 1;
    }
    return 0;
}

/* Does the driver still keep shared slot i's memory though no process of the slice holds
 * it?  An exported POSIX descriptor keeps it on the device after every handle is released
 * and unmapped, in whatever process it was passed to (one that never touches CUDA holds no
 * slot).  NVML lists such memory under its exporter's pid (simgpu; what a real driver
 * lists is not documented).  Kept: on a device it charges, NVML lists under the exporter
 * at least its charge beyond what the slice's other slots naming the exporter charge there
 * (its own slot, its other exports): draining it would leave the slice's charges below
 * what the driver holds for it.  Root pid namespace only (NVML's pids); 0 elsewhere, and
 * when NVML cannot say.  With S.lock held (not a hot path: a last release, a reap). */
int shared_kept_by_driver(int i)
{
    const struct vgpu_usage_proc *p = &S.usage->procs[i];
    int32_t exporter = (int32_t)LOAD(&p->state);
    uint64_t ns = LOAD(&p->pid_ns);
    if (exporter <= 0 || ns != ROOT_PID_NS_INODE)
        return 0;
    uint32_t used = LOAD(&S.usage->slots_used);
    nvmlProcessInfo_t infos[VGPU_MAX_PROCS * 4];
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        uint64_t charge = LOAD(&S.usage->charge[d][i]);
        if (!charge)
            continue;
        int n = nvml_rows(d, infos, sizeof infos / sizeof infos[0], now_ns());   /* (a live exporter's) */
        uint64_t listed = 0, others = 0;
        for (int r = 0; r < n; r++)
            if (infos[r].pid == (unsigned int)exporter && infos[r].usedGpuMemory != NVML_VALUE_NOT_AVAILABLE_ULL)
                listed += infos[r].usedGpuMemory;
        for (uint32_t j = 0; j < used && j < VGPU_MAX_PROCS; j++) {
            const struct vgpu_usage_proc *q = &S.usage->procs[j];
            if (j == (uint32_t)i || LOAD(&q->pid_ns) != ns)
                continue;
            int shared = (LOAD(&q->flags) & VGPU_PROC_SHARED) != 0;
            if ((shared ? (int32_t)LOAD(&q->state) : LOAD(&q->pid)) == exporter)
                others += LOAD(&S.usage->charge[d][j]);
        }
        if (listed > others && listed - others >= charge)
            return 1;
    }
    return 0;
}

static uint64_t measure_overhead(int dev)
{
    if (S.context_overhead_set)
        return S.context_overhead;
    /* the node's measured figure, carried in the quota: no NVML to start (on a real driver
     * its start takes milliseconds; on simgpu it was 112k of a process's start-up's 290k
     * instructions) */
    uint64_t known = LOAD(&S.quota->devices[dev].context_overhead);
    if (known && known <= CONTEXT_OVERHEAD_MAX)
        return known;
    if (LOAD(&S.usage->procs[S.slot].pid_ns) != ROOT_PID_NS_INODE) {
        INFO("device %d: in a pid namespace of its own NVML's pids are not this process's: no context "
             "overhead measured (VGPU_CONTEXT_OVERHEAD sets it)", dev);
        return 0;
    }
    nvmlProcessInfo_t infos[VGPU_MAX_PROCS * 4];
    int n = nvml_rows(dev, infos, sizeof infos / sizeof infos[0], now_ns());
    if (n < 0)
        return 0;
    uint64_t mine = LOAD(&S.usage->charge[dev][S.slot]), held = 0;
    int rows = 0;
    for (int i = 0; i < n; i++)
        if (infos[i].pid == (unsigned int)getpid()) {
            rows++;
            held = infos[i].usedGpuMemory;
        }
    if (rows != 1 || held == NVML_VALUE_NOT_AVAILABLE_ULL || held <= mine)
        return 0;
    if (held - mine > CONTEXT_OVERHEAD_MAX) {
        INFO("device %d: NVML lists %llu bytes under this pid beyond its charge, more than a context costs: "
             "another process's, not charged", dev, (unsigned long long)(held - mine));
        return 0;
    }
    return held - mine;
}

static void charge_overhead(int dev)
{
    pthread_mutex_lock(&overhead_lock);
    if (!(overhead_devices & 1u << dev) && S.slot >= 0) {
        uint64_t bytes = measure_overhead(dev);
        overhead_bytes[dev] = bytes;
        if (bytes) {
            charge_add(dev, S.slot, bytes);
            note_peak(&S.usage->devices[dev], memory_used(dev));
            INFO("device %d: a context's overhead, %llu bytes, charged", dev, (unsigned long long)bytes);
        }
        __atomic_or_fetch(&overhead_devices, 1u << dev, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&overhead_lock);
}

static void overhead_refund(int dev)
{
    pthread_mutex_lock(&overhead_lock);
    uint64_t bytes = 0;
    if (overhead_devices & 1u << dev) {
        bytes = overhead_bytes[dev];
        overhead_bytes[dev] = 0;
        __atomic_and_fetch(&overhead_devices, ~(1u << dev), __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&overhead_lock);
    refund(dev, bytes);
}

/* Reserve before allocating.  Publish, then check: add the bytes to this process's own
 * charge, then sum every slot's charge on the device; over the cap -> take them back
 * (a racing reader may see that transient: counters can pass the cap for an instant by
 * one refused request, the device never does).
 * Of two processes racing for the last bytes, whichever sums second sees the other's
 * charge (both steps are seq_cst), so the cap is never passed; at worst both retreat,
 * and the retries (after a reap of dead processes, then a yield) sort it out.  A kill at
 * any instruction leaves the slot holding exactly what its process may have allocated,
 * and a dead process's slot is drained whole: there is no second counter to drift. */
static uint64_t seen[VGPU_MAX_DEVICES];   /* admit_inline's; relaxed: a race only costs a look, or skips one */

/* admit from attempt `first` on (the inline path below made attempt 0) */
static __attribute__((noinline)) CUresult admit_slow(int dev, uint64_t bytes, int first)
{
    if (UNLIKELY(!have_slot()))
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (UNLIKELY(!(LOAD(&overhead_devices) & 1u << dev)))
        charge_overhead(dev);
    struct vgpu_usage_device *u = &S.usage->devices[dev];
    uint64_t cap = memory_cap(dev), used = 0;
    for (int attempt = first; bytes <= cap && attempt < ADMIT_TRIES; attempt++) {
        if (attempt == 1) {
            reap_dead();
            pools_settle(1);   /* reserve kept for reuse is given back first */
            graph_memory_trim();
        } else if (attempt > 1) {
            sched_yield();   /* let a racing admission finish or retreat */
        }
        /* a look first: what plainly does not fit is refused without ever showing in
         * the counters (only a race, or a stale `seen` below, leaves a transient that is
         * taken back) */
        if ((used = row_sum(dev)) <= cap - bytes) {
            charge_add(dev, S.slot, bytes);
            used = row_sum(dev);
            __atomic_store_n(&seen[dev], used, __ATOMIC_RELAXED);
            if (used <= cap) {
                peak_at_least(u, used);
                return CUDA_SUCCESS;
            }
            charge_sub(dev, S.slot, bytes);
        } else {
            __atomic_store_n(&seen[dev], used, __ATOMIC_RELAXED);
            used += bytes;
        }
        cap = memory_cap(dev);
    }
    __atomic_add_fetch(&u->oom_refusals, 1, __ATOMIC_RELAXED);
    DEBUG("refused %llu bytes on device %d: %llu of %llu in use", (unsigned long long)bytes, dev,
          (unsigned long long)(used >= bytes ? used - bytes : 0), (unsigned long long)cap);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

/* The common case inline: a slot, the context's overhead charged, and room at the first
 * try; anything else (and every retry) is admit_slow's.  The look before publishing is for
 * requests that plainly do not fit, and it costs a second sum on every allocation: it is
 * taken when the sum this process last saw on the device (`seen`, after its last
 * admission or refusal there) leaves less than the request; otherwise the bytes are
 * published at once and the sum after them decides, as always.  What the look would
 * have kept out of the counters then (a neighbour filled the cap since this process last
 * looked) shows there for an instant, as a racing request's does: the device, and the
 * cap, are as before. */

static inline __attribute__((always_inline)) CUresult admit_inline(int dev, uint64_t bytes)
{
    /* (a device's overhead bit is set only with a slot, and cleared with it at a fork) */
    if (UNLIKELY(!(LOAD(&overhead_devices) & 1u << dev)))
        return admit_slow(dev, bytes, 0);
    uint64_t cap = device_cap(dev);
    if (UNLIKELY(bytes > cap || __atomic_load_n(&seen[dev], __ATOMIC_RELAXED) > cap - bytes))
        return admit_slow(dev, bytes, 0);   /* (it looks first) */
    charge_add(dev, S.slot, bytes);
    uint64_t used = row_sum(dev);
    __atomic_store_n(&seen[dev], used, __ATOMIC_RELAXED);
    if (LIKELY(used <= cap)) {
        peak_at_least(&S.usage->devices[dev], used);
        return CUDA_SUCCESS;
    }
    charge_sub(dev, S.slot, bytes);
    return admit_slow(dev, bytes, 1);
}

CUresult admit(int dev, uint64_t bytes)
{
    return admit_inline(dev, bytes);
}

static inline void refund_inline(int dev, uint64_t bytes)
{
    if (LIKELY(S.slot >= 0 && bytes))
        charge_sub(dev, S.slot, bytes);
}

void refund(int dev, uint64_t bytes)
{
    refund_inline(dev, bytes);
}

/* The allocation table is private to the process (a forked child gets a fresh one). */
static struct entry *map_table(void)
{
    void *t = mmap(NULL, sizeof(struct entry) * TABLE_SIZE, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return t == MAP_FAILED ? NULL : t;
}

int memory_map_table(void)
{
    return (S.table = map_table()) ? 0 : -1;
}

/* The bookkeeping off the hot path (VMM handles and mappings, pools, graph reserves, exports
 * and imports, contexts) is kept under this lock, whichever file it is in. */
pthread_mutex_t vmm_lock = PTHREAD_MUTEX_INITIALIZER;
#define MAX_CONTEXTS 16
static struct { CUcontext ctx; int dev, live; } contexts[MAX_CONTEXTS];   /* ids; [0] unused */
static int ncontexts = 1;
static uint32_t contexts_gen;   /* bumped by every teardown (and fork): caches look again */

int location_device(const CUmemLocation *loc)
{
    switch (loc->type) {
    case 1:   /* CU_MEM_LOCATION_TYPE_DEVICE: id is a device ordinal */
        return loc->id >= 0 && loc->id < VGPU_MAX_DEVICES ? loc->id : LOCATION_PASS;
    case 0:   /* INVALID / NONE */
    case 2:   /* HOST */
    case 3:   /* HOST_NUMA */
    case 4:   /* HOST_NUMA_CURRENT */
        return LOCATION_PASS;
    default:
        ERR("memory location type %d is unknown to the shim; refused (it may be device memory)", (int)loc->type);
        return LOCATION_REFUSED;
    }
}

/* In a forked child: what the parent allocated is the parent's to free and refund. */
void memory_atfork_child(void)
{
    pthread_mutex_init(&vmm_lock, NULL);
    shared_atfork_child();
    if (S.table)   /* a fresh, untouched mapping: no 16 MiB memset per fork */
        S.table = map_table();
    nvmm = nmappings = npools = 0;
    ncontexts = 1;   /* a child has no context of its parent's, nor its overhead */
    overhead_devices = graph_devices = 0;
    memset(graph_charged, 0, sizeof graph_charged);
    memset(graph_pending, 0, sizeof graph_pending);
    graph_needs = 0;   /* (the table is fresh too: a child has no graphs of its parent's) */
    pthread_mutex_init(&overhead_lock, NULL);
    __atomic_add_fetch(&contexts_gen, 1, __ATOMIC_ACQ_REL);
}


/* === contexts: tearing one down frees what was allocated in it ===
 * Each table entry carries the context current at allocation (as a small id: 1..15,
 * 0 = not known), so cuCtxDestroy and a primary context's reset refund exactly what the
 * driver freed.  Pool reserves and VMM handles outlive the context, as in the driver.
 * A process with more than 15 contexts has the rest counted until it exits (safe side). */

/* The calling thread's current context, its device and id, cached: one driver call
 * (cuCtxGetCurrent) per allocation while the context stays the same.  A teardown bumps
 * contexts_gen, so a handle the driver hands out again is looked up afresh. */
static TLS struct { CUcontext ctx; int dev, id; uint32_t gen; } cur = {.dev = -1};

static int context_lookup(CUcontext c, int dev)   /* with vmm_lock held */
{
    int id = 0;
    for (int i = 1; i < ncontexts && !id; i++)
        if (contexts[i].ctx == c)
            id = i;
    if (!id && ncontexts < MAX_CONTEXTS)
        contexts[id = ncontexts++].ctx = c;
    if (id) {
        contexts[id].dev = dev;
        contexts[id].live = 1;
    }
    return id;
}

static __attribute__((noinline)) int current_device_lookup(CUcontext c)
{
    CUdevice d;
    if (!real_cuCtxGetDevice || real_cuCtxGetDevice(&d) != CUDA_SUCCESS || d < 0 || d >= VGPU_MAX_DEVICES)
        return -1;
    pthread_mutex_lock(&vmm_lock);
    cur.id = context_lookup(c, d);
    pthread_mutex_unlock(&vmm_lock);
    cur.ctx = c;
    cur.dev = d;
    cur.gen = LOAD(&contexts_gen);
    return d;
}

static inline __attribute__((always_inline)) int current_device_inline(void)
{
    CUcontext c = NULL;
    if (UNLIKELY(!real_cuCtxGetCurrent) || real_cuCtxGetCurrent(&c) != CUDA_SUCCESS || UNLIKELY(!c))
        return -1;
    if (LIKELY(c == cur.ctx && cur.gen == LOAD(&contexts_gen)))
        return cur.dev;
    return current_device_lookup(c);
}

int current_device(void)
{
    return current_device_inline();
}

/* The context of the allocation the calling thread is making (current_device() came
 * first in the same hook); 0 when not known. */
int context_id(void)
{
    return cur.dev >= 0 ? cur.id : 0;
}

static int known_context(CUcontext c)
{
    int id = 0;
    pthread_mutex_lock(&vmm_lock);
    for (int i = 1; i < ncontexts && !id; i++)
        if (contexts[i].ctx == c)
            id = i;
    pthread_mutex_unlock(&vmm_lock);
    return id;
}

static void refund_context(int id)
{
    __atomic_add_fetch(&contexts_gen, 1, __ATOMIC_ACQ_REL);
    if (!id || !S.table)
        return;
    uint64_t n = 0, bytes = 0;
    for (uint32_t i = 0; i < TABLE_SIZE; i++) {
        uint64_t k = LOAD(&S.table[i].key), v = LOAD(&S.table[i].value);
        if (k > TOMBSTONE && (int)(v >> 4 & 15) == id &&
            __atomic_compare_exchange_n(&S.table[i].key, &k, TOMBSTONE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            refund((int)(v & 15), v >> 8);
            n++;
            bytes += v >> 8;
        }
    }
    if (n)
        INFO("context torn down: %llu allocations, %llu bytes given back", (unsigned long long)n,
             (unsigned long long)bytes);
    /* its exports are freed (importers may keep them) and its imports closed */
    int let_go[2 * VGPU_MAX_PROCS], nlet = 0;
    pthread_mutex_lock(&vmm_lock);
    for (int pass = 0; pass < 2; pass++) {
        struct shared_ptr *v = pass ? imports : exports;
        size_t *count = pass ? &nimports : &nexports;
        for (size_t i = 0; i < *count;) {
            if (v[i].ctx != id) {
                i++;
                continue;
            }
            if (v[i].slot >= 0 && nlet < (int)(sizeof let_go / sizeof let_go[0]))
                let_go[nlet++] = v[i].slot;
            else if (v[i].slot < 0)
                refund(v[i].dev, v[i].bytes);
            v[i] = v[--*count];
        }
    }
    pthread_mutex_unlock(&vmm_lock);
    while (nlet)
        shared_release(let_go[--nlet]);
    /* the process's last context on the device: its overhead goes too */
    pthread_mutex_lock(&vmm_lock);
    int dev = contexts[id].dev, others = 0;
    contexts[id].live = 0;
    for (int i = 1; i < ncontexts; i++)
        others += contexts[i].live && contexts[i].dev == dev;
    pthread_mutex_unlock(&vmm_lock);
    if (!others)
        overhead_refund(dev);
}

/* The primary context's handle, without changing its reference count. */
static CUcontext primary_context(CUdevice dev)
{
    unsigned flags;
    int active = 0;
    CUcontext c = NULL;
    if (!REAL(cuDevicePrimaryCtxGetState) || real_cuDevicePrimaryCtxGetState(dev, &flags, &active) || !active ||
        !REAL(cuDevicePrimaryCtxRetain) || real_cuDevicePrimaryCtxRetain(&c, dev))
        return NULL;
    if (REAL(cuDevicePrimaryCtxRelease_v2))
        real_cuDevicePrimaryCtxRelease_v2(dev);
    return c;
}

SHIM_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    ENTER(cuCtxDestroy_v2, ctx);
    CUresult r = real_cuCtxDestroy_v2(ctx);
    if (r == CUDA_SUCCESS)
        refund_context(known_context(ctx));
    return r;
}

/* The v1 ABIs (a program that looks the unversioned names up) behave as the _v2 ones
 * (cuda.h documents one behaviour for both): either way the context's memory goes. */
static CUresult primary_reset(CUresult (*real)(CUdevice), CUdevice dev)
{
    CUcontext c = primary_context(dev);
    CUresult r = real(dev);
    if (r == CUDA_SUCCESS && c)
        refund_context(known_context(c));
    return r;
}

/* Releasing the last reference resets the primary context. */
static CUresult primary_release(CUresult (*real)(CUdevice), CUdevice dev)
{
    CUcontext c = primary_context(dev);
    CUresult r = real(dev);
    unsigned flags;
    int active = 1;
    if (r == CUDA_SUCCESS && c && REAL(cuDevicePrimaryCtxGetState) &&
        real_cuDevicePrimaryCtxGetState(dev, &flags, &active) == CUDA_SUCCESS && !active)
        refund_context(known_context(c));
    return r;
}

SHIM_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    ENTER(cuDevicePrimaryCtxReset, dev);
    return primary_reset(real_cuDevicePrimaryCtxReset, dev);
}

SHIM_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    ENTER(cuDevicePrimaryCtxReset_v2, dev);
    return primary_reset(real_cuDevicePrimaryCtxReset_v2, dev);
}

SHIM_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    ENTER(cuDevicePrimaryCtxRelease, dev);
    return primary_release(real_cuDevicePrimaryCtxRelease, dev);
}

SHIM_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    ENTER(cuDevicePrimaryCtxRelease_v2, dev);
    return primary_release(real_cuDevicePrimaryCtxRelease_v2, dev);
}

/* Lock-free open-addressing table: what each live allocation was charged, and where. */
static inline uint32_t slot_of(uint64_t key) { return (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - TABLE_BITS)); }

static inline __attribute__((always_inline)) int table_insert(uint64_t key, int dev, uint64_t bytes, int ctx)
{
    if (UNLIKELY(!S.table))
        return -1;
    for (uint32_t i = slot_of(key), n = 0; n < TABLE_SIZE; i = (i + 1) & (TABLE_SIZE - 1), n++) {
        uint64_t k = LOAD(&S.table[i].key);
        if (k <= TOMBSTONE &&   /* free, or a tombstone */
            __atomic_compare_exchange_n(&S.table[i].key, &k, key, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            STORE(&S.table[i].value, bytes << 8 | (uint64_t)ctx << 4 | (uint64_t)dev);
            return 0;
        }
    }
    return -1;
}

int remember_in(uint64_t key, int dev, uint64_t bytes, int ctx)
{
    return table_insert(key, dev, bytes, ctx);
}

int remember(uint64_t key, int dev, uint64_t bytes)
{
    return table_insert(key, dev, bytes, context_id());
}

/* The index of key's entry, or -1 when there is none. */
static inline __attribute__((always_inline)) int64_t table_find(uint64_t key)
{
    if (UNLIKELY(!S.table))   /* failed closed before the table existed: nothing was charged */
        return -1;
    for (uint32_t i = slot_of(key), n = 0; n < TABLE_SIZE; i = (i + 1) & (TABLE_SIZE - 1), n++) {
        uint64_t k = LOAD(&S.table[i].key);
        if (k == 0)
            return -1;
        if (k == key)
            return i;
    }
    return -1;
}

/* The bytes an entry holds, the entry kept; -1 when there is none. */
int recall(uint64_t key, uint64_t *bytes)
{
    int64_t i = table_find(key);
    if (i < 0)
        return -1;
    *bytes = LOAD(&S.table[i].value) >> 8;
    return 0;
}

static inline __attribute__((always_inline)) int table_take(uint64_t key, int *dev, uint64_t *bytes, int *ctx)
{
    for (int64_t i; (i = table_find(key)) >= 0;) {
        uint64_t k = key, v = LOAD(&S.table[i].value);
        if (LIKELY(__atomic_compare_exchange_n(&S.table[i].key, &k, TOMBSTONE, 0, __ATOMIC_ACQ_REL,
                                               __ATOMIC_ACQUIRE))) {
            *dev = (int)(v & 15);
            *ctx = (int)(v >> 4 & 15);
            *bytes = v >> 8;
            return 0;
        }   /* (another thread took it first: look again) */
    }
    return -1;
}

int forget_in(uint64_t key, int *dev, uint64_t *bytes, int *ctx)
{
    return table_take(key, dev, bytes, ctx);
}

int forget(uint64_t key, int *dev, uint64_t *bytes)
{
    int ctx;
    return table_take(key, dev, bytes, &ctx);
}


/* The device a stream's work (and its stream-ordered allocations) lands on. */
int stream_device(CUstream stream)
{
    CUcontext ctx, cur = NULL, popped;
    if (stream == NULL || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD ||
        !REAL(cuStreamGetCtx) || !real_cuCtxGetCurrent || real_cuStreamGetCtx(stream, &ctx) != CUDA_SUCCESS ||
        real_cuCtxGetCurrent(&cur) != CUDA_SUCCESS || ctx == cur)
        return current_device();
    if (!REAL(cuCtxPushCurrent_v2) || !REAL(cuCtxPopCurrent_v2) || real_cuCtxPushCurrent_v2(ctx) != CUDA_SUCCESS)
        return -1;
    int dev = current_device();
    real_cuCtxPopCurrent_v2(&popped);
    return dev;
}

/* Charge `bytes` on `dev`, run the real allocation, remember the result under `key`. */
#define CHARGED(dev, bytes, real_call, key)                                                    \
    do {                                                                                       \
        CUresult r_ = admit_inline((dev), (bytes));                                            \
        if (r_ != CUDA_SUCCESS)                                                                \
            return r_;                                                                         \
        r_ = (real_call);                                                                      \
        if (r_ != CUDA_SUCCESS)                                                                \
            refund_inline((dev), (bytes));                                                     \
        else if (table_insert((key), (dev), (bytes), context_id()))                            \
            ERR("allocation table full: %llu bytes stay charged", (unsigned long long)(bytes)); \
        return r_;                                                                             \
    } while (0)

/* Forget `key`, run the real free, refund on success (re-remember on failure). */
#define RELEASED(real_call, key)                        \
    do {                                                \
        int dev_;                                       \
        uint64_t bytes_;                                \
        int known_ = forget((key), &dev_, &bytes_) == 0; \
        CUresult r_ = (real_call);                      \
        if (known_ && r_ == CUDA_SUCCESS)               \
            refund(dev_, bytes_);                       \
        else if (known_)                                \
            remember((key), dev_, bytes_);              \
        return r_;                                      \
    } while (0)

/* === allocate === */

SHIM_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    ENTER(cuMemAlloc_v2, dptr, bytesize);
    int dev = current_device_inline();
    if (dev < 0 || !dptr || !bytesize)
        return real_cuMemAlloc_v2(dptr, bytesize);   /* the driver reports the error */
    CHARGED(dev, vgpu_alloc_footprint(bytesize), real_cuMemAlloc_v2(dptr, bytesize), KEY_PTR | *dptr);
}

SHIM_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                        unsigned int ElementSizeBytes)
{
    ENTER(cuMemAllocPitch_v2, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    int dev = current_device();
    if (dev < 0 || !dptr || !pPitch || !WidthInBytes || !Height)
        return real_cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    /* the pitch is known only afterwards: reserve at the usual 512-byte alignment, then
     * settle the difference */
    uint64_t guess = vgpu_alloc_footprint((WidthInBytes + 511) / 512 * 512 * (uint64_t)Height);
    CUresult r = admit(dev, guess);
    if (r != CUDA_SUCCESS)
        return r;
    r = real_cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (r != CUDA_SUCCESS) {
        refund(dev, guess);
        return r;
    }
    uint64_t actual = vgpu_alloc_footprint((uint64_t)*pPitch * Height);
    if (actual > guess && admit(dev, actual - guess) != CUDA_SUCCESS) {
        refund(dev, guess);
        if (REAL(cuMemFree_v2))
            real_cuMemFree_v2(*dptr);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < guess)
        refund(dev, guess - actual);
    if (remember(KEY_PTR | *dptr, dev, actual))
        ERR("allocation table full: %llu bytes stay charged", (unsigned long long)actual);
    return r;
}

SHIM_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    ENTER(cuMemAllocManaged, dptr, bytesize, flags);
    int dev = current_device();
    if (dev < 0 || !dptr || !bytesize)
        return real_cuMemAllocManaged(dptr, bytesize, flags);
    CHARGED(dev, vgpu_alloc_footprint(bytesize), real_cuMemAllocManaged(dptr, bytesize, flags), KEY_PTR | *dptr);
}

/* Bytes an array takes; formats of unknown element size are charged as 4 x 32-bit. */
static uint64_t array_charge(CUDA_ARRAY3D_DESCRIPTOR d, unsigned levels)
{
    uint64_t b = vgpu_array_bytes(&d, levels);
    if (!b) {
        d.Format = 0x20;
        d.NumChannels = 4;
        b = vgpu_array_bytes(&d, levels);
    }
    return b;
}

SHIM_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray)
{
    ENTER(cuArrayCreate_v2, pHandle, pAllocateArray);
    int dev = current_device();
    if (dev < 0 || !pHandle || !pAllocateArray)
        return real_cuArrayCreate_v2(pHandle, pAllocateArray);
    const CUDA_ARRAY_DESCRIPTOR *a = pAllocateArray;
    uint64_t bytes = array_charge((CUDA_ARRAY3D_DESCRIPTOR){a->Width, a->Height, 0, a->Format, a->NumChannels, 0}, 1);
    CHARGED(dev, bytes, real_cuArrayCreate_v2(pHandle, pAllocateArray), KEY_ARRAY | (uint64_t)(uintptr_t)*pHandle);
}

SHIM_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray)
{
    ENTER(cuArray3DCreate_v2, pHandle, pAllocateArray);
    int dev = current_device();
    if (dev < 0 || !pHandle || !pAllocateArray)
        return real_cuArray3DCreate_v2(pHandle, pAllocateArray);
    uint64_t bytes = array_charge(*pAllocateArray, 1);
    CHARGED(dev, bytes, real_cuArray3DCreate_v2(pHandle, pAllocateArray), KEY_ARRAY | (uint64_t)(uintptr_t)*pHandle);
}

SHIM_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,
                                            unsigned int numMipmapLevels)
{
    ENTER(cuMipmappedArrayCreate, pHandle, pMipmappedArrayDesc, numMipmapLevels);
    int dev = current_device();
    if (dev < 0 || !pHandle || !pMipmappedArrayDesc || !numMipmapLevels)
        return real_cuMipmappedArrayCreate(pHandle, pMipmappedArrayDesc, numMipmapLevels);
    uint64_t bytes = array_charge(*pMipmappedArrayDesc, numMipmapLevels);
    CHARGED(dev, bytes, real_cuMipmappedArrayCreate(pHandle, pMipmappedArrayDesc, numMipmapLevels),
            KEY_ARRAY | (uint64_t)(uintptr_t)*pHandle);
}

/* === free: always the real free, even for what the shim does not know === */

SHIM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    ENTER(cuMemFree_v2, dptr);
    int dev, ctx;
    uint64_t bytes;
    if (table_take(KEY_PTR | dptr, &dev, &bytes, &ctx)) {   /* not ours: maybe a pool's (settled), or exported */
        CUresult r = real_cuMemFree_v2(dptr);
        if (LOAD(&nexports))
            export_freed(dptr, r);
        return LOAD(&npools) ? after_release(r) : r;
    }
    CUresult r = real_cuMemFree_v2(dptr);
    if (LIKELY(r == CUDA_SUCCESS))
        refund_inline(dev, bytes);
    else
        table_insert(KEY_PTR | dptr, dev, bytes, ctx);   /* (its context, as it was) */
    return r;
}

SHIM_EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    ENTER(cuArrayDestroy, hArray);
    RELEASED(real_cuArrayDestroy(hArray), KEY_ARRAY | (uint64_t)(uintptr_t)hArray);
}

SHIM_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    ENTER(cuMipmappedArrayDestroy, hMipmappedArray);
    RELEASED(real_cuMipmappedArrayDestroy(hMipmappedArray), KEY_ARRAY | (uint64_t)(uintptr_t)hMipmappedArray);
}

/* === view: the container's slice, never negative, never above the device === */

/* total = min(cap, device); used = the container's; free = min(total - used, device free) */
static inline __attribute__((always_inline)) int slice_inline(int dev, uint64_t dev_total, uint64_t dev_free,
                                                             uint64_t *total, uint64_t *free, uint64_t *used)
{
    uint64_t cap = memory_cap(dev), u = 0;
    if (S.mode == MODE_ENFORCE) {
        if (cap == VGPU_UNLIMITED)
            return 0;   /* unlimited: the device as it is */
        maybe_reap();
        if (LOAD(&npools))   /* (no pool, no graph memory: nothing to settle, no call) */
            pools_settle(0);
        if (LOAD(&graph_devices))
            graph_memory_settle(-1);
        u = row_sum(dev);
    }
    *total = cap < dev_total ? cap : dev_total;
    *used = u < *total ? u : *total;
    *free = *total - *used < dev_free ? *total - *used : dev_free;
    return 1;
}

int slice(int dev, uint64_t dev_total, uint64_t dev_free, uint64_t *total, uint64_t *free, uint64_t *used)
{
    return slice_inline(dev, dev_total, dev_free, total, free, used);
}

SHIM_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    ENTER(cuMemGetInfo_v2, free, total);
    CUresult r = real_cuMemGetInfo_v2(free, total);
    int dev = current_device_inline();
    uint64_t t, f, u;
    if (r == CUDA_SUCCESS && dev >= 0 && slice_inline(dev, *total, *free, &t, &f, &u)) {
        *total = t;
        *free = f;
    }
    return r;
}

SHIM_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    ENTER(cuDeviceTotalMem_v2, bytes, dev);
    CUresult r = real_cuDeviceTotalMem_v2(bytes, dev);
    uint64_t t, f, u;
    if (r == CUDA_SUCCESS && dev >= 0 && dev < VGPU_MAX_DEVICES && slice(dev, *bytes, *bytes, &t, &f, &u))
        *bytes = t;
    return r;
}
