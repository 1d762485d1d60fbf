/* view.c — inside a slice, NVML shows the slice's memory and names no process but the
 * slice's own.
 *
 * Every NVML answer that lists processes or carries a pid (process lists of each mode,
 * process utilization samples, encoder and frame-capture sessions, accounting) is the
 * driver's answer with other slices' entries taken out, on every device, the slice's own
 * or not.  A process is the slice's when its usage file holds a slot for that pid, or it
 * is the caller (NVML reports pids of the namespace the tools see it in; as with the rest
 * of the shim's NVML view, a container whose pid namespace differs from the driver's sees
 * none of its own either).  The compute process lists of the slice's devices are made
 * from the usage file instead, as are the memory figures ("NVML view", at the end).
 * Device-wide figures without pids (utilization rates, samples) are not per-process and
 * not here.
 *
 * Fails closed: when the driver's list cannot be read whole (it grew four times between
 * two reads, or no memory for it), the caller gets the driver's error or
 * NVML_ERROR_MEMORY, never an unfiltered list.
 */
#include "internal.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

/* Is pid one of the slice's processes? */
static int own_pid(unsigned int pid)
{
    if (!pid)
        return 0;
    if (pid == (unsigned int)getpid())
        return 1;
    for (int i = 0; S.usage && i < VGPU_MAX_PROCS; i++)
        if ((unsigned int)LOAD(&S.usage->procs[i].pid) == pid)
            return 1;
    return 0;
}

/* Keep the slice's entries of n records of `size` bytes whose pid is at `pid_at`; returns
 * how many are left (in place, in order). */
static unsigned int keep_own(void *items, unsigned int n, size_t size, size_t pid_at)
{
    unsigned int kept = 0;
    for (unsigned int i = 0; i < n; i++) {
        char *item = (char *)items + i * size;
        unsigned int pid;
        memcpy(&pid, item + pid_at, sizeof pid);
        if (own_pid(pid)) {
            if (kept != i)
                memmove((char *)items + kept * size, item, size);
            kept++;
        }
    }
    return kept;
}

/* One read of the driver's list into buf (room for *n records; buf may be NULL with *n 0). */
typedef nvmlReturn_t (*fetch_fn)(const void *args, unsigned int *n, void *buf);

/* The driver's whole list (malloc'ed into *out, *n records): read once to learn its length
 * (a list call given no room answers INSUFFICIENT_SIZE, or SUCCESS with the count for the
 * session calls), then with room for it, again if it grew in between.  `none_found`: the
 * driver's way of saying the list is empty (NOT_FOUND for utilization samples), read as 0. */
static nvmlReturn_t fetch_all(fetch_fn fetch, const void *args, size_t size, nvmlReturn_t none_found,
                              void **out, unsigned int *n)
{
    void *buf = NULL;
    unsigned int room = 0;
    for (int tries = 0; tries < 4; tries++) {
        *n = room;
        nvmlReturn_t r = fetch(args, n, buf);
        if (r == none_found && none_found != NVML_SUCCESS) {
            *n = 0;
            r = NVML_SUCCESS;
        }
        if (r == NVML_SUCCESS && (buf || !*n)) {
            *out = buf;
            return NVML_SUCCESS;
        }
        if (r != NVML_SUCCESS && r != NVML_ERROR_INSUFFICIENT_SIZE) {
            free(buf);
            return r;
        }
        room = *n + 8;   /* some slack: the list may grow before the next read */
        void *bigger = realloc(buf, (size_t)room * size);
        if (!bigger) {
            free(buf);
            return NVML_ERROR_MEMORY;
        }
        buf = bigger;
    }
    free(buf);
    return NVML_ERROR_INSUFFICIENT_SIZE;   /* it kept growing: fail closed */
}

/* The slice's part of the driver's list, copied out with NVML's count-in/out contract:
 * too little room gives the count needed and INSUFFICIENT_SIZE (or, for the session
 * calls, `count_only_ok`: a count of 0 on input asks for the count, NVML_SUCCESS). */
