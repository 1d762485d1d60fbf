/* pools.c — stream-ordered allocation (pools and their reserves) and graph memory (the
 * per-device graph reserve, and the launches of graphs with allocation nodes admitted ahead).
 */
#include "internal.h"
#include "footprint.h"

#include <stdlib.h>
#include <string.h>

/* charged = reserve (as last read) + pending (provisional charges of allocations in flight) */
struct pool { CUmemoryPool pool; int dev; uint64_t charged, pending; };   /* dev -1: host memory */
static struct pool *pools;
size_t npools, pools_cap;
uint64_t graph_charged[VGPU_MAX_DEVICES];   /* graph memory reserve as charged */
uint32_t graph_devices;                     /* bit d: device d's reserve is watched */
int graph_needs;      /* 1 once an executable graph's need is in the table (see "graph memory") */
uint64_t graph_pending[VGPU_MAX_DEVICES];   /* charged ahead of graph launches in flight (vmm_lock) */

/* === pools: stream-ordered allocation ===
 * A pool keeps what is freed into it (up to its release threshold, until a
 * synchronisation; forever with a threshold of UINT64_MAX), so what the device holds
 * for a pool is its reserve, not its live allocations.  The shim charges each pool of
 * the process its CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: an allocation is admitted for
 * its footprint in whole 2 MiB chunks (what simgpu's reserve grows by at most; a real
 * driver's pool may take larger chunks, which are charged when seen, past the cap),
 * then the pool is re-read and the charge set to the reserve: growth charged first,
 * the provisional charge refunded after, so the count never drops below the device's.
 * Frees change nothing until the driver releases reserve (at a synchronisation, a trim,
 * a threshold change, a destroy); the charge follows on the next stream-ordered call,
 * memory query, refusal or trim.  Between those it is higher than the device: the safe
 * side, and never a refusal, since a refusal re-reads every pool first. */


/* Charge what the device already holds for the process: no cap check, the bytes are
 * spent (the next admissions see them). */
static void charge_held(int dev, uint64_t bytes)
{
    if (S.slot >= 0 && bytes)
        note_peak(&S.usage->devices[dev],
                  (charge_add(dev, S.slot, bytes), memory_used(dev)));
}

/* Called with vmm_lock held.  dev < 0: a pool of host memory (not charged). */
static struct pool *pool_record(CUmemoryPool pool, int dev)
{
    for (size_t i = 0; i < npools; i++)
        if (pools[i].pool == pool)
            return &pools[i];
    if (npools == pools_cap) {
        struct pool *n = realloc(pools, (pools_cap ? 2 * pools_cap : 16) * sizeof *n);
        if (!n)
            return NULL;
        pools = n;
        pools_cap = pools_cap ? 2 * pools_cap : 16;
    }
    pools[npools] = (struct pool){pool, dev, 0, 0};
    return &pools[npools++];
}

static void note_pool(CUmemoryPool pool, int dev)
{
    pthread_mutex_lock(&vmm_lock);
    struct pool *p = pool_record(pool, dev);
    if (p && p->dev != dev && !p->charged)
        p->dev = dev;
    pthread_mutex_unlock(&vmm_lock);
}

/* Bring the charge of one pool to its reserve plus what is in flight; called with
 * vmm_lock held.  trim: first give the pool's unused reserve back to the driver. */
