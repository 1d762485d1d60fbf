"""NVML for the controller: the one place vgpu-ctl talks to it (through pynvml).

Lazy: nothing is loaded at import, so `vgpu-ctl --help` works on any machine.  Graceful:
no NVML library, no driver, or a call a device does not support gives a note or None,
never a traceback; callers decide what they can do without it.  On simgpu (LD_LIBRARY_PATH
at simgpu's libraries) the same calls answer from the simulated node.
"""
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
    device cannot say."""
    n = _nvml()
    try:
        h = n.nvmlDeviceGetHandleByIndex(index)
        since = int((time.time() - window_s) * 1e6)
        samples = n.nvmlDeviceGetProcessUtilization(h, since)
    except Exception:   # NOT_FOUND (nothing ran), NOT_SUPPORTED, ...
        return {}
    util = {}
    for s in samples:   # several samples per process: the latest one counts
        if s.pid not in util or s.timeStamp >= util[s.pid][0]:
            util[s.pid] = (s.timeStamp, s.smUtil)
    return {pid: v for pid, (_, v) in util.items()}


class DeviceError(Exception):
    """A device answered a call with an error (str: NVML's reason)."""


def running_processes(index: int) -> dict:
    """{host pid: device memory in bytes, or None where the driver does not say} of every
    process with a context on the device: compute, graphics and MPS clients together
    (the driver's own figure, not the shim's).  Raises DeviceError when the device does
    not answer, NvmlUnavailable without NVML: never an empty answer for a failed call."""
    n = _nvml()
    try:
        h = n.nvmlDeviceGetHandleByIndex(index)
        procs = _processes(n, "nvmlDeviceGetComputeRunningProcesses_v3", h)
    except Exception as e:
        raise DeviceError(f"device {index}: {_describe(e)}") from None
    for extra in ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetMPSComputeRunningProcesses_v3"):
        try:
            procs += _processes(n, extra, h)
        except Exception:   # NOT_SUPPORTED on compute-only boards, absent in an old driver
            pass
    out = {}
    for pid, used in procs:
        if pid in out:       # listed as compute and graphics: one context, the larger figure
            seen = out[pid]
            used = seen if used is None else used if seen is None else max(used, seen)
        out[pid] = used
    return out


def _processes(n, name, handle) -> list:
    """[(pid, bytes or None)] from one of the *RunningProcesses_v3 calls, read straight
    from pynvml's ctypes array (the node agent asks every second: no per-entry objects)."""
    import ctypes
    fn = n._nvmlGetFunctionPointer(name)
    count = ctypes.c_uint(0)
    ret = fn(handle, ctypes.byref(count), None)
    if ret == n.NVML_SUCCESS:
        return []
    for _ in range(3):       # processes may start between the two calls
        if ret != n.NVML_ERROR_INSUFFICIENT_SIZE:
            raise n.NVMLError(ret)
        count.value = count.value * 2 + 5
        array = (n.c_nvmlProcessInfo_v3_t * count.value)()
        ret = fn(handle, ctypes.byref(count), array)
        if ret == n.NVML_SUCCESS:
            na = n.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
            return [(array[i].pid, None if array[i].usedGpuMemory == na else array[i].usedGpuMemory)
                    for i in range(count.value)]
    raise n.NVMLError(ret)


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
