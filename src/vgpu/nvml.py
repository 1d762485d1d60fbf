"""NVML for the controller: the one place vgpu-ctl talks to it (through pynvml).

Lazy: nothing is loaded at import, so `vgpu-ctl --help` works on any machine.  Graceful:
no NVML library, no driver, or a call a device does not support gives a note or None,
never a traceback; callers decide what they can do without it.  On simgpu (LD_LIBRARY_PATH
at simgpu's libraries) the same calls answer from the simulated node.
"""
import ctypes
import struct
import threading
import time

_lock = threading.Lock()
_state = {"nvml": None, "error": None}


class NvmlUnavailable(Exception):
    """NVML cannot be used here; str() says why."""


def _nvml():
    """pynvml, initialised once; raises NvmlUnavailable (and remembers why)."""
    with _lock:
        if _state["nvml"] is None and _state["error"] is None:
            try:
                import pynvml
                pynvml.nvmlInit()
                _state["nvml"] = pynvml
            except ImportError as e:
                _state["error"] = f"pynvml is not installed ({e})"
            except Exception as e:   # pynvml raises NVMLError subclasses, ctypes OSError
                _state["error"] = _describe(e)
        if _state["nvml"] is None:
            raise NvmlUnavailable(_state["error"])
        return _state["nvml"]


def _describe(e) -> str:
    text = str(e) or type(e).__name__
    if "Library Not Found" in text or "libnvidia-ml" in text:
        return "libnvidia-ml.so.1 not found (no NVIDIA driver here)"
    if "Driver Not Loaded" in text:
        return "the NVIDIA driver is not loaded"
    return text


def reset():
    """Forget the loaded state (tests; a long-running watcher after a driver reload)."""
    with _lock:
        if _state["nvml"] is not None:
            try:
                _state["nvml"].nvmlShutdown()
            except Exception:
                pass
        _state["nvml"] = _state["error"] = None


def available():
    """(True, None) or (False, why)."""
    try:
        _nvml()
        return True, None
    except NvmlUnavailable as e:
        return False, str(e)


def _call(f, *args, default=None):
    try:
        return f(*args)
    except Exception:
        return default


def _text(v):
    return v.decode() if isinstance(v, bytes) else v


def device_count() -> int:
    n = _nvml()
    return n.nvmlDeviceGetCount()


def devices() -> list:
    """Every device: index, name, uuid, memory total/used (bytes), gpu_util (percent over
    the driver's last sample window) -- None where a device does not say."""
    n = _nvml()
    out = []
    for i in range(n.nvmlDeviceGetCount()):
        h = _call(n.nvmlDeviceGetHandleByIndex, i)
        if h is None:   # fallen off the bus (GPU_IS_LOST) or otherwise unreachable: listed, unknown
            out.append({"index": i, "name": "?", "uuid": None, "memory_total": None, "memory_used": None,
                        "gpu_util": None})
            continue
        mem = _call(n.nvmlDeviceGetMemoryInfo, h)
        util = _call(n.nvmlDeviceGetUtilizationRates, h)
        out.append({"index": i, "name": _text(_call(n.nvmlDeviceGetName, h, default="?")),
                    "uuid": _text(_call(n.nvmlDeviceGetUUID, h)),
                    "memory_total": mem.total if mem else None, "memory_used": mem.used if mem else None,
                    "gpu_util": util.gpu if util else None})
    return out


def memory_total(index: int) -> int:
    n = _nvml()
    try:
        return n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetHandleByIndex(index)).total
    except n.NVMLError as e:
        raise NvmlUnavailable(f"device {index}: {e}") from None


def process_utilization(index: int, window_s: float = 1.0) -> dict:
    """{host pid: SM percent} over about the last `window_s`; {} when nothing ran or the
    device cannot say (a MIG-enabled GPU: NOT_SUPPORTED, as nvml.h says)."""
    n = _nvml()
    try:
        h = n.nvmlDeviceGetHandleByIndex(index)
        since = int((time.time() - window_s) * 1e6)
        samples = _samples(n, h, since)
    except Exception:   # NOT_FOUND (nothing ran), NOT_SUPPORTED, ...
        return {}
    util = {}
    for pid, stamp, sm in samples:   # several samples per process: the latest one counts
        if pid not in util or stamp >= util[pid][0]:
            util[pid] = (stamp, sm)
    return {pid: v for pid, (_, v) in util.items()}


