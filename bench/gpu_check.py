"""The real-GPU check: vgpu's promises on an NVIDIA GPU, with PyTorch, in a few minutes.

    python bench/gpu_check.py [--quick]

Builds the shim (system C compiler), then runs each check in a child process under it
and prints one JSON summary.  Needs an NVIDIA GPU with its driver, PyTorch with CUDA, and
nvidia-ml-py.  Without a GPU it prints {"gpu": null, "message": "no GPU found ..."} and
exits 0, so it is safe to run anywhere.

Checks:
  mem_get_info      torch.cuda.mem_get_info() reports the cap as total
  oom_and_recover   allocating past the cap raises torch.OutOfMemoryError; after freeing,
                    the same allocation succeeds (the process keeps working)
  expandable        the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (VMM path)
  shares            two matmul loops at 30% and 70% side by side: each one's share by NVML
                    (per-process utilization) and by throughput vs an unlimited solo run
  launch_overhead   a tiny-kernel loop: time per iteration without the shim, with it at
                    100%, and limited at 90% (within budget)
  graph_replay      a CUDA graph replayed in a loop at 30%: its NVML share
  footprint         what the shim charges against what the driver holds (NVML's per-process
                    used memory, read from outside): after a context and 256 MiB, and after a
                    1 GiB cuMemAllocAsync block is freed into a pool that keeps it (release
                    threshold UINT64_MAX): the pool's reserve must still be charged; within
                    the agent's tolerance (the larger of 64 MiB and 2%)
  burst             the 30/70 pair again with the 30% slice in burst mode (guaranteed 30%, up
                    to 100%): alone it takes the GPU, next to the 70% slice it gets 30%; needs
                    the vgpu package built here (`make venv`) to make the slices
"""
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICK = "--quick" in sys.argv
SHARE_S = 8 if QUICK else 20


def gpu_present():
    """The first GPU as NVML describes it, or None: no library, no driver, no device."""
    try:
        import pynvml
        pynvml.nvmlInit()
        if not pynvml.nvmlDeviceGetCount():
            return None
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        return {"name": name if isinstance(name, str) else name.decode(),
                "memory_bytes": pynvml.nvmlDeviceGetMemoryInfo(h).total,
                "driver": pynvml.nvmlSystemGetDriverVersion()}
    except Exception:
        return None


def build_shim(out):
    sys.path.insert(0, str(ROOT / "tools"))
    import build_c
    build_c.build_all(out, ["libvgpu"])
    return Path(out) / "libvgpu.so"


def child(code, env, timeout=120):
    """Run `code` in python under `env`; its last stdout line is JSON."""
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                       timeout=timeout)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode or not lines:
        return {"error": f"exit {p.returncode}: {p.stderr.strip()[-400:]}"}
    return json.loads(lines[-1])


def under_shim(shim, vgpu_dir, name, **limits):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VGPU_", "CUDA_DEVICE_"))}
    env.update(LD_PRELOAD=str(shim), VGPU_DIR=str(vgpu_dir), VGPU_SLICE=name)
    env.update({k: str(v) for k, v in limits.items()})
    return env


MEMORY = """
import json, torch
GiB = 1 << 30
free, total = torch.cuda.mem_get_info()
a = torch.empty(int(1.5 * GiB), dtype=torch.uint8, device="cuda")
try:
    b = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    refused = False
except torch.OutOfMemoryError:
    refused = True
del a
torch.cuda.empty_cache()
b = torch.empty(GiB, dtype=torch.uint8, device="cuda")
print(json.dumps({"total": total, "free": free, "refused_past_cap": refused, "recovered": True}))
"""

MATMUL = """
import json, sys, time, torch
seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 10
x = torch.randn(4096, 4096, device="cuda")
torch.cuda.synchronize()
n, t0 = 0, time.time()
while time.time() - t0 < seconds:
    for _ in range(10):
        y = x @ x
    torch.cuda.synchronize()
    n += 10
print(json.dumps({"iterations_per_s": n / (time.time() - t0)}))
"""

GRAPH = """
import json, sys, time, torch
seconds = float(sys.argv[1])
x = torch.randn(4096, 4096, device="cuda")
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    for _ in range(3):
        y = x @ x
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    y = x @ x
n, t0 = 0, time.time()
while time.time() - t0 < seconds:
    g.replay()
    n += 1
    if n % 20 == 0:
        torch.cuda.synchronize()
torch.cuda.synchronize()
print(json.dumps({"replays_per_s": n / (time.time() - t0)}))
"""

