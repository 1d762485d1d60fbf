/* simgpu libcuda.so.1: a stand-in CUDA driver for machines without a GPU.
 *
 * Device memory is ordinary host memory (lazily touched anonymous mappings), accounted
 * node-wide in the shared node file, so CUdeviceptr values are host addresses and copies
 * round-trip.  Kernels take simulated time on each device's serial timeline (node.c):
 * a function named sim_<N>us runs N microseconds per wave of blocks, a wave being as many
 * blocks as the device has SMs; other names take SIMGPU_DEFAULT_KERNEL_US.  Launches
 * return at once; synchronisation sleeps until the timeline says the work is done.
 *
 * What the device holds follows the driver as its API documentation describes it, so the
 * shim's accounting is tested against the driver's behaviour, not against requested bytes:
 * allocation footprints (footprint.h), pools that keep freed memory per release threshold,
 * graph memory reserves, context teardown freeing the context's allocations, an optional
 * per-process context overhead (SIMGPU_CONTEXT_OVERHEAD), location types of cuMemCreate
 * and pools.  Each section says what is documented and what is only a model.
 *
 * Entry points follow the public ABI: exported names with their _v2/_ptds/_ptsz suffixes,
 * and cuGetProcAddress(_v2) resolving (name, cudaVersion, flags) over the full list of
 * known ABIs (cuda_entry_points.h).  Known entry points that simgpu does not implement
 * resolve to a function that returns CUDA_ERROR_NOT_SUPPORTED; unknown names are not found.
 */
#include "cuda_internal.h"

/* === handles ===
 * Every handle the driver gives out is a slot of one arena, so a handle can be checked
 * (in range, slot aligned, right kind, alive) without ever dereferencing a wild pointer. */

pthread_mutex_t arena_lock = PTHREAD_MUTEX_INITIALIZER;
char *arena;
size_t arena_used;
static void *arena_free_list;

void *handle_new(enum kind k)
{
    pthread_mutex_lock(&arena_lock);
    if (!arena) {
        void *m = mmap(NULL, (size_t)ARENA_SLOT * ARENA_SLOTS, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        arena = m == MAP_FAILED ? NULL : m;
    }
    void *p = NULL;
    if (arena_free_list) {
        p = arena_free_list;
        arena_free_list = *(void **)((char *)p + sizeof(struct hdr));
    } else if (arena && arena_used < ARENA_SLOTS) {
        p = arena + ARENA_SLOT * arena_used++;
    }
    if (p) {
        memset(p, 0, ARENA_SLOT);
        ((struct hdr *)p)->kind = k;
        ((struct hdr *)p)->magic = HANDLE_MAGIC;
    }
    pthread_mutex_unlock(&arena_lock);
    return p;
}

void handle_free(void *p)
{
    pthread_mutex_lock(&arena_lock);
    ((struct hdr *)p)->kind = K_FREE;
    ((struct hdr *)p)->magic = 0;
    *(void **)((char *)p + sizeof(struct hdr)) = arena_free_list;
    arena_free_list = p;
    pthread_mutex_unlock(&arena_lock);
}

int handle_ok(const void *p, enum kind k)
{
    const char *c = p;
    if (!arena || c < arena || c >= arena + (size_t)ARENA_SLOT * ARENA_SLOTS ||
        (size_t)(c - arena) % ARENA_SLOT)
        return 0;
    const struct hdr *h = p;
    return h->magic == HANDLE_MAGIC && h->kind == (uint32_t)k;
}

/* Free every live handle of `kind` for which `pred` holds (pred NULL: all). */
void handles_drop(enum kind k, int (*pred)(void *, void *), void *arg, void (*before_free)(void *))
{
    for (size_t i = 0; arena && i < arena_used; i++) {
        void *p = arena + ARENA_SLOT * i;
        if (handle_ok(p, k) && (!pred || pred(p, arg))) {
            if (before_free)
                before_free(p);
            handle_free(p);
        }
    }
}

/* === init, driver, devices === */

int initialized;
__thread int tls_per_thread;   /* set by _ptds/_ptsz entry points */

static void forget_contexts(void);
static void atfork_child(void);
static void register_atfork(void) { pthread_atfork(NULL, NULL, atfork_child); }

/* fork.  The driver cannot be used in a child forked after the parent initialised it:
 * cuInit, and every call that needs it, return CUDA_ERROR_NOT_INITIALIZED there (what a
 * real driver returns: triton-lang/triton#10443, "A process that was fork()ed after its
 * parent already initialized CUDA gets CUDA_ERROR_NOT_INITIALIZED (rc=3) from cuInit ...
 * cuDeviceGetCount would itself return rc=3"; the CUDA runtime's "initialization error").
 * The child owns none of the parent's handles, but it holds the parent's device memory
 * until it exits, as the driver's descriptors it inherited do (node.c, fork).  A child
 * forked before cuInit is a new process like any other. */
static int forked_after_init;

static void atfork_child(void)
{
    if (__atomic_load_n(&initialized, __ATOMIC_ACQUIRE)) {
        forked_after_init = 1;
        __atomic_store_n(&initialized, 0, __ATOMIC_RELEASE);
    }
    forget_allocations();
    forget_contexts();
    forget_memops();
}

/* === context overhead ===
 * A process's first context on a device costs device memory (the driver's per-context
 * state, code and heaps), visible in NVML's per-process memory and counted against the
 * device, until the process's last context there is destroyed or the process dies.
 * SIMGPU_CONTEXT_OVERHEAD sets it: bytes, with an optional Ki/Mi/Gi/Ti suffix, or
 * "profile" for the figure of the simulated model (node.c).  Default 0 (for now). */

static uint64_t ctx_overhead;
static int ctx_overhead_bad;

static int parse_size(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *s == '-' || *s == '+' || *s == ' ')
        return -1;
    static const struct { const char *suffix; unsigned shift; } units[] = {
        {"", 0}, {"Ki", 10}, {"Mi", 20}, {"Gi", 30}, {"Ti", 40}};
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++)
        if (!strcmp(end, units[i].suffix)) {
            if (v > (UINT64_MAX >> units[i].shift))
                return -1;
            *out = (uint64_t)v << units[i].shift;
            return 0;
        }
    return -1;
}

static void read_ctx_overhead(void)
{
    const char *e = getenv("SIMGPU_CONTEXT_OVERHEAD");
    if (!e || !*e)
        ctx_overhead = 0;
    else if (!strcmp(e, "profile"))
        ctx_overhead = simgpu_profile()->context_overhead;
    else if (parse_size(e, &ctx_overhead)) {
        fprintf(stderr, "simgpu: SIMGPU_CONTEXT_OVERHEAD=%s is not a size (bytes, or with Ki/Mi/Gi/Ti) "
                        "or \"profile\"\n", e);
        ctx_overhead_bad = 1;
    }
}

static void init_once(void)
{
    read_ctx_overhead();
    register_atfork();
}

