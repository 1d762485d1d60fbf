"""Truth on the node: every process on the GPU attributed to a slice, every slice checked
against the driver.

A slice's usage file is the shim's fast path, written by the container's own processes;
the driver (NVML) knows which processes hold what.  The Observer turns one look at both
into a Snapshot: each process NVML lists on each device is attributed to a slice, marked
*unsliced*, or *unknown* (a pid this process cannot see); each slice's device has the
driver's figure (the sum of its processes' device memory) beside the shim's
(memory.current) and its cap.  The Agent (`vgpu-ctl agent`) looks every interval, reaps
dead slots, judges the snapshots over time (grace period, compute window) into
violations, logs each as one JSON line and, by policy, acts on the processes it is sure
of.  `status`, the metrics and the Kubernetes plugin read through the same Observer.

How a process is attributed (the first that applies; see docs/node-agent.md):
  usage-file     /proc/<pid>/maps holds the slice's usage file: the shim of that slice
                 runs in it (the kernel's word: a tenant cannot fake it for someone else);
  identity-file  the slice's identity file is mounted at /run/vgpu/.slice in the
                 process's mount namespace (stat through /proc/<pid>/root): the container
                 was given the slice, whatever the process loaded;
  pod            its cgroup path names the pod UID of the claim that made the slice;
  cgroup         it shares its cgroup with a process attributed above that lives in a
                 container (its own mount or pid namespace), of this slice only;
  pid-namespace  likewise its pid namespace (never the agent's own).
And a pid that is gone (or a zombie) here but whose memory a live process keeps on the
device is "held-slot": a slot of the slice still held (its lock taken: a forked child
inherited it) records that pid, or a shared slot (memory an importer keeps) records it as
its exporter -- only slots of the agent's own pid namespace.  Its memory counts in the
slice's driver figure; it is never acted on (there is no process to act on).
Two slices claiming a process is "ambiguous": reported with both, never acted on.  A pid
the agent cannot read is "unknown": reported, never acted on.  Nothing the usage file says
about its processes is taken as proof: its slots only help find them.

Where (Place): NVML lists processes per GPU, and on a GPU in MIG mode per MIG device, from
each MIG device's own handle (the GPU's own list is only an aggregate, and there is no
per-process utilization in MIG mode).  A software slice's quota device N is GPU N (CUDA's
ordinals follow NVML's in a container `env` made); a MIG slice's device 0 is its MIG
device, found by the UUID in its record (slices.MIG).  A process of a slice on a device
the slice does not hold is judged against a cap of 0 there.
"""
import collections
import fcntl
import json
import os
import select
import signal
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from . import nvml, procfs, slices
from ._region import ffi, lib
from .quantities import SHARE_FULL, UNLIMITED, format_memory

MiB = 1 << 20
KINDS = ("over-cap", "gap", "forged", "unsliced", "compute")
ACTIONS = {"over-cap": ("report", "kill"), "gap": ("report", "kill"), "forged": ("report", "kill"),
           "unsliced": ("report", "kill"),
           "compute": ("report", "kill", "stop")}
CERTAIN = ("usage-file", "identity-file", "pod", "cgroup", "pid-namespace")
STATE_FILE = ".agent.json"      # in the node directory (no slice name starts with '.')
IDENTITY_PATH = "/run/vgpu/.slice"
RECHECK_S = 10.0                # a process found in no slice is looked at again this often
ORPHAN_S = 2.0                  # temporary slices' owners are checked this often
SLACK_S = 0.005
SWEEP_LOOKS = 30                # and every slice once in 30 looks (a net under the inotify events)
RECENT_NS = 100_000_000         # a directory changed this recently is looked at again (coarse timestamps)
MIG_RESCAN_S = 30.0             # a MIG-mode GPU's MIG devices are listed again this often
RECHECK_AFTER = (0.005, 0.03, 0.1, 0.3)   # s after an open or close of a usage file: its slice looked at again
MIG_FORCED_S = 2.0              # ... and out of turn (a new instance, one gone) at most this often
# a slot charging this much on one device was written by hand: no device has 2^48 bytes (256
# TiB), and the shim never charges what a device cannot hold ("negative" charges are 2^64 - x)
FORGED_CHARGE = 1 << 48
CONFIRM_TRIES = 3               # bracketed looks at a gap before it is left unjudged (charges moving)


# === settings ===

@dataclass
class Settings:
    tolerance: int = 64 * MiB       # memory the driver may hold beyond the shim's figure / the cap
    tolerance_ratio: float = 0.02   # ... or this share of the cap, whichever is larger
    process_overhead: int = 0       # per process, on top (a context's own memory the shim does not charge)
    # a process of the slice that has charged nothing on a device since the agent first saw
    # it holds its context's memory there, which the shim charges with its first
    # allocation: up to this much of it is not a gap (a framework loading a model between
    # creating its context and allocating)
    context_allowance: int = 512 * MiB
    grace: float = 0.5              # a memory or unsliced condition must last this long
    window: float = 10.0            # a compute condition must hold on average over this long
    compute_margin: int = 1000      # NVML's share may pass sm.max by this much (1/100 percent: 10 points)
    require_slices: bool = False    # a GPU process in no slice is a violation
    actions: dict = field(default_factory=dict)   # kind -> report | kill | stop

    def action(self, kind):
        return self.actions.get(kind, "report")

    def tolerance_for(self, cap, processes=0) -> int:
        base = self.tolerance if cap in (None, UNLIMITED) else max(self.tolerance, int(cap * self.tolerance_ratio))
        return base + processes * self.process_overhead

    def to_json(self):
        return {"tolerance": self.tolerance, "tolerance_ratio": self.tolerance_ratio,
                "process_overhead": self.process_overhead, "context_allowance": self.context_allowance,
                "grace_s": self.grace, "window_s": self.window,
                "compute_margin": self.compute_margin, "require_slices": self.require_slices,
                "on_violation": {k: self.action(k) for k in KINDS}}


def parse_actions(values) -> dict:
    """`--on-violation` values: ACTION (every kind that has it) or KIND=ACTION, repeatable."""
    out = {}
    for v in values:
        kind, _, action = v.rpartition("=")
        kinds = [kind] if kind else [k for k in KINDS if action in ACTIONS[k]]
        if kind and kind not in KINDS:
            raise ValueError(f"{kind!r} is not a violation kind ({', '.join(KINDS)})")
        if not kinds or any(action not in ACTIONS[k] for k in kinds):
            raise ValueError(f"{v!r}: {action!r} is not an action for "
                             f"{kind or 'any kind'} (" + "; ".join(f"{k}: {'|'.join(ACTIONS[k])}" for k in
                                                                   ([kind] if kind else KINDS)) + ")")
        out.update({k: action for k in kinds})
    return out


# === reading a slice's slots ===

_PROC = struct.Struct("<iIQ32sQQQQ")
assert _PROC.size == ffi.sizeof("struct vgpu_usage_proc")
_PROCS_AT = ffi.offsetof("struct vgpu_usage", "procs")
_PIDS = struct.Struct("<" + f"i{_PROC.size - 4}x" * slices.MAX_PROCS)
_ROW = struct.Struct("<%dQ" % slices.MAX_PROCS)
_DEV_AT = ffi.offsetof("struct vgpu_usage", "devices")
_DEV_SIZE = ffi.sizeof("struct vgpu_usage_device")
_GPU_TIME_AT = ffi.offsetof("struct vgpu_usage_device", "gpu_time_ns")
_LAUNCHES_AT = ffi.offsetof("struct vgpu_usage_device", "launches")
_HEADER = struct.Struct("<QII")
_SEQ_AT = ffi.offsetof("struct vgpu_usage", "charge_seq")
_SEQ_SIZE = 4 * slices.MAX_PROCS


@dataclass
class Slot:
    slot: int
    pid: int                 # as the process sees itself
    start_ticks: int
    pid_ns: int
    cgroup_id: int
    from_file: bool
    comm: str
    charges: dict            # device -> bytes
    alive: bool
    shared: bool = False     # a shared slot (VGPU_PROC_SHARED): memory `exporter` exported, pid 0
    exporter: int = 0        # its exporter's pid, as it saw itself (in pid_ns)


_ZERO_ROW = (0,) * slices.MAX_PROCS
_QQ = struct.Struct("<QQ")


_SLOTS_USED_AT = ffi.offsetof("struct vgpu_usage", "slots_used")
_CHARGE_AT = slices.CHARGE_OFFSET


def _parse_usage(head, procs, devices):
    """({device: memory.current}, {device: (gpu_time_ns, launches)}, [Slot, alive unset])
    from the file's start (header, counters, the held devices' charge rows) and the
    process records of its used slots."""
    rows = {d: _ROW.unpack_from(head, _CHARGE_AT + d * _ROW.size) for d in devices}
    # (not modulo 2^64, as the shim never sums either: a row that wraps around is forged)
    current = {d: 0 if r == _ZERO_ROW else sum(r) for d, r in rows.items()}
    counters = {}
    for d in devices:
        launches, gpu = _QQ.unpack_from(head, _DEV_AT + d * _DEV_SIZE + _LAUNCHES_AT)
        counters[d] = (gpu, launches)
    n = len(procs) // _PROC.size
    used = {i for i in range(n) if procs[i * _PROC.size:i * _PROC.size + 4] != b"\0\0\0\0"}
    for r in rows.values():
        if r != _ZERO_ROW:
            used.update(i for i, v in enumerate(r) if v)
    out = []
    for i in sorted(used):
        if i < n:
            rec = _PROC.unpack_from(procs, i * _PROC.size)
        else:                # charged beyond the slots it says are used: a drain cut short
            rec = (0, 0, 0, b"", 0, 0, 0, 0)
        pid, state, _, comm, ticks, pns, cg, flags = rec
        shared = not pid and bool(flags & lib.VGPU_PROC_SHARED)
        out.append(Slot(i, pid, ticks, pns, cg, bool(flags & lib.VGPU_PROC_FROM_FILE),
                        comm.split(b"\0", 1)[0].decode(errors="replace"),
                        {d: r[i] for d, r in rows.items() if r[i]}, False, shared, state if shared else 0))
    return current, counters, out


class UsageReader:
    """Reads one slice's usage file: its start (header, counters, the held devices' charge
    rows) every look, and the records of the slots it says are used when that start
    changed, when asked (`full`), and every RECHECK_S; parsed again only when a byte
    changed.  An idle slice costs one read and a compare."""
    __slots__ = ("head", "procs", "devices", "parsed", "full_at")

    def __init__(self):
        self.head = self.procs = self.devices = self.parsed = None
        self.full_at = -1e9

    def read(self, fd, devices, known_alive=None, full=False, now=0.0):
        """(slots in use, {device: memory.current}, {device: (gpu_time_ns, launches)}).  A
        slot is alive when its lock is held, or when known_alive(pid, pid_ns,
        start_ticks) says so (a process the caller watches through a pidfd: no lock
        query).  Raises slices.BadFile for a file cut short or of another kind (the
        container's doing)."""
        devices = tuple(devices)
        end = _CHARGE_AT + (max(devices) + 1 if devices else 0) * _ROW.size
        head = os.pread(fd, end, 0)
        if len(head) != end or _HEADER.unpack_from(head) != \
                (lib.VGPU_USAGE_MAGIC, lib.VGPU_ABI_VERSION, slices.USAGE_SIZE):
            self.head = None
            raise slices.BadFile("usage file cut short or not a vgpu usage file")
        if full or head != self.head or devices != self.devices or now - self.full_at >= RECHECK_S:
            # (a slot claimed again by a new process may change only its record: `full`
            # when the caller finds a process of the slice that matches no slot)
            used = min(struct.unpack_from("<I", head, _SLOTS_USED_AT)[0], slices.MAX_PROCS)
            procs = os.pread(fd, used * _PROC.size, _PROCS_AT) if used else b""
            if len(procs) != used * _PROC.size:
                self.head = None
                raise slices.BadFile("usage file cut short")
            self.full_at = now
            if head != self.head or procs != self.procs or devices != self.devices:
                self.parsed = _parse_usage(head, procs, devices)
                self.head, self.procs, self.devices = head, procs, devices
        current, counters, slots = self.parsed
        for sl in slots:
            sl.alive = (known_alive is not None and sl.pid > 0 and known_alive(sl.pid, sl.pid_ns, sl.start_ticks)) \
                or slices.slot_alive(fd, sl.slot)
        return list(slots), current, counters