static void pool_settle_locked(struct pool *p, int trim)
{
    cuuint64_t reserved;
    if (p->dev < 0 || !REAL(cuMemPoolGetAttribute))
        return;
    if (trim && REAL(cuMemPoolTrimTo))
        real_cuMemPoolTrimTo(p->pool, 0);
    if (real_cuMemPoolGetAttribute(p->pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS)
        return;   /* (a destroyed pool is settled by the destroy hook) */
    uint64_t target = reserved + p->pending;
    if (target > p->charged)
        charge_held(p->dev, target - p->charged);
    else
        refund(p->dev, p->charged - target);
    p->charged = target;
}

/* trim: under the cap's pressure, reserve kept for reuse becomes budget again (the
 * pools lose only their cache; nothing in use is touched). */
void pools_settle(int trim)
{
    if (!LOAD(&npools))
        return;
    pthread_mutex_lock(&vmm_lock);
    for (size_t i = 0; i < npools; i++)
        pool_settle_locked(&pools[i], trim);
    pthread_mutex_unlock(&vmm_lock);
}

/* The pool a stream-ordered allocation on `stream` comes from: the device's current one. */
static CUmemoryPool current_pool(int dev)
{
    CUmemoryPool pool = NULL;
    if (!REAL(cuDeviceGetMemPool) || real_cuDeviceGetMemPool(&pool, dev) != CUDA_SUCCESS)
        return NULL;
    return pool;
}

static CUresult pool_alloc(int dev, CUmemoryPool pool, uint64_t bytes, CUresult r_call(void *), void *call)
{
    if (!pool)   /* no pool to read: charged as a plain allocation, for good */
        return admit(dev, bytes) != CUDA_SUCCESS ? CUDA_ERROR_OUT_OF_MEMORY : r_call(call);
    /* the most the reserve can grow by: the footprint, in whole pool chunks */
    uint64_t provisional = (vgpu_alloc_footprint(bytes) + VGPU_LARGE_PAGE - 1) & ~(VGPU_LARGE_PAGE - 1);
    CUresult r = admit(dev, provisional);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&vmm_lock);
    struct pool *p = pool_record(pool, dev);
    if (p) {
        p->charged += provisional;
        p->pending += provisional;
    }
    pthread_mutex_unlock(&vmm_lock);
    if (!p) {
        ERR("pool table full: %llu bytes stay charged", (unsigned long long)provisional);
        return r_call(call);
    }
    r = r_call(call);
    pthread_mutex_lock(&vmm_lock);
    if ((p = pool_record(pool, dev))) {
        p->pending -= provisional;
        pool_settle_locked(p, 0);
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

struct async_call { CUresult (*real)(CUdeviceptr *, size_t, CUstream); CUdeviceptr *dptr; size_t bytes; CUstream s; };
static CUresult call_async(void *c)
{
    struct async_call *a = c;
    return a->real(a->dptr, a->bytes, a->s);
}

/* Stream-ordered allocations come from the current pool of the stream's device. */
static CUresult alloc_async(CUresult (*real)(CUdeviceptr *, size_t, CUstream), CUdeviceptr *dptr,
                            size_t bytesize, CUstream hStream)
{
    int dev = dptr && bytesize ? stream_device(hStream) : -1;
    if (dev < 0)
        return real(dptr, bytesize, hStream);
    struct async_call c = {real, dptr, bytesize, hStream};
    return pool_alloc(dev, current_pool(dev), bytesize, call_async, &c);
}

SHIM_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    ENTER(cuMemAllocAsync, dptr, bytesize, hStream);
    return alloc_async(real_cuMemAllocAsync, dptr, bytesize, hStream);
}

SHIM_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    ENTER(cuMemAllocAsync_ptsz, dptr, bytesize, hStream);
    return alloc_async(real_cuMemAllocAsync_ptsz, dptr, bytesize, hStream);
}

/* A pool's memory lives on the pool's device (known when the program got the pool
 * through a hooked call), else on the stream's; -2: a host-memory pool. */
static int pool_device(CUmemoryPool pool, CUstream stream)
{
    int dev = -1;
    pthread_mutex_lock(&vmm_lock);
    for (size_t i = 0; i < npools; i++)
        if (pools[i].pool == pool)
            dev = pools[i].dev < 0 ? -2 : pools[i].dev;
    pthread_mutex_unlock(&vmm_lock);
    return dev != -1 ? dev : stream_device(stream);
}

struct pool_call {
    CUresult (*real)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
    CUdeviceptr *dptr; size_t bytes; CUmemoryPool pool; CUstream s;
};
static CUresult call_pool(void *c)
{
    struct pool_call *a = c;
    return a->real(a->dptr, a->bytes, a->pool, a->s);
}

static CUresult alloc_from_pool(CUresult (*real)(CUdeviceptr *, size_t, CUmemoryPool, CUstream),
                                CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    int dev = dptr && bytesize ? pool_device(pool, hStream) : -1;
    if (dev < 0)
        return real(dptr, bytesize, pool, hStream);
    struct pool_call c = {real, dptr, bytesize, pool, hStream};
    return pool_alloc(dev, pool, bytesize, call_pool, &c);
}

SHIM_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                             CUstream hStream)
{
    ENTER(cuMemAllocFromPoolAsync, dptr, bytesize, pool, hStream);
    return alloc_from_pool(real_cuMemAllocFromPoolAsync, dptr, bytesize, pool, hStream);
}

SHIM_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                  CUstream hStream)
{
    ENTER(cuMemAllocFromPoolAsync_ptsz, dptr, bytesize, pool, hStream);
    return alloc_from_pool(real_cuMemAllocFromPoolAsync_ptsz, dptr, bytesize, pool, hStream);
}

