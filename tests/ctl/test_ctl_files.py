"""The slice files vgpu-ctl writes: layout, modes, no link following, no torn writes."""
import os
import stat
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from vgpu import slices
from vgpu._region import ffi, lib
from vgpu.cli import main

GiB, MiB = 1 << 30, 1 << 20
QUOTA_SIZE, USAGE_SIZE = ffi.sizeof("struct vgpu_quota"), ffi.sizeof("struct vgpu_usage")


def make(directory, name="c1", memory=GiB, sm=5000, devices=(0,), **kw):
    q = slices.device_quota(memory, sm)
    return slices.create(directory, name, {d: q for d in devices}, overcommit=True, **kw)


def quota_struct(path):
    data = bytearray(path.read_bytes())
    return data, ffi.cast("struct vgpu_quota *", ffi.from_buffer(data))


def test_create_writes_the_layout_the_shim_reads(tmp_path):
    make(tmp_path, "c1", memory=4 * GiB, sm=5000, devices=(1,))
    data, q = quota_struct(tmp_path / "c1" / "quota")
    assert len(data) == QUOTA_SIZE
    assert (q.magic, q.abi_version, q.size, q.generation, q.device_count) == \
        (lib.VGPU_QUOTA_MAGIC, lib.VGPU_ABI_VERSION, QUOTA_SIZE, 2, 2)
    assert ffi.string(q.name) == b"c1"
    assert (q.devices[0].memory_max, q.devices[0].sm_max) == (0, 0)             # not given: denied
    assert (q.devices[1].memory_max, q.devices[1].memory_request, q.devices[1].memory_limit,
            q.devices[1].sm_max) == (4 * GiB, 4 * GiB, 4 * GiB, 5000)
    usage = (tmp_path / "c1" / "usage").read_bytes()
    u = ffi.cast("struct vgpu_usage *", ffi.from_buffer(usage))
    assert (len(usage), u.magic, u.abi_version, u.size) == (USAGE_SIZE, lib.VGPU_USAGE_MAGIC,
                                                             lib.VGPU_ABI_VERSION, USAGE_SIZE)
    assert usage[16:] == b"\0" * (USAGE_SIZE - 16)
    assert sorted(os.listdir(tmp_path / "c1")) == ["identity", "quota", "usage"]     # no temporary file left


def test_files_are_created_with_their_documented_modes_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        make(tmp_path / "node", "c1")
    finally:
        os.umask(old)
    mode = {p: stat.S_IMODE(os.stat(tmp_path / "node" / p).st_mode) for p in ("c1", "c1/quota", "c1/usage")}
    assert mode == {"c1": 0o755, "c1/quota": 0o644, "c1/usage": 0o666}


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_create_for_a_user_makes_the_usage_file_theirs_alone(tmp_path):
    make(tmp_path, "c1", owner=(65534, 65534))
    st = os.stat(tmp_path / "c1" / "usage")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65534, 65534, 0o600)
    assert os.stat(tmp_path / "c1" / "quota").st_uid == 0


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "-x", "..", ".", "", "x" * 64, "a\0b", "a\nb"])
def test_names_with_path_tricks_are_rejected_before_touching_disk(tmp_path, name):
    with pytest.raises(slices.InvalidRequest, match="not a valid slice name"):
        make(tmp_path / "node", name)
    assert not (tmp_path / "node").exists()
    assert not (tmp_path / "x").exists()


def test_names_the_shim_accepts_are_accepted(tmp_path):
    for name in ("a", "A-b_c.d", "0train", "x" * 63, "_x"):
        make(tmp_path, name)
    assert slices.list_names(tmp_path) == sorted(["a", "A-b_c.d", "0train", "x" * 63, "_x"])


def test_a_symlinked_quota_is_refused_and_its_target_untouched(tmp_path):
    node = tmp_path / "node"
    make(node, "c1")
    target = tmp_path / "precious"
    target.write_bytes((node / "c1" / "quota").read_bytes())
    before = target.read_bytes()
    (node / "c1" / "quota").unlink()
    (node / "c1" / "quota").symlink_to(target)
    r = CliRunner().invoke(main, ["resize", "c1", "--memory", "2Gi", "--overcommit", "--dir", str(node)])
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"Error: {node}/c1/quota is a symbolic link or not a file; refusing it; "
                                "hint: vgpu never follows links inside the node directory: remove it")
    assert target.read_bytes() == before
    ((name, quota, usage, problem),) = slices.read_all(node)       # what list and status show
    assert (name, quota, usage) == ("c1", None, None) and "symbolic link" in problem


def test_a_symlinked_slice_directory_is_refused(tmp_path):
    node = tmp_path / "node"
    make(tmp_path / "elsewhere", "real")
    node.mkdir()
    (node / "c1").symlink_to(tmp_path / "elsewhere" / "real")
    for args in (["resize", "c1", "--memory", "2Gi", "--overcommit"], ["delete", "c1"], ["reap", "c1"]):
        r = CliRunner().invoke(main, [*args, "--dir", str(node)])
        assert r.exit_code == 1 and "is a symbolic link or not a directory" in r.stderr, (args, r.output)
    assert slices.list_names(node) == []                        # not listed either
    assert slices.read_quota(tmp_path / "elsewhere", "real").devices[0].memory_max == GiB
    # and create does not write through it
    r = CliRunner().invoke(main, ["create", "c1", "--memory", "1Gi", "--overcommit", "--dir", str(node)])
    assert r.exit_code == 1 and "symbolic link" in r.stderr
    assert sorted(os.listdir(tmp_path / "elsewhere" / "real")) == ["identity", "quota", "usage"]