def read_slots(fd, devices, known_alive=None):
    """UsageReader.read without a cache."""
    return UsageReader().read(fd, devices, known_alive)


assert _LAUNCHES_AT + 8 == _GPU_TIME_AT, "usage counters moved"


# === processes, as the kernel knows them ===

class Tracked:
    """A process NVML lists (or a slot's process in our pid namespace), with what the
    kernel says of it, kept for its life (the pidfd says when it ends)."""
    __slots__ = ("pid", "start", "pid_ns", "mnt_ns", "inner", "cgroup", "pidfd", "usage", "usage_at",
                 "identity", "maps_ok", "comm", "visible", "charged")

    def __init__(self, pid):
        self.pid = pid
        self.pidfd = None
        self.charged = set()     # devices its slot was seen charging on
        self.visible = False     # a process this namespace can see (and read): start is not None
        self.start = procfs.start_ticks(pid)
        if self.start is None:
            return
        try:
            self.pidfd = os.pidfd_open(pid)
        except OSError:
            self.start = None
            return
        if procfs.start_ticks(pid) != self.start:     # the pid was reused between the two reads
            self.close()
            self.start = None
            return
        self.visible = True
        self.pid_ns = procfs.pid_ns(pid)
        self.mnt_ns = procfs.mnt_ns(pid)
        self.inner = procfs.inner_pid(pid)
        self.cgroup = procfs.cgroup(pid)
        self.comm = procfs.comm(pid)
        self.usage = None        # frozenset of slice names whose usage file it maps; None: not looked yet
        self.usage_at = None
        self.identity = None
        self.maps_ok = False

    def close(self):
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


@dataclass
class Attribution:
    slice: str = None
    method: str = None       # usage-file, identity-file, pod, cgroup, pid-namespace, held-slot; None: unsliced/unknown
    state: str = "unsliced"  # sliced, unsliced, unknown, ambiguous
    note: str = None
    candidates: tuple = ()
    reused: bool = False     # its pid was an ended process's, whose memory a held slot still charges

    @property
    def certain(self):
        return self.state == "sliced" and self.method in CERTAIN or self.state == "unsliced"

    def to_json(self):
        out = {"state": self.state, "container": self.slice, "method": self.method}
        if self.note:
            out["note"] = self.note
        if self.candidates:
            out["candidates"] = list(self.candidates)
        return out


# === where NVML lists a process ===

class Place(NamedTuple):
    """A device NVML lists processes on: a whole GPU (its NVML index), or a MIG device on a
    GPU in MIG mode (its UUID, GPU instance and compute instance IDs).  `label` is how the
    agent names it in status, JSON and metrics: "1" for GPU 1, "1/mig-2-0" for compute
    instance 0 of GPU instance 2 on GPU 1 (the GI and CI columns of nvidia-smi)."""
    gpu: int
    mig: str = None
    gi: int = None
    ci: int = None

    @property
    def label(self) -> str:
        return str(self.gpu) if self.mig is None else f"{self.gpu}/mig-{self.gi}-{self.ci}"

    @property
    def device(self):
        """As a process row's `device`: the GPU's index (an int) or the MIG label."""
        return self.gpu if self.mig is None else self.label


def record_place(record, listed=None) -> Place:
    """A MIG slice's instance (its quota's device 0): as NVML lists it now (`listed`:
    {MIG UUID: Place}; by UUID only: a GPU instance ID is reused by the next instance made
    at that placement), else as its record says (then NVML does not list it)."""
    record = record or {}
    uuid = record.get("uuid")
    if listed and uuid in listed:
        return listed[uuid]
    try:
        gpu = int(record.get("device"))
    except (TypeError, ValueError):
        gpu = -1
    return Place(gpu, str(uuid or "MIG-?"), record.get("gpu_instance"), record.get("compute_instance"))


# === the snapshot ===

@dataclass
class ProcRow:
    host_pid: int
    device: object           # Place.device: the GPU's index, or the MIG device's label
    driver: int              # bytes NVML says it holds there (None: not said)
    util: int                # SM percent NVML gives it over the last second (None: it cannot say, MIG)
    attribution: Attribution
    slot: int = None         # its slot in the slice's usage file, when one is its own
    charge: int = None       # what that slot charges on the device
    comm: str = None
    context: bool = False    # a context and nothing charged yet (Settings.context_allowance)
    place: Place = None
    other_slots: tuple = ()   # slots besides its own counted in `charge`: what it exported (shared
                              # slots), and its pid's earlier process's in its slice (pid reuse)

    @property
    def gap(self):
        if self.driver is None:
            return None
        return 0 if self.context else self.driver - (self.charge or 0)

    def to_json(self):
        out = {"host_pid": self.host_pid, "device": self.device, "memory_driver": self.driver,
               "sm_util": self.util * 100 if self.util is not None else None, "slot": self.slot,
               "memory_charged": self.charge, "context_only": self.context, "comm": self.comm,
               **self.attribution.to_json()}
        if self.place is not None and self.place.mig is not None:
            out["mig_uuid"] = self.place.mig
        return out


class SliceDevice:
    """One slice on one device: the shim's figure (memory.current, the sum of the slots'
    charges), the driver's (the sum of its processes' memory; None: unknown), the cap."""
    __slots__ = ("name", "device", "memory_max", "memory_current", "driver", "sm_max", "sm_nvml", "gpu_time_ns",
                 "settings", "processes", "shared", "context", "place")

    def __init__(self, name, device, memory_max, memory_current, driver, sm_max, sm_nvml, gpu_time_ns, settings,
                 shared=False, place=None):
        self.name, self.device, self.memory_max, self.memory_current = name, device, memory_max, memory_current
        self.driver, self.sm_max, self.sm_nvml, self.gpu_time_ns = driver, sm_max, sm_nvml, gpu_time_ns
        self.settings = settings
        self.processes = []
        self.shared = shared     # may be kept for the next look while the slice stays idle: never changed
        self.context = 0         # the driver's figure of its processes that have only a context yet
        self.place = place       # where NVML lists the device (a MIG slice's device 0: its MIG device)

    def copy(self):
        return SliceDevice(self.name, self.device, self.memory_max, self.memory_current, self.driver, self.sm_max,
                           self.sm_nvml, self.gpu_time_ns, self.settings, place=self.place)

    @property
    def tolerance(self):
        return self.settings.tolerance_for(self.memory_max, len(self.processes))

    def to_json(self):
        return {"container": self.name, "device": self.device, "memory_max": None if self.memory_max == UNLIMITED
                else self.memory_max, "memory_current": self.memory_current, "memory_driver": self.driver,
                "tolerance": self.tolerance, "sm_max": self.sm_max, "sm_nvml": self.sm_nvml,
                "processes": [p.host_pid for p in self.processes],
                "nvml_device": self.place.label if self.place is not None else None,
                "mig_uuid": self.place.mig if self.place is not None else None}


@dataclass
class Snapshot:
    t: float
    nvml_ok: bool
    nvml_note: str
    device_errors: dict                   # Place.device -> why NVML could not say
    slices: dict                          # (name, quota device) -> SliceDevice (a place the slice was not
                                          # given: (name, GPU index) for a software slice, else (name, label))
    processes: list                       # ProcRow of every process NVML lists, every device
    slots: dict                           # name -> [Slot]
    problems: dict                        # name -> why its files cannot be read
    dead: list = field(default_factory=list)   # slices with a slot whose process is gone
    active: dict = field(default_factory=dict)  # the SliceDevices with processes on the GPU
    places: list = field(default_factory=list)  # the devices NVML answered for (GPUs, MIG devices)

    def unsliced(self):
        return [p for p in self.processes if p.attribution.state in ("unsliced", "ambiguous")]

    def unknown(self):
        return [p for p in self.processes if p.attribution.state == "unknown"]

    def to_json(self):
        return {"nvml": {"available": self.nvml_ok, "note": self.nvml_note,
                         "device_errors": {str(d): e for d, e in self.device_errors.items()}},
                "slices": [sd.to_json() for sd in self.slices.values()],
                "processes": [p.to_json() for p in self.processes],
                "problems": self.problems}


# === inotify: a process of a slice opening or closing its usage file ===

IN_OPEN, IN_CLOSE_WRITE, IN_IGNORED, IN_DONT_FOLLOW = 0x20, 0x8, 0x8000, 0x02000000
_EVENT = struct.Struct("iIII")


class Inotify:
    """Watches usage files for opens (a process joins the slice) and closes after writing
    (one left it: ended, or exec'd; every shim process opens its usage file read-write),
    so a dead process's slot is reaped when it goes, whatever pid namespace it lived in.
    None of this is needed for correctness -- every slice is also looked at every
    SWEEP_LOOKS looks -- only for speed; without inotify every look reads every slice."""

    def __init__(self):
        import ctypes
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.names = {}          # watch descriptor -> slice
        self.wds = {}            # slice -> watch descriptor

    def watch(self, name, path):
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), IN_OPEN | IN_CLOSE_WRITE | IN_DONT_FOLLOW)
        if wd < 0:
            return False
        self.unwatch(name)
        self.names[wd], self.wds[name] = name, wd
        return True

    def unwatch(self, name):
        wd = self.wds.pop(name, None)
        if wd is not None and self.names.pop(wd, None) is not None:
            self._libc.inotify_rm_watch(self.fd, wd)

    def events(self):
        """[(slice, mask)] of what happened since the last call."""
        out = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            at = 0
            while at + _EVENT.size <= len(data):
                wd, mask, _, n = _EVENT.unpack_from(data, at)
                at += _EVENT.size + n
                name = self.names.get(wd)
                if mask & IN_IGNORED:
                    if name is not None:
                        del self.names[wd]
                        self.wds.pop(name, None)
                elif name is not None:
                    out.append((name, mask))

    def close(self):
        os.close(self.fd)


def _inotify():
    try:
        return Inotify()
    except (OSError, AttributeError):
        return None


# === the observer ===

class _Poller:
    """epoll where there is one (Linux), else poll: register(fd), unregister(fd),
    poll(timeout in seconds) -> [(fd, events)]."""

    def __init__(self):
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._poll = None if self._epoll is not None else select.poll()

    def register(self, fd):
        if self._epoll is not None:
            self._epoll.register(fd, select.EPOLLIN)
        else:
            self._poll.register(fd, select.POLLIN)

    def unregister(self, fd):
        (self._epoll or self._poll).unregister(fd)

    def poll(self, timeout=0.0):
        if self._epoll is not None:
            return self._epoll.poll(timeout, 256)
        return self._poll.poll(timeout * 1000)

    def close(self):
        if self._epoll is not None:
            self._epoll.close()


