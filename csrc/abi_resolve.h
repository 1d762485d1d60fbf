/* abi_resolve.h — which ABI of a driver entry point cuGetProcAddress hands out.
 *
 * Shared by simgpu (which implements cuGetProcAddress) and the shim (which must return
 * its wrapper only when the driver would return exactly the ABI that wrapper has).
 * Rule, as documented for cuGetProcAddress: among the known ABIs of `symbol`, take the
 * newest whose version is <= cudaVersion; with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
 * prefer a per-thread-default-stream (_ptds/_ptsz) ABI when one qualifies.
 */
#ifndef VGPU_ABI_RESOLVE_H
#define VGPU_ABI_RESOLVE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cuda_abi.h"
#include "cuda_entry_points.h"

/* The names are kept in one block of text, each entry holding its name's offset there: a
 * table of 673 pointers took one relocation each at load, which wrote 10.7 KB of the
 * library's pages in every process it is loaded into (the shim's and simgpu's, issue 31);
 * offsets are constants, so the table stays in the read-only pages as built. */
#define VGPU_ABI_NAME_FIELD(name, ver, pt) char name##_##ver##_##pt[sizeof #name];
struct vgpu_abi_names {
    VGPU_CUDA_ENTRY_POINTS(VGPU_ABI_NAME_FIELD)
};
#define VGPU_ABI_NAME_TEXT(name, ver, pt) #name,
static const struct vgpu_abi_names vgpu_abi_names = {VGPU_CUDA_ENTRY_POINTS(VGPU_ABI_NAME_TEXT)};

struct vgpu_abi {
    uint32_t name;   /* offset in vgpu_abi_names: vgpu_abi_name() */
    int version;
    int per_thread;
};

#define VGPU_AS_ABI(name, ver, pt) {offsetof(struct vgpu_abi_names, name##_##ver##_##pt), ver, pt},
static const struct vgpu_abi vgpu_known_abis[] = {VGPU_CUDA_ENTRY_POINTS(VGPU_AS_ABI)};

static inline const char *vgpu_abi_name(const struct vgpu_abi *e)
{
    return (const char *)&vgpu_abi_names + e->name;
}

/* Fills *out and returns CU_GET_PROC_ADDRESS_SUCCESS, or says why there is none. */
static inline CUdriverProcAddressQueryResult vgpu_resolve_abi(const char *symbol, int cudaVersion,
                                                              cuuint64_t flags, struct vgpu_abi *out)
{
    int want_pt = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const struct vgpu_abi *best = NULL;
    int seen = 0;
    /* The table is sorted by name as strcmp orders (tools/gen_entry_points.py): the
     * symbol's first entry by bisection, its other ABIs right after it.  A scan of all 673
     * cost ~2 us a call, and a runtime asks for hundreds at start-up (in simgpu and again
     * in the shim). */
    size_t n = sizeof vgpu_known_abis / sizeof vgpu_known_abis[0], lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (strcmp(vgpu_abi_name(&vgpu_known_abis[mid]), symbol) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (size_t i = lo; i < n && !strcmp(vgpu_abi_name(&vgpu_known_abis[i]), symbol); i++) {
        const struct vgpu_abi *e = &vgpu_known_abis[i];
        seen = 1;
        if (e->version > cudaVersion || (e->per_thread && !want_pt))
            continue;
        if (!best || e->per_thread > best->per_thread ||
            (e->per_thread == best->per_thread && e->version > best->version))
            best = e;
    }
    if (!best)
        return seen ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    *out = *best;
    return CU_GET_PROC_ADDRESS_SUCCESS;
}

#endif
