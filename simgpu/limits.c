/* limits.c — per-cgroup device memory limits, as nvml.h (CUDA 13.5) documents
 * nvmlDeviceSetMemoryLimits_v1 / nvmlDeviceGetMemoryLimits_v1, and no more:
 *
 *   - a limit is set for a device and a cgroup named by the full path of its sysfs
 *     directory ("Full path to sysfs cgroup file name"); it holds for the memory that
 *     applications in that cgroup allocate: here, every process whose cgroup (read from
 *     /proc/self/cgroup's cgroup v2 line when it took its process slot) is that directory
 *     or one below it;
 *   - hardLimit is the most they may hold together: an allocation past it fails as out of
 *     memory.  What they hold is what simgpu's driver holds for them, the figures NVML
 *     lists per process (allocations, pools, contexts) and shared memory they allocated;
 *   - softLimit (guaranteed before allocations may fail under pressure) is kept and
 *     reported; simgpu never runs short of memory under pressure, so it never acts;
 *   - soft 0 and hard NVML_DEVICE_MEMORY_LIMIT_MAX clear a limit; so does removing the
 *     cgroup (the directory's identity is kept: one made again under the name has none);
 *   - errors: INVALID_ARGUMENT when soft > hard or a limit exceeds the device's memory,
 *     OPERATING_SYSTEM when the path cannot be opened as a directory, NO_PERMISSION for a
 *     caller that is not root, NOT_SUPPORTED on MIG handles (nvml.c) and, with
 *     SIMGPU_MEMORY_LIMITS=0, on a driver older than the API.
 */
#include "simgpu/node.h"
#include "nvml_abi.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define LIMIT_MAX 0xFFFFFFFFFFFFFFFFull   /* NVML_DEVICE_MEMORY_LIMIT_MAX */

int simgpu_limits_supported(void)
{
    const char *v = getenv("SIMGPU_MEMORY_LIMITS");
    return !(v && !strcmp(v, "0"));
}

/* Where cgroup v2 is mounted (the unified hierarchy), "" when it is not. */
static void cgroup2_mount(char *out, size_t len)
{
    out[0] = 0;
    FILE *f = fopen("/proc/self/mountinfo", "re");
    if (!f)
        return;
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        /* ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [TAGS] - FSTYPE SOURCE SUPER */
        char *dash = strstr(line, " - cgroup2 ");
        char root[512], point[512];
        if (dash && sscanf(line, "%*s %*s %*s %511s %511s", root, point) == 2 && !strcmp(root, "/")) {
            snprintf(out, len, "%s", point);
            break;
        }
    }
    fclose(f);
}

void simgpu_cgroup_of_self(char *out, size_t len)
{
    out[0] = 0;
    char mount[512], line[1024];
    cgroup2_mount(mount, sizeof mount);
    FILE *f = fopen("/proc/self/cgroup", "re");
    if (!f || !mount[0]) {
        if (f)
            fclose(f);
        return;
    }
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "0::", 3)) {
            line[strcspn(line, "\n")] = 0;
            const char *rel = line + 3;
            if (snprintf(out, len, "%s%s", mount, strcmp(rel, "/") ? rel : "") >= (int)len)
                out[0] = 0;   /* too long to keep: no limit can name it */
            break;
        }
    fclose(f);
}

static int same_dir(const struct simgpu_mem_limit *l)
{
    struct stat st;
    return stat(l->path, &st) == 0 && S_ISDIR(st.st_mode) && (uint64_t)st.st_dev == l->st_dev &&
           (uint64_t)st.st_ino == l->st_ino;
}

static void forget(int dev, struct simgpu_mem_limit *l)
{
    memset(l, 0, sizeof *l);
    atomic_fetch_sub(&simgpu_node()->limits_set[dev], 1);
}

#define RECHECK_NS 100000000ull   /* a cgroup's directory is looked at again at most every 100 ms */

/* The device's limits, those of removed cgroups dropped first (the lock is held).  The
 * directories are not looked at on every allocation (a stat each, under the device's lock,
 * would slow every tenant's launches): a cgroup removed is forgotten within RECHECK_NS,
 * and at once by Set and Get (fresh). */
static struct simgpu_mem_limit *limits_of(int dev, int fresh)
{
    struct simgpu_mem_limit *ls = simgpu_node()->limits[dev];
    uint64_t now = simgpu_now_ns();
    for (int i = 0; i < SIMGPU_MAX_LIMITS; i++) {
        if (!ls[i].path[0] || (!fresh && now - ls[i].checked_ns < RECHECK_NS))
            continue;
        if (same_dir(&ls[i]))
            ls[i].checked_ns = now;
        else
            forget(dev, &ls[i]);
    }
    return ls;
}

