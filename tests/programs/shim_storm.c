/* Many real processes of one container hammering the memory cap at once.
 *
 *   shim_storm storm  NPROC DURATION_MS MAX_BYTES SEED
 *       each worker allocates (sync or async) and frees (sync or async) random sizes
 *       between 1 byte and MAX_BYTES for DURATION_MS, holding at most 8 at a time, then
 *       frees everything and exits; the parent prints one JSON line of totals.
 *   shim_storm greedy NPROC CHUNK_BYTES ATTEMPTS
 *       each worker tries ATTEMPTS allocations of CHUNK_BYTES and holds what it gets; the
 *       parent prints {"held": N, ...} once all have tried, waits for a line on stdin,
 *       lets the workers free and exit, and prints {"done": true}.
 *
 * The parent forks the workers before any CUDA call, so each is a fresh process that
 * finds the driver with dlopen("libcuda.so.1") + dlsym (which the shim intercepts).
 * Workers initialise first and then wait on a pipe that the parent closes when all are
 * ready: they start at the same moment.  Exit status 0 unless something unexpected
 * happens (any CUDA error other than CUDA_ERROR_OUT_OF_MEMORY on allocation). */
#define _GNU_SOURCE
#include "cuda_abi.h"

#include <dlfcn.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef CUresult (*init_t)(unsigned int);
typedef CUresult (*device_get_t)(CUdevice *, int);
typedef CUresult (*ctx_retain_t)(CUcontext *, CUdevice);
typedef CUresult (*ctx_set_t)(CUcontext);
typedef CUresult (*stream_create_t)(CUstream *, unsigned int);
typedef CUresult (*stream_sync_t)(CUstream);
typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);
typedef CUresult (*free_t)(CUdeviceptr);
typedef CUresult (*alloc_async_t)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*free_async_t)(CUdeviceptr, CUstream);

static struct {
    init_t init;
    device_get_t device_get;
    ctx_retain_t retain;
    ctx_set_t set_current;
    stream_create_t stream_create;
    stream_sync_t stream_sync;
    alloc_t alloc;
    free_t free;
    alloc_async_t alloc_async;
    free_async_t free_async;
} cu;

struct result {
    long allocs, async_allocs, refused, frees, async_frees, errors;
    long held_chunks;
    unsigned long long max_held;
};

static void *need(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "shim_storm: no symbol %s\n", name);
        _exit(3);
    }
    return p;
}

