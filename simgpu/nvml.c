/* simgpu's libnvidia-ml.so.1: NVML answered from the shared node state (node.h).
 *
 * Devices, memory and processes come from the node file that every simgpu process maps,
 * so what one process allocates through simgpu's libcuda another process sees here, and
 * a kill -9'ed process drops out as soon as the kernel drops its slot lock.  Utilization
 * comes from each device's kernel timeline.  Nothing runs at load time: the node is
 * attached by nvmlInit*.  This library never claims a process slot of its own: an NVML
 * client is not a GPU process.  The board's figures (identity, PCI, thermals, power,
 * clocks, ECC, BAR1, engines) are nvml_board.c's.
 */
#include "nvml_internal.h"

_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40 && nvmlMemory_v2 == 0x02000028u, "nvmlMemory_v2_t");
_Static_assert(sizeof(nvmlUtilization_t) == 8, "nvmlUtilization_t");
_Static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "nvmlProcessUtilizationSample_t");
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvmlProcessInfo_v1_t");
_Static_assert(sizeof(nvmlProcessInfo_v2_t) == 24, "nvmlProcessInfo_v2_t");
_Static_assert(sizeof(nvmlProcessDetail_v1_t) == 32, "nvmlProcessDetail_v1_t");
_Static_assert(sizeof(nvmlPciInfo_t) == 68 && sizeof(nvmlPciInfo_v2_t) == 52, "nvmlPciInfo_t");
_Static_assert(sizeof(nvmlPciInfoExt_v1_t) == 64 && nvmlPciInfoExt_v1 == 0x01000040u, "nvmlPciInfoExt_v1_t");
_Static_assert(sizeof(nvmlTemperature_v1_t) == 12 && nvmlTemperature_v1 == 0x0100000Cu, "nvmlTemperature_v1_t");
_Static_assert(sizeof(nvmlGpuFabricInfo_v2_t) == 36 && nvmlGpuFabricInfo_v2 == 0x02000024u, "nvmlGpuFabricInfo_v2_t");
_Static_assert(sizeof(nvmlGpuFabricInfo_v3_t) == 40 && nvmlGpuFabricInfo_v3 == 0x03000028u, "nvmlGpuFabricInfo_v3_t");

/* === init === */

static _Atomic int init_count;   /* nvmlInit* successes minus nvmlShutdown calls */

SIMGPU_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;   /* NO_GPUS / NO_ATTACH change nothing: simulated devices always attach */
    if (simgpu_attach())
        return NVML_ERROR_DRIVER_NOT_LOADED;   /* simgpu already said why on stderr */
    atomic_fetch_add(&init_count, 1);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
SIMGPU_EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

SIMGPU_EXPORT nvmlReturn_t nvmlShutdown(void)
{
    int c = atomic_load(&init_count);
    do {
        if (c <= 0)
            return NVML_ERROR_UNINITIALIZED;
    } while (!atomic_compare_exchange_weak(&init_count, &c, c - 1));
    return NVML_SUCCESS;   /* the node stays mapped: a later nvmlInit finds it again */
}

int initialized(void) { return atomic_load(&init_count) > 0; }

/* === handles === */

/* A handle points into this array; the magic and the range check catch stray pointers. */
#define DEV_MAGIC 0x4c4d564eu
static struct nvmlDevice_st {
    unsigned int magic;
    unsigned int index;
} devices[SIMGPU_MAX_DEVICES] = {
    {DEV_MAGIC, 0}, {DEV_MAGIC, 1}, {DEV_MAGIC, 2}, {DEV_MAGIC, 3},
    {DEV_MAGIC, 4}, {DEV_MAGIC, 5}, {DEV_MAGIC, 6}, {DEV_MAGIC, 7},
};
_Static_assert(SIMGPU_MAX_DEVICES == 8, "one handle per possible device");

/* Resolve a handle to a device index, or say what is wrong with the call. */
nvmlReturn_t device_index(nvmlDevice_t h, int *dev)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (simgpu_nvml_is_mig(h))
        return NVML_ERROR_NOT_SUPPORTED;   /* a MIG device: only the calls that say so answer (nvml_mig.h) */
    uintptr_t p = (uintptr_t)h, base = (uintptr_t)devices;
    if (p < base || p >= base + sizeof devices || (p - base) % sizeof devices[0] ||
        h->magic != DEV_MAGIC || h->index >= simgpu_node()->device_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (simgpu_gpu_lost((int)h->index))
        return NVML_ERROR_GPU_IS_LOST;   /* fallen off the bus: what nvml.h documents for device queries */
    *dev = (int)h->index;
    return NVML_SUCCESS;
}

