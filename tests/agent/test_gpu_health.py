"""GPU health: simgpu's NVML event sets as nvml.h documents them, XIDs and lost GPUs raised
with `vgpu-ctl sim xid|lose`, and the node agent telling healthy from unhealthy GPUs by
NVIDIA's Xid catalog (vgpu.health) in its log, `status` and metrics.  pynvml (NVIDIA's
nvidia-ml-py) is the client throughout; the agent runs as its own process."""
import json
import subprocess
import sys
import textwrap
import time

import pytest

from tests.agent.test_node_agent import CTL, Node, agents, spawn  # noqa: F401 (agents, spawn: fixtures)
from tests.helpers.simnode import run_python
from tests.helpers.wait import wait_until
from vgpu import health

EVENTS = """
import json, sys, time
import pynvml as n
n.nvmlInit()
out = {}
h0, h1 = n.nvmlDeviceGetHandleByIndex(0), n.nvmlDeviceGetHandleByIndex(1)
out["supported"] = n.nvmlDeviceGetSupportedEventTypes(h0)
s = n.nvmlEventSetCreate()
try:
    n.nvmlDeviceRegisterEvents(h0, n.nvmlEventTypeXidCriticalError | n.nvmlEventTypePState, s)
except n.NVMLError as e:
    out["unsupported"] = e.value
n.nvmlDeviceRegisterEvents(h1, n.nvmlEventTypeXidCriticalError, s)
t0 = time.monotonic()
try:
    n.nvmlEventSetWait_v2(s, 100)
except n.NVMLError as e:
    out["empty"] = [e.value, round(time.monotonic() - t0, 2)]
print(json.dumps({"registered": True}), flush=True)
sys.stdin.readline()                       # the test raises XIDs now
got = []
while True:
    try:
        d = n.nvmlEventSetWait_v2(s, 300)
    except n.NVMLError as e:
        got.append(e.value)
        break
    got.append([n.nvmlDeviceGetIndex(d.device), d.eventType, d.eventData, d.gpuInstanceId])
out["got"] = got
print(json.dumps(out), flush=True)
sys.stdin.readline()                       # GPU 1 falls off the bus now
out["after_loss"] = []
while True:
    try:
        d = n.nvmlEventSetWait_v2(s, 300)
    except n.NVMLError as e:
        out["after_loss"].append(e.value)
        break
    out["after_loss"].append([d.eventType, d.eventData])   # (its handle answers GPU_IS_LOST now)
try:
    n.nvmlDeviceGetHandleByIndex(1)
except n.NVMLError as e:
    out["handle_of_lost"] = e.value
out["gpu0_name"] = n.nvmlDeviceGetName(h0)
n.nvmlEventSetFree(s)
print(json.dumps(out), flush=True)
"""


def _ctl(node_, *args, ok=True, env=None):
    """`vgpu-ctl sim ARGS` on the node's simgpu (no node directory: simgpu's own)."""
    out = subprocess.run([CTL, "sim", *args], env=env or node_.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 or not ok, out.stderr
    return out


def test_simgpu_event_sets_deliver_each_xid_of_a_registered_gpu_and_say_when_a_gpu_is_lost(tmp_path):
    """XID 48 on GPU 1 and XID 13 on GPU 1 reach the set registered for GPU 1, in order, with
    their data; XID 31 raised before registration and GPU 0's XID (its registration refused:
    a type simgpu does not support) do not; an empty set times out; a lost GPU is
    NVML_ERROR_GPU_IS_LOST for its handle and for the set's wait."""
    node_ = Node(tmp_path, devices=2)
    node_.dir.mkdir()
    _ctl(node_, "xid", "1", "31")                        # before any set: recorded by none
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(EVENTS)], env=node_.env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert json.loads(p.stdout.readline()) == {"registered": True}, p.stderr.read()
        _ctl(node_, "xid", "1", "48")
        _ctl(node_, "xid", "0", "79")                    # GPU 0 is not in the set
        _ctl(node_, "xid", "1", "13")
        p.stdin.write("\n")
        p.stdin.flush()
        out = json.loads(p.stdout.readline())
        xid = 8                                          # nvmlEventTypeXidCriticalError
        assert out["supported"] == xid
        assert out["unsupported"] == 3                   # NVML_ERROR_NOT_SUPPORTED: nothing registered
        assert out["empty"][0] == 10 and 0.09 <= out["empty"][1] < 1.0    # NVML_ERROR_TIMEOUT after ~100 ms
        assert out["got"] == [[1, xid, 48, 0xFFFFFFFF], [1, xid, 13, 0xFFFFFFFF], 10]
        _ctl(node_, "lose", "1")
        p.stdin.write("\n")
        p.stdin.flush()
        out = json.loads(p.stdout.readline())
        # the XID 79 the loss raises comes first; then, nothing pending, the loss itself
        assert out["after_loss"] == [[xid, 79], 15], out
        assert out["handle_of_lost"] == 15               # NVML_ERROR_GPU_IS_LOST
        assert out["gpu0_name"]                          # the other GPU answers as before
    finally:
        p.kill()
        p.wait()


