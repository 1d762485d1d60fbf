/* cuda_internal.h — what simgpu's libcuda.so.1 files share (never installed, never exported):
 * the handle types, the shared helpers and state, and the entry points each file defines
 * (for cuGetProcAddress's table in cuda.c).  Only SIMGPU_EXPORT functions leave the library.
 *
 *   cuda.c          handles, init, devices, errors, contexts, cuGetProcAddress
 *   cuda_memory.c   the allocation table, pools, VMM, IPC/shareable handles, pointers, arrays, prefetch
 *   cuda_streams.c  streams, stream memory operations, events
 *   cuda_copy.c     memcpy / memset
 *   cuda_modules.c  modules, libraries, functions, attributes and occupancy, the linker, launch, tensor maps
 *   cuda_graphs.c   graphs and stream capture, graph memory nodes, kernel node parameters
 */
#ifndef SIMGPU_CUDA_INTERNAL_H
#define SIMGPU_CUDA_INTERNAL_H

#define _GNU_SOURCE
#include "cuda_abi.h"
#include "abi_resolve.h"
#include "footprint.h"
#include "simgpu/image.h"
#include "simgpu/node.h"

/* CUdevice ordinals are devices of the process's view (CUDA_VISIBLE_DEVICES; a MIG device
 * is one compute instance: its GI's memory pool, its own timeline): the node's memory and
 * timeline calls in these files go through the view (mig.h). */
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

/* === handles (cuda.c: the arena) === */

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
    int captured;   /* last recorded in a capturing stream: not to be queried (cuda.h) */
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

/* === what the files share: init, per-thread entry points, the allocation table, pools,
 * pointers, streams === */

#define REQUIRE_INIT()                                                        \
    do {                                                                      \
        if (!__atomic_load_n(&initialized, __ATOMIC_ACQUIRE))                 \
            return CUDA_ERROR_NOT_INITIALIZED;                                \
    } while (0)

static inline int ndevices(void) { return simgpu_view_count(); }
static inline int dev_ok(CUdevice d) { return d >= 0 && d < ndevices(); }

/* Run `call` as the per-thread-default-stream variant of an entry point. */
#define PER_THREAD(call)          \
    do {                          \
        tls_per_thread = 1;       \
        CUresult r_ = (call);     \
        tls_per_thread = 0;       \
        return r_;                \
    } while (0)

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

#define HOST_MEMORY (-1)

#define POOL_CHUNK (2ull << 20)

static inline uint64_t round_up(uint64_t v, uint64_t unit) { return (v + unit - 1) / unit * unit; }

struct ptr_info {
    int known;
    struct alloc a;
    uint64_t map_base, map_size;   /* VMM: the mapping */
};

typedef void (*host_fn)(void *);

/* cuda.c */
extern pthread_mutex_t arena_lock;
extern char *arena;
extern size_t arena_used;
void *handle_new(enum kind k);
void handle_free(void *p);
int handle_ok(const void *p, enum kind k);
void handles_drop(enum kind k, int (*pred)(void *, void *), void *arg, void (*before_free)(void *));
extern int initialized;
extern __thread int tls_per_thread;
extern struct vgpu_ctx *primary[SIMGPU_MAX_DEVICES];
extern pthread_mutex_t ctx_lock;
struct vgpu_ctx *current_ctx(void);
int ctx_gpu_lost(const struct vgpu_ctx *c);
CUresult ctx_use(struct vgpu_ctx *c);

/* cuda_copy.c */
CUresult copy(void *dst, const void *src, size_t n, int sync);

/* cuda_graphs.c */
struct vgpu_graph_node *graph_node_new(struct vgpu_graph *g, CUgraphNodeType type);
void graph_drop_node(struct vgpu_graph_node *n);
CUresult graph_add_kernel(struct vgpu_graph *g, struct vgpu_function *f, uint64_t blocks);
CUresult graph_mem_free(uint64_t ptr);
CUresult capture_alloc(struct vgpu_stream *s, CUdeviceptr *dptr, uint64_t size, int dev);
CUresult capture_free(struct vgpu_stream *s, CUdeviceptr dptr);
void forget_graph_mem(void);
struct kernel_params *kernel_params_new(const CUDA_KERNEL_NODE_PARAMS *p, struct vgpu_function *f);