/* Copy a string out the way NVML does: too small a buffer is an error, not a truncation. */
nvmlReturn_t put_str(char *dst, unsigned int length, const char *s)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

/* === errors === */

SIMGPU_EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: return "ECC is not supported on vGPU";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "Frequency not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    case NVML_ERROR_RESET_TYPE_NOT_SUPPORTED: return "Reset type not supported";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    }
    return "Unknown Error";
}

/* === system === */

SIMGPU_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    return initialized() ? put_str(version, length, DRIVER_VERSION) : NVML_ERROR_UNINITIALIZED;
}

SIMGPU_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    return initialized() ? put_str(version, length, NVML_VERSION) : NVML_ERROR_UNINITIALIZED;
}

SIMGPU_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!cudaDriverVersion)
        return NVML_ERROR_INVALID_ARGUMENT;
    *cudaDriverVersion = CUDA_DRIVER_VERSION;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

SIMGPU_EXPORT nvmlReturn_t nvmlSystemGetProcessName(unsigned int pid, char *name,
                                                    unsigned int length)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!name || !length)
        return NVML_ERROR_INVALID_ARGUMENT;
    char comm[64] = "", path[64];
    snprintf(path, sizeof path, "/proc/%u/comm", pid);
    FILE *f = fopen(path, "re");
    if (f) {
        if (!fgets(comm, sizeof comm, f))
            comm[0] = 0;
        comm[strcspn(comm, "\n")] = 0;
        fclose(f);
    }
    /* Not visible here (another pid namespace): the slot remembers what it was called. */
    struct simgpu_node *n = simgpu_node();
    for (int i = 0; !comm[0] && pid && i < SIMGPU_MAX_PROCS; i++)
        if ((unsigned int)atomic_load(&n->procs[i].pid) == pid)
            snprintf(comm, sizeof comm, "%.*s", (int)sizeof n->procs[i].comm, n->procs[i].comm);
    for (int i = 0; !comm[0] && pid && i < SIMGPU_MAX_SHARED; i++)
        if (atomic_load(&n->shared[i].id) && (unsigned int)n->shared[i].owner_pid == pid)
            snprintf(comm, sizeof comm, "%.*s", (int)sizeof n->shared[i].comm, n->shared[i].comm);
    if (!comm[0])
        return NVML_ERROR_NOT_FOUND;
    snprintf(name, length, "%s", comm);   /* the documented contract: at most length bytes */
    return NVML_SUCCESS;
}

/* === devices === */

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!deviceCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = simgpu_node()->device_count;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= simgpu_node()->device_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (simgpu_gpu_lost((int)index))
        return NVML_ERROR_GPU_IS_LOST;   /* documented for nvmlDeviceGetHandleByIndex_v2 */
    *device = &devices[index];
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

