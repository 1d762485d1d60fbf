"""The shim's memory cap, checked from outside the capped processes.

Every test runs real processes under the shim (LD_PRELOAD) on a fresh simgpu node and
judges them by what others see:
  - the referee: simgpu's NVML in a process WITHOUT the shim (what the simulated device
    really holds, and which processes hold it);
  - the container's usage file, read through the cffi binding of csrc/vgpu_region.h;
  - other processes, in the same container or another one.
Clients are NVIDIA's cuda-bindings and pynvml, and small C programs (tests/programs/
shim_*.c) where many processes or threads must race.
"""
import errno
import json
import os
import select
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.simnode import make_sim_env, run_python
from tests.helpers.slots import boot_ticks
from tests.helpers.wait import wait_gone, wait_until
from vgpu import procfs, slices
from vgpu._region import ffi, lib
from vgpu.paths import SHIM

GiB = 1 << 30
MiB = 1 << 20
A10_MEMORY = 24 * GiB
SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, NOT_INITIALIZED = 0, 1, 2, 3
QUOTA_SIZE = ffi.sizeof("struct vgpu_quota")
USAGE_SIZE = ffi.sizeof("struct vgpu_usage")


# === the node, its containers, and the referee ===

class Node:
    """A simgpu node and a vgpu directory, with environments for processes on it."""

    def __init__(self, root, profile="a10", devices=1):
        self.state = root / "node"
        self.dir = root / "vgpu"
        self.profile, self.devices = profile, devices

    def bare_env(self, **extra):
        """A process on the node with no shim at all (the referee, or another tenant)."""
        return make_sim_env(self.state, profile=self.profile, devices=self.devices, **extra)

    def env(self, container="c1", limit="4Gi", **extra):
        """A process of `container` under the shim; limit=None sets no limit variable."""
        env = self.bare_env(LD_PRELOAD=str(SHIM), VGPU_DIR=self.dir, VGPU_SLICE=container, **extra)
        if limit is not None:
            env["VGPU_MEMORY_LIMIT"] = limit
        return env

    def create(self, container="c1", memory="4Gi"):
        """Make `container` as the controller does: it outlives its processes (a standalone
        slice, made by the shim from the variables, goes with its last one)."""
        subprocess.run([str(Path(sys.executable).parent / "vgpu-ctl"), "create", container, "--memory", memory,
                        "--dir", self.dir], env=self.bare_env(), check=True, capture_output=True, timeout=60)

    def quota_path(self, container="c1"):
        return self.dir / container / "quota"

    def usage_path(self, container="c1"):
        return self.dir / container / "usage"

    def usage(self, container="c1", reap=True):
        """The usage file as vgpu-ctl reads it: dead processes' slots reaped first (the
        shim leaves a dead process's slot to whoever looks next); reap=False: raw."""
        if reap:
            slices.reap_slice(self.dir, container)
        return read_usage(self.usage_path(container))

    def referee(self, device=0):
        """What the device really holds, seen by NVML with no shim in the way."""
        out = run_python(REFEREE, self.bare_env(), args=[str(device)], timeout=60)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        return SimpleNamespace(total=r["total"], used=r["used"], free=r["free"],
                               procs={pid: mem for pid, mem in r["procs"]})


REFEREE = """
import json, sys, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(int(sys.argv[1]))
m = n.nvmlDeviceGetMemoryInfo(h)
procs = [[p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(h)]
print(json.dumps({"total": m.total, "used": m.used, "free": m.free, "procs": procs}))
"""


def read_usage(path):
    """Device 0 of a usage file: memory_current, peak, refusals, and {pid: bytes} of its slots."""
    data = path.read_bytes()
    assert len(data) == USAGE_SIZE
    u = ffi.cast("struct vgpu_usage *", ffi.from_buffer(data))
    assert (u.magic, u.abi_version) == (lib.VGPU_USAGE_MAGIC, lib.VGPU_ABI_VERSION)
    procs = {u.procs[i].pid: u.charge[0][i] for i in range(lib.VGPU_MAX_PROCS) if u.procs[i].pid}
    return SimpleNamespace(current=sum(u.charge[0]), peak=u.devices[0].memory_peak,
                           refusals=u.devices[0].oom_refusals, procs=procs)


def footprint(size):
    """What the device holds for an allocation of `size` (csrc/footprint.h's rule, written
    out again as the test's oracle)."""
    unit = 2 * MiB if size >= MiB else 512
    return -(-size // unit) * unit


def usage_slot_offset(path, pid):
    """File offset of the `pid` field of the usage slot that `pid` holds."""
    data = path.read_bytes()
    u = ffi.cast("struct vgpu_usage *", ffi.from_buffer(data))
    for i in range(lib.VGPU_MAX_PROCS):
        if u.procs[i].pid == pid:
            return (ffi.offsetof("struct vgpu_usage", "procs") + i * ffi.sizeof("struct vgpu_usage_proc")
                    + ffi.offsetof("struct vgpu_usage_proc", "pid"))
    raise AssertionError(f"pid {pid} has no slot in {path}")


def quota_bytes(memory_max, name="c1", magic=None, abi_version=None, device_count=1):
    """A quota file as a controller would write it."""
    q = ffi.new("struct vgpu_quota *")
    q.magic = lib.VGPU_QUOTA_MAGIC if magic is None else magic
    q.abi_version = lib.VGPU_ABI_VERSION if abi_version is None else abi_version
    q.size = QUOTA_SIZE
    q.generation = 1
    q.device_count = device_count
    q.name = name.encode()
    for d in range(lib.VGPU_MAX_DEVICES):
        q.devices[d].memory_max = q.devices[d].memory_request = q.devices[d].memory_limit = memory_max
        q.devices[d].sm_max = q.devices[d].sm_request = q.devices[d].sm_limit = 10000
    return bytes(ffi.buffer(q))


MEMORY_MAX_0 = (ffi.offsetof("struct vgpu_quota", "devices")
                + ffi.offsetof("struct vgpu_quota_device", "memory_max"))
GENERATION = ffi.offsetof("struct vgpu_quota", "generation")


def resize(quota_path, memory_max):
    """What `vgpu-ctl resize` does: rewrite device 0's memory.max in place, bump generation."""
    fd = os.open(quota_path, os.O_RDWR)
    try:
        generation, = struct.unpack("<Q", os.pread(fd, 8, GENERATION))
        os.pwrite(fd, struct.pack("<Q", memory_max), MEMORY_MAX_0)
        os.pwrite(fd, struct.pack("<Q", generation + 1), GENERATION)
    finally:
        os.close(fd)


@pytest.fixture
def node(tmp_path):
    return Node(tmp_path)


# === child processes ===

PRELUDE = """
import json, os, sys
from cuda.bindings import driver as cu
MiB, GiB = 1 << 20, 1 << 30

def rc(res):
    return int((res if isinstance(res, tuple) else (res,))[0])

def ok(res):
    res = res if isinstance(res, tuple) else (res,)
    if res[0] != cu.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"CUDA call failed: {res[0]!r}")
    return None if len(res) == 1 else res[1] if len(res) == 2 else res[1:]

def context():
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(dev))))
    return dev

def step(obj):
    \"\"\"Report, then wait until the test has looked from outside.\"\"\"
    print(json.dumps(obj), flush=True)
    sys.stdin.readline()
"""


class Child:
    """A child process speaking JSON lines: it prints one line, then waits for the test's
    line before it prints the next (so at most one line is ever in flight)."""

    def __init__(self, code, env, args=(), stderr_path=None):
        self._stderr = open(stderr_path, "w+") if stderr_path else subprocess.PIPE
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True)
        self.pid = self.proc.pid

    def read(self, timeout=30):
        poller = select.poll()   # (select() cannot wait on a descriptor past 1023)
        poller.register(self.proc.stdout, select.POLLIN)
        ready = poller.poll(timeout * 1000)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            self.proc.wait(10)
            err = self.proc.stderr.read() if self._stderr is subprocess.PIPE else self._stderr_text()
            raise AssertionError(f"child {self.pid} said nothing (rc {self.proc.returncode}):\n{err}")
        return json.loads(line)

    def _stderr_text(self):
        self._stderr.seek(0)
        return self._stderr.read()

    def send(self, obj=None):
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def call(self, *cmd):
        self.send(list(cmd))
        return self.read()

    def finish(self, timeout=30):
        """Let it end (stdin closed); return (exit status, stderr)."""
        _, err = self.proc.communicate(timeout=timeout)
        if self._stderr is not subprocess.PIPE:
            err = self._stderr_text()
        return self.proc.returncode, err

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr, self._stderr):
            if f is not None and f is not subprocess.PIPE:
                f.close()   # hundreds of children in a run: no descriptor left behind


