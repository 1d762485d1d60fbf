"""The real-GPU check: vgpu's promises on an NVIDIA GPU, with PyTorch, in a few minutes.

    python bench/gpu_check.py [--quick] [--only=CHECK,...] [--out=FILE]

(--out: the summary so far is rewritten to FILE after each check, so a run cut short still
leaves what it measured; `python3 bench/gpu_results.py FILE` prints its compute-share rows
as docs/real-gpu.md shows them.)

Builds the shim (system C compiler), then runs each check in a child process under it
and prints one JSON summary.  Needs an NVIDIA GPU with its driver, PyTorch with CUDA,
Triton (nvml_meaning, duty, woken) and nvidia-ml-py; the checks that make slices (made
slice, woken, burst) need the package's cffi part: `make venv`, or where the packages are
the machine's own, `cd src && python3 vgpu/_region_build.py` (cffi and pycparser).
Without a GPU it prints {"gpu": null, "message": "no GPU found ..."} and exits 0, so it
is safe to run anywhere.

Checks:
  start_up          bench/programs/first_alloc.c on the real driver: main() to the first
                    allocation without the shim, in a standalone slice, and in a slice made
                    where the node's context cost was measured (vgpu.overhead); interleaved
  start_up_32       bench/programs/overhead.c: median cuInit of 32 processes starting at once,
                    and ns per cuMemAlloc+cuMemFree (1 MiB) and per cuMemGetInfo, with and
                    without the shim, interleaved
  nvml_meaning      what NVML's per-process utilization (the shim's correction reads it as GPU
                    time) reports for one tenant of known duty, no shim: against its kernels'
                    count and the device's utilization
  duty              the side-by-side pairs of bench/test_compute_share_bench.py on hardware:
                    30/70% tenants of 20 ms kernels (a Triton kernel of fixed work, 1 block and
                    7200 blocks), back to back and with a sync after each, and four tenants
                    10/20/30/40% (guarantees that add up to the whole GPU): each one's error
                    over 6 s after 4 s and the worst 1 s window, by NVML and, with a sync after
                    each kernel, by the kernels each finished (count x the kernel's solo time);
                    with both, `nvml_samples`: what NVML's per-process samples are like (per
                    call, their age, missing ones) and the shim's own 0.5 s reading of them;
                    and `shim`, per tenant, what its shim logged at debug: its kernels'
                    samples (events, which include time behind a neighbour) and each
                    correction (NVML's measure, the estimates', the cost scale set)
  duty_no_agent     duty's pairs with a sync after each kernel, each tenant in a pid namespace
                    of its own (root) and no node agent, as containers are while it is down:
                    the correction cannot find them in NVML, so the shares are the estimates'
                    alone (beside duty: what the correction does); `corrections`: should be 0
  duty_containers   duty's first pair, each tenant in a pid namespace of its own (as in a
                    container: unshare --pid, needs root) and the node agent running: the
                    correction finds the tenants in NVML by the host pids the agent writes;
                    also whether it wrote them (needs the vgpu package and its dependencies)
  woken             a 70% slice wakes next to one bursting to 100% (guaranteed 30%): its share
                    over its first second, counted as above, and each one's `shim` as in
                    duty; needs the vgpu package's cffi part
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
                    to 100%): alone it takes the GPU, next to the 70% slice it gets 30%, by
                    throughput against an unlimited solo run (and NVML's shares)
  driver_limit      NVML's per-cgroup memory limit on a process without the shim; it sets a
                    driver limit (on a cgroup of its own, cleared after): leave it out with
                    --only on a GPU you may not change the settings of
"""
import atexit
import contextlib
import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICK = "--quick" in sys.argv
SHARE_S = 8 if QUICK else 20
ONLY = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), None)
OUT = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--out=")), None)


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
    # another machine's compiler may warn where ours does not: a check of the GPU, not of the
    # compiler, so warnings stay warnings here
    build_c.CFLAGS = [f for f in build_c.CFLAGS if f != "-Werror"]
    build_c.build_all(out, ["libvgpu"])
    return Path(out) / "libvgpu.so"


def c_program(name, out):
    """bench/programs/<name>.c, built as bench/conftest.py builds it."""
    exe = Path(out) / name
    subprocess.run([os.environ.get("CC", "cc"), "-std=gnu11", "-O2", "-I", str(ROOT / "csrc"),
                    str(ROOT / "bench" / "programs" / f"{name}.c"), "-o", str(exe), "-ldl", "-pthread"], check=True)
    return exe


