/* An honest tenant that allocates and frees as fast as it can: <threads> threads, each
 * taking blocks of 64 MiB .. 1 GiB (a fixed pseudo-random sequence per seed) with cuMemAlloc
 * or, every other time, cuMemAllocAsync on its own stream, keeping it a moment and freeing
 * it the same way, for <seconds>.  Refusals (the cap) are part of the churn, not errors.
 * usage: churn <seconds> <threads> <seed>
 * Prints: allocations=<n> refused=<n> */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_abi.h"

#define MiB (1ull << 20)

static void *cuda;
static CUcontext ctx;
static double seconds;
static long allocated, refused;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *churn(void *arg)
{
    unsigned seed = (unsigned)(unsigned long)arg;
    CUresult (*set)(CUcontext) = dlsym(cuda, "cuCtxSetCurrent");
    CUresult (*stream_create)(CUstream *, unsigned) = dlsym(cuda, "cuStreamCreate");
    CUresult (*alloc)(CUdeviceptr *, size_t) = dlsym(cuda, "cuMemAlloc_v2");
    CUresult (*release)(CUdeviceptr) = dlsym(cuda, "cuMemFree_v2");
    CUresult (*alloc_async)(CUdeviceptr *, size_t, CUstream) = dlsym(cuda, "cuMemAllocAsync");
    CUresult (*free_async)(CUdeviceptr, CUstream) = dlsym(cuda, "cuMemFreeAsync");
    CUresult (*sync)(CUstream) = dlsym(cuda, "cuStreamSynchronize");
    CUstream s;
    if (set(ctx) || stream_create(&s, 0))
        exit(4);
    double end = now() + seconds;
    for (long i = 0; now() < end; i++) {
        size_t bytes = (64 + (size_t)(rand_r(&seed) % 961)) * MiB;
        CUdeviceptr p;
        int async = i % 2;
        CUresult r = async ? alloc_async(&p, bytes, s) : alloc(&p, bytes);
        if (r == CUDA_ERROR_OUT_OF_MEMORY) {
            __atomic_add_fetch(&refused, 1, __ATOMIC_RELAXED);
            continue;
        }
        if (r)
            exit(5);
        __atomic_add_fetch(&allocated, 1, __ATOMIC_RELAXED);
        struct timespec hold = {0, (long)(rand_r(&seed) % 2000) * 1000};   /* 0-2 ms */
        nanosleep(&hold, NULL);
        if (async ? (free_async(p, s) || sync(s)) : release(p))
            exit(6);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 4)
        return 2;
    seconds = atof(argv[1]);
    int threads = atoi(argv[2]);
    unsigned seed = (unsigned)atoi(argv[3]);
    cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda)
        return 3;
    CUresult (*init)(unsigned) = dlsym(cuda, "cuInit");
    CUresult (*retain)(CUcontext *, CUdevice) = dlsym(cuda, "cuDevicePrimaryCtxRetain");
    if (init(0) || retain(&ctx, 0))
        return 4;
    pthread_t t[16];
    for (int i = 0; i < threads && i < 16; i++)
        pthread_create(&t[i], NULL, churn, (void *)(unsigned long)(seed * 16 + i + 1));
    for (int i = 0; i < threads && i < 16; i++)
        pthread_join(t[i], NULL);
    printf("allocations=%ld refused=%ld\n", allocated, refused);
    return 0;
}
