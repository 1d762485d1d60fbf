/* shared_memory.c — memory shared between processes (CUDA IPC, shareable VMM handles):
 * the exporter's slice pays, through a shared usage slot its holders keep alive.
 */
#include "internal.h"
#include "footprint.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* === memory shared between processes: the exporter's slice pays ===
 * Memory a process exports (cuIpcGetMemHandle, cuMemExportToShareableHandle) stays on the
 * device while any process holds it: the exporter until it frees it, each importer until
 * it closes or releases and unmaps it (the driver's rules: docs/shim.md).  So its charge
 * moves, at export, out of the exporter's slot into a slot of its own, a *shared slot*
 * (flags VGPU_PROC_SHARED, pid 0, start_ticks the export's key: a hash of its handle,
 * state the exporter's pid), and every process of the slice that holds the memory holds
 * that slot's OFD lock shared (a read lock).  The kernel keeps the count: the slot lives
 * while any holder does, whatever ends them (a release, exit, kill -9), and whoever finds
 * its lock free drains it, as any dead process's slot — the last holder as it lets go,
 * or a reaper.  One counter still: memory.current is the sum of the slots.
 * An importer finds the shared slot by the key of the handle it was given.  One that finds
 * none (the exporter is in another slice, or not under the shim) charges the slice itself
 * for what it keeps alive, admitted against the cap like an allocation: each slice pays
 * for what its own processes hold. */

static int shared_holds[VGPU_MAX_PROCS];   /* this process's holds of each shared slot (S.lock) */

int memory_holds_slot(int i)   /* with S.lock held */
{
    return i >= 0 && i < VGPU_MAX_PROCS && shared_holds[i] > 0;
}

static uint64_t key_of(const void *p, size_t n)   /* FNV-1a; never 0 */
{
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ull;
    return h | 1;
}

/* The key of a shareable handle: its bytes (fabric), or the file a descriptor is (POSIX:
 * the importer receives the same open file); 0 when it has none. */
static uint64_t shareable_key(const void *handle, CUmemAllocationHandleType type)
{
    struct stat st;
    if (type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR && fstat((int)(intptr_t)handle, &st) == 0) {
        uint64_t id[2] = {(uint64_t)st.st_dev, (uint64_t)st.st_ino};
        return key_of(id, sizeof id);
    }
    return type == CU_MEM_HANDLE_TYPE_FABRIC && handle ? key_of(handle, CU_IPC_HANDLE_SIZE) : 0;
}

/* A shared slot for `bytes` on dev, moved out of this process's charge, held by this
 * process: its index, or -1 when no slot is free. */
static int shared_new(int dev, uint64_t bytes, uint64_t key)
{
    if (S.slot < 0 || S.usage_fd < 0)
        return -1;
    pthread_mutex_lock(&S.lock);
    int s = take_free_slot();
    if (s >= 0) {
        struct vgpu_usage_proc *p = &S.usage->procs[s], *me = &S.usage->procs[S.slot];
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        memcpy(p->comm, me->comm, sizeof p->comm);
        p->started_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
        p->pid_ns = me->pid_ns;
        p->cgroup_id = me->cgroup_id;
        STORE(&p->state, (uint32_t)getpid());
        STORE(&p->start_ticks, key);
        STORE(&p->flags, (me->flags & VGPU_PROC_FROM_FILE) | VGPU_PROC_SHARED);
        /* counted twice for an instant, never not at all */
        charge_add(dev, s, bytes);
        charge_sub(dev, S.slot, bytes);
        slot_lock(S.usage_fd, s, F_RDLCK);   /* converted in place: held from now on, as by every holder */
        shared_holds[s] = 1;
    }
    pthread_mutex_unlock(&S.lock);
    if (s < 0)
        ERR("no usage slot free for memory shared with other processes; the export is refused");
    return s;
}

static int shared_slot_is(int i, uint64_t key)
{
    const struct vgpu_usage_proc *p = &S.usage->procs[i];
    if (LOAD(&p->pid) || !(LOAD(&p->flags) & VGPU_PROC_SHARED) || LOAD(&p->start_ticks) != key)
        return 0;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        if (LOAD(&S.usage->charge[d][i]))
            return 1;
    return 0;   /* drained: its memory is gone */
}

/* Hold the shared slot of export `key`: its index, or -1 when the slice has none. */
static int shared_hold(uint64_t key)
{
    if (S.mode != MODE_ENFORCE || S.usage_fd < 0 || !key)
        return -1;
    pthread_mutex_lock(&S.lock);
    int found = -1;
    uint32_t n = LOAD(&S.usage->slots_used);
    for (uint32_t i = 0; i < n && i < VGPU_MAX_PROCS && found < 0; i++) {
        if (!shared_slot_is((int)i, key))
            continue;
        if (shared_holds[i]) {
            found = (int)i;
            break;
        }
        /* a write lock is its exporter making it or a holder draining it: see which */
        for (int t = 0; t < 100; t++) {
            if (slot_lock(S.usage_fd, (int)i, F_RDLCK) == 0) {
                if (shared_slot_is((int)i, key))
                    found = (int)i;
                else
                    slot_lock(S.usage_fd, (int)i, F_UNLCK);
                break;
            }
            usleep(1000);
        }
    }
    if (found >= 0)
        shared_holds[found]++;
    pthread_mutex_unlock(&S.lock);
    return found;
}

static void shared_drain(int s)   /* with its lock held for writing */
{
    drain_slot(s);
    STORE(&S.usage->procs[s].flags, 0);
    STORE(&S.usage->procs[s].start_ticks, 0);
}

/* Let go of one hold; the slice's last holder drains the slot: the memory is gone (unless
 * the driver still keeps it: shared_kept_by_driver). */
void shared_release(int s)
{
    if (s < 0 || s >= VGPU_MAX_PROCS)
        return;
    pthread_mutex_lock(&S.lock);
    if (shared_holds[s] > 0 && --shared_holds[s] == 0) {
        slot_lock(S.usage_fd, s, F_UNLCK);
        if (slot_lock(S.usage_fd, s, F_WRLCK) == 0) {
            if (shared_kept_by_driver(s))   /* left charged: a reaper drains it once the driver lets go */
                INFO("memory exported through usage slot %d is still on the device (a descriptor of it open "
                     "elsewhere): it stays charged until the driver lets it go", s);
            else
                shared_drain(s);
            slot_lock(S.usage_fd, s, F_UNLCK);
        }
    }
    pthread_mutex_unlock(&S.lock);
}

/* the exports and imports (vmm_lock; struct shared_ptr: internal.h) */
struct shared_ptr *exports, *imports;
size_t nexports, nimports, exports_cap, imports_cap;

static int shared_ptr_add(struct shared_ptr **v, size_t *n, size_t *cap, struct shared_ptr e)
{
    if (*n == *cap) {
        struct shared_ptr *m = realloc(*v, (*cap ? 2 * *cap : 16) * sizeof *m);
        if (!m)
            return -1;
        *v = m;
        *cap = *cap ? 2 * *cap : 16;
    }
    (*v)[(*n)++] = e;
    __atomic_thread_fence(__ATOMIC_RELEASE);
    return 0;
}

static struct shared_ptr *shared_ptr_find(struct shared_ptr *v, size_t n, uint64_t ptr)
{
    for (size_t i = 0; i < n; i++)
        if (v[i].ptr == ptr)
            return &v[i];
    return NULL;
}

/* A forked child holds nothing of its own: what it inherited holds through the parent's
 * description, which it keeps open (shim.c). */
void shared_atfork_child(void)
{
    memset(shared_holds, 0, sizeof shared_holds);
    nexports = nimports = 0;
}

/* === memory shared between processes: the hooks (see "the exporter's slice pays") === */

/* cuIpcGetMemHandle: the allocation's charge moves to a shared slot of its own, which the
 * exporter holds until it frees the allocation (or its context goes). */
SHIM_EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    ENTER(cuIpcGetMemHandle, pHandle, dptr);
    CUresult r = real_cuIpcGetMemHandle(pHandle, dptr);
    if (r != CUDA_SUCCESS || !pHandle)
        return r;
    pthread_mutex_lock(&vmm_lock);
    int exported = shared_ptr_find(exports, nexports, dptr) != NULL;
    pthread_mutex_unlock(&vmm_lock);
    int dev, ctx;
    uint64_t bytes;
    if (exported || forget_in(KEY_PTR | dptr, &dev, &bytes, &ctx))
        return r;   /* exported already, or nothing of ours (nothing charged) */
    int s = shared_new(dev, bytes, key_of(pHandle, sizeof *pHandle));
    pthread_mutex_lock(&vmm_lock);
    int ok = s >= 0 && shared_ptr_add(&exports, &nexports, &exports_cap,
                                      (struct shared_ptr){dptr, bytes, dev, s, ctx, 1}) == 0;
    pthread_mutex_unlock(&vmm_lock);
    if (ok)
        return r;
    if (s >= 0) {   /* no room to remember it: back on our own charge */
        charge_add(dev, S.slot, bytes);
        shared_release(s);
    }
    remember_in(KEY_PTR | dptr, dev, bytes, ctx);
    return CUDA_ERROR_OUT_OF_MEMORY;   /* fail closed: an importer could keep it uncounted */
}

/* After the driver's free of an exported allocation: the exporter lets go of its slot. */
int export_freed(CUdeviceptr dptr, CUresult r)
{
    int s = -1;
    pthread_mutex_lock(&vmm_lock);
    struct shared_ptr *e = shared_ptr_find(exports, nexports, dptr);
    if (e && r == CUDA_SUCCESS) {
        s = e->slot;
        *e = exports[--nexports];
    }
    pthread_mutex_unlock(&vmm_lock);
    shared_release(s);
    return s;
}

static CUresult ipc_open(CUresult (*real)(CUdeviceptr *, CUipcMemHandle, unsigned int), CUdeviceptr *pdptr,
                         CUipcMemHandle handle, unsigned int flags)
{
    int s = shared_hold(key_of(&handle, sizeof handle));   /* before the driver maps it */
    CUresult r = real(pdptr, handle, flags);
    if (r != CUDA_SUCCESS || !pdptr) {
        shared_release(s);
        return r;
    }
    pthread_mutex_lock(&vmm_lock);
    struct shared_ptr *im = shared_ptr_find(imports, nimports, *pdptr);
    if (im)
        im->opens++;   /* opened again: the driver counts one more reference */
    pthread_mutex_unlock(&vmm_lock);
    if (im) {
        shared_release(s);   /* held once per import */
        return r;
    }
    struct shared_ptr rec = {*pdptr, 0, -1, s, context_id(), 1};
    if (s < 0) {
        /* the exporter is not in this slice: this slice pays while it holds it */
        size_t size = 0;
        int dev = current_device();
        rec.ctx = context_id();
        if (dev >= 0 && REAL(cuMemGetAddressRange_v2) && real_cuMemGetAddressRange_v2(NULL, &size, *pdptr) == 0 &&
            size) {
            if (admit(dev, vgpu_alloc_footprint(size)) != CUDA_SUCCESS) {
                if (REAL(cuIpcCloseMemHandle))
                    real_cuIpcCloseMemHandle(*pdptr);
                return CUDA_ERROR_OUT_OF_MEMORY;
            }
            rec.dev = dev;
            rec.bytes = vgpu_alloc_footprint(size);
        }
    }
    pthread_mutex_lock(&vmm_lock);
    int ok = shared_ptr_add(&imports, &nimports, &imports_cap, rec) == 0;
    pthread_mutex_unlock(&vmm_lock);
    if (!ok)
        ERR("import table full: %llu bytes stay charged", (unsigned long long)rec.bytes);
    return r;
}

SHIM_EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    ENTER(cuIpcOpenMemHandle, pdptr, handle, Flags);
    return ipc_open(real_cuIpcOpenMemHandle, pdptr, handle, Flags);
}

