"""One picture of a node's slices, which `vgpu-ctl status` (and through it the DRA
driver's claim status) and the metrics both render: per slice and device, what it holds
(its quota), uses (its usage file's counters, SM use over the interval between two
looks), is guaranteed and allowed now (the share board), and who holds its memory cap;
per device, the totals.  Each figure is worked out here once.

The autoscaler reads the same files through the same NodeReader, but keeps windows of
samples for its decisions rather than a picture; it does not render one.
"""
from dataclasses import dataclass, field

from . import board, driverlimits, nvml, procfs
from .quantities import SHARE_FULL, UNLIMITED
from .slices import MAX_DEVICES
from .slices.usage import COUNTERS

def shown_devices(quota, usage, nvml_count):
    """The devices a slice's rows cover: those it holds.  A quota made by a standalone
    shim holds all 16 indices: then the ones that exist (or, without NVML to say, the
    ones in use, or device 0)."""
    held = quota.held()
    if len(held) < MAX_DEVICES:
        return held
    if nvml_count is not None:
        return held[:nvml_count]
    return [d for d in held if usage and usage.devices[d]["memory_current"]] or [0]


class SmUse:
    """SM use of each (slice, device) between two looks.  From the usage file's GPU-time
    counter where the shim keeps it (paced launches: sm.max below 100%, the same share at
    both looks, or the rate would judge one share by another); else from NVML's
    per-process utilization of the slice's processes (none on a MIG device, as nvml.h
    says); None where neither can say.  Keep one per renderer: it remembers the last look."""

    def __init__(self):
        self._last = {}     # (slice, device) -> (monotonic s, gpu_time_ns, throttled_ns, sm_max)

    def measure(self, name, d, now, counters, sm_max, from_nvml):
        """(SM use in SHARE_FULL units or None, "usage" / "nvml" / None, ns waited per second
        of the interval or None).  `from_nvml()`: the NVML figure in SHARE_FULL units, or None."""
        last = self._last.get((name, d))
        used, source, throttled = None, None, None
        if last is not None and now > last[0]:
            # waited per second of the interval (several processes can wait at once)
            throttled = round(max(counters["throttled_ns"] - last[2], 0) / (now - last[0]))
            if sm_max < SHARE_FULL and last[3] == sm_max:
                used, source = round(max(counters["gpu_time_ns"] - last[1], 0) / ((now - last[0]) * 1e9) * SHARE_FULL), \
                    "usage"
        self._last[(name, d)] = (now, counters["gpu_time_ns"], counters["throttled_ns"], sm_max)
        if used is None:
            used = from_nvml()
            source = None if used is None else "nvml"
        return used, source, throttled

    def keep_only(self, names):
        """Forget slices that are gone."""
        self._last = {k: v for k, v in self._last.items() if k[0] in names}


@dataclass
class DeviceFigures:
    index: int
    quota: object                  # the slice's DeviceQuota on this device
    counters: dict                 # its usage counters (zeros without a usage file); None: unreadable
    sm_used: int = None            # SHARE_FULL units, over the interval
    sm_used_source: str = None     # "usage" or "nvml"
    throttled_ns_per_s: int = None
    sm_guaranteed: int = 0         # what it gets when every slice wants its own (burst: sm.request)
    sm_allowance: int = None       # what its launches are paced at now (the share board)


@dataclass
class SliceFigures:
    name: str
    problem: str = None            # why its files could not be read (nothing else is then known)
    quota: object = None
    usage: object = None
    mig: bool = False              # a MIG slice: its device 0 is its MIG instance, not GPU 0
    memory_layer: tuple = ("shim", None)   # who holds its memory cap, and why not the driver too
    devices: list = field(default_factory=list)
    _hosts: dict = None

    def host_pids(self) -> dict:
        """{pid in the slice: host pid} of its processes (looked up once)."""
        if self._hosts is None:
            self._hosts = procfs.host_pids(self.usage) if self.usage else {}
        return self._hosts


