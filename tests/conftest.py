"""Shared fixtures (pytest finds them here) and the suite's guard.  The harness the tests
import -- the simulated node, JSON-lines children, waiting, the Kubernetes stand-ins -- is
in tests/helpers/ (see its __init__.py).
"""
import os
import secrets
import signal
import subprocess

import pytest

from tests.helpers.paths import CSRC, PROGRAMS
from tests.helpers.simnode import make_sim_env


@pytest.fixture
def sim_env(tmp_path):
    """Environment for a child process on a fresh one-device A10 simgpu node."""
    return make_sim_env(tmp_path / "node")


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


# --- No process outlives the suite --------------------------------------------------------
# Every process a test starts carries RUN_MARK in its environment (children inherit it from
# this process's environment, and tests.helpers.simnode copies os.environ), or is a descendant of
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
