"""The autoscaler's cost and reaction time.  Run: `make bench` (or
`.venv/bin/python -m pytest bench/test_autoscale_bench.py -q -s -p no:cacheprovider`).

1. CPU per loop iteration with 1,000 slices' files (each with memory and SM between a
   request and a limit, so every one is sampled and judged), in three steady states:
   in band (use between the marks), idle at their requests, and saturated at their limits
   (wanting more every interval).  Measured with the process's CPU clock over 40
   iterations (4 of them re-scan the directory); as a share of one core at the default
   1 s interval.  Goal: under 1%.
2. From a window closing to the new quota being enforced: a process under the shim (on
   simgpu) holds 95% of its 1 GiB cap and polls cuMemGetInfo; the loop runs for real
   (window 1 s, interval 100 ms).  Window close = when the hot streak reached a whole
   window; enforced = when the process's cuMemGetInfo first showed the new total.
"""
import fcntl
import json
import mmap
import os
import select
import statistics
import struct
import subprocess
import sys
import time

from conftest import sim_env
from vgpu import slices
from vgpu._region import ffi, lib
from vgpu.autoscale import Autoscaler
from vgpu.paths import SHIM
from vgpu.policy import MEMORY, Policy

GiB, MiB = 1 << 30, 1 << 20
N = 1000
HOLDER_SLOT = slices.MAX_PROCS - 1
TICKS = 40
GOAL_PERCENT = 1.0


def _populate(directory, state):
    """N slices on one device in `state`; returns their mapped usage records."""
    for i in range(N):
        if state == "in band":
            q = slices.device_quota(4 * GiB, 2000, request=2 * GiB, limit=8 * GiB, sm_request=1000, sm_limit=4000)
        elif state == "idle at request":
            q = slices.device_quota(2 * GiB, 1000, request=2 * GiB, limit=8 * GiB, sm_request=1000, sm_limit=4000)
        else:
            q = slices.device_quota(8 * GiB, 4000, request=2 * GiB, limit=8 * GiB, sm_request=1000, sm_limit=4000)
        slices.create(directory, f"c{i:04d}", {0: q}, overcommit=True)
    usage = []
    for i in range(N):
        fd = os.open(os.path.join(directory, f"c{i:04d}", "usage"), os.O_RDWR)
        mm = mmap.mmap(fd, slices.USAGE_SIZE)
        # the memory is held by a live process: this one, owning the last slot's lock
        # (the descriptor stays open with the mapping), so the autoscaler's reaping keeps it
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET,
                                                        slices.LOCK_BASE + HOLDER_SLOT, 1, 0))
        u = ffi.cast("struct vgpu_usage *", ffi.from_buffer(mm))
        lib.vgpu_store_i32(ffi.addressof(u.procs[HOLDER_SLOT], "pid"), os.getpid())
        u.slots_used = slices.MAX_PROCS
        usage.append((mm, fd, u.devices[0], ffi.addressof(u.charge[0], HOLDER_SLOT)))
    return usage


def _advance(usage, state, second):
    """One second of each slice's life, as its shim would count it."""
    for _, _, u, held in usage:
        if state == "in band":        # 60% of 4Gi held; 14% of the GPU used of a 20% share
            lib.vgpu_store_u64(held, int(0.6 * 4 * GiB))
            lib.vgpu_store_u64(ffi.addressof(u, "gpu_time_ns"), second * 140_000_000)
        elif state == "saturated at limit":     # 95% of 8Gi, 40% of the GPU, waiting 60% of the time
            lib.vgpu_store_u64(held, int(0.95 * 8 * GiB))
            lib.vgpu_store_u64(ffi.addressof(u, "gpu_time_ns"), second * 400_000_000)
            lib.vgpu_store_u64(ffi.addressof(u, "throttled_ns"), second * 600_000_000)


def _loop_cpu(directory, usage, state, dry_run=False):
    """(mean, median, max) ms of CPU per iteration over TICKS steady seconds, and the lines logged."""
    logged = []
    scaler = Autoscaler(directory, Policy(), interval=1.0, use_nvml=False, device_memory=141 * GiB,
                        log=logged.append, dry_run=dry_run)
    now = 1000.0
    scaler.tick(now)            # opens and maps every slice once
    assert len(scaler.reader.views) == N
    cpu = []
    for s in range(1, TICKS + 1):
        _advance(usage, state, s)
        now += 1.0
        t0 = time.process_time()
        scaler.tick(now)
        cpu.append(time.process_time() - t0)
    changed = [line for line in logged if '"event":"resize"' in line]
    assert changed == []        # steady states: nothing moves
    return statistics.mean(cpu) * 1e3, statistics.median(cpu) * 1e3, max(cpu) * 1e3, len(logged)