# nvmlProcessUtilizationSample_t: pid, timeStamp, smUtil, memUtil, encUtil, decUtil
_SAMPLE = struct.Struct("<I4xQII8x")
# nvmlProcessInfo_v2_t (the _v2 and _v3 calls'): pid, usedGpuMemory, gpuInstanceId, computeInstanceId
_PROC = struct.Struct("<I4xQII")
_FIRST = 64              # entries asked for in the first call: one call, not two, in the common case
_fns = {}
_sizes = {}              # (call, handle) -> entries its last answer had (the next call asks for a few more)


# Versioned entry points, newest first: a call named without its suffix resolves to the
# first version the driver has (an older driver lacks the newer names).  nvml.h keeps each
# version's arguments: the _v3 and _v2 process lists both fill nvmlProcessInfo_v2_t, both
# event waits an nvmlEventData_t.  The one place a version is chosen.
VERSIONS = {
    "nvmlDeviceGetComputeRunningProcesses": ("_v3", "_v2"),
    "nvmlDeviceGetGraphicsRunningProcesses": ("_v3", "_v2"),
    "nvmlDeviceGetMPSComputeRunningProcesses": ("_v3", "_v2"),
    "nvmlDeviceGetProcessUtilization": ("",),
    "nvmlEventSetWait": ("_v2", ""),
}


def _fn(n, call):
    """The driver's entry point for `call` (a VERSIONS key); NVMLError FUNCTION_NOT_FOUND
    when it has none of its versions."""
    f = _fns.get(call)
    if f is None:
        for suffix in VERSIONS[call]:
            try:
                f = n._nvmlGetFunctionPointer(call + suffix)
                break
            except n.NVMLError:
                continue
        else:
            raise n.NVMLError(n.NVML_ERROR_FUNCTION_NOT_FOUND)
        _fns[call] = f
    return f


def _samples(n, handle, since) -> list:
    """[(pid, timeStamp, smUtil)] from nvmlDeviceGetProcessUtilization, in one call where
    the array is large enough (pynvml's wrapper always makes two and builds objects)."""
    assert ctypes.sizeof(n.c_nvmlProcessUtilizationSample_t) == _SAMPLE.size
    fn = _fn(n, "nvmlDeviceGetProcessUtilization")
    key = ("util", ctypes.cast(handle, ctypes.c_void_p).value)
    size = max(_FIRST, _sizes.get(key, 0) + 16)
    for _ in range(4):   # processes may start between two calls
        array = (n.c_nvmlProcessUtilizationSample_t * size)()
        count = ctypes.c_uint(size)
        ret = fn(handle, array, ctypes.byref(count), ctypes.c_ulonglong(since))
        if ret == n.NVML_SUCCESS:
            _sizes[key] = count.value
            return [s[:3] for s in _SAMPLE.iter_unpack(memoryview(array).cast("B")[:count.value * _SAMPLE.size])]
        if ret != n.NVML_ERROR_INSUFFICIENT_SIZE:
            raise n.NVMLError(ret)
        size = count.value * 2 + 8
    raise n.NVMLError(ret)


class DeviceError(Exception):
    """A device answered a call with an error (str: NVML's reason).  `reason`: which of
    REASONS it was ("not_supported", "in_use", ...), None for another; `code`: NVML's value."""

    def __init__(self, text, reason=None, code=None):
        super().__init__(text)
        self.reason, self.code = reason, code


# the NVML return values callers tell apart: nvml.h's nvmlReturn_t values (an ABI: fixed)
REASONS = {2: "invalid_argument", 3: "not_supported", 4: "no_permission", 6: "not_found", 19: "in_use",
           23: "insufficient_resources"}


def _error(n, e, prefix=""):
    """DeviceError of a pynvml error (or of a non-SUCCESS return value)."""
    code = e if isinstance(e, int) else getattr(e, "value", None)
    text = _call(lambda: n.nvmlErrorString(code), default=f"NVML error {code}") if isinstance(e, int) else str(e)
    return DeviceError(prefix + text, REASONS.get(code), code)


