/* simgpu MIG: profile tables, placements and instance rules, kept in the node file (mig.h).
 *
 * Linked into both libraries: libnvidia-ml gives it NVML's API (nvml_mig.c), libcuda uses
 * the process's device view at the end of this file.  Return codes are NVML's.
 */
#define _GNU_SOURCE
#include "nvml_mig_abi.h"
#include "simgpu/node.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#define MiB (1ull << 20)

/* === profiles ===
 * GPU instance profiles per model, as nvidia-smi mig -lgip prints them (memory is
 * memorySizeMB, in MiB; -lgip shows it /1024 with two decimals).  Sources:
 *   a100-40g: the A100-SXM4-40GB -lgip capture and MIG user guide table quoted in
 *     ../shared/reference/nvml-mig.md (1g.5gb 4.75 GiB ... 7g.40gb 39.38 GiB; SM 14 per
 *     slice, 98 for 7g; CE = slices; DEC/ENC/JPEG/OFA per profile).
 *   h100-80g: simgpu's h100-80g is the SXM5 board (132 SMs), so SM counts come from a
 *     published -lgip capture of an H100 SXM5 80GB (16/16/26/32/60/64/132); memory
 *     (9.75/19.62/39.50/79.25 GiB) and engines agree with the reference's PCIe capture,
 *     whose SM counts (14..114) are the PCIe board's.
 *   h200: the MIG user guide gives fractions only (memory 1/8, 1/8, 1/4, 2/8, 4/8, 4/8,
 *     full; SMs 1/7 ... 7/7; engines and instance counts as below).  SM counts are the
 *     H100 SXM5's (same GH100 configuration), which third-party reports of H200 MIG
 *     devices confirm for 1g (16), 2g (32), 3g (60), 4g (64) and 7g (132); memory figures
 *     (16.00, 32.50, 69.75, 140.00 GiB) are from third-party -lgip output and device
 *     reports, not NVIDIA documentation.
 * Placements ({starts}:memory slices, the MIG user guide, identical on the three): 1g
 * {0..6}:1, 1g with 2 memory slices {0,2,4,6}:2, 2g {0,2,4}:2, 3g {0,4}:4, 4g {0}:4,
 * 7g {0}:8.  Enum indices: 1g.*+me is 1_SLICE_REV1 and 1g with twice the memory is
 * 1_SLICE_REV2 (nvml.h's comments on the enum; go-nvml's A100 mock maps them the same). */
#define GI(index_, id_, name_, slices_, mem_, starts_, inst, sm, ce, dec, enc, jpeg, ofa, mib)      \
    {.index = index_, .id = id_, .name = name_, .slices = slices_, .mem_slices = mem_,               \
     .starts = starts_, .instances = inst, .sms = sm, .copy_engines = ce, .decoders = dec,          \
     .encoders = enc, .jpegs = jpeg, .ofas = ofa, .memory_mib = mib}
#define S_1 0x7fu    /* starts 0..6 */
#define S_1M2 0x55u  /* 0, 2, 4, 6 */
#define S_2 0x15u    /* 0, 2, 4 */
#define S_3 0x11u    /* 0, 4 */
#define S_0 0x01u    /* 0 */

static const struct simgpu_mig_gi_profile a100_40g[] = {
    GI(NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19, "1g.5gb", 1, 1, S_1, 7, 14, 1, 0, 0, 0, 0, 4864),
    GI(NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14, "2g.10gb", 2, 2, S_2, 3, 28, 2, 1, 0, 0, 0, 9984),
    GI(NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9, "3g.20gb", 3, 4, S_3, 2, 42, 3, 2, 0, 0, 0, 20096),
    GI(NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5, "4g.20gb", 4, 4, S_0, 1, 56, 4, 2, 0, 0, 0, 20096),
    GI(NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0, "7g.40gb", 7, 8, S_0, 1, 98, 7, 5, 0, 1, 1, 40320),
    GI(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, "1g.5gb+me", 1, 1, S_1, 1, 14, 1, 1, 0, 1, 1, 4864),
    GI(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, "1g.10gb", 1, 2, S_1M2, 4, 14, 1, 1, 0, 0, 0, 9984),
};

static const struct simgpu_mig_gi_profile h100_80g[] = {
    GI(NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19, "1g.10gb", 1, 1, S_1, 7, 16, 1, 1, 0, 1, 0, 9984),
    GI(NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14, "2g.20gb", 2, 2, S_2, 3, 32, 2, 2, 0, 2, 0, 20096),
    GI(NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9, "3g.40gb", 3, 4, S_3, 2, 60, 3, 3, 0, 3, 0, 40448),
    GI(NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5, "4g.40gb", 4, 4, S_0, 1, 64, 4, 4, 0, 4, 0, 40448),
    GI(NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0, "7g.80gb", 7, 8, S_0, 1, 132, 8, 7, 0, 7, 1, 81152),
    GI(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, "1g.10gb+me", 1, 1, S_1, 1, 16, 1, 1, 0, 1, 1, 9984),
    GI(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, "1g.20gb", 1, 2, S_1M2, 4, 26, 1, 1, 0, 1, 0, 20096),
};

