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
#define _GNU_SOURCE
#include "cuda_abi.h"
#include "abi_resolve.h"
#include "footprint.h"
#include "simgpu/image.h"
#include "simgpu/node.h"

/* CUdevice ordinals are devices of the process's view (CUDA_VISIBLE_DEVICES; a MIG device
 * is one compute instance: its GI's memory pool, its own timeline): the node's memory and
 * timeline calls in this file go through the view (mig.h). */
#define simgpu_mem_reserve simgpu_view_mem_reserve
#define simgpu_mem_release simgpu_view_mem_release
#define simgpu_mem_used simgpu_view_mem_used
#define simgpu_enqueue simgpu_view_enqueue
#define simgpu_note_context simgpu_view_note_context
#define simgpu_forget_context simgpu_view_forget_context

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define DRIVER_VERSION 13000
#define VMM_GRANULARITY VGPU_LARGE_PAGE   /* cuMemGetAllocationGranularity, min and recommended */
#define PITCH_ALIGNMENT 512

/* === handles ===
 * Every handle the driver gives out is a slot of one arena, so a handle can be checked
 * (in range, slot aligned, right kind, alive) without ever dereferencing a wild pointer. */

enum kind { K_FREE = 0, K_CTX, K_STREAM, K_EVENT, K_MODULE, K_FUNCTION, K_LIBRARY, K_POOL,
            K_ARRAY, K_GRAPH, K_GRAPH_NODE, K_GRAPH_EXEC, K_VMM, K_LINK };

#define ARENA_SLOT 256
#define ARENA_SLOTS 65536

struct hdr { uint32_t kind; uint32_t magic; };
#define HANDLE_MAGIC 0x53494d47u

struct vgpu_ctx {
    struct hdr h;
    int dev;
    int primary;
    unsigned flags;
    int refs;
    int active;                 /* 0: a primary context after reset or its last release */
    int cache_config;           /* cuCtxSetCacheConfig's preference (CUfunc_cache) */
    uint64_t last_end;          /* end of the latest work this context queued */
    struct vgpu_stream *null_stream;
};

struct memq;
struct vgpu_stream {
    struct hdr h;
    struct vgpu_ctx *ctx;
    unsigned flags;
    int priority;
    pthread_mutex_t lock;
    uint64_t last_end;
    uint64_t *pending;          /* ring of end times: the bounded launch queue */
    unsigned pending_head, pending_count;
    struct vgpu_graph *capture; /* non-NULL while capturing */
    unsigned long long id;      /* cuStreamGetId: unique for the life of the process */
    cuuint64_t capture_id;      /* the capture sequence's, unique for the life of the process */
    struct vgpu_graph_node *capture_last;   /* the node captured last: the next one depends on it */
    CUgraphNode capture_deps[1];            /* what cuStreamGetCaptureInfo hands out */
    CUgraphEdgeData capture_edges[1];
    struct memq *memq;          /* stream memory operations still pending (NULL: none yet) */
};

struct vgpu_event {
    struct hdr h;
    unsigned flags;
    int recorded;
    uint64_t t;
};

struct vgpu_function {
    struct hdr h;
    uint64_t us_per_wave;
    struct vgpu_function *next;   /* module's list */
    struct vgpu_module *module;
    char *name;
    struct simgpu_kernel info;    /* what the image says (name not owned) */
    int max_dynamic_shared;       /* CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES */
    int carveout;                 /* CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT; -1 default */
    int cluster[3];               /* REQUIRED_CLUSTER_WIDTH/HEIGHT/DEPTH */
    int non_portable_cluster, cluster_policy, cache_config;
};

struct vgpu_module {
    struct hdr h;
    struct vgpu_function *functions;
    struct simgpu_image image;
    struct vgpu_library *library;  /* the library it was loaded for (cuKernelGetLibrary), or NULL */
    uint64_t globals;              /* device memory of the image's variables (0: none) */
    uint64_t *global_at;           /* each variable's offset in it, as image.globals */
};

struct vgpu_link {                /* a pending cuLink* invocation */
    struct hdr h;
    struct simgpu_image image;    /* the inputs' kernels so far */
    void *options;                /* struct jit_log, kept for the link's life */
    void *cubin;                  /* cuLinkComplete's result, owned by the state */
    size_t cubin_size;
    int inputs;
};
struct vgpu_library {
    struct hdr h;
    struct vgpu_module *module;
};

struct vgpu_mempool {
    struct hdr h;
    int dev;                            /* device ordinal; -1 for a host pool */
    int destroyed;                      /* by cuMemPoolDestroy: gone with its last allocation */
    int reuse[3];                       /* the CU_MEMPOOL_ATTR_REUSE_* flags */
    uint64_t release_threshold;
    uint64_t reserved, reserved_high;   /* backing memory the pool holds */
    uint64_t used, used_high;           /* the part of it live allocations use */
    struct vgpu_mempool *next;          /* every live pool of this process */
};

struct vgpu_array {
    struct hdr h;
    int dev;
    struct vgpu_ctx *ctx;       /* destroyed with it */
    uint64_t size;
    void *data;
    uint64_t row_bytes, rows;   /* level 0 as rows of elements (2D copies) */
    unsigned elem;              /* bytes of one element (0: a format simgpu does not size) */
};

struct kernel_node { struct vgpu_function *fn; uint64_t blocks; };
struct graph_mem;
struct vgpu_graph {
    struct hdr h;
    struct kernel_node *nodes;
    size_t count, cap;
    struct graph_mem **mem;     /* its allocation nodes */
    size_t nmem, mem_cap;
    struct vgpu_graph_node **all;   /* every node, as cuGraphGetNodes lists them (the graph owns them) */
    size_t nall, all_cap;
};
struct kernel_params;
struct vgpu_graph_node {
    struct hdr h;
    struct vgpu_graph *graph;
    CUgraphNodeType type;
    struct graph_mem *mem;      /* memory nodes: the allocation */
    int frees;                  /* a free node (else an allocation node) */
    struct kernel_params *kp;   /* kernel nodes: their parameters (cuGraphKernelNodeGetParams) */
};
struct vgpu_graph_exec {
    struct hdr h;
    int dev;
    uint64_t duration_ns;
    size_t kernels;
    struct graph_mem **mem;     /* the graph's allocation nodes */
    size_t nmem;
    unsigned long long flags;
};

struct vgpu_vmm {               /* a cuMemCreate allocation, or one imported from a shareable handle */
    struct hdr h;
    int dev;
    int fd;                     /* memfd, or a shared object's file: every mapping shares its pages */
    uint64_t size;
    int refs;                   /* cuMemCreate / import, cuMemRetainAllocationHandle: each needs a cuMemRelease */
    int mappings;
    int handle_types;           /* requestedHandleTypes */
    int shared;                 /* index + 1 of its shared object (node.h); 0: none */
};

_Static_assert(sizeof(struct vgpu_ctx) <= ARENA_SLOT, "arena slot");
_Static_assert(sizeof(struct vgpu_stream) <= ARENA_SLOT, "arena slot");
_Static_assert(sizeof(struct vgpu_function) <= ARENA_SLOT, "arena slot");
_Static_assert(sizeof(struct vgpu_module) <= ARENA_SLOT, "arena slot");
_Static_assert(sizeof(struct vgpu_link) <= ARENA_SLOT, "arena slot");
_Static_assert(sizeof(struct vgpu_mempool) <= ARENA_SLOT, "arena slot");
_Static_assert(sizeof(struct vgpu_array) <= ARENA_SLOT, "arena slot");
_Static_assert(sizeof(struct vgpu_graph_node) <= ARENA_SLOT, "arena slot");

static pthread_mutex_t arena_lock = PTHREAD_MUTEX_INITIALIZER;
static char *arena;
static size_t arena_used;
static void *arena_free_list;

static void *handle_new(enum kind k)
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

static void handle_free(void *p)
{
    pthread_mutex_lock(&arena_lock);
    ((struct hdr *)p)->kind = K_FREE;
    ((struct hdr *)p)->magic = 0;
    *(void **)((char *)p + sizeof(struct hdr)) = arena_free_list;
    arena_free_list = p;
    pthread_mutex_unlock(&arena_lock);
}

static int handle_ok(const void *p, enum kind k)
{
    const char *c = p;
    if (!arena || c < arena || c >= arena + (size_t)ARENA_SLOT * ARENA_SLOTS ||
        (size_t)(c - arena) % ARENA_SLOT)
        return 0;
    const struct hdr *h = p;
    return h->magic == HANDLE_MAGIC && h->kind == (uint32_t)k;
}

/* Free every live handle of `kind` for which `pred` holds (pred NULL: all). */
static void handles_drop(enum kind k, int (*pred)(void *, void *), void *arg, void (*before_free)(void *))
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

static int initialized;
static __thread int tls_per_thread;   /* set by _ptds/_ptsz entry points */

#define REQUIRE_INIT()                                                        \
    do {                                                                      \
        if (!__atomic_load_n(&initialized, __ATOMIC_ACQUIRE))                 \
            return CUDA_ERROR_NOT_INITIALIZED;                                \
    } while (0)

static int ndevices(void) { return simgpu_view_count(); }
static int dev_ok(CUdevice d) { return d >= 0 && d < ndevices(); }

/* Run `call` as the per-thread-default-stream variant of an entry point. */
#define PER_THREAD(call)          \
    do {                          \
        tls_per_thread = 1;       \
        CUresult r_ = (call);     \
        tls_per_thread = 0;       \
        return r_;                \
    } while (0)

static void forget_allocations(void);
static void forget_contexts(void);
static void forget_memops(void);
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
static struct vgpu_ctx *primary[SIMGPU_MAX_DEVICES];
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;

static int ctx_count[SIMGPU_MAX_DEVICES];   /* active contexts of this process, per device */

static struct vgpu_stream *stream_new(struct vgpu_ctx *ctx, unsigned flags, int priority);
static void free_streams_of(struct vgpu_ctx *ctx, int keep_null_stream);
static void free_allocations_of(struct vgpu_ctx *ctx);
static void memops_drop_ctx(struct vgpu_ctx *c);

static struct vgpu_ctx *current_ctx(void)
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
static int ctx_gpu_lost(const struct vgpu_ctx *c)
{
    if (!atomic_load_explicit(&simgpu_node()->health.lost, memory_order_relaxed))
        return 0;   /* (every call passes here: no GPU lost is one load) */
    return simgpu_gpu_lost(simgpu_view_gpu(c->dev));
}

/* A primary context reset (or released) and then used again comes back to life, as the
 * driver re-initializes it. */
static CUresult ctx_use(struct vgpu_ctx *c)
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

/* === memory: allocation table ===
 * Sorted by address, so device pointers inside an allocation are recognised (copies
 * check them; frees find their size).  Reserved VMM ranges are entries too. */

/* A_IPC: an opened IPC handle; A_MODULE: a module's variables (cuModuleGetGlobal) */
enum alloc_kind { A_DEVICE, A_MANAGED, A_HOST, A_RESERVED, A_GRAPH, A_IPC, A_MODULE };

struct alloc {
    uint64_t base, size;
    int dev;
    enum alloc_kind kind;
    uint64_t footprint;          /* device memory it holds (0 for host memory) */
    struct vgpu_mempool *pool;   /* stream-ordered allocations: the pool it came from */
    struct vgpu_ctx *ctx;        /* the context it goes with (NULL: none, e.g. pools) */
    struct graph_mem *graph_mem; /* A_GRAPH: the allocation node's record */
    int shared;                  /* index + 1 of its shared object (an IPC export or import); 0: none */
    uint64_t shared_id;
    int opens;                   /* A_IPC: cuIpcOpenMemHandle calls not yet closed */
};

static pthread_mutex_t alloc_lock = PTHREAD_MUTEX_INITIALIZER;
static struct alloc *allocs;
static size_t nallocs, allocs_cap;

static size_t alloc_lower_bound(uint64_t addr)
{
    size_t lo = 0, hi = nallocs;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (allocs[mid].base < addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int alloc_insert(struct alloc a)
{
    pthread_mutex_lock(&alloc_lock);
    if (nallocs == allocs_cap) {
        size_t cap = allocs_cap ? allocs_cap * 2 : 256;
        struct alloc *n = realloc(allocs, cap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&alloc_lock);
            return -1;
        }
        allocs = n;
        allocs_cap = cap;
    }
    size_t i = alloc_lower_bound(a.base);
    memmove(&allocs[i + 1], &allocs[i], (nallocs - i) * sizeof *allocs);
    allocs[i] = a;
    nallocs++;
    pthread_mutex_unlock(&alloc_lock);
    return 0;
}

/* Remove the entry starting exactly at `base` of one of `kinds` (bitmask); 0 if found. */
static int alloc_remove(uint64_t base, unsigned kinds, struct alloc *out)
{
    pthread_mutex_lock(&alloc_lock);
    size_t i = alloc_lower_bound(base);
    int found = i < nallocs && allocs[i].base == base && (kinds & (1u << allocs[i].kind));
    if (found) {
        *out = allocs[i];
        memmove(&allocs[i], &allocs[i + 1], (nallocs - i - 1) * sizeof *allocs);
        nallocs--;
    }
    pthread_mutex_unlock(&alloc_lock);
    return found ? 0 : -1;
}

/* The allocation containing [addr, addr+len), if any. */
static int alloc_find(uint64_t addr, uint64_t len, struct alloc *out)
{
    pthread_mutex_lock(&alloc_lock);
    size_t i = alloc_lower_bound(addr + 1);
    int found = 0;
    if (i > 0) {
        struct alloc *a = &allocs[i - 1];
        found = addr >= a->base && len <= a->size && addr - a->base <= a->size - len;   /* no wrap */
        if (found && out)
            *out = *a;
    }
    pthread_mutex_unlock(&alloc_lock);
    return found;
}


static void *map_lazy(uint64_t size)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* Reserve the allocation's footprint (footprint.h) node-wide, then back it with lazily
 * touched host pages. */
static CUresult dev_alloc(CUdeviceptr *dptr, uint64_t size, struct vgpu_ctx *ctx, enum alloc_kind kind)
{
    int dev = ctx->dev;
    if (!dptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t footprint = vgpu_alloc_footprint(size);
    if (simgpu_mem_reserve(dev, footprint))
        return CUDA_ERROR_OUT_OF_MEMORY;
    void *p = map_lazy(size);
    if (!p || alloc_insert((struct alloc){(uint64_t)(uintptr_t)p, size, dev, kind, footprint, NULL, ctx, NULL, 0, 0, 0})) {
        if (p)
            munmap(p, size);
        simgpu_mem_release(dev, footprint);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

static void pool_give_back(struct vgpu_mempool *p, uint64_t footprint);

/* Free a whole allocation: its memory goes back to the device, or to its pool. */
static void alloc_drop(const struct alloc *a)
{
    munmap((void *)(uintptr_t)a->base, a->size);
    if (a->shared)
        simgpu_shared_drop(a->shared - 1);   /* the device's memory goes with its last holder */
    else if (a->pool)
        pool_give_back(a->pool, a->footprint);
    else if (a->footprint)
        simgpu_mem_release(a->dev, a->footprint);
}

static int array_in_ctx(void *a, void *ctx) { return ((struct vgpu_array *)a)->ctx == ctx; }

static void array_release(void *p)
{
    struct vgpu_array *a = p;
    munmap(a->data, a->size);
    simgpu_mem_release(a->dev, a->size);
}

/* Everything a context allocated (not pool allocations, which belong to their pool). */
static void free_allocations_of(struct vgpu_ctx *ctx)
{
    const unsigned kinds = (1u << A_DEVICE) | (1u << A_MANAGED) | (1u << A_HOST) | (1u << A_IPC);
    pthread_mutex_lock(&alloc_lock);
    struct alloc *gone = malloc((nallocs ? nallocs : 1) * sizeof *gone);
    size_t ngone = 0, kept = 0;
    for (size_t i = 0; i < nallocs; i++) {
        if (gone && allocs[i].ctx == ctx && !allocs[i].pool && (kinds & (1u << allocs[i].kind)))
            gone[ngone++] = allocs[i];
        else
            allocs[kept++] = allocs[i];
    }
    nallocs = kept;
    pthread_mutex_unlock(&alloc_lock);
    for (size_t i = 0; i < ngone; i++)
        alloc_drop(&gone[i]);
    free(gone);
    handles_drop(K_ARRAY, array_in_ctx, ctx, array_release);
}

static CUresult graph_mem_free(uint64_t ptr);

static CUresult dev_free(CUdeviceptr ptr)
{
    struct alloc a;
    if (ptr == 0)
        return CUDA_SUCCESS;
    if (alloc_remove(ptr, (1u << A_DEVICE) | (1u << A_MANAGED), &a)) {
        CUresult r = graph_mem_free(ptr);   /* or a graph allocation, freed outside its graph */
        return r == CUDA_ERROR_NOT_FOUND ? CUDA_ERROR_INVALID_VALUE : r;
    }
    alloc_drop(&a);
    return CUDA_SUCCESS;
}

#define REQUIRE_CTX(c)                          \
    REQUIRE_INIT();                             \
    struct vgpu_ctx *c = current_ctx();         \
    if (!c)                                     \
        return CUDA_ERROR_INVALID_CONTEXT;      \
    do {                                        \
        CUresult use_ = ctx_use(c);             \
        if (use_ != CUDA_SUCCESS)               \
            return use_;                        \
    } while (0)

SIMGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    REQUIRE_CTX(c);
    return dev_alloc(dptr, bytesize, c, A_DEVICE);
}

SIMGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                          size_t Height, unsigned int ElementSizeBytes)
{
    REQUIRE_CTX(c);
    if (!pPitch || !WidthInBytes || !Height ||
        (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = (WidthInBytes + PITCH_ALIGNMENT - 1) / PITCH_ALIGNMENT * PITCH_ALIGNMENT;
    CUresult r = dev_alloc(dptr, (uint64_t)pitch * Height, c, A_DEVICE);
    if (r == CUDA_SUCCESS)
        *pPitch = pitch;
    return r;
}

SIMGPU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    REQUIRE_CTX(c);
    if (flags != 1 && flags != 2)   /* CU_MEM_ATTACH_GLOBAL / CU_MEM_ATTACH_HOST */
        return CUDA_ERROR_INVALID_VALUE;
    return dev_alloc(dptr, bytesize, c, A_MANAGED);
}

SIMGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    REQUIRE_INIT();
    return dev_free(dptr);
}

SIMGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    REQUIRE_CTX(c);
    if (!free || !total)
        return CUDA_ERROR_INVALID_VALUE;
    simgpu_reap_dead();
    uint64_t cap = simgpu_view_memory(c->dev), used = simgpu_mem_used(c->dev);
    *total = cap;
    *free = used < cap ? cap - used : 0;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    REQUIRE_INIT();
    struct alloc a;
    if (!alloc_find(dptr, 1, &a) || a.kind == A_RESERVED)
        return CUDA_ERROR_NOT_FOUND;
    if (pbase)
        *pbase = a.base;
    if (psize)
        *psize = a.size;
    return CUDA_SUCCESS;
}

/* Page-locked host memory is plain host memory here; it does not count on the device. */
SIMGPU_EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
{
    REQUIRE_CTX(c);
    (void)Flags;
    if (!pp || !bytesize)
        return CUDA_ERROR_INVALID_VALUE;
    void *p = map_lazy(bytesize);
    if (!p || alloc_insert((struct alloc){(uint64_t)(uintptr_t)p, bytesize, c->dev, A_HOST, 0, NULL, c, NULL, 0, 0, 0})) {
        if (p)
            munmap(p, bytesize);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pp = p;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)
{
    return cuMemHostAlloc(pp, bytesize, 0);
}

SIMGPU_EXPORT CUresult cuMemFreeHost(void *p)
{
    REQUIRE_INIT();
    struct alloc a;
    if (alloc_remove((uint64_t)(uintptr_t)p, 1u << A_HOST, &a))
        return CUDA_ERROR_INVALID_VALUE;
    munmap(p, a.size);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags)
{
    REQUIRE_INIT();
    if (!pdptr || Flags)
        return CUDA_ERROR_INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p;   /* unified addressing: same address */
    return CUDA_SUCCESS;
}

#define HOST_MEMORY (-1)

/* Where memory of `loc` lives (cuMemCreate, cuMemPoolCreate, graph allocation nodes): a
 * device ordinal, or HOST_MEMORY for the host (which takes no device memory).  As cuda.h
 * of CUDA 13.0 documents them: DEVICE names a device ordinal; HOST ignores the id;
 * HOST_NUMA names a host NUMA node (simgpu's host has one, node 0); HOST_NUMA_CURRENT is
 * CUDA_ERROR_INVALID_VALUE for cuMemCreate and cuMemPoolCreate; INVALID (= NONE) and
 * every type this driver does not know (newer ones included) are invalid too. */
static CUresult mem_location(const CUmemLocation *loc, int *dev)
{
    switch (loc->type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        if (!dev_ok(loc->id))
            return CUDA_ERROR_INVALID_DEVICE;
        *dev = loc->id;
        return CUDA_SUCCESS;
    case CU_MEM_LOCATION_TYPE_HOST:
        *dev = HOST_MEMORY;
        return CUDA_SUCCESS;
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
        *dev = HOST_MEMORY;
        return loc->id == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

/* === memory: pools and stream-ordered allocation ===
 * As the driver documents it (cuMemPoolSetAttribute, cuMemPoolTrimTo, cuMemFreeAsync):
 * memory freed with cuMemFreeAsync goes back to its pool, not to the device; the pool
 * keeps that reserve, and an allocation from the pool uses it before taking new device
 * memory.  At the next stream, event or context synchronize, a pool holding more than
 * its CU_MEMPOOL_ATTR_RELEASE_THRESHOLD (default 0) gives the excess back;
 * cuMemPoolTrimTo gives back what is unused down to the bytes asked to keep, and
 * cuMemPoolDestroy all of it (once its last allocation is freed).  The reserve counts as
 * this process's device memory (NVML, cuMemGetInfo).
 * Model, not measured: the reserve grows and shrinks in POOL_CHUNK units, and the pool
 * never fragments (any unused reserve serves any allocation that fits in it). */

#define POOL_CHUNK (2ull << 20)

static struct vgpu_mempool *default_pool[SIMGPU_MAX_DEVICES];
static struct vgpu_mempool *current_pool[SIMGPU_MAX_DEVICES];
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;   /* every pool's state */
static struct vgpu_mempool *pools;                              /* under pool_lock */

static struct vgpu_stream *resolve_stream(CUstream s, CUresult *err);

static uint64_t round_up(uint64_t v, uint64_t unit) { return (v + unit - 1) / unit * unit; }

static struct vgpu_mempool *pool_new(int dev)
{
    struct vgpu_mempool *p = handle_new(K_POOL);
    if (!p)
        return NULL;
    p->dev = dev;
    p->reuse[0] = p->reuse[1] = p->reuse[2] = 1;   /* all reuse policies on, as documented */
    pthread_mutex_lock(&pool_lock);
    p->next = pools;
    pools = p;
    pthread_mutex_unlock(&pool_lock);
    return p;
}

/* A pool the caller may name (cuMemPoolDestroy makes it unnamable at once). */
static int pool_ok(const struct vgpu_mempool *p) { return handle_ok(p, K_POOL) && !p->destroyed; }

/* Give back unused reserve, keeping at least `keep` bytes and all memory in use (whole
 * chunks).  A pool holding no more than `keep` is left as it is. */
static void pool_trim_locked(struct vgpu_mempool *p, uint64_t keep)
{
    if (p->reserved <= keep)
        return;
    uint64_t target = round_up(p->used, POOL_CHUNK);
    uint64_t k = round_up(keep, POOL_CHUNK);   /* keep < reserved: cannot wrap */
    if (k > target)
        target = k;
    if (target >= p->reserved)
        return;
    if (p->dev >= 0)
        simgpu_mem_release(p->dev, p->reserved - target);
    p->reserved = target;
}

/* A destroyed pool goes once its last allocation is freed. */
static void pool_reap_locked(struct vgpu_mempool *p)
{
    if (!p->destroyed)
        return;
    pool_trim_locked(p, 0);
    if (p->used)
        return;
    for (struct vgpu_mempool **pp = &pools; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    handle_free(p);
}

static void pool_give_back(struct vgpu_mempool *p, uint64_t footprint)
{
    pthread_mutex_lock(&pool_lock);
    p->used = p->used >= footprint ? p->used - footprint : 0;
    pool_reap_locked(p);
    pthread_mutex_unlock(&pool_lock);
}

/* At a synchronization: every pool above its release threshold gives the excess back. */
static void pools_release_over_threshold(void)
{
    if (!__atomic_load_n(&pools, __ATOMIC_RELAXED))
        return;
    pthread_mutex_lock(&pool_lock);
    for (struct vgpu_mempool *p = pools; p; p = p->next)
        if (p->reserved > p->release_threshold)
            pool_trim_locked(p, p->release_threshold);
    pthread_mutex_unlock(&pool_lock);
}

/* Take `footprint` from the pool: first from its unused reserve, then by growing the
 * reserve (node-wide device memory for a device pool). */
static CUresult pool_take(struct vgpu_mempool *p, uint64_t footprint)
{
    pthread_mutex_lock(&pool_lock);
    uint64_t spare = p->reserved - p->used;
    uint64_t grow = footprint > spare ? round_up(footprint - spare, POOL_CHUNK) : 0;
    CUresult r = CUDA_SUCCESS;
    if (grow && p->dev >= 0 && simgpu_mem_reserve(p->dev, grow)) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        p->reserved += grow;
        p->used += footprint;
        if (p->reserved > p->reserved_high)
            p->reserved_high = p->reserved;
        if (p->used > p->used_high)
            p->used_high = p->used;
    }
    pthread_mutex_unlock(&pool_lock);
    return r;
}

static CUresult pool_alloc(CUdeviceptr *dptr, uint64_t size, struct vgpu_mempool *pool)
{
    if (!dptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (size > (1ull << 56))
        return CUDA_ERROR_OUT_OF_MEMORY;   /* more than any device: and no rounding wraps */
    uint64_t footprint = vgpu_alloc_footprint(size);   /* the block it takes from the pool */
    CUresult r = pool_take(pool, footprint);
    if (r != CUDA_SUCCESS)
        return r;
    void *m = map_lazy(size);
    if (!m || alloc_insert((struct alloc){(uint64_t)(uintptr_t)m, size, pool->dev, A_DEVICE, footprint,
                                          pool, NULL, NULL, 0, 0, 0})) {
        if (m)
            munmap(m, size);
        pool_give_back(pool, footprint);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *dptr = (CUdeviceptr)(uintptr_t)m;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev)
{
    REQUIRE_INIT();
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&ctx_lock);
    if (!default_pool[dev])
        default_pool[dev] = pool_new(dev);
    *pool = default_pool[dev];
    pthread_mutex_unlock(&ctx_lock);
    return *pool ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

SIMGPU_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    REQUIRE_INIT();
    if (pool && dev_ok(dev) && current_pool[dev]) {
        *pool = current_pool[dev];
        return CUDA_SUCCESS;
    }
    return cuDeviceGetDefaultMemPool(pool, dev);
}

SIMGPU_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool)
{
    REQUIRE_INIT();
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    if (!pool_ok(pool) || pool->dev != dev)
        return CUDA_ERROR_INVALID_VALUE;
    current_pool[dev] = pool;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    REQUIRE_INIT();
    if (!pool || !props || props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;   /* "currently must be" pinned, says cuda.h */
    int dev;
    CUresult r = mem_location(&props->location, &dev);
    if (r != CUDA_SUCCESS)
        return r;
    if (dev == HOST_MEMORY && props->handleTypes)
        return CUDA_ERROR_INVALID_VALUE;   /* documented: host pools are not IPC capable */
    struct vgpu_mempool *p = pool_new(dev);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *pool = p;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    REQUIRE_INIT();
    pthread_mutex_lock(&pool_lock);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    if (pool_ok(pool) && !(pool->dev >= 0 && pool == default_pool[pool->dev])) {
        if (pool->dev >= 0 && current_pool[pool->dev] == pool)
            current_pool[pool->dev] = NULL;   /* the device's default pool is current again */
        pool->destroyed = 1;
        pool_reap_locked(pool);   /* unused reserve now, the rest with the last free */
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&pool_lock);
    return r;
}

SIMGPU_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    REQUIRE_INIT();
    pthread_mutex_lock(&pool_lock);
    int ok = pool_ok(pool);
    if (ok)
        pool_trim_locked(pool, minBytesToKeep);
    pthread_mutex_unlock(&pool_lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIMGPU_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value)
{
    REQUIRE_INIT();
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_lock);
    CUresult r = pool_ok(pool) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    uint64_t v = attr >= CU_MEMPOOL_ATTR_RELEASE_THRESHOLD ? *(cuuint64_t *)value : 0;
    if (r != CUDA_SUCCESS) {
    } else if (attr >= CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES &&
               attr <= CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES) {
        pool->reuse[attr - 1] = *(int *)value != 0;
    } else if (attr == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) {
        pool->release_threshold = v;   /* applied at the next synchronization */
    } else if (attr == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH && v == 0) {
        pool->reserved_high = pool->reserved;   /* a reset watermark restarts from now */
    } else if (attr == CU_MEMPOOL_ATTR_USED_MEM_HIGH && v == 0) {
        pool->used_high = pool->used;
    } else {
        r = CUDA_ERROR_INVALID_VALUE;   /* current figures are read-only; marks reset to 0 only */
    }
    pthread_mutex_unlock(&pool_lock);
    return r;
}

SIMGPU_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value)
{
    REQUIRE_INIT();
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&pool_lock);
    CUresult r = pool_ok(pool) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        switch (attr) {
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
            *(int *)value = pool->reuse[attr - 1];
            break;
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: *(cuuint64_t *)value = pool->release_threshold; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: *(cuuint64_t *)value = pool->reserved; break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: *(cuuint64_t *)value = pool->reserved_high; break;
        case CU_MEMPOOL_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)value = pool->used; break;
        case CU_MEMPOOL_ATTR_USED_MEM_HIGH: *(cuuint64_t *)value = pool->used_high; break;
        default: r = CUDA_ERROR_INVALID_VALUE; break;
        }
    }
    pthread_mutex_unlock(&pool_lock);
    return r;
}

