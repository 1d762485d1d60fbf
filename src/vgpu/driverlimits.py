"""The driver layer of a slice's memory cap: NVIDIA's per-cgroup device memory limits.

The shim caps what its program allocates through it; a process that bypasses it (a static
binary, raw ioctls, LD_PRELOAD unset) is capped by nothing but this.  Drivers with
`nvmlDeviceSetMemoryLimits_v1` (nvml.h of CUDA 13.5) hold every allocation of the
processes in a cgroup (and the cgroups below it) to a hard limit, with a soft limit they
are guaranteed under pressure.  A slice whose processes live in a cgroup of their own gets
one per device it holds: hard = its memory.max, soft = its memory request.

Which layer holds a slice (`layer`): "driver+shim" when every device of its cgroup carries
the limit, else "shim", with why not the driver: the driver has no such limits, a MIG
slice (MIG handles take none), no cgroup of its own, no permission (root only), NVML
unavailable.  That is failing open to the shim alone, which still caps every program that
goes through it; the caller logs it once per slice.

`vgpu-ctl run` makes the cgroup itself: `<cgroup v2 root>/vgpu/<node id>/<slice>` (the node
id: a hash of the node directory's path), with the command
in it from its first instruction (SLICE_PARENT).  Removing the cgroup clears its limits
(the driver forgets them), and `clear` does so explicitly first.
"""
import os
from pathlib import Path

from . import nvml

SLICE_PARENT = "vgpu"          # run's cgroups: <cgroup v2 root>/vgpu/<node id>/<slice name>
LIMIT_MAX = 0xFFFFFFFFFFFFFFFF  # NVML_DEVICE_MEMORY_LIMIT_MAX: no hard limit


class Unavailable(Exception):
    """The driver layer cannot hold this slice; str() says why, in a few words."""


class NoDriver(Unavailable):
    """No NVIDIA driver to ask here (NVML cannot be loaded): nothing to fall back from."""


def cgroup2_root():
    """Where cgroup v2 is mounted (the unified hierarchy), None when it is not."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if " - cgroup2 " in line and len(fields) > 4 and fields[3] == "/":
            return Path(fields[4])
    return None


def _node_parent(directory):
    """The node directory's own cgroup parent, <root>/vgpu/<node id>: slices of two node
    directories on one host (tests, a second vgpu-ctl setup) never share a cgroup."""
    import hashlib
    from . import slices
    root = cgroup2_root()
    if root is None:
        return None
    node = os.path.realpath(slices.node_dir(directory))
    return root / SLICE_PARENT / hashlib.sha256(node.encode()).hexdigest()[:12]


def slice_cgroup(directory, name):
    """The cgroup `vgpu-ctl run` makes for slice `name` (None without cgroup v2)."""
    parent = _node_parent(directory)
    return parent / name if parent else None


def make_slice_cgroup(directory, name) -> Path:
    """Make run's cgroup for slice `name`; Unavailable when there can be none."""
    path = slice_cgroup(directory, name)
    if path is None:
        raise Unavailable("no cgroup v2 hierarchy on this host")
    for attempt in (1, 2):   # (a release of this node's last cgroup may remove the parent meanwhile)
        try:
            path.mkdir(parents=True, exist_ok=True)
            return path
        except FileNotFoundError:
            if attempt == 2:
                raise Unavailable(f"cannot make cgroup {path}: its parent keeps going away") from None
        except OSError as e:
            raise Unavailable(f"cannot make cgroup {path}: {e.strerror}") from None


def remove_cgroup(path):
    """Remove a cgroup made by make_slice_cgroup (its processes gone), and its node's parent
    once that holds no other, quietly."""
    for p in (path, os.path.dirname(path)):
        try:
            os.rmdir(p)
        except OSError:
            return


def tidy(directory, grace=60.0):
    """Remove run cgroups that a killed `vgpu-ctl run` left: those of this node directory
    whose slice is gone and that are older than `grace` seconds (a run between making its
    cgroup and its command joining it is never touched).  rmdir succeeds only once no
    process is left in one; the driver forgets a removed cgroup's limits."""
    import time
    from . import slices
    parent = _node_parent(directory)
    if parent is None or not parent.is_dir():
        return
    try:
        names = set(slices.list_names(directory))
    except slices.VgpuError:
        return
    for path in parent.iterdir():
        try:
            if path.is_dir() and path.name not in names and time.time() - path.stat().st_mtime > grace:
                remove_cgroup(path)
        except OSError:
            continue


