/* cuda_graphs.c — simgpu's graphs and stream capture, graph memory nodes and kernel node
 * parameters.
 */
#include "cuda_internal.h"

/* === graphs and stream capture ===
 * A graph is a list of kernels; on the serial timeline it costs their summed time. */

/* A new node of graph g, kept in its list (cuGraphGetNodes); NULL when out of memory.  Made
 * before the work it stands for, and dropped (graph_drop_node) when that work fails. */
struct vgpu_graph_node *graph_node_new(struct vgpu_graph *g, CUgraphNodeType type)
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

void graph_drop_node(struct vgpu_graph_node *n)
{
    struct vgpu_graph *g = n->graph;
    if (g->nall && g->all[g->nall - 1] == n)
        g->nall--;
    free(n->kp);
    handle_free(n);
}

CUresult graph_add_kernel(struct vgpu_graph *g, struct vgpu_function *f, uint64_t blocks)
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
CUresult graph_mem_free(uint64_t ptr)
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
CUresult capture_alloc(struct vgpu_stream *s, CUdeviceptr *dptr, uint64_t size, int dev)
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

CUresult capture_free(struct vgpu_stream *s, CUdeviceptr dptr)
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
void forget_graph_mem(void)
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

struct kernel_params *kernel_params_new(const CUDA_KERNEL_NODE_PARAMS *p, struct vgpu_function *f)
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
