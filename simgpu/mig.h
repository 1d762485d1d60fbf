/* simgpu MIG: GPU instances (GIs) and compute instances (CIs) of a simulated MIG-capable GPU.
 *
 * The MIG configuration of every GPU is part of the node file (node.h includes this
 * header for its layout), so every process on the node sees the same mode, instances
 * and UUIDs.  mig.c holds the profile tables and the rules (placements, IDs, capacity,
 * IN_USE); nvml_mig.c gives them NVML's API; the CUDA side sees a MIG device through the
 * process's device view (below), where each CI has its own memory pool (its GI's) and its
 * own timeline.
 */
#ifndef SIMGPU_MIG_H
#define SIMGPU_MIG_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#ifndef SIMGPU_MAX_DEVICES
#error "include simgpu/node.h, which includes this header"
#endif

#define SIMGPU_MIG_MEM_SLICES 8        /* memory slices of every supported GPU */
#define SIMGPU_MIG_COMPUTE_SLICES 7    /* compute slices */
#define SIMGPU_MIG_MAX_GI 15           /* GI IDs 0..14: one per aligned block of memory slices */
#define SIMGPU_MIG_MAX_CI 8            /* CI IDs 0..7 within a GI */
#define SIMGPU_MIG_MAX_DEVICES 7       /* MIG devices (CIs) a GPU can hold: nvmlDeviceGetMaxMigDeviceCount */

/* === layout in the node file === */

struct simgpu_mig_ci {
    uint32_t live;
    uint32_t profile_id;        /* compute instance profile ID */
    uint32_t start, size;       /* compute slices within the GI */
    uint32_t generation;        /* stamp of its creation: handles to a destroyed CI fail */
    uint32_t reserved;
    unsigned char uuid[16];     /* "MIG-<uuid>" */
    uint64_t free_at_ns;        /* its own serial timeline (end of the last queued kernel) */
    uint64_t launches;
};

struct simgpu_mig_gi {
    uint32_t live;
    uint32_t profile_id;        /* GPU instance profile ID (19, 15, 14, 9, 5, 0, 20) */
    uint32_t start, size;       /* memory slices */
    uint32_t generation;
    uint32_t reserved;
    struct simgpu_mig_ci ci[SIMGPU_MIG_MAX_CI];   /* indexed by CI ID */
};

struct simgpu_mig_gpu {
    pthread_mutex_t lock;       /* robust, process-shared: configuration, GI memory, CI timelines */
    _Atomic uint32_t current_mode, pending_mode;  /* NVML_DEVICE_MIG_DISABLE / _ENABLE */
    uint32_t generation;        /* last stamp given out */
    uint32_t reserved;
    struct simgpu_mig_gi gi[SIMGPU_MIG_MAX_GI];   /* indexed by GI ID */
};

/* Part of every process slot (struct simgpu_proc), cleared with it. */
struct simgpu_mig_proc {
    _Atomic uint64_t gi_mem[SIMGPU_MAX_DEVICES][SIMGPU_MIG_MAX_GI];      /* bytes held in a GI (also in mem[]) */
    _Atomic uint32_t ci_contexts[SIMGPU_MAX_DEVICES][SIMGPU_MIG_MAX_GI]; /* bit c: has a context on CI c */
};

void simgpu_mig_init(struct simgpu_mig_gpu *gpus, int n);   /* a fresh node */
void simgpu_mig_clear_proc(struct simgpu_mig_proc *p);      /* a slot freed or reclaimed */

/* === profiles === */

struct simgpu_mig_gi_profile {
    unsigned index;             /* NVML_GPU_INSTANCE_PROFILE_* */
    unsigned id;                /* profile ID */
    const char *name;           /* "1g.5gb" */
    unsigned slices;            /* compute slices (sliceCount) */
    unsigned mem_slices;        /* memory slices of each placement */
    unsigned starts;            /* bit s: a placement starts at memory slice s */
    unsigned instances, sms, copy_engines, decoders, encoders, jpegs, ofas;
    uint64_t memory_mib;
};

struct simgpu_mig_ci_profile {
    unsigned id;                /* == NVML_COMPUTE_INSTANCE_PROFILE_* index */
    unsigned slices, instances, sms;
    unsigned starts;            /* bit s: a placement starts at compute slice s of the GI */
    char name[40];              /* "1c.3g.20gb", or the GI's name when it takes the whole GI */
};

