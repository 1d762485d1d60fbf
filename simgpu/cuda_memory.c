/* cuda_memory.c — simgpu's device memory: the allocation table, stream-ordered pools, virtual
 * memory management, memory shared between processes (IPC and shareable handles), pointer
 * attributes, arrays and unified-memory prefetch.
 */
#include "cuda_internal.h"

/* === memory: allocation table ===
 * Sorted by address, so device pointers inside an allocation are recognised (copies
 * check them; frees find their size).  Reserved VMM ranges are entries too. */

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

int alloc_insert(struct alloc a)
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
int alloc_remove(uint64_t base, unsigned kinds, struct alloc *out)
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
int alloc_find(uint64_t addr, uint64_t len, struct alloc *out)
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

void *map_lazy(uint64_t size)
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
void alloc_drop(const struct alloc *a)
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
void free_allocations_of(struct vgpu_ctx *ctx)
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

/* Where memory of `loc` lives (cuMemCreate, cuMemPoolCreate, graph allocation nodes): a
 * device ordinal, or HOST_MEMORY for the host (which takes no device memory).  As cuda.h
 * of CUDA 13.0 documents them: DEVICE names a device ordinal; HOST ignores the id;
 * HOST_NUMA names a host NUMA node (simgpu's host has one, node 0); HOST_NUMA_CURRENT is
 * CUDA_ERROR_INVALID_VALUE for cuMemCreate and cuMemPoolCreate; INVALID (= NONE) and
 * every type this driver does not know (newer ones included) are invalid too. */
CUresult mem_location(const CUmemLocation *loc, int *dev)
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

static struct vgpu_mempool *default_pool[SIMGPU_MAX_DEVICES];
static struct vgpu_mempool *current_pool[SIMGPU_MAX_DEVICES];
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;   /* every pool's state */
static struct vgpu_mempool *pools;                              /* under pool_lock */

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
void pools_release_over_threshold(void)
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

void forget_allocations(void)
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

struct ptr_info ptr_info(CUdeviceptr ptr)
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