/* cuda_memory.c */
int alloc_insert(struct alloc a);
int alloc_remove(uint64_t base, unsigned kinds, struct alloc *out);
int alloc_find(uint64_t addr, uint64_t len, struct alloc *out);
void *map_lazy(uint64_t size);
void alloc_drop(const struct alloc *a);
void free_allocations_of(struct vgpu_ctx *ctx);
CUresult mem_location(const CUmemLocation *loc, int *dev);
void pools_release_over_threshold(void);
void forget_allocations(void);
struct ptr_info ptr_info(CUdeviceptr ptr);

/* cuda_modules.c */
uint64_t kernel_ns(int dev, const struct vgpu_function *f, uint64_t blocks);
void stream_enqueue(struct vgpu_stream *s, uint64_t dur_ns);

/* cuda_streams.c */
void free_streams_of(struct vgpu_ctx *ctx, int keep_null_stream);
struct vgpu_stream *stream_new(struct vgpu_ctx *ctx, unsigned flags, int priority);
struct vgpu_stream *resolve_stream(CUstream h, CUresult *err);
void memops_drop_ctx(struct vgpu_ctx *c);
void forget_memops(void);

/* === the entry points of the other files (cuda.c's table names them) === */

/* cuda_copy.c */
SIMGPU_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n);
SIMGPU_EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n);
SIMGPU_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n);
SIMGPU_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n);
SIMGPU_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream h);
SIMGPU_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream h);
SIMGPU_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h);
SIMGPU_EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h);
SIMGPU_EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr d, const void *s, size_t n);
SIMGPU_EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *d, CUdeviceptr s, size_t n);
SIMGPU_EXPORT CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr d, CUdeviceptr s, size_t n);
SIMGPU_EXPORT CUresult cuMemcpy_ptds(CUdeviceptr d, CUdeviceptr s, size_t n);
SIMGPU_EXPORT CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr d, const void *s, size_t n, CUstream h);
SIMGPU_EXPORT CUresult cuMemcpyDtoHAsync_v2_ptsz(void *d, CUdeviceptr s, size_t n, CUstream h);
SIMGPU_EXPORT CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h);
SIMGPU_EXPORT CUresult cuMemcpyAsync_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h);
SIMGPU_EXPORT CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *p, CUstream h);
SIMGPU_EXPORT CUresult cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D *p, CUstream h);
SIMGPU_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n);
SIMGPU_EXPORT CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n);
SIMGPU_EXPORT CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int v, size_t n);
SIMGPU_EXPORT CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream h);
SIMGPU_EXPORT CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream h);
SIMGPU_EXPORT CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream h);
SIMGPU_EXPORT CUresult cuMemsetD8_v2_ptds(CUdeviceptr d, unsigned char v, size_t n);
SIMGPU_EXPORT CUresult cuMemsetD16_v2_ptds(CUdeviceptr d, unsigned short v, size_t n);
SIMGPU_EXPORT CUresult cuMemsetD32_v2_ptds(CUdeviceptr d, unsigned int v, size_t n);
SIMGPU_EXPORT CUresult cuMemsetD8Async_ptsz(CUdeviceptr d, unsigned char v, size_t n, CUstream h);
SIMGPU_EXPORT CUresult cuMemsetD16Async_ptsz(CUdeviceptr d, unsigned short v, size_t n, CUstream h);
SIMGPU_EXPORT CUresult cuMemsetD32Async_ptsz(CUdeviceptr d, unsigned int v, size_t n, CUstream h);

/* cuda_graphs.c */
SIMGPU_EXPORT CUresult cuGraphAddMemAllocNode(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps,
                                              size_t ndeps, CUDA_MEM_ALLOC_NODE_PARAMS *params);
SIMGPU_EXPORT CUresult cuGraphAddMemFreeNode(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps,
                                             size_t ndeps, CUdeviceptr dptr);
