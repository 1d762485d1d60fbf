"""vgpu-ctl install-shim: the shim copied to a host directory, atomically.

Promises: the copy is the package's shim byte for byte; a reinstall never shows a reader
a partial file (a concurrent reader sees the old or the new library, whole); a process
that has the old library loaded keeps running on it (it holds the old inode); running
it again changes nothing; failures are one line with a hint.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.helpers.simnode import start_python
from vgpu import install
from vgpu.cli import main
from vgpu.paths import SHIM
from vgpu.runtime import CONTAINER_SHIM

CTL = str(Path(sys.executable).parent / "vgpu-ctl")


def ctl(*args):
    return CliRunner().invoke(main, [*map(str, args)])


def temp_files(dest):
    return [p.name for p in Path(dest).iterdir() if p.name.startswith(".")]


def test_install_copies_the_shim_byte_for_byte(tmp_path):
    dest = tmp_path / "opt-vgpu"
    r = ctl("install-shim", dest)
    assert r.exit_code == 0, r.output
    installed = dest / "libvgpu.so"
    assert installed.read_bytes() == SHIM.read_bytes()
    assert installed.stat().st_mode & 0o777 == 0o755 and dest.stat().st_mode & 0o777 == 0o755
    sha = hashlib.sha256(SHIM.read_bytes()).hexdigest()
    assert r.stdout.splitlines()[0] == f"installed {installed} ({SHIM.stat().st_size} bytes, sha256 {sha[:12]})"
    assert not (dest / "ld.so.preload").exists()
    assert temp_files(dest) == []


def test_installing_again_leaves_the_file_alone(tmp_path):
    assert ctl("install-shim", tmp_path).exit_code == 0
    inode = (tmp_path / "libvgpu.so").stat().st_ino
    r = ctl("install-shim", tmp_path)
    assert r.exit_code == 0 and r.stdout.startswith(f"unchanged {tmp_path}/libvgpu.so ")
    assert (tmp_path / "libvgpu.so").stat().st_ino == inode


def test_preload_file_names_the_shim_where_containers_mount_it(tmp_path):
    data = json.loads(ctl("install-shim", tmp_path, "--preload-file", "--json").stdout)
    assert (tmp_path / "ld.so.preload").read_text() == CONTAINER_SHIM + "\n"
    assert (tmp_path / "ld.so.preload").stat().st_mode & 0o777 == 0o644
    assert data["dest"] == str(tmp_path) and data["container_path"] == CONTAINER_SHIM
    assert [(Path(f["path"]).name, f["bytes"], f["changed"]) for f in data["files"]] == [
        ("libvgpu.so", SHIM.stat().st_size, True), ("ld.so.preload", len(CONTAINER_SHIM) + 1, True)]
    assert data["files"][0]["sha256"] == hashlib.sha256(SHIM.read_bytes()).hexdigest()


def test_the_command_line_program_installs_too(tmp_path):
    out = subprocess.run([CTL, "install-shim", str(tmp_path / "d")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "d" / "libvgpu.so").read_bytes() == SHIM.read_bytes()


def two_versions(tmp_path):
    """Two loadable shims of different sizes: the real one, and one with trailing padding
    (ELF loaders ignore bytes past the last segment)."""
    old = tmp_path / "old.so"
    old.write_bytes(SHIM.read_bytes() + b"\0" * 8192)
    return old, SHIM


DLOPEN_CHILD = r"""
import ctypes, os, sys
shim = ctypes.CDLL(sys.argv[1])            # the installed shim, by path
cuda = ctypes.CDLL("libcuda.so.1")         # simgpu, for what the shim does not hook
assert shim.cuInit(0) == 0

def total():
    dev, size = ctypes.c_int(), ctypes.c_size_t()
    assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    rc = shim.cuDeviceTotalMem_v2(ctypes.byref(size), dev)
    return f"{rc} {size.value}"

print(total(), flush=True)
for line in sys.stdin:                     # each line: call through the shim again
    print(total(), flush=True)