static CUresult capture_alloc(struct vgpu_stream *s, CUdeviceptr *dptr, uint64_t size, int dev);
static CUresult capture_free(struct vgpu_stream *s, CUdeviceptr dptr);

SIMGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                               CUstream hStream)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(hStream, &err);
    if (!s)
        return err;
    if (!pool_ok(pool))
        return CUDA_ERROR_INVALID_VALUE;
    if (s->capture)
        return capture_alloc(s, dptr, bytesize, pool->dev);
    return pool_alloc(dptr, bytesize, pool);
}

SIMGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
                                                    CUmemoryPool pool, CUstream hStream)
{
    PER_THREAD(cuMemAllocFromPoolAsync(dptr, bytesize, pool, hStream));
}

/* From the current pool of the stream's device. */
SIMGPU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(hStream, &err);
    if (!s)
        return err;
    if (s->capture)   /* captured: an allocation node, memory allocated at each launch */
        return capture_alloc(s, dptr, bytesize, s->ctx->dev);
    CUmemoryPool pool;
    if ((err = cuDeviceGetMemPool(&pool, s->ctx->dev)) != CUDA_SUCCESS)
        return err;
    return pool_alloc(dptr, bytesize, pool);
}

SIMGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    PER_THREAD(cuMemAllocAsync(dptr, bytesize, hStream));
}

SIMGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(hStream, &err);
    if (!s)
        return err;
    if (s->capture)
        return capture_free(s, dptr);
    return dev_free(dptr);   /* a pool allocation's memory stays in its pool */
}

SIMGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    PER_THREAD(cuMemFreeAsync(dptr, hStream));
}

/* === memory: virtual memory management (cuMemCreate / map) === */

