"""Reading a slice's usage file: its slots and charge rows, as the agent needs them."""
import os
import struct
from dataclasses import dataclass

from .. import slices
from .._region import ffi, lib
from .settings import RECHECK_S


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
