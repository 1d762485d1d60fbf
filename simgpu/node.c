/* simgpu node state shared by all processes: see node.h. */
#define _GNU_SOURCE
#include "simgpu/node.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* === profiles === */

/* Where the figures come from:
 *   model, memory, SMs, memory bus, L2, PCIe, max power (TDP), NVENC/NVDEC counts: NVIDIA's
 *     product datasheets (A10; A100 40GB SXM4; H100 SXM5 80GB; H200 SXM 141GB).  H200 is
 *     the same GH100 configuration as H100 SXM5 (132 SMs, 50 MB L2) with HBM3e on a 6144-bit
 *     bus.
 *   max SM clock (boost) and base clock, max memory clock: the boards' published boost and
 *     base clocks; memory clocks as deviceQuery/nvidia-smi report them (A10 GDDR6 6251 MHz,
 *     A100 HBM2 1215 MHz, H100 HBM3 2619 MHz, H200 HBM3e 3201 MHz).
 *   per-SM limits: the CUDA C++ Programming Guide's table of technical specifications per
 *     compute capability (8.0: 164 KB shared per SM, 163 KB opt-in per block, 2048 threads,
 *     32 blocks; 8.6: 100 KB, 99 KB, 1536 threads, 16 blocks; 9.0: 228 KB, 227 KB, 2048,
 *     32).  FP32 lanes per SM: 64 on GA100, 128 on GA102 and GH100.  FP64 rate: 1/2 of FP32
 *     on GA100 and GH100, 1/64 on GA102 (the architecture whitepapers).
 *   PCI device ids: 0x2236 (A10), 0x20B0 (A100 SXM4 40GB), 0x2330 (H100 SXM5 80GB), 0x2335
 *     (H200); subsystem ids as the PCI ID database lists NVIDIA's own boards.
 *   Not published per board, so ballparks of what nvidia-smi -q shows on these boards (a
 *     model, marked so in docs/simgpu.md): temperature thresholds, minimum power limit,
 *     idle power, video clock, BAR1 size, copy engines (2 on GA102, 3 on the others).
 *   context overhead (SIMGPU_CONTEXT_OVERHEAD=profile, cuda.c): what nvidia-smi commonly
 *     shows for a process that has only created a context with a recent driver and lazy
 *     module loading (a few hundred MiB, more on the larger parts); it varies with driver,
 *     CUDA version and loaded modules. */