SIMGPU_EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                                     int option)
{
    REQUIRE_INIT();
    if (!granularity || !prop ||
        (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    int dev;
    CUresult r = mem_location(&prop->location, &dev);
    if (r != CUDA_SUCCESS)
        return r;
    *granularity = VMM_GRANULARITY;
    return CUDA_SUCCESS;
}

static int shared_file(uint64_t size, int *shared, int dev, uint64_t bytes, unsigned kind);

SIMGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                   const CUmemAllocationProp *prop, unsigned long long flags)
{
    REQUIRE_INIT();
    if (!handle || !prop || flags || size == 0 || size % VMM_GRANULARITY ||
        prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
        return CUDA_ERROR_INVALID_VALUE;
    int dev;
    CUresult r = mem_location(&prop->location, &dev);
    if (r != CUDA_SUCCESS)
        return r;
    if (dev == HOST_MEMORY && prop->requestedHandleTypes)
        return CUDA_ERROR_INVALID_VALUE;   /* documented: host allocations are not IPC capable */
    /* POSIX file descriptors only: no Win32 handles on Linux, no fabric (no IMEX channel) */
    if (prop->requestedHandleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    int shareable = prop->requestedHandleTypes != 0;
    if (shareable && simgpu_mig_enabled(simgpu_view_gpu(dev)))
        return CUDA_ERROR_NOT_SUPPORTED;   /* not modelled: memory shared across processes on MIG */
    if (dev != HOST_MEMORY && simgpu_mem_reserve(dev, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct vgpu_vmm *v = handle_new(K_VMM);
    int fd = -1, shared = 0;
    if (v && shareable) {
        fd = shared_file(size, &shared, dev, size, SIMGPU_SHARED_VMM);
    } else if (v && (fd = memfd_create("simgpu-vmm", MFD_CLOEXEC)) >= 0 && ftruncate(fd, (off_t)size)) {
        close(fd);
        fd = -1;
    }
    if (fd < 0) {
        if (v)
            handle_free(v);
        simgpu_mem_release(dev, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    v->dev = dev;
    v->fd = fd;
    v->size = size;
    v->refs = 1;
    v->handle_types = prop->requestedHandleTypes;
    v->shared = shared;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)v;
    return CUDA_SUCCESS;
}

static pthread_mutex_t vmm_lock = PTHREAD_MUTEX_INITIALIZER;

static void vmm_drop_if_unused(struct vgpu_vmm *v)
{
    /* Like the driver: memory goes back once released and no longer mapped (and, when it
     * is shared, once every other holder let go too: node.c). */
    if (v->refs == 0 && v->mappings == 0) {
        close(v->fd);
        if (v->shared)
            simgpu_shared_drop(v->shared - 1);
        else
            simgpu_mem_release(v->dev, v->size);
        handle_free(v);
    }
}

/* Each reference (cuMemCreate, an import, cuMemRetainAllocationHandle) needs its release. */
SIMGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    REQUIRE_INIT();
    struct vgpu_vmm *v = (struct vgpu_vmm *)(uintptr_t)handle;
    pthread_mutex_lock(&vmm_lock);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    if (handle_ok(v, K_VMM) && v->refs > 0) {
        v->refs--;
        vmm_drop_if_unused(v);
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

SIMGPU_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                           CUdeviceptr addr, unsigned long long flags)
{
    REQUIRE_INIT();
    (void)flags;
    if (!ptr || size == 0 || size % VMM_GRANULARITY)
        return CUDA_ERROR_INVALID_VALUE;
    size_t align = alignment > VMM_GRANULARITY ? alignment : VMM_GRANULARITY;
    /* over-reserve, then trim to the alignment asked for */
    char *p = mmap((void *)(uintptr_t)addr, size + align, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    char *aligned = (char *)(((uintptr_t)p + align - 1) / align * align);
    if (aligned > p)
        munmap(p, (size_t)(aligned - p));
    munmap(aligned + size, (size_t)(p + size + align - (aligned + size)));
    if (alloc_insert((struct alloc){(uint64_t)(uintptr_t)aligned, size, -1, A_RESERVED, 0, NULL, NULL, NULL, 0, 0, 0})) {
        munmap(aligned, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ptr = (CUdeviceptr)(uintptr_t)aligned;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    REQUIRE_INIT();
    struct alloc a;
    if (!alloc_find(ptr, 1, &a) || a.kind != A_RESERVED || a.base != ptr || a.size != size)
        return CUDA_ERROR_INVALID_VALUE;   /* only a whole reservation, never what lies beyond */
    alloc_remove(ptr, 1u << A_RESERVED, &a);
    munmap((void *)(uintptr_t)ptr, a.size);
    return CUDA_SUCCESS;
}

/* Which handle backs each mapped range, so unmap can drop the handle's reference. */
struct vmm_map { uint64_t ptr, size; struct vgpu_vmm *v; };
static struct vmm_map *vmm_maps;
static size_t nvmm_maps, vmm_maps_cap;

SIMGPU_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                                CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    REQUIRE_INIT();
    struct vgpu_vmm *v = (struct vgpu_vmm *)(uintptr_t)handle;
    struct alloc a;
    /* As documented: inside one reservation; ptr, size and offset granularity multiples. */
    if (flags || !size || ptr % VMM_GRANULARITY || size % VMM_GRANULARITY || offset % VMM_GRANULARITY ||
        !alloc_find(ptr, size, &a) || a.kind != A_RESERVED)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_lock);
    CUresult r = CUDA_SUCCESS;
    int overlaps = 0;   /* "cuMemMap can only create mappings on VA range reservations that
                         * are not currently mapped" */
    for (size_t i = 0; i < nvmm_maps && !overlaps; i++)
        overlaps = ptr < vmm_maps[i].ptr + vmm_maps[i].size && vmm_maps[i].ptr < ptr + size;
    if (overlaps || !handle_ok(v, K_VMM) || !v->refs || offset > v->size || size > v->size - offset) {
        r = CUDA_ERROR_INVALID_VALUE;
    } else if (nvmm_maps == vmm_maps_cap &&
               !(vmm_maps = realloc(vmm_maps, (vmm_maps_cap = vmm_maps_cap ? vmm_maps_cap * 2 : 64) *
                                                  sizeof *vmm_maps))) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, v->fd,
                    (off_t)offset) == MAP_FAILED) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        vmm_maps[nvmm_maps++] = (struct vmm_map){ptr, size, v};
        v->mappings++;
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

SIMGPU_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                      size_t count)
{
    REQUIRE_INIT();
    if (!desc || !count || !alloc_find(ptr, size, NULL))
        return CUDA_ERROR_INVALID_VALUE;
    int prot = desc[0].flags == 3 ? PROT_READ | PROT_WRITE : desc[0].flags == 1 ? PROT_READ : PROT_NONE;
    return mprotect((void *)(uintptr_t)ptr, size, prot) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    REQUIRE_INIT();
    pthread_mutex_lock(&vmm_lock);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < nvmm_maps; i++) {
        if (vmm_maps[i].ptr != ptr || vmm_maps[i].size != size)
            continue;
        /* put the reservation back in place of the mapping */
        mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
             -1, 0);
        struct vgpu_vmm *v = vmm_maps[i].v;
        vmm_maps[i] = vmm_maps[--nvmm_maps];
        v->mappings--;
        vmm_drop_if_unused(v);
        r = CUDA_SUCCESS;
        break;
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}


/* === memory shared between processes: IPC handles and shareable VMM handles ===
 * The driver API's rules, as cuda.h documents them:
 *   cuIpcGetMemHandle: "Takes a pointer to the base of an existing device memory
 *     allocation created with cuMemAlloc"; "may be called multiple times on an allocation
 *     without adverse effects";
 *   cuIpcOpenMemHandle: memory "exported from another process"; handles "may only be opened
 *     by one CUcontext per CUdevice per other process"; opened again by the same context,
 *     "the reference count on the handle is incremented by 1 and the existing device pointer
 *     is returned"; Flags "Must be specified as CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS";
 *   cuIpcCloseMemHandle: "Decrements the reference count ... When the reference count
 *     reaches 0, this API unmaps the memory";
 *   cuMemRelease: freed "when all outstanding mappings to the memory are unmapped and when
 *     all outstanding references to the handle (including it's shareable counterparts) are
 *     also released"; each import "needs to pair it with cuMemRelease";
 *   cuMemExportToShareableHandle: "Once all shareable handles are closed and the
 *     allocation is released, the allocated memory referenced will be released";
 *   cuMemRetainAllocationHandle: the handle backing a mapped address, "released with
 *     corresponding number of calls to cuMemRelease".
 * "Calling cuMemFree on an exported memory region before calling cuIpcCloseMemHandle in the
 * importing context will result in undefined behavior": simgpu keeps the memory (and the
 * importer's mapping) until the last importer closes it, the case that holds the most
 * device memory.  Observed, not documented: opening a handle in the process that exported
 * it is CUDA_ERROR_INVALID_CONTEXT ("invalid device context", openucx/ucx#11603).  Model:
 * a second context of one device opening a handle that process has open is
 * CUDA_ERROR_INVALID_CONTEXT too, and a context on another device CUDA_ERROR_INVALID_VALUE
 * (simgpu has no peer access).  Not modelled: IPC events, pool export
 * (cuMemPoolExportPointer), fabric handles, sharing on MIG devices (NOT_SUPPORTED).
 * The memory is a shared object of the node (node.h): a file of the state directory that
 * every holder maps, its bytes counted once, to the process that allocated it. */

struct ipc_handle {             /* what simgpu writes in CUipcMemHandle.reserved */
    char magic[8];
    int32_t index;              /* the shared object */
    int32_t reserved;
    uint64_t id;
    uint64_t size;
};
_Static_assert(sizeof(struct ipc_handle) <= sizeof(CUipcMemHandle), "IPC handle");
static const char IPC_MAGIC[8] = "simgpuIP";

static int lock_file_byte(int fd, short type)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &fl);
}

/* A backing file of `size` bytes for a new shared object that takes `bytes` of device
 * `dev` (an ordinal) off this process's slot: the file's descriptor, *shared = index + 1;
 * -1 when no file or object can be made (nothing changed then). */
static int shared_file(uint64_t size, int *shared, int dev, uint64_t bytes, unsigned kind)
{
    static _Atomic unsigned counter;
    char tmp[4200], path[4200];
    simgpu_shared_path(-1, (uint64_t)getpid() << 32 | atomic_fetch_add(&counter, 1), tmp, sizeof tmp);
    int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0)
        return -1;
    uint64_t id;
    int index = -1;
    if (ftruncate(fd, (off_t)size) ||
        (index = simgpu_shared_new(simgpu_view_gpu(dev), bytes, size, kind, &id)) < 0) {
        unlink(tmp);
        close(fd);
        return -1;
    }
    simgpu_shared_path(index, id, path, sizeof path);
    if (rename(tmp, path)) {   /* (cannot fail in a directory we just wrote to, but) */
        unlink(tmp);
        simgpu_mem_reserve(dev, bytes);   /* back on the slot before the object goes */
        simgpu_shared_drop(index);
        close(fd);
        return -1;
    }
    *shared = index + 1;
    return fd;
}

static int all_zero(const unsigned char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return 0;
    return 1;
}

/* With alloc_lock held: put cuMemAlloc memory on a shared object, its contents kept (the
 * pages it has written go to the file, untouched ones stay holes). */
static CUresult ipc_share_locked(struct alloc *a)
{
    int shared;
    int fd = shared_file(a->size, &shared, a->dev, a->footprint, SIMGPU_SHARED_IPC);
    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    size_t page = (size_t)sysconf(_SC_PAGESIZE), pages = (a->size + page - 1) / page;
    unsigned char *resident = malloc(pages ? pages : 1);
    unsigned char *base = (unsigned char *)(uintptr_t)a->base;
    int ok = resident && mincore(base, a->size, resident) == 0;
    for (size_t i = 0; ok && i < pages; i++) {
        size_t off = i * page, n = a->size - off < page ? a->size - off : page;
        if ((resident[i] & 1) && !all_zero(base + off, n))
            ok = pwrite(fd, base + off, n, (off_t)off) == (ssize_t)n;
    }
    free(resident);
    if (!ok || mmap(base, a->size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
        close(fd);
        simgpu_mem_reserve(a->dev, a->footprint);   /* back on the slot: the allocation stays private */
        simgpu_shared_drop(shared - 1);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    close(fd);
    const struct simgpu_shared *sh = &simgpu_node()->shared[shared - 1];
    a->shared = shared;
    a->shared_id = atomic_load(&sh->id);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    REQUIRE_CTX(c);
    if (!pHandle)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&alloc_lock);
    size_t i = alloc_lower_bound(dptr);
    struct alloc *a = i < nallocs && allocs[i].base == dptr ? &allocs[i] : NULL;
    CUresult r = CUDA_SUCCESS;
    if (!a || a->kind != A_DEVICE || a->pool)
        r = CUDA_ERROR_INVALID_VALUE;   /* the base of a cuMemAlloc allocation only */
    else if (simgpu_mig_enabled(simgpu_view_gpu(a->dev)))
        r = CUDA_ERROR_NOT_SUPPORTED;
    else if (!a->shared)
        r = ipc_share_locked(a);
    if (r == CUDA_SUCCESS) {
        struct ipc_handle h = {.index = a->shared - 1, .id = a->shared_id, .size = a->size};
        memcpy(h.magic, IPC_MAGIC, sizeof h.magic);
        memset(pHandle, 0, sizeof *pHandle);
        memcpy(pHandle->reserved, &h, sizeof h);
    }
    pthread_mutex_unlock(&alloc_lock);
    return r;
}

/* With alloc_lock held: this process's allocation (kinds) of shared object index/id. */
static struct alloc *alloc_of_shared(int index, uint64_t id, unsigned kinds)
{
    for (size_t i = 0; i < nallocs; i++)
        if (allocs[i].shared == index + 1 && allocs[i].shared_id == id && (kinds & (1u << allocs[i].kind)))
            return &allocs[i];
    return NULL;
}

static CUresult ipc_open(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
    REQUIRE_CTX(c);
    if (!pdptr || flags > CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return CUDA_ERROR_INVALID_VALUE;
    struct ipc_handle h;
    memcpy(&h, handle.reserved, sizeof h);
    if (memcmp(h.magic, IPC_MAGIC, sizeof h.magic) || h.index < 0 || h.index >= SIMGPU_MAX_SHARED)
        return CUDA_ERROR_INVALID_HANDLE;
    for (int attempt = 0; attempt < 2; attempt++) {
        pthread_mutex_lock(&alloc_lock);
        CUresult r = CUDA_ERROR_NOT_FOUND;
        struct alloc *a;
        if (alloc_of_shared(h.index, h.id, 1u << A_DEVICE)) {
            r = CUDA_ERROR_INVALID_CONTEXT;   /* its own export */
        } else if ((a = alloc_of_shared(h.index, h.id, 1u << A_IPC))) {
            if (a->ctx == c) {
                a->opens++;
                *pdptr = a->base;
                r = CUDA_SUCCESS;
            } else {
                r = CUDA_ERROR_INVALID_CONTEXT;   /* one context per device per process */
            }
        }
        pthread_mutex_unlock(&alloc_lock);
        if (r != CUDA_ERROR_NOT_FOUND)
            return r;
        if (attempt)
            break;
        /* not open here yet: hold it, map it, and record it unless another thread did */
        if (simgpu_shared_hold(h.index, h.id))
            return CUDA_ERROR_INVALID_HANDLE;   /* freed: its last holder let go */
        const struct simgpu_shared *sh = &simgpu_node()->shared[h.index];
        char path[4200];
        simgpu_shared_path(h.index, h.id, path, sizeof path);
        int fd = sh->kind == SIMGPU_SHARED_IPC && sh->dev == simgpu_view_gpu(c->dev) &&
                 !simgpu_mig_enabled(sh->dev) ? open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW) : -1;
        void *p = fd >= 0 ? mmap(NULL, sh->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
        if (fd >= 0)
            close(fd);
        if (p == MAP_FAILED) {
            int other_device = sh->kind == SIMGPU_SHARED_IPC && sh->dev != simgpu_view_gpu(c->dev);
            simgpu_shared_drop(h.index);
            return other_device ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_MAP_FAILED;
        }
        struct alloc rec = {(uint64_t)(uintptr_t)p, sh->size, c->dev, A_IPC, 0, NULL, c, NULL,
                            h.index + 1, h.id, 1};
        pthread_mutex_lock(&alloc_lock);
        int raced = alloc_of_shared(h.index, h.id, 1u << A_IPC) != NULL;
        pthread_mutex_unlock(&alloc_lock);
        if (!raced && alloc_insert(rec) == 0) {
            *pdptr = rec.base;
            return CUDA_SUCCESS;
        }
        munmap(p, sh->size);
        simgpu_shared_drop(h.index);
        if (!raced)
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_ERROR_INVALID_HANDLE;
}

SIMGPU_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    return ipc_open(pdptr, handle, Flags);
}

SIMGPU_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    return ipc_open(pdptr, handle, Flags);
}

SIMGPU_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    REQUIRE_CTX(c);
    (void)c;
    struct alloc a;
    pthread_mutex_lock(&alloc_lock);
    size_t i = alloc_lower_bound(dptr);
    int found = i < nallocs && allocs[i].base == dptr && allocs[i].kind == A_IPC;
    int last = found && --allocs[i].opens == 0;
    if (last) {
        a = allocs[i];
        memmove(&allocs[i], &allocs[i + 1], (nallocs - i - 1) * sizeof *allocs);
        nallocs--;
    }
    pthread_mutex_unlock(&alloc_lock);
    if (last)
        alloc_drop(&a);   /* unmapped; the memory goes if this was its last holder */
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIMGPU_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                    CUmemAllocationHandleType handleType, unsigned long long flags)
{
    REQUIRE_INIT();
    struct vgpu_vmm *v = (struct vgpu_vmm *)(uintptr_t)handle;
    if (!shareableHandle || flags)
        return CUDA_ERROR_INVALID_VALUE;
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&vmm_lock);
    CUresult r = CUDA_ERROR_INVALID_VALUE;   /* not a live handle, or not made shareable as this type */
    if (handle_ok(v, K_VMM) && v->refs && v->shared && (v->handle_types & handleType)) {
        const struct simgpu_shared *sh = &simgpu_node()->shared[v->shared - 1];
        char path[4200];
        simgpu_shared_path(v->shared - 1, atomic_load(&sh->id), path, sizeof path);
        /* a description of its own, holding the memory for as long as it (or a copy of it,
         * in this process or another) is open */
        int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        if (fd >= 0 && lock_file_byte(fd, F_RDLCK) == 0) {
            *(int *)shareableHandle = fd;
            r = CUDA_SUCCESS;
        } else {
            if (fd >= 0)
                close(fd);
            r = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

/* The shared object a descriptor is a shareable handle of: its file in the state directory. */
static int shared_of_fd(int fd, int *index, uint64_t *id)
{
    char link[64], path[4200], want[4200];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0)
        return -1;
    path[n] = 0;
    const char *name = strrchr(path, '/');
    unsigned long long v;
    if (!name || sscanf(name, "/shm-%d-%16llx", index, &v) != 2 || *index < 0 || *index >= SIMGPU_MAX_SHARED)
        return -1;
    *id = v;
    simgpu_shared_path(*index, *id, want, sizeof want);
    return strcmp(want, path) ? -1 : 0;
}

SIMGPU_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                      CUmemAllocationHandleType shHandleType)
{
    REQUIRE_INIT();
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        return CUDA_ERROR_NOT_SUPPORTED;
    int index;
    uint64_t id;
    if (shared_of_fd((int)(intptr_t)osHandle, &index, &id) || simgpu_shared_hold(index, id))
        return CUDA_ERROR_INVALID_VALUE;   /* not a shareable handle of device memory that still exists */
    const struct simgpu_shared *sh = &simgpu_node()->shared[index];
    int dev = -1;
    for (int d = 0; d < ndevices() && dev < 0; d++)
        if (simgpu_view_gpu(d) == sh->dev && !simgpu_mig_enabled(sh->dev))
            dev = d;
    char path[4200];
    simgpu_shared_path(index, id, path, sizeof path);
    struct vgpu_vmm *v = sh->kind == SIMGPU_SHARED_VMM && dev >= 0 ? handle_new(K_VMM) : NULL;
    int fd = v ? open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW) : -1;
    if (fd < 0) {
        if (v)
            handle_free(v);
        simgpu_shared_drop(index);
        return dev < 0 ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_OUT_OF_MEMORY;   /* a GPU this process cannot see */
    }
    v->dev = dev;
    v->fd = fd;
    v->size = sh->size;
    v->refs = 1;
    v->handle_types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    v->shared = index + 1;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)v;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
    REQUIRE_INIT();
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    uint64_t at = (uint64_t)(uintptr_t)addr;
    CUresult r = CUDA_ERROR_INVALID_VALUE;   /* not a mapped address */
    pthread_mutex_lock(&vmm_lock);
    for (size_t i = 0; i < nvmm_maps; i++)
        if (at >= vmm_maps[i].ptr && at - vmm_maps[i].ptr < vmm_maps[i].size) {
            vmm_maps[i].v->refs++;
            *handle = (CUmemGenericAllocationHandle)(uintptr_t)vmm_maps[i].v;
            r = CUDA_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

SIMGPU_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                              CUmemGenericAllocationHandle handle)
{
    REQUIRE_INIT();
    struct vgpu_vmm *v = (struct vgpu_vmm *)(uintptr_t)handle;
    if (!prop)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&vmm_lock);
    int ok = handle_ok(v, K_VMM) && v->refs;
    if (ok) {
        memset(prop, 0, sizeof *prop);
        prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop->requestedHandleTypes = v->handle_types;
        prop->location.type = v->dev == HOST_MEMORY ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE;
        prop->location.id = v->dev == HOST_MEMORY ? 0 : v->dev;
    }
    pthread_mutex_unlock(&vmm_lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

static void close_vmm_fd(void *v) { close(((struct vgpu_vmm *)v)->fd); }

/* In a forked child: none of the parent's device memory is the child's to free. */
static void forget_graph_mem(void);

static void forget_allocations(void)
{
    pthread_mutex_init(&arena_lock, NULL);   /* another thread may have held it at fork */
    pthread_mutex_init(&alloc_lock, NULL);
    pthread_mutex_init(&vmm_lock, NULL);
    pthread_mutex_init(&pool_lock, NULL);
    nallocs = 0;
    nvmm_maps = 0;
    pools = NULL;   /* the parent's pools and their reserve stay the parent's */
    memset(default_pool, 0, sizeof default_pool);
    memset(current_pool, 0, sizeof current_pool);
    handles_drop(K_POOL, NULL, NULL, NULL);
    forget_graph_mem();
    handles_drop(K_ARRAY, NULL, NULL, NULL);
    handles_drop(K_VMM, NULL, NULL, close_vmm_fd);
}

/* === pointers (cuPointerGetAttribute[s]) ===
 * What the driver says about an address: the allocation that holds it (device, managed,
 * pool, graph, page-locked host memory) or the cuMemMap mapping over a reservation.  An
 * address simgpu did not hand out is CUDA_ERROR_INVALID_VALUE for cuPointerGetAttribute
 * (Triton relies on that to refuse host tensors) and default values for
 * cuPointerGetAttributes, as documented. */

struct ptr_info {
    int known;
    struct alloc a;
    uint64_t map_base, map_size;   /* VMM: the mapping */
};

static struct ptr_info ptr_info(CUdeviceptr ptr)
{
    struct ptr_info pi = {0};
    if (!alloc_find(ptr, 1, &pi.a))
        return pi;
    if (pi.a.kind == A_RESERVED) {   /* only a mapped part of a reservation is memory */
        pthread_mutex_lock(&vmm_lock);
        for (size_t i = 0; i < nvmm_maps; i++)
            if (ptr >= vmm_maps[i].ptr && ptr - vmm_maps[i].ptr < vmm_maps[i].size) {
                pi.known = 1;
                pi.map_base = vmm_maps[i].ptr;
                pi.map_size = vmm_maps[i].size;
                pi.a.dev = vmm_maps[i].v->dev;
            }
        pthread_mutex_unlock(&vmm_lock);
        return pi;
    }
    pi.known = 1;
    return pi;
}

#define PUT(type, v) (*(type *)data = (type)(v))

/* One attribute of a known pointer (pi.known), or of an unknown one's defaults. */
static CUresult pointer_attribute(const struct ptr_info *pi, CUpointer_attribute attr, void *data, CUdeviceptr ptr)
{
    const struct alloc *a = &pi->a;
    int host = pi->known && a->kind == A_HOST, vmm = pi->known && a->kind == A_RESERVED;
    struct vgpu_ctx *ctx = !pi->known ? NULL : a->ctx ? a->ctx : a->dev >= 0 ? primary[a->dev] : NULL;
    switch (attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: PUT(CUcontext, vmm ? NULL : ctx); break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        PUT(unsigned int, !pi->known ? 0 : host ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE);
        break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: PUT(CUdeviceptr, pi->known ? ptr : 0); break;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (pi->known && !host && a->kind != A_MANAGED)
            return CUDA_ERROR_INVALID_VALUE;   /* device memory has no host address */
        PUT(void *, pi->known ? (void *)(uintptr_t)ptr : NULL);
        break;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: PUT(unsigned int, 0); break;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
    case CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID:
        PUT(unsigned long long, pi->known ? (vmm ? pi->map_base : a->base) : 0);
        break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: PUT(unsigned int, pi->known && a->kind == A_MANAGED); break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: PUT(int, pi->known ? (a->dev >= 0 ? a->dev : 0) : -2); break;
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:   /* cuMemAlloc memory: cuIpcGetMemHandle */
        PUT(unsigned int, pi->known && !vmm && a->kind == A_DEVICE && !a->pool);
        break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: PUT(CUdeviceptr, !pi->known ? 0 : vmm ? pi->map_base : a->base); break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: PUT(size_t, !pi->known ? 0 : vmm ? pi->map_size : a->size); break;
    case CU_POINTER_ATTRIBUTE_MAPPED: PUT(unsigned int, pi->known); break;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: PUT(unsigned long long, 0); break;
    case CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE: PUT(unsigned int, 0); break;
    case CU_POINTER_ATTRIBUTE_ACCESS_FLAGS: PUT(unsigned int, pi->known ? 3 : 0); break;   /* READWRITE */
    case CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE: PUT(CUmemoryPool, pi->known ? a->pool : NULL); break;
    case CU_POINTER_ATTRIBUTE_MAPPING_SIZE: PUT(size_t, !pi->known ? 0 : vmm ? pi->map_size : a->size); break;
    case CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR:
        PUT(void *, !pi->known ? NULL : (void *)(uintptr_t)(vmm ? pi->map_base : a->base));
        break;
    case CU_POINTER_ATTRIBUTE_IS_HW_DECOMPRESS_CAPABLE: PUT(unsigned int, 0); break;
    case CU_POINTER_ATTRIBUTE_P2P_TOKENS: return CUDA_ERROR_NOT_SUPPORTED;   /* deprecated, no peers */
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}
#undef PUT

SIMGPU_EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
    REQUIRE_INIT();
    if (!data)
        return CUDA_ERROR_INVALID_VALUE;
    struct ptr_info pi = ptr_info(ptr);
    if (!pi.known)
        return CUDA_ERROR_INVALID_VALUE;
    return pointer_attribute(&pi, attribute, data, ptr);
}

SIMGPU_EXPORT CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes,
                                              void **data, CUdeviceptr ptr)
{
    REQUIRE_INIT();
    if (!attributes || !data)
        return CUDA_ERROR_INVALID_VALUE;
    struct ptr_info pi = ptr_info(ptr);
    for (unsigned i = 0; i < numAttributes; i++) {
        if (!data[i])
            return CUDA_ERROR_INVALID_VALUE;
        CUresult r = pointer_attribute(&pi, attributes[i], data[i], ptr);
        if (r == CUDA_ERROR_INVALID_VALUE && attributes[i] == CU_POINTER_ATTRIBUTE_HOST_POINTER)
            *(void **)data[i] = NULL, r = CUDA_SUCCESS;   /* no host address: NULL, not an error */
        if (r != CUDA_SUCCESS)
            return r;
    }
    return CUDA_SUCCESS;
}

/* === memory: arrays === */

static CUresult array_new(CUarray *out, uint64_t size, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    REQUIRE_CTX(c);
    if (!out || !size)
        return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR one = {1, 1, 1, d->Format, d->NumChannels, 0};
    unsigned elem = (unsigned)vgpu_array_bytes(&one, 1);   /* one element */
    if (simgpu_mem_reserve(c->dev, size))
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct vgpu_array *a = handle_new(K_ARRAY);
    void *data = a ? map_lazy(size) : NULL;
    if (!data) {
        if (a)
            handle_free(a);
        simgpu_mem_release(c->dev, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->dev = c->dev;
    a->ctx = c;
    a->size = size;
    a->data = data;
    a->elem = elem;
    a->row_bytes = (uint64_t)d->Width * elem;
    a->rows = d->Height ? d->Height : 1;
    *out = a;
    return CUDA_SUCCESS;
}

static CUresult array_destroy(CUarray a)
{
    REQUIRE_INIT();
    if (!handle_ok(a, K_ARRAY))
        return CUDA_ERROR_INVALID_HANDLE;
    array_release(a);
    handle_free(a);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d)
{
    REQUIRE_INIT();
    if (!d || !d->Width || (d->NumChannels != 1 && d->NumChannels != 2 && d->NumChannels != 4))
        return CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR d3 = {d->Width, d->Height, 0, d->Format, d->NumChannels, 0};
    return array_new(pHandle, vgpu_array_bytes(&d3, 1), &d3);
}

SIMGPU_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    REQUIRE_INIT();
    if (!d || !d->Width || (d->NumChannels != 1 && d->NumChannels != 2 && d->NumChannels != 4))
        return CUDA_ERROR_INVALID_VALUE;
    return array_new(pHandle, vgpu_array_bytes(d, 1), d);
}

SIMGPU_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                              unsigned int numMipmapLevels)
{
    REQUIRE_INIT();
    if (!d || !d->Width || !numMipmapLevels ||
        (d->NumChannels != 1 && d->NumChannels != 2 && d->NumChannels != 4))
        return CUDA_ERROR_INVALID_VALUE;
    return array_new(pHandle, vgpu_array_bytes(d, numMipmapLevels), d);
}

SIMGPU_EXPORT CUresult cuArrayDestroy(CUarray a) { return array_destroy(a); }
SIMGPU_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a) { return array_destroy(a); }

/* === streams === */

static __thread struct vgpu_stream *tls_pt_stream[SIMGPU_MAX_DEVICES];

static int stream_in_ctx(void *s, void *ctx) { return ((struct vgpu_stream *)s)->ctx == ctx; }
static int stream_in_ctx_not_null(void *s, void *ctx)
{
    return stream_in_ctx(s, ctx) && s != ((struct vgpu_ctx *)ctx)->null_stream;
}
static void memq_detach(struct vgpu_stream *s);
static int memops_pending(struct vgpu_stream *s);
static int ctx_memops_pending(struct vgpu_ctx *c);
static void memops_wait(struct vgpu_stream *s, struct vgpu_ctx *c);

static void stream_release(void *s)
{
    memq_detach(s);   /* its pending memory operations still complete */
    free(((struct vgpu_stream *)s)->pending);
}

static void free_streams_of(struct vgpu_ctx *ctx, int keep_null_stream)
{
    handles_drop(K_STREAM, keep_null_stream ? stream_in_ctx_not_null : stream_in_ctx, ctx, stream_release);
}

static unsigned long long stream_ids;   /* the last stream id handed out */

static struct vgpu_stream *stream_new(struct vgpu_ctx *ctx, unsigned flags, int priority)
{
    struct vgpu_stream *s = handle_new(K_STREAM);
    if (!s)
        return NULL;
    s->id = __atomic_add_fetch(&stream_ids, 1, __ATOMIC_RELAXED);
    s->pending = calloc(SIMGPU_QUEUE_DEPTH, sizeof *s->pending);
    if (!s->pending) {
        handle_free(s);
        return NULL;
    }
    s->ctx = ctx;
    s->flags = flags;
    s->priority = priority;
    pthread_mutex_init(&s->lock, NULL);
    return s;
}

/* NULL and CU_STREAM_LEGACY name the context's default stream; CU_STREAM_PER_THREAD (and
 * NULL in a _ptds/_ptsz entry point) this thread's own default stream. */
static struct vgpu_stream *resolve_stream(CUstream h, CUresult *err)
{
    *err = CUDA_ERROR_INVALID_HANDLE;
    if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
        struct vgpu_ctx *c = current_ctx();
        if (!c) {
            *err = CUDA_ERROR_INVALID_CONTEXT;
            return NULL;
        }
        if ((*err = ctx_use(c)) != CUDA_SUCCESS)
            return NULL;
        if (h == CU_STREAM_PER_THREAD || (h == NULL && tls_per_thread)) {
            struct vgpu_stream **pt = &tls_pt_stream[c->dev];
            if (!*pt || !handle_ok(*pt, K_STREAM) || (*pt)->ctx != c)
                *pt = stream_new(c, 0, 0);
            return *pt;
        }
        return c->null_stream;
    }
    if (!handle_ok(h, K_STREAM))
        return NULL;
    if (ctx_gpu_lost(((struct vgpu_stream *)h)->ctx)) {
        *err = CUDA_ERROR_UNKNOWN;
        return NULL;
    }
    return h;
}

SIMGPU_EXPORT CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
    REQUIRE_CTX(c);
    if (!phStream || flags > 1)
        return CUDA_ERROR_INVALID_VALUE;
    struct vgpu_stream *s = stream_new(c, flags, priority);
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *phStream = s;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int flags)
{
    return cuStreamCreateWithPriority(phStream, flags, 0);
}

SIMGPU_EXPORT CUresult cuStreamDestroy_v2(CUstream h)
{
    REQUIRE_INIT();
    if (!handle_ok(h, K_STREAM) || h == h->ctx->null_stream)
        return CUDA_ERROR_INVALID_HANDLE;
    stream_release(h);
    handle_free(h);   /* pending work still completes on the device timeline */
    return CUDA_SUCCESS;
}

static uint64_t stream_last_end(struct vgpu_stream *s)
{
    return __atomic_load_n(&s->last_end, __ATOMIC_ACQUIRE);
}

SIMGPU_EXPORT CUresult cuStreamSynchronize(CUstream h)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (s->capture)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    memops_wait(s, NULL);
    simgpu_sleep_until(stream_last_end(s));
    pools_release_over_threshold();
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream h) { PER_THREAD(cuStreamSynchronize(h)); }

SIMGPU_EXPORT CUresult cuStreamQuery(CUstream h)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (memops_pending(s))
        return CUDA_ERROR_NOT_READY;   /* a memory operation is still waiting */
    return simgpu_now_ns() >= stream_last_end(s) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIMGPU_EXPORT CUresult cuStreamQuery_ptsz(CUstream h) { PER_THREAD(cuStreamQuery(h)); }

SIMGPU_EXPORT CUresult cuStreamWaitEvent(CUstream h, CUevent ev, unsigned int flags)
{
    REQUIRE_INIT();
    (void)flags;
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!handle_ok(ev, K_EVENT))
        return CUDA_ERROR_INVALID_HANDLE;
    /* later work on s starts after the event: the device timeline is serial already,
     * so only the stream's notion of "done" moves */
    pthread_mutex_lock(&s->lock);
    if (ev->recorded && ev->t > s->last_end)
        __atomic_store_n(&s->last_end, ev->t, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&s->lock);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamWaitEvent_ptsz(CUstream h, CUevent ev, unsigned int flags)
{
    PER_THREAD(cuStreamWaitEvent(h, ev, flags));
}

