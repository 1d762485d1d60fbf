/* libvgpu.so — the in-container shim, loaded with LD_PRELOAD (or /etc/ld.so.preload).
 *
 * It sits between a CUDA program and the driver and keeps every process of a container
 * inside the container's memory cap on each device, and shows the program its slice
 * (cuMemGetInfo, cuDeviceTotalMem, NVML memory and process list) instead of the card.
 *
 * Four ways a program reaches the driver, all of which land here:
 *   1. direct linking: the hooks are exported under the driver's own symbol names;
 *   2. dlopen("libcuda.so.1") + dlsym: dlsym itself is hooked and hands out the hooks;
 *   3. cuGetProcAddress(_v2): hooked; hands out a hook only when the driver would hand out
 *      exactly the ABI that hook implements (abi_resolve.h), everything else untouched;
 *   4. NVML through dlopen("libnvidia-ml.so.1") + dlsym: as 2.
 *
 * Files (csrc/vgpu_region.h): <VGPU_DIR>/<VGPU_CONTAINER>/quota, mapped read-only, and
 * .../usage, mapped read-write and shared by all the container's processes.
 *
 * Failure policy — said once here, and in the README:
 *   fail open (pass everything through untouched):
 *     - no vgpu configuration at all (no VGPU_CONTAINER and no limit variables): the
 *       shim may be preloaded everywhere and must not disturb unmanaged programs;
 *     - a memory cap of "unlimited" on a device;
 *     - NVML calls when libnvidia-ml cannot be loaded (the program gets the driver's error);
 *     - cuGetProcAddress for an ABI newer than the shim knows (never a wrong-ABI hook).
 *   fail closed (every device allocation refused with CUDA_ERROR_OUT_OF_MEMORY, the view
 *   shows 0 bytes, one line on stderr saying why):
 *     - a malformed limit variable (never a silent no-limit);
 *     - a quota file that is missing (for a named container without limit variables),
 *       unreadable, truncated, or of another magic or ABI version;
 *     - a usage file that cannot be opened, created or validated;
 *     - no free process slot in the usage file;
 *     - a device index beyond the quota's device count, or with sm.max 0 (a device the
 *       slice was not given): allocations refused, and launches refused with
 *       CUDA_ERROR_NOT_PERMITTED (never made to wait forever).
 *   never: a crash or a hang.  A missing real driver symbol is CUDA_ERROR_NOT_FOUND.
 *
 * Hot path (an allocation under quota): no lock, no syscall, no log call — a CAS on the
 * container's counter, an add to this process's slot, and a lock-free table insert.
 */
#define _GNU_SOURCE
#include "abi_resolve.h"
#include "cuda_abi.h"
#include "hooks.h"
#include "nvml_abi.h"
#include "vgpu_region.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SHIM_EXPORT __attribute__((visibility("default")))
#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)
#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

/* === real symbols and the hook tables === */

#define DECLARE_CUDA(sym, base, ver, pt, ret, params) static ret(*real_##sym) params; SHIM_EXPORT ret sym params;
VGPU_CUDA_HOOKS(DECLARE_CUDA)
#define DECLARE_NVML(sym, ret, params) static ret(*real_##sym) params; SHIM_EXPORT ret sym params;
VGPU_NVML_HOOKS(DECLARE_NVML)
/* driver functions the shim calls but does not hook */
static CUresult (*real_cuCtxGetDevice)(CUdevice *);
static CUresult (*real_cuDeviceGetCount)(int *);
static CUresult (*real_cuCtxGetCurrent)(CUcontext *);
static CUresult (*real_cuCtxPushCurrent_v2)(CUcontext);
static CUresult (*real_cuCtxPopCurrent_v2)(CUcontext *);
static CUresult (*real_cuStreamGetCtx)(CUstream, CUcontext *);
static CUresult (*real_cuEventCreate)(CUevent *, unsigned int);
static CUresult (*real_cuEventRecord)(CUevent, CUstream);
static CUresult (*real_cuEventRecord_ptsz)(CUevent, CUstream);
static CUresult (*real_cuEventQuery)(CUevent);
static CUresult (*real_cuEventSynchronize)(CUevent);
static CUresult (*real_cuEventElapsedTime)(float *, CUevent, CUevent);
static CUresult (*real_cuEventDestroy_v2)(CUevent);
static nvmlReturn_t (*real_nvmlDeviceGetIndex)(nvmlDevice_t, unsigned int *);
static nvmlReturn_t (*real_nvmlInit_v2)(void);
static nvmlReturn_t (*real_nvmlDeviceGetHandleByIndex_v2)(unsigned int, nvmlDevice_t *);
static nvmlReturn_t (*real_nvmlDeviceGetProcessUtilization)(nvmlDevice_t, nvmlProcessUtilizationSample_t *,
                                                             unsigned int *, unsigned long long);

struct hook {
    const char *symbol, *base;
    int version, per_thread;
    void *hook;
    void **real;
};
#define AS_CUDA_HOOK(sym, base, ver, pt, ret, params) {#sym, #base, ver, pt, (void *)sym, (void **)&real_##sym},
static const struct hook cuda_hooks[] = {VGPU_CUDA_HOOKS(AS_CUDA_HOOK)};
#define AS_NVML_HOOK(sym, ret, params) {#sym, NULL, 0, 0, (void *)sym, (void **)&real_##sym},
static const struct hook nvml_hooks[] = {VGPU_NVML_HOOKS(AS_NVML_HOOK)};
#define NHOOKS(t) (sizeof(t) / sizeof((t)[0]))

/* === state === */

enum mode { MODE_PASS, MODE_ENFORCE, MODE_DENY };
#define LOCK_BASE (1ll << 40)   /* usage slot i is owned by an OFD lock on this byte + i */
#define KEY_PTR 0ull            /* allocation table key spaces (top bits): device pointers, */
#define KEY_ARRAY (2ull << 62)  /* array handles (VMM handles are tracked apart, with mappings) */
#define TABLE_BITS 20
#define TABLE_SIZE (1u << TABLE_BITS)
#define TOMBSTONE 1ull
#define REAP_INTERVAL_NS 200000000ull

struct entry { uint64_t key, value; };   /* value: bytes << 4 | device */

static struct {
    int ready;                  /* atomic: init done */
    pthread_mutex_t lock;       /* init, slot claim and reaping within this process */
    enum mode mode;
    int log_level;              /* 0 errors, 1 info, 2 debug (VGPU_LOG) */
    const struct vgpu_quota *quota;
    struct vgpu_usage *usage;
    int usage_fd;
    int slot;
    char usage_path[4096];
    struct entry *table;
    uint64_t next_reap_ns;
    void *cuda, *nvml;
    int nvml_ready;
} S = {.lock = PTHREAD_MUTEX_INITIALIZER, .usage_fd = -1, .slot = -1};

/* The shim is preloaded (loaded at startup), so its thread-locals can use the static TLS
 * model: no __tls_get_addr call on every hook. */
#define TLS __thread __attribute__((tls_model("initial-exec")))
static TLS int in_init;   /* recursion guard: hooks called during init pass through */
static void nvml_resolve(void);
static void forget_samples(void);

/* === log === */

static void vlog(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void vlog(int level, const char *fmt, ...)
{
    if (level > S.log_level)
        return;
    static const char *names[] = {"error", "info", "debug"};
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "vgpu[%d]: %s: %s\n", (int)getpid(), names[level], buf);
}
#define ERR(...) vlog(0, __VA_ARGS__)
#define INFO(...) vlog(1, __VA_ARGS__)
#define DEBUG(...) vlog(2, __VA_ARGS__)

