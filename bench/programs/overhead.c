/* Per-call cost of the hooked memory calls, for bench/test_shim_overhead.py.
 * usage: overhead N [alloc|info]   (default: both loops, N iterations each)
 *        overhead 1 hold           allocate 1 MiB, print "held", keep it until stdin closes
 *                                  (bench/figures.py: processes that ran in a slice before)
 * Prints: init_ns=<cuInit> alloc_free_ns=<per pair> meminfo_ns=<per call>
 * The same binary runs with and without LD_PRELOAD; the difference is the shim's.
 * Under callgrind, runs with two values of N give instructions per call. */
#include <string.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_abi.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 20000;
    const char *only = argc > 2 ? argv[2] : "";
    int n_alloc = strcmp(only, "info") ? n : 0, n_info = strcmp(only, "alloc") ? n : 0;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    CUresult (*init)(unsigned) = dlsym(cuda, "cuInit");
    CUresult (*retain)(CUcontext *, CUdevice) = dlsym(cuda, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = dlsym(cuda, "cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = dlsym(cuda, "cuMemAlloc_v2");
    CUresult (*mfree)(CUdeviceptr) = dlsym(cuda, "cuMemFree_v2");
    CUresult (*info)(size_t *, size_t *) = dlsym(cuda, "cuMemGetInfo_v2");
    double t0 = now();
    if (init(0))
        return 1;
    double t_init = now() - t0;
    CUcontext ctx;
    retain(&ctx, 0);
    set(ctx);
    CUdeviceptr p;
    size_t f, t;
    if (!strcmp(only, "hold")) {   /* a slot of the slice taken, and memory in it, till told */
        if (alloc(&p, 1 << 20))
            return 2;
        printf("held\n");
        fflush(stdout);
        while (getchar() != EOF)
            ;
        return 0;   /* (exits holding it: the driver frees it, the slot is reaped) */
    }
    for (int i = 0; i < 1000; i++) {   /* warm up */
        alloc(&p, 1 << 20);
        mfree(p);
        info(&f, &t);
    }
    t0 = now();
    for (int i = 0; i < n_alloc; i++) {
        if (alloc(&p, 1 << 20) || mfree(p))
            return 2;
    }
    double t_alloc = (now() - t0) / (n_alloc ? n_alloc : 1);
    t0 = now();
    for (int i = 0; i < n_info; i++)
        info(&f, &t);
    double t_info = (now() - t0) / (n_info ? n_info : 1);
    printf("init_ns=%.0f alloc_free_ns=%.1f meminfo_ns=%.1f\n", t_init, t_alloc, t_info);
    return 0;
}