static void load_driver(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "shim_storm: %s\n", dlerror());
        _exit(3);
    }
    cu.init = (init_t)need(lib, "cuInit");
    cu.device_get = (device_get_t)need(lib, "cuDeviceGet");
    cu.retain = (ctx_retain_t)need(lib, "cuDevicePrimaryCtxRetain");
    cu.set_current = (ctx_set_t)need(lib, "cuCtxSetCurrent");
    cu.stream_create = (stream_create_t)need(lib, "cuStreamCreate");
    cu.stream_sync = (stream_sync_t)need(lib, "cuStreamSynchronize");
    cu.alloc = (alloc_t)need(lib, "cuMemAlloc_v2");
    cu.free = (free_t)need(lib, "cuMemFree_v2");
    cu.alloc_async = (alloc_async_t)need(lib, "cuMemAllocAsync");
    cu.free_async = (free_async_t)need(lib, "cuMemFreeAsync");
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void pause_us(long us)
{
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

/* Worker setup: driver, context, stream; then tell the parent and wait for the start. */
static CUstream worker_start(int ready_fd, int start_fd)
{
    CUdevice dev;
    CUcontext ctx;
    CUstream stream;
    load_driver();
    if (cu.init(0) || cu.device_get(&dev, 0) || cu.retain(&ctx, dev) || cu.set_current(ctx) ||
        cu.stream_create(&stream, 0)) {
        fprintf(stderr, "shim_storm: worker %d cannot set up a context\n", (int)getpid());
        _exit(3);
    }
    char c = 'r';
    if (write(ready_fd, &c, 1) != 1)
        _exit(3);
    while (read(start_fd, &c, 1) > 0)   /* returns 0 when the parent closes it */
        ;
    return stream;
}

enum { MAX_HELD = 8, MAX_GREEDY = 64 };

static struct result storm_worker(CUstream stream, double duration_ms, unsigned long long max_bytes,
                                  unsigned seed)
{
    struct result r = {0};
    CUdeviceptr held[MAX_HELD];
    size_t sizes[MAX_HELD];
    int n = 0;
    unsigned long long held_bytes = 0;
    double end = now_ms() + duration_ms;
    while (now_ms() < end) {
        unsigned roll = (unsigned)rand_r(&seed) % 100;
        if (n < MAX_HELD && (n == 0 || roll < 60)) {
            size_t size = 1 + (size_t)(((unsigned long long)rand_r(&seed) << 16 ^ (unsigned)rand_r(&seed)) % max_bytes);
            int async = rand_r(&seed) % 3 == 0;
            CUresult e = async ? cu.alloc_async(&held[n], size, stream) : cu.alloc(&held[n], size);
            if (e == CUDA_SUCCESS) {
                sizes[n++] = size;
                held_bytes += size;
                if (held_bytes > r.max_held)
                    r.max_held = held_bytes;
                r.allocs++;
                r.async_allocs += async;
            } else if (e == CUDA_ERROR_OUT_OF_MEMORY) {
                r.refused++;
            } else {
                r.errors++;
            }
        } else {
            int i = (int)((unsigned)rand_r(&seed) % (unsigned)n);
            int async = rand_r(&seed) % 2;
            CUresult e = async ? cu.free_async(held[i], stream) : cu.free(held[i]);
            if (e != CUDA_SUCCESS)
                r.errors++;
            r.frees++;
            r.async_frees += async;
            held_bytes -= sizes[i];
            held[i] = held[--n];
            sizes[i] = sizes[n];
        }
        pause_us(300 + (long)(rand_r(&seed) % 400));
    }
    while (n > 0) {
        n--;
        CUresult e = n % 2 ? cu.free_async(held[n], stream) : cu.free(held[n]);
        if (e != CUDA_SUCCESS)
            r.errors++;
        r.frees++;
        r.async_frees += n % 2;
    }
    if (cu.stream_sync(stream))
        r.errors++;
    return r;
}

int main(int argc, char **argv)
{
    if (argc < 5 || (strcmp(argv[1], "storm") && strcmp(argv[1], "greedy")) ||
        (!strcmp(argv[1], "storm") && argc < 6)) {
        fprintf(stderr, "usage: shim_storm storm NPROC DURATION_MS MAX_BYTES SEED\n"
                        "       shim_storm greedy NPROC CHUNK_BYTES ATTEMPTS\n");
        return 2;
    }
    int greedy = !strcmp(argv[1], "greedy");
    int nproc = atoi(argv[2]);
    int ready[2], start[2], results[2], release[2];
    if (pipe(ready) || pipe(start) || pipe(results) || pipe(release))
        return 3;
    fflush(stdout);
    pid_t *pids = calloc((size_t)nproc, sizeof *pids);
    for (int w = 0; w < nproc; w++) {
        pid_t pid = fork();
        if (pid < 0)
            return 3;
        if (pid > 0) {
            pids[w] = pid;
            continue;
        }
        close(ready[0]);
        close(start[1]);
        close(results[0]);
        close(release[1]);
        CUstream stream = worker_start(ready[1], start[0]);
        struct result r = {0};
        if (greedy) {
            unsigned long long chunk = strtoull(argv[3], NULL, 10);
            int attempts = atoi(argv[4]);
            CUdeviceptr held[MAX_GREEDY];
            for (int a = 0; a < attempts && r.held_chunks < MAX_GREEDY; a++) {
                CUresult e = cu.alloc(&held[r.held_chunks], chunk);
                if (e == CUDA_SUCCESS)
                    r.held_chunks++;
                else if (e == CUDA_ERROR_OUT_OF_MEMORY)
                    r.refused++;
                else
                    r.errors++;
                sched_yield();
            }
            r.allocs = r.held_chunks;
            if (write(results[1], &r, sizeof r) != (ssize_t)sizeof r)
                _exit(3);
            char c;
            while (read(release[0], &c, 1) > 0)
                ;
            for (long i = 0; i < r.held_chunks; i++)
                if (cu.free(held[i]))
                    exit(4);
            exit(0);   /* a normal exit: the shim's and the driver's destructors run */
        }
        r = storm_worker(stream, atof(argv[3]), strtoull(argv[4], NULL, 10),
                         (unsigned)strtoul(argv[5], NULL, 10) * 7919u + (unsigned)w);
        if (write(results[1], &r, sizeof r) != (ssize_t)sizeof r)
            _exit(3);
        exit(r.errors ? 4 : 0);
    }
    close(ready[1]);
    close(start[0]);
    close(results[1]);
    close(release[0]);

    char c;
    for (int w = 0; w < nproc; w++)
        if (read(ready[0], &c, 1) != 1) {
            fprintf(stderr, "shim_storm: a worker died during setup\n");
            return 3;
        }
    double t0 = now_ms();
    close(start[1]);   /* go */

    struct result total = {0}, r;
    for (int w = 0; w < nproc; w++) {
        if (read(results[0], &r, sizeof r) != (ssize_t)sizeof r) {
            fprintf(stderr, "shim_storm: a worker died\n");
            return 3;
        }
        total.allocs += r.allocs;
        total.async_allocs += r.async_allocs;
        total.refused += r.refused;
        total.frees += r.frees;
        total.async_frees += r.async_frees;
        total.errors += r.errors;
        total.held_chunks += r.held_chunks;
        if (r.max_held > total.max_held)
            total.max_held = r.max_held;
    }
    printf("{\"workers\": %d, \"allocs\": %ld, \"async_allocs\": %ld, \"refused\": %ld, \"frees\": %ld, "
           "\"async_frees\": %ld, \"errors\": %ld, \"held\": %ld, \"seconds\": %.3f}\n",
           nproc, total.allocs, total.async_allocs, total.refused, total.frees, total.async_frees,
           total.errors, total.held_chunks, (now_ms() - t0) / 1e3);
    fflush(stdout);
    if (greedy) {
        char line[64];
        if (!fgets(line, sizeof line, stdin))
            line[0] = 0;
        close(release[1]);
    }
    int failed = 0;
    for (int w = 0; w < nproc; w++) {
        int status;
        waitpid(pids[w], &status, 0);
        failed += !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    }
    printf("{\"done\": true, \"failed_workers\": %d}\n", failed);
    return failed ? 1 : 0;
}
