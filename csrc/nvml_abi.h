/* nvml_abi.h — the slice of the NVML ABI that vgpu's C parts use.
 *
 * Written from the public nvml.h documentation and checked against the ctypes layouts
 * of NVIDIA's nvidia-ml-py (pynvml), so that simgpu and the shim build without the
 * driver's headers.  Types are the C types nvml.h uses (unsigned int, unsigned long
 * long), so a hook declared with them matches the real prototype exactly.
 */
#ifndef VGPU_NVML_ABI_H
#define VGPU_NVML_ABI_H

/* === return codes === */
typedef enum nvmlReturn_enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_FREQ_NOT_SUPPORTED = 24,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_DEPRECATED = 26,
    NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_GPU_NOT_FOUND = 28,
    NVML_ERROR_INVALID_STATE = 29,
    NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30,
    NVML_ERROR_UNKNOWN = 999,
} nvmlReturn_t;

/* === handles and constants === */
typedef struct nvmlDevice_st *nvmlDevice_t;

/* === events (nvml.h "Event Handling Methods") === */
typedef struct nvmlEventSet_st *nvmlEventSet_t;
typedef struct nvmlEventData_st {
    nvmlDevice_t device;                 /* where it happened */
    unsigned long long eventType;        /* nvmlEventType* */
    unsigned long long eventData;        /* the XID, for nvmlEventTypeXidCriticalError */
    unsigned int gpuInstanceId;          /* MIG: the instance it concerns (0xFFFFFFFF: the whole GPU) */
    unsigned int computeInstanceId;
} nvmlEventData_t;
#define nvmlEventTypeXidCriticalError 0x0000000000000008ULL

#define NVML_INIT_FLAG_NO_GPUS 1u
#define NVML_INIT_FLAG_NO_ATTACH 2u

#define NVML_DEVICE_UUID_BUFFER_SIZE 80
#define NVML_DEVICE_UUID_V2_BUFFER_SIZE 96
#define NVML_DEVICE_NAME_BUFFER_SIZE 64
#define NVML_DEVICE_NAME_V2_BUFFER_SIZE 96
#define NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE 80
#define NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE 80

/* usedGpuMemory when the driver cannot tell (nvml.h writes it as (-1)) */
#define NVML_VALUE_NOT_AVAILABLE (-1)
#define NVML_VALUE_NOT_AVAILABLE_ULL ((unsigned long long)NVML_VALUE_NOT_AVAILABLE)
#define NVML_VALUE_NOT_AVAILABLE_UINT ((unsigned int)NVML_VALUE_NOT_AVAILABLE)

