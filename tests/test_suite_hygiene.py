"""The suite's own guard (conftest.py): a process a test leaves running fails the run,
named with the test after which it was first seen, and is killed."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent

LEAKY = '''
import subprocess, sys

def test_tidy():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_leaves_a_daemon_behind():
    # double fork into a session of its own, as a daemon does: no longer this process's child
    subprocess.run([sys.executable, "-c", "import os, subprocess, sys; "
                    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
                    "start_new_session=True); print(p.pid)"], check=True, stdout=open("daemon.pid", "w"))

def test_after():
    pass
'''


def _pytest(directory):
    """pytest on `directory` alone, the repository on the path (the conftest imports tests.helpers)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(directory)],
                          capture_output=True, text=True, timeout=120, cwd=directory, env=env)


def test_a_process_left_running_fails_the_run_names_its_test_and_is_killed(tmp_path):
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    out = _pytest(tmp_path)
    pid = int((tmp_path / "daemon.pid").read_text())
    assert out.returncode != 0, out.stdout
    assert "3 passed, 1 error" in out.stdout, out.stdout
    assert re.search(rf"pid {pid} `\S*python\S* -c import time; time.sleep\(120\)`, first seen after "
                     rf"test_leaky.py::test_leaves_a_daemon_behind", out.stdout), out.stdout
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_tidy_run_passes(tmp_path):
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_tidy.py").write_text(LEAKY.split("def test_leaves")[0])
    out = _pytest(tmp_path)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout
