"""Autoscale policy: pure functions from windows of usage samples to resize decisions.

Each slice has, per device, a guaranteed `request` and a ceiling `limit` for memory and
for its SM share; the autoscaler moves the effective quota (memory.max, sm.max) between
them.  Everything here is data in, data out (no files, no clocks), so the loop in
vgpu.autoscale and the property tests run the same code.

One *track* per (slice, device, resource) follows the samples taken under the
current quota:

  observe(track, sample)  -> track    a sample is `hot` (use >= high x quota, or pressure:
                                      an OOM refusal / launches throttled), `cold` (use <
                                      low x quota, no pressure) or neither; the track keeps
                                      when the current hot and cold streaks began
  decide(track, bounds)   -> Want     grow after a whole window hot (memory: at once on an
                                      OOM refusal), shrink after a whole window cold
  plan(items, capacity)   -> [Decision]  per device: shrinks first, then grows within
                                      what the device has left, shared by request when short
  restart(track, quota)   -> track    after a change: a fresh window under the new quota

Invariants (tests/autoscale/test_autoscale_policy.py checks them for any sequence of samples):
  - request <= quota <= limit, always;
  - memory is never shrunk below its peak use in the window plus a margin;
  - a grow never takes the sum of a device's quotas above its capacity (memory: physical
    bytes; SM: 100% -- so every slice can have its whole sm.max at once, and requests are
    guaranteed); when several want more than is left, it is shared by request;
  - after a change the window restarts, and nothing changes again within the cooldown;
  - hysteresis: a grow or shrink lands use at about `target` (70%) of the new quota,
    between the marks, so a steady load is not moved back; load that swings faster than
    the window is neither hot nor cold for a whole window: nothing moves.
"""
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from .quantities import format_memory, format_share

MEMORY, SM = "memory", "sm"
RESOURCES = (MEMORY, SM)
MiB = 1 << 20


@dataclass(frozen=True)
class Policy:
    """Parameters (defaults in brackets are those of `vgpu-ctl autoscale`)."""
    window: float = 30.0           # seconds a condition must hold [30 s]
    high: float = 0.90             # grow mark: use / quota [90%]
    low: float = 0.50              # shrink mark [50%]
    target: float = 0.70           # where a change lands use / new quota [70%]
    grow_step: float = 0.25        # a grow adds at least this share of the quota [25%]
    shrink_step: float = 0.25      # a shrink takes at most this share of the quota [25%]
    cooldown: Optional[float] = None   # seconds after a change before the next [= window]
    memory_step_min: int = 256 * MiB   # smallest memory grow [256Mi]
    sm_step_min: int = 500             # smallest SM grow, 1/100 percent [5%]
    memory_margin: float = 0.10        # memory is never shrunk below peak use + this share [10%] ...
    memory_margin_min: int = 64 * MiB  # ... or + this much, whichever is more [64Mi]
    throttle_mark: float = 0.05        # launches waited >= this share of the time: SM pressure [5%]

    def __post_init__(self):
        if not self.window > 0:
            raise ValueError("window must be positive")
        if not 0 < self.low < self.target < self.high <= 1:
            raise ValueError(f"marks must satisfy 0 < low ({self.low:g}) < target ({self.target:g}) "
                             f"< high ({self.high:g}) <= 1")
        if not (0 < self.grow_step and 0 < self.shrink_step < 1):
            raise ValueError("steps must be positive (shrink step below 1)")
        if self.cooldown is not None and self.cooldown < 0:
            raise ValueError("cooldown must not be negative")
        if self.memory_step_min < 0 or self.sm_step_min < 0 or self.memory_margin < 0 or \
                self.memory_margin_min < 0 or not 0 < self.throttle_mark:
            raise ValueError("step minimums and margins must not be negative")

    @property
    def cooldown_s(self) -> float:
        return self.window if self.cooldown is None else self.cooldown

    def align(self, resource) -> int:
        return MiB if resource == MEMORY else 100       # memory in MiB, SM in whole percent

    def step_min(self, resource) -> int:
        return self.memory_step_min if resource == MEMORY else self.sm_step_min

    def margin(self, use) -> int:
        return max(self.memory_margin_min, _ceil(use * self.memory_margin))

    def to_json(self) -> dict:
        return {"window_s": self.window, "cooldown_s": self.cooldown_s, "high": self.high, "low": self.low,
                "target": self.target, "grow_step": self.grow_step, "shrink_step": self.shrink_step,
                "memory_step_min": self.memory_step_min, "sm_step_min": self.sm_step_min,
                "memory_margin": self.memory_margin, "memory_margin_min": self.memory_margin_min,
                "throttle_mark": self.throttle_mark}


