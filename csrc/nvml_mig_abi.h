/* nvml_mig_abi.h — the Multi-Instance GPU slice of the NVML ABI (simgpu, and the shim
 * when it learns MIG device handles).
 *
 * Written from NVIDIA's published nvml.h ("NVML VERSION: 13.3.29", NVML_API_VERSION 13,
 * the nvmlMultiInstanceGPU group and nvmlDeviceAttributes_t) and checked against the
 * ctypes layouts of nvidia-ml-py (pynvml.py); tests/simgpu/test_simgpu_mig.py compares both.
 * Field order and types are nvml.h's; the sizes below are what the compiler must agree on.
 */
#ifndef VGPU_NVML_MIG_ABI_H
#define VGPU_NVML_MIG_ABI_H

#include "nvml_abi.h"

typedef struct nvmlGpuInstance_st *nvmlGpuInstance_t;
typedef struct nvmlComputeInstance_st *nvmlComputeInstance_t;

/* === MIG mode === */
#define NVML_DEVICE_MIG_DISABLE 0x0
#define NVML_DEVICE_MIG_ENABLE 0x1

/* === GPU instance profiles: the `profile` argument is an index, not the profile ID === */
#define NVML_GPU_INSTANCE_PROFILE_1_SLICE 0x0
#define NVML_GPU_INSTANCE_PROFILE_2_SLICE 0x1
#define NVML_GPU_INSTANCE_PROFILE_3_SLICE 0x2
#define NVML_GPU_INSTANCE_PROFILE_4_SLICE 0x3
#define NVML_GPU_INSTANCE_PROFILE_7_SLICE 0x4
#define NVML_GPU_INSTANCE_PROFILE_8_SLICE 0x5
#define NVML_GPU_INSTANCE_PROFILE_6_SLICE 0x6
#define NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 0x7      /* 1 slice with media engines (+me) */
#define NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1 0x8
#define NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 0x9      /* 1 slice, twice the memory */
#define NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX 0x0A
#define NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX 0x0B
#define NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX 0x0C
#define NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME 0x0D
#define NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME 0x0E
#define NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME 0x0F
#define NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME 0x10
#define NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX 0x11
#define NVML_GPU_INSTANCE_PROFILE_COUNT 0x12

#define NVML_GPU_INSTANCE_PROFILE_CAPS_P2P 0x1
#define NVML_GPU_INSTANCE_PROFILE_CAPS_GFX 0x2
#define NVML_COMPUTE_INSTANCE_PROFILE_CAPS_GFX 0x1

/* === compute instance profiles (index == profile ID for these) === */
#define NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE 0x0
#define NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE 0x1
#define NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE 0x2
#define NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE 0x3
#define NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE 0x4
#define NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE 0x5
#define NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE 0x6
#define NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1 0x7
#define NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE_NVL 0x8
#define NVML_COMPUTE_INSTANCE_PROFILE_COUNT 0x9

#define NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED 0x0
#define NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT 0x1

/* === structs === */
typedef struct nvmlGpuInstancePlacement_st {
    unsigned int start;   /* first memory slice */
    unsigned int size;    /* memory slices */
} nvmlGpuInstancePlacement_t;

typedef struct nvmlGpuInstanceProfileInfo_st {
    unsigned int id;
    unsigned int isP2pSupported;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;   /* "MBytes" in nvml.h: the value is MiB */
} nvmlGpuInstanceProfileInfo_t;

typedef struct nvmlGpuInstanceProfileInfo_v2_st {
    unsigned int version;
    unsigned int id;
    unsigned int isP2pSupported;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
} nvmlGpuInstanceProfileInfo_v2_t;

/* v3 drops isP2pSupported and appends capabilities */
typedef struct nvmlGpuInstanceProfileInfo_v3_st {
    unsigned int version;
    unsigned int id;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    unsigned int capabilities;
} nvmlGpuInstanceProfileInfo_v3_t;

