"""The autoscale loop: sample every slice's usage file, keep windows, apply decisions.

Every `interval` the loop reads each slice's quota generation (from a mapping) and usage
counters (one pread) from files it keeps open (so a loop over 1,000 slices costs a load
and a read per slice, not file opens), turns them into samples (vgpu.policy.Sample),
moves each track, asks the policy for decisions and applies them through slices.resize
-- the code path of `vgpu-ctl resize`: the same locks, checks and in-place write the
running shim obeys.  Each decision is logged as one JSON line.

What lives where: quotas (and request/limit) live in the quota files; the loop keeps
only windows in memory.  A restart loses the windows in progress: it waits one whole
window (and the cooldown) before it changes anything again, and picks up the quotas as
the files say.

Samples per (slice, device):
  memory: use = memory.current; pressure = allocations refused by the cap (oom_refusals)
          since the last sample;
  sm:     use = GPU time charged to the slice's paced launches over the last few
          samples / wall time (the shim counts it while sm.max < 100%); at sm.max 100%
          NVML's per-process utilization of the slice's processes, where NVML is there;
          pressure = time its launches waited for their share / wall time.
"""
import collections
import json
import threading
import time

from . import nvml, procfs, slices
from .agent.model import record_place
from .inotify import IN_CLOSE_WRITE, open_inotify
from .policy import (MEMORY, SM, Item, Policy, could_change, new_track, observe_values, plan,
                     restart)
from .quantities import SHARE_FULL, UNLIMITED, format_utc
from .slices.reader import NodeReader

HOST_PIDS_TTL_S = 5.0  # NVML path: how long a slice's host pids are trusted
SMOOTH_S = 5.0         # SM use is measured over up to this much of the latest samples
REAP_S = 1.0           # dead processes' slots are reaped this often (their memory back within it)
REAP_SWEEP = 30        # ... and every slice is looked at once in this many, whatever inotify said


# === which slices may hold a dead process's slot ===

class _DeadSlotWatch:
    """Which slices a reap should look at: asking each slice's usage file every second
    (usage.has_dead_slot: a pread and a lock test per used slot) was 12-24 us a slice, most
    of the loop at 1,000 slices.  A process leaving its slice closes its usage file, which
    inotify reports (vgpu.inotify); the event comes just before its lock is let go, so a
    slice is looked at in the reap after its event and in the next.  A reap's own close of
    the file is an event too: a slice whose dead process is still letting go of its memory
    (its slot kept) is looked at every reap until it is drained.  A slice new to the loop (or
    whose usage file was made again) is looked at once; every slice once in REAP_SWEEP reaps
    (an event lost, a slot a container wrote by hand); every slice every time where there
    is no inotify, or its queue overflowed."""

    def __init__(self, reader):
        self.reader = reader
        self.inotify = open_inotify(IN_CLOSE_WRITE)
        self.seen = None         # reader.changes when the watches were last made to match its views
        self.watched = {}        # name -> the view whose usage file is watched
        self.unwatched = []      # slices with no watch (no usage file, no watch left): looked at every time
        self.names = []          # every slice, for the sweep
        self.again = set()       # looked at in the next reap too
        self.reaps = 0

    def suspects(self):
        """The names of the reader's views to look at in this reap."""
        views = self.reader.views
        self.reaps += 1
        if self.inotify is None:
            return list(views)
        closed = {name for name, _ in self.inotify.events()}
        out = closed | self.again
        self.again = closed
        if self.inotify.overflowed:
            out = set(views)
        if self.seen != self.reader.changes or len(self.inotify.wds) != len(self.watched):
            out |= self._watch(views)    # (views made or dropped; or a watch the kernel removed)
        out.update(self.unwatched, self.names[self.reaps % REAP_SWEEP::REAP_SWEEP])
        return [name for name in out if name in views]

    def _watch(self, views):
        """Watch every view's usage file (a watch is on the file its view reads: one made
        again is a new view, watched anew); returns the slices newly watched."""
        self.seen = self.reader.changes
        for name in [n for n in self.watched if n not in views]:
            self.inotify.unwatch(name)
            del self.watched[name]
        new, self.unwatched = set(), []
        for name, v in views.items():
            if self.watched.get(name) is v and name in self.inotify.wds:
                continue
            self.watched.pop(name, None)
            if v.watch_closes(self.inotify):
                self.watched[name] = v
                new.add(name)
            else:
                self.unwatched.append(name)
        self.names = list(views)
        return new


# === the loop ===

