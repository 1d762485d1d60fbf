"""Compute share, measured: accuracy, launch overhead, throttling cost, convergence.

All on simgpu, side by side in one run.  The referee is NVML per-process utilization
(vgpu.referee), i.e. the GPU time each tenant's kernels took on the device timeline.
Run: `make bench`; each table is printed and its figures saved in the benchmark JSON.
"""
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import time

import pytest

from conftest import ROOT, shims_to_compare, sim_env
from vgpu.paths import SHIM
from vgpu.referee import start as start_referee

DUTY = ROOT / "tests" / "programs" / "duty.c"
WARMUP_S, WINDOW_S = 1.5, 2.5
LONG_WINDOW_S = 6.0


@pytest.fixture(scope="module")
def duty(tmp_path_factory):
    exe = tmp_path_factory.mktemp("duty") / "duty"
    subprocess.run(["cc", "-std=gnu11", "-O2", "-I", str(ROOT / "csrc"), str(DUTY), "-o", str(exe), "-ldl"],
                   check=True)
    return exe


def tenant(state, vgpu_dir, name, share, shim=SHIM, **extra):
    return sim_env(state, LD_PRELOAD=shim, VGPU_DIR=vgpu_dir, VGPU_SLICE=name, VGPU_SM_LIMIT=f"{share}%", **extra)


def shares(duty, tmp_path, tenants, seconds, windows, how=(), shim=SHIM, **extra):
    """tenants: [(share, kernel_us)], each running `duty kernel_us seconds *how` (a mode and
    a grid) under `shim`, with `extra` in its environment; returns the referee's shares per
    window (the referee's environment has none of `extra`)."""
    state, vgpu_dir = tmp_path / f"node{time.monotonic_ns()}", tmp_path / f"vgpu{time.monotonic_ns()}"
    t0 = time.time()
    procs = [subprocess.Popen([str(duty), str(us), str(seconds), *map(str, how)], stdout=subprocess.DEVNULL,
                              env=tenant(state, vgpu_dir, f"t{i}", share, shim, **extra))
             for i, (share, us) in enumerate(tenants)]
    referee = start_referee([p.pid for p in procs], windows, t0, sim_env(state))
    out, err = referee.communicate(timeout=seconds + 30)
    for p in procs:
        p.wait(timeout=30)
    assert referee.returncode == 0, err
    return json.loads(out)


KERNELS = [("20 us", 20), ("200 us", 200), ("2 ms", 2000), ("20 ms", 20000)]


def _window(us):
    """Long kernels are few per second: a 20 ms kernel cut at a window's edge is most of a
    point of a 2.5 s window, so their cells are judged over 6 s (after a longer warm-up:
    the correction's memory is about 4 s)."""
    warm, span = (WARMUP_S, WINDOW_S) if us < 20000 else (2 * WARMUP_S, LONG_WINDOW_S)
    return warm + span + 0.5, [[warm, warm + span]]


def test_duty_cycle_accuracy_table(duty, tmp_path, benchmark):
    """|achieved - target| in points: one tenant, two and four sharing a device."""
    rows, worst = [], 0.0
    for target in (10, 30, 50, 70, 90):
        errs = []
        for _, us in KERNELS:
            [[got]] = shares(duty, tmp_path, [(target, us)], *_window(us))
            errs.append(abs(got - target))
        rows.append((f"1 tenant {target}%", errs))
    for a in (10, 30, 50):
        errs = []
        for _, us in KERNELS:
            [[ga, gb]] = shares(duty, tmp_path, [(a, us), (100 - a, us)], *_window(us))
            errs.append(max(abs(ga - a), abs(gb - (100 - a))))
        rows.append((f"2 tenants {a}/{100 - a}%", errs))
    four = (10, 20, 30, 40)
    errs = []
    for _, us in KERNELS:
        [got] = shares(duty, tmp_path, [(t, us) for t in four], *_window(us))
        errs.append(max(abs(g - t) for g, t in zip(got, four)))
    rows.append(("4 tenants 10/20/30/40%", errs))
    print(f"\n|achieved - target| (points, worst tenant; {WINDOW_S:.1f} s window after {WARMUP_S:.1f} s, "
          f"20 ms kernels {LONG_WINDOW_S:.0f} s after {2 * WARMUP_S:.0f} s)")
    print(f"{'':20}" + "".join(f"{k:>9}" for k, _ in KERNELS))
    for label, errs in rows:
        print(f"{label:20}" + "".join(f"{e:9.1f}" for e in errs))
        worst = max(worst, *errs)
    print(f"worst: {worst:.1f} points")
    benchmark.extra_info["accuracy"] = {label: errs for label, errs in rows}
    benchmark.extra_info["worst_points"] = worst
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


