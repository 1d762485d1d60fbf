"""The Observer's attribution: whose slice a process on the GPU is."""
import collections

from .. import procfs
from .model import Attribution
from .settings import IDENTITY_PATH, RECHECK_S


class Attributing:
    """(Observer) attribution of the processes NVML lists."""

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
        """(Attribution, [usage.Proc]) of an NVML pid that is gone here (or a zombie: dead, not yet
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
        # a zombie's own slot only if the slot names it (started_by; a shared slot records no start)
        found = [(n, sl) for n, sl in found
                 if sl.shared or start is None or procfs.may_have_started_by(start, sl.start_ticks)]
        names = sorted({n for n, _ in found})
        if not names:
            return None
        if len(names) > 1:
            return Attribution(state="ambiguous", note="gone; held slots of several slices name it",
                               candidates=tuple(names)), None
        own = [sl for _, sl in found if not sl.shared]
        note = ("gone; its slot is held by a process that inherited it (a forked child)" if own else
                "gone; memory it exported is held by another process (an importer, or a descriptor of it left open)")
        return Attribution(names[0], "held-slot", "sliced", note), own + [sl for _, sl in found if sl.shared]

    def _reused(self, pid, t, a, naming):
        """(Attribution, [usage.Proc]) of a live process whose pid live slots also name for an
        earlier process (another start: it ended, and a child or importer keeps its memory,
        which NVML lists under the pid the live process has now), or None when none do.  In
        its own slice those slots' charges count as its own (the slice's figure is right
        either way); a slot of another slice makes the figure no one's to judge: ambiguous,
        never acted on, rather than the live process's."""
        # (a shared slot records no start: its exporter is another process only when it is
        # of another slice)
        earlier = [(n, sl) for n, sl in naming
                   if (n != a.slice if sl.shared else not procfs.may_have_started_by(t.start, sl.start_ticks))]
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
            hits = {name for uid, name in pods.items() if procfs.cgroup_names_pod(t.cgroup, uid)}
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
