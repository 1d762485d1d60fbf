"""A slice's usage file, read: its layout (offsets from csrc/vgpu_region.h's binding), one
record type for a slot, one parser and one list of counters.  Whoever reads usage files --
`vgpu-ctl` (slices.read_usage, reaping), the node agent, the autoscaler, the metrics --
reads them here.

Never mapped: a container can truncate its own usage file, and touching a mapping beyond
its end is SIGBUS; every read is a pread on a descriptor, and a short one is BadFile.  The
container writes the file: what it says of its processes is a claim (vgpu.agent checks the
kernel), and a charge row that sums past 2^64 is forged, never wrapped.
"""
import os
import struct
from dataclasses import dataclass

from .._region import ffi, lib
from ..errors import BadFile
from .files import (_RO, USAGE, USAGE_SIZE, _check_regular, _fd, node_dir, _open_in, _open_node, _open_slice,
                    slot_alive)

MAX_DEVICES = lib.VGPU_MAX_DEVICES
MAX_PROCS = lib.VGPU_MAX_PROCS
SIZE = ffi.sizeof("struct vgpu_usage")
# memory_current is no field: it is the sum of the slots' charges on the device
STORED = ("memory_peak", "oom_refusals", "launches", "gpu_time_ns", "throttled_ns", "yielded_ns")
COUNTERS = ("memory_current",) + STORED

HEADER = struct.Struct("<QII")           # magic, abi_version, size
SLOTS_USED_AT = ffi.offsetof("struct vgpu_usage", "slots_used")
DEVICES_AT = ffi.offsetof("struct vgpu_usage", "devices")
DEVICE_SIZE = ffi.sizeof("struct vgpu_usage_device")
_STORED_AT = tuple(ffi.offsetof("struct vgpu_usage_device", c) for c in STORED)
assert list(_STORED_AT) == sorted(_STORED_AT), "struct vgpu_usage_device reordered"
# the stored counters of a device record in one unpack (the autoscaler reads them for every
# slice each interval): each field, with the bytes between them skipped
_STORED_FIELDS = struct.Struct("<" + "".join(f"{off - end}xQ" if off > end else "Q"
                                             for end, off in zip((0,) + tuple(a + 8 for a in _STORED_AT), _STORED_AT)))
CHARGE_AT = ffi.offsetof("struct vgpu_usage", "charge")
ROW = struct.Struct("<%dQ" % MAX_PROCS)  # one device's charges, slot by slot
PROCS_AT = ffi.offsetof("struct vgpu_usage", "procs")
PROC = struct.Struct("<iIQ32sQQQQ")       # pid, state, started_ns, comm, start_ticks, pid_ns, (unused), flags
assert PROC.size == ffi.sizeof("struct vgpu_usage_proc") and PROC.size % 4 == 0, "struct vgpu_usage_proc moved"
SEQ_AT = ffi.offsetof("struct vgpu_usage", "charge_seq")
SEQ_SIZE = 4 * MAX_PROCS
_ZERO_ROW = (0,) * MAX_PROCS
_ZERO_ROW_BYTES = bytes(ROW.size)
_NO_PROC = (0, 0, 0, b"", 0, 0, 0, 0)


def charge_offset(device, slot):
    """File offset of the bytes the process in `slot` holds on `device`."""
    return CHARGE_AT + 8 * (device * MAX_PROCS + slot)


def pid_offset(slot):
    return PROCS_AT + slot * PROC.size


def host_pid_offset(slot):
    """Where the node agent writes a slot's process's pid as NVML lists it (its `state`)."""
    return PROCS_AT + slot * PROC.size + 4


@dataclass
class Proc:
    """One used slot: the process that claimed it, or a shared slot of exported memory."""
    slot: int
    pid: int                 # as the process sees itself (its container's pid namespace)
    comm: str
    memory: dict             # device -> bytes charged
    alive: bool = False      # its lock is held (set by whoever read it)
    started_ns: int = 0      # CLOCK_REALTIME
    # what the process said of itself when it claimed the slot (0: unknown); written by
    # the container, so a hint for finding it, never proof (vgpu.agent checks the kernel)
    start_ticks: int = 0
    pid_ns: int = 0
    from_file: bool = False  # its slice came from the identity file, not the environment
    # a shared slot (VGPU_PROC_SHARED): no process, memory exported by `exporter` (its pid
    # as it saw itself, in pid_ns) and held by every process of the slice that holds it
    # (alive: one still does); pid is 0
    shared: bool = False
    exporter: int = 0
    # a process's slot in another pid namespace: its pid as NVML (and the host) sees it,
    # written by the node agent (0: not known); a hint, used only to keep a dead process's
    # slot charged while the driver still lists memory under it
    host_pid: int = 0

    @property
    def parked(self) -> bool:
        """A shared slot no process of the slice holds, still charged: the reapers leave it
        while the driver keeps its memory (a descriptor of the export open in a process that
        never touched CUDA), so it still names its exporter."""
        return self.shared and not self.alive and any(self.memory.values())

    def to_json(self):
        out = {"slot": self.slot, "pid": self.pid, "comm": self.comm, "started_ns": self.started_ns,
               "memory": {str(d): b for d, b in self.memory.items()}, "alive": self.alive,
               "pid_ns": self.pid_ns, "from_file": self.from_file}
        if self.shared:
            out.update(shared=True, exporter_pid=self.exporter)
        return out


