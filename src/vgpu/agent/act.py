"""Acting: holding compute hogs to their share from outside."""
import os
import signal
import threading
import time

from .. import procfs
from ..quantities import SHARE_FULL


# === acting ===

def _signal(pidfd, sig):
    signal.pidfd_send_signal(pidfd, sig)


class Holder(threading.Thread):
    """`stop`: duty-cycles compute hogs from outside, SIGSTOP/SIGCONT, to their share.
    Every PERIOD each held group runs for duty x PERIOD and is stopped for the rest; the
    agent moves each duty every interval toward the share NVML measures.  Processes are
    always continued when released and when the agent stops."""
    PERIOD = 0.1
    GAIN = 0.8

    def __init__(self, log):
        super().__init__(name="vgpu-holder", daemon=True)
        self.log = log
        self.groups = {}         # key -> {"pidfds": {pid: (pidfd, start)}, "duty", "target", "full_since"}
        self.lock = threading.Lock()
        self.halt = threading.Event()

    def hold(self, key, procs, target, measured):
        """Hold `procs` [(pid, start)] to `target` (1/100 percent of the GPU)."""
        with self.lock:
            g = self.groups.get(key)
            if g is None:
                g = self.groups[key] = {"pidfds": {}, "duty": max(0.05, min(1.0, target / max(measured, 1))),
                                        "target": target, "full_since": None}
            for pid, start in procs:
                if pid in g["pidfds"]:
                    continue
                try:
                    fd = os.pidfd_open(pid)
                except OSError:
                    continue
                if procfs.start_ticks(pid) != start:
                    os.close(fd)
                    continue
                g["pidfds"][pid] = (fd, start)
            g["target"] = target

    def steer(self, key, measured, now):
        """Move a group's duty toward its target from its share NVML measured; True while
        it still needs holding (released after a whole window at full duty)."""
        with self.lock:
            g = self.groups.get(key)
            if g is None:
                return False
            err = (g["target"] - measured) / SHARE_FULL
            g["duty"] = min(1.0, max(0.02, g["duty"] + self.GAIN * err))
            g["full_since"] = (g["full_since"] or now) if g["duty"] >= 1.0 else None
            return True

    def held_pids(self):
        with self.lock:
            return [(pid, start) for g in self.groups.values() for pid, (_, start) in g["pidfds"].items()]

    def release(self, key):
        with self.lock:   # (the thread signals under it too: no SIGSTOP of its can follow this SIGCONT)
            g = self.groups.pop(key, None)
            for fd, _ in (g["pidfds"].values() if g else ()):
                try:
                    _signal(fd, signal.SIGCONT)
                except OSError:
                    pass
                os.close(fd)

    def release_all(self):
        for key in list(self.groups):
            self.release(key)

    def stop(self):
        """End the thread, then continue every held process.  (The thread's plan for a period
        holds the descriptors it read at its start: before its signals were sent under the
        lock, and only to processes still held, a SIGSTOP of its could follow a release's
        SIGCONT, and a hog stayed stopped after the agent had gone: a CI run saw it at 0%.)"""
        self.halt.set()
        if self.is_alive():
            self.join()
        self.release_all()

    def _signal_held(self, fds, sig):
        """Signal those of `fds` still held (a group released meanwhile is not: its
        descriptors are closed), under the lock."""
        with self.lock:
            held = {fd for g in self.groups.values() for fd, _ in g["pidfds"].values()}
            for fd in fds:
                if fd in held:
                    try:
                        _signal(fd, sig)
                    except OSError:
                        pass

    def run(self):
        while not self.halt.is_set():
            t0 = time.monotonic()
            with self.lock:
                plan = sorted((g["duty"], list(g["pidfds"].values())) for g in self.groups.values())
            if not plan:
                self.halt.wait(self.PERIOD)
                continue
            self._signal_held([fd for _, fds in plan for fd, _ in fds], signal.SIGCONT)
            for duty, fds in plan:
                if duty >= 1.0:
                    continue
                if self.halt.wait(max(0.0, t0 + duty * self.PERIOD - time.monotonic())):
                    break                 # stopping: no more SIGSTOP
                self._signal_held([fd for fd, _ in fds], signal.SIGSTOP)
            self.halt.wait(max(0.0, t0 + self.PERIOD - time.monotonic()))
        self.release_all()