SIMGPU_EXPORT CUresult cuStreamGetPriority(CUstream h, int *priority)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!priority)
        return CUDA_ERROR_INVALID_VALUE;
    *priority = s->priority;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamGetPriority_ptsz(CUstream h, int *priority)
{
    PER_THREAD(cuStreamGetPriority(h, priority));
}

SIMGPU_EXPORT CUresult cuStreamGetFlags(CUstream h, unsigned int *flags)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!flags)
        return CUDA_ERROR_INVALID_VALUE;
    *flags = s->flags;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamGetFlags_ptsz(CUstream h, unsigned int *flags)
{
    PER_THREAD(cuStreamGetFlags(h, flags));
}

SIMGPU_EXPORT CUresult cuStreamGetCtx(CUstream h, CUcontext *pctx)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = s->ctx;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamGetCtx_ptsz(CUstream h, CUcontext *pctx) { PER_THREAD(cuStreamGetCtx(h, pctx)); }

/* cuda.h, cuStreamGetId: "the unique Id which is associated with the given stream handle.
 * The Id is unique for the life of the program"; the special streams (NULL,
 * CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) have theirs.  Ids are never reused, though
 * handles are. */
SIMGPU_EXPORT CUresult cuStreamGetId(CUstream h, unsigned long long *streamId)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!streamId)
        return CUDA_ERROR_INVALID_VALUE;
    *streamId = s->id;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamGetId_ptsz(CUstream h, unsigned long long *streamId)
{
    PER_THREAD(cuStreamGetId(h, streamId));
}

/* cuda.h, cuStreamGetDevice: "the device to which a stream belongs" (its context's). */
SIMGPU_EXPORT CUresult cuStreamGetDevice(CUstream h, CUdevice *device)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    *device = s->ctx->dev;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamGetDevice_ptsz(CUstream h, CUdevice *device)
{
    PER_THREAD(cuStreamGetDevice(h, device));
}

typedef void (*host_fn)(void *);

SIMGPU_EXPORT CUresult cuLaunchHostFunc(CUstream h, host_fn fn, void *userData)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!fn)
        return CUDA_ERROR_INVALID_VALUE;
    /* runs once the stream's earlier work is done; simgpu runs it on the caller's thread */
    simgpu_sleep_until(stream_last_end(s));
    fn(userData);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuLaunchHostFunc_ptsz(CUstream h, host_fn fn, void *userData)
{
    PER_THREAD(cuLaunchHostFunc(h, fn, userData));
}

SIMGPU_EXPORT CUresult cuCtxSynchronize(void)
{
    REQUIRE_CTX(c);
    memops_wait(NULL, c);
    simgpu_sleep_until(__atomic_load_n(&c->last_end, __ATOMIC_ACQUIRE));
    pools_release_over_threshold();
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx)
{
    REQUIRE_INIT();
    if (!ctx)
        return cuCtxSynchronize();
    if (!handle_ok(ctx, K_CTX) || !ctx->active)
        return CUDA_ERROR_INVALID_CONTEXT;
    memops_wait(NULL, ctx);
    simgpu_sleep_until(__atomic_load_n(&ctx->last_end, __ATOMIC_ACQUIRE));
    pools_release_over_threshold();
    return CUDA_SUCCESS;
}

/* === stream memory operations (cuStreamWaitValue32, cuStreamWriteValue32, cuStreamBatchMemOp) ===
 * cuda.h: a wait "enqueues a synchronization of the stream on the given memory location.
 * Work ordered after the operation will block until the given condition on the memory
 * is satisfied" (default: (int32_t)(*addr - value) >= 0; EQ; AND: (*addr & value) != 0);
 * a write stores a value once the stream's earlier work is done.  Addresses are device
 * pointers (device memory, or page-locked host memory's device pointer); "None of the
 * operations accepts pointers to managed memory buffers".
 *
 * The model: each stream keeps its memory operations in order.  What can complete when it
 * is enqueued completes then (a wait whose condition holds; a write whose stream has no
 * unfinished work); the rest wait in the stream's queue, which a helper thread works
 * through (a write once the work queued before it has run, a wait once its condition
 * holds), and the stream is not done until its queue is empty: cuStreamQuery answers
 * CUDA_ERROR_NOT_READY, cuStreamSynchronize and cuCtxSynchronize wait (for ever, for a
 * condition nothing satisfies: "Improper use of this API may deadlock the application").
 * Kernels, copies and events queued after a waiting operation are not held back by it
 * (simgpu's kernels touch no memory and its copies are done when called).
 * The device attributes say what is supported: 32-bit operations and barriers of the v2
 * API; not CU_STREAM_WAIT_VALUE_NOR (CAN_USE_STREAM_WAIT_VALUE_NOR reads 0), 64-bit
 * operations (CAN_USE_64_BIT_STREAM_MEM_OPS reads 0), flushes of remote writes
 * (CAN_FLUSH_REMOTE_WRITES reads 0), nor the v1 API (CAN_USE_STREAM_MEM_OPS_V1 reads 0,
 * as on a driver loaded without NVreg_EnableStreamMemOPs=1, the default): those are
 * CUDA_ERROR_NOT_SUPPORTED. */

struct memop {
    int write;                  /* else a wait */
    uint32_t *addr;
    uint32_t value;
    unsigned flags;             /* a wait's condition */
    uint64_t due;               /* a write: the end of the work queued before it */
};

struct memq {
    struct memq *next;          /* every queue of the process */
    struct vgpu_stream *stream; /* NULL once the stream is destroyed */
    struct vgpu_ctx *ctx;
    struct memop *ops;
    size_t head, count, cap;
};

static pthread_mutex_t memop_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t memop_cond = PTHREAD_COND_INITIALIZER;   /* a queue got an operation */
static struct memq *memqs;
static int memop_thread_started;

#define MEMOP_POLL_NS 50000ull   /* how often the helper looks at waiting operations */

static int memop_wait_holds(const struct memop *op)
{
    uint32_t v = __atomic_load_n(op->addr, __ATOMIC_SEQ_CST);
    switch (op->flags) {
    case CU_STREAM_WAIT_VALUE_EQ: return v == op->value;
    case CU_STREAM_WAIT_VALUE_AND: return (v & op->value) != 0;
    default: return (int32_t)(v - op->value) >= 0;   /* GEQ, a cyclic comparison */
    }
}

/* Complete op if it can complete now; 1 if it did. */
static int memop_try(const struct memop *op)
{
    if (!op->write)
        return memop_wait_holds(op);
    if (simgpu_now_ns() < op->due)
        return 0;
    __atomic_store_n(op->addr, op->value, __ATOMIC_SEQ_CST);   /* with the fence the doc promises */
    return 1;
}

static uint32_t *memop_word(CUdeviceptr addr);

/* Under memop_lock: complete what can be completed of q; 1 if it is empty.  An operation
 * whose memory was freed meanwhile (a program error: the driver leaves it undefined) is
 * dropped rather than done. */
static int memq_run_locked(struct memq *q)
{
    while (q->count) {
        const struct memop *op = &q->ops[q->head];
        if (memop_word((CUdeviceptr)(uintptr_t)op->addr) && !memop_try(op))
            break;
        q->head = (q->head + 1) % q->cap;
        q->count--;
    }
    return q->count == 0;
}

static void memq_unlink_locked(struct memq *q)
{
    for (struct memq **p = &memqs; *p; p = &(*p)->next)
        if (*p == q) {
            __atomic_store_n(p, q->next, __ATOMIC_RELEASE);   /* (memops_pending reads memqs unlocked) */
            break;
        }
    free(q->ops);
    free(q);
}

static void *memop_thread(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&memop_lock);
    for (;;) {
        int waiting = 0;
        for (struct memq *q = memqs, *next; q; q = next) {
            next = q->next;
            if (!memq_run_locked(q))
                waiting = 1;
            else if (!q->stream)
                memq_unlink_locked(q);   /* its stream is gone and its work done */
        }
        if (!waiting) {
            pthread_cond_wait(&memop_cond, &memop_lock);
            continue;
        }
        pthread_mutex_unlock(&memop_lock);
        struct timespec ts = {0, (long)MEMOP_POLL_NS};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&memop_lock);
    }
    return NULL;
}

/* Under memop_lock: append op to s's queue (made on first use); 0, or -1 out of memory. */
static int memq_push_locked(struct vgpu_stream *s, const struct memop *op)
{
    struct memq *q = s->memq;
    if (!q) {
        if (!(q = calloc(1, sizeof *q)))
            return -1;
        q->stream = s;
        q->ctx = s->ctx;
        q->next = memqs;
        __atomic_store_n(&memqs, q, __ATOMIC_RELEASE);
        s->memq = q;
    }
    if (q->count == q->cap) {
        size_t cap = q->cap ? q->cap * 2 : 16;
        struct memop *ops = malloc(cap * sizeof *ops);
        if (!ops)
            return -1;
        for (size_t i = 0; i < q->count; i++)
            ops[i] = q->ops[(q->head + i) % q->cap];
        free(q->ops);
        q->ops = ops;
        q->cap = cap;
        q->head = 0;
    }
    q->ops[(q->head + q->count++) % q->cap] = *op;
    if (!memop_thread_started) {
        pthread_t t;
        pthread_attr_t attr;
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);   /* the helper takes none of the program's signals */
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        memop_thread_started = pthread_create(&t, &attr, memop_thread, NULL) == 0;
        pthread_attr_destroy(&attr);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (!memop_thread_started) {
            q->count--;
            return -1;
        }
    }
    pthread_cond_signal(&memop_cond);
    return 0;
}

/* Enqueue n operations on s, in order: each completes now if it can and nothing before it
 * waits, else it waits in the stream's queue. */
static CUresult memops_enqueue(struct vgpu_stream *s, const struct memop *ops, unsigned n)
{
    uint64_t due = stream_last_end(s);
    pthread_mutex_lock(&memop_lock);
    int queued = s->memq && !memq_run_locked(s->memq);
    CUresult r = CUDA_SUCCESS;
    for (unsigned i = 0; i < n && r == CUDA_SUCCESS; i++) {
        struct memop op = ops[i];
        op.due = due;
        if (!queued && memop_try(&op))
            continue;
        queued = 1;
        if (memq_push_locked(s, &op))
            r = CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&memop_lock);
    return r;
}

/* Does s still have memory operations to complete? */
static int memops_pending(struct vgpu_stream *s)
{
    if (!__atomic_load_n(&memqs, __ATOMIC_ACQUIRE))
        return 0;   /* no stream ever queued one: every sync call of every other program */
    pthread_mutex_lock(&memop_lock);
    int pending = s->memq && !memq_run_locked(s->memq);
    pthread_mutex_unlock(&memop_lock);
    return pending;
}

static int ctx_memops_pending(struct vgpu_ctx *c)
{
    if (!__atomic_load_n(&memqs, __ATOMIC_ACQUIRE))
        return 0;
    int pending = 0;
    pthread_mutex_lock(&memop_lock);
    for (struct memq *q = memqs; q && !pending; q = q->next)
        pending = q->ctx == c && !memq_run_locked(q);
    pthread_mutex_unlock(&memop_lock);
    return pending;
}

/* Wait until the memory operations of stream s (or of every stream of context c) are done. */
static void memops_wait(struct vgpu_stream *s, struct vgpu_ctx *c)
{
    while (s ? memops_pending(s) : ctx_memops_pending(c)) {
        struct timespec ts = {0, (long)MEMOP_POLL_NS};
        nanosleep(&ts, NULL);
    }
}

/* A stream that goes (cuStreamDestroy, its context destroyed): operations it still has
 * complete all the same ("resources associated with hStream will be released
 * automatically once the device has completed all work"). */
static void memq_detach(struct vgpu_stream *s)
{
    pthread_mutex_lock(&memop_lock);
    struct memq *q = s->memq;
    s->memq = NULL;
    if (q) {
        q->stream = NULL;
        if (memq_run_locked(q))
            memq_unlink_locked(q);
    }
    pthread_mutex_unlock(&memop_lock);
}

/* A context reset or destroyed: "reset all state" (cuDevicePrimaryCtxReset), its memory
 * is freed: the operations still pending on its streams are dropped, not done. */
static void memops_drop_ctx(struct vgpu_ctx *c)
{
    pthread_mutex_lock(&memop_lock);
    for (struct memq *q = memqs, *next; q; q = next) {
        next = q->next;
        if (q->ctx != c)
            continue;
        q->count = 0;
        if (!q->stream)
            memq_unlink_locked(q);
    }
    pthread_mutex_unlock(&memop_lock);
}

/* In a forked child: the parent's queues and helper thread are the parent's. */
static void forget_memops(void)
{
    pthread_mutex_init(&memop_lock, NULL);
    pthread_cond_init(&memop_cond, NULL);
    memqs = NULL;
    memop_thread_started = 0;
}

/* The 32-bit word at device pointer addr, if a memory operation may use it: 4-byte aligned,
 * in device memory or page-locked host memory, not managed memory. */
static uint32_t *memop_word(CUdeviceptr addr)
{
    struct ptr_info pi = ptr_info(addr);
    if (!pi.known || pi.a.kind == A_MANAGED || addr % 4)
        return NULL;
    uint64_t base = pi.a.kind == A_RESERVED ? pi.map_base : pi.a.base;
    uint64_t size = pi.a.kind == A_RESERVED ? pi.map_size : pi.a.size;
    return size >= 4 && addr - base <= size - 4 ? (uint32_t *)(uintptr_t)addr : NULL;
}

/* One operation of the v2 API, checked: CUDA_SUCCESS with *op filled, or why not. */
static CUresult memop_of(const CUstreamBatchMemOpParams *p, struct memop *op, int *skip)
{
    *skip = 0;
    switch (p->operation) {
    case CU_STREAM_MEM_OP_WAIT_VALUE_32:
        if (p->waitValue.flags & ~(3u | (unsigned)CU_STREAM_WAIT_VALUE_FLUSH))
            return CUDA_ERROR_INVALID_VALUE;
        if ((p->waitValue.flags & 3u) == CU_STREAM_WAIT_VALUE_NOR || (p->waitValue.flags & CU_STREAM_WAIT_VALUE_FLUSH))
            return CUDA_ERROR_NOT_SUPPORTED;
        if (!(op->addr = memop_word(p->waitValue.address)))
            return CUDA_ERROR_INVALID_VALUE;
        op->write = 0;
        op->value = p->waitValue.value;
        op->flags = p->waitValue.flags;
        return CUDA_SUCCESS;
    case CU_STREAM_MEM_OP_WRITE_VALUE_32:
        if (p->writeValue.flags)   /* NO_MEMORY_BARRIER "is not supported in the v2 API" */
            return CUDA_ERROR_INVALID_VALUE;
        if (!(op->addr = memop_word(p->writeValue.address)))
            return CUDA_ERROR_INVALID_VALUE;
        op->write = 1;
        op->value = p->writeValue.value;
        op->flags = 0;
        return CUDA_SUCCESS;
    case CU_STREAM_MEM_OP_BARRIER:   /* the operations are done in order, sequentially consistent */
        *skip = 1;
        return p->memoryBarrier.flags <= CU_STREAM_MEMORY_BARRIER_TYPE_GPU ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case CU_STREAM_MEM_OP_WAIT_VALUE_64:
    case CU_STREAM_MEM_OP_WRITE_VALUE_64:
    case CU_STREAM_MEM_OP_FLUSH_REMOTE_WRITES:
        return CUDA_ERROR_NOT_SUPPORTED;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

/* cuda.h, cuStreamBatchMemOp: the operations "are enqueued in the order they appear in
 * the array"; count "Must be less than 256"; flags "must be 0".  All are checked before
 * any is enqueued. */
SIMGPU_EXPORT CUresult cuStreamBatchMemOp_v2(CUstream h, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                             unsigned int flags)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (count >= 256 || (count && !paramArray) || flags)
        return CUDA_ERROR_INVALID_VALUE;
    if (s->capture)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;   /* no memory-operation nodes in simgpu's graphs */
    struct memop ops[256];
    unsigned n = 0;
    for (unsigned i = 0; i < count; i++) {
        int skip;
        if ((err = memop_of(&paramArray[i], &ops[n], &skip)) != CUDA_SUCCESS)
            return err;
        n += !skip;
    }
    return memops_enqueue(s, ops, n);
}

/* cuda.h, cuStreamWaitValue32 (v2): the batch of one CU_STREAM_MEM_OP_WAIT_VALUE_32. */
SIMGPU_EXPORT CUresult cuStreamWaitValue32_v2(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    CUstreamBatchMemOpParams p = {.waitValue = {CU_STREAM_MEM_OP_WAIT_VALUE_32, addr, {value}, flags, 0}};
    return cuStreamBatchMemOp_v2(h, 1, &p, 0);
}

/* cuda.h, cuStreamWriteValue32 (v2): the batch of one CU_STREAM_MEM_OP_WRITE_VALUE_32. */
SIMGPU_EXPORT CUresult cuStreamWriteValue32_v2(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    CUstreamBatchMemOpParams p = {.writeValue = {CU_STREAM_MEM_OP_WRITE_VALUE_32, addr, {value}, flags, 0}};
    return cuStreamBatchMemOp_v2(h, 1, &p, 0);
}

SIMGPU_EXPORT CUresult cuStreamBatchMemOp_v2_ptsz(CUstream h, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                                  unsigned int flags)
{
    PER_THREAD(cuStreamBatchMemOp_v2(h, count, paramArray, flags));
}
SIMGPU_EXPORT CUresult cuStreamWaitValue32_v2_ptsz(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    PER_THREAD(cuStreamWaitValue32_v2(h, addr, value, flags));
}
SIMGPU_EXPORT CUresult cuStreamWriteValue32_v2_ptsz(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    PER_THREAD(cuStreamWriteValue32_v2(h, addr, value, flags));
}

/* The v1 API (the unversioned names, CUDA 8.0): CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1
 * reads 0 ("Deprecated, along with v1 MemOps API"), so after the stream is checked these
 * are CUDA_ERROR_NOT_SUPPORTED, as on a driver without NVreg_EnableStreamMemOPs=1. */
static CUresult memops_v1(CUstream h)
{
    REQUIRE_INIT();
    CUresult err;
    return resolve_stream(h, &err) ? CUDA_ERROR_NOT_SUPPORTED : err;
}

SIMGPU_EXPORT CUresult cuStreamBatchMemOp(CUstream h, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                          unsigned int flags)
{
    (void)count, (void)paramArray, (void)flags;
    return memops_v1(h);
}
SIMGPU_EXPORT CUresult cuStreamWaitValue32(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    (void)addr, (void)value, (void)flags;
    return memops_v1(h);
}
SIMGPU_EXPORT CUresult cuStreamWriteValue32(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    (void)addr, (void)value, (void)flags;
    return memops_v1(h);
}
SIMGPU_EXPORT CUresult cuStreamBatchMemOp_ptsz(CUstream h, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                               unsigned int flags)
{
    PER_THREAD(cuStreamBatchMemOp(h, count, paramArray, flags));
}
SIMGPU_EXPORT CUresult cuStreamWaitValue32_ptsz(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    PER_THREAD(cuStreamWaitValue32(h, addr, value, flags));
}
SIMGPU_EXPORT CUresult cuStreamWriteValue32_ptsz(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags)
{
    PER_THREAD(cuStreamWriteValue32(h, addr, value, flags));
}

/* === events === */

#define CU_EVENT_DISABLE_TIMING 0x2

SIMGPU_EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
    REQUIRE_CTX(c);
    (void)c;
    if (!phEvent || Flags > 0xf)
        return CUDA_ERROR_INVALID_VALUE;
    struct vgpu_event *e = handle_new(K_EVENT);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->flags = Flags;
    *phEvent = e;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuEventDestroy_v2(CUevent e)
{
    REQUIRE_INIT();
    if (!handle_ok(e, K_EVENT))
        return CUDA_ERROR_INVALID_HANDLE;
    handle_free(e);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuEventRecord(CUevent e, CUstream h)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!handle_ok(e, K_EVENT))
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t now = simgpu_now_ns(), end = stream_last_end(s);
    e->t = end > now ? end : now;   /* completes when the stream's earlier work has */
    e->recorded = 1;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuEventRecord_ptsz(CUevent e, CUstream h) { PER_THREAD(cuEventRecord(e, h)); }

SIMGPU_EXPORT CUresult cuEventRecordWithFlags(CUevent e, CUstream h, unsigned int flags)
{
    (void)flags;
    return cuEventRecord(e, h);
}

SIMGPU_EXPORT CUresult cuEventRecordWithFlags_ptsz(CUevent e, CUstream h, unsigned int flags)
{
    PER_THREAD(cuEventRecordWithFlags(e, h, flags));
}

SIMGPU_EXPORT CUresult cuEventQuery(CUevent e)
{
    REQUIRE_INIT();
    if (!handle_ok(e, K_EVENT))
        return CUDA_ERROR_INVALID_HANDLE;
    return !e->recorded || simgpu_now_ns() >= e->t ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

SIMGPU_EXPORT CUresult cuEventSynchronize(CUevent e)
{
    REQUIRE_INIT();
    if (!handle_ok(e, K_EVENT))
        return CUDA_ERROR_INVALID_HANDLE;
    if (e->recorded)
        simgpu_sleep_until(e->t);
    pools_release_over_threshold();
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end)
{
    REQUIRE_INIT();
    if (!ms)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(start, K_EVENT) || !handle_ok(end, K_EVENT) || !start->recorded || !end->recorded ||
        ((start->flags | end->flags) & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t now = simgpu_now_ns();
    if (now < start->t || now < end->t)
        return CUDA_ERROR_NOT_READY;
    *ms = (float)(((double)end->t - (double)start->t) / 1e6);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end)
{
    return cuEventElapsedTime_v2(ms, start, end);
}

/* === memcpy / memset ===
 * Synchronous copies wait for the context's queued work, as copies on the legacy stream
 * do; asynchronous ones are done at once (simulated kernels never touch data). */

static int device_range_ok(CUdeviceptr p, size_t n)
{
    struct alloc a;
    return alloc_find(p, n ? n : 1, &a) && a.kind != A_HOST;
}

static CUresult copy(void *dst, const void *src, size_t n, int sync)
{
    REQUIRE_CTX(c);
    if (n && (!dst || !src))
        return CUDA_ERROR_INVALID_VALUE;
    if (sync)
        simgpu_sleep_until(__atomic_load_n(&c->last_end, __ATOMIC_ACQUIRE));
    memmove(dst, src, n);
    return CUDA_SUCCESS;
}

#define DPTR(p) ((void *)(uintptr_t)(p))
#define CHECK_DEV(p, n)                     \
    REQUIRE_INIT();                         \
    if (!device_range_ok((p), (n)))         \
        return CUDA_ERROR_INVALID_VALUE

SIMGPU_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    CHECK_DEV(dst, n);
    return copy(DPTR(dst), src, n, 1);
}
SIMGPU_EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    CHECK_DEV(src, n);
    return copy(dst, DPTR(src), n, 1);
}
SIMGPU_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    CHECK_DEV(dst, n);
    CHECK_DEV(src, n);
    return copy(DPTR(dst), DPTR(src), n, 1);
}
SIMGPU_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    return copy(DPTR(dst), DPTR(src), n, 1);   /* unified addressing: either side may be host */
}

