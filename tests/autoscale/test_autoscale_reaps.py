"""The autoscaler returns a dead process's memory to its slice within a second
(autoscale.REAP_S), asking each slice's kept usage descriptor first whether any used
slot's lock is free (usage.has_dead_slot) instead of reaping all of them every second;
a usage file made again under a slice is read (and reaped) from the next re-scan.

Real processes under the shim on simgpu (tests/programs/tenant.py), one killed with
SIGKILL; judged from the usage file as a plain read (which reaps nothing)."""
import fcntl
import json
import os
import struct
import subprocess
import sys

from tests.helpers.paths import PROGRAMS
from tests.helpers.simnode import make_sim_env
from vgpu import slices
from vgpu._region import ffi, lib
from vgpu.autoscale import REAP_S, Autoscaler
from vgpu.paths import SHIM
from vgpu.policy import Policy
from vgpu.slices import usage
from vgpu.slices.reader import RESCAN_S

GiB, MiB = 1 << 30, 1 << 20


def _tenant(env):
    p = subprocess.Popen([sys.executable, str(PROGRAMS / "tenant.py")], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "pid" in json.loads(p.stdout.readline() or "{}"), p.stderr.read()
    return p


def _call(p, **cmd):
    p.stdin.write(json.dumps(cmd) + "\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def test_a_killed_process_memory_is_back_at_the_next_second_and_a_live_ones_stays(tmp_path):
    directory = tmp_path / "vgpu"
    slices.create(directory, "c1", {0: slices.device_quota(4 * GiB, request=2 * GiB, limit=8 * GiB)},
                  overcommit=True)
    env = {**make_sim_env(tmp_path / "node"), "LD_PRELOAD": str(SHIM), "VGPU_DIR": str(directory),
           "VGPU_SLICE": "c1"}
    tenants = [_tenant(env) for _ in range(2)]
    try:
        for t in tenants:
            assert _call(t, alloc=256 * MiB) == 0
        scaler = Autoscaler(directory, Policy(), interval=1.0, use_nvml=False, device_memory=24 * GiB,
                            log=lambda line: None)
        now = 1000.0
        scaler.tick(now)
        before = slices.read_usage(directory, "c1")
        assert len(before.procs) == 2 and all(p.alive for p in before.procs)
        dead, live = tenants
        dead.kill()
        dead.wait(10)
        assert REAP_S < RESCAN_S
        scaler.tick(now + REAP_S)        # a second later, no re-scan: the kept descriptor's answer calls the reap
        after = slices.read_usage(directory, "c1")
        assert [p.pid for p in after.procs] == [live.pid]
        assert after.devices[0]["memory_current"] == sum(after.procs[0].memory.values()) >= 256 * MiB
        scaler.tick(now + 2 * REAP_S)    # nothing dead: the live process keeps its memory
        assert slices.read_usage(directory, "c1").devices[0]["memory_current"] == after.devices[0]["memory_current"]
    finally:
        for t in tenants:
            t.kill()
            t.wait(10)


def test_a_usage_file_made_again_is_read_and_reaped_from_the_next_rescan(tmp_path):
    """A container can remove its usage file (its shim makes another): the view kept the
    old one open, and would never see the new file's dead slots.  (A fixed cap: nothing
    the autoscaler decides, no resize, reaps it instead.)"""
    slices.create(tmp_path, "c1", {0: slices.device_quota(4 * GiB)}, overcommit=True)
    path = tmp_path / "c1" / "usage"
    scaler = Autoscaler(tmp_path, Policy(), interval=1.0, use_nvml=False, device_memory=24 * GiB,
                        log=lambda line: None)
    now = 1000.0
    scaler.tick(now)
    buf = bytearray(path.read_bytes())
    u = ffi.cast("struct vgpu_usage *", ffi.from_buffer(buf))
    u.procs[2].pid, u.charge[0][2], u.slots_used = 4_000_000, 64 * MiB, 3    # a gone process's, no lock
    (tmp_path / "c1" / "usage.new").write_bytes(bytes(buf))
    os.replace(tmp_path / "c1" / "usage.new", path)
    assert slices.read_usage(tmp_path, "c1").devices[0]["memory_current"] == 64 * MiB
    scaler.tick(now + RESCAN_S + REAP_S)     # (a re-scan, whatever the directory's time says)
    seen = slices.read_usage(tmp_path, "c1")
    assert seen.procs == [] and seen.devices[0]["memory_current"] == 0


def _lock(fd, slot, kind=fcntl.F_WRLCK):
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", kind, os.SEEK_SET, slices.LOCK_BASE + slot, 1, 0))


def test_has_dead_slot_is_true_exactly_when_a_used_slots_lock_is_free(tmp_path):
    """The same rule a reap applies (a slot is used when its record names a process or a
    row charges it; it is dead when its lock is free), read from a kept read-only
    descriptor; a file cut short (a container's doing) says True: the reap says why."""
    slices.create(tmp_path, "c1", {0: slices.device_quota(4 * GiB)}, overcommit=True)
    path = tmp_path / "c1" / "usage"
    ro = os.open(path, os.O_RDONLY)
    holder = os.open(path, os.O_RDWR)     # another open file description: its locks are another owner's
    try:
        assert not usage.has_dead_slot(ro)                     # nothing used
        with open(path, "r+b") as f:
            buf = bytearray(f.read())
            u = ffi.cast("struct vgpu_usage *", ffi.from_buffer(buf))
            u.procs[5].pid = 4_000_000
            f.seek(0)
            f.write(buf)
        assert usage.has_dead_slot(ro)                         # a record naming a process, no lock
        _lock(holder, 5)
        assert not usage.has_dead_slot(ro)                     # its process holds the lock
        with open(path, "r+b") as f:                           # a charge with no record (a drain cut short)
            f.seek(usage.charge_offset(3, 40))
            f.write((1 * MiB).to_bytes(8, "little"))
        assert usage.has_dead_slot(ro)
        _lock(holder, 40, fcntl.F_RDLCK)                       # held shared, as a shared slot's holders do
        assert not usage.has_dead_slot(ro)
        _lock(holder, 5, fcntl.F_UNLCK)
        assert usage.has_dead_slot(ro)
        _lock(holder, 5)
        os.truncate(path, usage.SIZE - 1)
        assert usage.has_dead_slot(ro)
        assert lib.VGPU_MAX_PROCS > 40 and lib.VGPU_MAX_DEVICES > 3
    finally:
        os.close(ro)
        os.close(holder)
