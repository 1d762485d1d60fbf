/* Threads racing the shim's first call, then churning its allocation table.
 *
 *   shim_threads NTHREADS UNIT_BYTES CHURN
 *
 * The driver is found with dlopen + dlsym (no driver call yet: dlsym does not initialise
 * the shim).  NTHREADS threads meet at a barrier and then each, at the same moment, calls
 * cuInit, makes the primary context current and calls cuMemAlloc((i + 1) * UNIT_BYTES):
 * the shim's lazy initialisation is raced by all of them.  The program prints
 *   {"phase": "first", "ok": [...], "refused": N, "errors": N, "sum_ok": BYTES}
 * and waits for a line on stdin.  Then every thread does CHURN alloc/free pairs of small
 * odd sizes (all succeed while the first allocations are held), and the program prints
 *   {"phase": "churned", "errors": N, "churn_ok": N}
 * and waits again; then it frees the first allocations, prints {"phase": "freed", ...}
 * and waits for a last line before exiting. */
#define _GNU_SOURCE
#include "cuda_abi.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

typedef CUresult (*init_t)(unsigned int);
typedef CUresult (*device_get_t)(CUdevice *, int);
typedef CUresult (*ctx_retain_t)(CUcontext *, CUdevice);
typedef CUresult (*ctx_set_t)(CUcontext);
typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);
typedef CUresult (*free_t)(CUdeviceptr);

static init_t cu_init;
static device_get_t cu_device_get;
static ctx_retain_t cu_retain;
static ctx_set_t cu_set_current;
static alloc_t cu_alloc;
static free_t cu_free;

static pthread_barrier_t barrier;
static size_t unit;
static long churn;

struct worker {
    pthread_t thread;
    int index;
    CUresult first;
    CUdeviceptr ptr;
    long errors, churn_ok;
};

static void *first_call(void *arg)
{
    struct worker *w = arg;
    CUdevice dev;
    CUcontext ctx;
    pthread_barrier_wait(&barrier);
    if (cu_init(0) || cu_device_get(&dev, 0) || cu_retain(&ctx, dev) || cu_set_current(ctx)) {
        w->errors++;
        return NULL;
    }
    w->first = cu_alloc(&w->ptr, (size_t)(w->index + 1) * unit);
    if (w->first != CUDA_SUCCESS && w->first != CUDA_ERROR_OUT_OF_MEMORY)
        w->errors++;
    return NULL;
}

static void *churn_table(void *arg)
{
    struct worker *w = arg;
    CUdevice dev;
    CUcontext ctx;
    if (cu_device_get(&dev, 0) || cu_retain(&ctx, dev) || cu_set_current(ctx)) {
        w->errors++;
        return NULL;
    }
    pthread_barrier_wait(&barrier);
    for (long i = 0; i < churn; i++) {
        CUdeviceptr p[3];
        int got = 0;
        for (int k = 0; k < 3; k++)
            got += cu_alloc(&p[got], 4096 * (size_t)(k + 1) + (size_t)w->index + 1) == CUDA_SUCCESS;
        w->churn_ok += got;
        if (got != 3)
            w->errors++;
        while (got > 0)
            if (cu_free(p[--got]))
                w->errors++;
    }
    return NULL;
}

static void wait_line(void)
{
    char line[64];
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
        exit(5);
}

static void *need(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    if (!p) {
        printf("{\"error\": \"no symbol %s\"}\n", name);
        exit(3);
    }
    return p;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: shim_threads NTHREADS UNIT_BYTES CHURN\n");
        return 2;
    }
    int n = atoi(argv[1]);
    unit = strtoull(argv[2], NULL, 10);
    churn = atol(argv[3]);
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        printf("{\"error\": \"dlopen\"}\n");
        return 3;
    }
    cu_init = (init_t)need(lib, "cuInit");
    cu_device_get = (device_get_t)need(lib, "cuDeviceGet");
    cu_retain = (ctx_retain_t)need(lib, "cuDevicePrimaryCtxRetain");
    cu_set_current = (ctx_set_t)need(lib, "cuCtxSetCurrent");
    cu_alloc = (alloc_t)need(lib, "cuMemAlloc_v2");
    cu_free = (free_t)need(lib, "cuMemFree_v2");

    struct worker *w = calloc((size_t)n, sizeof *w);
    pthread_barrier_init(&barrier, NULL, (unsigned)n);
    for (int i = 0; i < n; i++) {
        w[i].index = i;
        pthread_create(&w[i].thread, NULL, first_call, &w[i]);
    }
    long errors = 0, refused = 0;
    unsigned long long sum = 0;
    printf("{\"phase\": \"first\", \"ok\": [");
    int first = 1;
    for (int i = 0; i < n; i++) {
        pthread_join(w[i].thread, NULL);
        errors += w[i].errors;
        if (w[i].first == CUDA_SUCCESS && !w[i].errors) {
            printf("%s%zu", first ? "" : ", ", (size_t)(i + 1) * unit);
            first = 0;
            sum += (unsigned long long)(i + 1) * unit;
        } else if (w[i].first == CUDA_ERROR_OUT_OF_MEMORY) {
            refused++;
        }
    }
    printf("], \"refused\": %ld, \"errors\": %ld, \"sum_ok\": %llu}\n", refused, errors, sum);
    wait_line();

    errors = 0;
    long churn_ok = 0;
    for (int i = 0; i < n; i++) {
        w[i].errors = 0;
        pthread_create(&w[i].thread, NULL, churn_table, &w[i]);
    }
    for (int i = 0; i < n; i++) {
        pthread_join(w[i].thread, NULL);
        errors += w[i].errors;
        churn_ok += w[i].churn_ok;
    }
    printf("{\"phase\": \"churned\", \"errors\": %ld, \"churn_ok\": %ld}\n", errors, churn_ok);
    wait_line();

    errors = 0;
    for (int i = 0; i < n; i++)
        if (w[i].first == CUDA_SUCCESS && cu_free(w[i].ptr))
            errors++;
    printf("{\"phase\": \"freed\", \"errors\": %ld}\n", errors);
    wait_line();
    return 0;
}
