/* simgpu libnvidia-ml: what nvml.c asks nvml_mig.c about MIG device handles.
 *
 * A MIG device handle (nvmlDeviceGetMigDeviceHandleByIndex, nvmlDeviceGetHandleByUUID
 * with a MIG- UUID) "maps to a MIG compute instance" and may be passed where a device
 * handle goes.  nvml.c answers name, UUID, index, memory and processes through these
 * for such a handle; its other calls refuse one with NOT_SUPPORTED.
 */
#ifndef SIMGPU_NVML_MIG_H
#define SIMGPU_NVML_MIG_H

#include "nvml_mig_abi.h"

int simgpu_nvml_is_mig(nvmlDevice_t device);
nvmlReturn_t simgpu_nvml_mig_name(nvmlDevice_t device, char *name, unsigned int length);
nvmlReturn_t simgpu_nvml_mig_uuid(nvmlDevice_t device, char *uuid, unsigned int length);
nvmlReturn_t simgpu_nvml_mig_index(nvmlDevice_t device, unsigned int *index);
nvmlReturn_t simgpu_nvml_mig_parent(nvmlDevice_t device, int *dev);   /* the GPU it is on */
nvmlReturn_t simgpu_nvml_mig_memory(nvmlDevice_t device, nvmlMemory_t *memory);
nvmlReturn_t simgpu_nvml_mig_memory_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory);
nvmlReturn_t simgpu_nvml_mig_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos, int v1);
nvmlReturn_t simgpu_nvml_mig_by_uuid(const char *uuid, nvmlDevice_t *device);
/* The GI and CI IDs of what the process in `slot` runs on GPU `dev` (NOT_AVAILABLE: none). */
void simgpu_nvml_mig_process_ids(int dev, int slot, unsigned int *gpuInstanceId,
                                 unsigned int *computeInstanceId);

#endif
