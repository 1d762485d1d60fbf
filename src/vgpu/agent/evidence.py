"""The Observer's second look before a gap is judged, and who holds a slot's lock."""
import os

from .. import slices
from ..slices import usage
from .settings import CONFIRM_TRIES
from .watch import _lock_start


class Evidence:
    """(Observer) evidence for the judge."""

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
        fd, at = f.view._ufd, usage.CHARGE_AT + sd.device * usage.ROW.size

        def seq_and_row():
            seq = os.pread(fd, usage.SEQ_SIZE, usage.SEQ_AT)
            row = os.pread(fd, usage.ROW.size, at)
            if len(seq) != usage.SEQ_SIZE or len(row) != usage.ROW.size:
                raise slices.BadFile("usage file cut short")
            return seq, row

        try:
            for _ in range(CONFIRM_TRIES):
                before = seq_and_row()
                listed = self._place_processes(place)
                after = seq_and_row()
                if before == after:
                    break
            else:
                return None
        except Exception:    # the file or the driver gone meanwhile: judged at the next look
            return None
        row = usage.ROW.unpack(after[1])
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
