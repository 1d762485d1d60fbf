/* memory.c — the memory cap: accounting, the allocate and free hooks, the view.
 *
 * Hot path (an allocation under quota): no lock, no syscall, no log call — an add to
 * this process's charge, a sum over the container's slots, and a lock-free table insert.
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

#define KEY_PTR 0ull            /* allocation table key spaces (top bits): device pointers, */
#define KEY_ARRAY (2ull << 62)  /* array handles (VMM handles are tracked apart, with mappings), */
#define KEY_GRAPH (1ull << 62)  /* and what an executable graph's allocation nodes need on a device */
#define TABLE_BITS 20
#define TABLE_SIZE (1u << TABLE_BITS)
#define TOMBSTONE 1ull
#define ADMIT_TRIES 4
#define CLAIM_RETRY_NS 100000000ull   /* no free slot: try again after this */

static inline uint64_t memory_cap(int dev)
{
    if (S.mode != MODE_ENFORCE || dev < 0 || (uint32_t)dev >= S.quota->device_count)
        return 0;
    return LOAD(&S.quota->devices[dev].memory_max);   /* a resize shows up on the next call */
}

/* The container's bytes on dev: the sum of its slots' charges (seq_cst loads: the
 * admission below relies on them).  A row whose sum passes 2^64 was written by hand (a
 * tenant writing a negative charge into a slot to make room): UINT64_MAX, so that nothing
 * more is admitted against it -- it never wraps around to a small figure. */
