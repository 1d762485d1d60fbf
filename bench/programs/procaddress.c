/* Cost of cuGetProcAddress_v2, for bench/test_shim_overhead.py.
 * usage: procaddress N  — N lookups cycling over hooked and unhooked names.
 * Prints: lookup_ns=<per call> */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_abi.h"

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 100000;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    CUresult (*init)(unsigned) = dlsym(cuda, "cuInit");
    CUresult (*gpa)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *) =
        dlsym(cuda, "cuGetProcAddress_v2");
    const char *names[] = {"cuMemAlloc", "cuLaunchKernel", "cuStreamSynchronize", "cuCtxGetDevice"};
    if (!init || !gpa || init(0))
        return 1;
    void *p;
    CUdriverProcAddressQueryResult st;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++)
        if (gpa(names[i & 3], &p, 12000, 0, &st))
            return 2;
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("lookup_ns=%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
}