class _Dev:
    """What the loop keeps per (slice, device): the latest few counter readings, the
    memory and SM tracks, and when a blocked hold was last logged (per resource).  It
    lives on the slice's SliceView, so it goes when the slice goes."""
    __slots__ = ("ring", "oom", "sm_max", "mem", "sm", "blocked")

    def __init__(self, n):
        self.ring = collections.deque(maxlen=n)
        self.oom = self.sm_max = self.mem = self.sm = None
        self.blocked = {}


class Autoscaler:
    """One node's autoscaler.  tick() samples, decides and applies once; run() loops."""

    def __init__(self, directory=None, policy=None, interval=1.0, dry_run=False, device_memory=None,
                 use_nvml=True, log=None):
        self.directory = slices.node_dir(directory)
        self.policy = policy or Policy()
        self.interval = interval
        self.dry_run = dry_run
        self.device_memory = device_memory
        self.use_nvml = use_nvml
        self.log = log or (lambda line: print(line, flush=True))
        self.reader = NodeReader(self.directory)
        self.decisions_total = collections.Counter()   # (name, device, resource, action) -> n
        self.ticks = 0
        self.last_tick_s = 0.0
        self._capacity = {}     # device -> (bytes or None, when asked)
        self._problems = {}     # slices that cannot be read, as last logged
        self._reaped_at = None  # when dead processes' slots were last reaped
        self._dead_slots = None if dry_run else _DeadSlotWatch(self.reader)   # (a dry run reaps nothing)
        self._lock = threading.Lock()
        # (name, device) -> NVML's share of the slice's processes (1/100 percent) or None: the
        # node agent's attribution when it runs the loop (vgpu.agent), else procfs.host_pids below
        self.sm_source = None
        # SM use over the last SMOOTH_S (at most a sixth of the window), never under one interval
        lookback = max(interval, min(SMOOTH_S, self.policy.window / 6))
        self._ring = max(2, int(round(lookback / interval)) + 1)

    # --- capacity ---

    def memory_capacity(self, d):
        if self.device_memory is not None:
            return self.device_memory
        if not self.use_nvml:
            return None
        cached = self._capacity.get(d)
        if cached and (cached[0] is not None or time.monotonic() - cached[1] < 60):
            return cached[0]
        try:
            cap = nvml.memory_total(d) if d < nvml.device_count() else None
        except nvml.NvmlUnavailable:
            cap = None
        self._capacity[d] = (cap, time.monotonic())
        return cap

    # --- sampling ---

    def _nvml_sm(self, view, d, util):
        """SM use of an unpaced slice on device d from NVML (1/100 percent), or None (a MIG
        slice: NVML has no per-process utilization on a MIG-enabled GPU)."""
        if self.sm_source is not None:
            return self.sm_source(view.name, d)
        if util is None or view.mig is not None:
            return None
        if d not in util:
            try:
                util[d] = nvml.process_utilization(d, max(self.interval, 1.0))
            except nvml.NvmlUnavailable:
                util[d] = None
        if util[d] is None:
            return None
        now = time.monotonic()
        cached = view.host_pids
        if cached is None or now - cached[0] > HOST_PIDS_TTL_S:
            try:
                seen = slices.read_usage(self.directory, view.name)
                pids = list(procfs.host_pids(seen).values()) if seen else []
            except (slices.VgpuError, OSError):
                pids = []
            cached = view.host_pids = (now, pids)
        return sum(util[d].get(p, 0) for p in cached[1]) * 100

    def tick(self, now=None) -> list:
        """Sample every slice, decide, apply.  Returns the decisions (grows, shrinks, and
        holds that wanted a change)."""
        t0 = time.process_time()
        now = time.monotonic() if now is None else now
        with self._lock:
            decisions = self._tick(now)
        self.ticks += 1
        self.last_tick_s = time.process_time() - t0
        return decisions

    def _tick(self, now):
        pol = self.policy
        views = self.reader.refresh(now)
        if self.reader.problems != self._problems:
            for name, why in sorted(self.reader.problems.items()):
                if self._problems.get(name) != why:
                    self.log(json.dumps({"ts": format_utc(), "event": "error", "slice": name, "error": why},
                                        separators=(",", ":")))
            self._problems = dict(self.reader.problems)
        if self._reaped_at is None or now - self._reaped_at >= REAP_S:
            self._reaped_at = now
            if not self.dry_run:
                for name in self._dead_slots.suspects():
                    if views[name].has_dead_slot():   # (a reap opens and parses the file: only where there is work)
                        slices.reap_quietly(self.directory, name)
        items = []
        # pool -> sum of the quotas of every slice in it: a GPU (its index), or a MIG slice's
        # instance (its device 0 is the instance, not GPU 0: the instance's memory alone)
        mem_alloc, sm_alloc = {}, {}
        pool_memory = {}                 # MIG pool -> the instance's memory
        nvml_util = {} if self.use_nvml else None
        ring = self._ring
        for name, v in views.items():
            if v.refresh_quota():
                v.state = {d: st for d, st in v.state.items() if d in v.managed}
            state = v.state
            record = v.mig
            for d, q, mem_managed, sm_managed, mem_bounds, sm_bounds in v.rows:
                pool = d if record is None else mig_pool(record)
                if record is not None:
                    pool_memory[pool] = record.get("memory_total")
                sm_alloc[pool] = sm_alloc.get(pool, 0) + q.sm_max
                if q.memory_max != UNLIMITED:
                    mem_alloc[pool] = mem_alloc.get(pool, 0) + q.memory_max
                if not (mem_managed or sm_managed):
                    if q.memory_max == UNLIMITED:    # no cap: count what it holds
                        c = v.read(d)
                        mem_alloc[pool] = mem_alloc.get(pool, 0) + (c[0] if c else 0)   # (memory_current)
                    continue
                c = v.read(d)
                if c is None:
                    continue            # usage file cut short: no sample (its windows wait)
                mem, _, oom, _, gpu, thr, _ = c      # usage.COUNTERS
                if q.memory_max == UNLIMITED:
                    mem_alloc[pool] = mem_alloc.get(pool, 0) + mem
                st = state.get(d)
                if st is None:
                    st = state[d] = _Dev(ring)
                refused = 0 if st.oom is None else max(0, oom - st.oom)
                st.oom = oom
                if st.sm_max != q.sm_max:
                    st.ring.clear()     # a rate across a change of the share would judge the new one by the old
                    st.sm_max = q.sm_max
                st.ring.append((now, gpu, thr))
                if mem_managed:
                    tr = st.mem
                    tr = new_track(MEMORY, now, q.memory_max) if tr is None else \
                        observe_values(tr, now, mem, q.memory_max, refused, pol)
                    st.mem = tr
                    if self._candidate(tr, st, mem_bounds, pol, now):
                        items.append(Item(name, d, tr, mem_bounds, pool))
                else:
                    st.mem = None
                if sm_managed:
                    tr = st.sm
                    if tr is None:
                        tr = new_track(SM, now, q.sm_max)
                    else:
                        t_a, g_a, th_a = st.ring[0]
                        span = (now - t_a) * 1e9
                        use, pressure = None, 0.0
                        if span > 0:
                            pressure = (thr - th_a) / span
                            if q.sm_max < SHARE_FULL:
                                use = int((gpu - g_a) / span * SHARE_FULL)
                            else:
                                use = self._nvml_sm(v, d, nvml_util)
                        tr = observe_values(tr, now, use, q.sm_max, pressure, pol)
                    st.sm = tr
                    if self._candidate(tr, st, sm_bounds, pol, now):
                        items.append(Item(name, d, tr, sm_bounds, pool))
                else:
                    st.sm = None
        if not items:
            return []
        capacity, allocated = {}, {}
        for d, total in mem_alloc.items():
            capacity[(d, MEMORY)] = pool_memory[d] if d in pool_memory else self.memory_capacity(d)
            allocated[(d, MEMORY)] = total
        for d, total in sm_alloc.items():
            capacity[(d, SM)], allocated[(d, SM)] = SHARE_FULL, total
        decisions = plan(items, capacity, allocated, pol, now)
        if decisions:
            self._apply(decisions, now)
        return decisions

    def _candidate(self, tr, st, bounds, pol, now):
        """Worth asking the policy about: below its limit, cooling down, or (at its limit
        and still wanting more) due for its once-a-window hold."""
        return (tr.quota < bounds.limit or tr.cold_since is not None or self._worth(tr, st, now)) \
            and could_change(tr, pol, now, bounds.request)

    def _worth(self, tr, st, now):
        """A slice at its limit that wants more can only be told no: judge it (and log
        the hold) once a window, not every interval.  (Asked of slices at their limit
        that are not shrinking.)"""
        last = st.blocked.get(tr.resource)
        return last is None or now - last >= self.policy.window

    def _state(self, name, device):
        v = self.reader.views.get(name)
        return None if v is None else v.state.get(device)

    def track(self, name, device, resource):
        """The window of one slice's device and resource (None: not managed)."""
        st = self._state(name, device)
        return None if st is None else (st.mem if resource == MEMORY else st.sm)

    # --- applying ---

    def _apply(self, decisions, now):
        by_slice = collections.defaultdict(list)
        for dec in decisions:
            st = self._state(dec.slice, dec.device)
            if not dec.changes:     # wanted to change, could not: logged (and counted) once a window
                last = st.blocked.get(dec.resource) if st else None
                if last is None or now - last >= self.policy.window:
                    if st:
                        st.blocked[dec.resource] = now
                    self._emit("hold", dec, applied=False)
                    self.decisions_total[(dec.slice, dec.device, dec.resource, "hold")] += 1
                continue
            if st:
                st.blocked.pop(dec.resource, None)
            by_slice[(dec.slice, dec.device)].append(dec)
        failed_shrinks = set()      # (device, resource): grows may have counted on what they free
        # the generation each slice's decisions were made at (moved on by our own resizes)
        expected = {name: v.gen for name, v in self.reader.views.items()}
        for (name, d), decs in sorted(by_slice.items(), key=lambda kv: any(x.action == "grow" for x in kv[1])):
            generation, error = None, None
            if any(x.action == "grow" and (d, x.resource) in failed_shrinks for x in decs):
                error = "not applied: a shrink on the device that this grow counted on failed; hint: retried " \
                        "after the cooldown"
            elif not self.dry_run:
                # request and limit given explicitly: resize would otherwise move a request
                # that equals the cap along with it (one number stays one number), and the
                # floor would follow the quota up
                kw = {}
                for dec in decs:
                    if dec.resource == MEMORY:
                        kw.update(memory=dec.new, request=dec.request, limit=dec.limit)
                    else:
                        kw.update(sm=dec.new, sm_request=dec.request, sm_limit=dec.limit)
                v = self.reader.views.get(name)
                # a MIG slice's instance is its own: the plan kept it within the instance's
                # memory (resize's check would count the GPU's software slices against it)
                mig = v is not None and v.mig is not None
                try:
                    # only if the quota is still the one decided on: an operator's resize
                    # in between wins, and the next interval decides from it
                    result = slices.resize(self.directory, name, devices=[d], capacity=self.memory_capacity,
                                           expect_generation=expected.get(name), overcommit=mig, **kw)
                    generation = expected[name] = result["generation"]
                except (slices.VgpuError, OSError) as e:
                    error = slices_error(e)
                    failed_shrinks |= {(d, x.resource) for x in decs if x.action == "shrink"}
            st = self._state(name, d)
            for dec in decs:
                tr = self.track(name, d, dec.resource)
                if tr is not None:
                    # the window restarts under the new quota (a dry run pretends, and a
                    # failure keeps the old one: retried after the cooldown, not every interval)
                    tr = restart(tr, dec.new if error is None and not self.dry_run else tr.quota, now)
                    if dec.resource == MEMORY:
                        st.mem = tr
                    else:
                        st.sm = tr
                if error is None:
                    self.decisions_total[(name, d, dec.resource, dec.action)] += 1
                self._emit("resize" if error is None and not self.dry_run else
                           "dry-run" if error is None else "error", dec,
                           applied=error is None and not self.dry_run, generation=generation, error=error)

    def _emit(self, event, dec, **extra):
        rec = {"ts": format_utc(), "event": event, **dec.to_json(), **{k: v for k, v in extra.items() if v is not None}}
        self.log(json.dumps(rec, separators=(",", ":")))

    # --- looping ---

    def run(self, once=False, stop=None):
        """Tick every interval until `stop` is set (or, once: until one window and the
        cooldown have passed -- the first moment anything can be decided -- and exit)."""
        stop = stop or threading.Event()
        self.log(json.dumps({"ts": format_utc(), "event": "start", "dir": self.directory, "interval_s": self.interval,
                             "dry_run": self.dry_run, "policy": self.policy.to_json()}, separators=(",", ":")))
        start = time.monotonic()
        horizon = start + max(self.policy.window, self.policy.cooldown_s)
        next_at = start
        while not stop.is_set():
            now = time.monotonic()
            try:
                self.tick(now)
            except Exception as e:     # one bad moment (a file vanishing mid-read) must not end the loop
                self.log(json.dumps({"ts": format_utc(), "event": "error", "error": f"{type(e).__name__}: {e}"},
                                    separators=(",", ":")))
            if once and now >= horizon:
                break
            next_at += self.interval
            if next_at < now:            # fell behind (a suspended machine): do not catch up
                next_at = now + self.interval
            if once:
                next_at = min(next_at, max(horizon, now))
            stop.wait(max(0.0, next_at - time.monotonic()))


def mig_pool(record) -> str:
    """The capacity pool of a MIG slice: its instance, named as the node agent names it
    (`<gpu>/mig-<GI>-<CI>`, vgpu.agent.Place)."""
    return record_place(record).label


def slices_error(e) -> str:
    hint = getattr(e, "hint", None)
    return f"{e}; hint: {hint}" if hint else str(e)