static void format_uuid(int dev, char out[UUID_LEN])
{
    const unsigned char *u = simgpu_node()->devices[dev].uuid;
    snprintf(out, UUID_LEN,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12],
             u[13], u[14], u[15]);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!strncasecmp(uuid, "MIG-", 4))
        return simgpu_nvml_mig_by_uuid(uuid, device);
    char s[UUID_LEN];
    for (unsigned int i = 0; i < simgpu_node()->device_count; i++) {
        format_uuid((int)i, s);
        if (strcasecmp(s, uuid) == 0) {
            *device = &devices[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    if (simgpu_nvml_is_mig(device))
        return simgpu_nvml_mig_index(device, index);
    int d;
    nvmlReturn_t r = device_index(device, &d);
    if (r)
        return r;
    if (!index)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)d;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    if (simgpu_nvml_is_mig(device))
        return simgpu_nvml_mig_name(device, name, length);
    int d;
    nvmlReturn_t r = device_index(device, &d);
    return r ? r : put_str(name, length, simgpu_profile()->model);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    if (simgpu_nvml_is_mig(device))
        return simgpu_nvml_mig_uuid(device, uuid, length);
    int d;
    nvmlReturn_t r = device_index(device, &d);
    if (r)
        return r;
    char s[UUID_LEN];
    format_uuid(d, s);
    return put_str(uuid, length, s);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major,
                                                              int *minor)
{
    int d;   /* a MIG device has its GPU's compute capability */
    nvmlReturn_t r = simgpu_nvml_is_mig(device) ? simgpu_nvml_mig_parent(device, &d) : device_index(device, &d);
    if (r)
        return r;
    if (!major || !minor)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = simgpu_profile()->cc_major;
    *minor = simgpu_profile()->cc_minor;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetMultiGpuBoard(nvmlDevice_t device,
                                                      unsigned int *multiGpuBool)
{
    int d;
    nvmlReturn_t r = device_index(device, &d);
    if (r)
        return r;
    if (!multiGpuBool)
        return NVML_ERROR_INVALID_ARGUMENT;
    *multiGpuBool = 0;   /* every simulated device is its own board */
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!pciBusId || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int domain = 0, bus, dev, fn;
    if (sscanf(pciBusId, "%x:%x:%x.%x", &domain, &bus, &dev, &fn) != 4 &&
        (domain = 0, sscanf(pciBusId, "%x:%x.%x", &bus, &dev, &fn) != 3))
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < simgpu_node()->device_count; i++)
        if (domain == 0 && bus == 0x10 + i && dev == 0 && fn == 0) {
            *device = &devices[i];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

/* === memory === */

/* Node-wide use, after returning what dead processes held. */
static void memory(int dev, unsigned long long *total, unsigned long long *used)
{
    simgpu_reap_dead();
    *total = simgpu_profile()->memory;
    *used = simgpu_mem_used(dev);
    if (*used > *total)
        *used = *total;   /* never a negative free, even mid-update */
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *mem)
{
    if (simgpu_nvml_is_mig(device))
        return simgpu_nvml_mig_memory(device, mem);
    int d;
    nvmlReturn_t r = device_index(device, &d);
    if (r)
        return r;
    if (!mem)
        return NVML_ERROR_INVALID_ARGUMENT;
    memory(d, &mem->total, &mem->used);
    mem->free = mem->total - mem->used;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *mem)
{
    if (simgpu_nvml_is_mig(device))
        return simgpu_nvml_mig_memory_v2(device, mem);
    int d;
    nvmlReturn_t r = device_index(device, &d);
    if (r)
        return r;
    if (!mem)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (mem->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory(d, &mem->total, &mem->used);
    mem->reserved = 0;   /* no firmware to hold any */
    mem->free = mem->total - mem->used;
    /* nvml.h: read "while in that cgroup", it shows what the cgroup may still allocate */
    uint64_t room = simgpu_limit_room(d);
    if (room < mem->free)
        mem->free = room;
    return NVML_SUCCESS;
}

/* === per-cgroup memory limits (limits.c says what is modelled) === */

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t *limits)
{
    if (simgpu_nvml_is_mig(device))
        return NVML_ERROR_NOT_SUPPORTED;   /* nvml.h: MIG handles are not supported */
    int d;
    nvmlReturn_t r = device_index(device, &d);
    if (r)
        return r;
    if (!limits)
        return NVML_ERROR_INVALID_ARGUMENT;
    return (nvmlReturn_t)simgpu_limit_set(d, limits->nameSpace, limits->softLimit, limits->hardLimit);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limits)
{
    if (simgpu_nvml_is_mig(device))
        return NVML_ERROR_NOT_SUPPORTED;
    int d;
    nvmlReturn_t r = device_index(device, &d);
    if (r)
        return r;
    if (!limits || !limits->nameSpace)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!simgpu_limits_supported())
        return NVML_ERROR_NOT_SUPPORTED;
    struct stat st;
    if (stat(limits->nameSpace, &st) || !S_ISDIR(st.st_mode))
        return NVML_ERROR_OPERATING_SYSTEM;
    uint64_t soft, hard, used;
    if (simgpu_limit_get(d, limits->nameSpace, &soft, &hard, &used))
        return NVML_ERROR_NOT_FOUND;
    limits->softLimit = soft, limits->hardLimit = hard, limits->currentUsed = used;
    return NVML_SUCCESS;
}

/* === utilization === */

/* Percent of [from, to) covered by busy, rounded to nearest. */
unsigned int percent(uint64_t busy, uint64_t from, uint64_t to)
{
    uint64_t span = to - from;
    uint64_t p = (busy * 100 + span / 2) / span;
    return p > 100 ? 100 : (unsigned int)p;
}

/* gpu: share of the last second some kernel ran.  memory: always 0 — simgpu does not
 * model memory bandwidth. */
SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device,
                                                         nvmlUtilization_t *utilization)
{
    int d;
    nvmlReturn_t r = device_index(device, &d);
    if (r)
        return r;
    if (simgpu_mig_enabled(d))
        return NVML_ERROR_NOT_SUPPORTED;   /* nvml.h: not supported on MIG-enabled GPUs */
    if (!utilization)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t now = simgpu_now_ns(), from = now > SEC_NS ? now - SEC_NS : 0;
    utilization->gpu = now > from ? percent(simgpu_busy_ns(d, 0, from, now), from, now) : 0;
    utilization->memory = 0;
    return NVML_SUCCESS;
}

static uint64_t wall_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * SEC_US + (uint64_t)ts.tv_nsec / 1000u;
}