static void deny(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void deny(const char *fmt, ...)
{
    char buf[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    ERR("%s; refusing GPU memory allocations (fail closed)", buf);
    S.mode = MODE_DENY;
}

/* === configuration: limit variables === */

/* "4Gi", "512Mi", "1073741824" (VGPU_*) or HAMi-core's "4096m", "4g" (binary units). */
static int parse_size(const char *s, int hami, uint64_t *out)
{
    char *end;
    if (*s < '0' || *s > '9')   /* strtoull would accept " -1" and wrap it to "unlimited" */
        return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return -1;
    int shift = 0;
    if (!hami) {
        static const char *units[] = {"", "Ki", "Mi", "Gi", "Ti"};
        int i = 0;
        while (i < 5 && strcmp(end, units[i]))
            i++;
        if (i == 5)
            return -1;
        shift = 10 * i;
    } else {
        const char *units = "kmgt";
        const char *u = *end ? strchr(units, end[0] | 0x20) : NULL;
        if (*end && (!u || end[1]))
            return -1;
        shift = u ? 10 * (int)(u - units + 1) : 0;
    }
    if (shift && v > (~0ull >> shift))
        return -1;
    *out = v << shift;
    return 0;
}

/* "50%" or "50" -> 5000 (1/100 percent).  HAMi-core's 0 means no limit. */
static int parse_share(const char *s, int hami, uint32_t *out)
{
    char *end;
    if (*s < '0' || *s > '9')   /* no blanks, signs, "inf" or "nan" */
        return -1;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || (*end && strcmp(end, "%")))
        return -1;
    if (hami && v == 0)
        v = 100;
    if (!(v > 0 && v <= 100))
        return -1;
    *out = (uint32_t)(v * 100 + 0.5);
    return 0;
}

/* The value for device i: per-device variable first, then the all-devices one; ours
 * before HAMi-core's.  Returns the variable's name, or NULL when none is set. */
static const char *limit_var(const char *vgpu, const char *hami, int dev, const char **value, int *is_hami)
{
    static TLS char name[64];
    const char *bases[2] = {vgpu, hami};
    for (int per_device = 1; per_device >= 0; per_device--)
        for (int h = 0; h < 2; h++) {
            if (per_device)
                snprintf(name, sizeof name, "%s_%d", bases[h], dev);
            else
                snprintf(name, sizeof name, "%s", bases[h]);
            const char *v = getenv(name);
            if (v && *v) {
                *value = v;
                *is_hami = h;
                return name;
            }
        }
    return NULL;
}

/* Fill a quota from the environment.  Returns 1 if any limit variable is set, 0 if none,
 * -1 (after saying why) if one is malformed. */
static int quota_from_env(struct vgpu_quota *q, const char *name)
{
    memset(q, 0, sizeof *q);
    q->magic = VGPU_QUOTA_MAGIC;
    q->abi_version = VGPU_ABI_VERSION;
    q->size = sizeof *q;
    q->generation = 2;
    q->device_count = VGPU_MAX_DEVICES;
    snprintf(q->name, sizeof q->name, "%s", name);
    int any = 0;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        struct vgpu_quota_device *qd = &q->devices[d];
        const char *value, *var;
        int hami;
        qd->memory_max = qd->memory_request = qd->memory_limit = VGPU_UNLIMITED;
        qd->sm_max = qd->sm_request = qd->sm_limit = 10000;
        if ((var = limit_var("VGPU_MEMORY_LIMIT", "CUDA_DEVICE_MEMORY_LIMIT", d, &value, &hami))) {
            any = 1;
            if (parse_size(value, hami, &qd->memory_max)) {
                deny("%s=%s is not a memory size (use bytes or Ki/Mi/Gi/Ti, e.g. 4Gi%s)", var, value,
                     hami ? "; or 4096m" : "");
                return -1;
            }
            qd->memory_request = qd->memory_limit = qd->memory_max;
        }
        if ((var = limit_var("VGPU_SM_LIMIT", "CUDA_DEVICE_SM_LIMIT", d, &value, &hami))) {
            any = 1;
            if (parse_share(value, hami, &qd->sm_max)) {
                deny("%s=%s is not a share of the GPU (use 1..100, e.g. 50%%)", var, value);
                return -1;
            }
            qd->sm_request = qd->sm_limit = qd->sm_max;
        }
    }
    return any;
}

/* === configuration: files === */

static int valid_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n >= VGPU_NAME_MAX || s[0] == '.' || s[0] == '-')
        return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
              *s == '-' || *s == '_' || *s == '.'))
            return 0;
    return 1;
}

/* Standalone mode: write the quota made from the environment, unless one exists (a
 * controller's, or an earlier process's: the first one wins, atomically). */
static void create_quota(const char *path, const struct vgpu_quota *q)
{
    char tmp[4200];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid()) >= sizeof tmp)
        return;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0)
        return;   /* reported when opening the quota fails */
    int ok = write(fd, q, sizeof *q) == (ssize_t)sizeof *q;
    close(fd);
    if (ok && link(tmp, path) && errno != EEXIST)
        ERR("cannot create %s: %s", path, strerror(errno));
    unlink(tmp);
}

static const struct vgpu_quota *map_quota(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        deny("cannot open quota file %s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    void *m = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(struct vgpu_quota))
        m = mmap(NULL, sizeof(struct vgpu_quota), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        deny("quota file %s is truncated (%lld bytes, need %zu)", path, (long long)st.st_size,
             sizeof(struct vgpu_quota));
        return NULL;
    }
    const struct vgpu_quota *q = m;
    if (q->magic != VGPU_QUOTA_MAGIC || q->abi_version != VGPU_ABI_VERSION || q->size != sizeof *q ||
        q->device_count > VGPU_MAX_DEVICES) {
        deny("quota file %s is not a vgpu quota of ABI version %d (magic %llx, version %u)", path,
             VGPU_ABI_VERSION, (unsigned long long)q->magic, q->abi_version);
        munmap(m, sizeof *q);
        return NULL;
    }
    return q;
}

static struct vgpu_usage *map_usage(const char *path)
{
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        deny("cannot open usage file %s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    int bad = fstat(fd, &st) != 0;
    if (!bad && st.st_size == 0) {
        /* a new file: one process writes the header, the others wait for it (only then) */
        flock(fd, LOCK_EX);
        struct vgpu_usage *u = calloc(1, sizeof *u);
        bad = !u || fstat(fd, &st) != 0;
        if (!bad && st.st_size == 0) {
            u->magic = VGPU_USAGE_MAGIC;
            u->abi_version = VGPU_ABI_VERSION;
            u->size = sizeof *u;
            bad = pwrite(fd, u, sizeof *u, 0) != (ssize_t)sizeof *u;
        }
        free(u);
        flock(fd, LOCK_UN);
    }
    void *m = MAP_FAILED;
    if (!bad && fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(struct vgpu_usage))
        m = mmap(NULL, sizeof(struct vgpu_usage), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        deny("usage file %s cannot be mapped (%lld bytes, need %zu)", path, (long long)st.st_size,
             sizeof(struct vgpu_usage));
        close(fd);
        return NULL;
    }
    struct vgpu_usage *u = m;
    if (u->magic != VGPU_USAGE_MAGIC || u->abi_version != VGPU_ABI_VERSION || u->size != sizeof *u) {
        deny("usage file %s is not a vgpu usage file of ABI version %d", path, VGPU_ABI_VERSION);
        munmap(m, sizeof *u);
        close(fd);
        return NULL;
    }
    S.usage_fd = fd;
    return u;
}

/* === process slots === */

static int slot_lock(int fd, int slot, short type)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = LOCK_BASE + slot, .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &fl);
}

/* Give back what the process in `p` held: its memory leaves the container's counters. */
static void drain_slot(struct vgpu_usage_proc *p)
{
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        uint64_t held = __atomic_exchange_n(&p->memory[d], 0, __ATOMIC_ACQ_REL);
        if (held)
            __atomic_sub_fetch(&S.usage->devices[d].memory_current, held, __ATOMIC_ACQ_REL);
    }
    STORE(&p->pid, 0);
}

/* Called with S.lock held. */
static void claim_slot(void)
{
    for (int i = 0; i < VGPU_MAX_PROCS; i++) {
        if (slot_lock(S.usage_fd, i, F_WRLCK))
            continue;   /* a live process holds it */
        struct vgpu_usage_proc *p = &S.usage->procs[i];
        if (LOAD(&p->pid))
            drain_slot(p);   /* its previous owner died without cleaning up */
        memset(p->comm, 0, sizeof p->comm);
        prctl(PR_GET_NAME, p->comm);   /* at most 16 bytes */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        p->started_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
        STORE(&p->pid, (int32_t)getpid());
        S.slot = i;
        return;
    }
    deny("all %d process slots of %s are taken", VGPU_MAX_PROCS, S.usage_path);
}