def test_a_hard_linked_quota_is_refused(tmp_path):
    make(tmp_path, "c1")
    os.link(tmp_path / "c1" / "quota", tmp_path / "other")
    with pytest.raises(slices.BadFile, match="not a plain file with one link"):
        slices.resize(tmp_path, "c1", memory=2 * GiB, overcommit=True)


def test_unwritable_node_directory_is_one_line_with_a_hint(tmp_path):
    if os.geteuid() == 0:
        node = "/sys/vgpu-ctl-test"               # even root may not create there (EPERM)
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        node = str(tmp_path / "ro" / "vgpu")
    r = CliRunner().invoke(main, ["create", "c1", "--memory", "1Gi", "--overcommit", "--dir", node])
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"Error: cannot create {node}: permission denied; hint: run as root, "
                                "or point --dir / VGPU_DIR at a directory you can write")


def test_a_writer_that_died_half_way_leaves_a_readable_quota_and_the_next_write_evens_it(tmp_path):
    make(tmp_path, "c1")
    fd = os.open(tmp_path / "c1" / "quota", os.O_RDWR)
    os.pwrite(fd, (7).to_bytes(8, "little"), ffi.offsetof("struct vgpu_quota", "generation"))
    os.close(fd)
    assert slices.read_quota(tmp_path, "c1").generation == 7      # no writer holds the lock: read as is
    assert slices.resize(tmp_path, "c1", memory=2 * GiB, overcommit=True)["generation"] == 10
    assert slices.read_quota(tmp_path, "c1").generation == 10


WRITER = """
import sys
from vgpu import slices
directory, mems, sm, n = sys.argv[1], [int(m) for m in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
print("ready", flush=True)
sys.stdin.readline()
for i in range(n):
    slices.resize(directory, "c1", memory=mems[i % 2], sm=sm, overcommit=True)
"""


def test_two_controllers_resizing_at_once_never_leave_a_torn_quota(tmp_path):
    """Two processes resize the same slice 1000 times each, each writing its own (memory,
    sm) pairs; meanwhile every read sees an intact header, and every consistent read sees
    one writer's pair -- never one's memory with the other's share."""
    make(tmp_path, "c1", memory=GiB, sm=10000)
    pairs = {"a": ([2 * GiB, 3 * GiB], 2000), "b": ([5 * GiB, 7 * GiB], 7000)}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), ",".join(map(str, mems)), str(sm),
                               "1000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for mems, sm in pairs.values()]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    share_of = {m: sm for mems, sm in pairs.values() for m in mems} | {GiB: 10000}
    path = tmp_path / "c1" / "quota"
    reads = consistent = 0
    while any(p.poll() is None for p in procs) or reads < 50:
        data, q = quota_struct(path)                      # raw: the header is never torn
        assert (len(data), q.magic, q.abi_version, q.size, q.device_count, ffi.string(q.name)) == \
            (QUOTA_SIZE, lib.VGPU_QUOTA_MAGIC, lib.VGPU_ABI_VERSION, QUOTA_SIZE, 1, b"c1")
        assert q.devices[0].memory_max in share_of
        d = slices.read_quota(tmp_path, "c1").devices[0]  # seqlock read: one whole write
        assert d.sm_max == share_of[d.memory_max]
        assert d.memory_request == d.memory_max == d.memory_limit and d.sm_request == d.sm_max == d.sm_limit
        reads += 1
        consistent += d.memory_max != GiB
        time.sleep(0.0005)
    assert [p.wait(30) for p in procs] == [0, 0]
    final = slices.read_quota(tmp_path, "c1")
    assert final.generation == 2 + 2 * 2000      # every write changed something: each bumped it by 2
    assert final.devices[0].sm_max == share_of[final.devices[0].memory_max]
    assert consistent > 0


def test_resize_with_an_expected_generation_loses_to_a_change_made_in_between(tmp_path):
    """The autoscaler decides from generation g and writes only if the quota is still g,
    so an operator's resize in between is never overwritten."""
    make(tmp_path, "c1", memory=GiB)
    g = slices.read_quota(tmp_path, "c1").generation
    slices.resize(tmp_path, "c1", memory=3 * GiB, overcommit=True)          # the operator
    with pytest.raises(slices.Changed):
        slices.resize(tmp_path, "c1", memory=2 * GiB, overcommit=True, expect_generation=g)
    q = slices.read_quota(tmp_path, "c1")
    assert q.devices[0].memory_max == 3 * GiB
    result = slices.resize(tmp_path, "c1", memory=2 * GiB, overcommit=True, expect_generation=q.generation)
    assert result["generation"] == q.generation + 2
    assert slices.read_quota(tmp_path, "c1").devices[0].memory_max == 2 * GiB
