/* simgpu's libnvidia-ml.so.1: the Multi Instance GPU Management API (nvml.h's
 * nvmlMultiInstanceGPU group) over the node's MIG state (mig.c).
 *
 * Handles are process-local objects (one per GPU instance, compute instance and MIG device
 * slot), each stamped with the generation of what it names: after a destroy, the old
 * handle is INVALID_ARGUMENT, as nvml.h says handles "become invalid".  Return codes are
 * those nvml.h documents for each call; where it lists two for one case, the choice is
 * noted.  Parent device handles are nvml.c's, reached through its exported calls.
 */
#define _GNU_SOURCE
#include "simgpu/nvml_mig.h"
#include "simgpu/node.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#define MiB (1ull << 20)
#define GI_MAGIC 0x49474d4eu   /* "NMGI" */
#define CI_MAGIC 0x49434d4eu
#define MD_MAGIC 0x444d4d4eu

struct nvmlGpuInstance_st {
    unsigned int magic, dev, id;
    uint32_t generation;
};

struct nvmlComputeInstance_st {
    unsigned int magic, dev, gi, id;
    uint32_t generation;
};

struct mig_device {   /* what a MIG device handle (an nvmlDevice_t) points at */
    unsigned int magic, dev, gi, ci;
    uint32_t generation;
};

static struct nvmlGpuInstance_st gi_handles[SIMGPU_MAX_DEVICES][SIMGPU_MIG_MAX_GI];
static struct nvmlComputeInstance_st ci_handles[SIMGPU_MAX_DEVICES][SIMGPU_MIG_MAX_GI][SIMGPU_MIG_MAX_CI];
static struct mig_device mig_devices[SIMGPU_MAX_DEVICES][SIMGPU_MIG_MAX_GI][SIMGPU_MIG_MAX_CI];

#define IN_ARRAY(p, arr, type) \
    ((uintptr_t)(p) >= (uintptr_t)(arr) && (uintptr_t)(p) < (uintptr_t)(arr) + sizeof(arr) && \
     ((uintptr_t)(p) - (uintptr_t)(arr)) % sizeof(type) == 0)

/* nvml.c's exports this file uses for the GPUs' own handles */
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount);
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index);
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device);

/* === handles === */

