/* Processes of one container ending in every way a process ends, for the accounting
 * tests (tests/shim/test_shim_races.py).  The driver is found with dlopen + dlsym, as in
 * shim_storm.c.
 *
 *   shim_lifecycle exit-freeing NTHREADS CHUNK DELAY_US
 *       allocates NTHREADS chunks, starts NTHREADS threads that each free theirs and
 *       allocate it again in a loop, and calls exit() after DELAY_US: exit runs while the
 *       threads are inside the driver.  Prints nothing.
 *   shim_lifecycle churn MAX_BYTES SEED
 *       prints "ready", then allocates and frees random sizes (up to 4 held) forever:
 *       a target for kill -9 and SIGTERM at random moments.
 *   shim_lifecycle hold BYTES
 *       allocates BYTES, prints {"alloc": rc}, then waits for a signal.
 *   shim_lifecycle fill CHUNK
 *       allocates CHUNK until refused, prints {"held": bytes, "error": first non-OOM rc}.
 *   shim_lifecycle together NPROC BYTES
 *       forks NPROC workers before any CUDA call; each initialises, waits for the common
 *       start, then allocates BYTES and frees it; prints {"ok": n, "refused": n, ...}.
 *   shim_lifecycle location TYPE BYTES
 *       cuMemCreate of BYTES with location type TYPE; prints {"create": rc}.
 *   shim_lifecycle relay NPROC WIDTH BYTES
 *       NPROC workers, WIDTH at a time (one forked as each ends): each initialises, allocates
 *       BYTES (asking again every 0.2 ms while refused, for up to 2 s), holds it 1 ms and
 *       calls exit() holding it: one starts while another ends.  Prints {"ok": n, "failed": n}. */
#define _GNU_SOURCE
#include "cuda_abi.h"

#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static CUresult (*cu_init)(unsigned int);
static CUresult (*cu_device_get)(CUdevice *, int);
static CUresult (*cu_retain)(CUcontext *, CUdevice);
static CUresult (*cu_set_current)(CUcontext);
static CUresult (*cu_alloc)(CUdeviceptr *, size_t);
static CUresult (*cu_free)(CUdeviceptr);
static CUresult (*cu_create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                             unsigned long long);
static CUcontext context;

static void *need(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "shim_lifecycle: no symbol %s\n", name);
        _exit(3);
    }
    return p;
}

static void setup(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "shim_lifecycle: %s\n", dlerror());
        _exit(3);
    }
    *(void **)&cu_init = need(lib, "cuInit");
    *(void **)&cu_device_get = need(lib, "cuDeviceGet");
    *(void **)&cu_retain = need(lib, "cuDevicePrimaryCtxRetain");
    *(void **)&cu_set_current = need(lib, "cuCtxSetCurrent");
    *(void **)&cu_alloc = need(lib, "cuMemAlloc_v2");
    *(void **)&cu_free = need(lib, "cuMemFree_v2");
    *(void **)&cu_create = need(lib, "cuMemCreate");
    CUdevice dev;
    if (cu_init(0) || cu_device_get(&dev, 0) || cu_retain(&context, dev) || cu_set_current(context)) {
        fprintf(stderr, "shim_lifecycle: no context\n");
        _exit(3);
    }
}

struct freer { size_t chunk; CUdeviceptr p; };

static void *free_loop(void *arg)
{
    struct freer *f = arg;
    cu_set_current(context);
    for (;;) {
        cu_free(f->p);
        if (cu_alloc(&f->p, f->chunk) != CUDA_SUCCESS)
            f->p = 0;
    }
    return NULL;
}

static int exit_freeing(int nthreads, size_t chunk, long delay_us)
{
    setup();
    struct freer *f = calloc((size_t)nthreads, sizeof *f);
    pthread_t t;
    for (int i = 0; i < nthreads; i++) {
        f[i].chunk = chunk;
        cu_alloc(&f[i].p, chunk);
    }
    for (int i = 0; i < nthreads; i++)
        pthread_create(&t, NULL, free_loop, &f[i]);
    struct timespec ts = {delay_us / 1000000, (delay_us % 1000000) * 1000};
    nanosleep(&ts, NULL);
    exit(0);   /* the destructors run while the threads are still freeing and allocating */
}

static __attribute__((noreturn)) void churn(size_t max_bytes, unsigned seed)
{
    setup();
    printf("ready\n");
    fflush(stdout);
    CUdeviceptr held[4] = {0};
    for (unsigned i = 0;; i++) {
        int k = (int)(i % 4);
        if (held[k]) {
            cu_free(held[k]);
            held[k] = 0;
        }
        size_t size = 1 + (size_t)rand_r(&seed) % max_bytes;
        if (cu_alloc(&held[k], size) != CUDA_SUCCESS)
            held[k] = 0;
    }
}

static __attribute__((noreturn)) void hold(size_t bytes)
{
    setup();
    CUdeviceptr p;
    printf("{\"alloc\": %d}\n", (int)cu_alloc(&p, bytes));
    fflush(stdout);
    for (;;)
        pause();
}