static const struct simgpu_mig_gi_profile h200[] = {
    GI(NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19, "1g.18gb", 1, 1, S_1, 7, 16, 1, 1, 0, 1, 0, 16384),
    GI(NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14, "2g.35gb", 2, 2, S_2, 3, 32, 2, 2, 0, 2, 0, 33280),
    GI(NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9, "3g.71gb", 3, 4, S_3, 2, 60, 3, 3, 0, 3, 0, 71424),
    GI(NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5, "4g.71gb", 4, 4, S_0, 1, 64, 4, 4, 0, 4, 0, 71424),
    GI(NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0, "7g.141gb", 7, 8, S_0, 1, 132, 8, 7, 0, 7, 1, 143360),
    GI(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, "1g.18gb+me", 1, 1, S_1, 1, 16, 1, 1, 0, 1, 1, 16384),
    GI(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, "1g.35gb", 1, 2, S_1M2, 4, 26, 1, 1, 0, 1, 0, 33280),
};

static const struct {
    const char *profile;   /* SIMGPU_PROFILE */
    const struct simgpu_mig_gi_profile *gi;
    size_t n;
} models[] = {
    {"a100-40g", a100_40g, sizeof a100_40g / sizeof a100_40g[0]},
    {"h100-80g", h100_80g, sizeof h100_80g / sizeof h100_80g[0]},
    {"h200", h200, sizeof h200 / sizeof h200[0]},
};

static const struct simgpu_mig_gi_profile *table(size_t *n)
{
    const struct simgpu_profile *p = simgpu_profile();
    for (size_t i = 0; p && i < sizeof models / sizeof models[0]; i++)
        if (!strcmp(models[i].profile, p->id)) {
            *n = models[i].n;
            return models[i].gi;
        }
    *n = 0;
    return NULL;
}

int simgpu_mig_supported(void)
{
    size_t n;
    return table(&n) != NULL;
}

const struct simgpu_mig_gi_profile *simgpu_mig_gi_by_index(unsigned index)
{
    size_t n;
    const struct simgpu_mig_gi_profile *t = table(&n);
    for (size_t i = 0; i < n; i++)
        if (t[i].index == index)
            return &t[i];
    return NULL;
}

const struct simgpu_mig_gi_profile *simgpu_mig_gi_by_id(unsigned id)
{
    size_t n;
    const struct simgpu_mig_gi_profile *t = table(&n);
    for (size_t i = 0; i < n; i++)
        if (t[i].id == id)
            return &t[i];
    return NULL;
}

/* Compute instance profiles of a GI: nc.<gi> for n in 1, 2, 3, 4, 7 compute slices up to
 * the GI's own (the -lcip listing of the MIG user guide: e.g. 1c.3g.20gb x3, 2c.3g.20gb,
 * 3g.20gb); the one that takes the whole GI carries the GI's name.  CI profile ID == the
 * NVML_COMPUTE_INSTANCE_PROFILE_* index (the reference: 4g.20gb's full CI is profile 3,
 * 2g.10gb's is 1, 1c.* is 0).  Placements start at multiples of n rounded up to a power of
 * two (so 3c sits at 0 and 4 in a 7g GI), as GI placements do.  SMs: the GI's own for a
 * full-GI CI, else n times the model's 1-slice GI's SMs (one GPC each) — simgpu's model,
 * not a published figure.  1_SLICE_REV1, 7_SLICE_NVL, 6 and 8 slices: not offered. */
int simgpu_mig_ci_profile(const struct simgpu_mig_gi_profile *gi, unsigned index,
                          struct simgpu_mig_ci_profile *out)
{
    static const unsigned slices[] = {1, 2, 3, 4, 7};
    if (!gi || index >= sizeof slices / sizeof slices[0] || slices[index] > gi->slices)
        return -1;
    unsigned c = slices[index], align = 1;
    while (align < c)
        align <<= 1;
    memset(out, 0, sizeof *out);
    out->id = index;
    out->slices = c;
    for (unsigned s = 0; s + c <= gi->slices; s += align)
        out->starts |= 1u << s;
    out->instances = (unsigned)__builtin_popcount(out->starts);
    const struct simgpu_mig_gi_profile *one = simgpu_mig_gi_by_index(NVML_GPU_INSTANCE_PROFILE_1_SLICE);
    out->sms = c == gi->slices ? gi->sms : c * (one ? one->sms : gi->sms / gi->slices);
    if (c == gi->slices)
        snprintf(out->name, sizeof out->name, "%s", gi->name);
    else
        snprintf(out->name, sizeof out->name, "%uc.%s", c, gi->name);
    return 0;
}

/* GI IDs are a function of the placement: one ID per aligned block of memory slices,
 * numbered level by level (8 slices: 0; 4: 1-2; 2: 3-6; 1: 7-14), the upper half of the
 * GPU first.  This reproduces every ID the reference records from an A100 (4g at 0:4 is
 * 2, 2g at 4:2 is 3, 1g at 6:1 is 9; seven 1g at 0..6 are 11,12,13,14,7,8,9; two 3g are
 * 2 at 0:4 and 1 at 4:4); that the rule holds everywhere is simgpu's assumption. */
