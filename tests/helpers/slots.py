"""Slots written by hand into a slice's usage file, as a shim writes them."""
import os
import time

from vgpu._region import ffi
from vgpu.slices import usage


def forge_slot(fd, slot, pid, memory, start_ticks=0, pid_ns=0):
    """A slot as a shim writes it, with no lock held, charged `memory` on device 0: pwrite
    through `fd` (no close: inotify sees nothing; no truncation: a process may map it; `fd`
    readable too)."""
    buf = bytearray(usage.SIZE)
    u = ffi.cast("struct vgpu_usage *", ffi.from_buffer(buf))
    u.procs[slot].pid, u.procs[slot].start_ticks, u.procs[slot].pid_ns = pid, start_ticks, pid_ns
    os.pwrite(fd, bytes(buf[usage.pid_offset(slot):usage.pid_offset(slot + 1)]), usage.pid_offset(slot))
    os.pwrite(fd, memory.to_bytes(8, "little"), usage.charge_offset(0, slot))
    if int.from_bytes(os.pread(fd, 4, usage.SLOTS_USED_AT), "little") < slot + 1:    # (widened, never narrowed)
        os.pwrite(fd, (slot + 1).to_bytes(4, "little"), usage.SLOTS_USED_AT)


def boot_ticks():
    """Now, in the clock ticks after boot of /proc/<pid>/stat's start times (what a shim
    records in its slot: a time its process was running at)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))