PAIR = (30, 70)
PAIR_CASES = [   # (what, kernel us, grid): 20 ms kernels either way (a wave is 72 blocks on the A10)
    ("1 block", 20000, 1),
    ("7200 blocks (100 waves of 200 us)", 200, 7200),
]


def _pairs(duty, tmp_path, benchmark, title, cases):
    """Run the 30/70% pair for each (label, kernel us, blocks, mode, environment) case with
    each shim to compare, and print each one's shares over 6 s after 4 s, error and worst
    1 s window's error (points)."""
    shims = shims_to_compare()
    windows = [[4.0, 10.0]] + [[4.0 + i, 5.0 + i] for i in range(6)]
    rows = []
    for label, us, blocks, mode, extra in cases:
        for name, shim in shims.items():
            got = shares(duty, tmp_path, [(PAIR[0], us), (PAIR[1], us)], 10.5, windows, (mode, blocks), shim, **extra)
            whole = max(abs(g - t) for g, t in zip(got[0], PAIR))
            worst = max(abs(g - t) for w in got[1:] for g, t in zip(w, PAIR))
            rows.append((name, f"{label}, {'a sync after each' if mode == 'sync' else 'back to back'}", got[0], whole,
                         worst))
    print(f"\n{PAIR[0]}/{PAIR[1]}% pairs of 20 ms kernels{title}: shares over 6 s after 4 s, error (points), "
          "worst 1 s window's error")
    width = max(len(label) for _, label, *_ in rows)
    for name, label, got, whole, worst in rows:
        print(f"{name:10} {label:{width}} {got[0]:5.1f} / {got[1]:5.1f}   {whole:4.1f}   {worst:4.1f}")
        benchmark.extra_info[f"{name}: {label}"] = {"shares": got, "error": whole, "worst_1s": worst}
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def test_side_by_side_pairs(duty, tmp_path, benchmark):
    """30/70% tenants of 20 ms kernels, launched back to back and with a cuStreamSynchronize
    after each (a training step that reads its loss), grids of 1 and 7200 blocks: each
    tenant's error over 6 s after 4 s, and the worst of the six 1 s windows in it, in
    points.  With BENCH_BASELINE_SHIM set, another build of the shim in the same rounds."""
    _pairs(duty, tmp_path, benchmark, "",
           [(what, us, blocks, mode, {}) for what, us, blocks in PAIR_CASES for mode in ("kernel", "sync")])


# nvidia-smi(1): a device's utilization sample period is 1/6 s to 1 s, by product
SAMPLE_PERIODS_MS = (167, 500, 1000)


def test_pairs_where_the_driver_samples_each_process(duty, tmp_path, benchmark):
    """The 1-block pair of test_side_by_side_pairs where the tenants' NVML answers as a
    driver that keeps one utilization sample per process every P ms, each covering the P ms
    before it, and answers with the average of a process's samples since the time asked
    (simgpu's SIMGPU_PROCESS_SAMPLE_MS): the correction's measure is then what NVML's
    samples say, not the exact timeline the other benches give it.  The referee still reads
    the exact timeline."""
    _pairs(duty, tmp_path, benchmark, " (1 block) where NVML samples each process",
           [(f"a sample every {period} ms", 20000, 1, mode, {"SIMGPU_PROCESS_SAMPLE_MS": str(period)})
            for period in SAMPLE_PERIODS_MS for mode in ("kernel", "sync")])


def _launch_ns(exe, env):
    out = subprocess.run([str(exe), "300000"], env=env, capture_output=True, text=True, check=True).stdout
    return float(out.split("=")[1])


def _launch_instructions(exe, env, tmp_path, n):
    out = tmp_path / f"cg.{n}.{time.monotonic_ns()}"
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", str(exe), str(n)], env=env,
                   capture_output=True, check=True)
    return int(re.search(r"^summary: (\d+)", out.read_text(), re.M).group(1))


