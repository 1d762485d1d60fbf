"""The driver layer of a slice's memory cap (src/vgpu/driverlimits.py): `vgpu-ctl run` puts
its command in a cgroup of the slice's own and has the driver (simgpu's model of NVML's
per-cgroup limits, simgpu/limits.c) hold it to the slice's cap, so a process that
bypasses the shim is held too.  Real processes, real cgroup v2 directories (as root),
`vgpu-ctl` as a real command; simgpu's NVML read without the shim is the referee.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.agent.test_node_agent import agents, boxes, cgroup  # noqa: F401 (fixtures)
from tests.helpers.paths import PROGRAMS
from tests.helpers.simnode import make_sim_env, run_python
from tests.helpers.wait import wait_until
from tests.simgpu.test_simgpu_limits import ROOT   # the cgroup v2 root
from vgpu import driverlimits

GiB, MiB = 1 << 30, 1 << 20
CTL = str(Path(sys.executable).parent / "vgpu-ctl")
TENANT = PROGRAMS / "tenant.py"
OOM = 2   # CUDA_ERROR_OUT_OF_MEMORY
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or ROOT is None or not os.access(ROOT, os.W_OK),
                                reason="needs root and a writable cgroup v2 hierarchy")

LIMITS = """
import json, sys
import pynvml as n
n.nvmlInit()
l = n.c_nvmlGetMemoryLimits_v1_t(sys.argv[1].encode(), 0, 0, 0)
try:
    n.nvmlDeviceGetMemoryLimits_v1(n.nvmlDeviceGetHandleByIndex(0), l)
    print(json.dumps([l.softLimit, l.hardLimit]))
except n.NVMLError:   # none set, or no such cgroup (yet)
    print(json.dumps(None))
"""


METRICS = """
from prometheus_client import CollectorRegistry, generate_latest
from vgpu.metrics import NodeCollector
registry = CollectorRegistry()
registry.register(NodeCollector())
print(generate_latest(registry).decode())
"""


def env_for(tmp_path, **extra):
    return make_sim_env(tmp_path / "node", VGPU_DIR=str(tmp_path / "vgpu"), **extra)


def cgroup_of(env, name):
    """The cgroup `vgpu-ctl run` gives slice `name` of the node directory in env."""
    return driverlimits.slice_cgroup(env["VGPU_DIR"], name)


def driver_limit(env, name):
    """What the driver holds slice `name`'s cgroup to: [soft, hard], or None."""
    return json.loads(run_python(LIMITS, env, args=(str(cgroup_of(env, name)),)).stdout.strip().splitlines()[-1])