def running_processes(index: int) -> dict:
    """{host pid: device memory in bytes, or None where the driver does not say} of every
    process with a context on the device: compute, graphics and MPS clients together
    (the driver's own figure, not the shim's).  Raises DeviceError when the device does
    not answer, NvmlUnavailable without NVML: never an empty answer for a failed call."""
    n = _nvml()
    try:
        h = n.nvmlDeviceGetHandleByIndex(index)
        lists = [_processes(n, "nvmlDeviceGetComputeRunningProcesses", h)]
    except Exception as e:
        raise DeviceError(f"device {index}: {_describe(e)}") from None
    for extra in ("nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
        try:
            lists.append(_processes(n, extra, h))
        except Exception:   # NOT_SUPPORTED on compute-only boards, absent in an old driver
            pass
    return _per_pid(lists)


def _per_pid(lists) -> dict:
    """{pid: bytes or None} from the process lists of one device (compute, graphics, MPS).
    One list naming a pid twice: two contexts under one pid (an ended process's, kept by a
    child, and the live process given its pid), their sum; a pid in two lists (compute and
    graphics): one context, the larger figure."""
    out = {}
    for procs in lists:
        mine = {}
        for pid, used in procs:
            seen = mine.get(pid, 0)
            mine[pid] = None if used is None or seen is None else seen + used
        for pid, used in mine.items():
            if pid in out:
                seen = out[pid]
                used = seen if used is None else used if seen is None else max(used, seen)
            out[pid] = used
    return out


def _processes(n, name, handle) -> list:
    """[(pid, bytes or None)] from one of the *RunningProcesses calls, read straight
    from the ctypes array (the node agent asks every second: no per-entry objects), in
    one call where the array is large enough."""
    return [(pid, used) for pid, used, _, _ in _process_infos(n, name, handle)]


def _process_infos(n, name, handle) -> list:
    """[(pid, bytes or None, GPU instance ID, compute instance ID)] (the IDs: NOT_AVAILABLE
    but on a MIG-enabled GPU)."""
    assert ctypes.sizeof(n.c_nvmlProcessInfo_v3_t) == _PROC.size
    fn = _fn(n, name)
    na = n.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
    key = (name, ctypes.cast(handle, ctypes.c_void_p).value)
    size = max(_FIRST, _sizes.get(key, 0) + 16)
    for _ in range(4):       # processes may start between two calls
        array = (n.c_nvmlProcessInfo_v3_t * size)()
        count = ctypes.c_uint(size)
        ret = fn(handle, ctypes.byref(count), array)
        if ret == n.NVML_SUCCESS:
            _sizes[key] = count.value
            return [(pid, None if used == na else used, gi, ci) for pid, used, gi, ci in
                    _PROC.iter_unpack(memoryview(array).cast("B")[:count.value * _PROC.size])]
        if ret != n.NVML_ERROR_INSUFFICIENT_SIZE:
            raise n.NVMLError(ret)
        size = count.value * 2 + 8
    raise n.NVMLError(ret)


# === MIG devices ===
# On a GPU in MIG mode the processes are on its MIG devices (a GPU instance's compute
# instance each).  nvml.h: the GPU's own handle gives aggregate information (only to a
# caller with the privilege), a MIG device's handle that instance's processes; per-process
# utilization is NOT_SUPPORTED on a MIG-enabled GPU.

class MigDevice:
    """One MIG device as NVML lists it under its GPU: UUID, GPU and compute instance IDs,
    and its handle (which "may be reused": valid until the instance is destroyed)."""
    __slots__ = ("gpu", "uuid", "gpu_instance", "compute_instance", "name", "handle")

    def __init__(self, gpu, uuid, gpu_instance, compute_instance, name, handle):
        self.gpu, self.uuid, self.gpu_instance, self.compute_instance = gpu, uuid, gpu_instance, compute_instance
        self.name, self.handle = name, handle


def mig_enabled(index: int):
    """True or False: device `index`'s current MIG mode; None for a GPU without MIG
    (NOT_SUPPORTED).  Raises DeviceError when the device does not answer."""
    n = _nvml()
    try:
        return bool(n.nvmlDeviceGetMigMode(n.nvmlDeviceGetHandleByIndex(index))[0])
    except n.NVMLError as e:
        if getattr(e, "value", None) == n.NVML_ERROR_NOT_SUPPORTED:
            return None
        raise DeviceError(f"device {index}: {_describe(e)}") from None


def mig_devices(index: int) -> list:
    """[MigDevice] of device `index` (a GPU in MIG mode): its MIG device handles by index up
    to nvmlDeviceGetMaxMigDeviceCount (NOT_FOUND: an empty index).  Walking them can be
    slow on a loaded driver (NVIDIA's DRA driver measured seconds): callers keep the answer."""
    n = _nvml()
    try:
        h = n.nvmlDeviceGetHandleByIndex(index)
        count = n.nvmlDeviceGetMaxMigDeviceCount(h)
    except Exception as e:
        raise DeviceError(f"device {index}: {_describe(e)}") from None
    out = []
    for i in range(count):
        try:
            m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
        except n.NVMLError:
            continue         # nothing at that index
        try:
            out.append(MigDevice(index, _text(n.nvmlDeviceGetUUID(m)), n.nvmlDeviceGetGpuInstanceId(m),
                                 n.nvmlDeviceGetComputeInstanceId(m), _text(_call(n.nvmlDeviceGetName, m, default="?")),
                                 m))
        except n.NVMLError:
            continue         # destroyed while we looked
    return out


def mig_processes(device: MigDevice) -> dict:
    """{host pid: bytes or None} of the processes on one MIG device, from its own handle
    (compute and graphics; simgpu has no graphics clients).  Raises DeviceError when the
    handle no longer answers (the instance destroyed)."""
    n = _nvml()
    try:
        lists = [_processes(n, "nvmlDeviceGetComputeRunningProcesses", device.handle)]
    except Exception as e:
        raise DeviceError(f"MIG device {device.uuid}: {_describe(e)}") from None
    try:
        lists.append(_processes(n, "nvmlDeviceGetGraphicsRunningProcesses", device.handle))
    except Exception:
        pass
    return _per_pid(lists)


def minor_number(index: int) -> int:
    """The GPU's minor number (/dev/nvidia<minor>, `gpu<minor>` in mig-minors).  Raises
    DeviceError when the device does not answer."""
    n = _nvml()
    try:
        return n.nvmlDeviceGetMinorNumber(n.nvmlDeviceGetHandleByIndex(index))
    except Exception as e:
        raise DeviceError(f"device {index}: {_describe(e)}") from None


def index_of(uuid: str):
    """The NVML index of the GPU with this UUID, or None when no GPU has it now."""
    n = _nvml()
    try:
        return n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByUUID(uuid))
    except Exception:
        return None