uint64_t memory_used(int dev)
{
    uint32_t n = LOAD(&S.usage->slots_used);
    if (n > VGPU_MAX_PROCS)
        n = VGPU_MAX_PROCS;   /* the file is the container's to scribble on */
    const uint64_t *row = S.usage->charge[dev];
    uint64_t used = 0;
    for (uint32_t i = 0; i < n; i++)
        if (__builtin_add_overflow(used, __atomic_load_n(&row[i], __ATOMIC_SEQ_CST), &used))
            return UINT64_MAX;
    return used;
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

static void note_peak(struct vgpu_usage_device *u, uint64_t now)
{
    uint64_t peak = LOAD(&u->memory_peak);
    while (peak < now &&
           !__atomic_compare_exchange_n(&u->memory_peak, &peak, now, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        ;
}

/* === context overhead ===
 * A context costs device memory of its own (hundreds of MiB per process on a real
 * card), which no allocation call shows.  On its first allocation on a device a process
 * is charged that overhead: VGPU_CONTEXT_OVERHEAD when set, else what NVML says the
 * process holds there beyond its charge (the driver's own figure), else nothing.  NVML
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

/* The rows NVML lists on device dev: their count, or -1 when NVML cannot say. */
static int nvml_rows(int dev, nvmlProcessInfo_t *infos, unsigned int room)
{
    nvml_resolve();
    nvmlDevice_t h;
    unsigned int n = room;
    if (!real_nvmlInit_v2 || real_nvmlInit_v2() != NVML_SUCCESS || nvml_handle(dev, &h) ||
        !real_nvmlDeviceGetComputeRunningProcesses_v3 ||
        real_nvmlDeviceGetComputeRunningProcesses_v3(h, &n, infos) != NVML_SUCCESS)
        return -1;
    return (int)n;
}

int driver_holds(int32_t pid, uint64_t pid_ns, uint32_t devices)
{
    if (pid <= 0 || pid_ns != ROOT_PID_NS_INODE)
        return -1;   /* NVML's pids are the root namespace's: this one cannot be found there */
    nvmlProcessInfo_t infos[VGPU_MAX_PROCS * 4];
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        if (!(devices & 1u << d))
            continue;
        int n = nvml_rows(d, infos, sizeof infos / sizeof infos[0]);
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
    static nvmlProcessInfo_t infos[VGPU_MAX_PROCS * 4];   /* (S.lock) */
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        uint64_t charge = LOAD(&S.usage->charge[d][i]);
        if (!charge)
            continue;
        int n = nvml_rows(d, infos, sizeof infos / sizeof infos[0]);
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
    if (LOAD(&S.usage->procs[S.slot].pid_ns) != ROOT_PID_NS_INODE) {
        INFO("device %d: in a pid namespace of its own NVML's pids are not this process's: no context "
             "overhead measured (VGPU_CONTEXT_OVERHEAD sets it)", dev);
        return 0;
    }
    nvmlProcessInfo_t infos[VGPU_MAX_PROCS * 4];
    int n = nvml_rows(dev, infos, sizeof infos / sizeof infos[0]);
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

static void refund(int dev, uint64_t bytes);
static void graph_memory_trim(void);

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
static CUresult admit(int dev, uint64_t bytes)
{
    if (UNLIKELY(!have_slot()))
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (UNLIKELY(!(LOAD(&overhead_devices) & 1u << dev)))
        charge_overhead(dev);
    struct vgpu_usage_device *u = &S.usage->devices[dev];
    uint64_t cap = memory_cap(dev), used = 0;
    for (int attempt = 0; bytes <= cap && attempt < ADMIT_TRIES; attempt++) {
        if (attempt == 1) {
            reap_dead();
            pools_settle(1);   /* reserve kept for reuse is given back first */
            graph_memory_trim();
        } else if (attempt > 1) {
            sched_yield();   /* let a racing admission finish or retreat */
        }
        /* a look first: what plainly does not fit is refused without ever showing in
         * the counters (only a true race leaves a transient that is taken back) */
        if ((used = memory_used(dev)) <= cap - bytes) {
            charge_add(dev, S.slot, bytes);
            used = memory_used(dev);
            if (used <= cap) {
                note_peak(u, used);
                return CUDA_SUCCESS;
            }
            charge_sub(dev, S.slot, bytes);
        } else {
            used += bytes;
        }
        cap = memory_cap(dev);
    }
    __atomic_add_fetch(&u->oom_refusals, 1, __ATOMIC_RELAXED);
    DEBUG("refused %llu bytes on device %d: %llu of %llu in use", (unsigned long long)bytes, dev,
          (unsigned long long)(used >= bytes ? used - bytes : 0), (unsigned long long)cap);
    return CUDA_ERROR_OUT_OF_MEMORY;
}

static void refund(int dev, uint64_t bytes)
{
    if (S.slot < 0 || !bytes)
        return;
    charge_sub(dev, S.slot, bytes);
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

/* VMM handles and pools, kept under a lock (not hot paths): see "where memory comes from".
 * refs: references the driver counts (cuMemCreate or an import, cuMemRetainAllocationHandle),
 * each ended by a cuMemRelease.  shared: the shared slot its memory is charged to (-1: none,
 * charged to this process); unpaid: imported from another slice, charged at its first map. */
struct vmm { uint64_t handle, bytes; int dev, mappings, refs, shared, unpaid; };
struct mapping { uint64_t ptr, size, handle; };
static pthread_mutex_t vmm_lock = PTHREAD_MUTEX_INITIALIZER;
static struct vmm *vmms;
static struct mapping *mappings;
static size_t nvmm, vmm_cap, nmappings, mappings_cap;
/* charged = reserve (as last read) + pending (provisional charges of allocations in flight) */
struct pool { CUmemoryPool pool; int dev; uint64_t charged, pending; };   /* dev -1: host memory */
static struct pool *pools;
static size_t npools, pools_cap;
static uint64_t graph_charged[VGPU_MAX_DEVICES];   /* graph memory reserve as charged */
static uint32_t graph_devices;                     /* bit d: device d's reserve is watched */
static int graph_needs;      /* 1 once an executable graph's need is in the table (see "graph memory") */
static uint64_t graph_pending[VGPU_MAX_DEVICES];   /* charged ahead of graph launches in flight (vmm_lock) */
#define MAX_CONTEXTS 16
static struct { CUcontext ctx; int dev, live; } contexts[MAX_CONTEXTS];   /* ids; [0] unused */
static int ncontexts = 1;
static uint32_t contexts_gen;   /* bumped by every teardown (and fork): caches look again */

/* Where memory of a location lives: a device index (charged there), LOCATION_PASS (not
 * device memory, or invalid: the driver answers), LOCATION_REFUSED (a location type
 * newer than the shim: it might be device memory, so it is refused, fail closed). */
#define LOCATION_PASS (-1)
#define LOCATION_REFUSED (-3)
static int location_device(const CUmemLocation *loc)
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

static void shared_atfork_child(void);

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


/* === memory shared between processes: the exporter's slice pays ===
 * Memory a process exports (cuIpcGetMemHandle, cuMemExportToShareableHandle) stays on the
 * device while any process holds it: the exporter until it frees it, each importer until
 * it closes or releases and unmaps it (the driver's rules: docs/shim.md).  So its charge
 * moves, at export, out of the exporter's slot into a slot of its own, a *shared slot*
 * (flags VGPU_PROC_SHARED, pid 0, start_ticks the export's key: a hash of its handle,
 * state the exporter's pid), and every process of the slice that holds the memory holds
 * that slot's OFD lock shared (a read lock).  The kernel keeps the count: the slot lives
 * while any holder does, whatever ends them (a release, exit, kill -9), and whoever finds
 * its lock free drains it, as any dead process's slot — the last holder as it lets go,
 * or a reaper.  One counter still: memory.current is the sum of the slots.
 * An importer finds the shared slot by the key of the handle it was given.  One that finds
 * none (the exporter is in another slice, or not under the shim) charges the slice itself
 * for what it keeps alive, admitted against the cap like an allocation: each slice pays
 * for what its own processes hold. */

static int shared_holds[VGPU_MAX_PROCS];   /* this process's holds of each shared slot (S.lock) */

int memory_holds_slot(int i)   /* with S.lock held */
{
    return i >= 0 && i < VGPU_MAX_PROCS && shared_holds[i] > 0;
}

static uint64_t key_of(const void *p, size_t n)   /* FNV-1a; never 0 */
{
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ull;
    return h | 1;
}

/* The key of a shareable handle: its bytes (fabric), or the file a descriptor is (POSIX:
 * the importer receives the same open file); 0 when it has none. */
static uint64_t shareable_key(const void *handle, CUmemAllocationHandleType type)
{
    struct stat st;
    if (type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR && fstat((int)(intptr_t)handle, &st) == 0) {
        uint64_t id[2] = {(uint64_t)st.st_dev, (uint64_t)st.st_ino};
        return key_of(id, sizeof id);
    }
    return type == CU_MEM_HANDLE_TYPE_FABRIC && handle ? key_of(handle, CU_IPC_HANDLE_SIZE) : 0;
}

/* A shared slot for `bytes` on dev, moved out of this process's charge, held by this
 * process: its index, or -1 when no slot is free. */
static int shared_new(int dev, uint64_t bytes, uint64_t key)
{
    if (S.slot < 0 || S.usage_fd < 0)
        return -1;
    pthread_mutex_lock(&S.lock);
    int s = take_free_slot();
    if (s >= 0) {
        struct vgpu_usage_proc *p = &S.usage->procs[s], *me = &S.usage->procs[S.slot];
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        memcpy(p->comm, me->comm, sizeof p->comm);
        p->started_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
        p->pid_ns = me->pid_ns;
        p->cgroup_id = me->cgroup_id;
        STORE(&p->state, (uint32_t)getpid());
        STORE(&p->start_ticks, key);
        STORE(&p->flags, (me->flags & VGPU_PROC_FROM_FILE) | VGPU_PROC_SHARED);
        /* counted twice for an instant, never not at all */
        charge_add(dev, s, bytes);
        charge_sub(dev, S.slot, bytes);
        slot_lock(S.usage_fd, s, F_RDLCK);   /* converted in place: held from now on, as by every holder */
        shared_holds[s] = 1;
    }
    pthread_mutex_unlock(&S.lock);
    if (s < 0)
        ERR("no usage slot free for memory shared with other processes; the export is refused");
    return s;
}

static int shared_slot_is(int i, uint64_t key)
{
    const struct vgpu_usage_proc *p = &S.usage->procs[i];
    if (LOAD(&p->pid) || !(LOAD(&p->flags) & VGPU_PROC_SHARED) || LOAD(&p->start_ticks) != key)
        return 0;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        if (LOAD(&S.usage->charge[d][i]))
            return 1;
    return 0;   /* drained: its memory is gone */
}

/* Hold the shared slot of export `key`: its index, or -1 when the slice has none. */
static int shared_hold(uint64_t key)
{
    if (S.mode != MODE_ENFORCE || S.usage_fd < 0 || !key)
        return -1;
    pthread_mutex_lock(&S.lock);
    int found = -1;
    uint32_t n = LOAD(&S.usage->slots_used);
    for (uint32_t i = 0; i < n && i < VGPU_MAX_PROCS && found < 0; i++) {
        if (!shared_slot_is((int)i, key))
            continue;
        if (shared_holds[i]) {
            found = (int)i;
            break;
        }
        /* a write lock is its exporter making it or a holder draining it: see which */
        for (int t = 0; t < 100; t++) {
            if (slot_lock(S.usage_fd, (int)i, F_RDLCK) == 0) {
                if (shared_slot_is((int)i, key))
                    found = (int)i;
                else
                    slot_lock(S.usage_fd, (int)i, F_UNLCK);
                break;
            }
            usleep(1000);
        }
    }
    if (found >= 0)
        shared_holds[found]++;
    pthread_mutex_unlock(&S.lock);
    return found;
}

static void shared_drain(int s)   /* with its lock held for writing */
{
    drain_slot(s);
    STORE(&S.usage->procs[s].flags, 0);
    STORE(&S.usage->procs[s].start_ticks, 0);
}

/* Let go of one hold; the slice's last holder drains the slot: the memory is gone (unless
 * the driver still keeps it: shared_kept_by_driver). */
static void shared_release(int s)
{
    if (s < 0 || s >= VGPU_MAX_PROCS)
        return;
    pthread_mutex_lock(&S.lock);
    if (shared_holds[s] > 0 && --shared_holds[s] == 0) {
        slot_lock(S.usage_fd, s, F_UNLCK);
        if (slot_lock(S.usage_fd, s, F_WRLCK) == 0) {
            if (shared_kept_by_driver(s))   /* left charged: a reaper drains it once the driver lets go */
                INFO("memory exported through usage slot %d is still on the device (a descriptor of it open "
                     "elsewhere): it stays charged until the driver lets it go", s);
            else
                shared_drain(s);
            slot_lock(S.usage_fd, s, F_UNLCK);
        }
    }
    pthread_mutex_unlock(&S.lock);
}

/* cuMemAlloc memory exported with cuIpcGetMemHandle, and IPC handles opened here (vmm_lock).
 * An import's slot is the shared slot it holds, or -1: charged to this process (bytes). */
struct shared_ptr { uint64_t ptr, bytes; int dev, slot, ctx, opens; };
static struct shared_ptr *exports, *imports;
static size_t nexports, nimports, exports_cap, imports_cap;

static int shared_ptr_add(struct shared_ptr **v, size_t *n, size_t *cap, struct shared_ptr e)
{
    if (*n == *cap) {
        struct shared_ptr *m = realloc(*v, (*cap ? 2 * *cap : 16) * sizeof *m);
        if (!m)
            return -1;
        *v = m;
        *cap = *cap ? 2 * *cap : 16;
    }
    (*v)[(*n)++] = e;
    __atomic_thread_fence(__ATOMIC_RELEASE);
    return 0;
}

static struct shared_ptr *shared_ptr_find(struct shared_ptr *v, size_t n, uint64_t ptr)
{
    for (size_t i = 0; i < n; i++)
        if (v[i].ptr == ptr)
            return &v[i];
    return NULL;
}

/* A forked child holds nothing of its own: what it inherited holds through the parent's
 * description, which it keeps open (shim.c). */
static void shared_atfork_child(void)
{
    memset(shared_holds, 0, sizeof shared_holds);
    nexports = nimports = 0;
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

int current_device(void)
{
    CUcontext c = NULL;
    if (!real_cuCtxGetCurrent || real_cuCtxGetCurrent(&c) != CUDA_SUCCESS || !c)
        return -1;
    if (LIKELY(c == cur.ctx && cur.gen == LOAD(&contexts_gen)))
        return cur.dev;
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

/* The context of the allocation the calling thread is making (current_device() came
 * first in the same hook); 0 when not known. */
static inline int context_id(void)
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
    if (!real_cuDevicePrimaryCtxGetState || real_cuDevicePrimaryCtxGetState(dev, &flags, &active) || !active ||
        !real_cuDevicePrimaryCtxRetain || real_cuDevicePrimaryCtxRetain(&c, dev))
        return NULL;
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
    if (r == CUDA_SUCCESS && c && real_cuDevicePrimaryCtxGetState &&
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

static int remember_in(uint64_t key, int dev, uint64_t bytes, int ctx)
{
    if (!S.table)
        return -1;
    for (uint32_t i = slot_of(key), n = 0; n < TABLE_SIZE; i = (i + 1) & (TABLE_SIZE - 1), n++) {
        uint64_t k = LOAD(&S.table[i].key);
        if ((k == 0 || k == TOMBSTONE) &&
            __atomic_compare_exchange_n(&S.table[i].key, &k, key, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            STORE(&S.table[i].value, bytes << 8 | (uint64_t)ctx << 4 | (uint64_t)dev);
            return 0;
        }
    }
    return -1;
}

static int remember(uint64_t key, int dev, uint64_t bytes)
{
    return remember_in(key, dev, bytes, context_id());
}

static int forget_in(uint64_t key, int *dev, uint64_t *bytes, int *ctx);

static int forget(uint64_t key, int *dev, uint64_t *bytes)
{
    int ctx;
    return forget_in(key, dev, bytes, &ctx);
}

/* The index of key's entry, or -1 when there is none. */
static int64_t table_find(uint64_t key)
{
    if (!S.table)   /* failed closed before the table existed: nothing was charged */
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
static int recall(uint64_t key, uint64_t *bytes)
{
    int64_t i = table_find(key);
    if (i < 0)
        return -1;
    *bytes = LOAD(&S.table[i].value) >> 8;
    return 0;
}

static int forget_in(uint64_t key, int *dev, uint64_t *bytes, int *ctx)
{
    for (int64_t i; (i = table_find(key)) >= 0;) {
        uint64_t k = key, v = LOAD(&S.table[i].value);
        if (__atomic_compare_exchange_n(&S.table[i].key, &k, TOMBSTONE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *dev = (int)(v & 15);
            *ctx = (int)(v >> 4 & 15);
            *bytes = v >> 8;
            return 0;
        }   /* (another thread took it first: look again) */
    }
    return -1;
}


/* The device a stream's work (and its stream-ordered allocations) lands on. */
int stream_device(CUstream stream)
{
    CUcontext ctx, cur = NULL, popped;
    if (stream == NULL || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD ||
        !real_cuStreamGetCtx || !real_cuCtxGetCurrent || real_cuStreamGetCtx(stream, &ctx) != CUDA_SUCCESS ||
        real_cuCtxGetCurrent(&cur) != CUDA_SUCCESS || ctx == cur)
        return current_device();
    if (!real_cuCtxPushCurrent_v2 || !real_cuCtxPopCurrent_v2 || real_cuCtxPushCurrent_v2(ctx) != CUDA_SUCCESS)
        return -1;
    int dev = current_device();
    real_cuCtxPopCurrent_v2(&popped);
    return dev;
}

/* Charge `bytes` on `dev`, run the real allocation, remember the result under `key`. */
#define CHARGED(dev, bytes, real_call, key)                                                    \
    do {                                                                                       \
        CUresult r_ = admit((dev), (bytes));                                                   \
        if (r_ != CUDA_SUCCESS)                                                                \
            return r_;                                                                         \
        r_ = (real_call);                                                                      \
        if (r_ != CUDA_SUCCESS)                                                                \
            refund((dev), (bytes));                                                            \
        else if (remember((key), (dev), (bytes)))                                              \
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
    int dev = current_device();
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
        if (real_cuMemFree_v2)
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

/* === pools: stream-ordered allocation ===
 * A pool keeps what is freed into it (up to its release threshold, until a
 * synchronisation; forever with a threshold of UINT64_MAX), so what the device holds
 * for a pool is its reserve, not its live allocations.  The shim charges each pool of
 * the process its CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: an allocation is admitted for
 * its footprint in whole 2 MiB chunks (what simgpu's reserve grows by at most; a real
 * driver's pool may take larger chunks, which are charged when seen, past the cap),
 * then the pool is re-read and the charge set to the reserve: growth charged first,
 * the provisional charge refunded after, so the count never drops below the device's.
 * Frees change nothing until the driver releases reserve (at a synchronisation, a trim,
 * a threshold change, a destroy); the charge follows on the next stream-ordered call,
 * memory query, refusal or trim.  Between those it is higher than the device: the safe
 * side, and never a refusal, since a refusal re-reads every pool first. */


/* Charge what the device already holds for the process: no cap check, the bytes are
 * spent (the next admissions see them). */
static void charge_held(int dev, uint64_t bytes)
{
    if (S.slot >= 0 && bytes)
        note_peak(&S.usage->devices[dev],
                  (charge_add(dev, S.slot, bytes), memory_used(dev)));
}

/* Called with vmm_lock held.  dev < 0: a pool of host memory (not charged). */
static struct pool *pool_record(CUmemoryPool pool, int dev)
{
    for (size_t i = 0; i < npools; i++)
        if (pools[i].pool == pool)
            return &pools[i];
    if (npools == pools_cap) {
        struct pool *n = realloc(pools, (pools_cap ? 2 * pools_cap : 16) * sizeof *n);
        if (!n)
            return NULL;
        pools = n;
        pools_cap = pools_cap ? 2 * pools_cap : 16;
    }
    pools[npools] = (struct pool){pool, dev, 0, 0};
    return &pools[npools++];
}

static void note_pool(CUmemoryPool pool, int dev)
{
    pthread_mutex_lock(&vmm_lock);
    struct pool *p = pool_record(pool, dev);
    if (p && p->dev != dev && !p->charged)
        p->dev = dev;
    pthread_mutex_unlock(&vmm_lock);
}

/* Bring the charge of one pool to its reserve plus what is in flight; called with
 * vmm_lock held.  trim: first give the pool's unused reserve back to the driver. */
static void pool_settle_locked(struct pool *p, int trim)
{
    cuuint64_t reserved;
    if (p->dev < 0 || !real_cuMemPoolGetAttribute)
        return;
    if (trim && real_cuMemPoolTrimTo)
        real_cuMemPoolTrimTo(p->pool, 0);
    if (real_cuMemPoolGetAttribute(p->pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS)
        return;   /* (a destroyed pool is settled by the destroy hook) */
    uint64_t target = reserved + p->pending;
    if (target > p->charged)
        charge_held(p->dev, target - p->charged);
    else
        refund(p->dev, p->charged - target);
    p->charged = target;
}

/* trim: under the cap's pressure, reserve kept for reuse becomes budget again (the
 * pools lose only their cache; nothing in use is touched). */
void pools_settle(int trim)
{
    if (!LOAD(&npools))
        return;
    pthread_mutex_lock(&vmm_lock);
    for (size_t i = 0; i < npools; i++)
        pool_settle_locked(&pools[i], trim);
    pthread_mutex_unlock(&vmm_lock);
}

/* The pool a stream-ordered allocation on `stream` comes from: the device's current one. */
static CUmemoryPool current_pool(int dev)
{
    CUmemoryPool pool = NULL;
    if (!real_cuDeviceGetMemPool || real_cuDeviceGetMemPool(&pool, dev) != CUDA_SUCCESS)
        return NULL;
    return pool;
}

static CUresult pool_alloc(int dev, CUmemoryPool pool, uint64_t bytes, CUresult r_call(void *), void *call)
{
    if (!pool)   /* no pool to read: charged as a plain allocation, for good */
        return admit(dev, bytes) != CUDA_SUCCESS ? CUDA_ERROR_OUT_OF_MEMORY : r_call(call);
    /* the most the reserve can grow by: the footprint, in whole pool chunks */
    uint64_t provisional = (vgpu_alloc_footprint(bytes) + VGPU_LARGE_PAGE - 1) & ~(VGPU_LARGE_PAGE - 1);
    CUresult r = admit(dev, provisional);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&vmm_lock);
    struct pool *p = pool_record(pool, dev);
    if (p) {
        p->charged += provisional;
        p->pending += provisional;
    }
    pthread_mutex_unlock(&vmm_lock);
    if (!p) {
        ERR("pool table full: %llu bytes stay charged", (unsigned long long)provisional);
        return r_call(call);
    }
    r = r_call(call);
    pthread_mutex_lock(&vmm_lock);
    if ((p = pool_record(pool, dev))) {
        p->pending -= provisional;
        pool_settle_locked(p, 0);
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

struct async_call { CUresult (*real)(CUdeviceptr *, size_t, CUstream); CUdeviceptr *dptr; size_t bytes; CUstream s; };
static CUresult call_async(void *c)
{
    struct async_call *a = c;
    return a->real(a->dptr, a->bytes, a->s);
}

/* Stream-ordered allocations come from the current pool of the stream's device. */
static CUresult alloc_async(CUresult (*real)(CUdeviceptr *, size_t, CUstream), CUdeviceptr *dptr,
                            size_t bytesize, CUstream hStream)
{
    int dev = dptr && bytesize ? stream_device(hStream) : -1;
    if (dev < 0)
        return real(dptr, bytesize, hStream);
    struct async_call c = {real, dptr, bytesize, hStream};
    return pool_alloc(dev, current_pool(dev), bytesize, call_async, &c);
}

SHIM_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    ENTER(cuMemAllocAsync, dptr, bytesize, hStream);
    return alloc_async(real_cuMemAllocAsync, dptr, bytesize, hStream);
}

SHIM_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    ENTER(cuMemAllocAsync_ptsz, dptr, bytesize, hStream);
    return alloc_async(real_cuMemAllocAsync_ptsz, dptr, bytesize, hStream);
}

/* A pool's memory lives on the pool's device (known when the program got the pool
 * through a hooked call), else on the stream's; -2: a host-memory pool. */
static int pool_device(CUmemoryPool pool, CUstream stream)
{
    int dev = -1;
    pthread_mutex_lock(&vmm_lock);
    for (size_t i = 0; i < npools; i++)
        if (pools[i].pool == pool)
            dev = pools[i].dev < 0 ? -2 : pools[i].dev;
    pthread_mutex_unlock(&vmm_lock);
    return dev != -1 ? dev : stream_device(stream);
}

struct pool_call {
    CUresult (*real)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
    CUdeviceptr *dptr; size_t bytes; CUmemoryPool pool; CUstream s;
};
static CUresult call_pool(void *c)
{
    struct pool_call *a = c;
    return a->real(a->dptr, a->bytes, a->pool, a->s);
}

static CUresult alloc_from_pool(CUresult (*real)(CUdeviceptr *, size_t, CUmemoryPool, CUstream),
                                CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    int dev = dptr && bytesize ? pool_device(pool, hStream) : -1;
    if (dev < 0)
        return real(dptr, bytesize, pool, hStream);
    struct pool_call c = {real, dptr, bytesize, pool, hStream};
    return pool_alloc(dev, pool, bytesize, call_pool, &c);
}

SHIM_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                             CUstream hStream)
{
    ENTER(cuMemAllocFromPoolAsync, dptr, bytesize, pool, hStream);
    return alloc_from_pool(real_cuMemAllocFromPoolAsync, dptr, bytesize, pool, hStream);
}

SHIM_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                  CUstream hStream)
{
    ENTER(cuMemAllocFromPoolAsync_ptsz, dptr, bytesize, pool, hStream);
    return alloc_from_pool(real_cuMemAllocFromPoolAsync_ptsz, dptr, bytesize, pool, hStream);
}

/* After a call that may let the driver release pool reserve (a free into a pool,
 * a trim, a threshold, a synchronisation): the charge follows the reserve. */
static CUresult after_release(CUresult r)
{
    pools_settle(0);
    graph_memory_settle(-1);
    return r;
}

/* A stream-ordered free may also free a plain allocation (refunded as cuMemFree does). */
static int export_freed(CUdeviceptr dptr, CUresult r);

static CUresult free_stream_ordered(CUresult (*real)(CUdeviceptr, CUstream), CUdeviceptr dptr, CUstream hStream)
{
    int dev;
    uint64_t bytes;
    int known = forget(KEY_PTR | dptr, &dev, &bytes) == 0;
    CUresult r = real(dptr, hStream);
    if (known && r == CUDA_SUCCESS)
        refund(dev, bytes);
    else if (known)
        remember(KEY_PTR | dptr, dev, bytes);
    else if (LOAD(&nexports))
        export_freed(dptr, r);
    return after_release(r);
}

SHIM_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    ENTER(cuMemFreeAsync, dptr, hStream);
    return free_stream_ordered(real_cuMemFreeAsync, dptr, hStream);
}

SHIM_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    ENTER(cuMemFreeAsync_ptsz, dptr, hStream);
    return free_stream_ordered(real_cuMemFreeAsync_ptsz, dptr, hStream);
}

SHIM_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    ENTER(cuMemPoolTrimTo, pool, minBytesToKeep);
    return after_release(real_cuMemPoolTrimTo(pool, minBytesToKeep));
}

SHIM_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    ENTER(cuMemPoolSetAttribute, pool, attr, value);
    return after_release(real_cuMemPoolSetAttribute(pool, attr, value));
}

SHIM_EXPORT CUresult cuStreamSynchronize(CUstream hStream)
{
    ENTER(cuStreamSynchronize, hStream);
    return after_release(real_cuStreamSynchronize(hStream));
}

SHIM_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream hStream)
{
    ENTER(cuStreamSynchronize_ptsz, hStream);
    return after_release(real_cuStreamSynchronize_ptsz(hStream));
}

SHIM_EXPORT CUresult cuEventSynchronize(CUevent hEvent)
{
    ENTER(cuEventSynchronize, hEvent);
    return after_release(real_cuEventSynchronize(hEvent));
}

SHIM_EXPORT CUresult cuCtxSynchronize(void)
{
    ENTER(cuCtxSynchronize);
    return after_release(real_cuCtxSynchronize());
}

/* === graph memory ===
 * Memory nodes of graphs allocate at launch from a per-device graph reserve that stays
 * (even after the graphs are gone) until cuDeviceGraphMemTrim: the process is charged
 * that reserve (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), read after each graph launch,
 * trim, synchronisation and memory query; before refusing, the shim trims it (what no
 * graph uses is a cache).
 * A launch is admitted ahead: at instantiation the graph's allocation nodes are walked
 * (cuGraphGetNodes, cuGraphNodeGetType, cuGraphMemAllocNodeGetParams: their bytesize and
 * device; child graphs too), and the executable graph keeps what it needs per device.
 * Before each launch what that need exceeds the reserve's free part (reserved less used)
 * by is charged as an allocation would be; over the cap the launch is refused with
 * CUDA_ERROR_OUT_OF_MEMORY and nothing runs.  The need is the sum of the nodes' sizes, an
 * upper bound (the driver may reuse the memory of nodes whose lives do not overlap).  The
 * need lives in the allocation table (KEY_GRAPH: one entry per device, context 0, so a
 * context's teardown never refunds it).  An executable graph whose walk fails, or that the
 * table has no room for, is launched as before and charged after (fail open, said once in
 * the log). */

static inline uint64_t graph_key(CUgraphExec exec, int dev)
{
    return KEY_GRAPH | (uint64_t)(uintptr_t)exec << 4 | (uint64_t)dev;
}

/* Adds the bytes graph g's allocation nodes take on each device to need; -1 when it cannot
 * be told. */
static int graph_need(CUgraph g, uint64_t need[VGPU_MAX_DEVICES], int depth)
{
    size_t n = 0;
    if (depth > 16 || !real_cuGraphGetNodes || !real_cuGraphNodeGetType || !real_cuGraphMemAllocNodeGetParams ||
        real_cuGraphGetNodes(g, NULL, &n) != CUDA_SUCCESS)
        return -1;
    if (!n)
        return 0;
    CUgraphNode *nodes = calloc(n, sizeof *nodes);
    int rc = nodes && real_cuGraphGetNodes(g, nodes, &n) == CUDA_SUCCESS ? 0 : -1;
    for (size_t i = 0; rc == 0 && i < n; i++) {
        CUgraphNodeType type;
        CUDA_MEM_ALLOC_NODE_PARAMS p;
        CUgraph child;
        if (real_cuGraphNodeGetType(nodes[i], &type) != CUDA_SUCCESS)
            rc = -1;
        else if (type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
            memset(&p, 0, sizeof p);
            if (real_cuGraphMemAllocNodeGetParams(nodes[i], &p) != CUDA_SUCCESS)
                rc = -1;
            else if (p.poolProps.location.type == CU_MEM_LOCATION_TYPE_DEVICE && p.poolProps.location.id >= 0 &&
                     p.poolProps.location.id < VGPU_MAX_DEVICES) {
                uint64_t *d = &need[p.poolProps.location.id];
                *d = *d + p.bytesize < *d ? UINT64_MAX : *d + p.bytesize;
            }
        } else if (type == CU_GRAPH_NODE_TYPE_GRAPH)
            rc = !real_cuGraphChildGraphNodeGetGraph ||
                 real_cuGraphChildGraphNodeGetGraph(nodes[i], &child) != CUDA_SUCCESS ||
                 graph_need(child, need, depth + 1) ? -1 : 0;
    }
    free(nodes);
    return rc;
}

static void graph_exec_forget(CUgraphExec exec)
{
    if (!LOAD(&graph_needs))
        return;
    int dev;
    uint64_t bytes;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        forget(graph_key(exec, d), &dev, &bytes);
}

/* After an instantiation: what the new executable graph's launches will take. */
static void graph_exec_note(CUresult r, CUgraphExec *exec, CUgraph g)
{
    if (r != CUDA_SUCCESS || !exec || !*exec || S.mode != MODE_ENFORCE)
        return;
    graph_exec_forget(*exec);   /* (a handle value of a destroyed one, reused) */
    uint64_t need[VGPU_MAX_DEVICES] = {0};
    static int said;
    if (graph_need(g, need, 0)) {
        if (!said++)
            INFO("a graph's allocation nodes could not be listed: its launches are charged after they run");
        return;
    }
    int stored = 0;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        if (need[d]) {
            STORE(&graph_needs, 1);
            stored |= remember_in(graph_key(*exec, d), d, need[d] < 1ull << 56 ? need[d] : (1ull << 56) - 1, 0);
        }
    if (stored) {
        graph_exec_forget(*exec);
        if (!said++)
            INFO("the allocation table is full: a graph's launches are charged after they run");
    }
}

CUresult graph_memory_admit(CUgraphExec exec, uint64_t taken[VGPU_MAX_DEVICES])
{
    memset(taken, 0, VGPU_MAX_DEVICES * sizeof *taken);
    if (!LOAD(&graph_needs) || !real_cuDeviceGetGraphMemAttribute)
        return CUDA_SUCCESS;     /* no graph with allocation nodes: the launch path as before */
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        uint64_t need;
        cuuint64_t reserved = 0, used = 0;
        if (recall(graph_key(exec, d), &need) ||
            real_cuDeviceGetGraphMemAttribute(d, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &reserved) ||
            real_cuDeviceGetGraphMemAttribute(d, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used))
            continue;
        uint64_t spare = reserved > used ? reserved - used : 0;
        if (need <= spare)
            continue;
        CUresult r = admit(d, need - spare);
        if (r != CUDA_SUCCESS) {
            /* what the devices before it took goes back: no longer pending, the settle
             * finds them charged above their reserve and refunds the difference */
            graph_memory_launched(taken);
            memset(taken, 0, VGPU_MAX_DEVICES * sizeof *taken);
            return r;
        }
        taken[d] = need - spare;
        pthread_mutex_lock(&vmm_lock);   /* the reserve to come: settled against once it is there */
        graph_charged[d] += taken[d];
        graph_pending[d] += taken[d];
        pthread_mutex_unlock(&vmm_lock);
    }
    return CUDA_SUCCESS;
}

void graph_memory_launched(const uint64_t taken[VGPU_MAX_DEVICES])
{
    int any = 0;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        any |= taken[d] != 0;
    if (!any)
        return;
    pthread_mutex_lock(&vmm_lock);
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        graph_pending[d] -= taken[d] < graph_pending[d] ? taken[d] : graph_pending[d];
    pthread_mutex_unlock(&vmm_lock);
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        if (taken[d])
            graph_memory_settle(d);
}

/* Every form of instantiation: the driver's, then what the new executable graph needs. */
#define INSTANTIATE(sym, ...)                     \
    ENTER(sym, __VA_ARGS__);                      \
    CUresult r_ = real_##sym(__VA_ARGS__);        \
    graph_exec_note(r_, phGraphExec, hGraph);     \
    return r_

SHIM_EXPORT CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                        char *logBuffer, size_t bufferSize)
{
    INSTANTIATE(cuGraphInstantiate, phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

SHIM_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                           char *logBuffer, size_t bufferSize)
{
    INSTANTIATE(cuGraphInstantiate_v2, phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

SHIM_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    INSTANTIATE(cuGraphInstantiateWithFlags, phGraphExec, hGraph, flags);
}

SHIM_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                  CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    INSTANTIATE(cuGraphInstantiateWithParams, phGraphExec, hGraph, instantiateParams);
}

SHIM_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                       CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    INSTANTIATE(cuGraphInstantiateWithParams_ptsz, phGraphExec, hGraph, instantiateParams);
}

SHIM_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    ENTER(cuGraphExecDestroy, hGraphExec);
    graph_exec_forget(hGraphExec);
    return real_cuGraphExecDestroy(hGraphExec);
}

void graph_memory_settle(int dev)
{
    if (dev >= VGPU_MAX_DEVICES || !real_cuDeviceGetGraphMemAttribute)
        return;
    if (dev >= 0)
        __atomic_or_fetch(&graph_devices, 1u << dev, __ATOMIC_RELAXED);
    uint32_t devs = dev >= 0 ? 1u << dev : LOAD(&graph_devices);
    if (!devs)
        return;
    pthread_mutex_lock(&vmm_lock);
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        cuuint64_t reserved;
        if (!(devs & 1u << d) ||
            real_cuDeviceGetGraphMemAttribute(d, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS)
            continue;
        reserved += graph_pending[d];    /* (what launches in flight were charged ahead stays) */
        if (reserved > graph_charged[d])
            charge_held(d, reserved - graph_charged[d]);
        else
            refund(d, graph_charged[d] - reserved);
        graph_charged[d] = reserved;
    }
    pthread_mutex_unlock(&vmm_lock);
}

/* Under the cap's pressure: the graph reserve nothing uses becomes budget again. */
static void graph_memory_trim(void)
{
    uint32_t devs = LOAD(&graph_devices);
    for (int d = 0; d < VGPU_MAX_DEVICES && real_cuDeviceGraphMemTrim; d++)
        if (devs & 1u << d)
            real_cuDeviceGraphMemTrim(d);
    graph_memory_settle(-1);
}

SHIM_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice device)
{
    ENTER(cuDeviceGraphMemTrim, device);
    CUresult r = real_cuDeviceGraphMemTrim(device);
    graph_memory_settle(device);
    return r;
}

SHIM_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    ENTER(cuMemPoolDestroy, pool);
    CUresult r = real_cuMemPoolDestroy(pool);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&vmm_lock);
    for (size_t i = 0; i < npools; i++)
        if (pools[i].pool == pool) {
            if (pools[i].dev >= 0)
                refund(pools[i].dev, pools[i].charged);
            pools[i] = pools[--npools];
            break;
        }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

