"""The autoscale policy (vgpu.policy), property-tested: the invariants hold for any
sequence of usage samples, and load that swings faster than the window moves nothing."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vgpu.policy import (MEMORY, SM, Bounds, Item, Policy, Sample, Simulation, decide, new_track,
                         observe, plan, share)
from vgpu.quantities import SHARE_FULL

MiB, GiB = 1 << 20, 1 << 30
WINDOW = 3.0
POLICY = Policy(window=WINDOW)
# derandomized (the same examples every run: deterministic, as the house style asks) and
# no example database in the working tree
FAST = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


# === strategies ===

@st.composite
def slices_on_a_device(draw):
    """1-4 managed slices (memory and SM bounds, starting quotas), what unmanaged slices
    hold, and the device's memory."""
    n = draw(st.integers(1, 4))
    bounds, quotas = {}, {}
    for i in range(n):
        c = f"c{i}"
        req = draw(st.integers(0, 8)) * 512 * MiB
        lim = req + draw(st.integers(0, 12)) * 512 * MiB
        bounds[(c, MEMORY)] = Bounds(req, lim)
        quotas[(c, MEMORY)] = draw(st.integers(req, lim))
        sreq = draw(st.integers(1, 40)) * 100
        slim = min(SHARE_FULL, sreq + draw(st.integers(0, 60)) * 100)
        bounds[(c, SM)] = Bounds(sreq, slim)
        quotas[(c, SM)] = draw(st.integers(sreq, slim))
    fixed = {MEMORY: draw(st.integers(0, 8)) * GiB, SM: draw(st.integers(0, 30)) * 100}
    capacity = {MEMORY: draw(st.sampled_from([24 * GiB, 40 * GiB])), SM: SHARE_FULL}
    return bounds, quotas, fixed, capacity


def load_steps(n_slices):
    """Per step: the time that passes, and per slice (memory use as a fraction of its cap,
    allocations refused, SM use as a fraction of its share, throttled share)."""
    per = st.tuples(st.floats(0, 1.0), st.sampled_from([0, 0, 0, 0, 1, 3]), st.floats(0, 1.0),
                    st.sampled_from([0.0, 0.0, 0.01, 0.3]))
    return st.lists(st.tuples(st.sampled_from([0.25, 0.5, 1.0]), st.lists(per, min_size=n_slices,
                                                                          max_size=n_slices)),
                    min_size=1, max_size=80)