def test_loop_cpu_per_iteration_with_1000_slices(tmp_path, benchmark):
    rows = {}
    for state in ("in band", "idle at request", "saturated at limit"):
        directory = tmp_path / state.replace(" ", "-")
        usage = _populate(directory, state)
        rows[state] = _loop_cpu(directory, usage, state)
    # the last state's slices again with --dry-run, which reaps nothing: what the loop costs
    # without its reaps (shown, not judged)
    without_reaps = _loop_cpu(directory, usage, state, dry_run=True)
    print(f"\n{'1,000 slices':28} {'CPU ms/iteration (mean)':>24} {'median':>7} {'max':>6} "
          f"{'% of a core at 1 s':>19} {'log lines':>10}")
    for state, (mean, med, worst, lines) in [*rows.items(), (state + ", dry run", without_reaps)]:
        print(f"{state:28} {mean:24.1f} {med:7.1f} {worst:6.1f} {mean / 10:19.2f} {lines:10}")
        key = state.replace(" ", "_").replace(",", "")
        benchmark.extra_info[f"{key}_cpu_ms_mean"] = mean
        benchmark.extra_info[f"{key}_core_percent_at_1s"] = mean / 10
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    over = [f"{state}: {mean / 10:.2f}% of a core" for state, (mean, *_) in rows.items() if mean / 10 >= GOAL_PERCENT]
    assert not over, f"over the goal of {GOAL_PERCENT}% (every state measured first): {'; '.join(over)}"


PROBE = """
import json, sys, time
from cuda.bindings import driver as cu
cu.cuInit(0)
cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1])
assert int(cu.cuMemAlloc(int(sys.argv[1]))[0]) == 0
last = None
while True:
    total = int(cu.cuMemGetInfo()[2])
    if total != last:
        print(json.dumps([time.monotonic_ns(), total]), flush=True)
        last = total
    time.sleep(0.0005)
"""
ROUNDS = 8


def test_window_close_to_quota_enforced_in_a_running_process(tmp_path, benchmark):
    directory = tmp_path / "vgpu"
    env = sim_env(tmp_path / "node")
    slices.create(directory, "hot", {0: slices.device_quota(GiB, request=GiB, limit=8 * GiB)}, overcommit=True)
    probe = subprocess.Popen([sys.executable, "-c", PROBE, str(int(0.95 * GiB))],
                             env={**env, "LD_PRELOAD": str(SHIM), "VGPU_DIR": str(directory),
                                  "VGPU_SLICE": "hot"}, stdout=subprocess.PIPE, text=True)

    def seen(timeout=10):
        ready, _, _ = select.select([probe.stdout], [], [], timeout)
        assert ready, "the probe did not see a new quota"
        return json.loads(probe.stdout.readline())

    policy = Policy(window=1.0)
    scaler = Autoscaler(directory, policy, interval=0.1, use_nvml=False, device_memory=24 * GiB, log=lambda _: None)
    try:
        assert seen(60)[1] == GiB
        to_file, to_process = [], []
        for _ in range(ROUNDS):
            next_at = time.monotonic()
            while True:                      # the loop, as `vgpu-ctl autoscale --window 1s --interval 100ms`
                tr = scaler.track("hot", 0, MEMORY)
                hot_since = tr.hot_since if tr else None
                decisions = scaler.tick()
                if any(d.changes for d in decisions):
                    written = time.monotonic()
                    break
                next_at += 0.1
                time.sleep(max(0.0, next_at - time.monotonic()))
            closed = hot_since + policy.window
            t_ns, total = seen()
            assert total > GiB
            to_file.append(written - closed)
            to_process.append(t_ns / 1e9 - closed)
            slices.resize(directory, "hot", memory=GiB, request=GiB, limit=8 * GiB)   # back, for the next round
            assert seen()[1] == GiB
    finally:
        probe.kill()
        probe.wait()
    ms = lambda v: (statistics.median(v) * 1e3, max(v) * 1e3)   # noqa: E731
    print(f"\nwindow closed -> (interval 100 ms, {ROUNDS} rounds)   median ms   max ms")
    print(f"quota file written                       {ms(to_file)[0]:9.1f} {ms(to_file)[1]:8.1f}")
    print(f"running process sees it (cuMemGetInfo)   {ms(to_process)[0]:9.1f} {ms(to_process)[1]:8.1f}")
    benchmark.extra_info["window_close_to_file_median_ms"], benchmark.extra_info["window_close_to_file_max_ms"] = \
        ms(to_file)
    benchmark.extra_info["window_close_to_process_median_ms"], \
        benchmark.extra_info["window_close_to_process_max_ms"] = ms(to_process)
    assert max(to_process) <= 0.1 + 0.25    # at most one interval, plus a noisy machine's slack
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
