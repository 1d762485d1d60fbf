/* Compiles only if every hook in shim/hooks.h has exactly the signature of NVIDIA's
 * PFN_<base>_v<version>[_ptsz] typedef (needs the CUDA toolkit headers). */
#define __CUDA_API_VERSION_INTERNAL 1   /* no cuMemAlloc -> cuMemAlloc_v2 renames */
#include <cuda.h>
#include <cudaTypedefs.h>

#include "hooks.h"

#define PFN_0(base, ver) PFN_##base##_v##ver
#define PFN_1(base, ver) PFN_##base##_v##ver##_ptsz
#define CHECK(sym, base, ver, pt, ret, params)                                          \
    _Static_assert(__builtin_types_compatible_p(ret(*) params, PFN_##pt(base, ver)),   \
                   #sym " does not match its PFN typedef");
VGPU_CUDA_HOOKS(CHECK)
