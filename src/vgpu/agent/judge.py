"""Judging: conditions seen in snapshots become violations when they last."""
import collections
import time
from dataclasses import dataclass, field


from ..quantities import SHARE_FULL, UNLIMITED
from .model import Snapshot, json_device
from .settings import FORGED_CHARGE, SLACK_S


# === judging ===

@dataclass
class Violation:
    kind: str
    key: tuple               # what it is about: (slice, device) or ("", host pid, start)
    slice: str
    device: int
    since: float             # monotonic time the condition was first seen
    started: float = None    # when it became a violation (after the grace period / window)
    detail: dict = field(default_factory=dict)
    offenders: list = field(default_factory=list)   # [(host pid, start ticks)]
    action: str = "report"
    acted: bool = False
    wall: float = None

    def to_json(self):
        return {"kind": self.kind, "slice": self.slice or None, "device": json_device(self.device),
                "since": round(self.wall, 3) if self.wall else None, "action": self.action,
                "offenders": [p for p, _ in self.offenders], **self.detail}


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


class ChargeHistory:
    """What a process's charge did between looks, to say whose doing its gap is.

    A gap (the driver holding more under a process than its slot charges) comes about in one
    of two ways: the driver's figure rose and the charge did not (the process allocated
    around the shim: its own doing), or the charge fell and the driver's figure did not (its
    slot was rewritten, by itself or by a neighbour in its container: the kernel does not
    say who wrote a file).  `rewritten` is the part of a process's gap the second way
    explains: charge falls the driver did not match, given back as the driver's figure
    later falls further than the charge (a look reads the driver before the usage files: an
    honest free between the two shows the charge fall one look before the driver's)."""

    def __init__(self):
        self._last = {}          # (host pid, device) -> (driver, charge, rewritten) at the last look

    def see(self, snap):
        """Take in every process row of a snapshot; forget processes it does not list."""
        seen = {}
        for p in snap.processes:
            if p.driver is None or p.context:
                continue
            key = (p.host_pid, p.device)
            driver, charge = p.driver, p.charge or 0
            last = self._last.get(key)
            rewritten = 0
            if last is not None:
                d0, c0, rewritten = last
                fell_charge, fell_driver = max(0, c0 - charge), max(0, d0 - driver)
                rewritten += max(0, fell_charge - fell_driver) - max(0, fell_driver - fell_charge)
            seen[key] = (driver, charge, max(0, min(rewritten, driver - charge)))
        self._last = seen

    def rewritten(self, pid, device) -> int:
        last = self._last.get((pid, device))
        return last[2] if last else 0


class Judge:
    """Conditions seen in snapshots become violations when they last: memory and
    unsliced ones for the grace period, compute ones on average over the window."""

    def __init__(self, settings):
        self.settings = settings
        self.pending = {}        # (kind, key) -> Violation (condition seen, not yet a violation)
        self.active = {}         # (kind, key) -> Violation
        self.compute = collections.defaultdict(_Ring)   # (slice, device) -> its window of (t, nvml, charged)
        self._gpu = {}           # (slice, device) -> (t, gpu_time_ns)
        self.counts = collections.Counter()   # (slice, kind) -> violations started
        # (slice device) -> a bracketed look (Observer.confirm_gap), or None: the snapshot's
        # figures are taken as they are (status and metrics report; only the agent acts)
        self.confirm = None
        # (slice device, slot numbers) -> host pids of its processes holding those slots'
        # locks (Observer.slot_lock_holders); None: none are looked for
        self.lock_holders = None
        self.unjudged = collections.Counter()   # (slice, device) -> gaps left unjudged: charges moving
        self.history = ChargeHistory()
        self._fit = {}           # (slice, device) -> {host pid: driver figure} at its last look within its cap

    def conditions(self, snap: Snapshot) -> dict:
        """(kind, key) -> (slice, device, detail, offenders) true in this snapshot."""
        st = self.settings
        out = {}
        compute, gpu = self.compute, self._gpu
        # a slice with nothing on the GPU: nothing the driver could say against it
        for key in [k for k in gpu if k not in snap.active]:
            del gpu[key]
            compute.pop(key, None)
        threshold = st.tolerance + st.process_overhead
        self.history.see(snap)
        for key in [k for k in self._fit if k not in snap.active]:
            del self._fit[key]
        for key, sd in snap.active.items():
            forged = [sl for sl in snap.slots.get(sd.name, ()) if sl.memory.get(sd.device, 0) >= FORGED_CHARGE or
                      (sl.memory.get(sd.device) and not sl.shared and sl.pid <= 0)]
            if forged or sd.memory_current >= 1 << 64:
                # a charge no device can hold, a row that sums past 2^64 (a "negative" charge
                # making room), or a charge in a slot no process claimed (the shim writes a
                # slot's pid before it charges anything, and drains charges before the pid):
                # the shim refuses to admit against the first two; the offender is whoever of
                # the slice holds the forged slots' locks (it wrote them)
                holders = self.lock_holders(sd, [sl.slot for sl in forged]) if self.lock_holders and forged else []
                out[("forged", key)] = (sd.name, sd.device, {
                    "memory_current": sd.memory_current, "slots": [
                        {"slot": sl.slot, "pid": sl.pid, "charge": sl.memory[sd.device], "alive": sl.alive}
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
                    over = sd.memory_max != UNLIMITED and driver > sd.memory_max + tol
                    if gap > tol:
                        detail = {"memory_driver": driver, "memory_current": current,
                                  "memory_max": None if sd.memory_max == UNLIMITED else sd.memory_max,
                                  "tolerance": tol, "gap": gap, **_where(sd)}
                        offenders, rewritten = [], []
                        for p in sd.processes:
                            own = own_gap.get(p.host_pid)
                            if not p.attribution.certain or own is None or own <= threshold:
                                continue
                            if own - self.history.rewritten(p.host_pid, p.device) > threshold:
                                offenders.append((p.host_pid, p))      # it allocated what it was not charged
                            else:
                                rewritten.append(p.host_pid)          # its charge was rewritten: by whom, unknown
                        gone = [p.host_pid for p in sd.processes if p.attribution.method == "held-slot" and
                                p.gap is not None and p.gap > threshold]
                        if gone:     # above their slots' charge, but gone: nothing to act on
                            detail["gone"] = gone
                        if rewritten:
                            detail["rewritten"] = rewritten
                        out[("gap", key)] = (sd.name, sd.device, detail, offenders)
                        if over:
                            if rewritten and not offenders:
                                offenders = self._grown(key, sd, rewritten, threshold)
                            out[("over-cap", key)] = (sd.name, sd.device, detail, offenders)
                if sd.memory_max == UNLIMITED or sd.driver <= sd.memory_max + sd.tolerance:
                    self._fit[key] = {p.host_pid: p.driver or 0 for p in sd.processes}
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

    def _grown(self, key, sd, rewritten, threshold):
        """A slice over its cap through rewritten charges: whoever took the room they made,
        the processes whose driver figure grew since the slice's last look within its cap
        (none when the agent has not seen it within its cap: nothing to compare with).  The
        ones whose charge was rewritten are never among them."""
        fit = self._fit.get(key)
        if fit is None:
            return []
        return [(p.host_pid, p) for p in sd.processes if p.attribution.certain and p.host_pid not in rewritten
                and p.driver is not None and p.driver - fit.get(p.host_pid, 0) > threshold]

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
