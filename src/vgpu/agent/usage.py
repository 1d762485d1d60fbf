"""A slice's usage file as the agent reads it every look: cheaply (vgpu.slices.usage parses)."""
import os

from .. import slices
from ..slices import usage
from .settings import RECHECK_S


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
        """(slots in use [usage.Proc], {device: memory.current}, {device: {counter: value}}).
        A slot is alive when its lock is held, or when known_alive(pid, pid_ns,
        start_ticks) says so (a process the caller watches through a pidfd: no lock
        query).  Raises slices.BadFile for a file cut short or of another kind (the
        container's doing)."""
        devices = tuple(devices)
        end = usage.CHARGE_AT + (max(devices) + 1 if devices else 0) * usage.ROW.size
        head = os.pread(fd, end, 0)
        if len(head) != end or usage.HEADER.unpack_from(head) != \
                (usage.lib.VGPU_USAGE_MAGIC, usage.lib.VGPU_ABI_VERSION, usage.SIZE):
            self.head = None
            raise slices.BadFile("usage file cut short or not a vgpu usage file")
        if full or head != self.head or devices != self.devices or now - self.full_at >= RECHECK_S:
            # (a slot claimed again by a new process may change only its record: `full`
            # when the caller finds a process of the slice that matches no slot)
            used = min(int.from_bytes(head[usage.SLOTS_USED_AT:usage.SLOTS_USED_AT + 4], "little"), usage.MAX_PROCS)
            procs = os.pread(fd, used * usage.PROC.size, usage.PROCS_AT) if used else b""
            if len(procs) != used * usage.PROC.size:
                self.head = None
                raise slices.BadFile("usage file cut short")
            self.full_at = now
            if head != self.head or procs != self.procs or devices != self.devices:
                self.parsed = usage.parse(head, procs, devices)
                self.head, self.procs, self.devices = head, procs, devices
        current, counters, slots = self.parsed
        for sl in slots:
            sl.alive = (known_alive is not None and sl.pid > 0 and known_alive(sl.pid, sl.pid_ns, sl.start_ticks)) \
                or slices.slot_alive(fd, sl.slot)
        return list(slots), current, counters
