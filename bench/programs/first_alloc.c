/* Start-up, for bench/test_shim_overhead.py: the time from main() to the end of the first
 * allocation (dlopen of the driver, cuInit, the primary context, 1 MiB), and of cuInit
 * alone within it.  The same binary runs with and without LD_PRELOAD.
 * Prints: first_alloc_ns=<main() to the first allocation> init_ns=<cuInit> */
#include <dlfcn.h>
#include <stdio.h>
#include <time.h>

#include "cuda_abi.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(void)
{
    double t0 = now();
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda)
        return 1;
    CUresult (*init)(unsigned) = dlsym(cuda, "cuInit");
    CUresult (*retain)(CUcontext *, CUdevice) = dlsym(cuda, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = dlsym(cuda, "cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = dlsym(cuda, "cuMemAlloc_v2");
    double t1 = now();
    if (init(0))
        return 2;
    double t_init = now() - t1;
    CUcontext ctx;
    CUdeviceptr p;
    if (retain(&ctx, 0) || set(ctx) || alloc(&p, 1 << 20))
        return 3;
    printf("first_alloc_ns=%.0f init_ns=%.0f\n", now() - t0, t_init);
    return 0;
}