SHIM_EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
    ENTER(cuIpcOpenMemHandle_v2, pdptr, handle, Flags);
    return ipc_open(real_cuIpcOpenMemHandle_v2, pdptr, handle, Flags);
}

SHIM_EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    ENTER(cuIpcCloseMemHandle, dptr);
    CUresult r = real_cuIpcCloseMemHandle(dptr);
    if (r != CUDA_SUCCESS)
        return r;
    struct shared_ptr gone = {0, 0, -1, -1, 0, 0};
    pthread_mutex_lock(&vmm_lock);
    struct shared_ptr *im = shared_ptr_find(imports, nimports, dptr);
    if (im && --im->opens == 0) {   /* the driver unmaps it at its last close */
        gone = *im;
        *im = imports[--nimports];
    }
    pthread_mutex_unlock(&vmm_lock);
    if (gone.slot >= 0)
        shared_release(gone.slot);
    else if (gone.bytes)
        refund(gone.dev, gone.bytes);
    return r;
}

/* A shareable handle: the handle's charge moves to a shared slot, which the handle holds
 * until it is released and unmapped.  (An exported descriptor that stays open after that
 * keeps the memory too, as the driver documents; the shim does not see descriptors.) */
SHIM_EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                                  CUmemAllocationHandleType handleType, unsigned long long flags)
{
    ENTER(cuMemExportToShareableHandle, shareableHandle, handle, handleType, flags);
    CUresult r = real_cuMemExportToShareableHandle(shareableHandle, handle, handleType, flags);
    if (r != CUDA_SUCCESS || !shareableHandle)
        return r;
    int posix = handleType == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    uint64_t key = shareable_key(posix ? (void *)(intptr_t) * (int *)shareableHandle : shareableHandle, handleType);
    pthread_mutex_lock(&vmm_lock);
    size_t i;
    struct vmm *v = vmm_find(handle, &i);
    int dev = v && v->shared < 0 && v->bytes && !v->unpaid ? v->dev : -1;
    uint64_t bytes = dev >= 0 ? v->bytes : 0;
    pthread_mutex_unlock(&vmm_lock);
    if (dev < 0 || !key)
        return r;   /* nothing of ours, shared already, or no key an importer could find */
    int s = shared_new(dev, bytes, key);
    pthread_mutex_lock(&vmm_lock);
    v = vmm_find(handle, &i);
    if (v && s >= 0)
        v->shared = s;
    pthread_mutex_unlock(&vmm_lock);
    if (v && s >= 0)
        return r;
    if (s >= 0) {   /* released meanwhile: settled as its own charge */
        charge_add(dev, S.slot, bytes);
        shared_release(s);
        return r;
    }
    if (posix)
        close(*(int *)shareableHandle);   /* fail closed: never handed out */
    return CUDA_ERROR_OUT_OF_MEMORY;
}

