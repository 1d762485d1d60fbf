/* board.c — the share board (csrc/vgpu_region.h): how slices on one device lend each
 * other idle time (burst mode) without a lock on the launch path.
 *
 * Each slice that paces launches on a device keeps one entry in that device's section:
 * its guarantee and ceiling, what it wants and is allowed, and how far its launches are
 * paid for.  Every BOARD_PERIOD_NS each of its processes (the first of its threads to
 * get there) turns the slice's running totals in its usage file (what its launches cost,
 * how long they waited) into a demand, reads the section, computes the slice's allowance
 * from every live entry and writes the slice's entry:
 *
 *   demand   the ceiling if its launches waited (it wants more than it has), else what
 *            it used over the period plus a small margin; a slice waking from idle asks
 *            for its guarantee (its first period says what it really wants);
 *   base     each live slice gets min(demand, guarantee);
 *   lent     what is left of the device is shared among the slices that want more, in
 *            proportion to their guarantees (water-filling: a slice never gets more than
 *            it asked for, what it leaves goes to the others);
 *   allowed  max(guarantee, base + lent), at most the ceiling.
 *
 * Every slice computes from the same entries, so their allowances agree up to a period.
 * A slice that wakes below its guarantee is paced at its guarantee from its first launch
 * and published at once; the others see it at their next period and yield.  An entry is
 * live while it is refreshed (VGPU_BOARD_STALE_NS) and its launches are paid up to a
 * period ago (BOARD_LIVE_NS): a dead or hung slice stops counting within a stale period.
 *
 * The board is mounted read-write into every container, so any tenant can write or
 * truncate it.  It is never mapped: a mapping of a file another container truncates
 * faults (SIGBUS) on the next touch, and that would kill the neighbours.  The entry is
 * written with pwrite and the section read with pread, once a period, off the launch
 * path; a short read (a truncated or replaced board) is a period without a board: the
 * slice runs at its guarantee.  Finding the device's section and claiming an entry are
 * done under an OFD lock on the board's first byte, asked without waiting (a tenant
 * holding it keeps others at their guarantees, never blocks them). */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SM_FULL 10000u
#define BOARD_IDLE_NS 20000000ull          /* paid-for time run out this long ago: idle */
#define BOARD_LIVE_NS (BOARD_IDLE_NS + BOARD_PERIOD_NS)   /* ... as published, up to a period ago */
#define BOARD_REUSE_NS 60000000000ull      /* an entry silent this long is a gone slice's */
#define HELD_BACK_PER 50                   /* waited > 1/50 of the period: wants more */
#define BOARD_WAKE_NS 200000000ull         /* after waking, ask for the guarantee this long */
#define CLAIM_TRIES 20                     /* the claim lock, asked every millisecond this often */

#define SECTION_OFF(s) (offsetof(struct vgpu_board, devices) + (size_t)(s) * sizeof(struct vgpu_board_device))
#define ENTRY_OFF(s, i) (SECTION_OFF(s) + offsetof(struct vgpu_board_device, slices) + \
                         (size_t)(i) * sizeof(struct vgpu_board_slice))

static int board_fd = -2;                  /* -2: not opened yet; -1: none, for good */
/* per device: where the slice's entry is (-1: none), and this process's own view of its
 * periods (what the usage file's totals were at its last one, when the slice woke) */
static struct {
    int tried, section, entry;
    uint64_t period_ns, used_at, waited_at, woke_ns, backlog_ns;
    uint32_t allowance;
} mine[VGPU_MAX_DEVICES];

