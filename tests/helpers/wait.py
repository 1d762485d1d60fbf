"""Waiting for something to hold: the suite's one polling loop."""
import time
from pathlib import Path


def wait_until(predicate, timeout, what=None, every=0.02):
    """Call predicate() every `every` seconds until it returns something true, and return
    that.  Past `timeout` seconds (it is always called once more at the deadline): with
    `what` (what is waited for), fail naming it; without, return the last, false, value for
    the caller's assert to report in its own words."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            break
        time.sleep(every)
    if not value and what is not None:
        raise AssertionError(f"not within {timeout} s: {what}")
    return value


def process_state(pid):
    """The state letter /proc gives `pid` (R, S, T, Z, ...), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def wait_gone(pid, timeout=10.0):
    """Until `pid` has exited (gone, or a zombie: its descriptors are closed either way)."""
    wait_until(lambda: process_state(pid) in (None, "Z"), timeout, f"pid {pid} to exit")