static CUresult copy_async(void *dst, const void *src, size_t n, CUstream h)
{
    REQUIRE_INIT();
    CUresult err;
    if (!resolve_stream(h, &err))
        return err;
    return copy(dst, src, n, 0);
}

SIMGPU_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream h)
{
    CHECK_DEV(dst, n);
    return copy_async(DPTR(dst), src, n, h);
}
SIMGPU_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream h)
{
    CHECK_DEV(src, n);
    return copy_async(dst, DPTR(src), n, h);
}
SIMGPU_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h)
{
    CHECK_DEV(dst, n);
    CHECK_DEV(src, n);
    return copy_async(DPTR(dst), DPTR(src), n, h);
}
SIMGPU_EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h)
{
    return copy_async(DPTR(dst), DPTR(src), n, h);
}

SIMGPU_EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr d, const void *s, size_t n) { PER_THREAD(cuMemcpyHtoD_v2(d, s, n)); }
SIMGPU_EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *d, CUdeviceptr s, size_t n) { PER_THREAD(cuMemcpyDtoH_v2(d, s, n)); }
SIMGPU_EXPORT CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr d, CUdeviceptr s, size_t n) { PER_THREAD(cuMemcpyDtoD_v2(d, s, n)); }
SIMGPU_EXPORT CUresult cuMemcpy_ptds(CUdeviceptr d, CUdeviceptr s, size_t n) { PER_THREAD(cuMemcpy(d, s, n)); }
SIMGPU_EXPORT CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr d, const void *s, size_t n, CUstream h) { PER_THREAD(cuMemcpyHtoDAsync_v2(d, s, n, h)); }
SIMGPU_EXPORT CUresult cuMemcpyDtoHAsync_v2_ptsz(void *d, CUdeviceptr s, size_t n, CUstream h) { PER_THREAD(cuMemcpyDtoHAsync_v2(d, s, n, h)); }
SIMGPU_EXPORT CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h) { PER_THREAD(cuMemcpyDtoDAsync_v2(d, s, n, h)); }
SIMGPU_EXPORT CUresult cuMemcpyAsync_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h) { PER_THREAD(cuMemcpyAsync(d, s, n, h)); }

/* One side of a 2D copy (cuda.h, CUDA_MEMCPY2D): HOST is host memory at host; DEVICE device
 * memory at dev; UNIFIED any address of the unified space at dev; ARRAY the array's level 0
 * (its rows, no pitch), where "XInBytes must be evenly divisible by the array element size".
 * The first row starts at base + y * pitch + x; "If specified, srcPitch must be greater
 * than or equal to WidthInBytes + srcXInBytes" (likewise dst), and no pitch may exceed
 * CU_DEVICE_ATTRIBUTE_MAX_PITCH.  Fills *start and *row (the pitch that applies). */
static CUresult copy2d_side(int type, const void *host, CUdeviceptr dev, CUarray array, size_t pitch, size_t x,
                            size_t y, size_t width, size_t height, unsigned char **start, size_t *row)
{
    uint64_t base, first, extent;
    switch (type) {
    case CU_MEMORYTYPE_ARRAY:
        if (!handle_ok(array, K_ARRAY))
            return CUDA_ERROR_INVALID_HANDLE;
        if (!array->elem || x % array->elem || x > array->row_bytes || width > array->row_bytes - x ||
            y > array->rows || height > array->rows - y)
            return CUDA_ERROR_INVALID_VALUE;
        *start = (unsigned char *)array->data + y * array->row_bytes + x;
        *row = (size_t)array->row_bytes;
        return CUDA_SUCCESS;
    case CU_MEMORYTYPE_HOST:
        base = (uint64_t)(uintptr_t)host;
        break;
    case CU_MEMORYTYPE_DEVICE:
    case CU_MEMORYTYPE_UNIFIED:
        base = dev;
        break;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!base || pitch > 2147483647u || ((pitch || height > 1) && (x + width < x || pitch < x + width)))
        return CUDA_ERROR_INVALID_VALUE;
    if (__builtin_mul_overflow((uint64_t)y, pitch, &first) || __builtin_add_overflow(first, x, &first) ||
        __builtin_mul_overflow((uint64_t)(height - 1), pitch, &extent) || __builtin_add_overflow(extent, width, &extent) ||
        __builtin_add_overflow(base, first, &first))
        return CUDA_ERROR_INVALID_VALUE;
    struct alloc a;
    if (type == CU_MEMORYTYPE_DEVICE && !device_range_ok(first, extent))
        return CUDA_ERROR_INVALID_VALUE;   /* not device memory, or past its end */
    if (type == CU_MEMORYTYPE_UNIFIED && alloc_find(first, 1, &a) && !alloc_find(first, extent, NULL))
        return CUDA_ERROR_INVALID_VALUE;   /* memory the driver knows, past its end */
    *start = (unsigned char *)(uintptr_t)first;
    *row = pitch;
    return CUDA_SUCCESS;
}

/* cuda.h, cuMemcpy2DAsync (_v2, CUDA 3.2): "Perform a 2D memory copy according to the
 * parameters specified in pCopy", WidthInBytes by Height rows, on hStream.  Done when
 * called, as simgpu's other asynchronous copies. */
SIMGPU_EXPORT CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *p, CUstream h)
{
    REQUIRE_CTX(c);
    (void)c;
    CUresult err;
    if (!resolve_stream(h, &err))
        return err;
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    if (!p->WidthInBytes || !p->Height)
        return CUDA_SUCCESS;
    unsigned char *src, *dst;
    size_t spitch, dpitch;
    if ((err = copy2d_side(p->srcMemoryType, p->srcHost, p->srcDevice, p->srcArray, p->srcPitch, p->srcXInBytes,
                           p->srcY, p->WidthInBytes, p->Height, &src, &spitch)) != CUDA_SUCCESS ||
        (err = copy2d_side(p->dstMemoryType, p->dstHost, p->dstDevice, p->dstArray, p->dstPitch, p->dstXInBytes,
                           p->dstY, p->WidthInBytes, p->Height, &dst, &dpitch)) != CUDA_SUCCESS)
        return err;
    for (size_t r = 0; r < p->Height; r++)
        memmove(dst + r * dpitch, src + r * spitch, p->WidthInBytes);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D *p, CUstream h) { PER_THREAD(cuMemcpy2DAsync_v2(p, h)); }

static CUresult fill(CUdeviceptr dst, uint32_t value, unsigned width, size_t count, int sync, CUstream h)
{
    REQUIRE_CTX(c);
    CUresult err;
    if (!sync && !resolve_stream(h, &err))
        return err;
    if (count > SIZE_MAX / width || !device_range_ok(dst, count * width))
        return CUDA_ERROR_INVALID_VALUE;
    if (sync)
        simgpu_sleep_until(__atomic_load_n(&c->last_end, __ATOMIC_ACQUIRE));
    unsigned char *p = DPTR(dst);
    if (width == 1) {
        memset(p, (int)value, count);
    } else if (width == 2) {
        uint16_t v = (uint16_t)value;
        for (size_t i = 0; i < count; i++)
            memcpy(p + 2 * i, &v, 2);
    } else {
        for (size_t i = 0; i < count; i++)
            memcpy(p + 4 * i, &value, 4);
    }
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { return fill(d, v, 1, n, 1, NULL); }
SIMGPU_EXPORT CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n) { return fill(d, v, 2, n, 1, NULL); }
SIMGPU_EXPORT CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int v, size_t n) { return fill(d, v, 4, n, 1, NULL); }
SIMGPU_EXPORT CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream h) { return fill(d, v, 1, n, 0, h); }
SIMGPU_EXPORT CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream h) { return fill(d, v, 2, n, 0, h); }
SIMGPU_EXPORT CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream h) { return fill(d, v, 4, n, 0, h); }
SIMGPU_EXPORT CUresult cuMemsetD8_v2_ptds(CUdeviceptr d, unsigned char v, size_t n) { PER_THREAD(cuMemsetD8_v2(d, v, n)); }
SIMGPU_EXPORT CUresult cuMemsetD16_v2_ptds(CUdeviceptr d, unsigned short v, size_t n) { PER_THREAD(cuMemsetD16_v2(d, v, n)); }
SIMGPU_EXPORT CUresult cuMemsetD32_v2_ptds(CUdeviceptr d, unsigned int v, size_t n) { PER_THREAD(cuMemsetD32_v2(d, v, n)); }
SIMGPU_EXPORT CUresult cuMemsetD8Async_ptsz(CUdeviceptr d, unsigned char v, size_t n, CUstream h) { PER_THREAD(cuMemsetD8Async(d, v, n, h)); }
SIMGPU_EXPORT CUresult cuMemsetD16Async_ptsz(CUdeviceptr d, unsigned short v, size_t n, CUstream h) { PER_THREAD(cuMemsetD16Async(d, v, n, h)); }
SIMGPU_EXPORT CUresult cuMemsetD32Async_ptsz(CUdeviceptr d, unsigned int v, size_t n, CUstream h) { PER_THREAD(cuMemsetD32Async(d, v, n, h)); }

/* === unified memory: prefetch ===
 * cuda.h, cuMemPrefetchAsync (_v2, CUDA 12.2): "The memory range must refer to managed
 * memory allocated via cuMemAllocManaged or declared via __managed__ variables"; the
 * location is a device (whose CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS is non-zero:
 * every simgpu device's is), the host, a host NUMA node (simgpu's host has node 0) or the
 * one nearest the calling thread; "flags for future use, must be zero now"; errors
 * CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_DEVICE.  Managed memory is host memory here,
 * always where every processor reads it: a valid prefetch has nothing to move ("this API
 * is not required for functionality and only serves to improve performance"). */
static CUresult prefetch(CUdeviceptr devPtr, size_t count, CUmemLocation loc, unsigned flags, CUstream h)
{
    REQUIRE_INIT();
    CUresult err;
    if (!resolve_stream(h, &err))
        return err;
    if (flags)
        return CUDA_ERROR_INVALID_VALUE;
    switch (loc.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE:
        if (!dev_ok(loc.id))
            return CUDA_ERROR_INVALID_DEVICE;
        break;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT:
        break;   /* "CUmemLocation::id will be ignored" */
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
        if (loc.id != 0)
            return CUDA_ERROR_INVALID_VALUE;
        break;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    struct alloc a;
    if (!count || !alloc_find(devPtr, count, &a) || a.kind != A_MANAGED)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                             unsigned int flags, CUstream h)
{
    return prefetch(devPtr, count, location, flags, h);
}

/* The 8.0 ABI (the unversioned name): a destination device ordinal, or CU_DEVICE_CPU for
 * the host. */
SIMGPU_EXPORT CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream h)
{
    REQUIRE_INIT();
    if (dstDevice != CU_DEVICE_CPU && !dev_ok(dstDevice))
        return CUDA_ERROR_INVALID_DEVICE;
    CUmemLocation loc = {dstDevice == CU_DEVICE_CPU ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE,
                         dstDevice == CU_DEVICE_CPU ? 0 : dstDevice};
    return prefetch(devPtr, count, loc, 0, h);
}

SIMGPU_EXPORT CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream h)
{
    PER_THREAD(cuMemPrefetchAsync(devPtr, count, dstDevice, h));
}

SIMGPU_EXPORT CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                                  unsigned int flags, CUstream h)
{
    PER_THREAD(cuMemPrefetchAsync_v2(devPtr, count, location, flags, h));
}

/* === modules, libraries, functions ===
 * A module holds the kernels its image names (simgpu/image.h): PTX, cubins, fatbins,
 * objects, libraries and what cuLinkComplete produced.  A stand-in image (anything else,
 * e.g. the string "image") holds every name: the simulation convention of simgpu's tests.
 * What a kernel does: nothing to memory (simgpu runs no device code), and it takes
 * simulated time on the device's timeline: a kernel named sim_<N>us, or whose mangled
 * name's identifier is sim_<N>us (numba's _ZN...9sim_300usB2v1..., a Triton kernel
 * def sim_300us), runs N microseconds per wave of blocks (a wave is as many blocks as the
 * device has SMs); any other kernel SIMGPU_DEFAULT_KERNEL_US per wave. */

static int device_cc(void) { return simgpu_profile()->cc_major * 10 + simgpu_profile()->cc_minor; }

/* N if `name` is sim_<N>us, or holds sim_<N>us as one length-prefixed identifier of an
 * Itanium-mangled name (…<len>sim_<N>us…); else SIMGPU_DEFAULT_KERNEL_US. */
static uint64_t sim_us_of(const char *name)
{
    unsigned long long us;
    int end = 0;
    if (sscanf(name, "sim_%lluus%n", &us, &end) == 1 && end && !name[end])
        return us;   /* sim_0us: no time at all */
    for (const char *p = strstr(name, "sim_"); p; p = strstr(p + 1, "sim_")) {
        const char *d = p;
        while (d > name && d[-1] >= '0' && d[-1] <= '9')
            d--;
        if (d == p || sscanf(p, "sim_%lluus%n", &us, &end) != 1 || !end)
            continue;
        if (strtoul(d, NULL, 10) == (unsigned long)end)   /* the identifier is exactly sim_<N>us */
            return us;
    }
    return SIMGPU_DEFAULT_KERNEL_US;
}

/* The module's function `name`: NULL with *err set when the image has no such kernel. */
static struct vgpu_function *function_get(struct vgpu_module *m, const char *name, CUresult *err)
{
    for (struct vgpu_function *f = m->functions; f; f = f->next)
        if (strcmp(f->name, name) == 0)
            return f;
    const struct simgpu_kernel *k = NULL;
    if (m->image.names_known && !(k = simgpu_image_find(&m->image, name))) {
        *err = CUDA_ERROR_NOT_FOUND;
        return NULL;
    }
    struct vgpu_function *f = handle_new(K_FUNCTION);
    if (!f || !(f->name = strdup(name))) {
        if (f)
            handle_free(f);
        *err = CUDA_ERROR_OUT_OF_MEMORY;
        return NULL;
    }
    if (k)
        f->info = *k;
    f->info.name = NULL;
    f->carveout = -1;
    f->module = m;
    f->us_per_wave = sim_us_of(name);
    f->next = m->functions;
    m->functions = f;
    return f;
}

/* JIT options (cuModuleLoadDataEx, cuLink*, cuLibraryLoadData): simgpu compiles nothing,
 * so it honours the log buffers (errors say why an image was refused; the info log, with
 * CU_JIT_LOG_VERBOSE, what was loaded), writes back the bytes logged and a wall time of 0,
 * and accepts every other known option. */
struct jit_log {
    char *info, *error;
    size_t info_cap, error_cap, info_len, error_len;
    void **values;
    int info_size_at, error_size_at, wall_at, verbose;
};

static CUresult jit_options(unsigned n, const CUjit_option *options, void **values, struct jit_log *log)
{
    memset(log, 0, sizeof *log);
    log->info_size_at = log->error_size_at = log->wall_at = -1;
    if (n && (!options || !values))
        return CUDA_ERROR_INVALID_VALUE;
    log->values = values;
    for (unsigned i = 0; i < n; i++) {
        uintptr_t v = (uintptr_t)values[i];
        switch (options[i]) {
        case CU_JIT_INFO_LOG_BUFFER: log->info = (char *)values[i]; break;
        case CU_JIT_ERROR_LOG_BUFFER: log->error = (char *)values[i]; break;
        case CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES: log->info_cap = (unsigned)v, log->info_size_at = (int)i; break;
        case CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES: log->error_cap = (unsigned)v, log->error_size_at = (int)i; break;
        case CU_JIT_WALL_TIME: log->wall_at = (int)i; break;
        case CU_JIT_LOG_VERBOSE: log->verbose = v != 0; break;
        default:
            if (options[i] < 0 || options[i] >= CU_JIT_NUM_OPTIONS)
                return CUDA_ERROR_INVALID_VALUE;
        }
    }
    if (!log->info)
        log->info_cap = 0;
    if (!log->error)
        log->error_cap = 0;
    return CUDA_SUCCESS;
}

static void jit_append(char *buf, size_t cap, size_t *len, const char *line)
{
    if (!buf || *len + 1 >= cap)
        return;
    int w = snprintf(buf + *len, cap - *len, "%s%s", *len ? "\n" : "", line);
    *len = w < 0 ? *len : *len + (size_t)w >= cap ? cap - 1 : *len + (size_t)w;
}

/* Write back what was logged (bytes including the NUL) and the wall time. */
static void jit_done(struct jit_log *log)
{
    if (log->info_size_at >= 0)
        log->values[log->info_size_at] = (void *)(uintptr_t)(log->info_len ? log->info_len + 1 : 0);
    if (log->error_size_at >= 0)
        log->values[log->error_size_at] = (void *)(uintptr_t)(log->error_len ? log->error_len + 1 : 0);
    if (log->wall_at >= 0) {
        float ms = 0;
        memcpy(&log->values[log->wall_at], &ms, sizeof ms);
    }
}

/* Read an image for a module or a link input, logging why it is refused. */
static CUresult read_image(const void *data, size_t size, int kind, const char *name, struct jit_log *log,
                           struct simgpu_image *img)
{
    char why[256];
    CUresult r = simgpu_image_read(data, size, kind, device_cc(), img, why, sizeof why);
    if (r != CUDA_SUCCESS && log) {
        char line[400];
        snprintf(line, sizeof line, "error   : %s%s%s", name ? name : "", name ? ": " : "", why[0] ? why : "bad image");
        jit_append(log->error, log->error_cap, &log->error_len, line);
    } else if (r == CUDA_SUCCESS && log && log->verbose) {
        char line[400];
        snprintf(line, sizeof line, "info    : simgpu: %s%s%zu kernel(s)%s, not compiled (simulated device)",
                 name ? name : "", name ? ": " : "", img->count, img->names_known ? "" : " (stand-in image)");
        jit_append(log->info, log->info_cap, &log->info_len, line);
    }
    return r;
}

/* A module's variables (cuModuleGetGlobal, cuLibraryGetGlobal) live in device memory of
 * their own from load to unload: one block, each variable at its section's alignment,
 * holding its initial bytes (zeros for .nv.global).  simgpu counts no device memory for a
 * module's code or data (a model: the driver does not document what loading costs). */
static CUresult module_globals(struct vgpu_module *m)
{
    const struct simgpu_image *img = &m->image;
    if (!img->nglobals)
        return CUDA_SUCCESS;
    uint64_t *at = malloc(img->nglobals * sizeof *at), size = 0;
    if (!at)
        return CUDA_ERROR_OUT_OF_MEMORY;
    for (size_t i = 0; i < img->nglobals; i++) {
        at[i] = size = round_up(size, img->globals[i].align);
        size += img->globals[i].size;
    }
    size = size ? size : 1;
    unsigned char *p = map_lazy(size);
    struct vgpu_ctx *c = current_ctx();
    if (!p || alloc_insert((struct alloc){(uint64_t)(uintptr_t)p, size, c ? c->dev : 0, A_MODULE, 0, NULL, NULL,
                                          NULL, 0, 0, 0})) {
        if (p)
            munmap(p, size);
        free(at);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (size_t i = 0; i < img->nglobals; i++)
        if (img->globals[i].init)
            memcpy(p + at[i], img->globals[i].init, img->globals[i].size);
    m->globals = (uint64_t)(uintptr_t)p;
    m->global_at = at;
    return CUDA_SUCCESS;
}

static CUresult module_new(CUmodule *out, const void *data, size_t size, struct jit_log *log)
{
    REQUIRE_INIT();
    if (!out || !data)
        return CUDA_ERROR_INVALID_VALUE;
    struct simgpu_image img;
    CUresult r = read_image(data, size, IMG_ANY, NULL, log, &img);
    if (log)
        jit_done(log);
    if (r != CUDA_SUCCESS)
        return r;
    struct vgpu_module *m = handle_new(K_MODULE);
    if (!m) {
        simgpu_image_free(&img);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->image = img;
    if ((r = module_globals(m)) != CUDA_SUCCESS) {
        simgpu_image_free(&m->image);
        handle_free(m);
        return r;
    }
    *out = m;
    return CUDA_SUCCESS;
}

/* A whole file, NUL-terminated (PTX is text); NULL with *err set. */
static void *read_file(const char *path, size_t *size, CUresult *err)
{
    FILE *f = path ? fopen(path, "rbe") : NULL;
    if (!f) {
        *err = path ? CUDA_ERROR_FILE_NOT_FOUND : CUDA_ERROR_INVALID_VALUE;
        return NULL;
    }
    char *d = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            char *n = realloc(d, cap = (cap ? cap * 2 : 65536));
            if (!n)
                break;
            d = n;
        }
        size_t got = fread(d + len, 1, cap - len - 1, f);
        len += got;
        if (!got)
            break;
    }
    int bad = ferror(f) || !d;
    fclose(f);
    if (bad) {
        free(d);
        *err = CUDA_ERROR_FILE_NOT_FOUND;
        return NULL;
    }
    d[len] = 0;
    *size = len;
    return d;
}

SIMGPU_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    return module_new(module, image, 0, NULL);
}

SIMGPU_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                          CUjit_option *options, void **optionValues)
{
    struct jit_log log;
    CUresult r = jit_options(numOptions, options, optionValues, &log);
    return r != CUDA_SUCCESS ? r : module_new(module, image, 0, &log);
}

SIMGPU_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    return cuModuleLoadData(module, fatCubin);
}

SIMGPU_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    REQUIRE_INIT();
    if (!fname)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r;
    size_t size;
    void *data = read_file(fname, &size, &r);
    if (!data)
        return r;
    r = module_new(module, data, size, NULL);
    free(data);
    return r;
}

