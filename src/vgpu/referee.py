"""Measure each process's share of a GPU from outside, through NVML.

Used by tests, benchmarks and the demo as the referee of compute shares: it polls
nvmlDeviceGetProcessUtilization (GPU time each process's kernels took) at every window's
edges and at least every POLL_S between, and averages the samples over time windows.  Run
it as a separate process pointed at the GPU (for simgpu: its environment), so the caller
need not load NVML itself:

    python -m vgpu.referee PIDS WINDOWS T0 [DEVICE]
      PIDS     JSON list of pids
      WINDOWS  JSON list of [start, end] seconds after T0
      T0       the time.time() the windows count from
    prints a JSON list: for each window, each pid's share in percent
"""
import json
import subprocess
import sys
import time

POLL_S = 0.2


def poll_times(windows, t0, poll_s=POLL_S):
    """When to read NVML (absolute times): at every window's edges, and never more than
    poll_s apart.  A read gives each process's share since the one before, so a window
    measured from reads at its own edges is its own time alone; a read across an edge
    spread one average over both sides (a slice waking 100 ms before its window opened
    was charged time it still slept)."""
    edges = sorted({t0 + x for w in windows for x in w})
    times, t = [], time.time()
    for edge in edges:
        while edge - t > poll_s:
            t += poll_s
            times.append(t)
        if edge > t:
            times.append(edge)
            t = edge
    return times


def measure(pids, windows, t0, device=0):
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(device)
    acc = [[0.0] * len(pids) for _ in windows]
    span = [0.0] * len(windows)
    last = time.time()
    for due in poll_times(windows, t0):
        time.sleep(max(0.0, due - time.time()))
        now = time.time()
        try:
            util = {s.pid: s.smUtil for s in pynvml.nvmlDeviceGetProcessUtilization(handle, int(last * 1e6))}
        except pynvml.NVMLError_NotFound:
            util = {}   # nobody ran a kernel in this interval
        for i, (a, b) in enumerate(windows):
            overlap = min(now, t0 + b) - max(last, t0 + a)
            if overlap > 0:
                span[i] += overlap
                for j, pid in enumerate(pids):
                    acc[i][j] += util.get(pid, 0) * overlap
        last = now
    return [[a / span[i] if span[i] else 0.0 for a in acc[i]] for i in range(len(windows))]


def start(pids, windows, t0, env, device=0):
    """Start the referee as a child process; .communicate() gives its JSON output."""
    return subprocess.Popen([sys.executable, "-m", "vgpu.referee", json.dumps(pids), json.dumps(windows),
                             str(t0), str(device)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(measure(json.loads(args[0]), json.loads(args[1]), float(args[2]),
                             int(args[3]) if len(args) > 3 else 0)))
