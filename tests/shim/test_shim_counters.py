"""Launch and GPU-time counters reach the usage file whole, however a process ends.

The shim batches its per-launch counters per thread (one shared atomic per launch would
cost more than the pacing); what is still batched is flushed when the process exits, before
it forks, and when a thread ends.  tests/programs/launch_count.c is a short-lived program:
it launches a number of 1 us kernels at a 50% share and exits at once.
"""
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.simnode import make_sim_env
from vgpu._region import ffi
from vgpu.paths import SHIM

CTL = str(Path(sys.executable).parent / "vgpu-ctl")


def run_counted(tmp_path, c_program, *counts):
    env = make_sim_env(tmp_path / "node", LD_PRELOAD=str(SHIM), VGPU_DIR=tmp_path / "vgpu", VGPU_SLICE="t")
    # a slice the controller made: it outlives its processes (a standalone one goes with its last)
    subprocess.run([CTL, "create", "t", "--sm", "50%", "--dir", tmp_path / "vgpu"], env=env | {"LD_PRELOAD": ""},
                   check=True, capture_output=True, timeout=60)
    p = subprocess.run([str(c_program("launch_count")), *map(str, counts)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stderr)
    u = ffi.from_buffer("struct vgpu_usage *", (tmp_path / "vgpu" / "t" / "usage").read_bytes())
    return u.devices[0]


@pytest.mark.parametrize("launches", [1, 63, 101, 201])
def test_a_short_lived_process_has_every_launch_counted(tmp_path, c_program, launches):
    d = run_counted(tmp_path, c_program, launches)
    assert d.launches == launches
    # each 1 us kernel is charged its measured time, except the very first, which runs
    # before any estimate exists (charged 0)
    assert d.gpu_time_ns >= (launches - 1) * 500, d.gpu_time_ns


def test_a_forked_child_and_its_parent_are_each_counted_once(tmp_path, c_program):
    """101 launches before the fork (batched, not yet flushed), 50 tried in the child (which
    the driver refuses: CUDA is not usable in a child forked after cuInit; the shim counts
    the launches it was asked for): 151, not 252 (the child counting its parent's batch
    again) nor 101 or 50."""
    d = run_counted(tmp_path, c_program, 101, 50)
    assert d.launches == 151


def test_a_thread_that_ends_has_its_launches_counted(tmp_path, c_program):
    d = run_counted(tmp_path, c_program, 10, 0, 37)
    assert d.launches == 47