unsigned simgpu_mig_gi_id(unsigned start, unsigned size)
{
    unsigned n = SIMGPU_MIG_MEM_SLICES / size;   /* blocks of this size */
    return (n - 1) + ((start / size + n / 2) % n);
}

/* === node state === */

void simgpu_mig_init(struct simgpu_mig_gpu *gpus, int n)
{
    for (int d = 0; d < n; d++) {
        pthread_mutexattr_t a;
        pthread_mutexattr_init(&a);
        pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
        pthread_mutex_init(&gpus[d].lock, &a);
        pthread_mutexattr_destroy(&a);
        atomic_store(&gpus[d].current_mode, NVML_DEVICE_MIG_DISABLE);
        atomic_store(&gpus[d].pending_mode, NVML_DEVICE_MIG_DISABLE);
    }
}

void simgpu_mig_clear_proc(struct simgpu_mig_proc *p)
{
    for (int d = 0; d < SIMGPU_MAX_DEVICES; d++)
        for (int g = 0; g < SIMGPU_MIG_MAX_GI; g++) {
            atomic_store(&p->gi_mem[d][g], 0);
            atomic_store(&p->ci_contexts[d][g], 0);
        }
}

static struct simgpu_mig_gpu *gpu(int dev) { return &simgpu_node()->mig[dev]; }

static void lock(struct simgpu_mig_gpu *m)
{
    if (pthread_mutex_lock(&m->lock) == EOWNERDEAD)
        pthread_mutex_consistent(&m->lock);   /* every change publishes `live` last */
}

static void unlock(struct simgpu_mig_gpu *m) { pthread_mutex_unlock(&m->lock); }

static void random_uuid(unsigned char u[16])
{
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, u, 16) != 16) {
        uint64_t t = simgpu_now_ns() ^ ((uint64_t)getpid() << 32);
        for (int i = 0; i < 16; i++, t = t * 6364136223846793005ull + 1442695040888963407ull)
            u[i] = (unsigned char)(t >> 56);
    }
    if (fd >= 0)
        close(fd);
    u[6] = (unsigned char)((u[6] & 0x0f) | 0x40);   /* version 4 */
    u[8] = (unsigned char)((u[8] & 0x3f) | 0x80);
}

void simgpu_mig_format_uuid(const unsigned char u[16], char out[41])
{
    snprintf(out, 41, "MIG-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
             u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

/* "MIG-GPU-<GPU UUID>/<GI ID>/<CI ID>", the MIG device names before R470, which
 * nvmlDeviceGetHandleByUUID still accepts (NVML change log) and CUDA_VISIBLE_DEVICES too. */
int simgpu_mig_parse_legacy(const char *s, int *dev, unsigned *gi, unsigned *ci)
{
    const size_t gpu_len = 40;   /* "GPU-" + 36 */
    if (strncasecmp(s, "MIG-GPU-", 8) || strlen(s) < 4 + gpu_len || s[4 + gpu_len] != '/')
        return -1;
    unsigned g, c;
    int end = 0;
    if (sscanf(s + 4 + gpu_len, "/%u/%u%n", &g, &c, &end) != 2 || s[4 + gpu_len + end] ||
        g >= SIMGPU_MIG_MAX_GI || c >= SIMGPU_MIG_MAX_CI)
        return -1;
    for (unsigned d = 0; d < simgpu_node()->device_count; d++) {
        char u[41];
        simgpu_mig_format_uuid(simgpu_node()->devices[d].uuid, u);
        memcpy(u, "GPU", 3);
        if (strncasecmp(u, s + 4, gpu_len) || !simgpu_mig_enabled((int)d))
            continue;
        struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
        simgpu_mig_snapshot((int)d, gis);
        if (!gis[g].live || !gis[g].ci[c].live)
            return -1;
        *dev = (int)d;
        *gi = g;
        *ci = c;
        return 0;
    }
    return -1;
}

void simgpu_mig_device_name(const struct simgpu_mig_gi *gi, const struct simgpu_mig_ci *ci, char *out,
                            unsigned len)
{
    struct simgpu_mig_ci_profile cp;
    if (simgpu_mig_ci_profile(simgpu_mig_gi_by_id(gi->profile_id), ci->profile_id, &cp))
        snprintf(cp.name, sizeof cp.name, "?");
    snprintf(out, len, "%s MIG %s", simgpu_profile()->model, cp.name);
}

void simgpu_mig_snapshot(int dev, struct simgpu_mig_gi out[SIMGPU_MIG_MAX_GI])
{
    struct simgpu_mig_gpu *m = gpu(dev);
    lock(m);
    memcpy(out, m->gi, sizeof m->gi);
    unlock(m);
}

/* === who uses what (live processes only: callers reap first) === */

static int gpu_busy(int dev)
{
    struct simgpu_node *n = simgpu_node();
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++)
        if (atomic_load(&n->procs[i].pid) &&
            (((atomic_load(&n->procs[i].context_devices) >> dev) & 1) || atomic_load(&n->procs[i].mem[dev])))
            return 1;
    return 0;
}

static int gi_busy(int dev, unsigned g)
{
    struct simgpu_node *n = simgpu_node();
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++)
        if (atomic_load(&n->procs[i].pid) &&
            (atomic_load(&n->procs[i].mig.gi_mem[dev][g]) || atomic_load(&n->procs[i].mig.ci_contexts[dev][g])))
            return 1;
    return 0;
}