def margin(use):
    return max(POLICY.memory_margin_min, -(-int(use * POLICY.memory_margin) // 1))


# === invariants for any sequence of samples ===

@FAST
@given(st.data())
def test_quotas_stay_within_request_limit_and_device_capacity_for_any_samples(data):
    bounds, quotas, fixed, capacity = data.draw(slices_on_a_device())
    names = sorted({c for c, _ in bounds})
    steps = data.draw(load_steps(len(names)))
    sim = Simulation(POLICY, capacity, bounds, dict(quotas), fixed)
    changed_at = {}
    now = 0.0
    for dt, loads in steps:
        now += dt
        before = dict(sim.quotas)
        samples = {}
        for c, (mem_frac, refused, sm_frac, throttled) in zip(names, loads):
            samples[(c, MEMORY)] = Sample(now, int(sim.quotas[(c, MEMORY)] * mem_frac), 0, refused)
            samples[(c, SM)] = Sample(now, int(sim.quotas[(c, SM)] * sm_frac), 0, throttled)
        decisions = sim.step(now, samples)
        for key, q in sim.quotas.items():
            assert bounds[key].request <= q <= bounds[key].limit, (key, q)
        for r in (MEMORY, SM):
            total_before = fixed[r] + sum(q for (_, rr), q in before.items() if rr == r)
            total = fixed[r] + sum(q for (_, rr), q in sim.quotas.items() if rr == r)
            # a grow never takes the device over; shrinks may leave it over, if it was
            assert total <= max(capacity[r], total_before), (r, total, capacity[r])
            if total > total_before:
                assert total <= capacity[r]
        for d in decisions:
            key = (d.slice, d.resource)
            if d.action == "shrink" and d.resource == MEMORY:
                use = samples[key].use
                assert d.new >= use + margin(use)          # never below use + margin
            if d.changes:
                assert now - changed_at.get(key, 0.0) >= POLICY.cooldown_s   # cooldown after every change
                assert (d.action == "grow") == (d.new > d.old)
                changed_at[key] = now
            else:
                assert d.action == "hold" and d.reason


@FAST
@given(st.data())
def test_nothing_grows_past_an_unknown_capacity(data):
    bounds, quotas, fixed, capacity = data.draw(slices_on_a_device())
    names = sorted({c for c, _ in bounds})
    sim = Simulation(POLICY, {MEMORY: None, SM: SHARE_FULL}, bounds, dict(quotas), fixed)
    now = 0.0
    for dt, loads in data.draw(load_steps(len(names))):
        now += dt
        before = {k: q for k, q in sim.quotas.items() if k[1] == MEMORY}
        sim.step(now, {(c, MEMORY): Sample(now, int(sim.quotas[(c, MEMORY)] * m), 0, refused)
                       for c, (m, refused, _, _) in zip(names, loads)})
        assert all(sim.quotas[k] <= q for k, q in before.items())


# === fair shares ===

@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.dictionaries(st.sampled_from("abcdef"), st.tuples(st.integers(0, 64 * GiB), st.integers(0, 16 * GiB)),
                       min_size=1), st.integers(-GiB, 64 * GiB), st.sampled_from([1, MiB]))
def test_short_capacity_is_shared_by_request(claims, free, align):
    wants = {k: w for k, (w, _) in claims.items()}
    weights = {k: r for k, (_, r) in claims.items()}
    got = share(wants, weights, free, align)
    assert sum(got.values()) <= max(free, 0)
    assert all(0 <= got[k] <= wants[k] for k in wants)
    if sum(wants.values()) <= free:
        assert got == wants
        return
    short = [k for k in wants if got[k] < wants[k]]
    assert short or free <= 0
    for i in short:     # the unsatisfied get the same amount per byte of request (alignment aside)
        for j in short:
            if weights[i] and weights[j]:
                assert abs(got[i] * weights[j] - got[j] * weights[i]) <= (align + 1) * (weights[i] + weights[j])
    for i in wants:     # nobody satisfied got more per request than an unsatisfied one could
        for j in short:
            if weights[i] and weights[j] and got[i] == wants[i]:
                assert got[i] * weights[j] <= (got[j] + align + 1) * weights[i]


def test_two_grows_on_a_full_device_are_shared_by_request_and_the_log_says_so():
    policy = Policy(window=1.0)
    a = new_track(MEMORY, 0.0, 2 * GiB)
    b = new_track(MEMORY, 0.0, 2 * GiB)
    for t in (0.5, 1.0, 1.5):
        a = observe(a, Sample(t, 2 * GiB - MiB, 2 * GiB, 1), policy)   # refusals: both want more
        b = observe(b, Sample(t, 2 * GiB - MiB, 2 * GiB, 1), policy)
    items = [Item("a", 0, a, Bounds(2 * GiB, 8 * GiB)), Item("b", 0, b, Bounds(GiB, 8 * GiB))]
    out = plan(items, {(0, MEMORY): 24 * GiB}, {(0, MEMORY): 24 * GiB - 768 * MiB}, policy, 1.5)
    got = {d.slice: d.new - d.old for d in out}
    assert got == {"a": 512 * MiB, "b": 256 * MiB}              # 768Mi free, 2:1 by request
    assert all(d.action == "grow" and d.shared for d in out)
    assert "capacity short" in out[0].reason and "shared by request (a 2Gi, b 1Gi)" in out[0].reason
    full = plan(items, {(0, MEMORY): 24 * GiB}, {(0, MEMORY): 24 * GiB}, policy, 1.5)
    assert [(d.action, "is full" in d.reason) for d in full] == [("hold", True), ("hold", True)]


# === no flapping ===

@FAST
@given(st.sampled_from([MEMORY, SM]), st.lists(st.tuples(st.integers(1, 5), st.floats(0.9, 1.0),
                                                         st.floats(0.0, 0.49)), min_size=4, max_size=40),
       st.sampled_from([0.25, 0.5]))
def test_load_swinging_faster_than_the_window_moves_nothing(resource, cycles, dt):
    """Each half cycle (hot, then cold) is shorter than the window: neither lasts a whole
    window, so the quota stays where it is."""
    q = 4 * GiB if resource == MEMORY else 4000
    bounds = Bounds(q // 4, q * 2)
    sim = Simulation(POLICY, {resource: 40 * GiB if resource == MEMORY else SHARE_FULL},
                     {("c", resource): bounds}, {("c", resource): q})
    now = 0.0
    for half_steps, high, low in cycles:
        steps = min(half_steps, int((WINDOW - 1e-9) / dt) - 1)
        for frac in (high, low):
            for _ in range(max(1, steps)):
                now += dt
                sim.step(now, {("c", resource): Sample(now, int(q * frac), q, 0)})
    assert sim.quotas[("c", resource)] == q
    assert [d for _, d in sim.log if d.changes] == []


@FAST
@given(st.sampled_from([MEMORY, SM]), st.integers(1, 64), st.floats(0.05, 3.0), st.floats(0.25, 1.0),
       st.integers(40, 120))
def test_a_steady_load_is_never_moved_back(resource, size, demand_frac, dt, steps):
    """Constant demand (memory held, or SM time wanted): the quota may move toward it, in
    one direction, and then stays -- never grown and then shrunk, or the other way (small
    quotas included, where the minimum step is large against them)."""
    q0 = size * 64 * MiB if resource == MEMORY else size * 50
    demand = int(q0 * demand_frac)
    bounds = Bounds(q0 // 8, q0 * 4)
    sim = Simulation(POLICY, {resource: 64 * GiB if resource == MEMORY else SHARE_FULL},
                     {("c", resource): bounds}, {("c", resource): q0})
    now = 0.0
    for _ in range(steps):
        now += dt
        q = sim.quotas[("c", resource)]
        used = min(demand, q)             # a slice cannot hold or run more than its quota
        wanted_more = demand > q
        pressure = (1 if wanted_more else 0) if resource == MEMORY else (0.5 if wanted_more else 0.0)
        sim.step(now, {("c", resource): Sample(now, used, q, pressure)})
    directions = {d.action for _, d in sim.log if d.changes}
    assert len(directions) <= 1, [(t, d.action, d.old, d.new) for t, d in sim.log]


# === single decisions, exactly ===

def run_track(resource, quota, uses, dt=0.5, pressure=0, policy=POLICY):
    t = new_track(resource, 0.0, quota)
    now = 0.0
    for u in uses:
        now += dt
        t = observe(t, Sample(now, u, quota, pressure), policy)
    return t, now


def test_memory_grows_at_once_on_a_refusal_after_the_cooldown_and_not_before():
    t, now = run_track(MEMORY, GiB, [GiB - 10 * MiB] * 5, pressure=1)     # 2.5 s < cooldown 3 s
    assert decide(t, Bounds(GiB, 4 * GiB), POLICY, now).action == "hold"
    t, now = run_track(MEMORY, GiB, [GiB - 10 * MiB] * 6, pressure=1)
    w = decide(t, Bounds(GiB, 4 * GiB), POLICY, now)
    assert w.action == "grow" and "6 allocation(s) refused" in w.reason
    assert w.target == 1449 * MiB      # (1Gi - 10Mi) / 70% = 1448.6Mi, rounded up to a MiB


def test_use_above_the_high_mark_for_a_whole_window_grows_by_at_least_a_step():
    uses = [int(0.95 * 4 * GiB)] * 5 + [int(0.5 * 4 * GiB)] + [int(0.92 * 4 * GiB)] * 5
    t, now = run_track(MEMORY, 4 * GiB, uses)
    assert decide(t, Bounds(GiB, 16 * GiB), POLICY, now).action == "hold"   # 2.5 s of the streak < 3 s
    t = observe(t, Sample(now + 0.5, int(0.92 * 4 * GiB), 4 * GiB, 0), POLICY)
    w = decide(t, Bounds(GiB, 16 * GiB), POLICY, now + 0.5)
    assert w.action == "grow" and w.target == 5384 * MiB     # 3.68Gi / 70%
    assert decide(t, Bounds(GiB, 5 * GiB), POLICY, now + 0.5).target == 5 * GiB   # never above the limit


def test_an_idle_slice_shrinks_by_steps_to_its_request_and_no_further():
    quota, request = 8 * GiB, 2 * GiB
    sim = Simulation(POLICY, {MEMORY: 24 * GiB}, {("c", MEMORY): Bounds(request, 8 * GiB)}, {("c", MEMORY): quota})
    now = 0.0
    while now < 60:
        now += 0.5
        sim.step(now, {("c", MEMORY): Sample(now, 100 * MiB, 0, 0)})
    steps = [(d.old, d.new) for _, d in sim.log]
    assert steps == [(8 * GiB, 6 * GiB), (6 * GiB, 4608 * MiB), (4608 * MiB, 3456 * MiB),
                     (3456 * MiB, 2592 * MiB), (2592 * MiB, 2 * GiB)]
    assert sim.quotas[("c", MEMORY)] == request


def test_a_throttled_sm_share_grows_toward_its_limit():
    sim = Simulation(POLICY, {SM: SHARE_FULL}, {("c", SM): Bounds(1000, 4000)}, {("c", SM): 1000})
    now = 0.0
    while now < 30:
        now += 0.5
        q = sim.quotas[("c", SM)]
        sim.step(now, {("c", SM): Sample(now, q, q, 0.8)})   # uses all of its share, waits 80% of the time
    assert [(d.old, d.new) for _, d in sim.log if d.changes] == [(1000, 1500), (1500, 2200), (2200, 3200),
                                                                  (3200, 4000)]
    assert sim.log[-1][1].action == "hold" and "at its limit 40%" in sim.log[-1][1].reason


def test_sm_without_data_holds():
    t, now = run_track(SM, 2000, [None] * 20)
    assert decide(t, Bounds(1000, 4000), POLICY, now).action == "hold"


@pytest.mark.parametrize("kwargs", [dict(low=0.8, target=0.7), dict(high=1.2), dict(window=0), dict(shrink_step=1),
                                    dict(cooldown=-1)])
def test_nonsense_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        Policy(**kwargs)
