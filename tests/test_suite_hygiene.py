"""The suite's own guard (conftest.py): a process a test leaves running fails the run,
named with the test after which it was first seen, and is killed."""
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


def _copy_conftest(to):
    """The suite's conftest.py, with the harness it imports (helpers/)."""
    shutil.copy(HERE / "conftest.py", to / "conftest.py")
    shutil.copytree(HERE / "helpers", to / "helpers", ignore=shutil.ignore_patterns("__pycache__"))


def test_a_process_left_running_fails_the_run_names_its_test_and_is_killed(tmp_path):
    _copy_conftest(tmp_path)
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    pid = int((tmp_path / "daemon.pid").read_text())
    assert out.returncode != 0, out.stdout
    assert "3 passed, 1 error" in out.stdout, out.stdout
    assert re.search(rf"pid {pid} `\S*python\S* -c import time; time.sleep\(120\)`, first seen after "
                     rf"test_leaky.py::test_leaves_a_daemon_behind", out.stdout), out.stdout
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_tidy_run_passes(tmp_path):
    _copy_conftest(tmp_path)
    (tmp_path / "test_tidy.py").write_text(LEAKY.split("def test_leaves")[0])
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout
