/* nvml_board.c — simgpu's NVML answers about the board: identity, PCI, thermals, power,
 * clocks, ECC, BAR1 and engines (figures from the device's profile, node.c).
 */
#include "nvml_internal.h"

/* === the board: identity, PCI, thermals, power, clocks, ECC, BAR1, engines ===
 * Figures come from the profile (node.c, which says where each comes from).  What a
 * real board keeps in firmware simgpu does not have (VBIOS, inforom, board part number)
 * and what these data-center boards lack (fans: passively cooled; NVENC on A100, H100
 * and H200; auto boost; a display) is NVML_ERROR_NOT_SUPPORTED, as the driver answers on
 * such a board.  Dynamic figures are a model of the device's timeline, not a measurement:
 *   busy = the share of the last second some kernel ran (nvmlDeviceGetUtilizationRates);
 *   temperature = 30 C + 40 C x busy; power = idle + (limit - idle) x busy;
 *   SM and graphics clocks = the maximum while busy, 210 MHz idle; memory clock = its max;
 *   performance state P0 while a process has a context on the device, else P8;
 *   clocks-event reasons = GPU idle when nothing ran in the last second, else none. */

#define DEVICE_OR_RETURN(h, d)                 \
    int d;                                     \
    do {                                       \
        nvmlReturn_t r_ = device_index(h, &d); \
        if (r_)                                \
            return r_;                         \
    } while (0)

#define OUT_OR_RETURN(p)                       \
    do {                                       \
        if (!(p))                              \
            return NVML_ERROR_INVALID_ARGUMENT; \
    } while (0)

static const struct simgpu_profile *P(void) { return simgpu_profile(); }

static unsigned int busy_percent(int d)
{
    uint64_t now = simgpu_now_ns(), from = now > SEC_NS ? now - SEC_NS : 0;
    return now > from ? percent(simgpu_busy_ns(d, 0, from, now), from, now) : 0;
}

static int has_context(int d)
{
    struct simgpu_node *n = simgpu_node();
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++)
        if (atomic_load(&n->procs[i].pid) > 0 && ((atomic_load(&n->procs[i].context_devices) >> d) & 1))
            return 1;
    return 0;
}

/* --- identity --- */

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, int *type)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(type);
    *type = NVML_BRAND_NVIDIA;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(arch);
    *arch = (unsigned int)P()->architecture;
    return NVML_SUCCESS;
}

/* A serial number and board id derived from the device's UUID: stable for the node. */
SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length)
{
    DEVICE_OR_RETURN(device, d);
    const unsigned char *u = simgpu_node()->devices[d].uuid;
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | u[8 + i];
    char s[NVML_DEVICE_SERIAL_BUFFER_SIZE];
    snprintf(s, sizeof s, "13%011llu", (unsigned long long)(v % 100000000000ull));
    return put_str(serial, length, s);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetBoardId(nvmlDevice_t device, unsigned int *boardId)
{
    DEVICE_OR_RETURN(device, d);
    OUT_OR_RETURN(boardId);
    const unsigned char *u = simgpu_node()->devices[d].uuid;
    *boardId = (unsigned int)u[0] << 24 | (unsigned int)u[1] << 16 | (unsigned int)(0x10 + d) << 8;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    DEVICE_OR_RETURN(device, d);
    OUT_OR_RETURN(minorNumber);
    *minorNumber = (unsigned int)d;   /* /dev/nvidia<d> */
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetNumGpuCores(nvmlDevice_t device, unsigned int *numCores)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(numCores);
    *numCores = (unsigned int)(P()->sm_count * P()->cores_per_sm);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryBusWidth(nvmlDevice_t device, unsigned int *busWidth)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(busWidth);
    *busWidth = (unsigned int)P()->bus_width;
    return NVML_SUCCESS;
}

/* No firmware in a simulated board: no VBIOS, inforom or part number to read. */
#define NO_FIRMWARE(name, ...)                                                     \
    _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wunused-parameter\"") \
    SIMGPU_EXPORT nvmlReturn_t name(nvmlDevice_t device, __VA_ARGS__)              \
    {                                                                              \
        int d;                                                                     \
        nvmlReturn_t r = device_index(device, &d);                                 \
        return r ? r : NVML_ERROR_NOT_SUPPORTED;                                   \
    }                                                                              \
    _Pragma("GCC diagnostic pop")
NO_FIRMWARE(nvmlDeviceGetVbiosVersion, char *version, unsigned int length)
NO_FIRMWARE(nvmlDeviceGetBoardPartNumber, char *partNumber, unsigned int length)
NO_FIRMWARE(nvmlDeviceGetInforomVersion, int object, char *version, unsigned int length)
NO_FIRMWARE(nvmlDeviceGetInforomImageVersion, char *version, unsigned int length)
NO_FIRMWARE(nvmlDeviceGetInforomConfigurationChecksum, unsigned int *checksum)
/* features of other boards: fans (these are passively cooled), auto boost (not on
 * data-center parts), a display, the Windows driver model, vGPU licensing */
NO_FIRMWARE(nvmlDeviceGetFanSpeed, unsigned int *speed)
NO_FIRMWARE(nvmlDeviceGetFanSpeed_v2, unsigned int fan, unsigned int *speed)
NO_FIRMWARE(nvmlDeviceGetTargetFanSpeed, unsigned int fan, unsigned int *targetSpeed)
NO_FIRMWARE(nvmlDeviceGetFanSpeedRPM, void *fanSpeed)
NO_FIRMWARE(nvmlDeviceGetAutoBoostedClocksEnabled, int *isEnabled, int *defaultIsEnabled)
NO_FIRMWARE(nvmlDeviceGetDriverModel, int *current, int *pending)
NO_FIRMWARE(nvmlDeviceGetDriverModel_v2, int *current, int *pending)
NO_FIRMWARE(nvmlDeviceGetGridLicensableFeatures, void *features)
NO_FIRMWARE(nvmlDeviceGetGridLicensableFeatures_v2, void *features)
NO_FIRMWARE(nvmlDeviceGetGridLicensableFeatures_v3, void *features)
NO_FIRMWARE(nvmlDeviceGetGridLicensableFeatures_v4, void *features)
NO_FIRMWARE(nvmlDeviceGetRetiredPages, int cause, unsigned int *pageCount, unsigned long long *addresses)
NO_FIRMWARE(nvmlDeviceGetRetiredPages_v2, int cause, unsigned int *pageCount, unsigned long long *addresses,
            unsigned long long *timestamps)
NO_FIRMWARE(nvmlDeviceGetRetiredPagesPendingStatus, int *isPending)   /* Ampere on: row remapping instead */
NO_FIRMWARE(nvmlDeviceGetConfComputeMemSizeInfo, void *memInfo)       /* confidential computing: off */
NO_FIRMWARE(nvmlDeviceGetGpuOperationMode, int *current, int *pending)   /* GOM: GeForce Titan / Tesla K only */

/* The GPU System Processor runs the driver's firmware on these boards (the R580 default):
 * its version is the driver's. */
SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetGspFirmwareMode(nvmlDevice_t device, unsigned int *isEnabled,
                                                        unsigned int *defaultMode)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(isEnabled && defaultMode);
    *isEnabled = *defaultMode = 1;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetGspFirmwareVersion(nvmlDevice_t device, char *version)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    return put_str(version, 64, DRIVER_VERSION);   /* NVML_GSP_FIRMWARE_VERSION_BUF_SIZE */
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetNumFans(nvmlDevice_t device, unsigned int *numFans)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(numFans);
    *numFans = 0;
    return NVML_SUCCESS;
}

/* --- modes --- */

#define CONSTANT(name, type, value)                                  \
    SIMGPU_EXPORT nvmlReturn_t name(nvmlDevice_t device, type *out)  \
    {                                                                \
        DEVICE_OR_RETURN(device, d);                                 \
        (void)d;                                                     \
        OUT_OR_RETURN(out);                                          \
        *out = (value);                                              \
        return NVML_SUCCESS;                                         \
    }
