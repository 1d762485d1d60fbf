"""GPU utilization inside a slice: nvmlDeviceGetUtilizationRates under the shim shows the
slice's own use as a share of its sm.max (as its memory view shows its cap), never a
neighbour's work; outside, NVML shows the whole device.  Workloads are
tests/programs/duty.c (back-to-back sim_2000us kernels)."""
import json
import subprocess
import time

import pytest

from tests.helpers.simnode import make_sim_env, run_python
from vgpu.paths import SHIM

pytestmark = pytest.mark.timing     # shares and latencies: run alone (Makefile)

UTIL = """
import json, time
import pynvml as n

n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
u = n.nvmlDeviceGetUtilizationRates(h)
print(json.dumps([u.gpu, u.memory]))
"""


def slice_env(tmp_path, name, sm=None, memory="2Gi"):
    env = make_sim_env(tmp_path / "node", LD_PRELOAD=str(SHIM), VGPU_DIR=tmp_path / "vgpu", VGPU_SLICE=name,
                       VGPU_MEMORY_LIMIT=memory)
    if sm:
        env["VGPU_SM_LIMIT"] = sm
    return env


def utilization(env):
    return json.loads(run_python(UTIL, env).stdout.splitlines()[-1])


def test_a_slice_sees_its_own_use_of_its_share_not_its_neighbours(tmp_path, c_program):
    """A (30%) and N (60%) both saturate their shares; C (50%) is idle.  Inside A and N:
    ~100% (each one's whole share in use); inside C: 0%, not the 90% the device is busy;
    from the host: the device, ~90%."""
    a, n, c = slice_env(tmp_path, "a", "30%"), slice_env(tmp_path, "n", "60%"), slice_env(tmp_path, "c", "50%")
    duty = c_program("duty")
    procs = [subprocess.Popen([str(duty), "2000", "4"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for env in (a, n)]
    try:
        time.sleep(2.0)
        inside_a, inside_n, inside_c = utilization(a), utilization(n), utilization(c)
        host = utilization(make_sim_env(tmp_path / "node"))
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    assert inside_a[0] >= 85 and inside_n[0] >= 85, (inside_a, inside_n)
    assert inside_c == [0, 0]
    assert 80 <= host[0] <= 97, host


def test_an_unlimited_slice_reads_its_own_share_of_the_device(tmp_path, c_program):
    """No SM limit: the slice's own processes' share of the whole device (here a 40%
    neighbour is the only other load, so the device is busy but the slice is not)."""
    u, busy = slice_env(tmp_path, "u"), slice_env(tmp_path, "busy", "40%")
    p = subprocess.Popen([str(c_program("duty")), "2000", "3.5"], env=busy, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        time.sleep(2.0)
        inside, host = utilization(u), utilization(make_sim_env(tmp_path / "node"))
    finally:
        p.kill()
        p.wait(timeout=30)
    assert inside == [0, 0] and 30 <= host[0] <= 50, (inside, host)


def test_an_idle_slice_reads_zero_and_a_busy_one_reads_its_share(tmp_path, c_program):
    """One tenant at 50%, saturating: the host sees the device about half busy; the slice
    sees its share fully used."""
    t = slice_env(tmp_path, "t", "50%")
    before = utilization(t)
    p = subprocess.Popen([str(c_program("duty")), "2000", "3.5"], env=t, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        time.sleep(2.0)
        inside, host = utilization(t), utilization(make_sim_env(tmp_path / "node"))
    finally:
        p.kill()
        p.wait(timeout=30)
    assert before == [0, 0]
    assert inside[0] >= 85 and 40 <= host[0] <= 60, (inside, host)