#define MiB (1ull << 20)
#define GiB (1ull << 30)
#define KiB 1024
static const struct simgpu_profile profiles[] = {
    {.id = "a10", .model = "NVIDIA A10", .memory = 24 * GiB, .sm_count = 72, .cc_major = 8, .cc_minor = 6,
     .clock_khz = 1695000, .mem_clock_khz = 6251000, .bus_width = 384, .l2_bytes = 6 << 20,
     .context_overhead = 256 * MiB,
     .smem_per_sm = 100 * KiB, .smem_per_block_optin = 99 * KiB, .threads_per_sm = 1536, .blocks_per_sm = 16,
     .copy_engines = 2, .fp32_per_fp64 = 64, .cores_per_sm = 128,
     .pci_device = 0x2236, .pci_subsystem = 0x1482, .pcie_gen = 4, .pcie_width = 16,
     .power_limit_w = 150, .power_min_w = 100, .power_idle_w = 15, .base_clock_mhz = 885, .video_clock_mhz = 1515,
     .bar1_mib = 32768, .encoders = 1, .decoders = 2,
     .temp_shutdown = 98, .temp_slowdown = 95, .temp_gpu_max = 93, .temp_mem_max = 0,
     .architecture = 7, .mig_capable = 0},
    {.id = "a100-40g", .model = "NVIDIA A100-SXM4-40GB", .memory = 40 * GiB, .sm_count = 108, .cc_major = 8,
     .cc_minor = 0, .clock_khz = 1410000, .mem_clock_khz = 1215000, .bus_width = 5120, .l2_bytes = 40 << 20,
     .context_overhead = 384 * MiB,
     .smem_per_sm = 164 * KiB, .smem_per_block_optin = 163 * KiB, .threads_per_sm = 2048, .blocks_per_sm = 32,
     .copy_engines = 3, .fp32_per_fp64 = 2, .cores_per_sm = 64,
     .pci_device = 0x20B0, .pci_subsystem = 0x134F, .pcie_gen = 4, .pcie_width = 16,
     .power_limit_w = 400, .power_min_w = 100, .power_idle_w = 50, .base_clock_mhz = 1095, .video_clock_mhz = 1290,
     .bar1_mib = 65536, .encoders = 0, .decoders = 5,
     .temp_shutdown = 92, .temp_slowdown = 89, .temp_gpu_max = 85, .temp_mem_max = 95,
     .architecture = 7, .mig_capable = 1},
    {.id = "h100-80g", .model = "NVIDIA H100 80GB HBM3", .memory = 80 * GiB, .sm_count = 132, .cc_major = 9,
     .cc_minor = 0, .clock_khz = 1980000, .mem_clock_khz = 2619000, .bus_width = 5120, .l2_bytes = 50 << 20,
     .context_overhead = 512 * MiB,
     .smem_per_sm = 228 * KiB, .smem_per_block_optin = 227 * KiB, .threads_per_sm = 2048, .blocks_per_sm = 32,
     .copy_engines = 3, .fp32_per_fp64 = 2, .cores_per_sm = 128,
     .pci_device = 0x2330, .pci_subsystem = 0x16C1, .pcie_gen = 5, .pcie_width = 16,
     .power_limit_w = 700, .power_min_w = 200, .power_idle_w = 70, .base_clock_mhz = 1590, .video_clock_mhz = 1755,
     .bar1_mib = 131072, .encoders = 0, .decoders = 7,
     .temp_shutdown = 92, .temp_slowdown = 89, .temp_gpu_max = 87, .temp_mem_max = 95,
     .architecture = 9, .mig_capable = 1},
    {.id = "h200", .model = "NVIDIA H200", .memory = 141 * GiB, .sm_count = 132, .cc_major = 9, .cc_minor = 0,
     .clock_khz = 1980000, .mem_clock_khz = 3201000, .bus_width = 6144, .l2_bytes = 50 << 20,
     .context_overhead = 512 * MiB,
     .smem_per_sm = 228 * KiB, .smem_per_block_optin = 227 * KiB, .threads_per_sm = 2048, .blocks_per_sm = 32,
     .copy_engines = 3, .fp32_per_fp64 = 2, .cores_per_sm = 128,
     .pci_device = 0x2335, .pci_subsystem = 0x18BE, .pcie_gen = 5, .pcie_width = 16,
     .power_limit_w = 700, .power_min_w = 200, .power_idle_w = 75, .base_clock_mhz = 1590, .video_clock_mhz = 1755,
     .bar1_mib = 262144, .encoders = 0, .decoders = 7,
     .temp_shutdown = 92, .temp_slowdown = 89, .temp_gpu_max = 87, .temp_mem_max = 95,
     .architecture = 9, .mig_capable = 1},
};
#define NPROFILES (sizeof profiles / sizeof profiles[0])

static const struct simgpu_profile *find_profile(const char *id)
{
    for (size_t i = 0; i < NPROFILES; i++)
        if (strcmp(profiles[i].id, id) == 0)
            return &profiles[i];
    return NULL;
}

/* === process-local attachment === */

#define LOCK_BASE (1ll << 40)   /* slot i is owned by an OFD lock on byte LOCK_BASE + i */
#define SHARED_LOCK_BASE (LOCK_BASE + 65536)   /* shared object i: held through byte + i */

static struct {
    pthread_mutex_t lock;       /* guards attach and reaping within this process */
    int attached;
    int fd;
    char path[4096];
    struct simgpu_node *node;
    size_t map_size;
    const struct simgpu_profile *profile;
    int slot;
    int forked;                 /* forked while holding a slot: a child may hold it too */
    char dir[4096];             /* the state directory */
    pthread_mutex_t shared_lock;   /* holds[] and every lock on a shared object's byte */
    int holds[SIMGPU_MAX_SHARED];  /* this process's holds of each shared object */
    char error[512];
    int log;                    /* 0 unknown, 1 on, -1 off (SIMGPU_LOG) */
} g = {.lock = PTHREAD_MUTEX_INITIALIZER, .fd = -1, .slot = -1, .shared_lock = PTHREAD_MUTEX_INITIALIZER};

void simgpu_log(const char *fmt, ...)
{
    if (g.log == 0) {   /* decided once, on the first message */
        const char *e = getenv("SIMGPU_LOG");
        g.log = e && *e && strcmp(e, "0") ? 1 : -1;
    }
    if (g.log < 0)
        return;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "simgpu[%d]: %s\n", (int)getpid(), buf);
}