CONSTANT(nvmlDeviceGetComputeMode, int, 0)          /* NVML_COMPUTEMODE_DEFAULT */
CONSTANT(nvmlDeviceGetPersistenceMode, int, 0)      /* disabled: the driver's default */
CONSTANT(nvmlDeviceGetDisplayMode, int, 0)          /* no display attached */
CONSTANT(nvmlDeviceGetDisplayActive, int, 0)
CONSTANT(nvmlDeviceGetVirtualizationMode, int, 0)   /* NVML_GPU_VIRTUALIZATION_MODE_NONE: bare metal */
CONSTANT(nvmlDeviceGetAccountingMode, int, 0)
CONSTANT(nvmlDeviceGetPowerManagementMode, int, 1)  /* enabled */
CONSTANT(nvmlDeviceGetPcieReplayCounter, unsigned int, 0)
CONSTANT(nvmlDeviceGetCurrPcieLinkGeneration, unsigned int, (unsigned int)P()->pcie_gen)
CONSTANT(nvmlDeviceGetMaxPcieLinkGeneration, unsigned int, (unsigned int)P()->pcie_gen)
CONSTANT(nvmlDeviceGetGpuMaxPcieLinkGeneration, unsigned int, (unsigned int)P()->pcie_gen)
CONSTANT(nvmlDeviceGetCurrPcieLinkWidth, unsigned int, (unsigned int)P()->pcie_width)
CONSTANT(nvmlDeviceGetMaxPcieLinkWidth, unsigned int, (unsigned int)P()->pcie_width)

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, int *current, int *pending)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(current && pending);
    *current = *pending = 1;   /* ECC on: the default of all four boards */
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetDefaultEccMode(nvmlDevice_t device, int *defaultMode)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(defaultMode);
    *defaultMode = 1;
    return NVML_SUCCESS;
}

/* A simulated memory makes no errors: every ECC counter is 0. */
SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType, int counterType,
                                                       unsigned long long *eccCounts)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(eccCounts && errorType >= 0 && errorType <= 1 && counterType >= 0 && counterType <= 1);
    *eccCounts = 0;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetDetailedEccErrors(nvmlDevice_t device, int errorType, int counterType,
                                                          nvmlEccErrorCounts_t *eccCounts)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(eccCounts && errorType >= 0 && errorType <= 1 && counterType >= 0 && counterType <= 1);
    memset(eccCounts, 0, sizeof *eccCounts);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetMemoryErrorCounter(nvmlDevice_t device, int errorType, int counterType,
                                                           int locationType, unsigned long long *count)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(count && errorType >= 0 && errorType <= 1 && counterType >= 0 && counterType <= 1 &&
                  locationType >= 0);
    *count = 0;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                                     unsigned int *uncRows, unsigned int *isPending,
                                                     unsigned int *failureOccurred)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(corrRows && uncRows && isPending && failureOccurred);
    *corrRows = *uncRows = *isPending = *failureOccurred = 0;
    return NVML_SUCCESS;
}

/* --- PCI --- */

static void pci_fill(int d, unsigned int *domain, unsigned int *bus, unsigned int *dev, unsigned int *id,
                     unsigned int *subsys)
{
    *domain = 0;
    *bus = 0x10 + (unsigned int)d;   /* as libcuda's cuDeviceGetPCIBusId */
    *dev = 0;
    *id = P()->pci_device << 16 | 0x10DE;
    *subsys = P()->pci_subsystem << 16 | 0x10DE;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    DEVICE_OR_RETURN(device, d);
    OUT_OR_RETURN(pci);
    memset(pci, 0, sizeof *pci);
    pci_fill(d, &pci->domain, &pci->bus, &pci->device, &pci->pciDeviceId, &pci->pciSubSystemId);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0", pci->domain, pci->bus, pci->device);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.0", pci->domain, pci->bus, pci->device);
    return NVML_SUCCESS;
}

