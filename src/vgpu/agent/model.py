"""What one look at the node is made of: processes, their attribution, places, rows, slices."""
import os
from dataclasses import dataclass, field
from typing import NamedTuple

from .. import procfs
from ..quantities import UNLIMITED
from .settings import CERTAIN


# === processes, as the kernel knows them ===

class Tracked:
    """A process NVML lists (or a slot's process in our pid namespace), with what the
    kernel says of it, kept for its life (the pidfd says when it ends)."""
    __slots__ = ("pid", "start", "pid_ns", "mnt_ns", "inner", "cgroup", "pidfd", "usage", "usage_at",
                 "identity", "maps_ok", "comm", "visible", "charged")

    def __init__(self, pid):
        self.pid = pid
        self.pidfd = None
        self.charged = set()     # devices its slot was seen charging on
        self.visible = False     # a process this namespace can see (and read): start is not None
        self.start = procfs.start_ticks(pid)
        if self.start is None:
            return
        try:
            self.pidfd = os.pidfd_open(pid)
        except OSError:
            self.start = None
            return
        if procfs.start_ticks(pid) != self.start:     # the pid was reused between the two reads
            self.close()
            self.start = None
            return
        self.visible = True
        self.pid_ns = procfs.pid_ns(pid)
        self.mnt_ns = procfs.mnt_ns(pid)
        self.inner = procfs.inner_pid(pid)
        self.cgroup = procfs.cgroup(pid)
        self.comm = procfs.comm(pid)
        self.usage = None        # frozenset of slice names whose usage file it maps; None: not looked yet
        self.usage_at = None
        self.identity = None
        self.maps_ok = False

    def close(self):
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


@dataclass
class Attribution:
    slice: str = None
    method: str = None       # usage-file, identity-file, pod, cgroup, pid-namespace, held-slot; None: unsliced/unknown
    state: str = "unsliced"  # sliced, unsliced, unknown, ambiguous
    note: str = None
    candidates: tuple = ()
    reused: bool = False     # its pid was an ended process's, whose memory a held slot still charges

    @property
    def certain(self):
        return self.state == "sliced" and self.method in CERTAIN or self.state == "unsliced"

    def to_json(self):
        out = {"state": self.state, "slice": self.slice, "method": self.method}
        if self.note:
            out["note"] = self.note
        if self.candidates:
            out["candidates"] = list(self.candidates)
        return out


# === where NVML lists a process ===

class Place(NamedTuple):
    """A device NVML lists processes on: a whole GPU (its NVML index), or a MIG device on a
    GPU in MIG mode (its UUID, GPU instance and compute instance IDs).  `label` is how the
    agent names it in status, JSON and metrics: "1" for GPU 1, "1/mig-2-0" for compute
    instance 0 of GPU instance 2 on GPU 1 (the GI and CI columns of nvidia-smi)."""
    gpu: int
    mig: str = None
    gi: int = None
    ci: int = None

    @property
    def label(self) -> str:
        return str(self.gpu) if self.mig is None else f"{self.gpu}/mig-{self.gi}-{self.ci}"

    @property
    def device(self):
        """As a process row's `device`: the GPU's index (an int) or the MIG label."""
        return self.gpu if self.mig is None else self.label


def json_device(device):
    """A device as JSON names it (docs/design.md "Logs and JSON"): `device` is always an index
    (a GPU's, or a slice's own), never a MIG label; where NVML lists it is `nvml_device`."""
    if isinstance(device, str):
        head = device.split("/", 1)[0]
        return int(head) if head.isdigit() else None
    return device


def record_place(record, listed=None) -> Place:
    """A MIG slice's instance (its quota's device 0): as NVML lists it now (`listed`:
    {MIG UUID: Place}; by UUID only: a GPU instance ID is reused by the next instance made
    at that placement), else as its record says (then NVML does not list it)."""
    record = record or {}
    uuid = record.get("uuid")
    if listed and uuid in listed:
        return listed[uuid]
    try:
        gpu = int(record.get("device"))
    except (TypeError, ValueError):
        gpu = -1
    return Place(gpu, str(uuid or "MIG-?"), record.get("gpu_instance"), record.get("compute_instance"))


# === the snapshot ===

