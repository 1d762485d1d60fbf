"""The node agent's violation rules (vgpu.agent.judge), on hand-made snapshots: what is a
condition, when a condition becomes a violation, whom it names.  The end-to-end tests
(test_node_agent.py, test_do_no_harm.py) show the same rules on simgpu with real processes."""
from types import SimpleNamespace

from vgpu.agent.judge import ChargeHistory, Judge
from vgpu.agent.model import Attribution, ProcRow, SliceDevice, Snapshot
from vgpu.agent.settings import FORGED_CHARGE, Settings
from vgpu.quantities import SHARE_FULL

MiB, GiB = 1 << 20, 1 << 30
TOLERANCE = 64 * MiB     # Settings' default; a 2 GiB cap's 2% is less


def proc(pid, driver, charge, method="usage-file", util=None, state="sliced", name="a"):
    return ProcRow(pid, 0, driver, util, Attribution(name if state == "sliced" else None, method, state),
                   slot=0, charge=charge)


def slice_device(settings, processes, cap=2 * GiB, current=None, driver=None, sm_max=SHARE_FULL, sm_nvml=None,
                 gpu_time_ns=0, name="a"):
    """Slice `name` on device 0; its figures default to its processes' sums."""
    current = sum(p.charge or 0 for p in processes) if current is None else current
    driver = sum(p.driver or 0 for p in processes) if driver is None else driver
    sd = SliceDevice(name, 0, cap, current, driver, sm_max, sm_nvml, gpu_time_ns, settings)
    sd.processes = list(processes)
    return sd


def snapshot(t, *sds, processes=None, slots=None):
    active = {(sd.name, sd.device): sd for sd in sds}
    procs = [p for sd in sds for p in sd.processes] if processes is None else processes
    return Snapshot(t, True, None, {}, dict(active), procs, slots or {}, {}, active=active)


class Observer:
    """What Judge.update reads of the Observer: the processes it tracks."""

    def __init__(self, *pids):
        self.tracked = {pid: SimpleNamespace(start=pid * 10, visible=True) for pid in pids}


def kinds(judge, snap):
    return sorted(kind for kind, _ in judge.conditions(snap))


# === memory: gap and over-cap ===

def test_a_gap_is_a_condition_only_past_the_tolerance():
    st = Settings()
    judge = Judge(st)
    at_tolerance = proc(101, GiB + TOLERANCE, GiB)
    assert kinds(judge, snapshot(0, slice_device(st, [at_tolerance]))) == []
    past = proc(101, GiB + TOLERANCE + 1, GiB)
    assert kinds(judge, snapshot(1, slice_device(st, [past]))) == ["gap"]


def test_a_gap_becomes_a_violation_after_the_grace_period_with_the_settings_action():
    st = Settings(grace=0.5, actions={"gap": "kill"})
    judge, observer = Judge(st), Observer(101)
    hider = proc(101, GiB + 256 * MiB, GiB)
    for t in (100.0, 100.3):
        started, ended = judge.update(snapshot(t, slice_device(st, [hider])), observer)
        assert (started, ended) == ([], [])
        assert list(judge.pending) == [("gap", ("a", 0))] and not judge.active
    [v] = judge.update(snapshot(100.5, slice_device(st, [hider])), observer)[0]
    assert (v.kind, v.slice, v.device, v.since, v.started, v.action) == ("gap", "a", 0, 100.0, 100.5, "kill")
    assert v.offenders == [(101, 1010)]
    assert (v.detail["gap"], v.detail["memory_driver"], v.detail["memory_current"]) == (256 * MiB, GiB + 256 * MiB, GiB)
    assert judge.counts[("a", "gap")] == 1 and not judge.pending
    # it lasts: no second start
    assert judge.update(snapshot(101.0, slice_device(st, [hider])), observer) == ([], [])


def test_a_condition_gone_before_the_grace_period_is_forgotten_and_one_gone_after_ends():
    st = Settings(grace=0.5)
    judge, observer = Judge(st), Observer(101)
    hider, honest = proc(101, GiB + 256 * MiB, GiB), proc(101, GiB, GiB)
    judge.update(snapshot(0.0, slice_device(st, [hider])), observer)
    assert judge.update(snapshot(0.2, slice_device(st, [honest])), observer) == ([], [])
    assert not judge.pending
    judge.update(snapshot(1.0, slice_device(st, [hider])), observer)
    [v] = judge.update(snapshot(1.5, slice_device(st, [hider])), observer)[0]
    assert judge.update(snapshot(2.0, slice_device(st, [honest])), observer) == ([], [v])
    assert not judge.active


def test_a_held_violation_stays_active_while_its_condition_is_gone():
    st = Settings(grace=0.0)
    judge, observer = Judge(st), Observer(101)
    [v] = judge.update(snapshot(0.0, slice_device(st, [proc(101, GiB + 256 * MiB, GiB)])), observer)[0]
    honest = slice_device(st, [proc(101, GiB, GiB)])
    assert judge.update(snapshot(1.0, honest), observer, held=lambda key: key == ("gap", ("a", 0))) == ([], [])
    assert judge.update(snapshot(2.0, honest), observer) == ([], [v])


def test_over_cap_is_the_driver_past_the_cap_and_its_tolerance():
    st = Settings()
    judge = Judge(st)
    cap = GiB
    tol = st.tolerance_for(cap, 1)
    assert kinds(judge, snapshot(0, slice_device(st, [proc(101, cap + tol, 512 * MiB)], cap=cap))) == ["gap"]
    assert kinds(judge, snapshot(1, slice_device(st, [proc(101, cap + tol + 1, 512 * MiB)], cap=cap))) == \
        ["gap", "over-cap"]