FOOTPRINT = """
import ctypes, json, sys
cu = ctypes.CDLL("libcuda.so.1")      # the driver API itself (the shim answers for it)
MiB, GiB = 1 << 20, 1 << 30
RELEASE_THRESHOLD = 4                 # CU_MEMPOOL_ATTR_RELEASE_THRESHOLD (cuda.h)
def ok(r):
    if r:
        raise SystemExit(f"CUresult {r}")
def used():
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    ok(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))   # the shim's view: cap - charge
    return total.value - free.value
def say(stage):
    print(json.dumps({"stage": stage, "shim_used": used()}), flush=True)
    sys.stdin.readline()              # the parent reads the driver's figure meanwhile
ctx, dev, pool = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_void_p()
ok(cu.cuInit(0)); ok(cu.cuDeviceGet(ctypes.byref(dev), 0))
ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)); ok(cu.cuCtxSetCurrent(ctx))
a = ctypes.c_uint64()
ok(cu.cuMemAlloc_v2(ctypes.byref(a), ctypes.c_size_t(256 * MiB)))
say("context and 256 MiB")
ok(cu.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev))
keep = ctypes.c_uint64(2 ** 64 - 1)
ok(cu.cuMemPoolSetAttribute(pool, RELEASE_THRESHOLD, ctypes.byref(keep)))
b = ctypes.c_uint64()
ok(cu.cuMemAllocAsync(ctypes.byref(b), ctypes.c_size_t(GiB), None))
ok(cu.cuMemFreeAsync(b, None))
ok(cu.cuStreamSynchronize(None))
say("a 1 GiB pool block freed, kept by the pool")
"""


def footprint_check(shim, vdir):
    """Each stage: the shim's charge and the driver's per-process figure for the child."""
    try:
        import pynvml
    except ImportError as e:
        return {"skipped": f"needs nvidia-ml-py ({e})"}
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    env = under_shim(shim, vdir, "footprint", VGPU_MEMORY_LIMIT="8Gi")
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(FOOTPRINT)], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stages = []
    try:
        for line in p.stdout:
            if not line.startswith("{"):
                continue
            got = json.loads(line)
            driver = next((x.usedGpuMemory for x in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                           if x.pid == p.pid), None)
            got["driver_used"] = driver
            got["ok"] = driver is not None and abs(got["shim_used"] - driver) <= max(64 << 20, driver // 50)
            stages.append(got)
            p.stdin.write("\n")
            p.stdin.flush()
    finally:
        p.wait(timeout=60)
    if p.returncode or len(stages) != 2:
        return {"ok": False, "stages": stages, "error": p.stderr.read().strip()[-400:]}
    return {"ok": all(st["ok"] for st in stages), "stages": stages}


TINY = """
import json, time, torch
x = torch.zeros(16, device="cuda")
for _ in range(2000):
    x.add_(1)
torch.cuda.synchronize()
n = 50000
t0 = time.perf_counter()
for _ in range(n):
    x.add_(1)
torch.cuda.synchronize()
print(json.dumps({"us_per_iteration": (time.perf_counter() - t0) / n * 1e6}))
"""


def nvml_shares(pids, seconds, warmup=2.0):
    """Average NVML per-process utilization of `pids` over `seconds` after `warmup`."""
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    time.sleep(warmup)
    acc, span = {p: 0.0 for p in pids}, 0.0
    last = time.time()
    end = last + seconds
    while time.time() < end:
        time.sleep(0.5)
        now = time.time()
        try:
            for s in pynvml.nvmlDeviceGetProcessUtilization(h, int(last * 1e6)):
                if s.pid in acc:
                    acc[s.pid] += s.smUtil * (now - last)
        except pynvml.NVMLError:
            pass
        span += now - last
        last = now
    return {p: acc[p] / span for p in pids} if span else {}


def run_side_by_side(code, envs, seconds):
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(seconds)], env=e,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for e in envs]
    shares = nvml_shares([p.pid for p in procs], seconds - 4)
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=seconds + 120)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        outs.append(json.loads(lines[-1]) if lines else {"error": err.strip()[-400:]})
    return [(shares.get(p.pid), o) for p, o in zip(procs, outs)]


def burst_check(shim, vdir):
    """The 30/70 pair with the 30% slice in burst mode, through the package's own slices."""
    try:
        sys.path.insert(0, str(ROOT / "src"))
        from vgpu import slices
    except ImportError as e:
        return {"skipped": f"the vgpu package is not built here ({e}): run `make venv` first"}
    slices.create(vdir, "b30", {0: slices.device_quota(sm=10000, sm_request=3000)}, overcommit=True)
    slices.create(vdir, "c70", {0: slices.device_quota(sm=7000)}, overcommit=True)
    [(alone, _)] = run_side_by_side(MATMUL, [under_shim(shim, vdir, "b30")], SHARE_S)
    pair = run_side_by_side(MATMUL, [under_shim(shim, vdir, "b30"), under_shim(shim, vdir, "c70")], SHARE_S)
    shared = [share for share, _ in pair]
    ok = alone is not None and alone >= 90 and None not in shared and abs(shared[0] - 30) <= 5 and \
        abs(shared[1] - 70) <= 5
    return {"ok": ok, "alone_nvml_percent": alone, "with_70_nvml_percent": shared}


DRIVER_LIMIT = """
import json, sys, torch
open(sys.argv[1] + "/cgroup.procs", "w").write(str(__import__("os").getpid()))   # into the limited cgroup
x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")        # under the limit: fits
try:
    y = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")     # past it (no shim here): refused?
    refused = False
except torch.OutOfMemoryError:
    refused = True
print(json.dumps({"refused_past_limit": refused}))
"""


