/* Cost of cuGetProcAddress_v2, for bench/test_shim_overhead.py and bench/figures.py.
 * usage: procaddress N REQUESTS   N lookups, cycling in order over REQUESTS: a file of
 *        "symbol<TAB>cudaVersion<TAB>flags" lines (tests/fixtures/cudart13-getprocaddress.tsv:
 *        what NVIDIA's CUDA 13 runtime asks for at start-up, one in eight of them hooked)
 * Prints: lookup_ns=<per call> */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cuda_abi.h"

#define MAX_REQUESTS 4096

static struct request {
    char symbol[128];
    int version;
    unsigned long long flags;
} requests[MAX_REQUESTS];

static int read_requests(const char *path)
{
    FILE *f = fopen(path, "r");
    char line[256];
    int n = 0;
    while (f && n < MAX_REQUESTS && fgets(line, sizeof line, f)) {
        struct request *r = &requests[n];
        if (line[0] != '#' && sscanf(line, "%127s %d %llu", r->symbol, &r->version, &r->flags) == 3)
            n++;   /* (the header line has no numbers) */
    }
    if (f)
        fclose(f);
    return n;
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 100000;
    int count = argc > 2 ? read_requests(argv[2]) : 0;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    CUresult (*init)(unsigned) = dlsym(cuda, "cuInit");
    CUresult (*gpa)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *) =
        dlsym(cuda, "cuGetProcAddress_v2");
    if (!count || !init || !gpa || init(0))
        return 1;
    void *p;
    CUdriverProcAddressQueryResult st;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) {
        const struct request *r = &requests[i % count];
        if (gpa(r->symbol, &p, r->version, r->flags, &st))
            return 2;
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("lookup_ns=%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
}