SIMGPU_EXPORT CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (forked_after_init)
        return CUDA_ERROR_NOT_INITIALIZED;   /* forked after the parent initialised CUDA */
    if (simgpu_attach())
        return CUDA_ERROR_NO_DEVICE;   /* simgpu printed why (profile, state dir) */
    if (simgpu_view_init())
        return CUDA_ERROR_NO_DEVICE;   /* CUDA_VISIBLE_DEVICES names no device */
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, init_once);
    if (ctx_overhead_bad)
        return CUDA_ERROR_NO_DEVICE;   /* said why on stderr */
    __atomic_store_n(&initialized, 1, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuDriverGetVersion(int *version)
{
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = DRIVER_VERSION;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuDeviceGetCount(int *count)
{
    REQUIRE_INIT();
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = ndevices();
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    REQUIRE_INIT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(ordinal))
        return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
    REQUIRE_INIT();
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    simgpu_view_name(dev, name, (unsigned)len);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
    REQUIRE_INIT();
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    memcpy(uuid->bytes, simgpu_node()->devices[simgpu_view_gpu(dev)].uuid, 16);   /* a MIG device: its GPU's */
    return CUDA_SUCCESS;
}

/* _v2 (CUDA 11.4) is the one that tells MIG devices apart: "If the device is in MIG mode,
 * returns its MIG UUID which uniquely identifies the subscribed MIG compute instance." */
SIMGPU_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev)
{
    REQUIRE_INIT();
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    simgpu_view_uuid(dev, uuid->bytes);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    REQUIRE_INIT();
    if (!bytes)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *bytes = simgpu_view_memory(dev);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev)
{
    REQUIRE_INIT();
    if (!major || !minor)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    *major = simgpu_profile()->cc_major;
    *minor = simgpu_profile()->cc_minor;
    return CUDA_SUCCESS;
}

/* Limits are the simulated board's (node.c says where each comes from; texture and
 * surface limits are those of compute capability 8.x and 9.0 in the CUDA C++ Programming
 * Guide).  Capabilities are what simgpu implements: a feature it does not simulate (IPC events,
 * the v1 and 64-bit stream memory operations, peer access, multicast, ...) reads 0, so a
 * program that asks does not go on to use it. */