/* VMM: a handle's memory stays on the device while it is mapped, even after release,
 * so the budget comes back when it is both released and unmapped (as the driver frees). */
SHIM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                 unsigned long long flags)
{
    ENTER(cuMemCreate, handle, size, prop, flags);
    int dev = prop ? location_device(&prop->location) : LOCATION_PASS;
    if (dev == LOCATION_REFUSED)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (dev < 0 || !handle || !size)
        return real_cuMemCreate(handle, size, prop, flags);
    CUresult r = admit(dev, size);
    if (r != CUDA_SUCCESS)
        return r;
    r = real_cuMemCreate(handle, size, prop, flags);
    if (r != CUDA_SUCCESS) {
        refund(dev, size);
        return r;
    }
    pthread_mutex_lock(&vmm_lock);
    if (nvmm == vmm_cap) {
        struct vmm *n = realloc(vmms, (vmm_cap ? 2 * vmm_cap : 16) * sizeof *n);
        if (n) {
            vmms = n;
            vmm_cap = vmm_cap ? 2 * vmm_cap : 16;
        }
    }
    if (nvmm < vmm_cap)
        vmms[nvmm++] = (struct vmm){*handle, size, dev, 0, 1, -1, 0};
    else
        ERR("VMM table full: %zu bytes stay charged", size);
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

/* Called with vmm_lock held: give the budget back once released and unmapped (shared:
 * let go of the shared slot; the last holder of the slice drains it). */
static void vmm_settle(size_t i)
{
    if (vmms[i].refs > 0 || vmms[i].mappings > 0)
        return;
    if (vmms[i].shared >= 0)
        shared_release(vmms[i].shared);
    else
        refund(vmms[i].dev, vmms[i].bytes);
    vmms[i] = vmms[--nvmm];
}

static struct vmm *vmm_find(uint64_t handle, size_t *index)
{
    for (size_t i = 0; i < nvmm; i++)
        if (vmms[i].handle == handle) {
            *index = i;
            return &vmms[i];
        }
    return NULL;
}

SHIM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                              unsigned long long flags)
{
    ENTER(cuMemMap, ptr, size, offset, handle, flags);
    /* memory imported from another slice is charged here, at its first mapping, for what is
     * mapped (an importer is not told the allocation's size) */
    size_t i;
    int dev = -1;
    pthread_mutex_lock(&vmm_lock);
    struct vmm *v = vmm_find(handle, &i);
    if (v && v->unpaid)
        dev = v->dev;
    pthread_mutex_unlock(&vmm_lock);
    if (dev >= 0 && admit(dev, size) != CUDA_SUCCESS)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real_cuMemMap(ptr, size, offset, handle, flags);
    if (r != CUDA_SUCCESS) {
        if (dev >= 0)
            refund(dev, size);
        return r;
    }
    pthread_mutex_lock(&vmm_lock);
    v = vmm_find(handle, &i);
    if (dev >= 0 && v && v->unpaid) {
        v->unpaid = 0;
        v->bytes = size;
    } else if (dev >= 0) {
        refund(dev, size);   /* another thread's mapping paid first */
    }
    if (v && nmappings == mappings_cap) {
        struct mapping *n = realloc(mappings, (mappings_cap ? 2 * mappings_cap : 16) * sizeof *n);
        if (n) {
            mappings = n;
            mappings_cap = mappings_cap ? 2 * mappings_cap : 16;
        }
    }
    if (v && nmappings < mappings_cap) {
        mappings[nmappings++] = (struct mapping){ptr, size, handle};
        v->mappings++;
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

SHIM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    ENTER(cuMemUnmap, ptr, size);
    CUresult r = real_cuMemUnmap(ptr, size);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&vmm_lock);
    for (size_t m = 0; m < nmappings;) {
        if (mappings[m].ptr < ptr || mappings[m].ptr >= ptr + size) {
            m++;
            continue;
        }
        size_t i;
        struct vmm *v = vmm_find(mappings[m].handle, &i);
        mappings[m] = mappings[--nmappings];
        if (v) {
            v->mappings--;
            vmm_settle(i);
        }
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}


/* === memory shared between processes: the hooks (see "the exporter's slice pays") === */

SHIM_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    ENTER(cuMemRetainAllocationHandle, handle, addr);
    CUresult r = real_cuMemRetainAllocationHandle(handle, addr);
    if (r != CUDA_SUCCESS || !handle)
        return r;
    pthread_mutex_lock(&vmm_lock);
    size_t i;
    struct vmm *v = vmm_find(*handle, &i);
    if (v)
        v->refs++;   /* one more cuMemRelease before its memory can go */
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

/* cuIpcGetMemHandle: the allocation's charge moves to a shared slot of its own, which the
 * exporter holds until it frees the allocation (or its context goes). */
SHIM_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    ENTER(cuIpcGetMemHandle, pHandle, dptr);
    CUresult r = real_cuIpcGetMemHandle(pHandle, dptr);
    if (r != CUDA_SUCCESS || !pHandle)
        return r;
    pthread_mutex_lock(&vmm_lock);
    int exported = shared_ptr_find(exports, nexports, dptr) != NULL;
    pthread_mutex_unlock(&vmm_lock);
    int dev, ctx;
    uint64_t bytes;
    if (exported || forget_in(KEY_PTR | dptr, &dev, &bytes, &ctx))
        return r;   /* exported already, or nothing of ours (nothing charged) */
    int s = shared_new(dev, bytes, key_of(pHandle, sizeof *pHandle));
    pthread_mutex_lock(&vmm_lock);
    int ok = s >= 0 && shared_ptr_add(&exports, &nexports, &exports_cap,
                                      (struct shared_ptr){dptr, bytes, dev, s, ctx, 1}) == 0;
    pthread_mutex_unlock(&vmm_lock);
    if (ok)
        return r;
    if (s >= 0) {   /* no room to remember it: back on our own charge */
        charge_add(dev, S.slot, bytes);
        shared_release(s);
    }
    remember_in(KEY_PTR | dptr, dev, bytes, ctx);
    return CUDA_ERROR_OUT_OF_MEMORY;   /* fail closed: an importer could keep it uncounted */
}