def driver_version():
    try:
        return _text(_nvml().nvmlSystemGetDriverVersion())
    except Exception:
        return None


def mig_mode(index: int):
    """Device `index`'s current MIG mode (True: on), None where NVML, the device or MIG
    is not there to say."""
    try:
        n = _nvml()
        return bool(n.nvmlDeviceGetMigMode(n.nvmlDeviceGetHandleByIndex(index))[0])
    except Exception:   # NvmlUnavailable, NOT_SUPPORTED (no MIG), INVALID_ARGUMENT (no such device)
        return None


# === MIG management: GPU and compute instances (vgpu-ctl mig, MIG slices) ===
# Calls that fail raise DeviceError with NVML's text and its reason; mig.py words them for
# the operator.  Handles are asked again by index or UUID on every call: "this API may
# unbind or reset the device" (nvml.h, nvmlDeviceSetMigMode), so a kept handle can go stale.

_PROFILE_SCAN = 64    # profile enumeration ends at INVALID_ARGUMENT; a bound in case a driver never says it


def _gpu(n, index=None, uuid=None):
    """The GPU's handle, by UUID when one is given, else by index; DeviceError when NVML
    has no such GPU (or neither is given: a record without them)."""
    try:
        if uuid is not None:
            return n.nvmlDeviceGetHandleByUUID(uuid)
        if index is not None:
            return n.nvmlDeviceGetHandleByIndex(index)
    except n.NVMLError as e:
        raise _error(n, e) from None
    raise DeviceError("no GPU named (neither a UUID nor an index)")