SIMGPU_EXPORT CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev)
{
    REQUIRE_INIT();
    if (!pi || attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    const struct simgpu_profile *p = simgpu_profile();
    int hopper = p->cc_major >= 9;
    int v;
    switch (attrib) {
    case 1: v = 1024; break;                       /* MAX_THREADS_PER_BLOCK */
    case 2: case 3: v = 1024; break;               /* MAX_BLOCK_DIM_X, _Y */
    case 4: v = 64; break;                         /* MAX_BLOCK_DIM_Z */
    case 5: v = 2147483647; break;                 /* MAX_GRID_DIM_X */
    case 6: case 7: v = 65535; break;              /* MAX_GRID_DIM_Y, _Z */
    case 8: v = 49152; break;                      /* MAX_SHARED_MEMORY_PER_BLOCK */
    case 9: v = 65536; break;                      /* TOTAL_CONSTANT_MEMORY */
    case 10: v = 32; break;                        /* WARP_SIZE */
    case 11: v = 2147483647; break;                /* MAX_PITCH */
    case 12: v = 65536; break;                     /* MAX_REGISTERS_PER_BLOCK */
    case 13: v = p->clock_khz; break;              /* CLOCK_RATE */
    case 14: v = 512; break;                       /* TEXTURE_ALIGNMENT */
    case 15: v = 1; break;                         /* GPU_OVERLAP */
    case 16: v = simgpu_view_sm_count(dev); break; /* MULTIPROCESSOR_COUNT */
    case 17: v = 0; break;                         /* KERNEL_EXEC_TIMEOUT: no display watchdog */
    case 18: v = 0; break;                         /* INTEGRATED */
    case 19: v = 1; break;                         /* CAN_MAP_HOST_MEMORY */
    case 20: v = 0; break;                         /* COMPUTE_MODE: default */
    case 21: v = 131072; break;                    /* MAXIMUM_TEXTURE1D_WIDTH */
    case 22: v = 131072; break;                    /* MAXIMUM_TEXTURE2D_WIDTH */
    case 23: v = 65536; break;                     /* MAXIMUM_TEXTURE2D_HEIGHT */
    case 24: case 25: case 26: v = 16384; break;   /* MAXIMUM_TEXTURE3D_WIDTH/HEIGHT/DEPTH */
    case 27: case 28: v = 32768; break;            /* MAXIMUM_TEXTURE2D_LAYERED_WIDTH/HEIGHT */
    case 29: v = 2048; break;                      /* MAXIMUM_TEXTURE2D_LAYERED_LAYERS */
    case 30: v = 512; break;                       /* SURFACE_ALIGNMENT */
    case 31: v = 1; break;                         /* CONCURRENT_KERNELS */
    case 32: v = 1; break;                         /* ECC_ENABLED: all four boards run with ECC on */
    case 33: v = 0x10 + simgpu_view_gpu(dev); break; /* PCI_BUS_ID (as cuDeviceGetPCIBusId) */
    case 34: v = 0; break;                         /* PCI_DEVICE_ID (the slot) */
    case 35: v = 0; break;                         /* TCC_DRIVER: Linux */
    case 36: v = p->mem_clock_khz; break;          /* MEMORY_CLOCK_RATE */
    case 37: v = p->bus_width; break;              /* GLOBAL_MEMORY_BUS_WIDTH */
    case 38: v = p->l2_bytes; break;               /* L2_CACHE_SIZE */
    case 39: v = p->threads_per_sm; break;         /* MAX_THREADS_PER_MULTIPROCESSOR */
    case 40: v = p->copy_engines; break;           /* ASYNC_ENGINE_COUNT */
    case 41: v = 1; break;                         /* UNIFIED_ADDRESSING */
    case 42: v = 32768; break;                     /* MAXIMUM_TEXTURE1D_LAYERED_WIDTH */
    case 43: v = 2048; break;                      /* MAXIMUM_TEXTURE1D_LAYERED_LAYERS */
    case 44: v = 0; break;                         /* CAN_TEX2D_GATHER (deprecated) */
    case 45: case 46: v = 32768; break;            /* MAXIMUM_TEXTURE2D_GATHER_WIDTH/HEIGHT */
    case 47: case 48: v = 8192; break;             /* MAXIMUM_TEXTURE3D_WIDTH/HEIGHT_ALTERNATE */
    case 49: v = 32768; break;                     /* MAXIMUM_TEXTURE3D_DEPTH_ALTERNATE */
    case 50: v = 0; break;                         /* PCI_DOMAIN_ID */
    case 51: v = 32; break;                        /* TEXTURE_PITCH_ALIGNMENT */
    case 52: v = 32768; break;                     /* MAXIMUM_TEXTURECUBEMAP_WIDTH */
    case 53: v = 32768; break;                     /* MAXIMUM_TEXTURECUBEMAP_LAYERED_WIDTH */
    case 54: v = 2046; break;                      /* MAXIMUM_TEXTURECUBEMAP_LAYERED_LAYERS */
    case 55: v = 32768; break;                     /* MAXIMUM_SURFACE1D_WIDTH */
    case 56: v = 131072; break;                    /* MAXIMUM_SURFACE2D_WIDTH */
    case 57: v = 65536; break;                     /* MAXIMUM_SURFACE2D_HEIGHT */
    case 58: case 59: case 60: v = 16384; break;   /* MAXIMUM_SURFACE3D_WIDTH/HEIGHT/DEPTH */
    case 61: v = 32768; break;                     /* MAXIMUM_SURFACE1D_LAYERED_WIDTH */
    case 62: v = 2048; break;                      /* MAXIMUM_SURFACE1D_LAYERED_LAYERS */
    case 63: case 64: v = 32768; break;            /* MAXIMUM_SURFACE2D_LAYERED_WIDTH/HEIGHT */
    case 65: v = 2048; break;                      /* MAXIMUM_SURFACE2D_LAYERED_LAYERS */
    case 66: case 67: v = 32768; break;            /* MAXIMUM_SURFACECUBEMAP(_LAYERED)_WIDTH */
    case 68: v = 2046; break;                      /* MAXIMUM_SURFACECUBEMAP_LAYERED_LAYERS */
    case 69: v = 268435456; break;                 /* MAXIMUM_TEXTURE1D_LINEAR_WIDTH (deprecated) */
    case 70: v = 131072; break;                    /* MAXIMUM_TEXTURE2D_LINEAR_WIDTH */
    case 71: v = 65000; break;                     /* MAXIMUM_TEXTURE2D_LINEAR_HEIGHT */
    case 72: v = 2097120; break;                   /* MAXIMUM_TEXTURE2D_LINEAR_PITCH */
    case 73: case 74: v = 32768; break;            /* MAXIMUM_TEXTURE2D_MIPMAPPED_WIDTH/HEIGHT */
    case 75: v = p->cc_major; break;               /* COMPUTE_CAPABILITY_MAJOR */
    case 76: v = p->cc_minor; break;               /* COMPUTE_CAPABILITY_MINOR */
    case 77: v = 32768; break;                     /* MAXIMUM_TEXTURE1D_MIPMAPPED_WIDTH */
    case 78: v = 1; break;                         /* STREAM_PRIORITIES_SUPPORTED */
    case 79: case 80: v = 1; break;                /* GLOBAL_L1_CACHE_SUPPORTED, LOCAL_L1_CACHE_SUPPORTED */
    case 81: v = p->smem_per_sm; break;            /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    case 82: v = 65536; break;                     /* MAX_REGISTERS_PER_MULTIPROCESSOR */
    case 83: v = 1; break;                         /* MANAGED_MEMORY */
    case 84: v = 0; break;                         /* MULTI_GPU_BOARD */
    case 85: v = dev; break;                       /* MULTI_GPU_BOARD_GROUP_ID */
    case 86: v = 0; break;                         /* HOST_NATIVE_ATOMIC_SUPPORTED: PCIe */
    case 87: v = p->fp32_per_fp64; break;          /* SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO */
    case 88: v = 0; break;                         /* PAGEABLE_MEMORY_ACCESS */
    case 89: v = 1; break;                         /* CONCURRENT_MANAGED_ACCESS */
    case 90: v = 1; break;                         /* COMPUTE_PREEMPTION_SUPPORTED */
    case 91: v = 1; break;                         /* CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM */
    case 95: v = 1; break;                         /* COOPERATIVE_LAUNCH */
    case 97: v = p->smem_per_block_optin; break;   /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
    case 99: v = 0; break;                         /* HOST_REGISTER_SUPPORTED: not simulated */
    case 102: v = 1; break;                        /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    case 103: v = 1; break;                        /* HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
    case 106: v = p->blocks_per_sm; break;         /* MAX_BLOCKS_PER_MULTIPROCESSOR */
    case 108: v = p->l2_bytes / 4 * 3; break;      /* MAX_PERSISTING_L2_CACHE_SIZE: 3/4 of L2 (model) */
    case 109: v = 134213632; break;                /* MAX_ACCESS_POLICY_WINDOW_SIZE */
    case 111: v = 1024; break;                     /* RESERVED_SHARED_MEMORY_PER_BLOCK */
    case 115: v = 1; break;                        /* MEMORY_POOLS_SUPPORTED */
    case 120: v = hopper; break;                   /* CLUSTER_LAUNCH */
    case 126: v = hopper ? 4 : 1; break;           /* MEM_SYNC_DOMAIN_COUNT */
    case 130: v = 0; break;                        /* NUMA_CONFIG: none */
    case 131: v = -1; break;                       /* NUMA_ID */
    case 134: v = 0; break;                        /* HOST_NUMA_ID: host node 0 */
    case 139: v = (int)(p->pci_device << 16 | 0x10DE); break;      /* GPU_PCI_DEVICE_ID */
    case 140: v = (int)(p->pci_subsystem << 16 | 0x10DE); break;   /* GPU_PCI_SUBSYSTEM_ID */
    case 141: case 142: v = 1; break;              /* HOST_NUMA_ VMM / MEMORY_POOLS: simgpu takes node 0 */
    case 144: case 145: v = 1; break;              /* HOST_MEMORY_POOLS, HOST_VIRTUAL_MEMORY_MANAGEMENT */
    default: v = 0; break;                         /* features simgpu does not simulate */
    }
    *pi = v;
    return CUDA_SUCCESS;
}

/* cuda.h, cuDeviceCanAccessPeer: 1 "if contexts on dev are capable of directly accessing
 * memory from contexts on peerDev and 0 otherwise"; CUDA_ERROR_INVALID_DEVICE for a bad
 * ordinal.  simgpu models no peer access (cuCtxEnablePeerAccess is not simulated), so 0
 * for every pair; for a device and itself too, as peer access is between two contexts
 * (cuCtxEnablePeerAccess: "CUDA_ERROR_INVALID_CONTEXT if ... the current context is
 * peerContext"). */
SIMGPU_EXPORT CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev)
{
    REQUIRE_INIT();
    if (!canAccessPeer)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev) || !dev_ok(peerDev))
        return CUDA_ERROR_INVALID_DEVICE;
    *canAccessPeer = 0;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev)
{
    REQUIRE_INIT();
    if (!pciBusId || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    snprintf(pciBusId, (size_t)len, "00000000:%02X:00.0", 0x10 + simgpu_view_gpu(dev));
    return CUDA_SUCCESS;
}

/* === errors === */

static const struct { CUresult code; const char *name, *text; } errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_NO_BINARY_FOR_GPU, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
    {CUDA_ERROR_INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "the provided PTX was compiled with an unsupported toolchain."},
    {CUDA_ERROR_FILE_NOT_FOUND, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static int error_index(CUresult e)
{
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == e)
            return (int)i;
    return -1;
}

SIMGPU_EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    int i = error_index(error);
    *pStr = i < 0 ? NULL : errors[i].name;
    return i < 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr)
{
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    int i = error_index(error);
    *pStr = i < 0 ? NULL : errors[i].text;
    return i < 0 ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

/* === contexts === */

#define CTX_STACK 16
static __thread struct vgpu_ctx *tls_ctx[CTX_STACK];
static __thread int tls_depth;
struct vgpu_ctx *primary[SIMGPU_MAX_DEVICES];
pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;

static int ctx_count[SIMGPU_MAX_DEVICES];   /* active contexts of this process, per device */

struct vgpu_ctx *current_ctx(void)
{
    struct vgpu_ctx *c = tls_depth ? tls_ctx[tls_depth - 1] : NULL;
    return c && handle_ok(c, K_CTX) ? c : NULL;
}

/* Under ctx_lock.  The process's first active context on a device makes it visible to
 * NVML. */
static CUresult ctx_activate(struct vgpu_ctx *c)
{
    if (c->active)
        return CUDA_SUCCESS;
    if (ctx_count[c->dev] == 0) {
        if (ctx_overhead && simgpu_mem_reserve(c->dev, ctx_overhead))
            return CUDA_ERROR_OUT_OF_MEMORY;   /* no room for the context itself */
        simgpu_note_context(c->dev);
    }
    ctx_count[c->dev]++;
    __atomic_store_n(&c->active, 1, __ATOMIC_RELEASE);
    return CUDA_SUCCESS;
}

/* Under ctx_lock.  As cuCtxDestroy documents: everything the context allocated goes with
 * it (cuMemAlloc, cuMemAllocPitch, cuMemAllocManaged, cuMemAllocHost, arrays, streams);
 * what is not tied to a context stays (cuMemCreate, cuMemAllocAsync and pools). */
static void ctx_deactivate(struct vgpu_ctx *c)
{
    if (!c->active)
        return;
    __atomic_store_n(&c->active, 0, __ATOMIC_RELEASE);
    c->cache_config = CU_FUNC_CACHE_PREFER_NONE;   /* reset "all state" (cuDevicePrimaryCtxReset) */
    memops_drop_ctx(c);   /* before its memory goes */
    free_allocations_of(c);
    free_streams_of(c, 1);
    if (--ctx_count[c->dev] == 0) {
        simgpu_mem_release(c->dev, ctx_overhead);
        simgpu_forget_context(c->dev);
    }
}

/* A GPU fallen off the bus (node.c: simgpuLoseGpu): every call that reaches it through a
 * context or stream fails.  cuda.h documents no error for it; applications see
 * CUDA_ERROR_UNKNOWN (observed: proteneer/timemachine#1203 "Handle gpu fell off bus" adds
 * cudaErrorUnknown to its hardware errors), so simgpu answers that. */
int ctx_gpu_lost(const struct vgpu_ctx *c)
{
    if (!atomic_load_explicit(&simgpu_node()->health.lost, memory_order_relaxed))
        return 0;   /* (every call passes here: no GPU lost is one load) */
    return simgpu_gpu_lost(simgpu_view_gpu(c->dev));
}

/* A primary context reset (or released) and then used again comes back to life, as the
 * driver re-initializes it. */
CUresult ctx_use(struct vgpu_ctx *c)
{
    if (ctx_gpu_lost(c))
        return CUDA_ERROR_UNKNOWN;
    if (__atomic_load_n(&c->active, __ATOMIC_ACQUIRE))
        return CUDA_SUCCESS;
    pthread_mutex_lock(&ctx_lock);
    CUresult r = ctx_activate(c);
    pthread_mutex_unlock(&ctx_lock);
    return r;
}

/* Under ctx_lock. */
static struct vgpu_ctx *ctx_new(int dev, unsigned flags, int is_primary)
{
    if (simgpu_my_slot() < 0)
        return NULL;
    struct vgpu_ctx *c = handle_new(K_CTX);
    if (!c)
        return NULL;
    c->dev = dev;
    c->flags = flags;
    c->primary = is_primary;
    c->refs = 1;
    c->null_stream = stream_new(c, 0, 0);
    if (!c->null_stream || ctx_activate(c) != CUDA_SUCCESS) {
        if (c->null_stream)
            free_streams_of(c, 0);
        handle_free(c);
        return NULL;
    }
    return c;
}

/* In a forked child: the parent's contexts are not the child's (it cannot use the driver,
 * see atfork_child). */
static void forget_contexts(void)
{
    pthread_mutex_init(&ctx_lock, NULL);
    memset(ctx_count, 0, sizeof ctx_count);
    for (size_t i = 0; arena && i < arena_used; i++) {
        struct vgpu_ctx *c = (struct vgpu_ctx *)(arena + ARENA_SLOT * i);
        if (handle_ok(c, K_CTX))
            c->active = 0;
    }
}

static void ctx_push(struct vgpu_ctx *c)
{
    if (tls_depth < CTX_STACK)
        tls_ctx[tls_depth++] = c;
}

SIMGPU_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    REQUIRE_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&ctx_lock);
    CUresult r = CUDA_SUCCESS;
    if (!primary[dev]) {
        primary[dev] = ctx_new(dev, 0, 1);
        r = primary[dev] ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    } else if ((r = ctx_activate(primary[dev])) == CUDA_SUCCESS) {
        primary[dev]->refs++;
    }
    *pctx = r == CUDA_SUCCESS ? primary[dev] : NULL;
    pthread_mutex_unlock(&ctx_lock);
    return r;
}

