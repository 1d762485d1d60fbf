/* simgpu node state: the part of a simulated GPU node that all processes share.
 *
 * One file, <state dir>/node, mapped MAP_SHARED by every process that uses simgpu
 * (both libcuda.so.1 and libnvidia-ml.so.1 link this code).  It holds:
 *   - the profile (model, memory, SMs) and device count, fixed when the file is created;
 *   - a table of process slots: who holds how much memory on each device.  A slot is
 *     owned through an OFD lock on one byte of the file, which the kernel drops when the
 *     process dies, so a kill -9'ed process's memory returns without trusting PIDs;
 *   - per device, one serial timeline (when the device is next free) and a ring of the
 *     kernel intervals it ran, from which NVML derives utilization.
 */
#ifndef SIMGPU_NODE_H
#define SIMGPU_NODE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define SIMGPU_MAGIC 0x5547504d49534756ull   /* "VGSIMPGU" */
#define SIMGPU_VERSION 7u                    /* 2: MIG state (mig.h); 3: shared memory; 6: cgroup limits;
                                                7: health (XID events, lost GPUs) */
#define SIMGPU_MAX_DEVICES 8
#define SIMGPU_MAX_PROCS 256
#define SIMGPU_RING_SIZE (1u << 20)          /* kernel intervals kept per device */
#define SIMGPU_DEFAULT_KERNEL_US 5           /* kernels not named sim_<N>us */
#define SIMGPU_QUEUE_DEPTH 1024              /* launches pending per stream before blocking */
#define SIMGPU_MAX_SHARED 256                /* memory objects more than one process can hold */
#define SIMGPU_MAX_LIMITS 32                 /* per-cgroup memory limits per device (limits.c) */
#define SIMGPU_CGROUP_PATH 160               /* a cgroup's sysfs path, NUL included */
#define SIMGPU_XID_RING 64                   /* XID events kept for NVML's event sets */

#include "simgpu/mig.h"                    /* MIG instances, kept in the node too */

/* A simulated board.  node.c says where each figure comes from. */
struct simgpu_profile {
    const char *id;          /* what SIMGPU_PROFILE names */
    const char *model;       /* what cuDeviceGetName / nvmlDeviceGetName report */
    uint64_t memory;         /* bytes */
    int sm_count;
    int cc_major, cc_minor;
    int clock_khz, mem_clock_khz, bus_width, l2_bytes;   /* max SM clock, max memory clock */
    uint64_t context_overhead;   /* device memory of a process's first context (node.c) */
    /* per SM, by compute capability */
    int smem_per_sm, smem_per_block_optin, threads_per_sm, blocks_per_sm;
    int copy_engines;        /* CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT */
    int fp32_per_fp64;       /* CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO */
    int cores_per_sm;        /* FP32 lanes: nvmlDeviceGetNumGpuCores */
    /* the board, for NVML */
    unsigned pci_device, pci_subsystem;   /* 16-bit device id, 16-bit subsystem id (vendor 0x10DE) */
    int pcie_gen, pcie_width;
    int power_limit_w, power_min_w, power_idle_w;
    int base_clock_mhz, video_clock_mhz;
    int bar1_mib;
    int encoders, decoders;  /* NVENC, NVDEC engines */
    int temp_shutdown, temp_slowdown, temp_gpu_max, temp_mem_max;   /* degrees C */
    int architecture;        /* NVML_DEVICE_ARCH_* (7 Ampere, 9 Hopper) */
    int mig_capable;
};

struct simgpu_proc {
    _Atomic int32_t pid;                       /* 0: free */
    _Atomic uint32_t context_devices;          /* bit d: has a context on device d */
    _Atomic uint64_t mem[SIMGPU_MAX_DEVICES];  /* bytes held on each device */
    char comm[32];
    char cgroup[SIMGPU_CGROUP_PATH];           /* its cgroup v2 directory when it took the slot ("": none) */
    struct simgpu_mig_proc mig;                /* what it holds in MIG instances */
};