class _SliceFiles:
    """A slice's files as the observer keeps them: the usage descriptor (the reader's),
    the usage and identity files' inodes."""
    __slots__ = ("view", "usage_inode", "identity_inode", "checked", "reader", "devices", "want_full", "same",
                 "index", "keys", "rw", "pod_uid", "gen", "places", "by_place", "dir_mtime")
    made = 0

    def __init__(self, view, directory):
        self.view = view
        self.reader = UsageReader()
        self.devices = tuple(d for d, _ in view.held)
        self.gen = view.gen
        self.want_full = False
        self.same = None         # (state, slots, table rows, watched, tracked version if all are): an unchanged look
        self.keys = ((), ())     # its keys in the observer's table and slot index
        self.rw = None           # a read-write descriptor for reaping, opened when first needed
        _SliceFiles.made += 1
        self.index = _SliceFiles.made   # spreads the sweeps of idle slices over the looks
        self.places = self.by_place = None   # {quota device: Place} and back, as of the last look at it
        self.dir_mtime = None
        self.usage_inode = None
        if view._ufd is not None:
            st = os.fstat(view._ufd)
            self.usage_inode = (st.st_dev, st.st_ino)
        self.identity_inode = None
        self.checked = None
        self.check_identity(directory)

    def close(self):
        if self.rw is not None:
            os.close(self.rw)
            self.rw = None

    def changed(self, directory) -> bool:
        """Has the slice's directory changed since the last check_identity (a file made in it:
        the identity file by `env`, the DRA driver's labels)?  One stat."""
        try:
            mtime = os.stat(os.path.join(directory, self.view.name), follow_symlinks=False).st_mtime_ns
        except OSError:
            return True
        return mtime != self.dir_mtime

    def check_identity(self, directory, now=None):
        try:
            self.dir_mtime = os.stat(os.path.join(directory, self.view.name), follow_symlinks=False).st_mtime_ns
            if time.time_ns() - self.dir_mtime < RECENT_NS:
                self.dir_mtime = None    # (timestamps are coarse: a file made in the same tick would go unseen)
        except OSError:
            self.dir_mtime = None
        try:
            st = os.stat(os.path.join(directory, self.view.name, slices.IDENTITY), follow_symlinks=False)
            self.identity_inode = (st.st_dev, st.st_ino)
        except OSError:
            self.identity_inode = None
        from . import podlabels   # a DRA slice's pod (the driver writes its labels just after the slice)
        self.pod_uid = podlabels.read(directory, self.view.name).get("pod_uid")
        self.checked = now


def _lock_start(line, ino):
    """The first byte of the lock an fdinfo "lock:" line describes, if it is on inode `ino`
    ("lock:\t1: OFDLCK ADVISORY WRITE -1 fe:00:<ino> <start> <end>"); else None."""
    fields = line.split()
    for i, f in enumerate(fields[:-1]):
        if f.count(":") == 2 and f.rsplit(":", 1)[1] == str(ino) and fields[i + 1].isdigit():
            return int(fields[i + 1])
    return None