/* Return the slots of dead processes (their lock is free) to the container. */
static void reap_dead(void)
{
    pthread_mutex_lock(&S.lock);   /* our own OFD would re-grant a lock we already hold */
    for (int i = 0; i < VGPU_MAX_PROCS; i++) {
        struct vgpu_usage_proc *p = &S.usage->procs[i];
        if (i == S.slot || !LOAD(&p->pid) || slot_lock(S.usage_fd, i, F_WRLCK))
            continue;
        INFO("returning the memory of dead process %d", (int)LOAD(&p->pid));
        drain_slot(p);
        slot_lock(S.usage_fd, i, F_UNLCK);
    }
    pthread_mutex_unlock(&S.lock);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* For views: reap at most every REAP_INTERVAL_NS, so a crashed process's memory shows
 * as free again within a fraction of a second without a syscall storm. */
static void maybe_reap(void)
{
    uint64_t t = now_ns();
    if (t >= LOAD(&S.next_reap_ns)) {
        STORE(&S.next_reap_ns, t + REAP_INTERVAL_NS);
        reap_dead();
    }
}

__attribute__((destructor)) static void release_slot(void)
{
    if (S.slot < 0 || !S.usage)
        return;
    drain_slot(&S.usage->procs[S.slot]);
    slot_lock(S.usage_fd, S.slot, F_UNLCK);
    S.slot = -1;
}

static struct entry *map_table(void)
{
    void *t = mmap(NULL, sizeof(struct entry) * TABLE_SIZE, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return t == MAP_FAILED ? NULL : t;
}

/* VMM handles and pools, kept under a lock (not hot paths): see "where memory comes from" */
struct vmm { uint64_t handle, bytes; int dev, mappings, released; };
struct mapping { uint64_t ptr, size, handle; };
struct pool { CUmemoryPool pool; int dev; };
static pthread_mutex_t vmm_lock = PTHREAD_MUTEX_INITIALIZER;
static struct vmm *vmms;
static struct mapping *mappings;
static struct pool *pools;
static size_t nvmm, vmm_cap, nmappings, mappings_cap, npools, pools_cap;

static void atfork_child(void)
{
    /* The child shares the parent's lock (same open file description) and inherited a
     * copy of its allocation table: it gets its own of both. */
    pthread_mutex_init(&S.lock, NULL);
    pthread_mutex_init(&vmm_lock, NULL);
    S.slot = -1;   /* claimed on the child's first allocation: forked helpers that never
                    * touch the GPU cost no slot */
    if (S.usage_fd >= 0) {
        close(S.usage_fd);
        S.usage_fd = open(S.usage_path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        if (S.usage_fd < 0)
            deny("cannot reopen %s after fork: %s", S.usage_path, strerror(errno));
    }
    if (S.table)   /* a fresh, untouched mapping: no 16 MiB memset per fork */
        S.table = map_table();
    nvmm = npools = 0;
    forget_samples();
}

/* === init (lazy, once, thread-safe; the constructor does nothing) === */

static void *(*real_dlsym)(void *, const char *);

static void resolve_real_dlsym(void)
{
    if (LOAD(&real_dlsym))
        return;
    void *f = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!f)
        f = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    if (!f)
        f = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.17");
    STORE(&real_dlsym, (void *(*)(void *, const char *))f);
}

static void resolve_cuda(void)
{
    S.cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!S.cuda) {
        ERR("cannot load libcuda.so.1: %s", dlerror());
        return;
    }
    for (size_t i = 0; i < NHOOKS(cuda_hooks); i++)
        *cuda_hooks[i].real = real_dlsym(S.cuda, cuda_hooks[i].symbol);
    *(void **)&real_cuCtxGetDevice = real_dlsym(S.cuda, "cuCtxGetDevice");
    *(void **)&real_cuDeviceGetCount = real_dlsym(S.cuda, "cuDeviceGetCount");
    *(void **)&real_cuCtxGetCurrent = real_dlsym(S.cuda, "cuCtxGetCurrent");
    *(void **)&real_cuCtxPushCurrent_v2 = real_dlsym(S.cuda, "cuCtxPushCurrent_v2");
    *(void **)&real_cuCtxPopCurrent_v2 = real_dlsym(S.cuda, "cuCtxPopCurrent_v2");
    *(void **)&real_cuStreamGetCtx = real_dlsym(S.cuda, "cuStreamGetCtx");
    *(void **)&real_cuEventCreate = real_dlsym(S.cuda, "cuEventCreate");
    *(void **)&real_cuEventRecord = real_dlsym(S.cuda, "cuEventRecord");
    *(void **)&real_cuEventRecord_ptsz = real_dlsym(S.cuda, "cuEventRecord_ptsz");
    *(void **)&real_cuEventQuery = real_dlsym(S.cuda, "cuEventQuery");
    *(void **)&real_cuEventSynchronize = real_dlsym(S.cuda, "cuEventSynchronize");
    *(void **)&real_cuEventElapsedTime = real_dlsym(S.cuda, "cuEventElapsedTime");
    *(void **)&real_cuEventDestroy_v2 = real_dlsym(S.cuda, "cuEventDestroy_v2");
}

static void configure(void)
{
    const char *lvl = getenv("VGPU_LOG");
    S.log_level = !lvl ? 0 : !strcmp(lvl, "debug") ? 2 : !strcmp(lvl, "info") ? 1 : 0;

    const char *name = getenv("VGPU_CONTAINER");
    struct vgpu_quota env_quota;
    int from_env = quota_from_env(&env_quota, name && *name ? name : "default");
    if (from_env < 0)
        return;   /* denied, with the reason */
    if (!from_env && !(name && *name)) {
        S.mode = MODE_PASS;   /* not a managed program */
        DEBUG("no VGPU_CONTAINER and no limits: passing through");
        return;
    }
    if (!name || !*name)
        name = "default";
    if (!valid_name(name))
        return deny("VGPU_CONTAINER=%s is not a valid name (letters, digits, '-', '_', '.')", name);

    const char *dir = getenv("VGPU_DIR");
    char tmpdir[64], cdir[4096], qpath[4096];
    if (!dir || !*dir) {
        dir = "/run/vgpu";
        if (from_env && access(dir, W_OK)) {   /* standalone without root: a private dir */
            snprintf(tmpdir, sizeof tmpdir, "/tmp/vgpu-%u", (unsigned)getuid());
            dir = tmpdir;
        }
    }
    if ((size_t)snprintf(cdir, sizeof cdir, "%s/%s", dir, name) >= sizeof cdir - 16)
        return deny("VGPU_DIR=%s is too long", dir);
    snprintf(qpath, sizeof qpath, "%.4080s/quota", cdir);
    snprintf(S.usage_path, sizeof S.usage_path, "%.4080s/usage", cdir);
    if (from_env && access(qpath, F_OK)) {
        mkdir(dir, 0755);
        mkdir(cdir, 0755);
        create_quota(qpath, &env_quota);
    }
    if (!(S.quota = map_quota(qpath)))
        return;
    if (from_env && memcmp(S.quota->devices, env_quota.devices, sizeof env_quota.devices))
        INFO("%s already exists; its limits apply, not the environment's", qpath);
    if (!(S.usage = map_usage(S.usage_path)))
        return;
    if (!(S.table = map_table()))
        return deny("cannot map the allocation table");
    S.mode = MODE_ENFORCE;
    claim_slot();
    INFO("container %s: quota %s, usage %s, slot %d", name, qpath, S.usage_path, S.slot);
}

static void init_slow(void)
{
    if (in_init)
        return;
    pthread_mutex_lock(&S.lock);
    if (!S.ready) {
        in_init = 1;
        resolve_real_dlsym();
        resolve_cuda();
        configure();
        pthread_atfork(NULL, NULL, atfork_child);
        in_init = 0;
        STORE(&S.ready, 1);
    }
    pthread_mutex_unlock(&S.lock);
}

static inline void ensure_init(void)
{
    if (UNLIKELY(!LOAD(&S.ready)))
        init_slow();
}

/* Start of every CUDA hook: init, a missing driver symbol is an error, unmanaged
 * programs (and calls made while initialising) go straight to the driver. */
#define ENTER(sym, ...)                                 \
    ensure_init();                                      \
    if (UNLIKELY(!real_##sym))                          \
        return CUDA_ERROR_NOT_FOUND;                    \
    if (UNLIKELY(S.mode == MODE_PASS || in_init))       \
        return real_##sym(__VA_ARGS__)

/* === memory accounting === */

static inline uint64_t memory_cap(int dev)
{
    if (S.mode != MODE_ENFORCE || dev < 0 || (uint32_t)dev >= S.quota->device_count)
        return 0;
    return LOAD(&S.quota->devices[dev].memory_max);   /* a resize shows up on the next call */
}

/* Reserve before allocating: check-and-add against the cap, so concurrent processes
 * can never take the container over it.  Refused -> one reap of dead processes, retry. */
static CUresult admit(int dev, uint64_t bytes)
{
    if (UNLIKELY(S.slot < 0) && S.mode == MODE_ENFORCE) {   /* a forked child's first */
        pthread_mutex_lock(&S.lock);
        if (S.slot < 0 && S.usage_fd >= 0)
            claim_slot();
        pthread_mutex_unlock(&S.lock);
    }
    if (S.slot < 0 || S.mode != MODE_ENFORCE)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct vgpu_usage_device *u = &S.usage->devices[dev];
    for (int attempt = 0;; attempt++) {
        uint64_t cap = memory_cap(dev);
        uint64_t cur = LOAD(&u->memory_current);
        int fits;
        while ((fits = bytes <= cap && cur <= cap - bytes) &&
               !__atomic_compare_exchange_n(&u->memory_current, &cur, cur + bytes, 1, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE))
            ;
        if (fits) {
            /* counter first, slot second: a crash in between over-counts (safe side) */
            __atomic_add_fetch(&S.usage->procs[S.slot].memory[dev], bytes, __ATOMIC_ACQ_REL);
            uint64_t peak = LOAD(&u->memory_peak), now = cur + bytes;
            while (peak < now && !__atomic_compare_exchange_n(&u->memory_peak, &peak, now, 1,
                                                              __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                ;
            return CUDA_SUCCESS;
        }
        if (attempt == 1) {
            __atomic_add_fetch(&u->oom_refusals, 1, __ATOMIC_RELAXED);
            DEBUG("refused %llu bytes on device %d: %llu of %llu in use", (unsigned long long)bytes, dev,
                  (unsigned long long)cur, (unsigned long long)cap);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        reap_dead();
    }
}

static void refund(int dev, uint64_t bytes)
{
    if (S.slot < 0 || !bytes)
        return;
    __atomic_sub_fetch(&S.usage->procs[S.slot].memory[dev], bytes, __ATOMIC_ACQ_REL);
    __atomic_sub_fetch(&S.usage->devices[dev].memory_current, bytes, __ATOMIC_ACQ_REL);
}

/* Lock-free open-addressing table: what each live allocation was charged, and where. */
static inline uint32_t slot_of(uint64_t key) { return (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - TABLE_BITS)); }

static int remember(uint64_t key, int dev, uint64_t bytes)
{
    if (!S.table)
        return -1;
    for (uint32_t i = slot_of(key), n = 0; n < TABLE_SIZE; i = (i + 1) & (TABLE_SIZE - 1), n++) {
        uint64_t k = LOAD(&S.table[i].key);
        if ((k == 0 || k == TOMBSTONE) &&
            __atomic_compare_exchange_n(&S.table[i].key, &k, key, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            STORE(&S.table[i].value, bytes << 4 | (uint64_t)dev);
            return 0;
        }
    }
    return -1;
}

static int forget(uint64_t key, int *dev, uint64_t *bytes)
{
    if (!S.table)   /* failed closed before the table existed: nothing was charged */
        return -1;
    for (uint32_t i = slot_of(key), n = 0; n < TABLE_SIZE; i = (i + 1) & (TABLE_SIZE - 1), n++) {
        uint64_t k = LOAD(&S.table[i].key);
        if (k == 0)
            return -1;
        if (k == key) {
            uint64_t v = LOAD(&S.table[i].value);
            if (__atomic_compare_exchange_n(&S.table[i].key, &k, TOMBSTONE, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE)) {
                *dev = (int)(v & 15);
                *bytes = v >> 4;
                return 0;
            }
        }
    }
    return -1;
}

static int current_device(void)
{
    CUdevice d;
    if (!real_cuCtxGetDevice || real_cuCtxGetDevice(&d) != CUDA_SUCCESS || d < 0 || d >= VGPU_MAX_DEVICES)
        return -1;
    return d;
}

/* The device a stream's work (and its stream-ordered allocations) lands on. */
static int stream_device(CUstream stream)
{
    CUcontext ctx, cur = NULL, popped;
    if (stream == NULL || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD ||
        !real_cuStreamGetCtx || !real_cuCtxGetCurrent || real_cuStreamGetCtx(stream, &ctx) != CUDA_SUCCESS ||
        real_cuCtxGetCurrent(&cur) != CUDA_SUCCESS || ctx == cur)
        return current_device();
    if (!real_cuCtxPushCurrent_v2 || !real_cuCtxPopCurrent_v2 || real_cuCtxPushCurrent_v2(ctx) != CUDA_SUCCESS)
        return -1;
    int dev = current_device();
    real_cuCtxPopCurrent_v2(&popped);
    return dev;
}

/* Charge `bytes` on `dev`, run the real allocation, remember the result under `key`. */
#define CHARGED(dev, bytes, real_call, key)                                                    \
    do {                                                                                       \
        CUresult r_ = admit((dev), (bytes));                                                   \
        if (r_ != CUDA_SUCCESS)                                                                \
            return r_;                                                                         \
        r_ = (real_call);                                                                      \
        if (r_ != CUDA_SUCCESS)                                                                \
            refund((dev), (bytes));                                                            \
        else if (remember((key), (dev), (bytes)))                                              \
            ERR("allocation table full: %llu bytes stay charged", (unsigned long long)(bytes)); \
        return r_;                                                                             \
    } while (0)

/* Forget `key`, run the real free, refund on success (re-remember on failure). */
#define RELEASED(real_call, key)                        \
    do {                                                \
        int dev_;                                       \
        uint64_t bytes_;                                \
        int known_ = forget((key), &dev_, &bytes_) == 0; \
        CUresult r_ = (real_call);                      \
        if (known_ && r_ == CUDA_SUCCESS)               \
            refund(dev_, bytes_);                       \
        else if (known_)                                \
            remember((key), dev_, bytes_);              \
        return r_;                                      \
    } while (0)

/* === allocate === */

SHIM_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    ENTER(cuMemAlloc_v2, dptr, bytesize);
    int dev = current_device();
    if (dev < 0 || !dptr || !bytesize)
        return real_cuMemAlloc_v2(dptr, bytesize);   /* the driver reports the error */
    CHARGED(dev, bytesize, real_cuMemAlloc_v2(dptr, bytesize), KEY_PTR | *dptr);
}

SHIM_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                        unsigned int ElementSizeBytes)
{
    ENTER(cuMemAllocPitch_v2, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    int dev = current_device();
    if (dev < 0 || !dptr || !pPitch || !WidthInBytes || !Height)
        return real_cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    /* the pitch is known only afterwards: reserve at the usual 512-byte alignment, then
     * settle the difference */
    uint64_t guess = (WidthInBytes + 511) / 512 * 512 * (uint64_t)Height;
    CUresult r = admit(dev, guess);
    if (r != CUDA_SUCCESS)
        return r;
    r = real_cuMemAllocPitch_v2(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (r != CUDA_SUCCESS) {
        refund(dev, guess);
        return r;
    }
    uint64_t actual = (uint64_t)*pPitch * Height;
    if (actual > guess && admit(dev, actual - guess) != CUDA_SUCCESS) {
        refund(dev, guess);
        if (real_cuMemFree_v2)
            real_cuMemFree_v2(*dptr);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (actual < guess)
        refund(dev, guess - actual);
    if (remember(KEY_PTR | *dptr, dev, actual))
        ERR("allocation table full: %llu bytes stay charged", (unsigned long long)actual);
    return r;
}

SHIM_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    ENTER(cuMemAllocManaged, dptr, bytesize, flags);
    int dev = current_device();
    if (dev < 0 || !dptr || !bytesize)
        return real_cuMemAllocManaged(dptr, bytesize, flags);
    CHARGED(dev, bytesize, real_cuMemAllocManaged(dptr, bytesize, flags), KEY_PTR | *dptr);
}

/* Stream-ordered allocations come from the stream's device. */
static CUresult alloc_async(CUresult (*real)(CUdeviceptr *, size_t, CUstream), CUdeviceptr *dptr,
                            size_t bytesize, CUstream hStream)
{
    int dev = dptr && bytesize ? stream_device(hStream) : -1;
    if (dev < 0)
        return real(dptr, bytesize, hStream);
    CHARGED(dev, bytesize, real(dptr, bytesize, hStream), KEY_PTR | *dptr);
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

static void note_pool(CUmemoryPool pool, int dev)
{
    pthread_mutex_lock(&vmm_lock);
    size_t i = 0;
    while (i < npools && pools[i].pool != pool)
        i++;
    if (i == npools && npools == pools_cap) {
        struct pool *n = realloc(pools, (pools_cap = pools_cap ? 2 * pools_cap : 16) * sizeof *n);
        if (n)
            pools = n;
        else
            pools_cap = npools;
    }
    if (i < pools_cap) {
        pools[i] = (struct pool){pool, dev};
        if (i == npools)
            npools++;
    }
    pthread_mutex_unlock(&vmm_lock);
}

/* A pool's memory lives on the pool's device (known when the program got the pool
 * through a hooked call), else on the stream's. */
static int pool_device(CUmemoryPool pool, CUstream stream)
{
    int dev = -1;
    pthread_mutex_lock(&vmm_lock);
    for (size_t i = 0; i < npools; i++)
        if (pools[i].pool == pool)
            dev = pools[i].dev;
    pthread_mutex_unlock(&vmm_lock);
    return dev >= 0 ? dev : stream_device(stream);
}

static CUresult alloc_from_pool(CUresult (*real)(CUdeviceptr *, size_t, CUmemoryPool, CUstream),
                                CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream)
{
    int dev = dptr && bytesize ? pool_device(pool, hStream) : -1;
    if (dev < 0)
        return real(dptr, bytesize, pool, hStream);
    CHARGED(dev, bytesize, real(dptr, bytesize, pool, hStream), KEY_PTR | *dptr);
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

/* VMM: a handle's memory stays on the device while it is mapped, even after release,
 * so the budget comes back when it is both released and unmapped (as the driver frees). */
SHIM_EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                                 unsigned long long flags)
{
    ENTER(cuMemCreate, handle, size, prop, flags);
    /* CU_MEM_LOCATION_TYPE_DEVICE = 1: the memory lives on prop->location.id */
    int dev = prop && prop->location.type == 1 ? prop->location.id : -1;
    if (dev < 0 || dev >= VGPU_MAX_DEVICES || !handle || !size)
        return real_cuMemCreate(handle, size, prop, flags);
    CUresult r = admit(dev, size);
    if (r != CUDA_SUCCESS)
        return r;
    r = real_cuMemCreate(handle, size, prop, flags);
    if (r != CUDA_SUCCESS) {
        refund(dev, size);
        return r;
    }
    pthread_mutex_lock(&vmm_lock);
    if (nvmm == vmm_cap) {
        struct vmm *n = realloc(vmms, (vmm_cap ? 2 * vmm_cap : 16) * sizeof *n);
        if (n) {
            vmms = n;
            vmm_cap = vmm_cap ? 2 * vmm_cap : 16;
        }
    }
    if (nvmm < vmm_cap)
        vmms[nvmm++] = (struct vmm){*handle, size, dev, 0, 0};
    else
        ERR("VMM table full: %zu bytes stay charged", size);
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

/* Called with vmm_lock held: give the budget back once released and unmapped. */
static void vmm_settle(size_t i)
{
    if (!vmms[i].released || vmms[i].mappings > 0)
        return;
    refund(vmms[i].dev, vmms[i].bytes);
    vmms[i] = vmms[--nvmm];
}

static struct vmm *vmm_find(uint64_t handle, size_t *index)
{
    for (size_t i = 0; i < nvmm; i++)
        if (vmms[i].handle == handle) {
            *index = i;
            return &vmms[i];
        }
    return NULL;
}

SHIM_EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                              unsigned long long flags)
{
    ENTER(cuMemMap, ptr, size, offset, handle, flags);
    CUresult r = real_cuMemMap(ptr, size, offset, handle, flags);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&vmm_lock);
    size_t i;
    struct vmm *v = vmm_find(handle, &i);
    if (v && nmappings == mappings_cap) {
        struct mapping *n = realloc(mappings, (mappings_cap ? 2 * mappings_cap : 16) * sizeof *n);
        if (n) {
            mappings = n;
            mappings_cap = mappings_cap ? 2 * mappings_cap : 16;
        }
    }
    if (v && nmappings < mappings_cap) {
        mappings[nmappings++] = (struct mapping){ptr, size, handle};
        v->mappings++;
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

SHIM_EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    ENTER(cuMemUnmap, ptr, size);
    CUresult r = real_cuMemUnmap(ptr, size);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&vmm_lock);
    for (size_t m = 0; m < nmappings;) {
        if (mappings[m].ptr < ptr || mappings[m].ptr >= ptr + size) {
            m++;
            continue;
        }
        size_t i;
        struct vmm *v = vmm_find(mappings[m].handle, &i);
        mappings[m] = mappings[--nmappings];
        if (v) {
            v->mappings--;
            vmm_settle(i);
        }
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

SHIM_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps)
{
    ENTER(cuMemPoolCreate, pool, poolProps);
    CUresult r = real_cuMemPoolCreate(pool, poolProps);
    if (r == CUDA_SUCCESS && pool && poolProps && poolProps->location.type == 1)
        note_pool(*pool, poolProps->location.id);
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

/* Bytes an array takes; formats of unknown element size are charged as 4 x 32-bit. */
static uint64_t array_charge(CUDA_ARRAY3D_DESCRIPTOR d, unsigned levels)
{
    uint64_t b = vgpu_array_bytes(&d, levels);
    if (!b) {
        d.Format = 0x20;
        d.NumChannels = 4;
        b = vgpu_array_bytes(&d, levels);
    }
    return b;
}

SHIM_EXPORT CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray)
{
    ENTER(cuArrayCreate_v2, pHandle, pAllocateArray);
    int dev = current_device();
    if (dev < 0 || !pHandle || !pAllocateArray)
        return real_cuArrayCreate_v2(pHandle, pAllocateArray);
    const CUDA_ARRAY_DESCRIPTOR *a = pAllocateArray;
    uint64_t bytes = array_charge((CUDA_ARRAY3D_DESCRIPTOR){a->Width, a->Height, 0, a->Format, a->NumChannels, 0}, 1);
    CHARGED(dev, bytes, real_cuArrayCreate_v2(pHandle, pAllocateArray), KEY_ARRAY | (uint64_t)(uintptr_t)*pHandle);
}

SHIM_EXPORT CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray)
{
    ENTER(cuArray3DCreate_v2, pHandle, pAllocateArray);
    int dev = current_device();
    if (dev < 0 || !pHandle || !pAllocateArray)
        return real_cuArray3DCreate_v2(pHandle, pAllocateArray);
    uint64_t bytes = array_charge(*pAllocateArray, 1);
    CHARGED(dev, bytes, real_cuArray3DCreate_v2(pHandle, pAllocateArray), KEY_ARRAY | (uint64_t)(uintptr_t)*pHandle);
}

SHIM_EXPORT CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,
                                            unsigned int numMipmapLevels)
{
    ENTER(cuMipmappedArrayCreate, pHandle, pMipmappedArrayDesc, numMipmapLevels);
    int dev = current_device();
    if (dev < 0 || !pHandle || !pMipmappedArrayDesc || !numMipmapLevels)
        return real_cuMipmappedArrayCreate(pHandle, pMipmappedArrayDesc, numMipmapLevels);
    uint64_t bytes = array_charge(*pMipmappedArrayDesc, numMipmapLevels);
    CHARGED(dev, bytes, real_cuMipmappedArrayCreate(pHandle, pMipmappedArrayDesc, numMipmapLevels),
            KEY_ARRAY | (uint64_t)(uintptr_t)*pHandle);
}

/* === free: always the real free, even for what the shim does not know === */

SHIM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    ENTER(cuMemFree_v2, dptr);
    RELEASED(real_cuMemFree_v2(dptr), KEY_PTR | dptr);
}

SHIM_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    ENTER(cuMemFreeAsync, dptr, hStream);
    RELEASED(real_cuMemFreeAsync(dptr, hStream), KEY_PTR | dptr);
}

SHIM_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    ENTER(cuMemFreeAsync_ptsz, dptr, hStream);
    RELEASED(real_cuMemFreeAsync_ptsz(dptr, hStream), KEY_PTR | dptr);
}

SHIM_EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    ENTER(cuMemRelease, handle);
    CUresult r = real_cuMemRelease(handle);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&vmm_lock);
    size_t i;
    struct vmm *v = vmm_find(handle, &i);
    if (v) {
        v->released = 1;
        vmm_settle(i);
    }
    pthread_mutex_unlock(&vmm_lock);
    return r;
}