def vgpu_package():
    """The vgpu package from this tree, or the reason it cannot be imported."""
    try:
        sys.path.insert(0, str(ROOT / "src"))
        import vgpu.slices
        # (its own children, `python -m vgpu.overhead`, import it from here too)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
        return vgpu, None
    except ImportError as e:
        return None, f"the vgpu package is not built here ({e}): run `make venv` first"


def plain_env():
    return {k: v for k, v in os.environ.items() if not k.startswith(("VGPU_", "CUDA_DEVICE_"))}


def child(code, env, timeout=120, args=(), program=None):
    """Run `code` (or the file `program`) in python under `env`; its last stdout line is JSON."""
    p = subprocess.run([sys.executable, *([program] if program else ["-c", textwrap.dedent(code)]), *args], env=env,
                       capture_output=True, text=True, timeout=timeout)
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
free, total = torch.cuda.mem_get_info()    # (total: the cap; free: what the context left of it)
part = int(free * 0.6)                     # one fits; two do not
a = torch.empty(part, dtype=torch.uint8, device="cuda")
try:
    b = torch.empty(part, dtype=torch.uint8, device="cuda")
    refused = False
except torch.OutOfMemoryError:
    refused = True
del a
torch.cuda.empty_cache()
b = torch.empty(part, dtype=torch.uint8, device="cuda")
print(json.dumps({"total": total, "free": free, "refused_past_cap": refused, "recovered": True}))
"""

# A tenant of run_together: set up (PyTorch's import and context take seconds), say so,
# and start at the time the parent sends, beside the others.
READY = """
print(json.dumps({"ready": True}), flush=True)
t0 = float(sys.stdin.readline())
time.sleep(max(0.0, t0 - time.time()))
"""
MATMUL = """
import json, sys, time, torch
seconds = float(sys.argv[1])
x = torch.randn(4096, 4096, device="cuda")
torch.cuda.synchronize()
""" + READY + """
n = 0
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
""" + READY + """
n = 0
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


def run_side_by_side(code, envs, seconds):
    """`code` (MATMUL, GRAPH) under each env, started together: [(NVML share over their
    run but its first and last second, its output)]."""
    _, [shares], outs = run_together([([sys.executable, "-c", textwrap.dedent(code), str(seconds)], e) for e in envs],
                                     seconds, [[1.0, seconds - 1.0]])
    return list(zip(shares, outs))


def burst_check(shim, vdir):
    """The 30/70 pair with the 30% slice in burst mode, through the package's own slices: NVML's
    shares, and each one's throughput against an unlimited solo run (judged by throughput)."""
    vgpu, why = vgpu_package()
    if not vgpu:
        return {"skipped": why}
    from vgpu import slices
    slices.create(vdir, "b30", {0: slices.device_quota(sm=10000, sm_request=3000)}, overcommit=True)
    slices.create(vdir, "c70", {0: slices.device_quota(sm=7000)}, overcommit=True)
    [(_, solo)] = run_side_by_side(MATMUL, [plain_env()], SHARE_S)
    [(alone, alone_out)] = run_side_by_side(MATMUL, [under_shim(shim, vdir, "b30")], SHARE_S)
    pair = run_side_by_side(MATMUL, [under_shim(shim, vdir, "b30"), under_shim(shim, vdir, "c70")], SHARE_S)
    base = solo.get("iterations_per_s") or float("nan")
    alone_tp = 100 * alone_out.get("iterations_per_s", 0) / base
    pair_tp = [100 * out.get("iterations_per_s", 0) / base for _, out in pair]
    ok = alone_tp >= 90 and abs(pair_tp[0] - 30) <= 5 and abs(pair_tp[1] - 70) <= 5
    return {"ok": ok, "alone_throughput_percent_of_solo": alone_tp, "with_70_throughput_percent_of_solo": pair_tp,
            "alone_nvml_percent": alone, "with_70_nvml_percent": [share for share, _ in pair]}


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
    vgpu, why = vgpu_package()
    if not vgpu:
        return {"skipped": why}
    from vgpu import driverlimits
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


def run_program(exe, *args, env):
    """A bench program's `key=value` output."""
    out = subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=60, check=True)
    return {k: float(v) for k, v in (kv.split("=") for kv in out.stdout.split())}