def join_cgroup(path):
    """Move the calling process into cgroup `path` (a child calls it before exec)."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def _why(e) -> str:
    text = str(e).lower()
    for words, why in (("not supported", "the driver has no per-cgroup memory limits"),
                       ("no permission", "no permission to set driver limits (root only)"),
                       ("operating system", "the driver cannot open the cgroup"),
                       ("function not found", "the driver has no per-cgroup memory limits")):
        if words in text:
            return why
    return f"NVML: {e}"


def _check_api():
    """NvmlUnavailable without NVML; Unavailable when pynvml has no per-cgroup limits."""
    if not nvml.has_memory_limits():
        raise Unavailable("the installed nvidia-ml-py has no per-cgroup memory limits")


def apply(path, devices: dict, mig=False):
    """Set the limit of cgroup `path` on each device: {NVML index: (soft, hard)}.
    Unavailable (nothing left half set) when any cannot be."""
    if mig:
        raise Unavailable("a MIG slice: MIG handles take no driver limits")
    try:
        _check_api()
    except nvml.NvmlUnavailable as e:
        raise NoDriver(f"NVML unavailable ({e})") from None
    done = []
    for index, (soft, hard) in sorted(devices.items()):
        try:
            nvml.set_memory_limits(index, path, min(soft, hard), hard)
        except nvml.DeviceError as e:
            clear(path, done)
            raise Unavailable(_why(e)) from None
        done.append(index)


def clear(path, indexes):
    """Take the limits of cgroup `path` off these devices (soft 0, hard LIMIT_MAX), quietly."""
    try:
        _check_api()
    except (nvml.NvmlUnavailable, Unavailable):
        return
    for index in indexes:
        try:
            nvml.set_memory_limits(index, path, 0, LIMIT_MAX)
        except nvml.DeviceError:
            pass


def read(path, index):
    """(soft, hard, used) of cgroup `path` on device `index`; None when it has no limit there
    or the driver cannot say."""
    return nvml.memory_limits(index, path)


def for_quota(quota) -> dict:
    """{device: (soft, hard)} of a slice's quota: each device it holds with a memory cap."""
    from .slices import UNLIMITED
    return {d: (q.memory_request if q.memory_request != UNLIMITED else 0, q.memory_max)
            for d, q in enumerate(quota.devices) if q.held and q.memory_max not in (0, UNLIMITED)}


def hold(directory, name, quota, mig=False):
    """Put slice `name`'s driver limits on its cgroup (made if missing): the cgroup's path,
    or Unavailable saying why not (nothing is left set)."""
    devices = for_quota(quota)
    if not devices:
        raise NoDriver("no memory cap to hold")
    try:
        _check_api()      # before any cgroup is made: is there a driver to ask at all?
    except nvml.NvmlUnavailable as e:
        raise NoDriver(f"NVML unavailable ({e})") from None
    path = make_slice_cgroup(directory, name)
    try:
        apply(path, devices, mig)
    except Unavailable:
        remove_cgroup(path)
        raise
    return path


def follow(directory, name, quota, mig=False):
    """After a resize: the cgroup of slice `name`, if it has one, takes the new quota;
    None, or why the driver could not (the shim holds the new quota either way)."""
    path = slice_cgroup(directory, name)
    if path is None or not path.is_dir():
        return None
    devices = for_quota(quota)
    try:
        apply(path, devices, mig)
        clear(path, [d for d in quota.held() if d not in devices])   # a cap lifted ("max")
    except Unavailable as e:
        return str(e)
    return None


def release(directory, name, quota):
    """Take slice `name`'s driver limits off and remove its cgroup (if no process is left in it)."""
    path = slice_cgroup(directory, name)
    if path is not None and path.is_dir():
        clear(path, quota.held() if quota else [])
        remove_cgroup(path)


def layer(directory, name, held: dict, mig=False, cgroup=None):
    """("driver+shim", None) when slice `name`'s cgroup (`run`'s, or `cgroup`: its
    container's, as the node agent found it) carries its hard limit on every device it holds
    ({NVML index: hard}), else ("shim", why not the driver)."""
    if mig:
        return "shim", "MIG slice: MIG handles take no driver limits"
    path = Path(cgroup) if cgroup else slice_cgroup(directory, name)
    if path is None or not path.is_dir():
        return "shim", "no cgroup of its own"
    for index, hard in held.items():
        got = read(path, index)
        if got is None or got[1] != hard:
            return "shim", "no driver limit on its cgroup"
    return "driver+shim", None