def check_header(head, shown):
    if len(head) < HEADER.size:
        raise BadFile(f"{shown} is cut short", "its slice's processes recreate it; `vgpu-ctl delete` and "
                      "`create` resets it")
    magic, version, size = HEADER.unpack_from(head)
    if (magic, version, size) != (lib.VGPU_USAGE_MAGIC, lib.VGPU_ABI_VERSION, SIZE):
        raise BadFile(f"{shown} is not a vgpu file of ABI version {lib.VGPU_ABI_VERSION} (magic {magic:#x}, version "
                      f"{version})", "delete the slice and create it again")


def parse(head, procs, devices):
    """({device: memory.current}, {device: {stored counter: value}}, [Proc, alive unset])
    from the file's start (`head`: header, counters and at least the charge rows of
    `devices`) and the records of its first slots (`procs`).  A slot is used when its
    record names a process or a row charges it (a drain cut short)."""
    rows = {d: ROW.unpack_from(head, CHARGE_AT + d * ROW.size) for d in devices}
    current = {d: 0 if r == _ZERO_ROW else sum(r) for d, r in rows.items()}
    counters = {}
    for d in devices:
        at = DEVICES_AT + d * DEVICE_SIZE
        counters[d] = dict(zip(STORED, _STORED_FIELDS.unpack_from(head, at)))
    n = len(procs) // PROC.size
    used = _used(procs, rows.values())
    out = []
    for i in sorted(used):
        pid, state, started, comm, ticks, pns, _, flags = PROC.unpack_from(procs, i * PROC.size) if i < n \
            else _NO_PROC
        shared = not pid and bool(flags & lib.VGPU_PROC_SHARED)
        out.append(Proc(i, pid, comm.split(b"\0", 1)[0].decode(errors="replace"),
                        {d: r[i] for d, r in rows.items() if r[i]}, False, started, ticks, pns,
                        bool(flags & lib.VGPU_PROC_FROM_FILE), shared, state if shared else 0,
                        0 if shared else state))
    return current, counters, out


def _used(procs, rows):
    """The slots in use: those whose record (in `procs`, the records of the first slots)
    names a process, and those a charge row charges (a drain cut short)."""
    n = len(procs) // PROC.size
    used = {i for i, pid in enumerate(memoryview(procs)[:n * PROC.size].cast("i")[::PROC.size // 4]) if pid}
    for r in rows:
        if r != _ZERO_ROW:
            used.update(i for i, v in enumerate(r) if v)
    return used


def has_dead_slot(fd) -> bool:
    """Would a reap find work here: a used slot whose lock is free (its process gone, or
    letting go)?  One pread and a lock test per used slot through a kept descriptor, where
    a reap opens three files and parses every counter (the autoscaler asks each second for
    every slice: its reaps were 93% of its loop at 1,000 slices).  True when the file cannot
    be read whole: the reap says why."""
    try:
        data = os.pread(fd, SIZE, 0)
        if len(data) < SIZE:
            return True
        rows = [ROW.unpack_from(data, at) for at in range(CHARGE_AT, CHARGE_AT + MAX_DEVICES * ROW.size, ROW.size)
                if data[at:at + ROW.size] != _ZERO_ROW_BYTES]
        return any(not slot_alive(fd, i) for i in _used(data[PROCS_AT:PROCS_AT + MAX_PROCS * PROC.size], rows))
    except OSError:
        return True


def read_counters(fd, d):
    """Device d's counters as a tuple in COUNTERS order (memory_current modulo 2^64), from
    one pread of its record through its charge row; None when the file is cut short."""
    at = DEVICES_AT + d * DEVICE_SIZE
    row_at = charge_offset(d, 0) - at
    data = os.pread(fd, row_at + ROW.size, at)
    if len(data) != row_at + ROW.size:
        return None
    return (sum(ROW.unpack_from(data, row_at)) & 0xFFFFFFFFFFFFFFFF,) + _STORED_FIELDS.unpack_from(data)


@dataclass
class Usage:
    devices: dict        # device -> {counter: value}
    procs: list          # Proc of every used slot
    path: str
    inode: tuple         # (st_dev, st_ino): how processes that map it are found

    def to_json(self):
        return {"devices": {str(d): c for d, c in self.devices.items()},
                "processes": [p.to_json() for p in self.procs]}


def _read_usage_fd(fd, shown) -> Usage:
    _check_regular(fd, shown, USAGE_SIZE)
    st = os.fstat(fd)
    data = os.pread(fd, USAGE_SIZE, 0)     # (a copy: see the module's doc)
    if len(data) < USAGE_SIZE:
        raise BadFile(f"{shown} is truncated ({len(data)} bytes, need {USAGE_SIZE})",
                      "the slice's processes recreate it; `vgpu-ctl delete` and `create` resets it")
    check_header(data, shown)
    records = data[PROCS_AT:PROCS_AT + MAX_PROCS * PROC.size]
    current, counters, procs = parse(data, records, range(MAX_DEVICES))
    for p in procs:
        p.alive = slot_alive(fd, p.slot)
    # the container's own file: a sum past 64 bits is its scribbling, shown as such
    devices = {d: {"memory_current": current[d] & 0xFFFFFFFFFFFFFFFF, **counters[d]} for d in range(MAX_DEVICES)}
    return Usage(devices, procs, shown, (st.st_dev, st.st_ino))


def read_usage(directory, name):
    """The slice's usage, or None when no usage file exists yet."""
    with _fd(_open_node(directory, name=name)) as node_fd, _fd(_open_slice(node_fd, directory, name)) as cfd:
        return _read_slice_usage(cfd, directory, name)


def _read_slice_usage(cfd, directory, name):
    shown = os.path.join(node_dir(directory), name, USAGE)
    try:
        fd = _open_in(cfd, USAGE, _RO, shown)
    except FileNotFoundError:
        return None
    with _fd(fd):
        return _read_usage_fd(fd, shown)