SHIM_EXPORT CUresult cuArrayDestroy(CUarray hArray)
{
    ENTER(cuArrayDestroy, hArray);
    RELEASED(real_cuArrayDestroy(hArray), KEY_ARRAY | (uint64_t)(uintptr_t)hArray);
}

SHIM_EXPORT CUresult cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray)
{
    ENTER(cuMipmappedArrayDestroy, hMipmappedArray);
    RELEASED(real_cuMipmappedArrayDestroy(hMipmappedArray), KEY_ARRAY | (uint64_t)(uintptr_t)hMipmappedArray);
}

/* === view: the container's slice, never negative, never above the device === */

/* total = min(cap, device); used = the container's; free = min(total - used, device free) */
static int slice(int dev, uint64_t dev_total, uint64_t dev_free, uint64_t *total, uint64_t *free, uint64_t *used)
{
    uint64_t cap = memory_cap(dev);
    if (S.mode == MODE_ENFORCE && cap == VGPU_UNLIMITED)
        return 0;   /* unlimited: the device as it is */
    if (S.mode == MODE_ENFORCE)
        maybe_reap();
    uint64_t u = S.mode == MODE_ENFORCE ? LOAD(&S.usage->devices[dev].memory_current) : 0;
    *total = cap < dev_total ? cap : dev_total;
    *used = u < *total ? u : *total;
    *free = *total - *used < dev_free ? *total - *used : dev_free;
    return 1;
}

