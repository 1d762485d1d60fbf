/* vgpu_region.h — the files the controller and the shim share: the single source of
 * truth for their layout.
 *
 *   <dir>/<container>/quota  written by the controller, mapped read-only by the shim
 *   <dir>/<container>/usage  written by the shim processes of the container, read by the
 *                            controller
 *
 * Both are fixed-layout, little-endian, naturally aligned, and start with a magic and an
 * ABI version; a reader refuses a file whose magic or version it does not know.  Fields
 * that change while mapped are read and written with __atomic builtins (the cffi
 * binding cannot express _Atomic, so the types here are plain integers).
 *
 * The region between the cffi markers is read by src/vgpu/_region_build.py to generate
 * the Python binding; keep it to what cffi's cdef understands (no macros with arguments,
 * no expressions in #defines).
 */
#ifndef VGPU_REGION_H
#define VGPU_REGION_H

#include <stdint.h>

/* cffi:begin */
#define VGPU_QUOTA_MAGIC 0x41544f5155504756
#define VGPU_USAGE_MAGIC 0x4547415355504756
#define VGPU_ABI_VERSION 2
#define VGPU_MAX_DEVICES 16
#define VGPU_MAX_PROCS 64
#define VGPU_NAME_MAX 64

/* memory_max == VGPU_UNLIMITED: no cap on that device */
#define VGPU_UNLIMITED 0xffffffffffffffff

/* struct vgpu_quota.flags */
#define VGPU_QUOTA_TEMPORARY 1      /* made for one command (`vgpu-ctl run`) or one standalone program:
                                       owner_* say whose */
#define VGPU_QUOTA_SM_CEILING 2     /* --sm-mode ceiling: sm.max always, idle time is never lent to it;
                                       without it (burst) the share is sm.request .. sm.max (board) */
#define VGPU_QUOTA_STANDALONE 4     /* with TEMPORARY: made by the shim from the limit variables (no
                                       controller); its last process to exit removes it (shim/shim.c) */
#define VGPU_QUOTA_MADE_DIR 8       /* STANDALONE: the node directory was made for it ... */
#define VGPU_QUOTA_MADE_BOARD 16    /* ... and the share board was not there yet: both go with the node's
                                       last slice, as `vgpu-ctl run` leaves the node as it found it */