/* After a call that may let the driver release pool reserve (a free into a pool,
 * a trim, a threshold, a synchronisation): the charge follows the reserve. */
CUresult after_release(CUresult r)
{
    pools_settle(0);
    graph_memory_settle(-1);
    return r;
}

/* A stream-ordered free may also free a plain allocation (refunded as cuMemFree does). */
static CUresult free_stream_ordered(CUresult (*real)(CUdeviceptr, CUstream), CUdeviceptr dptr, CUstream hStream)
{
    int dev;
    uint64_t bytes;
    int known = forget(KEY_PTR | dptr, &dev, &bytes) == 0;
    CUresult r = real(dptr, hStream);
    if (known && r == CUDA_SUCCESS)
        refund(dev, bytes);
    else if (known)
        remember(KEY_PTR | dptr, dev, bytes);
    else if (LOAD(&nexports))
        export_freed(dptr, r);
    return after_release(r);
}

SHIM_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    ENTER(cuMemFreeAsync, dptr, hStream);
    return free_stream_ordered(real_cuMemFreeAsync, dptr, hStream);
}

SHIM_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    ENTER(cuMemFreeAsync_ptsz, dptr, hStream);
    return free_stream_ordered(real_cuMemFreeAsync_ptsz, dptr, hStream);
}

SHIM_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    ENTER(cuMemPoolTrimTo, pool, minBytesToKeep);
    return after_release(real_cuMemPoolTrimTo(pool, minBytesToKeep));
}

SHIM_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value)
{
    ENTER(cuMemPoolSetAttribute, pool, attr, value);
    return after_release(real_cuMemPoolSetAttribute(pool, attr, value));
}

SHIM_EXPORT CUresult cuStreamSynchronize(CUstream hStream)
{
    ENTER(cuStreamSynchronize, hStream);
    return after_release(real_cuStreamSynchronize(hStream));
}

SHIM_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream hStream)
{
    ENTER(cuStreamSynchronize_ptsz, hStream);
    return after_release(real_cuStreamSynchronize_ptsz(hStream));
}

SHIM_EXPORT CUresult cuEventSynchronize(CUevent hEvent)
{
    ENTER(cuEventSynchronize, hEvent);
    return after_release(real_cuEventSynchronize(hEvent));
}

SHIM_EXPORT CUresult cuCtxSynchronize(void)
{
    ENTER(cuCtxSynchronize);
    return after_release(real_cuCtxSynchronize());
}

SHIM_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)
{
    ENTER(cuMemPoolCreate, pool, poolProps);
    int dev = poolProps ? location_device(&poolProps->location) : LOCATION_PASS;
    if (dev == LOCATION_REFUSED)
        return CUDA_ERROR_NOT_SUPPORTED;
    CUresult r = real_cuMemPoolCreate(pool, poolProps);
    if (r == CUDA_SUCCESS && pool)
        note_pool(*pool, dev);   /* LOCATION_PASS (-1): host memory, never charged */
    return r;
}

SHIM_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev)
{
    ENTER(cuDeviceGetDefaultMemPool, pool_out, dev);
    CUresult r = real_cuDeviceGetDefaultMemPool(pool_out, dev);
    if (r == CUDA_SUCCESS && pool_out)
        note_pool(*pool_out, dev);
    return r;
}

SHIM_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev)
{
    ENTER(cuDeviceGetMemPool, pool, dev);
    CUresult r = real_cuDeviceGetMemPool(pool, dev);
    if (r == CUDA_SUCCESS && pool)
        note_pool(*pool, dev);
    return r;
}

SHIM_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    ENTER(cuMemPoolDestroy, pool);
    CUresult r = real_cuMemPoolDestroy(pool);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&vmm_lock);
    for (size_t i = 0; i < npools; i++)
        if (pools[i].pool == pool) {
            if (pools[i].dev >= 0)
                refund(pools[i].dev, pools[i].charged);
            pools[i] = pools[--npools];
            break;
        }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

