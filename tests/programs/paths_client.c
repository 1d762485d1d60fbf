/* Reaches the driver by one of the four ways a program can, then allocates against the
 * container's cap and reads the memory view.  Prints one line the test checks:
 *   alloc3=<CUresult of 3 GiB> alloc2=<CUresult of a further 2 GiB> total=<bytes seen>
 * usage: paths_client link|dlsym|procaddress|procaddress_v1|nvml
 */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "cuda_abi.h"
#include "nvml_abi.h"

typedef CUresult (*init_fn)(unsigned);
typedef CUresult (*retain_fn)(CUcontext *, CUdevice);
typedef CUresult (*set_fn)(CUcontext);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*info_fn)(size_t *, size_t *);
typedef CUresult (*gpa_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
typedef CUresult (*gpa1_fn)(const char *, void **, int, cuuint64_t);

struct api { init_fn init; retain_fn retain; set_fn set; alloc_fn alloc; free_fn free; info_fn info; };

#ifdef LINKED
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
#endif

static int run(struct api a)
{
    CUcontext ctx;
    CUdeviceptr p3 = 0, p2 = 0;
    size_t free_b = 0, total = 0;
    if (a.init(0) || a.retain(&ctx, 0) || a.set(ctx))
        return 1;
    CUresult r3 = a.alloc(&p3, 3ull << 30);
    CUresult r2 = a.alloc(&p2, 2ull << 30);
    a.info(&free_b, &total);
    printf("alloc3=%d alloc2=%d total=%zu\n", r3, r2, total);
    if (!r3)
        a.free(p3);
    if (!r2)
        a.free(p2);
    return 0;
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "";
    struct api a;
#ifdef LINKED
    if (!strcmp(mode, "link")) {
        a = (struct api){cuInit, cuDevicePrimaryCtxRetain, cuCtxSetCurrent, cuMemAlloc_v2, cuMemFree_v2,
                         cuMemGetInfo_v2};
        return run(a);
    }
#endif
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!cuda)
        return 2;
    if (!strcmp(mode, "dlsym")) {
        a = (struct api){dlsym(cuda, "cuInit"), dlsym(cuda, "cuDevicePrimaryCtxRetain"),
                         dlsym(cuda, "cuCtxSetCurrent"), dlsym(cuda, "cuMemAlloc_v2"), dlsym(cuda, "cuMemFree_v2"),
                         dlsym(cuda, "cuMemGetInfo_v2")};
        return run(a);
    }
    if (!strcmp(mode, "procaddress") || !strcmp(mode, "procaddress_v1")) {
        gpa_fn gpa = (gpa_fn)dlsym(cuda, "cuGetProcAddress_v2");
        void *self = NULL, *p;
        CUdriverProcAddressQueryResult st;
        /* a program resolves cuGetProcAddress through itself, as libcudart does */
        gpa("cuGetProcAddress", &self, 12000, 0, &st);
        void *self1 = NULL;
        gpa("cuGetProcAddress", &self1, 11030, 0, &st);
        const char *names[] = {"cuInit", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuMemAlloc", "cuMemFree",
                               "cuMemGetInfo"};
        void *fns[6];
        for (int i = 0; i < 6; i++) {
            if (!strcmp(mode, "procaddress"))
                ((gpa_fn)self)(names[i], &p, 12000, 0, &st);
            else
                ((gpa1_fn)self1)(names[i], &p, 12000, 0);
            fns[i] = p;
        }
        printf("self=%d self1=%d ", self == (void *)gpa, self1 == dlsym(cuda, "cuGetProcAddress"));
        a = (struct api){fns[0], fns[1], fns[2], fns[3], fns[4], fns[5]};
        return run(a);
    }
    if (!strcmp(mode, "nvml")) {
        void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
        nvmlReturn_t (*ninit)(void) = nvml ? dlsym(nvml, "nvmlInit_v2") : NULL;
        nvmlReturn_t (*handle)(unsigned, nvmlDevice_t *) = nvml ? dlsym(nvml, "nvmlDeviceGetHandleByIndex_v2") : NULL;
        nvmlReturn_t (*info)(nvmlDevice_t, nvmlMemory_t *) = nvml ? dlsym(nvml, "nvmlDeviceGetMemoryInfo") : NULL;
        nvmlDevice_t h;
        nvmlMemory_t m;
        if (!ninit || ninit() || handle(0, &h) || info(h, &m))
            return 3;
        printf("nvml total=%llu used=%llu free=%llu\n", m.total, m.used, m.free);
        return 0;
    }
    return 4;
}