def gpu_identity(index) -> tuple:
    """(name, UUID) of GPU `index`; the name "?" where the GPU does not say it."""
    n = _nvml()
    h = _gpu(n, index)
    try:
        uuid = _text(n.nvmlDeviceGetUUID(h))
    except n.NVMLError as e:
        raise _error(n, e) from None
    return _text(_call(n.nvmlDeviceGetName, h, default="?")), uuid


def mig_modes(index) -> list:
    """[current, pending] MIG mode of GPU `index` (1: on).  DeviceError("not_supported") on a
    GPU without MIG."""
    n = _nvml()
    h = _gpu(n, index)
    try:
        return list(n.nvmlDeviceGetMigMode(h))
    except n.NVMLError as e:
        raise _error(n, e) from None


def set_mig_mode(index, on: bool):
    """Ask for MIG mode on or off: None when the driver took the request, else the refused
    activation's DeviceError (e.g. "in_use": processes on the GPU).  Raises DeviceError
    when the call itself fails (e.g. "no_permission")."""
    n = _nvml()
    h = _gpu(n, index)
    try:
        status = n.nvmlDeviceSetMigMode(h, n.NVML_DEVICE_MIG_ENABLE if on else n.NVML_DEVICE_MIG_DISABLE)
    except n.NVMLError as e:
        raise _error(n, e) from None
    return None if status == n.NVML_SUCCESS else _error(n, status)


def _placements(n, h, profile_id):
    """[[start, size]] where a GPU instance of the profile can go (nvml.h marks the call
    privileged: None where it is refused)."""
    count = ctypes.c_uint()
    try:
        n.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, None, ctypes.byref(count))
        arr = (n.c_nvmlGpuInstancePlacement_t * count.value)()
        if count.value:
            n.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, ctypes.byref(count))
    except n.NVMLError:
        return None
    return [[arr[i].start, arr[i].size] for i in range(count.value)]


def _profile_infos(n, h):
    """[(profile index, nvmlGpuInstanceProfileInfo)] of the GPU's profiles (a profile the
    GPU does not support is skipped)."""
    out = []
    for index in range(_PROFILE_SCAN):
        try:
            out.append((index, n.nvmlDeviceGetGpuInstanceProfileInfo(h, index)))
        except n.NVMLError as e:
            if getattr(e, "value", None) == n.NVML_ERROR_INVALID_ARGUMENT:
                break
            if getattr(e, "value", None) != n.NVML_ERROR_NOT_SUPPORTED:
                raise _error(n, e) from None
    return out


def gpu_instance_profiles(index, with_free: bool) -> list:
    """GPU `index`'s GPU instance profiles, as nvidia-smi mig -lgip/-lgipp list them: name
    (NVML's, e.g. "MIG 3g.40gb"), index, id, slices, instances, free (remaining capacity:
    only `with_free`, None where not said), memory_mib, engines, p2p, placements."""
    n = _nvml()
    h = _gpu(n, index)
    out = []
    for i, info in _profile_infos(n, h):
        free = _call(n.nvmlDeviceGetGpuInstanceRemainingCapacity, h, info.id) if with_free else None
        out.append({"name": _text(info.name), "index": i, "id": info.id, "slices": info.sliceCount,
                    "instances": info.instanceCount, "free": free, "memory_mib": info.memorySizeMB,
                    "multiprocessors": info.multiprocessorCount, "copy_engines": info.copyEngineCount,
                    "decoders": info.decoderCount, "encoders": info.encoderCount, "jpeg": info.jpegCount,
                    "ofa": info.ofaCount, "p2p": bool(info.isP2pSupported),
                    "placements": _placements(n, h, info.id)})
    return out