static nvmlReturn_t initialized(void)
{
    unsigned int n;
    return nvmlDeviceGetCount_v2(&n) == NVML_SUCCESS ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

int simgpu_nvml_is_mig(nvmlDevice_t device)
{
    return IN_ARRAY(device, mig_devices, struct mig_device) &&
           ((const struct mig_device *)(const void *)device)->magic == MD_MAGIC;
}

/* A GPU's own handle (not a MIG device's): its index. */
static nvmlReturn_t parent(nvmlDevice_t device, int *dev)
{
    nvmlReturn_t r = initialized();
    if (r)
        return r;
    if (simgpu_nvml_is_mig(device))
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int index;
    r = nvmlDeviceGetIndex(device, &index);
    *dev = (int)index;
    return r;
}

static nvmlDevice_t parent_handle(int dev)
{
    nvmlDevice_t h = NULL;
    nvmlDeviceGetHandleByIndex_v2((unsigned int)dev, &h);
    return h;
}

static nvmlGpuInstance_t gi_handle(int dev, unsigned g, uint32_t generation)
{
    struct nvmlGpuInstance_st *h = &gi_handles[dev][g];
    *h = (struct nvmlGpuInstance_st){GI_MAGIC, (unsigned)dev, g, generation};
    return h;
}

static nvmlComputeInstance_t ci_handle(int dev, unsigned g, unsigned c, uint32_t generation)
{
    struct nvmlComputeInstance_st *h = &ci_handles[dev][g][c];
    *h = (struct nvmlComputeInstance_st){CI_MAGIC, (unsigned)dev, g, c, generation};
    return h;
}

static nvmlDevice_t mig_handle(int dev, unsigned g, unsigned c, uint32_t generation)
{
    struct mig_device *h = &mig_devices[dev][g][c];
    *h = (struct mig_device){MD_MAGIC, (unsigned)dev, g, c, generation};
    return (nvmlDevice_t)(void *)h;
}

/* The live GPU instance a handle names, copied with its GPU's instances into `gis`. */
static nvmlReturn_t gi_of(nvmlGpuInstance_t h, struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI], int *dev,
                          unsigned *g)
{
    nvmlReturn_t r = initialized();
    if (r)
        return r;
    if (!IN_ARRAY(h, gi_handles, struct nvmlGpuInstance_st) || h->magic != GI_MAGIC ||
        h->dev >= simgpu_node()->device_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    simgpu_mig_snapshot((int)h->dev, gis);
    if (!gis[h->id].live || gis[h->id].generation != h->generation)
        return NVML_ERROR_INVALID_ARGUMENT;   /* destroyed */
    *dev = (int)h->dev;
    *g = h->id;
    return NVML_SUCCESS;
}

static nvmlReturn_t ci_of(nvmlComputeInstance_t h, struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI], int *dev,
                          unsigned *g, unsigned *c)
{
    nvmlReturn_t r = initialized();
    if (r)
        return r;
    if (!IN_ARRAY(h, ci_handles, struct nvmlComputeInstance_st) || h->magic != CI_MAGIC ||
        h->dev >= simgpu_node()->device_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    simgpu_mig_snapshot((int)h->dev, gis);
    const struct simgpu_mig_ci *ci = &gis[h->gi].ci[h->id];
    if (!gis[h->gi].live || !ci->live || ci->generation != h->generation)
        return NVML_ERROR_INVALID_ARGUMENT;
    *dev = (int)h->dev;
    *g = h->gi;
    *c = h->id;
    return NVML_SUCCESS;
}

static nvmlReturn_t mig_of(nvmlDevice_t device, struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI],
                           const struct mig_device **out)
{
    nvmlReturn_t r = initialized();
    if (r)
        return r;
    if (!simgpu_nvml_is_mig(device))
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct mig_device *m = (const struct mig_device *)(const void *)device;
    if (m->dev >= simgpu_node()->device_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    simgpu_mig_snapshot((int)m->dev, gis);
    const struct simgpu_mig_ci *ci = &gis[m->gi].ci[m->ci];
    if (!gis[m->gi].live || !ci->live || ci->generation != m->generation)
        return NVML_ERROR_INVALID_ARGUMENT;   /* its compute instance is gone */
    *out = m;
    return NVML_SUCCESS;
}

static nvmlReturn_t put_str(char *dst, unsigned int length, const char *s)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

/* === MIG mode === */

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                                unsigned int *pendingMode)
{
    int d;
    nvmlReturn_t r = parent(device, &d);
    if (r)
        return r;
    if (!currentMode || !pendingMode)
        return NVML_ERROR_INVALID_ARGUMENT;
    return simgpu_mig_mode(d, currentMode, pendingMode) ? NVML_ERROR_NOT_SUPPORTED : NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t device, unsigned int mode,
                                                nvmlReturn_t *activationStatus)
{
    int d, activation = NVML_SUCCESS;
    nvmlReturn_t r = parent(device, &d);
    if (r)
        return r;
    r = (nvmlReturn_t)simgpu_mig_set_mode(d, mode, activationStatus ? &activation : NULL);
    if (r == NVML_SUCCESS)
        *activationStatus = (nvmlReturn_t)activation;
    return r;
}

/* === GPU instance profiles === */

/* Profile lookups by index: an index past the enum is invalid (the documented end of a
 * forward-compatible enumeration), one this GPU lacks is unsupported. */