static void module_free(struct vgpu_module *m)
{
    for (struct vgpu_function *f = m->functions, *next; f; f = next) {
        next = f->next;
        free(f->name);
        handle_free(f);
    }
    struct alloc a;
    if (m->globals && !alloc_remove(m->globals, 1u << A_MODULE, &a))
        alloc_drop(&a);
    free(m->global_at);
    simgpu_image_free(&m->image);
    handle_free(m);
}

SIMGPU_EXPORT CUresult cuModuleUnload(CUmodule m)
{
    REQUIRE_INIT();
    if (!handle_ok(m, K_MODULE))
        return CUDA_ERROR_INVALID_HANDLE;
    module_free(m);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule m, const char *name)
{
    REQUIRE_INIT();
    if (!hfunc || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(m, K_MODULE))
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult err = CUDA_SUCCESS;
    *hfunc = function_get(m, name, &err);
    return err;
}

/* A variable of the module's image: its address and its symbol's size (st_size).  An
 * image whose symbols simgpu cannot read (PTX, which it does not compile; a stand-in or
 * compressed image) holds none. */
static CUresult module_global(struct vgpu_module *m, const char *name, CUdeviceptr *dptr, size_t *bytes)
{
    const struct simgpu_global *g = simgpu_image_global(&m->image, name);
    if (!g)
        return CUDA_ERROR_NOT_FOUND;
    if (dptr)
        *dptr = m->globals + m->global_at[g - m->image.globals];
    if (bytes)
        *bytes = (size_t)g->size;
    return CUDA_SUCCESS;
}

/* cuda.h, cuModuleGetGlobal (_v2, CUDA 3.2): "Returns in *dptr and *bytes the base pointer
 * and size of the global of name name located in module hmod.  If no variable of that name
 * exists, cuModuleGetGlobal() returns CUDA_ERROR_NOT_FOUND.  One of the parameters dptr or
 * bytes (not both) can be NULL in which case it is ignored." */
SIMGPU_EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule m, const char *name)
{
    REQUIRE_INIT();
    if ((!dptr && !bytes) || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(m, K_MODULE))
        return CUDA_ERROR_INVALID_HANDLE;
    return module_global(m, name, dptr, bytes);
}

SIMGPU_EXPORT CUresult cuModuleGetFunctionCount(unsigned int *count, CUmodule m)
{
    REQUIRE_INIT();
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(m, K_MODULE))
        return CUDA_ERROR_INVALID_HANDLE;
    *count = (unsigned)m->image.count;   /* a stand-in image names none */
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuModuleEnumerateFunctions(CUfunction *functions, unsigned int numFunctions, CUmodule m)
{
    REQUIRE_INIT();
    if (!functions)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(m, K_MODULE))
        return CUDA_ERROR_INVALID_HANDLE;
    for (unsigned i = 0; i < numFunctions && i < m->image.count; i++) {
        CUresult err = CUDA_SUCCESS;
        if (!(functions[i] = function_get(m, m->image.kernels[i].name, &err)))
            return err;
    }
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuModuleGetLoadingMode(int *mode)
{
    REQUIRE_INIT();
    if (!mode)
        return CUDA_ERROR_INVALID_VALUE;
    *mode = 2;   /* CU_MODULE_LAZY_LOADING, the default since CUDA 12.2 */
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuFuncGetModule(CUmodule *hmod, CUfunction f)
{
    REQUIRE_INIT();
    if (!hmod)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    *hmod = f->module;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuFuncIsLoaded(int *state, CUfunction f)
{
    REQUIRE_INIT();
    if (!state)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    *state = 1;   /* CU_FUNCTION_LOADING_STATE_LOADED */
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuFuncLoad(CUfunction f)
{
    REQUIRE_INIT();
    return handle_ok(f, K_FUNCTION) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

SIMGPU_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                         void **jitOptionsValues, unsigned int numJitOptions,
                                         void *libraryOptions, void **libraryOptionValues,
                                         unsigned int numLibraryOptions)
{
    (void)libraryOptions, (void)libraryOptionValues, (void)numLibraryOptions;
    REQUIRE_INIT();
    if (!library || !code)
        return CUDA_ERROR_INVALID_VALUE;
    struct jit_log log;
    CUresult r = jit_options(numJitOptions, jitOptions, jitOptionsValues, &log);
    if (r != CUDA_SUCCESS)
        return r;
    struct vgpu_library *l = handle_new(K_LIBRARY);
    if (!l)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if ((r = module_new(&l->module, code, 0, &log)) != CUDA_SUCCESS) {
        handle_free(l);
        return r;
    }
    l->module->library = l;
    *library = l;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                             void **jitOptionsValues, unsigned int numJitOptions,
                                             void *libraryOptions, void **libraryOptionValues,
                                             unsigned int numLibraryOptions)
{
    REQUIRE_INIT();
    CUresult r;
    size_t size;
    void *data = read_file(fileName, &size, &r);
    if (!data)
        return r;
    r = cuLibraryLoadData(library, data, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                          libraryOptionValues, numLibraryOptions);
    free(data);
    return r;
}

SIMGPU_EXPORT CUresult cuLibraryUnload(CUlibrary l)
{
    REQUIRE_INIT();
    if (!handle_ok(l, K_LIBRARY))
        return CUDA_ERROR_INVALID_HANDLE;
    module_free(l->module);
    handle_free(l);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary l, const char *name)
{
    REQUIRE_INIT();
    if (!pKernel || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(l, K_LIBRARY))
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult err = CUDA_SUCCESS;
    *pKernel = function_get(l->module, name, &err);
    return err;
}

SIMGPU_EXPORT CUresult cuLibraryGetKernelCount(unsigned int *count, CUlibrary l)
{
    REQUIRE_INIT();
    if (!handle_ok(l, K_LIBRARY))
        return CUDA_ERROR_INVALID_HANDLE;
    return cuModuleGetFunctionCount(count, l->module);
}

SIMGPU_EXPORT CUresult cuLibraryGetModule(CUmodule *pMod, CUlibrary l)
{
    REQUIRE_INIT();
    if (!pMod)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(l, K_LIBRARY))
        return CUDA_ERROR_INVALID_HANDLE;
    *pMod = l->module;
    return CUDA_SUCCESS;
}

/* cuda.h, cuLibraryGetGlobal: "the base pointer and size of the global with name name for
 * the requested library library and the current context"; CUDA_ERROR_NOT_FOUND if there
 * is none; dptr or bytes (not both) may be NULL.  (simgpu's library is one module for
 * every context: one copy of its variables.) */
SIMGPU_EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary l, const char *name)
{
    REQUIRE_CTX(c);
    (void)c;
    if ((!dptr && !bytes) || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(l, K_LIBRARY))
        return CUDA_ERROR_INVALID_HANDLE;
    return module_global(l->module, name, dptr, bytes);
}

/* cuda.h, cuKernelGetLibrary: "Returns in pLib the handle of the library for the requested
 * kernel".  A function of a module loaded with cuModuleLoad* is no library's kernel:
 * CUDA_ERROR_INVALID_HANDLE. */
SIMGPU_EXPORT CUresult cuKernelGetLibrary(CUlibrary *pLib, CUkernel k)
{
    REQUIRE_INIT();
    if (!pLib)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(k, K_FUNCTION) || !k->module->library)
        return CUDA_ERROR_INVALID_HANDLE;
    *pLib = k->module->library;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel k)
{
    REQUIRE_INIT();
    if (!pFunc)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(k, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    *pFunc = k;   /* one object serves as kernel and function */
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuFuncGetName(const char **name, CUfunction f)
{
    REQUIRE_INIT();
    if (!name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    *name = f->name;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuKernelGetName(const char **name, CUkernel k) { return cuFuncGetName(name, k); }

/* === function attributes and occupancy ===
 * Resources come from the image: registers, local (frame) and static shared memory and
 * the thread limit that a cubin records; PTX is not compiled here, so a kernel loaded as
 * PTX reports no registers or local memory.  The limits are the device's: a block's
 * threads are bounded by its registers (allocated per warp in units of 256) and by
 * 1024 or the kernel's .maxntid; occupancy follows the same per-SM limits (threads,
 * blocks, registers, shared memory in 128-byte units plus the 1 KiB the driver reserves
 * per block), as NVIDIA's occupancy calculator computes them. */

struct sm_limits { int threads, blocks, regs, smem, smem_optin, smem_reserved; };

static struct sm_limits sm_limits(void)
{
    const struct simgpu_profile *p = simgpu_profile();
    return (struct sm_limits){p->threads_per_sm, p->blocks_per_sm, 65536, p->smem_per_sm, p->smem_per_block_optin, 1024};
}

static int regs_per_warp(const struct vgpu_function *f) { return (f->info.regs * 32 + 255) / 256 * 256; }

static int func_max_threads(const struct vgpu_function *f)
{
    int t = f->info.max_threads ? f->info.max_threads : 1024;
    if (f->info.regs) {
        int warps = 65536 / regs_per_warp(f);
        if (warps * 32 < t)
            t = warps * 32;
    }
    return t;
}

SIMGPU_EXPORT CUresult cuFuncGetAttribute(int *pi, int attrib, CUfunction f)
{
    REQUIRE_INIT();
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    struct sm_limits lim = sm_limits();
    int cc = device_cc();
    switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = func_max_threads(f); break;
    case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: *pi = f->info.shared_bytes; break;
    case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: *pi = f->info.local_bytes; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *pi = f->info.regs; break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION:   /* the architecture the code was written for */
        *pi = f->module && f->module->image.arch ? f->module->image.arch : cc;
        break;
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION:   /* the SASS that runs: the cubin's, or JIT-compiled for this device */
        *pi = f->module && f->module->image.arch && !f->module->image.ptx_version ? f->module->image.arch : cc;
        break;
    case CU_FUNC_ATTRIBUTE_CACHE_MODE_CA: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        *pi = f->max_dynamic_shared ? f->max_dynamic_shared : 49152 - f->info.shared_bytes;
        break;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: *pi = f->carveout; break;
    case CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH:
        *pi = f->cluster[attrib - CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH];
        break;
    case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: *pi = f->non_portable_cluster; break;
    case CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE: *pi = f->cluster_policy; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    (void)lim;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuFuncSetAttribute(CUfunction f, int attrib, int value)
{
    REQUIRE_INIT();
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    struct sm_limits lim = sm_limits();
    int cluster_ok = simgpu_profile()->cc_major >= 9;
    switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        /* static + dynamic may not pass the opt-in limit */
        if (value < 0 || value + f->info.shared_bytes > lim.smem_optin)
            return CUDA_ERROR_INVALID_VALUE;
        f->max_dynamic_shared = value;
        return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
        if (value < -1 || value > 100)
            return CUDA_ERROR_INVALID_VALUE;
        f->carveout = value;
        return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH:
        if (!cluster_ok || value < 0)
            return CUDA_ERROR_NOT_SUPPORTED;
        f->cluster[attrib - CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH] = value;
        return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED:
        if (!cluster_ok)
            return CUDA_ERROR_NOT_SUPPORTED;
        f->non_portable_cluster = value != 0;
        return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE:
        if (!cluster_ok)
            return CUDA_ERROR_NOT_SUPPORTED;
        f->cluster_policy = value;
        return CUDA_SUCCESS;
    default:
        return attrib >= 0 && attrib < CU_FUNC_ATTRIBUTE_MAX ? CUDA_ERROR_INVALID_VALUE   /* read-only */
                                                             : CUDA_ERROR_INVALID_VALUE;
    }
}

SIMGPU_EXPORT CUresult cuFuncSetCacheConfig(CUfunction f, int config)
{
    REQUIRE_INIT();
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    if (config < 0 || config > 3)   /* CU_FUNC_CACHE_PREFER_NONE .. _EQUAL */
        return CUDA_ERROR_INVALID_VALUE;
    f->cache_config = config;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuKernelGetAttribute(int *pi, int attrib, CUkernel k, CUdevice dev)
{
    REQUIRE_INIT();
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    return cuFuncGetAttribute(pi, attrib, k);
}

SIMGPU_EXPORT CUresult cuKernelSetAttribute(int attrib, int val, CUkernel k, CUdevice dev)
{
    REQUIRE_INIT();
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    return cuFuncSetAttribute(k, attrib, val);
}

/* Blocks of `block` threads using `smem` dynamic shared memory that fit on one SM. */
static int blocks_per_sm(const struct vgpu_function *f, int block, size_t smem)
{
    struct sm_limits lim = sm_limits();
    if (block <= 0 || block > func_max_threads(f) ||
        smem + (size_t)f->info.shared_bytes > (size_t)lim.smem_optin)
        return 0;
    int warps = (block + 31) / 32;
    int n = lim.blocks;
    if (lim.threads / (warps * 32) < n)
        n = lim.threads / (warps * 32);
    if (f->info.regs) {
        int by_regs = lim.regs / (regs_per_warp(f) * warps);
        if (by_regs < n)
            n = by_regs;
    }
    size_t per_block = (smem + (size_t)f->info.shared_bytes + 127) / 128 * 128 + (size_t)lim.smem_reserved;
    if ((size_t)lim.smem / per_block < (size_t)n)
        n = (int)((size_t)lim.smem / per_block);
    return n;
}

SIMGPU_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *numBlocks, CUfunction f, int blockSize,
                                                                            size_t dynamicSMemSize, unsigned int flags)
{
    REQUIRE_INIT();
    if (!numBlocks || flags > CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    *numBlocks = blocks_per_sm(f, blockSize, dynamicSMemSize);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction f, int blockSize,
                                                                   size_t dynamicSMemSize)
{
    return cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(numBlocks, f, blockSize, dynamicSMemSize, 0);
}

/* The block size (a multiple of the warp size, up to blockSizeLimit) with the most
 * resident threads per SM; the smallest grid that fills the device with it. */
SIMGPU_EXPORT CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int *minGridSize, int *blockSize, CUfunction f,
                                                                 CUoccupancyB2DSize smemOf, size_t dynamicSMemSize,
                                                                 int blockSizeLimit, unsigned int flags)
{
    REQUIRE_INIT();
    if (!minGridSize || !blockSize || flags > CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    int limit = func_max_threads(f);
    if (blockSizeLimit > 0 && blockSizeLimit < limit)
        limit = blockSizeLimit;
    int best = 0, best_blocks = 0;
    for (int b = (limit + 31) / 32 * 32; b > 0; b -= 32) {
        int size = b > limit ? limit : b;
        int n = blocks_per_sm(f, size, smemOf ? smemOf(size) : dynamicSMemSize);
        if (n * size > best_blocks * best)
            best = size, best_blocks = n;
    }
    *blockSize = best;
    *minGridSize = best_blocks * simgpu_profile()->sm_count;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize, CUfunction f,
                                                        CUoccupancyB2DSize smemOf, size_t dynamicSMemSize,
                                                        int blockSizeLimit)
{
    return cuOccupancyMaxPotentialBlockSizeWithFlags(minGridSize, blockSize, f, smemOf, dynamicSMemSize,
                                                     blockSizeLimit, 0);
}

SIMGPU_EXPORT CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t *dynamicSmemSize, CUfunction f, int numBlocks,
                                                               int blockSize)
{
    REQUIRE_INIT();
    if (!dynamicSmemSize || numBlocks <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    if (blocks_per_sm(f, blockSize, 0) < numBlocks) {
        *dynamicSmemSize = 0;
        return CUDA_SUCCESS;
    }
    struct sm_limits lim = sm_limits();
    size_t per_block = (size_t)lim.smem / (size_t)numBlocks;
    size_t used = (size_t)f->info.shared_bytes + (size_t)lim.smem_reserved;
    size_t avail = per_block > used ? (per_block - used) / 128 * 128 : 0;
    size_t optin = (size_t)lim.smem_optin - (size_t)f->info.shared_bytes;
    *dynamicSmemSize = avail < optin ? avail : optin;
    return CUDA_SUCCESS;
}

/* Clusters (compute capability 9.0): at most 8 blocks portably, 16 when the kernel allows
 * non-portable sizes; as many clusters fit at once as blocks fit on the device's GPCs,
 * modelled here as the device's SMs in groups of the cluster size. */
static int cluster_blocks(const CUlaunchConfig *c)
{
    for (unsigned i = 0; c->attrs && i < c->numAttrs; i++) {
        const unsigned char *a = (const unsigned char *)c->attrs + (size_t)i * 72;   /* sizeof(CUlaunchAttribute) */
        int id;
        memcpy(&id, a, sizeof id);
        if (id == 4) {   /* CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: value.clusterDim at offset 8 */
            unsigned d[3];
            memcpy(d, a + 8, sizeof d);
            return (int)(d[0] * d[1] * d[2]);
        }
    }
    return 1;
}

SIMGPU_EXPORT CUresult cuOccupancyMaxPotentialClusterSize(int *clusterSize, CUfunction f, const CUlaunchConfig *config)
{
    REQUIRE_INIT();
    if (!clusterSize || !config)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    if (simgpu_profile()->cc_major < 9)
        return CUDA_ERROR_NOT_SUPPORTED;
    *clusterSize = f->non_portable_cluster ? 16 : 8;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuOccupancyMaxActiveClusters(int *numClusters, CUfunction f, const CUlaunchConfig *config)
{
    REQUIRE_INIT();
    if (!numClusters || !config)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    if (simgpu_profile()->cc_major < 9)
        return CUDA_ERROR_NOT_SUPPORTED;
    int size = cluster_blocks(config), limit = f->non_portable_cluster ? 16 : 8;
    if (size > limit)
        return CUDA_ERROR_INVALID_VALUE;
    int per_sm = blocks_per_sm(f, (int)(config->blockDimX * config->blockDimY * config->blockDimZ),
                               config->sharedMemBytes);
    *numClusters = per_sm * simgpu_profile()->sm_count / size;
    return CUDA_SUCCESS;
}

/* === the linker (cuLink*) ===
 * Inputs are read as their declared type (simgpu/image.h) and their kernels gathered;
 * cuLinkComplete writes them as one cubin (owned by the link state until cuLinkDestroy)
 * that cuModuleLoadData loads.  No code is compiled or linked: unresolved externals are
 * not detected; a kernel defined by two inputs is an error, as in nvlink. */

static CUresult link_log_error(struct vgpu_link *l, const char *line)
{
    struct jit_log *log = l->options;
    jit_append(log->error, log->error_cap, &log->error_len, line);
    jit_done(log);
    return CUDA_ERROR_INVALID_IMAGE;
}

SIMGPU_EXPORT CUresult cuLinkCreate_v2(unsigned int numOptions, CUjit_option *options, void **optionValues,
                                       CUlinkState *stateOut)
{
    REQUIRE_CTX(c);
    (void)c;
    if (!stateOut)
        return CUDA_ERROR_INVALID_VALUE;
    struct jit_log *log = malloc(sizeof *log);
    if (!log)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = jit_options(numOptions, options, optionValues, log);
    if (r != CUDA_SUCCESS) {
        free(log);
        return r;
    }
    struct vgpu_link *l = handle_new(K_LINK);
    if (!l) {
        free(log);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    l->options = log;
    l->image.names_known = 1;
    jit_done(log);
    *stateOut = l;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuLinkAddData_v2(CUlinkState l, CUjitInputType type, void *data, size_t size, const char *name,
                                        unsigned int numOptions, CUjit_option *options, void **optionValues)
{
    REQUIRE_INIT();
    if (!handle_ok(l, K_LINK))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!data || !size || l->cubin)
        return CUDA_ERROR_INVALID_VALUE;
    struct jit_log local;
    CUresult r = jit_options(numOptions, options, optionValues, &local);   /* checked; the link's logs are used */
    if (r != CUDA_SUCCESS)
        return r;
    struct simgpu_image img;
    if ((r = read_image(data, size, type, name, l->options, &img)) != CUDA_SUCCESS) {
        jit_done(l->options);
        return r;
    }
    char why[256] = "";
    r = simgpu_image_merge(&l->image, &img, why, sizeof why);
    simgpu_image_free(&img);
    if (r != CUDA_SUCCESS) {
        char line[400];
        snprintf(line, sizeof line, "error   : %s: %s", name ? name : "input", why);
        return link_log_error(l, line);
    }
    l->inputs++;
    jit_done(l->options);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuLinkAddFile_v2(CUlinkState l, CUjitInputType type, const char *path, unsigned int numOptions,
                                        CUjit_option *options, void **optionValues)
{
    REQUIRE_INIT();
    if (!handle_ok(l, K_LINK))
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult r;
    size_t size;
    void *data = read_file(path, &size, &r);
    if (!data)
        return r;
    r = size ? cuLinkAddData_v2(l, type, data, size, path, numOptions, options, optionValues) : CUDA_ERROR_INVALID_IMAGE;
    free(data);
    return r;
}

SIMGPU_EXPORT CUresult cuLinkComplete(CUlinkState l, void **cubinOut, size_t *sizeOut)
{
    REQUIRE_INIT();
    if (!handle_ok(l, K_LINK))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!cubinOut || !sizeOut)
        return CUDA_ERROR_INVALID_VALUE;
    if (!l->cubin) {
        if (!l->inputs)
            return link_log_error(l, "error   : no input files");
        if (!(l->cubin = simgpu_image_write(&l->image, device_cc(), &l->cubin_size)))
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct jit_log *log = l->options;
    if (log->verbose) {
        char line[200];
        snprintf(line, sizeof line, "info    : simgpu: linked %zu kernel(s) from %d input(s) for sm_%d", l->image.count,
                 l->inputs, device_cc());
        jit_append(log->info, log->info_cap, &log->info_len, line);
    }
    jit_done(log);
    *cubinOut = l->cubin;
    *sizeOut = l->cubin_size;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuLinkDestroy(CUlinkState l)
{
    REQUIRE_INIT();
    if (!handle_ok(l, K_LINK))
        return CUDA_ERROR_INVALID_HANDLE;
    free(l->cubin);
    free(l->options);
    simgpu_image_free(&l->image);
    handle_free(l);
    return CUDA_SUCCESS;
}

/* === launch === */

static uint64_t kernel_ns(int dev, const struct vgpu_function *f, uint64_t blocks)
{
    uint64_t sms = (uint64_t)simgpu_view_sm_count(dev);   /* a wave: as many blocks as SMs */
    uint64_t waves = (blocks + sms - 1) / sms;
    return waves * f->us_per_wave * 1000ull;
}

static CUresult graph_add_kernel(struct vgpu_graph *g, struct vgpu_function *f, uint64_t blocks);
static struct vgpu_graph_node *graph_node_new(struct vgpu_graph *g, CUgraphNodeType type);
static void graph_drop_node(struct vgpu_graph_node *n);
static struct kernel_params *kernel_params_new(const CUDA_KERNEL_NODE_PARAMS *p, struct vgpu_function *f);

/* Queue `dur_ns` on the stream's device, blocking while the stream's queue is full. */
static void stream_enqueue(struct vgpu_stream *s, uint64_t dur_ns)
{
    pthread_mutex_lock(&s->lock);
    if (s->pending_count == SIMGPU_QUEUE_DEPTH) {
        uint64_t oldest = s->pending[s->pending_head];
        if (oldest > simgpu_now_ns())
            simgpu_sleep_until(oldest);   /* a full queue blocks like a real one */
        s->pending_head = (s->pending_head + 1) % SIMGPU_QUEUE_DEPTH;
        s->pending_count--;
    }
    uint64_t end = simgpu_enqueue(s->ctx->dev, dur_ns);
    s->pending[(s->pending_head + s->pending_count++) % SIMGPU_QUEUE_DEPTH] = end;
    __atomic_store_n(&s->last_end, end, __ATOMIC_RELEASE);
    struct vgpu_ctx *c = s->ctx;
    uint64_t prev = __atomic_load_n(&c->last_end, __ATOMIC_RELAXED);
    while (prev < end && !__atomic_compare_exchange_n(&c->last_end, &prev, end, 1, __ATOMIC_RELEASE,
                                                      __ATOMIC_RELAXED))
        ;
    pthread_mutex_unlock(&s->lock);
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                       unsigned bz, unsigned shmem, void **kernelParams, void **extra, CUstream h)
{
    REQUIRE_INIT();
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    uint64_t blocks = (uint64_t)gx * gy * gz;
    if (s->capture) {   /* a kernel node, with the launch's parameters (cuGraphKernelNodeGetParams) */
        CUDA_KERNEL_NODE_PARAMS p = {f, gx, gy, gz, bx, by, bz, shmem, kernelParams, extra, NULL, NULL};
        struct vgpu_graph_node *n = graph_node_new(s->capture, CU_GRAPH_NODE_TYPE_KERNEL);
        CUresult r = n ? graph_add_kernel(s->capture, f, blocks) : CUDA_ERROR_OUT_OF_MEMORY;
        if (r == CUDA_SUCCESS && !(n->kp = kernel_params_new(&p, f)))
            r = CUDA_ERROR_OUT_OF_MEMORY;
        if (n && r != CUDA_SUCCESS)
            graph_drop_node(n);
        else if (n)
            s->capture_last = n;
        return r;
    }
    stream_enqueue(s, kernel_ns(s->ctx->dev, f, blocks));
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                      unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                      unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                      void **kernelParams, void **extra)
{
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, kernelParams,
                  extra, hStream);
}

SIMGPU_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                           unsigned int gridDimZ, unsigned int blockDimX,
                                           unsigned int blockDimY, unsigned int blockDimZ,
                                           unsigned int sharedMemBytes, CUstream hStream,
                                           void **kernelParams, void **extra)
{
    PER_THREAD(cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                              sharedMemBytes, hStream, kernelParams, extra));
}

SIMGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                        void **extra)
{
    REQUIRE_INIT();
    if (!config)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
                  config->blockDimY, config->blockDimZ, config->sharedMemBytes, kernelParams, extra,
                  config->hStream);
}

SIMGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                             void **kernelParams, void **extra)
{
    PER_THREAD(cuLaunchKernelEx(config, f, kernelParams, extra));
}

SIMGPU_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                 unsigned int gridDimZ, unsigned int blockDimX,
                                                 unsigned int blockDimY, unsigned int blockDimZ,
                                                 unsigned int sharedMemBytes, CUstream hStream,
                                                 void **kernelParams)
{
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, kernelParams,
                  NULL, hStream);
}

SIMGPU_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX,
                                                      unsigned int gridDimY, unsigned int gridDimZ,
                                                      unsigned int blockDimX, unsigned int blockDimY,
                                                      unsigned int blockDimZ, unsigned int sharedMemBytes,
                                                      CUstream hStream, void **kernelParams)
{
    PER_THREAD(cuLaunchCooperativeKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                         sharedMemBytes, hStream, kernelParams));
}

