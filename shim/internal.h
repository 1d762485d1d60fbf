/* internal.h — what the shim's files share (never installed, never exported).
 *
 *   shim.c           configuration, files, process slots, init, NVML loading, interception
 *   memory.c         the memory cap: accounting, contexts, allocate/free hooks, the CUDA view
 *   pools.c          stream-ordered pools and graph memory
 *   vmm.c            the VMM API's handles and mappings
 *   shared_memory.c  memory shared between processes (IPC, shareable handles)
 *   compute.c        the compute share: cost estimates, pacing, launch hooks
 *   board.c          the share board (burst mode)
 *   view.c           NVML's answers inside a slice: memory, processes (only the slice's)
 *
 * Every symbol here has hidden visibility (-fvisibility=hidden); only the hooks
 * (SHIM_EXPORT, listed once in hooks.h) leave the library.
 */
#ifndef VGPU_SHIM_INTERNAL_H
#define VGPU_SHIM_INTERNAL_H

#define _GNU_SOURCE
#include "abi_resolve.h"
#include "cuda_abi.h"
#include "hooks.h"
#include "nvml_abi.h"
#include "vgpu_region.h"

#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#define SHIM_EXPORT __attribute__((visibility("default")))
/* Variables one file defines and others use: hidden in the declaration too, so that they
 * are reached directly (as a file's static is), not through the GOT. */
#define HIDDEN __attribute__((visibility("hidden")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

/* The shim is preloaded (loaded at startup), so its thread-locals can use the static TLS
 * model: no __tls_get_addr call on every hook. */
#define TLS __thread __attribute__((tls_model("initial-exec")))

/* === real symbols === */

#define DECLARE_CUDA(sym, base, ver, pt, ret, params) extern HIDDEN ret(*real_##sym) params; SHIM_EXPORT ret sym params;
VGPU_CUDA_HOOKS(DECLARE_CUDA)
#define DECLARE_NVML(sym, ret, params) extern HIDDEN ret(*real_##sym) params; SHIM_EXPORT ret sym params;
VGPU_NVML_HOOKS(DECLARE_NVML)
#undef DECLARE_CUDA
#undef DECLARE_NVML

/* driver functions the shim calls but does not hook (X(name, return type, parameters)).
 * VGPU_CALLED: what start-up, every allocation and every paced launch call, looked up at
 * start-up (resolve_cuda).  VGPU_CALLED_ON_USE: what only rarer paths call (another
 * context's stream, pools, graphs, the share board, views, shared memory, a context's
 * teardown), looked up on first use: 14 fewer dlsym calls in every process's start
 * (issue 31).  Like a hook's own, such an entry point is asked for with REAL(sym) before
 * real_sym is called (NULL until then). */
#define VGPU_CALLED(X)                                                                     \
    X(cuCtxGetDevice, CUresult, (CUdevice *))                                              \
    X(cuDeviceGetCount, CUresult, (int *))                                                 \
    X(cuCtxGetCurrent, CUresult, (CUcontext *))                                            \
    X(cuEventCreate, CUresult, (CUevent *, unsigned int))                                  \
    X(cuEventRecord, CUresult, (CUevent, CUstream))                                        \
    X(cuEventRecord_ptsz, CUresult, (CUevent, CUstream))                                   \
    X(cuEventQuery, CUresult, (CUevent))                                                   \
    X(cuStreamIsCapturing, CUresult, (CUstream, CUstreamCaptureStatus *))                  \
    X(cuStreamIsCapturing_ptsz, CUresult, (CUstream, CUstreamCaptureStatus *))             \
    X(cuEventElapsedTime, CUresult, (float *, CUevent, CUevent))                           \
    X(cuEventDestroy_v2, CUresult, (CUevent))