static nvmlReturn_t gi_profile_at(nvmlDevice_t device, unsigned int profile, const void *info,
                                  const struct simgpu_mig_gi_profile **p)
{
    int d;
    nvmlReturn_t r = parent(device, &d);
    if (r)
        return r;
    if (!simgpu_mig_supported())
        return NVML_ERROR_NOT_SUPPORTED;
    if (profile >= NVML_GPU_INSTANCE_PROFILE_COUNT || !info)
        return NVML_ERROR_INVALID_ARGUMENT;
    *p = simgpu_mig_gi_by_index(profile);
    return *p ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

#define FILL_GI_COUNTS(info, p)                                                              \
    do {                                                                                     \
        (info)->id = (p)->id;                                                                \
        (info)->sliceCount = (p)->slices;                                                    \
        (info)->instanceCount = (p)->instances;                                              \
        (info)->multiprocessorCount = (p)->sms;                                              \
        (info)->copyEngineCount = (p)->copy_engines;                                         \
        (info)->decoderCount = (p)->decoders;                                                \
        (info)->encoderCount = (p)->encoders;                                                \
        (info)->jpegCount = (p)->jpegs;                                                      \
        (info)->ofaCount = (p)->ofas;                                                        \
        (info)->memorySizeMB = (p)->memory_mib;                                              \
    } while (0)

/* v2 and v3 carry their version first; anything else is an invalid argument (nvml.h:
 * "INVALID_ARGUMENT If ... info->version are invalid"). */
static nvmlReturn_t fill_gi_versioned(const struct simgpu_mig_gi_profile *p, nvmlGpuInstanceProfileInfo_v2_t *info)
{
    if (info->version == nvmlGpuInstanceProfileInfo_v2) {
        memset((char *)info + sizeof info->version, 0, sizeof *info - sizeof info->version);
        FILL_GI_COUNTS(info, p);
        info->isP2pSupported = 0;
        snprintf(info->name, sizeof info->name, "MIG %s", p->name);
        return NVML_SUCCESS;
    }
    if (info->version == nvmlGpuInstanceProfileInfo_v3) {
        nvmlGpuInstanceProfileInfo_v3_t *v3 = (nvmlGpuInstanceProfileInfo_v3_t *)(void *)info;
        memset((char *)v3 + sizeof v3->version, 0, sizeof *v3 - sizeof v3->version);
        FILL_GI_COUNTS(v3, p);
        snprintf(v3->name, sizeof v3->name, "MIG %s", p->name);
        v3->capabilities = 0;   /* no P2P ("P2P No" in -lgip), no graphics */
        return NVML_SUCCESS;
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfo(nvmlDevice_t device, unsigned int profile,
                                                               nvmlGpuInstanceProfileInfo_t *info)
{
    const struct simgpu_mig_gi_profile *p;
    nvmlReturn_t r = gi_profile_at(device, profile, info, &p);
    if (r)
        return r;
    memset(info, 0, sizeof *info);
    FILL_GI_COUNTS(info, p);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t device, unsigned int profile,
                                                                nvmlGpuInstanceProfileInfo_v2_t *info)
{
    const struct simgpu_mig_gi_profile *p;
    nvmlReturn_t r = gi_profile_at(device, profile, info, &p);
    return r ? r : fill_gi_versioned(p, info);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoByIdV(nvmlDevice_t device, unsigned int profileId,
                                                                    nvmlGpuInstanceProfileInfo_v2_t *info)
{
    int d;
    nvmlReturn_t r = parent(device, &d);
    if (r)
        return r;
    if (!simgpu_mig_supported())
        return NVML_ERROR_NOT_SUPPORTED;
    const struct simgpu_mig_gi_profile *p = simgpu_mig_gi_by_id(profileId);
    if (!p || !info)
        return NVML_ERROR_INVALID_ARGUMENT;
    return fill_gi_versioned(p, info);
}

/* "returns all the possible placements for the given profile regardless of whether MIG is
 * enabled"; placements may be NULL to get the count, else "must be large enough". */
SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements_v2(nvmlDevice_t device, unsigned int profileId,
                                                                         nvmlGpuInstancePlacement_t *placements,
                                                                         unsigned int *count)
{
    int d;
    nvmlReturn_t r = parent(device, &d);
    if (r)
        return r;
    if (!simgpu_mig_supported())
        return NVML_ERROR_NOT_SUPPORTED;
    const struct simgpu_mig_gi_profile *p = simgpu_mig_gi_by_id(profileId);
    if (!p || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = 0;
    for (unsigned s = 0; s < SIMGPU_MIG_MEM_SLICES; s++)
        if (p->starts >> s & 1) {
            if (placements)
                placements[n] = (nvmlGpuInstancePlacement_t){s, p->mem_slices};
            n++;
        }
    *count = n;
    return NVML_SUCCESS;
}

/* nvml.h #defines the unversioned name to _v2; the library exports both names. */
SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstancePossiblePlacements(nvmlDevice_t device, unsigned int profileId,
                                                                      nvmlGpuInstancePlacement_t *placements,
                                                                      unsigned int *count)
{
    return nvmlDeviceGetGpuInstancePossiblePlacements_v2(device, profileId, placements, count);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceRemainingCapacity(nvmlDevice_t device, unsigned int profileId,
                                                                     unsigned int *count)
{
    int d;
    nvmlReturn_t r = parent(device, &d);
    return r ? r : (nvmlReturn_t)simgpu_mig_gi_remaining(d, profileId, count);
}

/* === GPU instances === */

/* placed: the caller gives a placement (which must then be a valid pointer). */
static nvmlReturn_t create_gi(nvmlDevice_t device, unsigned int profileId, int placed,
                              const nvmlGpuInstancePlacement_t *placement, nvmlGpuInstance_t *gpuInstance)
{
    int d;
    nvmlReturn_t r = parent(device, &d);
    if (r)
        return r;
    if (!simgpu_mig_supported())
        return NVML_ERROR_NOT_SUPPORTED;
    if (!gpuInstance || (placed && !placement))
        return NVML_ERROR_INVALID_ARGUMENT;
    int start = -1, size = -1;
    if (placed) {   /* anything out of range is an invalid placement for every profile */
        start = placement->start < SIMGPU_MIG_MEM_SLICES ? (int)placement->start : SIMGPU_MIG_MEM_SLICES;
        size = placement->size <= SIMGPU_MIG_MEM_SLICES ? (int)placement->size : 0;
    }
    unsigned g;
    r = (nvmlReturn_t)simgpu_mig_gi_create(d, profileId, start, size, &g);
    if (r)
        return r;
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    simgpu_mig_snapshot(d, gis);
    *gpuInstance = gi_handle(d, g, gis[g].generation);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstance(nvmlDevice_t device, unsigned int profileId,
                                                       nvmlGpuInstance_t *gpuInstance)
{
    return create_gi(device, profileId, 0, NULL, gpuInstance);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t device, unsigned int profileId,
                                                                    const nvmlGpuInstancePlacement_t *placement,
                                                                    nvmlGpuInstance_t *gpuInstance)
{
    return create_gi(device, profileId, 1, placement, gpuInstance);
}

SIMGPU_EXPORT nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    int d;
    unsigned g;
    nvmlReturn_t r = gi_of(gpuInstance, gis, &d, &g);
    return r ? r : (nvmlReturn_t)simgpu_mig_gi_destroy(d, g, gis[g].generation);
}

/* Calls that list or look up existing instances need MIG mode on. */
static nvmlReturn_t parent_in_mig_mode(nvmlDevice_t device, int *d)
{
    nvmlReturn_t r = parent(device, d);
    if (r)
        return r;
    return simgpu_mig_enabled(*d) ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t device, unsigned int profileId,
                                                     nvmlGpuInstance_t *gpuInstances, unsigned int *count)
{
    int d;
    nvmlReturn_t r = parent_in_mig_mode(device, &d);
    if (r)
        return r;
    if (!simgpu_mig_gi_by_id(profileId) || !gpuInstances || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    simgpu_mig_snapshot(d, gis);
    unsigned int n = 0;
    for (unsigned g = 0; g < SIMGPU_MIG_MAX_GI; g++)
        if (gis[g].live && gis[g].profile_id == profileId)
            gpuInstances[n++] = gi_handle(d, g, gis[g].generation);
    *count = n;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceById(nvmlDevice_t device, unsigned int id,
                                                        nvmlGpuInstance_t *gpuInstance)
{
    int d;
    nvmlReturn_t r = parent_in_mig_mode(device, &d);
    if (r)
        return r;
    if (!gpuInstance)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    simgpu_mig_snapshot(d, gis);
    if (id >= SIMGPU_MIG_MAX_GI || !gis[id].live)
        return NVML_ERROR_NOT_FOUND;
    *gpuInstance = gi_handle(d, id, gis[id].generation);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    int d;
    unsigned g;
    nvmlReturn_t r = gi_of(gpuInstance, gis, &d, &g);
    if (r)
        return r;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    *info = (nvmlGpuInstanceInfo_t){.device = parent_handle(d), .id = g, .profileId = gis[g].profile_id,
                                    .placement = {gis[g].start, gis[g].size}};
    return NVML_SUCCESS;
}

/* === compute instance profiles === */

static nvmlReturn_t ci_profile_at(nvmlGpuInstance_t gpuInstance, unsigned int profile, unsigned int engProfile,
                                  const void *info, const struct simgpu_mig_gi_profile **gp,
                                  struct simgpu_mig_ci_profile *cp)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    int d;
    unsigned g;
    nvmlReturn_t r = gi_of(gpuInstance, gis, &d, &g);
    if (r)
        return r;
    if (profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT || engProfile >= NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT ||
        !info)
        return NVML_ERROR_INVALID_ARGUMENT;
    *gp = simgpu_mig_gi_by_id(gis[g].profile_id);
    return simgpu_mig_ci_profile(*gp, profile, cp) ? NVML_ERROR_NOT_SUPPORTED : NVML_SUCCESS;
}

/* Engines other than SMs are shared by a GI's compute instances (ENGINE_PROFILE_SHARED). */
#define FILL_CI_COUNTS(info, gp, cp)                                                         \
    do {                                                                                     \
        (info)->id = (cp)->id;                                                               \
        (info)->sliceCount = (cp)->slices;                                                   \
        (info)->instanceCount = (cp)->instances;                                             \
        (info)->multiprocessorCount = (cp)->sms;                                             \
        (info)->sharedCopyEngineCount = (gp)->copy_engines;                                  \
        (info)->sharedDecoderCount = (gp)->decoders;                                         \
        (info)->sharedEncoderCount = (gp)->encoders;                                         \
        (info)->sharedJpegCount = (gp)->jpegs;                                               \
        (info)->sharedOfaCount = (gp)->ofas;                                                 \
    } while (0)

SIMGPU_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfo(nvmlGpuInstance_t gpuInstance,
                                                                        unsigned int profile, unsigned int engProfile,
                                                                        nvmlComputeInstanceProfileInfo_t *info)
{
    const struct simgpu_mig_gi_profile *gp;
    struct simgpu_mig_ci_profile cp;
    nvmlReturn_t r = ci_profile_at(gpuInstance, profile, engProfile, info, &gp, &cp);
    if (r)
        return r;
    memset(info, 0, sizeof *info);
    FILL_CI_COUNTS(info, gp, &cp);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance,
                                                                         unsigned int profile, unsigned int engProfile,
                                                                         nvmlComputeInstanceProfileInfo_v2_t *info)
{
    const struct simgpu_mig_gi_profile *gp;
    struct simgpu_mig_ci_profile cp;
    nvmlReturn_t r = ci_profile_at(gpuInstance, profile, engProfile, info, &gp, &cp);
    if (r)
        return r;
    if (info->version == nvmlComputeInstanceProfileInfo_v2) {
        memset((char *)info + sizeof info->version, 0, sizeof *info - sizeof info->version);
        FILL_CI_COUNTS(info, gp, &cp);
        snprintf(info->name, sizeof info->name, "MIG %s", cp.name);
        return NVML_SUCCESS;
    }
    if (info->version == nvmlComputeInstanceProfileInfo_v3) {
        nvmlComputeInstanceProfileInfo_v3_t *v3 = (nvmlComputeInstanceProfileInfo_v3_t *)(void *)info;
        memset((char *)v3 + sizeof v3->version, 0, sizeof *v3 - sizeof v3->version);
        FILL_CI_COUNTS(v3, gp, &cp);
        snprintf(v3->name, sizeof v3->name, "MIG %s", cp.name);
        v3->capabilities = 0;
        return NVML_SUCCESS;
    }
    return NVML_ERROR_INVALID_ARGUMENT;
}

SIMGPU_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceRemainingCapacity(nvmlGpuInstance_t gpuInstance,
                                                                              unsigned int profileId,
                                                                              unsigned int *count)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    int d;
    unsigned g;
    nvmlReturn_t r = gi_of(gpuInstance, gis, &d, &g);
    if (r)
        return r;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    return (nvmlReturn_t)simgpu_mig_ci_remaining(d, g, gis[g].generation, profileId, count);
}

SIMGPU_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstancePossiblePlacements(
    nvmlGpuInstance_t gpuInstance, unsigned int profileId, nvmlComputeInstancePlacement_t *placements,
    unsigned int *count)
{
    const struct simgpu_mig_gi_profile *gp;
    struct simgpu_mig_ci_profile cp;
    nvmlReturn_t r = ci_profile_at(gpuInstance, profileId, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, count,
                                   &gp, &cp);
    if (r)
        return r;
    unsigned int n = 0;
    for (unsigned s = 0; s < SIMGPU_MIG_COMPUTE_SLICES; s++)
        if (cp.starts >> s & 1) {
            if (placements)
                placements[n] = (nvmlComputeInstancePlacement_t){s, cp.slices};
            n++;
        }
    *count = n;
    return NVML_SUCCESS;
}

/* === compute instances === */

static nvmlReturn_t create_ci(nvmlGpuInstance_t gpuInstance, unsigned int profileId, int placed,
                              const nvmlComputeInstancePlacement_t *placement, nvmlComputeInstance_t *computeInstance)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    int d;
    unsigned g, c;
    nvmlReturn_t r = gi_of(gpuInstance, gis, &d, &g);
    if (r)
        return r;
    if (!computeInstance || (placed && !placement))
        return NVML_ERROR_INVALID_ARGUMENT;
    int start = -1, size = -1;
    if (placed) {
        start = placement->start < SIMGPU_MIG_COMPUTE_SLICES ? (int)placement->start : SIMGPU_MIG_COMPUTE_SLICES;
        size = placement->size <= SIMGPU_MIG_COMPUTE_SLICES ? (int)placement->size : 0;
    }
    r = (nvmlReturn_t)simgpu_mig_ci_create(d, g, gis[g].generation, profileId, start, size, &c);
    if (r)
        return r;
    simgpu_mig_snapshot(d, gis);
    *computeInstance = ci_handle(d, g, c, gis[g].ci[c].generation);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                                nvmlComputeInstance_t *computeInstance)
{
    return create_ci(gpuInstance, profileId, 0, NULL, computeInstance);
}

SIMGPU_EXPORT nvmlReturn_t nvmlGpuInstanceCreateComputeInstanceWithPlacement(
    nvmlGpuInstance_t gpuInstance, unsigned int profileId, const nvmlComputeInstancePlacement_t *placement,
    nvmlComputeInstance_t *computeInstance)
{
    return create_ci(gpuInstance, profileId, 1, placement, computeInstance);
}

SIMGPU_EXPORT nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    int d;
    unsigned g, c;
    nvmlReturn_t r = ci_of(computeInstance, gis, &d, &g, &c);
    return r ? r : (nvmlReturn_t)simgpu_mig_ci_destroy(d, g, c, gis[g].ci[c].generation);
}

SIMGPU_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profileId,
                                                              nvmlComputeInstance_t *computeInstances,
                                                              unsigned int *count)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    int d;
    unsigned g;
    nvmlReturn_t r = gi_of(gpuInstance, gis, &d, &g);
    if (r)
        return r;
    if (profileId >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT || !computeInstances || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct simgpu_mig_ci_profile cp;
    if (simgpu_mig_ci_profile(simgpu_mig_gi_by_id(gis[g].profile_id), profileId, &cp))
        return NVML_ERROR_NOT_SUPPORTED;
    unsigned int n = 0;
    for (unsigned c = 0; c < SIMGPU_MIG_MAX_CI; c++)
        if (gis[g].ci[c].live && gis[g].ci[c].profile_id == profileId)
            computeInstances[n++] = ci_handle(d, g, c, gis[g].ci[c].generation);
    *count = n;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlGpuInstanceGetComputeInstanceById(nvmlGpuInstance_t gpuInstance, unsigned int id,
                                                                 nvmlComputeInstance_t *computeInstance)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    int d;
    unsigned g;
    nvmlReturn_t r = gi_of(gpuInstance, gis, &d, &g);
    if (r)
        return r;
    if (!computeInstance)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (id >= SIMGPU_MIG_MAX_CI || !gis[g].ci[id].live)
        return NVML_ERROR_NOT_FOUND;
    *computeInstance = ci_handle(d, g, id, gis[g].ci[id].generation);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance,
                                                         nvmlComputeInstanceInfo_t *info)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    int d;
    unsigned g, c;
    nvmlReturn_t r = ci_of(computeInstance, gis, &d, &g, &c);
    if (r)
        return r;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct simgpu_mig_ci *ci = &gis[g].ci[c];
    *info = (nvmlComputeInstanceInfo_t){.device = parent_handle(d), .gpuInstance = gi_handle(d, g, gis[g].generation),
                                        .id = c, .profileId = ci->profile_id, .placement = {ci->start, ci->size}};
    return NVML_SUCCESS;
}

/* The unversioned export predates `placement`: it fills only the fields before it. */
SIMGPU_EXPORT nvmlReturn_t nvmlComputeInstanceGetInfo(nvmlComputeInstance_t computeInstance,
                                                      nvmlComputeInstanceInfo_t *info)
{
    nvmlComputeInstanceInfo_t full;
    nvmlReturn_t r = nvmlComputeInstanceGetInfo_v2(computeInstance, info ? &full : NULL);
    if (r == NVML_SUCCESS)
        memcpy(info, &full, offsetof(nvmlComputeInstanceInfo_t, placement));
    return r;
}

/* === MIG device handles === */

/* MIG devices of a GPU in the order of their index: by GI ID, then CI ID. */
static unsigned int list_mig_devices(const struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI], unsigned out[][2])
{
    unsigned int n = 0;
    for (unsigned g = 0; g < SIMGPU_MIG_MAX_GI; g++)
        for (unsigned c = 0; gis[g].live && c < SIMGPU_MIG_MAX_CI; c++)
            if (gis[g].ci[c].live) {
                out[n][0] = g;
                out[n][1] = c;
                n++;
            }
    return n;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice)
{
    nvmlReturn_t r = initialized();
    if (r)
        return r;
    if (!isMigDevice)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (simgpu_nvml_is_mig(device)) {
        *isMigDevice = 1;
        return NVML_SUCCESS;
    }
    int d;
    r = parent(device, &d);
    if (!r)
        *isMigDevice = 0;   /* also on a GPU without MIG (the A10) */
    return r;
}

/* On a GPU's own handle these have nothing to answer: NOT_SUPPORTED ("if this query is not
 * supported by the device"). */
static nvmlReturn_t instance_ids(nvmlDevice_t device, unsigned int *gi, unsigned int *ci)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    const struct mig_device *m;
    nvmlReturn_t r = initialized();
    if (r)
        return r;
    if (!simgpu_nvml_is_mig(device)) {
        int d;
        r = parent(device, &d);
        return r ? r : NVML_ERROR_NOT_SUPPORTED;
    }
    if ((r = mig_of(device, gis, &m)))
        return r;
    if (!gi && !ci)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (gi)
        *gi = m->gi;
    if (ci)
        *ci = m->ci;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id)
{
    return id ? instance_ids(device, id, NULL) : NVML_ERROR_INVALID_ARGUMENT;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id)
{
    return id ? instance_ids(device, NULL, id) : NVML_ERROR_INVALID_ARGUMENT;
}