# === samples and tracks ===

class Sample(NamedTuple):
    """What one interval ending at `t` (seconds) showed.
    memory: use = bytes held at t, pressure = allocations refused by the cap in the interval;
    sm:     use = share of SM time used over the interval (1/100 percent, None: unknown),
            pressure = share of the interval launches spent waiting for the share."""
    t: float
    use: Optional[int]
    quota: int
    pressure: float = 0


class Track(NamedTuple):
    resource: str
    since: float                  # the window's start: the last change (or the loop's start)
    quota: int                    # the quota every sample in the window was taken under
    last: float                   # end of the last sample's interval
    hot_since: Optional[float] = None   # start of the current hot streak
    cold_since: Optional[float] = None  # start of the current cold streak
    hot_low: int = 0              # lowest use during the hot streak
    cold_peak: int = 0            # highest use during the cold streak
    use: int = 0                  # the latest known use
    pressure_at: Optional[float] = None  # last interval with pressure (since `since`)
    refused: int = 0              # memory: allocations refused by the cap since `since`


def new_track(resource, now, quota) -> Track:
    return Track(resource, now, quota, now)


def restart(track: Track, quota, now) -> Track:
    """The window after a change (or a change the loop only pretended, in a dry run)."""
    return Track(track.resource, now, quota, now, use=track.use)


def observe(track: Track, sample: Sample, policy: Policy) -> Track:
    """The track after one more sample.  A sample under another quota than the window's
    (someone resized the slice) restarts the window: it judged a quota that is gone."""
    return observe_values(track, sample.t, sample.use, sample.quota, sample.pressure, policy)


def observe_values(track: Track, t, use, quota, pressure_value, policy: Policy) -> Track:
    """observe() without building a Sample (the loop calls it for every slice, every interval)."""
    resource, q, last = track.resource, track.quota, track.last
    if quota != q:
        return restart(track, quota, t)
    if t <= last:
        return track
    memory = resource == MEMORY
    pressure = pressure_value > 0 if memory else pressure_value >= policy.throttle_mark
    refused = track.refused + int(pressure_value) if memory else 0
    if use is None:
        if not pressure:     # unknown: neither hot nor cold
            return Track(resource, track.since, q, t, None, None, 0, 0, track.use, track.pressure_at, refused)
        use_seen, u = track.use, 0
    else:
        use_seen = u = use
    if pressure or u >= policy.high * q:
        demand = (u if u > q else q) if pressure else u    # pressure: it wanted at least all it had
        hs = track.hot_since
        if hs is None:
            hs, low = last, demand
        else:
            low = track.hot_low if track.hot_low < demand else demand
        return Track(resource, track.since, q, t, hs, None, low, 0, use_seen, t if pressure else track.pressure_at,
                     refused)
    if u < policy.low * q:
        cs = track.cold_since
        if cs is None:
            cs, peak = last, u
        else:
            peak = track.cold_peak if track.cold_peak > u else u
        return Track(resource, track.since, q, t, None, cs, 0, peak, use_seen, track.pressure_at, refused)
    return Track(resource, track.since, q, t, None, None, 0, 0, use_seen, track.pressure_at, refused)


# === one track's wish ===

class Bounds(NamedTuple):
    request: int
    limit: int


class Want(NamedTuple):
    action: str          # "grow", "shrink" or "hold"
    target: int          # the quota it wants (the current one for a hold)
    reason: str
    blocked: bool = False   # a hold that wanted to change (worth logging)