class Observer:
    """One look at the node: slices (through an autoscale.NodeReader, shared with the
    autoscaler and the metrics) and NVML."""

    def __init__(self, directory=None, reader=None, use_nvml=True, settings=None, nvml_module=None,
                 pod_uids=None):
        from .autoscale import NodeReader
        self.directory = slices.node_dir(directory)
        self.reader = reader or NodeReader(self.directory)
        self.use_nvml = use_nvml
        self.settings = settings or Settings()
        self.nvml = nvml_module or nvml
        self.pod_uids = pod_uids or (lambda: {})      # -> {slice: [pod UID]}
        self.tracked = {}         # host pid -> Tracked
        self.files = {}           # slice -> _SliceFiles
        self.my_pid_ns = procfs.pid_ns()
        self.my_mnt_ns = procfs.mnt_ns()
        self._prev = {}           # (slice, device) -> (t, gpu_time_ns)
        self.lock = threading.Lock()
        self._not_slots = {}      # slot pid -> start ticks that named no such process here
        self.looks = 0
        self._active = set()      # slices that had processes on the GPU at the last look
        # what the looks keep between them (only the slices looked at change; see _observe)
        self._table, self._slot_of, self._slots, self._table_keys = {}, {}, {}, {}
        self._shared_of = {}      # slice -> {(pid_ns, exporter pid): [its live shared Slots]}
        self._held_pids = {}      # slice -> pids its live slots of our pid namespace name (a shared one: its exporter)
        self._pid_slices = {}     # and back: pid -> {slice}
        self._state, self._dirty_all = None, True
        self._attention, self._ended = set(), set()
        self._read_problems = {}
        self._version = 0         # bumped whenever what _groups reads changes
        self._tracked_version = 0  # bumped whenever a process is tracked or dropped
        self._files_version = 0   # bumped whenever a slice's files (their inodes) change
        self._by_inode = None
        self._maps_index = None
        self._invisible = set()
        self._attr_cache = (None, {})
        self._rows = {}           # (Place, pid) -> what its row was made from, and the row (see _observe)
        self._groups_cache = None
        self._buckets = [set() for _ in range(SWEEP_LOOKS)]
        # where NVML lists processes: whole GPUs, and the MIG devices of GPUs in MIG mode
        self._gpu_places = {}     # NVML index -> Place
        self._no_mig = set()      # GPUs without MIG (NOT_SUPPORTED): never asked again
        self._migs = {}           # GPU in MIG mode -> (when listed, [nvml.MigDevice])
        self._mig_forced = {}     # GPU -> when its MIG devices were last listed out of turn
        self.mig_places = {}      # MIG UUID -> Place, of every MIG device listed
        # every tracked process's pidfd (readable once it ended) and the inotify descriptor, in an
        # epoll set: registered once, and a wait costs what is ready, not what is watched
        self.poller = _Poller()
        self._by_fd = {}
        self.inotify = _inotify()
        if self.inotify is not None:
            self.poller.register(self.inotify.fd)

    # --- processes ---

    def track(self, pid):
        """The Tracked for a host pid (forget_ended has dropped the ones that ended)."""
        t = self.tracked.get(pid)
        if t is None:
            self._version += 1
            self._tracked_version += 1
            t = self.tracked[pid] = Tracked(pid)
            if not t.visible:
                self._invisible.add(pid)     # looked at again next time
            if t.pidfd is not None:
                self.poller.register(t.pidfd)
                self._by_fd[t.pidfd] = t
        return t

    def _drop(self, t):
        self._version += 1
        self._tracked_version += 1
        if t.pidfd is not None:
            self.poller.unregister(t.pidfd)
            self._by_fd.pop(t.pidfd, None)
        t.close()
        if self.tracked.get(t.pid) is t:
            del self.tracked[t.pid]

    def forget_ended(self, events=None) -> list:
        """Drop processes that ended (one poll over their pidfds, or the poll's `events`)
        and the pids that could not be seen (looked at again next time); returns those
        that ended."""
        events = self.poller.poll(0) if events is None else events
        ended = [self._by_fd[fd] for fd, _ in events if fd in self._by_fd]
        for t in ended:
            self._ended |= set(t.usage or ())
        for t in ended + [t for t in (self.tracked.get(pid) for pid in self._invisible) if t is not None]:
            self._drop(t)
        self._invisible.clear()
        return ended

    def reap(self, name) -> list:
        """Drain the slots of the slice's dead processes through a kept read-write
        descriptor (opening the file for each reap would itself be an inotify event).
        Returns what was reclaimed, as slices.reap_slice does."""
        f = self.files.get(name)
        if f is None or f.view._ufd is None:
            return slices.reap_slice(self.directory, name)
        return self._reap(f, name)[1]

    def recheck(self, name, now=None):
        """Between looks, after an inotify event on the slice's usage file (a process
        joined or left): reap its dead slots, and watch through a pidfd each process of our
        pid namespace that claimed a slot since, so its end is seen at once.  Returns (what
        was reclaimed, unsure): unsure while a slot's process is alive by its lock alone --
        the kernel sends a close's event just before it drops the closing process's lock, so
        such a slot is looked at again (Agent: RECHECK_AFTER).  A slice not looked at yet:
        ([], True), the next look reads it."""
        f = self.files.get(name)
        if f is None or f.view._ufd is None:
            return [], True
        now = time.monotonic() if now is None else now
        ss, reclaimed = self._reap(f, name)
        tracked, not_slots, unsure = self.tracked, self._not_slots, False
        by_usage = self._by_inode[1] if self._by_inode is not None else None
        for sl in ss:
            if not sl.alive:
                continue
            t = tracked.get(sl.pid) if sl.pid > 0 and sl.pid_ns == self.my_pid_ns else None
            if t is None and sl.pid > 0 and sl.pid_ns == self.my_pid_ns and by_usage is not None and \
                    not_slots.get(sl.pid) != sl.start_ticks:
                t = self.track(sl.pid)
                if t.visible and t.start == sl.start_ticks:
                    self._usage_of(t, by_usage, now)
                else:            # another process has that pid now, or none: not the slot's
                    self._drop(t)
                    not_slots[sl.pid] = sl.start_ticks
                    t = None
            if t is None or not t.visible or t.start != sl.start_ticks:
                unsure = True
        return reclaimed, unsure

    def _reap(self, f, name):
        if f.rw is None:
            shown = os.path.join(self.directory, name, slices.USAGE)
            fd = os.open(shown, slices._RW)
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != f.usage_inode:
                    raise slices.BadFile(f"{shown} was replaced", "the next look reads it again")
                slices._check_regular(fd, shown, slices.USAGE_SIZE)
            except BaseException:
                os.close(fd)
                raise
            f.rw = fd
        ss, _, _ = UsageReader().read(f.rw, f.devices)
        f.same = None            # the next look reads it again
        self._ended.add(name)
        return ss, [{"slot": r["slot"], "pid": r["pid"], "comm": r["comm"], "memory": r["memory"]}
                    for r in (slices._reap_slot(f.rw, sl) for sl in ss if not sl.alive) if r]

    def alive(self, pid, pid_ns, start_ticks) -> bool:
        """Is the slot's process one this observer watches, still running?  (Only for
        processes of our own pid namespace: their slot pid is their pid here.)"""
        if pid_ns != self.my_pid_ns:
            return False
        t = self.tracked.get(pid)
        return t is not None and t.visible and t.start == start_ticks

    def _usage_of(self, t, by_usage, now):
        if t.usage is None or (not t.usage and now - t.usage_at >= RECHECK_S):
            self._version += 1
            if self._maps_index is None or self._maps_index[0] is not by_usage:
                self._maps_index = (by_usage, procfs.maps_index(by_usage))
            found = procfs.maps_inodes(t.pid, self._maps_index[1])
            t.maps_ok = found is not None
            t.usage = frozenset(by_usage[i] for i in found) if found else frozenset()
            t.usage_at = now
            ident = procfs.file_in_root(t.pid, IDENTITY_PATH)
            t.identity = ident
        return t.usage

    # --- the driver ---

    def _driver(self, now):
        """(ok, note, {Place: {host pid: bytes}}, {Place: {host pid: SM percent}}, {Place: why})
        from one look at NVML.  A GPU in MIG mode has no processes of its own: they are on
        its MIG devices, each read through its own handle; per-process utilization is not
        there (NOT_SUPPORTED on a MIG-enabled GPU), so its places have none."""
        ok, note = (self.nvml.available() if self.use_nvml else (False, "NVML not used"))
        per_place, util, errors = {}, {}, {}
        if not ok:
            return ok, note, per_place, util, errors
        try:
            count = self.nvml.device_count()
        except Exception as e:   # a driver going away
            return False, str(e), per_place, util, errors
        mig_enabled = getattr(self.nvml, "mig_enabled", None)
        for d in range(count):
            whole = self._gpu_places.get(d)
            if whole is None:
                whole = self._gpu_places[d] = Place(d)
            on = None
            if mig_enabled is not None and d not in self._no_mig:
                try:
                    on = mig_enabled(d)
                except Exception:    # its mode unknown this once: as it was at the last look
                    on = d in self._migs
                if on is None:
                    self._no_mig.add(d)
            if not on:
                if d in self._migs:
                    self._forget_migs(d)
                try:
                    per_place[whole] = self.nvml.running_processes(d)
                except Exception as e:
                    errors[whole] = str(e)
                    continue
                try:
                    util[whole] = self.nvml.process_utilization(d)
                except Exception:
                    util[whole] = {}
                continue
            self._mig_view(d, now, per_place, errors)
        return ok, note, per_place, util, errors

    def _mig_view(self, d, now, per_place, errors):
        """The processes of GPU d's MIG devices (listed again when one stops answering, when
        the GPU's own aggregate list names a process none of them has -- an instance made
        since -- and every MIG_RESCAN_S)."""
        listed = self._migs.get(d)
        if listed is None or now - listed[0] >= MIG_RESCAN_S:
            listed = self._list_migs(d, now, errors)
        for attempt in (0, 1):
            found, failed = {}, False
            for m in listed[1]:
                p = self.mig_places[m.uuid]
                try:
                    found[p] = self.nvml.mig_processes(m)
                    errors.pop(p, None)
                except Exception as e:
                    errors[p] = str(e)
                    failed = True
            try:             # (the aggregate needs privileges: without them, only the rescans)
                everyone = self.nvml.running_processes(d)
            except Exception:
                everyone = {}
            missing = set(everyone).difference(*found.values()) if everyone else ()
            if attempt == 0 and (failed or missing) and now - self._mig_forced.get(d, -1e9) >= MIG_FORCED_S:
                self._mig_forced[d] = now
                for p in [p for p in errors if p.gpu == d and p.mig is not None]:
                    del errors[p]
                listed = self._list_migs(d, now, errors)
                continue
            break
        per_place.update(found)

    def _list_migs(self, d, now, errors):
        try:
            devices = self.nvml.mig_devices(d)
        except Exception as e:
            errors[self._gpu_places[d]] = str(e)
            devices = []
        for m in (self._migs.get(d) or (0, []))[1]:
            self.mig_places.pop(m.uuid, None)
        for m in devices:
            self.mig_places[m.uuid] = Place(d, m.uuid, m.gpu_instance, m.compute_instance)
        self._migs[d] = (now, devices)
        return self._migs[d]

    def _forget_migs(self, d):
        for m in self._migs.pop(d, (0, []))[1]:
            self.mig_places.pop(m.uuid, None)

    def places_of(self, view) -> dict:
        """{quota device: Place} of a slice: a software slice's device d is GPU d (CUDA's
        ordinals follow NVML's: `env` sets CUDA_DEVICE_ORDER=PCI_BUS_ID and gives every
        GPU); a MIG slice's device 0 is its MIG device, wherever NVML lists it."""
        record = view.mig
        if record is not None:
            return {0: record_place(record, self.mig_places)}
        gp = self._gpu_places
        return {d: gp.get(d) or Place(d) for d, _ in view.held}

    # --- one look ---

    def observe(self, now=None) -> Snapshot:
        with self.lock:
            return self._observe(time.monotonic() if now is None else now)

    def _observe(self, now):
        st = self.settings
        self.forget_ended()
        views = self.reader.refresh(now)
        files, files_gone = self.files, self._table_keys

        # the driver's view first: which slices have processes on the GPU
        ok, note, per_device, util, errors = self._driver(now)

        # the slices' own figures: quota, usage file, a row per device.  Every slice when the
        # node changed; else those with processes on the GPU (by their maps, now or at the
        # last look), those with slots no pidfd watches (their locks are asked), those a
        # watched process of just ended, and every SWEEP_LOOKS-th look the rest
        problems = dict(self.reader.problems)
        alive, my_pid_ns, tracked, not_slots = self.alive, self.my_pid_ns, self.tracked, self._not_slots
        newly, dead = [], []         # slot processes of our pid namespace not watched yet; slices to reap
        state = (ok, tuple(errors), tuple(per_device))
        self.looks += 1
        ptable, pslot_of, pslots = self._table, self._slot_of, self._slots
        for name in [n for n in pslots if n not in views]:
            for key in files_gone.pop(name, ()):
                ptable.pop(key, None)
            pslots.pop(name, None)
            self._shared_of.pop(name, None)
            self._note_held(name, ())
        if state != self._state or len(pslots) != len(views) or self._dirty_all or self.inotify is None:
            todo = list(views)
            self._state, self._dirty_all = state, False
        else:
            todo = set(self._active) | self._attention | self._ended | self._buckets[self.looks % SWEEP_LOOKS]
            for procs in per_device.values():
                for pid in procs:
                    t = tracked.get(pid)
                    if t is not None and t.usage:
                        todo |= t.usage
            todo = [n for n in todo if n in views]
        self._ended = set()
        slot_alive = slices.slot_alive
        for name in todo:
            v = views[name]
            f = files.get(name)
            if f is None or f.view is not v:
                if f is not None:
                    self._buckets[f.index % SWEEP_LOOKS].discard(name)
                    f.close()
                f = files[name] = _SliceFiles(v, self.directory)
                self._files_version += 1
                self._buckets[f.index % SWEEP_LOOKS].add(name)
                if self.inotify is not None and not self.inotify.watch(name, os.path.join(self.directory, name,
                                                                                          slices.USAGE)):
                    self._attention.add(name)   # no watch (the kernel's limit): looked at every time
            elif (f.identity_inode is None or f.pod_uid is None) and \
                    (f.checked is None or now - f.checked >= RECHECK_S):
                if f.changed(self.directory):    # (a file is made in the slice's directory, never edited)
                    before = (f.identity_inode, f.pod_uid)
                    f.check_identity(self.directory, now)
                    if (f.identity_inode, f.pod_uid) != before:
                        self._files_version += 1
                else:
                    f.checked = now
            v.refresh_quota()
            if v.gen != f.gen:       # (the autoscaler, sharing the reader, may have read it first)
                f.devices, f.gen = tuple(d for d, _ in v.held), v.gen
                f.same = None
            old_keys = f.keys
            # as it was: one read to see that nothing changed, and a lock query for each
            # slot whose process no pidfd watches
            same = f.same
            if same is not None and same[0] == state and not f.want_full and now - f.reader.full_at < RECHECK_S:
                head = os.pread(v._ufd, len(f.reader.head), 0)
                if head == f.reader.head:
                    if same[4] == self._tracked_version:   # every slot watched, and no process came or went
                        self._attention.discard(name)
                        continue
                    ss, rows_, watched = same[1], same[2], same[3]
                    if all(tracked.get(pid) is t for pid, t in watched):
                        stale, more, unwatched = False, None, False
                        for sl in ss:
                            t = tracked.get(sl.pid) if sl.pid > 0 and sl.pid_ns == my_pid_ns else None
                            if t is not None and (sl.pid, t) in watched:
                                continue
                            if t is not None and t.visible and t.start == sl.start_ticks:
                                more = (more or set()) | {(sl.pid, t)}     # watched from now on
                                continue
                            unwatched = True
                            if not slot_alive(v._ufd, sl.slot):
                                stale = True
                                break
                        if more and not stale:
                            watched = watched | more
                            f.same = (same[0], ss, rows_, watched,
                                      self._tracked_version if len(watched) == len(ss) else None)
                        if not stale:
                            (self._attention.add if unwatched else self._attention.discard)(name)
                            continue
            held = v.held
            ss, current, counters = [], {}, {}
            if v._ufd is not None:
                try:
                    ss, current, counters = f.reader.read(v._ufd, f.devices, alive, f.want_full, now)
                    self._read_problems.pop(name, None)
                except (slices.BadFile, OSError) as e:
                    self._read_problems[name] = str(e)
                f.want_full = False
            for key in old_keys[1]:
                pslot_of.pop(key, None)
            pslots[name] = ss
            slot_keys = []
            unwatched = False
            shared, held_pids = None, set()
            for sl in ss:
                if not sl.alive:
                    if name not in dead:
                        dead.append(name)
                    continue
                if sl.pid_ns == my_pid_ns:
                    held_pids.add(sl.exporter if sl.shared else sl.pid)
                if sl.shared:
                    shared = shared or {}
                    shared.setdefault((sl.pid_ns, sl.exporter), []).append(sl)
                elif sl.pid > 0:
                    key = (name, sl.pid_ns, sl.pid)
                    pslot_of[key] = sl
                    slot_keys.append(key)
                    if sl.pid_ns == my_pid_ns and sl.pid not in tracked and not_slots.get(sl.pid) != sl.start_ticks:
                        newly.append(sl)
                    if sl.pid_ns != my_pid_ns or sl.pid not in tracked:
                        unwatched = True
            (self._attention.add if unwatched else self._attention.discard)(name)
            if shared:
                self._shared_of[name] = shared
            else:
                self._shared_of.pop(name, None)
            self._note_held(name, held_pids)
            standalone = ok and len(held) == slices.MAX_DEVICES
            places = f.places = self.places_of(v)
            f.by_place = {p: d for d, p in places.items()}
            mine = {}
            for d, q in held:
                place = places.get(d)
                if standalone and place not in per_device and place not in errors:
                    continue     # a standalone quota holds every index: the devices that exist
                known = 0 if ok and place in per_device else None
                mine[(name, d)] = SliceDevice(name, d, q.memory_max, current.get(d, 0), known, q.sm_max,
                                              0 if ok and place in util else None, counters.get(d, (0, 0))[0], st,
                                              shared=True, place=place)
            for key in old_keys[0]:
                if key not in mine:
                    ptable.pop(key, None)
            ptable.update(mine)
            f.keys = (tuple(mine), tuple(slot_keys))
            files_gone[name] = f.keys[0]
            watched = frozenset((sl.pid, tracked[sl.pid]) for sl in ss if sl.alive and sl.pid > 0 and
                                sl.pid_ns == my_pid_ns and sl.pid in tracked)
            f.same = (state, ss, mine, watched, self._tracked_version if len(watched) == len(ss) else None) \
                if v._ufd is not None and all(sl.alive for sl in ss) and f.reader.head is not None else None
        for name in list(files):
            if name not in views:
                f = files.pop(name)
                self._files_version += 1
                f.close()
                if self.inotify is not None:
                    self.inotify.unwatch(name)
                self._buckets[f.index % SWEEP_LOOKS].discard(name)
                for key in f.keys[1]:
                    pslot_of.pop(key, None)
                self._attention.discard(name)
                self._shared_of.pop(name, None)
                self._note_held(name, ())
        for name in [n for n in self._read_problems if n not in views]:
            del self._read_problems[name]
        problems.update(self._read_problems)
        slots, table, slot_of = dict(pslots), dict(ptable), pslot_of

        # attribution
        key = (len(files), self._files_version)
        if self._by_inode is None or self._by_inode[0] != key:
            self._by_inode = (key, {f.usage_inode: name for name, f in files.items() if f.usage_inode},
                              {f.identity_inode: name for name, f in files.items() if f.identity_inode},
                              {f.pod_uid: name for name, f in files.items() if f.pod_uid})
        by_usage, by_identity = self._by_inode[1], self._by_inode[2]
        extra = self.pod_uids() or {}
        pods = self._by_inode[3]
        if extra:
            pods = dict(pods)
            for name, uids in extra.items():
                for uid in uids or ():
                    pods[uid] = name
        gpu_pids = sorted({p for procs in per_device.values() for p in procs})
        for pid in gpu_pids:
            t = tracked.get(pid) or self.track(pid)
            if t.visible and (t.usage is None or not t.usage and now - t.usage_at >= RECHECK_S):
                self._usage_of(t, by_usage, now)
        for sl in newly:             # found without NVML: their end is seen at once
            if sl.pid in tracked:
                continue
            t = self.track(sl.pid)
            if t.visible and t.start == sl.start_ticks:
                self._usage_of(t, by_usage, now)
            else:                    # another process has that pid now, or none: not the slot's
                self._drop(t)
                not_slots[sl.pid] = sl.start_ticks
        if len(not_slots) > 4096:
            not_slots.clear()
        groups = self._groups(by_identity)
        key = (self._version, self._files_version, tuple(sorted((n, tuple(u or ())) for n, u in extra.items())),
               id(groups))
        cache = self._attr_cache[1] if self._attr_cache[0] == key else {}
        attribution = {}
        for pid in gpu_pids:
            a = cache.get(pid)
            if a is None:
                a = self._attribute(tracked.get(pid), by_identity, pods, groups)
            attribution[pid] = a
        self._attr_cache = (key, attribution)
        # a pid that is gone, whose memory a live process keeps: a held slot records it.  And a
        # pid reused by a live process while such a slot still names it: NVML's figure under
        # it may be the earlier process's memory (nvml.py sums one pid's rows)
        held_of, reused_of, pid_slices = {}, {}, self._pid_slices
        for pid in gpu_pids:
            if pid not in pid_slices:
                continue
            a, t = attribution[pid], tracked.get(pid)
            naming = [(n, sl) for n in sorted(pid_slices[pid]) for sl in slots.get(n, ())
                      if sl.alive and sl.pid_ns == my_pid_ns and (sl.exporter if sl.shared else sl.pid) == pid]
            found = None
            if a.state in ("unknown", "unsliced"):
                found = self._held(pid, t, naming)
            if found is None and t is not None and t.visible:
                found = self._reused(pid, t, a, naming)
            if found is not None:
                if not held_of and not reused_of:  # (not in the cache: its slots change without a version)
                    attribution = dict(attribution)
                attribution[pid], earlier = found
                if attribution[pid].method == "held-slot":
                    held_of[pid] = earlier
                elif earlier:
                    reused_of[pid] = earlier

        # the driver's figures per slice and device.  A process whose figures, attribution and
        # slice files are as they were at the last look keeps its row from then
        rows, active = [], {}
        before, kept = self._rows, {}
        for place, procs in per_device.items():
            u = util.get(place)      # None: NVML cannot say (a MIG device)
            pd = place.device
            for pid, used in sorted(procs.items()):
                a = attribution[pid]
                t = tracked.get(pid)
                uv = None if u is None else u.get(pid, 0)
                f = files.get(a.slice) if a.state == "sliced" else None
                same = f.same if f is not None else None
                c = before.get((place, pid))
                if c is not None and same is not None and c[4] is same and c[0] == used and c[1] == uv and \
                        c[2] is a and c[3] is t:
                    row, d = c[5], c[6]
                    kept[(place, pid)] = c
                    rows.append(row)
                    sd = table.get((a.slice, d))
                    if sd is None:
                        sd = table[(a.slice, d)] = SliceDevice(a.slice, d, 0, 0, 0, 0, None if u is None else 0, 0,
                                                               st, place=place)
                    elif sd.shared:
                        sd = table[(a.slice, d)] = sd.copy()
                    active[(a.slice, d)] = sd
                    if row.context:
                        sd.context += used
                    sd.processes.append(row)
                    if sd.driver is not None:
                        sd.driver = None if used is None else sd.driver + used
                    if sd.sm_nvml is not None and uv is not None:
                        sd.sm_nvml += uv * 100
                    continue
                row = ProcRow(pid, pd, used, uv, a, comm=t.comm if t and t.visible else None, place=place)
                rows.append(row)
                hs = held_of.get(pid) if a.method == "held-slot" else None
                if a.state != "sliced":
                    continue
                d = f.by_place.get(place) if f is not None and f.by_place is not None else None
                if d is None:        # a place the slice was not given: a GPU its quota denies, another MIG device
                    d = place.gpu if place.mig is None and (f is None or f.view.mig is None) else place.label
                sd = table.get((a.slice, d))
                if sd is None:       # a process of a slice on a device the slice was not given
                    sd = table[(a.slice, d)] = SliceDevice(a.slice, d, 0, 0, 0, 0, None if u is None else 0, 0, st,
                                                           place=place)
                elif sd.shared:      # kept from an earlier look for an idle slice: this one has processes
                    sd = table[(a.slice, d)] = sd.copy()
                active[(a.slice, d)] = sd
                keep = a.method != "usage-file"
                if hs:               # gone: what its held slots (and those of what it exported) charge
                    row.slot, row.charge = hs[0].slot, sum(x.charges.get(d, 0) for x in hs)
                    row.comm = row.comm or hs[0].comm
                elif t is not None and t.visible and a.method == "usage-file":
                    sl = slot_of.get((a.slice, t.pid_ns, t.inner)) or slot_of.get((a.slice, 0, t.inner))
                    if sl is not None and (not sl.start_ticks or sl.start_ticks == t.start):
                        keep = True
                        row.slot, row.charge = sl.slot, sl.charges.get(d, 0)
                        sh = self._shared_of.get(a.slice)
                        # memory it exported, in shared slots (NVML lists it under the exporter),
                        # and an earlier process's under its pid, in slots its slice still holds
                        others = list(sh.get((sl.pid_ns, t.inner), ()) if sh else ()) + reused_of.get(pid, [])
                        if others:
                            row.charge += sum(x.charges.get(d, 0) for x in others)
                            row.other_slots = tuple(x.slot for x in others)
                        if row.charge:
                            t.charged.add(d)
                        elif d not in t.charged and used is not None and used <= st.context_allowance:
                            row.context = True
                            sd.context += used
                    elif a.slice in files:     # its slot's record may be newer than what was read
                        files[a.slice].want_full = True
                if keep and same is not None:
                    kept[(place, pid)] = (used, uv, a, t, same, row, d)
                sd.processes.append(row)
                if sd.driver is not None:
                    sd.driver = None if used is None else sd.driver + used
                if sd.sm_nvml is not None and uv is not None:
                    sd.sm_nvml += uv * 100
        self._rows = kept
        self._active = {r.attribution.slice for r in rows if r.attribution.slice}
        snap = Snapshot(now, ok, note, {p.device: why for p, why in errors.items()}, table, rows, slots, problems)
        snap.dead = dead
        snap.places = list(per_device)
        snap.active = active
        return snap

    def confirm_gap(self, sd):
        """A gap a snapshot shows for slice device `sd`, looked at again with its usage file
        read just before and just after the driver: (driver, memory.current, context,
        {host pid: its own gap}) from a look in which no charge of the slice moved (the
        shim moves a slot's sequence after each change of its charge, and charges before
        it allocates, uncharges after it frees: a charge that held still over the look
        covers what an honest process held at any moment of it).  None when every one of
        CONFIRM_TRIES looks saw a charge move (the slice is allocating and freeing: no
        evidence either way this time) or NVML could not be read again.  The snapshot's own
        look reads the driver first and the usage files after: a free in between looks
        like memory the shim did not count.  Where the slice has no charges that could
        move (a device it was not given, its usage file unreadable), the snapshot's figures
        stand."""
        f = self.files.get(sd.name)
        place = sd.place
        if f is None or f.view._ufd is None or place is None or not isinstance(sd.device, int) or \
                not 0 <= sd.device < slices.MAX_DEVICES:
            return sd.driver, sd.memory_current, sd.context, {p.host_pid: p.gap for p in sd.processes}
        fd, at = f.view._ufd, _CHARGE_AT + sd.device * _ROW.size

        def usage():
            seq = os.pread(fd, _SEQ_SIZE, _SEQ_AT)
            row = os.pread(fd, _ROW.size, at)
            if len(seq) != _SEQ_SIZE or len(row) != _ROW.size:
                raise slices.BadFile("usage file cut short")
            return seq, row

        try:
            for _ in range(CONFIRM_TRIES):
                before = usage()
                listed = self._place_processes(place)
                after = usage()
                if before == after:
                    break
            else:
                return None
        except Exception:    # the file or the driver gone meanwhile: judged at the next look
            return None
        row = _ROW.unpack(after[1])
        driver = context = 0
        gaps = {}
        for p in sd.processes:
            used = listed.get(p.host_pid) or 0
            driver += used
            if p.context:
                context += used
                continue
            charge = (p.charge or 0) if p.slot is None else row[p.slot] + sum(row[x] for x in p.other_slots)
            gaps[p.host_pid] = used - charge
        return driver, sum(row), context, gaps

    def slot_lock_holders(self, sd, slot_numbers):
        """Host pids among the slice device's processes that hold the lock of one of these
        slots of its usage file (/proc/<pid>/fdinfo lists the OFD locks each descriptor
        holds: the file's inode and the locked byte, LOCK_BASE + slot)."""
        f = self.files.get(sd.name)
        if f is None or f.usage_inode is None:
            return []
        ino, wanted = f.usage_inode[1], {slices.LOCK_BASE + n for n in slot_numbers}
        holders = []
        for p in sd.processes:
            try:
                fds = os.listdir(f"/proc/{p.host_pid}/fdinfo")
            except OSError:
                continue
            for fd in fds:
                try:
                    with open(f"/proc/{p.host_pid}/fdinfo/{fd}") as info:
                        text = info.read()
                except OSError:
                    continue
                if any(_lock_start(line, ino) in wanted for line in text.splitlines() if line.startswith("lock:")):
                    holders.append(p.host_pid)
                    break
        return holders

    def _place_processes(self, place):
        """{host pid: bytes} NVML lists on one place now."""
        if place.mig is None:
            return self.nvml.running_processes(place.gpu)
        listed = self._migs.get(place.gpu)
        m = next((m for m in (listed[1] if listed else ()) if m.uuid == place.mig), None)
        if m is None:
            raise LookupError(f"MIG device {place.mig} not listed")
        return self.nvml.mig_processes(m)

    def _note_held(self, name, pids):
        """The pids the slice's live slots of our pid namespace name now (for _held)."""
        old = self._held_pids.pop(name, ())
        new = frozenset(p for p in pids if p > 0)
        if new:
            self._held_pids[name] = new
        for pid in old:
            if pid not in new:
                names = self._pid_slices.get(pid)
                if names is not None:
                    names.discard(name)
                    if not names:
                        del self._pid_slices[pid]
        for pid in new:
            self._pid_slices.setdefault(pid, set()).add(name)

    def _held(self, pid, t, found):
        """(Attribution, [Slot]) of an NVML pid that is gone here (or a zombie: dead, not yet
        waited for) whose memory held slots keep -- its own slot, held by a child that
        inherited the lock, or shared slots of memory it exported, held by an importer --
        or None when the pid is a live process (then the attribution it has stands)."""
        if t is not None and t.visible:
            if procfs.state(pid) not in ("Z", "X"):
                return None
            start = t.start
        elif procfs.exists(pid):
            return None      # there, but not readable from here: as it was
        else:
            start = None
        # a zombie's own slot only if it started when the slot says (a shared slot records no start)
        found = [(n, sl) for n, sl in found if sl.shared or start is None or sl.start_ticks in (0, start)]
        names = sorted({n for n, _ in found})
        if not names:
            return None
        if len(names) > 1:
            return Attribution(state="ambiguous", note="gone; held slots of several slices name it",
                               candidates=tuple(names)), None
        own = [sl for _, sl in found if not sl.shared]
        note = ("gone; its slot is held by a process that inherited it (a forked child)" if own else
                "gone; memory it exported is held by another process (an importer)")
        return Attribution(names[0], "held-slot", "sliced", note), own + [sl for _, sl in found if sl.shared]

    def _reused(self, pid, t, a, naming):
        """(Attribution, [Slot]) of a live process whose pid live slots also name for an
        earlier process (another start: it ended, and a child or importer keeps its memory,
        which NVML lists under the pid the live process has now), or None when none do.  In
        its own slice those slots' charges count as its own (the slice's figure is right
        either way); a slot of another slice makes the figure no one's to judge: ambiguous,
        never acted on, rather than the live process's."""
        # (a shared slot records no start: its exporter is another process only when it is
        # of another slice)
        earlier = [(n, sl) for n, sl in naming if (n != a.slice if sl.shared else sl.start_ticks not in (0, t.start))]
        if not earlier:
            return None
        names = sorted({n for n, _ in earlier})
        if a.state == "sliced" and names == [a.slice]:     # (none shared: those are of another slice)
            return Attribution(a.slice, a.method, "sliced", "its pid was an ended process's, whose memory its "
                               "slice still holds: that counts as its own", reused=True), [sl for _, sl in earlier]
        return Attribution(state="ambiguous", note="its pid was an ended process's, whose memory slice "
                           f"{', '.join(n for n in names if n != a.slice)} still holds: NVML's figure under it is "
                           "not its own alone", candidates=tuple(sorted(set(names) | ({a.slice} - {None}))),
                           reused=True), []

    def _groups(self, by_identity):
        """{("cgroup", path) | ("pid_ns", inode): {slice}} over processes attributed by the
        kernel that live in a container (their own mount or pid namespace)."""
        key = (self._version, self._files_version)   # (by_identity is made from the files)
        if self._groups_cache is not None and self._groups_cache[0] == key:
            return self._groups_cache[1]
        groups = collections.defaultdict(set)
        for t in self.tracked.values():
            if not t.visible or (t.mnt_ns == self.my_mnt_ns and t.pid_ns == self.my_pid_ns):
                continue
            names = set(t.usage or ()) | ({by_identity[t.identity]} if t.identity in by_identity else set())
            if len(names) != 1:
                continue
            if t.cgroup and t.cgroup != "/":
                groups[("cgroup", t.cgroup)] |= names
            if t.pid_ns and t.pid_ns != self.my_pid_ns:
                groups[("pid_ns", t.pid_ns)] |= names
        self._groups_cache = (key, groups)
        return groups

    def _attribute(self, t, by_identity, pods, groups) -> Attribution:
        if t is None or not t.visible:
            return Attribution(state="unknown", note="not visible from here (another pid namespace?)")
        if t.usage and len(t.usage) > 1:
            return Attribution(state="ambiguous", note="maps the usage files of several slices",
                               candidates=tuple(sorted(t.usage)))
        if t.usage:
            (name,) = t.usage
            ident = by_identity.get(t.identity)
            note = f"its container was given slice {ident}" if ident and ident != name else None
            return Attribution(name, "usage-file", "sliced", note)
        if t.identity in by_identity:
            return Attribution(by_identity[t.identity], "identity-file", "sliced")
        if t.cgroup:
            hits = {name for uid, name in pods.items() if uid in t.cgroup or uid.replace("-", "_") in t.cgroup}
            if len(hits) == 1:
                return Attribution(hits.pop(), "pod", "sliced")
            if len(hits) > 1:
                return Attribution(state="ambiguous", note="its cgroup names pods of several slices",
                                   candidates=tuple(sorted(hits)))
        for key, method in ((("cgroup", t.cgroup), "cgroup"), (("pid_ns", t.pid_ns), "pid-namespace")):
            names = groups.get(key)
            if names and len(names) == 1:
                return Attribution(next(iter(names)), method, "sliced")
            if names:
                return Attribution(state="ambiguous", note=f"its {method} holds processes of several slices",
                                   candidates=tuple(sorted(names)))
        if not t.maps_ok:
            return Attribution(state="unknown", note="its memory maps cannot be read here (CAP_SYS_PTRACE?)")
        return Attribution(state="unsliced")

    def close(self):
        for t in list(self.tracked.values()):
            self._drop(t)
        for f in self.files.values():
            f.close()
        if self.inotify is not None:
            self.poller.unregister(self.inotify.fd)
            self.inotify.close()
            self.inotify = None
        self.poller.close()


