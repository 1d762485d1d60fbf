"""What the example workloads share: a CUDA context through NVIDIA's cuda-python driver
bindings, device memory held for the whole run, and simgpu's timed kernels.

On simgpu a kernel named `sim_<N>us` takes N µs of GPU time per wave of blocks (a wave is
as many blocks as the device has SMs), so a workload's GPU load is set by which kernels it
launches and how often.  On a real GPU these scripts need a module with such kernels; they
are for trying vgpu on simgpu.

The workloads print nothing while all is well (they are meant to run in the background of
a shell session) and one line on stderr when CUDA refuses something; SIGTERM and Ctrl-C end
them quietly.
"""
import argparse
import signal
import sys
import time

from vgpu.quantities import parse_memory


def check(result, what):
    """cuda-python returns (err, value...) tuples: the value, or exit with one line."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err):
        sys.exit(f"{sys.argv[0]}: {what} failed: CUDA error {int(err)} ({err.name if hasattr(err, 'name') else err})")
    return rest[0] if len(rest) == 1 else rest


class Gpu:
    """Device 0, a stream, and the kernels `sim_<N>us` for the durations asked."""

    def __init__(self):
        from cuda.bindings import driver as cu
        self.cu = cu
        check(cu.cuInit(0), "cuInit")
        dev = check(cu.cuDeviceGet(0), "cuDeviceGet")
        check(cu.cuCtxSetCurrent(check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")),
              "cuCtxSetCurrent")
        self.sms = check(cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "cuDeviceGetAttribute")
        self.module = check(cu.cuModuleLoadData(b"simgpu runs kernels by name"), "cuModuleLoadData")
        self.stream = check(cu.cuStreamCreate(0), "cuStreamCreate")
        self.kernels, self.held = {}, []

    def hold(self, nbytes):
        """Allocate nbytes of device memory and keep it."""
        self.held.append(check(self.cu.cuMemAlloc(nbytes), f"cuMemAlloc of {nbytes} bytes"))

    def launch(self, micros, count=1):
        """Queue `count` kernels of `micros` µs of GPU time each (one wave of blocks)."""
        if micros not in self.kernels:
            self.kernels[micros] = check(self.cu.cuModuleGetFunction(self.module, f"sim_{micros}us".encode()),
                                         "cuModuleGetFunction")
        for _ in range(count):
            check(self.cu.cuLaunchKernel(self.kernels[micros], self.sms, 1, 1, 128, 1, 1, 0, self.stream, 0, 0),
                  "cuLaunchKernel")

    def sync(self):
        check(self.cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")


def arguments(description, **extra):
    """SIZE (memory to hold), --seconds (how long; default until stopped), and extra
    options: name -> (type, default, help)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("size", type=parse_memory, help="device memory to hold, e.g. 8Gi")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long [default: until stopped]")
    for name, (kind, default, text) in extra.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, help=f"{text} [{default}]")
    return p.parse_args()


def run_until_stopped(seconds, step):
    """Call step() until `seconds` pass or SIGTERM/SIGINT arrives; exit 0 either way."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    end = None if seconds is None else time.monotonic() + seconds
    try:
        while end is None or time.monotonic() < end:
            step()
    except KeyboardInterrupt:
        pass
