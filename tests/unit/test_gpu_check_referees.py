"""bench/gpu_check.py's two referees of a share on hardware, checked where they can be: the
count of finished kernels (arithmetic), and its NVML reading against simgpu's NVML, whose
per-process utilization is exact (a tenant that keeps the device busy reads 100%)."""
import json
import subprocess
import sys

from tests.helpers.paths import ROOT
from tests.helpers.pid_namespaces import needs_pid_namespaces
from tests.helpers.simnode import make_sim_env, run_python
from vgpu.paths import SHIM

sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def test_a_share_counted_from_finished_kernels_cuts_them_at_the_window():
    # a 20 ms kernel finishing every 40 ms from 0.04 s: half the device's time
    done = [100.0 + 0.04 * k for k in range(1, 100)]
    assert gpu_check.counted(done, 100.0, 0.02, [[0.5, 1.5]]) == [50.0]
    # a window from 10 ms into a kernel to the end of the next: 10 ms + 20 ms of 40 ms
    assert gpu_check.counted(done, 100.0, 0.02, [[0.03, 0.08]]) == [round(100 * 0.03 / 0.05, 1)]
    assert gpu_check.counted([], 100.0, 0.02, [[0.5, 1.5]]) == [0.0]


def test_errors_are_the_worst_tenant_over_the_whole_and_over_one_second_windows():
    shares = [[29.0, 70.5], [27.0, 71.0], [31.5, 69.0]]
    assert gpu_check.errors(shares, (30, 70)) == (1.0, 3.0)


def test_nvml_windows_weighs_each_window_by_its_own_time(tmp_path, c_program):
    """A tenant that keeps simgpu busy (2 ms kernels back to back, no shim) from 1 s to 3.2 s:
    over [0.5, 1.5] s half busy, over [1.5, 2.5] s all, over [0.5, 2.5] s three quarters; a
    sample in every poll once it runs, and the shim's own 0.5 s reading of the time it covers."""
    duty = c_program("duty")
    env = make_sim_env(tmp_path / "node")
    subprocess.run([str(duty), "2000", "0.1"], env=env, check=True)   # the node made first
    out = run_python(f"""
        import json, subprocess, sys, time
        sys.path.insert(0, {str(ROOT / "bench")!r})
        import gpu_check
        start, diag = time.time(), {{}}
        p = subprocess.Popen(["sh", "-c", "sleep 1; exec {duty} 2000 2.2"], stdout=subprocess.DEVNULL)
        shares = gpu_check.nvml_windows([p.pid], start, [[0.5, 2.5], [0.5, 1.5], [1.5, 2.5]], diag)
        p.wait()
        print(json.dumps({{"shares": shares, "diag": diag}}))
    """, env).stdout
    got = json.loads(out.splitlines()[-1])
    assert [round(share / 5) * 5 for [share] in got["shares"]] == [75, 50, 100], got
    diag = got["diag"]
    assert diag["samples_per_call_max"] == [1] and diag["polls_without_a_sample"][0] <= diag["polls"] // 4 + 1
    assert diag["sample_age_ms_median"][0] >= 0   # (simgpu stamps a sample with the time of the call)
    # its reads look back 0.5 s from inside [0.5, 2.5] s, so cover about [0.25, 2.25] s: 62.5%
    assert 50 <= diag["as_the_shim_reads"]["mean_percent"][0] <= 75, diag


# run_together's protocol (a JSON line once set up, the start time on stdin), then the duty
# program (by default 2 ms kernels back to back for 2 s), exec'd in the same process
RUN_TOGETHER_TENANT = """
import json, os, sys, time
print(json.dumps({{"ready": True}}), flush=True)
t0 = float(sys.stdin.readline())
time.sleep(max(0.0, t0 - time.time()))
os.execv({duty!r}, [{duty!r}, *{args!r}])
"""


def run_together_tenant(duty, args=("2000", "2.0")):
    return RUN_TOGETHER_TENANT.format(duty=str(duty), args=list(args))