/* SIMGPU_PROCESS_SAMPLE_MS=P (unset or 0: off): answer as a driver that samples each process
 * every P ms rather than over whatever window is asked for.  nvml.h
 * (nvmlDeviceGetProcessUtilization): one sample structure per process, stamped with the CPU
 * time it was recorded, and only those newer than lastSeenTimeStamp; nvidia-smi(1): the
 * utilization sample period is 1/6 s to 1 s by product.  Each process has a phase of its
 * own (a V100's single answer has held busy processes' samples seconds apart, as published
 * in the KubernetesNotes repository's gpu/nvml-python notes).  A sample is its process's
 * share of the period before its timestamp, and the answer for a process is the average of
 * its samples newer than lastSeenTimeStamp, stamped with the latest: nvml.h
 * (nvmlDeviceGetProcessesUtilizationInfo: 0 reads "utilization based on all the samples
 * maintained by the driver's internal sample buffer", a timestamp of a previous query
 * "utilization since the previous query"), as clients saw it (nvitop pull request 85: an
 * older lastSeenTimeStamp returns the average rather than the instant value; ksysguard6
 * pull request 18: all samples give a rolling average).  The buffer is taken to hold the
 * last second, as without P. */
static uint64_t sample_period_us(void)
{
    static _Atomic long long period = -1;
    long long p = atomic_load(&period);
    if (p < 0) {
        const char *e = getenv("SIMGPU_PROCESS_SAMPLE_MS");
        p = e ? atoll(e) * 1000 : 0;
        atomic_store(&period, p > 0 ? p : 0);
    }
    return p > 0 ? (uint64_t)p : 0;
}

/* One sample per live process that ran kernels on the device in the window
 * [lastSeenTimeStamp, now), clamped to the last second (also when lastSeenTimeStamp is 0).
 * Timestamps are wall-clock microseconds, as with the real driver, so clients that pass
 * time.time()-based values work; every sample carries the time of the call, so passing
 * it back as lastSeenTimeStamp reads the interval since the previous call (with
 * SIMGPU_PROCESS_SAMPLE_MS: its process's latest sample and its time, as above).  smUtil is
 * that process's share of the window; the other engines are 0.  No process ran:
 * NOT_FOUND.  Fills samples[] (SIMGPU_MAX_PROCS) and *count. */
