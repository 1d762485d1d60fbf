/* The referee: samples what device 0 really holds, from outside any container.
 *
 *   shim_sampler USAGE_FILE INTERVAL_US
 *
 * Run WITHOUT the shim.  Every INTERVAL_US it reads nvmlDeviceGetMemoryInfo's `used`
 * from libnvidia-ml.so.1 (simgpu: the node's real memory) and, once the file exists,
 * memory.current of device 0 in the container's usage file.  It stops when stdin reaches
 * end of file and prints one JSON line: samples, the maximum of each, and the last. */
#define _GNU_SOURCE
#include "nvml_abi.h"
#include "vgpu_region.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef nvmlReturn_t (*init_t)(void);
typedef nvmlReturn_t (*handle_t)(unsigned int, nvmlDevice_t *);
typedef nvmlReturn_t (*memory_t)(nvmlDevice_t, nvmlMemory_t *);

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: shim_sampler USAGE_FILE INTERVAL_US\n");
        return 2;
    }
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "shim_sampler: %s\n", dlerror());
        return 3;
    }
    init_t init = (init_t)dlsym(lib, "nvmlInit_v2");
    handle_t handle = (handle_t)dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
    memory_t memory = (memory_t)dlsym(lib, "nvmlDeviceGetMemoryInfo");
    nvmlDevice_t dev;
    if (!init || !handle || !memory || init() != NVML_SUCCESS || handle(0, &dev) != NVML_SUCCESS) {
        fprintf(stderr, "shim_sampler: NVML unavailable\n");
        return 3;
    }
    long interval_us = atol(argv[2]);
    const struct vgpu_usage *usage = NULL;
    unsigned long long samples = 0, usage_samples = 0, max_used = 0, max_current = 0, last_used = 0,
                       last_current = 0;
    struct pollfd in = {.fd = 0, .events = POLLIN};
    printf("{\"sampling\": true}\n");
    fflush(stdout);
    for (;;) {
        if (poll(&in, 1, 0) > 0) {
            char buf[256];
            if (read(0, buf, sizeof buf) <= 0)
                break;
        }
        nvmlMemory_t m;
        if (memory(dev, &m) == NVML_SUCCESS) {
            samples++;
            last_used = m.used;
            if (m.used > max_used)
                max_used = m.used;
        }
        if (!usage) {
            int fd = open(argv[1], O_RDONLY | O_CLOEXEC);
            struct stat st;
            if (fd >= 0 && (fstat(fd, &st) || (size_t)st.st_size < sizeof *usage)) {
                close(fd);   /* not written yet: mapping it would fault */
                fd = -1;
            }
            if (fd >= 0) {
                void *p = mmap(NULL, sizeof *usage, PROT_READ, MAP_SHARED, fd, 0);
                close(fd);
                if (p != MAP_FAILED && ((const struct vgpu_usage *)p)->magic == VGPU_USAGE_MAGIC)
                    usage = p;
                else if (p != MAP_FAILED)
                    munmap(p, sizeof *usage);
            }
        }
        if (usage) {
            unsigned long long cur = 0;   /* memory.current: the sum of the slots' charges */
            for (int i = 0; i < VGPU_MAX_PROCS; i++)
                cur += __atomic_load_n(&usage->charge[0][i], __ATOMIC_ACQUIRE);
            usage_samples++;
            last_current = cur;
            if (cur > max_current)
                max_current = cur;
        }
        struct timespec ts = {interval_us / 1000000, (interval_us % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
    printf("{\"samples\": %llu, \"max_used\": %llu, \"last_used\": %llu, \"usage_samples\": %llu, "
           "\"max_current\": %llu, \"last_current\": %llu}\n",
           samples, max_used, last_used, usage_samples, max_current, last_current);
    return 0;
}
