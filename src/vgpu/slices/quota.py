"""The quota file as data: what a slice may use on each device, and its bytes."""
from dataclasses import asdict, dataclass


from ..errors import InvalidRequest
from .._region import ffi, lib
from ..quantities import SHARE_FULL, UNLIMITED
from .files import BURST, CEILING, MAX_DEVICES, QUOTA_SIZE, SM_MODES


# === the quota, as data ===

@dataclass(frozen=True)
class DeviceQuota:
    """One device of a slice.  Memory in bytes (UNLIMITED: no cap), SM in 1/100 percent."""
    memory_max: int = UNLIMITED
    memory_request: int = UNLIMITED
    memory_limit: int = UNLIMITED
    sm_max: int = SHARE_FULL
    sm_request: int = SHARE_FULL
    sm_limit: int = SHARE_FULL

    @property
    def held(self) -> bool:
        """Devices a slice was not given are in its quota with everything 0 (denied)."""
        return self.memory_max > 0 or self.sm_max > 0

    @property
    def guaranteed_memory(self) -> int:
        """What the slice is promised on the device: its request (never above its cap);
        a slice without a cap and without a request is best effort (0)."""
        g = min(self.memory_request, self.memory_max)
        return 0 if g == UNLIMITED else g

    def to_json(self) -> dict:
        return {k: (None if k.startswith("memory") and v == UNLIMITED else v) for k, v in asdict(self).items()}


DENIED = DeviceQuota(0, 0, 0, 0, 0, 0)


@dataclass(frozen=True)
class Owner:
    """Who made a temporary slice (`vgpu-ctl run`): a pid in pid namespace `pid_ns`, and
    its start time (clock ticks after boot), so a reused pid is not taken for it."""
    pid: int
    start_ticks: int
    pid_ns: int


@dataclass(frozen=True)
class Quota:
    name: str
    generation: int
    device_count: int
    devices: tuple    # DeviceQuota per index < device_count
    temporary: Owner = None   # set on a slice `vgpu-ctl run` made for one command
    sm_mode: str = BURST      # BURST: guaranteed sm.request, idle time lent up to sm.max; CEILING: sm.max

    def held(self) -> list:
        return [d for d, q in enumerate(self.devices) if q.held]

    def guaranteed_sm(self, d) -> int:
        """The SM share device d promises when every slice wants its own: burst, sm.request
        (idle time above it is lent, up to sm.max); ceiling, sm.max."""
        q = self.devices[d]
        return q.sm_max if self.sm_mode == CEILING else min(q.sm_request, q.sm_max)

    def to_json(self) -> dict:
        return {"name": self.name, "generation": self.generation, "device_count": self.device_count,
                "sm_mode": self.sm_mode, "devices": [{"index": d, **self.devices[d].to_json()} for d in self.held()]}


def _quota_from(q) -> Quota:
    n = min(q.device_count, MAX_DEVICES)
    devs = tuple(DeviceQuota(q.devices[d].memory_max, q.devices[d].memory_request, q.devices[d].memory_limit,
                             q.devices[d].sm_max, q.devices[d].sm_request, q.devices[d].sm_limit)
                 for d in range(n))
    owner = Owner(q.owner_pid, q.owner_start, q.owner_pid_ns) if q.flags & lib.VGPU_QUOTA_TEMPORARY else None
    return Quota(ffi.string(q.name).decode(errors="replace"), q.generation, q.device_count, devs, owner,
                 CEILING if q.flags & lib.VGPU_QUOTA_SM_CEILING else BURST)


def _fill_device(qd, dq: DeviceQuota):
    for field in ("memory_max", "memory_request", "memory_limit"):
        lib.vgpu_store_u64(ffi.addressof(qd, field), getattr(dq, field))
    for field in ("sm_max", "sm_request", "sm_limit"):
        lib.vgpu_store_u32(ffi.addressof(qd, field), getattr(dq, field))


def check_sm_mode(mode) -> str:
    if mode not in SM_MODES:
        raise InvalidRequest(f"SM mode {mode!r} is not one of {', '.join(SM_MODES)}",
                             "pass --sm-mode burst (lend idle time up to --sm) or ceiling (never above --sm)")
    return mode


def quota_bytes(name: str, devices: dict, temporary: Owner = None, sm_mode: str = None,
                context_overhead: dict = None) -> bytes:
    """A new quota file: `devices` maps index -> DeviceQuota; indices below the highest one
    that are not in it are denied, and the shim denies every index >= device_count.
    context_overhead: {index: bytes} a context costs there, as measured on the node (the
    shim charges it at a process's first allocation without asking NVML)."""
    q = ffi.new("struct vgpu_quota *")
    q.magic, q.abi_version, q.size = lib.VGPU_QUOTA_MAGIC, lib.VGPU_ABI_VERSION, QUOTA_SIZE
    q.generation = 2
    if check_sm_mode(sm_mode or BURST) == CEILING:
        q.flags |= lib.VGPU_QUOTA_SM_CEILING
    if temporary is not None:
        q.flags |= lib.VGPU_QUOTA_TEMPORARY
        q.owner_pid, q.owner_start, q.owner_pid_ns = temporary.pid, temporary.start_ticks, temporary.pid_ns
    q.device_count = max(devices) + 1
    q.name = name.encode()
    for d in range(q.device_count):
        _fill_device(q.devices[d], devices.get(d, DENIED))
        if d in devices and (context_overhead or {}).get(d):
            q.devices[d].context_overhead = context_overhead[d]
    return bytes(ffi.buffer(q))