static int fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g.error, sizeof g.error, fmt, ap);
    va_end(ap);
    fprintf(stderr, "simgpu: %s\n", g.error);
    return -1;
}

const char *simgpu_error(void) { return g.error; }
struct simgpu_node *simgpu_node(void) { return g.node; }
const struct simgpu_profile *simgpu_profile(void) { return g.profile; }

static size_t header_size(void)
{
    size_t page = 4096;
    return (sizeof(struct simgpu_node) + page - 1) / page * page;
}

struct simgpu_interval *simgpu_ring(int dev)
{
    char *base = (char *)g.node + header_size();
    return (struct simgpu_interval *)(base + (size_t)dev * SIMGPU_RING_SIZE *
                                                 sizeof(struct simgpu_interval));
}

static void init_node(struct simgpu_node *n, const struct simgpu_profile *p, int ndev)
{
    memset(n, 0, sizeof *n);
    n->version = SIMGPU_VERSION;
    n->device_count = (uint32_t)ndev;
    snprintf(n->profile_id, sizeof n->profile_id, "%s", p->id);
    unsigned char seed[16] = {0};
    int r = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (r >= 0) {
        if (read(r, seed, sizeof seed) != (ssize_t)sizeof seed)
            memset(seed, 0x5a, sizeof seed);
        close(r);
    }
    for (int d = 0; d < SIMGPU_MAX_DEVICES; d++) {
        struct simgpu_device *dev = &n->devices[d];
        pthread_mutexattr_t a;
        pthread_mutexattr_init(&a);
        pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
        pthread_mutex_init(&dev->lock, &a);
        pthread_mutexattr_destroy(&a);
        memcpy(dev->uuid, seed, 16);
        dev->uuid[15] = (unsigned char)(seed[15] + d);
        dev->uuid[6] = (unsigned char)((dev->uuid[6] & 0x0f) | 0x40);   /* version 4 */
        dev->uuid[8] = (unsigned char)((dev->uuid[8] & 0x3f) | 0x80);
    }
    simgpu_mig_init(n->mig, SIMGPU_MAX_DEVICES);
    /* magic last: a reader that sees it sees an initialised node */
    __atomic_store_n(&n->magic, SIMGPU_MAGIC, __ATOMIC_RELEASE);
}

static int parse_devices(const char *s, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < 1 || v > SIMGPU_MAX_DEVICES)
        return -1;
    *out = (int)v;
    return 0;
}