@dataclass
class Totals:
    """What is handed out on one device (a GPU, or a MIG instance where a renderer counts
    them apart)."""
    memory_allocated: int = 0      # the sum of the memory caps
    memory_unlimited: int = 0      # slices with no cap there
    memory_guaranteed: int = 0
    memory_in_use: int = 0
    sm_allocated: int = 0          # the sum of sm.max
    sm_guaranteed: int = 0
    slices: int = 0

    @property
    def sm_ceilings(self) -> bool:
        """Guarantees adding up past the device: what each slice gets is then at most its share."""
        return self.sm_guaranteed > SHARE_FULL


class Snapshot:
    """One look at a node's slices.  `entries`: (name, Quota or None, Usage or None,
    problem or None, is MIG) for each slice, read by the caller its own way (status once,
    the metrics through their NodeReader).  `cgroups`: {slice: its container's cgroup}
    where the node agent found one (the memory layer is read there)."""

    def __init__(self, directory, entries, sm_use: SmUse, now, use_nvml=True, cgroups=None):
        self.directory = directory
        self.nvml_ok, self.nvml_note = nvml.available() if use_nvml else (False, "NVML not used")
        self.nv_devices = None
        if self.nvml_ok:
            try:
                self.nv_devices = nvml.devices()
            except Exception:   # a driver going away mid-look: what the files say
                self.nvml_ok, self.nvml_note = False, "NVML stopped answering"
        self._util = {}
        shares = board.read(directory)   # what each slice's shim paces at now (burst: guarantee..ceiling)
        nvml_count = len(self.nv_devices) if self.nv_devices is not None else None
        self.slices = []
        for name, quota, usage, problem, is_mig in entries:
            s = SliceFigures(name, problem, quota, usage, is_mig)
            self.slices.append(s)
            if quota is None:
                continue
            if self.nvml_ok:
                caps = {d: hard for d, (_, hard) in driverlimits.for_quota(quota).items()}
                s.memory_layer = driverlimits.layer(directory, name, caps, is_mig, cgroup=(cgroups or {}).get(name))
            else:
                s.memory_layer = ("shim", "NVML unavailable")
            on_board = shares.get(board.slice_key(name), [])
            for d in shown_devices(quota, usage, nvml_count):
                # no usage file yet: nothing used; one that cannot be read: no counters rather than wrong ones
                counters = usage.devices[d] if usage else None if problem else dict.fromkeys(COUNTERS, 0)
                q = quota.devices[d]
                used, source, throttled = (None, None, None) if counters is None else sm_use.measure(
                    name, d, now, counters, q.sm_max, lambda: self._nvml_use(s, d))
                s.devices.append(DeviceFigures(d, q, counters, used, source, throttled, quota.guaranteed_sm(d),
                                               board.allowance(on_board, self.nv_devices, d, is_mig)))
        sm_use.keep_only({s.name for s in self.slices})

    def process_utilization(self, d) -> dict:
        """{host pid: percent} on GPU d over the last second (NVML; asked once per look)."""
        if d not in self._util:
            self._util[d] = nvml.process_utilization(d) if self.nvml_ok else {}
        return self._util[d]

    def _nvml_use(self, s, d):
        if not self.nvml_ok or s.mig or s.usage is None:
            return None
        hosts = s.host_pids()
        util = self.process_utilization(d)
        return sum(util.get(hosts.get(p.pid), 0) for p in s.usage.procs if p.alive) * 100

    def totals(self, key) -> dict:
        """{device key: Totals}; `key(slice, device figures)` names the device a row counts
        on, or None for a row counted nowhere."""
        out = {}
        for s in self.slices:
            for f in s.devices:
                k = key(s, f)
                if k is None:
                    continue
                t = out.setdefault(k, Totals())
                q = f.quota
                if q.memory_max == UNLIMITED:
                    t.memory_unlimited += 1
                else:
                    t.memory_allocated += q.memory_max
                t.memory_guaranteed += q.guaranteed_memory
                t.memory_in_use += f.counters["memory_current"] if f.counters else 0
                t.sm_allocated += q.sm_max
                t.sm_guaranteed += f.sm_guaranteed
                t.slices += 1
        return out