/* After the driver's free of an exported allocation: the exporter lets go of its slot. */
static int export_freed(CUdeviceptr dptr, CUresult r)
{
    int s = -1;
    pthread_mutex_lock(&vmm_lock);
    struct shared_ptr *e = shared_ptr_find(exports, nexports, dptr);
    if (e && r == CUDA_SUCCESS) {
        s = e->slot;
        *e = exports[--nexports];
    }
    pthread_mutex_unlock(&vmm_lock);
    shared_release(s);
    return s;
}

static CUresult ipc_open(CUresult (*real)(CUdeviceptr *, CUipcMemHandle, unsigned int), CUdeviceptr *pdptr,
                         CUipcMemHandle handle, unsigned int flags)
{
    int s = shared_hold(key_of(&handle, sizeof handle));   /* before the driver maps it */
    CUresult r = real(pdptr, handle, flags);
    if (r != CUDA_SUCCESS || !pdptr) {
        shared_release(s);
        return r;
    }
    pthread_mutex_lock(&vmm_lock);
    struct shared_ptr *im = shared_ptr_find(imports, nimports, *pdptr);
    if (im)
        im->opens++;   /* opened again: the driver counts one more reference */
    pthread_mutex_unlock(&vmm_lock);
    if (im) {
        shared_release(s);   /* held once per import */
        return r;
    }
    struct shared_ptr rec = {*pdptr, 0, -1, s, context_id(), 1};
    if (s < 0) {
        /* the exporter is not in this slice: this slice pays while it holds it */
        size_t size = 0;
        int dev = current_device();
        rec.ctx = context_id();
        if (dev >= 0 && real_cuMemGetAddressRange_v2 && real_cuMemGetAddressRange_v2(NULL, &size, *pdptr) == 0 &&
            size) {
            if (admit(dev, vgpu_alloc_footprint(size)) != CUDA_SUCCESS) {
                real_cuIpcCloseMemHandle(*pdptr);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            rec.dev = dev;
            rec.bytes = vgpu_alloc_footprint(size);
        }
    }
    pthread_mutex_lock(&vmm_lock);
    int ok = shared_ptr_add(&imports, &nimports, &imports_cap, rec) == 0;
    pthread_mutex_unlock(&vmm_lock);
    if (!ok)
        ERR("import table full: %llu bytes stay charged", (unsigned long long)rec.bytes);
    return r;
}

SHIM_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    ENTER(cuIpcOpenMemHandle, pdptr, handle, Flags);
    return ipc_open(real_cuIpcOpenMemHandle, pdptr, handle, Flags);
}

