/* Prints the MIG constants and struct layouts simgpu implements.  Built against
 * csrc/nvml_mig_abi.h, and with -DWITH_NVML_H against NVIDIA's nvml.h where one is
 * installed; the two outputs must be identical, and both must match nvidia-ml-py's
 * ctypes layouts (tests/simgpu/test_simgpu_mig.py). */
#include <stddef.h>
#include <stdio.h>

#ifdef WITH_NVML_H
#include <nvml.h>
#else
#include "nvml_mig_abi.h"
#endif

#define V(x) printf("%s=%lld\n", #x, (long long)(x))
#define S(type) printf("sizeof(%s)=%zu\n", #type, sizeof(type))
#define L(type, member) printf("%s.%s=%zu\n", #type, #member, offsetof(type, member))

int main(void)
{
    V(NVML_DEVICE_MIG_DISABLE); V(NVML_DEVICE_MIG_ENABLE);
    V(NVML_GPU_INSTANCE_PROFILE_1_SLICE); V(NVML_GPU_INSTANCE_PROFILE_2_SLICE);
    V(NVML_GPU_INSTANCE_PROFILE_3_SLICE); V(NVML_GPU_INSTANCE_PROFILE_4_SLICE);
    V(NVML_GPU_INSTANCE_PROFILE_7_SLICE); V(NVML_GPU_INSTANCE_PROFILE_8_SLICE);
    V(NVML_GPU_INSTANCE_PROFILE_6_SLICE); V(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1);
    V(NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1); V(NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2);
    V(NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX); V(NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX);
    V(NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX); V(NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME);
    V(NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME); V(NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME);
    V(NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME); V(NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX);
    V(NVML_GPU_INSTANCE_PROFILE_COUNT);
    V(NVML_GPU_INSTANCE_PROFILE_CAPS_P2P); V(NVML_GPU_INSTANCE_PROFILE_CAPS_GFX);
    V(NVML_COMPUTE_INSTANCE_PROFILE_CAPS_GFX);
    V(NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE); V(NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE);
    V(NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE); V(NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE);
    V(NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE); V(NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE);
    V(NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE); V(NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1);
    V(NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE_NVL); V(NVML_COMPUTE_INSTANCE_PROFILE_COUNT);
    V(NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED); V(NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT);
    V(nvmlGpuInstanceProfileInfo_v2); V(nvmlGpuInstanceProfileInfo_v3);
    V(nvmlComputeInstanceProfileInfo_v2); V(nvmlComputeInstanceProfileInfo_v3);
    V(NVML_ERROR_IN_USE); V(NVML_ERROR_INSUFFICIENT_RESOURCES); V(NVML_ERROR_NOT_FOUND);

    S(nvmlGpuInstancePlacement_t); S(nvmlGpuInstanceProfileInfo_t); S(nvmlGpuInstanceProfileInfo_v2_t);
    S(nvmlGpuInstanceProfileInfo_v3_t); S(nvmlGpuInstanceInfo_t); S(nvmlComputeInstancePlacement_t);
    S(nvmlComputeInstanceProfileInfo_t); S(nvmlComputeInstanceProfileInfo_v2_t);
    S(nvmlComputeInstanceProfileInfo_v3_t); S(nvmlComputeInstanceInfo_t); S(nvmlDeviceAttributes_t);

    L(nvmlGpuInstanceProfileInfo_t, sliceCount); L(nvmlGpuInstanceProfileInfo_t, ofaCount);
    L(nvmlGpuInstanceProfileInfo_t, memorySizeMB);
    L(nvmlGpuInstanceProfileInfo_v2_t, id); L(nvmlGpuInstanceProfileInfo_v2_t, memorySizeMB);
    L(nvmlGpuInstanceProfileInfo_v2_t, name);
    L(nvmlGpuInstanceProfileInfo_v3_t, sliceCount); L(nvmlGpuInstanceProfileInfo_v3_t, memorySizeMB);
    L(nvmlGpuInstanceProfileInfo_v3_t, name); L(nvmlGpuInstanceProfileInfo_v3_t, capabilities);
    L(nvmlGpuInstanceInfo_t, id); L(nvmlGpuInstanceInfo_t, profileId); L(nvmlGpuInstanceInfo_t, placement);
    L(nvmlComputeInstanceProfileInfo_t, sharedOfaCount);
    L(nvmlComputeInstanceProfileInfo_v2_t, name); L(nvmlComputeInstanceProfileInfo_v3_t, capabilities);
    L(nvmlComputeInstanceInfo_t, gpuInstance); L(nvmlComputeInstanceInfo_t, id);
    L(nvmlComputeInstanceInfo_t, profileId); L(nvmlComputeInstanceInfo_t, placement);
    L(nvmlDeviceAttributes_t, computeInstanceSliceCount); L(nvmlDeviceAttributes_t, memorySizeMB);
    return 0;
}
