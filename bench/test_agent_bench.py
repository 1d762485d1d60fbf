"""The node agent's cost and how fast it sees a violation.  Run: `make bench` (or
`.venv/bin/python -m pytest bench/test_agent_bench.py -q -s -p no:cacheprovider`).

1. CPU per loop iteration (vgpu.agent.Agent.tick, the process's CPU clock) with real
   processes under the shim on simgpu, each holding a slot in its slice's usage file:
     - 100 slices x 10 processes (1,000 processes; 2 per slice hold device memory, so
       NVML lists 200 of them: simgpu has room for 256 GPU processes);
     - 1,000 slices x 1 process (200 of them holding device memory).
   The first iteration (every process attributed for the first time: /proc/<pid>/maps,
   cgroup, namespaces) apart from the steady state (40 iterations after it).  Then the
   whole agent as its own process (`vgpu-ctl agent`, 1 s interval) for 20 s: its CPU time
   from /proc/<pid>/stat, waits and wake-ups included, as a share of one core.
   Goal: under 1% of a core at a 1 s interval (asserted for the iteration; the whole
   process's figure is reported as measured).
2. Detection latency: a tenant under the shim rewrites its usage file to hide 1 GiB at a
   random moment; from the moment it wrote (its own clock) to the agent's violation line
   (its timestamp), 10 times, default interval (1 s) and grace (500 ms).  Goal: at most 2 s.
"""
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import sim_env
from vgpu import slices
from vgpu.paths import SHIM

GiB, MiB = 1 << 30, 1 << 20
CTL = str(Path(sys.executable).parent / "vgpu-ctl")
TENANT = str(Path(__file__).resolve().parent.parent / "tests" / "programs" / "tenant.py")
TICKS = 40
GOAL_PERCENT = 1.0


def _members(exe, env, directory, layout):
    """Start the processes of `layout` [(slice, bytes)], all under the shim; wait for each."""
    procs = []
    for name, nbytes in layout:
        e = {**env, "LD_PRELOAD": str(SHIM), "VGPU_DIR": str(directory), "VGPU_SLICE": name}
        procs.append(subprocess.Popen([str(exe), str(nbytes)], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True))
    for p in procs:
        assert p.stdout.readline().strip() == "ready", "a member did not start"
    return procs


def _stop(procs):
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(30)