SHIM_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    ENTER(cuIpcOpenMemHandle_v2, pdptr, handle, Flags);
    return ipc_open(real_cuIpcOpenMemHandle_v2, pdptr, handle, Flags);
}

SHIM_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    ENTER(cuIpcCloseMemHandle, dptr);
    CUresult r = real_cuIpcCloseMemHandle(dptr);
    if (r != CUDA_SUCCESS)
        return r;
    struct shared_ptr gone = {0, 0, -1, -1, 0, 0};
    pthread_mutex_lock(&vmm_lock);
    struct shared_ptr *im = shared_ptr_find(imports, nimports, dptr);
    if (im && --im->opens == 0) {   /* the driver unmaps it at its last close */
        gone = *im;
        *im = imports[--nimports];
    }
    pthread_mutex_unlock(&vmm_lock);
    if (gone.slot >= 0)
        shared_release(gone.slot);
    else if (gone.bytes)
        refund(gone.dev, gone.bytes);
    return r;
}

/* A shareable handle: the handle's charge moves to a shared slot, which the handle holds
 * until it is released and unmapped.  (An exported descriptor that stays open after that
 * keeps the memory too, as the driver documents; the shim does not see descriptors.) */
SHIM_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                  CUmemAllocationHandleType handleType, unsigned long long flags)
{
    ENTER(cuMemExportToShareableHandle, shareableHandle, handle, handleType, flags);
    CUresult r = real_cuMemExportToShareableHandle(shareableHandle, handle, handleType, flags);
    if (r != CUDA_SUCCESS || !shareableHandle)
        return r;
    int posix = handleType == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    uint64_t key = shareable_key(posix ? (void *)(intptr_t) * (int *)shareableHandle : shareableHandle, handleType);
    pthread_mutex_lock(&vmm_lock);
    size_t i;
    struct vmm *v = vmm_find(handle, &i);
    int dev = v && v->shared < 0 && v->bytes && !v->unpaid ? v->dev : -1;
    uint64_t bytes = dev >= 0 ? v->bytes : 0;
    pthread_mutex_unlock(&vmm_lock);
    if (dev < 0 || !key)
        return r;   /* nothing of ours, shared already, or no key an importer could find */
    int s = shared_new(dev, bytes, key);
    pthread_mutex_lock(&vmm_lock);
    v = vmm_find(handle, &i);
    if (v && s >= 0)
        v->shared = s;
    pthread_mutex_unlock(&vmm_lock);
    if (v && s >= 0)
        return r;
    if (s >= 0) {   /* released meanwhile: settled as its own charge */
        charge_add(dev, S.slot, bytes);
        shared_release(s);
        return r;
    }
    if (posix)
        close(*(int *)shareableHandle);   /* fail closed: never handed out */
    return CUDA_ERROR_OUT_OF_MEMORY;
}