/* Device memory more than one process can hold: an allocation exported with
 * cuIpcGetMemHandle, or a cuMemCreate handle made shareable (a POSIX file descriptor).  Its
 * bytes are counted here, not in a process slot, for as long as anything holds it, and
 * NVML charges them to owner_pid, the process that allocated it (node.c says why).  Holders
 * own it through OFD read locks on byte SHARED_LOCK_BASE + index of the node file: the
 * allocating process while it holds its allocation, each importer while it has it open or
 * mapped (the kernel drops a dead holder's).  An exported file descriptor holds it through
 * a read lock on the backing file itself, <state dir>/shm-<index>-<id>, wherever that
 * descriptor went.  Whoever finds no holder left frees it. */
struct simgpu_shared {
    _Atomic uint64_t id;                       /* 0: free; unique, names the backing file */
    _Atomic uint64_t bytes;                    /* device memory it holds */
    uint64_t size;                             /* what a mapping of it covers */
    int32_t dev;                               /* the node's GPU */
    int32_t owner_pid;                         /* as NVML reports the process that allocated it */
    int32_t owner_slot;                        /* that process's slot when it made it */
    uint32_t kind;                             /* SIMGPU_SHARED_* */
    char comm[32];
};
#define SIMGPU_SHARED_IPC 1                    /* cuMemAlloc memory exported with cuIpcGetMemHandle */
#define SIMGPU_SHARED_VMM 2                    /* a cuMemCreate handle with a POSIX fd handle type */

struct simgpu_interval {
    uint64_t start_ns, end_ns;                 /* CLOCK_MONOTONIC */
    int32_t pid;
    int32_t slot;
};

struct simgpu_device {
    pthread_mutex_t lock;                      /* robust, process-shared */
    uint64_t free_at_ns;                       /* end of the last queued kernel */
    _Atomic uint64_t ring_head;                /* intervals ever appended */
    unsigned char uuid[16];
    uint64_t launches;
};

/* A memory limit on a device for the processes of one cgroup and its descendants
 * (nvmlDeviceSetMemoryLimits_v1; limits.c).  Kept with the directory's identity, so a
 * cgroup removed (and made again under the same name) has none. */
struct simgpu_mem_limit {
    char path[SIMGPU_CGROUP_PATH];             /* "": free */
    uint64_t st_dev, st_ino;
    uint64_t soft, hard;
    uint64_t checked_ns;                       /* when the directory was last seen (limits.c) */
};

/* What befell the node's GPUs: XID errors as the driver reports them to NVML's event sets
 * (nvml.c), and GPUs that fell off the bus.  Raised by tests (simgpuRaiseXid,
 * simgpuLoseGpu), never by simgpu itself. */
struct simgpu_xid {
    _Atomic uint64_t seq;                      /* its number + 1 once written (0: not yet) */
    int32_t gpu;
    uint32_t xid;
};
struct simgpu_health {
    _Atomic uint64_t raised;                   /* XID events ever raised on the node */
    struct simgpu_xid ring[SIMGPU_XID_RING];   /* event n at ring[n % SIMGPU_XID_RING] */
    _Atomic uint32_t lost;                     /* bit g: GPU g has fallen off the bus */
    _Atomic uint32_t changes;                  /* moved on by every XID and loss: a futex event sets wait on */
};

struct simgpu_node {
    uint64_t magic;
    uint32_t version;
    uint32_t device_count;
    char profile_id[32];
    struct simgpu_proc procs[SIMGPU_MAX_PROCS];
    struct simgpu_device devices[SIMGPU_MAX_DEVICES];
    struct simgpu_mig_gpu mig[SIMGPU_MAX_DEVICES];
    struct simgpu_shared shared[SIMGPU_MAX_SHARED];
    struct simgpu_mem_limit limits[SIMGPU_MAX_DEVICES][SIMGPU_MAX_LIMITS];   /* under the device's lock */
    _Atomic uint32_t limits_set[SIMGPU_MAX_DEVICES];   /* how many: 0 keeps the allocation path free of them */
    struct simgpu_health health;
    /* followed, page aligned, by SIMGPU_MAX_DEVICES rings of SIMGPU_RING_SIZE intervals */
};