def start_up_check(shim, tmp):
    """bench/test_shim_overhead.py's one-process start-up row on the real driver: main() to the
    first allocation without the shim, in a standalone slice, and in a made slice where the
    node's context cost was measured first; interleaved rounds, medians."""
    first = c_program("first_alloc", tmp)
    plain = plain_env()
    envs = {"without": plain,
            "standalone": under_shim(shim, Path(tmp) / "vgpu-alone", "alone", VGPU_MEMORY_LIMIT="8Gi")}
    vgpu, made_slice = vgpu_package()   # (why not, or what was measured for it)
    if vgpu:   # a container's case: the node's context cost measured, then a slice made
        from vgpu import overhead, slices
        made = Path(tmp) / "vgpu-made"
        made.mkdir()
        try:
            made_slice = {"context_measured": overhead.measure(made)}
            slices.create(made, "one", {0: slices.device_quota(memory=8 << 30)}, overcommit=True)
            envs["made slice"] = under_shim(shim, made, "one")
        except Exception as e:
            made_slice = f"{type(e).__name__}: {e}"

    for env in envs.values():   # each slice makes its files before the rounds
        run_program(first, env=env)
    rounds = {k: [] for k in envs}
    for i in range(10):
        for name in (list(envs) if i % 2 else list(envs)[::-1]):
            rounds[name].append(run_program(first, env=envs[name]))
    med = {k: {m: statistics.median(r[m] for r in v) / 1000 for m in v[0]} for k, v in rounds.items()}
    one = {k: {"first_alloc_us": round(m["first_alloc_ns"]), "added_us": round(m["first_alloc_ns"] -
           med["without"]["first_alloc_ns"]), "cuInit_us": round(m["init_ns"])} for k, m in med.items()}
    return {"one_process": one, "made_slice": made_slice}


def start_up_32_check(shim, tmp):
    """32 processes starting at once (median cuInit per round), and ns per memory call."""
    over = c_program("overhead", tmp)
    plain, shimmed = plain_env(), under_shim(shim, Path(tmp) / "vgpu-alone", "alone", VGPU_MEMORY_LIMIT="8Gi")
    crowd = {"without": [], "with": []}
    for i in range(6):
        for name in (["without", "with"] if i % 2 else ["with", "without"]):
            env = plain if name == "without" else shimmed
            procs = [subprocess.Popen([str(over), "10", "info"], env=env, stdout=subprocess.PIPE, text=True)
                     for _ in range(32)]
            inits = [float(p.communicate(timeout=120)[0].split()[0].split("=")[1]) / 1000 for p in procs]
            crowd[name].append(statistics.median(inits))
    w, s = statistics.median(crowd["without"]), statistics.median(crowd["with"])
    return {"32_at_once_median_cuInit_us": {"without": round(w), "with": round(s), "ratio": round(s / w, 2),
                                            "rounds": crowd}, "per_call_ns": per_call_check(over, plain, shimmed)}


def per_call_check(over, plain, shimmed):
    """ns per cuMemAlloc+cuMemFree (1 MiB) and per cuMemGetInfo, interleaved rounds: medians."""
    calls = {"without": [], "with": []}
    for i in range(3):
        for name in (["without", "with"] if i % 2 else ["with", "without"]):
            calls[name].append(run_program(over, "20000", env=plain if name == "without" else shimmed))
    return {k: {m: round(statistics.median(r[m] for r in v), 1) for m in ("alloc_free_ns", "meminfo_ns")}
            for k, v in calls.items()}


SPIN = """
import json, sys, time, torch, triton, triton.language as tl

@triton.jit
def spin(out, n):   # fixed work per block: a dependent chain of n multiply-adds
    x = tl.program_id(0).to(tl.float32)
    for _ in range(n):
        x = x * 0.999 + 0.5
    tl.store(out + tl.program_id(0), x)

blocks, n, mode, seconds, delay = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), \\
    float(sys.argv[5])
out = torch.empty(blocks, device="cuda")
step = lambda: spin[(blocks,)](out, n, num_warps=1)
if mode == "calibrate":   # solo ms of the kernel at n (no shim), after a second that brings the clocks up
    t_end = time.time() + 1
    while time.time() < t_end:
        step()
        torch.cuda.synchronize()
    ms = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); step(); b.record(); b.synchronize()
        ms.append(a.elapsed_time(b))
    print(json.dumps({"ms": sorted(ms)[2]}))
    raise SystemExit
step(); torch.cuda.synchronize()
""" + READY + """
start = t0 + delay
time.sleep(max(0.0, start - time.time()))
done, launches = [], 0
while time.time() < start + seconds:
    launched = time.time()
    step()
    launches += 1
    if mode in ("sync", "half"):
        torch.cuda.synchronize()
        done.append(time.time())
    if mode == "half":   # idle as long as the launch and its kernel took: about a 50% duty cycle
        time.sleep(done[-1] - launched)
torch.cuda.synchronize()
print(json.dumps({"done": done, "launches": launches}))
"""
KERNEL_MS = 20.0
DUTY_WINDOWS = [[4.0, 10.0]] + [[4.0 + i, 5.0 + i] for i in range(6)]


