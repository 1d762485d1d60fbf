"""A GPU tenant for the node agent's tests: talks to whatever libcuda.so.1 it is given (the
shim in front of simgpu, or simgpu alone) and takes one JSON command per line on stdin:

  {"alloc": BYTES}                 cuMemAlloc; prints the CUresult
  {"free": 1}                      cuMemFree the last allocation still held; prints the CUresult
  {"hide": BYTES, "usage": PATH}   rewrite this process's own slot charge on device 0 in its
                                   slice's usage file (as a tenant can: the file is writable
                                   in its container); prints the old charge.  With "pid": PID,
                                   the slot of that process (a neighbour in the container); with
                                   "alloc": BYTES, cuMemAlloc at once after (its CUresult as "alloc")
  {"forge": BYTES, "usage": PATH} take the last slot's lock (free, as a cheater finds it) and
                                   write BYTES (mod 2^64: -3 GiB is 2^64 - 3 GiB) as its
                                   charge on device 0; prints 0
  {"hog": KERNEL_US}               from now on, launch and synchronise sim_<KERNEL_US>us
                                   kernels back to back in a thread (no pause); prints 0
  {"child": [ARGV...]}             start ARGV with an EMPTY environment but for simgpu's
                                   variables (which stand in for the GPU, not for vgpu) and
                                   relay its lines; prints {"child": pid} first
  {"mmap": [PATH...]}              map these files read-only (and keep them mapped); prints 0
  {"fork_keep": PATH}              fork a child that lets go of usage file PATH (its descriptors and
                                   mappings: the slot's lock is no longer held through it) but keeps
                                   the driver's files, and with them this process's memory; prints
                                   {"child": its pid in the /proc it sees}
  {"exit": CODE}                   os._exit(CODE) at once; prints nothing
At start it prints {"pid": its pid, "host_pid": its pid in the /proc it sees}.  It works on
CUDA device TENANT_DEVICE (default 0).
"""
import ctypes
import json
import mmap
import os
import struct
import subprocess
import sys
import threading
import time

cuda = ctypes.CDLL("libcuda.so.1")


def check(rc, what):
    if rc != 0:
        raise SystemExit(f"{what} -> {rc}")


check(cuda.cuInit(0), "cuInit")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
check(cuda.cuDeviceGet(ctypes.byref(dev), int(os.environ.get("TENANT_DEVICE", "0"))), "cuDeviceGet")
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


try:
    host = int(os.readlink("/proc/self"))
except (OSError, ValueError):
    host = None
say({"pid": os.getpid(), "host_pid": host, "time": time.time()})
held, maps = [], []


def alloc(size):
    """cuMemAlloc; the pointer kept (for "free") when it succeeds.  Returns the CUresult."""
    ptr = ctypes.c_uint64()
    rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))
    if rc == 0:
        held.append(ptr)
    return rc


def hog(us):
    module, func = ctypes.c_void_p(), ctypes.c_void_p()
    check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    check(cuda.cuModuleLoadData(ctypes.byref(module), b"img"), "cuModuleLoadData")
    check(cuda.cuModuleGetFunction(ctypes.byref(func), module, f"sim_{us}us".encode()), "cuModuleGetFunction")
    launch = cuda.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                                                                 ctypes.c_void_p]
    while True:
        launch(func, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        cuda.cuCtxSynchronize()


def relay(proc):
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()


for line in sys.stdin:
    cmd = json.loads(line)
    if "alloc" in cmd and "hide" not in cmd:
        say(alloc(cmd["alloc"]))
    elif "free" in cmd:
        ptr = next(h for h in reversed(held) if isinstance(h, ctypes.c_uint64))
        held.remove(ptr)
        say(cuda.cuMemFree_v2(ptr))
    elif "hide" in cmd:
        # the layout of csrc/vgpu_region.h, as a tenant would read it from the header
        sys.path.insert(0, os.environ.get("TENANT_SRC", ""))
        from vgpu import slices
        from vgpu.slices import usage
        fd = os.open(cmd["usage"], os.O_RDWR)
        slot = next(i for i in range(slices.MAX_PROCS)
                    if struct.unpack("<i", os.pread(fd, 4, usage.pid_offset(i)))[0] == cmd.get("pid", os.getpid()))
        old = struct.unpack("<Q", os.pread(fd, 8, usage.charge_offset(0, slot)))[0]
        os.pwrite(fd, struct.pack("<Q", cmd["hide"]), usage.charge_offset(0, slot))
        os.close(fd)
        hid = time.time()
        if "alloc" in cmd:       # at once: no look of the agent's falls between the two
            say({"old": old, "time": hid, "alloc": alloc(cmd["alloc"])})
        else:
            say({"old": old, "time": hid})
    elif "forge" in cmd:
        sys.path.insert(0, os.environ.get("TENANT_SRC", ""))
        import fcntl
        from vgpu import slices
        from vgpu.slices import usage
        fd = os.open(cmd["usage"], os.O_RDWR)    # kept open: the lock is this descriptor's
        slot = slices.MAX_PROCS - 1
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, slices._flock_struct(fcntl.F_WRLCK, slot))
        os.pwrite(fd, struct.pack("<Q", cmd["forge"] % (1 << 64)), usage.charge_offset(0, slot))
        from vgpu._region import ffi           # every slot counted (the shim sums slots_used of them)
        os.pwrite(fd, struct.pack("<I", slices.MAX_PROCS), ffi.offsetof("struct vgpu_usage", "slots_used"))
        held.append(fd)
        say(0)
    elif "hog" in cmd:
        threading.Thread(target=hog, args=(cmd["hog"],), daemon=True).start()
        say({"hog": 0, "time": time.time()})
    elif "child" in cmd:
        env = {k: v for k, v in os.environ.items() if k.startswith("SIMGPU_") or k == "LD_LIBRARY_PATH"}
        proc = subprocess.Popen(["env", "-i", *(f"{k}={v}" for k, v in env.items()), *cmd["child"]],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        held.append(proc)
        say({"child": proc.pid})
        threading.Thread(target=relay, args=(proc,), daemon=True).start()
        for sub in cmd.get("send", []):
            proc.stdin.write(json.dumps(sub) + "\n")
            proc.stdin.flush()
    elif "fork_keep" in cmd:
        kids = f"/proc/{host}/task/{host}/children"      # (pids as the /proc we see names them)
        before = set(open(kids).read().split())
        child = os.fork()
        if child == 0:
            from let_go import let_go        # (this program's directory is on sys.path)
            let_go(cmd["fork_keep"])
            while True:
                time.sleep(3600)
        (child_here,) = set(open(kids).read().split()) - before
        say({"child": int(child_here)})
    elif "exit" in cmd:
        os._exit(cmd["exit"])
    elif "mmap" in cmd:
        for path in cmd["mmap"]:
            with open(path, "rb") as f:
                maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
        say(0)
