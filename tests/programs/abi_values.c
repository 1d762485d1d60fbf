/* Prints the values and layouts simgpu relies on for memory pools, locations and graph
 * memory nodes.  Built twice: against csrc/cuda_abi.h, and with -DWITH_TOOLKIT against
 * NVIDIA's cuda.h; the two outputs must be identical. */
#include <stddef.h>
#include <stdio.h>

#ifdef WITH_TOOLKIT
#include <cuda.h>
#else
#include "cuda_abi.h"
#endif

#define V(x) printf("%s=%lld\n", #x, (long long)(x))
#define L(type, member) printf("%s.%s=%zu\n", #type, #member, offsetof(type, member))

int main(void)
{
    V(CU_MEM_LOCATION_TYPE_INVALID); V(CU_MEM_LOCATION_TYPE_DEVICE); V(CU_MEM_LOCATION_TYPE_HOST);
    V(CU_MEM_LOCATION_TYPE_HOST_NUMA); V(CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT);
    V(CU_MEM_ALLOCATION_TYPE_INVALID); V(CU_MEM_ALLOCATION_TYPE_PINNED); V(CU_MEM_ALLOCATION_TYPE_MANAGED);
    V(CU_MEM_ALLOC_GRANULARITY_MINIMUM); V(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    V(CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES); V(CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC);
    V(CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES); V(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD);
    V(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT); V(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH);
    V(CU_MEMPOOL_ATTR_USED_MEM_CURRENT); V(CU_MEMPOOL_ATTR_USED_MEM_HIGH);
    V(CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT); V(CU_GRAPH_MEM_ATTR_USED_MEM_HIGH);
    V(CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT); V(CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH);
    V(CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    V(sizeof(CUmemLocation)); V(sizeof(CUmemAllocationProp)); V(sizeof(CUmemPoolProps));
    V(sizeof(CUDA_MEM_ALLOC_NODE_PARAMS)); V(sizeof(CUmemAccessDesc));
    L(CUmemAllocationProp, requestedHandleTypes); L(CUmemAllocationProp, location);
    L(CUmemPoolProps, handleTypes); L(CUmemPoolProps, location); L(CUmemPoolProps, maxSize);
    L(CUDA_MEM_ALLOC_NODE_PARAMS, accessDescs); L(CUDA_MEM_ALLOC_NODE_PARAMS, accessDescCount);
    L(CUDA_MEM_ALLOC_NODE_PARAMS, bytesize); L(CUDA_MEM_ALLOC_NODE_PARAMS, dptr);
    return 0;
}