static nvmlReturn_t pci_legacy(nvmlDevice_t device, nvmlPciInfo_v2_t *pci)
{
    DEVICE_OR_RETURN(device, d);
    OUT_OR_RETURN(pci);
    memset(pci, 0, sizeof *pci);
    pci_fill(d, &pci->domain, &pci->bus, &pci->device, &pci->pciDeviceId, &pci->pciSubSystemId);
    snprintf(pci->busId, sizeof pci->busId, "%04X:%02X:%02X.0", pci->domain, pci->bus, pci->device);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_v2_t *pci)
{
    return pci_legacy(device, pci);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_v2_t *pci)
{
    return pci_legacy(device, pci);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t device, nvmlPciInfoExt_v1_t *pci)
{
    DEVICE_OR_RETURN(device, d);
    OUT_OR_RETURN(pci);
    if (pci->version != nvmlPciInfoExt_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    pci_fill(d, &pci->domain, &pci->bus, &pci->device, &pci->pciDeviceId, &pci->pciSubSystemId);
    pci->baseClass = 3;   /* display controller */
    pci->subClass = 2;    /* 3D controller: no VGA */
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.0", pci->domain, pci->bus, pci->device);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, int counter, unsigned int *value)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(value && (counter == 0 || counter == 1));   /* TX, RX bytes: copies are host memcpy here */
    *value = 0;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetPcieSpeed(nvmlDevice_t device, unsigned int *pcieSpeed)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(pcieSpeed);
    static const unsigned int mts[] = {0, 2500, 5000, 8000, 16000, 32000};   /* per lane, by generation */
    *pcieSpeed = mts[P()->pcie_gen];
    return NVML_SUCCESS;
}

/* --- NvLink and the NVLink fabric ---
 * These boards stand alone: no NvLink link is up and no NVSwitch fabric is attached. */

/* nvml.h, nvmlDeviceGetNvLinkRemoteDeviceType and nvmlDeviceGetNvLinkRemotePciInfo_v2:
 * NVML_ERROR_INVALID_ARGUMENT "if device or link is invalid" or the output is NULL,
 * NVML_ERROR_NOT_SUPPORTED "if NVLink is not supported" / "if the device doesn't support
 * this feature": simgpu simulates no NvLink, so every valid link index
 * (< NVML_NVLINK_MAX_LINKS) answers that. */
static nvmlReturn_t no_nvlink(nvmlDevice_t device, unsigned int link, const void *out)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(out && link < NVML_NVLINK_MAX_LINKS);
    return NVML_ERROR_NOT_SUPPORTED;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                               nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType)
{
    return no_nvlink(device, link, pNvLinkDeviceType);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
                                                               nvmlPciInfo_t *pci)
{
    return no_nvlink(device, link, pci);
}

/* nvml.h, nvmlDeviceGetGpuFabricInfoV: "For Hopper or newer fully supported devices",
 * NVML_ERROR_NOT_SUPPORTED "If device doesn't support gpu fabric" (the A10 and A100: what
 * a pre-Hopper board answers, pytorch/pytorch#186375); the caller sets the version,
 * nvmlGpuFabricInfo_v2 or _v3 (another: NVML_ERROR_ARGUMENT_VERSION_MISMATCH).  A Hopper
 * board outside an NVSwitch system reports the probe state
 * NVML_GPU_FABRIC_STATE_NOT_SUPPORTED (observed on H100 PCIe: leptonai/gpud#1147), with no
 * cluster, clique or health to report (the health fields' NOT_SUPPORTED values are 0). */
SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfoV_t *gpuFabricInfo)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(gpuFabricInfo);
    unsigned int version = gpuFabricInfo->version;
    if (version != nvmlGpuFabricInfo_v2 && version != nvmlGpuFabricInfo_v3)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (P()->cc_major < 9)
        return NVML_ERROR_NOT_SUPPORTED;
    memset(gpuFabricInfo, 0, version == nvmlGpuFabricInfo_v2 ? sizeof(nvmlGpuFabricInfo_v2_t)
                                                             : sizeof(nvmlGpuFabricInfo_v3_t));
    gpuFabricInfo->version = version;
    gpuFabricInfo->status = NVML_SUCCESS;
    gpuFabricInfo->state = NVML_GPU_FABRIC_STATE_NOT_SUPPORTED;
    if (version == nvmlGpuFabricInfo_v3)
        gpuFabricInfo->healthSummary = NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

