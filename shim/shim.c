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
 * Files (csrc/vgpu_region.h): <VGPU_DIR>/<VGPU_SLICE>/quota, mapped read-only, and
 * .../usage, mapped read-write and shared by all the slice's processes.
 *
 * Failure policy — said once here, and in the README:
 *   fail open (pass everything through untouched):
 *     - no vgpu configuration at all (no VGPU_SLICE and no limit variables): the
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
#include "internal.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* === real symbols and the hook tables === */

#define DEFINE_CUDA(sym, base, ver, pt, ret, params) ret(*real_##sym) params;
VGPU_CUDA_HOOKS(DEFINE_CUDA)
#define DEFINE_NVML(sym, ret, params) ret(*real_##sym) params;
VGPU_NVML_HOOKS(DEFINE_NVML)
#define DEFINE_CALLED(sym, ret, params) ret(*real_##sym) params;
VGPU_CALLED(DEFINE_CALLED)
VGPU_CALLED_ON_USE(DEFINE_CALLED)
VGPU_NVML_CALLED(DEFINE_CALLED)

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

#define REAP_INTERVAL_NS 200000000ull

struct shim_state S = {.lock = PTHREAD_MUTEX_INITIALIZER, .usage_fd = -1, .slot = -1};
TLS int in_init;

/* === log === */

void vgpu_log(int level, const char *fmt, ...)
{
    static const char *names[] = {"error", "info", "debug"};
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "vgpu[%d]: %s: %s\n", (int)getpid(), names[level], buf);
}

void deny(const char *fmt, ...)
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

/* VGPU_*: the grammar vgpu-ctl reads sizes in (src/vgpu/quantities.py: Kubernetes'
 * quantities): bytes, binary "4Gi" (Ki..Ei), decimal "4G" = 4*10^9 (k/K, M, G, T, P, E), or
 * "max" (no cap).  HAMi-core's own variables keep its meaning: "4096m", "4g" are binary. */
