"""Shared fixtures: every test talks to simgpu from real child processes.

A process binds to one simgpu node (state directory) the first time it loads the
libraries, so tests never load libcuda / libnvidia-ml into the pytest process itself:
they run small programs (Python or C) with an environment pointing at a fresh node.
"""
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vgpu.paths import simgpu_dir

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
PROGRAMS = Path(__file__).resolve().parent / "programs"
# NVIDIA's libcudart 13.0 cuGetProcAddress requests, in call order (recorded data, copied
# from the project's shared fixtures so a clean clone has it).
CUDART13_REQUESTS = Path(__file__).resolve().parent / "fixtures" / "cudart13-getprocaddress.tsv"


def make_sim_env(state_dir, profile="a10", devices=1, **extra):
    env = dict(os.environ)
    for k in list(env):
        # CUDA_VISIBLE_DEVICES: simgpu's libcuda honours it, and a host's value names its real GPUs
        if k.startswith(("SIMGPU_", "VGPU_", "CUDA_DEVICE_")) or k == "CUDA_VISIBLE_DEVICES":
            del env[k]
    lib = str(simgpu_dir())
    env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    env["SIMGPU_STATE_DIR"] = str(state_dir)
    env["SIMGPU_PROFILE"] = profile
    env["SIMGPU_DEVICES"] = str(devices)
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture
def sim_env(tmp_path):
    """Environment for a child process on a fresh one-device A10 simgpu node."""
    return make_sim_env(tmp_path / "node")


def run_python(code, env, timeout=120, check=True, args=()):
    """Run `code` in a fresh interpreter; return the CompletedProcess."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\nstdout:\n{proc.stdout}\n"
                             f"stderr:\n{proc.stderr}")
    return proc


def start_python(code, env, args=()):
    """Start `code` in a fresh interpreter without waiting (stdin/stdout are pipes)."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


class JsonChild:
    """A long-running python child that answers each JSON command line on its stdin with
    one JSON line on its stdout (the workloads of the end-to-end tests)."""

    def __init__(self, code, env, what="child"):
        self.what = what
        self.proc = start_python(code, env)

    def read(self, timeout=30):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise AssertionError(f"{self.what} said nothing: {self.proc.stderr.read()}")
        return json.loads(line)

    def send(self, cmd, arg=0):
        self.proc.stdin.write(json.dumps([cmd, arg]) + "\n")
        self.proc.stdin.flush()

    def call(self, cmd, arg=0, timeout=30):
        self.send(cmd, arg)
        return self.read(timeout)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="session")
def c_program(tmp_path_factory):
    """Compile tests/programs/<name>.c (against csrc/ headers only) and return its path."""
    out_dir = tmp_path_factory.mktemp("programs")
    built = {}

    def build(name, extra_flags=()):
        if name not in built:
            exe = out_dir / name
            subprocess.run(["cc", "-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror",
                            "-I", str(CSRC), str(PROGRAMS / f"{name}.c"), "-o", str(exe),
                            *extra_flags, "-ldl", "-pthread"], check=True)
            built[name] = exe
        return built[name]

    return build


_STAGED_HOLDERS = []   # descriptors whose OFD locks keep staged slots alive


def write_usage_counters(directory, name, device=0, **counters):
    """Set a slice's usage counters on `device` as the shim does (atomic stores into the
    mapped file): lets controller tests stage any usage without a workload.  memory_current
    is not a field but the sum of the slots' charges: it is staged in the last slot, held
    (locked) by this test process as a live process would hold it, so reaping keeps it."""
    import fcntl
    import mmap
    import struct

    from vgpu._region import ffi, lib
    path = os.path.join(directory, name, "usage")
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, ffi.sizeof("struct vgpu_usage"))
    finally:
        os.close(fd)
    u = ffi.cast("struct vgpu_usage *", ffi.from_buffer(mm))
    for k, v in counters.items():
        if k == "memory_current":
            slot = lib.VGPU_MAX_PROCS - 1
            holder = os.open(path, os.O_RDWR)
            fcntl.fcntl(holder, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET,
                                                                (1 << 40) + slot, 1, 0))
            _STAGED_HOLDERS.append(holder)
            lib.vgpu_store_i32(ffi.addressof(u.procs[slot], "pid"), os.getpid())
            lib.vgpu_store_u64(ffi.addressof(u.charge[device], slot), v)
            u.slots_used = lib.VGPU_MAX_PROCS
        else:
            lib.vgpu_store_u64(ffi.addressof(u.devices[device], k), v)


# --- No process outlives the suite --------------------------------------------------------
# Every process a test starts carries RUN_MARK in its environment (children inherit it from
# this process's environment, and the helpers above copy os.environ), or is a descendant of
# this process; after each test the ones not seen before are noted with the test's id, and at
# the end of the session any still alive fails the run, naming the test, and is killed.
# Each pytest process (an xdist worker too) has a mark of its own.
RUN_MARK_VAR = "VGPU_TEST_RUN"
RUN_MARK = f"{os.getpid()}.{secrets.token_hex(4)}"
os.environ[RUN_MARK_VAR] = RUN_MARK
_first_seen = {}    # pid -> (start time, test id)


def _started_by_this_run():
    """{pid: (start time, command)} of the live (not zombie) processes carrying this run's
    mark in their environment, and of this process's descendants."""
    import psutil
    mark = f"{RUN_MARK_VAR}={RUN_MARK}".encode()
    pids = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        pids.add(int(entry.name))
            except OSError:
                pass
    try:
        pids.update(p.pid for p in psutil.Process().children(recursive=True))
    except psutil.Error:
        pass
    found = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                found[pid] = (p.create_time(), " ".join(p.cmdline())[:160] or p.name())
        except psutil.Error:
            pass
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield
    for pid, (started, _) in _started_by_this_run().items():
        if _first_seen.get(pid, (None,))[0] != started:
            _first_seen[pid] = (started, item.nodeid)


@pytest.fixture(scope="session", autouse=True)
def no_process_outlives_the_suite():
    yield
    left = _started_by_this_run()
    if not left:
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    lines = []
    for pid, (started, command) in sorted(left.items()):
        seen_started, test = _first_seen.get(pid, (None, "?"))
        lines.append(f"  pid {pid} `{command}`, first seen after "
                     f"{test if seen_started == started else 'the last test'}")
    raise AssertionError(f"{len(left)} process(es) the suite started outlived it (now killed):\n"
                         + "\n".join(lines))