SIMGPU_EXPORT CUresult cuGraphMemAllocNodeGetParams(CUgraphNode node, CUDA_MEM_ALLOC_NODE_PARAMS *out);
SIMGPU_EXPORT CUresult cuGraphMemFreeNodeGetParams(CUgraphNode node, CUdeviceptr *dptr);
SIMGPU_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice dev);
SIMGPU_EXPORT CUresult cuDeviceGetGraphMemAttribute(CUdevice dev, int attr, void *value);
SIMGPU_EXPORT CUresult cuDeviceSetGraphMemAttribute(CUdevice dev, int attr, void *value);
SIMGPU_EXPORT CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags);
SIMGPU_EXPORT CUresult cuGraphDestroy(CUgraph g);
SIMGPU_EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps,
                                               size_t ndeps, const CUDA_KERNEL_NODE_PARAMS *p);
SIMGPU_EXPORT CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode node, CUDA_KERNEL_NODE_PARAMS *nodeParams);
SIMGPU_EXPORT CUresult cuGraphKernelNodeGetParams(CUgraphNode node, CUDA_KERNEL_NODE_PARAMS_v1 *nodeParams);
SIMGPU_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phExec, CUgraph g, unsigned long long flags);
SIMGPU_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phExec, CUgraph g, CUgraphNode *errNode,
                                             char *logBuffer, size_t bufferSize);
SIMGPU_EXPORT CUresult cuGraphInstantiate(CUgraphExec *phExec, CUgraph g, CUgraphNode *errNode, char *logBuffer,
                                          size_t bufferSize);
SIMGPU_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phExec, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p);
SIMGPU_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phExec, CUgraph g,
                                                         CUDA_GRAPH_INSTANTIATE_PARAMS *p);
SIMGPU_EXPORT CUresult cuGraphGetNodes(CUgraph g, CUgraphNode *nodes, size_t *numNodes);
SIMGPU_EXPORT CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType *type);
SIMGPU_EXPORT CUresult cuGraphExecDestroy(CUgraphExec e);
SIMGPU_EXPORT CUresult cuGraphUpload(CUgraphExec e, CUstream h);
SIMGPU_EXPORT CUresult cuGraphUpload_ptsz(CUgraphExec e, CUstream h);
SIMGPU_EXPORT CUresult cuGraphLaunch(CUgraphExec e, CUstream h);
SIMGPU_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec e, CUstream h);
SIMGPU_EXPORT CUresult cuStreamBeginCapture_v2(CUstream h, int mode);
SIMGPU_EXPORT CUresult cuStreamBeginCapture_v2_ptsz(CUstream h, int mode);
SIMGPU_EXPORT CUresult cuStreamEndCapture(CUstream h, CUgraph *phGraph);
SIMGPU_EXPORT CUresult cuStreamEndCapture_ptsz(CUstream h, CUgraph *phGraph);
SIMGPU_EXPORT CUresult cuStreamIsCapturing(CUstream h, int *status);
SIMGPU_EXPORT CUresult cuStreamIsCapturing_ptsz(CUstream h, int *status);
SIMGPU_EXPORT CUresult cuStreamGetCaptureInfo(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id);
SIMGPU_EXPORT CUresult cuStreamGetCaptureInfo_v2(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id,
                                                 CUgraph *graph, const CUgraphNode **deps, size_t *ndeps);
SIMGPU_EXPORT CUresult cuStreamGetCaptureInfo_v3(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id,
                                                 CUgraph *graph, const CUgraphNode **deps,
                                                 const CUgraphEdgeData **edges, size_t *ndeps);
SIMGPU_EXPORT CUresult cuStreamGetCaptureInfo_ptsz(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id);
SIMGPU_EXPORT CUresult cuStreamGetCaptureInfo_v2_ptsz(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id,
                                                      CUgraph *graph, const CUgraphNode **deps, size_t *ndeps);
SIMGPU_EXPORT CUresult cuStreamGetCaptureInfo_v3_ptsz(CUstream h, CUstreamCaptureStatus *status, cuuint64_t *id,
                                                      CUgraph *graph, const CUgraphNode **deps,
                                                      const CUgraphEdgeData **edges, size_t *ndeps);
SIMGPU_EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode);