/* Versioned structs carry sizeof(struct) | version << 24 in their first field. */
#define NVML_STRUCT_VERSION(data, ver) \
    (unsigned int)(sizeof(nvml##data##_v##ver##_t) | ((unsigned int)(ver) << 24))

/* === memory === */
typedef struct nvmlMemory_st {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct nvmlMemory_v2_st {
    unsigned int version;          /* nvmlMemory_v2 */
    unsigned long long total;
    unsigned long long reserved;   /* held by the driver and firmware */
    unsigned long long free;
    unsigned long long used;       /* excludes reserved */
} nvmlMemory_v2_t;

#define nvmlMemory_v2 NVML_STRUCT_VERSION(Memory, 2)   /* 0x02000028 */

/* per-cgroup memory limits (nvmlDeviceSetMemoryLimits_v1, nvmlDeviceGetMemoryLimits_v1) */
#define NVML_DEVICE_MEMORY_LIMIT_MAX 0xFFFFFFFFFFFFFFFFull   /* no hard limit */
typedef struct {
    const char *nameSpace;           /* full path of the cgroup's sysfs directory */
    unsigned long long softLimit;    /* bytes guaranteed before allocations may fail under pressure */
    unsigned long long hardLimit;    /* bytes it may allocate at most */
} nvmlSetMemoryLimits_v1_t;

typedef struct {
    const char *nameSpace;
    unsigned long long softLimit, hardLimit;
    unsigned long long currentUsed;  /* what the cgroup holds now */
} nvmlGetMemoryLimits_v1_t;

/* === utilization === */
typedef struct nvmlUtilization_st {
    unsigned int gpu;      /* percent of the sample period a kernel was running */
    unsigned int memory;   /* percent of it device memory was read or written */
} nvmlUtilization_t;

typedef struct nvmlProcessUtilizationSample_st {
    unsigned int pid;
    unsigned long long timeStamp;   /* CPU timestamp, microseconds */
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

/* nvmlDeviceGetProcessesUtilizationInfo: the caller gives version, the array and its
 * length in processSamplesCount (too short or no array: the count needed and
 * NVML_ERROR_INSUFFICIENT_SIZE), and lastSeenTimeStamp (samples newer than it) */
typedef struct nvmlProcessUtilizationInfo_v1_st {
    unsigned long long timeStamp;   /* CPU timestamp, microseconds */
    unsigned int pid;
    unsigned int smUtil, memUtil, encUtil, decUtil, jpgUtil, ofaUtil;
} nvmlProcessUtilizationInfo_v1_t;

typedef struct nvmlProcessesUtilizationInfo_v1_st {
    unsigned int version;           /* nvmlProcessesUtilizationInfo_v1 */
    unsigned int processSamplesCount;
    unsigned long long lastSeenTimeStamp;
    nvmlProcessUtilizationInfo_v1_t *procUtilArray;
} nvmlProcessesUtilizationInfo_v1_t, nvmlProcessesUtilizationInfo_t;

#define nvmlProcessesUtilizationInfo_v1 NVML_STRUCT_VERSION(ProcessesUtilizationInfo, 1)

/* === running processes === */
/* nvmlDeviceGet*RunningProcesses (unsuffixed) */
typedef struct nvmlProcessInfo_v1_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* _v2 and _v3 both take this layout.  The R535 headers briefly gave _v3 a struct with
 * usedGpuCcProtectedMemory appended; later headers moved that one to
 * nvmlProcessDetail_v1_t (nvmlDeviceGetRunningProcessDetailList) and put _v3 back on
 * this layout, which is what nvidia-ml-py passes to _v3. */
typedef struct nvmlProcessInfo_v2_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;       /* NVML_VALUE_NOT_AVAILABLE_UINT outside MIG */
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t, nvmlProcessInfo_t;

/* Copy a process list out the way nvmlDevice*RunningProcesses do: too small a buffer
 * gives the needed count and NVML_ERROR_INSUFFICIENT_SIZE; `v1` selects the unsuffixed
 * export's layout, else the _v2/_v3 one. */
static inline nvmlReturn_t vgpu_nvml_put_processes(const nvmlProcessInfo_v2_t *found, unsigned int count,
                                                   unsigned int *infoCount, void *infos, int v1)
{
    if (*infoCount < count) {
        *infoCount = count;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (count && !infos)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < count; i++) {
        if (v1)
            ((nvmlProcessInfo_v1_t *)infos)[i] = (nvmlProcessInfo_v1_t){found[i].pid, found[i].usedGpuMemory};
        else
            ((nvmlProcessInfo_v2_t *)infos)[i] = found[i];
    }
    *infoCount = count;
    return NVML_SUCCESS;
}

typedef struct nvmlProcessDetail_v1_st {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
    unsigned long long usedGpuCcProtectedMemory;
} nvmlProcessDetail_v1_t;

/* nvmlDeviceGetRunningProcessDetailList: the caller gives version, mode and the array
 * with its length in numProcArrayEntries (too short or none, with processes running: the
 * count needed and NVML_ERROR_INSUFFICIENT_SIZE; none running: NVML_SUCCESS and 0) */
enum { NVML_PROCESS_MODE_COMPUTE = 0, NVML_PROCESS_MODE_GRAPHICS = 1, NVML_PROCESS_MODE_MPS = 2 };
typedef struct nvmlProcessDetailList_v1_st {
    unsigned int version;           /* nvmlProcessDetailList_v1 */
    unsigned int mode;              /* nvmlProcessMode_t */
    unsigned int numProcArrayEntries;
    nvmlProcessDetail_v1_t *procArray;
} nvmlProcessDetailList_v1_t, nvmlProcessDetailList_t;

#define nvmlProcessDetailList_v1 NVML_STRUCT_VERSION(ProcessDetailList, 1)

/* encoder and frame-buffer-capture sessions (nvmlDeviceGetEncoderSessions, ...FBCSessions):
 * a count of 0 on input gives the count and NVML_SUCCESS */
typedef struct nvmlEncoderSessionInfo_st {
    unsigned int sessionId, pid, vgpuInstance, codecType, hResolution, vResolution, averageFps, averageLatency;
} nvmlEncoderSessionInfo_t;

typedef struct nvmlFBCSessionInfo_st {
    unsigned int sessionId, pid, vgpuInstance, displayOrdinal, sessionType, sessionFlags, hMaxResolution,
        vMaxResolution, hResolution, vResolution, averageFPS, averageLatency;
} nvmlFBCSessionInfo_t;

typedef struct nvmlAccountingStats_st {
    unsigned int gpuUtilization, memoryUtilization;
    unsigned long long maxMemoryUsage, time, startTime;
    unsigned int isRunning;
    unsigned int reserved[5];
} nvmlAccountingStats_t;

/* === the board: PCI, thermals, power, clocks, ECC, BAR1 (layouts as nvidia-ml-py's) === */
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16
#define NVML_DEVICE_SERIAL_BUFFER_SIZE 30

/* nvmlDeviceGetPciInfo and _v2 */
typedef struct nvmlPciInfo_v2_st {
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];   /* "0000:10:00.0" */
    unsigned int domain, bus, device;
    unsigned int pciDeviceId;      /* device id << 16 | vendor id */
    unsigned int pciSubSystemId;   /* subsystem id << 16 | subsystem vendor id */
    unsigned int reserved0, reserved1, reserved2, reserved3;
} nvmlPciInfo_v2_t;

/* nvmlDeviceGetPciInfo_v3 */
typedef struct nvmlPciInfo_st {
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain, bus, device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];      /* "00000000:10:00.0" */
} nvmlPciInfo_t;

typedef struct nvmlPciInfoExt_v1_st {
    unsigned int version;          /* nvmlPciInfoExt_v1 */
    unsigned int domain, bus, device;
    unsigned int pciDeviceId, pciSubSystemId;
    unsigned int baseClass, subClass;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfoExt_v1_t;
#define nvmlPciInfoExt_v1 NVML_STRUCT_VERSION(PciInfoExt, 1)   /* 0x01000040 */

typedef struct nvmlTemperature_v1_st {
    unsigned int version;          /* nvmlTemperature_v1 */
    int sensorType;                /* nvmlTemperatureSensors_t: 0 = the GPU */
    int temperature;
} nvmlTemperature_v1_t;
#define nvmlTemperature_v1 NVML_STRUCT_VERSION(Temperature, 1)   /* 0x0100000C */

typedef struct nvmlBAR1Memory_st {
    unsigned long long bar1Total, bar1Free, bar1Used;
} nvmlBAR1Memory_t;

typedef struct nvmlEccErrorCounts_st {
    unsigned long long l1Cache, l2Cache, deviceMemory, registerFile;
} nvmlEccErrorCounts_t;

typedef struct nvmlFBCStats_st {
    unsigned int sessionsCount, averageFPS, averageLatency;
} nvmlFBCStats_t;

enum {   /* nvmlTemperatureThresholds_t */
    NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0,
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1,
    NVML_TEMPERATURE_THRESHOLD_MEM_MAX = 2,
    NVML_TEMPERATURE_THRESHOLD_GPU_MAX = 3,
};
enum { NVML_CLOCK_GRAPHICS = 0, NVML_CLOCK_SM = 1, NVML_CLOCK_MEM = 2, NVML_CLOCK_VIDEO = 3 };
enum { NVML_CLOCK_ID_CURRENT = 0, NVML_CLOCK_ID_APP_CLOCK_TARGET = 1, NVML_CLOCK_ID_APP_CLOCK_DEFAULT = 2,
       NVML_CLOCK_ID_CUSTOMER_BOOST_MAX = 3 };
#define NVML_BRAND_NVIDIA 14
#define NVML_CLOCKS_EVENT_REASON_GPU_IDLE 0x1ull
#define NVML_CLOCKS_EVENT_REASONS_SUPPORTED 0x1ffull   /* idle .. display clock setting */

/* === NvLink and the NVLink fabric === */
#define NVML_NVLINK_MAX_LINKS 36
typedef enum nvmlIntNvLinkDeviceType_enum {
    NVML_NVLINK_DEVICE_TYPE_GPU = 0x00,
    NVML_NVLINK_DEVICE_TYPE_IBMNPU = 0x01,
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 0x02,
    NVML_NVLINK_DEVICE_TYPE_UNKNOWN = 0xFF,
} nvmlIntNvLinkDeviceType_t;

#define NVML_GPU_FABRIC_UUID_LEN 16
#define NVML_GPU_FABRIC_STATE_NOT_SUPPORTED 0
#define NVML_GPU_FABRIC_STATE_NOT_STARTED 1
#define NVML_GPU_FABRIC_STATE_IN_PROGRESS 2
#define NVML_GPU_FABRIC_STATE_COMPLETED 3
#define NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED 0
typedef unsigned char nvmlGpuFabricState_t;

typedef struct {
    unsigned int version;                                   /* nvmlGpuFabricInfo_v2 */
    unsigned char clusterUuid[NVML_GPU_FABRIC_UUID_LEN];
    nvmlReturn_t status;                                    /* read only once the state is COMPLETED */
    unsigned int cliqueId;
    nvmlGpuFabricState_t state;                             /* NVML_GPU_FABRIC_STATE_* */
    unsigned int healthMask;                                /* 0: every field NOT_SUPPORTED */
} nvmlGpuFabricInfo_v2_t;

typedef struct {
    unsigned int version;                                   /* nvmlGpuFabricInfo_v3 */
    unsigned char clusterUuid[NVML_GPU_FABRIC_UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    nvmlGpuFabricState_t state;
    unsigned int healthMask;
    unsigned char healthSummary;                            /* NVML_GPU_FABRIC_HEALTH_SUMMARY_* */
} nvmlGpuFabricInfo_v3_t;
typedef nvmlGpuFabricInfo_v3_t nvmlGpuFabricInfoV_t;

#define nvmlGpuFabricInfo_v2 NVML_STRUCT_VERSION(GpuFabricInfo, 2)   /* 0x02000024 */
#define nvmlGpuFabricInfo_v3 NVML_STRUCT_VERSION(GpuFabricInfo, 3)   /* 0x03000028 */

#endif