static int fill(size_t chunk)
{
    setup();
    unsigned long long held = 0;
    CUdeviceptr p;
    CUresult e;
    while ((e = cu_alloc(&p, chunk)) == CUDA_SUCCESS)
        held += chunk;
    printf("{\"held\": %llu, \"error\": %d}\n", held, e == CUDA_ERROR_OUT_OF_MEMORY ? 0 : (int)e);
    fflush(stdout);
    return 0;
}

static int together(int nproc, size_t bytes)
{
    int ready[2], start[2], results[2];
    if (pipe(ready) || pipe(start) || pipe(results))
        return 3;
    for (int i = 0; i < nproc; i++) {
        if (fork() == 0) {
            close(start[1]);
            char c = 'r';
            if (write(ready[1], &c, 1) != 1)
                _exit(3);
            while (read(start[0], &c, 1) > 0)   /* all start when the parent closes it */
                ;
            setup();
            CUdeviceptr p;
            CUresult e = cu_alloc(&p, bytes);
            if (e == CUDA_SUCCESS)
                e = cu_free(p);
            c = e == CUDA_SUCCESS ? 'o' : e == CUDA_ERROR_OUT_OF_MEMORY ? 'x' : 'e';
            if (write(results[1], &c, 1) != 1)
                _exit(3);
            _exit(0);
        }
    }
    close(start[0]);
    char c;
    for (int i = 0; i < nproc; i++)
        if (read(ready[0], &c, 1) != 1)
            return 3;
    close(start[1]);
    int ok = 0, refused = 0, errors = 0;
    for (int i = 0; i < nproc; i++) {
        if (read(results[0], &c, 1) != 1)
            return 3;
        ok += c == 'o';
        refused += c == 'x';
        errors += c == 'e';
    }
    int failed = 0, status;
    while (wait(&status) > 0)
        failed += !WIFEXITED(status) || WEXITSTATUS(status);
    printf("{\"ok\": %d, \"refused\": %d, \"errors\": %d, \"failed_workers\": %d}\n", ok, refused, errors, failed);
    return 0;
}

static __attribute__((noreturn)) void relay_worker(size_t bytes)
{
    setup();
    CUdeviceptr p;
    for (int i = 0; i < 10000; i++) {
        CUresult e = cu_alloc(&p, bytes);
        if (e == CUDA_SUCCESS) {
            struct timespec held = {0, 1000000};
            nanosleep(&held, NULL);
            exit(0);   /* exit handlers run, the allocation still held */
        }
        if (e != CUDA_ERROR_OUT_OF_MEMORY)
            _exit(4);
        struct timespec again = {0, 200000};
        nanosleep(&again, NULL);
    }
    _exit(5);
}

static int relay(int nproc, int width, size_t bytes)
{
    int started = 0, running = 0, ok = 0, failed = 0, status;
    while (started < nproc || running) {
        if (started < nproc && running < width) {
            pid_t pid = fork();
            if (pid == 0)
                relay_worker(bytes);
            if (pid < 0)
                return 3;
            started++;
            running++;
            continue;
        }
        if (wait(&status) < 0)
            return 3;
        running--;
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
            ok++;
        else
            failed++;
    }
    printf("{\"ok\": %d, \"failed\": %d}\n", ok, failed);
    return 0;
}

static __attribute__((noreturn)) void location(int type, size_t bytes)
{
    setup();
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;   /* CU_MEM_ALLOCATION_TYPE_PINNED */
    prop.location.type = type;
    prop.location.id = 0;
    CUmemGenericAllocationHandle h;
    printf("{\"create\": %d}\n", (int)cu_create(&h, bytes, &prop, 0));
    fflush(stdout);
    for (;;)
        pause();
}

int main(int argc, char **argv)
{
    if (argc == 5 && !strcmp(argv[1], "exit-freeing"))
        return exit_freeing(atoi(argv[2]), strtoull(argv[3], NULL, 10), atol(argv[4]));
    if (argc == 4 && !strcmp(argv[1], "churn"))
        churn(strtoull(argv[2], NULL, 10), (unsigned)strtoul(argv[3], NULL, 10));
    if (argc == 3 && !strcmp(argv[1], "hold"))
        hold(strtoull(argv[2], NULL, 10));
    if (argc == 3 && !strcmp(argv[1], "fill"))
        return fill(strtoull(argv[2], NULL, 10));
    if (argc == 4 && !strcmp(argv[1], "together"))
        return together(atoi(argv[2]), strtoull(argv[3], NULL, 10));
    if (argc == 5 && !strcmp(argv[1], "relay"))
        return relay(atoi(argv[2]), atoi(argv[3]), strtoull(argv[4], NULL, 10));
    if (argc == 4 && !strcmp(argv[1], "location"))
        location(atoi(argv[2]), strtoull(argv[3], NULL, 10));
    fprintf(stderr, "usage: see the comment at the top of shim_lifecycle.c\n");
    return 2;
}