static int ci_busy(int dev, unsigned g, unsigned c)
{
    struct simgpu_node *n = simgpu_node();
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++)
        if (atomic_load(&n->procs[i].pid) && ((atomic_load(&n->procs[i].mig.ci_contexts[dev][g]) >> c) & 1))
            return 1;
    return 0;
}

uint64_t simgpu_mig_gi_used(int dev, unsigned g, int slot)
{
    struct simgpu_node *n = simgpu_node();
    uint64_t used = 0;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++)
        if ((slot < 0 || i == slot) && atomic_load(&n->procs[i].pid))
            used += atomic_load(&n->procs[i].mig.gi_mem[dev][g]);
    return used;
}

/* === MIG mode ===
 * SetMigMode "may unbind or reset the device to activate the requested mode"; when the
 * device is not idle, activationStatus is IN_USE and the mode stays pending (nvml.h).
 * simgpu applies a change at once when no process holds a context or memory on the GPU
 * (and, to disable, no GPU instance is left), on Ampere and Hopper alike (bare metal:
 * the driver resets an idle GPU itself); otherwise the request stays pending until a
 * later call finds the GPU idle.  No privilege check: simgpu runs unprivileged. */

int simgpu_mig_mode(int dev, unsigned *current, unsigned *pending)
{
    if (!simgpu_mig_supported())
        return -1;
    *current = atomic_load(&gpu(dev)->current_mode);
    *pending = atomic_load(&gpu(dev)->pending_mode);
    return 0;
}

int simgpu_mig_enabled(int dev)
{
    return simgpu_mig_supported() && atomic_load(&gpu(dev)->current_mode) == NVML_DEVICE_MIG_ENABLE;
}

static int any_gi(const struct simgpu_mig_gpu *m)
{
    for (int g = 0; g < SIMGPU_MIG_MAX_GI; g++)
        if (m->gi[g].live)
            return 1;
    return 0;
}

int simgpu_mig_set_mode(int dev, unsigned mode, int *activation)
{
    if (!simgpu_mig_supported())
        return NVML_ERROR_NOT_SUPPORTED;
    if (mode > NVML_DEVICE_MIG_ENABLE || !activation)
        return NVML_ERROR_INVALID_ARGUMENT;
    simgpu_reap_dead();
    struct simgpu_mig_gpu *m = gpu(dev);
    lock(m);
    atomic_store(&m->pending_mode, mode);
    unsigned was = atomic_load(&m->current_mode);
    *activation = NVML_SUCCESS;
    if (was != mode) {
        /* Publish the new mode before looking for users: a process reserving memory on the
         * whole GPU checks the mode after publishing its bytes, so one of the two sees
         * the other (view_reserve). */
        atomic_store(&m->current_mode, mode);
        if (gpu_busy(dev) || (mode == NVML_DEVICE_MIG_DISABLE && any_gi(m))) {
            atomic_store(&m->current_mode, was);
            *activation = NVML_ERROR_IN_USE;
        }
    }
    unlock(m);
    return NVML_SUCCESS;
}

/* === GPU instances === */

static unsigned span(unsigned start, unsigned size) { return ((1u << size) - 1) << start; }

static unsigned occupied_memory(const struct simgpu_mig_gpu *m)
{
    unsigned mask = 0;
    for (int g = 0; g < SIMGPU_MIG_MAX_GI; g++)
        if (m->gi[g].live)
            mask |= span(m->gi[g].start, m->gi[g].size);
    return mask;
}

static unsigned count_gi(const struct simgpu_mig_gpu *m, unsigned profile_id)
{
    unsigned c = 0;
    for (int g = 0; g < SIMGPU_MIG_MAX_GI; g++)
        c += m->gi[g].live && m->gi[g].profile_id == profile_id;
    return c;
}

/* Free placements of profile p, in order of their start, capped by its instance count. */
static unsigned free_starts(const struct simgpu_mig_gpu *m, const struct simgpu_mig_gi_profile *p)
{
    unsigned busy = occupied_memory(m), starts = 0;
    for (unsigned s = 0; s < SIMGPU_MIG_MEM_SLICES; s++)
        if ((p->starts >> s & 1) && !(busy & span(s, p->mem_slices)))
            starts |= 1u << s;
    return count_gi(m, p->id) >= p->instances ? 0 : starts;
}

/* A placement given by the caller must be one of the profile's (INVALID_ARGUMENT) and free
 * (INSUFFICIENT_RESOURCES: "creation fails on overlap with occupied memory slices"); with
 * none given, the driver takes the free placement with the lowest start (what the
 * reference's A100 observations show: 3g then 3g at 0:4 then 4:4; 4g, 2g, 1g at 0:4, 4:2,
 * 6:1). */
