/* view.c — inside a slice, NVML names no process but the slice's own.
 *
 * Every NVML answer that lists processes or carries a pid (process lists of each mode,
 * process utilization samples, encoder and frame-capture sessions, accounting) is the
 * driver's answer with other slices' entries taken out, on every device, the slice's own
 * or not.  A process is the slice's when its usage file holds a slot for that pid, or it
 * is the caller (NVML reports pids of the namespace the tools see it in; as with the rest
 * of the shim's NVML view, a container whose pid namespace differs from the driver's sees
 * none of its own either).  The compute process lists of the slice's devices are made
 * from the usage file instead (memory.c).  Device-wide figures without pids (utilization
 * rates, samples) are not per-process and not here.
 *
 * Fails closed: when the driver's list cannot be read whole (it grew four times between
 * two reads, or no memory for it), the caller gets the driver's error or
 * NVML_ERROR_MEMORY, never an unfiltered list.
 */
#include "internal.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>
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
 * (memory.c makes the list of the slice's own devices from its usage file). */
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
