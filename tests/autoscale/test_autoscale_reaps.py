"""The autoscaler returns a dead process's memory to its slice within a second
(autoscale.REAP_S), asking each slice's kept usage descriptor first whether any used
slot's lock is free (usage.has_dead_slot) instead of reaping all of them every second,
and asking only the slices inotify saw a process leave (and every slice once in
REAP_SWEEP reaps, and every one every time without inotify); a usage file made again
under a slice is read (and reaped) from the next re-scan.

Real processes under the shim on simgpu (tests/programs/tenant.py), one killed with
SIGKILL; judged from the usage file as a plain read (which reaps nothing)."""
import fcntl
import gc
import json
import os
import struct
import subprocess
import sys

import pytest

from tests.helpers.paths import PROGRAMS
from tests.helpers.simnode import make_sim_env
from tests.helpers.slots import forge_slot
from vgpu import autoscale, procfs, slices
from vgpu._region import ffi, lib
from vgpu.autoscale import REAP_S, REAP_SWEEP, Autoscaler
from vgpu.paths import SHIM
from vgpu.policy import Policy
from vgpu.slices import usage
from vgpu.slices.reader import RESCAN_S, SliceView

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


def _scaler(directory):
    return Autoscaler(directory, Policy(), interval=1.0, use_nvml=False, device_memory=24 * GiB,
                      log=lambda line: None)


def _looked_at(monkeypatch):
    """Counts has_dead_slot per slice (what a reap asks each slice it looks at)."""
    seen = {}
    real = SliceView.has_dead_slot

    def counted(self):
        seen[self.name] = seen.get(self.name, 0) + 1
        return real(self)
    monkeypatch.setattr(SliceView, "has_dead_slot", counted)
    return seen


def test_a_slot_dead_without_a_close_is_found_by_the_sweep_and_quiet_slices_are_asked_once_a_sweep(
        tmp_path, monkeypatch):
    """No process closed a usage file: each of 2 * REAP_SWEEP slices is asked once in
    REAP_SWEEP reaps (not every second), and a dead slot written by hand (no close, no
    event) is reaped at its slice's turn."""
    names = [f"c{i:02d}" for i in range(2 * REAP_SWEEP)]
    for name in names:
        slices.create(tmp_path, name, {0: slices.device_quota(4 * GiB)}, overcommit=True)
    scaler = _scaler(tmp_path)
    now = 1000.0
    scaler.tick(now)                     # every slice new to the loop: asked once
    seen = _looked_at(monkeypatch)
    fd = os.open(tmp_path / "c07" / "usage", os.O_RDWR)
    try:
        forge_slot(fd, 2, 4_000_000, 64 * MiB)    # a gone process's, no lock
        for k in range(1, REAP_SWEEP + 1):
            scaler.tick(now + k * REAP_S)
    finally:
        os.close(fd)
    assert slices.read_usage(tmp_path, "c07").devices[0]["memory_current"] == 0
    assert {n: c for n, c in seen.items() if n != "c07"} == {n: 1 for n in names if n != "c07"}
    assert 1 <= seen["c07"] <= 4         # its turn; then its reap's own close of the file: asked twice more


def test_without_inotify_every_slice_is_asked_every_reap(tmp_path, monkeypatch):
    monkeypatch.setattr(autoscale, "open_inotify", lambda mask: None)
    for name in ("a", "b", "c"):
        slices.create(tmp_path, name, {0: slices.device_quota(4 * GiB)}, overcommit=True)
    scaler = _scaler(tmp_path)
    seen = _looked_at(monkeypatch)
    now = 1000.0
    for k in range(4):
        scaler.tick(now + k * REAP_S)
    assert seen == {"a": 4, "b": 4, "c": 4}
    fd = os.open(tmp_path / "b" / "usage", os.O_RDWR)
    try:
        forge_slot(fd, 0, 4_000_000, 64 * MiB)
        scaler.tick(now + 4 * REAP_S)
    finally:
        os.close(fd)
    assert slices.read_usage(tmp_path, "b").devices[0]["memory_current"] == 0