static int attach_locked(void)
{
    const char *want_profile = getenv("SIMGPU_PROFILE");
    const char *want_devices = getenv("SIMGPU_DEVICES");
    const struct simgpu_profile *p = find_profile(want_profile && *want_profile ? want_profile : "a10");
    if (!p) {
        char known[256] = "";
        for (size_t i = 0; i < NPROFILES; i++) {
            strncat(known, i ? ", " : "", sizeof known - strlen(known) - 1);
            strncat(known, profiles[i].id, sizeof known - strlen(known) - 1);
        }
        return fail("SIMGPU_PROFILE=%s is not a known profile (known: %s)", want_profile, known);
    }
    int ndev = 1;
    if (want_devices && *want_devices && parse_devices(want_devices, &ndev))
        return fail("SIMGPU_DEVICES=%s is not a device count between 1 and %d", want_devices,
                    SIMGPU_MAX_DEVICES);

    const char *dir = getenv("SIMGPU_STATE_DIR");
    char defdir[256];
    if (!dir || !*dir) {
        snprintf(defdir, sizeof defdir, "/tmp/simgpu-%u", (unsigned)getuid());
        dir = defdir;
    }
    if (mkdir(dir, 0700) && errno != EEXIST)
        return fail("cannot create state directory %s: %s (set SIMGPU_STATE_DIR to a writable "
                    "directory)", dir, strerror(errno));
    if ((size_t)snprintf(g.path, sizeof g.path, "%s/node", dir) >= sizeof g.path)
        return fail("state directory path too long: %s", dir);
    snprintf(g.dir, sizeof g.dir, "%s", dir);
    int fd = open(g.path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0)
        return fail("cannot open %s: %s (set SIMGPU_STATE_DIR to a writable directory)", g.path,
                    strerror(errno));

    size_t size = header_size() + (size_t)SIMGPU_MAX_DEVICES * SIMGPU_RING_SIZE *
                                      sizeof(struct simgpu_interval);
    flock(fd, LOCK_EX);   /* serialises creation between processes starting together */
    struct stat st;
    int fresh = fstat(fd, &st) == 0 && (size_t)st.st_size < size;
    if (!fresh) {
        struct simgpu_node hdr;
        fresh = pread(fd, &hdr, sizeof hdr, 0) != (ssize_t)sizeof hdr || hdr.magic != SIMGPU_MAGIC ||
                hdr.version != SIMGPU_VERSION;
    }
    if (fresh && (ftruncate(fd, 0) || ftruncate(fd, (off_t)size))) {
        int e = errno;
        flock(fd, LOCK_UN);
        close(fd);
        return fail("cannot size %s: %s", g.path, strerror(e));
    }
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        int e = errno;
        flock(fd, LOCK_UN);
        close(fd);
        return fail("cannot map %s: %s", g.path, strerror(e));
    }
    struct simgpu_node *n = m;
    if (fresh)
        init_node(n, p, ndev);
    flock(fd, LOCK_UN);

    /* A node outlives the processes that made it; an explicit request must match it. */
    if ((want_profile && *want_profile && strcmp(n->profile_id, p->id)) ||
        (want_devices && *want_devices && (int)n->device_count != ndev)) {
        char have[64];
        snprintf(have, sizeof have, "%s x%u", n->profile_id, n->device_count);
        munmap(m, size);
        close(fd);
        return fail("%s already simulates %s; it does not match SIMGPU_PROFILE/SIMGPU_DEVICES "
                    "(use another SIMGPU_STATE_DIR)", g.path, have);
    }
    g.profile = find_profile(n->profile_id);
    if (!g.profile) {
        munmap(m, size);
        close(fd);
        return fail("%s names unknown profile %.32s", g.path, n->profile_id);
    }
    g.fd = fd;
    g.node = n;
    g.map_size = size;
    simgpu_log("attached %s (%s x%u)", g.path, n->profile_id, n->device_count);
    return 0;
}

/* fork: what a process holds on the device lives as long as its descriptors.  A real
 * driver's device memory belongs to the process's open descriptors of the device files,
 * and a forked child inherits them: the memory stays held until every process holding
 * them is gone, as with DataLoader workers that outlive their parent (NVIDIA/Megatron-LM
 * #3684: "GPU memory remains non-zero in nvidia-smi, because the dataloader workers" keep
 * /dev/nvidia* open; nvidia-smi then shows the memory under the dead parent's pid).  Here
 * the parent's slot (its memory, its context) and its holds of shared objects are OFD
 * locks of the parent's description of the node file: the child keeps that description
 * open (unused; close-on-exec like the driver's) and takes a fresh one for itself. */
static void atfork_parent(void)
{
    if (g.slot >= 0)
        g.forked = 1;   /* a child may hold our slot now: no clearing it at exit */
}

static void atfork_child(void)
{
    pthread_mutex_init(&g.lock, NULL);
    pthread_mutex_init(&g.shared_lock, NULL);
    if (g.fd >= 0)
        g.fd = open(g.path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);   /* the inherited one stays open */
    g.slot = -1;
    g.forked = 0;
    memset(g.holds, 0, sizeof g.holds);
}

int simgpu_attach(void)
{
    if (__atomic_load_n(&g.attached, __ATOMIC_ACQUIRE) == 1)
        return 0;
    pthread_mutex_lock(&g.lock);
    int rc = 0;
    if (g.attached == 0) {
        rc = attach_locked();
        if (rc == 0)
            pthread_atfork(NULL, atfork_parent, atfork_child);
        __atomic_store_n(&g.attached, rc == 0 ? 1 : -1, __ATOMIC_RELEASE);
    } else if (g.attached < 0) {
        rc = -1;
    }
    pthread_mutex_unlock(&g.lock);
    return rc;
}

/* === process slots === */

static int slot_lock(int slot, short type)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = LOCK_BASE + slot, .l_len = 1};
    return fcntl(g.fd, F_OFD_SETLK, &fl);
}

static void clear_slot(struct simgpu_proc *p)
{
    for (int d = 0; d < SIMGPU_MAX_DEVICES; d++)
        atomic_store(&p->mem[d], 0);
    atomic_store(&p->context_devices, 0);
    simgpu_mig_clear_proc(&p->mig);
    atomic_store(&p->pid, 0);
}