/* struct vgpu_usage_proc.flags */
#define VGPU_PROC_FROM_FILE 1       /* its slice came from the slice identity file, not the environment */
#define VGPU_PROC_SHARED 2          /* not a process: device memory shared between processes (an IPC or
                                       shareable-handle export), charged here while any process holding it
                                       lives (each holds the slot's lock shared); pid 0, state the
                                       exporter's pid, start_ticks the export's key (a hash of its handle) */

struct vgpu_quota_device {
    uint64_t memory_max;        /* bytes the container may hold on the device */
    uint64_t memory_request;    /* guaranteed bytes (autoscale floor) */
    uint64_t memory_limit;      /* autoscale ceiling */
    uint32_t sm_max;            /* share of SM time, in 1/100 percent (10000 = 100%) */
    uint32_t sm_request;
    uint32_t sm_limit;
    uint32_t reserved0;
    uint64_t context_overhead;  /* bytes a context costs on the device, as vgpu-ctl measure-context found
                                   it (written by it, and by create after it): charged at a process's
                                   first allocation there without asking NVML; 0 = not known (the shim
                                   asks NVML, in the host's pid namespace only) */
    uint64_t reserved[3];
};

struct vgpu_quota {
    uint64_t magic;
    uint32_t abi_version;
    uint32_t size;              /* sizeof(struct vgpu_quota) as written */
    uint64_t generation;        /* bumped after every change: the shim re-reads on change */
    uint32_t device_count;      /* entries of devices[] in use */
    uint32_t flags;             /* VGPU_QUOTA_* */
    char name[VGPU_NAME_MAX];
    struct vgpu_quota_device devices[VGPU_MAX_DEVICES];
    /* TEMPORARY: the process that made the slice and removes it when its command ends (a
     * standalone one: the last of its processes does); the node agent removes it once that
     * process and the slice's own are gone */
    uint64_t owner_pid;         /* as the node's pid namespace owner_pid_ns sees it */
    uint64_t owner_start;       /* a time it was running at, as a slot's start_ticks (its start time,
                                   /proc/<pid>/stat field 22, or later) */
    uint64_t owner_pid_ns;      /* inode of that pid namespace (/proc/<pid>/ns/pid) */
    uint64_t reserved[29];
};

struct vgpu_usage_device {
    uint64_t memory_peak;       /* highest memory.current an admission saw */
    uint64_t oom_refusals;      /* allocations refused by the cap */
    uint64_t launches;          /* launches paced against sm.max (none at 100%) */
    uint64_t gpu_time_ns;       /* GPU time charged for them (corrected estimates) */
    uint64_t throttled_ns;      /* time launches waited for their share */
    /* compute share: a token bucket kept as one virtual clock (GCRA): each launch moves
     * it cost / sm.max ahead; a launch waits until it is at most the burst ahead of now */
    uint64_t sm_vtime_ns;       /* CLOCK_MONOTONIC */
    uint64_t sm_correction;     /* scale on estimated cost, 16.16 fixed point (0 = 1.0) */
    uint64_t sm_check_ns;       /* when the correction was last computed (CLOCK_MONOTONIC) */
    uint64_t sm_measured_sum;   /* correction: NVML-measured GPU time, a sum decaying per check */
    uint64_t sm_check_raw_ns;   /* sm_raw_ns at the last check */
    uint64_t yielded_ns;        /* time launches waited below sm.max, for neighbours' guarantees
                                   (burst mode; throttled_ns is the wait at sm.max itself) */
    uint64_t sm_raw_ns;         /* paced launches' estimated GPU time before correction, unbatched */
    uint64_t sm_raw_sum;        /* correction: sm_raw_ns over the same checks, decaying alike */
    uint64_t reserved[3];
};

/* Who a slot's process is, as it said when it claimed the slot.  The node agent uses
 * these to find the process (pid_ns + pid + start_ticks name one process, whatever pid
 * namespace the reader is in: the process at that pid that started no later than
 * start_ticks, vgpu/procfs.py started_by) and checks them against the kernel before it
 * relies on them: like everything in the usage file, they are written by the container. */
struct vgpu_usage_proc {
    int32_t pid;                /* as the process sees itself; 0 = free slot */
    uint32_t state;             /* a process's slot: its pid as NVML lists it (the root pid namespace's),
                                   written by the node agent, which sees both; 0 = unknown.  A hint,
                                   used only to keep a dead process's slot charged while the driver
                                   lists memory under that pid, and to find the container's processes
                                   in NVML's utilization (compute.c).  A shared slot: see VGPU_PROC_SHARED */
    uint64_t started_ns;
    char comm[32];
    uint64_t start_ticks;       /* a time it was running at, in the clock ticks after boot of its start
                                   time (/proc/self/stat field 22): the shim writes its claim's
                                   CLOCK_BOOTTIME; 0 = unknown */
    uint64_t pid_ns;            /* inode of its pid namespace (/proc/self/ns/pid); 0 = unknown */
    uint64_t cgroup_id;         /* 0: unused since issue 31 (the node agent reads /proc/<pid>/cgroup itself) */
    uint64_t flags;             /* VGPU_PROC_* */
};

/* Memory is counted in one place only: charge[d][p], the bytes the process in slot p
 * holds on device d, written by that process alone (and, once it is dead, by whoever
 * reaps it).  memory.current of device d is the sum of charge[d][*]; there is no
 * second counter that a kill between two updates could leave out of step.  An
 * allocation adds to its own charge first and then sums the row: of two processes
 * racing for the last bytes at least one sees the other, so the cap holds without a
 * lock (see shim/memory.c). */
struct vgpu_usage {
    uint64_t magic;
    uint32_t abi_version;
    uint32_t size;
    uint32_t slots_used;        /* a bound on the sum, 0..VGPU_MAX_PROCS: every slot at or above it is
                                   uncharged.  A claim widens it (compare-and-swap) before its first
                                   charge; a shim that holds the top slot's lock with its process
                                   gone lowers it past that slot (shim/shim.c: shrink_slots_used) */
    uint32_t flags;
    struct vgpu_usage_device devices[VGPU_MAX_DEVICES];
    uint64_t charge[VGPU_MAX_DEVICES][VGPU_MAX_PROCS];
    struct vgpu_usage_proc procs[VGPU_MAX_PROCS];
    /* charge_seq[p] moves on after every change of slot p's charges (wrapping): the node
     * agent reads it before and after its look at the driver, so that an unchanged
     * sequence and charge say the charge held still while the driver was read */
    uint32_t charge_seq[VGPU_MAX_PROCS];
};
/* The share board: <dir>/.sm-board, one per node, read and written with pread/pwrite by
 * every slice's shim, never mapped: it is mounted read-write into every container beside
 * its slice's files, and a mapping of a file a tenant truncates faults on its next touch.
 * Per device (a GPU or a MIG device, by UUID) one entry per slice that paces launches there, written by
 * that slice's processes alone: what it is guaranteed, what it wants, what it was
 * allowed, and how far its launches are paid for.  From the live entries each slice
 * computes its own allowance (guarantee + its part of what the others leave idle, up to
 * its ceiling); an entry not refreshed for VGPU_BOARD_STALE_NS, or whose paid-for time
 * has run out, is idle.  A tenant can write any entry: the worst it can do is keep others
 * from bursting, never take a guarantee (each shim's floor is its own quota's request). */
#define VGPU_BOARD_MAGIC 0x4452414f424d5356
#define VGPU_BOARD_DEVICES 64
#define VGPU_BOARD_SLICES 64
#define VGPU_BOARD_STALE_NS 500000000

struct vgpu_board_slice {
    uint64_t key;               /* hash of the slice's name; 0 = free */
    uint32_t guarantee;         /* sm.request (ceiling mode: sm.max), 1/100 percent */
    uint32_t ceiling;           /* sm.max */
    uint32_t demand;            /* what it wanted over its last period (= ceiling: held back) */
    uint32_t allowance;         /* the share it paces at now */
    uint64_t paid_until_ns;     /* its virtual clock (CLOCK_MONOTONIC): launches paid up to here */
    uint64_t waited_ns;         /* time its launches waited, a running total (slow paths only) */
    uint64_t period_used_ns;    /* what its launches had cost in all (usage file, corrected) then */
    uint64_t period_ns;         /* when its allowance was last computed (CLOCK_MONOTONIC) */
    uint64_t period_waited_ns;  /* waited_ns then */
    uint64_t woke_ns;           /* when it last woke from idle (it asks for its guarantee a while) */
    uint64_t reserved[4];
};

struct vgpu_board_device {
    uint8_t uuid[16];           /* cuDeviceGetUuid: the GPU's, or the MIG device's; 0s = free */
    uint64_t claimed;           /* 1 once uuid is written */
    uint64_t reserved[5];
    struct vgpu_board_slice slices[VGPU_BOARD_SLICES];
};

struct vgpu_board {
    uint64_t magic;
    uint32_t abi_version;
    uint32_t size;
    uint64_t reserved[7];
    struct vgpu_board_device devices[VGPU_BOARD_DEVICES];
};
/* cffi:end */

#endif