/* --- thermals --- */

static unsigned int temperature(int d) { return 30 + (40 * busy_percent(d) + 50) / 100; }

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensorType, unsigned int *temp)
{
    DEVICE_OR_RETURN(device, d);
    OUT_OR_RETURN(temp && sensorType == 0);   /* NVML_TEMPERATURE_GPU, the only sensor */
    *temp = temperature(d);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_v1_t *temp)
{
    DEVICE_OR_RETURN(device, d);
    OUT_OR_RETURN(temp);
    if (temp->version != nvmlTemperature_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (temp->sensorType != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    temp->temperature = (int)temperature(d);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device, int thresholdType,
                                                             unsigned int *temp)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(temp);
    int v;
    switch (thresholdType) {
    case NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: v = P()->temp_shutdown; break;
    case NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: v = P()->temp_slowdown; break;
    case NVML_TEMPERATURE_THRESHOLD_MEM_MAX: v = P()->temp_mem_max; break;   /* HBM boards only */
    case NVML_TEMPERATURE_THRESHOLD_GPU_MAX: v = P()->temp_gpu_max; break;
    default:
        if (thresholdType < 0 || thresholdType >= 8)
            return NVML_ERROR_INVALID_ARGUMENT;
        v = 0;   /* acoustic and GPS thresholds: not on these boards */
    }
    if (!v)
        return NVML_ERROR_NOT_SUPPORTED;
    *temp = (unsigned int)v;
    return NVML_SUCCESS;
}

/* --- power --- */

static unsigned int power_mw(int d)
{
    unsigned int idle = (unsigned int)P()->power_idle_w * 1000, limit = (unsigned int)P()->power_limit_w * 1000;
    return idle + (limit - idle) / 100 * busy_percent(d);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    DEVICE_OR_RETURN(device, d);
    OUT_OR_RETURN(power);
    *power = power_mw(d);
    return NVML_SUCCESS;
}

CONSTANT(nvmlDeviceGetPowerManagementLimit, unsigned int, (unsigned int)P()->power_limit_w * 1000)
CONSTANT(nvmlDeviceGetPowerManagementDefaultLimit, unsigned int, (unsigned int)P()->power_limit_w * 1000)
CONSTANT(nvmlDeviceGetEnforcedPowerLimit, unsigned int, (unsigned int)P()->power_limit_w * 1000)

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimitConstraints(nvmlDevice_t device, unsigned int *minLimit,
                                                                        unsigned int *maxLimit)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(minLimit && maxLimit);
    *minLimit = (unsigned int)P()->power_min_w * 1000;
    *maxLimit = (unsigned int)P()->power_limit_w * 1000;
    return NVML_SUCCESS;
}

/* Energy since the node was made: idle power all along, plus the rest of the limit for
 * the time kernels ran (the timeline's ring holds the recent past). */
SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device, unsigned long long *energy)
{
    DEVICE_OR_RETURN(device, d);
    OUT_OR_RETURN(energy);
    uint64_t now = simgpu_now_ns(), busy = simgpu_busy_ns(d, 0, 0, now);
    uint64_t idle_mw = (uint64_t)P()->power_idle_w * 1000, extra_mw = (uint64_t)P()->power_limit_w * 1000 - idle_mw;
    *energy = (unsigned long long)((idle_mw * (now / 1000000) + extra_mw * (busy / 1000000)) / 1000);   /* mJ */
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t device, int *pState)
{
    DEVICE_OR_RETURN(device, d);
    OUT_OR_RETURN(pState);
    *pState = has_context(d) ? 0 : 8;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetPowerState(nvmlDevice_t device, int *pState)
{
    return nvmlDeviceGetPerformanceState(device, pState);
}

/* --- clocks (MHz) --- */

#define IDLE_CLOCK_MHZ 210
#define IDLE_VIDEO_MHZ 585

static unsigned int max_clock(int type)
{
    switch (type) {
    case NVML_CLOCK_GRAPHICS:
    case NVML_CLOCK_SM: return (unsigned int)P()->clock_khz / 1000;
    case NVML_CLOCK_MEM: return (unsigned int)P()->mem_clock_khz / 1000;
    case NVML_CLOCK_VIDEO: return (unsigned int)P()->video_clock_mhz;
    }
    return 0;
}

static unsigned int current_clock(int d, int type)
{
    int busy = busy_percent(d) > 0;
    switch (type) {
    case NVML_CLOCK_GRAPHICS:
    case NVML_CLOCK_SM: return busy ? max_clock(type) : IDLE_CLOCK_MHZ;
    case NVML_CLOCK_MEM: return max_clock(type);
    case NVML_CLOCK_VIDEO: return busy ? max_clock(type) : IDLE_VIDEO_MHZ;
    }
    return 0;
}

/* Applications clocks: the board's base clock for graphics and SM, the memory's max. */
static unsigned int app_clock(int type)
{
    return type == NVML_CLOCK_GRAPHICS || type == NVML_CLOCK_SM ? (unsigned int)P()->base_clock_mhz : max_clock(type);
}

#define CLOCK_CALL(name, expr)                                                              \
    SIMGPU_EXPORT nvmlReturn_t name(nvmlDevice_t device, int type, unsigned int *clock)     \
    {                                                                                       \
        DEVICE_OR_RETURN(device, d);                                                        \
        (void)d;                                                                            \
        OUT_OR_RETURN(clock && type >= NVML_CLOCK_GRAPHICS && type <= NVML_CLOCK_VIDEO);    \
        *clock = (expr);                                                                    \
        return NVML_SUCCESS;                                                                \
    }
CLOCK_CALL(nvmlDeviceGetClockInfo, current_clock(d, type))
CLOCK_CALL(nvmlDeviceGetMaxClockInfo, max_clock(type))
CLOCK_CALL(nvmlDeviceGetApplicationsClock, app_clock(type))
CLOCK_CALL(nvmlDeviceGetDefaultApplicationsClock, app_clock(type))
CLOCK_CALL(nvmlDeviceGetMaxCustomerBoostClock, max_clock(type))

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetClock(nvmlDevice_t device, int clockType, int clockId,
                                              unsigned int *clockMHz)
{
    DEVICE_OR_RETURN(device, d);
    OUT_OR_RETURN(clockMHz && clockType >= NVML_CLOCK_GRAPHICS && clockType <= NVML_CLOCK_VIDEO);
    switch (clockId) {
    case NVML_CLOCK_ID_CURRENT: *clockMHz = current_clock(d, clockType); break;
    case NVML_CLOCK_ID_APP_CLOCK_TARGET:
    case NVML_CLOCK_ID_APP_CLOCK_DEFAULT: *clockMHz = app_clock(clockType); break;
    case NVML_CLOCK_ID_CUSTOMER_BOOST_MAX: *clockMHz = max_clock(clockType); break;
    default: return NVML_ERROR_INVALID_ARGUMENT;
    }
    return NVML_SUCCESS;
}

static nvmlReturn_t put_clocks(const unsigned int *v, unsigned int n, unsigned int *count, unsigned int *clocks)
{
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (*count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n && !clocks)
        return NVML_ERROR_INVALID_ARGUMENT;
    memcpy(clocks, v, n * sizeof *v);
    *count = n;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetSupportedMemoryClocks(nvmlDevice_t device, unsigned int *count,
                                                              unsigned int *clocksMHz)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    unsigned int mem = max_clock(NVML_CLOCK_MEM);
    return put_clocks(&mem, 1, count, clocksMHz);
}

/* From the maximum down to the idle clock in 15 MHz steps (a model of the table). */
SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetSupportedGraphicsClocks(nvmlDevice_t device, unsigned int memoryClockMHz,
                                                                unsigned int *count, unsigned int *clocksMHz)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    if (memoryClockMHz != max_clock(NVML_CLOCK_MEM))
        return NVML_ERROR_NOT_FOUND;
    unsigned int v[256], n = 0;
    for (unsigned int c = max_clock(NVML_CLOCK_GRAPHICS); c >= IDLE_CLOCK_MHZ && n < 256; c -= 15)
        v[n++] = c;
    return put_clocks(v, n, count, clocksMHz);
}