int simgpu_slot_alive(int slot)
{
    if (slot == g.slot)
        return 1;
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = LOCK_BASE + slot, .l_len = 1};
    if (fcntl(g.fd, F_OFD_GETLK, &fl))
        return 1;   /* cannot tell: assume alive (never free memory in use) */
    return fl.l_type != F_UNLCK;
}

/* The pid NVML reports for this process.  The driver names processes by their pid in the
 * root pid namespace (nvidia-smi in a container lists pids it cannot see, or none of its own);
 * simgpu has no kernel module to ask, so it takes the pid the mounted /proc gives this
 * process (readlink /proc/self): in a pid namespace that shares the host's /proc (unshare
 * --pid without --mount-proc) its host pid, as the driver would report it. */
static int32_t nvml_pid(void)
{
    static _Atomic uint64_t cache;   /* getpid() << 32 | the pid, so a forked child looks again */
    uint32_t me = (uint32_t)getpid();
    uint64_t c = atomic_load(&cache);
    if ((uint32_t)(c >> 32) == me)
        return (int32_t)(uint32_t)c;
    char buf[32];
    ssize_t n = readlink("/proc/self", buf, sizeof buf - 1);
    long pid = me;
    if (n > 0) {
        buf[n] = 0;
        char *end;
        long v = strtol(buf, &end, 10);
        if (*end == 0 && v > 0 && v <= INT32_MAX)
            pid = v;
    }
    atomic_store(&cache, (uint64_t)me << 32 | (uint32_t)pid);
    return (int32_t)pid;
}

int simgpu_my_slot(void)
{
    if (g.slot >= 0)
        return g.slot;
    if (simgpu_attach())
        return -1;
    pthread_mutex_lock(&g.lock);
    for (int i = 0; i < SIMGPU_MAX_PROCS && g.slot < 0; i++) {
        struct simgpu_proc *p = &g.node->procs[i];
        if (slot_lock(i, F_WRLCK))
            continue;                /* owned by a live process */
        clear_slot(p);               /* a dead owner's memory goes back to the device */
        FILE *f = fopen("/proc/self/comm", "re");
        p->comm[0] = 0;
        if (f) {
            if (fgets(p->comm, sizeof p->comm, f))
                p->comm[strcspn(p->comm, "\n")] = 0;
            fclose(f);
        }
        simgpu_cgroup_of_self(p->cgroup, sizeof p->cgroup);   /* for its cgroup's memory limits */
        atomic_store(&p->pid, nvml_pid());
        g.slot = i;
    }
    pthread_mutex_unlock(&g.lock);
    if (g.slot < 0)
        fail("all %d process slots of %s are in use", SIMGPU_MAX_PROCS, g.path);
    return g.slot;
}

void simgpu_note_context(int dev)
{
    int slot = simgpu_my_slot();
    if (slot >= 0)
        atomic_fetch_or(&g.node->procs[slot].context_devices, 1u << dev);
}

void simgpu_forget_context(int dev)
{
    if (g.slot >= 0)
        atomic_fetch_and(&g.node->procs[g.slot].context_devices, ~(1u << dev));
}

/* At exit (or unload) our memory goes back at once; a crash leaves it to simgpu_reap_dead,
 * and so does the exit of a process that forked (a child may still hold it: the lock says). */
__attribute__((destructor)) static void release_slot(void)
{
    if (g.slot < 0 || !g.node || g.forked)
        return;
    clear_slot(&g.node->procs[g.slot]);
    slot_lock(g.slot, F_UNLCK);
    g.slot = -1;
}

static void shared_try_free(int i);

void simgpu_reap_dead(void)
{
    if (simgpu_attach())
        return;
    pthread_mutex_lock(&g.lock);   /* our own OFD would re-grant a lock we already hold */
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++) {
        struct simgpu_proc *p = &g.node->procs[i];
        if (i == g.slot || atomic_load(&p->pid) == 0)
            continue;
        if (slot_lock(i, F_WRLCK) == 0) {
            simgpu_log("reaping slot %d of dead pid %d", i, (int)atomic_load(&p->pid));
            clear_slot(p);
            slot_lock(i, F_UNLCK);
        }
    }
    pthread_mutex_unlock(&g.lock);
    pthread_mutex_lock(&g.shared_lock);
    for (int i = 0; i < SIMGPU_MAX_SHARED; i++)
        if (!g.holds[i] && atomic_load(&g.node->shared[i].id))
            shared_try_free(i);
    pthread_mutex_unlock(&g.shared_lock);
}