/* cuda_memory.c */
SIMGPU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
SIMGPU_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                          size_t Height, unsigned int ElementSizeBytes);
SIMGPU_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
SIMGPU_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr);
SIMGPU_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
SIMGPU_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr);
SIMGPU_EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags);
SIMGPU_EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t bytesize);
SIMGPU_EXPORT CUresult cuMemFreeHost(void *p);
SIMGPU_EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags);
SIMGPU_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev);
SIMGPU_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev);
SIMGPU_EXPORT CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool);
SIMGPU_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props);
SIMGPU_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool);
SIMGPU_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep);
SIMGPU_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value);
SIMGPU_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value);
SIMGPU_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                               CUstream hStream);
SIMGPU_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
                                                    CUmemoryPool pool, CUstream hStream);
SIMGPU_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
SIMGPU_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
SIMGPU_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream);
SIMGPU_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);
SIMGPU_EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                                     int option);
SIMGPU_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                   const CUmemAllocationProp *prop, unsigned long long flags);
SIMGPU_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
SIMGPU_EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                           CUdeviceptr addr, unsigned long long flags);
SIMGPU_EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
SIMGPU_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                                CUmemGenericAllocationHandle handle, unsigned long long flags);
SIMGPU_EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                      size_t count);
SIMGPU_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
SIMGPU_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr);
SIMGPU_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags);
SIMGPU_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags);
SIMGPU_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr);
SIMGPU_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                    CUmemAllocationHandleType handleType, unsigned long long flags);
SIMGPU_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                      CUmemAllocationHandleType shHandleType);
SIMGPU_EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);
SIMGPU_EXPORT CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                              CUmemGenericAllocationHandle handle);
SIMGPU_EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr);
SIMGPU_EXPORT CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes,
                                              void **data, CUdeviceptr ptr);
SIMGPU_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d);
SIMGPU_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d);
SIMGPU_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                              unsigned int numMipmapLevels);
SIMGPU_EXPORT CUresult cuArrayDestroy(CUarray a);
SIMGPU_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray a);
SIMGPU_EXPORT CUresult cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                             unsigned int flags, CUstream h);
SIMGPU_EXPORT CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream h);
SIMGPU_EXPORT CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream h);
SIMGPU_EXPORT CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                                  unsigned int flags, CUstream h);

/* cuda_modules.c */
SIMGPU_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image);
SIMGPU_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                          CUjit_option *options, void **optionValues);
SIMGPU_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin);
SIMGPU_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname);
SIMGPU_EXPORT CUresult cuModuleUnload(CUmodule m);
SIMGPU_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule m, const char *name);
SIMGPU_EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule m, const char *name);
SIMGPU_EXPORT CUresult cuModuleGetFunctionCount(unsigned int *count, CUmodule m);
SIMGPU_EXPORT CUresult cuModuleEnumerateFunctions(CUfunction *functions, unsigned int numFunctions, CUmodule m);
SIMGPU_EXPORT CUresult cuModuleGetLoadingMode(int *mode);
SIMGPU_EXPORT CUresult cuFuncGetModule(CUmodule *hmod, CUfunction f);
SIMGPU_EXPORT CUresult cuFuncIsLoaded(int *state, CUfunction f);
SIMGPU_EXPORT CUresult cuFuncLoad(CUfunction f);
SIMGPU_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                         void **jitOptionsValues, unsigned int numJitOptions,
                                         void *libraryOptions, void **libraryOptionValues,
                                         unsigned int numLibraryOptions);
SIMGPU_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                             void **jitOptionsValues, unsigned int numJitOptions,
                                             void *libraryOptions, void **libraryOptionValues,
                                             unsigned int numLibraryOptions);
SIMGPU_EXPORT CUresult cuLibraryUnload(CUlibrary l);
SIMGPU_EXPORT CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary l, const char *name);
SIMGPU_EXPORT CUresult cuLibraryGetKernelCount(unsigned int *count, CUlibrary l);
SIMGPU_EXPORT CUresult cuLibraryGetModule(CUmodule *pMod, CUlibrary l);
SIMGPU_EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary l, const char *name);
SIMGPU_EXPORT CUresult cuKernelGetLibrary(CUlibrary *pLib, CUkernel k);
SIMGPU_EXPORT CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel k);
SIMGPU_EXPORT CUresult cuFuncGetName(const char **name, CUfunction f);
SIMGPU_EXPORT CUresult cuKernelGetName(const char **name, CUkernel k);
SIMGPU_EXPORT CUresult cuFuncGetAttribute(int *pi, int attrib, CUfunction f);
SIMGPU_EXPORT CUresult cuFuncSetAttribute(CUfunction f, int attrib, int value);
SIMGPU_EXPORT CUresult cuFuncSetCacheConfig(CUfunction f, int config);
SIMGPU_EXPORT CUresult cuKernelGetAttribute(int *pi, int attrib, CUkernel k, CUdevice dev);
SIMGPU_EXPORT CUresult cuKernelSetAttribute(int attrib, int val, CUkernel k, CUdevice dev);
SIMGPU_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *numBlocks, CUfunction f, int blockSize,
                                                                            size_t dynamicSMemSize, unsigned int flags);