AGENT = PRELUDE + """
dev = context()
held, nvml, keys = {}, [], iter(range(1 << 30))

def alloc(size):
    res = cu.cuMemAlloc(size)
    if rc(res):
        return [rc(res), None]
    key = next(keys)            # 0, 1, 2, ... in order of successful allocations
    held[key] = res[1]
    return [0, key]

def free(key):
    return rc(cu.cuMemFree(held.pop(key)))

def info():
    res = cu.cuMemGetInfo()
    return [rc(res)] + [int(v) for v in res[1:]]

def total():
    res = cu.cuDeviceTotalMem(dev)
    return [rc(res), int(res[1])]

def nvml_handle():
    if not nvml:
        import pynvml
        pynvml.nvmlInit()
        nvml.extend([pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)])
    return nvml

def memory():
    n, h = nvml_handle()
    m1, m2 = n.nvmlDeviceGetMemoryInfo(h), n.nvmlDeviceGetMemoryInfo(h, n.nvmlMemory_v2)
    return {"v1": [m1.total, m1.free, m1.used], "v2": [m2.total, m2.reserved, m2.free, m2.used]}

def processes():
    n, h = nvml_handle()
    return sorted([p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(h))

COMMANDS = {f.__name__: f for f in (alloc, free, info, total, memory, processes)}
print(json.dumps({"pid": os.getpid()}), flush=True)
for line in sys.stdin:
    cmd, *args = json.loads(line)
    print(json.dumps(COMMANDS[cmd](*args)), flush=True)
"""


@pytest.fixture
def spawn():
    """Start long-running children (agents or scripts); every one is killed at teardown."""
    children = []

    def start(env, code=AGENT, args=(), stderr_path=None):
        child = Child(code, env, args, stderr_path)
        children.append(child)
        if code is AGENT:
            assert child.read()["pid"] == child.pid
        return child

    yield start
    for child in children:
        child.kill()


# === the cap ===

def test_allocation_beyond_the_cap_is_refused_and_the_process_keeps_working(node, spawn):
    a = spawn(node.env(limit="4Gi"))
    assert a.call("alloc", 3 * GiB) == [SUCCESS, 0]
    assert a.call("alloc", 2 * GiB) == [OUT_OF_MEMORY, None]
    assert node.usage().current == 3 * GiB
    assert node.referee().used == 3 * GiB
    assert a.call("free", 0) == SUCCESS
    assert a.call("alloc", 2 * GiB) == [SUCCESS, 1]
    assert node.usage().procs == {a.pid: 2 * GiB}
    assert node.referee().used == 2 * GiB


def test_a_long_slice_directory_is_used_whole_and_one_past_path_max_fails_closed(tmp_path, spawn):
    """The slice's paths are sized to VGPU_DIR, not to fixed buffers: a directory 3,000
    characters deep holds a working slice, and one no path under it could be opened in
    (over PATH_MAX) is refused at start, the variable named: never a silent no-cap."""
    node = Node(tmp_path)
    while len(str(node.dir)) < 3000:
        node.dir = node.dir / ("d" * 200)
    node.dir.mkdir(parents=True)
    a = spawn(node.env(limit="1Gi"))
    assert a.call("alloc", 768 * MiB) == [SUCCESS, 0]
    assert a.call("alloc", 512 * MiB) == [OUT_OF_MEMORY, None]
    assert node.usage().procs == {a.pid: 768 * MiB}

    node.dir = Path(str(node.dir) * 2)
    b = spawn(node.env(limit="1Gi"), stderr_path=tmp_path / "err")
    assert b.call("alloc", MiB) == [OUT_OF_MEMORY, None]
    assert f"VGPU_DIR is too long ({len(str(node.dir))} characters)" in (tmp_path / "err").read_text()


@pytest.mark.parametrize("failing", ["malloc,calloc,realloc", "calloc"])
def test_a_shim_out_of_memory_at_start_refuses_allocations_and_the_program_runs_on(tmp_path, spawn, c_program,
                                                                                  failing):
    """The allocations the shim itself makes fail (tests/programs/no_heap_for_shim.c,
    preloaded before it): all of them, so it cannot build its slice's paths, or only calloc,
    so it cannot write a new usage file's header.  Either way it refuses device memory (fail
    closed) with one line saying why, and the program keeps running: its calls answer,
    nothing is charged and the device holds nothing for it."""
    node = Node(tmp_path)
    env = node.env(limit="1Gi", NO_HEAP_FOR_SHIM=failing)
    env["LD_PRELOAD"] = f"{c_program('no_heap_for_shim', ('-shared', '-fPIC'))} {env['LD_PRELOAD']}"
    a = spawn(env, stderr_path=tmp_path / "err")
    assert a.call("alloc", MiB) == [OUT_OF_MEMORY, None]
    assert a.call("alloc", MiB) == [OUT_OF_MEMORY, None]
    assert a.call("info")[0] == SUCCESS
    assert node.referee().used == 0
    rc, err = a.finish()
    assert rc == 0
    assert [line for line in err.splitlines() if "vgpu[" in line] == [
        f"vgpu[{a.pid}]: error: out of memory at start-up; refusing GPU memory allocations (fail closed)"]


def test_cap_is_exact_to_the_byte_of_what_the_device_holds(node, spawn):
    """The cap counts footprints (csrc/footprint.h: 2 MiB pages from 1 MiB on, 512-byte
    rounding below), exactly: the referee holds what the usage file says."""
    a = spawn(node.env(limit="4Gi"))
    assert a.call("alloc", 4 * GiB) == [SUCCESS, 0]
    assert a.call("alloc", 1) == [OUT_OF_MEMORY, None]
    assert a.call("free", 0) == SUCCESS
    assert a.call("alloc", 4 * GiB + 1) == [OUT_OF_MEMORY, None]
    assert a.call("alloc", 4 * GiB - 2 * MiB - 1) == [SUCCESS, 1]     # takes 4 GiB - 2 MiB
    assert a.call("alloc", 1 * MiB + 1) == [SUCCESS, 2]               # a whole 2 MiB page
    assert a.call("alloc", 1) == [OUT_OF_MEMORY, None]                # 512 bytes: no room
    usage = node.usage()
    assert (usage.current, usage.peak, usage.refusals) == (4 * GiB, 4 * GiB, 3)
    assert node.referee().used == 4 * GiB
    assert a.call("free", 2) == SUCCESS
    assert a.call("alloc", 1000) == [SUCCESS, 3]                      # small: rounded to 512
    assert node.usage().current == node.referee().used == 4 * GiB - 2 * MiB + 1024


# Each family: how it allocates `charge` bytes (more than half the cap: a second one must
# be refused) and how it gives them back.  CAP = 256 MiB.
FAMILY_CAP = 256 * MiB
FAMILIES = {
    # charged what the device holds: 200 MiB + 12345 bytes take 101 pages of 2 MiB
    "cuMemAlloc": (202 * MiB, "cu.cuMemAlloc(200 * MiB + 12345)", "cu.cuMemFree(h)"),
    # 1000 bytes wide pitched to 1024: charged pitch * height, not width * height
    "cuMemAllocPitch": (160 * MiB, "cu.cuMemAllocPitch(1000, 160 * 1024, 4)", "cu.cuMemFree(h)"),
    "cuMemAllocManaged": (200 * MiB, "cu.cuMemAllocManaged(200 * MiB, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL)",
                          "cu.cuMemFree(h)"),
    "cuMemAllocAsync": (200 * MiB, "cu.cuMemAllocAsync(200 * MiB, stream)", "cu.cuMemFreeAsync(h, stream)"),
    "cuMemAllocFromPoolAsync": (200 * MiB, "cu.cuMemAllocFromPoolAsync(200 * MiB, pool, stream)",
                                "cu.cuMemFreeAsync(h, stream)"),
    "cuMemCreate": (200 * MiB, "cu.cuMemCreate(200 * MiB, vmm_prop, 0)", "cu.cuMemRelease(h)"),
    # float4 elements: 16 bytes
    "cuArrayCreate": (4096 * 3200 * 16, "cu.cuArrayCreate(array_desc(4096, 3200))", "cu.cuArrayDestroy(h)"),
    "cuArray3DCreate": (1024 * 1024 * 12 * 16, "cu.cuArray3DCreate(array3d_desc(1024, 1024, 12))",
                        "cu.cuArrayDestroy(h)"),
    # three levels: 4096x2048 + 2048x1024 + 1024x512
    "cuMipmappedArrayCreate": ((4096 * 2048 + 2048 * 1024 + 1024 * 512) * 16,
                               "cu.cuMipmappedArrayCreate(array3d_desc(4096, 2048, 0), 3)",
                               "cu.cuMipmappedArrayDestroy(h)"),
}