def _ceil(x) -> int:
    return int(-(-x // 1))


def _align_up(x, a) -> int:
    return -(-int(x) // a) * a


def fmt(resource, v) -> str:
    return format_memory(v) if resource == MEMORY else format_share(v)


def _secs(s) -> str:
    return f"{s:g}s"


def could_change(track: Track, policy: Policy, now, request=None) -> bool:
    """Cheap test: can decide() return anything but a quiet hold?  (The loop asks for
    each of 1,000s of tracks every interval; most are in band, or resting at their
    request.)"""
    if track.hot_since is None and track.cold_since is None and track.pressure_at is None:
        return False     # in band, never refused: the common case, asked first
    if now - track.since < policy.cooldown_s:
        return False
    w = now - policy.window
    if (track.hot_since is not None and track.hot_since <= w) or \
            (track.resource == MEMORY and track.pressure_at is not None and track.pressure_at >= w):
        return True
    return track.cold_since is not None and track.cold_since <= w and (request is None or track.quota > request)


def decide(track: Track, bounds: Bounds, policy: Policy, now) -> Want:
    """What one track wants now, before the device's capacity is considered."""
    r, q = track.resource, track.quota
    hold = Want("hold", q, "")
    if bounds.request >= bounds.limit or not could_change(track, policy, now, bounds.request):
        return hold
    w = now - policy.window
    oom = r == MEMORY and track.pressure_at is not None and track.pressure_at >= w
    hot = track.hot_since is not None and track.hot_since <= w
    name = "memory.max" if r == MEMORY else "sm.max"
    if oom or hot:
        if oom:
            reason = f"{track.refused} allocation(s) refused by memory.max since the window opened"
        else:
            what = "use" if r == MEMORY else "use or throttling"
            reason = (f"{what} >= {policy.high:.0%} of {name} for {_secs(policy.window)} "
                      f"(lowest {fmt(r, track.hot_low)} of {fmt(r, q)})")
        if q >= bounds.limit:
            return Want("hold", q, f"wants to grow ({reason}) but is at its limit {fmt(r, bounds.limit)}", True)
        a = policy.align(r)
        base = max(_ceil(q * (1 + policy.grow_step)), q + policy.step_min(r),
                   _ceil((track.use if oom else track.hot_low) / policy.target))
        # hysteresis: never so far that the demand that asked for it (at least the lowest
        # use of the hot streak; after a refusal, at least the quota) would sit below the
        # low mark -- else a steady load could be grown and then shrunk back
        demand = max(q, track.hot_low if hot else 0) if oom else track.hot_low
        cap = max(int(demand / ((policy.low + policy.target) / 2)), q + 1)
        # rounded up to whole MiB / percent, unless that would pass the cap (tiny quotas)
        new = min(bounds.limit, max(min(_align_up(min(base, cap), a), cap), q + 1))
        return Want("grow", new, reason)
    cold = track.cold_since is not None and track.cold_since <= w
    if cold:
        peak = max(track.cold_peak, track.use)
        a = policy.align(r)
        floor = max(_align_up(_ceil(peak / policy.target), a), _align_up(_ceil(q * (1 - policy.shrink_step)), a))
        if r == MEMORY:
            floor = max(floor, peak + policy.margin(peak))
        new = max(bounds.request, floor)
        if new >= q:
            return hold     # at its request, or its use needs what it has: the resting state
        reason = (f"use < {policy.low:.0%} of {name} for {_secs(policy.window)} "
                  f"(peak {fmt(r, peak)} of {fmt(r, q)})")
        return Want("shrink", new, reason)
    return hold


# === a device's decisions ===

class Item(NamedTuple):
    slice: str
    device: int
    track: Track
    bounds: Bounds
    pool: object = None      # what its capacity is shared in (default: the device); a MIG slice's: its instance


@dataclass(frozen=True)
class Decision:
    slice: str
    device: int
    resource: str
    action: str          # "grow", "shrink", or "hold" (wanted to change, could not)
    old: int
    new: int
    reason: str
    request: int
    limit: int
    use: int
    shared: bool = False  # capacity was short: this grow got a share by request

    @property
    def changes(self) -> bool:
        return self.new != self.old

    def to_json(self) -> dict:
        return {"slice": self.slice, "device": self.device, "resource": self.resource,
                "action": self.action, "old": self.old, "new": self.new, "request": self.request,
                "limit": self.limit, "use": self.use, "reason": self.reason, "shared": self.shared}


def share(wants: dict, weights: dict, free: int, align: int = 1) -> dict:
    """Split `free` among claimants wanting `wants[k]` in proportion to `weights[k]`
    (water-filling: whoever needs less than their share gets what they need, the rest is
    split again among the others).  Grants are multiples of `align` unless they are the
    whole want; their sum never exceeds `free`.  All weights 0: equal shares."""
    grants = {k: 0 for k in wants}
    active = {k for k, v in wants.items() if v > 0}
    left = max(0, free)
    while active and left > 0:
        w = {k: weights.get(k, 0) for k in active}
        total = sum(w.values())
        if total <= 0:
            w = dict.fromkeys(active, 1)
            total = len(active)
        satisfied = {k for k in active if left * w[k] // total >= wants[k] - grants[k]}
        if satisfied:
            for k in satisfied:
                left -= wants[k] - grants[k]
                grants[k] = wants[k]
            active -= satisfied
            continue
        given = 0
        for k in sorted(active):
            g = left * w[k] // total
            g -= g % align
            grants[k] += g
            given += g
        left -= given
        break
    return grants


def plan(items, capacity, allocated, policy: Policy, now) -> list:
    """Decisions for every (device, resource): `items` the managed tracks (Item);
    `capacity[(device, resource)]` what the device has (None: unknown, so nothing grows);
    `allocated[(device, resource)]` the sum of the quotas of every slice on the device,
    managed or not (an item's `pool`, where it has one, stands for its device in both: a
    MIG slice's device 0 is its instance).  Returns the changes and the holds that wanted
    a change."""
    groups = {}
    for it in items:
        groups.setdefault((it.device if it.pool is None else it.pool, it.track.resource), []).append(it)
    out = []
    for (d, r), group in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        wants = [(it, decide(it.track, it.bounds, policy, now)) for it in group]
        total = allocated.get((d, r), 0)
        grows = []
        for it, w in wants:
            if w.action == "shrink":
                total -= it.track.quota - w.target
            if w.action == "grow":
                grows.append((it, w))
            elif w.action != "hold" or w.blocked:
                out.append(_decision(it, w, w.target))
        if not grows:
            continue
        cap = capacity.get((d, r))
        if cap is None:
            out += [_decision(it, w, it.track.quota, "hold", f"wants to grow ({w.reason}) but device {d}'s "
                              "capacity is unknown (no NVML: pass --device-memory)") for it, w in grows]
            continue
        free = cap - total
        key = {(it.slice): i for i, (it, _) in enumerate(grows)}
        want = {it.slice: w.target - it.track.quota for it, w in grows}
        need = sum(want.values())
        if need <= free:
            out += [_decision(it, w, w.target) for it, w in grows]
            continue
        weights = {it.slice: it.bounds.request for it, _ in grows}
        got = share(want, weights, free, policy.align(r))
        note = (f"capacity short: {fmt(r, need)} wanted, {fmt(r, max(free, 0))} free of {fmt(r, cap)} on "
                f"device {d}; shared by request ("
                + ", ".join(f"{it.slice} {fmt(r, it.bounds.request)}" for it, _ in grows) + ")")
        least = max(policy.align(r), policy.step_min(r) // 8)   # not worth a resize below this
        for c in sorted(key):
            it, w = grows[key[c]]
            if got[c] >= min(least, want[c]):
                out.append(_decision(it, w, it.track.quota + got[c], "grow", f"{w.reason}; {note}", True))
            else:
                out.append(_decision(it, w, it.track.quota, "hold", f"wants to grow ({w.reason}) but device {d} "
                                     f"is full: {note}"))
    return out


def _decision(it: Item, w: Want, new, action=None, reason=None, shared=False) -> Decision:
    return Decision(it.slice, it.device, it.track.resource, action or w.action, it.track.quota, new,
                    reason or w.reason, it.bounds.request, it.bounds.limit, it.track.use, shared)


@dataclass
class Simulation:
    """One device in memory, for tests and examples: a track per (slice, resource)
    from time `start`, decisions applied at once."""
    policy: Policy
    capacity: dict                               # resource -> capacity (None: unknown)
    bounds: dict                                 # (slice, resource) -> Bounds
    quotas: dict                                 # (slice, resource) -> quota
    fixed: dict = field(default_factory=dict)    # resource -> quota held by unmanaged slices
    start: float = 0.0
    tracks: dict = field(default_factory=dict)
    log: list = field(default_factory=list)

    def __post_init__(self):
        for (c, r), q in self.quotas.items():
            self.tracks[(c, r)] = new_track(r, self.start, q)

    def step(self, now, samples: dict) -> list:
        """samples: (slice, resource) -> Sample; its quota is taken from `quotas`."""
        for key, s in samples.items():
            self.tracks[key] = observe(self.tracks[key], s._replace(quota=self.quotas[key]), self.policy)
        items = [Item(c, 0, self.tracks[(c, r)], self.bounds[(c, r)]) for (c, r) in sorted(self.tracks)]
        allocated = {(0, r): self.fixed.get(r, 0) + sum(q for (_, rr), q in self.quotas.items() if rr == r)
                     for r in RESOURCES}
        decisions = plan(items, {(0, r): v for r, v in self.capacity.items()}, allocated, self.policy, now)
        for dec in decisions:
            if dec.changes:
                key = (dec.slice, dec.resource)
                self.quotas[key] = dec.new
                self.tracks[key] = restart(self.tracks[key], dec.new, now)
            self.log.append((now, dec))
        return decisions