int simgpu_mig_gi_create(int dev, unsigned profile_id, int start, int size, unsigned *out)
{
    if (!simgpu_mig_supported())
        return NVML_ERROR_NOT_SUPPORTED;
    const struct simgpu_mig_gi_profile *p = simgpu_mig_gi_by_id(profile_id);
    if (!p)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (start >= 0 && (start >= SIMGPU_MIG_MEM_SLICES || !(p->starts >> start & 1) ||
                       size != (int)p->mem_slices))
        return NVML_ERROR_INVALID_ARGUMENT;
    struct simgpu_mig_gpu *m = gpu(dev);
    lock(m);
    int rc = NVML_SUCCESS;
    unsigned free = free_starts(m, p);
    if (atomic_load(&m->current_mode) != NVML_DEVICE_MIG_ENABLE)
        rc = NVML_ERROR_NOT_SUPPORTED;
    else if (start >= 0 ? !(free >> start & 1) : !free)
        rc = NVML_ERROR_INSUFFICIENT_RESOURCES;
    else {
        unsigned s = start >= 0 ? (unsigned)start : (unsigned)__builtin_ctz(free);
        unsigned id = simgpu_mig_gi_id(s, p->mem_slices);
        struct simgpu_mig_gi *g = &m->gi[id];
        memset(g, 0, sizeof *g);
        g->profile_id = p->id;
        g->start = s;
        g->size = p->mem_slices;
        g->generation = ++m->generation;
        __atomic_store_n(&g->live, 1, __ATOMIC_RELEASE);
        *out = id;
    }
    unlock(m);
    return rc;
}

int simgpu_mig_gi_destroy(int dev, unsigned g, uint32_t generation)
{
    simgpu_reap_dead();
    struct simgpu_mig_gpu *m = gpu(dev);
    lock(m);
    int rc = NVML_SUCCESS;
    struct simgpu_mig_gi *gi = &m->gi[g];
    if (!gi->live || gi->generation != generation)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else {
        for (int c = 0; c < SIMGPU_MIG_MAX_CI; c++)
            if (gi->ci[c].live)
                rc = NVML_ERROR_IN_USE;   /* "processes ... or compute instances are active" */
        if (!rc && gi_busy(dev, g))
            rc = NVML_ERROR_IN_USE;
        if (!rc)
            gi->live = 0;
    }
    unlock(m);
    return rc;
}

