/* simgpu's libnvidia-ml.so.1: NVML answered from the shared node state (node.h).
 *
 * Devices, memory and processes come from the node file that every simgpu process maps,
 * so what one process allocates through simgpu's libcuda another process sees here, and
 * a kill -9'ed process drops out as soon as the kernel drops its slot lock.  Utilization
 * comes from each device's kernel timeline.  Nothing runs at load time: the node is
 * attached by nvmlInit*.  This library never claims a process slot of its own: an NVML
 * client is not a GPU process.
 */
#define _GNU_SOURCE
#include "nvml_abi.h"
#include "simgpu/node.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>

_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40 && nvmlMemory_v2 == 0x02000028u, "nvmlMemory_v2_t");
_Static_assert(sizeof(nvmlUtilization_t) == 8, "nvmlUtilization_t");
_Static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "nvmlProcessUtilizationSample_t");
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvmlProcessInfo_v1_t");
_Static_assert(sizeof(nvmlProcessInfo_v2_t) == 24, "nvmlProcessInfo_v2_t");
_Static_assert(sizeof(nvmlProcessDetail_v1_t) == 32, "nvmlProcessDetail_v1_t");

#define DRIVER_VERSION "580.65.06"           /* an R580 driver: the one that ships CUDA 13.0 */
#define NVML_VERSION "13." DRIVER_VERSION
#define CUDA_DRIVER_VERSION 13000
#define UUID_LEN 41                          /* "GPU-" + 36 + NUL */
#define SEC_NS 1000000000ull
#define SEC_US 1000000ull

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

static int initialized(void) { return atomic_load(&init_count) > 0; }

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
static nvmlReturn_t device_index(nvmlDevice_t h, int *dev)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    uintptr_t p = (uintptr_t)h, base = (uintptr_t)devices;
    if (p < base || p >= base + sizeof devices || (p - base) % sizeof devices[0] ||
        h->magic != DEV_MAGIC || h->index >= simgpu_node()->device_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *dev = (int)h->index;
    return NVML_SUCCESS;
}

/* Copy a string out the way NVML does: too small a buffer is an error, not a truncation. */
static nvmlReturn_t put_str(char *dst, unsigned int length, const char *s)
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
    int d;
    nvmlReturn_t r = device_index(device, &d);
    return r ? r : put_str(name, length, simgpu_profile()->model);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
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
    int d;
    nvmlReturn_t r = device_index(device, &d);
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
    return NVML_SUCCESS;
}

/* === utilization === */

/* Percent of [from, to) covered by busy, rounded to nearest. */
static unsigned int percent(uint64_t busy, uint64_t from, uint64_t to)
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

/* One sample per live process that ran kernels on the device in the window
 * [lastSeenTimeStamp, now), clamped to the last second (also when lastSeenTimeStamp is 0).
 * Timestamps are wall-clock microseconds, as with the real driver, so clients that pass
 * time.time()-based values work; every sample carries the time of the call, so passing
 * it back as lastSeenTimeStamp reads the interval since the previous call.  smUtil is
 * that process's share of the window; mem/enc/dec are 0.  No process ran: NOT_FOUND. */
SIMGPU_EXPORT nvmlReturn_t
nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                unsigned int *processSamplesCount,
                                unsigned long long lastSeenTimeStamp)
{
    int d;
    nvmlReturn_t r = device_index(device, &d);
    if (r)
        return r;
    if (!processSamplesCount)
        return NVML_ERROR_INVALID_ARGUMENT;
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
    nvmlProcessUtilizationSample_t samples[SIMGPU_MAX_PROCS];
    unsigned int count = 0;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        int32_t pid = atomic_load(&n->procs[i].pid);
        uint64_t busy = pid > 0 ? simgpu_busy_ns(d, pid, from, now) : 0;
        if (busy)
            samples[count++] = (nvmlProcessUtilizationSample_t){
                .pid = (unsigned int)pid, .timeStamp = now_us, .smUtil = percent(busy, from, now)};
    }
    if (!count)
        return NVML_ERROR_NOT_FOUND;
    if (!utilization || *processSamplesCount < count) {
        *processSamplesCount = count;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(utilization, samples, count * sizeof samples[0]);
    *processSamplesCount = count;
    return NVML_SUCCESS;
}

/* === running processes === */

/* A compute process is a live slot with a context or memory on the device. */
enum proc_abi { GRAPHICS_NONE, PROC_V1, PROC_V2 };

static nvmlReturn_t running_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos,
                                      enum proc_abi abi)
{
    int d;
    nvmlReturn_t r = device_index(device, &d);
    if (r)
        return r;
    if (!infoCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlProcessInfo_v2_t found[SIMGPU_MAX_PROCS];
    unsigned int count = 0;
    if (abi != GRAPHICS_NONE) {
        simgpu_reap_dead();   /* so a kill -9'ed process is gone now, not later */
        struct simgpu_node *n = simgpu_node();
        for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
            int32_t pid = atomic_load(&n->procs[i].pid);
            uint64_t mem = atomic_load(&n->procs[i].mem[d]);
            int has_ctx = (atomic_load(&n->procs[i].context_devices) >> d) & 1;
            if (pid > 0 && (mem > 0 || has_ctx))
                found[count++] = (nvmlProcessInfo_v2_t){
                    .pid = (unsigned int)pid, .usedGpuMemory = mem,
                    .gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT,   /* not MIG */
                    .computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT};
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
