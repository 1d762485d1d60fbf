"""The Observer: one look at the node, slices and driver together, as a Snapshot."""
import os
import struct
import threading
import time

from .. import nvml, procfs, slices
from ..inotify import IN_CLOSE_WRITE, IN_OPEN, open_inotify
from ..slices import usage
from ..slices.reader import NodeReader
from .attribute import Attributing
from .driver import DriverLook
from .evidence import Evidence
from .model import ProcRow, SliceDevice, Snapshot, Tracked
from .settings import RECHECK_S, SWEEP_LOOKS, Settings
from .usage import UsageReader
from .watch import _Poller, _SliceFiles


class _Look:
    """What one look knows as it goes: its time, the driver's view, and what reading the
    slices found for the phases after it."""
    __slots__ = ("now", "ok", "note", "per_device", "util", "errors", "state", "newly", "dead")

    def __init__(self, now, ok, note, per_device, util, errors):
        self.now, self.ok, self.note, self.per_device, self.util, self.errors = now, ok, note, per_device, util, errors
        self.state = (ok, tuple(errors), tuple(per_device))   # changed: every slice is read again
        self.newly = []     # slot processes of our pid namespace not watched yet
        self.dead = []      # slices with dead slots (to reap)


class Observer(DriverLook, Attributing, Evidence):
    """One look at the node: slices (through an reader.NodeReader, shared with the
    autoscaler and the metrics) and NVML."""

    def __init__(self, directory=None, reader=None, use_nvml=True, settings=None, nvml_module=None,
                 pod_uids=None):
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
        self.inotify = open_inotify(IN_OPEN | IN_CLOSE_WRITE)
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
                t = self._watch_slot(sl, by_usage, now)
            if t is None or not t.visible or not procfs.started_by(t.start, sl.start_ticks):
                unsure = True
        return reclaimed, unsure

    def _watch_slot(self, sl, by_usage, now):
        """The Tracked of a slot's process of our pid namespace, watched from now on through
        its pidfd; None when another process has that pid now, or none (remembered, so the
        slot is not looked up again)."""
        t = self.track(sl.pid)
        if t.visible and procfs.started_by(t.start, sl.start_ticks):
            self._usage_of(t, by_usage, now)
            return t
        self._drop(t)
        self._not_slots[sl.pid] = sl.start_ticks
        return None

    def _rw(self, f, name):
        """The slice's usage file, read-write, kept open (opening it for each write would
        itself be an inotify event)."""
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
        return f.rw

    def _reap(self, f, name):
        self._rw(f, name)
        ss, _, _ = UsageReader().read(f.rw, f.devices)
        f.same = None            # the next look reads it again
        self._ended.add(name)
        lists = {}               # NVML's, read once for the slots of this reap
        return ss, [{"slot": r["slot"], "pid": r["pid"], "comm": r["comm"], "memory": r["memory"]}
                    for r in (slices._reap_slot(f.rw, sl, ss, lists) for sl in ss if not sl.alive) if r]

    def _note_host_pid(self, name, sl, pid):
        """Write into the slot of a process in another pid namespace (a container's) its pid
        as NVML lists it, which the container cannot know: once the process ends, a reaper
        (its slice's shims, `reap`, this agent) keeps its slot charged while the driver
        still lists memory under that pid (usage.Proc.host_pid).  Only from the root pid
        namespace, whose pids NVML's are."""
        f = self.files.get(name)
        if f is None or self.my_pid_ns != procfs.ROOT_PID_NS:
            return
        try:
            os.pwrite(self._rw(f, name), struct.pack("<I", pid), usage.host_pid_offset(sl.slot))
            sl.host_pid = pid
        except (OSError, slices.BadFile):
            pass                 # the file gone or replaced: the next look sees to it

    def alive(self, pid, pid_ns, start_ticks) -> bool:
        """Is the slot's process one this observer watches, still running?  (Only for
        processes of our own pid namespace: their slot pid is their pid here.)"""
        if pid_ns != self.my_pid_ns:
            return False
        t = self.tracked.get(pid)
        return t is not None and t.visible and procfs.started_by(t.start, start_ticks)

    # --- one look ---

    def observe(self, now=None) -> Snapshot:
        with self.lock:
            return self._observe(time.monotonic() if now is None else now)

    def _observe(self, now):
        """One look, in phases: the driver's view; the slices' files (those that may have
        changed); who each GPU process belongs to; the driver's figures per slice."""
        self.forget_ended()
        views = self.reader.refresh(now)
        look = _Look(now, *self._driver(now))      # the driver's view first: which slices have processes on it
        self.looks += 1
        self._forget_slices(views)
        for name in self._slices_to_read(views, look):
            self._read_slice(name, views[name], look)
        self._close_gone(views)
        problems = dict(self.reader.problems)
        for name in [n for n in self._read_problems if n not in views]:
            del self._read_problems[name]
        problems.update(self._read_problems)
        slots, table = dict(self._slots), dict(self._table)
        attribution, held_of, reused_of = self._attribution(look, slots)
        rows, active = self._driver_rows(look, table, attribution, held_of, reused_of)
        self._active = {r.attribution.slice for r in rows if r.attribution.slice}
        snap = Snapshot(now, look.ok, look.note, {p.device: why for p, why in look.errors.items()}, table, rows,
                        slots, problems)
        snap.dead = look.dead
        snap.places = list(look.per_device)
        snap.active = active
        return snap

    # the phases of a look, in order

    def _forget_slices(self, views):
        """What the looks kept of slices that are gone."""
        for name in [n for n in self._slots if n not in views]:
            for key in self._table_keys.pop(name, ()):
                self._table.pop(key, None)
            self._slots.pop(name, None)
            self._shared_of.pop(name, None)
            self._note_held(name, ())

    def _slices_to_read(self, views, look) -> list:
        """The slices whose files this look reads.  Every slice when the node or the
        driver's view changed; else those with processes on the GPU (by their maps, now or
        at the last look), those with slots no pidfd watches (their locks are asked), those
        a watched process of just ended, and every SWEEP_LOOKS-th look the rest."""
        if look.state != self._state or len(self._slots) != len(views) or self._dirty_all or self.inotify is None:
            self._state, self._dirty_all = look.state, False
            todo = list(views)
        else:
            todo = set(self._active) | self._attention | self._ended | self._buckets[self.looks % SWEEP_LOOKS]
            tracked = self.tracked
            for procs in look.per_device.values():
                for pid in procs:
                    t = tracked.get(pid)
                    if t is not None and t.usage:
                        todo |= t.usage
            todo = [n for n in todo if n in views]
        self._ended = set()
        return todo

    def _read_slice(self, name, v, look):
        """One slice's own figures: its files (opened again when replaced), quota, slots
        and a row per device; nothing read when one read shows its usage file as it was
        and every slot's process is watched (or alive by its lock)."""
        now, state, ok, per_device, errors = look.now, look.state, look.ok, look.per_device, look.errors
        files, tracked, my_pid_ns, not_slots = self.files, self.tracked, self.my_pid_ns, self._not_slots
        ptable, pslot_of, pslots, files_gone = self._table, self._slot_of, self._slots, self._table_keys
        st, util, alive, slot_alive = self.settings, look.util, self.alive, slices.slot_alive
        dead, newly = look.dead, look.newly
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
                    return
                ss, rows_, watched = same[1], same[2], same[3]
                if all(tracked.get(pid) is t for pid, t in watched):
                    stale, more, unwatched = False, None, False
                    for sl in ss:
                        t = tracked.get(sl.pid) if sl.pid > 0 and sl.pid_ns == my_pid_ns else None
                        if t is not None and (sl.pid, t) in watched:
                            continue
                        if t is not None and t.visible and procfs.started_by(t.start, sl.start_ticks):
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
                        return
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
                    dead.append(name)     # reaped (a parked one, once the driver lets go)
                if not sl.parked:
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
            gpu_time = counters[d]["gpu_time_ns"] if d in counters else 0
            mine[(name, d)] = SliceDevice(name, d, q.memory_max, current.get(d, 0), known, q.sm_max,
                                          0 if ok and place in util else None, gpu_time, st,
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

    def _close_gone(self, views):
        """The kept files of slices that are gone."""
        files = self.files
        for name in list(files):
            if name not in views:
                f = files.pop(name)
                self._files_version += 1
                f.close()
                if self.inotify is not None:
                    self.inotify.unwatch(name)
                self._buckets[f.index % SWEEP_LOOKS].discard(name)
                for key in f.keys[1]:
                    self._slot_of.pop(key, None)
                self._attention.discard(name)
                self._shared_of.pop(name, None)
                self._note_held(name, ())

    def _attribution(self, look, slots):
        """{GPU pid: Attribution}, and the pids that are gone whose memory a held slot
        records ({pid: its slots}) or reused by a live process while such a slot names it."""
        now, per_device, tracked, files, not_slots = look.now, look.per_device, self.tracked, self.files, \
            self._not_slots
        my_pid_ns = self.my_pid_ns
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
        for sl in look.newly:             # found without NVML: their end is seen at once
            if sl.pid not in tracked:
                self._watch_slot(sl, by_usage, now)
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
                      if (sl.alive or sl.parked) and sl.pid_ns == my_pid_ns and
                      (sl.exporter if sl.shared else sl.pid) == pid]
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
        return attribution, held_of, reused_of

    def _driver_rows(self, look, table, attribution, held_of, reused_of):
        """The driver's figures per slice and device: a ProcRow per GPU process, added to
        its slice's SliceDevice in `table`.  A process whose figures, attribution and slice
        files are as they were at the last look keeps its row from then."""
        st, per_device, util, tracked, files = self.settings, look.per_device, look.util, self.tracked, self.files
        my_pid_ns, slot_of = self.my_pid_ns, self._slot_of
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
                    row.slot, row.charge = hs[0].slot, sum(x.memory.get(d, 0) for x in hs)
                    row.comm = row.comm or hs[0].comm
                elif t is not None and t.visible and a.method == "usage-file":
                    sl = slot_of.get((a.slice, t.pid_ns, t.inner)) or slot_of.get((a.slice, 0, t.inner))
                    if sl is not None and procfs.may_have_started_by(t.start, sl.start_ticks):
                        if sl.pid_ns != my_pid_ns and sl.host_pid != pid and sl.start_ticks:
                            self._note_host_pid(a.slice, sl, pid)
                        keep = True
                        row.slot, row.charge = sl.slot, sl.memory.get(d, 0)
                        sh = self._shared_of.get(a.slice)
                        # memory it exported, in shared slots (NVML lists it under the exporter),
                        # and an earlier process's under its pid, in slots its slice still holds
                        others = list(sh.get((sl.pid_ns, t.inner), ()) if sh else ()) + reused_of.get(pid, [])
                        if others:
                            row.charge += sum(x.memory.get(d, 0) for x in others)
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
        return rows, active

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
