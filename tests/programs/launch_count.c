/* Launch counters of a short-lived process: launches sim_1us kernels and exits at once.
 * usage: launch_count <launches> [<child launches after a fork> [<launches of a thread>]]
 * The main thread launches <launches>; with a second argument it then forks a child that
 * tries that many (each refused: the driver is not usable in a child forked after cuInit) and
 * exits (the parent waits); with a third, a thread launches that
 * many and ends before the process exits.  Exits 0 when every call succeeded. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_abi.h"

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);
static launch_fn launch;
static CUresult (*set_current)(CUcontext);
static CUresult (*sync_ctx)(void);
static CUcontext ctx;
static CUfunction f;

static int launch_n(long n)
{
    for (long i = 0; i < n; i++)
        if (launch(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL))
            return 6;
    return sync_ctx() ? 7 : 0;
}

/* A child forked after cuInit cannot use the driver: every call is CUDA_ERROR_NOT_INITIALIZED
 * (3), as a real driver answers.  0 when each of the child's launches was refused so. */
static int refused_n(long n)
{
    for (long i = 0; i < n; i++)
        if (launch(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) != 3)
            return 6;
    return sync_ctx() != 3 ? 7 : 0;
}

static void *thread_main(void *arg)
{
    if (set_current(ctx))
        return (void *)8;
    return (void *)(long)launch_n((long)arg);
}

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda)
        return 3;
    CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(cuda, "cuInit");
    CUresult (*retain)(CUcontext *, CUdevice) = (CUresult(*)(CUcontext *, CUdevice))dlsym(cuda, "cuDevicePrimaryCtxRetain");
    CUresult (*load)(CUmodule *, const void *) = (CUresult(*)(CUmodule *, const void *))dlsym(cuda, "cuModuleLoadData");
    CUresult (*get)(CUfunction *, CUmodule, const char *) =
        (CUresult(*)(CUfunction *, CUmodule, const char *))dlsym(cuda, "cuModuleGetFunction");
    set_current = (CUresult(*)(CUcontext))dlsym(cuda, "cuCtxSetCurrent");
    sync_ctx = (CUresult(*)(void))dlsym(cuda, "cuCtxSynchronize");
    launch = (launch_fn)dlsym(cuda, "cuLaunchKernel");
    CUmodule mod;
    if (init(0) || retain(&ctx, 0) || set_current(ctx) || load(&mod, "image") || get(&f, mod, "sim_1us"))
        return 4;
    int r = launch_n(atol(argv[1]));
    if (r)
        return r;
    if (argc > 2) {
        pid_t child = fork();
        if (child < 0)
            return 9;
        if (child == 0)
            exit(refused_n(atol(argv[2])));   /* exit(), not _exit(): as a program ends */
        int st;
        if (waitpid(child, &st, 0) != child || !WIFEXITED(st) || WEXITSTATUS(st))
            return 10;
    }
    if (argc > 3) {
        pthread_t t;
        void *tr;
        if (pthread_create(&t, NULL, thread_main, (void *)atol(argv[3])) || pthread_join(t, &tr) || tr)
            return 11;
    }
    return 0;
}