/* === shared memory (struct simgpu_shared) ===
 * As the driver API documents it: cuMemRelease — "The memory allocation will be freed when
 * all outstanding mappings to the memory are unmapped and when all outstanding references
 * to the handle (including it's shareable counterparts) are also released";
 * cuMemExportToShareableHandle — "Once all shareable handles are closed and the allocation
 * is released, the allocated memory referenced will be released back to the OS";
 * cuIpcCloseMemHandle unmaps the importer's mapping when its reference count reaches 0.
 * An object is freed by whoever finds it held by no process (its byte's lock free) and by
 * no exported descriptor (its file's lock free): the last holder as it lets go, or the
 * reaper after the last holder died.
 * NVML charges the object to the process that allocated it, for as long as it exists, even
 * after that process freed it or died while another keeps it alive.  What a real driver
 * reports for memory an importer keeps alive is not documented; this is what it is seen to
 * do for memory a forked child keeps alive (the memory stays under the dead parent's pid),
 * applied to both. */

static int lock_byte(int fd, off_t at, short type)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = at, .l_len = 1};
    return fcntl(fd, F_OFD_SETLK, &fl);
}

void simgpu_shared_path(int index, uint64_t id, char *out, size_t len)
{
    snprintf(out, len, "%s/shm-%d-%016llx", g.dir, index, (unsigned long long)id);
}

/* With the object's byte locked for writing (no process holds it): free it, unless an
 * exported descriptor still holds its file.  0: freed (or was free), -1: still held. */
static int shared_free_locked(int i)
{
    struct simgpu_shared *s = &g.node->shared[i];
    uint64_t id = atomic_load(&s->id);
    if (!id)
        return 0;
    char path[4200];
    simgpu_shared_path(i, id, path, sizeof path);
    int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd >= 0 && lock_byte(fd, 0, F_WRLCK)) {
        close(fd);
        return -1;   /* a shareable handle of it is still open somewhere */
    }
    simgpu_log("freeing shared object %d (%llu bytes)", i, (unsigned long long)atomic_load(&s->bytes));
    unlink(path);
    atomic_store(&s->bytes, 0);
    atomic_store(&s->id, 0);
    if (fd >= 0)
        close(fd);
    return 0;
}

/* With g.shared_lock held and no hold of ours on object i. */
static void shared_try_free(int i)
{
    if (lock_byte(g.fd, SHARED_LOCK_BASE + i, F_WRLCK))
        return;   /* a holder is alive */
    shared_free_locked(i);
    lock_byte(g.fd, SHARED_LOCK_BASE + i, F_UNLCK);
}

static uint64_t new_id(void)
{
    uint64_t id = 0;
    if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id)
        id = simgpu_now_ns() ^ (uint64_t)getpid() << 40;
    return id | 1;
}

int simgpu_shared_new(int gpu, uint64_t bytes, uint64_t size, unsigned kind, uint64_t *id)
{
    int slot = simgpu_my_slot();
    if (slot < 0)
        return -1;
    int found = -1;
    pthread_mutex_lock(&g.shared_lock);
    for (int i = 0; i < SIMGPU_MAX_SHARED && found < 0; i++) {
        if (g.holds[i] || lock_byte(g.fd, SHARED_LOCK_BASE + i, F_WRLCK))
            continue;   /* held */
        if (shared_free_locked(i)) {   /* what a dead holder left, unless a descriptor holds it */
            lock_byte(g.fd, SHARED_LOCK_BASE + i, F_UNLCK);
            continue;
        }
        struct simgpu_shared *s = &g.node->shared[i];
        s->size = size;
        s->dev = gpu;
        s->kind = kind;
        s->owner_pid = nvml_pid();
        s->owner_slot = slot;
        memcpy(s->comm, g.node->procs[slot].comm, sizeof s->comm);
        atomic_store(&s->bytes, bytes);   /* counted here first, then taken off the slot */
        *id = new_id();
        atomic_store(&s->id, *id);
        lock_byte(g.fd, SHARED_LOCK_BASE + i, F_RDLCK);   /* converted at once: held from now on */
        g.holds[i] = 1;
        found = i;
    }
    pthread_mutex_unlock(&g.shared_lock);
    if (found >= 0)
        simgpu_mem_release(gpu, bytes);
    return found;
}