SHIM_EXPORT CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
{
    ENTER(cuMemGetInfo_v2, free, total);
    CUresult r = real_cuMemGetInfo_v2(free, total);
    int dev = current_device();
    uint64_t t, f, u;
    if (r == CUDA_SUCCESS && dev >= 0 && slice(dev, *total, *free, &t, &f, &u)) {
        *total = t;
        *free = f;
    }
    return r;
}

SHIM_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    ENTER(cuDeviceTotalMem_v2, bytes, dev);
    CUresult r = real_cuDeviceTotalMem_v2(bytes, dev);
    uint64_t t, f, u;
    if (r == CUDA_SUCCESS && dev >= 0 && dev < VGPU_MAX_DEVICES && slice(dev, *bytes, *bytes, &t, &f, &u))
        *bytes = t;
    return r;
}

/* === compute share ===
 * Each launch is charged its estimated GPU time, and the container's processes draw on
 * one bucket per device kept in the usage file as a virtual clock (GCRA): a launch moves
 * the clock cost / sm.max ahead and waits (sleeping, never spinning, never failing)
 * until the clock is at most SM_BURST_NS ahead of real time.
 *   estimate: per (function, grid) the lower envelope of sampled CUDA event timings
 *             (one launch in SAMPLE_EVERY, a bounded number of samples in flight);
 *             graph launches likewise per executable graph;
 *   correction: every SM_CHECK_NS, while the container is held back by its share, one of
 *             its processes compares the share NVML measured for the container with sm.max
 *             and moves a cost scale half way to what would have hit it (event timings
 *             also count time spent waiting behind other tenants' kernels; NVML does not).
 * At sm.max = 100% a launch costs a generation check and a branch. */