int simgpu_mig_gi_remaining(int dev, unsigned profile_id, unsigned *count)
{
    if (!simgpu_mig_supported())
        return NVML_ERROR_NOT_SUPPORTED;
    const struct simgpu_mig_gi_profile *p = simgpu_mig_gi_by_id(profile_id);
    if (!p || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct simgpu_mig_gpu *m = gpu(dev);
    lock(m);
    int rc = NVML_SUCCESS;
    if (atomic_load(&m->current_mode) != NVML_DEVICE_MIG_ENABLE)
        rc = NVML_ERROR_NOT_SUPPORTED;
    else {
        /* placements of one profile never overlap each other, so each free one is one more */
        unsigned n = (unsigned)__builtin_popcount(free_starts(m, p)), left = p->instances - count_gi(m, p->id);
        *count = n < left ? n : left;
    }
    unlock(m);
    return rc;
}

/* === compute instances === */

static struct simgpu_mig_gi *live_gi(struct simgpu_mig_gpu *m, unsigned g, uint32_t generation)
{
    struct simgpu_mig_gi *gi = g < SIMGPU_MIG_MAX_GI ? &m->gi[g] : NULL;
    return gi && gi->live && gi->generation == generation ? gi : NULL;
}

static unsigned ci_free_starts(const struct simgpu_mig_gi *gi, const struct simgpu_mig_ci_profile *cp)
{
    unsigned busy = 0, count = 0, starts = 0;
    for (int c = 0; c < SIMGPU_MIG_MAX_CI; c++)
        if (gi->ci[c].live) {
            busy |= span(gi->ci[c].start, gi->ci[c].size);
            count += gi->ci[c].profile_id == cp->id;
        }
    for (unsigned s = 0; s < SIMGPU_MIG_COMPUTE_SLICES; s++)
        if ((cp->starts >> s & 1) && !(busy & span(s, cp->slices)))
            starts |= 1u << s;
    return count >= cp->instances ? 0 : starts;
}

/* CI profile lookup for the create/capacity calls: IDs past the enum are invalid, IDs
 * the GI does not offer unsupported (nvml.h's return codes for these calls). */
static int ci_profile_of(const struct simgpu_mig_gi *gi, unsigned profile_id, struct simgpu_mig_ci_profile *cp)
{
    if (profile_id >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT)
        return NVML_ERROR_INVALID_ARGUMENT;
    return simgpu_mig_ci_profile(simgpu_mig_gi_by_id(gi->profile_id), profile_id, cp) ? NVML_ERROR_NOT_SUPPORTED
                                                                                       : NVML_SUCCESS;
}

int simgpu_mig_ci_create(int dev, unsigned g, uint32_t gi_generation, unsigned profile_id, int start,
                         int size, unsigned *out)
{
    struct simgpu_mig_gpu *m = gpu(dev);
    unsigned char uuid[16];
    random_uuid(uuid);
    lock(m);
    struct simgpu_mig_ci_profile cp;
    struct simgpu_mig_gi *gi = live_gi(m, g, gi_generation);
    int rc = gi ? ci_profile_of(gi, profile_id, &cp) : NVML_ERROR_INVALID_ARGUMENT;
    if (!rc && start >= 0 && (start >= SIMGPU_MIG_COMPUTE_SLICES || !(cp.starts >> start & 1) ||
                              size != (int)cp.slices))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (!rc) {
        unsigned free = ci_free_starts(gi, &cp);
        int id = -1;
        for (int c = 0; c < SIMGPU_MIG_MAX_CI && id < 0; c++)
            if (!gi->ci[c].live)
                id = c;
        if ((start >= 0 ? !(free >> start & 1) : !free) || id < 0)
            rc = NVML_ERROR_INSUFFICIENT_RESOURCES;
        else {
            struct simgpu_mig_ci *ci = &gi->ci[id];
            memset(ci, 0, sizeof *ci);
            ci->profile_id = cp.id;
            ci->start = start >= 0 ? (unsigned)start : (unsigned)__builtin_ctz(free);
            ci->size = cp.slices;
            ci->generation = ++m->generation;
            memcpy(ci->uuid, uuid, 16);
            __atomic_store_n(&ci->live, 1, __ATOMIC_RELEASE);
            *out = (unsigned)id;
        }
    }
    unlock(m);
    return rc;
}

int simgpu_mig_ci_destroy(int dev, unsigned g, unsigned c, uint32_t generation)
{
    simgpu_reap_dead();
    struct simgpu_mig_gpu *m = gpu(dev);
    lock(m);
    int rc = NVML_SUCCESS;
    struct simgpu_mig_ci *ci = g < SIMGPU_MIG_MAX_GI && c < SIMGPU_MIG_MAX_CI ? &m->gi[g].ci[c] : NULL;
    if (!ci || !m->gi[g].live || !ci->live || ci->generation != generation)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (ci_busy(dev, g, c))
        rc = NVML_ERROR_IN_USE;   /* "processes (e.g. CUDA application) are active" */
    else
        ci->live = 0;
    unlock(m);
    return rc;
}

int simgpu_mig_ci_remaining(int dev, unsigned g, uint32_t gi_generation, unsigned profile_id, unsigned *count)
{
    struct simgpu_mig_gpu *m = gpu(dev);
    lock(m);
    struct simgpu_mig_ci_profile cp;
    struct simgpu_mig_gi *gi = live_gi(m, g, gi_generation);
    int rc = gi ? ci_profile_of(gi, profile_id, &cp) : NVML_ERROR_INVALID_ARGUMENT;
    if (!rc)
        *count = (unsigned)__builtin_popcount(ci_free_starts(gi, &cp));
    unlock(m);
    return rc;
}

/* === the process's device view === */

struct view_dev {
    int gpu, gi, ci;            /* gi, ci: -1 for a whole GPU */
    uint32_t generation;        /* the CI's, when the view was built */
    uint64_t memory;            /* bytes: the GPU's, or the GI's */
    int sms;
    unsigned char uuid[16];
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
};

static struct {
    int built;
    int count;
    struct view_dev dev[SIMGPU_MAX_DEVICES];
} view;

static void view_add_gpu_itself(int d)
{
    struct view_dev *v = &view.dev[view.count++];
    *v = (struct view_dev){.gpu = d, .gi = -1, .ci = -1, .memory = simgpu_profile()->memory,
                           .sms = simgpu_profile()->sm_count};
    memcpy(v->uuid, simgpu_node()->devices[d].uuid, 16);
    snprintf(v->name, sizeof v->name, "%s", simgpu_profile()->model);
}

static void view_add_ci(int d, const struct simgpu_mig_gi *gis, int g, int c)
{
    for (int i = 0; i < view.count; i++)
        if (view.dev[i].gpu == d && view.dev[i].gi == g)
            return;   /* one CI per GI for a process */
    if (view.count == SIMGPU_MAX_DEVICES)
        return;
    const struct simgpu_mig_gi *gi = &gis[g];
    const struct simgpu_mig_ci *ci = &gi->ci[c];
    const struct simgpu_mig_gi_profile *gp = simgpu_mig_gi_by_id(gi->profile_id);
    struct simgpu_mig_ci_profile cp;
    if (!gp || simgpu_mig_ci_profile(gp, ci->profile_id, &cp))
        return;
    struct view_dev *v = &view.dev[view.count++];
    *v = (struct view_dev){.gpu = d, .gi = g, .ci = c, .generation = ci->generation,
                           .memory = gp->memory_mib * MiB, .sms = (int)cp.sms};
    memcpy(v->uuid, ci->uuid, 16);
    simgpu_mig_device_name(gi, ci, v->name, sizeof v->name);
}

/* A GPU in MIG mode stands for its MIG devices: the first CI of each GI, by GI ID. */
static void view_add_gpu(int d)
{
    for (int i = 0; i < view.count; i++)
        if (view.dev[i].gpu == d && view.dev[i].gi < 0)
            return;
    if (!simgpu_mig_enabled(d)) {
        if (view.count < SIMGPU_MAX_DEVICES)
            view_add_gpu_itself(d);
        return;
    }
    struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
    simgpu_mig_snapshot(d, gis);
    for (int g = 0; g < SIMGPU_MIG_MAX_GI; g++)
        for (int c = 0; gis[g].live && c < SIMGPU_MIG_MAX_CI; c++)
            if (gis[g].ci[c].live) {
                view_add_ci(d, gis, g, c);
                break;
            }
}

static int has_prefix(const char *s, const char *prefix) { return !strncasecmp(s, prefix, strlen(prefix)); }

/* "GPU-<uuid or a prefix of it>": the one GPU it names, or -1. */
static int find_gpu(const char *tok)
{
    int found = -1;
    char s[48];
    for (unsigned d = 0; d < simgpu_node()->device_count; d++) {
        const unsigned char *u = simgpu_node()->devices[d].uuid;
        simgpu_mig_format_uuid(u, s);
        memcpy(s, "GPU", 3);   /* same format, other prefix */
        if (has_prefix(s, tok)) {
            if (found >= 0)
                return -1;   /* ambiguous */
            found = (int)d;
        }
    }
    return found;
}

/* "MIG-<uuid or a prefix of it>": add the CI it names; 0 when it names none. */
static int add_mig(const char *tok)
{
    int ld;
    unsigned lg, lc;
    if (!simgpu_mig_parse_legacy(tok, &ld, &lg, &lc)) {
        struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
        simgpu_mig_snapshot(ld, gis);
        view_add_ci(ld, gis, (int)lg, (int)lc);
        return 1;
    }
    for (unsigned d = 0; d < simgpu_node()->device_count; d++) {
        if (!simgpu_mig_enabled((int)d))
            continue;
        struct simgpu_mig_gi gis[SIMGPU_MIG_MAX_GI];
        simgpu_mig_snapshot((int)d, gis);
        char s[41];
        for (int g = 0; g < SIMGPU_MIG_MAX_GI; g++)
            for (int c = 0; gis[g].live && c < SIMGPU_MIG_MAX_CI; c++)
                if (gis[g].ci[c].live) {
                    simgpu_mig_format_uuid(gis[g].ci[c].uuid, s);
                    if (has_prefix(s, tok)) {
                        view_add_ci((int)d, gis, g, c);
                        return 1;
                    }
                }
    }
    return 0;
}

static void view_build(void)
{
    const char *e = getenv("CUDA_VISIBLE_DEVICES");
    unsigned n = simgpu_node()->device_count;
    if (!e) {
        for (unsigned d = 0; d < n; d++)
            view_add_gpu((int)d);
        return;
    }
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", e);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ' || *tok == '\t')
            tok++;
        size_t len = strlen(tok);
        while (len && (tok[len - 1] == ' ' || tok[len - 1] == '\t'))
            tok[--len] = 0;
        if (has_prefix(tok, "MIG-")) {
            if (len < 5 || !add_mig(tok))
                break;
        } else if (has_prefix(tok, "GPU-")) {
            int d = len < 5 ? -1 : find_gpu(tok);
            if (d < 0)
                break;
            view_add_gpu(d);
        } else {
            char *end;
            errno = 0;
            long d = strtol(tok, &end, 10);
            if (errno || end == tok || *end || d < 0 || d >= (long)n)
                break;   /* CUDA: devices before an invalid entry stay visible */
            view_add_gpu((int)d);
        }
    }
}

