/* Per-launch CPU cost, for bench/test_compute_share_bench.py.
 * usage: launch N   — N launches of the no-op kernel sim_0us, after a warm-up.
 * Prints: launch_ns=<per launch> */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_abi.h"

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 200000;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    CUresult (*init)(unsigned) = dlsym(cuda, "cuInit");
    CUresult (*retain)(CUcontext *, CUdevice) = dlsym(cuda, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = dlsym(cuda, "cuCtxSetCurrent");
    CUresult (*load)(CUmodule *, const void *) = dlsym(cuda, "cuModuleLoadData");
    CUresult (*get)(CUfunction *, CUmodule, const char *) = dlsym(cuda, "cuModuleGetFunction");
    launch_fn launch = (launch_fn)dlsym(cuda, "cuLaunchKernel");
    CUcontext ctx;
    CUmodule m;
    CUfunction f;
    if (init(0) || retain(&ctx, 0) || set(ctx) || load(&m, "image") || get(&f, m, "sim_0us"))
        return 1;
    for (int i = 0; i < 2000; i++)
        launch(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++)
        if (launch(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL))
            return 2;
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("launch_ns=%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
}