# === judging ===

@dataclass
class Violation:
    kind: str
    key: tuple               # what it is about: (slice, device) or ("", host pid, start)
    container: str
    device: int
    since: float             # monotonic time the condition was first seen
    started: float = None    # when it became a violation (after the grace period / window)
    detail: dict = field(default_factory=dict)
    offenders: list = field(default_factory=list)   # [(host pid, start ticks)]
    action: str = "report"
    acted: bool = False
    wall: float = None

    def to_json(self):
        return {"kind": self.kind, "container": self.container or None, "device": self.device,
                "since": round(self.wall, 3) if self.wall else None, "action": self.action,
                "offenders": [p for p, _ in self.offenders], **self.detail}


def _utc(t=None):
    t = time.time() if t is None else t
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


class _Ring:
    """A window of (t, NVML share, charged share) samples with their running sums (the
    agent judges 1,000 slices a second: no sum over the window each time)."""
    __slots__ = ("q", "nv", "ch")

    def __init__(self):
        self.q = collections.deque()
        self.nv = self.ch = 0.0

    def add(self, t, nv, ch, window):
        q = self.q
        q.append((t, nv, ch))
        self.nv += nv
        self.ch += ch
        while q and t - q[0][0] > window:
            _, a, b = q.popleft()
            self.nv -= a
            self.ch -= b
        if len(q) == 1:          # (no drift carried from one window to the next)
            self.nv, self.ch = float(nv), float(ch)

    def full(self, window) -> bool:
        q = self.q
        return len(q) >= 2 and q[-1][0] - q[0][0] >= window * 0.9

    def means(self):
        n = len(self.q)
        return self.nv / n, self.ch / n

    def __len__(self):
        return len(self.q)


