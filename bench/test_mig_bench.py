"""MIG slices: how long `vgpu-ctl create --mig` and `delete` take on simgpu.

Measured, not asserted (simgpu's NVML answers from a shared memory file; a real driver
takes far longer: NVIDIA's DRA driver notes that destroying a GPU instance "may take O(1 s)"
and that changing MIG mode can need a GPU reset).  Three figures, side by side in one run
on a simulated H100 80GB:
  - the command line, per command (each a fresh vgpu-ctl process: Python, click, NVML
    initialisation), against a software slice's create and delete as the baseline;
  - the first create, which also turns MIG mode on, and a delete --disable-mig;
  - vgpu.mig's functions in one process (no process start), to show what the MIG work
    itself costs.
Run: `make bench` (or pytest bench/test_mig_bench.py -s).
"""
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from vgpu.sim import sim_environment

CTL = str(Path(sys.executable).parent / "vgpu-ctl")
ROUNDS = 10
FUNCTION_ROUNDS = 50

LIBRARY = """
import json, sys, time
from vgpu import mig, slices
directory, rounds = sys.argv[1], int(sys.argv[2])
out = {"create": [], "delete": []}
for i in range(rounds):
    t = time.perf_counter()
    mig.create_slice(directory, "f", 0, "3g.40gb", slices.device_quota())
    out["create"].append((time.perf_counter() - t) * 1e3)
    t = time.perf_counter()
    mig.delete_slice(directory, "f")
    out["delete"].append((time.perf_counter() - t) * 1e3)
print(json.dumps(out))
"""


def _env(tmp_path):
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIMGPU_", "VGPU_", "CUDA_"))}
    env.update(sim_environment("h100-80g", 1, str(tmp_path / "node"), base_env=env))
    env["VGPU_DIR"] = str(tmp_path / "vgpu")
    return env


def _timed(env, *args):
    t = time.perf_counter()
    subprocess.run([CTL, *args], env=env, check=True, capture_output=True, text=True)
    return (time.perf_counter() - t) * 1e3


def _summary(values):
    return [statistics.median(values), max(values)]


def test_mig_slice_create_and_delete_time(tmp_path, benchmark):
    env = _env(tmp_path)
    first_create = _timed(env, "create", "m0", "--mig", "3g.40gb")     # turns MIG mode on
    first_delete = _timed(env, "delete", "m0", "--disable-mig")        # and off again
    figures = {"software": {"create": [], "delete": []}, "mig": {"create": [], "delete": []}}
    _timed(env, "create", "hold", "--mig", "1g.10gb", "--placement", "6")  # MIG mode stays on from here
    for i in range(ROUNDS):
        figures["mig"]["create"].append(_timed(env, "create", f"m{i}", "--mig", "3g.40gb"))
        figures["mig"]["delete"].append(_timed(env, "delete", f"m{i}"))
    _timed(env, "delete", "hold", "--disable-mig")
    for i in range(ROUNDS):   # the baseline: the same commands for a software slice
        figures["software"]["create"].append(_timed(env, "create", f"s{i}", "--memory", "4Gi"))
        figures["software"]["delete"].append(_timed(env, "delete", f"s{i}"))
    out = subprocess.run([sys.executable, "-c", LIBRARY, str(tmp_path / "lib"), str(FUNCTION_ROUNDS)], env=env,
                         check=True, capture_output=True, text=True)
    library = json.loads(out.stdout)

    print(f"\n{'on simgpu h100-80g':40} {'median ms':>10} {'max ms':>8}")
    rows = [("vgpu-ctl create (software slice)", figures["software"]["create"]),
            ("vgpu-ctl delete (software slice)", figures["software"]["delete"]),
            ("vgpu-ctl create --mig 3g.40gb", figures["mig"]["create"]),
            ("vgpu-ctl delete (MIG slice)", figures["mig"]["delete"]),
            ("first create --mig (MIG mode turned on)", [first_create]),
            ("delete --disable-mig (turned off)", [first_delete]),
            (f"mig.create_slice, in-process (n={FUNCTION_ROUNDS})", library["create"]),
            (f"mig.delete_slice, in-process (n={FUNCTION_ROUNDS})", library["delete"])]
    for label, values in rows:
        med, top = _summary(values)
        print(f"{label:40} {med:10.1f} {top:8.1f}")
    benchmark.extra_info.update({
        "cli_software_create_ms": _summary(figures["software"]["create"]),
        "cli_software_delete_ms": _summary(figures["software"]["delete"]),
        "cli_mig_create_ms": _summary(figures["mig"]["create"]),
        "cli_mig_delete_ms": _summary(figures["mig"]["delete"]),
        "cli_first_create_enabling_mig_ms": first_create,
        "cli_delete_disable_mig_ms": first_delete,
        "function_mig_create_ms": _summary(library["create"]),
        "function_mig_delete_ms": _summary(library["delete"])})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