/* "Returns zero if MIG is not supported or enabled." */
SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    int d;
    nvmlReturn_t r = parent(device, &d);
    if (r)
        return r;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = simgpu_mig_enabled(d) ? SIMGPU_MIG_MAX_DEVICES : 0;
    return NVML_SUCCESS;
}

/* An index past GetMaxMigDeviceCount is invalid; an index below it with no MIG device is
 * NOT_FOUND.  Indices are dense in (GI ID, CI ID) order, so they shift when an instance is
 * destroyed ("handles may be reused and their properties can change"). */
SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                               nvmlDevice_t *migDevice)
{
    int d;
    nvmlReturn_t r = parent(device, &d);
    if (r)
        return r;
    if (!simgpu_mig_supported())
        return NVML_ERROR_NOT_SUPPORTED;
    if (!migDevice || index >= (simgpu_mig_enabled(d) ? SIMGPU_MIG_MAX_DEVICES : 0u))
        return NVML_ERROR_INVALID_ARGUMENT;
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    unsigned list[SIMGPU_MIG_MAX_GI * SIMGPU_MIG_MAX_CI][2];
    simgpu_mig_snapshot(d, gis);
    if (index >= list_mig_devices(gis, list))
        return NVML_ERROR_NOT_FOUND;
    unsigned g = list[index][0], c = list[index][1];
    *migDevice = mig_handle(d, g, c, gis[g].ci[c].generation);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    const struct mig_device *m;
    nvmlReturn_t r = mig_of(migDevice, gis, &m);
    if (r)
        return r;
    if (!device)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = parent_handle((int)m->dev);
    return NVML_SUCCESS;
}