def test_launch_overhead_with_shim_vs_without(bench_program, tmp_path, benchmark):
    """Per launch of a no-op kernel: without the shim, shim at 100%, shim limited (90%,
    within budget) in ceiling mode and in burst mode (guaranteed 30%, up to 90%, alone:
    the share board lends it the rest).  Time: median of alternating rounds; instructions:
    callgrind slope."""
    from vgpu import slices
    exe = bench_program("launch")
    made = tmp_path / "made"
    slices.create(made, "ceil", {0: slices.device_quota(sm=9000)}, overcommit=True, sm_mode="ceiling")
    slices.create(made, "burst", {0: slices.device_quota(sm=9000, sm_request=3000)}, overcommit=True)
    configs = {
        "without shim": sim_env(tmp_path / "node"),
        "shim, sm 100%": tenant(tmp_path / "node", tmp_path / "vgpu", "full", 100),
        "shim, 90% ceiling": sim_env(tmp_path / "node", LD_PRELOAD=SHIM, VGPU_DIR=made, VGPU_SLICE="ceil"),
        "shim, 30-90% burst": sim_env(tmp_path / "node", LD_PRELOAD=SHIM, VGPU_DIR=made, VGPU_SLICE="burst"),
    }
    times = {k: [] for k in configs}
    for i in range(5):
        for name in (list(configs) if i % 2 else list(reversed(configs))):
            times[name].append(_launch_ns(exe, configs[name]))
    base = statistics.median(times["without shim"])
    instr = {}
    if shutil.which("valgrind"):
        for name, env in configs.items():
            lo, hi = (_launch_instructions(exe, env, tmp_path, n) for n in (10000, 30000))
            instr[name] = (hi - lo) / 20000
    print(f"\n{'per launch':20} {'ns':>7} {'added ns':>9} {'instructions':>13} {'added':>6}")
    for name in configs:
        t = statistics.median(times[name])
        i = instr.get(name, float("nan"))
        print(f"{name:20} {t:7.1f} {t - base:9.1f} {i:13.0f} {i - instr.get('without shim', float('nan')):6.0f}")
        benchmark.extra_info[name] = {"ns": t, "added_ns": t - base, "instructions": i}
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def test_throttled_tenant_sleeps_instead_of_spinning(duty, tmp_path, benchmark):
    """CPU time a saturating tenant at 10% spends per second of wall time."""
    env = tenant(tmp_path / "node", tmp_path / "vgpu", "slow", 10)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    subprocess.run([str(duty), "20", "3"], env=env, stdout=subprocess.DEVNULL, check=True)
    wall = time.monotonic() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"\nthrottled tenant (10%, 20 us kernels): {100 * cpu / wall:.1f}% of a core over {wall:.1f} s")
    benchmark.extra_info["cpu_percent"] = 100 * cpu / wall
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def test_convergence_after_start_and_after_resize(duty, tmp_path, benchmark):
    """Time until the share is within 2 points, in 0.25 s windows: from start, and from a
    live resize 20% -> 60% (quota rewritten in place, as vgpu-ctl resize does)."""
    from vgpu._region import ffi
    import mmap

    state, vgpu_dir = tmp_path / "conv", tmp_path / "convv"
    env = tenant(state, vgpu_dir, "c", 20)
    seconds, resize_at, step = 7.0, 3.5, 0.25
    windows = [[i * step, (i + 1) * step] for i in range(int(seconds / step) - 1)]
    t0 = time.time()
    proc = subprocess.Popen([str(duty), "2000", str(seconds)], env=env, stdout=subprocess.DEVNULL)
    referee = start_referee([proc.pid], windows, t0, sim_env(state))
    time.sleep(max(0.0, t0 + resize_at - time.time()))
    fd = os.open(vgpu_dir / "c" / "quota", os.O_RDWR)
    with mmap.mmap(fd, ffi.sizeof("struct vgpu_quota")) as m:
        q = ffi.from_buffer("struct vgpu_quota *", m)
        q.generation += 1
        q.devices[0].sm_max = 6000
        q.generation += 1
        ffi.release(q)
    os.close(fd)
    out, _ = referee.communicate(timeout=60)
    proc.wait(timeout=30)
    series = [w[0] for w in json.loads(out)]

    def settle(start, target):
        for i, (a, _) in enumerate(windows):
            if a >= start and all(abs(s - target) <= 2 for s in series[i:i + 2] if series[i:i + 2]):
                return a - start
        return float("nan")

    after_start, after_resize = settle(0.0, 20), settle(resize_at, 60)
    print(f"\nwithin 2 points of the share: {after_start:.2f} s after start (20%), "
          f"{after_resize:.2f} s after resize to 60%")
    print("share per 0.25 s window:", " ".join(f"{s:.0f}" for s in series))
    benchmark.extra_info.update(after_start_s=after_start, after_resize_s=after_resize)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