SIMGPU_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    REQUIRE_INIT();
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&ctx_lock);
    CUresult r = CUDA_SUCCESS;
    if (!primary[dev] || primary[dev]->refs <= 0)
        r = CUDA_ERROR_INVALID_CONTEXT;
    else if (--primary[dev]->refs == 0)
        ctx_deactivate(primary[dev]);   /* "reset once the last reference is released" */
    pthread_mutex_unlock(&ctx_lock);   /* the handle stays valid: the primary context is reused */
    return r;
}

SIMGPU_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    REQUIRE_INIT();
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&ctx_lock);
    if (primary[dev])
        ctx_deactivate(primary[dev]);   /* frees its resources; does not release it */
    pthread_mutex_unlock(&ctx_lock);
    return CUDA_SUCCESS;
}

/* The 7.0 ABIs (unversioned names): cuda.h documents one behaviour for both ABIs of each,
 * "Releasing a primary context that has not been previously retained will fail with
 * CUDA_ERROR_INVALID_CONTEXT"; reset destroys its allocations and state, not the context. */
SIMGPU_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { return cuDevicePrimaryCtxRelease_v2(dev); }
SIMGPU_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return cuDevicePrimaryCtxReset_v2(dev); }

SIMGPU_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    REQUIRE_INIT();
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&ctx_lock);
    *flags = primary[dev] ? primary[dev]->flags : 0;
    *active = primary[dev] && primary[dev]->active;
    pthread_mutex_unlock(&ctx_lock);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    REQUIRE_INIT();
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&ctx_lock);
    if (primary[dev])
        primary[dev]->flags = flags;
    pthread_mutex_unlock(&ctx_lock);
    return CUDA_SUCCESS;
}

static CUresult ctx_create(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    REQUIRE_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&ctx_lock);
    struct vgpu_ctx *c = ctx_new(dev, flags, 0);
    pthread_mutex_unlock(&ctx_lock);
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    ctx_push(c);
    *pctx = c;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    return ctx_create(pctx, flags, dev);
}

SIMGPU_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, void *paramsArray, int numParams,
                                      unsigned int flags, CUdevice dev)
{
    (void)paramsArray;   /* execution affinity: every context gets the whole device */
    (void)numParams;
    return ctx_create(pctx, flags, dev);
}

SIMGPU_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, void *ctxCreateParams, unsigned int flags,
                                      CUdevice dev)
{
    (void)ctxCreateParams;
    return ctx_create(pctx, flags, dev);
}

SIMGPU_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    REQUIRE_INIT();
    if (!handle_ok(ctx, K_CTX) || ctx->primary)
        return CUDA_ERROR_INVALID_CONTEXT;
    for (int i = 0; i < tls_depth; i++)
        if (tls_ctx[i] == ctx) {
            memmove(&tls_ctx[i], &tls_ctx[i + 1], sizeof(tls_ctx[0]) * (size_t)(tls_depth - i - 1));
            tls_depth--;
            i--;
        }
    pthread_mutex_lock(&ctx_lock);
    ctx_deactivate(ctx);
    free_streams_of(ctx, 0);
    handle_free(ctx);
    pthread_mutex_unlock(&ctx_lock);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx)
{
    REQUIRE_INIT();
    if (ctx && !handle_ok(ctx, K_CTX))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!ctx) {
        if (tls_depth)
            tls_depth--;
    } else if (tls_depth) {
        tls_ctx[tls_depth - 1] = ctx;
    } else {
        ctx_push(ctx);
    }
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    REQUIRE_INIT();
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = current_ctx();
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    REQUIRE_INIT();
    if (!handle_ok(ctx, K_CTX))
        return CUDA_ERROR_INVALID_CONTEXT;
    ctx_push(ctx);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    REQUIRE_INIT();
    if (!tls_depth)
        return CUDA_ERROR_INVALID_CONTEXT;
    struct vgpu_ctx *c = tls_ctx[--tls_depth];
    if (pctx)
        *pctx = c;
    return CUDA_SUCCESS;
}

/* The 2.0 ABIs (unversioned names): the same calls as the _v2 ones (cuda.h maps
 * cuCtxPushCurrent / cuCtxPopCurrent to _v2 and documents them once). */
SIMGPU_EXPORT CUresult cuCtxPushCurrent(CUcontext ctx) { return cuCtxPushCurrent_v2(ctx); }
SIMGPU_EXPORT CUresult cuCtxPopCurrent(CUcontext *pctx) { return cuCtxPopCurrent_v2(pctx); }

