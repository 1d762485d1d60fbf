"""The deterministic figures: instructions the shim adds per hot call, counted by callgrind
(the same whatever else the machine is doing), measured in one place and written into
docs/benchmarks.md between two markers, so the docs cannot drift from the code.

  .venv/bin/python bench/figures.py --write   measure, and rewrite the docs' block
  .venv/bin/python bench/figures.py           measure, and say whether the docs match (exit 1 if not)
  .venv/bin/python bench/figures.py --baseline OTHER/libvgpu.so
                                              also measure another build of the shim (an older
                                              commit's, docs/benchmarks.md says how), side by side

`make bench` writes them first; bench/test_figures_in_docs.py fails when the block differs
from a fresh measurement.  Per call = the slope between runs of N and 3N calls (start-up
costs cancel; a warm-up run first, so that no measured run is the node's or the
slice's first).  Needs valgrind and a C compiler.

The second row's slice had CROWD processes at once, each holding memory in a slot of its
own, all gone before its warm-up run (which finds their slots and gives them back): what an
allocation costs must not grow with the processes that ever ran in a slice.  Before
slots_used came down again it did, by 7 instructions a slot: 297 / 351 / 519 / 738 after
1 / 8 / 32 / 64 processes.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.helpers.paths import CUDART13_REQUESTS  # noqa: E402  (after the path it needs)
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- bench/figures.py: begin (generated: do not edit by hand) -->"
END = "<!-- bench/figures.py: end -->"

# (row, program, argument after N, environment, N)
CROWD = 64   # the "crowd" slice: this many processes ran in it (at once, each holding memory) and exited
CALLS = (
    ("`cuMemAlloc` + `cuMemFree` pair (1 MiB)", "overhead", "alloc", "capped", 1000),
    (f"`cuMemAlloc` + `cuMemFree` pair, after {CROWD} processes ran in the slice", "overhead", "alloc", "crowd", 1000),
    ("`cuMemGetInfo`", "overhead", "info", "capped", 1000),
    ("`cuLaunchKernel`, sm 100% (unpaced)", "launch", None, "full", 10000),
    ("`cuLaunchKernel`, sm 90% ceiling (paced, within budget)", "launch", None, "paced", 10000),
    # n: the whole recorded sequence, so that the slope is two passes over it (the mean per request)
    ("`cuGetProcAddress_v2`, the CUDA 13 runtime's start-up requests in turn, one in eight hooked",
     "procaddress", str(CUDART13_REQUESTS), "capped",
     sum(1 for line in CUDART13_REQUESTS.read_text().splitlines() if line and not line.startswith(("#", "symbol")))),
)
# (row, program, runs before): instructions of a whole process, once, in a slice made on a
# node where `vgpu-ctl measure-context` ran (contexts costing the A10 profile's 256 MiB), after
# that many runs of it (at least one: a node's and a slice's first run is not measured).  Each
# run exits holding its context and 1 MiB: 31 of them fill the slice's 8 GiB.
REAPING = 31
STARTUP = (
    ("start-up, once per process: `exec` to the end of the first `cuMemAlloc` (1 MiB)", "first_alloc", 1),
    (f"the same, where {REAPING} processes before it exited holding memory and filled the cap (its "
     "allocation returns their charges)", "first_alloc", REAPING),
)


def _build(name, out):
    exe = out / name
    subprocess.run(["cc", "-std=gnu11", "-O2", "-Wall", "-Werror", "-I", str(ROOT / "csrc"),
                    str(ROOT / "bench" / "programs" / f"{name}.c"), "-o", str(exe), "-ldl", "-pthread"], check=True)
    return exe


def _environments(tmp, shim):
    from vgpu import slices
    from vgpu.sim import sim_environment
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SIMGPU_", "VGPU_", "CUDA_DEVICE_"))}
    base.update(sim_environment("a10", 1, str(tmp / "node"), base_env=base))
    made = tmp / "vgpu"
    slices.create(made, "capped", {0: slices.device_quota(memory=8 << 30)}, overcommit=True)
    slices.create(made, "crowd", {0: slices.device_quota(memory=8 << 30)}, overcommit=True)
    slices.create(made, "full", {0: slices.device_quota()}, overcommit=True)
    slices.create(made, "paced", {0: slices.device_quota(sm=9000)}, overcommit=True, sm_mode="ceiling")
    shimmed = {**base, "LD_PRELOAD": str(shim), "VGPU_DIR": str(made)}
    return base, {name: {**shimmed, "VGPU_SLICE": name} for name in ("capped", "crowd", "full", "paced")}


def _measured_node(tmp, shim, slice_):
    """(without, with the shim): a node of its own whose contexts cost memory, measured by
    `vgpu-ctl measure-context` before its slice was made (so its quota carries the figure)."""
    from vgpu import slices
    from vgpu.sim import sim_environment
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SIMGPU_", "VGPU_", "CUDA_DEVICE_"))}
    base.update(sim_environment("a10", 1, str(tmp / "measured-node"), base_env=base), SIMGPU_CONTEXT_OVERHEAD="profile")
    made = tmp / "measured"
    if not made.exists():
        made.mkdir()
        subprocess.run([str(Path(sys.executable).parent / "vgpu-ctl"), "measure-context", "--dir", str(made)],
                       env=base, capture_output=True, check=True)
    slices.create(made, slice_, {0: slices.device_quota(memory=8 << 30)}, overcommit=True)
    return base, {**base, "LD_PRELOAD": str(shim), "VGPU_DIR": str(made), "VGPU_SLICE": slice_}


def crowd(exe, env, n=CROWD):
    """n processes of the slice at once, each holding memory (a slot each), then gone: what
    the processes that ran in a slice leave behind for the next ones."""
    procs = [subprocess.Popen([str(exe), "1", "hold"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
             for _ in range(n)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != b"held":
                raise RuntimeError("a crowd process did not get its memory")
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            p.wait()
            p.stdout.close()


def _instructions(exe, arg, env, n, out):
    cg = out / f"cg.{exe.name}.{Path(arg).name if arg else None}.{n}.{env.get('VGPU_SLICE', 'base')}"
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={cg}", str(exe), str(n),
                    *([arg] if arg else [])], env=env, capture_output=True, check=True)
    return int(re.search(r"^summary: (\d+)", cg.read_text(), re.M).group(1))


def per_call(exe, arg, env, n, out):
    """Instructions per call: the slope between n and 3n calls.  A plain run comes first, so
    that what only a first process pays (simgpu making its node, the shim its slice's
    board) falls in neither: before it, the first measured run of the node paid 567k
    instructions the second did not, and the alloc row's "without" column read 283 low."""
    subprocess.run([str(exe), "1", *([arg] if arg else [])], env=env, capture_output=True, check=True)
    lo, hi = (_instructions(exe, arg, env, k, out) for k in (n, 3 * n))
    return (hi - lo) / (2 * n)


