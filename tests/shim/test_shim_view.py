"""Inside a slice, NVML names no process but the slice's own (shim/view.c).

A neighbour in slice `b` (tests/programs/tenant.py under the shim) allocates and keeps a
kernel running; a process of slice `a` asks every NVML call that lists processes or
carries a pid, through pynvml, on every GPU.  The referee is the same query without the
shim: it must see the neighbour (else the test could not fail), the slice must not.
Real processes on simgpu.
"""
import json
import subprocess
import sys
import time

import pytest

from tests.helpers.paths import PROGRAMS
from tests.helpers.simnode import make_sim_env, run_python
from vgpu.paths import SHIM

MiB = 1 << 20
TENANT = PROGRAMS / "tenant.py"

# what a monitoring tool inside the slice asks, per GPU: {call: [pids]} (None: not supported)
ASK = """
import json, sys, time
import pynvml as n
from cuda.bindings import driver as cu
assert cu.cuInit(0)[0] == 0
ctx = cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1]
assert cu.cuCtxSetCurrent(ctx)[0] == 0 and cu.cuMemAlloc(64 << 20)[0] == 0
n.nvmlInit()

def pids(call, *args):
    try:
        return sorted(int(x.pid) for x in call(*args))
    except n.NVMLError_NotFound:
        return []
    except (n.NVMLError_NotSupported, n.NVMLError_FunctionNotFound):
        return None

out = {"me": __import__("os").getpid(), "gpus": []}
for i in range(n.nvmlDeviceGetCount()):
    h = n.nvmlDeviceGetHandleByIndex(i)
    out["gpus"].append({
        "compute": pids(n.nvmlDeviceGetComputeRunningProcesses, h),
        "compute_v2": pids(n.nvmlDeviceGetComputeRunningProcesses_v2, h),
        "graphics": pids(n.nvmlDeviceGetGraphicsRunningProcesses, h),
        "mps": pids(n.nvmlDeviceGetMPSComputeRunningProcesses_v3, h),
        "detail": pids(n.nvmlDeviceGetRunningProcessDetailList, h, n.nvmlProcessDetailList_v1,
                       n.NVML_PROCESS_MODE_COMPUTE),
        "utilization": pids(n.nvmlDeviceGetProcessUtilization, h, 0),
        "utilization_info": pids(n.nvmlDeviceGetProcessesUtilizationInfo, h, 0),
        "encoder": pids(n.nvmlDeviceGetEncoderSessions, h),
        "fbc": pids(n.nvmlDeviceGetFBCSessions, h),
    })
print(json.dumps(out))
"""
# calls whose answer has the neighbour in it on simgpu (it has no graphics, MPS, encoder
# or capture clients: those lists are empty with or without the shim)
SHOWS_A_RUNNING_PROCESS = ("compute", "compute_v2", "detail", "utilization", "utilization_info")


def slice_env(env, tmp_path, name, device):
    return dict(env, LD_PRELOAD=str(SHIM), VGPU_DIR=str(tmp_path / "vgpu"), VGPU_SLICE=name,
                VGPU_MEMORY_LIMIT="1Gi", CUDA_VISIBLE_DEVICES=str(device))


@pytest.fixture
def neighbour():
    procs = []

    def start(env):
        p = subprocess.Popen([sys.executable, str(TENANT)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        procs.append(p)
        pid = json.loads(p.stdout.readline())["pid"]
        for cmd in ({"alloc": 256 * MiB}, {"hog": 2000}):
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()
            answer = json.loads(p.stdout.readline())
            assert (answer if isinstance(answer, int) else answer[next(iter(cmd))]) == 0, answer
        return pid
    yield start
    for p in procs:
        p.kill()
        p.wait()


def ask(env):
    return json.loads(run_python(ASK, env).stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("where", ["same GPU", "another GPU"])
def test_no_nvml_call_from_inside_a_slice_names_a_neighbours_process(tmp_path, neighbour, where):
    env = make_sim_env(tmp_path / "node", profile="a10", devices=2)
    theirs = 0 if where == "same GPU" else 1
    other = neighbour(slice_env(env, tmp_path, "b", theirs))
    # the referee, without the shim: the neighbour is there to be seen
    deadline = time.monotonic() + 10
    while True:
        seen = ask(dict(env, CUDA_VISIBLE_DEVICES="0"))["gpus"][theirs]
        if all(other in seen[k] for k in SHOWS_A_RUNNING_PROCESS) or time.monotonic() > deadline:
            break
    assert all(other in seen[k] for k in SHOWS_A_RUNNING_PROCESS), seen
    # the slice, on every GPU and every call
    view = ask(slice_env(env, tmp_path, "a", 0))
    for gpu in view["gpus"]:
        for call, listed in gpu.items():
            assert listed is None or other not in listed, (call, gpu)
    assert view["me"] in view["gpus"][0]["compute"] and view["me"] in view["gpus"][0]["detail"]
