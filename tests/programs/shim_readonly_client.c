/* A container process that tries to raise its own cap, then allocates.
 *
 *   shim_readonly_client QUOTA_FILE CAP_BYTES
 *
 * Run under the shim (normally as an unprivileged user).  It tries to open the quota
 * file for writing and to remove it (what a process would do to raise or drop its
 * limits), then allocates exactly CAP_BYTES and one more byte through the driver
 * (dlopen + dlsym).  Prints one JSON line: the errno of each attempt (0 = it worked) and
 * the CUresult of each allocation. */
#define _GNU_SOURCE
#include "cuda_abi.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef CUresult (*init_t)(unsigned int);
typedef CUresult (*device_get_t)(CUdevice *, int);
typedef CUresult (*ctx_retain_t)(CUcontext *, CUdevice);
typedef CUresult (*ctx_set_t)(CUcontext);
typedef CUresult (*alloc_t)(CUdeviceptr *, size_t);

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: shim_readonly_client QUOTA_FILE CAP_BYTES\n");
        return 2;
    }
    int fd = open(argv[1], O_RDWR | O_CLOEXEC);
    int open_errno = fd < 0 ? errno : 0;
    if (fd >= 0)
        close(fd);
    int unlink_errno = unlink(argv[1]) ? errno : 0;

    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        printf("{\"error\": \"dlopen\"}\n");
        return 3;
    }
    init_t init = (init_t)dlsym(lib, "cuInit");
    device_get_t device_get = (device_get_t)dlsym(lib, "cuDeviceGet");
    ctx_retain_t retain = (ctx_retain_t)dlsym(lib, "cuDevicePrimaryCtxRetain");
    ctx_set_t set_current = (ctx_set_t)dlsym(lib, "cuCtxSetCurrent");
    alloc_t alloc = (alloc_t)dlsym(lib, "cuMemAlloc_v2");
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr a, b;
    if (!init || !device_get || !retain || !set_current || !alloc || init(0) || device_get(&dev, 0) ||
        retain(&ctx, dev) || set_current(ctx)) {
        printf("{\"error\": \"context\"}\n");
        return 3;
    }
    CUresult at_cap = alloc(&a, (size_t)strtoull(argv[2], NULL, 10));
    CUresult over = alloc(&b, 1);
    printf("{\"open_for_writing\": %d, \"unlink\": %d, \"alloc_cap\": %d, \"alloc_one_more\": %d}\n",
           open_errno, unlink_errno, (int)at_cap, (int)over);
    return 0;
}