SHIM_EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                    CUmemAllocationHandleType shHandleType)
{
    ENTER(cuMemImportFromShareableHandle, handle, osHandle, shHandleType);
    int s = shared_hold(shareable_key(osHandle, shHandleType));   /* before the driver imports it */
    CUresult r = real_cuMemImportFromShareableHandle(handle, osHandle, shHandleType);
    if (r != CUDA_SUCCESS || !handle) {
        shared_release(s);
        return r;
    }
    struct vmm rec = {*handle, 0, -1, 0, 1, s, 0};
    CUmemAllocationProp prop;
    if (s < 0 && REAL(cuMemGetAllocationPropertiesFromHandle) &&
        real_cuMemGetAllocationPropertiesFromHandle(&prop, *handle) == CUDA_SUCCESS) {
        int dev = location_device(&prop.location);
        if (dev == LOCATION_REFUSED) {
            if (REAL(cuMemRelease))
                real_cuMemRelease(*handle);
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        rec.dev = dev;
        rec.unpaid = dev >= 0;   /* from another slice: this slice pays for what it maps */
    }
    pthread_mutex_lock(&vmm_lock);
    if (nvmm == vmm_cap) {
        struct vmm *n = realloc(vmms, (vmm_cap ? 2 * vmm_cap : 16) * sizeof *n);
        if (n) {
            vmms = n;
            vmm_cap = vmm_cap ? 2 * vmm_cap : 16;
        }
    }
    int ok = nvmm < vmm_cap;
    if (ok)
        vmms[nvmm++] = rec;
    pthread_mutex_unlock(&vmm_lock);
    if (!ok)
        ERR("VMM table full: an imported handle is not followed");
    return r;
}
