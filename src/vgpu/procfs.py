"""What the kernel says about a process, from /proc: the facts the node agent trusts.

Everything a container writes (its usage file's slots) is a hint; these are the checks.
Each function takes a host pid (a pid in this process's pid namespace) and returns None
when the process is gone or its /proc entry cannot be read (another user's without
CAP_SYS_PTRACE, or a pid this namespace does not have): the caller treats that as
"unknown", never as "no".
"""
import os
import re

_FIELD_START = 19    # /proc/<pid>/stat: starttime is field 22, the 20th after the ")" of comm


def _read(path, size=4096):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)


def start_ticks(pid):
    """When the process started, in clock ticks after boot (with the pid, one process)."""
    data = _read(f"/proc/{pid}/stat", 2048)
    if not data:
        return None
    try:
        return int(data[data.rindex(b")") + 2:].split()[_FIELD_START])
    except (ValueError, IndexError):
        return None


def state(pid):
    """Its state letter (/proc/<pid>/stat field 3: "R", "S", ..., "Z" a zombie)."""
    data = _read(f"/proc/{pid}/stat", 2048)
    if not data:
        return None
    try:
        return data[data.rindex(b")") + 2:].split()[0].decode()
    except (ValueError, IndexError):
        return None


# include/linux/proc_ns.h PROC_PID_INIT_INO: the root pid namespace's inode, whose pids
# are the ones NVML lists
ROOT_PID_NS = 0xEFFFFFFC


def cgroup_names_pod(path, uid) -> bool:
    """Does a cgroup path name pod `uid`, as the kubelet's cgroup drivers write it (cgroupfs
    as is, systemd with '_' for '-')?"""
    return bool(uid) and (uid in path or uid.replace("-", "_") in path)


def pid_ns(pid="self"):
    """The inode of the process's pid namespace."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def mnt_ns(pid="self"):
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino
    except OSError:
        return None


def inner_pid(pid):
    """The pid the process has in its own (innermost) pid namespace."""
    data = _read(f"/proc/{pid}/status", 8192)
    if not data:
        return None
    at = data.find(b"\nNSpid:")
    if at < 0:
        return None
    try:
        return int(data[at + 7:data.index(b"\n", at + 1)].split()[-1])
    except (ValueError, IndexError):
        return None


def cgroup(pid):
    """The process's cgroup v2 path as this process's cgroup namespace shows it (the
    "0::" line of /proc/<pid>/cgroup), or None on a host without the unified hierarchy."""
    data = _read(f"/proc/{pid}/cgroup", 8192)
    if not data:
        return None
    for line in data.split(b"\n"):
        if line.startswith(b"0::"):
            return line[3:].decode(errors="replace")
    return None


def maps_index(wanted) -> dict:
    """For maps_inodes: {(device as maps writes it, inode as text): (st_dev, st_ino)}."""
    return {(f"{os.major(dev):02x}:{os.minor(dev):02x}".encode(), str(ino).encode()): (dev, ino)
            for dev, ino in wanted}


def maps_inodes(pid, wanted) -> set:
    """Which files of `wanted` ({(st_dev, st_ino): anything}, or a maps_index of it) the
    process has mapped (/proc/<pid>/maps): a set of their (st_dev, st_ino), or None when
    the maps cannot be read."""
    keys = wanted if wanted and isinstance(next(iter(wanted)), tuple) and \
        isinstance(next(iter(wanted))[0], bytes) else maps_index(wanted)
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            found = set()
            for line in f:
                fields = line.split(None, 5)
                if len(fields) >= 5:
                    key = keys.get((fields[3], fields[4]))
                    if key is not None:
                        found.add(key)
            return found
    except OSError:
        return None


def file_in_root(pid, path):
    """(st_dev, st_ino) of `path` as the process sees it (through its root and mount
    namespace, /proc/<pid>/root), or None when it has no such file."""
    try:
        st = os.stat(f"/proc/{pid}/root{path}")
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def comm(pid):
    data = _read(f"/proc/{pid}/comm", 64)
    return data.decode(errors="replace").strip() if data else None


def cmdline(pid):
    data = _read(f"/proc/{pid}/cmdline", 4096)
    if not data:
        return None
    return " ".join(a.decode(errors="replace") for a in data.rstrip(b"\0").split(b"\0"))


def exists(pid) -> bool:
    return os.path.exists(f"/proc/{pid}")


def started_by(start, ticks) -> bool:
    """Is the process at a pid now, which started at `start`, the one a record of that pid
    made at `ticks` names?  A record holds its process's start time or any later time it
    was running at, in the same clock ticks after boot (the shim writes its claim's
    CLOCK_BOOTTIME: no /proc read at start-up).  Only the process that had the pid then can
    have started no later and have it now: a later one started after that one ended.  (A
    pid handed on within the same 10 ms tick would pass, as with an equal start time.)
    0 = no record: never."""
    return start is not None and bool(ticks) and start <= ticks


def may_have_started_by(start, ticks) -> bool:
    """started_by, where a record of 0 (none kept: a shared slot's, an older shim's) may
    name any process."""
    return not ticks or started_by(start, ticks)


def same_process(pid, ticks) -> bool:
    """Is `pid` still the process a record made at `ticks` names (started_by)?"""
    return started_by(start_ticks(pid), ticks)


THERE, GONE, REUSED = "there", "gone", "reused"


def owner(pid, ticks) -> str:
    """Where the process a record of `pid` made at `ticks` names (started_by) is: THERE
    (running, or exiting and not done with its files), GONE (no such pid, or a zombie with
    no other thread left: do_exit releases the files before exit_notify makes the zombie,
    and a thread group's table goes with its last thread), or REUSED (its pid is a later
    process's).  A dead slot is drained only once its process is not THERE: its lock may
    drop before the descriptors through which the driver holds its memory (shim/shim.c
    slot_owner)."""
    data = _read(f"/proc/{pid}/stat", 2048)
    if not data:
        return GONE
    try:
        fields = data[data.rindex(b")") + 2:].split()
        state, start = fields[0], int(fields[_FIELD_START])
    except (ValueError, IndexError):
        return GONE
    if not started_by(start, ticks):
        return REUSED
    if state not in (b"Z", b"X"):
        return THERE
    threads = re.search(rb"\nThreads:\s*(\d+)", _read(f"/proc/{pid}/status") or b"")
    return THERE if threads and int(threads.group(1)) > 1 else GONE


def host_pids(usage) -> dict:
    """{pid in the container: host pid} for the live processes of a slice's usage file
    (a slices.Usage): the processes that map it, found by their pid first (the common case:
    the same pid namespace as the caller), else by a walk of /proc."""
    wanted_file = {usage.inode: True}
    wanted = {p.pid for p in usage.procs if p.alive and p.pid > 0}   # (a shared slot is no process: pid 0)
    found = {}
    for pid in wanted:
        if maps_inodes(pid, wanted_file) and inner_pid(pid) == pid:
            found[pid] = pid
    # a slot of our own pid namespace whose process was not found there is gone (held by a
    # child that inherited its lock): no other namespace to look in
    mine = pid_ns()
    missing = wanted - set(found) - {p.pid for p in usage.procs if p.alive and mine and p.pid_ns == mine}
    if missing:
        index = maps_index(wanted_file)
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            host = int(entry.name)
            inner = inner_pid(host)
            if inner in missing and maps_inodes(host, index):
                found[inner] = host
                missing.discard(inner)
                if not missing:
                    break
    return found