SIMGPU_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction f, int blockSize,
                                                                   size_t dynamicSMemSize);
SIMGPU_EXPORT CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int *minGridSize, int *blockSize, CUfunction f,
                                                                 CUoccupancyB2DSize smemOf, size_t dynamicSMemSize,
                                                                 int blockSizeLimit, unsigned int flags);
SIMGPU_EXPORT CUresult cuOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize, CUfunction f,
                                                        CUoccupancyB2DSize smemOf, size_t dynamicSMemSize,
                                                        int blockSizeLimit);
SIMGPU_EXPORT CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t *dynamicSmemSize, CUfunction f, int numBlocks,
                                                               int blockSize);
SIMGPU_EXPORT CUresult cuOccupancyMaxPotentialClusterSize(int *clusterSize, CUfunction f, const CUlaunchConfig *config);
SIMGPU_EXPORT CUresult cuOccupancyMaxActiveClusters(int *numClusters, CUfunction f, const CUlaunchConfig *config);
SIMGPU_EXPORT CUresult cuLinkCreate_v2(unsigned int numOptions, CUjit_option *options, void **optionValues,
                                       CUlinkState *stateOut);
SIMGPU_EXPORT CUresult cuLinkAddData_v2(CUlinkState l, CUjitInputType type, void *data, size_t size, const char *name,
                                        unsigned int numOptions, CUjit_option *options, void **optionValues);
SIMGPU_EXPORT CUresult cuLinkAddFile_v2(CUlinkState l, CUjitInputType type, const char *path, unsigned int numOptions,
                                        CUjit_option *options, void **optionValues);
SIMGPU_EXPORT CUresult cuLinkComplete(CUlinkState l, void **cubinOut, size_t *sizeOut);
SIMGPU_EXPORT CUresult cuLinkDestroy(CUlinkState l);
SIMGPU_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                      unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                      unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                      void **kernelParams, void **extra);
SIMGPU_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                           unsigned int gridDimZ, unsigned int blockDimX,
                                           unsigned int blockDimY, unsigned int blockDimZ,
                                           unsigned int sharedMemBytes, CUstream hStream,
                                           void **kernelParams, void **extra);
SIMGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                        void **extra);
SIMGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                             void **kernelParams, void **extra);
SIMGPU_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                 unsigned int gridDimZ, unsigned int blockDimX,
                                                 unsigned int blockDimY, unsigned int blockDimZ,
                                                 unsigned int sharedMemBytes, CUstream hStream,
                                                 void **kernelParams);
SIMGPU_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX,
                                                      unsigned int gridDimY, unsigned int gridDimZ,
                                                      unsigned int blockDimX, unsigned int blockDimY,
                                                      unsigned int blockDimZ, unsigned int sharedMemBytes,
                                                      CUstream hStream, void **kernelParams);
SIMGPU_EXPORT CUresult cuTensorMapEncodeTiled(void *tensorMap, CUtensorMapDataType tensorDataType,
                                              uint32_t tensorRank, void *globalAddress, const cuuint64_t *globalDim,
                                              const cuuint64_t *globalStrides, const uint32_t *boxDim,
                                              const uint32_t *elementStrides, CUtensorMapInterleave interleave,
                                              CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion,
                                              CUtensorMapFloatOOBfill oobFill);

