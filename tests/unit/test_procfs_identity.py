"""procfs.started_by: the one rule by which a recorded (pid, time) names a process."""
import subprocess

from tests.helpers.slots import boot_ticks
from tests.helpers.wait import wait_until
from vgpu import procfs


def test_a_record_names_the_process_at_its_pid_that_started_no_later():
    child = subprocess.Popen(["sleep", "600"])
    try:
        start = procfs.start_ticks(child.pid)
        assert wait_until(lambda: boot_ticks() > start, 5, every=0.002)
        later = boot_ticks()
        # its start, or any time it ran at: that process
        assert procfs.same_process(child.pid, start) and procfs.same_process(child.pid, later)
        assert procfs.owner(child.pid, later) == procfs.THERE
        # a time before it started: another's record (the pid's earlier owner)
        assert not procfs.same_process(child.pid, start - 1)
        assert procfs.owner(child.pid, start - 1) == procfs.REUSED
    finally:
        child.kill()
        child.wait(10)
    # no such process, no record
    assert not procfs.same_process(child.pid, later) and procfs.owner(child.pid, later) == procfs.GONE
    assert not procfs.started_by(start, 0) and not procfs.started_by(None, later)


def test_a_record_of_none_may_name_any_process_where_a_caller_accepts_it():
    assert procfs.may_have_started_by(5000, 0) and procfs.may_have_started_by(None, 0)
    assert procfs.may_have_started_by(5000, 5000) and procfs.may_have_started_by(5000, 5042)
    assert not procfs.may_have_started_by(5000, 4999) and not procfs.may_have_started_by(None, 5000)