#define SM_FULL 10000u
#define SM_BURST_NS 20000000ull        /* how far the virtual clock may run ahead */
#define SM_CHECK_NS 500000000ull       /* correction period */
#define SAMPLE_EVERY 64
#define SAMPLE_AGE_NS 50000000ull      /* ... or when the last sample is older than this */
#define MAX_SAMPLES 16
#define ESTIMATE_BITS 12
#define CORR_ONE 65536ull

struct estimate { uint64_t key, ns, sampled_at; uint32_t launches, sampling; };
static struct estimate estimates[1u << ESTIMATE_BITS];   /* per process; races only blur an average */
static uint64_t typical_ns;                    /* for launches not measured yet */

/* busy: 0 free, 1 being started, 2 in flight, 3 being read.  A slot keeps its two events
 * (created once per context: creating events is not cheap on a real driver). */
struct sample { int busy; uint64_t key; CUcontext ctx; CUevent start, end; };
static struct sample samples[MAX_SAMPLES];
static int in_flight;   /* samples with busy == 2 */

static void forget_samples(void)   /* in a forked child: their events are the parent's */
{
    memset(samples, 0, sizeof samples);
    in_flight = 0;
}

/* Derived from the quota, recomputed only when its generation moves. */
static uint32_t sm_gen_seen = 1;             /* (odd: never computed) */
static int sm_any_limited;
static uint64_t sm_wall_scale[VGPU_MAX_DEVICES];   /* SM_FULL / sm.max, 16.16; 0 = unlimited */
#define SM_DENIED UINT64_MAX   /* scale of a device the slice was not given (sm.max 0) */
static int sm_only_device = -1;              /* the device, when the process sees just one */

/* Any device below 100%?  One load and a branch while the quota does not change. */
static inline int sm_limited(void)
{
    if (S.mode != MODE_ENFORCE)
        return 0;
    uint64_t g = LOAD(&S.quota->generation);
    if (UNLIKELY((uint32_t)g != LOAD(&sm_gen_seen))) {
        int any = 0, count = 0;
        for (uint32_t d = 0; d < VGPU_MAX_DEVICES; d++) {
            uint32_t sm = d < S.quota->device_count ? LOAD(&S.quota->devices[d].sm_max) : 0;
            uint64_t scale = sm == 0 ? SM_DENIED : sm < SM_FULL ? ((uint64_t)SM_FULL << 16) / sm : 0;
            STORE(&sm_wall_scale[d], scale);
            any |= scale != 0;
        }
        /* with one visible device (the usual container), launches need not ask which */
        STORE(&sm_only_device, real_cuDeviceGetCount && real_cuDeviceGetCount(&count) == CUDA_SUCCESS &&
                                   count == 1 ? 0 : -1);
        STORE(&sm_any_limited, any);
        STORE(&sm_gen_seen, (uint32_t)g);
    }
    return LOAD(&sm_any_limited);
}

static inline int launch_device(void)
{
    int d = LOAD(&sm_only_device);
    return d >= 0 ? d : current_device();
}

/* Counters are added to the usage file in batches: one shared atomic per launch would
 * cost more than the pacing itself. */
static TLS struct { uint64_t launches, gpu_time_ns; int dev; } pending;

static void flush_counters(void)
{
    if (!pending.launches)
        return;
    struct vgpu_usage_device *u = &S.usage->devices[pending.dev];
    __atomic_add_fetch(&u->launches, pending.launches, __ATOMIC_RELAXED);
    __atomic_add_fetch(&u->gpu_time_ns, pending.gpu_time_ns, __ATOMIC_RELAXED);
    pending.launches = pending.gpu_time_ns = 0;
}

static struct estimate *estimate_for(uint64_t key)
{
    return &estimates[(key * 0x9E3779B97F4A7C15ull) >> (64 - ESTIMATE_BITS)];
}

static void learn(uint64_t key, uint64_t ns)
{
    struct estimate *e = estimate_for(key);
    uint64_t old = LOAD(&e->ns);
    if (LOAD(&e->key) != key || old == 0) {
        STORE(&e->key, key);
        STORE(&e->ns, ns);
    } else {
        /* follow the lower envelope: a sample is the kernel's time plus any wait behind
         * other tenants' work, so the shortest samples are the truest; rise slowly */
        STORE(&e->ns, ns < old ? ns : old + (ns - old) / 64);
    }
    uint64_t t = LOAD(&typical_ns);
    STORE(&typical_ns, t ? (t * 7 + ns) / 8 : ns);
    STORE(&e->sampling, 0);
}

