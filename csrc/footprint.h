/* footprint.h — the device memory an allocation takes, as simgpu models the driver.
 *
 * One rule, shared by simgpu (which holds this much on the device) and the shim (which
 * charges the same), so both agree on what an allocation costs:
 *   - sizes of 1 MiB and more take whole 2 MiB pages: the driver backs large allocations
 *     with 2 MiB pages, the granularity cuMemGetAllocationGranularity reports for VMM;
 *   - smaller sizes are rounded up to 512 bytes.  A real driver packs small allocations
 *     into shared 2 MiB pages, so a single one costs up to 2 MiB and many cost about their
 *     sum; that packing is not modelled.
 * Used for cuMemAlloc, cuMemAllocPitch (pitch x height), cuMemAllocManaged and the blocks
 * stream-ordered allocations take from a pool.  cuMemCreate sizes are multiples of the
 * 2 MiB granularity already; arrays are counted as their bytes.
 */
#ifndef VGPU_FOOTPRINT_H
#define VGPU_FOOTPRINT_H

#include <stdint.h>

#define VGPU_LARGE_PAGE (2ull << 20)        /* page of large allocations, VMM granularity */
#define VGPU_LARGE_FROM (1ull << 20)        /* sizes from here on take large pages */
#define VGPU_SMALL_ALIGN 512ull             /* rounding of smaller sizes */

/* Bytes of device memory an allocation of `size` bytes holds (0 for 0; UINT64_MAX when
 * rounding up would wrap, which no device can hold). */
static inline uint64_t vgpu_alloc_footprint(uint64_t size)
{
    uint64_t mask = (size >= VGPU_LARGE_FROM ? VGPU_LARGE_PAGE : VGPU_SMALL_ALIGN) - 1, end = size + mask;
    return end < size ? UINT64_MAX : end & ~mask;   /* (end < size: rounding up wrapped) */
}

#endif