def _measure(tmp, exe, slices_n, per_slice, gpu_per_slice_every):
    directory = tmp / f"vgpu-{slices_n}x{per_slice}"
    env = sim_env(tmp / f"node-{slices_n}x{per_slice}")
    for i in range(slices_n):
        slices.create(directory, f"s{i:04d}", {0: slices.device_quota(GiB, 5000)}, overcommit=True)
    layout = []
    for i in range(slices_n):
        for j in range(per_slice):
            holds = (i * per_slice + j) % gpu_per_slice_every == 0
            layout.append((f"s{i:04d}", 16 * MiB if holds else 0))
    procs = _members(exe, env, directory, layout)
    try:
        # the bench process is the agent: it needs simgpu's NVML, which binds to a node on
        # first use; so it runs in a child with the node's environment
        code = f"""
import json, time, sys
from vgpu import agent
a = agent.Agent({str(directory)!r}, log=lambda line: None)
t0 = time.process_time(); snap = a.tick(); first = time.process_time() - t0
gpu = len(snap.processes); sliced = sum(1 for p in snap.processes if p.attribution.state == "sliced")
cpu = []
for i in range({TICKS}):
    time.sleep(0.05)
    t0 = time.process_time(); a.tick(); cpu.append(time.process_time() - t0)
print(json.dumps({{"first_s": first, "cpu_s": cpu, "gpu_processes": gpu, "sliced": sliced,
                  "tracked": len(a.observer.tracked)}}))
"""
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        # the whole agent, as a process, for 20 s at its 1 s interval
        agent = subprocess.Popen([CTL, "agent", "--dir", str(directory)], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        deadline = time.time() + 60      # started and through its first (cold) iteration
        while not (directory / ".agent.json").exists() and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(2)
        c0, t0 = _cpu(agent.pid), time.monotonic()
        time.sleep(20)
        c1, t1 = _cpu(agent.pid), time.monotonic()
        agent.terminate()
        agent.wait(30)
    finally:
        _stop(procs)
    steady = statistics.median(r["cpu_s"])
    return {"processes": len(layout), "gpu processes (NVML)": r["gpu_processes"], "attributed": r["sliced"],
            "first iteration ms": round(r["first_s"] * 1e3, 1), "iteration ms (median)": round(steady * 1e3, 2),
            "iteration ms (max)": round(max(r["cpu_s"]) * 1e3, 2),
            "% of a core at 1 s (iteration)": round(steady * 100, 2),
            "% of a core, agent process over 20 s": round((c1 - c0) / (t1 - t0) * 100, 2)}


def _cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_agent_cpu_per_iteration(tmp_path, benchmark, bench_program):
    exe = bench_program("member")
    rows = {"100 slices x 10 processes": _measure(tmp_path, exe, 100, 10, 5),
            "1,000 slices x 1 process": _measure(tmp_path, exe, 1000, 1, 5)}
    benchmark.extra_info.update(rows)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print()
    for k, r in rows.items():
        print(f"{k}: {json.dumps(r)}")
    for r in rows.values():
        assert r["gpu processes (NVML)"] == r["attributed"] == 200
        assert r["% of a core at 1 s (iteration)"] < GOAL_PERCENT
        # the whole process (waits, wake-ups, the interpreter's own work) is reported as
        # measured; held here only to no hidden busy loop
        assert r["% of a core, agent process over 20 s"] < 2 * GOAL_PERCENT


def test_detection_latency(tmp_path, benchmark):
    directory = tmp_path / "vgpu"
    env = sim_env(tmp_path / "node")
    slices.create(directory, "a", {0: slices.device_quota(4 * GiB)}, overcommit=True)
    agent = subprocess.Popen([CTL, "agent", "--dir", str(directory)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    lines = []
    threading.Thread(target=lambda: [lines.append(json.loads(x)) for x in agent.stdout], daemon=True).start()
    latencies = []
    try:
        for trial in range(10):
            e = {**env, "LD_PRELOAD": str(SHIM), "VGPU_DIR": str(directory), "VGPU_SLICE": "a"}
            t = subprocess.Popen([sys.executable, TENANT], env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
            t.stdout.readline()

            def call(**cmd):
                t.stdin.write(json.dumps(cmd) + "\n")
                t.stdin.flush()
                return json.loads(t.stdout.readline())
            assert call(alloc=3 * GiB // 2) == 0
            time.sleep(1.2 + random.random())          # a random phase against the agent's interval
            seen = len(lines)
            hid = call(hide=GiB // 2, usage=str(directory / "a" / "usage"))
            deadline = time.time() + 10
            v = None
            while v is None and time.time() < deadline:
                v = next((x for x in lines[seen:] if x.get("event") == "violation" and x.get("kind") == "gap"), None)
                time.sleep(0.01)
            assert v is not None, "no violation logged"
            latencies.append(_ts(v["ts"]) - hid["time"])
            t.kill()
            t.wait(10)
            time.sleep(1.0)                            # reaped; the violation ends
    finally:
        agent.terminate()
        agent.wait(30)
    row = {"trials": len(latencies), "median s": round(statistics.median(latencies), 3),
           "max s": round(max(latencies), 3), "min s": round(min(latencies), 3)}
    benchmark.extra_info["violation to its log line"] = row
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    print(f"\ndetection latency: {json.dumps(row)}")
    assert max(latencies) <= 2.0


def _ts(text):
    import datetime
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc).timestamp()