/* Collect finished samples (bounded work: MAX_SAMPLES queries at most). */
static void harvest(void)
{
    for (int i = 0; i < MAX_SAMPLES; i++) {
        struct sample *sp = &samples[i];
        int flying = 2;
        if (LOAD(&sp->busy) != 2 ||
            !__atomic_compare_exchange_n(&sp->busy, &flying, 3, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        if (real_cuEventQuery(sp->end) != CUDA_SUCCESS) {
            STORE(&sp->busy, 2);   /* not done yet */
            continue;
        }
        float ms = 0;
        if (real_cuEventElapsedTime(&ms, sp->start, sp->end) == CUDA_SUCCESS && ms >= 0)
            learn(sp->key, ms > 0 ? (uint64_t)((double)ms * 1e6) : 1);   /* 0 means "not measured" */
        __atomic_sub_fetch(&in_flight, 1, __ATOMIC_RELAXED);
        STORE(&sp->busy, 0);
    }
}

/* A kernel never measured yet: wait for its first sample rather than queue unknown
 * amounts of work for free (once per kernel and grid). */
static void await_first_sample(uint64_t key)
{
    for (int i = 0; i < MAX_SAMPLES; i++) {
        struct sample *sp = &samples[i];
        if (LOAD(&sp->busy) == 2 && sp->key == key && real_cuEventSynchronize) {
            real_cuEventSynchronize(sp->end);
            harvest();
            return;
        }
    }
}

/* Start measuring this launch: returns the sample to finish after it, or NULL. */
static struct sample *sample_begin(uint64_t key, CUstream stream, int per_thread)
{
    CUresult (*record)(CUevent, CUstream) = per_thread ? real_cuEventRecord_ptsz : real_cuEventRecord;
    CUcontext ctx = NULL;
    if (!record || !real_cuEventCreate || !real_cuEventQuery || !real_cuEventElapsedTime || !real_cuCtxGetCurrent ||
        real_cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx)
        return NULL;
    harvest();
    for (int i = 0; i < MAX_SAMPLES; i++) {
        int idle = 0;
        struct sample *sp = &samples[i];
        if (!__atomic_compare_exchange_n(&sp->busy, &idle, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        if (sp->ctx != ctx) {   /* events belong to a context: make this slot's anew */
            if (sp->ctx && real_cuEventDestroy_v2) {
                real_cuEventDestroy_v2(sp->start);
                real_cuEventDestroy_v2(sp->end);
            }
            sp->ctx = NULL;
            if (real_cuEventCreate(&sp->start, 0) == CUDA_SUCCESS) {
                if (real_cuEventCreate(&sp->end, 0) == CUDA_SUCCESS)
                    sp->ctx = ctx;
                else if (real_cuEventDestroy_v2)
                    real_cuEventDestroy_v2(sp->start);
            }
        }
        sp->key = key;
        if (sp->ctx && record(sp->start, stream) == CUDA_SUCCESS)
            return sp;
        STORE(&sp->busy, 0);
        return NULL;
    }
    return NULL;   /* all in flight: skip this one */
}

static void sample_end(struct sample *sp, CUstream stream, int per_thread, CUresult launched)
{
    CUresult (*record)(CUevent, CUstream) = per_thread ? real_cuEventRecord_ptsz : real_cuEventRecord;
    if (launched == CUDA_SUCCESS && record(sp->end, stream) == CUDA_SUCCESS) {
        __atomic_add_fetch(&in_flight, 1, __ATOMIC_RELAXED);
        STORE(&sp->busy, 2);
    } else {
        STORE(&sp->busy, 0);
    }
}

static uint64_t wall_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000ull + (uint64_t)ts.tv_nsec / 1000u;
}

/* GPU time NVML saw the container's processes use on `dev` over the last `window_ns`;
 * NOT_MEASURED when NVML cannot say. */
#define NOT_MEASURED UINT64_MAX
static uint64_t measured_ns(int dev, uint64_t window_ns)
{
    if (!LOAD(&S.nvml_ready))
        nvml_resolve();
    static int nvml_up;
    if (!real_nvmlDeviceGetProcessUtilization || !real_nvmlDeviceGetHandleByIndex_v2)
        return NOT_MEASURED;
    if (!LOAD(&nvml_up)) {
        if (!real_nvmlInit_v2 || real_nvmlInit_v2() != NVML_SUCCESS)
            return NOT_MEASURED;
        STORE(&nvml_up, 1);
    }
    nvmlDevice_t h;
    nvmlProcessUtilizationSample_t smp[VGPU_MAX_PROCS * 2];
    unsigned int n = VGPU_MAX_PROCS * 2;
    if (real_nvmlDeviceGetHandleByIndex_v2((unsigned)dev, &h) != NVML_SUCCESS)
        return NOT_MEASURED;
    nvmlReturn_t r = real_nvmlDeviceGetProcessUtilization(h, smp, &n, wall_us() - window_ns / 1000);
    if (r == NVML_ERROR_NOT_FOUND)
        return 0;   /* no process ran a kernel in the window */
    if (r != NVML_SUCCESS)
        return NOT_MEASURED;
    uint64_t pct = 0;
    for (unsigned int i = 0; i < n; i++)
        for (int p = 0; p < VGPU_MAX_PROCS; p++)
            if ((unsigned)LOAD(&S.usage->procs[p].pid) == smp[i].pid && smp[i].pid)
                pct += smp[i].smUtil;
    return pct * window_ns / 100;
}

/* Every SM_CHECK_NS, one process of the container (whoever moves sm_check_ns first)
 * compares the share NVML measured for the container's processes with sm.max and nudges
 * the cost scale.  Only while the container was held back by its share (it wanted more):
 * a container that uses less than its share is not mis-charged, merely idle. */
static void maybe_correct(int dev, struct vgpu_usage_device *u, uint32_t sm, uint64_t now)
{
    uint64_t last = LOAD(&u->sm_check_ns);
    if (now - last < SM_CHECK_NS ||
        !__atomic_compare_exchange_n(&u->sm_check_ns, &last, now, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return;
    uint64_t throttled = LOAD(&u->throttled_ns);
    uint64_t waited = throttled - __atomic_exchange_n(&u->sm_check_throttled_ns, throttled, __ATOMIC_ACQ_REL);
    uint64_t share_then = __atomic_exchange_n(&u->sm_check_share, (uint64_t)sm, __ATOMIC_ACQ_REL);
    uint64_t window = now - last;
    if (!last || window > 4 * SM_CHECK_NS || waited < window / 100 || share_then != sm)
        return;   /* first period, a long pause, not held back by the share, or resized */
    uint64_t actual = measured_ns(dev, window);
    if (actual == NOT_MEASURED)
        return;
    uint64_t target = window * sm / SM_FULL;
    uint64_t corr = LOAD(&u->sm_correction);
    if (!corr)
        corr = CORR_ONE;
    /* half way to the scale that would have given exactly the share */
    corr = corr / 2 + corr * actual / target / 2;
    if (corr < CORR_ONE / 16)
        corr = CORR_ONE / 16;
    if (corr > CORR_ONE * 16)
        corr = CORR_ONE * 16;
    STORE(&u->sm_correction, corr);
    DEBUG("device %d: share %.1f%% of %.1f%%: cost scale %.3f", dev, 100.0 * actual / window,
          100.0 * sm / SM_FULL, (double)corr / CORR_ONE);
}

/* Wait for the container's share, charge the launch, and say whether to sample it
 * (1), not (0), or that the launch is refused (-1: a device the slice was not given). */
static int pace(int dev, uint64_t key)
{
    uint64_t scale = dev >= 0 && dev < VGPU_MAX_DEVICES ? LOAD(&sm_wall_scale[dev]) : 0;
    if (!scale)
        return 0;
    if (scale == SM_DENIED)
        return -1;   /* fail closed, like its memory; never a wait */
    struct vgpu_usage_device *u = &S.usage->devices[dev];
    struct estimate *e = estimate_for(key);
    uint64_t raw = LOAD(&e->key) == key ? LOAD(&e->ns) : 0;
    if (!raw && LOAD(&e->sampling)) {
        await_first_sample(key);
        raw = LOAD(&e->key) == key ? LOAD(&e->ns) : 0;
    }
    uint32_t n = __atomic_add_fetch(&e->launches, 1, __ATOMIC_RELAXED);
    uint64_t now = now_ns();
    /* sample the unknown, one launch in SAMPLE_EVERY, and any kernel whose estimate has
     * aged (a rare, expensive-looking kernel must get the chance to look cheaper) */
    int sample = (raw == 0 || n % SAMPLE_EVERY == 0 || now - LOAD(&e->sampled_at) > SAMPLE_AGE_NS) &&
                 !LOAD(&e->sampling);
    if (!raw)
        raw = LOAD(&typical_ns);
    uint64_t corr = LOAD(&u->sm_correction);
    uint64_t cost = corr ? raw * corr >> 16 : raw;
    uint64_t wall = cost * scale >> 16;

    uint64_t t = LOAD(&u->sm_vtime_ns), next;
    do
        next = (t > now ? t : now) + wall;
    while (!__atomic_compare_exchange_n(&u->sm_vtime_ns, &t, next, 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    if (pending.dev != dev)
        flush_counters();
    pending.dev = dev;
    pending.launches++;
    pending.gpu_time_ns += cost;
    if (next > now + SM_BURST_NS) {
        flush_counters();   /* about to sleep anyway */
        struct timespec ts = {.tv_sec = (time_t)((next - SM_BURST_NS) / 1000000000ull),
                              .tv_nsec = (long)((next - SM_BURST_NS) % 1000000000ull)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
            ;
        __atomic_add_fetch(&u->throttled_ns, next - SM_BURST_NS - now, __ATOMIC_RELAXED);
        now = next - SM_BURST_NS;
    } else if (pending.launches >= 64) {
        flush_counters();
    }
    if (UNLIKELY(now - LOAD(&u->sm_check_ns) >= SM_CHECK_NS))
        maybe_correct(dev, u, (uint32_t)((((uint64_t)SM_FULL << 16) + scale / 2) / scale), now);
    if (!sample && LOAD(&in_flight) && n % 8 == 0)
        harvest();   /* finished samples are collected every few launches, not each */
    if (sample) {
        STORE(&e->sampling, 1);
        STORE(&e->sampled_at, now);
    }
    return sample;
}

/* The body of every launch hook: pace, maybe measure, launch. */
#define PACED_LAUNCH(sym, per_thread, key, stream, ...)                                 \
    ENTER(sym, __VA_ARGS__);                                                            \
    if (LIKELY(!sm_limited()))                                                          \
        return real_##sym(__VA_ARGS__);                                                 \
    int dev_ = launch_device(), paced_ = pace(dev_, (key));                            \
    if (UNLIKELY(paced_ < 0))                                                           \
        return CUDA_ERROR_NOT_PERMITTED;                                                \
    struct sample *sp_ = paced_ ? sample_begin((key), (stream), (per_thread)) : NULL;   \
    CUresult r_ = real_##sym(__VA_ARGS__);                                              \
    if (sp_)                                                                            \
        sample_end(sp_, (stream), (per_thread), r_);                                    \
    return r_

static inline uint64_t kernel_key(CUfunction f, uint64_t blocks) { return (uint64_t)(uintptr_t)f * 1000003ull ^ blocks; }

SHIM_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                    unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                    unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)
{
    PACED_LAUNCH(cuLaunchKernel, 0, kernel_key(f, (uint64_t)gridDimX * gridDimY * gridDimZ), hStream, f, gridDimX,
                 gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream, kernelParams, extra);
}

SHIM_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                         unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                         unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                         void **kernelParams, void **extra)
{
    PACED_LAUNCH(cuLaunchKernel_ptsz, 1, kernel_key(f, (uint64_t)gridDimX * gridDimY * gridDimZ), hStream, f,
                 gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                 kernelParams, extra);
}

static inline uint64_t config_key(const CUlaunchConfig *c, CUfunction f)
{
    return c ? kernel_key(f, (uint64_t)c->gridDimX * c->gridDimY * c->gridDimZ) : kernel_key(f, 0);
}

SHIM_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)
{
    PACED_LAUNCH(cuLaunchKernelEx, 0, config_key(config, f), config ? config->hStream : NULL, config, f,
                 kernelParams, extra);
}

SHIM_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                           void **extra)
{
    PACED_LAUNCH(cuLaunchKernelEx_ptsz, 1, config_key(config, f), config ? config->hStream : NULL, config, f,
                 kernelParams, extra);
}

SHIM_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                               unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                               unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                               void **kernelParams)
{
    PACED_LAUNCH(cuLaunchCooperativeKernel, 0, kernel_key(f, (uint64_t)gridDimX * gridDimY * gridDimZ), hStream, f,
                 gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                 kernelParams);
}

SHIM_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                    unsigned int gridDimZ, unsigned int blockDimX,
                                                    unsigned int blockDimY, unsigned int blockDimZ,
                                                    unsigned int sharedMemBytes, CUstream hStream, void **kernelParams)
{
    PACED_LAUNCH(cuLaunchCooperativeKernel_ptsz, 1, kernel_key(f, (uint64_t)gridDimX * gridDimY * gridDimZ), hStream,
                 f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                 kernelParams);
}

/* A graph costs its measured duration, learnt per executable graph like a kernel. */
SHIM_EXPORT CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    PACED_LAUNCH(cuGraphLaunch, 0, kernel_key((CUfunction)(void *)hGraphExec, 1ull << 40), hStream, hGraphExec,
                 hStream);
}

SHIM_EXPORT CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    PACED_LAUNCH(cuGraphLaunch_ptsz, 1, kernel_key((CUfunction)(void *)hGraphExec, 1ull << 40), hStream, hGraphExec,
                 hStream);
}