/* "This API currently only supports MIG device handles." */
SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    const struct mig_device *m;
    nvmlReturn_t r = initialized();
    if (r)
        return r;
    if (!simgpu_nvml_is_mig(device)) {
        int d;
        r = parent(device, &d);
        return r ? r : NVML_ERROR_NOT_SUPPORTED;
    }
    if ((r = mig_of(device, gis, &m)))
        return r;
    if (!attributes)
        return NVML_ERROR_INVALID_ARGUMENT;
    const struct simgpu_mig_gi_profile *gp = simgpu_mig_gi_by_id(gis[m->gi].profile_id);
    struct simgpu_mig_ci_profile cp;
    if (simgpu_mig_ci_profile(gp, gis[m->gi].ci[m->ci].profile_id, &cp))
        return NVML_ERROR_UNKNOWN;
    *attributes = (nvmlDeviceAttributes_t){
        .multiprocessorCount = cp.sms, .sharedCopyEngineCount = gp->copy_engines,
        .sharedDecoderCount = gp->decoders, .sharedEncoderCount = gp->encoders, .sharedJpegCount = gp->jpegs,
        .sharedOfaCount = gp->ofas, .gpuInstanceSliceCount = gp->slices, .computeInstanceSliceCount = cp.slices,
        .memorySizeMB = gp->memory_mib};
    return NVML_SUCCESS;
}