def driver_limit_check(tmp):
    """NVML's per-cgroup memory limit on the real driver (src/vgpu/driverlimits.py): a 1 GiB
    hard limit on a cgroup of our own, a process in it WITHOUT the shim allocating past it,
    then the limit cleared.  Skipped (with why) where the driver, nvidia-ml-py, cgroup v2 or
    root is missing."""
    try:
        sys.path.insert(0, str(ROOT / "src"))
        from vgpu import driverlimits
    except ImportError as e:
        return {"skipped": f"the vgpu package is not built here ({e})"}
    try:
        path = driverlimits.make_slice_cgroup(tmp, f"gpu-check-{os.getpid()}")
        driverlimits.apply(path, {0: (0, 1 << 30)})
    except driverlimits.Unavailable as e:
        return {"skipped": str(e)}
    try:
        plain = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}
        p = subprocess.run([sys.executable, "-c", DRIVER_LIMIT, str(path)], env=plain, capture_output=True,
                           text=True, timeout=120)
        lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
        r = json.loads(lines[-1]) if lines else {"error": p.stderr.strip()[-400:]}
        r["limit_read_back"] = driverlimits.read(path, 0)
    finally:
        driverlimits.clear(path, [0])
        r_after = driverlimits.read(path, 0)
        driverlimits.remove_cgroup(path)
    return {"ok": bool(r.get("refused_past_limit")) and r_after is None, "after_clear": r_after, **r}


def main():
    gpu = gpu_present()
    if not gpu:
        print(json.dumps({"gpu": None, "message": "no GPU found: this check needs an NVIDIA GPU, its driver and "
                          "nvidia-ml-py; nothing was run"}))
        return 0
    try:
        import torch   # noqa: F401
    except ImportError:
        print(json.dumps({"gpu": gpu, "message": "PyTorch is not installed: nothing was run"}))
        return 0
    result = {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "checks": {}}
    checks = result["checks"]
    with tempfile.TemporaryDirectory(prefix="vgpu-gpu-check-") as tmp:
        shim = build_shim(os.path.join(tmp, "lib"))
        vdir = Path(tmp) / "vgpu"
        cap = 2 << 30

        r = child(MEMORY, under_shim(shim, vdir, "mem", VGPU_MEMORY_LIMIT="2Gi"))
        checks["mem_get_info"] = {"ok": r.get("total") == cap, **r}
        checks["oom_and_recover"] = {"ok": bool(r.get("refused_past_cap") and r.get("recovered")), **r}
        env = under_shim(shim, vdir, "expandable", VGPU_MEMORY_LIMIT="2Gi",
                         PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
        r = child(MEMORY, env)
        checks["expandable"] = {"ok": bool(r.get("total") == cap and r.get("refused_past_cap")), **r}

        plain = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}
        [(solo_share, solo)] = run_side_by_side(MATMUL, [plain], SHARE_S)
        pair = run_side_by_side(MATMUL, [under_shim(shim, vdir, "s30", VGPU_SM_LIMIT="30%"),
                                         under_shim(shim, vdir, "s70", VGPU_SM_LIMIT="70%")], SHARE_S)
        base = solo.get("iterations_per_s") or float("nan")
        checks["shares"] = {
            "solo": {"nvml_percent": solo_share, **solo},
            "30%": {"nvml_percent": pair[0][0], "throughput_percent_of_solo":
                    100 * pair[0][1].get("iterations_per_s", 0) / base, **pair[0][1]},
            "70%": {"nvml_percent": pair[1][0], "throughput_percent_of_solo":
                    100 * pair[1][1].get("iterations_per_s", 0) / base, **pair[1][1]},
        }
        s = checks["shares"]
        checks["shares"]["ok"] = all(abs((s[k]["nvml_percent"] or -100) - t) <= 5 for k, t in (("30%", 30), ("70%", 70)))

        overhead = {}
        for label, env in [("without", plain), ("shim 100%", under_shim(shim, vdir, "t100", VGPU_SM_LIMIT="100%")),
                           ("shim 90%", under_shim(shim, vdir, "t90", VGPU_SM_LIMIT="90%"))]:
            overhead[label] = child(TINY, env).get("us_per_iteration")
        checks["launch_overhead"] = overhead

        [(g_share, g)] = run_side_by_side(GRAPH, [under_shim(shim, vdir, "graph", VGPU_SM_LIMIT="30%")], SHARE_S)
        checks["graph_replay"] = {"ok": g_share is not None and abs(g_share - 30) <= 5, "nvml_percent": g_share, **g}
        checks["footprint"] = footprint_check(shim, Path(tmp) / "vgpu-footprint")
        checks["burst"] = burst_check(shim, Path(tmp) / "vgpu-burst")
        checks["driver_limit"] = driver_limit_check(tmp)
    result["ok"] = all(c.get("ok", True) for c in checks.values())
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