static nvmlReturn_t own_list(fetch_fn fetch, const void *args, size_t size, size_t pid_at, nvmlReturn_t none_found,
                             int count_only_ok, unsigned int *count, void *out)
{
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    void *all = NULL;
    unsigned int n;
    nvmlReturn_t r = fetch_all(fetch, args, size, none_found, &all, &n);
    if (r != NVML_SUCCESS)
        return r;
    unsigned int kept = all ? keep_own(all, n, size, pid_at) : 0;
    if (!kept && none_found != NVML_SUCCESS) {
        free(all);
        return none_found;
    }
    if (count_only_ok && *count == 0) {
        *count = kept;
        free(all);
        return NVML_SUCCESS;
    }
    if (*count < kept || (kept && !out)) {
        *count = kept;
        free(all);
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (kept)
        memcpy(out, all, (size_t)kept * size);
    *count = kept;
    free(all);
    return NVML_SUCCESS;
}

/* === process lists of each mode === */

struct list_args {
    nvmlDevice_t device;
    nvmlReturn_t (*real)(nvmlDevice_t, unsigned int *, void *);
};

static nvmlReturn_t fetch_list(const void *a, unsigned int *n, void *buf)
{
    const struct list_args *args = a;
    return args->real(args->device, n, buf);
}

#define OWN_PROCESS_LIST(sym, type)                                                                              \
    SHIM_EXPORT nvmlReturn_t sym(nvmlDevice_t device, unsigned int *infoCount, type *infos)                   \
    {                                                                                                          \
        NVML_ENTER(sym, device, infoCount, infos);                                                             \
        struct list_args args = {device, (nvmlReturn_t(*)(nvmlDevice_t, unsigned int *, void *))real_##sym}; \
        return own_list(fetch_list, &args, sizeof(type), offsetof(type, pid), NVML_SUCCESS, 0, infoCount,     \
                        infos);                                                                                \
    }

OWN_PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses, nvmlProcessInfo_v1_t)
OWN_PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlProcessInfo_v2_t)
OWN_PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlProcessInfo_t)
OWN_PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses, nvmlProcessInfo_v1_t)
OWN_PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlProcessInfo_v2_t)
OWN_PROCESS_LIST(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlProcessInfo_t)

/* A device that is none of the slice's: the driver's compute list, the slice's part of it
 * (own_processes, below, makes the list of the slice's own devices from its usage file). */
nvmlReturn_t view_compute_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos, size_t size,
                                    nvmlReturn_t (*real)(nvmlDevice_t, unsigned int *, void *))
{
    struct list_args args = {device, real};
    return own_list(fetch_list, &args, size, 0, NVML_SUCCESS, 0, infoCount, infos);
}

/* The detail list (one mode per call, its array inside the struct). */
struct detail_args {
    nvmlDevice_t device;
    const nvmlProcessDetailList_t *plist;
};

static nvmlReturn_t fetch_detail(const void *a, unsigned int *n, void *buf)
{
    const struct detail_args *args = a;
    nvmlProcessDetailList_t l = *args->plist;
    l.numProcArrayEntries = *n;
    l.procArray = buf;
    nvmlReturn_t r = real_nvmlDeviceGetRunningProcessDetailList(args->device, &l);
    *n = l.numProcArrayEntries;
    return r;
}

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device, nvmlProcessDetailList_t *plist)
{
    NVML_ENTER(nvmlDeviceGetRunningProcessDetailList, device, plist);
    if (!plist)
        return real_nvmlDeviceGetRunningProcessDetailList(device, plist);
    struct detail_args args = {device, plist};
    unsigned int count = plist->numProcArrayEntries;
    nvmlReturn_t r = own_list(fetch_detail, &args, sizeof(nvmlProcessDetail_v1_t), offsetof(nvmlProcessDetail_v1_t, pid),
                              NVML_SUCCESS, 0, &count, plist->procArray);
    if (r == NVML_SUCCESS || r == NVML_ERROR_INSUFFICIENT_SIZE)
        plist->numProcArrayEntries = count;
    return r;
}

/* === per-process utilization === */

struct samples_args {
    nvmlDevice_t device;
    unsigned long long since;
};

static nvmlReturn_t fetch_samples(const void *a, unsigned int *n, void *buf)
{
    const struct samples_args *args = a;
    return real_nvmlDeviceGetProcessUtilization(args->device, buf, n, args->since);
}

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                                         unsigned int *processSamplesCount,
                                                         unsigned long long lastSeenTimeStamp)
{
    NVML_ENTER(nvmlDeviceGetProcessUtilization, device, utilization, processSamplesCount, lastSeenTimeStamp);
    struct samples_args args = {device, lastSeenTimeStamp};
    return own_list(fetch_samples, &args, sizeof *utilization, offsetof(nvmlProcessUtilizationSample_t, pid),
                    NVML_ERROR_NOT_FOUND, 0, processSamplesCount, utilization);
}

struct info_args {
    nvmlDevice_t device;
    const nvmlProcessesUtilizationInfo_t *info;
};