@dataclass
class ProcRow:
    host_pid: int
    device: object           # Place.device: the GPU's index, or the MIG device's label
    driver: int              # bytes NVML says it holds there (None: not said)
    util: int                # SM percent NVML gives it over the last second (None: it cannot say, MIG)
    attribution: Attribution
    slot: int = None         # its slot in the slice's usage file, when one is its own
    charge: int = None       # what that slot charges on the device
    comm: str = None
    context: bool = False    # a context and nothing charged yet (Settings.context_allowance)
    place: Place = None
    other_slots: tuple = ()   # slots besides its own counted in `charge`: what it exported (shared
                              # slots), and its pid's earlier process's in its slice (pid reuse)

    @property
    def gap(self):
        if self.driver is None:
            return None
        return 0 if self.context else self.driver - (self.charge or 0)

    def to_json(self):
        out = {"host_pid": self.host_pid, "device": json_device(self.device), "memory_driver": self.driver,
               "sm_util": self.util * 100 if self.util is not None else None, "slot": self.slot,
               "memory_charged": self.charge, "context_only": self.context, "comm": self.comm,
               **self.attribution.to_json()}
        if self.place is not None:
            out["nvml_device"] = self.place.label
            if self.place.mig is not None:
                out["mig_uuid"] = self.place.mig
        return out


class SliceDevice:
    """One slice on one device: the shim's figure (memory.current, the sum of the slots'
    charges), the driver's (the sum of its processes' memory; None: unknown), the cap."""
    __slots__ = ("name", "device", "memory_max", "memory_current", "driver", "sm_max", "sm_nvml", "gpu_time_ns",
                 "settings", "processes", "shared", "context", "place")

    def __init__(self, name, device, memory_max, memory_current, driver, sm_max, sm_nvml, gpu_time_ns, settings,
                 shared=False, place=None):
        self.name, self.device, self.memory_max, self.memory_current = name, device, memory_max, memory_current
        self.driver, self.sm_max, self.sm_nvml, self.gpu_time_ns = driver, sm_max, sm_nvml, gpu_time_ns
        self.settings = settings
        self.processes = []
        self.shared = shared     # may be kept for the next look while the slice stays idle: never changed
        self.context = 0         # the driver's figure of its processes that have only a context yet
        self.place = place       # where NVML lists the device (a MIG slice's device 0: its MIG device)

    def copy(self):
        return SliceDevice(self.name, self.device, self.memory_max, self.memory_current, self.driver, self.sm_max,
                           self.sm_nvml, self.gpu_time_ns, self.settings, place=self.place)

    @property
    def tolerance(self):
        return self.settings.tolerance_for(self.memory_max, len(self.processes))

    def to_json(self):
        return {"slice": self.name, "device": json_device(self.device),
                "memory_max": None if self.memory_max == UNLIMITED
                else self.memory_max, "memory_current": self.memory_current, "memory_driver": self.driver,
                "tolerance": self.tolerance, "sm_max": self.sm_max, "sm_nvml": self.sm_nvml,
                "processes": [p.host_pid for p in self.processes],
                "nvml_device": self.place.label if self.place is not None else None,
                "mig_uuid": self.place.mig if self.place is not None else None}


@dataclass
class Snapshot:
    t: float
    nvml_ok: bool
    nvml_note: str
    device_errors: dict                   # Place.device -> why NVML could not say
    slices: dict                          # (name, quota device) -> SliceDevice (a place the slice was not
                                          # given: (name, GPU index) for a software slice, else (name, label))
    processes: list                       # ProcRow of every process NVML lists, every device
    slots: dict                           # name -> [usage.Proc]
    problems: dict                        # name -> why its files cannot be read
    dead: list = field(default_factory=list)   # slices with a slot whose process is gone
    active: dict = field(default_factory=dict)  # the SliceDevices with processes on the GPU
    places: list = field(default_factory=list)  # the devices NVML answered for (GPUs, MIG devices)

    def unsliced(self):
        return [p for p in self.processes if p.attribution.state in ("unsliced", "ambiguous")]

    def unknown(self):
        return [p for p in self.processes if p.attribution.state == "unknown"]

    def to_json(self):
        return {"nvml": {"available": self.nvml_ok, "note": self.nvml_note,
                         "device_errors": {str(d): e for d, e in self.device_errors.items()}},
                "slices": [sd.to_json() for sd in self.slices.values()],
                "processes": [p.to_json() for p in self.processes],
                "problems": self.problems}
