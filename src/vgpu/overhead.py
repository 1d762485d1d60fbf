"""A context's own device memory, measured on this node (`vgpu-ctl measure-context`).

A CUDA context costs device memory that no allocation call shows.  The shim charges it on
a process's first allocation on a device: VGPU_CONTEXT_OVERHEAD when set, else what NVML
lists under its pid beyond its charge -- only in the host's pid namespace, where NVML's
pid is the process's own (docs/shim.md).  In a container with a pid namespace of its own
the figure measured here and kept in <dir>/.context-overhead travels in every software
slice's quota (written here into those there, by create into later ones), and the runtime
side sets the variable from it too (`env --format docker|k8s`, the DRA driver's CDI spec);
without one, nothing is charged there.

The measurement: for each GPU not in MIG mode, a child process in this pid namespace,
without the shim, sees that GPU alone, makes its context, allocates 2 MiB (a process's
first allocation: when the shim measures) and reads what NVML lists under its pid; the
figure less the 2 MiB is the context's.
"""
import json
import os
import subprocess
import sys

from . import nvml, slices

FILE = ".context-overhead"
# a context's own memory, at most (shim/memory.c CONTEXT_OVERHEAD_MAX): more is not a context's
MAX_BYTES = 2 << 30
_PROBE_BYTES = 2 << 20
_MAX_FILE = 64 << 10


class BadFigures(slices.VgpuError):
    pass


def path(directory) -> str:
    return os.path.join(slices.node_dir(directory), FILE)


def read(directory) -> dict:
    """{GPU index: bytes} as measured, {} when never measured.  BadFigures (one line and
    a hint) for a file that is not what measure() writes."""
    shown = path(directory)
    try:
        with open(shown, "rb") as f:
            data = f.read(_MAX_FILE + 1)
    except FileNotFoundError:
        return {}
    hint = "run vgpu-ctl measure-context again"
    try:
        figures = json.loads(data)["devices"] if len(data) <= _MAX_FILE else None
        out = {int(k): v for k, v in figures.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        raise BadFigures(f"{shown} is not a measurement", hint) from None
    if not all(0 <= k < slices.MAX_DEVICES and type(v) is int and 0 <= v <= MAX_BYTES for k, v in out.items()):
        raise BadFigures(f"{shown} holds a device or figure out of range", hint)
    return out


def for_devices(directory, devices) -> int:
    """The figure for a slice on these GPUs (the largest: the variable is one figure for
    every device), or None when none of them was measured."""
    figures = read(directory)
    known = [figures[d] for d in devices if d in figures]
    return max(known) if known else None


def for_slice(directory, name) -> int:
    """The figure for slice `name` (a MIG slice: none -- a MIG device's context is not a
    whole GPU's, and is not measured)."""
    if slices.read_mig(directory, name):
        return None
    return for_devices(directory, slices.read_quota(directory, name).held())


def measure(directory, timeout=60.0) -> dict:
    """Measure every GPU not in MIG mode and keep the figures: {index: bytes or the
    reason there is none}."""
    results = {}
    for d in nvml.devices():
        i = d["index"]
        if nvml.mig_enabled(i):
            results[i] = "in MIG mode: not measured"
            continue
        if not d["uuid"]:
            results[i] = "not answering"
            continue
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("VGPU_")}
        env.update(CUDA_VISIBLE_DEVICES=d["uuid"], CUDA_DEVICE_ORDER="PCI_BUS_ID")
        p = subprocess.run([sys.executable, "-m", "vgpu.overhead", str(i)], env=env, capture_output=True,
                           text=True, timeout=timeout)
        try:
            results[i] = int(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else \
                (p.stderr.strip().splitlines() or ["failed"])[-1]
        except (ValueError, IndexError):
            results[i] = "no figure"
    figures = {i: v for i, v in results.items() if isinstance(v, int)}
    os.close(slices._open_node(directory, create=True))     # (measured before the node's first slice)
    node = slices.node_dir(directory)
    tmp = os.path.join(node, f"{FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"devices": {str(i): v for i, v in figures.items()}}, f)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path(directory))
    slices.carry_context_overhead(directory, figures)   # the slices already there; create does the rest
    return results


def _probe(index):
    """In the child: make a context on CUDA's device 0 (the GPU `index` alone is
    visible), allocate, and print what NVML lists under this pid on `index`, less the
    allocation."""
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    for call, args in ((cu.cuInit, (0,)), (cu.cuDeviceGet, (ctypes.byref(dev), 0)),
                       (cu.cuDevicePrimaryCtxRetain, (ctypes.byref(ctx), dev)), (cu.cuCtxSetCurrent, (ctx,)),
                       (cu.cuMemAlloc_v2, (ctypes.byref(ptr), ctypes.c_size_t(_PROBE_BYTES)))):
        rc = call(*args)
        if rc:
            sys.exit(f"{call.__name__} failed: CUresult {rc}")
    held = nvml.running_processes(index).get(os.getpid())
    if held is None:
        sys.exit("NVML lists no memory under this process")
    figure = max(0, held - _PROBE_BYTES)
    if figure > MAX_BYTES:
        sys.exit(f"{figure} bytes is more than a context costs")
    print(figure)


if __name__ == "__main__":
    _probe(int(sys.argv[1]))