#define nvmlGpuInstanceProfileInfo_v2 NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 2)
#define nvmlGpuInstanceProfileInfo_v3 NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 3)

typedef struct nvmlGpuInstanceInfo_st {
    nvmlDevice_t device;                    /* parent device */
    unsigned int id;
    unsigned int profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;

typedef struct nvmlComputeInstancePlacement_st {
    unsigned int start;   /* first compute slice within the GPU instance */
    unsigned int size;
} nvmlComputeInstancePlacement_t;

typedef struct nvmlComputeInstanceProfileInfo_st {
    unsigned int id;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
} nvmlComputeInstanceProfileInfo_t;

typedef struct nvmlComputeInstanceProfileInfo_v2_st {
    unsigned int version;
    unsigned int id;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
} nvmlComputeInstanceProfileInfo_v2_t;

typedef struct nvmlComputeInstanceProfileInfo_v3_st {
    unsigned int version;
    unsigned int id;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    unsigned int capabilities;
} nvmlComputeInstanceProfileInfo_v3_t;

#define nvmlComputeInstanceProfileInfo_v2 NVML_STRUCT_VERSION(ComputeInstanceProfileInfo, 2)
#define nvmlComputeInstanceProfileInfo_v3 NVML_STRUCT_VERSION(ComputeInstanceProfileInfo, 3)

typedef struct nvmlComputeInstanceInfo_st {
    nvmlDevice_t device;                        /* parent device */
    nvmlGpuInstance_t gpuInstance;              /* parent GPU instance */
    unsigned int id;
    unsigned int profileId;
    nvmlComputeInstancePlacement_t placement;   /* within the GPU instance's compute slices */
} nvmlComputeInstanceInfo_t;

/* nvmlDeviceGetAttributes_v2: "currently only supports MIG device handles" */
typedef struct nvmlDeviceAttributes_st {
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    unsigned int gpuInstanceSliceCount;
    unsigned int computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

/* The sizes the published layouts give on LP64 (tests/simgpu/test_simgpu_mig.py checks pynvml's). */
_Static_assert(sizeof(nvmlGpuInstancePlacement_t) == 8, "nvmlGpuInstancePlacement_t");
_Static_assert(sizeof(nvmlGpuInstanceProfileInfo_t) == 48, "nvmlGpuInstanceProfileInfo_t");
_Static_assert(sizeof(nvmlGpuInstanceProfileInfo_v2_t) == 152 && nvmlGpuInstanceProfileInfo_v2 == 0x02000098u,
               "nvmlGpuInstanceProfileInfo_v2_t");
_Static_assert(sizeof(nvmlGpuInstanceProfileInfo_v3_t) == 152 && nvmlGpuInstanceProfileInfo_v3 == 0x03000098u,
               "nvmlGpuInstanceProfileInfo_v3_t");
_Static_assert(sizeof(nvmlGpuInstanceInfo_t) == 24, "nvmlGpuInstanceInfo_t");
_Static_assert(sizeof(nvmlComputeInstanceProfileInfo_t) == 36, "nvmlComputeInstanceProfileInfo_t");
_Static_assert(sizeof(nvmlComputeInstanceProfileInfo_v2_t) == 136 &&
               nvmlComputeInstanceProfileInfo_v2 == 0x02000088u, "nvmlComputeInstanceProfileInfo_v2_t");
_Static_assert(sizeof(nvmlComputeInstanceProfileInfo_v3_t) == 140 &&
               nvmlComputeInstanceProfileInfo_v3 == 0x0300008Cu, "nvmlComputeInstanceProfileInfo_v3_t");
_Static_assert(sizeof(nvmlComputeInstanceInfo_t) == 32, "nvmlComputeInstanceInfo_t");
_Static_assert(sizeof(nvmlDeviceAttributes_t) == 40, "nvmlDeviceAttributes_t");

#endif