/* === what nvml.c answers for a MIG device handle === */

nvmlReturn_t simgpu_nvml_mig_name(nvmlDevice_t device, char *name, unsigned int length)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    const struct mig_device *m;
    nvmlReturn_t r = mig_of(device, gis, &m);
    if (r)
        return r;
    char s[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    simgpu_mig_device_name(&gis[m->gi], &gis[m->gi].ci[m->ci], s, sizeof s);
    return put_str(name, length, s);
}

nvmlReturn_t simgpu_nvml_mig_uuid(nvmlDevice_t device, char *uuid, unsigned int length)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    const struct mig_device *m;
    nvmlReturn_t r = mig_of(device, gis, &m);
    if (r)
        return r;
    char s[41];
    simgpu_mig_format_uuid(gis[m->gi].ci[m->ci].uuid, s);
    return put_str(uuid, length, s);
}

/* "When used with MIG device handles this API returns indices that can be passed to
 * nvmlDeviceGetMigDeviceHandleByIndex to retrieve an identical handle." */
nvmlReturn_t simgpu_nvml_mig_index(nvmlDevice_t device, unsigned int *index)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    const struct mig_device *m;
    nvmlReturn_t r = mig_of(device, gis, &m);
    if (r)
        return r;
    if (!index)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned list[SIMGPU_MIG_MAX_GI * SIMGPU_MIG_MAX_CI][2];
    unsigned int n = list_mig_devices(gis, list);
    for (unsigned int i = 0; i < n; i++)
        if (list[i][0] == m->gi && list[i][1] == m->ci)
            *index = i;
    return NVML_SUCCESS;
}

