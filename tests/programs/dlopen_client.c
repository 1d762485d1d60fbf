/* A CUDA client that finds the driver the way most programs do: dlopen("libcuda.so.1")
 * and dlsym of each versioned entry point, with no CUDA headers beyond csrc/cuda_abi.h.
 *
 * It initialises the driver, makes the primary context current, allocates device memory,
 * round-trips a buffer through it, runs one simulated kernel (sim_1000us, 1 block),
 * synchronises, frees, and launches once through a bogus function handle.  It prints
 * key=value lines for the test to check, then "ok"; or "FAIL <step> <code>" and exits 1. */
#define _GNU_SOURCE
#include "cuda_abi.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef CUresult (*cuInit_t)(unsigned int);
typedef CUresult (*cuDeviceGet_t)(CUdevice *, int);
typedef CUresult (*cuDeviceGetName_t)(char *, int, CUdevice);
typedef CUresult (*cuDevicePrimaryCtxRetain_t)(CUcontext *, CUdevice);
typedef CUresult (*cuCtxSetCurrent_t)(CUcontext);
typedef CUresult (*cuMemGetInfo_t)(size_t *, size_t *);
typedef CUresult (*cuMemAlloc_t)(CUdeviceptr *, size_t);
typedef CUresult (*cuMemFree_t)(CUdeviceptr);
typedef CUresult (*cuMemcpyHtoD_t)(CUdeviceptr, const void *, size_t);
typedef CUresult (*cuMemcpyDtoH_t)(void *, CUdeviceptr, size_t);
typedef CUresult (*cuModuleLoadData_t)(CUmodule *, const void *);
typedef CUresult (*cuModuleGetFunction_t)(CUfunction *, CUmodule, const char *);
typedef CUresult (*cuLaunchKernel_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                     unsigned, unsigned, CUstream, void **, void **);
typedef CUresult (*cuStreamSynchronize_t)(CUstream);

static void *lib;

static void *sym(const char *name)
{
    void *p = dlsym(lib, name);
    if (!p) {
        printf("FAIL dlsym %s\n", name);
        exit(1);
    }
    return p;
}

#define CHECK(step, call)                                  \
    do {                                                   \
        CUresult r_ = (call);                              \
        if (r_ != CUDA_SUCCESS) {                          \
            printf("FAIL %s %d\n", step, (int)r_);         \
            return 1;                                      \
        }                                                  \
    } while (0)

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

int main(void)
{
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        printf("FAIL dlopen %s\n", dlerror());
        return 1;
    }
    cuInit_t init = (cuInit_t)sym("cuInit");
    cuDeviceGet_t device_get = (cuDeviceGet_t)sym("cuDeviceGet");
    cuDeviceGetName_t device_name = (cuDeviceGetName_t)sym("cuDeviceGetName");
    cuDevicePrimaryCtxRetain_t retain = (cuDevicePrimaryCtxRetain_t)sym("cuDevicePrimaryCtxRetain");
    cuCtxSetCurrent_t set_current = (cuCtxSetCurrent_t)sym("cuCtxSetCurrent");
    cuMemGetInfo_t mem_info = (cuMemGetInfo_t)sym("cuMemGetInfo_v2");
    cuMemAlloc_t mem_alloc = (cuMemAlloc_t)sym("cuMemAlloc_v2");
    cuMemFree_t mem_free = (cuMemFree_t)sym("cuMemFree_v2");
    cuMemcpyHtoD_t htod = (cuMemcpyHtoD_t)sym("cuMemcpyHtoD_v2");
    cuMemcpyDtoH_t dtoh = (cuMemcpyDtoH_t)sym("cuMemcpyDtoH_v2");
    cuModuleLoadData_t load = (cuModuleLoadData_t)sym("cuModuleLoadData");
    cuModuleGetFunction_t get_function = (cuModuleGetFunction_t)sym("cuModuleGetFunction");
    cuLaunchKernel_t launch = (cuLaunchKernel_t)sym("cuLaunchKernel");
    cuStreamSynchronize_t sync = (cuStreamSynchronize_t)sym("cuStreamSynchronize");

    CUdevice dev;
    CUcontext ctx;
    char name[128];
    size_t free0, free1, free2, total;
    CHECK("cuInit", init(0));
    CHECK("cuDeviceGet", device_get(&dev, 0));
    CHECK("cuDeviceGetName", device_name(name, (int)sizeof name, dev));
    CHECK("cuDevicePrimaryCtxRetain", retain(&ctx, dev));
    CHECK("cuCtxSetCurrent", set_current(ctx));
    CHECK("cuMemGetInfo", mem_info(&free0, &total));

    enum { N = 1 << 20 };
    unsigned char *out = malloc(N), *back = malloc(N);
    if (!out || !back) {
        printf("FAIL malloc 0\n");
        return 1;
    }
    for (size_t i = 0; i < N; i++)
        out[i] = (unsigned char)(i * 131u + 7u);
    memset(back, 0, N);

    CUdeviceptr d;
    CHECK("cuMemAlloc", mem_alloc(&d, N));
    CHECK("cuMemGetInfo", mem_info(&free1, &total));
    CHECK("cuMemcpyHtoD", htod(d, out, N));
    CHECK("cuMemcpyDtoH", dtoh(back, d, N));
    int roundtrip = memcmp(out, back, N) == 0;

    CUmodule mod;
    CUfunction fn;
    static const char image[] = "any image: simgpu runs functions by name";
    CHECK("cuModuleLoadData", load(&mod, image));
    CHECK("cuModuleGetFunction", get_function(&fn, mod, "sim_1000us"));
    double t0 = now_ms();
    CHECK("cuLaunchKernel", launch(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
    CHECK("cuStreamSynchronize", sync(NULL));
    double kernel_ms = now_ms() - t0;

    CHECK("cuMemFree", mem_free(d));
    CHECK("cuMemGetInfo", mem_info(&free2, &total));

    CUfunction bogus = (CUfunction)(uintptr_t)12345;
    CUresult bogus_launch = launch(bogus, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);

    printf("name=%s\ntotal=%zu\nalloc_drop=%zu\nfree_restored=%d\nroundtrip=%d\nkernel_ms=%.3f\n"
           "bogus_launch=%d\nok\n",
           name, total, free0 - free1, free2 == free0, roundtrip, kernel_ms, (int)bogus_launch);
    free(out);
    free(back);
    return 0;
}
