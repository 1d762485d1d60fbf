"""vgpu-ctl end to end on simgpu: the real command line, real workloads under the shim.

The controller runs as its own process (`vgpu-ctl ...` with simgpu's libraries on
LD_LIBRARY_PATH, so its NVML is the simulated node's); workloads are long-running
cuda-bindings children under LD_PRELOAD=libvgpu.so that take commands on stdin.  Judged
from outside: the workload's own CUDA results, `status --json`, and the usage file.
"""
import ctypes.util
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.children import JsonChild
from tests.helpers.simnode import make_sim_env
from vgpu.paths import SHIM
from vgpu.slices import read_usage

GiB, MiB = 1 << 30, 1 << 20
SUCCESS, OUT_OF_MEMORY = 0, 2
CTL = str(Path(sys.executable).parent / "vgpu-ctl")

AGENT = r"""
import json, os, sys
from cuda.bindings import driver as cu

def rc(r):
    return int((r if isinstance(r, tuple) else (r,))[0])

assert rc(cu.cuInit(0)) == 0
dev = cu.cuDeviceGet(0)[1]
assert rc(cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(dev)[1])) == 0
stream = cu.cuStreamCreate(0)[1]
held = []
print(json.dumps({"pid": os.getpid()}), flush=True)
for line in sys.stdin:
    cmd, arg = json.loads(line)
    if cmd == "alloc":
        r = cu.cuMemAlloc(arg)
        if rc(r) == 0:
            held.append(r[1])
        out = rc(r)
    elif cmd == "free":
        out = rc(cu.cuMemFree(held.pop()))
    elif cmd == "busy":            # arg kernels of 20 ms each, queued at once
        f = cu.cuModuleGetFunction(cu.cuModuleLoadData(b"img")[1], b"sim_20000us")[1]
        out = max(rc(cu.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, 0, 0)) for _ in range(arg))
    print(json.dumps(out), flush=True)
"""


class Node:
    def __init__(self, root):
        self.dir = root / "vgpu"
        self.env = make_sim_env(root / "node")

    def ctl(self, *args, ok=True):
        out = subprocess.run([CTL, *map(str, args), "--dir", str(self.dir)], env=self.env, capture_output=True,
                             text=True, timeout=60)
        if ok and out.returncode != 0:
            raise AssertionError(f"vgpu-ctl {' '.join(map(str, args))} -> {out.returncode}\n"
                                 f"{out.stdout}{out.stderr}")
        return out

    def ctl_json(self, *args):
        return json.loads(self.ctl(*args, "--json").stdout)

    def workload_env(self, name):
        return {**self.env, "LD_PRELOAD": str(SHIM), "VGPU_DIR": str(self.dir), "VGPU_SLICE": name}


class Agent(JsonChild):
    def __init__(self, env):
        super().__init__(AGENT, env, "agent")
        self.pid = self.read()["pid"]


@pytest.fixture
def node(tmp_path):
    return Node(tmp_path)


@pytest.fixture
def agents():
    started = []

    def start(env):
        started.append(Agent(env))
        return started[-1]

    yield start
    for a in started:
        a.kill()