def gpu_instances(index=None, uuid=None) -> list:
    """The GPU instances on a MIG-enabled GPU (by index or UUID): [{id, profile_id, profile
    (NVML's name), start, size}], in placement order."""
    n = _nvml()
    h = _gpu(n, index, uuid)
    out = []
    for _, info in _profile_infos(n, h):
        arr = (n.c_nvmlGpuInstance_t * max(info.instanceCount, 1))()
        count = ctypes.c_uint()
        try:
            n.nvmlDeviceGetGpuInstances(h, info.id, arr, ctypes.byref(count))
            for i in range(count.value):
                gi = n.nvmlGpuInstanceGetInfo(arr[i])
                out.append({"id": gi.id, "profile_id": gi.profileId, "profile": _text(info.name),
                            "start": gi.placement.start, "size": gi.placement.size})
        except n.NVMLError:
            continue
    return sorted(out, key=lambda g: (g["start"], g["id"]))


class GpuInstance:
    """A GPU instance: its ID, profile ID, placement, and handle (valid until destroyed)."""
    __slots__ = ("id", "profile_id", "start", "size", "handle")

    def __init__(self, n, handle):
        info = n.nvmlGpuInstanceGetInfo(handle)
        self.id, self.profile_id, self.handle = info.id, info.profileId, handle
        self.start, self.size = info.placement.start, info.placement.size


class ComputeInstance:
    """A compute instance: its ID, profile ID, multiprocessors, and handle."""
    __slots__ = ("id", "profile_id", "multiprocessors", "handle")

    def __init__(self, n, handle, multiprocessors):
        info = n.nvmlComputeInstanceGetInfo(handle)
        self.id, self.profile_id, self.handle = info.id, info.profileId, handle
        self.multiprocessors = multiprocessors


def create_gpu_instance(index, profile_id, placement=None) -> GpuInstance:
    """A GPU instance of the profile on GPU `index`: at `placement` ([start, size]), else
    where the driver chooses.  DeviceError("insufficient_resources") when there is no room."""
    n = _nvml()
    h = _gpu(n, index)
    try:
        if placement is None:
            gi = n.nvmlDeviceCreateGpuInstance(h, profile_id)
        else:
            gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(
                h, profile_id, ctypes.byref(n.c_nvmlGpuInstancePlacement_t(*placement)))
        return GpuInstance(n, gi)
    except n.NVMLError as e:
        raise _error(n, e) from None


def create_compute_instance(gi: GpuInstance, ci_profile) -> ComputeInstance:
    """A compute instance of profile index `ci_profile` (engines shared) over GPU instance `gi`."""
    n = _nvml()
    try:
        info = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi.handle, ci_profile,
                                                              n.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        return ComputeInstance(n, n.nvmlGpuInstanceCreateComputeInstance(gi.handle, info.id),
                               info.multiprocessorCount)
    except n.NVMLError as e:
        raise _error(n, e) from None


def destroy(instance):
    """Destroy a ComputeInstance or GpuInstance (DeviceError "in_use" while a process is on it)."""
    n = _nvml()
    try:
        (n.nvmlComputeInstanceDestroy if isinstance(instance, ComputeInstance) else
         n.nvmlGpuInstanceDestroy)(instance.handle)
    except n.NVMLError as e:
        raise _error(n, e) from None


def instances_by_id(gpu_instance, compute_instance, uuid=None, index=None):
    """(GpuInstance or None, ComputeInstance or None) with these IDs on the GPU (by UUID,
    else by index).  DeviceError when the GPU itself is not there."""
    n = _nvml()
    try:
        h = _gpu(n, uuid=uuid)
    except DeviceError:
        h = _gpu(n, index)      # (indices may change across boots: the UUID first)
    try:
        gi = GpuInstance(n, n.nvmlDeviceGetGpuInstanceById(h, gpu_instance))
    except n.NVMLError:
        return None, None
    try:
        ci = ComputeInstance(n, n.nvmlGpuInstanceGetComputeInstanceById(gi.handle, compute_instance), None)
    except n.NVMLError:
        ci = None
    return gi, ci


def mig_device(uuid) -> MigDevice:
    """The MIG device with this UUID (gpu: None).  DeviceError when NVML does not know it."""
    n = _nvml()
    m = _gpu(n, uuid=uuid)
    try:
        return MigDevice(None, uuid, n.nvmlDeviceGetGpuInstanceId(m), n.nvmlDeviceGetComputeInstanceId(m),
                         _text(_call(n.nvmlDeviceGetName, m, default="?")), m)
    except n.NVMLError as e:
        raise _error(n, e) from None


