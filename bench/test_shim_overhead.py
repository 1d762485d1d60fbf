"""What the shim adds per hooked memory call, and at process start, on simgpu.

Measured side by side in one run: the same C program, alternately with and without
LD_PRELOAD, several rounds; medians compared.  Absolute times on a shared machine mean
little; the added nanoseconds and the ratio are the figures.  Run: `make bench`.
"""
import re
import shutil
import statistics
import subprocess

import pytest

from conftest import sim_env
from vgpu.paths import SHIM

ROUNDS = 7


def _run(exe, env):
    out = subprocess.run([str(exe), "20000"], env=env, capture_output=True, text=True, check=True).stdout
    return {k: float(v) for k, v in (kv.split("=") for kv in out.split())}


def test_memory_call_overhead_with_shim_vs_without(tmp_path, bench_program, benchmark):
    exe = bench_program("overhead")
    base = sim_env(tmp_path / "node")
    shim = sim_env(tmp_path / "node", LD_PRELOAD=SHIM, VGPU_DIR=tmp_path / "vgpu", VGPU_CONTAINER="bench",
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


def _instructions(exe, env, n, loop, tmp_path):
    out = tmp_path / f"cg.{loop}.{n}.{'shim' if 'LD_PRELOAD' in env else 'base'}"
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", str(exe), str(n), loop],
                   env=env, capture_output=True, check=True)
    return int(re.search(r"^summary: (\d+)", out.read_text(), re.M).group(1))


@pytest.mark.skipif(not shutil.which("valgrind"), reason="valgrind not installed")
def test_instructions_added_per_call_by_the_shim(tmp_path, bench_program, benchmark):
    """Instruction counts are repeatable on a noisy machine: per call = slope over N."""
    exe = bench_program("overhead")
    base = sim_env(tmp_path / "node")
    shim = sim_env(tmp_path / "node", LD_PRELOAD=SHIM, VGPU_DIR=tmp_path / "vgpu", VGPU_CONTAINER="bench",
                   VGPU_MEMORY_LIMIT="8Gi")
    print(f"\n{'call':28} {'without instr':>14} {'with instr':>11} {'added':>7}")
    for label, loop in [("cuMemAlloc+cuMemFree pair", "alloc"), ("cuMemGetInfo", "info")]:
        per = {}
        for name, env in [("without", base), ("with", shim)]:
            lo, hi = (_instructions(exe, env, n, loop, tmp_path) for n in (1000, 3000))
            per[name] = (hi - lo) / 2000
        print(f"{label:28} {per['without']:14.0f} {per['with']:11.0f} {per['with'] - per['without']:7.0f}")
        benchmark.extra_info[loop + "_instructions_added"] = per["with"] - per["without"]
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
