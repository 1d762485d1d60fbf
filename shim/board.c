/* board.c — the share board (csrc/vgpu_region.h): how slices on one device lend each
 * other idle time (burst mode) without a lock on the launch path.
 *
 * Each slice that paces launches on a device keeps one entry in that device's section:
 * its guarantee and ceiling, how far its launches are paid for and how long they waited
 * (what they cost is the usage file's running total, read once a period).
 * Every BOARD_PERIOD_NS one of its processes (whoever moves period_ns first) turns those
 * running totals into a demand and computes the slice's allowance from every live entry:
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
 * live while it is refreshed (VGPU_BOARD_STALE_NS) and its launches are paid up to now
 * (BOARD_IDLE_NS): a dead or hung slice stops counting within a stale period. */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define SM_FULL 10000u
#define BOARD_IDLE_NS 20000000ull          /* paid-for time run out this long ago: idle */
#define BOARD_REUSE_NS 60000000000ull      /* an entry silent this long is a gone slice's */
#define HELD_BACK_PER 50                   /* waited > 1/50 of the period: wants more */
#define BOARD_WAKE_NS 200000000ull         /* after waking, ask for the guarantee this long */

static struct vgpu_board *board;           /* NULL: none (yet); MAP_FAILED: none, for good */
static struct vgpu_board_device *sections[VGPU_MAX_DEVICES];
static struct vgpu_board_slice *entries[VGPU_MAX_DEVICES];
static int entry_tried[VGPU_MAX_DEVICES];  /* 1: looked once and found no room (or no UUID) */

