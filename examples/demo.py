"""The vgpu demo: four tenants packed on one GPU, without and with vgpu.

The scenario people have: one training job (8 GiB, 70% of the GPU) and three inference
services (2 GiB, 20% each) on one 24 GiB A10 — here simgpu's `a10` profile.  One of the
inference services leaks memory.  The same four programs (NVIDIA's cuda-python driver
bindings, unchanged) run twice:

  without vgpu: plain time-slicing, no caps — the leak eats the card and the training job
                runs out of memory; the training job's queue delays every inference request;
  with vgpu:    each tenant has its slice — the leaky service hits its own 2 GiB cap, the
                others never notice; then the training job is resized live to 40% and its
                share follows.

Shares are measured from outside (vgpu.referee: NVML per-process utilization).  Run with
`make demo`; if matplotlib is installed, a timeline is saved as demo-timeline.png.
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from vgpu.paths import shim_path
from vgpu.referee import start as start_referee
from vgpu.sim import sim_environment
from vgpu import slices

GiB = 1 << 30
RUN_S = 16.0            # each phase
RESIZE_AT = 9.0         # with vgpu: the training job goes from 70% to 40% here
WINDOW = (3.0, 8.5)     # where the table's shares are measured

# name, memory (GiB), SM share (%), role
TENANTS = [
    ("train", 8, 70, "train"),
    ("infer-a", 2, 20, "infer"),
    ("infer-b", 2, 20, "infer"),
    ("infer-leaky", 2, 20, "leak"),
]


# === one tenant (a child process) ===

def check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    return int(err), (rest[0] if len(rest) == 1 else rest)


def tenant(role, seconds, memory_gib):
    """Run one workload; print a JSON line of progress every 0.5 s and a final one."""
    from cuda.bindings import driver as cu

    cu.cuInit(0)
    cu.cuCtxSetCurrent(check(cu.cuDevicePrimaryCtxRetain(0))[1])
    _, module = check(cu.cuModuleLoadData(b"any image: simgpu runs kernels by name"))
    _, step_kernel = check(cu.cuModuleGetFunction(module, b"sim_2000us"))     # a training step
    _, infer_kernel = check(cu.cuModuleGetFunction(module, b"sim_500us"))     # part of a request
    _, stream = check(cu.cuStreamCreate(0))
    held, ooms, work, peak = [], 0, 0, 0

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
    next_report = start + 0.5
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
            work += 1
            time.sleep(0.015)
            if role == "leak" and now >= next_leak:   # forgets to free 1 GiB every second
                alloc(1)
                next_leak += 1.0
        if now >= next_report:
            print(json.dumps({"t": now - start, "work": work, "ooms": ooms, "mem": len(held)}), flush=True)
            next_report += 0.5
    print(json.dumps({"final": True, "work": work, "ooms": ooms, "peak": peak}), flush=True)


# === the orchestration ===

def _collect(stream, into):
    for line in stream:
        if line.startswith("{"):
            into.append(json.loads(line))


def run_phase(label, state, vgpu_dir, with_vgpu):
    base = {**os.environ, **sim_environment("a10", 1, state)}
    for k in [k for k in base if k.startswith(("VGPU_", "CUDA_DEVICE_"))]:
        del base[k]
    procs = {}
    t0 = time.time()
    for name, mem, share, role in TENANTS:
        env = dict(base)
        if with_vgpu:
            env.update(LD_PRELOAD=str(shim_path()), VGPU_DIR=vgpu_dir, VGPU_CONTAINER=name)
        procs[name] = subprocess.Popen([sys.executable, __file__, "--tenant", role, str(RUN_S), str(mem)],
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    windows = [list(WINDOW), [RESIZE_AT + 1.5, RUN_S - 0.5]] + [[i, i + 1.0] for i in range(int(RUN_S) - 1)]
    referee = start_referee([p.pid for p in procs.values()], windows, t0, base)
    lines = {name: [] for name in procs}
    readers = [threading.Thread(target=_collect, args=(p.stdout, lines[name]), daemon=True)
               for name, p in procs.items()]
    for r in readers:
        r.start()
    resized = False
    while any(p.poll() is None for p in procs.values()):
        time.sleep(0.5)
        elapsed = time.time() - t0
        if with_vgpu and not resized and elapsed >= RESIZE_AT:
            slices.resize(vgpu_dir, "train", sm=4000)   # what `vgpu-ctl resize train --sm 40%` does
            resized = True
        progress = "  ".join(f"{n} {(lines[n][-1] if lines[n] else {}).get('work', 0):4}" for n in procs)
        line = f"[{label}] {min(elapsed, RUN_S):4.1f}/{RUN_S:.0f} s  work: {progress}"
        if sys.stdout.isatty():
            print("\r" + line, end="", flush=True)
        elif int(elapsed * 2) % 8 == 0:   # a log gets a line every 4 s
            print(line, flush=True)
    print()
    for r in readers:
        r.join(timeout=10)
    results = {name: {"final": got[-1] if got else {}} for name, got in lines.items()}
    out, err = referee.communicate(timeout=60)
    shares = json.loads(out) if referee.returncode == 0 else [[0.0] * len(procs)] * len(windows)
    for i, name in enumerate(procs):
        results[name]["share"] = shares[0][i]
        results[name]["share_after_resize"] = shares[1][i]
        results[name]["timeline"] = [w[i] for w in shares[2:]]
    return results


def create_slices(vgpu_dir):
    """What `vgpu-ctl create NAME --memory 8Gi --sm 70%` does, for each tenant.  The SM
    shares add up to 130%: they are ceilings, and the inference services rarely use theirs."""
    for name, mem, share, _ in TENANTS:
        quota = slices.DeviceQuota(mem * GiB, mem * GiB, mem * GiB, share * 100, share * 100, share * 100)
        slices.create(vgpu_dir, name, {0: quota}, capacity=lambda device: 24 * GiB)


def table(without, with_):
    cols = f"{'mem peak':>8} {'SM %':>6} {'work':>11} {'OOMs':>5}"
    print(f"\n{'':12} {'':>9} | {'without vgpu':^33} | {'with vgpu':^33}")
    print(f"{'tenant':12} {'slice':>9} | {cols} | {cols}")
    for name, mem, share, role in TENANTS:
        unit = "steps" if role == "train" else "reqs"
        cells = []
        for res in (without[name], with_[name]):
            f = res["final"]
            work = f"{f.get('work', 0)} {unit}"
            cells.append(f"{f.get('peak', 0):>6} G {res['share']:6.1f} {work:>11} {f.get('ooms', 0):5}")
        print(f"{name:12} {f'{mem}G {share}%':>9} | {cells[0]} | {cells[1]}")
    print(f"\nSM %: share of GPU time measured by NVML over {WINDOW[0]:.0f}-{WINDOW[1]:.1f} s.  work: training "
          "steps or requests served in the run.")
    tr = with_["train"]
    print(f"Live resize with vgpu at {RESIZE_AT:.0f} s: train 70% -> 40%; its share went "
          f"{tr['share']:.1f}% -> {tr['share_after_resize']:.1f}% (no restart).")


def plot(without, with_, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5), sharey=True)
    for ax, (title, res) in zip(axes, [("without vgpu", without), ("with vgpu", with_)]):
        for name, *_ in TENANTS:
            ax.plot([i + 0.5 for i in range(len(res[name]["timeline"]))], res[name]["timeline"], label=name)
        ax.set_title(title)
        ax.set_xlabel("seconds")
    axes[0].set_ylabel("share of GPU time (%)")
    axes[1].axvline(RESIZE_AT, color="grey", linestyle=":")
    axes[1].legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def main():
    print("Four tenants on one simulated NVIDIA A10 (24 GiB, 72 SMs): a training job (8 GiB, 70%)\n"
          "and three inference services (2 GiB, 20% each); infer-leaky leaks 1 GiB a second.\n")
    with tempfile.TemporaryDirectory(prefix="vgpu-demo-") as tmp:
        without = run_phase("without vgpu", os.path.join(tmp, "node-a"), None, False)
        vgpu_dir = os.path.join(tmp, "vgpu")
        create_slices(vgpu_dir)
        with_ = run_phase("with vgpu   ", os.path.join(tmp, "node-b"), vgpu_dir, True)
    table(without, with_)
    png = plot(without, with_, "demo-timeline.png")
    if png:
        print(f"Timeline saved to {png}.")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tenant"]:
        tenant(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
