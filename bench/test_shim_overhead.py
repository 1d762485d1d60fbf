"""What the shim adds per hooked memory call, and at process start, on simgpu.

Measured side by side in one run: the same C program, alternately with and without
LD_PRELOAD, several rounds; medians compared.  Absolute times on a shared machine mean
little; the added nanoseconds and the ratio are the figures.  Run: `make bench`.
"""
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, shims_to_compare, sim_env
from tests.helpers.paths import CUDART13_REQUESTS
from vgpu import slices
from vgpu.paths import SHIM

ROUNDS = 7
CTL = str(Path(sys.executable).parent / "vgpu-ctl")


def _run(exe, env):
    out = subprocess.run([str(exe), "20000"], env=env, capture_output=True, text=True, check=True).stdout
    return {k: float(v) for k, v in (kv.split("=") for kv in out.split())}


def test_memory_call_overhead_with_shim_vs_without(tmp_path, bench_program, benchmark):
    exe = bench_program("overhead")
    base = sim_env(tmp_path / "node")
    shim = sim_env(tmp_path / "node", LD_PRELOAD=SHIM, VGPU_DIR=tmp_path / "vgpu", VGPU_SLICE="bench",
                   VGPU_MEMORY_LIMIT="8Gi")
    runs = {"without": [], "with": []}
    for i in range(ROUNDS):   # alternate which goes first, so drift hits both alike
        for name in (("without", "with") if i % 2 else ("with", "without")):
            runs[name].append(_run(exe, base if name == "without" else shim))
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    rows = [("cuMemAlloc+cuMemFree pair", "alloc_free_ns"), ("cuMemGetInfo", "meminfo_ns"),
            ("cuInit (shim init included)", "init_ns")]
    print(f"\n{'call':32} {'without ns':>11} {'with ns':>9} {'added ns':>9} {'ratio':>6}")
    for label, key in rows:
        a, b = med["without"][key], med["with"][key]
        print(f"{label:32} {a:11.1f} {b:9.1f} {b - a:9.1f} {b / a:6.2f}")
        benchmark.extra_info[key + "_added"] = b - a
        benchmark.extra_info[key + "_ratio"] = b / a
    benchmark.pedantic(lambda: _run(exe, shim), rounds=1, iterations=1)


def test_cuGetProcAddress_with_shim_vs_without(tmp_path, bench_program, benchmark):
    """The CUDA 13 runtime's start-up requests, replayed in its order (one in eight is
    hooked: tests/fixtures/cudart13-getprocaddress.tsv), with and without the shim and, with
    BENCH_BASELINE_SHIM, another build of it; interleaved rounds, medians."""
    exe = bench_program("procaddress")
    envs = {"without": sim_env(tmp_path / "node")}
    for name, shim in shims_to_compare().items():
        envs[name] = sim_env(tmp_path / "node", LD_PRELOAD=shim, VGPU_DIR=tmp_path / name, VGPU_SLICE="bench",
                             VGPU_MEMORY_LIMIT="8Gi")
    runs = {k: [] for k in envs}
    for i in range(7):
        for name in (list(envs) if i % 2 else list(envs)[::-1]):
            out = subprocess.run([str(exe), "100000", str(CUDART13_REQUESTS)], env=envs[name], capture_output=True,
                                 text=True, check=True).stdout
            runs[name].append(float(out.split("=")[1]))
    med = {k: statistics.median(v) for k, v in runs.items()}
    print("\ncuGetProcAddress_v2, the CUDA 13 runtime's requests in turn (ns per call, median of 7 runs)")
    for name, m in med.items():
        print(f"{name:10} {m:7.0f} ns" + ("" if name == "without" else f"  +{m - med['without']:.0f} ns"))
    benchmark.extra_info.update({f"procaddress {k} ns": v for k, v in med.items()})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def test_one_process_start_up(tmp_path, bench_program, benchmark):
    """main() to the end of the first allocation, one process at a time: without the shim, in
    a slice vgpu-ctl made on a node where `vgpu-ctl measure-context` ran (a container's case:
    the quota carries the context's cost), and standalone (the limit variables: the process
    makes its slice and removes it at exit, and asks NVML what its context costs).  Contexts
    cost the A10 profile's 256 MiB, as on a card.  Interleaved rounds, medians."""
    exe = bench_program("first_alloc")
    made = tmp_path / "made"
    node = {"SIMGPU_CONTEXT_OVERHEAD": "profile"}
    made.mkdir()
    subprocess.run([CTL, "measure-context", "--dir", str(made)], env=sim_env(tmp_path / "node", **node), check=True,
                   capture_output=True)
    slices.create(made, "one", {0: slices.device_quota(memory=8 << 30)}, overcommit=True)
    envs = {"without": sim_env(tmp_path / "node", **node),
            "made slice": sim_env(tmp_path / "node", LD_PRELOAD=SHIM, VGPU_DIR=made, VGPU_SLICE="one", **node),
            "standalone": sim_env(tmp_path / "node", LD_PRELOAD=SHIM, VGPU_DIR=tmp_path / "vgpu",
                                  VGPU_SLICE="alone", VGPU_MEMORY_LIMIT="8Gi", **node)}
    envs.update(_baseline_envs(tmp_path, envs["made slice"], node))
    for env in envs.values():   # simgpu makes its node, and a standalone slice its files, before the rounds
        subprocess.run([str(exe)], env=env, check=True, capture_output=True)
    runs = {k: [] for k in envs}
    for i in range(40):
        for name in (list(envs) if i % 2 else list(envs)[::-1]):
            before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
            out = subprocess.run([str(exe)], env=envs[name], capture_output=True, text=True, check=True).stdout
            # the whole process's page faults, exec to exit (each about 1 us here)
            faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
            runs[name].append({**{k: float(v) / 1000 for k, v in (kv.split("=") for kv in out.split())},
                               "faults": faults})
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    print("\none process                main() to first allocation   added    cuInit   added   page faults added")
    for name, m in med.items():
        base = med[_without_for(name, med)]
        print(f"{name:26} {m['first_alloc_ns']:20.0f} us {m['first_alloc_ns'] - base['first_alloc_ns']:6.0f} us "
              f"{m['init_ns']:6.0f} us {m['init_ns'] - base['init_ns']:5.0f} us {m['faults']:7.0f} "
              f"{m['faults'] - base['faults']:5.0f}")
        benchmark.extra_info[f"{name} first_alloc_us"] = m["first_alloc_ns"]
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def _baseline_envs(tmp_path, made_slice, node):
    """Another build of the shim, for the start-up rows side by side (docs/benchmarks.md).
    BENCH_BASELINE_SHIM alone: it runs in the same made slice, on this simgpu.  With
    BENCH_BASELINE_SIMGPU too (the directory of that tree's own simgpu libraries: an old
    commit whose files and simgpu differ from these), it runs on its own simgpu node, in a
    standalone slice that its first run made (the case closest to joining a made slice that
    trees without `vgpu-ctl measure-context` have), beside that simgpu without a shim."""
    shim = shims_to_compare().get("baseline")
    if not shim:
        return {}
    old_simgpu = os.environ.get("BENCH_BASELINE_SIMGPU")
    if not old_simgpu:
        return {"made slice, baseline": {**made_slice, "LD_PRELOAD": shim}}
    without = {**sim_env(tmp_path / "baseline-node", **node), "LD_LIBRARY_PATH": old_simgpu}
    return {"baseline without": without,
            "baseline, its slice": {**without, "LD_PRELOAD": shim, "VGPU_DIR": str(tmp_path / "baseline-vgpu"),
                                    "VGPU_SLICE": "old", "VGPU_MEMORY_LIMIT": "8Gi"}}