def test_a_namespaced_tenant_is_read_by_its_host_pid_and_the_agent_writes_that_into_its_slot(tmp_path, c_program):
    """duty_containers' plumbing, on simgpu: a tenant of run_together in a pid namespace of its
    own (IN_OWN_PID_NAMESPACE), under the shim in a standalone slice, with gpu_check's node
    agent watching the slices.  NVML is read for the process unshare started (2 ms kernels
    back to back: the window all busy; unshare's own pid would read 0), and the agent writes
    the host pid NVML lists it by into its slot."""
    needs_pid_namespaces()
    duty = c_program("duty")
    env = make_sim_env(tmp_path / "node")
    subprocess.run([str(duty), "2000", "0.1"], env=env, check=True)   # the node made first
    vdir = tmp_path / "vgpu"
    vdir.mkdir()
    tenant = {**env, "LD_PRELOAD": str(SHIM), "VGPU_DIR": str(vdir), "VGPU_SLICE": "t0", "VGPU_MEMORY_LIMIT": "1Gi"}
    out = run_python(f"""
        import json, sys, time
        sys.path.insert(0, {str(ROOT / "bench")!r})
        import gpu_check
        from vgpu import slices
        TENANT = {run_together_tenant(duty)!r}
        written = []

        def note(start, windows):
            while time.time() < start + 2.0 and not written:
                try:
                    u = slices.read_usage({str(vdir)!r}, "t0")
                except slices.NotFound:     # (the tenant has not made its slice yet)
                    u = None
                written.extend(p.host_pid for p in (u.procs if u else ()) if p.host_pid)
                time.sleep(0.05)
        with gpu_check.node_agent({str(vdir)!r}) as agent:
            start, nvml, outs = gpu_check.run_together(
                [([*gpu_check.IN_OWN_PID_NAMESPACE, sys.executable, "-c", TENANT], {tenant!r})], 2.0, [[0.5, 1.5]],
                also=note, namespaced=True)
        print(json.dumps({{"nvml": nvml, "written": written, "agent": agent["stderr"]}}))
    """, env, timeout=120).stdout
    got = json.loads(out.splitlines()[-1])
    assert got["nvml"][0][0] >= 90, got
    assert got["written"], got


def traced_tenant(tmp_path, c_program, namespaced=False):
    """One run_together tenant under the shim at 50% on simgpu, its shim at TRACED's level:
    2 ms kernels with a sync after each for 3.5 s, in a pid namespace of its own where
    `namespaced` (as run_spins starts it there; no node agent either way).  Returns NVML's
    share of it over [1.0, 3.5] s, read from outside, and its shim_trace."""
    duty = c_program("duty")
    env = make_sim_env(tmp_path / "node")
    subprocess.run([str(duty), "2000", "0.1"], env=env, check=True)   # the node made first
    tenant = {**env, "LD_PRELOAD": str(SHIM), "VGPU_DIR": str(tmp_path / "vgpu"), "VGPU_SLICE": "t0",
              "VGPU_SM_LIMIT": "50%"}
    code = run_together_tenant(duty, ("2000", "3.5", "sync"))
    out = run_python(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / "bench")!r})
        import gpu_check
        env = {{**{tenant!r}, **gpu_check.TRACED}}
        prefix = gpu_check.IN_OWN_PID_NAMESPACE if {namespaced!r} else []
        _, nvml, [out] = gpu_check.run_together([([*prefix, sys.executable, "-c", {code!r}], env)], 3.5,
                                                [[1.0, 3.5]], namespaced={namespaced!r})
        print(json.dumps([nvml[0][0], out["shim"]]))
    """, env, timeout=120).stdout
    return json.loads(out.splitlines()[-1])


def test_a_tenant_s_shim_trace_reads_its_kernel_samples_and_each_correction(tmp_path, c_program):
    """What duty and woken record of each tenant's shim (shim_trace of its stderr at TRACED's
    level), on simgpu, for traced_tenant's tenant.  Its kernels' samples are read (simgpu's
    kernel takes the 2 ms it is named for, and alone nothing waits behind a neighbour), and
    its corrections, one per 0.5 s from the first 1.5 s on, each NVML's measure beside the
    estimates': alone and estimated right, both near its 50% and the cost scale near 1."""
    _, trace = traced_tenant(tmp_path, c_program)
    assert trace["samples"] >= 1 and 1.9 <= trace["estimate_ms_last"] <= 2.5, trace
    assert 1.9 <= trace["sample_ms_min_q1_median_q3"][0] <= 2.5, trace
    assert len(trace["corrections"]) >= 2, trace
    for measured, estimated, scale in trace["corrections"]:
        assert 35 <= measured <= 60 and abs(measured - estimated) <= 10 and 0.7 <= scale <= 1.4, trace


def test_without_the_agent_a_namespaced_tenant_s_shim_samples_its_kernels_and_never_corrects(tmp_path, c_program):
    """What duty_no_agent rests on, on simgpu: traced_tenant's tenant in a pid namespace of its
    own, and no node agent.  Its shim still samples its kernels, but finds none of its
    processes in NVML (which lists the host pid only the agent writes into a slot): no
    correction, so the share is the estimates' alone.  NVML, read from outside for the host
    pid, sees it run all the same."""
    needs_pid_namespaces()
    nvml, trace = traced_tenant(tmp_path, c_program, namespaced=True)
    assert trace["samples"] >= 1 and 1.9 <= trace["estimate_ms_last"] <= 2.5, trace
    assert trace["corrections"] == [], trace
    assert 35 <= nvml <= 65, (nvml, trace)