def measure(shim=None):
    """[(row, without, with, added)] for CALLS, instructions per call, rounded; with this
    project's shim, or the one at `shim`."""
    from vgpu.paths import SHIM
    shim = shim or SHIM
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        base, shimmed = _environments(tmp, shim)
        exes = {name: _build(name, tmp) for name in {c[1] for c in CALLS + STARTUP}}
        crowd(exes["overhead"], shimmed["crowd"])
        rows = []
        for row, program, arg, slice_, n in CALLS:
            without = per_call(exes[program], arg, base, n, tmp)
            # the median of three: under callgrind a paced run sleeps a varying number of
            # times (each a flush and a wait), and one run's figure moves by up to 13
            with_ = statistics.median(per_call(exes[program], arg, shimmed[slice_], n, tmp) for _ in range(3))
            rows.append((row, round(without), round(with_), round(with_ - without)))
        for k, (row, program, before) in enumerate(STARTUP):
            counts = []
            for env in _measured_node(tmp, shim, f"started{k}"):
                for _ in range(before):
                    subprocess.run([str(exes[program])], env=env, capture_output=True, check=True)
                counts.append(_instructions(exes[program], None, env, 0, tmp))
            rows.append((row, *counts, counts[1] - counts[0]))
        return rows


def render(rows):
    lines = [BEGIN,
             "| instructions (callgrind), per call | without shim | with shim | added by the shim |",
             "|---|---|---|---|"]
    lines += [f"| {row} | {w:,} | {s:,} | {a:,} |" for row, w, s, a in rows]
    lines.append(END)
    return "\n".join(lines)


# Not quite deterministic: the shim reaps dead slots at most every 0.2 s of wall time on
# its view path, and under callgrind a run takes long enough for a few more of those
# (cuMemGetInfo read 277-291 in three runs when a reap looked at all 64 slots; the same
# 194 in three since it looks at those that can be charged); a start-up reading /proc moves
# the alloc+free pair by about 5.  A figure is as documented within this.
TOLERANCE = 0.05


def parse(block_text):
    """[(row, without, with, added)] from a rendered block."""
    rows = []
    for line in block_text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].replace(",", "").isdigit():
            rows.append((cells[0], *(int(c.replace(",", "")) for c in cells[1:])))
    return rows


def drift(documented, measured):
    """The figures that differ by more than TOLERANCE: [(row, documented added, measured added)]."""
    doc = {r[0]: r for r in documented}
    out = []
    for row, w, s, a in measured:
        d = doc.get(row)
        if d is None or any(abs(x - y) > TOLERANCE * max(y, 1) for x, y in zip(d[1:], (w, s, a)) if y > 100):
            out.append((row, d[3] if d else None, a))
        elif abs(d[3] - a) > max(TOLERANCE * a, 10):
            out.append((row, d[3], a))
    return out


def block(text):
    """The generated block of a doc's text, or None."""
    m = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, re.S)
    return m.group(0) if m else None


def write(rows, doc=DOC):
    text = doc.read_text()
    old = block(text)
    if old is None:
        raise SystemExit(f"{doc}: no generated block (the markers {BEGIN!r} ... {END!r})")
    doc.write_text(text.replace(old, render(rows)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the block in docs/benchmarks.md")
    ap.add_argument("--baseline", metavar="LIBVGPU", help="another build of the shim, measured side by side")
    args = ap.parse_args(argv)
    rows = measure()
    print(render(rows))
    if args.baseline:
        print(f"\n| added by the shim | {args.baseline} | this tree's |\n|---|---|---|")
        for (row, *_, old), (_, *_, new) in zip(measure(args.baseline), rows):
            print(f"| {row} | {old:,} | {new:,} |")
    if args.write:
        write(rows)
        print(f"written into {DOC.relative_to(ROOT)}")
        return 0
    found = block(DOC.read_text())
    bad = drift(parse(found or ""), rows)
    for row, documented, measured in bad:
        print(f"{DOC.relative_to(ROOT)}: {row}: documented {documented}, measured {measured} added",
              file=sys.stderr)
    if bad:
        print("run with --write (and say in the docs what changed)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