class Bypass:
    """tenant.py WITHOUT the shim (LD_PRELOAD taken out), started by `vgpu-ctl run` in slice
    `name`: as a program that unsets LD_PRELOAD would be."""

    def __init__(self, env, name, *run_args):
        self.proc = subprocess.Popen([CTL, "run", "--name", name, *run_args, "--", "env", "-u", "LD_PRELOAD",
                                      sys.executable, str(TENANT)], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = self.proc.stdout.readline()
        assert first, self.proc.stderr.read()
        self.pid = json.loads(first)["pid"]

    def alloc(self, size):
        self.proc.stdin.write(json.dumps({"alloc": size}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return answer if isinstance(answer, int) else answer["alloc"]

    def end(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        return self.proc.stderr.read()


@pytest.fixture
def bypasses():
    made = []
    yield lambda *a: made.append(Bypass(*a)) or made[-1]
    for b in made:
        if b.proc.poll() is None:
            b.proc.kill()
            b.proc.wait()


def ctl(env, *args):
    out = subprocess.run([CTL, *args], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def test_a_process_that_bypasses_the_shim_is_held_by_the_driver_and_resize_and_delete_follow(tmp_path, bypasses):
    env = env_for(tmp_path)
    ctl(env, "create", "train", "--memory", "512Mi")
    raw = bypasses(env, "train")
    assert driver_limit(env, "train") == [512 * MiB, 512 * MiB]
    assert raw.alloc(256 * MiB) == 0
    assert raw.alloc(512 * MiB) == OOM                    # past the slice's cap: the driver refuses
    status = json.loads(ctl(env, "status", "--json").stdout)
    [c] = status["slices"]
    assert c["memory_layer"] == {"layer": "driver+shim", "why": None}
    assert "memory capped by the driver too: train" in ctl(env, "status").stdout
    scraped = run_python(METRICS, env).stdout
    assert 'vgpu_memory_layer_info{container="train",layer="driver+shim",slice="train"} 1.0' in scraped, scraped
    ctl(env, "resize", "train", "--memory", "1Gi")         # grows with it, process running
    assert driver_limit(env, "train")[1] == GiB
    assert raw.alloc(512 * MiB) == 0
    ctl(env, "resize", "train", "--memory", "768Mi")       # shrinks below use: nothing more fits
    assert driver_limit(env, "train")[1] == 768 * MiB and raw.alloc(64 * MiB) == OOM
    assert "held by the shim alone" not in raw.end()
    assert not cgroup_of(env, "train").exists()            # the run's cgroup went with its command


def test_a_driver_without_the_api_falls_back_to_the_shim_and_says_so(tmp_path, bypasses):
    env = env_for(tmp_path, SIMGPU_MEMORY_LIMITS="0")
    ctl(env, "create", "old", "--memory", "512Mi")
    raw = bypasses(env, "old")
    assert raw.alloc(GiB) == 0                             # nothing but the shim, which it bypassed
    status = json.loads(ctl(env, "status", "--json").stdout)
    assert status["slices"][0]["memory_layer"] == {"layer": "shim", "why": "no cgroup of its own"}
    warning = raw.end()
    assert "slice old: memory held by the shim alone (the driver has no per-cgroup memory limits)" in warning


def test_a_temporary_run_clears_its_limit_and_leaves_no_cgroup(tmp_path):
    env = env_for(tmp_path)
    code = ("import ctypes; c = ctypes.CDLL('libcuda.so.1'); c.cuInit(0); d = ctypes.c_int(); x = ctypes.c_void_p(); "
            "c.cuDeviceGet(ctypes.byref(d), 0); c.cuDevicePrimaryCtxRetain(ctypes.byref(x), d); c.cuCtxSetCurrent(x); "
            "p = ctypes.c_uint64(); print(c.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(768 << 20))); "
            "print([l for l in open('/proc/self/cgroup') if l.startswith('0::')][0][3:].strip())")
    out = subprocess.run([CTL, "run", "--memory", "512Mi", "--", "env", "-u", "LD_PRELOAD", sys.executable, "-c",
                          code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    refused, cgroup = out.stdout.split()
    assert refused == str(OOM) and cgroup.startswith("/vgpu/") and "/run" in cgroup   # its own, held at the cap
    assert not (ROOT / cgroup.lstrip("/")).exists()                   # gone with the run


CHURN = """
import ctypes, os, random, sys, time
c = ctypes.CDLL("libcuda.so.1")
c.cuInit(0)
d, x = ctypes.c_int(), ctypes.c_void_p()
c.cuDeviceGet(ctypes.byref(d), 0)
c.cuDevicePrimaryCtxRetain(ctypes.byref(x), d)
c.cuCtxSetCurrent(x)
held, end = [], time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:          # take 32 MiB chunks until refused, give some back
    p = ctypes.c_uint64()
    if c.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(32 << 20)) == 0:
        held.append(p.value)
    elif held:
        for _ in range(random.randint(1, len(held))):
            c.cuMemFree_v2(ctypes.c_uint64(held.pop(random.randrange(len(held)))))
os.write(1, b"done\\n")   # one write: the two processes share the pipe (print split it once: "donedone")
"""

REFEREE = """
import json, sys, time
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
l = n.c_nvmlGetMemoryLimits_v1_t(sys.argv[1].encode(), 0, 0, 0)
peak, samples, end = 0, 0, time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:          # every millisecond: what the slice's cgroup holds
    try:
        n.nvmlDeviceGetMemoryLimits_v1(h, l)
        peak, samples = max(peak, l.currentUsed), samples + 1
    except n.NVMLError:
        pass
    time.sleep(0.001)
print(json.dumps([peak, samples]))
"""


def test_a_shimmed_and_an_unshimmed_process_in_one_cgroup_never_exceed_the_cap_together(tmp_path):
    env = env_for(tmp_path)
    ctl(env, "create", "both", "--memory", "256Mi")
    seconds = 3
    # the run's command starts one process under the shim and one without it, both churning
    script = (f"{sys.executable} -c '{CHURN}' {seconds} & env -u LD_PRELOAD {sys.executable} -c '{CHURN}' {seconds} & "
              "wait")
    run = subprocess.Popen([CTL, "run", "--name", "both", "--", "sh", "-c", script], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        cgroup = cgroup_of(env, "both")
        deadline = time.monotonic() + 10
        while driver_limit(env, "both") is None:            # the limit is set before the command starts
            assert time.monotonic() < deadline and run.poll() is None, run.stderr.read()
        peak, samples = json.loads(run_python(REFEREE, env, args=(str(cgroup), str(seconds - 0.5))).stdout
                                   .strip().splitlines()[-1])
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert out.split() == ["done", "done"], err
    assert samples > 100                                    # a sample every millisecond or so (fewer under load)
    assert 0 < peak <= 256 * MiB, peak


def test_the_cgroup_a_killed_run_left_is_removed_by_reap_once_its_slice_is_gone(tmp_path):
    env = env_for(tmp_path)
    ctl(env, "create", "kept", "--memory", "512Mi")
    left, kept, young = cgroup_of(env, "run-gone"), cgroup_of(env, "kept"), cgroup_of(env, "run-new")
    for path in (left, kept, young):
        path.mkdir(parents=True, exist_ok=True)
    try:
        old = time.time() - 3600
        os.utime(left, (old, old))
        os.utime(kept, (old, old))
        ctl(env, "reap")
        assert not left.exists()                    # its slice is gone: removed
        assert kept.exists() and young.exists()     # a slice that exists; one made a moment ago
    finally:
        for path in (left, kept, young, left.parent):
            if path.exists():
                path.rmdir()


# === containers: the node agent limits the cgroup it finds their processes in ===

def test_the_agent_puts_a_container_s_slice_cap_on_its_cgroup_and_a_bypasser_is_held(tmp_path, boxes, cgroup,
                                                                                      agents):
    """A container (its own mount namespace and cgroup) of slice `a` (2 GiB): a process
    under the shim and one without it.  The node agent finds their cgroup and puts the
    slice's cap on it: the bypasser, which the shim cannot see, is refused past 2 GiB by the
    driver (before: admitted, 2.5 GiB on the device).  `status` says driver+shim with the
    cgroup; a resize follows; deleting the slice clears it."""
    from tests.agent.test_node_agent import Node, _slice_mounts, inner_env
    from vgpu import runtime
    node_ = Node(tmp_path)
    node_.dir.mkdir()
    node_.ctl("create", "a", "--memory", "2Gi", "--request", "1Gi")
    box = boxes(_slice_mounts(node_, "a"), cgroup=cgroup)
    member = box.run(inner_env(node_, LD_PRELOAD=runtime.CONTAINER_SHIM, VGPU_DIR="/run/vgpu", VGPU_SLICE="a"))
    raw = box.run(inner_env(node_))                   # no shim: only the driver can hold it
    assert member.call(alloc=GiB // 2) == 0 and raw.call(alloc=GiB) == 0
    agent = agents(node_, "--interval", "200ms")
    done = agent.wait_for(lambda e: e.get("event") == "driver-limit" and e.get("result") == "set", 10)
    assert (done["slice"], done["cgroup"], done["devices"]) == ("a", cgroup, {"0": {"soft": GiB, "hard": 2 * GiB}})
    assert _limits(node_.env, cgroup) == [GiB, 2 * GiB]
    assert raw.call(alloc=GiB) == OOM                 # 0.5 + 1 + 1 > 2 GiB: the driver refuses
    assert raw.call(alloc=GiB // 4) == 0
    (c,) = node_.status()["slices"]
    assert c["memory_layer"] == {"layer": "driver+shim", "why": None, "cgroup": cgroup}
    node_.ctl("resize", "a", "--memory", "3Gi")
    assert agent.wait_for(lambda e: e.get("event") == "driver-limit" and e.get("result") == "resized", 10)
    assert _limits(node_.env, cgroup) == [GiB, 3 * GiB]
    assert raw.call(alloc=GiB) == 0
    member.kill()
    raw.kill()
    node_.ctl("delete", "a")
    assert agent.wait_for(lambda e: e.get("event") == "driver-limit" and e.get("result") == "cleared", 10)
    assert _limits(node_.env, cgroup) is None


def test_two_slices_in_one_cgroup_are_left_to_the_shim_and_say_why(tmp_path, boxes, cgroup, agents):
    """Two containers of two slices put in one cgroup: one limit cannot be two caps, so
    neither gets one, and the log and `status` say the cgroup is shared."""
    from tests.agent.test_node_agent import Node, _slice_mounts, inner_env
    from vgpu import runtime
    node_ = Node(tmp_path)
    node_.dir.mkdir()
    for name in ("a", "b"):
        node_.ctl("create", name, "--memory", "1Gi")
        box = boxes(_slice_mounts(node_, name), cgroup=cgroup)
        t = box.run(inner_env(node_, LD_PRELOAD=runtime.CONTAINER_SHIM, VGPU_DIR="/run/vgpu", VGPU_SLICE=name))
        assert t.call(alloc=GiB // 4) == 0
    agent = agents(node_, "--interval", "200ms")
    said = agent.wait_for(lambda e: e.get("event") == "driver-limit" and e.get("result") == "shim only", 10)
    assert said["why"] in ("its cgroup is shared with slice a", "its cgroup is shared with slice b"), said
    assert _limits(node_.env, cgroup) is None
    assert wait_until(lambda: sorted(c["memory_layer"]["why"] for c in node_.status()["slices"]) ==
                      ["its cgroup is shared with slice a", "its cgroup is shared with slice b"], 5)


def _limits(env, path):
    return json.loads(run_python(LIMITS, env, args=[path]).stdout)


def test_a_pod_s_containers_in_cgroups_of_their_own_are_held_together_by_the_pod_s_cgroup(tmp_path, cgroup, agents):
    """A pod of two containers (each its own cgroup below the pod's, as the kubelet's systemd
    driver names them, and its own mount namespace) shares one claim's 1 GiB, no shim in
    either.  A limit on each container would give each the whole cap; the agent puts it on
    the pod's cgroup, so together they are refused past 1 GiB."""
    import uuid
    from tests.agent.test_node_agent import Node, Tenant, inner_env
    from vgpu import podlabels
    node_ = Node(tmp_path)
    node_.dir.mkdir()
    uid = str(uuid.uuid4())
    pod = f"{cgroup}/kubepods-besteffort-pod{uid.replace('-', '_')}.slice"
    parts = [f"{pod}/cri-containerd-{i}.scope" for i in (1, 2)]
    for path in (pod, *parts):
        os.mkdir(path)
    node_.ctl("create", "claim-1", "--memory", "1Gi")
    podlabels.write(node_.dir, "claim-1", {"namespace": "ns", "pod": "p", "pod_uid": uid})
    tenants = [Tenant({"PATH": "/usr/bin:/bin", **inner_env(node_)},
                      prefix=["unshare", "--mount", "sh", "-c", f'echo $$ > {part}/cgroup.procs; exec "$0" "$@"'])
               for part in parts]
    try:
        assert tenants[0].call(alloc=GiB // 2) == 0 and tenants[1].call(alloc=GiB // 4) == 0
        agent = agents(node_, "--interval", "200ms")
        done = agent.wait_for(lambda e: e.get("event") == "driver-limit" and e.get("result") == "set", 10)
        assert (done["slice"], done["cgroup"]) == ("claim-1", pod)
        assert tenants[1].call(alloc=GiB // 2) == OOM     # 0.5 + 0.25 + 0.5 GiB > 1 GiB, in the pod together
        assert tenants[0].call(alloc=GiB // 4) == 0
    finally:
        for t in tenants:
            t.kill()
        for path in (*parts, pod):
            for _ in range(50):
                try:
                    os.rmdir(path)
                    break
                except OSError:
                    time.sleep(0.1)