static pthread_once_t view_once = PTHREAD_ONCE_INIT;
static void view_build_once(void)
{
    view_build();
    __atomic_store_n(&view.built, 1, __ATOMIC_RELEASE);
}

int simgpu_view_init(void)
{
    pthread_once(&view_once, view_build_once);
    return view.count ? 0 : -1;
}

static int built(void) { return __atomic_load_n(&view.built, __ATOMIC_ACQUIRE); }

int simgpu_view_count(void) { return built() ? view.count : (int)simgpu_node()->device_count; }

/* The view entry of an ordinal; NULL for a whole GPU (or an ordinal outside the view,
 * passed through as the device it names, e.g. host memory's -1). */
static const struct view_dev *mig_entry(int dev)
{
    if (!built() || dev < 0 || dev >= view.count || view.dev[dev].gi < 0)
        return NULL;
    return &view.dev[dev];
}

int simgpu_view_gpu(int dev)
{
    return built() && dev >= 0 && dev < view.count ? view.dev[dev].gpu : dev;
}

uint64_t simgpu_view_memory(int dev)
{
    return built() && dev >= 0 && dev < view.count ? view.dev[dev].memory : simgpu_profile()->memory;
}

int simgpu_view_sm_count(int dev)
{
    return built() && dev >= 0 && dev < view.count ? view.dev[dev].sms : simgpu_profile()->sm_count;
}

void simgpu_view_name(int dev, char *out, unsigned len)
{
    snprintf(out, len, "%s", built() && dev >= 0 && dev < view.count ? view.dev[dev].name : simgpu_profile()->model);
}

