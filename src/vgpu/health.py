"""GPU health: XID errors and GPUs fallen off the bus, as NVML's event sets report them.

One table says what each XID means for new work on the GPU.  Its source is NVIDIA's Xid
catalog (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), column "Resolution
Bucket (Immediate Action)": where the catalog asks only to restart the application, the
GPU stays fit for new slices (the XID is logged and counted); where it asks to reset the
GPU or restart the node, the GPU is unhealthy until the agent restarts after that reset.
An XID the table does not name is taken as needing a reset, as NVIDIA's device plugin
does with every XID outside its short list of application errors (fail closed: a GPU is
left out of placement rather than handed a failing one).
"""
import collections
import threading
import time

from . import nvml
from .quantities import format_utc

# xid: (the catalog's description, its immediate action)
XIDS = {
    8: ("GPU stopped processing", "RESTART_APP"),
    13: ("Graphics Engine Exception", "RESTART_APP"),
    31: ("GPU memory page fault", "RESTART_APP"),
    43: ("GPU stopped processing", "RESTART_APP"),
    45: ("Preemptive cleanup, due to previous errors", "RESTART_APP"),
    48: ("Double Bit ECC Error", "RESET_GPU"),
    68: ("NVDEC0 Exception", "RESTART_APP"),
    74: ("NVLINK Error", "RESET_GPU"),
    79: ("GPU has fallen off the bus", "RESTART_BM"),
    94: ("Contained ECC error", "RESTART_APP"),
    95: ("Uncontained ECC error", "RESET_GPU"),
    109: ("Context Switch Timeout Error", "RESTART_APP"),
    119: ("GSP RPC Timeout", "RESET_GPU"),
    120: ("GSP Error", "RESET_GPU"),
}
APPLICATION_ONLY = "RESTART_APP"


def meaning(xid) -> tuple:
    """(description, immediate action, fatal: the GPU should take no new work)."""
    what, action = XIDS.get(xid, ("not in vgpu's table", "RESET_GPU"))
    return what, action, action != APPLICATION_ONLY


class GpuHealth:
    __slots__ = ("index", "healthy", "reason", "since", "xids")

    def __init__(self, index):
        self.index, self.healthy, self.reason, self.since = index, True, None, None
        self.xids = collections.Counter()     # xid -> how many seen

    def to_json(self):
        return {"index": self.index, "healthy": self.healthy, "reason": self.reason,
                "since": format_utc(self.since) if self.since else None,
                "xids": {str(x): n for x, n in sorted(self.xids.items())}}


class Watcher(threading.Thread):
    """Waits on NVML's XID events for every GPU (and notices GPUs that fall off the bus);
    `gpus()` is each GPU's health, `on_event(kind, GpuHealth, xid)` is called for every
    XID ("xid"), every GPU that turns unhealthy ("unhealthy") and once when there is no
    event set to wait on ("unavailable", None, None).  Without NVML event
    sets it says so once (`unavailable`) and every GPU stays as it was last seen."""
    WAIT_S = 0.2

    def __init__(self, on_event=lambda kind, gpu, xid: None):
        super().__init__(name="vgpu-health", daemon=True)
        self.on_event = on_event
        self.lock = threading.Lock()
        self._gpus = {}
        self.unavailable = None
        self.halt = threading.Event()
        self.ready = threading.Event()    # the event set is registered (or cannot be)

    def gpus(self) -> dict:
        with self.lock:
            return {i: g.to_json() for i, g in sorted(self._gpus.items())}

    def _gpu(self, index):
        g = self._gpus.get(index)
        if g is None:
            g = self._gpus[index] = GpuHealth(index)
        return g

    def _unhealthy(self, index, reason):
        with self.lock:
            g = self._gpu(index)
            if not g.healthy:
                return
            g.healthy, g.reason, g.since = False, reason, time.time()
        self.on_event("unhealthy", g, None)

    def _xid(self, index, xid):
        what, action, fatal = meaning(xid)
        with self.lock:
            g = self._gpu(index)
            g.xids[xid] += 1
        self.on_event("xid", g, xid)
        if fatal:
            self._unhealthy(index, f"XID {xid}: {what} (NVIDIA's action: {action})")

    def _look_for_lost(self):
        try:
            lost = nvml.lost_gpus()
        except nvml.NvmlUnavailable:
            return {}
        for i, why in lost.items():
            self._unhealthy(i, f"unreachable: {why}")
        return lost

    def run(self):
        try:
            events = nvml.XidEvents()
        except (nvml.NvmlUnavailable, Exception) as e:   # (an NVML without event sets: AttributeError)
            self.unavailable = str(e) or type(e).__name__
            self.ready.set()
            self.on_event("unavailable", None, None)
            return
        with self.lock:
            for i in range(nvml.device_count()):
                self._gpu(i)
        self._look_for_lost()
        self.ready.set()
        try:
            while not self.halt.is_set():
                got = events.wait(self.WAIT_S)
                if got is None:
                    continue
                kind, index, xid = got
                if kind == "xid" and index is not None:
                    self._xid(index, xid)
                elif kind == "lost":
                    self._look_for_lost()
                    # (a set keeps answering GPU_IS_LOST: a new one over the GPUs still there)
                    events.close()
                    events = nvml.XidEvents()
        finally:
            events.close()

    def stop(self):
        self.halt.set()