static nvmlReturn_t utilization_samples(nvmlDevice_t device, unsigned long long lastSeenTimeStamp,
                                        nvmlProcessUtilizationSample_t *samples, unsigned int *count)
{
    int d;
    nvmlReturn_t r = device_index(device, &d);
    if (r)
        return r;
    if (simgpu_mig_enabled(d))
        return NVML_ERROR_NOT_SUPPORTED;   /* nvml.h: not supported on MIG-enabled GPUs */
    uint64_t now = simgpu_now_ns(), now_us = wall_us();
    uint64_t from = now > SEC_NS ? now - SEC_NS : 0;
    if (lastSeenTimeStamp >= now_us)
        return NVML_ERROR_NOT_FOUND;   /* nothing newer than what the caller has seen */
    if (lastSeenTimeStamp && now_us - lastSeenTimeStamp < SEC_US &&
        (now_us - lastSeenTimeStamp) * 1000 < now - from)   /* newer than the 1 s clamp */
        from = now - (now_us - lastSeenTimeStamp) * 1000;
    if (from >= now)
        return NVML_ERROR_NOT_FOUND;

    simgpu_reap_dead();
    struct simgpu_node *n = simgpu_node();
    uint64_t period_us = sample_period_us();
    *count = 0;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        int32_t pid = atomic_load(&n->procs[i].pid);
        if (pid <= 0)
            continue;
        uint64_t a = from, b = now, stamp = now_us;
        if (period_us) {
            /* Its samples newer than the caller's: each counts whole, so a sample's stamp
             * must pass `after`, both lastSeenTimeStamp and the point from which its whole
             * period lies in the buffer's second.  `stamp` is the latest, `first` the oldest. */
            uint64_t phase = (uint64_t)pid * 7919u % period_us;
            uint64_t after = now_us - SEC_US + period_us - 1;
            after = lastSeenTimeStamp > after ? lastSeenTimeStamp : after;
            if (now_us < phase + period_us || after < phase)
                continue;
            stamp = (now_us - phase) / period_us * period_us + phase;
            uint64_t first = (after - phase) / period_us * period_us + phase + period_us;
            if (first > stamp || (now_us - first + period_us) * 1000 > now)
                continue;
            b = now - (now_us - stamp) * 1000;
            a = b - (stamp - first + period_us) * 1000;
        }
        uint64_t busy = simgpu_busy_ns(d, pid, a, b);
        if (busy)
            samples[(*count)++] = (nvmlProcessUtilizationSample_t){
                .pid = (unsigned int)pid, .timeStamp = stamp, .smUtil = percent(busy, a, b)};
    }
    return *count ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
}

SIMGPU_EXPORT nvmlReturn_t
nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                unsigned int *processSamplesCount,
                                unsigned long long lastSeenTimeStamp)
{
    nvmlProcessUtilizationSample_t samples[SIMGPU_MAX_PROCS];
    unsigned int count;
    if (!processSamplesCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = utilization_samples(device, lastSeenTimeStamp, samples, &count);
    if (r)
        return r;
    if (!utilization || *processSamplesCount < count) {
        *processSamplesCount = count;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(utilization, samples, count * sizeof samples[0]);
    *processSamplesCount = count;
    return NVML_SUCCESS;
}

/* The same samples in the versioned struct of newer drivers (jpg and ofa engines too). */
SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                                 nvmlProcessesUtilizationInfo_t *info)
{
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlProcessesUtilizationInfo_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlProcessUtilizationSample_t samples[SIMGPU_MAX_PROCS];
    unsigned int count;
    nvmlReturn_t r = utilization_samples(device, info->lastSeenTimeStamp, samples, &count);
    if (r)
        return r;
    if (!info->procUtilArray || info->processSamplesCount < count) {
        info->processSamplesCount = count;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < count; i++)
        info->procUtilArray[i] = (nvmlProcessUtilizationInfo_v1_t){
            .timeStamp = samples[i].timeStamp, .pid = samples[i].pid, .smUtil = samples[i].smUtil};
    info->processSamplesCount = count;
    return NVML_SUCCESS;
}

/* === running processes === */

/* A compute process is a live slot with a context or memory on the device. */
enum proc_abi { GRAPHICS_NONE, PROC_V1, PROC_V2 };

static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos,
                                      enum proc_abi abi)
{
    if (simgpu_nvml_is_mig(device) && abi != GRAPHICS_NONE)
        return simgpu_nvml_mig_processes(device, infoCount, infos, abi == PROC_V1);
    int d;
    nvmlReturn_t r = device_index(device, &d);
    if (r)
        return r;
    if (!infoCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlProcessInfo_v2_t found[SIMGPU_MAX_PROCS + SIMGPU_MAX_SHARED];
    unsigned int count = 0;
    if (abi != GRAPHICS_NONE) {
        simgpu_reap_dead();   /* so a kill -9'ed process is gone now, not later */
        struct simgpu_node *n = simgpu_node();
        for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
            int32_t pid = atomic_load(&n->procs[i].pid);
            uint64_t mem = atomic_load(&n->procs[i].mem[d]);
            int has_ctx = (atomic_load(&n->procs[i].context_devices) >> d) & 1;
            if (pid > 0 && (mem > 0 || has_ctx)) {
                found[count] = (nvmlProcessInfo_v2_t){
                    .pid = (unsigned int)pid, .usedGpuMemory = mem,
                    .gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT,   /* not MIG */
                    .computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT};
                if (simgpu_mig_enabled(d))   /* aggregate: each process with its instance */
                    simgpu_nvml_mig_process_ids(d, i, &found[count].gpuInstanceId, &found[count].computeInstanceId);
                count++;
            }
        }
        /* memory more than one process holds: under the process that allocated it, dead
         * or alive (node.h, struct simgpu_shared) */
        for (int i = 0; i < SIMGPU_MAX_SHARED; i++) {
            struct simgpu_shared *sh = &n->shared[i];
            uint64_t mem = atomic_load(&sh->bytes);
            if (!atomic_load(&sh->id) || sh->dev != d || !mem)
                continue;
            unsigned int k = 0;
            while (k < count && found[k].pid != (unsigned int)sh->owner_pid)
                k++;
            if (k == count)
                found[count++] = (nvmlProcessInfo_v2_t){
                    .pid = (unsigned int)sh->owner_pid, .usedGpuMemory = 0,
                    .gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT, .computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT};
            found[k].usedGpuMemory += mem;
        }
    }
    return vgpu_nvml_put_processes(found, count, infoCount, infos, abi == PROC_V1);
}

