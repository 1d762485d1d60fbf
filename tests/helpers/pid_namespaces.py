"""Pid namespaces, as each container has one: a process knows its own pid in the namespace,
while the host (NVML, the node agent) names it by its host pid.  Made with `unshare --pid`,
which needs root: tests that need one skip without it.  (bench/gpu_check.py keeps its own
copy of `started_by`: it runs on a lent GPU machine with the standard library alone.)"""
import subprocess
import time

import pytest

# the host's /proc and mounts kept, so simgpu's NVML lists the host pid, as a driver does
IN_OWN_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--kill-child"]


def needs_pid_namespaces():
    if subprocess.run([*IN_OWN_PID_NAMESPACE, "true"], capture_output=True).returncode:
        pytest.skip("needs root and pid namespaces")


def children(pid):
    """The host pids of `pid`'s children."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def started_by(outer, timeout=10.0):
    """The host pid of the process `unshare --fork` (host pid `outer`) started, awaited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pids = children(outer)
        except FileNotFoundError:        # unshare gone already
            break
        if pids:
            return pids[0]
        time.sleep(0.01)
    raise AssertionError(f"unshare ({outer}) started no process")
