"""The vgpu demo: four tenants packed on one GPU, without vgpu, with vgpu, and with vgpu's
autoscaler -- and only what was measured.

The scenario: one training job (8 GiB, runs flat out) and three inference services (2 GiB
each, a request is 2 ms of GPU time, one every ~15 ms) on one 24 GiB A10 -- simgpu's `a10`
profile.  One inference service leaks 1 GiB a second.  The same four cuda-python programs
run three times, on a fresh simulated node each time:

  1. without vgpu: plain time-slicing, no caps;
  2. with vgpu: a slice each (training 70%, inference 20% each: ceilings, not guarantees,
     adding up to 130%), and halfway through, training is resized live to 40%;
  3. with vgpu and the autoscaler: training starts at 40% with room to grow, the inference
     services are guaranteed 10% with a ceiling of 20%; `vgpu-ctl autoscale` moves the
     ceilings with the load;
  4. with vgpu in burst mode: training guaranteed 40% with a ceiling of 100%, inference 20%
     each -- whatever inference leaves idle goes to training at once, and comes back the
     moment inference wants it (no windows).

Every change goes through the `vgpu-ctl` command line, printed as it runs.  Shares are
measured from outside (vgpu.referee: NVML per-process utilization), work and latency by
the tenants themselves.  Run with `make demo`; with matplotlib installed, the timeline of
shares and memory is saved as demo-timeline.png.  `--quick` runs short phases (a test).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

from vgpu.paths import shim_path
from vgpu.referee import start as start_referee
from vgpu.sim import sim_environment

GiB = 1 << 30
CTL = os.path.join(os.path.dirname(sys.executable), "vgpu-ctl")
REQUEST_GAP_S = 0.015      # an inference service's pause between requests

# name, memory (GiB), SM ceiling in phase 2 (%), role
TENANTS = [
    ("train", 8, 70, "train"),
    ("infer-a", 2, 20, "infer"),
    ("infer-b", 2, 20, "infer"),
    ("infer-leaky", 2, 20, "leak"),
]
INFER = [t[0] for t in TENANTS if t[3] != "train"]
AUTOSCALE = ["--window", "2s", "--interval", "250ms", "--low", "70%", "--target", "80%"]


class Timing:
    def __init__(self, quick):
        self.run_s = 6.0 if quick else 14.0               # each phase
        self.resize_at = self.run_s / 2                    # phase 2: training 70% -> 40%
        self.before = (1.5, self.resize_at - 0.5) if quick else (2.0, self.resize_at - 0.5)
        self.after = (self.resize_at + 1.0, self.run_s - 0.5)
        self.alone_s = 2.0 if quick else 3.0


# === one tenant (a child process) ===

def check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    return int(err), (rest[0] if len(rest) == 1 else rest)


def tenant(role, seconds, memory_gib):
    """Run one workload; print a JSON line of progress every 0.25 s and a final one with
    each request's (end time, latency)."""
    from cuda.bindings import driver as cu

    cu.cuInit(0)
    cu.cuCtxSetCurrent(check(cu.cuDevicePrimaryCtxRetain(0))[1])
    _, module = check(cu.cuModuleLoadData(b"any image: simgpu runs kernels by name"))
    _, step_kernel = check(cu.cuModuleGetFunction(module, b"sim_2000us"))     # a training step
    _, infer_kernel = check(cu.cuModuleGetFunction(module, b"sim_500us"))     # part of a request
    _, stream = check(cu.cuStreamCreate(0))
    held, ooms, work, peak, latencies = [], 0, 0, 0, []

    def alloc(n_gib):
        nonlocal ooms, peak
        for _ in range(n_gib):
            err, ptr = check(cu.cuMemAlloc(GiB))
            if err:
                ooms += 1
                return False
            held.append(ptr)
            peak = max(peak, len(held))
        return True

    alloc(memory_gib - 1 if role == "train" else memory_gib)   # the working set (training: +1 GiB per step)
    start = time.monotonic()
    wall0 = time.time()
    next_report = start + 0.25
    next_leak = start + 1.0
    while (now := time.monotonic()) < start + seconds:
        if role == "train":
            # every 50 steps the job needs 1 GiB more for a moment (activations): 8 GiB at peak
            if work % 50 == 0 and alloc(1):
                cu.cuMemFree(held.pop())
            for _ in range(10):
                cu.cuLaunchKernel(step_kernel, 72, 1, 1, 256, 1, 1, 0, stream, 0, 0)
            cu.cuStreamSynchronize(stream)
            work += 10
        else:
            # a request: 4 kernels (2 ms of GPU), then idle until the next arrives
            for _ in range(4):
                cu.cuLaunchKernel(infer_kernel, 72, 1, 1, 256, 1, 1, 0, stream, 0, 0)
            cu.cuStreamSynchronize(stream)
            done = time.monotonic()
            latencies.append((round(wall0 + done - start, 4), round((done - now) * 1000, 3)))
            work += 1
            time.sleep(REQUEST_GAP_S)
            if role == "leak" and now >= next_leak:   # forgets to free 1 GiB every second
                alloc(1)
                next_leak += 1.0
        if now >= next_report:
            print(json.dumps({"t": wall0 + now - start, "work": work, "ooms": ooms, "mem": len(held)}), flush=True)
            next_report += 0.25
    print(json.dumps({"final": True, "work": work, "ooms": ooms, "peak": peak, "latencies": latencies}), flush=True)