nvmlReturn_t simgpu_nvml_mig_parent(nvmlDevice_t device, int *dev)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    const struct mig_device *m;
    nvmlReturn_t r = mig_of(device, gis, &m);
    if (!r)
        *dev = (int)m->dev;
    return r;
}

/* Per instance: total is the GI's memory, used what processes hold in the GI (its
 * compute instances share it). */
static nvmlReturn_t mig_memory(nvmlDevice_t device, unsigned long long *total, unsigned long long *used)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    const struct mig_device *m;
    nvmlReturn_t r = mig_of(device, gis, &m);
    if (r)
        return r;
    simgpu_reap_dead();
    *total = simgpu_mig_gi_by_id(gis[m->gi].profile_id)->memory_mib * MiB;
    *used = simgpu_mig_gi_used((int)m->dev, m->gi, -1);
    if (*used > *total)
        *used = *total;
    return NVML_SUCCESS;
}

nvmlReturn_t simgpu_nvml_mig_memory(nvmlDevice_t device, nvmlMemory_t *memory)
{
    unsigned long long total, used;
    nvmlReturn_t r = mig_memory(device, &total, &used);
    if (r)
        return r;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    *memory = (nvmlMemory_t){.total = total, .free = total - used, .used = used};
    return NVML_SUCCESS;
}

