/* vmm.c — the virtual memory management API: a handle's memory is charged from its
 * cuMemCreate until it is both released and unmapped (as the driver frees it).
 */
#include "internal.h"

#include <stdlib.h>

struct mapping { uint64_t ptr, size, handle; };
struct vmm *vmms;
static struct mapping *mappings;
size_t nvmm, vmm_cap, nmappings, mappings_cap;

/* VMM: a handle's memory stays on the device while it is mapped, even after release,
 * so the budget comes back when it is both released and unmapped (as the driver frees). */
SHIM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                 unsigned long long flags)
{
    ENTER(cuMemCreate, handle, size, prop, flags);
    int dev = prop ? location_device(&prop->location) : LOCATION_PASS;
    if (dev == LOCATION_REFUSED)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (dev < 0 || !handle || !size)
        return real_cuMemCreate(handle, size, prop, flags);
    CUresult r = admit(dev, size);
    if (r != CUDA_SUCCESS)
        return r;
    r = real_cuMemCreate(handle, size, prop, flags);
    if (r != CUDA_SUCCESS) {
        refund(dev, size);
        return r;
    }
    pthread_mutex_lock(&vmm_lock);
    if (nvmm == vmm_cap) {
        struct vmm *n = realloc(vmms, (vmm_cap ? 2 * vmm_cap : 16) * sizeof *n);
        if (n) {
            vmms = n;
            vmm_cap = vmm_cap ? 2 * vmm_cap : 16;
        }
    }
    if (nvmm < vmm_cap)
        vmms[nvmm++] = (struct vmm){*handle, size, dev, 0, 1, -1, 0};
    else
        ERR("VMM table full: %zu bytes stay charged", size);
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

/* Called with vmm_lock held: give the budget back once released and unmapped (shared:
 * let go of the shared slot; the last holder of the slice drains it). */
static void vmm_settle(size_t i)
{
    if (vmms[i].refs > 0 || vmms[i].mappings > 0)
        return;
    if (vmms[i].shared >= 0)
        shared_release(vmms[i].shared);
    else
        refund(vmms[i].dev, vmms[i].bytes);
    vmms[i] = vmms[--nvmm];
}

struct vmm *vmm_find(uint64_t handle, size_t *index)
{
    for (size_t i = 0; i < nvmm; i++)
        if (vmms[i].handle == handle) {
            *index = i;
            return &vmms[i];
        }
    return NULL;
}

SHIM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                              unsigned long long flags)
{
    ENTER(cuMemMap, ptr, size, offset, handle, flags);
    /* memory imported from another slice is charged here, at its first mapping, for what is
     * mapped (an importer is not told the allocation's size) */
    size_t i;
    int dev = -1;
    pthread_mutex_lock(&vmm_lock);
    struct vmm *v = vmm_find(handle, &i);
    if (v && v->unpaid)
        dev = v->dev;
    pthread_mutex_unlock(&vmm_lock);
    if (dev >= 0 && admit(dev, size) != CUDA_SUCCESS)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = real_cuMemMap(ptr, size, offset, handle, flags);
    if (r != CUDA_SUCCESS) {
        if (dev >= 0)
            refund(dev, size);
        return r;
    }
    pthread_mutex_lock(&vmm_lock);
    v = vmm_find(handle, &i);
    if (dev >= 0 && v && v->unpaid) {
        v->unpaid = 0;
        v->bytes = size;
    } else if (dev >= 0) {
        refund(dev, size);   /* another thread's mapping paid first */
    }
    if (v && nmappings == mappings_cap) {
        struct mapping *n = realloc(mappings, (mappings_cap ? 2 * mappings_cap : 16) * sizeof *n);
        if (n) {
            mappings = n;
            mappings_cap = mappings_cap ? 2 * mappings_cap : 16;
        }
    }
    if (v && nmappings < mappings_cap) {
        mappings[nmappings++] = (struct mapping){ptr, size, handle};
        v->mappings++;
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

SHIM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    ENTER(cuMemUnmap, ptr, size);
    CUresult r = real_cuMemUnmap(ptr, size);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&vmm_lock);
    for (size_t m = 0; m < nmappings;) {
        if (mappings[m].ptr < ptr || mappings[m].ptr >= ptr + size) {
            m++;
            continue;
        }
        size_t i;
        struct vmm *v = vmm_find(mappings[m].handle, &i);
        mappings[m] = mappings[--nmappings];
        if (v) {
            v->mappings--;
            vmm_settle(i);
        }
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}


SHIM_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    ENTER(cuMemRetainAllocationHandle, handle, addr);
    CUresult r = real_cuMemRetainAllocationHandle(handle, addr);
    if (r != CUDA_SUCCESS || !handle)
        return r;
    pthread_mutex_lock(&vmm_lock);
    size_t i;
    struct vmm *v = vmm_find(*handle, &i);
    if (v)
        v->refs++;   /* one more cuMemRelease before its memory can go */
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

SHIM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    ENTER(cuMemRelease, handle);
    CUresult r = real_cuMemRelease(handle);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&vmm_lock);
    size_t i;
    struct vmm *v = vmm_find(handle, &i);
    if (v) {
        if (v->refs > 0)
            v->refs--;
        vmm_settle(i);
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}