SHIM_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                    CUmemAllocationHandleType shHandleType)
{
    ENTER(cuMemImportFromShareableHandle, handle, osHandle, shHandleType);
    int s = shared_hold(shareable_key(osHandle, shHandleType));   /* before the driver imports it */
    CUresult r = real_cuMemImportFromShareableHandle(handle, osHandle, shHandleType);
    if (r != CUDA_SUCCESS || !handle) {
        shared_release(s);
        return r;
    }
    struct vmm rec = {*handle, 0, -1, 0, 1, s, 0};
    CUmemAllocationProp prop;
    if (s < 0 && real_cuMemGetAllocationPropertiesFromHandle &&
        real_cuMemGetAllocationPropertiesFromHandle(&prop, *handle) == CUDA_SUCCESS) {
        int dev = location_device(&prop.location);
        if (dev == LOCATION_REFUSED) {
            if (real_cuMemRelease)
                real_cuMemRelease(*handle);
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        rec.dev = dev;
        rec.unpaid = dev >= 0;   /* from another slice: this slice pays for what it maps */
    }
    pthread_mutex_lock(&vmm_lock);
    if (nvmm == vmm_cap) {
        struct vmm *n = realloc(vmms, (vmm_cap ? 2 * vmm_cap : 16) * sizeof *n);
        if (n) {
            vmms = n;
            vmm_cap = vmm_cap ? 2 * vmm_cap : 16;
        }
    }
    int ok = nvmm < vmm_cap;
    if (ok)
        vmms[nvmm++] = rec;
    pthread_mutex_unlock(&vmm_lock);
    if (!ok)
        ERR("VMM table full: an imported handle is not followed");
    return r;
}

SHIM_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)
{
    ENTER(cuMemPoolCreate, pool, poolProps);
    int dev = poolProps ? location_device(&poolProps->location) : LOCATION_PASS;
    if (dev == LOCATION_REFUSED)
        return CUDA_ERROR_NOT_SUPPORTED;
    CUresult r = real_cuMemPoolCreate(pool, poolProps);
    if (r == CUDA_SUCCESS && pool)
        note_pool(*pool, dev);   /* LOCATION_PASS (-1): host memory, never charged */
    return r;
}