nvmlReturn_t simgpu_nvml_mig_memory_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    unsigned long long total, used;
    nvmlReturn_t r = mig_memory(device, &total, &used);
    if (r)
        return r;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = total;
    memory->reserved = 0;
    memory->used = used;
    memory->free = total - used;
    return NVML_SUCCESS;
}

/* A process runs on a MIG device when it has a context on that CI, or holds memory in its
 * GI with no context on any of the GI's CIs (it is then listed on each of them). */
nvmlReturn_t simgpu_nvml_mig_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos, int v1)
{
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    const struct mig_device *m;
    nvmlReturn_t r = mig_of(device, gis, &m);
    if (r)
        return r;
    if (!infoCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    simgpu_reap_dead();
    struct simgpu_node *n = simgpu_node();
    nvmlProcessInfo_v2_t found[SIMGPU_MAX_PROCS];
    unsigned int count = 0;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        int32_t pid = atomic_load(&n->procs[i].pid);
        uint32_t ctx = atomic_load(&n->procs[i].mig.ci_contexts[m->dev][m->gi]);
        uint64_t mem = atomic_load(&n->procs[i].mig.gi_mem[m->dev][m->gi]);
        if (pid > 0 && ((ctx >> m->ci & 1) || (mem && !ctx)))
            found[count++] = (nvmlProcessInfo_v2_t){.pid = (unsigned int)pid, .usedGpuMemory = mem,
                                                    .gpuInstanceId = m->gi, .computeInstanceId = m->ci};
    }
    return vgpu_nvml_put_processes(found, count, infoCount, infos, v1);
}

nvmlReturn_t simgpu_nvml_mig_by_uuid(const char *uuid, nvmlDevice_t *device)
{
    nvmlReturn_t r = initialized();
    if (r)
        return r;
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    int ld;
    unsigned lg, lc;
    if (!simgpu_mig_parse_legacy(uuid, &ld, &lg, &lc)) {
        struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
        simgpu_mig_snapshot(ld, gis);
        *device = mig_handle(ld, lg, lc, gis[lg].ci[lc].generation);
        return NVML_SUCCESS;
    }
    char s[41];
    for (unsigned d = 0; d < simgpu_node()->device_count; d++) {
        if (!simgpu_mig_enabled((int)d))
            continue;
        struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
        simgpu_mig_snapshot((int)d, gis);
        for (unsigned g = 0; g < SIMGPU_MIG_MAX_GI; g++)
            for (unsigned c = 0; gis[g].live && c < SIMGPU_MIG_MAX_CI; c++) {
                if (!gis[g].ci[c].live)
                    continue;
                simgpu_mig_format_uuid(gis[g].ci[c].uuid, s);
                if (!strcasecmp(s, uuid)) {
                    *device = mig_handle((int)d, g, c, gis[g].ci[c].generation);
                    return NVML_SUCCESS;
                }
            }
    }
    return NVML_ERROR_NOT_FOUND;
}

void simgpu_nvml_mig_process_ids(int dev, int slot, unsigned int *gpuInstanceId, unsigned int *computeInstanceId)
{
    const struct simgpu_mig_proc *p = &simgpu_node()->procs[slot].mig;
    for (unsigned g = 0; g < SIMGPU_MIG_MAX_GI; g++) {
        uint32_t ctx = atomic_load(&p->ci_contexts[dev][g]);
        if (ctx || atomic_load(&p->gi_mem[dev][g])) {
            *gpuInstanceId = g;
            *computeInstanceId = ctx ? (unsigned)__builtin_ctz(ctx) : NVML_VALUE_NOT_AVAILABLE_UINT;
            return;
        }
    }
}