/* === tensor maps ===
 * cuda.h, cuTensorMapEncodeTiled: "Tensor map objects are only supported on devices of
 * compute capability 9.0 or higher" (others: CUDA_ERROR_NOT_SUPPORTED, the current
 * context's device deciding), and "a tensor map object is an opaque value": simgpu writes
 * its own encoding of the arguments.  Each documented requirement on the arguments is
 * checked (CUDA_ERROR_INVALID_VALUE): the map 64-byte aligned; a known data type; rank 1
 * to 5 (at least 3 when interleaved); globalAddress 16-byte aligned (32 with
 * CU_TENSOR_MAP_INTERLEAVE_32B or the 16-byte-aligned packed types); each globalDim
 * non-zero and at most 2^32 (a multiple of 128 for the 16-byte-aligned packed types, of 2
 * for 16U4_ALIGN8B); each globalStride a multiple of 16 (32 as for the address) below 2^40;
 * each boxDim 1 to 256, the inner box a multiple of 16 bytes without interleave, 128
 * elements for the 16-byte-aligned packed types; each elementStride 1 to 8; known
 * interleave, swizzle, L2 promotion and fill values; INTERLEAVE_32B only with SWIZZLE_32B;
 * a swizzled inner box no wider than its span; the swizzles each packed type allows;
 * 16U6_ALIGN16B without interleave; the NaN fill for floating-point types only. */

/* Memory per element in half-bytes (the packed types: 16 values in 8 or 16 bytes). */
static unsigned tensor_nibbles(unsigned t)
{
    static const unsigned nibbles[] = {2, 4, 8, 8, 16, 16, 4, 8, 16, 4, 8, 8, 8, 1, 2, 2};
    return t < sizeof nibbles / sizeof nibbles[0] ? nibbles[t] : 0;
}

/* tensorMap is a CUtensorMap *; taken as void * so that its alignment is checked, not assumed. */
SIMGPU_EXPORT CUresult cuTensorMapEncodeTiled(void *tensorMap, CUtensorMapDataType tensorDataType,
                                              uint32_t tensorRank, void *globalAddress, const cuuint64_t *globalDim,
                                              const cuuint64_t *globalStrides, const uint32_t *boxDim,
                                              const uint32_t *elementStrides, CUtensorMapInterleave interleave,
                                              CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion,
                                              CUtensorMapFloatOOBfill oobFill)
{
    REQUIRE_CTX(c);
    (void)c;
    unsigned t = (unsigned)tensorDataType, il = (unsigned)interleave, sw = (unsigned)swizzle;
    int packed16 = t == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B || t == CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B;
    int packed = packed16 || t == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B;
    unsigned align32 = il == CU_TENSOR_MAP_INTERLEAVE_32B || packed16 ? 32 : 16;
    if (!tensorMap || (uintptr_t)tensorMap % 64 || !tensor_nibbles(t) || !tensorRank || tensorRank > 5 ||
        il > CU_TENSOR_MAP_INTERLEAVE_32B || (il != CU_TENSOR_MAP_INTERLEAVE_NONE && tensorRank < 3) ||
        sw > CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B || (unsigned)l2Promotion > CU_TENSOR_MAP_L2_PROMOTION_L2_256B ||
        (unsigned)oobFill > CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA ||
        (uintptr_t)globalAddress % align32 || !globalDim || !boxDim || !elementStrides ||
        (tensorRank > 1 && !globalStrides))
        return CUDA_ERROR_INVALID_VALUE;
    for (uint32_t i = 0; i < tensorRank; i++)
        if (!globalDim[i] || globalDim[i] > (1ull << 32) || !boxDim[i] || boxDim[i] > 256 || !elementStrides[i] ||
            elementStrides[i] > 8 || (i + 1 < tensorRank && (globalStrides[i] % align32 || globalStrides[i] >= (1ull << 40))))
            return CUDA_ERROR_INVALID_VALUE;
    uint64_t inner = (uint64_t)boxDim[0] * tensor_nibbles(t) / 2;   /* bytes of the box's inner dimension */
    static const unsigned span[] = {0, 32, 64, 128, 128, 128, 128};
    if ((packed16 && (globalDim[0] % 128 || boxDim[0] != 128)) ||
        (t == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B && globalDim[0] % 2) ||
        (il == CU_TENSOR_MAP_INTERLEAVE_NONE && inner % 16) ||
        (il == CU_TENSOR_MAP_INTERLEAVE_32B && sw != CU_TENSOR_MAP_SWIZZLE_32B) ||
        (il == CU_TENSOR_MAP_INTERLEAVE_NONE && sw != CU_TENSOR_MAP_SWIZZLE_NONE && inner > span[sw]) ||
        (t == CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B &&
         (il != CU_TENSOR_MAP_INTERLEAVE_NONE ||
          (sw != CU_TENSOR_MAP_SWIZZLE_NONE && sw != CU_TENSOR_MAP_SWIZZLE_128B &&
           sw != CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B && sw != CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B))) ||
        (t == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B && sw != CU_TENSOR_MAP_SWIZZLE_NONE &&
         sw != CU_TENSOR_MAP_SWIZZLE_128B && sw != CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B))
        return CUDA_ERROR_INVALID_VALUE;
    int floating = t == CU_TENSOR_MAP_DATA_TYPE_FLOAT16 || t == CU_TENSOR_MAP_DATA_TYPE_FLOAT32 ||
                   t == CU_TENSOR_MAP_DATA_TYPE_FLOAT64 || t == CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 ||
                   t == CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ || t == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32 ||
                   t == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ;
    if (oobFill == CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA && (!floating || packed))
        return CUDA_ERROR_INVALID_VALUE;
    if (simgpu_profile()->cc_major < 9)
        return CUDA_ERROR_NOT_SUPPORTED;
    /* simgpu's encoding: address; the enums and rank; dims; strides; box and element strides */
    uint64_t *o = tensorMap;
    memset(o, 0, sizeof(CUtensorMap));
    o[0] = (uint64_t)(uintptr_t)globalAddress;
    o[1] = t | (uint64_t)tensorRank << 8 | (uint64_t)il << 12 | (uint64_t)sw << 16 | (uint64_t)l2Promotion << 20 |
           (uint64_t)oobFill << 24;
    for (uint32_t i = 0; i < tensorRank; i++) {
        o[2 + i] = globalDim[i];
        if (i + 1 < tensorRank)
            o[7 + i] = globalStrides[i];
        o[11] |= (uint64_t)(boxDim[i] - 1) << (8 * i);
        o[12] |= (uint64_t)(elementStrides[i] - 1) << (4 * i);
    }
    return CUDA_SUCCESS;
}

/* === graphs and stream capture ===
 * A graph is a list of kernels; on the serial timeline it costs their summed time. */

/* A new node of graph g, kept in its list (cuGraphGetNodes); NULL when out of memory.  Made
 * before the work it stands for, and dropped (graph_drop_node) when that work fails. */
static struct vgpu_graph_node *graph_node_new(struct vgpu_graph *g, CUgraphNodeType type)
{
    if (g->nall == g->all_cap) {
        size_t cap = g->all_cap ? g->all_cap * 2 : 16;
        struct vgpu_graph_node **all = realloc(g->all, cap * sizeof *all);
        if (!all)
            return NULL;
        g->all = all;
        g->all_cap = cap;
    }
    struct vgpu_graph_node *n = handle_new(K_GRAPH_NODE);
    if (!n)
        return NULL;
    n->graph = g;
    n->type = type;
    g->all[g->nall++] = n;
    return n;
}

static void graph_drop_node(struct vgpu_graph_node *n)
{
    struct vgpu_graph *g = n->graph;
    if (g->nall && g->all[g->nall - 1] == n)
        g->nall--;
    free(n->kp);
    handle_free(n);
}

static CUresult graph_add_kernel(struct vgpu_graph *g, struct vgpu_function *f, uint64_t blocks)
{
    if (g->count == g->cap) {
        size_t cap = g->cap ? g->cap * 2 : 16;
        struct kernel_node *n = realloc(g->nodes, cap * sizeof *n);
        if (!n)
            return CUDA_ERROR_OUT_OF_MEMORY;
        g->nodes = n;
        g->cap = cap;
    }
    g->nodes[g->count++] = (struct kernel_node){f, blocks};
    return CUDA_SUCCESS;
}

static void graph_mem_unref_locked(struct graph_mem *m);
static pthread_mutex_t graph_mem_lock;

static void graph_free(struct vgpu_graph *g)
{
    pthread_mutex_lock(&graph_mem_lock);
    for (size_t i = 0; i < g->nmem; i++)
        graph_mem_unref_locked(g->mem[i]);   /* a live allocation stays until freed */
    pthread_mutex_unlock(&graph_mem_lock);
    free(g->mem);
    free(g->nodes);
    for (size_t i = 0; i < g->nall; i++) {
        free(g->all[i]->kp);
        handle_free(g->all[i]);
    }
    free(g->all);
    handle_free(g);
}

/* === graphs: memory nodes ===
 * As cuGraphAddMemAllocNode, cuGraphLaunch and cuDeviceGraphMemTrim document them: an
 * allocation node gets its address when it is added (fixed across launches); its memory
 * is allocated when the graph is launched, from a per-device graph memory reserve of the
 * process, and freed by a free node of the same graph, by cuMemFree/cuMemFreeAsync, or by
 * the next launch of a graph instantiated with AUTO_FREE_ON_LAUNCH.  Relaunching a graph
 * whose allocations are still live fails with CUDA_ERROR_INVALID_VALUE.  Freed graph
 * memory stays in the reserve (also when graphs are destroyed) until cuDeviceGraphMemTrim.
 * The reserve counts as this process's device memory.
 * Model, not measured: USED is the footprint of the live allocations; an allocation freed
 * inside the graph is live only while the launch runs, so it only raises the reserve (to
 * the launch's peak) and the high watermarks; the reserve grows and is trimmed in
 * POOL_CHUNK units.  Free nodes for another graph's allocations are not supported. */

struct graph_mem {
    uint64_t dptr, size, footprint;
    int dev;
    int live;                    /* allocated by a launch, not freed since */
    int freed_in_graph;          /* the owning graph has a free node for it */
    int refs;                    /* the owning graph and its executable graph */
    struct vgpu_graph_exec *exec;   /* the one executable graph of its graph, if any */
    CUmemPoolProps props;
};

static pthread_mutex_t graph_mem_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    uint64_t used, used_high, reserved, reserved_high;
} graph_pool[SIMGPU_MAX_DEVICES];   /* under graph_mem_lock */

static void graph_pool_sub_locked(int dev, uint64_t bytes)
{
    graph_pool[dev].used = graph_pool[dev].used >= bytes ? graph_pool[dev].used - bytes : 0;
}

/* Under graph_mem_lock.  Free the record (and its address) once nothing refers to it. */
static void graph_mem_unref_locked(struct graph_mem *m)
{
    if (--m->refs > 0 || m->live)
        return;
    struct alloc a;
    if (alloc_remove(m->dptr, 1u << A_GRAPH, &a) == 0)
        munmap((void *)(uintptr_t)a.base, a.size);
    free(m);
}

/* cuMemFree / cuMemFreeAsync of a graph allocation: CUDA_ERROR_NOT_FOUND if `ptr` is none. */
static CUresult graph_mem_free(uint64_t ptr)
{
    struct alloc a;
    if (!alloc_find(ptr, 1, &a) || a.kind != A_GRAPH || a.base != ptr)
        return CUDA_ERROR_NOT_FOUND;
    struct graph_mem *m = a.graph_mem;
    pthread_mutex_lock(&graph_mem_lock);
    CUresult r = CUDA_ERROR_INVALID_VALUE;   /* not allocated now, or the graph frees it */
    if (m->live && !m->freed_in_graph) {
        m->live = 0;
        graph_pool_sub_locked(m->dev, m->footprint);
        m->refs++;
        graph_mem_unref_locked(m);   /* frees it if its graph is gone */
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&graph_mem_lock);
    return r;
}

static CUresult graph_add_mem(struct vgpu_graph *g, struct graph_mem *m)
{
    if (g->nmem == g->mem_cap) {
        size_t cap = g->mem_cap ? g->mem_cap * 2 : 8;
        struct graph_mem **n = realloc(g->mem, cap * sizeof *n);
        if (!n)
            return CUDA_ERROR_OUT_OF_MEMORY;
        g->mem = n;
        g->mem_cap = cap;
    }
    g->mem[g->nmem++] = m;
    return CUDA_SUCCESS;
}

/* An allocation node of `size` bytes on the device of `props` in graph `g`. */
static CUresult graph_new_alloc(struct vgpu_graph *g, const CUmemPoolProps *props, uint64_t size,
                                struct graph_mem **out)
{
    int dev;
    if (props->allocType != CU_MEM_ALLOCATION_TYPE_PINNED || props->handleTypes || !size)
        return CUDA_ERROR_INVALID_VALUE;   /* documented: no IPC for graph allocations */
    CUresult r = mem_location(&props->location, &dev);
    if (r != CUDA_SUCCESS)
        return r;
    if (dev == HOST_MEMORY)
        return CUDA_ERROR_NOT_SUPPORTED;   /* simgpu: graph allocations live on a device */
    if (size > (1ull << 56))
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct graph_mem *m = calloc(1, sizeof *m);
    void *va = m ? map_lazy(size) : NULL;
    if (!va) {
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *m = (struct graph_mem){.dptr = (uint64_t)(uintptr_t)va, .size = size,
                            .footprint = vgpu_alloc_footprint(size), .dev = dev, .refs = 1,
                            .props = *props};
    struct alloc a = {m->dptr, size, dev, A_GRAPH, 0, NULL, NULL, m, 0, 0, 0};
    if (alloc_insert(a) || graph_add_mem(g, m) != CUDA_SUCCESS) {
        struct alloc gone;
        alloc_remove(m->dptr, 1u << A_GRAPH, &gone);
        munmap(va, size);
        free(m);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = m;
    return CUDA_SUCCESS;
}

/* A free node in `g` for `dptr`, which must be one of g's allocations. */
static CUresult graph_new_free(struct vgpu_graph *g, uint64_t dptr, struct graph_mem **out)
{
    struct alloc a;
    if (!alloc_find(dptr, 1, &a) || a.base != dptr || a.kind != A_GRAPH)
        return CUDA_ERROR_INVALID_VALUE;   /* not an address an allocation node returned */
    struct graph_mem *m = a.graph_mem;
    int owned = 0;
    for (size_t i = 0; i < g->nmem && !owned; i++)
        owned = g->mem[i] == m;
    if (!owned)
        return CUDA_ERROR_NOT_SUPPORTED;   /* simgpu: only the owning graph frees */
    pthread_mutex_lock(&graph_mem_lock);
    CUresult r = m->freed_in_graph || m->live ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS)
        m->freed_in_graph = 1;   /* freed twice in one graph: invalid, as documented */
    pthread_mutex_unlock(&graph_mem_lock);
    *out = m;
    return r;
}

/* At launch: allocate the executable graph's allocations from the graph reserve. */
static CUresult graph_launch_mem(struct vgpu_graph_exec *e)
{
    if (!e->nmem)
        return CUDA_SUCCESS;
    pthread_mutex_lock(&graph_mem_lock);
    CUresult r = CUDA_SUCCESS;
    for (size_t i = 0; i < e->nmem && r == CUDA_SUCCESS; i++) {
        struct graph_mem *m = e->mem[i];
        if (!m->live)
            continue;
        if (e->flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) {
            m->live = 0;   /* as though the launch called cuMemFreeAsync on it */
            graph_pool_sub_locked(m->dev, m->footprint);
        } else {
            r = CUDA_ERROR_INVALID_VALUE;   /* "allocations ... remain unfreed" */
        }
    }
    uint64_t peak[SIMGPU_MAX_DEVICES] = {0}, kept[SIMGPU_MAX_DEVICES] = {0}, grow[SIMGPU_MAX_DEVICES] = {0};
    for (size_t i = 0; i < e->nmem && r == CUDA_SUCCESS; i++) {
        struct graph_mem *m = e->mem[i];
        peak[m->dev] += m->footprint;
        if (!m->freed_in_graph)
            kept[m->dev] += m->footprint;
    }
    int d = 0;
    for (; r == CUDA_SUCCESS && d < SIMGPU_MAX_DEVICES; d++) {
        uint64_t need = graph_pool[d].used + peak[d];
        if (need > graph_pool[d].reserved) {
            grow[d] = round_up(need - graph_pool[d].reserved, POOL_CHUNK);
            if (simgpu_mem_reserve(d, grow[d]))
                r = CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    if (r == CUDA_ERROR_OUT_OF_MEMORY) {
        for (int u = 0; u < d - 1; u++)
            simgpu_mem_release(u, grow[u]);
    } else if (r == CUDA_SUCCESS) {
        for (d = 0; d < SIMGPU_MAX_DEVICES; d++) {
            graph_pool[d].reserved += grow[d];
            if (graph_pool[d].used + peak[d] > graph_pool[d].used_high)
                graph_pool[d].used_high = graph_pool[d].used + peak[d];
            if (graph_pool[d].reserved > graph_pool[d].reserved_high)
                graph_pool[d].reserved_high = graph_pool[d].reserved;
            graph_pool[d].used += kept[d];
        }
        for (size_t i = 0; i < e->nmem; i++)
            e->mem[i]->live = !e->mem[i]->freed_in_graph;
    }
    pthread_mutex_unlock(&graph_mem_lock);
    return r;
}

SIMGPU_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps,
                                              size_t ndeps, CUDA_MEM_ALLOC_NODE_PARAMS *params)
{
    REQUIRE_INIT();
    (void)deps, (void)ndeps;
    if (!phNode || !params || !handle_ok(g, K_GRAPH))
        return CUDA_ERROR_INVALID_VALUE;
    struct vgpu_graph_node *n = graph_node_new(g, CU_GRAPH_NODE_TYPE_MEM_ALLOC);
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct graph_mem *m;
    CUresult r = graph_new_alloc(g, &params->poolProps, params->bytesize, &m);
    if (r != CUDA_SUCCESS) {
        graph_drop_node(n);
        return r;
    }
    n->mem = m;
    params->dptr = m->dptr;
    *phNode = n;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps,
                                             size_t ndeps, CUdeviceptr dptr)
{
    REQUIRE_INIT();
    (void)deps, (void)ndeps;
    if (!phNode || !handle_ok(g, K_GRAPH))
        return CUDA_ERROR_INVALID_VALUE;
    struct vgpu_graph_node *n = graph_node_new(g, CU_GRAPH_NODE_TYPE_MEM_FREE);
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct graph_mem *m;
    CUresult r = graph_new_free(g, dptr, &m);
    if (r != CUDA_SUCCESS) {
        graph_drop_node(n);
        return r;
    }
    n->mem = m;
    n->frees = 1;
    *phNode = n;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuGraphMemAllocNodeGetParams(CUgraphNode node, CUDA_MEM_ALLOC_NODE_PARAMS *out)
{
    REQUIRE_INIT();
    if (!out || !handle_ok(node, K_GRAPH_NODE) || !node->mem || node->frees)
        return CUDA_ERROR_INVALID_VALUE;
    *out = (CUDA_MEM_ALLOC_NODE_PARAMS){.poolProps = node->mem->props, .accessDescs = NULL,
                                        .accessDescCount = 0, .bytesize = node->mem->size,
                                        .dptr = node->mem->dptr};
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuGraphMemFreeNodeGetParams(CUgraphNode node, CUdeviceptr *dptr)
{
    REQUIRE_INIT();
    if (!dptr || !handle_ok(node, K_GRAPH_NODE) || !node->mem || !node->frees)
        return CUDA_ERROR_INVALID_VALUE;
    *dptr = node->mem->dptr;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev)
{
    REQUIRE_INIT();
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&graph_mem_lock);
    uint64_t keep = round_up(graph_pool[dev].used, POOL_CHUNK);
    if (graph_pool[dev].reserved > keep) {
        simgpu_mem_release(dev, graph_pool[dev].reserved - keep);
        graph_pool[dev].reserved = keep;
    }
    pthread_mutex_unlock(&graph_mem_lock);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice dev, int attr, void *value)
{
    REQUIRE_INIT();
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&graph_mem_lock);
    CUresult r = CUDA_SUCCESS;
    switch (attr) {
    case CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT: *(cuuint64_t *)value = graph_pool[dev].used; break;
    case CU_GRAPH_MEM_ATTR_USED_MEM_HIGH: *(cuuint64_t *)value = graph_pool[dev].used_high; break;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: *(cuuint64_t *)value = graph_pool[dev].reserved; break;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH: *(cuuint64_t *)value = graph_pool[dev].reserved_high; break;
    default: r = CUDA_ERROR_INVALID_VALUE; break;
    }
    pthread_mutex_unlock(&graph_mem_lock);
    return r;
}

SIMGPU_EXPORT CUresult cuDeviceSetGraphMemAttribute(CUdevice dev, int attr, void *value)
{
    REQUIRE_INIT();
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    if (!value || *(cuuint64_t *)value != 0)
        return CUDA_ERROR_INVALID_VALUE;   /* "High watermark can only be reset to zero" */
    pthread_mutex_lock(&graph_mem_lock);
    CUresult r = CUDA_SUCCESS;
    if (attr == CU_GRAPH_MEM_ATTR_USED_MEM_HIGH)
        graph_pool[dev].used_high = graph_pool[dev].used;
    else if (attr == CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)
        graph_pool[dev].reserved_high = graph_pool[dev].reserved;
    else
        r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&graph_mem_lock);
    return r;
}

/* Stream capture turns cuMemAllocAsync / cuMemFreeAsync into allocation and free nodes. */
static CUresult capture_alloc(struct vgpu_stream *s, CUdeviceptr *dptr, uint64_t size, int dev)
{
    if (!dptr)
        return CUDA_ERROR_INVALID_VALUE;
    CUmemPoolProps props = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED,
                            .location = {dev < 0 ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE,
                                         dev < 0 ? 0 : dev}};
    struct vgpu_graph_node *n = graph_node_new(s->capture, CU_GRAPH_NODE_TYPE_MEM_ALLOC);
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct graph_mem *m;
    CUresult r = graph_new_alloc(s->capture, &props, size, &m);
    if (r != CUDA_SUCCESS) {
        graph_drop_node(n);
        return r;
    }
    n->mem = m;
    *dptr = m->dptr;
    s->capture_last = n;
    return r;
}