def _without_for(name, runs):
    """The row without a shim that `name` is measured against: its own simgpu's, if it has one."""
    return "baseline without" if name.startswith("baseline") and "baseline without" in runs else "without"


def test_32_processes_starting_at_once(tmp_path, bench_program, benchmark):
    """Shim init does not serialise processes: 32 start together in one standalone slice and
    each times its cuInit; rounds with and without the shim alternate, on a node simgpu made
    before (the node's first processes would time its making)."""
    exe = bench_program("overhead")
    envs = {"without": sim_env(tmp_path / "node"),
            "with": sim_env(tmp_path / "node", LD_PRELOAD=SHIM, VGPU_DIR=tmp_path / "vgpu", VGPU_SLICE="many",
                            VGPU_MEMORY_LIMIT="8Gi")}
    baseline = shims_to_compare().get("baseline")
    if baseline:   # another build of the shim, side by side (_baseline_envs)
        envs["baseline"] = {**envs["with"], "LD_PRELOAD": baseline,
                            "VGPU_DIR": str(tmp_path / "vgpu-baseline")}
        if os.environ.get("BENCH_BASELINE_SIMGPU"):   # on its own simgpu, beside that simgpu without a shim
            envs["baseline without"] = {**sim_env(tmp_path / "baseline-node"),
                                        "LD_LIBRARY_PATH": os.environ["BENCH_BASELINE_SIMGPU"]}
            envs["baseline"] = {**envs["baseline"], "LD_LIBRARY_PATH": os.environ["BENCH_BASELINE_SIMGPU"],
                                "SIMGPU_STATE_DIR": envs["baseline without"]["SIMGPU_STATE_DIR"]}
    for name in ("without", "baseline without"):
        if name in envs:
            subprocess.run([str(exe), "10", "info"], env=envs[name], check=True, capture_output=True)
    medians = {k: [] for k in envs}
    for i in range(12):
        for name in (list(envs) if i % 2 else list(envs)[::-1]):
            procs = [subprocess.Popen([str(exe), "10", "info"], env=envs[name], stdout=subprocess.PIPE, text=True)
                     for _ in range(32)]
            medians[name].append(statistics.median(float(p.communicate()[0].split()[0].split("=")[1]) / 1000
                                                   for p in procs))
    w, s = statistics.median(medians["without"]), statistics.median(medians["with"])
    print("\n32 processes at once, median cuInit per round (us):")
    for name, m in medians.items():
        print(f"{name + ' shim':13}", " ".join(f"{x:6.0f}" for x in m))
    print(f"median of the rounds: {w:.0f} us without, {s:.0f} us with ({s / w:.2f}x)")
    if "baseline" in medians:
        b = statistics.median(medians["baseline"])
        bw = statistics.median(medians[_without_for("baseline", medians)])
        print(f"baseline shim: {b:.0f} us ({b / bw:.2f}x{f' its simgpu without a shim: {bw:.0f} us' if bw != w else ''})")
        benchmark.extra_info.update(baseline_median_init_us=b)
    benchmark.extra_info.update(without_median_init_us=w, with_median_init_us=s, ratio=s / w)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def test_memory_cap_under_a_16_process_storm(tmp_path, bench_program, benchmark):
    """16 processes allocate and free random sizes for 5 s against a 2 GiB cap; a sampler
    outside the container (simgpu's NVML) records the most the device ever held."""
    programs = ROOT / "tests" / "programs"
    storm, sampler_exe = bench_program("shim_storm", programs), bench_program("shim_sampler", programs)
    node, vdir = tmp_path / "storm-node", tmp_path / "storm-vgpu"
    env = sim_env(node, LD_PRELOAD=SHIM, VGPU_DIR=vdir, VGPU_SLICE="c1", VGPU_MEMORY_LIMIT="2Gi")
    sampler = subprocess.Popen([str(sampler_exe), str(vdir / "c1" / "usage"), "5000"], env=sim_env(node),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    sampler.stdout.readline()
    out = subprocess.run([str(storm), "storm", "16", "5000", str(256 << 20), "7"], env=env, capture_output=True,
                         text=True, check=True).stdout
    seen = json.loads(sampler.communicate(timeout=30)[0].strip().splitlines()[-1])
    totals = json.loads(out.strip().splitlines()[0])
    over = max(0, seen["max_used"] - (2 << 30))
    print(f"\nstorm: {totals['allocs']} allocations, {totals['refused']} refused, {seen['samples']} referee "
          f"samples; most the device held: {seen['max_used']} bytes of a {2 << 30} cap -> {over} bytes over")
    benchmark.extra_info.update(bytes_over_cap=over, allocations=totals["allocs"])
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


REAP_64 = """
import statistics, sys, time
from pathlib import Path
from vgpu import procfs, slices
from vgpu._region import ffi, lib
d, asked = Path(sys.argv[1]), sys.argv[2] == "nvml"
slices.create(d, "c1", {0: slices.device_quota(64 << 30)}, overcommit=True)
path = d / "c1" / "usage"
clean = path.read_bytes()
staged = bytearray(clean)
u = ffi.cast("struct vgpu_usage *", ffi.from_buffer(staged))
for i in range(lib.VGPU_MAX_PROCS):
    u.procs[i].pid, u.charge[0][i], u.charge[1][i] = 4000000 + i, 1 << 30, 1 << 20
    if asked:   # a gone process of this pid namespace (the root one) whose start it recorded: NVML is asked
        u.procs[i].start_ticks, u.procs[i].pid_ns = 1, procfs.pid_ns()
dead = bytes(ffi.buffer(u))
times = []
for _ in range(20):
    path.write_bytes(dead)
    t = time.perf_counter()
    reaped = slices.reap_slice(d, "c1")
    times.append(time.perf_counter() - t)
    assert len(reaped) == lib.VGPU_MAX_PROCS
path.write_bytes(clean)
t = time.perf_counter()
for _ in range(20):
    assert slices.reap_slice(d, "c1") == []
print(statistics.median(times) * 1e3, (time.perf_counter() - t) / 20 * 1e3)
"""


def test_reap_of_64_dead_slots(tmp_path, benchmark):
    """What the host pays to give back the memory of 64 dead processes (vgpu-ctl reap,
    status and the node agent do this on every read): slots staged as dead ones look
    (pid and charges set, no lock held), reaped, staged again; as slots that say no more,
    and as gone processes of the root pid namespace whose start they recorded (the reaper
    then asks NVML whether the driver still keeps their memory; simgpu's NVML here)."""
    figures = {}
    for kind in ("plain", "nvml"):
        out = subprocess.run([sys.executable, "-c", REAP_64, str(tmp_path / kind), kind], env=sim_env(tmp_path / "node"),
                             capture_output=True, text=True, check=True).stdout.split()
        figures[kind] = [float(x) for x in out]
    print(f"\nreap of 64 dead slots (median of 20): {figures['plain'][0]:.2f} ms; NVML asked: "
          f"{figures['nvml'][0]:.2f} ms; of a slice with none dead: {figures['plain'][1]:.2f} ms")
    benchmark.extra_info.update(reap_64_dead_ms=figures["plain"][0], reap_64_dead_nvml_ms=figures["nvml"][0],
                                reap_none_dead_ms=figures["plain"][1])
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