def test_create_run_status_resize_down_and_up_without_restart(node, agents):
    assert "created c1" in node.ctl("create", "c1", "--memory", "2Gi", "--sm", "50%").stdout
    a = agents(node.workload_env("c1"))
    assert a.call("alloc", GiB) == SUCCESS
    assert a.call("busy", 50) == SUCCESS          # 1 s of GPU time, so NVML has something to say

    s = node.ctl_json("status", "c1")
    (c,) = s["slices"]
    (d,) = c["devices"]
    assert (c["name"], d["index"], d["memory_max"], d["memory_current"], d["sm_max"]) == \
        ("c1", 0, 2 * GiB, GiB, 5000)
    (p,) = c["processes"]
    assert (p["pid"], p["host_pid"], p["alive"], p["memory"]) == (a.pid, a.pid, True, {"0": GiB})
    assert "python" in p["command"]
    assert d["sm_used"] > 0 and d["sm_used_source"] == "nvml"   # simgpu's per-process utilization
    (dev,) = s["devices"]
    assert (dev["name"], dev["memory_total"], dev["memory_used"]) == ("NVIDIA A10", 24 * GiB, GiB)
    assert (dev["memory_allocated"], dev["memory_guaranteed"], dev["sm_allocated"]) == (2 * GiB, 2 * GiB, 5000)
    assert s["nvml"]["available"] is True

    table = node.ctl("status").stdout
    assert "GPU-MEMORY" in table and "GPU-UTIL" in table
    assert any(line.split()[:3] == ["c1", "0", "1Gi/2Gi"] for line in table.splitlines())
    assert any(line.split()[:3] == ["c1", str(a.pid), str(a.pid)] for line in table.splitlines())

    out = node.ctl("resize", "c1", "--memory", "1536Mi")
    assert out.stdout.splitlines()[0].startswith("c1 device 0: memory.max 2Gi → 1.5Gi")
    assert out.stderr == ""
    assert a.call("alloc", GiB) == OUT_OF_MEMORY   # 1 GiB held + 1 GiB > 1.5 GiB, at once
    assert a.call("alloc", 512 * MiB) == SUCCESS

    node.ctl("resize", "c1", "--memory", "3Gi")
    assert a.call("alloc", GiB) == SUCCESS         # same process: no restart
    assert read_usage(node.dir, "c1").devices[0]["memory_current"] == 2560 * MiB

    out = node.ctl("resize", "c1", "--memory", "1Gi")   # below what it holds
    assert "warning: c1 device 0 holds 2.5Gi, above the new memory.max 1Gi" in out.stderr
    assert a.call("alloc", 1) == OUT_OF_MEMORY
    assert a.call("free") == SUCCESS and a.call("free") == SUCCESS   # 1 GiB left
    assert a.call("alloc", 1) == OUT_OF_MEMORY     # exactly at the cap
    assert a.call("free") == SUCCESS
    assert a.call("alloc", GiB) == SUCCESS
    assert a.proc.poll() is None


def test_resize_refuses_to_overcommit_the_device_unless_asked(node):
    node.ctl("create", "a", "--memory", "16Gi")
    node.ctl("create", "b", "--memory", "4Gi")
    out = node.ctl("resize", "b", "--memory", "10Gi", ok=False)
    assert out.returncode == 1
    assert out.stderr.strip() == ("Error: device 0 would be overcommitted: 26Gi guaranteed (b 10Gi + others 16Gi)"
                                  " > 24Gi physical; hint: shrink other slices, ask for less, or pass "
                                  "--overcommit")
    assert node.ctl_json("list")[1]["devices"][0]["memory_max"] == 4 * GiB   # untouched
    # a cap above what is guaranteed is fine: only requests are promises
    node.ctl("resize", "b", "--memory", "10Gi", "--request", "8Gi")               # 24Gi of 24Gi: fits
    node.ctl("resize", "b", "--memory", "12Gi", "--request", "9Gi", "--overcommit")
    out = node.ctl("create", "c", "--memory", "8Gi", ok=False)
    assert out.returncode == 1 and "overcommitted: 33Gi guaranteed" in out.stderr
    node.ctl("create", "c", "--memory", "8Gi", "--request", "0")                  # best effort: no promise
    node.ctl("resize", "b", "--request", "8Gi")           # shrinking is allowed on an overcommitted device
    assert node.ctl_json("status")["devices"][0]["memory_guaranteed"] == 24 * GiB


def test_reap_after_kill_9_returns_the_memory(node, agents):
    node.ctl("create", "c1", "--memory", "4Gi")
    a = agents(node.workload_env("c1"))
    b = agents(node.workload_env("c1"))
    assert a.call("alloc", GiB) == SUCCESS and b.call("alloc", 512 * MiB) == SUCCESS
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)

    usage = read_usage(node.dir, "c1")      # the file as the shim left it: a's slot is dead
    assert {p.pid: p.alive for p in usage.procs} == {a.pid: False, b.pid: True}
    reaped = node.ctl_json("reap")
    assert [(r["slice"], r["pid"], r["memory"]) for r in reaped] == [("c1", a.pid, {"0": GiB})]
    usage = read_usage(node.dir, "c1")
    assert usage.devices[0]["memory_current"] == 512 * MiB
    assert [(p.pid, p.memory) for p in usage.procs] == [(b.pid, {0: 512 * MiB})]
    assert node.ctl("reap").stdout.strip() == "nothing to reap"
    assert b.call("alloc", 3 * GiB + 512 * MiB) == SUCCESS    # the whole budget is there again


