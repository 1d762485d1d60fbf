"""The agent's loop: observe, reap, judge, act, every interval."""
import collections
import json
import os
import signal
import threading
import time

from .. import driverlimits, health, procfs, slices
from ..inotify import IN_CLOSE_WRITE
from ..quantities import format_utc
from ..slices.reader import NodeReader
from .act import Holder, _signal
from .judge import Judge
from .limits import CgroupLimits
from .model import Tracked, json_device
from .observe import Observer
from .settings import ORPHAN_S, RECHECK_AFTER, Settings
from .state import read_state, write_state

# === the agent ===

class Agent:
    """The node agent: observe, reap, judge, act, every interval; a dead process's slot
    is reaped as soon as its pidfd says it ended."""

    def __init__(self, directory=None, settings=None, interval=1.0, use_nvml=True, log=None, autoscaler=None,
                 nvml_module=None, pod_uids=None, on_violation=None, on_action=None, reap=True):
        self.directory = slices.node_dir(directory)
        self.settings = settings or Settings()
        self.interval = interval
        self.log_line = log or (lambda line: print(line, flush=True))
        self._log_lock = threading.Lock()
        self.autoscaler = autoscaler
        reader = autoscaler.reader if autoscaler is not None else NodeReader(self.directory)
        if autoscaler is not None:   # its SM use of unpaced slices: this agent's attribution, not its own
            autoscaler.sm_source = self._sm_of
        self.observer = Observer(self.directory, reader, use_nvml, self.settings, nvml_module, pod_uids)
        self.judge = Judge(self.settings)
        self.judge.confirm = self.observer.confirm_gap
        self.judge.lock_holders = self.observer.slot_lock_holders
        self.holder = Holder(self.log)
        # GPU health from NVML's XID events (not without NVML: nothing to wait on)
        self.health = health.Watcher(self._health_event) if use_nvml else None
        self.cgroup_limits = CgroupLimits(self.observer, self.log) if use_nvml else None
        self.on_violation = on_violation or (lambda v, record: None)
        self.on_action = on_action or (lambda slice_name, kind, action, pid, result: None)
        self.reap_enabled = reap
        self.latest = None
        self.iterations = 0
        self.failed_looks = 0    # looks that raised (logged as errors)
        self.last_iteration_cpu_s = 0.0
        self.reaped_total = 0
        self.actions_total = collections.Counter()    # (kind, action) -> n
        self._orphans_at = -1e9
        self._orphan_seen = {}   # slice -> when its owner was first seen gone
        self._state_at = -1e9
        self._state_written = None
        self._nvml_note = None
        self._acted = set()      # (pid, start) already killed
        self._held_seen = set()  # (slice, host pid) of the gone processes attributed by a held slot
        self._reused_seen = set()  # (host pid, state, candidates) of processes whose pid a held slot names
        self._soon = {}          # slice -> [monotonic times it is looked at again] (after inotify events)
        self._joined = {}        # slice -> when a process last opened its usage file

    def _health_event(self, kind, gpu, xid):
        if kind == "xid":
            what, action, fatal = health.meaning(xid)
            self.log("xid", device=gpu.index, xid=xid, meaning=what, nvidia_action=action,
                     gpu_healthy=not fatal and gpu.healthy)
        elif kind == "unavailable":
            self.log("gpu-health", watching=False, why=self.health.unavailable)
        else:
            self.log("gpu-unhealthy", device=gpu.index, reason=gpu.reason,
                     hint="new slices are not placed on it; reset the GPU (or the node) and restart the agent")

    def _sm_of(self, name, device):
        snap = self.latest
        sd = snap.slices.get((name, device)) if snap is not None else None
        return None if sd is None else sd.sm_nvml

    def log(self, event, **fields):
        if "device" in fields:      # an index, never a MIG label (docs/design.md "Logs and JSON")
            fields["device"] = json_device(fields["device"])
        rec = {"ts": format_utc(), "event": event, **{k: v for k, v in fields.items() if v is not None}}
        with self._log_lock:     # (threads log too: the health watcher, the holder) one line at a time
            self.log_line(json.dumps(rec, separators=(",", ":")))

    # --- one iteration ---

    def tick(self, now=None):
        t0 = time.process_time()
        now = time.monotonic() if now is None else now
        snap = self.observer.observe(now)
        if snap.nvml_ok != (self._nvml_note is None) or (not snap.nvml_ok and snap.nvml_note != self._nvml_note):
            if snap.nvml_ok:
                self.log("nvml", available=True)
            else:
                self.log("nvml", available=False, note=snap.nvml_note,
                         effect="driver figures unknown: nothing judged against the driver, nothing acted on")
            self._nvml_note = None if snap.nvml_ok else snap.nvml_note
        if self.reap_enabled:
            self._reap(snap)
        self._log_held(snap)
        started, ended = self.judge.update(snap, self.observer, held=lambda k: k in self.holder.groups)
        for v in started:
            self._started(v, snap)
        for v in ended:
            if v.action == "stop":
                self.holder.release(("compute", v.key))
            self.log("violation-end", kind=v.kind, slice=v.slice or None, device=v.device,
                     lasted_s=round(now - v.started, 3))
        self._steer(snap, now)
        if self.cgroup_limits is not None:
            self.cgroup_limits.update(snap)
        if now - self._orphans_at >= ORPHAN_S:
            self._orphans_at = now
            self._orphans(snap, now)
            driverlimits.tidy(self.directory)   # and the cgroups killed runs left
        self.latest = snap
        self.iterations += 1
        self._write_state(now)
        if self.autoscaler is not None:
            self.autoscaler.tick(now)
        self.last_iteration_cpu_s = time.process_time() - t0
        return snap

    def _log_held(self, snap):
        """One line for each gone process NVML still lists whose memory a held slot keeps,
        as it is first attributed that way."""
        seen = set()
        for p in snap.processes:
            if p.attribution.method != "held-slot":
                continue
            key = (p.attribution.slice, p.host_pid)
            if key not in self._held_seen and key not in seen:
                self.log("held-slot", slice=p.attribution.slice, device=p.device,
                         nvml_device=p.place.label if p.place is not None else None, pid=p.host_pid,
                         memory_driver=p.driver, slot=p.slot, memory_charged=p.charge,
                         note=f"{p.attribution.note}: its memory counts in the slice; never acted on")
            seen.add(key)
        self._held_seen = seen
        seen = set()
        for p in snap.processes:
            a = p.attribution
            if not a.reused:
                continue
            key = (p.host_pid, a.state, a.candidates)
            if key not in self._reused_seen:
                self.log("pid-reused", slice=a.slice, candidates=list(a.candidates) or None, state=a.state,
                         device=p.device, nvml_device=p.place.label if p.place is not None else None,
                         pid=p.host_pid, memory_driver=p.driver, memory_charged=p.charge,
                         note=a.note + ("; never acted on" if a.state == "ambiguous" else ""))
            seen.add(key)
        self._reused_seen = seen

    def _reap(self, snap):
        for name in snap.dead:
            self.reap(name)

    def reap(self, name, recheck=False):
        """Reap the slice's dead slots (recheck: and watch its new processes, see
        Observer.recheck); True while the slice is worth looking at again soon."""
        try:
            if recheck:
                recs, unsure = self.observer.recheck(name)
            else:
                recs, unsure = self.observer.reap(name), False
            self._log_reaped(name, recs)
            return unsure
        except slices.NotFound:
            pass
        except (slices.VgpuError, OSError) as e:
            self.log("error", slice=name, error=f"reap: {e}")
        return False

    def _log_reaped(self, name, recs):
        for rec in recs:
            self.reaped_total += 1
            self.log("reaped", slice=name, slot=rec["slot"], pid=rec["pid"], comm=rec["comm"],
                     memory=rec["memory"])

    def _started(self, v, snap):
        record = {"kind": v.kind, "slice": v.slice or None, "device": v.device, "action": v.action,
                  **v.detail, "offenders": [pid for pid, _ in v.offenders],
                  "processes": [p.to_json() for p in (snap.slices[v.key].processes if v.key in snap.slices else [])]}
        self.log("violation", **record)
        self.on_violation(v, record)
        if v.action == "kill":
            self._kill(v)
        elif v.action == "stop":
            sd = snap.slices.get(v.key)
            if sd is not None and v.offenders:
                self.holder.hold(("compute", v.key), v.offenders, sd.sm_max, sd.sm_nvml or 0)
                if not self.holder.is_alive():
                    self.holder.start()
                for pid, _ in v.offenders:
                    self.actions_total[(v.kind, "stop")] += 1
                    self.log("action", action="stop", kind=v.kind, slice=v.slice, device=v.device, pid=pid,
                             result="held to its share with SIGSTOP/SIGCONT", target=sd.sm_max)
                    self.on_action(v.slice, v.kind, "stop", pid, f"held to its share ({sd.sm_max / 100:g}%)")
            else:
                self.log("action", action="stop", kind=v.kind, slice=v.slice, device=v.device,
                         result="no process the agent is sure of: reported only")

    def _kill(self, v):
        for pid in v.detail.get("gone", ()):
            self.log("action", action="kill", kind=v.kind, slice=v.slice or None, device=v.device, pid=pid,
                     result="not killed: the process is gone (its memory is kept by a process that holds its slot)")
        if not v.offenders:
            why = ("charges rewritten in the usage file, by a process the kernel does not name"
                   if v.detail.get("rewritten") else "no process the agent is sure of")
            self.log("action", action="kill", kind=v.kind, slice=v.slice or None, device=v.device,
                     result=f"{why}: reported only")
            return
        for pid, start in v.offenders:
            if (pid, start) in self._acted:
                continue
            result = self._kill_one(v, pid, start)
            self._acted.add((pid, start))
            self.actions_total[(v.kind, "kill")] += result == "killed"
            self.log("action", action="kill", kind=v.kind, slice=v.slice or None, device=v.device, pid=pid,
                     result=result)
            self.on_action(v.slice, v.kind, "kill", pid, result)

    def _kill_one(self, v, pid, start):
        """SIGKILL through a pidfd, after checking once more that it is the same process and
        still where the agent put it."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return "gone"
        try:
            if procfs.start_ticks(pid) != start:
                return "gone (its pid is another process now): not killed"
            t = Tracked(pid)
            try:
                obs = self.observer
                by_usage = {f.usage_inode: name for name, f in obs.files.items() if f.usage_inode}
                by_identity = {f.identity_inode: name for name, f in obs.files.items() if f.identity_inode}
                if t.visible:
                    obs._usage_of(t, by_usage, time.monotonic())
                a = obs._attribute(t, by_identity, {}, obs._groups(by_identity))
            finally:
                t.close()
            wanted = ("unsliced",) if v.kind == "unsliced" else ("sliced",)
            if a.state not in wanted or (v.kind != "unsliced" and a.slice != v.slice):
                return f"not killed: no longer attributed with certainty ({a.state})"
            _signal(fd, signal.SIGKILL)
            return "killed"
        except OSError as e:
            return f"not killed: {e.strerror or e}"
        finally:
            os.close(fd)

    def _steer(self, snap, now):
        for key in list(self.holder.groups):
            _, sk = key
            sd = snap.slices.get(sk)
            if sd is None or sd.sm_nvml is None:
                continue
            g = self.holder.groups.get(key)
            held = {pid for pid in g["pidfds"]} if g else set()
            measured = sum(p.util * 100 for p in sd.processes if p.host_pid in held)
            others = sum(p.util * 100 for p in sd.processes if p.host_pid not in held)
            g["target"] = max(100, sd.sm_max - others)
            self.holder.steer(key, measured, now)
            if g["full_since"] is not None and now - g["full_since"] >= self.settings.window:
                self.holder.release(key)
                self.judge.active.pop(key, None)
                self.log("violation-end", kind="compute", slice=sk[0], device=sk[1],
                         note="released: within its share without being held for a whole window")
            elif all(procfs.start_ticks(pid) != start for pid, (_, start) in g["pidfds"].items()):
                self.holder.release(key)
                self.judge.active.pop(key, None)
                self.log("violation-end", kind="compute", slice=sk[0], device=sk[1],
                         note="released: the held processes ended")

    # --- orphans ---

    def _orphans(self, snap, now):
        views = self.observer.reader.views
        attributed = {p.attribution.slice for p in snap.processes if p.attribution.slice}
        for name, v in list(views.items()):
            owner = v.quota.temporary
            if owner is None:
                continue
            if owner.pid_ns != self.observer.my_pid_ns:
                continue         # made in another pid namespace: its owner cannot be judged from here
            if procfs.same_process(owner.pid, owner.start_ticks):
                self._orphan_seen.pop(name, None)
                continue
            if any(s.alive for s in snap.slots.get(name, [])) or name in attributed:
                continue         # its command still runs: when it ends
            first = self._orphan_seen.setdefault(name, now)
            if now - first < ORPHAN_S:
                continue         # `run` may be deleting it itself right now
            try:
                slices.delete(self.directory, name)
                self.log("orphan-removed", slice=name, owner_pid=owner.pid,
                         reason="temporary slice (vgpu-ctl run's, or a standalone shim's) whose owner is gone, "
                                "with no process left")
            except slices.NotFound:
                pass
            except (slices.VgpuError, OSError) as e:
                self.log("error", slice=name, error=f"orphan not removed: {e}")
            self._orphan_seen.pop(name, None)

    # --- state for status ---

    def state(self):
        return {"version": 1, "pid": os.getpid(), "pid_start": procfs.start_ticks(os.getpid()),
                "updated": round(time.time(), 3), "interval_s": self.interval, "settings": self.settings.to_json(),
                "violations": [v.to_json() for v in self.judge.active.values()],
                "gpus": self.health.gpus() if self.health is not None else {},
                "driver_limits": self.cgroup_limits.state() if self.cgroup_limits is not None else {},
                "held": [{"pid": p, "start_ticks": s} for p, s in self.holder.held_pids()],
                "violations_total": [{"slice": c or None, "kind": k, "count": n}
                                     for (c, k), n in sorted(self.judge.counts.items())]}

    def _write_state(self, now, force=False):
        state = self.state()
        changed = {k: v for k, v in state.items() if k != "updated"} != self._state_written
        if not (force or changed or now - self._state_at >= max(2.0, self.interval * 2)):
            return
        self._state_at = now
        self._state_written = {k: v for k, v in state.items() if k != "updated"}
        try:
            write_state(self.directory, state)
        except FileNotFoundError:
            pass                 # no node directory (yet): nothing to report on

    # --- looping ---

    def resume_held(self):
        """Continue processes a previous agent held when it ended without releasing them."""
        old = read_state(self.directory)
        for h in (old or {}).get("held", []):
            if procfs.same_process(h.get("pid"), h.get("start_ticks")):
                try:
                    fd = os.pidfd_open(h["pid"])
                    try:
                        _signal(fd, signal.SIGCONT)
                    finally:
                        os.close(fd)
                    self.log("action", action="continue", pid=h["pid"], result="held by a previous agent: continued")
                except OSError:
                    pass

    def run(self, stop=None, once=False):
        """Look every interval until `stop` is set (once: one look, and out)."""
        stop = stop or threading.Event()
        self.resume_held()
        self.log("start", dir=self.directory, interval_s=self.interval, settings=self.settings.to_json(),
                 autoscale=self.autoscaler is not None)
        if self.health is not None and not once:
            self.health.start()
        next_at = time.monotonic()
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now >= next_at:
                    try:
                        self.tick(now)
                    except Exception as e:    # one bad moment must not end the node's agent
                        self.failed_looks += 1
                        self.log("error", error=f"{type(e).__name__}: {e}")
                    if once:
                        break
                    next_at += self.interval
                    if next_at < now:
                        next_at = now + self.interval
                # a condition waiting out its grace period is looked at again as it ends
                due = self.judge.next_due()
                until = next_at if due is None or due >= next_at else max(due, time.monotonic())
                if self._wait(stop, until) and until < next_at:
                    try:
                        self.tick(time.monotonic())
                    except Exception as e:
                        self.failed_looks += 1
                        self.log("error", error=f"{type(e).__name__}: {e}")
        finally:
            if self.health is not None:
                self.health.stop()
            self.holder.stop()
            self.log("stopped")
            try:
                self._write_state(time.monotonic(), force=True)
            except OSError:
                pass

    def _wait(self, stop, until):
        """Sleep until `until`, waking at once when a tracked process ends (its slice is
        reaped then) and when a process opens or closes a usage file (the slice is looked
        at again at once and RECHECK_AFTER: a close's slot once its lock is free, a
        newcomer's to watch it through a pidfd); False when `stop` was set."""
        obs = self.observer
        soon = self._soon            # slice -> when it is looked at again, soonest first
        while not stop.is_set():
            now = time.monotonic()
            if soon:
                for name in [n for n, at in soon.items() if at[0] <= now]:
                    with obs.lock:
                        unsure = self.reap(name, recheck=True)
                    at = [x for x in soon[name] if x > now]
                    if at and (unsure or self._joined.get(name, 0) > now - RECHECK_AFTER[-1]):
                        soon[name] = at
                    else:
                        del soon[name]
                        self._joined.pop(name, None)
            left = until - now
            if left <= 0:
                return True
            if soon:
                left = min(left, max(0.0, min(at[0] for at in soon.values()) - now))
            events = obs.poller.poll(min(left, 1.0))
            if not events:
                continue
            names = set()
            now = time.monotonic()
            with obs.lock:
                if obs.inotify is not None and any(fd == obs.inotify.fd for fd, _ in events):
                    for name, mask in obs.inotify.events():
                        if mask & IN_CLOSE_WRITE:
                            names.add(name)        # a process of it ended (or let go of the file)
                        else:
                            self._joined[name] = now   # a process joined: its slot is claimed just after
                        obs._ended.add(name)       # looked at next time: a process joined or left
                        if name not in soon:
                            soon[name] = [now + x for x in RECHECK_AFTER]
                for t in obs.forget_ended(events):
                    names |= set(t.usage or ())
                for name in sorted(names):
                    self.reap(name, recheck=name in soon)
        return False
