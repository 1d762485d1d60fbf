"""A simulated node: every test talks to simgpu from real child processes.

A process binds to one simgpu node (state directory) the first time it loads the
libraries, so tests never load libcuda / libnvidia-ml into the pytest process itself:
they run small programs (Python or C) with an environment pointing at a fresh node.
"""
import os
import subprocess
import sys
import textwrap

from vgpu.paths import simgpu_dir


def make_sim_env(state_dir, profile="a10", devices=1, **extra):
    env = dict(os.environ)
    for k in list(env):
        # CUDA_VISIBLE_DEVICES: simgpu's libcuda honours it, and a host's value names its real GPUs
        if k.startswith(("SIMGPU_", "VGPU_", "CUDA_DEVICE_")) or k == "CUDA_VISIBLE_DEVICES":
            del env[k]
    lib = str(simgpu_dir())
    env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    env["SIMGPU_STATE_DIR"] = str(state_dir)
    env["SIMGPU_PROFILE"] = profile
    env["SIMGPU_DEVICES"] = str(devices)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_python(code, env, timeout=120, check=True, args=()):
    """Run `code` in a fresh interpreter; return the CompletedProcess."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\nstdout:\n{proc.stdout}\n"
                             f"stderr:\n{proc.stderr}")
    return proc


def start_python(code, env, args=()):
    """Start `code` in a fresh interpreter without waiting (stdin/stdout are pipes)."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


_STAGED_HOLDERS = []   # descriptors whose OFD locks keep staged slots alive


def write_usage_counters(directory, name, device=0, **counters):
    """Set a slice's usage counters on `device` as the shim does (atomic stores into the
    mapped file): lets controller tests stage any usage without a workload.  memory_current
    is not a field but the sum of the slots' charges: it is staged in the last slot, held
    (locked) by this test process as a live process would hold it, so reaping keeps it."""
    import fcntl
    import mmap
    import struct

    from vgpu._region import ffi, lib
    path = os.path.join(directory, name, "usage")
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, ffi.sizeof("struct vgpu_usage"))
    finally:
        os.close(fd)
    u = ffi.cast("struct vgpu_usage *", ffi.from_buffer(mm))
    for k, v in counters.items():
        if k == "memory_current":
            slot = lib.VGPU_MAX_PROCS - 1
            holder = os.open(path, os.O_RDWR)
            fcntl.fcntl(holder, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET,
                                                                (1 << 40) + slot, 1, 0))
            _STAGED_HOLDERS.append(holder)
            lib.vgpu_store_i32(ffi.addressof(u.procs[slot], "pid"), os.getpid())
            lib.vgpu_store_u64(ffi.addressof(u.charge[device], slot), v)
            u.slots_used = lib.VGPU_MAX_PROCS
        else:
            lib.vgpu_store_u64(ffi.addressof(u.devices[device], k), v)
