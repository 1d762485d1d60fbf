"""`vgpu-ctl autoscale` end to end on simgpu, with short windows (1 s).

The autoscaler is its own process (simgpu's NVML tells it the device's memory); the
workloads are real processes under the shim: cuda-bindings agents that hold memory and
retry an allocation until it fits, and tests/programs/duty.c saturating the GPU.  Judged
from outside: the workloads' CUDA results, the quota files (polled every 20 ms by a
watcher that also checks the device's total), and the autoscaler's decision log.
"""
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.children import JsonChild
from tests.helpers.simnode import make_sim_env, write_usage_counters
from tests.helpers.wait import wait_until
from vgpu import slices
from vgpu.paths import SHIM

pytestmark = pytest.mark.timing     # shares and latencies: run alone (Makefile)

GiB, MiB = 1 << 30, 1 << 20
SUCCESS = 0
CTL = str(Path(sys.executable).parent / "vgpu-ctl")
A10 = 24 * GiB

AGENT = r"""
import json, sys, time
from cuda.bindings import driver as cu

def rc(r):
    return int((r if isinstance(r, tuple) else (r,))[0])

assert rc(cu.cuInit(0)) == 0
assert rc(cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1])) == 0
held = []
print(json.dumps("ready"), flush=True)
for line in sys.stdin:
    cmd, arg = json.loads(line)
    if cmd == "hold":
        r = cu.cuMemAlloc(arg)
        if rc(r) == 0:
            held.append(r[1])
        out = rc(r)
    elif cmd == "retry":           # allocate until it fits: [size, timeout]; -> [rc, tries, seconds]
        size, timeout = arg
        start, tries = time.monotonic(), 0
        while True:
            tries += 1
            r = cu.cuMemAlloc(size)
            if rc(r) == 0:
                held.append(r[1])
                break
            if time.monotonic() - start > timeout:
                break
            time.sleep(0.02)
        out = [rc(r), tries, time.monotonic() - start]
    print(json.dumps(out), flush=True)
"""


class Agent(JsonChild):
    def __init__(self, env):
        super().__init__(AGENT, env, "agent")
        assert self.read(60) == "ready"