# === vgpu-ctl, printed ===

def ctl(args, env, quiet=False):
    """Run `vgpu-ctl ARGS`, printing the command and (unless quiet) its output, indented."""
    print("  $ vgpu-ctl " + " ".join(shlex.quote(a) for a in args), flush=True)
    out = subprocess.run([CTL, *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"vgpu-ctl {' '.join(args)} failed ({out.returncode}):\n{out.stderr}")
    if not quiet:
        for line in (out.stderr + out.stdout).splitlines():
            print("    " + line)
    return out.stdout


# === a phase ===

def _collect(stream, into):
    for line in stream:
        if line.startswith("{"):
            into.append(json.loads(line))


def node_env(state, vgpu_dir):
    env = {**os.environ, **sim_environment("a10", 1, state), "PYTHONUNBUFFERED": "1"}
    for k in [k for k in env if k.startswith(("VGPU_", "CUDA_DEVICE_"))]:
        del env[k]
    if vgpu_dir:
        env["VGPU_DIR"] = vgpu_dir
    return env


def run_phase(label, env, timing, names, with_vgpu, during=None):
    """Run the tenants `names` for one phase; `during(elapsed)` is called every 0.25 s."""
    procs = {}
    t0 = time.time()
    for name, mem, _, role in TENANTS:
        if name not in names:
            continue
        child = dict(env)
        if with_vgpu:
            child.update(LD_PRELOAD=str(shim_path()), VGPU_SLICE=name)
        procs[name] = subprocess.Popen([sys.executable, __file__, "--tenant", role, str(timing.run_s), str(mem)],
                                       env=child, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seconds = int(timing.run_s)
    windows = [list(timing.before), list(timing.after)] + [[i, i + 1.0] for i in range(seconds)]
    referee = start_referee([p.pid for p in procs.values()], windows, t0, env)
    lines = {name: [] for name in procs}
    readers = [threading.Thread(target=_collect, args=(p.stdout, lines[name]), daemon=True)
               for name, p in procs.items()]
    for r in readers:
        r.start()
    shown = 0.0
    while any(p.poll() is None for p in procs.values()):
        time.sleep(0.25)
        elapsed = time.time() - t0
        if during:
            during(elapsed)
        progress = "  ".join(f"{n} {(lines[n][-1] if lines[n] else {}).get('work', 0):4}" for n in procs)
        line = f"[{label}] {min(elapsed, timing.run_s):4.1f}/{timing.run_s:.0f} s  work: {progress}"
        if sys.stdout.isatty():
            print("\r" + line, end="", flush=True)
        elif elapsed - shown >= 4:      # a log gets a line every 4 s
            print(line, flush=True)
            shown = elapsed
    if sys.stdout.isatty():
        print()
    for r in readers:
        r.join(timeout=10)
    out, _ = referee.communicate(timeout=60)
    shares = json.loads(out) if referee.returncode == 0 else [[0.0] * len(procs)] * len(windows)
    results = {}
    for i, (name, got) in enumerate(lines.items()):
        reports = [g for g in got if "t" in g]
        final = got[-1] if got and got[-1].get("final") else {}
        results[name] = {
            "final": final, "t0": t0,
            "share": {"before": shares[0][i], "after": shares[1][i]},
            "timeline": [w[i] for w in shares[2:]],
            "memory": [(g["t"] - t0, g["mem"]) for g in reports],
            "rate": {k: _rate(reports, t0, *getattr(timing, k)) for k in ("before", "after")},
            "latency": {k: _percentiles(final.get("latencies", []), t0, *getattr(timing, k))
                        for k in ("before", "after")},
        }
    return results


def _rate(reports, t0, a, b):
    """Work per second between a and b seconds into the phase, from the progress reports."""
    inside = [g for g in reports if a <= g["t"] - t0 <= b]
    if len(inside) < 2:
        return 0.0
    return (inside[-1]["work"] - inside[0]["work"]) / (inside[-1]["t"] - inside[0]["t"])


def _percentiles(latencies, t0, a, b):
    got = sorted(ms for t, ms in latencies if a <= t - t0 <= b)
    if not got:
        return (0.0, 0.0)

    def pick(q):
        return got[min(len(got) - 1, int(q * len(got)))]
    return (pick(0.50), pick(0.99))


# === the phases ===

def demand_alone(tmp, timing):
    """What one inference service uses with the GPU to itself: its demand."""
    env = node_env(os.path.join(tmp, "node-alone"), None)
    t = Timing.__new__(Timing)
    t.run_s, t.before, t.after = timing.alone_s, (0.5, timing.alone_s - 0.2), (0.5, timing.alone_s - 0.2)
    res = run_phase("alone       ", env, t, ["infer-a"], False)
    return res["infer-a"]["share"]["before"], res["infer-a"]["latency"]["before"]


def phase_with_vgpu(tmp, timing):
    vgpu_dir = os.path.join(tmp, "vgpu")
    env = node_env(os.path.join(tmp, "node-2"), vgpu_dir)
    print(f"  $ export VGPU_DIR={vgpu_dir}")
    for name, mem, share, _ in TENANTS:
        ctl(["create", name, "--memory", f"{mem}Gi", "--sm", f"{share}%"], env, quiet=name != "infer-leaky")
    print("    (the SM shares add up to 130%: more than the GPU, so they cannot all be guaranteed)")
    resized = []

    def during(elapsed):
        if not resized and elapsed >= timing.resize_at:
            resized.append(elapsed)
            print()
            ctl(["resize", "train", "--sm", "40%"], env)
    res = run_phase("with vgpu   ", env, timing, [t[0] for t in TENANTS], True, during)
    return res, vgpu_dir, env


def phase_autoscaled(tmp, timing, vgpu_dir):
    env = node_env(os.path.join(tmp, "node-3"), vgpu_dir)
    ctl(["reap"], env)      # the last phase's processes are gone: their slots go back
    spec = os.path.join(tmp, "autoscaled.yaml")
    with open(spec, "w") as f:
        f.write("slices:\n  train: {memory: 8Gi, sm: 40%, sm-limit: 100%}\n" +
                "".join(f"  {n}: {{memory: 2Gi, sm: 20%, sm-request: 10%}}\n" for n in INFER))
    print(f"  $ cat {spec}")
    for line in open(spec):
        print("    " + line.rstrip())
    ctl(["apply", "-f", spec], env)
    print("  $ vgpu-ctl " + " ".join(["autoscale", *AUTOSCALE]) + " &")
    scaler = subprocess.Popen([CTL, "autoscale", *AUTOSCALE], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    decisions = []
    reader = threading.Thread(target=_collect, args=(scaler.stdout, decisions), daemon=True)
    reader.start()
    t_start = time.time()
    try:
        res = run_phase("autoscaled  ", env, timing, [t[0] for t in TENANTS], True)
    finally:
        scaler.terminate()
        scaler.wait(10)
        reader.join(5)
    moves = [d for d in decisions if d.get("event") == "resize" and d.get("resource") == "sm"]
    for d in moves:
        print(f"    {_ts(d['ts']) - t_start:4.1f} s  {d['slice']}: sm.max {d['old'] / 100:g}% -> "
              f"{d['new'] / 100:g}%  ({d['reason']})")
    final = {}
    for d in moves:
        final[d["slice"]] = d["new"] / 100
    return res, final


def phase_burst(tmp, timing):
    vgpu_dir = os.path.join(tmp, "vgpu-burst")
    env = node_env(os.path.join(tmp, "node-4"), vgpu_dir)
    print(f"  $ export VGPU_DIR={vgpu_dir}")
    ctl(["create", "train", "--memory", "8Gi", "--sm", "100%", "--sm-request", "40%"], env)
    for name in INFER:
        ctl(["create", name, "--memory", "2Gi", "--sm", "20%"], env, quiet=True)
    return run_phase("burst       ", env, timing, [t[0] for t in TENANTS], True)


def _ts(text):
    from datetime import datetime
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=__import__("datetime").timezone.utc
                                                                   ).timestamp()


# === the report ===

def report(timing, demand, without, with_, auto, ceilings3, burst):
    w0, w1 = timing.before, timing.after
    print(f"\nSM share: % of the GPU's time, measured by NVML; before the resize = {w0[0]:g}-{w0[1]:g} s, "
          f"after = {w1[0]:g}-{w1[1]:g} s of each phase.")
    print(f"Demand: an inference service alone on the GPU uses {demand[0]:.1f}%; training takes all it can get.\n")
    cols = ["ceiling", "without", "with vgpu", "ceiling", "after resize", "ceiling", "autoscaled", "share", "burst"]
    print(f"{'tenant':12} | {cols[0]:>7} {cols[1]:>8} {cols[2]:>9} | {cols[3]:>7} {cols[4]:>12} | "
          f"{cols[5]:>7} {cols[6]:>10} | {cols[7]:>7} {cols[8]:>6}")
    busy = {"without": 0.0, "with": 0.0, "after": 0.0, "auto": 0.0, "burst": 0.0}
    for name, _, share, role in TENANTS:
        after_ceiling = 40 if role == "train" else share
        c3 = ceilings3.get(name, 40 if role == "train" else share)
        c4 = "40-100%" if role == "train" else f"{share}%"
        a, b, c, d, e = (without[name]["share"]["before"], with_[name]["share"]["before"],
                         with_[name]["share"]["after"], auto[name]["share"]["after"], burst[name]["share"]["after"])
        for k, v in zip(busy, (a, b, c, d, e)):
            busy[k] += v
        print(f"{name:12} | {share:>6}% {a:8.1f} {b:9.1f} | {after_ceiling:>6}% {c:12.1f} | {c3:>6g}% {d:10.1f} | "
              f"{c4:>7} {e:6.1f}")
    print(f"{'GPU busy':12} | {'':7} {busy['without']:8.1f} {busy['with']:9.1f} | {'':7} {busy['after']:12.1f} | "
          f"{'':7} {busy['auto']:10.1f} | {'':7} {busy['burst']:6.1f}")

    print("\nWork per second and inference latency (ms, p50/p99), by the same windows:")
    print(f"{'tenant':12} | {'without':>18} | {'with vgpu':>18} | {'after resize':>18} | {'autoscaled':>18} | "
          f"{'burst':>18}")
    for name, _, _, role in TENANTS:
        cells = []
        for res, k in ((without, "before"), (with_, "before"), (with_, "after"), (auto, "after"), (burst, "after")):
            r = res[name]
            if role == "train":
                cells.append(f"{r['rate'][k]:6.0f} steps/s".rjust(18))
            else:
                p50, p99 = r["latency"][k]
                cells.append(f"{r['rate'][k]:4.0f}/s {p50:4.1f}/{p99:5.1f}".rjust(18))
        print(f"{name:12} | " + " | ".join(cells))

    print("\nMemory over the whole phase (GiB peak, allocations refused):")
    print(f"{'tenant':12} {'cap':>4} | {'without':>14} | {'with vgpu':>14} | {'autoscaled':>14}")
    for name, mem, _, _ in TENANTS:
        cells = [f"{res[name]['final'].get('peak', 0):>2} G, {res[name]['final'].get('ooms', 0):>3} OOM"
                 for res in (without, with_, auto)]
        print(f"{name:12} {mem:>3}G | " + " | ".join(c.rjust(14) for c in cells))
    return busy


def summary(timing, demand, without, with_, auto, ceilings3, busy, burst):
    lk, tr = "infer-leaky", "train"

    def gain(new, old):
        return (new / old - 1) * 100 if old else 0.0

    inf = [n for n in INFER if n != lk]
    phases = (("without", without), ("with", with_), ("auto", auto), ("burst", burst))
    rate = {(res_name, k): sum(res[n]["rate"][k] for n in inf) / len(inf)
            for res_name, res in phases for k in ("before", "after")}
    p99 = {(res_name, k): max(res[n]["latency"][k][1] for n in inf)
           for res_name, res in phases for k in ("before", "after")}
    print("\nWhat this run measured:")
    bullet(f"Memory: without vgpu the leak grew to {without[lk]['final'].get('peak', 0)} GiB and training's "
          f"allocations were refused {without[tr]['final'].get('ooms', 0)} times; with vgpu the leak stopped at "
          f"its 2 GiB cap ({with_[lk]['final'].get('ooms', 0)} refusals, and it kept serving) and training was "
          f"refused {with_[tr]['final'].get('ooms', 0)} times.")
    bullet(f"Ceilings alone (before the resize, training at 70%): inference served {gain(rate['with', 'before'], rate['without', 'before']):+.0f}% "
          f"requests a second, p99 {p99['without', 'before']:.1f} -> {p99['with', 'before']:.1f} ms; training did "
          f"{gain(with_[tr]['rate']['before'], without[tr]['rate']['before']):+.0f}% steps a second.")
    bullet(f"The resize to 40% (live, no restart): training's share went {with_[tr]['share']['before']:.1f}% -> "
          f"{with_[tr]['share']['after']:.1f}%, its steps {gain(with_[tr]['rate']['after'], with_[tr]['rate']['before']):+.0f}%; "
          f"inference {gain(rate['with', 'after'], rate['with', 'before']):+.0f}% requests a second, p99 "
          f"{p99['with', 'before']:.1f} -> {p99['with', 'after']:.1f} ms. The GPU was {100 - busy['after']:.0f}% idle: "
          f"inference uses about {demand[0]:.0f}% of its 20% ceilings, and nobody else may take the rest.")
    t3 = ceilings3.get(tr, 40)
    i3 = sorted({ceilings3.get(n, 20) for n in INFER})
    bullet(f"The autoscaler gave training the idle time its neighbours' ceilings held: training 40% -> {t3:g}% "
          f"(measured {auto[tr]['share']['after']:.1f}%, steps {gain(auto[tr]['rate']['after'], with_[tr]['rate']['after']):+.0f}% "
          f"against after the resize), the GPU {busy['auto']:.0f}% busy. The cost: inference ceilings went "
          f"20% -> {'/'.join(f'{v:g}%' for v in i3)} (their guaranteed 10% stays), p99 "
          f"{p99['with', 'after']:.1f} -> {p99['auto', 'after']:.1f} ms; and, by the policy (not measured here), a "
          f"burst above the new ceiling waits one window (2 s here) before the ceiling can grow back.")
    bullet(f"Burst mode gave training the idle time at once, without windows: guaranteed 40%, it measured "
          f"{burst[tr]['share']['after']:.1f}% (steps {gain(burst[tr]['rate']['after'], with_[tr]['rate']['after']):+.0f}% "
          f"against the 40% ceiling), the GPU {busy['burst']:.0f}% busy against {busy['after']:.0f}% with ceilings; "
          f"inference still got what it asks for ({burst[inf[0]]['share']['after']:.1f}% each, {demand[0]:.1f}% alone) "
          f"and served {gain(rate['burst', 'after'], rate['with', 'after']):+.0f}% requests a second, p99 "
          f"{p99['with', 'after']:.1f} -> {p99['burst', 'after']:.1f} ms (a request now queues behind training's "
          f"kernels: the price of lending on a GPU that runs one kernel at a time).")


def bullet(text):
    print(textwrap.fill(text, 100, initial_indent="- ", subsequent_indent="  "))


def plot(phases, timing, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(2, len(phases), figsize=(4.2 * len(phases), 6.4), sharex=True, sharey="row")
    # the three inference services ask alike and often draw one line: a style each keeps them apart
    styles = {"train": "-", "infer-a": "-", "infer-b": (0, (4, 2)), "infer-leaky": (0, (1, 1.5))}
    colours = {name: f"C{i}" for i, (name, *_rest) in enumerate(TENANTS)}
    for col, (title, res) in enumerate(phases):
        top, bottom = axes[0][col], axes[1][col]
        for name, mem, share, _ in TENANTS:
            style = dict(color=colours[name], linestyle=styles.get(name, "-"), linewidth=1.4)
            top.plot([i + 0.5 for i in range(len(res[name]["timeline"]))], res[name]["timeline"], label=name,
                     **style)
            pts = res[name]["memory"]
            bottom.step([t for t, _ in pts], [m for _, m in pts], where="post", label=name, **style)
            if "without" not in title:   # ceiling and cap as the phase starts (resize, autoscale move them)
                ceiling = 100 if "burst" in title and name == "train" else share   # burst: 100%, 40% guaranteed
                top.axhline(ceiling, color=colours[name], linewidth=0.6, alpha=0.5, linestyle=":")
                bottom.axhline(mem, color=colours[name], linewidth=0.6, alpha=0.5, linestyle=":")
        top.set_title(title)
        bottom.set_xlabel("seconds")
        if "resize" in title:
            for ax in (top, bottom):
                ax.axvline(timing.resize_at, color="grey", linestyle=":")
    axes[0][0].set_ylabel("share of GPU time (%)\n(dotted: ceilings at the start)")
    axes[1][0].set_ylabel("memory held (GiB)\n(dotted: caps at the start)")
    for ax in axes[1]:
        ax.axhline(24, color="black", linewidth=0.5)
        ax.text(0.2, 24.3, "the GPU's 24 GiB", fontsize=7)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(TENANTS), fontsize=8)   # one legend for every panel
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short phases (for tests)")
    ap.add_argument("--plot", default="demo-timeline.png", help="where to save the timeline ('' for none)")
    args = ap.parse_args()
    timing = Timing(args.quick)
    started = time.monotonic()
    print("Four tenants on one simulated NVIDIA A10 (24 GiB, 72 SMs): a training job (8 GiB, flat out) and three\n"
          "inference services (2 GiB; a request is 2 ms of GPU time, then a 15 ms pause); infer-leaky leaks\n"
          "1 GiB a second.  Each phase runs the same four programs on a fresh simulated node.\n")
    with tempfile.TemporaryDirectory(prefix="vgpu-demo-") as tmp:
        demand = demand_alone(tmp, timing)
        print("\n1. Without vgpu: plain time-slicing, no caps.")
        without = run_phase("without vgpu", node_env(os.path.join(tmp, "node-1"), None), timing,
                            [t[0] for t in TENANTS], False)
        print("\n2. With vgpu: a slice each; halfway through, training is resized live.")
        with_, vgpu_dir, _ = phase_with_vgpu(tmp, timing)
        print("\n3. With vgpu and the autoscaler: ceilings follow the load, within requests and limits.")
        auto, ceilings3 = phase_autoscaled(tmp, timing, vgpu_dir)
        print("\n4. With vgpu in burst mode: training guaranteed 40%, idle time lent to it up to 100%.")
        burst = phase_burst(tmp, timing)
    busy = report(timing, demand, without, with_, auto, ceilings3, burst)
    summary(timing, demand, without, with_, auto, ceilings3, busy, burst)
    png = plot([("without vgpu", without), ("with vgpu (resize at the line)", with_),
                ("with vgpu, autoscaled", auto), ("with vgpu, burst", burst)],
               timing, args.plot) if args.plot else None
    print(f"\n{time.monotonic() - started:.0f} s." + (f"  Timeline of shares and memory: {png}." if png else
                                                      "  (pip install matplotlib for a timeline plot)"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tenant"]:
        tenant(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