"""


def test_a_process_holding_the_old_shim_keeps_running_it_after_a_reinstall(tmp_path, sim_env):
    old, new = two_versions(tmp_path)
    dest = tmp_path / "opt"
    install.install_shim(dest, source=old)
    lib = dest / "libvgpu.so"
    old_inode = lib.stat().st_ino
    env = {**sim_env, "VGPU_DIR": str(tmp_path / "vgpu"), "VGPU_SLICE": "c1", "VGPU_MEMORY_LIMIT": "1Gi"}
    child = start_python(DLOPEN_CHILD, env, args=[str(lib)])
    try:
        assert child.stdout.readline().split() == ["0", str(1 << 30)]   # the shim's view: the cap
        result = install.install_shim(dest, source=new)
        assert result["files"][0]["changed"] is True
        assert lib.read_bytes() == new.read_bytes() and lib.stat().st_ino != old_inode
        maps = Path(f"/proc/{child.pid}/maps").read_text()
        held = {line.split()[4] for line in maps.splitlines() if str(lib) in line}
        assert held == {str(old_inode)} and "(deleted)" in maps   # the old library, unlinked, still mapped
        for _ in range(3):
            child.stdin.write("again\n")
            child.stdin.flush()
            assert child.stdout.readline().split() == ["0", str(1 << 30)]
    finally:
        child.stdin.close()
        assert child.wait(timeout=30) == 0, child.stderr.read()
    # a process starting now loads the new one
    fresh = start_python(DLOPEN_CHILD, env, args=[str(lib)])
    assert fresh.stdout.readline().split() == ["0", str(1 << 30)]
    maps = Path(f"/proc/{fresh.pid}/maps").read_text()
    assert {line.split()[4] for line in maps.splitlines() if str(lib) in line} == {str(lib.stat().st_ino)}
    fresh.stdin.close()
    assert fresh.wait(timeout=30) == 0


def test_a_concurrent_reader_only_ever_sees_a_whole_library(tmp_path):
    old, new = two_versions(tmp_path)
    wholes = {hashlib.sha256(p.read_bytes()).hexdigest(): p.name for p in (old, new)}
    dest = tmp_path / "opt"
    install.install_shim(dest, source=old)
    lib = dest / "libvgpu.so"
    seen, problems, stop = {}, [], threading.Event()

    def reader():
        while not stop.is_set():
            try:
                with open(lib, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            except OSError as e:          # a missing file would be a gap between old and new
                problems.append(repr(e))
                continue
            if digest not in wholes:
                problems.append(f"partial or foreign file {digest}")
            else:
                seen[wholes[digest]] = seen.get(wholes[digest], 0) + 1

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(60):
            install.install_shim(dest, source=(new if i % 2 == 0 else old))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert problems == []
    assert set(seen) == {"old.so", "libvgpu.so"}      # both versions were really read
    assert lib.read_bytes() == old.read_bytes()       # the last install (i = 59) was the old one
    assert temp_files(dest) == []


def one_line_error(result, *parts):
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for p in parts:
        assert p in lines[0], lines[0]


def run_unprivileged(args):
    """vgpu-ctl as a user who cannot write the directory (nobody when we are root)."""
    prefix = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"] if os.geteuid() == 0 else []
    return subprocess.run(prefix + [CTL, *map(str, args)], capture_output=True, text=True, timeout=60)


def test_a_directory_it_cannot_write_is_one_line_with_a_hint():
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv to drop privileges")
    base = Path(tempfile.mkdtemp(prefix="vgpu-install-"))   # outside pytest's 0700 tree: others can reach it
    try:
        base.chmod(0o755)
        locked = base / "locked"
        locked.mkdir(mode=0o555)
        for dest in (locked, locked / "sub"):
            one_line_error(run_unprivileged(["install-shim", dest]), f"cannot write {dest}: permission denied",
                           "hint: run as root")
        assert list(locked.iterdir()) == []
    finally:
        shutil.rmtree(base)


def test_other_destinations_that_cannot_work(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    r = ctl("install-shim", afile)
    assert r.exit_code == 2 and "is a file" in r.stderr        # a usage error, caught by click
    with pytest.raises(install.InstallError, match="exists and is not a directory"):
        install.install_shim(afile)
    r = ctl("install-shim", tmp_path / "no" / "such" / "dir")
    assert r.exit_code == 1 and "its parent directory does not exist" in r.stderr
    with pytest.raises(install.InstallError, match="cannot be named in ld.so.preload"):
        install.install_shim(tmp_path / "d", preload_file=True, container_path="relative/libvgpu.so")