static struct vgpu_board *board_map(void)
{
    struct vgpu_board *b = LOAD(&board);
    if (LIKELY(b != NULL))
        return b == MAP_FAILED ? NULL : b;
    pthread_mutex_lock(&S.lock);
    if (!board) {
        b = MAP_FAILED;
        int fd = S.board_path[0] ? open(S.board_path, O_RDWR | O_CLOEXEC | O_NOFOLLOW) : -1;
        if (fd < 0 && errno == ENOENT) {   /* no controller made one (standalone containers) */
            static struct vgpu_board empty;   /* zeroed: every section free */
            empty.magic = VGPU_BOARD_MAGIC;
            empty.abi_version = VGPU_ABI_VERSION;
            empty.size = sizeof empty;
            if (create_file_once(S.board_path, &empty, sizeof empty, 0666))
                INFO("made the share board %s", S.board_path);
            fd = open(S.board_path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        }
        struct stat st;
        if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size == sizeof(struct vgpu_board)) {
            void *m = mmap(NULL, sizeof(struct vgpu_board), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (m != MAP_FAILED) {
                struct vgpu_board *cand = m;
                if (LOAD(&cand->magic) == VGPU_BOARD_MAGIC && LOAD(&cand->abi_version) == VGPU_ABI_VERSION &&
                    LOAD(&cand->size) == sizeof(struct vgpu_board))
                    b = cand;
                else
                    munmap(m, sizeof(struct vgpu_board));
            }
        }
        if (fd >= 0)
            close(fd);
        if (b == MAP_FAILED)
            INFO("no share board at %s: burst slices run at their guarantee", S.board_path);
        STORE(&board, b);
    }
    b = board;
    pthread_mutex_unlock(&S.lock);
    return b == MAP_FAILED ? NULL : b;
}

/* The device's section: found by UUID, or claimed. */
static struct vgpu_board_device *board_device(struct vgpu_board *b, const uint8_t uuid[16])
{
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < VGPU_BOARD_DEVICES; i++) {
            struct vgpu_board_device *d = &b->devices[i];
            uint64_t c = LOAD(&d->claimed);
            if (c == 1 && !memcmp(d->uuid, uuid, 16))
                return d;
            if (pass == 1 && c == 0) {
                uint64_t free_ = 0;
                if (!__atomic_compare_exchange_n(&d->claimed, &free_, 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                    continue;
                memcpy(d->uuid, uuid, 16);
                STORE(&d->claimed, 1);
                /* another process may have claimed a second section for the same UUID
                 * meanwhile: the first one in the table is the one everybody uses */
                for (int j = 0; j < i; j++)
                    if (LOAD(&b->devices[j].claimed) == 1 && !memcmp(b->devices[j].uuid, uuid, 16))
                        return &b->devices[j];
                return d;
            }
        }
    }
    return NULL;
}

static struct vgpu_board_slice *first_with_key(struct vgpu_board_device *d, uint64_t key)
{
    for (int i = 0; i < VGPU_BOARD_SLICES; i++)
        if (LOAD(&d->slices[i].key) == key)
            return &d->slices[i];
    return NULL;
}

/* The slice's entry in the section: found by key, or a free (or long silent) one taken. */
static struct vgpu_board_slice *board_slice(struct vgpu_board_device *d, uint64_t key, uint64_t now)
{
    struct vgpu_board_slice *e = first_with_key(d, key);
    if (e)
        return e;
    for (int i = 0; i < VGPU_BOARD_SLICES && !e; i++) {
        struct vgpu_board_slice *c = &d->slices[i];
        uint64_t k = LOAD(&c->key), at = LOAD(&c->period_ns);
        /* (period 0: just taken by a slice that has not computed yet -- not silent) */
        if (k != 0 && !(at != 0 && at < now && now - at > BOARD_REUSE_NS))
            continue;
        if (!__atomic_compare_exchange_n(&c->key, &k, key, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        STORE(&c->period_ns, 0);   /* its first update is a waking one */
        STORE(&c->paid_until_ns, 0);
        STORE(&c->demand, 0);
        STORE(&c->allowance, 0);
        e = c;
    }
    if (!e)
        return NULL;
    /* two processes of the slice may have taken two entries: all use the first */
    struct vgpu_board_slice *first = first_with_key(d, key);
    if (first && first != e)
        STORE(&e->key, 0);
    return first;
}

struct vgpu_board_slice *board_entry(int dev)
{
    if (dev < 0 || dev >= VGPU_MAX_DEVICES)
        return NULL;
    struct vgpu_board_slice *e = LOAD(&entries[dev]);
    if (LIKELY(e != NULL) || LOAD(&entry_tried[dev]))
        return e;
    struct vgpu_board *b = board_map();
    CUuuid uuid;
    struct vgpu_board_device *d;
    if (!b || !real_cuDeviceGetUuid_v2 || real_cuDeviceGetUuid_v2(&uuid, dev) != CUDA_SUCCESS ||
        !(d = board_device(b, (const uint8_t *)uuid.bytes)) || !(e = board_slice(d, S.slice_key, now_ns()))) {
        if (b)
            INFO("device %d: no room on the share board: runs at its guarantee", dev);
        STORE(&entry_tried[dev], 1);
        return NULL;
    }
    STORE(&sections[dev], d);
    STORE(&entries[dev], e);
    return e;
}

/* Water-filling: what the live entries leave of the device, shared by guarantee among
 * those that want more, none given more than it asked for. */
static uint32_t allowance_from(struct vgpu_board_device *d, struct vgpu_board_slice *self, uint64_t now)
{
    uint32_t want[VGPU_BOARD_SLICES], weight[VGPU_BOARD_SLICES], got_self = 0;
    int self_i = -1, n = 0;
    uint64_t taken = 0;
    for (int i = 0; i < VGPU_BOARD_SLICES; i++) {
        struct vgpu_board_slice *c = &d->slices[i];
        if (c != self) {
            uint64_t at = LOAD(&c->period_ns), paid = LOAD(&c->paid_until_ns);
            if (!LOAD(&c->key) || at > now + BOARD_IDLE_NS || now - at > VGPU_BOARD_STALE_NS ||
                paid + BOARD_IDLE_NS < now)
                continue;   /* free, silent, or idle */
        } else {
            self_i = n;
        }
        /* what another slice wrote is clamped to the device: a hostile entry can ask for
         * everything, which only keeps the others at their guarantees */
        uint32_t g = LOAD(&c->guarantee), cap = LOAD(&c->ceiling), dem = LOAD(&c->demand);
        g = g > SM_FULL ? SM_FULL : g;
        cap = cap > SM_FULL ? SM_FULL : cap < g ? g : cap;
        dem = dem > cap ? cap : dem;
        uint32_t base = dem < g ? dem : g;
        taken += base;
        want[n] = dem - base;
        weight[n] = g > 100 ? g : 100;   /* a slice guaranteed nothing still gets a part */
        if (c == self)
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

/* The slice's allowance on the device, recomputed once a period by whichever process
 * gets there first; the others keep pacing at the one in the entry. */
uint32_t board_update(int dev, struct vgpu_board_slice *e, uint32_t guarantee, uint32_t ceiling, uint64_t now,
                      const struct vgpu_usage_device *u)
{
    uint64_t last = LOAD(&e->period_ns);
    if ((last <= now && now - last < BOARD_PERIOD_NS) ||
        !__atomic_compare_exchange_n(&e->period_ns, &last, now, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return LOAD(&e->allowance);
    /* what the slice's launches cost: the usage file's running total of estimates (kept
     * for the correction) at today's cost scale -- no counter of its own on the launch path */
    uint64_t corr = LOAD(&u->sm_correction), waited = LOAD(&e->waited_ns);
    uint64_t total = (uint64_t)((double)LOAD(&u->sm_raw_ns) * (corr ? corr : 65536) / 65536);
    uint64_t used = total - __atomic_exchange_n(&e->period_used_ns, total, __ATOMIC_ACQ_REL);
    uint64_t held = waited - __atomic_exchange_n(&e->period_waited_ns, waited, __ATOMIC_ACQ_REL);
    uint64_t span = now - last;
    uint32_t demand;
    int waking = !last || last > now || span > VGPU_BOARD_STALE_NS;
    if (waking)
        STORE(&e->woke_ns, now);
    uint64_t woke = LOAD(&e->woke_ns);
    if (held > span / HELD_BACK_PER) {
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
    STORE(&e->guarantee, guarantee);
    STORE(&e->ceiling, ceiling);
    STORE(&e->demand, demand);
    uint32_t got = allowance_from(LOAD(&sections[dev]), e, now);
    uint32_t allowed = got > guarantee ? got : guarantee;
    if (allowed > ceiling)
        allowed = ceiling;
    STORE(&e->allowance, allowed);
    return allowed;
}