def _where(x) -> dict:
    """Where NVML lists a SliceDevice's or ProcRow's device: nvml_device (its label) and,
    on a MIG device, mig_uuid."""
    p = x.place
    if p is None:
        return {}
    return {"nvml_device": p.label} if p.mig is None else {"nvml_device": p.label, "mig_uuid": p.mig}


class Judge:
    """Conditions seen in snapshots become violations when they last: memory and
    unsliced ones for the grace period, compute ones on average over the window."""

    def __init__(self, settings):
        self.settings = settings
        self.pending = {}        # (kind, key) -> Violation (condition seen, not yet a violation)
        self.active = {}         # (kind, key) -> Violation
        self.compute = collections.defaultdict(_Ring)   # (slice, device) -> its window of (t, nvml, charged)
        self._gpu = {}           # (slice, device) -> (t, gpu_time_ns)
        self.counts = collections.Counter()   # (container, kind) -> violations started
        # (slice device) -> a bracketed look (Observer.confirm_gap), or None: the snapshot's
        # figures are taken as they are (status and metrics report; only the agent acts)
        self.confirm = None
        # (slice device, slot numbers) -> host pids of its processes holding those slots'
        # locks (Observer.slot_lock_holders); None: none are looked for
        self.lock_holders = None
        self.unjudged = collections.Counter()   # (container, device) -> gaps left unjudged: charges moving

    def conditions(self, snap: Snapshot) -> dict:
        """(kind, key) -> (container, device, detail, offenders) true in this snapshot."""
        st = self.settings
        out = {}
        compute, gpu = self.compute, self._gpu
        # a slice with nothing on the GPU: nothing the driver could say against it
        for key in [k for k in gpu if k not in snap.active]:
            del gpu[key]
            compute.pop(key, None)
        threshold = st.tolerance + st.process_overhead
        for key, sd in snap.active.items():
            forged = [sl for sl in snap.slots.get(sd.name, ()) if sl.charges.get(sd.device, 0) >= FORGED_CHARGE]
            if forged or sd.memory_current >= 1 << 64:
                # a charge no device can hold, or a row that sums past 2^64 (a "negative"
                # charge making room): the shim refuses to admit against it; the offender is
                # whoever of the slice holds the forged slots' locks (it wrote them)
                holders = self.lock_holders(sd, [sl.slot for sl in forged]) if self.lock_holders and forged else []
                out[("forged", key)] = (sd.name, sd.device, {
                    "memory_current": sd.memory_current, "slots": [
                        {"slot": sl.slot, "pid": sl.pid, "charge": sl.charges[sd.device], "alive": sl.alive}
                        for sl in forged], **_where(sd)},
                    [(p.host_pid, p) for p in sd.processes if p.host_pid in holders and p.attribution.certain])
                continue
            if sd.driver is not None:
                gap = sd.driver - sd.memory_current - sd.context
                if gap > st.tolerance:           # (the least any tolerance is: only then worth the rest)
                    tol = sd.tolerance
                    own_gap = {p.host_pid: p.gap for p in sd.processes}
                    driver, current = sd.driver, sd.memory_current
                    if gap > tol and self.confirm is not None:
                        fresh = self.confirm(sd)
                        if fresh is None:
                            self.unjudged[(sd.name, sd.device)] += 1
                            gap = 0
                        else:
                            driver, current, context, own_gap = fresh
                            gap = driver - current - context
                    if gap > tol:
                        detail = {"memory_driver": driver, "memory_current": current,
                                  "memory_max": None if sd.memory_max == UNLIMITED else sd.memory_max,
                                  "tolerance": tol, "gap": gap, **_where(sd)}
                        offenders = [(p.host_pid, p) for p in sd.processes if p.attribution.certain and
                                     own_gap.get(p.host_pid) is not None and own_gap[p.host_pid] > threshold]
                        gone = [p.host_pid for p in sd.processes if p.attribution.method == "held-slot" and
                                p.gap is not None and p.gap > threshold]
                        if gone:     # above their slots' charge, but gone: nothing to act on
                            detail["gone"] = gone
                        out[("gap", key)] = (sd.name, sd.device, detail, offenders)
                        if sd.memory_max != UNLIMITED and driver > sd.memory_max + tol:
                            out[("over-cap", key)] = (sd.name, sd.device, detail, offenders)
            if sd.sm_nvml is None or sd.sm_max >= SHARE_FULL:
                if key in compute:
                    del compute[key]
                    gpu.pop(key, None)
                continue
            prev = gpu.get(key)
            gpu[key] = (snap.t, sd.gpu_time_ns)
            if prev is None or snap.t <= prev[0]:
                continue
            charged = max(0, sd.gpu_time_ns - prev[1]) / ((snap.t - prev[0]) * 1e9) * SHARE_FULL
            ring = compute[key]
            ring.add(snap.t, sd.sm_nvml, charged, st.window)
            if ring.full(st.window):
                nv, ch = ring.means()
                if nv - sd.sm_max > st.compute_margin and nv - ch > st.compute_margin:
                    busy = [p for p in sd.processes if p.util and p.attribution.certain]
                    unpaced = [p for p in busy if p.attribution.method != "usage-file"] or busy
                    out[("compute", key)] = (sd.name, sd.device, {"sm_max": sd.sm_max, "sm_nvml": round(nv),
                                                                  "sm_charged": round(ch), "window_s": st.window,
                                                                  **_where(sd)},
                                             [(p.host_pid, p) for p in unpaced])
        for key in [k for k in compute if k not in snap.active]:
            del compute[key]
        if st.require_slices:
            for p in snap.processes:
                if p.attribution.state == "unsliced":
                    key = ("", p.host_pid, p.device)
                    out[("unsliced", key)] = ("", p.device, {"host_pid": p.host_pid, "memory_driver": p.driver,
                                                             "comm": p.comm, **_where(p)}, [(p.host_pid, p)])
        return out

    def next_due(self):
        """When a pending memory or unsliced condition is due to be looked at again (it
        becomes a violation then, if it still holds), or None."""
        due = [v.since + self.settings.grace for v in self.pending.values() if v.kind != "compute"]
        return min(due) if due else None

    def update(self, snap: Snapshot, observer, held=lambda key: False) -> tuple:
        """(started, ended): violations that began and ended with this snapshot.  A held
        one (`stop`: its condition is gone because the agent holds it) stays active."""
        now = snap.t
        seen = self.conditions(snap)
        started, ended = [], []
        for k, (name, d, detail, offenders) in seen.items():
            kind = k[0]
            v = self.active.get(k) or self.pending.get(k)
            if v is None:
                v = self.pending[k] = Violation(kind, k[1], name, d, now, wall=time.time())
            v.detail = detail
            v.offenders = [(pid, observer.tracked[pid].start) for pid, _ in offenders
                           if pid in observer.tracked and observer.tracked[pid].visible]
            if k in self.pending:
                # (a hair of slack: two looks a grace period apart are never quite that far apart)
                due = now - v.since >= (0 if kind == "compute" else self.settings.grace - SLACK_S)
                if due:
                    del self.pending[k]
                    v.started = now
                    v.action = self.settings.action(kind)
                    self.active[k] = v
                    self.counts[(name, kind)] += 1
                    started.append(v)
        for k in list(self.pending):
            if k not in seen:
                del self.pending[k]
        for k in list(self.active):
            if k not in seen and not held(k):
                ended.append(self.active.pop(k))
        return started, ended