static nvmlReturn_t event_reasons(nvmlDevice_t device, unsigned long long *reasons, int supported)
{
    DEVICE_OR_RETURN(device, d);
    OUT_OR_RETURN(reasons);
    *reasons = supported ? NVML_CLOCKS_EVENT_REASONS_SUPPORTED
                         : busy_percent(d) ? 0 : NVML_CLOCKS_EVENT_REASON_GPU_IDLE;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *r)
{
    return event_reasons(device, r, 0);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *r)
{
    return event_reasons(device, r, 0);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetSupportedClocksEventReasons(nvmlDevice_t device, unsigned long long *r)
{
    return event_reasons(device, r, 1);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetSupportedClocksThrottleReasons(nvmlDevice_t device, unsigned long long *r)
{
    return event_reasons(device, r, 1);
}

/* --- BAR1 --- */

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetBAR1MemoryInfo(nvmlDevice_t device, nvmlBAR1Memory_t *bar1)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(bar1);
    bar1->bar1Total = (unsigned long long)P()->bar1_mib << 20;
    bar1->bar1Used = 0;   /* nothing maps device memory for the CPU here */
    bar1->bar1Free = bar1->bar1Total;
    return NVML_SUCCESS;
}

/* --- video engines: none of them runs here, so they are idle where the board has them --- */

static nvmlReturn_t engine_util(nvmlDevice_t device, int engines, unsigned int *util, unsigned int *period_us)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(util && period_us);
    if (!engines)
        return NVML_ERROR_NOT_SUPPORTED;
    *util = 0;
    *period_us = SEC_US;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t device, unsigned int *u, unsigned int *p)
{
    return engine_util(device, P() ? P()->encoders : 0, u, p);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t device, unsigned int *u, unsigned int *p)
{
    return engine_util(device, P() ? P()->decoders : 0, u, p);
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetEncoderCapacity(nvmlDevice_t device, int encoderQueryType,
                                                        unsigned int *encoderCapacity)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(encoderCapacity && encoderQueryType >= 0);
    if (!P()->encoders)
        return NVML_ERROR_NOT_SUPPORTED;
    *encoderCapacity = 100;   /* percent free: nothing encodes */
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetEncoderStats(nvmlDevice_t device, unsigned int *sessionCount,
                                                     unsigned int *averageFps, unsigned int *averageLatency)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(sessionCount && averageFps && averageLatency);
    if (!P()->encoders)
        return NVML_ERROR_NOT_SUPPORTED;
    *sessionCount = *averageFps = *averageLatency = 0;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetEncoderSessions(nvmlDevice_t device, unsigned int *sessionCount,
                                                        void *sessionInfos)
{
    DEVICE_OR_RETURN(device, d);
    (void)d, (void)sessionInfos;
    OUT_OR_RETURN(sessionCount);
    if (!P()->encoders)
        return NVML_ERROR_NOT_SUPPORTED;
    *sessionCount = 0;
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetFBCStats(nvmlDevice_t device, nvmlFBCStats_t *fbcStats)
{
    DEVICE_OR_RETURN(device, d);
    (void)d;
    OUT_OR_RETURN(fbcStats);
    memset(fbcStats, 0, sizeof *fbcStats);
    return NVML_SUCCESS;
}

SIMGPU_EXPORT nvmlReturn_t nvmlDeviceGetFBCSessions(nvmlDevice_t device, unsigned int *sessionCount,
                                                    void *sessionInfo)
{
    DEVICE_OR_RETURN(device, d);
    (void)d, (void)sessionInfo;
    OUT_OR_RETURN(sessionCount);
    *sessionCount = 0;
    return NVML_SUCCESS;
}