int simgpu_shared_hold(int i, uint64_t id)
{
    if (i < 0 || i >= SIMGPU_MAX_SHARED || !id || simgpu_attach())
        return -1;
    struct simgpu_shared *s = &g.node->shared[i];
    int ok = 0;
    pthread_mutex_lock(&g.shared_lock);
    if (g.holds[i]) {
        ok = atomic_load(&s->id) == id;
    } else {
        /* a write lock is someone making or freeing it: wait to see which */
        for (int t = 0; t < 500 && atomic_load(&s->id) == id; t++) {
            if (lock_byte(g.fd, SHARED_LOCK_BASE + i, F_RDLCK) == 0) {
                ok = atomic_load(&s->id) == id && atomic_load(&s->bytes);
                if (!ok)
                    lock_byte(g.fd, SHARED_LOCK_BASE + i, F_UNLCK);
                break;
            }
            usleep(1000);
        }
    }
    if (ok)
        g.holds[i]++;
    pthread_mutex_unlock(&g.shared_lock);
    return ok ? 0 : -1;
}

void simgpu_shared_drop(int i)
{
    if (i < 0 || i >= SIMGPU_MAX_SHARED)
        return;
    pthread_mutex_lock(&g.shared_lock);
    if (g.holds[i] > 0 && --g.holds[i] == 0) {
        lock_byte(g.fd, SHARED_LOCK_BASE + i, F_UNLCK);
        shared_try_free(i);
    }
    pthread_mutex_unlock(&g.shared_lock);
}

/* === memory === */

static void dev_lock(struct simgpu_device *d)
{
    if (pthread_mutex_lock(&d->lock) == EOWNERDEAD)
        pthread_mutex_consistent(&d->lock);   /* every update under it is a single store */
}

void simgpu_dev_lock(int dev) { dev_lock(&g.node->devices[dev]); }
void simgpu_dev_unlock(int dev) { pthread_mutex_unlock(&g.node->devices[dev].lock); }

uint64_t simgpu_mem_used(int dev)
{
    uint64_t used = 0;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++)
        if (atomic_load(&g.node->procs[i].pid))
            used += atomic_load(&g.node->procs[i].mem[dev]);
    for (int i = 0; i < SIMGPU_MAX_SHARED; i++)
        if (atomic_load(&g.node->shared[i].id) && g.node->shared[i].dev == dev)
            used += atomic_load(&g.node->shared[i].bytes);
    return used;
}

int simgpu_mem_reserve(int dev, uint64_t bytes)
{
    int slot = simgpu_my_slot();
    if (slot < 0)
        return -1;
    struct simgpu_device *d = &g.node->devices[dev];
    for (int attempt = 0; attempt < 2; attempt++) {
        dev_lock(d);
        uint64_t used = simgpu_mem_used(dev);
        int ok = bytes <= g.profile->memory && used <= g.profile->memory - bytes && simgpu_limit_fits(dev, bytes);
        if (ok)
            atomic_fetch_add(&g.node->procs[slot].mem[dev], bytes);
        pthread_mutex_unlock(&d->lock);
        if (ok)
            return 0;
        simgpu_reap_dead();   /* maybe a dead process still holds memory */
    }
    return -1;
}

void simgpu_mem_release(int dev, uint64_t bytes)
{
    if (g.slot < 0 || dev < 0 || dev >= SIMGPU_MAX_DEVICES)
        return;   /* host memory (dev -1) was never on a device */
    _Atomic uint64_t *m = &g.node->procs[g.slot].mem[dev];
    uint64_t cur = atomic_load(m);
    while (!atomic_compare_exchange_weak(m, &cur, cur >= bytes ? cur - bytes : 0))
        ;
}

/* === timeline === */

