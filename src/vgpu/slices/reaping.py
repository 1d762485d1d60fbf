"""Reaping: a dead process's slot drained, its memory back to the slice -- only once the
process is done with its files and, where NVML can say, the driver no longer holds its memory."""
import fcntl
import os
import struct

from .. import nvml, procfs
from ..errors import NotFound, VgpuError
from .files import (MAX_DEVICES, _RW, USAGE, _fd, _flock_struct, list_names, node_dir, _open_in, _open_node,
                    _open_slice)
from . import usage
from .usage import _read_usage_fd


# === reap ===

def reap(directory, names=None) -> list:
    """Clear the process slots of dead processes (lock free, pid or charge still set):
    their memory goes back to the slice.  Returns what was reclaimed.  A slice whose
    usage file is broken is skipped and reported ({"slice", "error"}), never fatal:
    the file is writable from inside the container."""
    out = []
    for name in (list_names(directory) if names is None else names):
        try:
            out += [{"slice": name, **rec} for rec in reap_slice(directory, name)]
        except NotFound:
            if names is not None:
                raise
        except VgpuError as e:
            out.append({"slice": name, "error": str(e)})
    return out


def reap_quietly(directory, name):
    """Reap before reading, where this process may (root, or the slice's owner): what is
    reported is then what live processes hold.  Anything wrong is for the read to say."""
    try:
        reap_slice(directory, name)
    except (VgpuError, OSError):
        pass


def reap_slice(directory, name) -> list:
    with _fd(_open_node(directory, name=name)) as node_fd, _fd(_open_slice(node_fd, directory, name)) as cfd:
        shown = os.path.join(node_dir(directory), name, USAGE)
        try:
            fd = _open_in(cfd, USAGE, _RW, shown)
        except FileNotFoundError:
            return []
        with _fd(fd):
            procs, lists = _read_usage_fd(fd, shown).procs, {}
            return [rec for rec in (_reap_slot(fd, p, procs, lists) for p in procs if not p.alive) if rec]


def _listed(lists, device) -> dict:
    """NVML's processes on `device`, read once per reap (`lists`: {device: its list}, from
    the first slot that asks): every slot a reap judges was seen done with its files (its
    lock free) when the usage file was read, before any list, so what a list shows under
    its pid is what the driver still keeps for it (as shim/shim.c reap_dead_locked).  A
    reap of 64 gone processes asked NVML 64 times."""
    if device not in lists:
        lists[device] = nvml.running_processes(device)
    return lists[device]


def _driver_holds(proc, pid, lists) -> bool:
    """Does NVML still list memory under the slot's gone process (`pid`, as NVML names it)
    on a device it charges?  (The kernel can finish a process before the last of its
    device files is let go: its memory is still the device's.  NVML's pids are the root
    namespace's, as ours are here; NVML not there: the kernel's word alone, as
    shim/shim.c slot_owner_gone.  A MIG slice's device 0 is its MIG device, on whichever
    GPU: GPU 0's list may not name it, and then the kernel's word decides too.)"""
    try:
        return any((_listed(lists, d).get(pid) or 0) > 0 for d in proc.memory)
    except Exception:      # NVML unavailable, a device not answering
        return False


def _driver_keeps_shared(proc, procs) -> bool:
    """A shared slot no process of the slice holds: does the driver still keep its memory
    (an exported descriptor open in a process that never touched CUDA)?  As
    shim/memory.c shared_kept_by_driver: on a device it charges, NVML lists under its
    exporter at least its charge beyond the slice's other slots naming the exporter there.
    Our pid namespace only (NVML's pids); False when NVML cannot say."""
    if proc.exporter <= 0 or proc.pid_ns != procfs.pid_ns():
        return False
    try:
        for d, charge in proc.memory.items():
            listed = nvml.running_processes(d).get(proc.exporter) or 0
            others = sum(q.memory.get(d, 0) for q in procs if q.slot != proc.slot and q.pid_ns == proc.pid_ns and
                         (q.exporter if q.shared else q.pid) == proc.exporter)
            if listed - others >= charge:
                return True
    except Exception:      # NVML unavailable, a device not answering
        return False
    return False


def _reap_slot(fd, proc, procs, lists):
    """Drain one slot with pread/pwrite only (no mapping: see vgpu.slices.usage) while
    holding its lock, so no process can claim it meanwhile.  Zeroing a dead process's
    charges only ever lowers them, so a shim summing them mid-way sees a value between
    before and after, both true of a dead process.  `procs`: the slice's slots, as read
    with this one (a shared slot is weighed against them); `lists`: NVML's lists of this
    reap, as _listed keeps them (a shared slot's exporter may be alive: its are read anew)."""
    i = proc.slot
    if not proc.shared and proc.pid > 0 and proc.start_ticks:
        # its pid here: its own in our pid namespace, or (a container's process) the one the
        # node agent wrote, when we are in the root namespace (NVML's pids are its)
        mine = procfs.pid_ns()
        here = proc.pid if proc.pid_ns == mine else proc.host_pid if mine == procfs.ROOT_PID_NS else 0
        where = procfs.owner(here, proc.start_ticks) if here > 0 else procfs.REUSED
        if where == procfs.THERE:
            return None    # dead by its lock, but alive (without the file, or exiting)
        if proc.host_pid > 0 and _driver_holds(proc, proc.host_pid, lists) or \
                where == procfs.GONE and mine == procfs.ROOT_PID_NS and _driver_holds(proc, here, lists):
            return None    # gone, but the driver still lists its memory: still letting go of it
    if proc.shared and _driver_keeps_shared(proc, procs):
        return None        # no holder, but the memory is still on the device: it stays charged
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock_struct(fcntl.F_WRLCK, i))
    except (BlockingIOError, PermissionError):
        return None    # its owner is alive (or came to life since the read)
    try:
        memory = {}
        rows = os.pread(fd, MAX_DEVICES * usage.ROW.size, usage.CHARGE_AT)   # every device's: one read
        for d in range(MAX_DEVICES):
            held = usage.ROW.unpack_from(rows, d * usage.ROW.size)[i] if len(rows) >= (d + 1) * usage.ROW.size else 0
            if held:
                os.pwrite(fd, bytes(8), usage.charge_offset(d, i))
                memory[d] = held
        raw = os.pread(fd, 4, usage.pid_offset(i))
        pid = struct.unpack("<i", raw)[0] if len(raw) == 4 else 0
        if pid:
            os.pwrite(fd, bytes(4), usage.pid_offset(i))
        if not (pid or memory):
            return None
        return {"slot": i, "pid": pid, "comm": proc.comm, "memory": {str(d): b for d, b in memory.items()}}
    finally:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock_struct(fcntl.F_UNLCK, i))