FAMILY_CHILD = PRELUDE + """
charge, alloc_expr, free_expr = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dev = context()
stream = ok(cu.cuStreamCreate(0))
pool_props = cu.CUmemPoolProps()
pool_props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
pool_props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
pool_props.location.id = 0
pool = ok(cu.cuMemPoolCreate(pool_props))
vmm_prop = cu.CUmemAllocationProp()
vmm_prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
vmm_prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
vmm_prop.location.id = 0

def array_desc(w, h):
    d = cu.CUDA_ARRAY_DESCRIPTOR()
    d.Width, d.Height, d.NumChannels = w, h, 4
    d.Format = cu.CUarray_format.CU_AD_FORMAT_FLOAT
    return d

def array3d_desc(w, h, depth):
    d = cu.CUDA_ARRAY3D_DESCRIPTOR()
    d.Width, d.Height, d.Depth, d.NumChannels, d.Flags = w, h, depth, 4, 0
    d.Format = cu.CUarray_format.CU_AD_FORMAT_FLOAT
    return d

def allocate():
    res = eval(alloc_expr)
    if rc(res):
        return rc(res), None, []
    return 0, res[1], [int(x) for x in res[2:]]

def release(h):
    r = rc(eval(free_expr))
    ok(cu.cuStreamSynchronize(stream))
    return r

first, h, extra = allocate()
second, _, _ = allocate()
step({"first": first, "second": second, "extra": extra})
step({"free": release(h)})
again, h, _ = allocate()
step({"again": again, "free": release(h)})
"""


FAMILY_CASES = [pytest.param(f, False, id=f) for f in FAMILIES] + [
    pytest.param(f, True, id=f + "_ptsz")
    for f in ("cuMemAllocAsync", "cuMemAllocFromPoolAsync")]


@pytest.mark.parametrize("family,per_thread", FAMILY_CASES)
def test_every_allocation_family_is_capped_and_its_free_returns_the_budget(node, spawn, tmp_path, family,
                                                                           per_thread):
    """per_thread: cuda-bindings asks for the per-thread-default-stream ABI, so the
    _ptsz hooks are the ones in use."""
    charge, alloc_expr, free_expr = FAMILIES[family]
    assert FAMILY_CAP // 2 < charge <= FAMILY_CAP
    extra = {"CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM": "1", "VGPU_LOG": "debug"} if per_thread else {}
    child = spawn(node.env(limit=f"{FAMILY_CAP}", **extra), FAMILY_CHILD, (charge, alloc_expr, free_expr),
                  stderr_path=tmp_path / "stderr")

    r = child.read()
    assert (r["first"], r["second"]) == (SUCCESS, OUT_OF_MEMORY)
    if family == "cuMemAllocPitch":
        assert r["extra"] == [1024]
    usage = node.usage()
    assert (usage.current, usage.procs) == (charge, {child.pid: charge})
    assert node.referee().used == charge

    child.send()
    assert child.read() == {"free": SUCCESS}
    assert (node.usage().current, node.usage().procs) == (0, {child.pid: 0})
    assert node.referee().used == 0

    child.send()
    assert child.read() == {"again": SUCCESS, "free": SUCCESS}
    assert node.usage().current == 0
    status, err = child.finish()
    assert status == 0, err
    if per_thread:
        assert f"-> hook {family}_ptsz" in err
        assert "-> hook cuMemFreeAsync_ptsz" in err


VMM_CHILD = PRELUDE + """
dev = context()
prop = cu.CUmemAllocationProp()
prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
granule = int(ok(cu.cuMemGetAllocationGranularity(
    prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
odd = rc(cu.cuMemCreate(granule // 2, prop, 0))
whole = cu.cuMemCreate(128 * granule, prop, 0)
one_more = rc(cu.cuMemCreate(granule, prop, 0))
step({"granule": granule, "whole": rc(whole), "one_more": one_more, "odd": odd})
released = rc(cu.cuMemRelease(whole[1]))
h = cu.cuMemCreate(granule, prop, 0)
step({"released": released, "after": rc(h)})
"""


def test_vmm_cap_counts_whole_granules(node, spawn):
    child = spawn(node.env(limit="256Mi"), VMM_CHILD)
    r = child.read()
    # half a granule is the driver's own INVALID_VALUE and charges nothing; 128 granules
    # of 2 MiB fill the cap; one more granule is refused by the cap
    assert r == {"granule": 2 * MiB, "whole": SUCCESS, "one_more": OUT_OF_MEMORY, "odd": INVALID_VALUE}
    assert node.usage().current == 256 * MiB
    assert node.referee().used == 256 * MiB
    child.send()
    assert child.read() == {"released": SUCCESS, "after": SUCCESS}
    assert node.usage().current == 2 * MiB
    assert node.referee().used == 2 * MiB


VMM_MAPPED_RELEASE = PRELUDE + """
dev = context()
prop = cu.CUmemAllocationProp()
prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
results = []
for _ in range(4):
    # the documented pattern (CUDA samples, allocators): create, map, release the handle
    # at once; the memory stays allocated until it is unmapped
    res = cu.cuMemCreate(512 * MiB, prop, 0)
    results.append(rc(res))
    if rc(res):
        continue
    va = ok(cu.cuMemAddressReserve(512 * MiB, 0, 0, 0))
    ok(cu.cuMemMap(va, 512 * MiB, 0, res[1], 0))
    ok(cu.cuMemRelease(res[1]))
step({"creates": results})
"""


def test_vmm_memory_released_while_still_mapped_stays_charged(node, spawn):
    child = spawn(node.env(limit="1Gi"), VMM_MAPPED_RELEASE)
    r = child.read()
    used = node.referee().used
    assert used <= 1 * GiB, f"the device holds {used >> 20} MiB for a container capped at 1024 MiB"
    assert r["creates"] == [SUCCESS, SUCCESS, OUT_OF_MEMORY, OUT_OF_MEMORY]


CROSS_DEVICE = PRELUDE + """
ok(cu.cuInit(0))
ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(1))))))
stream1 = ok(cu.cuStreamCreate(0))
direct = rc(cu.cuMemAlloc(512 * MiB))
ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))))
props = cu.CUmemPoolProps()
props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
props.location.id = 1
pool1 = ok(cu.cuMemPoolCreate(props))
stream0 = ok(cu.cuStreamCreate(0))
step({"direct": direct,
      "pool_of_device_1": rc(cu.cuMemAllocFromPoolAsync(512 * MiB, pool1, stream0)),
      "stream_of_device_1": rc(cu.cuMemAllocAsync(512 * MiB, stream1))})
"""


def test_stream_ordered_allocation_is_charged_to_the_device_it_lands_on(tmp_path, spawn):
    node = Node(tmp_path, devices=2)
    child = spawn(node.env(limit=None, VGPU_MEMORY_LIMIT_0="4Gi", VGPU_MEMORY_LIMIT_1="256Mi"), CROSS_DEVICE)
    r = child.read()
    used = node.referee(device=1).used
    assert used <= 256 * MiB, f"device 1 holds {used >> 20} MiB for a container capped at 256 MiB there"
    assert r == {"direct": OUT_OF_MEMORY, "pool_of_device_1": OUT_OF_MEMORY,
                 "stream_of_device_1": OUT_OF_MEMORY}


# === the view ===

def test_memory_view_shows_the_cap_and_all_views_agree(node, spawn):
    a = spawn(node.env(limit="4Gi"))
    assert a.call("alloc", 1 * GiB + 12345)[0] == SUCCESS
    used = 1 * GiB + 2 * MiB     # its footprint: whole 2 MiB pages
    assert a.call("info") == [SUCCESS, 4 * GiB - used, 4 * GiB]
    assert a.call("total") == [SUCCESS, 4 * GiB]
    assert a.call("memory") == {"v1": [4 * GiB, 4 * GiB - used, used],
                                "v2": [4 * GiB, 0, 4 * GiB - used, used]}
    referee = node.referee()
    assert (referee.total, referee.used) == (A10_MEMORY, used)