@functools.lru_cache(maxsize=None)
def spin_program():
    """SPIN as a file (Triton's jit reads a kernel's source, which `python -c` has not)."""
    folder = tempfile.mkdtemp(prefix="vgpu-gpu-check-spin-")
    atexit.register(shutil.rmtree, folder, True)
    path = Path(folder) / "spin.py"
    path.write_text(SPIN)
    return str(path)


def solo_ms(blocks, n):
    got = child(None, plain_env(), args=[str(blocks), str(n), "calibrate", "0", "0"], program=spin_program())
    if "ms" not in got:
        raise RuntimeError(f"the Triton kernel did not run: {got.get('error')}")
    return got["ms"]


@functools.lru_cache(maxsize=None)
def spin_calibration():
    """(blocks, n) for 20 ms kernels of 1 and 7200 blocks, and each one's solo ms (no shim)."""
    sizes = {}
    for blocks, n in ((1, 1 << 20), (7200, 1 << 14)):
        n = max(16, int(n * KERNEL_MS / solo_ms(blocks, n)) // 16 * 16)   # a multiple of 16: Triton specialises
        sizes[blocks] = (n, solo_ms(blocks, n))
    return sizes


# a tenant in a pid namespace of its own, as in a container (the host's /proc and mounts
# kept): NVML lists it by its host pid, which its shim does not know
IN_OWN_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--kill-child"]


def can_unshare_pid():
    """Whether this process may start one in a pid namespace of its own (root)."""
    return subprocess.run([*IN_OWN_PID_NAMESPACE, "true"], capture_output=True).returncode == 0


def run_spins(tenants, seconds, windows, also=None, diag=None, namespaced=False):
    """tenants: [(env, blocks, n, mode, delay s)] of SPIN, started together (run_together);
    namespaced: each in a pid namespace of its own."""
    prefix = IN_OWN_PID_NAMESPACE if namespaced else []
    return run_together([([*prefix, sys.executable, spin_program(), str(b), str(n), mode, str(seconds), str(delay)],
                          env) for env, b, n, mode, delay in tenants], seconds, windows, also, diag,
                        namespaced=namespaced)


def namespaced_pid(outer, timeout=10.0):
    """The host pid of the process `unshare --fork` (pid `outer`) started."""
    children = Path(f"/proc/{outer}/task/{outer}/children")
    deadline = time.time() + timeout
    while time.time() < deadline:
        pids = children.read_text().split() if children.exists() else []
        if pids:
            return int(pids[0])
        time.sleep(0.01)
    raise RuntimeError(f"unshare ({outer}) started no process")


# The duty tenants' shims log at debug, and shim_trace reads what they say of the compute
# share (shim/compute.c): each kernel sample their events gave, each 0.5 s correction of
# the cost scale by NVML.  So a run on a GPU shows which input of the correction was off.
TRACED = {"VGPU_LOG": "debug"}
SAMPLE_LINE = re.compile(r"debug: kernel [0-9a-f]+: sampled ([0-9.]+) ms, estimate ([0-9.]+) ms$")
CORRECTION_LINE = re.compile(r"debug: device \d+: measured ([0-9.]+)%, estimated ([0-9.]+)%: cost scale ([0-9.]+)$")


def shim_trace(stderr):
    """A tenant's stderr at VGPU_LOG=debug, summed up: how many kernel samples, their ms
    (min, quartiles; a sample includes time spent behind a neighbour's context), the
    estimate they led to last, and every correction in turn ([NVML's measure %, the
    estimates' %, the cost scale set]); None where the shim said none of it."""
    sampled, estimate, corrections = [], None, []
    for line in stderr.splitlines():
        if m := SAMPLE_LINE.search(line):
            sampled.append(float(m[1]))
            estimate = float(m[2])
        elif m := CORRECTION_LINE.search(line):
            corrections.append([float(m[1]), float(m[2]), float(m[3])])
    if not sampled and not corrections:
        return None
    spread = None
    if sampled:
        quartiles = statistics.quantiles(sampled, n=4, method="inclusive") if len(sampled) > 1 else sampled * 3
        spread = [round(x, 3) for x in (min(sampled), *quartiles)]
    return {"samples": len(sampled), "sample_ms_min_q1_median_q3": spread, "estimate_ms_last": estimate,
            "corrections": corrections}


def run_together(tenants, seconds, windows, also=None, diag=None, namespaced=False):
    """tenants: [(argv, env)] of programs that print a JSON line once set up, then read a start
    time (epoch seconds) on stdin and run `seconds` from it, ending with a JSON line.  Started
    together once all are set up.  Returns (start time, NVML shares per window (seconds from
    the start) per tenant, each one's last JSON line); `also(start, windows)` runs in a
    thread meanwhile; `diag`: nvml_windows's.  namespaced: each argv starts with
    IN_OWN_PID_NAMESPACE, and NVML is read for the process it started."""
    # stderr to files: a chatty tenant (PyTorch's warnings) must not fill a pipe nobody reads
    errs = [tempfile.TemporaryFile(mode="w+") for _ in tenants]
    procs = [subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
             for (argv, env), err in zip(tenants, errs)]

    def stderr_of(i):
        errs[i].seek(0)
        return errs[i].read().strip()[-400:]
    try:
        for i, p in enumerate(procs):   # each has its context (and its compiled kernel)
            if not p.stdout.readline().startswith("{"):
                p.wait(timeout=60)
                raise RuntimeError(f"a tenant did not start: {stderr_of(i)}")
        start = time.time() + 0.2
        for p in procs:
            p.stdin.write(f"{start}\n")
            p.stdin.flush()
        if also:   # (another sampler, in a thread beside NVML's per-process one)
            import threading
            sampler = threading.Thread(target=also, args=(start, windows))
            sampler.start()
        nvml = nvml_windows([namespaced_pid(p.pid) if namespaced else p.pid for p in procs], start, windows, diag)
        if also:
            sampler.join()
        outs = []
        for i, p in enumerate(procs):
            out, _ = p.communicate(timeout=seconds + 60)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            outs.append(json.loads(lines[-1]) if lines else {"error": stderr_of(i)})
            errs[i].seek(0)
            outs[-1]["shim"] = shim_trace(errs[i].read())
        return start, nvml, outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for err in errs:
            err.close()


def nvml_windows(pids, start, windows, diag=None):
    """NVML per-process utilization, time-weighted over each window (seconds after `start`):
    [[share of pid, ...] per window].  A process NVML does not list in an interval was idle.
    With `diag` (a dict), also what the samples are like over the first window, per pid:
    how many NVML returns per call, how old their timestamps are, how often a pid has none,
    and the shim's own reading (shim/compute.c own_utilization: every 0.5 s, the samples
    since 0.5 s ago; here a pid without one counts 0, where the shim skips the window) --
    to tell, on a GPU, how often the driver samples each process."""
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)

    def read(since):
        got = {}
        try:
            for smp in pynvml.nvmlDeviceGetProcessUtilization(h, int(since * 1e6)):
                got.setdefault(smp.pid, []).append((smp.smUtil, smp.timeStamp / 1e6))
        except pynvml.NVMLError:
            pass
        return got

    end = start + max(b for _, b in windows)
    first = windows[0]
    intervals, shim_reads, last, polls = [], [], time.time(), 0
    counts, lags = {pid: [] for pid in pids}, {pid: [] for pid in pids}
    while last < end:
        time.sleep(0.25)
        now = time.time()
        got = read(last)
        answered = time.time()
        intervals.append((last - start, now - start, {pid: sum(u for u, _ in v) / len(v) for pid, v in got.items()}))
        if first[0] <= now - start <= first[1]:
            for pid in pids:
                counts[pid].append(len(got.get(pid, ())))
                lags[pid] += [1000 * (answered - ts) for _, ts in got.get(pid, ())]
            polls += 1
            if polls % 2 == 0:   # as the shim reads it
                shim = read(now - 0.5)
                shim_reads.append({pid: sum(u for u, _ in v) for pid, v in shim.items()})
        last = now
    if diag is not None and polls:
        diag.update({
            "polls": polls,
            "samples_per_call_max": [max(counts[p]) for p in pids],
            "polls_without_a_sample": [counts[p].count(0) for p in pids],
            "sample_age_ms_median": [round(statistics.median(lags[p])) if lags[p] else None for p in pids],
            "as_the_shim_reads": {
                "reads": len(shim_reads),
                "reads_without_a_sample": [sum(p not in r for r in shim_reads) for p in pids],
                "mean_percent": [round(statistics.mean(r.get(p, 0) for r in shim_reads), 1) if shim_reads else None
                                 for p in pids]}})
    return [[round(sum(u.get(pid, 0) * max(0.0, min(b, t1) - max(a, t0)) for t0, t1, u in intervals) / (b - a), 1)
             for pid in pids] for a, b in windows]