/* The simulated model's MIG support: 0 for a GPU without MIG (the A10). */
int simgpu_mig_supported(void);
const struct simgpu_mig_gi_profile *simgpu_mig_gi_by_index(unsigned index);   /* NULL: unsupported */
const struct simgpu_mig_gi_profile *simgpu_mig_gi_by_id(unsigned id);
/* CI profile `index` of a GI of profile `gi`: 0, or -1 when the GI has no such profile. */
int simgpu_mig_ci_profile(const struct simgpu_mig_gi_profile *gi, unsigned index,
                          struct simgpu_mig_ci_profile *out);
/* The GI ID a placement gets (a function of the placement, as on the real driver). */
unsigned simgpu_mig_gi_id(unsigned start, unsigned size);

/* === configuration (NVML return codes, nvml_abi.h) === */

int simgpu_mig_mode(int dev, unsigned *current, unsigned *pending);     /* 0, or -1: no MIG */
int simgpu_mig_enabled(int dev);                                        /* current mode */
/* Returns the NVML result of the call; *activation that of the mode change (IN_USE: busy). */
int simgpu_mig_set_mode(int dev, unsigned mode, int *activation);
/* start < 0: the driver picks the placement. */
int simgpu_mig_gi_create(int dev, unsigned profile_id, int start, int size, unsigned *gi);
int simgpu_mig_gi_destroy(int dev, unsigned gi, uint32_t generation);
int simgpu_mig_gi_remaining(int dev, unsigned profile_id, unsigned *count);
int simgpu_mig_ci_create(int dev, unsigned gi, uint32_t gi_generation, unsigned profile_id, int start,
                         int size, unsigned *ci);
int simgpu_mig_ci_destroy(int dev, unsigned gi, unsigned ci, uint32_t generation);
int simgpu_mig_ci_remaining(int dev, unsigned gi, uint32_t gi_generation, unsigned profile_id,
                            unsigned *count);
/* A consistent copy of device `dev`'s instances (taken under its lock). */
void simgpu_mig_snapshot(int dev, struct simgpu_mig_gi out[SIMGPU_MIG_MAX_GI]);
/* Bytes held in GI `gi` by live processes (all, or the one in `slot` when slot >= 0). */
uint64_t simgpu_mig_gi_used(int dev, unsigned gi, int slot);
/* MIG device names: "<model> MIG 3g.20gb" (NVML's and CUDA's device name). */
void simgpu_mig_device_name(const struct simgpu_mig_gi *gi, const struct simgpu_mig_ci *ci, char *out,
                            unsigned len);
void simgpu_mig_format_uuid(const unsigned char uuid[16], char out[41]);   /* "MIG-…" */
/* "MIG-GPU-<uuid>/<GI>/<CI>" (before R470): 0 with the live CI it names, else -1. */
int simgpu_mig_parse_legacy(const char *s, int *dev, unsigned *gi, unsigned *ci);

/* === the process's device view (libcuda) ===
 * CUDA ordinals are built once, at cuInit, from CUDA_VISIBLE_DEVICES: GPU indices, GPU-
 * and MIG- UUIDs (or their prefixes), in the order given, up to the first entry that names
 * nothing.  A GPU in MIG mode stands for its MIG devices, one CI per GI (the R570+ rule);
 * unset means every GPU.  At most SIMGPU_MAX_DEVICES ordinals.  Without simgpu_view_init
 * (libnvidia-ml) the view is the node's devices in order.  The calls below take an ordinal
 * and reach the GPU, or the CI's GI memory pool and the CI's own timeline. */
int simgpu_view_init(void);          /* 0, or -1 when no device is visible */
int simgpu_view_count(void);
int simgpu_view_gpu(int dev);        /* the physical GPU behind an ordinal */
uint64_t simgpu_view_memory(int dev);
int simgpu_view_sm_count(int dev);
void simgpu_view_name(int dev, char *out, unsigned len);
void simgpu_view_uuid(int dev, unsigned char out[16]);
int simgpu_view_mem_reserve(int dev, uint64_t bytes);
void simgpu_view_mem_release(int dev, uint64_t bytes);
uint64_t simgpu_view_mem_used(int dev);
uint64_t simgpu_view_enqueue(int dev, uint64_t dur_ns);
void simgpu_view_note_context(int dev);
void simgpu_view_forget_context(int dev);

#endif