def mig_memory(device: MigDevice):
    """(total, used) bytes of a MIG device, or None where it does not say."""
    n = _nvml()
    mem = _call(n.nvmlDeviceGetMemoryInfo, device.handle)
    return (mem.total, mem.used) if mem else None


# === per-cgroup device memory limits (nvml.h of CUDA 13.5: nvmlDeviceSetMemoryLimits_v1) ===

def has_memory_limits() -> bool:
    """Whether the installed nvidia-ml-py has the per-cgroup limit calls (NvmlUnavailable
    without NVML).  Whether the driver has them only a call tells (NOT_SUPPORTED)."""
    return hasattr(_nvml(), "nvmlDeviceSetMemoryLimits_v1")


def set_memory_limits(index, cgroup, soft, hard):
    """Hold cgroup `cgroup` (its path) on GPU `index` to `hard` bytes, `soft` guaranteed
    under pressure.  DeviceError with NVML's text when the driver refuses."""
    n = _nvml()
    try:
        n.nvmlDeviceSetMemoryLimits_v1(n.nvmlDeviceGetHandleByIndex(index),
                                       n.c_nvmlSetMemoryLimits_v1_t(str(cgroup).encode(), soft, hard))
    except n.NVMLError as e:
        raise _error(n, e) from None


def memory_limits(index, cgroup):
    """(soft, hard, used) of cgroup `cgroup` on GPU `index`; None when it has no limit there
    or the driver cannot say."""
    try:
        n = _nvml()
        limits = n.c_nvmlGetMemoryLimits_v1_t(str(cgroup).encode(), 0, 0, 0)
        n.nvmlDeviceGetMemoryLimits_v1(n.nvmlDeviceGetHandleByIndex(index), limits)
    except Exception:    # NvmlUnavailable, no such call in pynvml, NVMLError
        return None
    return limits.softLimit, limits.hardLimit, limits.currentUsed


class XidEvents:
    """NVML's event set over every GPU, for XID critical errors (nvmlDeviceRegisterEvents,
    nvmlEventSetWait).  `wait(timeout_s)`: ("xid", GPU index, XID), ("lost", None, None)
    when a GPU it watches has fallen off the bus (NVML_ERROR_GPU_IS_LOST), or None when
    nothing came.  GPUs it could not watch (lost, events not supported): `unwatched`
    {index: why}.  Raises NvmlUnavailable without NVML or event sets."""

    def __init__(self):
        n = self.n = _nvml()
        self._address = lambda h: ctypes.cast(h, ctypes.c_void_p).value
        try:
            self.set = n.nvmlEventSetCreate()
        except n.NVMLError as e:
            raise NvmlUnavailable(f"NVML event sets: {_describe(e)}") from None
        self.index_of, self.unwatched = {}, {}
        for i in range(n.nvmlDeviceGetCount()):
            try:
                h = n.nvmlDeviceGetHandleByIndex(i)
                n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, self.set)
                self.index_of[self._address(h)] = i
            except n.NVMLError as e:
                self.unwatched[i] = _describe(e)

    def wait(self, timeout_s):
        n = self.n
        data = n.c_nvmlEventData_t()
        ret = _fn(n, "nvmlEventSetWait")(self.set, ctypes.byref(data), ctypes.c_uint(max(1, int(timeout_s * 1000))))
        if ret == n.NVML_ERROR_TIMEOUT:
            return None
        if ret == n.NVML_ERROR_GPU_IS_LOST:
            return ("lost", None, None)
        if ret != n.NVML_SUCCESS:
            raise n.NVMLError(ret)
        return ("xid", self.index_of.get(self._address(data.device)), int(data.eventData))

    def close(self):
        _call(self.n.nvmlEventSetFree, self.set)


def lost_gpus() -> dict:
    """{index: why} of the GPUs that have fallen off the bus (NVML_ERROR_GPU_IS_LOST).  Other
    errors (a GPU busy with a MIG change, a call it does not support) are not a loss."""
    n = _nvml()
    out = {}
    for i in range(n.nvmlDeviceGetCount()):
        try:
            n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(i))
        except n.NVMLError_GpuIsLost as e:
            out[i] = _describe(e)
        except n.NVMLError:
            pass
    return out