def test_a_slot_whose_process_is_still_there_is_asked_every_reap_until_it_is_gone(tmp_path, monkeypatch):
    """A slot whose lock is free but whose process is still there (exiting, or exec'd
    without the file) keeps its charge; the slice is asked again every reap, not only after
    the event and the reap after it, so the charge is back in the reap after the process
    ends (with no event then: its file was closed long before)."""
    if procfs.pid_ns() != procfs.ROOT_PID_NS:
        pytest.skip("the reaper looks a slot's process up in its own pid namespace: the test's")
    slices.create(tmp_path, "c1", {0: slices.device_quota(4 * GiB)}, overcommit=True)
    scaler = _scaler(tmp_path)
    now = 1000.0
    scaler.tick(now)
    child = subprocess.Popen(["sleep", "600"])
    try:
        fd = os.open(tmp_path / "c1" / "usage", os.O_RDWR)
        forge_slot(fd, 1, child.pid, 64 * MiB, procfs.start_ticks(child.pid), procfs.pid_ns())
        os.close(fd)                     # the close: inotify's event
        for k in (1, 2, 3):              # the event's reap, the one after, and one more
            scaler.tick(now + k * REAP_S)
            assert slices.read_usage(tmp_path, "c1").devices[0]["memory_current"] == 64 * MiB
    finally:
        child.kill()
        child.wait(10)
    scaler.tick(now + 4 * REAP_S)
    assert slices.read_usage(tmp_path, "c1").devices[0]["memory_current"] == 0


def test_a_slice_whose_close_came_before_its_lock_went_is_looked_at_again(tmp_path):
    """The kernel reports a close (fsnotify) before it lets the file's locks go (__fput):
    a reap that comes in between finds the slot still locked.  The slice is looked at in the
    next reap too, where the lock is gone (let go here without a close: no second event)."""
    names = [f"c{i:02d}" for i in range(4)]
    for name in names:
        slices.create(tmp_path, name, {0: slices.device_quota(4 * GiB)}, overcommit=True)
    scaler = _scaler(tmp_path)
    now = 1000.0
    scaler.tick(now)
    holder = os.open(tmp_path / "c00" / "usage", os.O_RDWR)
    try:
        forge_slot(holder, 5, 4_000_000, 64 * MiB)
        _lock(holder, 5)                                   # still held at the first look
        os.close(os.open(tmp_path / "c00" / "usage", os.O_RDWR))   # the close: inotify's event
        scaler.tick(now + REAP_S)
        assert slices.read_usage(tmp_path, "c00").devices[0]["memory_current"] == 64 * MiB
        _lock(holder, 5, fcntl.F_UNLCK)
        scaler.tick(now + 2 * REAP_S)
        assert slices.read_usage(tmp_path, "c00").devices[0]["memory_current"] == 0
    finally:
        os.close(holder)
    assert REAP_SWEEP > 3                                  # (no sweep turn of c00's in these reaps)


def test_an_autoscaler_let_go_of_leaves_no_descriptor_open(tmp_path):
    """A view keeps its slice's usage file open; one dropped with its reader (an autoscaler
    a long-lived process made and forgot) closes it, and the watcher its inotify descriptor."""
    def open_fds():
        """This test's own: the slices' files and inotify instances (garbage an earlier test
        of this worker left may be collected meanwhile and close descriptors of its own)."""
        def target(fd):
            try:
                return os.readlink(f"/proc/self/fd/{fd}")
            except OSError:   # closed since the listing
                return ""
        return sorted(t for t in map(target, os.listdir("/proc/self/fd"))
                      if t.startswith(str(tmp_path)) or t == "anon_inode:inotify")
    for i in range(20):
        slices.create(tmp_path, f"c{i:02d}", {0: slices.device_quota(4 * GiB)}, overcommit=True)
    gc.collect()
    before = open_fds()
    scaler = _scaler(tmp_path)
    scaler.tick(1000.0)
    assert len(open_fds()) >= len(before) + 20
    del scaler
    gc.collect()
    assert open_fds() == before