static CUresult capture_free(struct vgpu_stream *s, CUdeviceptr dptr)
{
    struct vgpu_graph_node *n = graph_node_new(s->capture, CU_GRAPH_NODE_TYPE_MEM_FREE);
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct graph_mem *m;
    CUresult r = graph_new_free(s->capture, dptr, &m);
    if (r != CUDA_SUCCESS) {
        graph_drop_node(n);
        return r;
    }
    n->mem = m;
    n->frees = 1;
    s->capture_last = n;
    return r;
}

/* In a forked child: the parent's graph memory is the parent's. */
static void forget_graph_mem(void)
{
    pthread_mutex_init(&graph_mem_lock, NULL);
    memset(graph_pool, 0, sizeof graph_pool);
}


SIMGPU_EXPORT CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    REQUIRE_INIT();
    if (!phGraph || flags)
        return CUDA_ERROR_INVALID_VALUE;
    *phGraph = handle_new(K_GRAPH);
    return *phGraph ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

SIMGPU_EXPORT CUresult cuGraphDestroy(CUgraph g)
{
    REQUIRE_INIT();
    if (!handle_ok(g, K_GRAPH))
        return CUDA_ERROR_INVALID_VALUE;
    graph_free(g);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps,
                                               size_t ndeps, const CUDA_KERNEL_NODE_PARAMS *p)
{
    REQUIRE_INIT();
    (void)deps, (void)ndeps;   /* dependencies do not matter on a serial timeline */
    if (!phNode || !p || !handle_ok(g, K_GRAPH))
        return CUDA_ERROR_INVALID_VALUE;
    struct vgpu_function *f = p->func ? p->func : p->kern;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!p->gridDimX || !p->gridDimY || !p->gridDimZ)
        return CUDA_ERROR_INVALID_VALUE;
    struct vgpu_graph_node *n = graph_node_new(g, CU_GRAPH_NODE_TYPE_KERNEL);
    if (!n)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = graph_add_kernel(g, f, (uint64_t)p->gridDimX * p->gridDimY * p->gridDimZ);
    if (r == CUDA_SUCCESS && !(n->kp = kernel_params_new(p, f)))
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r != CUDA_SUCCESS) {
        graph_drop_node(n);
        return r;
    }
    *phNode = n;
    return CUDA_SUCCESS;
}

/* === graphs: kernel node parameters ===
 * cuda.h, cuGraphKernelNodeGetParams: "The kernelParams or extra array returned in
 * nodeParams, as well as the argument values it points to, are owned by the node.  This
 * memory remains valid until the node is destroyed or its parameters are modified"; "The
 * params will contain either kernelParams or extra, according to which of these was most
 * recently set on the node".  So a node keeps copies: of each argument, sized as the
 * kernel's image says (a cubin's EIATTR_KPARAM_INFO, PTX's .param list), and of an extra
 * buffer given with CU_LAUNCH_PARAM_BUFFER_SIZE.  A stand-in image says nothing of its
 * kernels' parameters: its node keeps the arrays it was given (the caller's memory). */
struct kernel_params {
    CUDA_KERNEL_NODE_PARAMS p;  /* as set, kernelParams / extra pointing into this block when copied */
    struct vgpu_function *fn;   /* what it runs (func, else kern) */
    size_t buffer_size;         /* the copied extra buffer's size (CU_LAUNCH_PARAM_BUFFER_SIZE points here) */
};

/* The extra buffer and its size, if `extra` is exactly the documented list of a buffer
 * pointer and its size (either order) ended by CU_LAUNCH_PARAM_END. */
static int extra_buffer(void **extra, void **buf, size_t *size)
{
    *buf = NULL;
    int sized = 0;
    for (int i = 0; extra[i] != CU_LAUNCH_PARAM_END; i += 2) {
        if (i == 4)
            return 0;   /* more than the two options */
        if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER)
            *buf = extra[i + 1];
        else if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE && extra[i + 1])
            *size = *(size_t *)extra[i + 1], sized = 1;
        else
            return 0;
    }
    return *buf && sized;
}

static struct kernel_params *kernel_params_new(const CUDA_KERNEL_NODE_PARAMS *p, struct vgpu_function *f)
{
    const struct simgpu_kernel *k = &f->info;
    void *buf = NULL;
    size_t bytes = sizeof(struct kernel_params), nargs = 0, buffer = 0, at;
    int copy_args = p->kernelParams && k->params_known;
    int copy_extra = !p->kernelParams && p->extra && extra_buffer(p->extra, &buf, &buffer);
    if (copy_args) {
        nargs = (size_t)k->nparams;
        bytes += nargs * sizeof(void *);
        for (size_t i = 0; i < nargs; i++)
            bytes += (k->params[i].size + 15) / 16 * 16;
    } else if (copy_extra) {
        bytes += 5 * sizeof(void *) + buffer;
    }
    struct kernel_params *kp = malloc(bytes);
    if (!kp)
        return NULL;
    kp->p = *p;
    kp->fn = f;
    kp->buffer_size = buffer;
    at = sizeof *kp;
    if (copy_args) {   /* the arguments, each 16-byte aligned after the array of their pointers */
        void **args = (void **)((char *)kp + at);
        at += nargs * sizeof(void *);
        for (size_t i = 0; i < nargs; i++) {
            args[i] = (char *)kp + at;
            memcpy(args[i], p->kernelParams[i], k->params[i].size);
            at += (k->params[i].size + 15) / 16 * 16;
        }
        kp->p.kernelParams = args;
    } else if (copy_extra) {
        void **extra = (void **)((char *)kp + at);
        void *copy = (char *)kp + at + 5 * sizeof(void *);
        memcpy(copy, buf, buffer);
        extra[0] = CU_LAUNCH_PARAM_BUFFER_POINTER, extra[1] = copy;
        extra[2] = CU_LAUNCH_PARAM_BUFFER_SIZE, extra[3] = &kp->buffer_size;
        extra[4] = CU_LAUNCH_PARAM_END;
        kp->p.extra = extra;
    }
    return kp;
}

static CUresult kernel_node(CUgraphNode node, const struct kernel_params **kp)
{
    if (!handle_ok(node, K_GRAPH_NODE) || node->type != CU_GRAPH_NODE_TYPE_KERNEL || !node->kp)
        return CUDA_ERROR_INVALID_VALUE;   /* cuda.h documents no other error for a wrong node */
    *kp = node->kp;
    return CUDA_SUCCESS;
}

/* CUDA 12.0's ABI: the parameters as set, func / kern / ctx included. */
SIMGPU_EXPORT CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode node, CUDA_KERNEL_NODE_PARAMS *nodeParams)
{
    REQUIRE_INIT();
    const struct kernel_params *kp;
    CUresult r = kernel_node(node, &kp);
    if (r != CUDA_SUCCESS)
        return r;
    if (!nodeParams)
        return CUDA_ERROR_INVALID_VALUE;
    *nodeParams = kp->p;
    return CUDA_SUCCESS;
}

/* CUDA 10.0's ABI (CUDA_KERNEL_NODE_PARAMS_v1: no kern or ctx): func is the function the
 * node runs, set by func or by kern (simgpu's kernels and functions are one object). */
SIMGPU_EXPORT CUresult cuGraphKernelNodeGetParams(CUgraphNode node, CUDA_KERNEL_NODE_PARAMS_v1 *nodeParams)
{
    REQUIRE_INIT();
    const struct kernel_params *kp;
    CUresult r = kernel_node(node, &kp);
    if (r != CUDA_SUCCESS)
        return r;
    if (!nodeParams)
        return CUDA_ERROR_INVALID_VALUE;
    *nodeParams = (CUDA_KERNEL_NODE_PARAMS_v1){kp->fn, kp->p.gridDimX, kp->p.gridDimY, kp->p.gridDimZ,
                                               kp->p.blockDimX, kp->p.blockDimY, kp->p.blockDimZ,
                                               kp->p.sharedMemBytes, kp->p.kernelParams, kp->p.extra};
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phExec, CUgraph g, unsigned long long flags)
{
    REQUIRE_CTX(c);
    (void)flags;
    if (!phExec || !handle_ok(g, K_GRAPH))
        return CUDA_ERROR_INVALID_VALUE;
    struct vgpu_graph_exec *e = handle_new(K_GRAPH_EXEC);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->dev = c->dev;
    for (size_t i = 0; i < g->count; i++)
        e->duration_ns += kernel_ns(c->dev, g->nodes[i].fn, g->nodes[i].blocks);
    e->kernels = g->count;
    e->flags = flags;
    if (g->nmem) {
        pthread_mutex_lock(&graph_mem_lock);
        int second = 0;   /* "at most one executable graph ... at a time" with memory nodes */
        for (size_t i = 0; i < g->nmem; i++)
            second |= g->mem[i]->exec != NULL;
        e->mem = second ? NULL : malloc(g->nmem * sizeof *e->mem);
        if (e->mem) {
            memcpy(e->mem, g->mem, g->nmem * sizeof *e->mem);
            e->nmem = g->nmem;
            for (size_t i = 0; i < g->nmem; i++) {
                g->mem[i]->exec = e;
                g->mem[i]->refs++;
            }
        }
        pthread_mutex_unlock(&graph_mem_lock);
        if (!e->mem) {
            handle_free(e);
            return second ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    *phExec = e;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phExec, CUgraph g, CUgraphNode *errNode,
                                             char *logBuffer, size_t bufferSize)
{
    if (errNode)
        *errNode = NULL;
    if (logBuffer && bufferSize)
        logBuffer[0] = 0;
    return cuGraphInstantiateWithFlags(phExec, g, 0);
}

/* The 10.0 ABI (the unversioned name): cuda.h declares it as _v2 is declared (error node,
 * log buffer) and documents one cuGraphInstantiate. */
SIMGPU_EXPORT CUresult cuGraphInstantiate(CUgraphExec *phExec, CUgraph g, CUgraphNode *errNode, char *logBuffer,
                                          size_t bufferSize)
{
    return cuGraphInstantiate_v2(phExec, g, errNode, logBuffer, bufferSize);
}

/* cuda.h, cuGraphInstantiateWithParams: flags as cuGraphInstantiateWithFlags takes them
 * (UPLOAD, with hUploadStream, is not modelled: refused); result_out says how it went. */
SIMGPU_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phExec, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    if (!p || (p->flags & ~(cuuint64_t)CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = cuGraphInstantiateWithFlags(phExec, g, p->flags);
    p->hErrNode_out = NULL;
    p->result_out = r == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS : CUDA_GRAPH_INSTANTIATE_ERROR;
    return r;
}

SIMGPU_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phExec, CUgraph g,
                                                         CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    PER_THREAD(cuGraphInstantiateWithParams(phExec, g, p));
}

/* cuda.h, cuGraphGetNodes: "nodes may be NULL, in which case this function will return the
 * number of nodes in numNodes.  Otherwise, numNodes entries will be filled in.  If numNodes
 * is higher than the actual number of nodes, the remaining entries in nodes will be set to
 * NULL, and the number of nodes actually obtained will be returned in numNodes." */
SIMGPU_EXPORT CUresult cuGraphGetNodes(CUgraph g, CUgraphNode *nodes, size_t *numNodes)
{
    REQUIRE_INIT();
    if (!numNodes || !handle_ok(g, K_GRAPH))
        return CUDA_ERROR_INVALID_VALUE;
    if (!nodes) {
        *numNodes = g->nall;
        return CUDA_SUCCESS;
    }
    size_t n = *numNodes < g->nall ? *numNodes : g->nall;
    for (size_t i = 0; i < *numNodes; i++)
        nodes[i] = i < n ? g->all[i] : NULL;
    *numNodes = n;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType *type)
{
    REQUIRE_INIT();
    if (!type || !handle_ok(node, K_GRAPH_NODE))
        return CUDA_ERROR_INVALID_VALUE;
    *type = node->type;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuGraphExecDestroy(CUgraphExec e)
{
    REQUIRE_INIT();
    if (!handle_ok(e, K_GRAPH_EXEC))
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&graph_mem_lock);
    for (size_t i = 0; i < e->nmem; i++) {
        e->mem[i]->exec = NULL;
        graph_mem_unref_locked(e->mem[i]);
    }
    pthread_mutex_unlock(&graph_mem_lock);
    free(e->mem);
    handle_free(e);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuGraphUpload(CUgraphExec e, CUstream h)
{
    REQUIRE_INIT();
    (void)h;
    return handle_ok(e, K_GRAPH_EXEC) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

SIMGPU_EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec e, CUstream h) { PER_THREAD(cuGraphUpload(e, h)); }

SIMGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec e, CUstream h)
{
    REQUIRE_INIT();
    if (!handle_ok(e, K_GRAPH_EXEC))
        return CUDA_ERROR_INVALID_VALUE;
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if ((err = graph_launch_mem(e)) != CUDA_SUCCESS)
        return err;
    if (e->kernels)
        stream_enqueue(s, e->duration_ns);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec e, CUstream h) { PER_THREAD(cuGraphLaunch(e, h)); }

static cuuint64_t capture_ids;   /* the last capture sequence id handed out */

SIMGPU_EXPORT CUresult cuStreamBeginCapture_v2(CUstream h, int mode)
{
    REQUIRE_INIT();
    (void)mode;
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (s == s->ctx->null_stream)
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;   /* the legacy stream cannot capture */
    if (s->capture)
        return CUDA_ERROR_ILLEGAL_STATE;
    s->capture = handle_new(K_GRAPH);
    s->capture_id = __atomic_add_fetch(&capture_ids, 1, __ATOMIC_RELAXED);
    s->capture_last = NULL;
    return s->capture ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

SIMGPU_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream h, int mode)
{
    PER_THREAD(cuStreamBeginCapture_v2(h, mode));
}

SIMGPU_EXPORT CUresult cuStreamEndCapture(CUstream h, CUgraph *phGraph)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!phGraph)
        return CUDA_ERROR_INVALID_VALUE;
    if (!s->capture)
        return CUDA_ERROR_ILLEGAL_STATE;
    *phGraph = s->capture;
    s->capture = NULL;
    s->capture_last = NULL;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream h, CUgraph *phGraph)
{
    PER_THREAD(cuStreamEndCapture(h, phGraph));
}

SIMGPU_EXPORT CUresult cuStreamIsCapturing(CUstream h, int *status)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    *status = s->capture ? 1 : 0;   /* CU_STREAM_CAPTURE_STATUS_ACTIVE / NONE */
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamIsCapturing_ptsz(CUstream h, int *status)
{
    PER_THREAD(cuStreamIsCapturing(h, status));
}

/* Is a stream of c that synchronizes with the legacy stream (not CU_STREAM_NON_BLOCKING)
 * capturing? */
static int blocking_capture_in(struct vgpu_ctx *c)
{
    for (size_t i = 0; arena && i < arena_used; i++) {
        struct vgpu_stream *s = (struct vgpu_stream *)(arena + ARENA_SLOT * i);
        if (handle_ok(s, K_STREAM) && s->ctx == c && s->capture && !(s->flags & CU_STREAM_NON_BLOCKING))
            return 1;
    }
    return 0;
}

/* cuda.h, cuStreamGetCaptureInfo (_v3; _v2 without edgeData_out; the 10.1 ABI with the
 * status and id only): captureStatus_out is required and is CU_STREAM_CAPTURE_STATUS_NONE
 * for a stream not capturing, _ACTIVE for one that is; the rest is valid only when active:
 * the id of the capture sequence ("unique over the lifetime of the process"), the graph
 * captured into, and the nodes the next captured node will depend on (simgpu captures in
 * order: the node captured last, if any), with their edge data (all zero: simgpu has no
 * ports) in a driver-owned array valid "until the next API call which operates on the
 * stream".  "If edgeData_out is non-NULL then dependencies_out must be as well."  On the
 * legacy stream while a stream not created with CU_STREAM_NON_BLOCKING is capturing:
 * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT. */
static CUresult capture_info(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id, CUgraph *graph,
                             const CUgraphNode **deps, const CUgraphEdgeData **edges, size_t *ndeps)
{
    REQUIRE_INIT();
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    if (!status || (edges && !deps))
        return CUDA_ERROR_INVALID_VALUE;
    if (s == s->ctx->null_stream && !s->capture && blocking_capture_in(s->ctx))
        return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    *status = s->capture ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    size_t n = s->capture && s->capture_last && handle_ok(s->capture_last, K_GRAPH_NODE) ? 1 : 0;
    s->capture_deps[0] = n ? s->capture_last : NULL;
    memset(s->capture_edges, 0, sizeof s->capture_edges);
    if (id)
        *id = s->capture ? s->capture_id : 0;
    if (graph)
        *graph = s->capture;
    if (deps)
        *deps = n ? s->capture_deps : NULL;
    if (edges)
        *edges = n ? s->capture_edges : NULL;
    if (ndeps)
        *ndeps = n;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuStreamGetCaptureInfo(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id)
{
    return capture_info(h, status, id, NULL, NULL, NULL, NULL);
}

SIMGPU_EXPORT CUresult cuStreamGetCaptureInfo_v2(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id,
                                                 CUgraph *graph, const CUgraphNode **deps, size_t *ndeps)
{
    return capture_info(h, status, id, graph, deps, NULL, ndeps);
}

SIMGPU_EXPORT CUresult cuStreamGetCaptureInfo_v3(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id,
                                                 CUgraph *graph, const CUgraphNode **deps,
                                                 const CUgraphEdgeData **edges, size_t *ndeps)
{
    return capture_info(h, status, id, graph, deps, edges, ndeps);
}

SIMGPU_EXPORT CUresult cuStreamGetCaptureInfo_ptsz(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id)
{
    PER_THREAD(cuStreamGetCaptureInfo(h, status, id));
}

SIMGPU_EXPORT CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id,
                                                      CUgraph *graph, const CUgraphNode **deps, size_t *ndeps)
{
    PER_THREAD(cuStreamGetCaptureInfo_v2(h, status, id, graph, deps, ndeps));
}

SIMGPU_EXPORT CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id,
                                                      CUgraph *graph, const CUgraphNode **deps,
                                                      const CUgraphEdgeData **edges, size_t *ndeps)
{
    PER_THREAD(cuStreamGetCaptureInfo_v3(h, status, id, graph, deps, edges, ndeps));
}

/* cuda.h, cuThreadExchangeStreamCaptureMode: "Sets the calling thread's stream capture
 * interaction mode to the value contained in *mode, and overwrites *mode with the previous
 * mode for the thread"; CU_STREAM_CAPTURE_MODE_GLOBAL is the default.  (simgpu keeps the
 * mode; it does not refuse the calls a mode prohibits during capture.) */
static __thread CUstreamCaptureMode tls_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

SIMGPU_EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)
{
    REQUIRE_INIT();
    if (!mode || (unsigned)*mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureMode old = tls_capture_mode;
    tls_capture_mode = *mode;
    *mode = old;
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