def test_status_reaps_what_it_reads(node, agents):
    """status shows what live processes hold: a killed process's slot is reaped by the
    read itself, not left for a later `reap`."""
    node.ctl("create", "c1", "--memory", "4Gi")
    a = agents(node.workload_env("c1"))
    b = agents(node.workload_env("c1"))
    assert a.call("alloc", GiB) == SUCCESS and b.call("alloc", 512 * MiB) == SUCCESS
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    c = node.ctl_json("status", "c1")["slices"][0]
    assert [p["pid"] for p in c["processes"]] == [b.pid]
    assert c["devices"][0]["memory_current"] == 512 * MiB
    assert node.ctl("reap").stdout.strip() == "nothing to reap"


def test_resize_below_what_only_a_dead_process_held_does_not_warn(node, agents):
    """The shrink warning is about live processes: a killed holder's slot is reaped
    first, so a resize after a crash is not told its slice is over the new cap."""
    node.ctl("create", "c1", "--memory", "4Gi")
    a = agents(node.workload_env("c1"))
    assert a.call("alloc", 3 * GiB) == SUCCESS
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    out = node.ctl("resize", "c1", "--memory", "2Gi")
    assert "holds" not in out.stderr, out.stderr
    b = agents(node.workload_env("c1"))
    assert b.call("alloc", 3 * GiB) != SUCCESS and b.call("alloc", 2 * GiB) == SUCCESS
    out = node.ctl("resize", "c1", "--memory", "1Gi")
    assert "c1 device 0 holds 2Gi, above the new memory.max 1Gi" in out.stderr


def test_delete_is_refused_while_processes_run(node, agents):
    node.ctl("create", "c1", "--memory", "1Gi")
    a = agents(node.workload_env("c1"))
    assert a.call("alloc", MiB) == SUCCESS
    out = node.ctl("delete", "c1", ok=False)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"Error: slice c1 has 1 live process(es) (pid {a.pid}); "
                                  "hint: stop them first, or pass --force")
    a.kill()
    assert node.ctl("delete", "c1").stdout.strip() == "deleted c1"
    assert not (node.dir / "c1").exists()


def test_run_sim_passes_the_exit_code_through_and_keeps_an_existing_preload(node, tmp_path):
    report = tmp_path / "child.json"
    child = ("import json, os, sys\n"
             "from cuda.bindings import driver as cu\n"
             "cu.cuInit(0); cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1])\n"
             "json.dump({'preload': os.environ['LD_PRELOAD'], 'ctr': os.environ['VGPU_SLICE'],\n"
             "           'info': [int(x) for x in cu.cuMemGetInfo()[1:]],\n"
             "           'over': int(cu.cuMemAlloc(1 << 30)[0])}, open(sys.argv[1], 'w'))\n"
             "sys.exit(7)\n")
    env = {k: v for k, v in node.env.items() if k != "LD_LIBRARY_PATH"}   # --sim must add it
    env["LD_PRELOAD"] = "libm.so.6"                                          # defines nothing we hook
    env["VGPU_MEMORY_LIMIT"] = "garbage"          # standalone variables do not leak into a slice
    out = subprocess.run([CTL, "run", "--sim", "--memory", "512Mi", "--dir", str(node.dir), "--",
                          sys.executable, "-c", child, str(report)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 7, out.stderr
    r = json.loads(report.read_text())
    assert r["preload"] == f"{SHIM}:libm.so.6"   # kept, with the shim first (its dlsym must win)
    assert r["ctr"].startswith("run-")
    assert r["info"] == [512 * MiB, 512 * MiB]
    assert r["over"] == OUT_OF_MEMORY
    assert not node.dir.exists()   # the temporary slice is gone, with the node directory and board it made


def test_run_reports_a_signal_death_as_128_plus_the_signal(node):
    out = subprocess.run([CTL, "run", "--sim", "--dir", str(node.dir), "--", sys.executable, "-c",
                          "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], env=node.env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 128 + signal.SIGTERM


@pytest.mark.skipif(bool(ctypes.util.find_library("nvidia-ml")), reason="a real NVML is installed here")
def test_status_without_nvml_still_reports_the_slices_with_a_note(node, agents):
    node.ctl("create", "c1", "--memory", "2Gi", "--sm", "25%")
    a = agents(node.workload_env("c1"))
    assert a.call("alloc", GiB) == SUCCESS
    env = {k: v for k, v in node.env.items() if k != "LD_LIBRARY_PATH"}
    out = subprocess.run([CTL, "status", "--dir", str(node.dir)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert any(line.split()[:4] == ["c1", "0", "1Gi/2Gi", "(50%)"] for line in out.stdout.splitlines())
    assert "note: NVML unavailable" in out.stdout