void simgpu_view_uuid(int dev, unsigned char out[16])
{
    memcpy(out, built() && dev >= 0 && dev < view.count ? view.dev[dev].uuid
                                                        : simgpu_node()->devices[simgpu_view_gpu(dev)].uuid, 16);
}

static struct simgpu_mig_ci *view_ci(struct simgpu_mig_gpu *m, const struct view_dev *v)
{
    struct simgpu_mig_ci *ci = &m->gi[v->gi].ci[v->ci];
    return m->gi[v->gi].live && ci->live && ci->generation == v->generation ? ci : NULL;
}

/* Memory in a CI comes from its GI's pool: check-and-add against the GI's size across
 * all processes (under the GPU's MIG lock), also counted in the GPU's total. */
int simgpu_view_mem_reserve(int dev, uint64_t bytes)
{
    const struct view_dev *v = mig_entry(dev);
    int d = simgpu_view_gpu(dev);
    if (!v) {
        if (simgpu_mem_reserve(d, bytes))
            return -1;
        if (d >= 0 && d < SIMGPU_MAX_DEVICES && simgpu_mig_enabled(d)) {
            simgpu_mem_release(d, bytes);   /* the GPU went into MIG mode: no whole-GPU memory */
            return -1;
        }
        return 0;
    }
    int slot = simgpu_my_slot();
    if (slot < 0)
        return -1;
    struct simgpu_proc *p = &simgpu_node()->procs[slot];
    struct simgpu_mig_gpu *m = gpu(d);
    for (int attempt = 0; attempt < 2; attempt++) {
        lock(m);
        uint64_t used = simgpu_mig_gi_used(d, (unsigned)v->gi, -1);
        int ok = view_ci(m, v) && bytes <= v->memory && used <= v->memory - bytes;
        if (ok) {
            atomic_fetch_add(&p->mig.gi_mem[d][v->gi], bytes);
            atomic_fetch_add(&p->mem[d], bytes);
        }
        unlock(m);
        if (ok)
            return 0;
        simgpu_reap_dead();   /* maybe a dead process still holds memory */
    }
    return -1;
}

static void sub_saturating(_Atomic uint64_t *a, uint64_t bytes)
{
    uint64_t cur = atomic_load(a);
    while (!atomic_compare_exchange_weak(a, &cur, cur >= bytes ? cur - bytes : 0))
        ;
}

void simgpu_view_mem_release(int dev, uint64_t bytes)
{
    const struct view_dev *v = mig_entry(dev);
    if (!v) {
        simgpu_mem_release(simgpu_view_gpu(dev), bytes);
        return;
    }
    int slot = simgpu_my_slot();
    if (slot < 0)
        return;
    struct simgpu_proc *p = &simgpu_node()->procs[slot];
    sub_saturating(&p->mig.gi_mem[v->gpu][v->gi], bytes);
    sub_saturating(&p->mem[v->gpu], bytes);
}

uint64_t simgpu_view_mem_used(int dev)
{
    const struct view_dev *v = mig_entry(dev);
    return v ? simgpu_mig_gi_used(v->gpu, (unsigned)v->gi, -1) : simgpu_mem_used(simgpu_view_gpu(dev));
}

/* Each CI has its own serial timeline: kernels in different instances never queue behind
 * each other.  (Utilization is not sampled per instance: NVML does not report it on a
 * MIG-enabled GPU.) */
uint64_t simgpu_view_enqueue(int dev, uint64_t dur_ns)
{
    const struct view_dev *v = mig_entry(dev);
    if (!v)
        return simgpu_enqueue(simgpu_view_gpu(dev), dur_ns);
    struct simgpu_mig_gpu *m = gpu(v->gpu);
    struct simgpu_mig_ci *ci = &m->gi[v->gi].ci[v->ci];
    uint64_t now = simgpu_now_ns();
    lock(m);
    uint64_t start = ci->free_at_ns > now ? ci->free_at_ns : now;
    uint64_t end = start + dur_ns;
    ci->free_at_ns = end;
    ci->launches++;
    unlock(m);
    return end;
}

void simgpu_view_note_context(int dev)
{
    const struct view_dev *v = mig_entry(dev);
    simgpu_note_context(simgpu_view_gpu(dev));   /* the GPU lists the process (aggregate) */
    int slot = v ? simgpu_my_slot() : -1;
    if (slot >= 0)
        atomic_fetch_or(&simgpu_node()->procs[slot].mig.ci_contexts[v->gpu][v->gi], 1u << v->ci);
}

void simgpu_view_forget_context(int dev)
{
    const struct view_dev *v = mig_entry(dev);
    if (!v) {
        simgpu_forget_context(simgpu_view_gpu(dev));
        return;
    }
    int slot = simgpu_my_slot();
    if (slot < 0)
        return;
    struct simgpu_mig_proc *p = &simgpu_node()->procs[slot].mig;
    atomic_fetch_and(&p->ci_contexts[v->gpu][v->gi], ~(1u << v->ci));
    for (int g = 0; g < SIMGPU_MIG_MAX_GI; g++)
        if (atomic_load(&p->ci_contexts[v->gpu][g]))
            return;   /* still a context on another CI of this GPU */
    simgpu_forget_context(v->gpu);
}
