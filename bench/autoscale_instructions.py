"""Instructions per autoscale loop iteration at 1,000 slices, counted by callgrind: the
repeatable figure behind bench/test_autoscale_bench.py's CPU times (which move by a third
between runs on a shared machine).

    .venv/bin/python bench/autoscale_instructions.py [--baseline-src DIR] [STATE ...]

Each STATE ("in band", "idle at request", "saturated at limit"; default: in band and
saturated) is the bench's: 1,000 slices made and held as it makes them, 35 iterations to
reach a steady state (a window and the cooldown), then 10 counted iterations -- only the
autoscaler's `tick`, callgrind collecting between two toggles.  --baseline-src puts
another tree's `src` first on PYTHONPATH (its vgpu._region built there: docs/benchmarks.md)
and counts it in the same run, side by side.  About 45 s a state and tree.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
COUNTED = 10
TOGGLE_C = "#include <valgrind/callgrind.h>\nvoid toggle(void) { CALLGRIND_TOGGLE_COLLECT; }\n"


def _child(state, toggle_so):
    import ctypes
    sys.path.insert(0, str(HERE))
    import test_autoscale_bench as b
    from vgpu.autoscale import Autoscaler
    from vgpu.policy import Policy
    toggle = ctypes.CDLL(toggle_so).toggle
    directory = tempfile.mkdtemp()
    usage = b._populate(directory, state)
    scaler = Autoscaler(directory, Policy(), interval=1.0, use_nvml=False, device_memory=141 << 30,
                        log=lambda line: None)
    now = 1000.0
    for s in range(1, 36 + COUNTED):
        b._advance(usage, state, s)
        now += 1.0
        if s > 35:
            toggle()
        scaler.tick(now)
        if s > 35:
            toggle()


def _count(state, toggle_so, src=None):
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    r = subprocess.run(["valgrind", "--tool=callgrind", "--collect-atstart=no", "--callgrind-out-file=/dev/null",
                        sys.executable, __file__, "--child", state, toggle_so],
                       env=env, capture_output=True, text=True)
    m = re.search(r"Collected : (\d+)", r.stderr)
    if r.returncode or not m:
        sys.exit(f"callgrind run failed ({state}): {r.stderr.strip().splitlines()[-1:]}")
    return int(m.group(1)) // COUNTED


def main():
    if sys.argv[1:2] == ["--child"]:
        return _child(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-src", help="another tree's src directory, counted beside this one")
    ap.add_argument("states", nargs="*", default=["in band", "saturated at limit"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        toggle_so = os.path.join(tmp, "toggle.so")
        c = os.path.join(tmp, "toggle.c")
        Path(c).write_text(TOGGLE_C)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", c, "-o", toggle_so], check=True)
        print(f"{'1,000 slices':22} {'instructions per iteration':>27}" +
              (f" {'baseline':>14} {'ratio':>6}" if args.baseline_src else ""))
        for state in args.states:
            n = _count(state, toggle_so)
            line = f"{state:22} {n:27,}"
            if args.baseline_src:
                base = _count(state, toggle_so, args.baseline_src)
                line += f" {base:14,} {n / base:6.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