static int parse_size(const char *s, int hami, uint64_t *out)
{
    char *end;
    if (!hami && !strcmp(s, "max")) {
        *out = VGPU_UNLIMITED;
        return 0;
    }
    if (*s < '0' || *s > '9')   /* strtoull would accept " -1" and wrap it to "unlimited" */
        return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return -1;
    int shift = 0;
    if (!hami) {
        static const char *binary[] = {"", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"};
        static const char decimal[] = "kMGTPE";   /* and K, as vgpu-ctl takes it */
        int i = 0;
        while (i < 7 && strcmp(end, binary[i]))
            i++;
        if (i == 7) {
            const char *u = *end && !end[1] ? strchr(decimal, *end == 'K' ? 'k' : *end) : NULL;
            if (!u)
                return -1;
            for (long k = 0; k <= u - decimal; k++) {
                if (v > ~0ull / 1000)
                    return -1;
                v *= 1000;
            }
            *out = v;
            return 0;
        }
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

enum limit_kind { LIMIT_MEMORY, LIMIT_SM };
static const char *const limit_names[2][2] = {{"VGPU_MEMORY_LIMIT", "CUDA_DEVICE_MEMORY_LIMIT"},
                                              {"VGPU_SM_LIMIT", "CUDA_DEVICE_SM_LIMIT"}};
/* [kind][HAMi-core's][device, or VGPU_MAX_DEVICES for the all-devices variable] */
static const char *limit_values[2][2][VGPU_MAX_DEVICES + 1];

/* The limit variables, found in one pass over the environment: a getenv for each name
 * (2 kinds, 2 spellings, 17 names each) cost 136k instructions at every start (callgrind).
 * A variable's first occurrence counts, empty or not, as getenv finds it.  Returns whether
 * one counted holds a value (limit_value skips empty ones). */
static int find_limit_vars(void)
{
    int any = 0;
    extern char **environ;
    memset(limit_values, 0, sizeof limit_values);
    for (char **e = environ; e && *e; e++) {
        const char *s = *e;
        if (s[0] != 'V' && s[0] != 'C')
            continue;
        for (int k = 0; k < 2; k++)
            for (int h = 0; h < 2; h++) {
                size_t n = strlen(limit_names[k][h]);
                if (strncmp(s, limit_names[k][h], n))
                    continue;
                const char *p = s + n;
                int dev = VGPU_MAX_DEVICES;
                if (*p == '_') {   /* a device index as "%d" prints it: no sign, no leading zero */
                    p++;
                    if (*p < '0' || *p > '9' || (*p == '0' && p[1] != '='))
                        continue;
                    for (dev = 0; *p >= '0' && *p <= '9' && dev < VGPU_MAX_DEVICES; p++)
                        dev = dev * 10 + (*p - '0');
                    if (dev >= VGPU_MAX_DEVICES)
                        continue;
                }
                if (*p == '=' && !limit_values[k][h][dev]) {
                    limit_values[k][h][dev] = p + 1;
                    any |= p[1] != 0;
                }
            }
    }
    return any;
}

/* The value for device i: per-device variable first, then the all-devices one; ours
 * before HAMi-core's.  Returns the value (NULL when none is set), with which variable
 * holds it (limit_var_name). */
struct limit_value {
    const char *value;
    int hami, per_device;
};

static struct limit_value limit_value(enum limit_kind kind, int dev)
{
    for (int per_device = 1; per_device >= 0; per_device--)
        for (int h = 0; h < 2; h++) {
            const char *v = limit_values[kind][h][per_device ? dev : VGPU_MAX_DEVICES];
            if (v && *v)
                return (struct limit_value){v, h, per_device};
        }
    return (struct limit_value){NULL, 0, 0};
}

/* The variable's name, for a message (only a refusal needs it). */
static const char *limit_var_name(enum limit_kind kind, int dev, struct limit_value lv)
{
    static TLS char name[64];
    if (lv.per_device)
        snprintf(name, sizeof name, "%s_%d", limit_names[kind][lv.hami], dev);
    else
        snprintf(name, sizeof name, "%s", limit_names[kind][lv.hami]);
    return name;
}

/* Fill a quota from the environment.  Returns 1 if any limit variable is set, 0 if none,
 * -1 (after saying why) if one is malformed.  A value is parsed once, not once per device
 * it covers (an all-devices variable covers 16: ~17k instructions at start-up). */
static int quota_from_env(struct vgpu_quota *q, const char *name)
{
    if (!find_limit_vars())
        return 0;   /* (a slice vgpu-ctl made: nothing to fill) */
    memset(q, 0, sizeof *q);
    q->magic = VGPU_QUOTA_MAGIC;
    q->abi_version = VGPU_ABI_VERSION;
    q->size = sizeof *q;
    q->generation = 2;
    q->device_count = VGPU_MAX_DEVICES;
    snprintf(q->name, sizeof q->name, "%s", name);
    const char *last_mem = NULL, *last_sm = NULL;   /* the values parsed last */
    uint64_t mem = 0;
    uint32_t sm = 0;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++) {
        struct vgpu_quota_device *qd = &q->devices[d];
        qd->memory_max = qd->memory_request = qd->memory_limit = VGPU_UNLIMITED;
        qd->sm_max = qd->sm_request = qd->sm_limit = 10000;
        struct limit_value lv = limit_value(LIMIT_MEMORY, d);
        if (lv.value) {
            if (lv.value != last_mem) {   /* (a pointer into one variable's text) */
                const char *value = lv.value;
                int bad = parse_size(value, lv.hami, &mem);
                if (!bad && !lv.hami && strspn(value, "0123456789") == strlen(value) && mem &&
                    mem < (1ull << 20)) {   /* vgpu-ctl's rule: a unit left out */
                    deny("%s=%s has no unit, so it is %s bytes: a size without a unit must be at least 1Mi "
                         "(did you mean %sGi?)", limit_var_name(LIMIT_MEMORY, d, lv), value, value, value);
                    return -1;
                }
                if (bad) {
                    deny("%s=%s is not a memory size (use bytes, Ki/Mi/Gi/Ti or K/M/G/T, e.g. 4Gi%s)",
                         limit_var_name(LIMIT_MEMORY, d, lv), value, lv.hami ? "; or 4096m" : "");
                    return -1;
                }
                last_mem = lv.value;
            }
            qd->memory_max = qd->memory_request = qd->memory_limit = mem;
        }
        lv = limit_value(LIMIT_SM, d);
        if (lv.value) {
            if (lv.value != last_sm) {
                if (parse_share(lv.value, lv.hami, &sm)) {
                    deny("%s=%s is not a share of the GPU (use 1..100, e.g. 50%%)", limit_var_name(LIMIT_SM, d, lv),
                         lv.value);
                    return -1;
                }
                last_sm = lv.value;
            }
            qd->sm_max = qd->sm_request = qd->sm_limit = sm;
        }
    }
    return 1;
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

/* Make `path` holding `data`, complete or not at all (a temporary, then link): any
 * number of processes may race to make it, one wins, none sees it half written.  1 when
 * this process made it; 0 when it was there already or cannot be made (the caller's open
 * reports that). */
int create_file_once(const char *path, const void *data, size_t len, mode_t mode)
{
    char tmp[4200];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid()) >= sizeof tmp)
        return 0;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, mode);
    if (fd < 0)
        return 0;
    int ok = fchmod(fd, mode) == 0 && write(fd, data, len) == (ssize_t)len;   /* (not the umask's mode) */
    close(fd);
    int made = ok && link(tmp, path) == 0;
    if (ok && !made && errno != EEXIST)
        ERR("cannot create %s: %s", path, strerror(errno));
    unlink(tmp);
    return made;
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

/* Any number of processes may start at once in a new container: the file is created
 * empty, whoever takes the exclusive lock first writes the header, and a process that
 * finds it short validates it under a shared lock, so none can see it half-written.  One
 * that finds it at its full size takes no lock (two system calls saved in every process
 * but a slice's first): the size reaches the whole only with the last page of that one
 * pwrite (the header, page 0, went first; the rest is zeros, written or not), and vgpu-ctl
 * links a complete file into place. */
static int usage_complete(const struct stat *st)
{
    return S_ISREG(st->st_mode) && (size_t)st->st_size == sizeof(struct vgpu_usage);
}

static struct vgpu_usage *map_usage(const char *path)
{
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        deny("cannot open usage file %s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    int ok = fstat(fd, &st) == 0;
    if (ok && !usage_complete(&st)) {
        if (st.st_size == 0) {
            flock(fd, LOCK_EX);
            if ((ok = fstat(fd, &st) == 0) && st.st_size == 0) {
                struct vgpu_usage *u = calloc(1, sizeof *u);
                if (!u) {
                    flock(fd, LOCK_UN);
                    close(fd);
                    deny("out of memory at start-up");
                    return NULL;
                }
                u->magic = VGPU_USAGE_MAGIC;
                u->abi_version = VGPU_ABI_VERSION;
                u->size = sizeof *u;
                ok = pwrite(fd, u, sizeof *u, 0) == (ssize_t)sizeof *u;
                free(u);
            }
            flock(fd, LOCK_UN);
        }
        flock(fd, LOCK_SH);
        ok = ok && fstat(fd, &st) == 0;
        flock(fd, LOCK_UN);   /* (complete now: it stays so) */
    }
    void *m = ok && usage_complete(&st) ? mmap(NULL, sizeof(struct vgpu_usage), PROT_READ | PROT_WRITE, MAP_SHARED,
                                               fd, 0)
                                        : MAP_FAILED;
    if (m == MAP_FAILED) {
        deny("usage file %s cannot be mapped (%lld bytes, need %zu)", path, ok ? (long long)st.st_size : -1ll,
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

/* === process slots ===
 * A slot is owned through an OFD lock on one byte of the usage file, which the kernel
 * drops when the process's last descriptor closes, i.e. when it is dead: no thread of
 * it can still be touching its charge then.  The charge therefore stays until the
 * process is gone (its memory really is held until then, whatever its threads are doing
 * at exit), and whoever finds the lock free drains the slot: any live process of the
 * container (before refusing an allocation, and when it shows its view), vgpu-ctl
 * (reap, status, metrics) and the node agent.  No exit handler, no signal handler:
 * exit, kill -9 and SIGTERM all end the same way. */

int slot_lock(int fd, int slot, short type)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = LOCK_BASE + slot, .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &fl);
}

/* With slot i's lock held (its owner is dead, or it is ours and new): its process holds
 * nothing.  A drain cut short by a kill is finished by the next one. */
void drain_slot(int i)
{
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        if (LOAD(&S.usage->charge[d][i]))
            __atomic_store_n(&S.usage->charge[d][i], 0, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&S.usage->charge_seq[i], 1, __ATOMIC_SEQ_CST);
    STORE(&S.usage->procs[i].pid, 0);
}

/* charge_sub found slot `slot` holding less than its process frees (internal.h): said once. */
void charge_found_rewritten(int dev, int slot)
{
    static int said;
    if (!__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
        ERR("usage slot %d charged less on device %d than this process frees: another process rewrote it "
            "(counted from zero again)", slot, dev);
}

static int slot_charged(int i)
{
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        if (LOAD(&S.usage->charge[d][i]))
            return 1;
    return 0;
}

static int slot_in_use(int i)
{
    return LOAD(&S.usage->procs[i].pid) || slot_charged(i);   /* (charged alone: a drain cut short) */
}

/* === who this process is, for the node agent (csrc/vgpu_region.h: vgpu_usage_proc) ===
 * Read from /proc at every claim: a forked child is another process.  0 = unknown; the
 * agent checks what it uses against the kernel anyway (the file is the container's). */

static ssize_t read_small(const char *path, char *buf, size_t size)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    if (n < 0)
        return -1;
    buf[n] = 0;
    return n;
}

/* From a /proc/<pid>/stat: field 3, the state, and field 22, when the process started
 * (clock ticks after boot).  -1 when it cannot be read (the process is gone). */
static int read_stat(const char *path, char *state, uint64_t *start_ticks)
{
    char buf[1024];
    if (read_small(path, buf, sizeof buf) <= 0)
        return -1;
    char *p = strrchr(buf, ')');   /* the name (field 2) may hold spaces and parentheses */
    if (!p || !p[1] || !p[2])
        return -1;
    *state = p[2];
    for (int field = 2; *p && field < 22; p++)
        if (*p == ' ')
            field++;
    *start_ticks = strtoull(p, NULL, 10);
    return 0;
}

/* Now, as a time this process was running at: CLOCK_BOOTTIME in the clock ticks after
 * boot of /proc/<pid>/stat's start time (field 22: CLOCK_BOOTTIME at fork, in 1/USER_HZ s,
 * rounded down alike).  A slot records it in place of the start time itself, which cost
 * the process its first /proc lookups (27 us of the 40 the identity took at start-up, this
 * machine), and it names the process as exactly: the process at its pid that started no
 * later can only be the one that had the pid then; a later one started after that one
 * ended (vgpu/procfs.py started_by, the rule every reader applies). */
static uint64_t running_ticks(void)
{
    struct timespec ts;
    long hz = sysconf(_SC_CLK_TCK);   /* USER_HZ (the auxiliary vector's AT_CLKTCK) */
    if (clock_gettime(CLOCK_BOOTTIME, &ts) || hz <= 0)
        return 0;
    return (uint64_t)ts.tv_sec * (uint64_t)hz + (uint64_t)ts.tv_nsec / (1000000000ull / (uint64_t)hz);
}

static uint64_t inode_of(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* include/uapi/linux/pidfd.h (Linux 6.11): the pid namespace of a pidfd's process, as a
 * namespace descriptor (close-on-exec) */
#ifndef PIDFD_GET_PID_NAMESPACE
#define PIDFD_GET_PID_NAMESPACE _IO(0xFF, 5)
#endif

/* This process's pid namespace (the inode /proc/self/ns/pid shows; 0 = unknown): from a
 * pidfd of its own, which needs no /proc (the process's first /proc lookups took 15.6 us
 * of its start-up here, the pidfd's three calls 9.4), else from /proc where the kernel
 * (before 6.11) or a seccomp profile refuses those. */
static uint64_t own_pid_ns(void)
{
    uint64_t ino = 0;
#ifdef SYS_pidfd_open
    int pidfd = (int)syscall(SYS_pidfd_open, getpid(), 0);
    if (pidfd >= 0) {
        int ns = ioctl(pidfd, PIDFD_GET_PID_NAMESPACE, 0);
        struct stat st;
        if (ns >= 0 && fstat(ns, &st) == 0)
            ino = (uint64_t)st.st_ino;
        if (ns >= 0)
            close(ns);
        close(pidfd);
    }
#endif
    return ino ? ino : inode_of("/proc/self/ns/pid");
}

/* Who this process is (a time it was running at, and its pid namespace: a slot's and a
 * standalone quota's owner fields), read once per process: the time stays one it ran at,
 * and the namespace does not change for a process (setns and unshare move only the
 * children it makes after).  A child reads its own: atfork_child forgets the parent's,
 * and a child made without fork's handlers (a raw clone) has another pid --
 * unless that pid was the reader's, its ancestor that has since exited, so the handler
 * is the rule and the pid the fallback.  A standalone slice's maker read both twice, a
 * reap the namespace once per slot. */
struct identity {
    uint64_t start_ticks, pid_ns;   /* start_ticks: running_ticks() at the first read */
};

static int32_t identity_read_by;   /* the pid that read own_identity's; 0: not read in this process */

static struct identity own_identity(void)
{
    static struct identity id;
    int32_t me = (int32_t)getpid();
    if (LOAD(&identity_read_by) != me) {
        id = (struct identity){running_ticks(), own_pid_ns()};
        STORE(&identity_read_by, me);
    }
    return id;
}

/* Where slot i's process is: still there, gone (done with its files), or not ours to say.
 * Its lock drops when its last reference to the usage file goes, which at exit may come
 * before the release of the files through which the driver holds its device memory (a
 * real driver's context teardown can take seconds): drained then, the slot would hand on
 * budget the device still spends.  So a slot whose lock is free is drained only once its
 * process is gone, its pid is a later process's (one that started after the time the slot
 * records), or it is a zombie with no other thread left: do_exit releases the files
 * before exit_notify makes the zombie, and a thread group's table goes with its last
 * thread (kernel/exit.c).  A process still there keeps its charge (exiting; or alive
 * without the file, as after an exec of a program without the shim: its charge stays
 * until it exits).  Our own slot
 * from before an exec is ours to drain.  Only a process of our own pid namespace can be
 * looked up: any other's slot is drained at once, as before. */
enum owner {
    OWNER_THERE,
    OWNER_GONE,
    OWNER_UNKNOWN,   /* not ours to look up, or its pid is another process's */
};

static enum owner slot_owner(int i)
{
    const struct vgpu_usage_proc *p = &S.usage->procs[i];
    int32_t pid = LOAD(&p->pid);
    uint64_t ticks = LOAD(&p->start_ticks), pid_ns = LOAD(&p->pid_ns), mine = own_identity().pid_ns;
    if (pid_ns != mine && mine == ROOT_PID_NS_INODE && pid > 0)
        pid = (int32_t)LOAD(&p->state);   /* a container's process: its pid here, as the node agent wrote it */
    else if (pid_ns != mine)
        return OWNER_UNKNOWN;
    if (pid <= 0 || !ticks || !pid_ns || pid == getpid())
        return OWNER_UNKNOWN;
    char path[64], state, status[2048];
    uint64_t start_now;   /* the start of the process at the pid now */
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    if (read_stat(path, &state, &start_now))
        return OWNER_GONE;
    if (start_now > ticks)
        return OWNER_UNKNOWN;   /* started after the slot's process was running: a later process */
    if (state != 'Z' && state != 'X')
        return OWNER_THERE;
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    if (read_small(path, status, sizeof status) > 0) {
        const char *threads = strstr(status, "\nThreads:");
        if (threads && strtol(threads + 9, NULL, 10) > 1)
            return OWNER_THERE;
    }
    return OWNER_GONE;
}

/* Is slot i's process done with its files, and does the driver no longer list memory under
 * it?  The kernel can finish a process before the last of its device files is let go (a
 * reference held elsewhere for a moment, a driver's deferred teardown): its memory is then
 * still the device's, listed under its pid.  That can be asked where NVML's pids are the
 * slot's (the root pid namespace), or where the node agent wrote the process's pid as NVML
 * lists it into the slot (`state`: a container's process); elsewhere the kernel's word
 * alone decides.  locked: when the caller took the slot's lock (NVML's list must be newer). */
static int slot_owner_gone(int i, uint64_t locked)
{
    if (LOAD(&S.usage->procs[i].flags) & VGPU_PROC_SHARED)
        return !shared_kept_by_driver(i);   /* no holder left (its lock is free): is the memory gone too? */
    enum owner o = slot_owner(i);
    if (o == OWNER_THERE)
        return 0;
    const struct vgpu_usage_proc *p = &S.usage->procs[i];
    uint32_t devices = 0;
    for (int d = 0; d < VGPU_MAX_DEVICES; d++)
        if (LOAD(&S.usage->charge[d][i]))
            devices |= 1u << d;
    if (!devices)
        return 1;
    /* the pid NVML names it by, as the agent wrote it: asked whatever the kernel here could
     * say (a tenant can write it too: it only keeps its own slice's slot) */
    int32_t nvml_pid = (int32_t)LOAD(&p->state);
    if (nvml_pid > 0 && driver_holds(nvml_pid, ROOT_PID_NS_INODE, devices, locked) == 1)
        return 0;
    if (o == OWNER_UNKNOWN)
        return 1;   /* (its pid another's now: NVML's figure under it is not the slot's) */
    return driver_holds(LOAD(&p->pid), LOAD(&p->pid_ns), devices, locked) != 1;
}

static int slice_from_file;   /* configure: the slice came from VGPU_SLICE_FILE */

/* Slot i, its lock taken and drained for a new owner (1), or left as it was (0): a live
 * process holds it, its process is still letting go of its memory, or (unless charged_too)
 * something is charged to it.  With S.lock held: our own description would re-grant a lock
 * it holds (our slot, the shared slots we hold), so those are skipped. */
static int take_slot(int i, int charged_too)
{
    if (i == S.slot || memory_holds_slot(i) || (!charged_too && slot_charged(i)) ||
        slot_lock(S.usage_fd, i, F_WRLCK))
        return 0;
    if (slot_in_use(i) && ((!charged_too && slot_charged(i)) || !slot_owner_gone(i, now_ns()))) {
        slot_lock(S.usage_fd, i, F_UNLCK);
        return 0;
    }
    drain_slot(i);   /* whatever its previous owner held went with it */
    /* the sum in admissions covers slots below slots_used: widen it before the first charge */
    uint32_t used = LOAD(&S.usage->slots_used);
    while (used < (uint32_t)i + 1 &&
           !__atomic_compare_exchange_n(&S.usage->slots_used, &used, (uint32_t)i + 1, 1, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST))
        ;
    return 1;
}

/* A free slot, its lock taken, drained, and inside slots_used; -1 when none is free.  With
 * S.lock held.  A slot nothing is charged to comes first: taking a charged one, a dead
 * process's, means asking NVML whether the driver let go of its memory (at start-up that
 * was most of what the shim cost: 99k instructions and an NVML start, in a slice whose
 * previous process had exited holding memory), and the reapers (a view, a refusal,
 * vgpu-ctl, the node agent) return those anyway. */
int take_free_slot(void)
{
    for (int charged_too = 0; charged_too < 2; charged_too++)
        for (int i = 0; i < VGPU_MAX_PROCS; i++)
            if (take_slot(i, charged_too))
                return i;
    return -1;
}

/* slots_used comes down past the free slots at its top, so that the sum in every admission
 * covers the slots that may be charged, not every slot ever used (a slice whose processes
 * came and went once summed all 64 on each allocation).  With S.lock held.  The top slot
 * is let go only with its lock held here (no process owns it, and none can claim it
 * meanwhile), drained first when its process is gone (as a reap does), and slots_used
 * moves down by a compare-and-swap: a claim widening it at the same time (take_free_slot,
 * before its first charge) either comes after and widens again, or makes this one fail.
 * Every slot at or above slots_used is therefore uncharged, and stays so until a claim
 * has widened past it. */
static void shrink_slots_used(void)
{
    for (;;) {
        uint32_t n = LOAD(&S.usage->slots_used);
        if (n == 0 || n > VGPU_MAX_PROCS)
            return;
        int i = (int)n - 1, ok = 1;
        if (i == S.slot || memory_holds_slot(i) || slot_lock(S.usage_fd, i, F_WRLCK))
            return;   /* ours, or a live process's */
        if (slot_in_use(i)) {
            if ((ok = slot_owner_gone(i, now_ns()))) {
                INFO("returning the memory of dead process %d", (int)LOAD(&S.usage->procs[i].pid));
                drain_slot(i);
            }
        }
        ok = ok && __atomic_compare_exchange_n(&S.usage->slots_used, &n, n - 1, 0, __ATOMIC_SEQ_CST,
                                               __ATOMIC_SEQ_CST);
        slot_lock(S.usage_fd, i, F_UNLCK);
        if (!ok)
            return;
    }
}

int claim_slot(void)
{
    int i = take_free_slot();
    if (i >= 0) {
        struct vgpu_usage_proc *p = &S.usage->procs[i];
        memset(p->comm, 0, sizeof p->comm);
        prctl(PR_GET_NAME, p->comm);   /* at most 16 bytes */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        p->started_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
        struct identity me = own_identity();
        p->start_ticks = me.start_ticks;
        p->pid_ns = me.pid_ns;
        p->cgroup_id = 0;   /* not read here (4 system calls, ~20 us): the node agent reads it from outside */
        p->flags = slice_from_file ? VGPU_PROC_FROM_FILE : 0;
        p->state = 0;                  /* NVML's pid for it: the node agent's to write */
        STORE(&p->pid, (int32_t)getpid());   /* last: a reader that sees the pid sees the rest */
        S.slot = i;
        shrink_slots_used();   /* (the slots above it that processes before left) */
        return 0;
    }
    static int said;
    if (!said++)
        ERR("all %d process slots of %s are taken; refusing GPU memory allocations until one frees",
            VGPU_MAX_PROCS, S.usage_path);
    return -1;
}

/* Return the slots of dead processes (their lock is free) to the container.  With
 * S.lock held: our own OFD would re-grant a lock we already hold. */
void reap_dead_locked(void)
{
    if (S.usage_fd < 0)
        return;
    uint32_t used = LOAD(&S.usage->slots_used);
    _Static_assert(VGPU_MAX_PROCS <= 64, "a slot's bit in one word");
    uint64_t locked = 0;   /* bit i: slot i's lock, taken here */
    for (int i = 0; i < VGPU_MAX_PROCS; i++)
        /* above slots_used a slot is uncharged (shrink_slots_used): only a process there
         * (a claim in progress, or one a tenant wrote) needs the look below */
        if (!(((uint32_t)i >= used && !LOAD(&S.usage->procs[i].pid)) || i == S.slot || memory_holds_slot(i) ||
              !slot_in_use(i) || slot_lock(S.usage_fd, i, F_WRLCK)))
            locked |= 1ull << i;
    /* every lock first, then one NVML list read after them all serves every slot */
    uint64_t after = now_ns();
    for (int i = 0; i < VGPU_MAX_PROCS; i++) {
        if (!(locked & 1ull << i))
            continue;
        if (slot_owner_gone(i, after)) {
            INFO("returning the memory of dead process %d", (int)LOAD(&S.usage->procs[i].pid));
            drain_slot(i);
        }
        slot_lock(S.usage_fd, i, F_UNLCK);
    }
    shrink_slots_used();
}

void reap_dead(void)
{
    pthread_mutex_lock(&S.lock);
    reap_dead_locked();
    pthread_mutex_unlock(&S.lock);
}

/* For views: reap at most every REAP_INTERVAL_NS, so a dead process's memory shows
 * as free again within a fraction of a second without a syscall storm. */
void reap_due(uint64_t t)
{
    STORE(&S.next_reap_ns, t + REAP_INTERVAL_NS);
    reap_dead();
}

/* nvml_resolve's own lock, not S.lock: it is called with S.lock held (a reaper asking NVML
 * whether a dead slot's process still holds memory). */
static pthread_mutex_t nvml_resolve_lock = PTHREAD_MUTEX_INITIALIZER;

static void atfork_child(void)
{
    /* The child shares the parent's open file description, and with it the locks of the
     * parent's slot and of the shared slots it holds.  It keeps that description open,
     * unused: a child forked from a process with a CUDA context holds the driver's
     * descriptors it inherited, and with them the parent's device memory, until it exits
     * (DataLoader workers; docs/shim.md), so the parent's charge must stay as long as
     * the child does.  Close-on-exec, like the driver's.  It takes a description of its
     * own, and a slot of its own on its first allocation. */
    pthread_mutex_init(&S.lock, NULL);
    pthread_mutex_init(&nvml_resolve_lock, NULL);
    S.slot = -1;
    S.next_claim_ns = 0;
    STORE(&identity_read_by, 0);   /* (own_identity: the parent's start is not ours) */
    if (S.usage_fd >= 0) {
        S.usage_fd = open(S.usage_path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);   /* the inherited one stays open */
        if (S.usage_fd < 0)
            deny("cannot reopen %s after fork: %s", S.usage_path, strerror(errno));
    }
    memory_atfork_child();
    compute_atfork_child();
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
#define RESOLVE_CALLED(sym, ret, params) *(void **)&real_##sym = real_dlsym(S.cuda, #sym);
    VGPU_CALLED(RESOLVE_CALLED)
}

void *resolve_real(void **real, const char *symbol)
{
    void *f = LOAD(real);
    if (f)
        return f;
    f = S.cuda ? real_dlsym(S.cuda, symbol) : NULL;   /* never RTLD_DEFAULT: it finds the hooks */
    if (f)
        __atomic_store_n(real, f, __ATOMIC_RELEASE);
    return f;
}

/* === configuration: the slice identity file ===
 * A container given a slice has its name in a file mounted read-only at a fixed path
 * (vgpu-ctl env --format docker|k8s, the DRA driver's CDI spec).  It wins over the
 * environment, so a process that clears its environment (env -i, a daemon's sanitised
 * children) stays in its slice when the shim comes from /etc/ld.so.preload.  The slice's
 * files are beside it: VGPU_SLICE_FILE's directory is the node directory. */
#define VGPU_SLICE_FILE "/run/vgpu/.slice"
#define VGPU_SLICE_DIR "/run/vgpu"

/* 1 with name filled, 0 when there is no file, -1 (denied, with the reason) when the
 * file is there but unusable: the container was meant to be in a slice. */
static int slice_file(char name[VGPU_NAME_MAX])
{
    char buf[VGPU_NAME_MAX + 2];
    int fd = open(VGPU_SLICE_FILE, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT || errno == ENOTDIR)
            return 0;
        deny("cannot read the slice identity file %s: %s", VGPU_SLICE_FILE, strerror(errno));
        return -1;
    }
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n < 0) {
        deny("cannot read the slice identity file %s: %s", VGPU_SLICE_FILE, strerror(errno));
        return -1;
    }
    buf[n] = 0;
    if (n > 0 && buf[n - 1] == '\n')
        buf[--n] = 0;
    if (!valid_name(buf)) {
        deny("the slice identity file %s does not hold a slice name (one line: letters, digits, '-', '_', "
             "'.')", VGPU_SLICE_FILE);
        return -1;
    }
    memcpy(name, buf, (size_t)n + 1);
    return 1;
}

/* === standalone slices ===
 * Without a controller the limit variables make the slice (quota_from_env).  It is
 * temporary: sized to the devices the driver shows this program (not all 16 indices),
 * owned by the process that made it, and removed by the last of its processes to exit,
 * with the node directory and share board where they were made for it, so a later run
 * with other limits gets them, not the first run's (and a killed last process leaves it
 * to the node agent's orphan removal).  Making, joining and removing all hold the node
 * directory's flock, the lock vgpu-ctl's create and delete take (src/vgpu/slices/files.py
 * _node_lock): a process joining the slice holds it (shared) from finding the quota until
 * its slot is claimed, the last one (exclusive) while it removes, so a last process ending
 * meanwhile either removes the slice before (the joiner makes it again) or sees the
 * joiner's slot and leaves it. */

static int standalone_node_fd = -1;      /* the node directory, locked while configure joins */
static char *standalone_dir;             /* set once this process is in a standalone slice */
static char standalone_name[VGPU_NAME_MAX];
static dev_t standalone_quota_dev;       /* the quota file it joined (not one made again since) */
static ino_t standalone_quota_ino;

#define NODE_LOCK_WAIT_NS 2000000000ull   /* vgpu-ctl holds it for a file write; an exiting process
                                             for its look at the slots */

/* The node directory's flock (LOCK_SH to join: joiners never wait for each other, and the
 * quota is made atomically whoever makes it; LOCK_EX to remove), or 0 after
 * NODE_LOCK_WAIT_NS (then the caller goes on without: the race above reopens, nothing
 * hangs).  The waits grow from 20 us to 1 ms: with 32 processes of one slice starting and
 * ending at once, each holding it a moment, a fixed 1 ms between tries made some rounds'
 * median cuInit 5-11 ms (issue 31). */
static int node_lock(int fd, int how)
{
    uint64_t deadline = now_ns() + NODE_LOCK_WAIT_NS;
    for (long wait_ns = 20000;; wait_ns = wait_ns < 1000000 ? 2 * wait_ns : 1000000) {
        if (flock(fd, how | LOCK_NB) == 0)
            return 1;
        if ((errno != EWOULDBLOCK && errno != EINTR) || now_ns() >= deadline)
            return 0;
        struct timespec ts = {0, wait_ns};
        nanosleep(&ts, NULL);
    }
}

/* The devices the driver shows this program: what a standalone slice holds.  0 when it
 * cannot say (no driver, no device): the slice then holds every index, as before. */
static uint32_t visible_devices(void)
{
    int n = 0;
    if (!REAL(cuInit) || !real_cuDeviceGetCount || real_cuInit(0) != CUDA_SUCCESS ||
        real_cuDeviceGetCount(&n) != CUDA_SUCCESS || n <= 0)
        return 0;
    return n < VGPU_MAX_DEVICES ? (uint32_t)n : VGPU_MAX_DEVICES;
}

/* Make the slice's quota from the environment unless one is there (a controller's, or
 * another process's: that one wins), with the node lock held from here until configure
 * has claimed a slot (standalone_joined). */
static void standalone_join(const char *dir, const char *cdir, const char *qpath, struct vgpu_quota *q)
{
    uint32_t devices = access(qpath, F_OK) ? visible_devices() : 0;   /* (cuInit outside the lock) */
    int made_dir = 0, fd = -1;
    for (int tries = 0; tries < 10 && fd < 0; tries++) {
        made_dir = mkdir(dir, 0755) == 0;
        if ((fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0)
            continue;   /* removed between the two (or unusable: join_slice says why) */
        if (!node_lock(fd, LOCK_SH)) {
            INFO("the node directory %s stayed locked: joining slice %s without its lock", dir, q->name);
            close(fd);
            fd = -1;
            break;
        }
        struct stat st;
        if (fstat(fd, &st) == 0 && st.st_nlink == 0) {
            close(fd);   /* the last process of the node's last slice removed it before the lock came */
            fd = -1;
        }
    }
    standalone_node_fd = fd;
    if (access(qpath, F_OK) == 0)
        return;
    if (!devices)
        devices = visible_devices();   /* (removed since the look above: rare) */
    if (devices)
        q->device_count = devices;
    q->flags |= VGPU_QUOTA_TEMPORARY | VGPU_QUOTA_STANDALONE | (made_dir ? VGPU_QUOTA_MADE_DIR : 0) |
                (access(S.board_path, F_OK) ? VGPU_QUOTA_MADE_BOARD : 0);
    q->owner_pid = (uint64_t)getpid();
    struct identity me = own_identity();
    q->owner_start = me.start_ticks;
    q->owner_pid_ns = me.pid_ns;
    mkdir(cdir, 0755);
    if (create_file_once(qpath, q, sizeof *q, 0644))
        INFO("made standalone slice %s in %s (%u devices): removed when its last process ends", q->name, dir,
             q->device_count);
}

/* configure is done with the node lock (whether it joined or not). */
static void standalone_joined(const char *dir, const char *name, const char *qpath)
{
    struct stat st;
    if (S.mode == MODE_ENFORCE && (LOAD(&S.quota->flags) & VGPU_QUOTA_STANDALONE) && stat(qpath, &st) == 0) {
        standalone_dir = strdup(dir);   /* (out of memory: the slice stays, as if a process were left) */
        snprintf(standalone_name, sizeof standalone_name, "%s", name);
        standalone_quota_dev = st.st_dev;
        standalone_quota_ino = st.st_ino;
    }
    if (standalone_node_fd >= 0)
        close(standalone_node_fd);   /* (closing lets go of the flock) */
    standalone_node_fd = -1;
}

/* Does a child of this process live?  A child forked after CUDA was initialised holds
 * the driver's descriptors, and with them this process's memory, and this process's usage
 * description, and with it its slot (atfork_child): its lock never answers this process.
 * Any live child keeps the slice (the node agent removes it once all are gone); where
 * the kernel cannot list children, so does not knowing. */
static int live_children(void)
{
    DIR *tasks = opendir("/proc/self/task");
    if (!tasks)
        return 1;
    struct dirent *t;
    int any = 0;
    while (!any && (t = readdir(tasks))) {
        if (t->d_name[0] == '.')
            continue;
        char path[64], buf[4096];
        snprintf(path, sizeof path, "/proc/self/task/%.16s/children", t->d_name);
        ssize_t n = read_small(path, buf, sizeof buf);
        if (n < 0) {
            any = 1;
            break;
        }
        for (char *p = buf, *end; !any && *p; p = end) {
            long pid = strtol(p, &end, 10);
            if (end == p)
                break;
            char state, stat_path[64];
            uint64_t ticks;
            snprintf(stat_path, sizeof stat_path, "/proc/%ld/stat", pid);
            any = read_stat(stat_path, &state, &ticks) == 0 && state != 'Z';   /* a zombie holds nothing */
        }
    }
    closedir(tasks);
    return any;
}

/* Is anything but this process in the slice?  Every slot's lock is asked from this
 * process's description, which never conflicts with its own locks: a live process's slot,
 * or a shared slot another holds, answers.  A charged shared slot is SOMEONE too, since the
 * driver may keep an export this process holds past its exit (a descriptor parked
 * elsewhere), as is a live child (live_children).  A dead process's slot still charged
 * while the driver holds its memory (slot_owner_gone: its device files can outlive it
 * for a moment) is LETTING_GO: worth waiting for. */
enum others { NOBODY, SOMEONE, LETTING_GO };
static enum others others_in_slice(void)
{
    enum others found = NOBODY;
    for (int i = 0; i < VGPU_MAX_PROCS; i++) {
        struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = LOCK_BASE + i, .l_len = 1};
        if (fcntl(S.usage_fd, F_OFD_GETLK, &fl) != 0 || fl.l_type != F_UNLCK)
            return SOMEONE;
        if (i == S.slot || !slot_in_use(i))
            continue;
        if (LOAD(&S.usage->procs[i].flags) & VGPU_PROC_SHARED) {
            if (slot_charged(i))
                return SOMEONE;
        } else if (!slot_owner_gone(i, now_ns())) {
            found = LETTING_GO;
        }
    }
    return live_children() ? SOMEONE : found;
}

static int node_has_slices(int node_fd)
{
    DIR *d = fdopendir(dup(node_fd));
    if (!d)
        return 1;
    struct dirent *e;
    int any = 0;
    while (!any && (e = readdir(d)))
        any = e->d_type == DT_DIR && valid_name(e->d_name);
    closedir(d);
    return any;
}

/* The last process of a standalone slice removes it at exit, under the node lock: the
 * quota it joined (not one made again since), the usage file, the slice's directory, and
 * the board and node directory where they were made for it and no slice is left.  Where a
 * dead process's memory is still being let go it asks again, LETGO_TRIES times.  No S.lock
 * here: a thread that held it when exit began would hang the exit. */
#define LETGO_TRIES 100                   /* 2 ms apart */

static enum others remove_if_last(int fd, uint32_t flags)
{
    if (!node_lock(fd, LOCK_EX))
        return SOMEONE;
    enum others who = others_in_slice();
    int cfd = who == NOBODY ? openat(fd, standalone_name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW) : -1;
    struct stat st;
    if (cfd >= 0 && fstatat(cfd, "quota", &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_dev == standalone_quota_dev &&
        st.st_ino == standalone_quota_ino) {
        unlinkat(cfd, "usage", 0);
        unlinkat(cfd, "quota", 0);
        if (unlinkat(fd, standalone_name, AT_REMOVEDIR) == 0 && (flags & VGPU_QUOTA_MADE_BOARD) &&
            !node_has_slices(fd)) {
            unlinkat(fd, ".sm-board", 0);
            if (flags & VGPU_QUOTA_MADE_DIR)
                rmdir(standalone_dir);   /* (fails where something else lives there now) */
        }
    }
    if (cfd >= 0)
        close(cfd);
    flock(fd, LOCK_UN);
    return who;
}

__attribute__((destructor)) static void standalone_remove_at_exit(void)
{
    if (!standalone_dir || S.usage_fd < 0)
        return;
    uint32_t flags = LOAD(&S.quota->flags);
    int fd = open(standalone_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return;
    for (int i = 0; i < LETGO_TRIES && remove_if_last(fd, flags) == LETTING_GO; i++) {
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
    close(fd);
}

/* Map the slice's files and claim a slot (or deny, saying why). */
static void join_slice(const char *name, const char *qpath, const struct vgpu_quota *env_quota)
{
    if (!(S.quota = map_quota(qpath)))
        return;
    if (env_quota && memcmp(S.quota->devices, env_quota->devices, S.quota->device_count * sizeof env_quota->devices[0]))
        INFO("%s already exists; its limits apply, not the environment's", qpath);
    if (!(S.usage = map_usage(S.usage_path)))
        return;
    if (memory_map_table())
        return deny("cannot map the allocation table");
    S.mode = MODE_ENFORCE;
    claim_slot();   /* none free: allocations are refused until one is (see have_slot) */
    INFO("container %s: quota %s, usage %s, slot %d", name, qpath, S.usage_path, S.slot);
}

/* 64-bit FNV-1a of a string: the slice's key on the share board, the hooked names' set. */
static uint64_t fnv1a(const char *s)
{
    uint64_t h = 14695981039346656037ull;
    while (*s)
        h = (h ^ (unsigned char)*s++) * 1099511628211ull;
    return h;
}

/* "<dir>/<leaf>", allocated; NULL when memory is short.  Sized to the path, where buffers
 * of PATH_MAX (two in the state, two on the stack) each had a page of their own written at
 * every start: a page fault each, ~1 us here (issue 31). */
static char *path_in(const char *dir, const char *leaf)
{
    size_t a = strlen(dir), b = strlen(leaf);
    char *p = malloc(a + b + 2);
    if (p) {
        memcpy(p, dir, a);
        p[a] = '/';
        memcpy(p + a + 1, leaf, b + 1);
    }
    return p;
}

static void configure(void)
{
    const char *lvl = getenv("VGPU_LOG");
    S.log_level = !lvl ? 0 : !strcmp(lvl, "debug") ? 2 : !strcmp(lvl, "info") ? 1 : 0;

    const char *overhead = getenv("VGPU_CONTEXT_OVERHEAD");
    if (overhead && *overhead) {
        if (parse_size(overhead, 0, &S.context_overhead) || S.context_overhead == VGPU_UNLIMITED)
            return deny("VGPU_CONTEXT_OVERHEAD=%s is not a memory size (use bytes or Ki/Mi/Gi/Ti, e.g. 500Mi)",
                        overhead);
        S.context_overhead_set = 1;
    }

    /* the slice's name: VGPU_SLICE, or where it is unset or empty VGPU_CONTAINER, its old
     * name (still read until the next release: an image's older tools may set only it) */
    const char *name_var = "VGPU_SLICE";
    const char *name = getenv(name_var);
    if (!name || !*name)
        name = getenv(name_var = "VGPU_CONTAINER");
    char file_name[VGPU_NAME_MAX];
    if ((slice_from_file = slice_file(file_name)) < 0)
        return;   /* denied, with the reason */
    if (slice_from_file) {
        if (name && *name && strcmp(name, file_name))
            INFO("%s=%s ignored: %s names slice %s", name_var, name, VGPU_SLICE_FILE, file_name);
        name = file_name;
    }
    struct vgpu_quota env_quota;
    /* with the file the slice's quota is mounted beside it: never one made from variables */
    int from_env = slice_from_file ? 0 : quota_from_env(&env_quota, name && *name ? name : "default");
    if (from_env < 0)
        return;   /* denied, with the reason */
    if (!from_env && !(name && *name)) {
        S.mode = MODE_PASS;   /* not a managed program */
        DEBUG("no VGPU_SLICE and no limits: passing through");
        return;
    }
    if (!name || !*name)
        name = "default";
    if (!valid_name(name))
        return deny("%s=%s is not a valid name (letters, digits, '-', '_', '.')", name_var, name);

    const char *dir = slice_from_file ? VGPU_SLICE_DIR : getenv("VGPU_DIR");
    char tmpdir[64];
    if (!dir || !*dir) {
        dir = "/run/vgpu";
        if (from_env && access(dir, W_OK)) {   /* standalone without root: a private dir */
            snprintf(tmpdir, sizeof tmpdir, "/tmp/vgpu-%u", (unsigned)getuid());
            dir = tmpdir;
        }
    }
    if (strlen(dir) + 1 + strlen(name) >= PATH_MAX - 16)
        return deny("VGPU_DIR is too long (%zu characters): its slice's files would pass PATH_MAX (%d)", strlen(dir),
                    PATH_MAX);
    char *cdir = path_in(dir, name), *qpath = cdir ? path_in(cdir, "quota") : NULL;
    S.usage_path = cdir ? path_in(cdir, "usage") : NULL;
    S.board_path = path_in(dir, ".sm-board");
    if (!qpath || !S.usage_path || !S.board_path) {
        free(cdir);
        free(qpath);
        return deny("out of memory at start-up");
    }
    S.slice_key = fnv1a(name) | 1;   /* never 0, a free entry (vgpu/board.py slice_key: the same) */
    if (from_env)
        standalone_join(dir, cdir, qpath, &env_quota);
    join_slice(name, qpath, from_env ? &env_quota : NULL);
    if (from_env)
        standalone_joined(dir, name, qpath);
    free(cdir);
    free(qpath);
}

void init_slow(void)
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

/* === lifecycle === */

SHIM_EXPORT CUresult cuInit(unsigned int Flags)
{
    ENTER(cuInit, Flags);   /* initialising here puts configuration errors next to cuInit */
    return real_cuInit(Flags);
}


/* === NVML === */

void nvml_resolve(void)
{
    if (LOAD(&S.nvml_ready))
        return;
    pthread_mutex_lock(&nvml_resolve_lock);
    if (!S.nvml_ready) {
        resolve_real_dlsym();
        S.nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL);
        for (size_t i = 0; S.nvml && i < NHOOKS(nvml_hooks); i++)
            *nvml_hooks[i].real = real_dlsym(S.nvml, nvml_hooks[i].symbol);
        if (S.nvml) {
#define RESOLVE_NVML_CALLED(sym, ret, params) *(void **)&real_##sym = real_dlsym(S.nvml, #sym);
            VGPU_NVML_CALLED(RESOLVE_NVML_CALLED)
        }
        STORE(&S.nvml_ready, 1);
    }
    pthread_mutex_unlock(&nvml_resolve_lock);
}

int nvml_start(void)
{
    static int up;
    if (LOAD(&up))
        return 0;
    nvml_resolve();
    pthread_mutex_lock(&nvml_resolve_lock);
    if (!up && real_nvmlInit_v2 && real_nvmlInit_v2() == NVML_SUCCESS)
        STORE(&up, 1);
    pthread_mutex_unlock(&nvml_resolve_lock);
    return LOAD(&up) ? 0 : -1;
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

/* A runtime asks cuGetProcAddress for hundreds of symbols at start-up, and the shim hooks
 * fewer than one in eight of them: a 512-bit set of the hooked names' hashes turns most
 * away before the ABI lookup and the scan of the hooks.  Built on the first query. */
static uint64_t hooked_bases[8];
static pthread_once_t hooked_bases_once = PTHREAD_ONCE_INIT;

static unsigned name_hash(const char *s)
{
    return (unsigned)(fnv1a(s) >> 55);   /* its top 9 bits: a bit of the set */
}

static void hash_hooked_bases(void)
{
    for (size_t i = 0; i < NHOOKS(cuda_hooks); i++) {
        unsigned h = name_hash(cuda_hooks[i].base);
        hooked_bases[h / 64] |= 1ull << (h % 64);
    }
}

static int maybe_hooked(const char *base)
{
    pthread_once(&hooked_bases_once, hash_hooked_bases);
    unsigned h = name_hash(base);
    return hooked_bases[h / 64] >> (h % 64) & 1;
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
    int known = maybe_hooked(symbol) &&
                vgpu_resolve_abi(symbol, cudaVersion, flags, &abi) == CU_GET_PROC_ADDRESS_SUCCESS;
    for (size_t i = 0; known && i < NHOOKS(cuda_hooks); i++) {
        const struct hook *h = &cuda_hooks[i];
        if (h->version != abi.version || h->per_thread != abi.per_thread || strcmp(h->base, symbol))
            continue;
        static int newest;
        if (!newest)
            newest = newest_known_version();
        if (cudaVersion > newest && *pfn != resolve_real(h->real, h->symbol)) {
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
    if (!REAL(cuGetProcAddress))
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
    if (!REAL(cuGetProcAddress_v2))
        return CUDA_ERROR_NOT_FOUND;
    CUresult r = real_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (r == CUDA_SUCCESS)
        substitute(symbol, pfn, cudaVersion, flags);
    return r;
}