SIMGPU_EXPORT CUresult cuCtxGetDevice(CUdevice *device)
{
    REQUIRE_INIT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    struct vgpu_ctx *c = current_ctx();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    *device = c->dev;
    return CUDA_SUCCESS;
}

/* CUDA 13.0's forms: the context is named (NULL: the current one). */
SIMGPU_EXPORT CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx)
{
    REQUIRE_INIT();
    if (!ctx)
        return cuCtxGetDevice(device);
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(ctx, K_CTX) || !ctx->active)
        return CUDA_ERROR_INVALID_CONTEXT;
    *device = ctx->dev;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuCtxGetFlags(unsigned int *flags)
{
    REQUIRE_INIT();
    struct vgpu_ctx *c = current_ctx();
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    *flags = c->flags;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version)
{
    REQUIRE_INIT();
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    if (ctx ? !handle_ok(ctx, K_CTX) : !current_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    *version = 3020;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority)
{
    REQUIRE_INIT();
    if (leastPriority)
        *leastPriority = 0;
    if (greatestPriority)
        *greatestPriority = -5;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuCtxGetLimit(size_t *pvalue, int limit)
{
    REQUIRE_INIT();
    static const size_t defaults[] = {1024, 1 << 20, 8 << 20, 2, 2048, 0, 0};
    if (!pvalue || limit < 0 || limit >= (int)(sizeof defaults / sizeof defaults[0]))
        return CUDA_ERROR_INVALID_VALUE;
    *pvalue = defaults[limit];
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuCtxSetLimit(int limit, size_t value)
{
    REQUIRE_INIT();
    (void)value;
    return limit >= 0 && limit < 7 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* cuda.h, cuCtxGetCacheConfig / cuCtxSetCacheConfig: the current context's preferred
 * split of L1 and shared memory, one of CU_FUNC_CACHE_PREFER_NONE (the default), _SHARED,
 * _L1, _EQUAL; "only a preference".  These boards share L1 and shared memory (Ampere,
 * Hopper), so what is set is what is read back (PREFER_NONE is only forced on devices
 * whose split is fixed); a reset primary context is back to PREFER_NONE. */
SIMGPU_EXPORT CUresult cuCtxGetCacheConfig(CUfunc_cache *pconfig)
{
    REQUIRE_INIT();
    struct vgpu_ctx *c = current_ctx();
    if (!pconfig)
        return CUDA_ERROR_INVALID_VALUE;
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    *pconfig = (CUfunc_cache)c->cache_config;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuCtxSetCacheConfig(CUfunc_cache config)
{
    REQUIRE_INIT();
    struct vgpu_ctx *c = current_ctx();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    if ((int)config < CU_FUNC_CACHE_PREFER_NONE || config > CU_FUNC_CACHE_PREFER_EQUAL)
        return CUDA_ERROR_INVALID_VALUE;
    c->cache_config = config;
    return CUDA_SUCCESS;
}

/* === cuGetProcAddress ===
 * IMPLEMENTED lists each (base name, ABI version, per-thread variant, function) simgpu
 * provides.  A request resolves against every known ABI (abi_resolve.h) so that the ABI
 * chosen is the one the real driver would choose; if simgpu lacks that exact ABI the
 * caller gets not_supported() rather than a function with the wrong signature. */

SIMGPU_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                        cuuint64_t flags);
SIMGPU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                           cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus);
SIMGPU_EXPORT CUresult cuGetExportTable(const void **ppExportTable, const void *pExportTableId);

#define IMPLEMENTED(X)                                                         \
    X(cuInit, 2000, 0, cuInit)                                                 \
    X(cuDriverGetVersion, 2020, 0, cuDriverGetVersion)                         \
    X(cuGetProcAddress, 11030, 0, cuGetProcAddress)                            \
    X(cuGetProcAddress, 12000, 0, cuGetProcAddress_v2)                         \
    X(cuGetExportTable, 3000, 0, cuGetExportTable)                             \
    X(cuGetErrorName, 6000, 0, cuGetErrorName)                                 \
    X(cuGetErrorString, 6000, 0, cuGetErrorString)                             \
    X(cuDeviceGet, 2000, 0, cuDeviceGet)                                       \
    X(cuDeviceGetCount, 2000, 0, cuDeviceGetCount)                             \
    X(cuDeviceGetName, 2000, 0, cuDeviceGetName)                               \
    X(cuDeviceGetUuid, 9020, 0, cuDeviceGetUuid)                               \
    X(cuDeviceGetUuid, 11040, 0, cuDeviceGetUuid_v2)                           \
    X(cuDeviceTotalMem, 3020, 0, cuDeviceTotalMem_v2)                          \
    X(cuDeviceComputeCapability, 2000, 0, cuDeviceComputeCapability)           \
    X(cuDeviceGetAttribute, 2000, 0, cuDeviceGetAttribute)                     \
    X(cuDeviceGetPCIBusId, 4010, 0, cuDeviceGetPCIBusId)                       \
    X(cuDeviceCanAccessPeer, 4000, 0, cuDeviceCanAccessPeer)                   \
    X(cuDeviceGetDefaultMemPool, 11020, 0, cuDeviceGetDefaultMemPool)          \
    X(cuDeviceGetMemPool, 11020, 0, cuDeviceGetMemPool)                        \
    X(cuDeviceSetMemPool, 11020, 0, cuDeviceSetMemPool)                        \
    X(cuDevicePrimaryCtxRetain, 7000, 0, cuDevicePrimaryCtxRetain)             \
    X(cuDevicePrimaryCtxRelease, 7000, 0, cuDevicePrimaryCtxRelease)           \
    X(cuDevicePrimaryCtxRelease, 11000, 0, cuDevicePrimaryCtxRelease_v2)       \
    X(cuDevicePrimaryCtxReset, 7000, 0, cuDevicePrimaryCtxReset)               \
    X(cuDevicePrimaryCtxReset, 11000, 0, cuDevicePrimaryCtxReset_v2)           \
    X(cuDevicePrimaryCtxGetState, 7000, 0, cuDevicePrimaryCtxGetState)         \
    X(cuDevicePrimaryCtxSetFlags, 11000, 0, cuDevicePrimaryCtxSetFlags_v2)     \
    X(cuCtxCreate, 3020, 0, cuCtxCreate_v2)                                    \
    X(cuCtxCreate, 11040, 0, cuCtxCreate_v3)                                   \
    X(cuCtxCreate, 12050, 0, cuCtxCreate_v4)                                   \
    X(cuCtxDestroy, 4000, 0, cuCtxDestroy_v2)                                  \
    X(cuCtxSetCurrent, 4000, 0, cuCtxSetCurrent)                               \
    X(cuCtxGetCurrent, 4000, 0, cuCtxGetCurrent)                               \
    X(cuCtxPushCurrent, 2000, 0, cuCtxPushCurrent)                             \
    X(cuCtxPushCurrent, 4000, 0, cuCtxPushCurrent_v2)                          \
    X(cuCtxPopCurrent, 2000, 0, cuCtxPopCurrent)                               \
    X(cuCtxPopCurrent, 4000, 0, cuCtxPopCurrent_v2)                            \
    X(cuCtxGetDevice, 2000, 0, cuCtxGetDevice)                                 \
    X(cuCtxGetDevice, 13000, 0, cuCtxGetDevice_v2)                             \
    X(cuCtxGetFlags, 7000, 0, cuCtxGetFlags)                                   \
    X(cuCtxGetApiVersion, 3020, 0, cuCtxGetApiVersion)                         \
    X(cuCtxGetStreamPriorityRange, 5050, 0, cuCtxGetStreamPriorityRange)       \
    X(cuCtxGetLimit, 3010, 0, cuCtxGetLimit)                                   \
    X(cuCtxSetLimit, 3010, 0, cuCtxSetLimit)                                   \
    X(cuCtxGetCacheConfig, 3020, 0, cuCtxGetCacheConfig)                       \
    X(cuCtxSetCacheConfig, 3020, 0, cuCtxSetCacheConfig)                       \
    X(cuCtxSynchronize, 2000, 0, cuCtxSynchronize)                             \
    X(cuCtxSynchronize, 13000, 0, cuCtxSynchronize_v2)                         \
    X(cuMemAlloc, 3020, 0, cuMemAlloc_v2)                                      \
    X(cuMemAllocPitch, 3020, 0, cuMemAllocPitch_v2)                            \
    X(cuMemAllocManaged, 6000, 0, cuMemAllocManaged)                           \
    X(cuMemFree, 3020, 0, cuMemFree_v2)                                        \
    X(cuMemGetInfo, 3020, 0, cuMemGetInfo_v2)                                  \
    X(cuMemGetAddressRange, 3020, 0, cuMemGetAddressRange_v2)                  \
    X(cuMemHostAlloc, 2020, 0, cuMemHostAlloc)                                 \
    X(cuMemAllocHost, 3020, 0, cuMemAllocHost_v2)                              \
    X(cuMemFreeHost, 2000, 0, cuMemFreeHost)                                   \
    X(cuMemHostGetDevicePointer, 3020, 0, cuMemHostGetDevicePointer_v2)        \
    X(cuMemPoolCreate, 11020, 0, cuMemPoolCreate)                              \
    X(cuMemPoolDestroy, 11020, 0, cuMemPoolDestroy)                            \
    X(cuMemPoolTrimTo, 11020, 0, cuMemPoolTrimTo)                              \
    X(cuMemPoolSetAttribute, 11020, 0, cuMemPoolSetAttribute)                  \
    X(cuMemPoolGetAttribute, 11020, 0, cuMemPoolGetAttribute)                  \
    X(cuMemAllocAsync, 11020, 0, cuMemAllocAsync)                              \
    X(cuMemAllocAsync, 11020, 1, cuMemAllocAsync_ptsz)                         \
    X(cuMemAllocFromPoolAsync, 11020, 0, cuMemAllocFromPoolAsync)              \
    X(cuMemAllocFromPoolAsync, 11020, 1, cuMemAllocFromPoolAsync_ptsz)         \
    X(cuMemFreeAsync, 11020, 0, cuMemFreeAsync)                                \
    X(cuMemFreeAsync, 11020, 1, cuMemFreeAsync_ptsz)                           \
    X(cuMemGetAllocationGranularity, 10020, 0, cuMemGetAllocationGranularity)  \
    X(cuMemCreate, 10020, 0, cuMemCreate)                                      \
    X(cuMemRelease, 10020, 0, cuMemRelease)                                    \
    X(cuMemExportToShareableHandle, 10020, 0, cuMemExportToShareableHandle)    \
    X(cuMemImportFromShareableHandle, 10020, 0, cuMemImportFromShareableHandle) \
    X(cuMemGetAllocationPropertiesFromHandle, 10020, 0, cuMemGetAllocationPropertiesFromHandle) \
    X(cuMemRetainAllocationHandle, 11000, 0, cuMemRetainAllocationHandle)      \
    X(cuIpcGetMemHandle, 4010, 0, cuIpcGetMemHandle)                           \
    X(cuIpcOpenMemHandle, 4010, 0, cuIpcOpenMemHandle)                         \
    X(cuIpcOpenMemHandle, 11000, 0, cuIpcOpenMemHandle_v2)                     \
    X(cuIpcCloseMemHandle, 4010, 0, cuIpcCloseMemHandle)                       \
    X(cuMemAddressReserve, 10020, 0, cuMemAddressReserve)                      \
    X(cuMemAddressFree, 10020, 0, cuMemAddressFree)                            \
    X(cuMemMap, 10020, 0, cuMemMap)                                            \
    X(cuMemUnmap, 10020, 0, cuMemUnmap)                                        \
    X(cuMemSetAccess, 10020, 0, cuMemSetAccess)                                \
    X(cuArrayCreate, 3020, 0, cuArrayCreate_v2)                                \
    X(cuArray3DCreate, 3020, 0, cuArray3DCreate_v2)                            \
    X(cuArrayDestroy, 2000, 0, cuArrayDestroy)                                 \
    X(cuMipmappedArrayCreate, 5000, 0, cuMipmappedArrayCreate)                 \
    X(cuMipmappedArrayDestroy, 5000, 0, cuMipmappedArrayDestroy)               \
    X(cuMemcpy, 4000, 0, cuMemcpy)                                             \
    X(cuMemcpy, 7000, 1, cuMemcpy_ptds)                                        \
    X(cuMemcpyAsync, 4000, 0, cuMemcpyAsync)                                   \
    X(cuMemcpyAsync, 7000, 1, cuMemcpyAsync_ptsz)                              \
    X(cuMemcpyHtoD, 3020, 0, cuMemcpyHtoD_v2)                                  \
    X(cuMemcpyHtoD, 7000, 1, cuMemcpyHtoD_v2_ptds)                             \
    X(cuMemcpyDtoH, 3020, 0, cuMemcpyDtoH_v2)                                  \
    X(cuMemcpyDtoH, 7000, 1, cuMemcpyDtoH_v2_ptds)                             \
    X(cuMemcpyDtoD, 3020, 0, cuMemcpyDtoD_v2)                                  \
    X(cuMemcpyDtoD, 7000, 1, cuMemcpyDtoD_v2_ptds)                             \
    X(cuMemcpyHtoDAsync, 3020, 0, cuMemcpyHtoDAsync_v2)                        \
    X(cuMemcpyHtoDAsync, 7000, 1, cuMemcpyHtoDAsync_v2_ptsz)                   \
    X(cuMemcpyDtoHAsync, 3020, 0, cuMemcpyDtoHAsync_v2)                        \
    X(cuMemcpyDtoHAsync, 7000, 1, cuMemcpyDtoHAsync_v2_ptsz)                   \
    X(cuMemcpyDtoDAsync, 3020, 0, cuMemcpyDtoDAsync_v2)                        \
    X(cuMemcpyDtoDAsync, 7000, 1, cuMemcpyDtoDAsync_v2_ptsz)                   \
    X(cuMemsetD8, 3020, 0, cuMemsetD8_v2)                                      \
    X(cuMemsetD8, 7000, 1, cuMemsetD8_v2_ptds)                                 \
    X(cuMemsetD16, 3020, 0, cuMemsetD16_v2)                                    \
    X(cuMemsetD16, 7000, 1, cuMemsetD16_v2_ptds)                               \
    X(cuMemsetD32, 3020, 0, cuMemsetD32_v2)                                    \
    X(cuMemsetD32, 7000, 1, cuMemsetD32_v2_ptds)                               \
    X(cuMemsetD8Async, 3020, 0, cuMemsetD8Async)                               \
    X(cuMemsetD8Async, 7000, 1, cuMemsetD8Async_ptsz)                          \
    X(cuMemsetD16Async, 3020, 0, cuMemsetD16Async)                             \
    X(cuMemsetD16Async, 7000, 1, cuMemsetD16Async_ptsz)                        \
    X(cuMemsetD32Async, 3020, 0, cuMemsetD32Async)                             \
    X(cuMemsetD32Async, 7000, 1, cuMemsetD32Async_ptsz)                        \
    X(cuMemcpy2DAsync, 3020, 0, cuMemcpy2DAsync_v2)                            \
    X(cuMemcpy2DAsync, 7000, 1, cuMemcpy2DAsync_v2_ptsz)                       \
    X(cuMemPrefetchAsync, 8000, 0, cuMemPrefetchAsync)                         \
    X(cuMemPrefetchAsync, 8000, 1, cuMemPrefetchAsync_ptsz)                    \
    X(cuMemPrefetchAsync, 12020, 0, cuMemPrefetchAsync_v2)                     \
    X(cuMemPrefetchAsync, 12020, 1, cuMemPrefetchAsync_v2_ptsz)                \
    X(cuStreamCreate, 2000, 0, cuStreamCreate)                                 \
    X(cuStreamCreateWithPriority, 5050, 0, cuStreamCreateWithPriority)         \
    X(cuStreamDestroy, 4000, 0, cuStreamDestroy_v2)                            \
    X(cuStreamSynchronize, 2000, 0, cuStreamSynchronize)                       \
    X(cuStreamSynchronize, 7000, 1, cuStreamSynchronize_ptsz)                  \
    X(cuStreamQuery, 2000, 0, cuStreamQuery)                                   \
    X(cuStreamQuery, 7000, 1, cuStreamQuery_ptsz)                              \
    X(cuStreamWaitEvent, 3020, 0, cuStreamWaitEvent)                           \
    X(cuStreamWaitEvent, 7000, 1, cuStreamWaitEvent_ptsz)                      \
    X(cuStreamGetPriority, 5050, 0, cuStreamGetPriority)                       \
    X(cuStreamGetPriority, 7000, 1, cuStreamGetPriority_ptsz)                  \
    X(cuStreamGetFlags, 5050, 0, cuStreamGetFlags)                             \
    X(cuStreamGetFlags, 7000, 1, cuStreamGetFlags_ptsz)                        \
    X(cuStreamGetCtx, 9020, 0, cuStreamGetCtx)                                 \
    X(cuStreamGetCtx, 9020, 1, cuStreamGetCtx_ptsz)                            \
    X(cuStreamGetId, 12000, 0, cuStreamGetId)                                  \
    X(cuStreamGetId, 12000, 1, cuStreamGetId_ptsz)                             \
    X(cuStreamGetDevice, 12080, 0, cuStreamGetDevice)                          \
    X(cuStreamGetDevice, 12080, 1, cuStreamGetDevice_ptsz)                     \
    X(cuStreamBatchMemOp, 8000, 0, cuStreamBatchMemOp)                         \
    X(cuStreamBatchMemOp, 8000, 1, cuStreamBatchMemOp_ptsz)                    \
    X(cuStreamBatchMemOp, 11070, 0, cuStreamBatchMemOp_v2)                     \
    X(cuStreamBatchMemOp, 11070, 1, cuStreamBatchMemOp_v2_ptsz)                \
    X(cuStreamWaitValue32, 8000, 0, cuStreamWaitValue32)                       \
    X(cuStreamWaitValue32, 8000, 1, cuStreamWaitValue32_ptsz)                  \
    X(cuStreamWaitValue32, 11070, 0, cuStreamWaitValue32_v2)                   \
    X(cuStreamWaitValue32, 11070, 1, cuStreamWaitValue32_v2_ptsz)              \
    X(cuStreamWriteValue32, 8000, 0, cuStreamWriteValue32)                     \
    X(cuStreamWriteValue32, 8000, 1, cuStreamWriteValue32_ptsz)                \
    X(cuStreamWriteValue32, 11070, 0, cuStreamWriteValue32_v2)                 \
    X(cuStreamWriteValue32, 11070, 1, cuStreamWriteValue32_v2_ptsz)            \
    X(cuStreamBeginCapture, 10010, 0, cuStreamBeginCapture_v2)                 \
    X(cuStreamBeginCapture, 10010, 1, cuStreamBeginCapture_v2_ptsz)            \
    X(cuStreamEndCapture, 10000, 0, cuStreamEndCapture)                        \
    X(cuStreamEndCapture, 10000, 1, cuStreamEndCapture_ptsz)                   \
    X(cuStreamIsCapturing, 10000, 0, cuStreamIsCapturing)                      \
    X(cuStreamIsCapturing, 10000, 1, cuStreamIsCapturing_ptsz)                 \
    X(cuStreamGetCaptureInfo, 10010, 0, cuStreamGetCaptureInfo)                \
    X(cuStreamGetCaptureInfo, 10010, 1, cuStreamGetCaptureInfo_ptsz)           \
    X(cuStreamGetCaptureInfo, 11030, 0, cuStreamGetCaptureInfo_v2)             \
    X(cuStreamGetCaptureInfo, 11030, 1, cuStreamGetCaptureInfo_v2_ptsz)        \
    X(cuStreamGetCaptureInfo, 12030, 0, cuStreamGetCaptureInfo_v3)             \
    X(cuStreamGetCaptureInfo, 12030, 1, cuStreamGetCaptureInfo_v3_ptsz)        \
    X(cuThreadExchangeStreamCaptureMode, 10010, 0, cuThreadExchangeStreamCaptureMode) \
    X(cuLaunchHostFunc, 10000, 0, cuLaunchHostFunc)                            \
    X(cuLaunchHostFunc, 10000, 1, cuLaunchHostFunc_ptsz)                       \
    X(cuEventCreate, 2000, 0, cuEventCreate)                                   \
    X(cuEventDestroy, 4000, 0, cuEventDestroy_v2)                              \
    X(cuEventRecord, 2000, 0, cuEventRecord)                                   \
    X(cuEventRecord, 7000, 1, cuEventRecord_ptsz)                              \
    X(cuEventRecordWithFlags, 11010, 0, cuEventRecordWithFlags)                \
    X(cuEventRecordWithFlags, 11010, 1, cuEventRecordWithFlags_ptsz)           \
    X(cuEventQuery, 2000, 0, cuEventQuery)                                     \
    X(cuEventSynchronize, 2000, 0, cuEventSynchronize)                         \
    X(cuEventElapsedTime, 2000, 0, cuEventElapsedTime)                         \
    X(cuEventElapsedTime, 12080, 0, cuEventElapsedTime_v2)                     \
    X(cuModuleLoad, 2000, 0, cuModuleLoad)                                     \
    X(cuModuleLoadData, 2000, 0, cuModuleLoadData)                             \
    X(cuModuleLoadDataEx, 2010, 0, cuModuleLoadDataEx)                         \
    X(cuModuleLoadFatBinary, 2000, 0, cuModuleLoadFatBinary)                   \
    X(cuModuleUnload, 2000, 0, cuModuleUnload)                                 \
    X(cuModuleGetFunction, 2000, 0, cuModuleGetFunction)                       \
    X(cuModuleGetGlobal, 3020, 0, cuModuleGetGlobal_v2)                        \
    X(cuLibraryLoadData, 12000, 0, cuLibraryLoadData)                          \
    X(cuLibraryLoadFromFile, 12000, 0, cuLibraryLoadFromFile)                  \
    X(cuLibraryUnload, 12000, 0, cuLibraryUnload)                              \
    X(cuLibraryGetKernel, 12000, 0, cuLibraryGetKernel)                        \
    X(cuLibraryGetModule, 12000, 0, cuLibraryGetModule)                        \
    X(cuLibraryGetGlobal, 12000, 0, cuLibraryGetGlobal)                        \
    X(cuKernelGetLibrary, 12050, 0, cuKernelGetLibrary)                        \
    X(cuKernelGetFunction, 12000, 0, cuKernelGetFunction)                      \
    X(cuKernelGetAttribute, 12000, 0, cuKernelGetAttribute)                    \
    X(cuKernelSetAttribute, 12000, 0, cuKernelSetAttribute)                    \
    X(cuFuncGetName, 12030, 0, cuFuncGetName)                                  \
    X(cuFuncGetAttribute, 2020, 0, cuFuncGetAttribute)                         \
    X(cuFuncSetAttribute, 9000, 0, cuFuncSetAttribute)                         \
    X(cuFuncSetCacheConfig, 3000, 0, cuFuncSetCacheConfig)                     \
    X(cuFuncGetModule, 11000, 0, cuFuncGetModule)                              \
    X(cuFuncIsLoaded, 12040, 0, cuFuncIsLoaded)                                \
    X(cuFuncLoad, 12040, 0, cuFuncLoad)                                        \
    X(cuKernelGetName, 12030, 0, cuKernelGetName)                              \
    X(cuModuleGetFunctionCount, 12040, 0, cuModuleGetFunctionCount)            \
    X(cuModuleEnumerateFunctions, 12040, 0, cuModuleEnumerateFunctions)        \
    X(cuModuleGetLoadingMode, 11070, 0, cuModuleGetLoadingMode)                \
    X(cuLibraryGetKernelCount, 12040, 0, cuLibraryGetKernelCount)              \
    X(cuLinkCreate, 6050, 0, cuLinkCreate_v2)                                  \
    X(cuLinkAddData, 6050, 0, cuLinkAddData_v2)                                \
    X(cuLinkAddFile, 6050, 0, cuLinkAddFile_v2)                                \
    X(cuLinkComplete, 5050, 0, cuLinkComplete)                                 \
    X(cuLinkDestroy, 5050, 0, cuLinkDestroy)                                   \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessor, 6050, 0, cuOccupancyMaxActiveBlocksPerMultiprocessor) \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags, 7000, 0,           \
      cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags)                    \
    X(cuOccupancyMaxPotentialBlockSize, 6050, 0, cuOccupancyMaxPotentialBlockSize) \
    X(cuOccupancyMaxPotentialBlockSizeWithFlags, 7000, 0, cuOccupancyMaxPotentialBlockSizeWithFlags) \
    X(cuOccupancyAvailableDynamicSMemPerBlock, 10020, 0, cuOccupancyAvailableDynamicSMemPerBlock) \
    X(cuOccupancyMaxActiveClusters, 11070, 0, cuOccupancyMaxActiveClusters)    \
    X(cuOccupancyMaxPotentialClusterSize, 11070, 0, cuOccupancyMaxPotentialClusterSize) \
    X(cuPointerGetAttribute, 4000, 0, cuPointerGetAttribute)                   \
    X(cuPointerGetAttributes, 7000, 0, cuPointerGetAttributes)                 \
    X(cuLaunchKernel, 4000, 0, cuLaunchKernel)                                 \
    X(cuLaunchKernel, 7000, 1, cuLaunchKernel_ptsz)                            \
    X(cuLaunchKernelEx, 11060, 0, cuLaunchKernelEx)                            \
    X(cuLaunchKernelEx, 11060, 1, cuLaunchKernelEx_ptsz)                       \
    X(cuLaunchCooperativeKernel, 9000, 0, cuLaunchCooperativeKernel)           \
    X(cuLaunchCooperativeKernel, 9000, 1, cuLaunchCooperativeKernel_ptsz)      \
    X(cuTensorMapEncodeTiled, 12000, 0, cuTensorMapEncodeTiled)                \
    X(cuGraphCreate, 10000, 0, cuGraphCreate)                                  \
    X(cuGraphDestroy, 10000, 0, cuGraphDestroy)                                \
    X(cuGraphAddKernelNode, 12000, 0, cuGraphAddKernelNode_v2)                 \
    X(cuGraphInstantiate, 10000, 0, cuGraphInstantiate)                        \
    X(cuGraphInstantiate, 11000, 0, cuGraphInstantiate_v2)                     \
    X(cuGraphInstantiateWithFlags, 11040, 0, cuGraphInstantiateWithFlags)      \
    X(cuGraphInstantiateWithParams, 12000, 0, cuGraphInstantiateWithParams)    \
    X(cuGraphInstantiateWithParams, 12000, 1, cuGraphInstantiateWithParams_ptsz) \
    X(cuGraphGetNodes, 10000, 0, cuGraphGetNodes)                              \
    X(cuGraphNodeGetType, 10000, 0, cuGraphNodeGetType)                        \
    X(cuGraphKernelNodeGetParams, 10000, 0, cuGraphKernelNodeGetParams)        \
    X(cuGraphKernelNodeGetParams, 12000, 0, cuGraphKernelNodeGetParams_v2)     \
    X(cuGraphExecDestroy, 10000, 0, cuGraphExecDestroy)                        \
    X(cuGraphUpload, 11010, 0, cuGraphUpload)                                  \
    X(cuGraphUpload, 11010, 1, cuGraphUpload_ptsz)                             \
    X(cuGraphLaunch, 10000, 0, cuGraphLaunch)                                  \
    X(cuGraphLaunch, 10000, 1, cuGraphLaunch_ptsz)                             \
    X(cuGraphAddMemAllocNode, 11040, 0, cuGraphAddMemAllocNode)                \
    X(cuGraphAddMemFreeNode, 11040, 0, cuGraphAddMemFreeNode)                  \
    X(cuGraphMemAllocNodeGetParams, 11040, 0, cuGraphMemAllocNodeGetParams)    \
    X(cuGraphMemFreeNodeGetParams, 11040, 0, cuGraphMemFreeNodeGetParams)      \
    X(cuDeviceGraphMemTrim, 11040, 0, cuDeviceGraphMemTrim)                    \
    X(cuDeviceGetGraphMemAttribute, 11040, 0, cuDeviceGetGraphMemAttribute)    \
    X(cuDeviceSetGraphMemAttribute, 11040, 0, cuDeviceSetGraphMemAttribute)

struct entry { const char *name; int version, per_thread; void *fn; };

#define AS_IMPLEMENTED(name, ver, pt, fn) {#name, ver, pt, (void *)fn},
static const struct entry implemented[] = {IMPLEMENTED(AS_IMPLEMENTED)};

static CUresult not_supported(void) { return CUDA_ERROR_NOT_SUPPORTED; }

static CUdriverProcAddressQueryResult resolve(const char *symbol, int cudaVersion, cuuint64_t flags, void **pfn)
{
    struct vgpu_abi abi;
    *pfn = NULL;
    CUdriverProcAddressQueryResult st = vgpu_resolve_abi(symbol, cudaVersion, flags, &abi);
    if (st != CU_GET_PROC_ADDRESS_SUCCESS)
        return st;
    *pfn = (void *)not_supported;
    for (size_t i = 0; i < sizeof implemented / sizeof implemented[0]; i++) {
        const struct entry *e = &implemented[i];
        if (e->version == abi.version && e->per_thread == abi.per_thread && !strcmp(e->name, symbol)) {
            *pfn = e->fn;
            break;
        }
    }
    simgpu_log("cuGetProcAddress(%s, %d, %llu) -> v%d%s%s", symbol, cudaVersion, (unsigned long long)flags,
               abi.version, abi.per_thread ? " per-thread" : "",
               *pfn == (void *)not_supported ? " (not implemented)" : "");
    return st;
}

SIMGPU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                           cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus)
{
    if (!symbol || !pfn || flags > 2)
        return CUDA_ERROR_INVALID_VALUE;
    CUdriverProcAddressQueryResult st = resolve(symbol, cudaVersion, flags, pfn);
    if (symbolStatus)
        *symbolStatus = st;
    return st == CU_GET_PROC_ADDRESS_SUCCESS ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

SIMGPU_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}

/* NVIDIA's private tables (used by the CUDA runtime) are not part of the public ABI. */
SIMGPU_EXPORT CUresult cuGetExportTable(const void **ppExportTable, const void *pExportTableId)
{
    if (!ppExportTable || !pExportTableId)
        return CUDA_ERROR_INVALID_VALUE;
    *ppExportTable = NULL;
    return CUDA_ERROR_NOT_SUPPORTED;
}