/* Attach to the node named by SIMGPU_STATE_DIR / SIMGPU_PROFILE / SIMGPU_DEVICES.
 * Thread-safe, idempotent.  Returns 0, or -1 with simgpu_error() saying why. */
int simgpu_attach(void);
const char *simgpu_error(void);
struct simgpu_node *simgpu_node(void);
const struct simgpu_profile *simgpu_profile(void);
struct simgpu_interval *simgpu_ring(int dev);

/* Health: is GPU g lost; event n (0-based) if it is still in the ring: 0, else -1. */
int simgpu_gpu_lost(int gpu);
int simgpu_xid_event(uint64_t n, int *gpu, unsigned *xid);
/* Sleep until the node's health changes from `seen` (simgpu_health.changes), at most ns. */
void simgpu_health_wait(uint32_t seen, uint64_t ns);

/* This process's slot, claimed on first call (-1 if the table is full). */
int simgpu_my_slot(void);
/* Record that this process has a context on `dev` (NVML lists it from then on), or, after
 * its last one there is destroyed, no longer has one (NVML lists it while it holds memory). */
void simgpu_note_context(int dev);
void simgpu_forget_context(int dev);
/* Return dead processes' slots (and their memory) to the pool. */
void simgpu_reap_dead(void);
/* Is the process in `slot` alive (its lock is held by someone else)? */
int simgpu_slot_alive(int slot);

/* Shared memory (struct simgpu_shared).  new: an object of `bytes` on node GPU `gpu`,
 * held by this process, its bytes moved out of this process's slot (which holds them
 * already); returns its index (id filled), or -1 when the table is full.  hold: hold
 * object `index` again (an importer), 0, or -1 when it is no longer there.  drop: let go of
 * one hold; the last hold of the last holder frees it.  path: its backing file. */
int simgpu_shared_new(int gpu, uint64_t bytes, uint64_t size, unsigned kind, uint64_t *id);
int simgpu_shared_hold(int index, uint64_t id);
void simgpu_shared_drop(int index);
void simgpu_shared_path(int index, uint64_t id, char *out, size_t len);
/* Memory: reserve is check-and-add against the device's capacity across all processes. */
int simgpu_mem_reserve(int dev, uint64_t bytes);   /* 0 ok, -1 out of memory / no slot */
void simgpu_mem_release(int dev, uint64_t bytes);
uint64_t simgpu_mem_used(int dev);                  /* all live processes */

/* Per-cgroup memory limits (limits.c), as nvml.h documents nvmlDeviceSetMemoryLimits_v1.
 * The device's lock is held around each.  set: 0, or an nvmlReturn_t value; get: the
 * limit of exactly `path` (-1: none); fits: may this process add `bytes` on `dev` under
 * every limit of its cgroup and its ancestors; room: what it may still add (UINT64_MAX:
 * no limit).  SIMGPU_MEMORY_LIMITS=0 models a driver without the API (NOT_SUPPORTED). */
int simgpu_limits_supported(void);
int simgpu_limit_set(int dev, const char *path, uint64_t soft, uint64_t hard);
int simgpu_limit_get(int dev, const char *path, uint64_t *soft, uint64_t *hard, uint64_t *used);
int simgpu_limit_fits(int dev, uint64_t bytes);
uint64_t simgpu_limit_room(int dev);
void simgpu_cgroup_of_self(char *out, size_t len);  /* the caller's cgroup v2 directory, "" if none */
void simgpu_dev_lock(int dev);
void simgpu_dev_unlock(int dev);

/* Timeline: queue `dur_ns` of work on the device; returns when it will end. */
uint64_t simgpu_enqueue(int dev, uint64_t dur_ns);
/* Device busy time in [from, to), for one pid (pid > 0) or all (pid == 0). */
uint64_t simgpu_busy_ns(int dev, int32_t pid, uint64_t from_ns, uint64_t to_ns);

uint64_t simgpu_now_ns(void);
void simgpu_sleep_until(uint64_t t_ns);
void simgpu_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#define SIMGPU_EXPORT __attribute__((visibility("default")))

#endif
