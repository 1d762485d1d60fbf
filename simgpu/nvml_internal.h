/* nvml_internal.h — what simgpu's libnvidia-ml.so.1 files share (never installed, never exported).
 *
 *   nvml.c        init, handles, errors, system, devices, memory, limits, utilization,
 *                 running processes, events
 *   nvml_board.c  the board: identity, PCI, thermals, power, clocks, ECC, BAR1, engines
 */
#ifndef SIMGPU_NVML_INTERNAL_H
#define SIMGPU_NVML_INTERNAL_H

#define _GNU_SOURCE
#include "nvml_abi.h"
#include "simgpu/node.h"
#include "simgpu/nvml_mig.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#define DRIVER_VERSION "580.65.06"           /* an R580 driver: the one that ships CUDA 13.0 */
#define NVML_VERSION "13." DRIVER_VERSION
#define CUDA_DRIVER_VERSION 13000
#define UUID_LEN 41                          /* "GPU-" + 36 + NUL */
#define SEC_NS 1000000000ull
#define SEC_US 1000000ull

/* nvml.c */
int initialized(void);
nvmlReturn_t device_index(nvmlDevice_t h, int *dev);
nvmlReturn_t put_str(char *dst, unsigned int length, const char *s);
unsigned int percent(uint64_t busy, uint64_t from, uint64_t to);

#endif