#define VGPU_CALLED_ON_USE(X)                                                              \
    X(cuCtxPushCurrent_v2, CUresult, (CUcontext))                                          \
    X(cuCtxPopCurrent_v2, CUresult, (CUcontext *))                                         \
    X(cuStreamGetCtx, CUresult, (CUstream, CUcontext *))                                   \
    X(cuMemPoolGetAttribute, CUresult, (CUmemoryPool, CUmemPool_attribute, void *))        \
    X(cuDevicePrimaryCtxRetain, CUresult, (CUcontext *, CUdevice))                         \
    X(cuDevicePrimaryCtxGetState, CUresult, (CUdevice, unsigned int *, int *))             \
    X(cuDeviceGetGraphMemAttribute, CUresult, (CUdevice, CUgraphMem_attribute, void *))    \
    X(cuGraphGetNodes, CUresult, (CUgraph, CUgraphNode *, size_t *))                       \
    X(cuGraphNodeGetType, CUresult, (CUgraphNode, CUgraphNodeType *))                      \
    X(cuGraphMemAllocNodeGetParams, CUresult, (CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS *)) \
    X(cuGraphChildGraphNodeGetGraph, CUresult, (CUgraphNode, CUgraph *))                   \
    X(cuDeviceGetUuid_v2, CUresult, (CUuuid *, CUdevice))                                  \
    X(cuMemGetAddressRange_v2, CUresult, (CUdeviceptr *, size_t *, CUdeviceptr))           \
    X(cuMemGetAllocationPropertiesFromHandle, CUresult, (CUmemAllocationProp *, CUmemGenericAllocationHandle))
#define VGPU_NVML_CALLED(X)                                                                    \
    X(nvmlDeviceGetIndex, nvmlReturn_t, (nvmlDevice_t, unsigned int *))                        \
    X(nvmlDeviceGetUUID, nvmlReturn_t, (nvmlDevice_t, char *, unsigned int))                   \
    X(nvmlDeviceGetHandleByUUID, nvmlReturn_t, (const char *, nvmlDevice_t *))                 \
    X(nvmlInit_v2, nvmlReturn_t, (void))                                                       \
    X(nvmlDeviceGetHandleByIndex_v2, nvmlReturn_t, (unsigned int, nvmlDevice_t *))
#define DECLARE_CALLED(sym, ret, params) extern HIDDEN ret(*real_##sym) params;
VGPU_CALLED(DECLARE_CALLED)
VGPU_CALLED_ON_USE(DECLARE_CALLED)
VGPU_NVML_CALLED(DECLARE_CALLED)
#undef DECLARE_CALLED

/* === state === */

enum mode { MODE_PASS, MODE_ENFORCE, MODE_DENY };
#define LOCK_BASE (1ll << 40)   /* usage slot i is owned by an OFD lock on this byte + i */

struct entry { uint64_t key, value; };   /* allocation table; value: bytes << 8 | context id << 4 | device */

struct shim_state {
    int ready;                  /* atomic: init done */
    pthread_mutex_t lock;       /* init, slot claim and reaping within this process */
    enum mode mode;
    int log_level;              /* 0 errors, 1 info, 2 debug (VGPU_LOG) */
    const struct vgpu_quota *quota;
    struct vgpu_usage *usage;
    int usage_fd;
    int slot;                   /* this process's slot in the usage file; -1: none (yet) */
    char *usage_path;           /* set by configure, kept */
    struct entry *table;
    uint64_t next_reap_ns;
    uint64_t next_claim_ns;     /* no slot: when to try again */
    void *cuda, *nvml;
    int nvml_ready;
    uint64_t context_overhead;  /* VGPU_CONTEXT_OVERHEAD, when set: no measuring */
    int context_overhead_set;
    char *board_path;           /* <dir>/.sm-board: the share board (board.c); set by configure */
    uint64_t slice_key;         /* the slice's name, hashed: its entries on the board */
};
extern HIDDEN struct shim_state S;

/* A slot's charge on a device, moved by `bytes`; then its sequence (csrc/vgpu_region.h:
 * charge_seq), so that the node agent, reading sequence and charges before and after it
 * reads the driver, sees any move in between.  Returns the new charge. */
static inline uint64_t charge_add(int dev, int slot, uint64_t bytes)
{
    uint64_t now = __atomic_add_fetch(&S.usage->charge[dev][slot], bytes, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&S.usage->charge_seq[slot], 1, __ATOMIC_SEQ_CST);
    return now;
}