def test_sim_xid_without_a_simulated_node_or_gpu_is_one_line_with_a_hint(tmp_path):
    node_ = Node(tmp_path)
    out = _ctl(node_, "xid", "3", "48", ok=False)
    assert out.returncode == 1 and "no GPU 3" in out.stderr and "Traceback" not in out.stderr
    env = {k: v for k, v in node_.env.items() if k != "SIMGPU_STATE_DIR"}
    out = _ctl(node_, "lose", "0", ok=False, env=env)
    assert "SIMGPU_STATE_DIR is not set" in out.stderr and "vgpu-ctl sim env" in out.stderr


def test_the_xid_table_follows_nvidia_s_catalog_and_fails_closed_on_xids_it_does_not_name():
    assert health.meaning(13)[2] is False and health.meaning(31)[2] is False     # RESTART_APP
    assert health.meaning(48) == ("Double Bit ECC Error", "RESET_GPU", True)
    assert health.meaning(79)[1:] == ("RESTART_BM", True)
    assert health.meaning(4242)[2] is True


def test_the_agent_marks_a_gpu_unhealthy_on_a_fatal_xid_and_only_logs_an_informational_one(tmp_path, agents):
    """Two GPUs.  XID 13 on GPU 0 (an application's error): logged and counted, GPU 0 stays
    healthy.  XID 48 on GPU 1 (double-bit ECC, NVIDIA: reset the GPU): within 2 s the agent
    logs it and marks GPU 1 unhealthy, in `status` (JSON and table) and in the metrics.
    Then GPU 1 falls off the bus: still unhealthy, its reason kept."""
    node_ = Node(tmp_path, devices=2)
    node_.dir.mkdir()
    agent = agents(node_, "--metrics-port", 0, "--metrics-address", "127.0.0.1")
    assert wait_until(lambda: agent.metrics().get(("vgpu_gpu_healthy", (("device", "1"),))) == 1, 10)
    _ctl(node_, "xid", "0", "13")
    seen = agent.wait_for(lambda e: e.get("event") == "xid" and e.get("device") == 0, 5)
    assert (seen["xid"], seen["nvidia_action"], seen["gpu_healthy"]) == (13, "RESTART_APP", True)
    t0 = time.time()
    _ctl(node_, "xid", "1", "48")
    bad = agent.wait_for(lambda e: e.get("event") == "gpu-unhealthy", 5)
    assert bad["device"] == 1 and "XID 48" in bad["reason"] and "RESET_GPU" in bad["reason"]
    assert time.time() - t0 <= 2.0
    assert [e["device"] for e in agent.events("gpu-unhealthy")] == [1]      # GPU 0 never

    def healthy_in_status():
        return {d["index"]: (d["health"] or {}).get("healthy") for d in node_.status()["devices"]}
    assert wait_until(lambda: healthy_in_status() == {0: True, 1: False}, 5), node_.status()["devices"]
    lines = node_.ctl("status").stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("UNHEALTHY-GPU"))
    assert lines[head + 1].split()[0] == "1" and "XID 48: Double Bit ECC Error" in lines[head + 1]
    assert len(lines) == head + 2 or not lines[head + 2].strip()      # GPU 1 alone
    m = agent.metrics()
    assert m[("vgpu_gpu_healthy", (("device", "0"),))] == 1 and m[("vgpu_gpu_healthy", (("device", "1"),))] == 0
    assert m[("vgpu_gpu_xid_errors_total", (("device", "0"), ("xid", "13")))] == 1
    assert m[("vgpu_gpu_xid_errors_total", (("device", "1"), ("xid", "48")))] == 1

    _ctl(node_, "lose", "1")
    assert agent.wait_for(lambda e: e.get("event") == "xid" and e.get("xid") == 79, 5)["device"] == 1
    time.sleep(0.5)                                       # a few waits after the loss
    assert [e["device"] for e in agent.events("gpu-unhealthy")] == [1]      # said once, reason kept
    assert healthy_in_status() == {0: True, 1: False}
    assert [e for e in agent.events("error")] == []


@pytest.mark.parametrize("what", ["lose"])
def test_a_gpu_lost_before_the_agent_starts_is_unhealthy_from_its_first_look(tmp_path, agents, what):
    node_ = Node(tmp_path, devices=2)
    node_.dir.mkdir()
    node_.ctl("create", "a", "--memory", "1Gi")           # (the node exists before the GPU goes)
    run_python("import pynvml; pynvml.nvmlInit()", node_.env)
    _ctl(node_, what, "1")
    agent = agents(node_)
    bad = agent.wait_for(lambda e: e.get("event") == "gpu-unhealthy", 5)
    assert bad["device"] == 1 and "unreachable" in bad["reason"]


def test_cuda_calls_on_a_lost_gpu_fail_and_the_other_gpu_carries_on(tmp_path, spawn):
    """A process on each GPU (no shim), then GPU 1 falls off the bus: calls through its
    context answer CUDA_ERROR_UNKNOWN (999: what applications are seen to get; cuda.h
    documents nothing for it), GPU 0's process allocates as before."""
    node_ = Node(tmp_path, devices=2)
    on0, on1 = spawn(node_.env), spawn({**node_.env, "TENANT_DEVICE": "1"})
    assert on0.call(alloc=64 << 20) == 0 and on1.call(alloc=64 << 20) == 0
    _ctl(node_, "lose", "1")
    assert on1.call(alloc=64 << 20) == 999
    assert on0.call(alloc=64 << 20) == 0