SHIM_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    ENTER(cuDeviceGetDefaultMemPool, pool_out, dev);
    CUresult r = real_cuDeviceGetDefaultMemPool(pool_out, dev);
    if (r == CUDA_SUCCESS && pool_out)
        note_pool(*pool_out, dev);
    return r;
}

SHIM_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    ENTER(cuDeviceGetMemPool, pool, dev);
    CUresult r = real_cuDeviceGetMemPool(pool, dev);
    if (r == CUDA_SUCCESS && pool)
        note_pool(*pool, dev);
    return r;
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
    int dev;
    uint64_t bytes;
    if (forget(KEY_PTR | dptr, &dev, &bytes)) {   /* not ours: maybe a pool's (settled), or exported */
        CUresult r = real_cuMemFree_v2(dptr);
        if (LOAD(&nexports))
            export_freed(dptr, r);
        return LOAD(&npools) ? after_release(r) : r;
    }
    CUresult r = real_cuMemFree_v2(dptr);
    if (r == CUDA_SUCCESS)
        refund(dev, bytes);
    else
        remember(KEY_PTR | dptr, dev, bytes);
    return r;
}

SHIM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    ENTER(cuMemRelease, handle);
    CUresult r = real_cuMemRelease(handle);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&vmm_lock);
    size_t i;
    struct vmm *v = vmm_find(handle, &i);
    if (v) {
        if (v->refs > 0)
            v->refs--;
        vmm_settle(i);
    }
    pthread_mutex_unlock(&vmm_lock);
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
static int slice(int dev, uint64_t dev_total, uint64_t dev_free, uint64_t *total, uint64_t *free, uint64_t *used)
{
    uint64_t cap = memory_cap(dev);
    if (S.mode == MODE_ENFORCE && cap == VGPU_UNLIMITED)
        return 0;   /* unlimited: the device as it is */
    if (S.mode == MODE_ENFORCE) {
        maybe_reap();
        pools_settle(0);
        graph_memory_settle(-1);
    }
    uint64_t u = S.mode == MODE_ENFORCE ? memory_used(dev) : 0;
    *total = cap < dev_total ? cap : dev_total;
    *used = u < *total ? u : *total;
    *free = *total - *used < dev_free ? *total - *used : dev_free;
    return 1;
}

