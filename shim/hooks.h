/* hooks.h — every symbol the shim intercepts, listed once.
 *
 * VGPU_CUDA_HOOKS(X): X(symbol, base name, ABI version, per-thread variant, return type,
 *                       parameter list)
 *   symbol       the exported driver symbol the hook replaces (and its name in the shim)
 *   base, ABI    what cuGetProcAddress is asked for, and the version that introduced this
 *                ABI (as in cudaTypedefs.h's PFN_<base>_v<version>[_ptsz]); the shim hands
 *                out its hook only when the driver would hand out exactly this ABI
 * VGPU_NVML_HOOKS(X): X(symbol, return type, parameter list)
 *
 * Expanded in shim/internal.h and shim/shim.c (declarations, real-symbol resolution, dlsym and cuGetProcAddress
 * tables) and in tests/programs/hook_signatures.c, which checks each parameter list
 * against NVIDIA's typedefs where the CUDA toolkit is installed.  Type names are those of
 * cuda.h, so the list compiles against either csrc/cuda_abi.h or the real headers.
 */
#ifndef VGPU_SHIM_HOOKS_H
#define VGPU_SHIM_HOOKS_H

#define VGPU_CUDA_HOOKS(X)                                                                         \
    /* === interception === */                                                                    \
    X(cuGetProcAddress, cuGetProcAddress, 11030, 0, CUresult,                                      \
      (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags))                         \
    X(cuGetProcAddress_v2, cuGetProcAddress, 12000, 0, CUresult,                                   \
      (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,                          \
       CUdriverProcAddressQueryResult *symbolStatus))                                              \
    /* === lifecycle: tearing a context down frees its allocations === */                        \
    X(cuInit, cuInit, 2000, 0, CUresult, (unsigned int Flags))                                     \
    X(cuCtxDestroy_v2, cuCtxDestroy, 4000, 0, CUresult, (CUcontext ctx))                           \
    X(cuDevicePrimaryCtxReset, cuDevicePrimaryCtxReset, 7000, 0, CUresult, (CUdevice dev))          \
    X(cuDevicePrimaryCtxReset_v2, cuDevicePrimaryCtxReset, 11000, 0, CUresult, (CUdevice dev))     \
    X(cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease, 7000, 0, CUresult, (CUdevice dev))      \
    X(cuDevicePrimaryCtxRelease_v2, cuDevicePrimaryCtxRelease, 11000, 0, CUresult, (CUdevice dev)) \
    /* === allocate === */                                                                        \
    X(cuMemAlloc_v2, cuMemAlloc, 3020, 0, CUresult, (CUdeviceptr *dptr, size_t bytesize))          \
    X(cuMemAllocPitch_v2, cuMemAllocPitch, 3020, 0, CUresult,                                      \
      (CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,                      \
       unsigned int ElementSizeBytes))                                                             \
    X(cuMemAllocManaged, cuMemAllocManaged, 6000, 0, CUresult,                                     \
      (CUdeviceptr *dptr, size_t bytesize, unsigned int flags))                                    \
    X(cuMemAllocAsync, cuMemAllocAsync, 11020, 0, CUresult,                                        \
      (CUdeviceptr *dptr, size_t bytesize, CUstream hStream))                                      \
    X(cuMemAllocAsync_ptsz, cuMemAllocAsync, 11020, 1, CUresult,                                   \
      (CUdeviceptr *dptr, size_t bytesize, CUstream hStream))                                      \
    X(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync, 11020, 0, CUresult,                        \
      (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream))                   \
    X(cuMemAllocFromPoolAsync_ptsz, cuMemAllocFromPoolAsync, 11020, 1, CUresult,                   \
      (CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream))                   \
    X(cuMemCreate, cuMemCreate, 10020, 0, CUresult,                                                \
      (CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,         \
       unsigned long long flags))                                                                  \
    X(cuArrayCreate_v2, cuArrayCreate, 3020, 0, CUresult,                                          \
      (CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray))                             \
    X(cuArray3DCreate_v2, cuArray3DCreate, 3020, 0, CUresult,                                      \
      (CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray))                           \
    X(cuMipmappedArrayCreate, cuMipmappedArrayCreate, 5000, 0, CUresult,                           \
      (CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,              \
       unsigned int numMipmapLevels))                                                              \
    /* === where memory comes from: mappings keep VMM memory alive; pools have a device === */    \
    X(cuMemMap, cuMemMap, 10020, 0, CUresult,                                                      \
      (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,           \
       unsigned long long flags))                                                                  \
    X(cuMemUnmap, cuMemUnmap, 10020, 0, CUresult, (CUdeviceptr ptr, size_t size))                  \
    X(cuMemRetainAllocationHandle, cuMemRetainAllocationHandle, 11000, 0, CUresult,                \
      (CUmemGenericAllocationHandle *handle, void *addr))                                          \
    /* === memory shared between processes: the exporter's slice pays while anyone holds it === */ \
    X(cuIpcGetMemHandle, cuIpcGetMemHandle, 4010, 0, CUresult, (CUipcMemHandle *pHandle, CUdeviceptr dptr)) \
    X(cuIpcOpenMemHandle, cuIpcOpenMemHandle, 4010, 0, CUresult,                                  \
      (CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags))                             \
    X(cuIpcOpenMemHandle_v2, cuIpcOpenMemHandle, 11000, 0, CUresult,                              \
      (CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags))                             \
    X(cuIpcCloseMemHandle, cuIpcCloseMemHandle, 4010, 0, CUresult, (CUdeviceptr dptr))             \
    X(cuMemExportToShareableHandle, cuMemExportToShareableHandle, 10020, 0, CUresult,              \
      (void *shareableHandle, CUmemGenericAllocationHandle handle, CUmemAllocationHandleType handleType, \
       unsigned long long flags))                                                                  \
    X(cuMemImportFromShareableHandle, cuMemImportFromShareableHandle, 10020, 0, CUresult,          \
      (CUmemGenericAllocationHandle *handle, void *osHandle, CUmemAllocationHandleType shHandleType)) \
    X(cuMemPoolCreate, cuMemPoolCreate, 11020, 0, CUresult,                                        \
      (CUmemoryPool *pool, const CUmemPoolProps *poolProps))                                       \
    X(cuDeviceGetDefaultMemPool, cuDeviceGetDefaultMemPool, 11020, 0, CUresult,                    \
      (CUmemoryPool *pool_out, CUdevice dev))                                                      \
    X(cuDeviceGetMemPool, cuDeviceGetMemPool, 11020, 0, CUresult, (CUmemoryPool *pool, CUdevice dev)) \
    /* === pools give memory back (their reserve is what is charged) === */                      \
    X(cuMemPoolTrimTo, cuMemPoolTrimTo, 11020, 0, CUresult, (CUmemoryPool pool, size_t minBytesToKeep)) \
    X(cuMemPoolSetAttribute, cuMemPoolSetAttribute, 11020, 0, CUresult,                            \
      (CUmemoryPool pool, CUmemPool_attribute attr, void *value))                                  \
    X(cuMemPoolDestroy, cuMemPoolDestroy, 11020, 0, CUresult, (CUmemoryPool pool))                 \
    /* === synchronisation: where pools release what was freed into them === */                  \
    X(cuStreamSynchronize, cuStreamSynchronize, 2000, 0, CUresult, (CUstream hStream))             \
    X(cuStreamSynchronize_ptsz, cuStreamSynchronize, 7000, 1, CUresult, (CUstream hStream))        \
    X(cuEventSynchronize, cuEventSynchronize, 2000, 0, CUresult, (CUevent hEvent))                 \
    X(cuCtxSynchronize, cuCtxSynchronize, 2000, 0, CUresult, (void))                               \
    X(cuDeviceGraphMemTrim, cuDeviceGraphMemTrim, 11040, 0, CUresult, (CUdevice device))           \
    /* === free (always calls the real free) === */                                               \
    X(cuMemFree_v2, cuMemFree, 3020, 0, CUresult, (CUdeviceptr dptr))                              \
    X(cuMemFreeAsync, cuMemFreeAsync, 11020, 0, CUresult, (CUdeviceptr dptr, CUstream hStream))    \
    X(cuMemFreeAsync_ptsz, cuMemFreeAsync, 11020, 1, CUresult, (CUdeviceptr dptr, CUstream hStream)) \
    X(cuMemRelease, cuMemRelease, 10020, 0, CUresult, (CUmemGenericAllocationHandle handle))       \
    X(cuArrayDestroy, cuArrayDestroy, 2000, 0, CUresult, (CUarray hArray))                         \
    X(cuMipmappedArrayDestroy, cuMipmappedArrayDestroy, 5000, 0, CUresult,                         \
      (CUmipmappedArray hMipmappedArray))                                                          \
    /* === launch (paced against the container's SM share) === */                                \
    X(cuLaunchKernel, cuLaunchKernel, 4000, 0, CUresult,                                           \
      (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,          \
       unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,                     \
       unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra))         \
    X(cuLaunchKernel_ptsz, cuLaunchKernel, 7000, 1, CUresult,                                      \
      (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,          \
       unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,                     \
       unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra))         \
    X(cuLaunchKernelEx, cuLaunchKernelEx, 11060, 0, CUresult,                                      \
      (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra))             \
    X(cuLaunchKernelEx_ptsz, cuLaunchKernelEx, 11060, 1, CUresult,                                 \
      (const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra))             \
    X(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel, 9000, 0, CUresult,                    \
      (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,          \
       unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,                     \
       unsigned int sharedMemBytes, CUstream hStream, void **kernelParams))                        \
    X(cuLaunchCooperativeKernel_ptsz, cuLaunchCooperativeKernel, 9000, 1, CUresult,               \
      (CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,          \
       unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,                     \
       unsigned int sharedMemBytes, CUstream hStream, void **kernelParams))                        \
    /* an executable graph's allocation nodes: known at instantiation, admitted at launch */     \
    X(cuGraphInstantiate, cuGraphInstantiate, 10000, 0, CUresult,                                 \
      (CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode, char *logBuffer,        \
       size_t bufferSize))                                                                         \
    X(cuGraphInstantiate_v2, cuGraphInstantiate, 11000, 0, CUresult,                              \
      (CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode, char *logBuffer,        \
       size_t bufferSize))                                                                         \
    X(cuGraphInstantiateWithFlags, cuGraphInstantiateWithFlags, 11040, 0, CUresult,               \
      (CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags))                        \
    X(cuGraphInstantiateWithParams, cuGraphInstantiateWithParams, 12000, 0, CUresult,             \
      (CUgraphExec *phGraphExec, CUgraph hGraph, CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)) \
    X(cuGraphInstantiateWithParams_ptsz, cuGraphInstantiateWithParams, 12000, 1, CUresult,        \
      (CUgraphExec *phGraphExec, CUgraph hGraph, CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)) \
    X(cuGraphExecDestroy, cuGraphExecDestroy, 10000, 0, CUresult, (CUgraphExec hGraphExec))       \
    X(cuGraphLaunch, cuGraphLaunch, 10000, 0, CUresult, (CUgraphExec hGraphExec, CUstream hStream)) \
    X(cuGraphLaunch_ptsz, cuGraphLaunch, 10000, 1, CUresult, (CUgraphExec hGraphExec, CUstream hStream)) \
    /* === view === */                                                                            \
    X(cuMemGetInfo_v2, cuMemGetInfo, 3020, 0, CUresult, (size_t *free, size_t *total))             \
    X(cuDeviceTotalMem_v2, cuDeviceTotalMem, 3020, 0, CUresult, (size_t *bytes, CUdevice dev))