/* === graph memory ===
 * Memory nodes of graphs allocate at launch from a per-device graph reserve that stays
 * (even after the graphs are gone) until cuDeviceGraphMemTrim: the process is charged
 * that reserve (CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT), read after each graph launch,
 * trim, synchronisation and memory query; before refusing, the shim trims it (what no
 * graph uses is a cache).
 * A launch is admitted ahead: at instantiation the graph's allocation nodes are walked
 * (cuGraphGetNodes, cuGraphNodeGetType, cuGraphMemAllocNodeGetParams: their bytesize and
 * device; child graphs too), and the executable graph keeps what it needs per device.
 * Before each launch what that need exceeds the reserve's free part (reserved less used)
 * by is charged as an allocation would be; over the cap the launch is refused with
 * CUDA_ERROR_OUT_OF_MEMORY and nothing runs.  The need is the sum of the nodes' sizes, an
 * upper bound (the driver may reuse the memory of nodes whose lives do not overlap).  The
 * need lives in the allocation table (KEY_GRAPH: one entry per device, context 0, so a
 * context's teardown never refunds it).  An executable graph whose walk fails, or that the
 * table has no room for, is launched as before and charged after (fail open, said once in
 * the log). */

static inline uint64_t graph_key(CUgraphExec exec, int dev)
{
    return KEY_GRAPH | (uint64_t)(uintptr_t)exec << 4 | (uint64_t)dev;
}

/* Adds the bytes graph g's allocation nodes take on each device to need; -1 when it cannot
 * be told. */
static int graph_need(CUgraph g, uint64_t need[VGPU_MAX_DEVICES], int depth)
{
    size_t n = 0;
    if (depth > 16 || !REAL(cuGraphGetNodes) || !REAL(cuGraphNodeGetType) || !REAL(cuGraphMemAllocNodeGetParams) ||
        real_cuGraphGetNodes(g, NULL, &n) != CUDA_SUCCESS)
        return -1;
    if (!n)
        return 0;
    CUgraphNode *nodes = calloc(n, sizeof *nodes);
    int rc = nodes && real_cuGraphGetNodes(g, nodes, &n) == CUDA_SUCCESS ? 0 : -1;
    for (size_t i = 0; rc == 0 && i < n; i++) {
        CUgraphNodeType type;
        CUDA_MEM_ALLOC_NODE_PARAMS p;
        CUgraph child;
        if (real_cuGraphNodeGetType(nodes[i], &type) != CUDA_SUCCESS)
            rc = -1;
        else if (type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
            memset(&p, 0, sizeof p);
            if (real_cuGraphMemAllocNodeGetParams(nodes[i], &p) != CUDA_SUCCESS)
                rc = -1;
            else if (p.poolProps.location.type == CU_MEM_LOCATION_TYPE_DEVICE && p.poolProps.location.id >= 0 &&
                     p.poolProps.location.id < VGPU_MAX_DEVICES) {
                uint64_t *d = &need[p.poolProps.location.id];
                *d = *d + p.bytesize < *d ? UINT64_MAX : *d + p.bytesize;
            }
        } else if (type == CU_GRAPH_NODE_TYPE_GRAPH)
            rc = !REAL(cuGraphChildGraphNodeGetGraph) ||
                 real_cuGraphChildGraphNodeGetGraph(nodes[i], &child) != CUDA_SUCCESS ||
                 graph_need(child, need, depth + 1) ? -1 : 0;
    }
    free(nodes);
    return rc;
}

static void graph_exec_forget(CUgraphExec exec)
{
    if (!LOAD(&graph_needs))
        return;
    int dev;
    uint64_t bytes;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        forget(graph_key(exec, d), &dev, &bytes);
}

/* After an instantiation: what the new executable graph's launches will take. */
static void graph_exec_note(CUresult r, CUgraphExec *exec, CUgraph g)
{
    if (r != CUDA_SUCCESS || !exec || !*exec || S.mode != MODE_ENFORCE)
        return;
    graph_exec_forget(*exec);   /* (a handle value of a destroyed one, reused) */
    uint64_t need[VGPU_MAX_DEVICES] = {0};
    static int said;
    if (graph_need(g, need, 0)) {
        if (!said++)
            INFO("a graph's allocation nodes could not be listed: its launches are charged after they run");
        return;
    }
    int stored = 0;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        if (need[d]) {
            STORE(&graph_needs, 1);
            stored |= remember_in(graph_key(*exec, d), d, need[d] < 1ull << 56 ? need[d] : (1ull << 56) - 1, 0);
        }
    if (stored) {
        graph_exec_forget(*exec);
        if (!said++)
            INFO("the allocation table is full: a graph's launches are charged after they run");
    }
}