/* === lifecycle === */

SHIM_EXPORT CUresult cuInit(unsigned int Flags)
{
    ENTER(cuInit, Flags);   /* initialising here puts configuration errors next to cuInit */
    return real_cuInit(Flags);
}

/* === NVML === */

static void nvml_resolve(void)
{
    pthread_mutex_lock(&S.lock);
    if (!S.nvml_ready) {
        resolve_real_dlsym();
        S.nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL);
        for (size_t i = 0; S.nvml && i < NHOOKS(nvml_hooks); i++)
            *nvml_hooks[i].real = real_dlsym(S.nvml, nvml_hooks[i].symbol);
        if (S.nvml) {
            *(void **)&real_nvmlDeviceGetIndex = real_dlsym(S.nvml, "nvmlDeviceGetIndex");
            *(void **)&real_nvmlInit_v2 = real_dlsym(S.nvml, "nvmlInit_v2");
            *(void **)&real_nvmlDeviceGetHandleByIndex_v2 = real_dlsym(S.nvml, "nvmlDeviceGetHandleByIndex_v2");
            *(void **)&real_nvmlDeviceGetProcessUtilization = real_dlsym(S.nvml, "nvmlDeviceGetProcessUtilization");
        }
        STORE(&S.nvml_ready, 1);
    }
    pthread_mutex_unlock(&S.lock);
}

#define NVML_ENTER(sym, ...)                                     \
    ensure_init();                                               \
    if (UNLIKELY(!LOAD(&S.nvml_ready)))                          \
        nvml_resolve();                                          \
    if (UNLIKELY(!real_##sym))                                   \
        return NVML_ERROR_FUNCTION_NOT_FOUND;                    \
    if (S.mode == MODE_PASS || in_init)                          \
        return real_##sym(__VA_ARGS__)

static int nvml_index(nvmlDevice_t device)
{
    unsigned int i;
    if (!real_nvmlDeviceGetIndex || real_nvmlDeviceGetIndex(device, &i) != NVML_SUCCESS || i >= VGPU_MAX_DEVICES)
        return -1;
    return (int)i;
}

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    NVML_ENTER(nvmlDeviceGetMemoryInfo, device, memory);
    nvmlReturn_t r = real_nvmlDeviceGetMemoryInfo(device, memory);
    int dev = nvml_index(device);
    uint64_t t, f, u;
    if (r == NVML_SUCCESS && dev >= 0 && slice(dev, memory->total, memory->free, &t, &f, &u)) {
        memory->total = t;
        memory->used = u;
        memory->free = f;
    }
    return r;
}

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    NVML_ENTER(nvmlDeviceGetMemoryInfo_v2, device, memory);
    nvmlReturn_t r = real_nvmlDeviceGetMemoryInfo_v2(device, memory);
    int dev = nvml_index(device);
    uint64_t t, f, u;
    if (r == NVML_SUCCESS && dev >= 0 && slice(dev, memory->total, memory->free, &t, &f, &u)) {
        memory->total = t;
        memory->reserved = 0;
        memory->used = u;
        memory->free = f;
    }
    return r;
}

/* The container's own processes on the device, from the usage file: pids as the
 * container sees them, whatever pid namespace the driver reports in. */
enum proc_abi { PROC_V1, PROC_V2 };

static nvmlReturn_t own_processes(nvmlDevice_t device, unsigned int *infoCount, void *infos, enum proc_abi abi)
{
    int dev = nvml_index(device);
    if (!infoCount || dev < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (S.mode == MODE_ENFORCE)
        maybe_reap();
    unsigned int count = 0;
    nvmlProcessInfo_v2_t found[VGPU_MAX_PROCS];
    for (int i = 0; S.mode == MODE_ENFORCE && i < VGPU_MAX_PROCS; i++) {
        struct vgpu_usage_proc *p = &S.usage->procs[i];
        int32_t pid = LOAD(&p->pid);
        uint64_t mem = LOAD(&p->memory[dev]);
        if (pid > 0 && mem)
            found[count++] = (nvmlProcessInfo_v2_t){.pid = (unsigned int)pid, .usedGpuMemory = mem,
                                                    .gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT,
                                                    .computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT};
    }
    return vgpu_nvml_put_processes(found, count, infoCount, infos, abi == PROC_V1);
}

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                              nvmlProcessInfo_v1_t *infos)
{
    NVML_ENTER(nvmlDeviceGetComputeRunningProcesses, device, infoCount, infos);
    return own_processes(device, infoCount, infos, PROC_V1);
}

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                                 nvmlProcessInfo_v2_t *infos)
{
    NVML_ENTER(nvmlDeviceGetComputeRunningProcesses_v2, device, infoCount, infos);
    return own_processes(device, infoCount, infos, PROC_V2);
}

SHIM_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                                 nvmlProcessInfo_t *infos)
{
    NVML_ENTER(nvmlDeviceGetComputeRunningProcesses_v3, device, infoCount, infos);
    return own_processes(device, infoCount, infos, PROC_V2);
}

/* === interception: dlsym and cuGetProcAddress === */

static void *hook_named(const char *name)
{
    const struct hook *tables[2] = {cuda_hooks, nvml_hooks};
    size_t sizes[2] = {NHOOKS(cuda_hooks), NHOOKS(nvml_hooks)};
    for (int t = 0; t < 2; t++)
        for (size_t i = 0; i < sizes[t]; i++)
            if (!strcmp(tables[t][i].symbol, name))
                return tables[t][i].hook;
    return NULL;
}

/* Programs that dlopen the driver and look symbols up by handle would bypass the
 * exported hooks: hand them the hooks instead.  No init is needed here. */
SHIM_EXPORT void *dlsym(void *handle, const char *name)
{
    resolve_real_dlsym();
    if (handle == RTLD_NEXT)
        return real_dlsym(handle, name);   /* a tail call: "next" stays relative to the caller */
    void *real = real_dlsym(handle, name);
    if (!real || (name[0] != 'c' && name[0] != 'n'))
        return real;
    void *hook = hook_named(name);
    return hook ? hook : real;
}

static int newest_known_version(void)
{
    int v = 0;
    for (size_t i = 0; i < sizeof vgpu_known_abis / sizeof vgpu_known_abis[0]; i++)
        if (vgpu_known_abis[i].version > v)
            v = vgpu_known_abis[i].version;
    return v;
}

/* Replace the driver's answer with our hook when, and only when, the driver handed out
 * exactly the ABI the hook implements. */
static void substitute(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    if (!symbol || !pfn || !*pfn)
        return;
    struct vgpu_abi abi;
    if (vgpu_resolve_abi(symbol, cudaVersion, flags, &abi) != CU_GET_PROC_ADDRESS_SUCCESS)
        return;
    for (size_t i = 0; i < NHOOKS(cuda_hooks); i++) {
        const struct hook *h = &cuda_hooks[i];
        if (h->version != abi.version || h->per_thread != abi.per_thread || strcmp(h->base, symbol))
            continue;
        static int newest;
        if (!newest)
            newest = newest_known_version();
        if (cudaVersion > newest && *pfn != *h->real) {
            INFO("cuGetProcAddress(%s, %d): newer than the ABIs the shim knows; not intercepted", symbol,
                 cudaVersion);
            return;
        }
        DEBUG("cuGetProcAddress(%s, %d, %llu) -> hook %s", symbol, cudaVersion, (unsigned long long)flags,
              h->symbol);
        *pfn = h->hook;
        return;
    }
    DEBUG("cuGetProcAddress(%s, %d, %llu) -> driver", symbol, cudaVersion, (unsigned long long)flags);
}

SHIM_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    ensure_init();
    if (!real_cuGetProcAddress)
        return CUDA_ERROR_NOT_FOUND;
    CUresult r = real_cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (r == CUDA_SUCCESS)
        substitute(symbol, pfn, cudaVersion, flags);
    return r;
}

SHIM_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                         CUdriverProcAddressQueryResult *symbolStatus)
{
    ensure_init();
    if (!real_cuGetProcAddress_v2)
        return CUDA_ERROR_NOT_FOUND;
    CUresult r = real_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (r == CUDA_SUCCESS)
        substitute(symbol, pfn, cudaVersion, flags);
    return r;
}