static int board_open(void)
{
    int fd = LOAD(&board_fd);
    if (LIKELY(fd != -2))
        return fd;
    pthread_mutex_lock(&S.lock);
    if (board_fd == -2) {
        fd = S.board_path ? open(S.board_path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK) : -1;
        if (fd < 0 && errno == ENOENT) {   /* no controller made one (standalone containers) */
            static struct vgpu_board empty;   /* zeroed: every section free */
            empty.magic = VGPU_BOARD_MAGIC;
            empty.abi_version = VGPU_ABI_VERSION;
            empty.size = sizeof empty;
            if (create_file_once(S.board_path, &empty, sizeof empty, 0666))
                INFO("made the share board %s", S.board_path);
            fd = open(S.board_path, O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        }
        struct stat st;
        struct vgpu_board head;
        if (fd >= 0 && !(fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size == sizeof(struct vgpu_board) &&
                         pread(fd, &head, offsetof(struct vgpu_board, devices), 0) ==
                             (ssize_t)offsetof(struct vgpu_board, devices) &&
                         head.magic == VGPU_BOARD_MAGIC && head.abi_version == VGPU_ABI_VERSION &&
                         head.size == sizeof(struct vgpu_board))) {
            close(fd);
            fd = -1;
        }
        if (fd < 0)
            INFO("no share board at %s: burst slices run at their guarantee", S.board_path);
        STORE(&board_fd, fd);
    }
    fd = board_fd;
    pthread_mutex_unlock(&S.lock);
    return fd;
}

/* The claim lock on the board's first byte: 1 once held (asked every millisecond,
 * CLAIM_TRIES times: a tenant holding it keeps others at their guarantees, never blocks). */
static int claim_lock(int fd, short type)
{
    struct flock l = {.l_type = type, .l_whence = SEEK_SET, .l_start = 0, .l_len = 1};
    for (int i = 0; i < CLAIM_TRIES; i++) {
        if (fcntl(fd, F_OFD_SETLK, &l) == 0)
            return 1;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

/* A section's head: struct vgpu_board_device up to its reserved words. */
struct section_head {
    uint8_t uuid[16];
    uint64_t claimed;
};

/* The device's section: found by UUID, or a free one claimed (claim lock held). */
static int board_device(int fd, const uint8_t uuid[16])
{
    int free_ = -1;
    for (int s = 0; s < VGPU_BOARD_DEVICES; s++) {
        struct section_head h;
        if (pread(fd, &h, sizeof h, (off_t)SECTION_OFF(s)) != (ssize_t)sizeof h)
            return -1;
        if (h.claimed == 1 && !memcmp(h.uuid, uuid, 16))
            return s;
        if (h.claimed == 0 && free_ < 0)
            free_ = s;
    }
    if (free_ < 0)
        return -1;
    struct section_head h = {.claimed = 1};
    memcpy(h.uuid, uuid, 16);
    return pwrite(fd, &h, sizeof h, (off_t)SECTION_OFF(free_)) == (ssize_t)sizeof h ? free_ : -1;
}

static int read_section(int fd, int section, struct vgpu_board_slice out[VGPU_BOARD_SLICES])
{
    size_t n = sizeof(struct vgpu_board_slice) * VGPU_BOARD_SLICES;
    return pread(fd, out, n, (off_t)ENTRY_OFF(section, 0)) == (ssize_t)n;
}

/* The slice's entry in the section: found by key, or a free (or long silent) one taken
 * (claim lock held). */
static int board_slice(int fd, int section, uint64_t key, uint64_t now)
{
    struct vgpu_board_slice e[VGPU_BOARD_SLICES];
    if (!read_section(fd, section, e))
        return -1;
    int take = -1;
    for (int i = 0; i < VGPU_BOARD_SLICES; i++) {
        if (e[i].key == key)
            return i;
        /* (period 0: just taken by a slice that has not computed yet -- not silent) */
        if (take < 0 && (e[i].key == 0 || (e[i].period_ns != 0 && e[i].period_ns < now &&
                                           now - e[i].period_ns > BOARD_REUSE_NS)))
            take = i;
    }
    if (take < 0)
        return -1;
    struct vgpu_board_slice fresh = {.key = key};   /* its first update is a waking one */
    return pwrite(fd, &fresh, sizeof fresh, (off_t)ENTRY_OFF(section, take)) == (ssize_t)sizeof fresh ? take : -1;
}

int board_entry(int dev)
{
    if (dev < 0 || dev >= VGPU_MAX_DEVICES)
        return 0;
    if (LIKELY(LOAD(&mine[dev].tried)))
        return LOAD(&mine[dev].entry) >= 0;
    int fd = board_open();
    pthread_mutex_lock(&S.lock);
    if (!mine[dev].tried) {
        int section = -1, entry = -1;
        CUuuid uuid;
        if (fd >= 0 && REAL(cuDeviceGetUuid_v2) && real_cuDeviceGetUuid_v2(&uuid, dev) == CUDA_SUCCESS) {
            if (claim_lock(fd, F_WRLCK)) {
                section = board_device(fd, (const uint8_t *)uuid.bytes);
                if (section >= 0)
                    entry = board_slice(fd, section, S.slice_key, now_ns());
                claim_lock(fd, F_UNLCK);
            }
            if (entry < 0)
                INFO("device %d: no room on the share board: runs at its guarantee", dev);
        }
        mine[dev].section = section;
        STORE(&mine[dev].entry, entry);
        STORE(&mine[dev].tried, 1);
    }
    int e = mine[dev].entry;
    pthread_mutex_unlock(&S.lock);
    return e >= 0;
}

void board_note_wait(int dev, uint64_t ns)
{
    if (dev >= 0 && dev < VGPU_MAX_DEVICES)
        __atomic_add_fetch(&mine[dev].backlog_ns, ns, __ATOMIC_RELAXED);
}

uint64_t board_period(int dev)
{
    return LOAD(&mine[dev].period_ns);
}

/* Water-filling: what the live entries leave of the device, shared by guarantee among
 * those that want more, none given more than it asked for. */
static uint32_t allowance_from(const struct vgpu_board_slice *e, int self, uint64_t now)
{
    uint32_t want[VGPU_BOARD_SLICES], weight[VGPU_BOARD_SLICES], got_self = 0;
    int self_i = -1, n = 0;
    uint64_t taken = 0;
    for (int i = 0; i < VGPU_BOARD_SLICES; i++) {
        const struct vgpu_board_slice *c = &e[i];
        if (i != self) {
            if (!c->key || c->period_ns > now + BOARD_IDLE_NS || now - c->period_ns > VGPU_BOARD_STALE_NS ||
                c->paid_until_ns + BOARD_LIVE_NS < now)
                continue;   /* free, silent, or idle */
        } else {
            self_i = n;
        }
        /* what another slice wrote is clamped to the device: a hostile entry can ask for
         * everything, which only keeps the others at their guarantees */
        uint32_t g = c->guarantee, cap = c->ceiling, dem = c->demand;
        g = g > SM_FULL ? SM_FULL : g;
        cap = cap > SM_FULL ? SM_FULL : cap < g ? g : cap;
        dem = dem > cap ? cap : dem;
        uint32_t base = dem < g ? dem : g;
        taken += base;
        want[n] = dem - base;
        weight[n] = g > 100 ? g : 100;   /* a slice guaranteed nothing still gets a part */
        if (i == self)
            got_self = base;
        n++;
    }
    if (self_i < 0)
        return 0;
    uint64_t left = taken >= SM_FULL ? 0 : SM_FULL - taken;
    /* each round gives everyone still wanting its weighted part of what is left; one
     * whose want is met drops out and leaves the rest to the next round */
    for (int round = 0; round < VGPU_BOARD_SLICES && left; round++) {
        uint64_t total = 0;
        for (int i = 0; i < n; i++)
            if (want[i])
                total += weight[i];
        if (!total)
            break;
        int met = 0;
        for (int i = 0; i < n; i++)
            if (want[i] && left * weight[i] / total >= want[i])
                met = 1;
        if (!met) {   /* nobody's want is met: everyone takes its part, and that is all */
            if (want[self_i])
                got_self += (uint32_t)(left * weight[self_i] / total);
            break;
        }
        uint64_t given = 0;
        for (int i = 0; i < n; i++)
            if (want[i] && left * weight[i] / total >= want[i]) {
                given += want[i];
                if (i == self_i)
                    got_self += want[i];
                want[i] = 0;
            }
        left -= given < left ? given : left;
    }
    return got_self;
}

/* GPU time used over a span, in 1/100 percent (several streams may charge more than the
 * span: capped at twice the device, so nothing overflows) */
static uint64_t share_of(uint64_t used, uint64_t span)
{
    return used >= 2 * span ? 2 * SM_FULL : used * SM_FULL / span;
}

/* The slice's allowance on the device, recomputed by this process once a period (the
 * first of its threads to get there); until then, the one it computed last. */
uint32_t board_update(int dev, uint32_t guarantee, uint32_t ceiling, uint64_t now, const struct vgpu_usage_device *u)
{
    uint64_t last = LOAD(&mine[dev].period_ns);
    if ((last <= now && now - last < BOARD_PERIOD_NS) ||
        !__atomic_compare_exchange_n(&mine[dev].period_ns, &last, now, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return LOAD(&mine[dev].allowance);
    /* what the slice's launches cost and how long they waited: the usage file's running
     * totals (cost at today's scale; waits at the ceiling and below it) and this process's
     * own waits for its queue -- no counter of the board's on the launch path */
    uint64_t corr = LOAD(&u->sm_correction);
    uint64_t total = (uint64_t)((double)LOAD(&u->sm_raw_ns) * (corr ? corr : 65536) / 65536);
    uint64_t waited = LOAD(&u->throttled_ns) + LOAD(&u->yielded_ns) + LOAD(&mine[dev].backlog_ns);
    uint64_t used = total - mine[dev].used_at, held = waited - mine[dev].waited_at;
    mine[dev].used_at = total;
    mine[dev].waited_at = waited;
    uint64_t span = now - last;
    uint32_t demand;
    int waking = !last || last > now || span > VGPU_BOARD_STALE_NS;
    if (waking)
        mine[dev].woke_ns = now;
    uint64_t woke = mine[dev].woke_ns;
    if (!waking && held > span / HELD_BACK_PER) {
        demand = ceiling;
    } else if (waking || (woke <= now && now - woke < BOARD_WAKE_NS)) {
        /* waking: at least its guarantee until its launches say more (the first ones
         * wait for the device to measure them, which is not wanting less) */
        uint64_t share = waking ? 0 : share_of(used, span);
        demand = share > guarantee ? (share > ceiling ? ceiling : (uint32_t)share) : guarantee;
    } else {
        uint64_t share = share_of(used, span);
        share += share / 32 + 25;   /* a quarter point and 3%: noise, not hoarding */
        demand = share > ceiling ? ceiling : (uint32_t)share;
    }
    /* the section as it is now, this slice's entry as it is about to be written; a short
     * read (truncated, replaced) is a period without a board: the guarantee */
    int fd = LOAD(&board_fd), section = mine[dev].section, i = mine[dev].entry;
    struct vgpu_board_slice e[VGPU_BOARD_SLICES];
    uint32_t allowed = guarantee;
    if (fd >= 0 && read_section(fd, section, e)) {
        uint64_t vtime = LOAD(&u->sm_vtime_ns);
        e[i] = (struct vgpu_board_slice){
            .key = S.slice_key, .guarantee = guarantee, .ceiling = ceiling, .demand = demand,
            .paid_until_ns = vtime > now ? vtime : now,   /* (launching now: not idle) */
            .waited_ns = waited, .period_used_ns = total, .period_ns = now, .period_waited_ns = waited,
            .woke_ns = woke};
        uint32_t got = allowance_from(e, i, now);
        allowed = got > guarantee ? got : guarantee;
        if (allowed > ceiling)
            allowed = ceiling;
        e[i].allowance = allowed;
        if (pwrite(fd, &e[i], sizeof e[i], (off_t)ENTRY_OFF(section, i)) != (ssize_t)sizeof e[i])
            allowed = guarantee;
    }
    STORE(&mine[dev].allowance, allowed);
    return allowed;
}