uint64_t simgpu_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void simgpu_sleep_until(uint64_t t_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(t_ns / 1000000000ull), .tv_nsec = (long)(t_ns % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

uint64_t simgpu_enqueue(int dev, uint64_t dur_ns)
{
    struct simgpu_device *d = &g.node->devices[dev];
    int slot = simgpu_my_slot();
    uint64_t now = simgpu_now_ns();
    dev_lock(d);
    uint64_t start = d->free_at_ns > now ? d->free_at_ns : now;
    uint64_t end = start + dur_ns;
    d->free_at_ns = end;
    d->launches++;
    uint64_t h = atomic_load_explicit(&d->ring_head, memory_order_relaxed);
    struct simgpu_interval *e = &simgpu_ring(dev)[h % SIMGPU_RING_SIZE];
    e->start_ns = start;
    e->end_ns = end;
    e->pid = nvml_pid();
    e->slot = slot;
    atomic_store_explicit(&d->ring_head, h + 1, memory_order_release);
    pthread_mutex_unlock(&d->lock);
    return end;
}

uint64_t simgpu_busy_ns(int dev, int32_t pid, uint64_t from_ns, uint64_t to_ns)
{
    struct simgpu_interval *ring = simgpu_ring(dev);
    uint64_t head = atomic_load_explicit(&g.node->devices[dev].ring_head, memory_order_acquire);
    uint64_t busy = 0;
    /* Intervals are appended in time order (each starts at or after the previous end),
     * so walking back stops at the first one that ended before the window. */
    for (uint64_t i = head; i > 0 && head - i < SIMGPU_RING_SIZE; i--) {
        const struct simgpu_interval *e = &ring[(i - 1) % SIMGPU_RING_SIZE];
        if (e->end_ns <= from_ns)
            break;
        if (pid && e->pid != pid)
            continue;
        uint64_t s = e->start_ns > from_ns ? e->start_ns : from_ns;
        uint64_t t = e->end_ns < to_ns ? e->end_ns : to_ns;
        if (t > s)
            busy += t - s;
    }
    return busy;
}

/* === health: XID events and lost GPUs (struct simgpu_health) === */

int simgpu_gpu_lost(int gpu)
{
    return gpu >= 0 && gpu < SIMGPU_MAX_DEVICES && (atomic_load(&g.node->health.lost) >> gpu & 1u);
}

/* The node file is a shared mapping: a futex on it works across processes (not FUTEX_PRIVATE). */
static void health_changed(void)
{
    atomic_fetch_add(&g.node->health.changes, 1);
    syscall(SYS_futex, &g.node->health.changes, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

void simgpu_health_wait(uint32_t seen, uint64_t ns)
{
    struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
    syscall(SYS_futex, &g.node->health.changes, FUTEX_WAIT, seen, &ts, NULL, 0);
}

int simgpu_xid_event(uint64_t n, int *gpu, unsigned *xid)
{
    const struct simgpu_xid *e = &g.node->health.ring[n % SIMGPU_XID_RING];
    if (atomic_load_explicit(&e->seq, memory_order_acquire) != n + 1)
        return -1;   /* not written yet, or overwritten by a later one */
    *gpu = e->gpu;
    *xid = e->xid;
    return atomic_load_explicit(&e->seq, memory_order_acquire) == n + 1 ? 0 : -1;
}

SIMGPU_EXPORT int simgpuRaiseXid(unsigned gpu, unsigned xid);

/* Test hooks, in both libraries: raise XID `xid` on GPU `gpu` (its event reaches every NVML
 * event set registered for it), or make GPU `gpu` fall off the bus.  0, or -1: no such
 * GPU, or no node. */
SIMGPU_EXPORT int simgpuRaiseXid(unsigned gpu, unsigned xid)
{
    if (simgpu_attach() || gpu >= g.node->device_count)
        return -1;
    uint64_t n = atomic_fetch_add(&g.node->health.raised, 1);
    struct simgpu_xid *e = &g.node->health.ring[n % SIMGPU_XID_RING];
    atomic_store_explicit(&e->seq, 0, memory_order_release);
    e->gpu = (int32_t)gpu;
    e->xid = xid;
    atomic_store_explicit(&e->seq, n + 1, memory_order_release);
    health_changed();
    simgpu_log("XID %u raised on GPU %u", xid, gpu);
    return 0;
}

SIMGPU_EXPORT int simgpuLoseGpu(unsigned gpu)
{
    if (simgpu_attach() || gpu >= g.node->device_count)
        return -1;
    if (simgpu_gpu_lost((int)gpu))
        return 0;
    /* the driver's Xid 79, "GPU has fallen off the bus", reaches event sets before the loss
     * itself (their wait answers NVML_ERROR_GPU_IS_LOST once nothing is pending) */
    simgpuRaiseXid(gpu, 79);
    atomic_fetch_or(&g.node->health.lost, 1u << gpu);
    simgpu_log("GPU %u has fallen off the bus", gpu);
    health_changed();
    return 0;
}