def test_memory_view_is_never_above_the_physical_device(node, spawn):
    a = spawn(node.env(limit="100Gi"))
    assert a.call("alloc", 1 * GiB)[0] == SUCCESS
    assert a.call("info") == [SUCCESS, A10_MEMORY - GiB, A10_MEMORY]
    assert a.call("total") == [SUCCESS, A10_MEMORY]
    assert a.call("memory") == {"v1": [A10_MEMORY, A10_MEMORY - GiB, GiB],
                                "v2": [A10_MEMORY, 0, A10_MEMORY - GiB, GiB]}


def test_free_is_what_the_device_has_left_when_others_filled_it(node, spawn):
    other = spawn(node.bare_env())          # another tenant, not under the shim
    a = spawn(node.env(limit="4Gi"))
    assert other.call("alloc", 23 * GiB)[0] == SUCCESS
    assert a.call("alloc", 512 * MiB)[0] == SUCCESS
    # cap - used = 3.5 GiB, but the device has only 0.5 GiB left
    assert a.call("info") == [SUCCESS, 512 * MiB, 4 * GiB]
    assert other.call("alloc", 512 * MiB)[0] == SUCCESS
    assert a.call("info") == [SUCCESS, 0, 4 * GiB]          # 0, not negative (no wrap-around)
    # under its cap but the device is full: the driver refuses, and the charge is rolled back
    assert a.call("alloc", 1 * MiB) == [OUT_OF_MEMORY, None]
    assert node.usage().current == 512 * MiB
    assert node.referee().used == A10_MEMORY


def test_nvml_free_agrees_with_cuMemGetInfo_when_others_filled_the_device(node, spawn):
    other = spawn(node.bare_env())
    a = spawn(node.env(limit="4Gi"))
    assert other.call("alloc", 23 * GiB)[0] == SUCCESS
    assert a.call("alloc", 512 * MiB)[0] == SUCCESS
    _, free, total = a.call("info")
    memory = a.call("memory")
    assert memory["v1"][:2] == [total, free]
    assert memory["v2"][0] == total and memory["v2"][2] == free


def test_process_list_shows_only_the_containers_processes(node, spawn):
    a = spawn(node.env("c1", limit="4Gi"))
    b = spawn(node.env("c2", limit="4Gi"))
    assert a.call("alloc", 256 * MiB)[0] == SUCCESS
    assert b.call("alloc", 512 * MiB)[0] == SUCCESS
    viewer = spawn(node.env("c1", limit="4Gi"))
    assert viewer.call("processes") == [[a.pid, 256 * MiB]]
    assert spawn(node.env("c2", limit="4Gi")).call("processes") == [[b.pid, 512 * MiB]]
    referee = node.referee().procs
    assert (referee[a.pid], referee[b.pid]) == (256 * MiB, 512 * MiB)


# === several processes, several containers ===

def test_two_containers_on_one_device_are_capped_independently(node, spawn):
    a = spawn(node.env("c1", limit="2Gi"))
    b = spawn(node.env("c2", limit="2Gi"))
    assert a.call("alloc", 2 * GiB)[0] == SUCCESS
    assert a.call("alloc", 1) == [OUT_OF_MEMORY, None]
    assert b.call("alloc", 2 * GiB)[0] == SUCCESS          # c1 at its cap does not touch c2
    assert b.call("alloc", 1) == [OUT_OF_MEMORY, None]
    assert a.call("info") == b.call("info") == [SUCCESS, 0, 2 * GiB]
    assert (node.usage("c1").current, node.usage("c2").current) == (2 * GiB, 2 * GiB)
    assert node.referee().used == 4 * GiB


