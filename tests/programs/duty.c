/* A saturating GPU workload for compute-share tests: launches sim_<us>us kernels (or a
 * graph of them) back to back on one stream for <seconds>, through dlopen + dlsym.
 * usage: duty <kernel_us> <seconds> [kernel|graph|ex|ptsz|sync|many|captured] [blocks]
 * (sync: cuStreamSynchronize after each launch, as a training step that reads its loss does;
 * many: first 16 other grids of the kernel, 1 to 16 blocks, once each and back to back, as a
 * framework's first step launches many kernels, then the loop's; captured: the same 16
 * captured into a graph, launched once, then the loop's, as a framework that captures its
 * step before it runs it)
 * Prints: launches=<n> */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_abi.h"

#define SYM(name) void *name = dlsym(cuda, #name)
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    if (argc < 3)
        return 2;
    int us = atoi(argv[1]);
    double seconds = atof(argv[2]);
    const char *mode = argc > 3 ? argv[3] : "kernel";
    unsigned blocks = argc > 4 ? (unsigned)atoi(argv[4]) : 1;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda)
        return 3;
    SYM(cuInit); SYM(cuDevicePrimaryCtxRetain); SYM(cuCtxSetCurrent); SYM(cuModuleLoadData);
    SYM(cuModuleGetFunction); SYM(cuStreamCreate); SYM(cuLaunchKernel); SYM(cuLaunchKernel_ptsz);
    SYM(cuLaunchKernelEx); SYM(cuStreamSynchronize); SYM(cuStreamBeginCapture_v2); SYM(cuStreamEndCapture);
    SYM(cuGraphInstantiateWithFlags); SYM(cuGraphLaunch);
    CUcontext ctx;
    CUmodule mod;
    CUfunction f;
    CUstream s;
    char name[64];
    snprintf(name, sizeof name, "sim_%dus", us);
    if (((CUresult(*)(unsigned))cuInit)(0) ||
        ((CUresult(*)(CUcontext *, CUdevice))cuDevicePrimaryCtxRetain)(&ctx, 0) ||
        ((CUresult(*)(CUcontext))cuCtxSetCurrent)(ctx) ||
        ((CUresult(*)(CUmodule *, const void *))cuModuleLoadData)(&mod, "image") ||
        ((CUresult(*)(CUfunction *, CUmodule, const char *))cuModuleGetFunction)(&f, mod, name) ||
        ((CUresult(*)(CUstream *, unsigned))cuStreamCreate)(&s, 0))
        return 4;
    CUgraphExec exec = NULL;
    if (!strcmp(mode, "graph")) {   /* a graph of 4 kernels, captured from the stream */
        CUgraph g;
        ((CUresult(*)(CUstream, int))cuStreamBeginCapture_v2)(s, 0);
        for (int i = 0; i < 4; i++)
            ((launch_fn)cuLaunchKernel)(f, blocks, 1, 1, 32, 1, 1, 0, s, NULL, NULL);
        ((CUresult(*)(CUstream, CUgraph *))cuStreamEndCapture)(s, &g);
        if (((CUresult(*)(CUgraphExec *, CUgraph, unsigned long long))cuGraphInstantiateWithFlags)(&exec, g, 0))
            return 5;
    }
    int captured = !strcmp(mode, "captured");
    if (captured)
        ((CUresult(*)(CUstream, int))cuStreamBeginCapture_v2)(s, 0);
    if (captured || !strcmp(mode, "many"))
        for (unsigned b = 1; b <= 16; b++)
            if (((launch_fn)cuLaunchKernel)(f, b, 1, 1, 32, 1, 1, 0, s, NULL, NULL))
                return 6;
    if (captured) {
        CUgraph g;
        CUgraphExec once;
        if (((CUresult(*)(CUstream, CUgraph *))cuStreamEndCapture)(s, &g) ||
            ((CUresult(*)(CUgraphExec *, CUgraph, unsigned long long))cuGraphInstantiateWithFlags)(&once, g, 0) ||
            ((CUresult(*)(CUgraphExec, CUstream))cuGraphLaunch)(once, s) ||
            ((CUresult(*)(CUstream))cuStreamSynchronize)(s))
            return 5;
    }
    long n = 0;
    double end = now() + seconds;
    while (now() < end) {
        CUresult r;
        if (exec) {
            r = ((CUresult(*)(CUgraphExec, CUstream))cuGraphLaunch)(exec, s);
        } else if (!strcmp(mode, "ex")) {
            CUlaunchConfig c = {blocks, 1, 1, 32, 1, 1, 0, s, NULL, 0};
            r = ((CUresult(*)(const CUlaunchConfig *, CUfunction, void **, void **))cuLaunchKernelEx)(&c, f, NULL, NULL);
        } else {
            launch_fn l = (launch_fn)(!strcmp(mode, "ptsz") ? cuLaunchKernel_ptsz : cuLaunchKernel);
            r = l(f, blocks, 1, 1, 32, 1, 1, 0, !strcmp(mode, "ptsz") ? NULL : s, NULL, NULL);
        }
        if (r)
            return 6;
        if (!strcmp(mode, "sync") && ((CUresult(*)(CUstream))cuStreamSynchronize)(s))
            return 7;
        n++;
    }
    ((CUresult(*)(CUstream))cuStreamSynchronize)(s);
    printf("launches=%ld\n", n);
    return 0;
}