/* Same body, three ABIs each: unsuffixed = v1 struct, _v2 and _v3 = v2 struct. */
#define RUNNING(name, type, abi)                                                       \
    SIMGPU_EXPORT nvmlReturn_t name(nvmlDevice_t device, unsigned int *infoCount,     \
                                    type *infos)                                      \
    {                                                                                  \
        return running_processes(device, infoCount, infos, abi);                       \
    }

RUNNING(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t, PROC_V1)
RUNNING(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_v2_t, PROC_V2)
RUNNING(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_t, PROC_V2)
/* simgpu has no graphics or MPS clients: these always report none. */
RUNNING(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t, GRAPHICS_NONE)
RUNNING(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_v2_t, GRAPHICS_NONE)
RUNNING(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t, GRAPHICS_NONE)
RUNNING(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t, GRAPHICS_NONE)

/* The running processes of one mode (compute, graphics, MPS) in the versioned detail
 * struct that drivers from R550 export and nvitop prefers: the compute list as above
 * (usedGpuCcProtectedMemory 0: no confidential computing), none for the others. */
SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device, nvmlProcessDetailList_t *plist)
{
    if (!plist)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (plist->version != nvmlProcessDetailList_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (plist->mode > NVML_PROCESS_MODE_MPS)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlProcessInfo_v2_t found[SIMGPU_MAX_PROCS + SIMGPU_MAX_SHARED];
    unsigned int count = SIMGPU_MAX_PROCS + SIMGPU_MAX_SHARED;
    nvmlReturn_t r = running_processes(device, &count, found,
                                       plist->mode == NVML_PROCESS_MODE_COMPUTE ? PROC_V2 : GRAPHICS_NONE);
    if (r)
        return r;
    if (count && (!plist->procArray || plist->numProcArrayEntries < count)) {
        plist->numProcArrayEntries = count;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < count; i++)
        plist->procArray[i] = (nvmlProcessDetail_v1_t){
            .pid = found[i].pid, .usedGpuMemory = found[i].usedGpuMemory, .gpuInstanceId = found[i].gpuInstanceId,
            .computeInstanceId = found[i].computeInstanceId};
    plist->numProcArrayEntries = count;
    return NVML_SUCCESS;
}

/* === events (nvml.h "Event Handling Methods") ===
 * As NVML documents them: nvmlDeviceRegisterEvents "Starts recording of events on a
 * specified devices and add the events to specified nvmlEventSet_t" (events from before
 * the call are not recorded; a type the device does not support is
 * NVML_ERROR_NOT_SUPPORTED); nvmlEventSetWait_v2 returns at once when an event is ready,
 * else "sleeps till event arrives but not longer than specified timeout"
 * (NVML_ERROR_TIMEOUT), and NVML_ERROR_GPU_IS_LOST "if a GPU has fallen off the bus"; on
 * Linux "every Xid error event would return the associated event data"; for a whole GPU
 * gpuInstanceId and computeInstanceId are 0xFFFFFFFF.  simgpu supports XID critical errors
 * only, raised by tests (node.c: simgpuRaiseXid, simgpuLoseGpu). */

#define EVENT_SET_MAGIC 0x54455645u
#define SUPPORTED_EVENTS nvmlEventTypeXidCriticalError
#define WHOLE_GPU 0xFFFFFFFFu
struct nvmlEventSet_st {
    unsigned int magic;
    pthread_mutex_t lock;
    unsigned long long types[SIMGPU_MAX_DEVICES];   /* registered, per GPU */
    uint64_t from[SIMGPU_MAX_DEVICES];              /* the first event each GPU's registration records */
    uint64_t next;                                  /* the next node event to look at */
};

static int event_set_ok(nvmlEventSet_t set)
{
    return set && set->magic == EVENT_SET_MAGIC;
}

SIMGPU_EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct nvmlEventSet_st *s = calloc(1, sizeof *s);
    if (!s)
        return NVML_ERROR_MEMORY;
    s->magic = EVENT_SET_MAGIC;
    pthread_mutex_init(&s->lock, NULL);
    s->next = atomic_load(&simgpu_node()->health.raised);
    *set = s;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    int d;
    nvmlReturn_t r = device_index(device, &d);
    if (r)
        return r;
    if (!eventTypes)
        return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = SUPPORTED_EVENTS;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                                    nvmlEventSet_t set)
{
    int d;
    nvmlReturn_t r = device_index(device, &d);
    if (r)
        return r;
    if (!event_set_ok(set))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (eventTypes & ~SUPPORTED_EVENTS)
        return NVML_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&set->lock);
    if (!(set->types[d] & eventTypes))
        set->from[d] = atomic_load(&simgpu_node()->health.raised);
    set->types[d] |= eventTypes;
    pthread_mutex_unlock(&set->lock);
    return NVML_SUCCESS;
}