/* cuda_streams.c */
SIMGPU_EXPORT CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority);
SIMGPU_EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int flags);
SIMGPU_EXPORT CUresult cuStreamDestroy_v2(CUstream h);
SIMGPU_EXPORT CUresult cuStreamSynchronize(CUstream h);
SIMGPU_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream h);
SIMGPU_EXPORT CUresult cuStreamQuery(CUstream h);
SIMGPU_EXPORT CUresult cuStreamQuery_ptsz(CUstream h);
SIMGPU_EXPORT CUresult cuStreamWaitEvent(CUstream h, CUevent ev, unsigned int flags);
SIMGPU_EXPORT CUresult cuStreamWaitEvent_ptsz(CUstream h, CUevent ev, unsigned int flags);
SIMGPU_EXPORT CUresult cuStreamGetPriority(CUstream h, int *priority);
SIMGPU_EXPORT CUresult cuStreamGetPriority_ptsz(CUstream h, int *priority);
SIMGPU_EXPORT CUresult cuStreamGetFlags(CUstream h, unsigned int *flags);
SIMGPU_EXPORT CUresult cuStreamGetFlags_ptsz(CUstream h, unsigned int *flags);
SIMGPU_EXPORT CUresult cuStreamGetCtx(CUstream h, CUcontext *pctx);
SIMGPU_EXPORT CUresult cuStreamGetCtx_ptsz(CUstream h, CUcontext *pctx);
SIMGPU_EXPORT CUresult cuStreamGetId(CUstream h, unsigned long long *streamId);
SIMGPU_EXPORT CUresult cuStreamGetId_ptsz(CUstream h, unsigned long long *streamId);
SIMGPU_EXPORT CUresult cuStreamGetDevice(CUstream h, CUdevice *device);
SIMGPU_EXPORT CUresult cuStreamGetDevice_ptsz(CUstream h, CUdevice *device);
SIMGPU_EXPORT CUresult cuLaunchHostFunc(CUstream h, host_fn fn, void *userData);
SIMGPU_EXPORT CUresult cuLaunchHostFunc_ptsz(CUstream h, host_fn fn, void *userData);
SIMGPU_EXPORT CUresult cuCtxSynchronize(void);
SIMGPU_EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx);
SIMGPU_EXPORT CUresult cuStreamBatchMemOp_v2(CUstream h, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                             unsigned int flags);
SIMGPU_EXPORT CUresult cuStreamWaitValue32_v2(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags);
SIMGPU_EXPORT CUresult cuStreamWriteValue32_v2(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags);
SIMGPU_EXPORT CUresult cuStreamBatchMemOp_v2_ptsz(CUstream h, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                                  unsigned int flags);
SIMGPU_EXPORT CUresult cuStreamWaitValue32_v2_ptsz(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags);
SIMGPU_EXPORT CUresult cuStreamWriteValue32_v2_ptsz(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags);
SIMGPU_EXPORT CUresult cuStreamBatchMemOp(CUstream h, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                          unsigned int flags);
SIMGPU_EXPORT CUresult cuStreamWaitValue32(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags);
SIMGPU_EXPORT CUresult cuStreamWriteValue32(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags);
SIMGPU_EXPORT CUresult cuStreamBatchMemOp_ptsz(CUstream h, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                               unsigned int flags);
SIMGPU_EXPORT CUresult cuStreamWaitValue32_ptsz(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags);
SIMGPU_EXPORT CUresult cuStreamWriteValue32_ptsz(CUstream h, CUdeviceptr addr, uint32_t value, unsigned int flags);
SIMGPU_EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags);
SIMGPU_EXPORT CUresult cuEventDestroy_v2(CUevent e);
SIMGPU_EXPORT CUresult cuEventRecord(CUevent e, CUstream h);
SIMGPU_EXPORT CUresult cuEventRecord_ptsz(CUevent e, CUstream h);
SIMGPU_EXPORT CUresult cuEventRecordWithFlags(CUevent e, CUstream h, unsigned int flags);
SIMGPU_EXPORT CUresult cuEventRecordWithFlags_ptsz(CUevent e, CUstream h, unsigned int flags);
SIMGPU_EXPORT CUresult cuEventQuery(CUevent e);
SIMGPU_EXPORT CUresult cuEventSynchronize(CUevent e);
SIMGPU_EXPORT CUresult cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end);
SIMGPU_EXPORT CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end);

#endif