SHIM_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    ENTER(cuMemGetInfo_v2, free, total);
    CUresult r = real_cuMemGetInfo_v2(free, total);
    int dev = current_device();
    uint64_t t, f, u;
    if (r == CUDA_SUCCESS && dev >= 0 && slice(dev, *total, *free, &t, &f, &u)) {
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

/* === NVML view ===
 * Which CUDA device an NVML handle is: the one with the same UUID.  CUDA numbers the
 * devices it sees (CUDA_VISIBLE_DEVICES reorders and hides them; a MIG instance is a
 * device of its own), NVML numbers the node's GPUs, and the slice's devices are CUDA's.
 * Before the process has initialised CUDA (NVML-only tools: nvidia-smi, gpustat), or
 * where a UUID cannot be read, NVML's index stands in (the two agree without
 * CUDA_VISIBLE_DEVICES and MIG).  A handle no CUDA device matches (a GPU CUDA was not
 * given, or the parent of a MIG instance) shows the driver's figures. */

static pthread_mutex_t nvml_map_lock = PTHREAD_MUTEX_INITIALIZER;
static struct { nvmlDevice_t handle; int dev; } nvml_map[4 * VGPU_MAX_DEVICES];
static int nvml_mapped;

static int cuda_uuid(int dev, char out[40])   /* "8-4-4-4-12" hex, as after NVML's prefix */
{
    CUuuid u;
    if (!real_cuDeviceGetUuid_v2 || real_cuDeviceGetUuid_v2(&u, dev) != CUDA_SUCCESS)
        return -1;
    const unsigned char *b = (const unsigned char *)u.bytes;
    snprintf(out, 40, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
    return 0;
}

static int nvml_index_of(nvmlDevice_t device, int *cacheable)
{
    char s[96];
    int count;
    *cacheable = 1;
    if (real_nvmlDeviceGetUUID && real_nvmlDeviceGetUUID(device, s, sizeof s) == NVML_SUCCESS && real_cuDeviceGetCount &&
        real_cuDeviceGetCount(&count) == CUDA_SUCCESS) {
        const char *hex = strchr(s, '-');
        hex = hex ? hex + 1 : s;
        char u[40];
        for (int d = 0; d < count && d < VGPU_MAX_DEVICES; d++)
            if (cuda_uuid(d, u) == 0 && !strcasecmp(u, hex))
                return d;
        if (cuda_uuid(0, u) == 0)
            return -1;   /* CUDA's devices are known, and this is none of them */
    }
    *cacheable = 0;   /* CUDA not initialised yet: ask again once it is */
    unsigned int i;
    if (!real_nvmlDeviceGetIndex || real_nvmlDeviceGetIndex(device, &i) != NVML_SUCCESS || i >= VGPU_MAX_DEVICES)
        return -1;
    return (int)i;
}

int nvml_index(nvmlDevice_t device)
{
    pthread_mutex_lock(&nvml_map_lock);
    for (int i = 0; i < nvml_mapped; i++)
        if (nvml_map[i].handle == device) {
            int dev = nvml_map[i].dev;
            pthread_mutex_unlock(&nvml_map_lock);
            return dev;
        }
    int cacheable, dev = nvml_index_of(device, &cacheable);
    if (cacheable && nvml_mapped < (int)(sizeof nvml_map / sizeof nvml_map[0]))
        nvml_map[nvml_mapped++] = (typeof(nvml_map[0])){device, dev};
    pthread_mutex_unlock(&nvml_map_lock);
    return dev;
}

/* The NVML handle of CUDA device dev (the reverse). */
int nvml_handle(int dev, nvmlDevice_t *handle)
{
    char u[40], s[48];
    if (real_nvmlDeviceGetHandleByUUID && cuda_uuid(dev, u) == 0)
        for (int k = 0; k < 2; k++) {
            snprintf(s, sizeof s, "%s-%s", k ? "MIG" : "GPU", u);
            if (real_nvmlDeviceGetHandleByUUID(s, handle) == NVML_SUCCESS)
                return 0;
        }
    return real_nvmlDeviceGetHandleByIndex_v2 && real_nvmlDeviceGetHandleByIndex_v2((unsigned)dev, handle) == NVML_SUCCESS
               ? 0 : -1;
}


SHIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    NVML_ENTER(nvmlDeviceGetMemoryInfo, device, memory);
    nvmlReturn_t r = real_nvmlDeviceGetMemoryInfo(device, memory);
    int dev = nvml_index(device);
    uint64_t t, f, u;
    if (r == NVML_SUCCESS && dev >= 0 && slice(dev, memory->total, memory->free, &t, &f, &u)) {
        memory->total = t;
        memory->used = u;
        memory->free = f;
    }
    return r;
}

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    NVML_ENTER(nvmlDeviceGetMemoryInfo_v2, device, memory);
    nvmlReturn_t r = real_nvmlDeviceGetMemoryInfo_v2(device, memory);
    int dev = nvml_index(device);
    uint64_t t, f, u;
    if (r == NVML_SUCCESS && dev >= 0 && slice(dev, memory->total, memory->free, &t, &f, &u)) {
        memory->total = t;
        memory->reserved = 0;
        memory->used = u;
        memory->free = f;
    }
    return r;
}

/* The container's own processes on the device, from the usage file: pids as the
 * container sees them, whatever pid namespace the driver reports in. */
enum proc_abi { PROC_V1, PROC_V2 };

static nvmlReturn_t own_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos, enum proc_abi abi)
{
    int dev = nvml_index(device);
    if (!infoCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (S.mode == MODE_ENFORCE)
        maybe_reap();
    unsigned int count = 0;
    nvmlProcessInfo_v2_t found[VGPU_MAX_PROCS];
    /* the figures never add up past the total shown (after a resize below use, they
     * would): the shown total is the cap */
    uint64_t left = memory_cap(dev);
    for (int i = 0; S.mode == MODE_ENFORCE && i < VGPU_MAX_PROCS; i++) {
        int32_t pid = LOAD(&S.usage->procs[i].pid);
        if (!pid && (LOAD(&S.usage->procs[i].flags) & VGPU_PROC_SHARED))
            pid = (int32_t)LOAD(&S.usage->procs[i].state);   /* shared memory: under its exporter */
        uint64_t mem = LOAD(&S.usage->charge[dev][i]);
        mem = mem < left ? mem : left;
        left -= mem;
        unsigned int k = 0;
        while (k < count && found[k].pid != (unsigned int)pid)
            k++;
        if (pid > 0 && mem && k < count)
            found[k].usedGpuMemory += mem;
        else if (pid > 0 && mem)
            found[count++] = (nvmlProcessInfo_v2_t){.pid = (unsigned int)pid, .usedGpuMemory = mem,
                                                    .gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT,
                                                    .computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT};
    }
    return vgpu_nvml_put_processes(found, count, infoCount, infos, abi == PROC_V1);
}

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                              nvmlProcessInfo_v1_t *infos)
{
    NVML_ENTER(nvmlDeviceGetComputeRunningProcesses, device, infoCount, infos);
    if (nvml_index(device) < 0)   /* none of the slice's devices: its processes in the driver's list */
        return view_compute_processes(device, infoCount, infos, sizeof(nvmlProcessInfo_v1_t),
                                      (nvmlReturn_t(*)(nvmlDevice_t, unsigned int *, void *))real_nvmlDeviceGetComputeRunningProcesses);
    return own_processes(device, infoCount, infos, PROC_V1);
}

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                                 nvmlProcessInfo_v2_t *infos)
{
    NVML_ENTER(nvmlDeviceGetComputeRunningProcesses_v2, device, infoCount, infos);
    if (nvml_index(device) < 0)   /* none of the slice's devices: its processes in the driver's list */
        return view_compute_processes(device, infoCount, infos, sizeof(nvmlProcessInfo_v2_t),
                                      (nvmlReturn_t(*)(nvmlDevice_t, unsigned int *, void *))real_nvmlDeviceGetComputeRunningProcesses_v2);
    return own_processes(device, infoCount, infos, PROC_V2);
}

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                 nvmlProcessInfo_t *infos)
{
    NVML_ENTER(nvmlDeviceGetComputeRunningProcesses_v3, device, infoCount, infos);
    if (nvml_index(device) < 0)   /* none of the slice's devices: its processes in the driver's list */
        return view_compute_processes(device, infoCount, infos, sizeof(nvmlProcessInfo_t),
                                      (nvmlReturn_t(*)(nvmlDevice_t, unsigned int *, void *))real_nvmlDeviceGetComputeRunningProcesses_v3);
    return own_processes(device, infoCount, infos, PROC_V2);
}