/* The next event of the set, if one is ready: 1 (data set), 0 (none yet), -1 (a GPU it
 * watches is lost, and nothing is pending). */
static int next_event(nvmlEventSet_t set, nvmlEventData_t *data)
{
    uint64_t raised = atomic_load(&simgpu_node()->health.raised);
    if (raised - set->next > SIMGPU_XID_RING)
        set->next = raised - SIMGPU_XID_RING;   /* older ones were overwritten: lost to this set */
    for (; set->next < raised; set->next++) {
        int gpu;
        unsigned xid;
        if (simgpu_xid_event(set->next, &gpu, &xid))
            return 0;   /* raised, not written yet: looked at again */
        if (gpu < 0 || gpu >= SIMGPU_MAX_DEVICES || !(set->types[gpu] & nvmlEventTypeXidCriticalError) ||
            set->next < set->from[gpu])
            continue;
        set->next++;
        *data = (nvmlEventData_t){.device = &devices[gpu], .eventType = nvmlEventTypeXidCriticalError,
                                  .eventData = xid, .gpuInstanceId = WHOLE_GPU, .computeInstanceId = WHOLE_GPU};
        return 1;
    }
    for (int d = 0; d < SIMGPU_MAX_DEVICES; d++)
        if (set->types[d] && simgpu_gpu_lost(d))
            return -1;
    return 0;
}

SIMGPU_EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!event_set_ok(set) || !data)
        return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t deadline = simgpu_now_ns() + (uint64_t)timeoutms * 1000000ull;
    for (;;) {
        uint32_t seen = atomic_load(&simgpu_node()->health.changes);
        pthread_mutex_lock(&set->lock);
        int got = next_event(set, data);
        pthread_mutex_unlock(&set->lock);
        if (got)
            return got > 0 ? NVML_SUCCESS : NVML_ERROR_GPU_IS_LOST;
        uint64_t now = simgpu_now_ns();
        if (now >= deadline)
            return NVML_ERROR_TIMEOUT;
        /* asleep until a change (or 50 ms: an event raised, not yet written, is looked at again) */
        simgpu_health_wait(seen, deadline - now < 50000000ull ? deadline - now : 50000000ull);
    }
}

SIMGPU_EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

SIMGPU_EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!event_set_ok(set))
        return NVML_ERROR_INVALID_ARGUMENT;
    set->magic = 0;
    pthread_mutex_destroy(&set->lock);
    free(set);
    return NVML_SUCCESS;
}