# === acting ===

def _signal(pidfd, sig):
    signal.pidfd_send_signal(pidfd, sig)


class Holder(threading.Thread):
    """`stop`: duty-cycles compute hogs from outside, SIGSTOP/SIGCONT, to their share.
    Every PERIOD each held group runs for duty x PERIOD and is stopped for the rest; the
    agent moves each duty every interval toward the share NVML measures.  Processes are
    always continued when released and when the agent stops."""
    PERIOD = 0.1
    GAIN = 0.8

    def __init__(self, log):
        super().__init__(name="vgpu-holder", daemon=True)
        self.log = log
        self.groups = {}         # key -> {"pidfds": {pid: (pidfd, start)}, "duty", "target", "full_since"}
        self.lock = threading.Lock()
        self.halt = threading.Event()

    def hold(self, key, procs, target, measured):
        """Hold `procs` [(pid, start)] to `target` (1/100 percent of the GPU)."""
        with self.lock:
            g = self.groups.get(key)
            if g is None:
                g = self.groups[key] = {"pidfds": {}, "duty": max(0.05, min(1.0, target / max(measured, 1))),
                                        "target": target, "full_since": None}
            for pid, start in procs:
                if pid in g["pidfds"]:
                    continue
                try:
                    fd = os.pidfd_open(pid)
                except OSError:
                    continue
                if procfs.start_ticks(pid) != start:
                    os.close(fd)
                    continue
                g["pidfds"][pid] = (fd, start)
            g["target"] = target

    def steer(self, key, measured, now):
        """Move a group's duty toward its target from its share NVML measured; True while
        it still needs holding (released after a whole window at full duty)."""
        with self.lock:
            g = self.groups.get(key)
            if g is None:
                return False
            err = (g["target"] - measured) / SHARE_FULL
            g["duty"] = min(1.0, max(0.02, g["duty"] + self.GAIN * err))
            g["full_since"] = (g["full_since"] or now) if g["duty"] >= 1.0 else None
            return True

    def held_pids(self):
        with self.lock:
            return [(pid, start) for g in self.groups.values() for pid, (_, start) in g["pidfds"].items()]

    def release(self, key):
        with self.lock:
            g = self.groups.pop(key, None)
        if g:
            for pid, (fd, _) in g["pidfds"].items():
                try:
                    _signal(fd, signal.SIGCONT)
                except OSError:
                    pass
                os.close(fd)

    def release_all(self):
        for key in list(self.groups):
            self.release(key)

    def run(self):
        while not self.halt.is_set():
            t0 = time.monotonic()
            with self.lock:
                plan = sorted((g["duty"], list(g["pidfds"].values())) for g in self.groups.values())
            if not plan:
                self.halt.wait(self.PERIOD)
                continue
            for _, fds in plan:
                for fd, _ in fds:
                    try:
                        _signal(fd, signal.SIGCONT)
                    except OSError:
                        pass
            for duty, fds in plan:
                if duty >= 1.0:
                    continue
                self.halt.wait(max(0.0, t0 + duty * self.PERIOD - time.monotonic()))
                for fd, _ in fds:
                    try:
                        _signal(fd, signal.SIGSTOP)
                    except OSError:
                        pass
            self.halt.wait(max(0.0, t0 + self.PERIOD - time.monotonic()))
        self.release_all()


# === the agent ===