class Node:
    def __init__(self, root):
        self.dir = root / "vgpu"
        self.env = make_sim_env(root / "node")
        self.procs = []

    def ctl(self, *args):
        out = subprocess.run([CTL, *map(str, args), "--dir", str(self.dir)], env=self.env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, f"vgpu-ctl {' '.join(map(str, args))}: {out.stdout}{out.stderr}"
        return out

    def workload_env(self, name):
        return {**self.env, "LD_PRELOAD": str(SHIM), "VGPU_DIR": str(self.dir), "VGPU_SLICE": name}

    def agent(self, name):
        a = Agent(self.workload_env(name))
        self.procs.append(a.proc)
        return a

    def autoscale(self, *args):
        p = subprocess.Popen([CTL, "autoscale", "--dir", str(self.dir), *map(str, args)], env=self.env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        return p

    def quota(self, name, d=0):
        return slices.read_quota(self.dir, name).devices[d]

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def decisions(proc):
    """The decision lines of a stopped autoscaler's log."""
    out = proc.stdout.read()
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert lines and lines[0]["event"] == "start", out
    return lines[1:]


class Watcher(threading.Thread):
    """Polls every quota on the node: the device's sum of memory.max, and each slice's
    request <= max <= limit, for the whole test."""

    def __init__(self, node):
        super().__init__(daemon=True)
        self.node, self.stop_flag, self.worst, self.bad, self.polls = node, threading.Event(), 0, [], 0

    def run(self):
        while not self.stop_flag.is_set():
            total = 0
            for name, quota, _, problem in slices.read_all(self.node.dir):
                if quota is None:
                    continue
                q = quota.devices[0]
                total += q.memory_max
                if not (q.memory_request <= q.memory_max <= q.memory_limit and q.sm_request <= q.sm_max <= q.sm_limit):
                    self.bad.append((name, q))
            self.worst = max(self.worst, total)
            self.polls += 1
            time.sleep(0.02)

    def stop(self):
        self.stop_flag.set()
        self.join(10)


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.stop()


def test_a_workload_short_of_memory_grows_and_succeeds_while_an_idle_one_shrinks_to_its_request(node):
    node.ctl("create", "hungry", "--memory", "1Gi", "--request", "1Gi", "--limit", "4Gi")
    node.ctl("create", "idle", "--memory", "3Gi", "--request", "1Gi", "--limit", "4Gi")
    node.ctl("create", "fixed", "--memory", "2Gi")                 # request = limit: left alone
    hungry, idle = node.agent("hungry"), node.agent("idle")
    assert hungry.call("hold", 900 * MiB) == SUCCESS
    assert idle.call("hold", 100 * MiB) == SUCCESS
    assert hungry.call("hold", GiB) != SUCCESS                      # does not fit in 1Gi
    watcher = Watcher(node)
    watcher.start()
    scaler = node.autoscale("--window", "1s", "--interval", "200ms")

    rc, tries, seconds = hungry.call("retry", [GiB, 30], timeout=40)
    assert rc == SUCCESS, (tries, seconds)                          # it grew until the gigabyte fit
    assert 1924 * MiB <= node.quota("hungry").memory_max <= 4 * GiB
    wait_until(lambda: node.quota("idle").memory_max == GiB, 30, "idle to shrink to its request")
    time.sleep(1.5)                                                 # another window: it stays there
    watcher.stop()
    node.stop()

    assert node.quota("idle") == slices.DeviceQuota(GiB, GiB, 4 * GiB, 10000, 10000, 10000)
    assert node.quota("hungry").memory_request == GiB             # the floor did not follow the cap up
    assert node.quota("fixed").memory_max == 2 * GiB
    assert watcher.polls > 20 and watcher.bad == [] and watcher.worst <= A10
    log = decisions(scaler)
    grows = [d for d in log if d["slice"] == "hungry"]
    shrinks = [d for d in log if d["slice"] == "idle"]
    assert grows and all(d["event"] == "resize" and d["action"] == "grow" for d in grows)
    assert "refused by memory.max" in grows[0]["reason"]
    assert [d["old"] for d in grows[1:]] == [d["new"] for d in grows[:-1]]       # each step from the last
    assert shrinks and all(d["event"] == "resize" and d["action"] == "shrink" for d in shrinks)
    assert shrinks[-1]["new"] == GiB and all(d["new"] >= 100 * MiB + 64 * MiB for d in shrinks)
    assert not [d for d in log if d["slice"] == "fixed"]


def test_when_the_device_is_short_the_rest_is_shared_by_request_and_never_exceeded(node):
    node.ctl("create", "big", "--memory", "19.5Gi")                # fixed; 23.5Gi of 24Gi handed out
    node.ctl("create", "a", "--memory", "2Gi", "--request", "2Gi", "--limit", "8Gi")
    node.ctl("create", "b", "--memory", "2Gi", "--request", "1Gi", "--limit", "8Gi")
    a, b = node.agent("a"), node.agent("b")
    assert a.call("hold", 1900 * MiB) == SUCCESS and b.call("hold", 1900 * MiB) == SUCCESS
    a.send("retry", [300 * MiB, 30])                                # both want more than the 512Mi left
    b.send("retry", [GiB, 60])
    wait_until(lambda: all(slices.read_usage(node.dir, n).devices[0]["oom_refusals"] for n in "ab"), 10,
               "both to be refused")
    watcher = Watcher(node)
    watcher.start()
    scaler = node.autoscale("--window", "1s", "--interval", "200ms")
    rc, _, _ = a.read(40)
    assert rc == SUCCESS                                            # a's share was enough
    time.sleep(2.5)                                                 # b's was not: two more windows of asking
    refused = slices.read_usage(node.dir, "b").devices[0]["oom_refusals"]
    time.sleep(0.2)
    assert slices.read_usage(node.dir, "b").devices[0]["oom_refusals"] > refused    # still refused
    watcher.stop()
    node.stop()

    assert watcher.bad == [] and watcher.worst <= A10
    log = decisions(scaler)
    first = {d["slice"]: d for d in log if d["event"] == "resize"}
    assert set(first) == {"a", "b"}
    # 512Mi free, each wanted ~666Mi: split 2:1 by request (MiB-aligned)
    assert (first["a"]["new"] - first["a"]["old"], first["b"]["new"] - first["b"]["old"]) == (341 * MiB, 170 * MiB)
    assert all(first[c]["shared"] and "shared by request (a 2Gi, b 1Gi)" in first[c]["reason"] for c in "ab")
    assert any(d["event"] == "hold" and d["slice"] == "b" and "is full" in d["reason"] for d in log)
    total = sum(node.quota(n).memory_max for n in ("big", "a", "b"))
    assert A10 - 2 * MiB <= total <= A10


def test_a_throttled_tenant_gets_more_sm_up_to_its_limit(node, c_program):
    node.ctl("create", "t", "--memory", "1Gi", "--sm", "10%", "--sm-request", "10%", "--sm-limit", "40%")
    duty = subprocess.Popen([str(c_program("duty")), "200", "20"], env=node.workload_env("t"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    node.procs.append(duty)
    scaler = node.autoscale("--window", "1s", "--interval", "250ms")
    wait_until(lambda: node.quota("t").sm_max == 4000, 25, "sm.max to reach its limit")
    node.stop()
    grows = [d for d in decisions(scaler) if d["event"] == "resize"]
    assert [d["resource"] for d in grows] == ["sm"] * len(grows) and len(grows) >= 2
    assert grows[0]["old"] == 1000 and grows[-1]["new"] == 4000
    assert all(d["action"] == "grow" and "throttling" in d["reason"] for d in grows)
    assert node.quota("t") == slices.DeviceQuota(GiB, GiB, GiB, 4000, 1000, 4000)


def test_once_and_dry_run_and_a_restart_continue_from_the_files(node):
    node.ctl("create", "idle", "--memory", "2Gi", "--request", "1Gi", "--limit", "4Gi")
    once = ["--window", "500ms", "--interval", "100ms", "--once"]

    out = node.ctl("autoscale", *once, "--dry-run")
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[0]["event"] == "start" and lines[0]["dry_run"] is True
    assert [(d["event"], d["action"], d["old"], d["new"]) for d in lines[1:]] == \
        [("dry-run", "shrink", 2 * GiB, 1536 * MiB)]
    assert lines[1]["applied"] is False and node.quota("idle").memory_max == 2 * GiB

    for was, expect in (("2Gi", 1536 * MiB), ("1.5Gi", 1152 * MiB)):   # each run starts from the quota file
        out = node.ctl("autoscale", *once)
        (d,) = [json.loads(line) for line in out.stdout.splitlines()][1:]
        assert (d["event"], d["applied"], d["new"]) == ("resize", True, expect)
        assert d["reason"] == f"use < 50% of memory.max for 0.5s (peak 0 of {was})"
        assert node.quota("idle").memory_max == expect




def test_the_loop_follows_operators_and_survives_broken_and_vanishing_slices(tmp_path):
    """In process, on a clock of its own: an operator's resize restarts the window; a usage
    file cut short by its container crashes nothing and moves nothing; a slice whose files
    are broken is reported once and skipped; one deleted is forgotten."""
    import os
    from vgpu.autoscale import Autoscaler
    from vgpu.slices.reader import RESCAN_S
    from vgpu.policy import Policy
    d = tmp_path / "vgpu"
    for name in ("a", "b"):
        slices.create(d, name, {0: slices.device_quota(4 * GiB, request=GiB, limit=8 * GiB)}, overcommit=True)
    lines = []
    scaler = Autoscaler(d, Policy(window=2.0), interval=0.5, use_nvml=False, device_memory=24 * GiB,
                        log=lambda line: lines.append(json.loads(line)))
    now = 100.0

    def run(seconds):
        nonlocal now
        out = []
        for _ in range(int(seconds / 0.5)):
            now += 0.5
            out += scaler.tick(now)
        return out

    write_usage_counters(d, "a", memory_current=2 * GiB)          # 50%: in band
    write_usage_counters(d, "b", memory_current=3 * GiB)
    assert run(1.5) == []
    slices.resize(d, "a", memory=6 * GiB)        # an operator: 2Gi of 6Gi is now cold, but the window restarts
    assert run(1.5) == []                         # 1.5 s < 2 s under the new quota
    (dec,) = run(1.0)
    assert (dec.slice, dec.action, dec.old, dec.new) == ("a", "shrink", 6 * GiB, 4608 * MiB)

    os.truncate(d / "b" / "usage", 0)            # its container can (read-write mount): no SIGBUS, no zeros
    assert [x for x in run(3.0) if x.slice == "b"] == []

    (d / "b" / "quota").unlink()
    (d / "b" / "quota").write_bytes(b"garbage")  # a new file, broken: seen at the next re-scan
    run(RESCAN_S + 1)
    run(RESCAN_S + 1)
    errors = [x for x in lines if x["event"] == "error"]
    assert [(x["slice"], "refusing it" in x["error"] or "not a vgpu file" in x["error"]) for x in errors] == \
        [("b", True)]                             # once, not every interval
    slices.delete(d, "a", force=True)
    assert run(1.0) == [] and set(scaler.reader.views) == set()


def test_a_burst_slice_yielding_to_a_guarantee_is_not_starved_but_one_held_at_its_ceiling_is(node, c_program):
    """Burst mode: a (guaranteed 30%, ceiling 50%, autoscale limit 90%) next to b (70%,
    saturating) is held at 30% by b's guarantee: that wait is `yielded`, which growing a's
    ceiling would not help, and the autoscaler leaves it.  Once b is gone, a bursts to its
    ceiling and waits there (`throttled`): the autoscaler grows it."""
    node.ctl("create", "a", "--memory", "1Gi", "--sm", "50%", "--sm-request", "30%", "--sm-limit", "90%")
    node.ctl("create", "b", "--memory", "1Gi", "--sm", "70%")
    exe = str(c_program("duty"))
    a = subprocess.Popen([exe, "2000", "12"], env=node.workload_env("a"), stdout=subprocess.DEVNULL)
    b = subprocess.Popen([exe, "2000", "4"], env=node.workload_env("b"), stdout=subprocess.DEVNULL)
    node.procs += [a, b]
    scaler = node.autoscale("--window", "1s", "--interval", "250ms")
    assert b.wait(timeout=30) == 0
    u = slices.read_usage(node.dir, "a").devices[0]
    assert node.quota("a").sm_max == 5000, decisions(scaler)    # 4 s of yielding: no growth
    assert u["yielded_ns"] > 1.5e9 and u["throttled_ns"] < 0.2e9, u
    node.ctl("delete", "b")     # (its 70% ceiling no longer takes the room a would grow into)
    wait_until(lambda: node.quota("a").sm_max > 5000, 10, "a's ceiling to grow once it waits at it")
    node.stop()
    grows = [d for d in decisions(scaler) if d["event"] == "resize" and d["slice"] == "a"]
    assert grows and all(d["action"] == "grow" and "throttling" in d["reason"] for d in grows), grows