static int within(const char *cgroup, const char *path)
{
    size_t n = strlen(path);
    return cgroup[0] && !strncmp(cgroup, path, n) && (cgroup[n] == 0 || cgroup[n] == '/');
}

/* What the processes of `path` and below hold on the device (the lock is held). */
static uint64_t used_under(int dev, const char *path)
{
    struct simgpu_node *node = simgpu_node();
    uint64_t used = 0;
    for (int i = 0; i < SIMGPU_MAX_PROCS; i++)
        if (atomic_load(&node->procs[i].pid) && within(node->procs[i].cgroup, path))
            used += atomic_load(&node->procs[i].mem[dev]);
    for (int i = 0; i < SIMGPU_MAX_SHARED; i++) {
        struct simgpu_shared *sh = &node->shared[i];
        if (atomic_load(&sh->id) && sh->dev == dev && sh->owner_slot >= 0 && sh->owner_slot < SIMGPU_MAX_PROCS &&
            within(node->procs[sh->owner_slot].cgroup, path))
            used += atomic_load(&sh->bytes);
    }
    return used;
}

int simgpu_limit_set(int dev, const char *path, uint64_t soft, uint64_t hard)
{
    if (!simgpu_limits_supported())
        return NVML_ERROR_NOT_SUPPORTED;
    if (!path)
        return NVML_ERROR_INVALID_ARGUMENT;
    int clear = soft == 0 && hard == LIMIT_MAX;
    uint64_t total = simgpu_profile()->memory;
    if (!clear && (soft > hard || hard > total))
        return NVML_ERROR_INVALID_ARGUMENT;
    struct stat st;
    if (strlen(path) >= SIMGPU_CGROUP_PATH || stat(path, &st) || !S_ISDIR(st.st_mode))
        return NVML_ERROR_OPERATING_SYSTEM;
    if (geteuid() != 0)
        return NVML_ERROR_NO_PERMISSION;
    simgpu_dev_lock(dev);
    struct simgpu_mem_limit *ls = limits_of(dev, 1), *slot = NULL;
    for (int i = 0; i < SIMGPU_MAX_LIMITS && !slot; i++)
        if (!strcmp(ls[i].path, path))
            slot = &ls[i];
    int r = NVML_SUCCESS;
    if (clear) {
        if (slot)
            forget(dev, slot);
    } else {
        if (!slot)
            for (int i = 0; i < SIMGPU_MAX_LIMITS && !slot; i++)
                if (!ls[i].path[0]) {
                    slot = &ls[i];
                    atomic_fetch_add(&simgpu_node()->limits_set[dev], 1);
                }
        if (!slot)
            r = NVML_ERROR_UNKNOWN;   /* the table is full (a model limit, not the driver's) */
        else {
            *slot = (struct simgpu_mem_limit){.st_dev = st.st_dev, .st_ino = st.st_ino, .soft = soft, .hard = hard,
                                              .checked_ns = simgpu_now_ns()};
            snprintf(slot->path, sizeof slot->path, "%s", path);
        }
    }
    simgpu_dev_unlock(dev);
    return r;
}

int simgpu_limit_get(int dev, const char *path, uint64_t *soft, uint64_t *hard, uint64_t *used)
{
    simgpu_dev_lock(dev);
    struct simgpu_mem_limit *ls = limits_of(dev, 1);
    int found = -1;
    for (int i = 0; i < SIMGPU_MAX_LIMITS; i++)
        if (ls[i].path[0] && !strcmp(ls[i].path, path)) {
            *soft = ls[i].soft, *hard = ls[i].hard, *used = used_under(dev, path);
            found = 0;
        }
    simgpu_dev_unlock(dev);
    return found;
}

/* The room under every limit of the caller's cgroup and its ancestors (the lock is held). */
static uint64_t room_locked(int dev)
{
    if (!atomic_load(&simgpu_node()->limits_set[dev]))
        return UINT64_MAX;   /* no limit on the device: nothing to look through */
    int slot = simgpu_my_slot();
    if (slot < 0)
        return UINT64_MAX;
    const char *mine = simgpu_node()->procs[slot].cgroup;
    struct simgpu_mem_limit *ls = limits_of(dev, 0);
    uint64_t room = UINT64_MAX;
    for (int i = 0; i < SIMGPU_MAX_LIMITS; i++)
        if (ls[i].path[0] && within(mine, ls[i].path)) {
            uint64_t used = used_under(dev, ls[i].path);
            uint64_t left = used < ls[i].hard ? ls[i].hard - used : 0;
            room = left < room ? left : room;
        }
    return room;
}

int simgpu_limit_fits(int dev, uint64_t bytes)
{
    return bytes <= room_locked(dev);
}

uint64_t simgpu_limit_room(int dev)
{
    simgpu_dev_lock(dev);
    uint64_t room = room_locked(dev);
    simgpu_dev_unlock(dev);
    return room;
}