class Agent:
    """The node agent: observe, reap, judge, act, every interval; a dead process's slot
    is reaped as soon as its pidfd says it ended."""

    def __init__(self, directory=None, settings=None, interval=1.0, use_nvml=True, log=None, autoscaler=None,
                 nvml_module=None, pod_uids=None, on_violation=None, on_action=None, reap=True):
        from .autoscale import NodeReader
        self.directory = slices.node_dir(directory)
        self.settings = settings or Settings()
        self.interval = interval
        self.log_line = log or (lambda line: print(line, flush=True))
        self.autoscaler = autoscaler
        reader = autoscaler.reader if autoscaler is not None else NodeReader(self.directory)
        if autoscaler is not None:   # its SM use of unpaced slices: this agent's attribution, not its own
            autoscaler.sm_source = self._sm_of
        self.observer = Observer(self.directory, reader, use_nvml, self.settings, nvml_module, pod_uids)
        self.judge = Judge(self.settings)
        self.judge.confirm = self.observer.confirm_gap
        self.judge.lock_holders = self.observer.slot_lock_holders
        self.holder = Holder(self.log)
        self.on_violation = on_violation or (lambda v, record: None)
        self.on_action = on_action or (lambda container, kind, action, pid, result: None)
        self.reap_enabled = reap
        self.latest = None
        self.iterations = 0
        self.last_iteration_cpu_s = 0.0
        self.reaped_total = 0
        self.actions_total = collections.Counter()    # (kind, action) -> n
        self._orphans_at = -1e9
        self._orphan_seen = {}   # slice -> when its owner was first seen gone
        self._state_at = -1e9
        self._state_written = None
        self._nvml_note = None
        self._acted = set()      # (pid, start) already killed
        self._held_seen = set()  # (slice, host pid) of the gone processes attributed by a held slot
        self._reused_seen = set()  # (host pid, state, candidates) of processes whose pid a held slot names
        self._soon = {}          # slice -> [monotonic times it is looked at again] (after inotify events)
        self._joined = {}        # slice -> when a process last opened its usage file

    def _sm_of(self, name, device):
        snap = self.latest
        sd = snap.slices.get((name, device)) if snap is not None else None
        return None if sd is None else sd.sm_nvml

    def log(self, event, **fields):
        rec = {"ts": _utc(), "event": event, **{k: v for k, v in fields.items() if v is not None}}
        self.log_line(json.dumps(rec, separators=(",", ":")))

    # --- one iteration ---

    def tick(self, now=None):
        t0 = time.process_time()
        now = time.monotonic() if now is None else now
        snap = self.observer.observe(now)
        if snap.nvml_ok != (self._nvml_note is None) or (not snap.nvml_ok and snap.nvml_note != self._nvml_note):
            if snap.nvml_ok:
                self.log("nvml", available=True)
            else:
                self.log("nvml", available=False, note=snap.nvml_note,
                         effect="driver figures unknown: nothing judged against the driver, nothing acted on")
            self._nvml_note = None if snap.nvml_ok else snap.nvml_note
        if self.reap_enabled:
            self._reap(snap)
        self._log_held(snap)
        started, ended = self.judge.update(snap, self.observer, held=lambda k: k in self.holder.groups)
        for v in started:
            self._started(v, snap)
        for v in ended:
            if v.action == "stop":
                self.holder.release(("compute", v.key))
            self.log("violation-end", kind=v.kind, container=v.container or None, device=v.device,
                     lasted_s=round(now - v.started, 3))
        self._steer(snap, now)
        if now - self._orphans_at >= ORPHAN_S:
            self._orphans_at = now
            self._orphans(snap, now)
        self.latest = snap
        self.iterations += 1
        self._write_state(now)
        if self.autoscaler is not None:
            self.autoscaler.tick(now)
        self.last_iteration_cpu_s = time.process_time() - t0
        return snap

    def _log_held(self, snap):
        """One line for each gone process NVML still lists whose memory a held slot keeps,
        as it is first attributed that way."""
        seen = set()
        for p in snap.processes:
            if p.attribution.method != "held-slot":
                continue
            key = (p.attribution.slice, p.host_pid)
            if key not in self._held_seen and key not in seen:
                self.log("held-slot", container=p.attribution.slice, device=p.device, pid=p.host_pid,
                         memory_driver=p.driver, slot=p.slot, memory_charged=p.charge,
                         note=f"{p.attribution.note}: its memory counts in the slice; never acted on")
            seen.add(key)
        self._held_seen = seen
        seen = set()
        for p in snap.processes:
            a = p.attribution
            if not a.reused:
                continue
            key = (p.host_pid, a.state, a.candidates)
            if key not in self._reused_seen:
                self.log("pid-reused", container=a.slice, candidates=list(a.candidates) or None, state=a.state,
                         device=p.device, pid=p.host_pid, memory_driver=p.driver, memory_charged=p.charge,
                         note=a.note + ("; never acted on" if a.state == "ambiguous" else ""))
            seen.add(key)
        self._reused_seen = seen

    def _reap(self, snap):
        for name in snap.dead:
            self.reap(name)

    def reap(self, name, recheck=False):
        """Reap the slice's dead slots (recheck: and watch its new processes, see
        Observer.recheck); True while the slice is worth looking at again soon."""
        try:
            if recheck:
                recs, unsure = self.observer.recheck(name)
            else:
                recs, unsure = self.observer.reap(name), False
            self._log_reaped(name, recs)
            return unsure
        except slices.NotFound:
            pass
        except (slices.VgpuError, OSError) as e:
            self.log("error", container=name, error=f"reap: {e}")
        return False

    def _log_reaped(self, name, recs):
        for rec in recs:
            self.reaped_total += 1
            self.log("reaped", container=name, slot=rec["slot"], pid=rec["pid"], comm=rec["comm"],
                     memory=rec["memory"])

    def _started(self, v, snap):
        record = {"kind": v.kind, "container": v.container or None, "device": v.device, "action": v.action,
                  **v.detail, "offenders": [pid for pid, _ in v.offenders],
                  "processes": [p.to_json() for p in (snap.slices[v.key].processes if v.key in snap.slices else [])]}
        self.log("violation", **record)
        self.on_violation(v, record)
        if v.action == "kill":
            self._kill(v)
        elif v.action == "stop":
            sd = snap.slices.get(v.key)
            if sd is not None and v.offenders:
                self.holder.hold(("compute", v.key), v.offenders, sd.sm_max, sd.sm_nvml or 0)
                if not self.holder.is_alive():
                    self.holder.start()
                for pid, _ in v.offenders:
                    self.actions_total[(v.kind, "stop")] += 1
                    self.log("action", action="stop", kind=v.kind, container=v.container, device=v.device, pid=pid,
                             result="held to its share with SIGSTOP/SIGCONT", target=sd.sm_max)
                    self.on_action(v.container, v.kind, "stop", pid, f"held to its share ({sd.sm_max / 100:g}%)")
            else:
                self.log("action", action="stop", kind=v.kind, container=v.container, device=v.device,
                         result="no process the agent is sure of: reported only")

    def _kill(self, v):
        for pid in v.detail.get("gone", ()):
            self.log("action", action="kill", kind=v.kind, container=v.container or None, device=v.device, pid=pid,
                     result="not killed: the process is gone (its memory is kept by a process that holds its slot)")
        if not v.offenders:
            self.log("action", action="kill", kind=v.kind, container=v.container or None, device=v.device,
                     result="no process the agent is sure of: reported only")
            return
        for pid, start in v.offenders:
            if (pid, start) in self._acted:
                continue
            result = self._kill_one(v, pid, start)
            self._acted.add((pid, start))
            self.actions_total[(v.kind, "kill")] += result == "killed"
            self.log("action", action="kill", kind=v.kind, container=v.container or None, device=v.device, pid=pid,
                     result=result)
            self.on_action(v.container, v.kind, "kill", pid, result)

    def _kill_one(self, v, pid, start):
        """SIGKILL through a pidfd, after checking once more that it is the same process and
        still where the agent put it."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return "gone"
        try:
            if procfs.start_ticks(pid) != start:
                return "gone (its pid is another process now): not killed"
            t = Tracked(pid)
            try:
                obs = self.observer
                by_usage = {f.usage_inode: name for name, f in obs.files.items() if f.usage_inode}
                by_identity = {f.identity_inode: name for name, f in obs.files.items() if f.identity_inode}
                if t.visible:
                    obs._usage_of(t, by_usage, time.monotonic())
                a = obs._attribute(t, by_identity, {}, obs._groups(by_identity))
            finally:
                t.close()
            wanted = ("unsliced",) if v.kind == "unsliced" else ("sliced",)
            if a.state not in wanted or (v.kind != "unsliced" and a.slice != v.container):
                return f"not killed: no longer attributed with certainty ({a.state})"
            _signal(fd, signal.SIGKILL)
            return "killed"
        except OSError as e:
            return f"not killed: {e.strerror or e}"
        finally:
            os.close(fd)

    def _steer(self, snap, now):
        for key in list(self.holder.groups):
            _, sk = key
            sd = snap.slices.get(sk)
            if sd is None or sd.sm_nvml is None:
                continue
            g = self.holder.groups.get(key)
            held = {pid for pid in g["pidfds"]} if g else set()
            measured = sum(p.util * 100 for p in sd.processes if p.host_pid in held)
            others = sum(p.util * 100 for p in sd.processes if p.host_pid not in held)
            g["target"] = max(100, sd.sm_max - others)
            self.holder.steer(key, measured, now)
            if g["full_since"] is not None and now - g["full_since"] >= self.settings.window:
                self.holder.release(key)
                self.judge.active.pop(key, None)
                self.log("violation-end", kind="compute", container=sk[0], device=sk[1],
                         note="released: within its share without being held for a whole window")
            elif all(procfs.start_ticks(pid) != start for pid, (_, start) in g["pidfds"].items()):
                self.holder.release(key)
                self.judge.active.pop(key, None)
                self.log("violation-end", kind="compute", container=sk[0], device=sk[1],
                         note="released: the held processes ended")

    # --- orphans ---

    def _orphans(self, snap, now):
        views = self.observer.reader.views
        attributed = {p.attribution.slice for p in snap.processes if p.attribution.slice}
        for name, v in list(views.items()):
            owner = v.quota.temporary
            if owner is None:
                continue
            if owner.pid_ns != self.observer.my_pid_ns:
                continue         # made in another pid namespace: its owner cannot be judged from here
            if procfs.same_process(owner.pid, owner.start_ticks):
                self._orphan_seen.pop(name, None)
                continue
            if any(s.alive for s in snap.slots.get(name, [])) or name in attributed:
                continue         # its command still runs: when it ends
            first = self._orphan_seen.setdefault(name, now)
            if now - first < ORPHAN_S:
                continue         # `run` may be deleting it itself right now
            try:
                slices.delete(self.directory, name)
                self.log("orphan-removed", container=name, owner_pid=owner.pid,
                         reason="temporary slice of vgpu-ctl run whose owner is gone, with no process left")
            except slices.NotFound:
                pass
            except (slices.VgpuError, OSError) as e:
                self.log("error", container=name, error=f"orphan not removed: {e}")
            self._orphan_seen.pop(name, None)

    # --- state for status ---

    def state(self):
        return {"version": 1, "pid": os.getpid(), "pid_start": procfs.start_ticks(os.getpid()),
                "updated": round(time.time(), 3), "interval_s": self.interval, "settings": self.settings.to_json(),
                "violations": [v.to_json() for v in self.judge.active.values()],
                "held": [{"pid": p, "start_ticks": s} for p, s in self.holder.held_pids()],
                "violations_total": [{"container": c or None, "kind": k, "count": n}
                                     for (c, k), n in sorted(self.judge.counts.items())]}

    def _write_state(self, now, force=False):
        state = self.state()
        changed = {k: v for k, v in state.items() if k != "updated"} != self._state_written
        if not (force or changed or now - self._state_at >= max(2.0, self.interval * 2)):
            return
        self._state_at = now
        self._state_written = {k: v for k, v in state.items() if k != "updated"}
        try:
            write_state(self.directory, state)
        except FileNotFoundError:
            pass                 # no node directory (yet): nothing to report on

    # --- looping ---

    def resume_held(self):
        """Continue processes a previous agent held when it ended without releasing them."""
        old = read_state(self.directory)
        for h in (old or {}).get("held", []):
            if procfs.same_process(h.get("pid"), h.get("start_ticks")):
                try:
                    fd = os.pidfd_open(h["pid"])
                    try:
                        _signal(fd, signal.SIGCONT)
                    finally:
                        os.close(fd)
                    self.log("action", action="continue", pid=h["pid"], result="held by a previous agent: continued")
                except OSError:
                    pass

    def run(self, stop=None, once=False):
        """Look every interval until `stop` is set (once: one look, and out)."""
        stop = stop or threading.Event()
        self.resume_held()
        self.log("start", dir=self.directory, interval_s=self.interval, settings=self.settings.to_json(),
                 autoscale=self.autoscaler is not None)
        next_at = time.monotonic()
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now >= next_at:
                    try:
                        self.tick(now)
                    except Exception as e:    # one bad moment must not end the node's agent
                        self.log("error", error=f"{type(e).__name__}: {e}")
                    if once:
                        break
                    next_at += self.interval
                    if next_at < now:
                        next_at = now + self.interval
                # a condition waiting out its grace period is looked at again as it ends
                due = self.judge.next_due()
                until = next_at if due is None or due >= next_at else max(due, time.monotonic())
                if self._wait(stop, until) and until < next_at:
                    try:
                        self.tick(time.monotonic())
                    except Exception as e:
                        self.log("error", error=f"{type(e).__name__}: {e}")
        finally:
            self.holder.halt.set()
            self.holder.release_all()
            self.log("stopped")
            try:
                self._write_state(time.monotonic(), force=True)
            except OSError:
                pass

    def _wait(self, stop, until):
        """Sleep until `until`, waking at once when a tracked process ends (its slice is
        reaped then) and when a process opens or closes a usage file (the slice is looked
        at again at once and RECHECK_AFTER: a close's slot once its lock is free, a
        newcomer's to watch it through a pidfd); False when `stop` was set."""
        obs = self.observer
        soon = self._soon            # slice -> when it is looked at again, soonest first
        while not stop.is_set():
            now = time.monotonic()
            if soon:
                for name in [n for n, at in soon.items() if at[0] <= now]:
                    with obs.lock:
                        unsure = self.reap(name, recheck=True)
                    at = [x for x in soon[name] if x > now]
                    if at and (unsure or self._joined.get(name, 0) > now - RECHECK_AFTER[-1]):
                        soon[name] = at
                    else:
                        del soon[name]
                        self._joined.pop(name, None)
            left = until - now
            if left <= 0:
                return True
            if soon:
                left = min(left, max(0.0, min(at[0] for at in soon.values()) - now))
            events = obs.poller.poll(min(left, 1.0))
            if not events:
                continue
            names = set()
            now = time.monotonic()
            with obs.lock:
                if obs.inotify is not None and any(fd == obs.inotify.fd for fd, _ in events):
                    for name, mask in obs.inotify.events():
                        if mask & IN_CLOSE_WRITE:
                            names.add(name)        # a process of it ended (or let go of the file)
                        else:
                            self._joined[name] = now   # a process joined: its slot is claimed just after
                        obs._ended.add(name)       # looked at next time: a process joined or left
                        if name not in soon:
                            soon[name] = [now + x for x in RECHECK_AFTER]
                for t in obs.forget_ended(events):
                    names |= set(t.usage or ())
                for name in sorted(names):
                    self.reap(name, recheck=name in soon)
        return False


# === the state file (status reads what the agent judged) ===

def _state_path(directory):
    return os.path.join(slices.node_dir(directory), STATE_FILE)


def write_state(directory, state):
    """Rewrite the agent's state in place (not by rename: the node directory's mtime, which
    readers watch for new slices, stays put), under an exclusive flock."""
    data = (json.dumps(state, separators=(",", ":")) + "\n").encode()
    fd = os.open(_state_path(directory), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


def read_state(directory):
    """The agent's last state, or None without one (or a broken one)."""
    try:
        fd = os.open(_state_path(directory), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        data = os.read(fd, 1 << 22)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        state = json.loads(data)
    except ValueError:
        return None
    return state if isinstance(state, dict) else None


def agent_running(state, now=None) -> bool:
    """Is the agent that wrote `state` alive and current?"""
    if not state:
        return False
    now = time.time() if now is None else now
    fresh = now - state.get("updated", 0) <= max(5.0, 3 * state.get("interval_s", 1.0))
    return fresh and procfs.same_process(state.get("pid"), state.get("pid_start"))


# === for status ===

def annotate(data: dict, use_nvml=True):
    """Add the driver's view to `vgpu-ctl status`'s data: per container device
    memory_driver, per process how it was attributed; unsliced and unknown GPU processes;
    and the agent's violations (when an agent runs)."""
    obs = Observer(data["dir"], use_nvml=use_nvml and data["nvml"]["available"])
    try:
        snap = obs.observe()
    finally:
        obs.close()
    for c in data["containers"]:
        c["driver_only"] = []    # its processes the driver lists that hold no slot of its own (no shim)
        for cd in c["devices"]:
            sd = snap.slices.get((c["name"], cd["index"]))
            cd["memory_driver"] = sd.driver if sd is not None else None
            cd["nvml_device"] = sd.place.label if sd is not None and sd.place is not None else None
            cd["driver_processes"] = [p.host_pid for p in sd.processes] if sd is not None else []
            if sd is not None:
                c["driver_only"] += [p.to_json() | {"command": procfs.cmdline(p.host_pid) or p.comm}
                                     for p in sd.processes if p.slot is None]
    procs = [p.to_json() | {"command": procfs.cmdline(p.host_pid) or p.comm}
             for p in snap.processes if p.attribution.state != "sliced"]
    data["unsliced"] = [p for p in procs if p["state"] in ("unsliced", "ambiguous")]
    data["unknown"] = [p for p in procs if p["state"] == "unknown"]
    state = read_state(data["dir"])
    running = agent_running(state)
    data["agent"] = {"running": running, "pid": state.get("pid") if running else None}
    data["violations"] = state.get("violations", []) if running else None
    return data


def describe_violation(v: dict) -> str:
    what = {"over-cap": "holds more than its cap (driver)", "gap": "driver figure above the shim's",
            "unsliced": "a GPU process in no slice", "compute": "SM share above sm.max, unpaced",
            "forged": "usage file written by hand"}[v["kind"]]
    parts = [what]
    if v["kind"] == "forged":
        parts.append(", ".join(f"slot {s['slot']} charges {s['charge']}" for s in v.get("slots", ())) or
                     "charges sum past 2^64")
    if v.get("memory_driver") is not None and v["kind"] in ("over-cap", "gap"):
        parts.append(f"driver {format_memory(v['memory_driver'])}, shim {format_memory(v['memory_current'])}"
                     + (f", cap {format_memory(v['memory_max'])}" if v.get("memory_max") is not None else ""))
    if v["kind"] == "compute":
        parts.append(f"NVML {v['sm_nvml'] / 100:.0f}% vs sm.max {v['sm_max'] / 100:.0f}%")
    if v.get("offenders"):
        parts.append("pid " + ", ".join(map(str, v["offenders"])))
    parts.append(f"action {v['action']}")
    return "; ".join(parts)

