"""Live resize: how long after `vgpu-ctl resize` returns does a running process obey it?

A probe process under the shim (cuda-bindings on simgpu) allocates and frees a 1.5 GiB
block in a loop and prints CLOCK_MONOTONIC whenever the outcome flips.  The controller
moves the cap between 2 GiB (fits) and 1 GiB (does not) and notes when resize returned;
the figure is probe-saw-it minus resize-returned (0 when the probe saw it before the call
had even returned).  Measured through the function `vgpu-ctl resize` runs and through the
real command line (from its process exiting).  Goal: <= 50 ms.  Run: `make bench`.
"""
import json
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

from conftest import sim_env
from vgpu import slices
from vgpu.paths import SHIM

GiB, MiB = 1 << 30, 1 << 20
ROUNDS = 20
CLI_ROUNDS = 5
GOAL_MS = 50
CTL = str(Path(sys.executable).parent / "vgpu-ctl")

PROBE = """
import json, sys, time
from cuda.bindings import driver as cu
size = int(sys.argv[1])
cu.cuInit(0)
cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1])
last = None
while True:
    r = cu.cuMemAlloc(size)
    fits = int(r[0]) == 0
    if fits:
        cu.cuMemFree(r[1])
    if fits != last:
        print(json.dumps([time.monotonic_ns(), fits]), flush=True)
        last = fits
"""


def _seen(probe, expect, timeout=10):
    ready, _, _ = select.select([probe.stdout], [], [], timeout)
    assert ready, "the probe did not notice the resize within 10 s"
    t, fits = json.loads(probe.stdout.readline())
    assert fits is expect
    return t


def test_resize_reaches_a_running_process_within_50ms(tmp_path, benchmark):
    directory = tmp_path / "vgpu"
    env = sim_env(tmp_path / "node")
    slices.create(directory, "bench", {0: slices.device_quota(2 * GiB)}, overcommit=True)
    probe = subprocess.Popen([sys.executable, "-c", PROBE, str(1536 * MiB)],
                             env={**env, "LD_PRELOAD": str(SHIM), "VGPU_DIR": str(directory),
                                  "VGPU_SLICE": "bench"},
                             stdout=subprocess.PIPE, text=True)
    try:
        _seen(probe, True, timeout=60)
        lat = {"function": [], "command line": []}     # (from call start, after return) ns
        for i in range(ROUNDS + CLI_ROUNDS):
            for cap, fits in ((GiB, False), (2 * GiB, True)):
                start = time.monotonic_ns()
                if i < ROUNDS:
                    slices.resize(directory, "bench", memory=cap, overcommit=True)
                    kind = "function"
                else:
                    subprocess.run([CTL, "resize", "bench", "--memory", str(cap), "--overcommit",
                                    "--dir", str(directory)], env=env, check=True, capture_output=True)
                    kind = "command line"
                returned = time.monotonic_ns()
                seen = _seen(probe, fits)
                lat[kind].append((seen - start, max(0, seen - returned)))
    finally:
        probe.kill()
        probe.wait()
    print(f"\n{'resize by':14} {'n':>3} {'obeyed before it returned':>26} {'after return ms (median/max)':>29}"
          f" {'from call start ms (median/max)':>32}")
    for kind, v in lat.items():
        after = [a / 1e6 for _, a in v]
        total = [t / 1e6 for t, _ in v]
        early = sum(1 for a in after if a == 0)
        whole = "(process start)" if kind == "command line" else \
            f"{statistics.median(total):.3f} / {max(total):.3f}"
        print(f"{kind:14} {len(v):3} {f'{early}/{len(v)}':>26} "
              f"{f'{statistics.median(after):.3f} / {max(after):.3f}':>29} {whole:>32}")
        key = kind.replace(" ", "_")
        benchmark.extra_info[f"{key}_after_return_median_ms"] = statistics.median(after)
        benchmark.extra_info[f"{key}_after_return_max_ms"] = max(after)
        assert max(after) <= GOAL_MS
    benchmark.extra_info["function_from_call_start_median_ms"] = \
        statistics.median(t / 1e6 for t, _ in lat["function"])
    benchmark.pedantic(lambda: slices.resize(directory, "bench", memory=GiB, overcommit=True), rounds=1,
                       iterations=1)