/* Never below zero: a slot a neighbour rewrote lower (the file is writable in the container)
 * would otherwise wrap to 2^64 - x as its owner frees, a charge the agent takes for forged,
 * and the honest owner for its forger.  What went below zero is added back (an add, as
 * every other change: concurrent ones still sum). */
void charge_found_rewritten(int dev, int slot);
static inline uint64_t charge_sub(int dev, int slot, uint64_t bytes)
{
    uint64_t now = __atomic_sub_fetch(&S.usage->charge[dev][slot], bytes, __ATOMIC_SEQ_CST);
    if (__builtin_expect(now + bytes < bytes, 0)) {   /* it held less than `bytes` */
        now = __atomic_add_fetch(&S.usage->charge[dev][slot], bytes - (now + bytes), __ATOMIC_SEQ_CST);
        charge_found_rewritten(dev, slot);
    }
    __atomic_add_fetch(&S.usage->charge_seq[slot], 1, __ATOMIC_SEQ_CST);
    return now;
}

extern TLS int in_init;   /* recursion guard: hooks called during init pass through */

/* === log === */

void vgpu_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* the level is checked here: a message not shown costs a load, not a call */
#define VGPU_LOG_AT(level, ...) ((level) <= S.log_level ? vgpu_log(level, __VA_ARGS__) : (void)0)
#define ERR(...) VGPU_LOG_AT(0, __VA_ARGS__)
#define INFO(...) VGPU_LOG_AT(1, __VA_ARGS__)
#define DEBUG(...) VGPU_LOG_AT(2, __VA_ARGS__)
void deny(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* === shim.c === */

void init_slow(void);

/* A hook's driver entry point is looked up on the hook's first call, not at start-up: a
 * dlsym of each of the 84 hooked symbols cost 54k instructions (~20 us) in every process,
 * where a program calls a handful (issue 31).  NULL while the driver lacks it.  Of the
 * entry points the shim calls for itself, VGPU_CALLED are looked up at start-up and
 * VGPU_CALLED_ON_USE here.
 * Racing threads may both look one up; they store the same pointer. */
void *resolve_real(void **real, const char *symbol);   /* *real once found, or looked up */
#define REAL(sym) (LIKELY(real_##sym != NULL) ? real_##sym \
                                              : (__typeof__(real_##sym))resolve_real((void **)&real_##sym, #sym))
static inline void ensure_init(void)
{
    if (UNLIKELY(!LOAD(&S.ready)))
        init_slow();
}
void nvml_resolve(void);
/* The shim's own NVML reference, taken once and never given back (so the handles
 * nvml_handle keeps stay valid): 0 once NVML is up, -1 while it cannot start. */
int nvml_start(void);
/* CLOCK_MONOTONIC in ns; inline: it is on the paced launch's path (a vDSO call, no syscall) */
static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
int create_file_once(const char *path, const void *data, size_t len, mode_t mode);   /* 1: made it */
int claim_slot(void);         /* with S.lock held; 0, or -1 when every slot is taken */
int take_free_slot(void);     /* with S.lock held: a free slot, locked and drained; -1: none */
int slot_lock(int fd, int slot, short type);   /* the OFD lock of a usage slot (F_OFD_SETLK) */
void drain_slot(int i);       /* with slot i's lock held: its charges and pid to 0 */
void reap_dead(void);
void reap_dead_locked(void);  /* with S.lock held */
void reap_due(uint64_t now);  /* maybe_reap's reap: the next one REAP_INTERVAL_NS from now */
static inline void maybe_reap(void)   /* reap_dead at most every REAP_INTERVAL_NS */
{
    uint64_t t = now_ns();
    if (UNLIKELY(t >= LOAD(&S.next_reap_ns)))
        reap_due(t);
}

/* Start of every CUDA hook: init, a missing driver symbol is an error, unmanaged
 * programs (and calls made while initialising) go straight to the driver. */
/* (in_init is set only while S.ready is not: a call made during init finds ready unset, and
 * the init it starts returns at once in that thread; any other thread's init_slow returns
 * with ready set.  So in_init is asked only when ready was not set.) */
static inline int enter_slow(void)   /* init; 1: this thread is initialising (pass through) */
{
    init_slow();
    return in_init;
}
#define ENTER(sym, ...)                                                 \
    if (UNLIKELY(!LOAD(&S.ready)) && enter_slow())                      \
        return REAL(sym) ? real_##sym(__VA_ARGS__) : CUDA_ERROR_NOT_FOUND; \
    if (UNLIKELY(!REAL(sym)))                                           \
        return CUDA_ERROR_NOT_FOUND;                                    \
    if (UNLIKELY(S.mode == MODE_PASS))                                  \
        return real_##sym(__VA_ARGS__)

#define NVML_ENTER(sym, ...)                                     \
    ensure_init();                                               \
    if (UNLIKELY(!LOAD(&S.nvml_ready)))                          \
        nvml_resolve();                                          \
    if (UNLIKELY(!real_##sym))                                   \
        return NVML_ERROR_FUNCTION_NOT_FOUND;                    \
    if (S.mode == MODE_PASS || in_init)                          \
        return real_##sym(__VA_ARGS__)

/* === memory: memory.c, pools.c, vmm.c, shared_memory.c === */


#define KEY_PTR 0ull            /* allocation table key spaces (top bits): device pointers, */
#define KEY_ARRAY (2ull << 62)  /* array handles (VMM handles are tracked apart, with mappings), */
#define KEY_GRAPH (1ull << 62)  /* and what an executable graph's allocation nodes need on a device */

/* memory_cap of a device known to be 0..VGPU_MAX_DEVICES-1, as admissions have it */
static inline uint64_t device_cap(int dev)
{
    if (UNLIKELY(S.mode != MODE_ENFORCE) || UNLIKELY((uint32_t)dev >= S.quota->device_count))
        return 0;
    return LOAD(&S.quota->devices[dev].memory_max);
}

/* the cap of any device number (a resize shows up on the next call) */
static inline uint64_t memory_cap(int dev)
{
    return dev < 0 ? 0 : device_cap(dev);
}

/* memory.c */
int memory_map_table(void);           /* 0, or -1 when the allocation table cannot be mapped */
void memory_atfork_child(void);
int current_device(void);
int context_id(void);                 /* the context of the allocation being made (after current_device) */
int stream_device(CUstream stream);
uint64_t memory_used(int dev);        /* the container's bytes on dev: sum of its slots */
void note_peak(struct vgpu_usage_device *u, uint64_t now);
CUresult admit(int dev, uint64_t bytes);   /* reserve bytes on dev, within the cap */
void refund(int dev, uint64_t bytes);
/* the allocation table: remember (in the current context) and forget an entry, or read it */
int remember_in(uint64_t key, int dev, uint64_t bytes, int ctx);
int remember(uint64_t key, int dev, uint64_t bytes);
int forget_in(uint64_t key, int *dev, uint64_t *bytes, int *ctx);
int forget(uint64_t key, int *dev, uint64_t *bytes);
int recall(uint64_t key, uint64_t *bytes);
/* the container's view of device dev: 0 when it is the device as it is */
int slice(int dev, uint64_t dev_total, uint64_t dev_free, uint64_t *total, uint64_t *free, uint64_t *used);
extern HIDDEN pthread_mutex_t vmm_lock;
/* Where memory of a location lives: a device index (charged there), LOCATION_PASS (not
 * device memory, or invalid: the driver answers), LOCATION_REFUSED (a location type
 * newer than the shim: it might be device memory, so it is refused, fail closed). */
#define LOCATION_PASS (-1)
#define LOCATION_REFUSED (-3)
int location_device(const CUmemLocation *loc);
/* include/linux/proc_ns.h: PROC_PID_INIT_INO, the root pid namespace's inode (NVML's pids are its) */
#define ROOT_PID_NS_INODE 0xEFFFFFFCull
/* does NVML list memory under this process (of pid namespace pid_ns) on these devices, in a list
 * read at not_before or later? 1, 0, or -1: it cannot say (NVML's pids are the root namespace's) */
int driver_holds(int32_t pid, uint64_t pid_ns, uint32_t devices, uint64_t not_before);
int shared_kept_by_driver(int i);   /* with S.lock held */

/* pools.c */
void pools_settle(int trim);          /* charge each pool of the process its reserve */
CUresult after_release(CUresult r);   /* after a call that may release pool reserve: settle */
void graph_memory_settle(int dev);    /* charge the device's graph memory reserve (dev < 0: every one seen) */
void graph_memory_trim(void);         /* under the cap's pressure: unused graph reserve goes back */
/* before a graph launch: admit what its allocation nodes need beyond the free part of the
 * graph reserve (`taken`: what was charged ahead, per device); after it: graph_memory_launched */
CUresult graph_memory_admit(CUgraphExec exec, uint64_t taken[VGPU_MAX_DEVICES]);
void graph_memory_launched(const uint64_t taken[VGPU_MAX_DEVICES]);
extern HIDDEN size_t npools;
extern HIDDEN uint64_t graph_charged[VGPU_MAX_DEVICES], graph_pending[VGPU_MAX_DEVICES];
extern HIDDEN uint32_t graph_devices;
extern HIDDEN int graph_needs;

/* vmm.c */
/* VMM handles and pools, kept under a lock (not hot paths): see "where memory comes from".
 * refs: references the driver counts (cuMemCreate or an import, cuMemRetainAllocationHandle),
 * each ended by a cuMemRelease.  shared: the shared slot its memory is charged to (-1: none,
 * charged to this process); unpaid: imported from another slice, charged at its first map. */
struct vmm { uint64_t handle, bytes; int dev, mappings, refs, shared, unpaid; };
extern HIDDEN struct vmm *vmms;
extern HIDDEN size_t nvmm, vmm_cap, nmappings;
struct vmm *vmm_find(uint64_t handle, size_t *index);   /* with vmm_lock held */

/* shared_memory.c */
/* cuMemAlloc memory exported with cuIpcGetMemHandle, and IPC handles opened here (vmm_lock).
 * An import's slot is the shared slot it holds, or -1: charged to this process (bytes). */
struct shared_ptr { uint64_t ptr, bytes; int dev, slot, ctx, opens; };
extern HIDDEN struct shared_ptr *exports, *imports;
extern HIDDEN size_t nexports, nimports;
void shared_release(int s);           /* let go of one hold of shared slot s (-1: none) */
int export_freed(CUdeviceptr dptr, CUresult r);   /* after the driver's free of dptr */
void shared_atfork_child(void);
int memory_holds_slot(int i);         /* with S.lock held: does this process hold shared slot i? */

/* === view.c === */

int nvml_index(nvmlDevice_t device);  /* the CUDA device an NVML handle is; -1: none of them */
int nvml_handle(int dev, nvmlDevice_t *handle);   /* and back; 0 or -1 */
/* a device none of the slice's: the driver's compute list (of the caller's ABI: `real`,
 * records of `size` bytes) with only the slice's processes left */
nvmlReturn_t view_compute_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos, size_t size,
                                    nvmlReturn_t (*real)(nvmlDevice_t, unsigned int *, void *));

/* === compute.c === */

void compute_atfork_child(void);

/* === board.c === */

#define BOARD_PERIOD_NS 20000000ull   /* how often a slice recomputes its allowance */
int board_entry(int dev);          /* 1: the slice has an entry for dev (claimed on first use); 0: no board */
uint32_t board_update(int dev, uint32_t guarantee, uint32_t ceiling, uint64_t now,
                      const struct vgpu_usage_device *u);   /* u: the slice's usage of dev (what it used) */
void board_note_wait(int dev, uint64_t ns);   /* this process's launches waited for its queue */
uint64_t board_period(int dev);    /* when this process's current period on dev began (board_update) */

#endif