def test_only_processes_certainly_of_the_slice_with_a_gap_of_their_own_are_offenders():
    st = Settings(grace=0.0)
    judge = Judge(st)
    honest = proc(101, GiB, GiB)
    hider = proc(102, GiB + 512 * MiB, GiB)
    unsure = proc(103, GiB + 512 * MiB, GiB, method=None, state="ambiguous")   # not certain: never named
    gone = proc(104, GiB + 512 * MiB, GiB, method="held-slot")                  # held by another: nothing to act on
    [(name, device, detail, offenders)] = judge.conditions(
        snapshot(0, slice_device(st, [honest, hider, unsure, gone], cap=8 * GiB))).values()
    assert (name, device) == ("a", 0)
    assert [pid for pid, _ in offenders] == [102]
    assert detail["gone"] == [104]
    assert detail["gap"] == 3 * 512 * MiB


def test_a_gap_from_a_rewritten_charge_names_no_one():
    """A charge that falls while the driver's figure stays was rewritten (not the process's
    own allocation): the gap is reported, its process listed as rewritten, not an offender."""
    st = Settings(grace=0.0)
    judge = Judge(st)
    judge.conditions(snapshot(0, slice_device(st, [proc(101, 2 * GiB, 2 * GiB)], cap=4 * GiB)))
    [(_, _, detail, offenders)] = judge.conditions(
        snapshot(1, slice_device(st, [proc(101, 2 * GiB, GiB)], cap=4 * GiB))).values()
    assert offenders == [] and detail["rewritten"] == [101]


def test_a_forged_charge_is_its_own_kind_naming_the_holder_of_the_forged_slot():
    st = Settings()
    judge = Judge(st)
    forged = SimpleNamespace(slot=3, pid=7, memory={0: FORGED_CHARGE}, shared=False, alive=True)
    p = proc(101, GiB, GiB)
    judge.lock_holders = lambda sd, slots: [101] if slots == [3] else []
    snap = snapshot(0, slice_device(st, [p], current=GiB + FORGED_CHARGE), slots={"a": [forged]})
    [((kind, key), (_, _, detail, offenders))] = judge.conditions(snap).items()
    assert (kind, key) == ("forged", ("a", 0))       # and nothing else judged on the slice
    assert detail["slots"] == [{"slot": 3, "pid": 7, "charge": FORGED_CHARGE, "alive": True}]
    assert [pid for pid, _ in offenders] == [101]
    forged.memory = {0: FORGED_CHARGE - 1}
    assert kinds(Judge(st), snap) == []


# === compute ===

def _compute_run(st, nvml_share, charged_share, seconds):
    """A slice held to sm.max 30% that NVML sees at `nvml_share` and the shim charges at
    `charged_share` (of SHARE_FULL), looked at every 0.25 s: the started violations."""
    judge, observer = Judge(st), Observer(101)
    started = []
    for i in range(int(seconds / 0.25) + 1):
        t = i * 0.25
        p = proc(101, GiB, GiB, util=nvml_share // 100)
        sd = slice_device(st, [p], sm_max=3000, sm_nvml=nvml_share,
                          gpu_time_ns=int(t * 1e9 * charged_share / SHARE_FULL))
        started += judge.update(snapshot(t, sd), observer)[0]
    return started


def test_compute_is_judged_on_the_window_average_past_the_margin():
    st = Settings(window=2.0)
    # NVML 60%, charged 30%: past sm.max and past what the shim charged by more than the margin
    [v] = _compute_run(st, 6000, 3000, 3.0)
    assert v.kind == "compute" and v.started >= 0.9 * st.window       # not before the window is full
    assert (v.detail["sm_nvml"], v.detail["sm_charged"]) == (6000, 3000)
    # the shim charged what NVML saw: paced, its own time (a neighbour's work is not its doing)
    assert _compute_run(st, 6000, 6000, 3.0) == []
    # within the margin of sm.max
    assert _compute_run(st, 3000 + st.compute_margin, 3000, 3.0) == []


# === unsliced ===

def test_an_unsliced_process_is_a_condition_only_when_slices_are_required():
    p = proc(200, GiB, None, method=None, state="unsliced")
    assert kinds(Judge(Settings()), snapshot(0, processes=[p])) == []
    conditions = Judge(Settings(require_slices=True)).conditions(snapshot(0, processes=[p]))
    assert list(conditions) == [("unsliced", ("", 200, 0))]


# === whose doing a gap is ===

def test_charge_history_counts_a_charge_fall_the_driver_did_not_match_as_rewritten():
    h = ChargeHistory()

    def look(driver, charge):
        h.see(SimpleNamespace(processes=[proc(101, driver, charge)]))
        return h.rewritten(101, 0)

    assert look(2 * GiB, 2 * GiB) == 0
    assert look(2 * GiB, GiB) == GiB                  # charge fell, driver did not
    assert look(2 * GiB + 256 * MiB, GiB) == GiB      # the driver rose: its own, not rewritten
    assert look(2 * GiB, GiB) == 768 * MiB            # the driver fell later, the charge not: given back
    assert look(2 * GiB, 2 * GiB) == 0                # never more than its gap
    h.see(SimpleNamespace(processes=[]))
    assert h.rewritten(101, 0) == 0                   # forgotten once not listed