def run_sampler(node, c_program, container="c1", interval_us=10000):
    """Start the referee sampler (no shim); close its stdin to get its JSON summary."""
    sampler = subprocess.Popen([str(c_program("shim_sampler")), str(node.usage_path(container)),
                                str(interval_us)], env=node.bare_env(), stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert json.loads(sampler.stdout.readline()) == {"sampling": True}
    return sampler


def sampler_summary(sampler):
    out, _ = sampler.communicate(timeout=30)
    return json.loads(out.strip().splitlines()[-1])


def test_processes_racing_for_the_cap_never_exceed_it(node, c_program):
    cap, chunk = 1 * GiB, 200 * MiB
    node.create(memory=str(cap))                  # read after its processes end
    sampler = run_sampler(node, c_program, interval_us=2000)
    race = subprocess.Popen([str(c_program("shim_storm")), "greedy", "8", str(chunk), "10"],
                            env=node.env(limit=None), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        held = json.loads(race.stdout.readline())
        # 8 processes x 10 attempts of 200 MiB, started together, all holding: exactly 5 fit
        assert (held["held"], held["refused"], held["errors"]) == (5, 75, 0)
        usage = node.usage()
        assert usage.current == 5 * chunk
        assert len(usage.procs) == 8 and sum(usage.procs.values()) == 5 * chunk
        assert node.referee().used == 5 * chunk
    finally:
        out, err = race.communicate("release\n", timeout=30)
    assert json.loads(out.strip().splitlines()[-1]) == {"done": True, "failed_workers": 0}, err
    seen = sampler_summary(sampler)
    assert seen["samples"] > 0 and seen["usage_samples"] > 0
    assert seen["max_used"] <= cap and seen["max_current"] <= cap
    assert (node.usage().current, node.usage().procs) == (0, {})
    assert node.referee().used == 0


STORM_SECONDS = 10


def test_storm_of_processes_never_exceeds_the_cap(node, c_program):
    """The issue's "done when": 16 processes allocating and freeing random sizes (sync and
    async) for 10 s against a 2 GiB cap; the referee never sees more than the cap."""
    cap = 2 * GiB
    node.create(memory="2Gi")                     # read after its processes end
    sampler = run_sampler(node, c_program, interval_us=10000)
    storm = subprocess.run([str(c_program("shim_storm")), "storm", "16", str(STORM_SECONDS * 1000),
                            str(256 * MiB), "20261130"],
                           env=node.env(limit=None), capture_output=True, text=True,
                           timeout=STORM_SECONDS + 60)
    seen = sampler_summary(sampler)
    assert storm.returncode == 0, storm.stderr
    totals = json.loads(storm.stdout.strip().splitlines()[0])
    print(f"storm: {totals}\nreferee: {seen}")
    assert totals["errors"] == 0 and totals["frees"] == totals["allocs"]
    assert totals["allocs"] > 1000 and totals["async_allocs"] > 0 and totals["async_frees"] > 0
    assert totals["refused"] > 0                    # the cap was really in the way
    assert seen["samples"] >= STORM_SECONDS * 20    # the referee kept looking
    assert seen["max_used"] <= cap, f"the device held {seen['max_used'] - cap} bytes over the cap"
    # the counters: a refused request of two racing ones shows for an instant, then goes
    assert seen["max_current"] <= cap + 256 * MiB
    assert seen["max_used"] > cap // 2               # and the storm did press against it
    usage = node.usage()
    assert (usage.current, usage.procs) == (0, {})
    assert usage.refusals == totals["refused"]
    assert node.referee().used == 0


# === process lifecycle ===

def test_killed_process_memory_returns_to_the_container(node, spawn):
    """kill -9: the budget comes back through the slot's lock, not the pid (here the dead
    process's slot is even made to name a live pid before anyone looks: a process started
    after the victim's slot was claimed, as one that reused its pid would be)."""
    survivor = spawn(node.env(limit="2Gi"))
    for reaped_by in ("view", "refused allocation"):
        victim = spawn(node.env(limit="2Gi"))
        assert victim.call("alloc", 1 * GiB)[0] == SUCCESS
        claimed_by = boot_ticks()        # (no earlier than the time the victim's slot records)
        assert node.usage().procs == {survivor.pid: 0, victim.pid: GiB}
        offset = usage_slot_offset(node.usage_path(), victim.pid)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        assert wait_until(lambda: boot_ticks() > claimed_by, 5, every=0.002)
        later = subprocess.Popen(["sleep", "600"])
        try:
            fd = os.open(node.usage_path(), os.O_WRONLY)
            os.pwrite(fd, struct.pack("<i", later.pid), offset)         # a later process at its pid: "pid reuse"
            os.close(fd)
            if reaped_by == "view":
                t0 = time.monotonic()
                wait_until(lambda: survivor.call("info") == [SUCCESS, 2 * GiB, 2 * GiB], 5,
                           "the victim's slot reaped by a view", every=0.05)
                took = time.monotonic() - t0
                assert node.usage().current == 0
            else:
                t0 = time.monotonic()
                assert survivor.call("alloc", 2 * GiB)[0] == SUCCESS
                took = time.monotonic() - t0
                assert node.usage().current == 2 * GiB
            assert took < 5
            assert later.pid not in node.usage().procs
        finally:
            later.kill()
            later.wait(10)
    assert node.usage().procs == {survivor.pid: 2 * GiB}
    assert node.referee().used == 2 * GiB


EXIT_WITHOUT_FREE = PRELUDE + """
context()
held = [ok(cu.cuMemAlloc(512 * MiB)), ok(cu.cuMemAlloc(256 * MiB))]
print("holding", flush=True)
"""


def test_exit_with_live_allocations_returns_the_budget_at_once(node):
    node.create(memory="1Gi")                     # read after its process ends
    run_python(EXIT_WITHOUT_FREE, node.env(limit=None))
    usage = node.usage()
    assert (usage.current, usage.peak, usage.procs) == (0, 768 * MiB, {})
    assert node.referee().used == 0
    # and the whole cap is there for the next process
    run_python(PRELUDE + "context(); ok(cu.cuMemAlloc(GiB))", node.env(limit=None))


FORKED = PRELUDE + """
import time
release = sys.argv[1]
context()
held = ok(cu.cuMemAlloc(GiB))
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.close(r)
    calls = [rc(cu.cuMemAlloc(512 * MiB)), rc(cu.cuMemFree(held)), rc(cu.cuMemGetInfo())]
    os.write(w, json.dumps(calls).encode())
    os.close(w)
    while not os.path.exists(release):   # a DataLoader worker outliving its parent
        time.sleep(0.02)
    os._exit(0)
os.close(w)
step({"parent": os.getpid(), "child": child, "child_calls": json.loads(os.fdopen(r).read())})
"""


@pytest.mark.parametrize("parent_ends", ["exit", "kill -9"])
def test_forked_child_keeps_its_parents_charge_until_it_exits(node, spawn, tmp_path, parent_ends):
    """A child forked after CUDA was initialised cannot use it, but holds the driver's
    descriptors it inherited, and with them the parent's memory: the charge stays while
    either lives, and the slice's cap counts it."""
    release = tmp_path / "release"
    p = spawn(node.env(limit="2Gi"), FORKED, args=(release,))
    try:
        r = p.read()
        parent, child = r["parent"], r["child"]
        assert r["child_calls"] == [NOT_INITIALIZED] * 3
        assert (node.usage().procs, node.referee().procs) == ({parent: GiB}, {parent: GiB})

        if parent_ends == "exit":
            p.send()
            assert p.proc.wait(10) == 0
        else:
            p.kill()
        usage, referee = node.usage(), node.referee()        # (dead slots reaped first)
        assert (usage.current, usage.procs) == (GiB, {parent: GiB})
        assert (referee.used, referee.procs) == (GiB, {parent: GiB})
        assert probe(node.env(limit="2Gi"), GiB + MiB, GiB)[0]["allocs"] == [OUT_OF_MEMORY, SUCCESS]
    finally:
        release.touch()         # a failed run leaves no child waiting for it
    wait_gone(child)
    assert (node.usage().current, node.usage().procs, node.referee().used) == (0, {}, 0)


REUSED_PID = """
import ctypes, json, os, time
import pynvml as n

def say(obj):
    os.write(1, (json.dumps(obj) + "\\n").encode())

# A: NVML only, so CUDA stays usable in its children; its view reaps the dead slot the test
# wrote, and reading that slot's owner reads A's own identity
n.nvmlInit()
n.nvmlDeviceGetComputeRunningProcesses(n.nvmlDeviceGetHandleByIndex(0))
time.sleep(0.05)                   # (a clock tick at least between A's start and C's)
a = os.getpid()
if os.fork():
    say({"a": a})
    os._exit(0)
os.read(0, 3)                      # B: A is gone; a child C with A's pid
deadline = time.monotonic() + 20
for _ in range(50):
    # another process (the suite runs in parallel) may hold A's pid for a while: wait it out
    while os.path.exists(f"/proc/{a}") and time.monotonic() < deadline:
        time.sleep(0.01)
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(a - 1))
    c = os.fork()
    if c == 0:
        if os.getpid() != a:
            os._exit(3)
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
        say({"c": os.getpid(), "rcs": [cuda.cuInit(0), cuda.cuDeviceGet(ctypes.byref(dev), 0),
                                       cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                                       cuda.cuCtxSetCurrent(ctx),
                                       cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20))]})
        while os.read(0, 1):
            pass
        os._exit(0)
    if os.waitpid(c, 0)[1] >> 8 != 3:
        os._exit(0)
say({"c": None})
"""


def test_a_process_at_an_ancestors_pid_records_its_own_identity_in_its_slot(node):
    """The shim reads its process's identity once: a child forked after that reads its own.
    Its pid tells it apart from its parent, but not from an ancestor that has exited: A
    reads its identity, forks B and exits; B forks C, which gets A's pid (set through
    ns_last_pid) and allocates.  C's slot must name C (a time C ran at), or the reapers and
    the node agent would take C for A, whose slot names a time before C started."""
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("needs root: the next pid is set through /proc/sys/kernel/ns_last_pid")
    node.create(memory="4Gi")
    buf = bytearray(node.usage_path().read_bytes())
    u = ffi.cast("struct vgpu_usage *", ffi.from_buffer(buf))
    u.procs[0].pid, u.procs[0].pid_ns, u.procs[0].start_ticks = 4_000_000, procfs.pid_ns(), 1   # gone
    u.charge[0][0], u.slots_used = 64 * MiB, 1
    node.usage_path().write_bytes(bytes(buf))
    p = subprocess.Popen([sys.executable, "-c", REUSED_PID], env=node.env(limit=None), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        a = json.loads(p.stdout.readline() or "{}").get("a")
        assert a and p.wait(30) == 0, p.stderr.read()
        a_start = {x.start_ticks for x in slices.read_usage(node.dir, "c1").procs if x.pid == a}
        assert len(a_start) == 1, "A claimed no slot"
        p.stdin.write(b"go\n")
        p.stdin.flush()
        c = json.loads(p.stdout.readline())
        assert c == {"c": a, "rcs": [SUCCESS] * 5}, "no child got A's pid (another process took it)"
        c_start = procfs.start_ticks(a)
        (a_record,) = a_start
        assert not procfs.started_by(c_start, a_record), "A's slot names C"
        c_record = {x.start_ticks for x in slices.read_usage(node.dir, "c1").procs if x.pid == a} - a_start
        assert len(c_record) == 1 and procfs.started_by(c_start, c_record.pop()), "C's slot does not name C"
    finally:
        p.stdin.close()          # C ends on it, and B after C
        p.wait(30)
    wait_gone(a)


# === memory shared between processes (IPC, shareable handles): the exporter pays ===

IPC_EXPORTER = PRELUDE + """
import ctypes
context()
p = ok(cu.cuMemAlloc(512 * MiB))
h = ok(cu.cuIpcGetMemHandle(p))
step({"pid": os.getpid(), "handle": ctypes.string_at(h.getPtr(), 64).hex()})
ok(cu.cuMemFree(p))
step({"freed": True})
"""

IPC_IMPORTER = PRELUDE + """
import ctypes
context()
h = cu.CUipcMemHandle()
ctypes.memmove(h.getPtr(), bytes.fromhex(sys.argv[1]), 64)
res = cu.cuIpcOpenMemHandle(h, 1)
step({"pid": os.getpid(), "open": rc(res)})
step({"close": rc(cu.cuIpcCloseMemHandle(res[1]))})
"""


@pytest.mark.parametrize("exporter_ends", ["free", "kill -9"])
def test_ipc_memory_stays_charged_to_the_exporters_slice_until_its_last_holder_lets_go(node, spawn,
                                                                                       exporter_ends):
    e = spawn(node.env(limit="1Gi"), IPC_EXPORTER)
    er = e.read()
    i = spawn(node.env(limit="1Gi"), IPC_IMPORTER, args=(er["handle"],))
    assert i.read()["open"] == SUCCESS
    usage, referee = node.usage(), node.referee()
    assert (usage.current, referee.used, referee.procs[e.pid]) == (512 * MiB, 512 * MiB, 512 * MiB)
    assert usage.procs == {e.pid: 0, i.pid: 0}   # in a slot of its own, held by both

    if exporter_ends == "free":
        assert e.call() == {"freed": True}
    else:
        e.kill()
    # the importer keeps it on the device: still the slice's, and its cap counts it
    usage, referee = node.usage(), node.referee()
    assert (usage.current, referee.used, referee.procs.get(e.pid)) == (512 * MiB, 512 * MiB, 512 * MiB)
    assert probe(node.env(limit="1Gi"), 512 * MiB + MiB, 512 * MiB)[0]["allocs"] == [OUT_OF_MEMORY, SUCCESS]

    assert i.call() == {"close": SUCCESS}
    assert (node.usage().current, node.referee().used) == (0, 0)


def test_ipc_memory_a_holder_killed_keeps_is_given_back_when_the_last_one_goes(node, spawn):
    """Importer killed -9 while the exporter holds the memory; then the exporter frees it."""
    e = spawn(node.env(limit="1Gi"), IPC_EXPORTER)
    er = e.read()
    i = spawn(node.env(limit="1Gi"), IPC_IMPORTER, args=(er["handle"],))
    assert i.read()["open"] == SUCCESS
    i.kill()
    assert (node.usage().current, node.referee().used) == (512 * MiB, 512 * MiB)
    assert e.call() == {"freed": True}
    assert (node.usage().current, node.referee().used) == (0, 0)


def test_ipc_import_from_another_slice_is_charged_to_the_importers_slice(node, spawn):
    """The importer's slice cannot see the exporter's: it pays for what it keeps alive,
    admitted against its own cap."""
    e = spawn(node.env("c1", limit="1Gi"), IPC_EXPORTER)
    er = e.read()
    small = spawn(node.env("c3", limit="256Mi"), IPC_IMPORTER, args=(er["handle"],))
    assert small.read()["open"] == OUT_OF_MEMORY
    i = spawn(node.env("c2", limit="1Gi"), IPC_IMPORTER, args=(er["handle"],))
    assert i.read()["open"] == SUCCESS
    assert (node.usage("c1").current, node.usage("c2").current, node.usage("c3").current) == \
        (512 * MiB, 512 * MiB, 0)
    assert e.call() == {"freed": True}
    assert (node.usage("c1").current, node.usage("c2").current) == (0, 512 * MiB)
    assert node.referee().used == 512 * MiB
    assert i.call() == {"close": SUCCESS}
    assert (node.usage("c2").current, node.referee().used) == (0, 0)


IPC_PEER = PRELUDE + """
import ctypes
context()
held = {}

def export(size):
    p = ok(cu.cuMemAlloc(size))
    h = ok(cu.cuIpcGetMemHandle(p))
    held[0] = p
    return ctypes.string_at(h.getPtr(), 64).hex()

def open_(handle):
    h = cu.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), bytes.fromhex(handle), 64)
    res = cu.cuIpcOpenMemHandle(h, 1)
    held[0] = res[1]
    return rc(res)

def free():
    return rc(cu.cuMemFree(held.pop(0)))

def close():
    return rc(cu.cuIpcCloseMemHandle(held.pop(0)))

COMMANDS = {"export": export, "open": open_, "free": free, "close": close}
print(json.dumps({"pid": os.getpid()}), flush=True)
for line in sys.stdin:
    cmd, *args = json.loads(line)
    print(json.dumps(COMMANDS[cmd](*args)), flush=True)
"""


def test_exporter_and_importer_letting_go_at_once_leave_nothing_charged(node, spawn):
    """The last two holders let go at the same moment, 200 times: one of them drains the
    shared slot, never neither (a charge with no holder) nor a slot drained under a holder."""
    e, i = spawn(node.env(limit="1Gi"), IPC_PEER), spawn(node.env(limit="1Gi"), IPC_PEER)
    for peer in (e, i):
        assert peer.read()["pid"] == peer.pid
    for n in range(200):
        handle = e.call("export", 64 * MiB)
        assert i.call("open", handle) == SUCCESS
        first, second = (e, i) if n % 2 else (i, e)
        first.send(["free" if first is e else "close"])
        second.send(["free" if second is e else "close"])
        assert (first.read(), second.read()) == (SUCCESS, SUCCESS)
        if n % 50 == 49:
            assert (node.usage().current, node.referee().used) == (0, 0)
    assert node.usage(reap=False).current == 0   # drained by its last holder, not by a reaper


VMM_SHARING = PRELUDE + """
import socket
context()
size = 64 * MiB
POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
loc = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop = cu.CUmemAllocationProp()
prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type, prop.location.id, prop.requestedHandleTypes = loc, 0, POSIX_FD

def mapped(handle):
    va = ok(cu.cuMemAddressReserve(size, 0, 0, 0))
    ok(cu.cuMemMap(va, size, 0, handle, 0))
    return va

if sys.argv[1] == "export":
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(sys.argv[2])
    srv.listen(1)
    h = ok(cu.cuMemCreate(size, prop, 0))
    va = mapped(h)
    step({"pid": os.getpid()})
    conn, _ = srv.accept()
    fd = ok(cu.cuMemExportToShareableHandle(h, POSIX_FD, 0))
    socket.send_fds(conn, [b"x"], [fd])
    os.close(fd)
    step({"sent": True})
    ok(cu.cuMemUnmap(va, size))
    ok(cu.cuMemRelease(h))
    step({"released": True})
else:
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(sys.argv[2])
    _, fds, _, _ = socket.recv_fds(conn, 1, 1)
    h = ok(cu.cuMemImportFromShareableHandle(fds[0], POSIX_FD))
    os.close(fds[0])
    va = mapped(h)
    again = ok(cu.cuMemRetainAllocationHandle(va))
    ok(cu.cuMemRelease(h))
    step({"imported": True})
    ok(cu.cuMemUnmap(va, size))
    step({"unmapped": True})          # the retained reference still holds it
    ok(cu.cuMemRelease(again))
    step({"released": True})
"""


def test_shareable_vmm_memory_stays_charged_while_an_importer_holds_it(node, spawn, tmp_path):
    path = tmp_path / "sock"
    e = spawn(node.env(limit="1Gi"), VMM_SHARING, args=("export", path))
    pid = e.read()["pid"]
    i = spawn(node.env(limit="1Gi"), VMM_SHARING, args=("import", path))
    assert e.call() == {"sent": True}
    assert i.read() == {"imported": True}
    assert (node.usage().current, node.referee().used, node.referee().procs[pid]) == (64 * MiB,) * 3
    assert e.call() == {"released": True}    # released and unmapped by its exporter
    assert (node.usage().current, node.referee().used) == (64 * MiB, 64 * MiB)
    assert i.call() == {"unmapped": True}
    assert (node.usage().current, node.referee().used) == (64 * MiB, 64 * MiB)
    assert i.call() == {"released": True}
    assert (node.usage().current, node.referee().used) == (0, 0)


VMM_PARKING = PRELUDE + """
import socket
context()
POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
prop = cu.CUmemAllocationProp()
prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type, prop.location.id = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, 0
prop.requestedHandleTypes = POSIX_FD
srv = socket.socket(socket.AF_UNIX)
srv.bind(sys.argv[1])
srv.listen(1)
step({"pid": os.getpid()})
conn, _ = srv.accept()

def park():
    res = cu.cuMemCreate(GiB, prop, 0)
    if rc(res):
        return rc(res)
    fd = ok(cu.cuMemExportToShareableHandle(res[1], POSIX_FD, 0))
    socket.send_fds(conn, [b"x"], [fd])      # to a process that never touches CUDA
    os.close(fd)
    ok(cu.cuMemRelease(res[1]))              # no handle, no mapping left here
    return 0

step({"created": [park() for _ in range(3)]})
step({"again": park()})
"""

# holds every descriptor it is sent until its stdin closes; no CUDA, no shim
PARKER = """
import os, socket, sys, threading
conn = socket.socket(socket.AF_UNIX)
conn.connect(sys.argv[1])
held = []
threading.Thread(target=lambda: held.extend(f for _, fds, _, _ in iter(lambda: socket.recv_fds(conn, 1, 4), (b"", [], 0, None)) for f in fds), daemon=True).start()
print('{"connected": true}', flush=True)
sys.stdin.read()
"""


def test_memory_exported_to_a_descriptor_parked_outside_cuda_stays_charged_until_the_driver_lets_go(
        node, spawn, tmp_path):
    """An exporter passes POSIX descriptors of its memory to a process with no CUDA (and so
    no slot) and releases every handle: the driver keeps the memory for the descriptor.
    Before, the shim refunded it at the release, and a 1 GiB slice put 3 GiB on the device
    (the referee's figure).  Now the export's shared slot stays charged while the driver
    still lists its memory under the exporter: the second GiB is refused, the device holds
    the cap, alive exporter or dead; when the parker closes them, the next reap gives it back."""
    path = tmp_path / "sock"
    e = spawn(node.env(limit="1Gi"), VMM_PARKING, args=(path,))
    pid = e.read()["pid"]
    parker = spawn(node.bare_env(), PARKER, args=(path,))
    assert parker.read() == {"connected": True}
    assert e.call() == {"created": [SUCCESS, OUT_OF_MEMORY, OUT_OF_MEMORY]}

    def reaped():        # by a host reaper that can ask NVML (the one NVML of the node)
        run_python(f"from vgpu import slices; slices.reap_slice({str(node.dir)!r}, 'c1')", node.bare_env())
        return node.usage(reap=False)

    usage, referee = reaped(), node.referee()
    assert (usage.current, referee.used, referee.procs[pid]) == (GiB, GiB, GiB)
    assert usage.procs == {pid: 0}                       # the GiB is the export's shared slot's
    assert e.call() == {"again": OUT_OF_MEMORY}
    e.proc.stdin.close()
    e.proc.wait(30)                                      # the exporter gone: the parker still holds it
    assert (reaped().current, node.referee().used) == (GiB, GiB)
    parker.proc.stdin.close()
    parker.proc.wait(30)
    wait_until(lambda: reaped().current == 0 and node.referee().used == 0, 10, "the parker's GiB to be freed")


def test_threads_racing_the_first_call_are_accounted_exactly(node, c_program):
    """16 threads make their first driver calls (cuInit, context, cuMemAlloc) at once:
    (i + 1) x (64 MiB + 1) each, 136 units asked of a 1 GiB cap."""
    unit, churn = 64 * MiB + 1, 500
    prog = subprocess.Popen([str(c_program("shim_threads")), "16", str(unit), str(churn)],
                            env=node.env(limit="1Gi"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(prog.stdout.readline())
        assert first["errors"] == 0
        assert len(first["ok"]) + first["refused"] == 16 and first["refused"] > 0
        assert first["sum_ok"] == sum(first["ok"])
        held = sum(footprint(n) for n in first["ok"])
        assert held <= GiB
        usage = node.usage()
        assert usage.current == held
        assert usage.procs == {prog.pid: held}
        assert usage.refusals == first["refused"]
        assert node.referee().used == held

        prog.stdin.write("churn\n")
        prog.stdin.flush()
        churned = json.loads(prog.stdout.readline())
        assert churned == {"phase": "churned", "errors": 0, "churn_ok": 16 * churn * 3}
        assert node.usage().current == held
        assert node.referee().used == held

        prog.stdin.write("free\n")
        prog.stdin.flush()
        assert json.loads(prog.stdout.readline()) == {"phase": "freed", "errors": 0}
        assert (node.usage().current, node.usage().procs) == (0, {prog.pid: 0})
        assert node.referee().used == 0
    finally:
        _, err = prog.communicate("exit\n", timeout=30)
    assert prog.returncode == 0, err


# === quota: read-only to the container, resizable from outside ===

def test_shim_maps_the_quota_read_only_and_never_writes_it(node, spawn):
    a = spawn(node.env(limit="1Gi"))
    quota = node.quota_path()
    before = quota.read_bytes(), quota.stat()
    q = ffi.cast("struct vgpu_quota *", ffi.from_buffer(before[0]))
    assert (q.magic, q.abi_version, q.size) == (lib.VGPU_QUOTA_MAGIC, lib.VGPU_ABI_VERSION, QUOTA_SIZE)
    assert (q.devices[0].memory_max, ffi.string(q.name)) == (GiB, b"c1")
    assert stat.S_IMODE(before[1].st_mode) & 0o022 == 0     # nobody but its owner may write it

    maps = {}
    for line in open(f"/proc/{a.pid}/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] in (str(quota), str(node.usage_path())):
            maps[fields[5]] = fields[1]
    assert maps == {str(quota): "r--s", str(node.usage_path()): "rw-s"}

    time.sleep(0.01)    # so that a write would show in the mtime
    assert a.call("alloc", GiB)[0] == SUCCESS
    assert a.call("alloc", 1)[0] == OUT_OF_MEMORY
    assert a.call("free", 0) == SUCCESS
    b = spawn(node.env(limit="8Gi"))                         # the quota exists: its limits apply
    assert b.call("alloc", GiB + 1)[0] == OUT_OF_MEMORY
    assert b.call("alloc", GiB)[0] == SUCCESS
    assert b.finish()[0] == 0
    after = quota.read_bytes(), quota.stat()
    assert after[0] == before[0]
    assert (after[1].st_mtime_ns, after[1].st_ino) == (before[1].st_mtime_ns, before[1].st_ino)


def _as_nobody():
    """preexec_fn: the child drops to nobody (65534) before it runs."""
    os.setgid(65534)
    os.setuid(65534)


def test_container_cannot_raise_its_own_cap(c_program):
    """Deployment shape: the controller writes the quota (mode 0444, in a directory the
    container cannot write); the container runs unprivileged.  When the tests run as root
    (where chmod stops nothing) the container process runs as nobody."""
    as_root = os.geteuid() == 0
    root = Path(tempfile.mkdtemp(prefix="vgpu-ro-"))   # reachable by nobody, unlike tmp_path
    node = Node(root)
    ctr = node.quota_path().parent
    try:
        root.chmod(0o755)
        client = root / "shim_readonly_client"
        shutil.copy(c_program("shim_readonly_client"), client)
        client.chmod(0o755)
        node.state.mkdir()
        node.state.chmod(0o777)
        ctr.mkdir(parents=True)
        node.quota_path().write_bytes(quota_bytes(256 * MiB))
        node.quota_path().chmod(0o444)
        node.usage_path().touch(mode=0o600)
        if as_root:
            os.chown(node.usage_path(), 65534, 65534)
        ctr.chmod(0o555)
        out = subprocess.run([str(client), str(node.quota_path()), str(256 * MiB)],
                             env=node.env(limit="100Gi"), capture_output=True, text=True, timeout=60,
                             preexec_fn=_as_nobody if as_root else None, cwd=root)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"open_for_writing": errno.EACCES, "unlink": errno.EACCES,
                                          "alloc_cap": SUCCESS, "alloc_one_more": OUT_OF_MEMORY}
        assert node.quota_path().read_bytes() == quota_bytes(256 * MiB)
        assert node.usage().current == 0
    finally:
        if ctr.exists():
            ctr.chmod(0o755)
        shutil.rmtree(root, ignore_errors=True)


def test_live_resize_applies_to_a_running_process(node, spawn):
    a = spawn(node.env(limit="1Gi"))
    assert a.call("alloc", 1536 * MiB) == [OUT_OF_MEMORY, None]
    resize(node.quota_path(), 2 * GiB)
    assert a.call("info") == [SUCCESS, 2 * GiB, 2 * GiB]
    assert a.call("alloc", 1536 * MiB) == [SUCCESS, 0]     # no restart
    assert node.usage().current == 1536 * MiB

    resize(node.quota_path(), 512 * MiB)                    # below what it holds
    assert a.call("info") == [SUCCESS, 0, 512 * MiB]
    assert a.call("alloc", 1) == [OUT_OF_MEMORY, None]
    assert node.usage().current == 1536 * MiB               # nothing is taken away
    assert a.call("free", 0) == SUCCESS
    assert a.call("alloc", 512 * MiB)[0] == SUCCESS          # fits again once use dropped
    assert a.call("alloc", 1) == [OUT_OF_MEMORY, None]
    assert node.referee().used == 512 * MiB


# === configuration: fail closed on anything malformed, fail open with no configuration ===

PROBE = PRELUDE + """
dev = context()
allocs = []
for size in map(int, sys.argv[1:]):
    allocs.append(rc(cu.cuMemAlloc(size)))
res = cu.cuMemGetInfo()
print(json.dumps({"allocs": allocs, "info": [int(res[1]), int(res[2])],
                  "total": int(cu.cuDeviceTotalMem(dev)[1])}))
"""


def probe(env, *sizes):
    out = run_python(PROBE, env, args=[str(s) for s in sizes], timeout=60)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    return json.loads(out.stdout.strip().splitlines()[-1]), lines


DENIED = {"allocs": [OUT_OF_MEMORY], "info": [0, 0], "total": 0}


def assert_fails_closed(env, *names):
    """One stderr line naming the problem; every allocation refused; the view shows 0."""
    result, stderr = probe(env, MiB)
    assert result == DENIED
    assert len(stderr) == 1, stderr
    assert stderr[0].startswith("vgpu[") and ": error: " in stderr[0]
    for name in names:
        assert str(name) in stderr[0]


def test_malformed_limit_fails_closed_naming_the_variable(node):
    assert_fails_closed(node.env(limit="abc"), "VGPU_MEMORY_LIMIT=abc")


def test_a_malformed_per_device_limit_fails_closed_naming_it_among_good_ones(node):
    # each value is parsed once for all the devices it covers: device 3's own variable
    # is still read, and named, after the all-devices one served devices 0-2
    assert_fails_closed(node.env(limit="4Gi", VGPU_MEMORY_LIMIT_3="abc"), "VGPU_MEMORY_LIMIT_3=abc")


@pytest.mark.parametrize("variables,cap", [
    ({"CUDA_DEVICE_MEMORY_LIMIT": "1024m"}, GiB),                              # HAMi-core style
    ({"VGPU_MEMORY_LIMIT": "4Gi", "VGPU_MEMORY_LIMIT_0": "1Gi"}, GiB),         # per device wins
    ({"VGPU_MEMORY_LIMIT": "1073741824"}, GiB),                                # plain bytes
    ({"CUDA_DEVICE_MEMORY_LIMIT": "4g", "CUDA_DEVICE_MEMORY_LIMIT_0": "512m"}, 512 * MiB),
    ({"VGPU_MEMORY_LIMIT": "768Mi", "CUDA_DEVICE_MEMORY_LIMIT": "4096m"}, 768 * MiB),  # ours first
    ({"CUDA_DEVICE_MEMORY_LIMIT": "1g"}, GiB),                                  # HAMi's g: binary
    # names the shim's one pass over the environment must not take for device 0's
    ({"VGPU_MEMORY_LIMIT": "768Mi", "VGPU_MEMORY_LIMIT_00": "1Gi", "VGPU_MEMORY_LIMIT_0X": "1Gi",
      "VGPU_MEMORY_LIMITS": "1Gi", "VGPU_MEMORY_LIMIT_16": "1Gi", "VGPU_MEMORY_LIMIT_1": "1Gi"}, 768 * MiB),
    ({"VGPU_MEMORY_LIMIT": "1Gi", "VGPU_MEMORY_LIMIT_0": ""}, GiB),             # empty: unset
], ids=["hami", "per_device", "bytes", "hami_per_device", "vgpu_before_hami", "hami_g_is_binary",
        "look_alike_names", "empty_per_device"])
def test_limit_variables_set_the_cap(node, variables, cap):
    result, stderr = probe(node.env(limit=None, **variables), cap, 1)
    assert result == {"allocs": [SUCCESS, OUT_OF_MEMORY], "info": [0, cap], "total": cap}
    assert stderr == []


GARBAGE = bytes((i * 167 + 13) & 0xff for i in range(64 * 1024))


def test_named_container_without_quota_or_limits_fails_closed(node):
    assert_fails_closed(node.env(limit=None), node.quota_path())


@pytest.mark.parametrize("content", [
    GARBAGE[:QUOTA_SIZE],
    quota_bytes(GiB)[:100],
    quota_bytes(GiB, abi_version=lib.VGPU_ABI_VERSION + 1),
    quota_bytes(GiB, magic=lib.VGPU_USAGE_MAGIC),
], ids=["garbage", "truncated", "other_abi_version", "wrong_magic"])
def test_bad_quota_file_fails_closed_naming_the_file(node, content):
    node.quota_path().parent.mkdir(parents=True)
    node.quota_path().write_bytes(content)
    assert_fails_closed(node.env(limit=None), node.quota_path())
    assert_fails_closed(node.env(limit="4Gi"), node.quota_path())   # the env does not paper over it


@pytest.mark.parametrize("content", [GARBAGE[:USAGE_SIZE], b"\0" * 100],
                         ids=["garbage", "truncated"])
def test_bad_usage_file_fails_closed_naming_the_file(node, content):
    node.quota_path().parent.mkdir(parents=True)
    node.quota_path().write_bytes(quota_bytes(GiB))
    node.usage_path().write_bytes(content)
    assert_fails_closed(node.env(limit=None), node.usage_path())


def test_no_configuration_passes_through_untouched(node):
    env = node.bare_env(LD_PRELOAD=str(SHIM))
    result, stderr = probe(env, A10_MEMORY)
    assert result == {"allocs": [SUCCESS], "info": [0, A10_MEMORY], "total": A10_MEMORY}
    assert stderr == []


def test_container_name_with_path_tricks_is_refused(node, tmp_path):
    assert_fails_closed(node.env("../evil", limit="1Gi"), "VGPU_SLICE=../evil")
    assert not (tmp_path / "evil").exists()
    assert not node.dir.exists() or list(node.dir.iterdir()) == []


def test_the_old_variable_vgpu_container_names_the_slice_where_vgpu_slice_is_unset(node):
    # VGPU_CONTAINER: VGPU_SLICE's old name, still read until the next release (an image's
    # older tools may set only it); where both are set VGPU_SLICE wins
    node.create("old", memory="1Gi")
    node.create("new", memory="2Gi")
    shim = dict(LD_PRELOAD=str(SHIM), VGPU_DIR=node.dir)
    for names, cap in [({"VGPU_CONTAINER": "old"}, GiB), ({"VGPU_SLICE": "", "VGPU_CONTAINER": "old"}, GiB),
                       ({"VGPU_SLICE": "new", "VGPU_CONTAINER": "old"}, 2 * GiB), ({"VGPU_SLICE": "new"}, 2 * GiB)]:
        result, stderr = probe(node.bare_env(**shim, **names), 768 * MiB, 768 * MiB)
        assert (result["total"], result["allocs"]) == (cap, [SUCCESS, SUCCESS if cap > GiB else OUT_OF_MEMORY]), names
        assert stderr == [], names
    assert_fails_closed(node.bare_env(**shim, VGPU_CONTAINER="../evil"), "VGPU_CONTAINER=../evil")


@pytest.mark.parametrize("limit, cap", [("1G", 10**9), ("900M", 900 * 10**6), ("1000000k", 10**9),
                                        ("1000000K", 10**9)])
def test_decimal_units_mean_what_they_mean_to_vgpu_ctl_and_kubernetes(node, limit, cap):
    # one grammar for vgpu's inputs: 1G is 10^9 bytes (vgpu-ctl shows it as 953.67Mi)
    result, stderr = probe(node.env(limit=limit), 512 * MiB, 512 * MiB)
    assert result["total"] == cap and result["allocs"] == [SUCCESS, OUT_OF_MEMORY] and stderr == []


def test_a_bare_number_below_a_mib_is_a_unit_left_out_and_fails_closed_saying_so(node):
    # vgpu-ctl refuses `--memory 4` the same way (src/vgpu/quantities.py)
    assert_fails_closed(node.env(limit="4"), "VGPU_MEMORY_LIMIT=4 has no unit", "did you mean 4Gi?")


def test_limit_with_a_leading_blank_and_minus_sign_fails_closed(node):
    assert_fails_closed(node.env(limit=" -1"), "VGPU_MEMORY_LIMIT")


FREE_WHEN_DENIED = PRELUDE + """
context()
print(json.dumps({"alloc": rc(cu.cuMemAlloc(MiB)), "free_null": rc(cu.cuMemFree(0))}))
"""


def test_fail_closed_process_survives_its_free_calls(node):
    out = run_python(FREE_WHEN_DENIED, node.env(limit="abc"), check=False, timeout=60)
    assert out.returncode == 0, f"exit status {out.returncode}: {out.stderr}"
    assert json.loads(out.stdout) == {"alloc": OUT_OF_MEMORY, "free_null": SUCCESS}