static nvmlReturn_t fetch_info(const void *a, unsigned int *n, void *buf)
{
    const struct info_args *args = a;
    nvmlProcessesUtilizationInfo_t i = *args->info;
    i.processSamplesCount = *n;
    i.procUtilArray = buf;
    nvmlReturn_t r = real_nvmlDeviceGetProcessesUtilizationInfo(args->device, &i);
    *n = i.processSamplesCount;
    return r;
}

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                               nvmlProcessesUtilizationInfo_t *info)
{
    NVML_ENTER(nvmlDeviceGetProcessesUtilizationInfo, device, info);
    if (!info || info->version != nvmlProcessesUtilizationInfo_v1)
        return real_nvmlDeviceGetProcessesUtilizationInfo(device, info);   /* its own error */
    struct info_args args = {device, info};
    unsigned int count = info->processSamplesCount;
    nvmlReturn_t r = own_list(fetch_info, &args, sizeof(nvmlProcessUtilizationInfo_v1_t),
                              offsetof(nvmlProcessUtilizationInfo_v1_t, pid), NVML_ERROR_NOT_FOUND, 0, &count,
                              info->procUtilArray);
    if (r == NVML_SUCCESS || r == NVML_ERROR_INSUFFICIENT_SIZE)
        info->processSamplesCount = count;
    return r;
}

/* === encoder and frame-capture sessions, accounting === */

#define OWN_SESSIONS(sym, type)                                                                                  \
    SHIM_EXPORT nvmlReturn_t sym(nvmlDevice_t device, unsigned int *sessionCount, type *sessionInfos)          \
    {                                                                                                          \
        NVML_ENTER(sym, device, sessionCount, sessionInfos);                                                   \
        struct list_args args = {device, (nvmlReturn_t(*)(nvmlDevice_t, unsigned int *, void *))real_##sym}; \
        return own_list(fetch_list, &args, sizeof(type), offsetof(type, pid), NVML_SUCCESS, 1, sessionCount,  \
                        sessionInfos);                                                                         \
    }

OWN_SESSIONS(nvmlDeviceGetEncoderSessions, nvmlEncoderSessionInfo_t)
OWN_SESSIONS(nvmlDeviceGetFBCSessions, nvmlFBCSessionInfo_t)

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetAccountingPids(nvmlDevice_t device, unsigned int *count, unsigned int *pids)
{
    NVML_ENTER(nvmlDeviceGetAccountingPids, device, count, pids);
    struct list_args args = {device, (nvmlReturn_t(*)(nvmlDevice_t, unsigned int *, void *))
                                         real_nvmlDeviceGetAccountingPids};
    return own_list(fetch_list, &args, sizeof *pids, 0, NVML_SUCCESS, 0, count, pids);
}

/* Another slice's process is one the driver keeps no statistics for, as far as the slice can tell. */
SHIM_EXPORT nvmlReturn_t nvmlDeviceGetAccountingStats(nvmlDevice_t device, unsigned int pid,
                                                      nvmlAccountingStats_t *stats)
{
    NVML_ENTER(nvmlDeviceGetAccountingStats, device, pid, stats);
    if (!own_pid(pid))
        return NVML_ERROR_NOT_FOUND;
    return real_nvmlDeviceGetAccountingStats(device, pid, stats);
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
    if (!REAL(cuDeviceGetUuid_v2) || real_cuDeviceGetUuid_v2(&u, dev) != CUDA_SUCCESS)
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

/* The NVML handle of CUDA device dev (the reverse), found once (14k instructions: the
 * UUID, formatted and looked up).  Only after nvml_start: the shim's reference keeps it
 * valid. */
int nvml_handle(int dev, nvmlDevice_t *handle)
{
    static nvmlDevice_t found[VGPU_MAX_DEVICES];   /* (racing threads find the same) */
    if ((unsigned)dev < VGPU_MAX_DEVICES && (*handle = LOAD(&found[dev])))
        return 0;
    char u[40], s[48];
    int ok = 0;
    if (real_nvmlDeviceGetHandleByUUID && cuda_uuid(dev, u) == 0)
        for (int k = 0; k < 2 && !ok; k++) {
            snprintf(s, sizeof s, "%s-%s", k ? "MIG" : "GPU", u);
            ok = real_nvmlDeviceGetHandleByUUID(s, handle) == NVML_SUCCESS;
        }
    if (!ok)
        ok = real_nvmlDeviceGetHandleByIndex_v2 && real_nvmlDeviceGetHandleByIndex_v2((unsigned)dev, handle) == NVML_SUCCESS;
    if (ok && (unsigned)dev < VGPU_MAX_DEVICES)
        STORE(&found[dev], *handle);
    return ok ? 0 : -1;
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