#define VGPU_NVML_HOOKS(X)                                                                         \
    X(nvmlDeviceGetMemoryInfo, nvmlReturn_t, (nvmlDevice_t device, nvmlMemory_t *memory))          \
    X(nvmlDeviceGetMemoryInfo_v2, nvmlReturn_t, (nvmlDevice_t device, nvmlMemory_v2_t *memory))    \
    X(nvmlDeviceGetComputeRunningProcesses, nvmlReturn_t,                                          \
      (nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_v1_t *infos))                 \
    X(nvmlDeviceGetComputeRunningProcesses_v2, nvmlReturn_t,                                       \
      (nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_v2_t *infos))                 \
    X(nvmlDeviceGetComputeRunningProcesses_v3, nvmlReturn_t,                                       \
      (nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_t *infos))                    \
    /* === view: utilization as the slice's own use of its share (compute.c) === */              \
    X(nvmlDeviceGetUtilizationRates, nvmlReturn_t, (nvmlDevice_t device, nvmlUtilization_t *utilization)) \
    /* === view: only the slice's processes, wherever NVML names one (view.c) === */             \
    X(nvmlDeviceGetGraphicsRunningProcesses, nvmlReturn_t,                                         \
      (nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_v1_t *infos))                 \
    X(nvmlDeviceGetGraphicsRunningProcesses_v2, nvmlReturn_t,                                      \
      (nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_v2_t *infos))                 \
    X(nvmlDeviceGetGraphicsRunningProcesses_v3, nvmlReturn_t,                                      \
      (nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_t *infos))                    \
    X(nvmlDeviceGetMPSComputeRunningProcesses, nvmlReturn_t,                                       \
      (nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_v1_t *infos))                 \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v2, nvmlReturn_t,                                    \
      (nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_v2_t *infos))                 \
    X(nvmlDeviceGetMPSComputeRunningProcesses_v3, nvmlReturn_t,                                    \
      (nvmlDevice_t device, unsigned int *infoCount, nvmlProcessInfo_t *infos))                    \
    X(nvmlDeviceGetRunningProcessDetailList, nvmlReturn_t,                                         \
      (nvmlDevice_t device, nvmlProcessDetailList_t *plist))                                       \
    X(nvmlDeviceGetProcessUtilization, nvmlReturn_t,                                               \
      (nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,                           \
       unsigned int *processSamplesCount, unsigned long long lastSeenTimeStamp))                   \
    X(nvmlDeviceGetProcessesUtilizationInfo, nvmlReturn_t,                                         \
      (nvmlDevice_t device, nvmlProcessesUtilizationInfo_t *info))                                 \
    X(nvmlDeviceGetEncoderSessions, nvmlReturn_t,                                                  \
      (nvmlDevice_t device, unsigned int *sessionCount, nvmlEncoderSessionInfo_t *sessionInfos))  \
    X(nvmlDeviceGetFBCSessions, nvmlReturn_t,                                                      \
      (nvmlDevice_t device, unsigned int *sessionCount, nvmlFBCSessionInfo_t *sessionInfos))      \
    X(nvmlDeviceGetAccountingPids, nvmlReturn_t, (nvmlDevice_t device, unsigned int *count, unsigned int *pids)) \
    X(nvmlDeviceGetAccountingStats, nvmlReturn_t,                                                  \
      (nvmlDevice_t device, unsigned int pid, nvmlAccountingStats_t *stats))

#endif
