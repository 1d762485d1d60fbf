/* A slice member for bench/test_agent_bench.py: under the shim, cuInit (which claims the
 * process's slot in its slice's usage file) and, with BYTES > 0, a context and an
 * allocation of BYTES (so NVML lists it); then "ready" on stdout and sleep until killed.
 * usage: member [BYTES] */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "cuda_abi.h"

int main(int argc, char **argv)
{
    size_t bytes = argc > 1 ? strtoull(argv[1], NULL, 10) : 0;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda)
        return 1;
    CUresult (*init)(unsigned) = dlsym(cuda, "cuInit");
    CUresult (*retain)(CUcontext *, CUdevice) = dlsym(cuda, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = dlsym(cuda, "cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = dlsym(cuda, "cuMemAlloc_v2");
    if (init(0))
        return 2;
    if (bytes) {
        CUcontext ctx;
        CUdeviceptr p;
        if (retain(&ctx, 0) || set(ctx) || alloc(&p, bytes))
            return 3;
    }
    printf("ready\n");
    fflush(stdout);
    for (;;)
        pause();
}