CUresult graph_memory_admit(CUgraphExec exec, uint64_t taken[VGPU_MAX_DEVICES])
{
    memset(taken, 0, VGPU_MAX_DEVICES * sizeof *taken);
    if (!LOAD(&graph_needs) || !REAL(cuDeviceGetGraphMemAttribute))
        return CUDA_SUCCESS;     /* no graph with allocation nodes: the launch path as before */
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        uint64_t need;
        cuuint64_t reserved = 0, used = 0;
        if (recall(graph_key(exec, d), &need) ||
            real_cuDeviceGetGraphMemAttribute(d, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &reserved) ||
            real_cuDeviceGetGraphMemAttribute(d, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used))
            continue;
        uint64_t spare = reserved > used ? reserved - used : 0;
        if (need <= spare)
            continue;
        CUresult r = admit(d, need - spare);
        if (r != CUDA_SUCCESS) {
            /* what the devices before it took goes back: no longer pending, the settle
             * finds them charged above their reserve and refunds the difference */
            graph_memory_launched(taken);
            memset(taken, 0, VGPU_MAX_DEVICES * sizeof *taken);
            return r;
        }
        taken[d] = need - spare;
        pthread_mutex_lock(&vmm_lock);   /* the reserve to come: settled against once it is there */
        graph_charged[d] += taken[d];
        graph_pending[d] += taken[d];
        pthread_mutex_unlock(&vmm_lock);
    }
    return CUDA_SUCCESS;
}

void graph_memory_launched(const uint64_t taken[VGPU_MAX_DEVICES])
{
    int any = 0;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        any |= taken[d] != 0;
    if (!any)
        return;
    pthread_mutex_lock(&vmm_lock);
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        graph_pending[d] -= taken[d] < graph_pending[d] ? taken[d] : graph_pending[d];
    pthread_mutex_unlock(&vmm_lock);
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        if (taken[d])
            graph_memory_settle(d);
}

/* Every form of instantiation: the driver's, then what the new executable graph needs. */
#define INSTANTIATE(sym, ...)                     \
    ENTER(sym, __VA_ARGS__);                      \
    CUresult r_ = real_##sym(__VA_ARGS__);        \
    graph_exec_note(r_, phGraphExec, hGraph);     \
    return r_

SHIM_EXPORT CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                        char *logBuffer, size_t bufferSize)
{
    INSTANTIATE(cuGraphInstantiate, phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

SHIM_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                           char *logBuffer, size_t bufferSize)
{
    INSTANTIATE(cuGraphInstantiate_v2, phGraphExec, hGraph, phErrorNode, logBuffer, bufferSize);
}

SHIM_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    INSTANTIATE(cuGraphInstantiateWithFlags, phGraphExec, hGraph, flags);
}

SHIM_EXPORT CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                  CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    INSTANTIATE(cuGraphInstantiateWithParams, phGraphExec, hGraph, instantiateParams);
}

SHIM_EXPORT CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                       CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
    INSTANTIATE(cuGraphInstantiateWithParams_ptsz, phGraphExec, hGraph, instantiateParams);
}

SHIM_EXPORT CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    ENTER(cuGraphExecDestroy, hGraphExec);
    graph_exec_forget(hGraphExec);
    return real_cuGraphExecDestroy(hGraphExec);
}

void graph_memory_settle(int dev)
{
    if (dev >= VGPU_MAX_DEVICES || !REAL(cuDeviceGetGraphMemAttribute))
        return;
    if (dev >= 0)
        __atomic_or_fetch(&graph_devices, 1u << dev, __ATOMIC_RELAXED);
    uint32_t devs = dev >= 0 ? 1u << dev : LOAD(&graph_devices);
    if (!devs)
        return;
    pthread_mutex_lock(&vmm_lock);
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        cuuint64_t reserved;
        if (!(devs & 1u << d) ||
            real_cuDeviceGetGraphMemAttribute(d, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS)
            continue;
        reserved += graph_pending[d];    /* (what launches in flight were charged ahead stays) */
        if (reserved > graph_charged[d])
            charge_held(d, reserved - graph_charged[d]);
        else
            refund(d, graph_charged[d] - reserved);
        graph_charged[d] = reserved;
    }
    pthread_mutex_unlock(&vmm_lock);
}

/* Under the cap's pressure: the graph reserve nothing uses becomes budget again. */
void graph_memory_trim(void)
{
    uint32_t devs = LOAD(&graph_devices);
    for (int d = 0; d < VGPU_MAX_DEVICES && REAL(cuDeviceGraphMemTrim); d++)
        if (devs & 1u << d)
            real_cuDeviceGraphMemTrim(d);
    graph_memory_settle(-1);
}

SHIM_EXPORT CUresult cuDeviceGraphMemTrim(CUdevice device)
{
    ENTER(cuDeviceGraphMemTrim, device);
    CUresult r = real_cuDeviceGraphMemTrim(device);
    graph_memory_settle(device);
    return r;
}