def counted(done, start, kernel_s, windows):
    """A tenant's share per window from the kernels it finished (sync mode): each took its solo
    time on the GPU, ending when the sync returned."""
    return [round(100 * sum(max(0.0, min(b, t - start) - max(a, t - start - kernel_s)) for t in done) / (b - a), 1)
            for a, b in windows]


def errors(shares, targets):
    """(error over the whole window, worst 1 s window's error) in points; shares[0] is the whole."""
    return (round(max(abs(g - t) for g, t in zip(shares[0], targets)), 1),
            round(max(abs(g - t) for w in shares[1:] for g, t in zip(w, targets)), 1))


def nvml_meaning_check():
    """What NVML's per-process utilization (smUtil, which the shim's correction reads as GPU
    time) reports on this GPU for work of known duty, no shim: one tenant at a time, 1 and
    7200 blocks, back to back and at a 50% duty cycle (idle as long as each kernel took),
    against the duty its kernels' count gives and the device's own utilization."""
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    sizes, rows = spin_calibration(), {}
    for blocks in (1, 7200):
        for mode in ("sync", "half"):
            n, ms = sizes[blocks]
            device = []

            def sample_device(start, windows):
                while time.time() < start + windows[0][1]:
                    time.sleep(0.2)
                    device.append(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
            diag = {}
            start, nvml, [out] = run_spins([(plain_env(), blocks, n, mode, 0.0)], 4.5, [[1.0, 4.0]],
                                           also=sample_device, diag=diag)
            rows[f"{blocks} block{'s' if blocks > 1 else ''}, {'back to back' if mode == 'sync' else '50% duty'}"] = {
                "counted": counted(out["done"], start, ms / 1000, [[1.0, 4.0]])[0], "process_smUtil": nvml[0][0],
                "device_gpu_util": round(statistics.mean(device[5:]), 1) if len(device) > 5 else None,
                "nvml_samples": diag}
    return rows


def duty_row(tenants, targets, mode, ms, also=None, namespaced=False):
    """One row of the duty table: the tenants (run_spins's) run together for 10.5 s; each
    one's NVML share and error against `targets`, with a sync after each kernel (`mode`
    "sync") also by the kernels it finished (each `ms` alone), and NVML's samples."""
    diag = {}
    start, nvml, outs = run_spins(tenants, 10.5, DUTY_WINDOWS, also=also, diag=diag, namespaced=namespaced)
    row = {"nvml": nvml[0], "nvml_error_points": errors(nvml, targets), "nvml_samples": diag}
    if mode == "sync" and all("done" in o for o in outs):
        by_count = [list(w) for w in zip(*(counted(o["done"], start, ms / 1000, DUTY_WINDOWS) for o in outs))]
        row.update(counted=by_count[0], counted_error_points=errors(by_count, targets))
    row["launches"] = [o.get("launches", o.get("error")) for o in outs]
    row["shim"] = [o["shim"] for o in outs]
    return row


def worst_error(row):
    """A duty row's worst tenant over the whole window: by the kernels it finished where
    they were counted, else by NVML."""
    return row.get("counted_error_points", row["nvml_error_points"])[0]


def duty_check(shim, tmp):
    """The side-by-side pairs and a four-tenant row on hardware; see the module's docstring."""
    sizes = spin_calibration()
    cases = [(f"30/70%, {what}, {'a sync after each' if mode == 'sync' else 'back to back'}", (30, 70), blocks, mode)
             for blocks, what in ((1, "1 block"), (7200, "7200 blocks")) for mode in ("kernel", "sync")]
    cases.append(("10/20/30/40%, 1 block, a sync after each", (10, 20, 30, 40), 1, "sync"))
    rows = {}
    for label, targets, blocks, mode in cases:
        n, ms = sizes[blocks]
        tenants = [(under_shim(shim, Path(tmp) / f"vgpu-duty-{len(rows)}", f"t{i}", VGPU_SM_LIMIT=f"{t}%", **TRACED),
                    blocks, n, mode, 0.0) for i, t in enumerate(targets)]
        rows[label] = duty_row(tenants, targets, mode, ms)
    worst = max(worst_error(r) for r in rows.values())
    return {"ok": worst <= 1.0, "kernel_ms": {str(b): round(ms, 2) for b, (_, ms) in sizes.items()},
            "worst_error_points": worst, "rows": rows}


@contextlib.contextmanager
def node_agent(vdir):
    """`vgpu-ctl agent` (this tree's, reporting only) watching `vdir` meanwhile; yields a
    dict whose "stderr" is the end of what it wrote there, once it has stopped."""
    ended = {}
    with tempfile.TemporaryFile(mode="w+") as log:
        agent = subprocess.Popen([sys.executable, "-c", "import sys; from vgpu.cli import main; sys.exit(main())",
                                  "agent", "--interval", "200ms", "--dir", str(vdir)], env=plain_env(),
                                 stdout=subprocess.DEVNULL, stderr=log)
        try:
            yield ended
        finally:
            agent.terminate()
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
            log.seek(0)
            ended["stderr"] = log.read().strip()[-600:]


def duty_no_agent_check(shim, tmp):
    """duty's pairs with a sync after each kernel (30/70%, 1 and 7200 blocks), each tenant in a
    pid namespace of its own and no node agent running: as containers are while the agent is
    down.  NVML lists processes by host pid, which only the agent writes into a slot, so the
    correction finds none of the tenants' and never sets a cost scale: their shares are the
    estimates' alone.  Beside duty's same rows, what the correction does on this GPU (the
    shim has no switch that turns it off).  `corrections`: how many the tenants' shims made,
    0 unless the check did not measure what it says."""
    if not can_unshare_pid():
        return {"skipped": "needs pid namespaces (unshare --pid: root)"}
    sizes, targets, rows = spin_calibration(), (30, 70), {}
    for blocks, what in ((1, "1 block"), (7200, "7200 blocks")):
        n, ms = sizes[blocks]
        vdir = Path(tmp) / f"vgpu-no-agent-{blocks}"
        tenants = [(under_shim(shim, vdir, f"t{i}", VGPU_SM_LIMIT=f"{t}%", **TRACED), blocks, n, "sync", 0.0)
                   for i, t in enumerate(targets)]
        rows[f"30/70%, {what}, a sync after each"] = duty_row(tenants, targets, "sync", ms, namespaced=True)
    return {"worst_error_points": max(worst_error(r) for r in rows.values()),
            "corrections": sum(len(t["corrections"]) for r in rows.values() for t in r["shim"] if t), "rows": rows}


def duty_containers_check(shim, tmp):
    """duty's first pair (30/70%, 1 block, a sync after each 20 ms kernel) with each tenant in
    a pid namespace of its own, as in a container, and the node agent (`vgpu-ctl agent`)
    watching their slices: the shim's correction reads NVML by the host pid the agent writes
    into each slot.  Also: the host pids the agent wrote (none: the correction never
    measured, and the estimates stood alone)."""
    if not can_unshare_pid():
        return {"skipped": "needs pid namespaces (unshare --pid: root)"}
    vgpu, why = vgpu_package()
    if not vgpu:
        return {"skipped": why}
    from vgpu import slices
    n, ms = spin_calibration()[1]
    vdir = Path(tmp) / "vgpu-containers"
    vdir.mkdir()
    targets = (30, 70)
    with node_agent(vdir) as agent:
        tenants = [(under_shim(shim, vdir, f"t{i}", VGPU_SM_LIMIT=f"{t}%", **TRACED), 1, n, "sync", 0.0)
                   for i, t in enumerate(targets)]
        host_pids = {}

        def note_host_pids(start, windows):   # what the agent wrote, while the slices are there
            while time.time() < start + windows[0][1] and len(host_pids) < len(targets):
                for i in range(len(targets)):
                    try:
                        u = slices.read_usage(vdir, f"t{i}")
                    except (slices.NotFound, slices.BadFile, OSError):   # not made yet
                        continue
                    host_pids.update({f"t{i}": p.host_pid for p in (u.procs if u else ()) if p.host_pid})
                time.sleep(0.1)
        row = duty_row(tenants, targets, "sync", ms, also=note_host_pids, namespaced=True)
    worst = worst_error(row)
    return {"ok": worst <= 1.0 and len(host_pids) == len(targets), "worst_error_points": worst,
            "agent_wrote_host_pids": host_pids, "agent_stderr": agent["stderr"], **row}


def woken_check(shim, tmp):
    """bench/test_burst_bench.py's yield case on hardware: t0 (guaranteed 30%, up to 100%)
    saturates with 20 ms kernels back to back; t1 (guaranteed 70%) wakes 3 s later, a sync
    after each 20 ms kernel.  The woken slice's share over its first second (from 0.1 s after
    the wake) by the kernels it finished, and by NVML; two rounds."""
    vgpu, why = vgpu_package()
    if not vgpu:
        return {"skipped": why}
    from vgpu import slices
    n, ms = spin_calibration()[1]
    wake = 3.0
    windows = [[1.0, 2.8], [wake + 0.1, wake + 1.1]]
    rounds = []
    for r in range(2):
        vdir = Path(tmp) / f"vgpu-woken-{r}"
        slices.create(vdir, "t0", {0: slices.device_quota(sm=10000, sm_request=3000)}, overcommit=True)
        slices.create(vdir, "t1", {0: slices.device_quota(sm=7000)}, overcommit=True)
        start, nvml, outs = run_spins([(under_shim(shim, vdir, "t0", **TRACED), 1, n, "kernel", 0.0),
                                       (under_shim(shim, vdir, "t1", **TRACED), 1, n, "sync", wake)], wake + 2.5,
                                      windows)
        first = counted(outs[1].get("done", []), start, ms / 1000, windows[1:])[0]
        rounds.append({"burster_alone_nvml": nvml[0][0], "woken_first_second_counted": first,
                       "woken_first_second_nvml": nvml[1][1], "burster_then_nvml": nvml[1][0],
                       "shim": [o["shim"] for o in outs]})
    return {"ok": all(abs(r["woken_first_second_counted"] - 70) <= 1 for r in rounds), "rounds": rounds}


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
        plain = plain_env()

        def memory():
            cap = 2 << 30
            r = child(MEMORY, under_shim(shim, vdir, "mem", VGPU_MEMORY_LIMIT="2Gi"))
            checks["mem_get_info"] = {"ok": r.get("total") == cap, **r}
            checks["oom_and_recover"] = {"ok": bool(r.get("refused_past_cap") and r.get("recovered")), **r}
            env = under_shim(shim, vdir, "expandable", VGPU_MEMORY_LIMIT="2Gi",
                             PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
            r = child(MEMORY, env)
            return {"ok": bool(r.get("total") == cap and r.get("refused_past_cap")), **r}

        def shares():
            [(solo_share, solo)] = run_side_by_side(MATMUL, [plain], SHARE_S)
            pair = run_side_by_side(MATMUL, [under_shim(shim, vdir, "s30", VGPU_SM_LIMIT="30%"),
                                             under_shim(shim, vdir, "s70", VGPU_SM_LIMIT="70%")], SHARE_S)
            base = solo.get("iterations_per_s") or float("nan")
            s = {"solo": {"nvml_percent": solo_share, **solo}}
            for (share, out), label in zip(pair, ("30%", "70%")):
                s[label] = {"nvml_percent": share, "throughput_percent_of_solo":
                            100 * out.get("iterations_per_s", 0) / base, **out}
            s["ok"] = all(abs((s[k]["nvml_percent"] or -100) - t) <= 5 for k, t in (("30%", 30), ("70%", 70)))
            return s

        def launch_overhead():
            """The tiny-kernel loop, two interleaved rounds of each: medians."""
            envs = {"without": plain, "shim 100%": under_shim(shim, vdir, "t100", VGPU_SM_LIMIT="100%"),
                    "shim 90%": under_shim(shim, vdir, "t90", VGPU_SM_LIMIT="90%")}
            got = {k: [] for k in envs}
            for i in range(2):
                for label in (list(envs) if i % 2 else list(envs)[::-1]):
                    got[label].append(child(TINY, envs[label]).get("us_per_iteration"))
            return {k: {"us_per_iteration": statistics.median(v) if None not in v else None, "rounds": v}
                    for k, v in got.items()}

        def graph_replay():
            [(g_share, g)] = run_side_by_side(GRAPH, [under_shim(shim, vdir, "graph", VGPU_SM_LIMIT="30%")], SHARE_S)
            return {"ok": g_share is not None and abs(g_share - 30) <= 5, "nvml_percent": g_share, **g}

        plan = [("start_up", lambda: start_up_check(shim, tmp)), ("start_up_32", lambda: start_up_32_check(shim, tmp)),
                ("expandable", memory), ("nvml_meaning", nvml_meaning_check),
                ("duty", lambda: duty_check(shim, tmp)),
                ("duty_no_agent", lambda: duty_no_agent_check(shim, tmp)),
                ("duty_containers", lambda: duty_containers_check(shim, tmp)),
                ("woken", lambda: woken_check(shim, tmp)),
                ("launch_overhead", launch_overhead), ("shares", shares), ("graph_replay", graph_replay),
                ("footprint", lambda: footprint_check(shim, Path(tmp) / "vgpu-footprint")),
                ("burst", lambda: burst_check(shim, Path(tmp) / "vgpu-burst")),
                ("driver_limit", lambda: driver_limit_check(tmp))]
        for name, check in plan:
            # (the memory checks run together: any of their names runs them)
            together = {"mem_get_info", "oom_and_recover", "expandable"} if name == "expandable" else {name}
            if ONLY and not together & set(ONLY):
                continue
            t0 = time.time()
            try:
                checks[name] = check()
            except Exception as e:   # one check's failure is its result; the others still run
                checks[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-600:]}
            checks[name]["seconds"] = round(time.time() - t0, 1)
            if OUT:
                Path(OUT).write_text(json.dumps(result, indent=2))
            print(f"{name}: {json.dumps(checks[name])}", file=sys.stderr, flush=True)
    result["ok"] = all(c.get("ok", True) for c in checks.values())
    print(json.dumps(result, indent=2))
    if OUT:
        Path(OUT).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
