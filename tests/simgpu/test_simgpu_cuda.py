"""simgpu's libcuda.so.1, driven through NVIDIA's driver API client (cuda-bindings), ctypes
and a C program that finds the driver with dlopen.

Every check runs in child processes bound to a fresh simgpu node: libcuda is never loaded
into the pytest process.  Multi-process checks use real processes (and kill -9).
"""
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.paths import CUDART13_REQUESTS, ROOT
from tests.helpers.simnode import make_sim_env, run_python, start_python
from tests.helpers.wait import wait_gone
from vgpu.paths import SIMGPU_DIR
from vgpu.sim import PROFILES

GiB = 1 << 30
MiB = 1 << 20
ENTRY_POINTS_H = ROOT / "csrc" / "cuda_entry_points.h"
LIBCUDA = SIMGPU_DIR / "libcuda.so.1"

# CUresult values (cuda.h) the checks compare against.
SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, NOT_INITIALIZED = 0, 1, 2, 3
NO_DEVICE, INVALID_DEVICE, INVALID_CONTEXT = 100, 101, 201
INVALID_HANDLE, NOT_FOUND, NOT_READY, NOT_SUPPORTED = 400, 500, 600, 801
# CUdriverProcAddressQueryResult
PROC_SUCCESS, PROC_SYMBOL_NOT_FOUND, PROC_VERSION_NOT_SUFFICIENT = 0, 1, 2
PER_THREAD = 2   # CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM

# Compute capability is not part of vgpu.sim.Profile; every profile must have one here.
COMPUTE_CAPABILITY = {"a10": (8, 6), "a100-40g": (8, 0), "h100-80g": (9, 0), "h200": (9, 0)}

# A child's toolkit: `ok` unwraps a cuda-bindings result tuple or exits with the error,
# `rc` is the bare CUresult as an int.
PRELUDE = """
import ctypes, json, os, sys, time
from cuda.bindings import driver as cu

def ok(res):
    res = res if isinstance(res, tuple) else (res,)
    if res[0] != cu.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"CUDA call failed: {res[0]!r}")
    return None if len(res) == 1 else res[1] if len(res) == 2 else res[1:]

def rc(res):
    return int((res if isinstance(res, tuple) else (res,))[0])

def context(ordinal=0):
    ok(cu.cuInit(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(ordinal))))
    ok(cu.cuCtxSetCurrent(ctx))
    return ctx

def free_bytes():
    return int(ok(cu.cuMemGetInfo())[0])

def kernel(name):
    module = ok(cu.cuModuleLoadData(b"any image: simgpu runs kernels by name"))
    return ok(cu.cuModuleGetFunction(module, name.encode()))

def launch(fn, blocks=1, stream=0):
    ok(cu.cuLaunchKernel(fn, blocks, 1, 1, 1, 1, 1, 0, stream, 0, 0))

def dptr(p, offset=0):
    return cu.CUdeviceptr(int(p) + offset)

def timed(stream, work):
    \"\"\"Milliseconds between events recorded before and after `work()` on `stream`.  The
    stream is kept busy (a 50 ms kernel) while they and the work are queued: what is
    measured is the device's time for the work, not the host's time between the calls
    (a busy machine once added 3 ms to a 20 ms kernel).\"\"\"
    start, end = ok(cu.cuEventCreate(0)), ok(cu.cuEventCreate(0))
    launch(kernel("sim_50000us"), 1, stream)
    ok(cu.cuEventRecord(start, stream))
    work()
    ok(cu.cuEventRecord(end, stream))
    ok(cu.cuEventSynchronize(end))
    return ok(cu.cuEventElapsedTime(start, end))
"""


def cuda(code, env, **kw):
    """Run `code` after PRELUDE in a child; return the JSON it prints last."""
    out = run_python(PRELUDE + code, env, **kw)
    return json.loads(out.stdout.strip().splitlines()[-1])


def ms(expected, rel=0.05):
    return pytest.approx(expected, rel=rel)


class Agent:
    """A long-running child that holds a context and answers one JSON command per line."""

    CODE = PRELUDE + """
context()
held = []

def alloc(size):
    res = cu.cuMemAlloc(size)
    if rc(res) == 0:
        held.append(res[1])
        return [res[0].name, len(held) - 1]
    return [res[0].name, None]

def free(index):
    res = cu.cuMemFree(held[index])
    return res[0].name

def info():
    return [int(v) for v in ok(cu.cuMemGetInfo())]

print(json.dumps("ready"), flush=True)
for line in sys.stdin:
    cmd, *args = json.loads(line)
    if cmd == "exit":
        break
    print(json.dumps(globals()[cmd](*args)), flush=True)
"""

    def __init__(self, env):
        self.proc = start_python(self.CODE, env)
        assert self.read() == "ready"

    def read(self):
        line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            raise AssertionError(f"agent {self.proc.pid} died:\n{self.proc.stderr.read()}")
        return json.loads(line)

    def ask(self, *cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def exit(self):
        self.proc.stdin.write(json.dumps(["exit"]) + "\n")
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0, self.proc.stderr.read()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if not pipe.closed:
                pipe.close()


@pytest.fixture
def agents():
    """Start Agents; whatever a test leaves running is killed afterwards."""
    started = []

    def start(env):
        agent = Agent(env)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.kill()


# === devices ===

def test_device_count_and_ordinals_follow_simgpu_devices(tmp_path):
    env = make_sim_env(tmp_path / "node", devices=2)
    r = cuda("""
ok(cu.cuInit(0))
count = ok(cu.cuDeviceGetCount())
print(json.dumps([count, [int(ok(cu.cuDeviceGet(i))) for i in range(count)],
                  rc(cu.cuDeviceGet(count))]))
""", env)
    assert r == [2, [0, 1], INVALID_DEVICE]


def test_python_profiles_pin_the_documented_devices():
    by_id = {p: (PROFILES[p].model, PROFILES[p].memory_gib, PROFILES[p].sm_count)
             for p in ("a10", "a100-40g", "h200")}
    assert by_id == {"a10": ("NVIDIA A10", 24, 72),
                     "a100-40g": ("NVIDIA A100-SXM4-40GB", 40, 108),
                     "h200": ("NVIDIA H200", 141, 132)}
    assert COMPUTE_CAPABILITY["a10"] == (8, 6) and COMPUTE_CAPABILITY["h200"] == (9, 0)
    assert set(COMPUTE_CAPABILITY) == set(PROFILES), "add the new profile's compute capability"


@pytest.mark.parametrize("profile", list(PROFILES))
def test_device_properties_match_the_python_profile(tmp_path, profile):
    env = make_sim_env(tmp_path / "node", profile=profile, devices=2)
    r = cuda("""
A = cu.CUdevice_attribute
ok(cu.cuInit(0))
out = []
for i in range(ok(cu.cuDeviceGetCount())):
    dev = ok(cu.cuDeviceGet(i))
    attr = lambda a: ok(cu.cuDeviceGetAttribute(a, dev))
    out.append([ok(cu.cuDeviceGetName(96, dev)).split(b"\\0")[0].decode(),
                int(ok(cu.cuDeviceTotalMem(dev))),
                attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
                [attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                 attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)]])
print(json.dumps(out))
""", env)
    p = PROFILES[profile]
    expected = [p.model, p.memory_gib * GiB, p.sm_count, list(COMPUTE_CAPABILITY[profile])]
    assert r == [expected, expected]


def test_cuda_uuid_matches_nvml_uuid_of_the_same_device(tmp_path):
    env = make_sim_env(tmp_path / "node", devices=2)
    from_cuda = cuda("""
ok(cu.cuInit(0))
out = []
for i in range(ok(cu.cuDeviceGetCount())):
    h = bytes(ok(cu.cuDeviceGetUuid(ok(cu.cuDeviceGet(i)))).bytes).hex()
    out.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
print(json.dumps(out))
""", env)
    from_nvml = run_python("""
import json, pynvml as n
n.nvmlInit()
print(json.dumps([n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(i))
                  for i in range(n.nvmlDeviceGetCount())]))
""", env).stdout
    assert len(set(from_cuda)) == 2
    assert from_cuda == json.loads(from_nvml)


# === memory: contents ===

def test_host_device_round_trips_are_byte_identical(sim_env):
    r = cuda("""
context()
n = (1 << 20) + 123
data = bytes((i * 131 + 7) % 256 for i in range(n))
a, b = ok(cu.cuMemAlloc(n)), ok(cu.cuMemAlloc(n))
ok(cu.cuMemcpyHtoD(a, data, n))
back = bytearray(n)
ok(cu.cuMemcpyDtoH(back, a, n))
ok(cu.cuMemcpyDtoD(b, a, n))
via_dtod = bytearray(n)
ok(cu.cuMemcpyDtoH(via_dtod, b, n))
s = ok(cu.cuStreamCreate(0))
ok(cu.cuMemcpyHtoDAsync(dptr(b, 1000), b"simgpu", 6, s))
ok(cu.cuMemcpyDtoDAsync(dptr(a, 10), dptr(b, 1000), 6, s))
tail = bytearray(16)
ok(cu.cuMemcpyDtoHAsync(tail, a, 16, s))
ok(cu.cuStreamSynchronize(s))
print(json.dumps([bytes(back) == data, bytes(via_dtod) == data, tail.hex()]))
""", sim_env)
    assert r == [True, True, (bytes([7, 138, 13, 144, 19, 150, 25, 156, 31, 162])
                              + b"simgpu").hex()]


def test_memset_variants_fill_exactly_the_elements_asked_for(sim_env):
    r = cuda("""
context()
s = ok(cu.cuStreamCreate(0))
p = ok(cu.cuMemAlloc(64))
out = {}
for name, call, width in [
        ("D8", lambda q: cu.cuMemsetD8(q, 0xAB, 5), 1),
        ("D16", lambda q: cu.cuMemsetD16(q, 0xBEEF, 5), 2),
        ("D32", lambda q: cu.cuMemsetD32(q, 0x01020304, 5), 4),
        ("D8Async", lambda q: cu.cuMemsetD8Async(q, 0xCD, 5, s), 1),
        ("D16Async", lambda q: cu.cuMemsetD16Async(q, 0x1234, 5, s), 2),
        ("D32Async", lambda q: cu.cuMemsetD32Async(q, 0xDEADBEEF, 5, s), 4)]:
    ok(cu.cuMemsetD8(p, 0x11, 64))
    ok(call(dptr(p, 4)))
    ok(cu.cuStreamSynchronize(s))
    back = bytearray(64)
    ok(cu.cuMemcpyDtoH(back, p, 64))
    out[name] = back.hex()
print(json.dumps(out))
""", sim_env)

    def expect(pattern):
        return (b"\x11" * 4 + pattern * 5).ljust(64, b"\x11").hex()

    assert r == {"D8": expect(b"\xab"), "D16": expect(b"\xef\xbe"),
                 "D32": expect(b"\x04\x03\x02\x01"), "D8Async": expect(b"\xcd"),
                 "D16Async": expect(b"\x34\x12"), "D32Async": expect(b"\xef\xbe\xad\xde")}


# === memory: accounting, one allocation family at a time ===

def test_plain_allocation_is_counted_exactly_until_freed(sim_env):
    r = cuda("""
context()
f0 = free_bytes()
p = ok(cu.cuMemAlloc(5 * (1 << 20) + 3))
f1 = free_bytes()
ok(cu.cuMemFree(p))
print(json.dumps([ok(cu.cuMemGetInfo())[1], f0, f0 - f1, free_bytes() - f0]))
""", sim_env)
    assert r == [24 * GiB, 24 * GiB, 6 * MiB, 0]   # 2 MiB pages: see test_allocation_footprint...


@pytest.mark.parametrize("width,height,elem", [(1, 3, 4), (512, 2, 8), (513, 7, 16), (1000, 3, 4)])
def test_pitched_allocation_is_pitch_times_height(sim_env, width, height, elem):
    r = cuda(f"""
context()
f0 = free_bytes()
p, pitch = ok(cu.cuMemAllocPitch({width}, {height}, {elem}))
f1 = free_bytes()
ok(cu.cuMemFree(p))
print(json.dumps([int(pitch), f0 - f1, free_bytes() - f0]))
""", sim_env)
    pitch, drop, after_free = r
    assert pitch % 512 == 0 and width <= pitch < width + 512
    assert (drop, after_free) == (pitch * height, 0)


def test_managed_allocation_is_counted_and_host_accessible(sim_env):
    r = cuda("""
context()
f0 = free_bytes()
n = 3 << 20
p = ok(cu.cuMemAllocManaged(n, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL.value))
f1 = free_bytes()
ok(cu.cuMemcpyHtoD(p, b"from the device side", 20))
seen_by_host = ctypes.string_at(int(p), 20).decode()
ctypes.memmove(int(p) + 100, b"from the host", 13)
back = bytearray(13)
ok(cu.cuMemcpyDtoH(back, dptr(p, 100), 13))
ok(cu.cuMemFree(p))
print(json.dumps([f0 - f1, seen_by_host, back.decode(), free_bytes() - f0]))
""", sim_env)
    assert r == [4 * MiB, "from the device side", "from the host", 0]   # 2 MiB pages


def test_stream_ordered_allocation_is_counted_until_freed_async(sim_env):
    r = cuda("""
context()
s = ok(cu.cuStreamCreate(0))
f0 = free_bytes()
p = ok(cu.cuMemAllocAsync(7 << 20, s))
q = ok(cu.cuMemAllocAsync(1 << 20, 0))
f1 = free_bytes()
ok(cu.cuMemcpyHtoDAsync(p, b"async", 5, s))
back = bytearray(5)
ok(cu.cuMemcpyDtoHAsync(back, p, 5, s))
ok(cu.cuMemFreeAsync(p, s))
ok(cu.cuMemFreeAsync(q, 0))
ok(cu.cuStreamSynchronize(s))
print(json.dumps([f0 - f1, back.decode(), free_bytes() - f0]))
""", sim_env)
    assert r == [(8 + 2) * MiB, "async", 0]   # 7 and 1 MiB take 2 MiB pages of the pool


def test_allocation_from_a_created_pool_is_counted_until_freed(sim_env):
    r = cuda("""
context()
s = ok(cu.cuStreamCreate(0))
props = cu.CUmemPoolProps()
props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
props.location.id = 0
pool = ok(cu.cuMemPoolCreate(props))
f0 = free_bytes()
p = ok(cu.cuMemAllocFromPoolAsync(3 << 20, pool, s))
f1 = free_bytes()
ok(cu.cuMemFreeAsync(p, s))
ok(cu.cuStreamSynchronize(s))
f2 = free_bytes()
ok(cu.cuMemPoolDestroy(pool))
print(json.dumps([f0 - f1, f2 - f0]))
""", sim_env)
    assert r == [4 * MiB, 0]   # the pool's reserve grows in 2 MiB units


# === memory: pools keep freed memory (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) ===

POOL = """
import pynvml
A = cu.CUmemPool_attribute
U64_MAX = (1 << 64) - 1
context()
s = ok(cu.cuStreamCreate(0))
pynvml.nvmlInit()
nvml_dev = pynvml.nvmlDeviceGetHandleByIndex(0)

def new_pool(location_type=cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE):
    props = cu.CUmemPoolProps()
    props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    props.location.type = location_type
    props.location.id = 0
    return ok(cu.cuMemPoolCreate(props))

def get(pool, attr):
    return int(ok(cu.cuMemPoolGetAttribute(pool, attr)))

def set_u64(pool, attr, value):
    return rc(cu.cuMemPoolSetAttribute(pool, attr, cu.cuuint64_t(value)))

def reserved(pool):
    return [get(pool, A.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), get(pool, A.CU_MEMPOOL_ATTR_USED_MEM_CURRENT)]

def mine():
    \"\"\"What NVML says this process holds on device 0.\"\"\"
    return sum(p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(nvml_dev)
               if p.pid == os.getpid())

def alloc(pool, size):
    return ok(cu.cuMemAllocFromPoolAsync(size, pool, s))
"""


def test_pool_attributes_start_at_the_driver_defaults(sim_env):
    r = cuda(POOL + """
out = []
for pool in (ok(cu.cuDeviceGetDefaultMemPool(0)), new_pool()):
    out.append([get(pool, a) for a in (
        A.CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES, A.CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
        A.CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
        A.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, A.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        A.CU_MEMPOOL_ATTR_USED_MEM_CURRENT, A.CU_MEMPOOL_ATTR_USED_MEM_HIGH)])
print(json.dumps(out))
""", sim_env)
    assert r == [[1, 1, 1, 0, 0, 0, 0, 0]] * 2


def test_memory_freed_to_a_pool_stays_reserved_until_a_synchronize_with_the_default_threshold(sim_env):
    r = cuda(POOL + """
pool = ok(cu.cuDeviceGetDefaultMemPool(0))
f0 = free_bytes()
p = ok(cu.cuMemAllocAsync(64 << 20, s))
held = [reserved(pool), f0 - free_bytes(), mine()]
ok(cu.cuMemFreeAsync(p, s))
freed = [reserved(pool), f0 - free_bytes(), mine()]
ok(cu.cuStreamSynchronize(s))
print(json.dumps([held, freed, [reserved(pool), f0 - free_bytes(), mine()]]))
""", sim_env)
    held, freed, synced = r
    assert held == [[64 * MiB, 64 * MiB], 64 * MiB, 64 * MiB]
    assert freed == [[64 * MiB, 0], 64 * MiB, 64 * MiB]   # back in the pool, not the device
    assert synced == [[0, 0], 0, 0]                        # above the threshold of 0: released


@pytest.mark.parametrize("sync", ["stream", "event", "context"])
def test_every_kind_of_synchronize_releases_pool_memory_above_the_threshold(sim_env, sync):
    r = cuda(POOL + f"""
pool = new_pool()
assert set_u64(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, 16 << 20) == 0
ok(cu.cuMemFreeAsync(alloc(pool, 64 << 20), s))
before = reserved(pool)
if "{sync}" == "stream":
    ok(cu.cuStreamSynchronize(s))
elif "{sync}" == "event":
    e = ok(cu.cuEventCreate(0))
    ok(cu.cuEventRecord(e, s))
    ok(cu.cuEventSynchronize(e))
else:
    ok(cu.cuCtxSynchronize())
print(json.dumps([before, reserved(pool), mine()]))
""", sim_env)
    assert r == [[64 * MiB, 0], [16 * MiB, 0], 16 * MiB]   # keeps exactly the threshold


def test_a_pool_with_the_maximum_release_threshold_keeps_freed_memory_until_trimmed(sim_env):
    r = cuda(POOL + """
pool = new_pool()
assert set_u64(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, U64_MAX) == 0
f0 = free_bytes()
ok(cu.cuMemFreeAsync(alloc(pool, 256 << 20), s))
ok(cu.cuStreamSynchronize(s))
ok(cu.cuCtxSynchronize())
kept = [get(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD), reserved(pool), f0 - free_bytes(), mine()]
ok(cu.cuMemPoolTrimTo(pool, 0))
print(json.dumps([kept, [reserved(pool), f0 - free_bytes(), mine()]]))
""", sim_env)
    kept, trimmed = r
    assert kept == [(1 << 64) - 1, [256 * MiB, 0], 256 * MiB, 256 * MiB]
    assert trimmed == [[0, 0], 0, 0]


def test_pool_memory_is_seen_by_another_process_and_a_full_device_refuses_it(agents, sim_env):
    holder = start_python(PRELUDE + POOL + """
pool = new_pool()
set_u64(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, U64_MAX)
ok(cu.cuMemFreeAsync(alloc(pool, 20 << 30), s))
ok(cu.cuStreamSynchronize(s))
print("ready", flush=True)
sys.stdin.readline()
""", sim_env)
    try:
        assert holder.stdout.readline().strip() == "ready", holder.stderr.read()
        other = agents(sim_env)
        assert other.ask("info") == [4 * GiB, 24 * GiB]   # the reserve is used device memory
        assert other.ask("alloc", 4 * GiB + 1) == ["CUDA_ERROR_OUT_OF_MEMORY", None]
        assert other.ask("alloc", 4 * GiB) == ["CUDA_SUCCESS", 0]
    finally:
        holder.kill()
        holder.wait()


def test_an_allocation_reuses_the_pools_unused_reserve_before_taking_device_memory(sim_env):
    r = cuda(POOL + """
pool = new_pool()
set_u64(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, U64_MAX)
ok(cu.cuMemFreeAsync(alloc(pool, 64 << 20), s))
ok(cu.cuStreamSynchronize(s))
f0 = free_bytes()
p = alloc(pool, 40 << 20)
q = alloc(pool, 24 << 20)
reused = [reserved(pool), f0 - free_bytes()]
r = alloc(pool, 1 << 20)          # nothing unused left: the reserve grows by one 2 MiB unit
print(json.dumps([reused, [reserved(pool), f0 - free_bytes()]]))
""", sim_env)
    assert r == [[[64 * MiB, 64 * MiB], 0], [[66 * MiB, 66 * MiB], 2 * MiB]]


def test_pool_reserve_grows_in_2mib_units(sim_env):
    r = cuda(POOL + """
pool = new_pool()
out = []
for size in (1, 2 << 20, (3 << 20) + 1):
    p = alloc(pool, size)
    out.append(reserved(pool)[0])
    ok(cu.cuMemFreeAsync(p, s))
    ok(cu.cuStreamSynchronize(s))
print(json.dumps(out))
""", sim_env)
    assert r == [2 * MiB, 2 * MiB, 4 * MiB]


def test_trim_keeps_at_least_the_bytes_asked_for_and_all_memory_in_use(sim_env):
    r = cuda(POOL + """
pool = new_pool()
set_u64(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, U64_MAX)
a, b, c = alloc(pool, 8 << 20), alloc(pool, 8 << 20), alloc(pool, 8 << 20)
ok(cu.cuMemFreeAsync(b, s))
ok(cu.cuMemFreeAsync(c, s))
out = [reserved(pool)]
for keep in (12 << 20, 100 << 20, 0):
    ok(cu.cuMemPoolTrimTo(pool, keep))
    out.append(reserved(pool))
print(json.dumps(out))
""", sim_env)
    assert r == [[24 * MiB, 8 * MiB],
                 [12 * MiB, 8 * MiB],    # at least 12 MiB kept
                 [12 * MiB, 8 * MiB],    # holds less than 100 MiB: nothing to do
                 [8 * MiB, 8 * MiB]]     # memory in use is never released


def test_pool_watermarks_reset_to_zero_only_and_current_figures_are_read_only(sim_env):
    r = cuda(POOL + """
pool = new_pool()
set_u64(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, U64_MAX)
p = alloc(pool, 32 << 20)
ok(cu.cuMemFreeAsync(alloc(pool, 16 << 20), s))
marks = lambda: [get(pool, A.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH), get(pool, A.CU_MEMPOOL_ATTR_USED_MEM_HIGH)]
high = marks()
ok(cu.cuMemPoolTrimTo(pool, 0))
after_trim = marks()
refused = [set_u64(pool, A.CU_MEMPOOL_ATTR_USED_MEM_HIGH, 5), set_u64(pool, A.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 5),
           set_u64(pool, A.CU_MEMPOOL_ATTR_USED_MEM_CURRENT, 0),
           set_u64(pool, A.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, 0)]
reset = [set_u64(pool, A.CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0), set_u64(pool, A.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)]
flag = A.CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC
flags = [rc(cu.cuMemPoolSetAttribute(pool, flag, 0)), get(pool, flag)]
print(json.dumps([high, after_trim, refused, reset, marks(), flags]))
""", sim_env)
    high, after_trim, refused, reset, after_reset, flags = r
    assert high == [48 * MiB, 48 * MiB]
    assert after_trim == high                   # a watermark is not moved by a trim
    assert refused == [INVALID_VALUE] * 4
    assert reset == [SUCCESS, SUCCESS]
    assert after_reset == [32 * MiB, 32 * MiB]  # restarted from what the pool holds now
    assert flags == [SUCCESS, 0]


def test_destroying_a_pool_returns_its_reserve_once_its_last_allocation_is_freed(sim_env):
    r = cuda(POOL + """
pool = new_pool()
set_u64(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, U64_MAX)
f0 = free_bytes()
live = alloc(pool, 8 << 20)
ok(cu.cuMemFreeAsync(alloc(pool, 32 << 20), s))
ok(cu.cuMemPoolDestroy(pool))
destroyed = [f0 - free_bytes(), rc(cu.cuMemAllocFromPoolAsync(1 << 20, pool, s)),
             rc(cu.cuMemPoolTrimTo(pool, 0)), rc(cu.cuMemPoolDestroy(pool))]
ok(cu.cuMemFreeAsync(live, s))
print(json.dumps([destroyed, f0 - free_bytes(), mine()]))
""", sim_env)
    destroyed, after_last_free, nvml = r
    assert destroyed == [8 * MiB, INVALID_VALUE, INVALID_VALUE, INVALID_VALUE]
    assert (after_last_free, nvml) == (0, 0)


def test_the_default_pool_cannot_be_destroyed_and_allocations_use_the_devices_current_pool(sim_env):
    r = cuda(POOL + """
default = ok(cu.cuDeviceGetDefaultMemPool(0))
pool = new_pool()
ok(cu.cuDeviceSetMemPool(0, pool))
p = ok(cu.cuMemAllocAsync(4 << 20, s))
from_current = [reserved(pool), reserved(default)]
ok(cu.cuMemFreeAsync(p, s))
ok(cu.cuMemPoolDestroy(pool))
back_to_default = int(ok(cu.cuDeviceGetMemPool(0))) == int(default)
print(json.dumps([rc(cu.cuMemPoolDestroy(default)), from_current, back_to_default]))
""", sim_env)
    assert r == [INVALID_VALUE, [[4 * MiB, 4 * MiB], [0, 0]], True]


VMM = """
context()
loc = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop = cu.CUmemAllocationProp()
prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = loc
prop.location.id = 0
access = cu.CUmemAccessDesc()
access.location.type = loc
access.location.id = 0
access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
gran = int(ok(cu.cuMemGetAllocationGranularity(
    prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))

def mapped(handle, size):
    va = ok(cu.cuMemAddressReserve(size, 0, 0, 0))
    ok(cu.cuMemMap(va, size, 0, handle, 0))
    ok(cu.cuMemSetAccess(va, size, [access], 1))
    return va
"""


def test_vmm_memory_is_counted_in_granules_while_created_or_mapped(sim_env):
    r = cuda(VMM + """
f0 = free_bytes()
size = 3 * gran
h = ok(cu.cuMemCreate(size, prop, 0))
f_created = free_bytes()
va, vb = mapped(h, size), mapped(h, size)
ok(cu.cuMemcpyHtoD(dptr(va, size - 4), b"vmm!", 4))
back = bytearray(4)
ok(cu.cuMemcpyDtoH(back, dptr(vb, size - 4), 4))
ok(cu.cuMemRelease(h))
f_released_mapped = free_bytes()
ok(cu.cuMemUnmap(va, size))
f_one_mapping_left = free_bytes()
ok(cu.cuMemUnmap(vb, size))
f_unmapped = free_bytes()
ok(cu.cuMemAddressFree(va, size))
ok(cu.cuMemAddressFree(vb, size))
print(json.dumps([gran, f0 - f_created, back.decode(), f0 - f_released_mapped,
                  f0 - f_one_mapping_left, f0 - f_unmapped]))
""", sim_env)
    assert r == [2 * MiB, 6 * MiB, "vmm!", 6 * MiB, 6 * MiB, 0]


def test_allocation_granularity_is_2mib_minimum_and_recommended(sim_env):
    r = cuda(VMM + """
G = cu.CUmemAllocationGranularity_flags
print(json.dumps([int(ok(cu.cuMemGetAllocationGranularity(prop, G.CU_MEM_ALLOC_GRANULARITY_MINIMUM))),
                  int(ok(cu.cuMemGetAllocationGranularity(prop, G.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))]))
""", sim_env)
    assert r == [2 * MiB, 2 * MiB]


FOOTPRINT_SIZES = [1, 511, 512, 513, 4096, MiB - 1, MiB, 2 * MiB, 2 * MiB + 1, 5 * MiB + 3, 64 * MiB]


def expected_footprint(size):
    """The documented model: 2 MiB pages from 1 MiB on, 512-byte rounding below."""
    unit = 2 * MiB if size >= MiB else 512
    return -(-size // unit) * unit


@pytest.mark.parametrize("family", ["cuMemAlloc", "cuMemAllocManaged", "cuMemAllocPitch", "cuMemAllocAsync"])
def test_allocation_footprint_rounds_large_sizes_to_2mib_pages_and_small_ones_to_512_bytes(
        sim_env, family):
    r = cuda(POOL + f"""
allocate = {{
    "cuMemAlloc": lambda n: ok(cu.cuMemAlloc(n)),
    "cuMemAllocManaged": lambda n: ok(cu.cuMemAllocManaged(n, 1)),
    "cuMemAllocPitch": lambda n: ok(cu.cuMemAllocPitch(n, 1, 4))[0],   # one row of pitch >= n
    "cuMemAllocAsync": lambda n: ok(cu.cuMemAllocAsync(n, s)),
}}["{family}"]
out = []
for size in {FOOTPRINT_SIZES}:
    f0, m0 = free_bytes(), mine()
    p = allocate(size)
    out.append([f0 - free_bytes(), mine() - m0, int(ok(cu.cuMemGetAddressRange(p))[1])])
    ok(cu.cuMemFree(p))
    ok(cu.cuCtxSynchronize())   # a pool gives its reserve back above its threshold of 0
print(json.dumps(out))
""", sim_env)
    for size, (drop, nvml, range_size) in zip(FOOTPRINT_SIZES, r):
        asked = -(-size // 512) * 512 if family == "cuMemAllocPitch" else size   # the pitch
        held = expected_footprint(asked)
        if family == "cuMemAllocAsync":
            held = -(-held // (2 * MiB)) * (2 * MiB)   # a fresh pool reserves whole 2 MiB units
        assert (drop, nvml, range_size) == (held, held, asked), size


def test_the_shared_footprint_rule_in_c_is_the_documented_one(c_program):
    exe = c_program("footprint_rule")
    edges = [0, 2**64 - 2 * MiB, 2**64 - 2 * MiB + 1, 2**64 - 1]
    out = subprocess.run([str(exe), *map(str, FOOTPRINT_SIZES + edges)], capture_output=True, text=True,
                         check=True)
    got = [int(v) for v in out.stdout.split()]
    # sizes whose rounding would wrap take "all memory": no device holds them
    assert got == [expected_footprint(n) for n in FOOTPRINT_SIZES] + [0, 2**64 - 2 * MiB, 2**64 - 1, 2**64 - 1]


def test_vmm_create_of_a_size_not_a_multiple_of_the_granularity_is_invalid(sim_env):
    r = cuda(VMM + """
f0 = free_bytes()
print(json.dumps([rc(cu.cuMemCreate(gran + 4096, prop, 0)), rc(cu.cuMemCreate(0, prop, 0)),
                  f0 - free_bytes()]))
""", sim_env)
    assert r == [INVALID_VALUE, INVALID_VALUE, 0]


LOCATIONS = """
L = cu.CUmemLocationType

def vmm_prop(location_type, location_id=0, handle_types=0, alloc_type=None):
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED if alloc_type is None else alloc_type
    p.location.type = location_type
    p.location.id = location_id
    p.requestedHandleTypes = handle_types
    return p

def pool_props(location_type, location_id=0, handle_types=0):
    p = cu.CUmemPoolProps()
    p.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = location_type
    p.location.id = location_id
    p.handleTypes = handle_types
    return p

POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
# Types a CUDA 13.0 driver does not know (newer toolkits define them; 6 is device memory).
NEWER = [L.CU_MEM_LOCATION_TYPE_INVISIBLE, L.CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN,
         L.CU_MEM_LOCATION_TYPE_MAX]
REFUSED = [L.CU_MEM_LOCATION_TYPE_INVALID, L.CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT] + NEWER
"""


def test_vmm_memory_takes_device_memory_only_for_a_device_location(sim_env):
    r = cuda(VMM + POOL + LOCATIONS + """
out = {}
for name, p in [("device", vmm_prop(L.CU_MEM_LOCATION_TYPE_DEVICE)),
                ("host", vmm_prop(L.CU_MEM_LOCATION_TYPE_HOST, 7)),          # id ignored
                ("host numa 0", vmm_prop(L.CU_MEM_LOCATION_TYPE_HOST_NUMA, 0))]:
    f0, m0 = free_bytes(), mine()
    h = ok(cu.cuMemCreate(4 << 20, p, 0))
    va = mapped(h, 4 << 20)
    ok(cu.cuMemcpyHtoD(dptr(va, 100), b"where", 5))
    back = bytearray(5)
    ok(cu.cuMemcpyDtoH(back, dptr(va, 100), 5))
    out[name] = [f0 - free_bytes(), mine() - m0, back.decode()]
    ok(cu.cuMemUnmap(va, 4 << 20))
    ok(cu.cuMemRelease(h))
print(json.dumps(out))
""", sim_env)
    assert r == {"device": [4 * MiB, 4 * MiB, "where"], "host": [0, 0, "where"],
                 "host numa 0": [0, 0, "where"]}


def test_vmm_create_refuses_locations_the_driver_documents_as_invalid(sim_env):
    r = cuda(VMM + LOCATIONS + """
f0 = free_bytes()
refused = {int(t): rc(cu.cuMemCreate(2 << 20, vmm_prop(t), 0)) for t in REFUSED}
out = [refused,
       rc(cu.cuMemCreate(2 << 20, vmm_prop(L.CU_MEM_LOCATION_TYPE_HOST_NUMA, 1), 0)),   # no node 1
       rc(cu.cuMemCreate(2 << 20, vmm_prop(L.CU_MEM_LOCATION_TYPE_HOST, 0, POSIX_FD), 0)),  # no IPC
       rc(cu.cuMemCreate(2 << 20, vmm_prop(L.CU_MEM_LOCATION_TYPE_DEVICE, 3), 0)),
       rc(cu.cuMemCreate(2 << 20, vmm_prop(L.CU_MEM_LOCATION_TYPE_DEVICE, 0, 0,
                                           cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_INVALID), 0)),
       [rc(cu.cuMemGetAllocationGranularity(vmm_prop(t), 0)) for t in REFUSED],
       f0 - free_bytes()]
print(json.dumps(out))
""", sim_env)
    refused, numa1, host_ipc, bad_device, bad_type, granularity, taken = r
    assert refused == {"0": INVALID_VALUE, "4": INVALID_VALUE, "5": INVALID_VALUE, "6": INVALID_VALUE,
                       str(2**31 - 1): INVALID_VALUE}
    assert (numa1, host_ipc, bad_device, bad_type) == (INVALID_VALUE, INVALID_VALUE, INVALID_DEVICE,
                                                       INVALID_VALUE)
    assert granularity == [INVALID_VALUE] * 5
    assert taken == 0


def test_a_host_pool_takes_no_device_memory_and_bad_pool_locations_are_refused(sim_env):
    r = cuda(POOL + LOCATIONS + """
f0, m0 = free_bytes(), mine()
host = ok(cu.cuMemPoolCreate(pool_props(L.CU_MEM_LOCATION_TYPE_HOST)))
p = alloc(host, 64 << 20)
ok(cu.cuMemcpyHtoD(p, b"host pool", 9))
held = [reserved(host), f0 - free_bytes(), mine() - m0]
ok(cu.cuMemFreeAsync(p, s))
refused = {int(t): rc(cu.cuMemPoolCreate(pool_props(t))) for t in REFUSED}
out = [held, refused, rc(cu.cuMemPoolCreate(pool_props(L.CU_MEM_LOCATION_TYPE_HOST, 0, POSIX_FD))),
       rc(cu.cuMemPoolCreate(pool_props(L.CU_MEM_LOCATION_TYPE_DEVICE, 2))),
       rc(cu.cuDeviceSetMemPool(0, host))]
print(json.dumps(out))
""", sim_env)
    held, refused, host_ipc, bad_device, host_as_device_pool = r
    assert held == [[64 * MiB, 64 * MiB], 0, 0]
    assert set(refused.values()) == {INVALID_VALUE} and len(refused) == 5
    assert (host_ipc, bad_device, host_as_device_pool) == (INVALID_VALUE, INVALID_DEVICE, INVALID_VALUE)


def test_mapping_a_range_that_is_already_mapped_is_invalid_value(sim_env):
    r = cuda(VMM + """
a, b = ok(cu.cuMemCreate(2 * gran, prop, 0)), ok(cu.cuMemCreate(2 * gran, prop, 0))
va = ok(cu.cuMemAddressReserve(4 * gran, 0, 0, 0))
ok(cu.cuMemMap(va, 2 * gran, 0, a, 0))
ok(cu.cuMemSetAccess(va, 2 * gran, [access], 1))
ok(cu.cuMemcpyHtoD(va, b"first", 5))
twice = [rc(cu.cuMemMap(va, 2 * gran, 0, b, 0)),                 # the same range
         rc(cu.cuMemMap(dptr(va, gran), 2 * gran, 0, b, 0)),      # half of it
         rc(cu.cuMemMap(va, 2 * gran, 0, a, 0))]                  # even with the same handle
back = bytearray(5)
ok(cu.cuMemcpyDtoH(back, va, 5))                                  # the first mapping is intact
free_half = rc(cu.cuMemMap(dptr(va, 2 * gran), 2 * gran, 0, b, 0))  # the unmapped half is fine
ok(cu.cuMemUnmap(va, 2 * gran))
remap = rc(cu.cuMemMap(va, 2 * gran, 0, b, 0))                    # once unmapped, mappable again
print(json.dumps([twice, back.decode(), free_half, remap]))
""", sim_env)
    assert r == [[INVALID_VALUE] * 3, "first", SUCCESS, SUCCESS]


def test_mapping_requires_granularity_multiples_inside_one_reservation(sim_env):
    r = cuda(VMM + """
h = ok(cu.cuMemCreate(2 * gran, prop, 0))
va = ok(cu.cuMemAddressReserve(2 * gran, 0, 0, 0))
print(json.dumps([rc(cu.cuMemMap(dptr(va, 4096), gran, 0, h, 0)), rc(cu.cuMemMap(va, gran + 4096, 0, h, 0)),
                  rc(cu.cuMemMap(va, gran, 4096, h, 0)), rc(cu.cuMemMap(va, 3 * gran, 0, h, 0)),
                  rc(cu.cuMemMap(va, gran, 2 * gran, h, 0)), rc(cu.cuMemMap(va, gran, gran, h, 0))]))
""", sim_env)
    assert r == [INVALID_VALUE] * 5 + [SUCCESS]   # an offset that is a granule multiple is fine


def test_released_unmapped_vmm_memory_returns_at_once(sim_env):
    r = cuda(VMM + """
f0 = free_bytes()
h = ok(cu.cuMemCreate(gran, prop, 0))
f1 = free_bytes()
ok(cu.cuMemRelease(h))
print(json.dumps([f0 - f1, f0 - free_bytes(), rc(cu.cuMemRelease(h))]))
""", sim_env)
    assert r == [2 * MiB, 0, INVALID_VALUE]


def test_arrays_are_counted_as_width_height_depth_element_channels(sim_env):
    r = cuda("""
context()
F = cu.CUarray_format

def desc2d(w, h, fmt, ch):
    d = cu.CUDA_ARRAY_DESCRIPTOR()
    d.Width, d.Height, d.Format, d.NumChannels = w, h, fmt, ch
    return d

def desc3d(w, h, depth, fmt, ch):
    d = cu.CUDA_ARRAY3D_DESCRIPTOR()
    d.Width, d.Height, d.Depth, d.Format, d.NumChannels = w, h, depth, fmt, ch
    return d

out = []
for create, destroy in [
        (lambda: cu.cuArrayCreate(desc2d(100, 10, F.CU_AD_FORMAT_FLOAT, 4)), cu.cuArrayDestroy),
        (lambda: cu.cuArrayCreate(desc2d(1000, 0, F.CU_AD_FORMAT_UNSIGNED_INT8, 1)), cu.cuArrayDestroy),
        (lambda: cu.cuArray3DCreate(desc3d(16, 8, 4, F.CU_AD_FORMAT_HALF, 2)), cu.cuArrayDestroy),
        (lambda: cu.cuArray3DCreate(desc3d(64, 0, 0, F.CU_AD_FORMAT_SIGNED_INT32, 2)), cu.cuArrayDestroy),
        (lambda: cu.cuMipmappedArrayCreate(desc3d(16, 8, 4, F.CU_AD_FORMAT_HALF, 2), 3),
         cu.cuMipmappedArrayDestroy)]:
    f0 = free_bytes()
    handle = ok(create())
    f1 = free_bytes()
    ok(destroy(handle))
    out.append([f0 - f1, free_bytes() - f0])
print(json.dumps(out))
""", sim_env)
    assert r == [[100 * 10 * 4 * 4, 0],
                 [1000 * 1 * 1, 0],
                 [16 * 8 * 4 * 2 * 2, 0],
                 [64 * 4 * 2, 0],
                 [(16 * 8 * 4 + 8 * 4 * 2 + 4 * 2 * 1) * 2 * 2, 0]]   # three mip levels


def test_memory_is_accounted_per_device(tmp_path):
    env = make_sim_env(tmp_path / "node", devices=2)
    r = cuda("""
ctx1 = context(1)
p = ok(cu.cuMemAlloc(1 << 30))
free1 = free_bytes()
context(0)
print(json.dumps([free1, free_bytes()]))
""", env)
    assert r == [23 * GiB, 24 * GiB]



# === memory: context teardown (cuCtxDestroy, cuDevicePrimaryCtxReset / Release) ===

TEARDOWN = POOL + """
VMM_PROP = cu.CUmemAllocationProp()
VMM_PROP.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
VMM_PROP.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
VMM_PROP.location.id = 0

def context_allocations():
    \"\"\"One allocation of each kind cuCtxDestroy documents as the context's: 64 + 8 + 16 + 4 MiB
    on the device, plus page-locked host memory.\"\"\"
    d = cu.CUDA_ARRAY_DESCRIPTOR()
    d.Width, d.Height, d.Format, d.NumChannels = 1024, 1024, cu.CUarray_format.CU_AD_FORMAT_FLOAT, 1
    return [ok(cu.cuMemAlloc(64 << 20)), ok(cu.cuMemAllocPitch(1 << 20, 8, 4))[0],
            ok(cu.cuMemAllocManaged(16 << 20, 1)), ok(cu.cuArrayCreate(d)), ok(cu.cuMemAllocHost(4096))]

def contextless_allocations():
    \"\"\"What the driver does not tie to a context: 32 MiB from a pool, 2 MiB of VMM.\"\"\"
    return [ok(cu.cuMemAllocAsync(32 << 20, s)), ok(cu.cuMemCreate(2 << 20, VMM_PROP, 0))]

def listed():
    return [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(nvml_dev)].count(os.getpid())
"""


def test_destroying_a_context_frees_what_it_allocated_but_not_pool_or_vmm_memory(sim_env):
    r = cuda(TEARDOWN + """
primary = ok(cu.cuCtxGetCurrent())
dev = ok(cu.cuDeviceGet(0))
before = mine()
ctx = ok(cu.cuCtxCreate(None, 0, dev))
s = ok(cu.cuStreamCreate(0))
p, pitched, managed, array, host = context_allocations()
pool_ptr, vmm = contextless_allocations()
held = mine() - before
ok(cu.cuCtxDestroy(ctx))
after = mine() - before
ok(cu.cuCtxSetCurrent(primary))
stale = [rc(cu.cuMemFree(p)), rc(cu.cuMemFreeHost(host)), rc(cu.cuArrayDestroy(array))]
ok(cu.cuMemFreeAsync(pool_ptr, 0))
ok(cu.cuCtxSynchronize())
ok(cu.cuMemRelease(vmm))
print(json.dumps([held, after, stale, mine() - before]))
""", sim_env)
    held, after, stale, end = r
    assert held == (64 + 8 + 16 + 4 + 32 + 2) * MiB
    assert after == (32 + 2) * MiB                 # cuMemAllocAsync and cuMemCreate stay
    assert stale == [INVALID_VALUE, INVALID_VALUE, INVALID_HANDLE]
    assert end == 0


def test_the_process_leaves_nvml_when_its_last_context_is_destroyed(sim_env):
    r = cuda(POOL + """
ok(cu.cuDevicePrimaryCtxRelease(ok(cu.cuDeviceGet(0))))   # context() retained it
out = [[p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(nvml_dev)]]
ctx = ok(cu.cuCtxCreate(None, 0, ok(cu.cuDeviceGet(0))))
p = ok(cu.cuMemAlloc(1 << 20))
out.append([p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(nvml_dev)])
ok(cu.cuCtxDestroy(ctx))
out.append([p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(nvml_dev)])
print(json.dumps([os.getpid(), out]))
""", sim_env)
    pid, views = r
    assert views == [[], [pid], []]


def test_primary_context_reset_frees_what_it_allocated_and_the_context_stays_usable(sim_env):
    r = cuda(TEARDOWN + """
dev = ok(cu.cuDeviceGet(0))
context_allocations()
pool_ptr, vmm = contextless_allocations()
held = mine()
ok(cu.cuDevicePrimaryCtxReset(dev))
after_reset = [mine(), list(ok(cu.cuDevicePrimaryCtxGetState(dev)))]
p = ok(cu.cuMemAlloc(8 << 20))            # used again: the driver re-initializes it
again = [mine(), ok(cu.cuDevicePrimaryCtxGetState(dev))[1]]
release = rc(cu.cuDevicePrimaryCtxRelease(dev))   # a retained context is still to be released
print(json.dumps([held, after_reset, again, release]))
""", sim_env)
    held, after_reset, again, release = r
    assert held == (64 + 8 + 16 + 4 + 32 + 2) * MiB
    assert after_reset == [(32 + 2) * MiB, [0, 0]]
    assert again == [(32 + 2 + 8) * MiB, 1]
    assert release == SUCCESS


def test_releasing_the_last_primary_context_reference_resets_it(sim_env):
    r = cuda(TEARDOWN + """
dev = ok(cu.cuDeviceGet(0))
ok(cu.cuDevicePrimaryCtxRetain(dev))     # a second reference
context_allocations()
out = [mine()]
ok(cu.cuDevicePrimaryCtxRelease(dev))
out.append(mine())                       # one reference left: nothing freed
ok(cu.cuDevicePrimaryCtxRelease(dev))
out += [mine(), ok(cu.cuDevicePrimaryCtxGetState(dev))[1], listed(),
        rc(cu.cuDevicePrimaryCtxRelease(dev))]
print(json.dumps(out))
""", sim_env)
    assert r == [92 * MiB, 92 * MiB, 0, 0, 0, INVALID_CONTEXT]



# === memory: context overhead (SIMGPU_CONTEXT_OVERHEAD) ===

OVERHEAD_VIEW = """
import pynvml
ok(cu.cuInit(0))
pynvml.nvmlInit()

def view(device=0):
    h = pynvml.nvmlDeviceGetHandleByIndex(device)
    mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid()]
    return [mine, int(pynvml.nvmlDeviceGetMemoryInfo(h).used)]
"""


def test_context_overhead_is_zero_by_default(sim_env):
    r = cuda(OVERHEAD_VIEW + """
context()
print(json.dumps([view(), free_bytes()]))
""", sim_env)
    assert r == [[[0], 0], 24 * GiB]


@pytest.mark.parametrize("profile", list(PROFILES))
def test_the_profile_context_overhead_is_the_documented_figure(tmp_path, profile):
    env = make_sim_env(tmp_path / "node", profile=profile, SIMGPU_CONTEXT_OVERHEAD="profile")
    r = cuda(OVERHEAD_VIEW + """
context()
print(json.dumps([view(), free_bytes(), int(ok(cu.cuMemGetInfo())[1])]))
""", env)
    overhead = PROFILES[profile].context_overhead_mib * MiB
    assert 128 * MiB <= overhead <= GiB and overhead % (2 * MiB) == 0
    assert r == [[[overhead], overhead], PROFILES[profile].memory_gib * GiB - overhead,
                 PROFILES[profile].memory_gib * GiB]


def test_context_overhead_is_paid_once_per_process_and_device_until_its_last_context_goes(tmp_path):
    env = make_sim_env(tmp_path / "node", devices=2, SIMGPU_CONTEXT_OVERHEAD="64Mi")
    r = cuda(OVERHEAD_VIEW + """
out = [view()]
devs = [ok(cu.cuDeviceGet(0)), ok(cu.cuDeviceGet(1))]
a = ok(cu.cuCtxCreate(None, 0, devs[0]))
out.append(view())
primary = ok(cu.cuDevicePrimaryCtxRetain(devs[0]))   # a second context on device 0
b = ok(cu.cuCtxCreate(None, 0, devs[0]))             # and a third
p = ok(cu.cuMemAlloc(32 << 20))
out.append(view())
other = ok(cu.cuCtxCreate(None, 0, devs[1]))
out.append([view(0), view(1)])
ok(cu.cuCtxDestroy(b))
ok(cu.cuCtxDestroy(a))
out.append(view())                                    # the primary context still holds it
ok(cu.cuDevicePrimaryCtxRelease(devs[0]))
out.append([view(0), view(1)])
print(json.dumps(out))
""", env)
    none, first, three, two_devices, primary_left, released = r
    assert none == [[], 0]
    assert first == [[64 * MiB], 64 * MiB]
    assert three == [[(64 + 32) * MiB], (64 + 32) * MiB]   # once, whatever the context count
    assert two_devices == [[[96 * MiB], 96 * MiB], [[64 * MiB], 64 * MiB]]
    assert primary_left == [[64 * MiB], 64 * MiB]          # b's 32 MiB went with b
    assert released == [[[], 0], [[64 * MiB], 64 * MiB]]


def test_context_overhead_counts_against_the_device_and_returns_when_the_process_dies(tmp_path):
    env = make_sim_env(tmp_path / "node", SIMGPU_CONTEXT_OVERHEAD=str(GiB))
    holder = start_python(PRELUDE + """
context()
print(json.dumps(free_bytes()), flush=True)
sys.stdin.readline()
""", env)
    try:
        assert json.loads(holder.stdout.readline()) == 23 * GiB
        r = cuda(OVERHEAD_VIEW + """
context()
print(json.dumps([free_bytes(), rc(cu.cuMemAlloc((22 << 30) + 1)), rc(cu.cuMemAlloc(22 << 30))]))
""", env)
        assert r == [22 * GiB, OUT_OF_MEMORY, SUCCESS]   # two contexts' overhead: 2 GiB gone
    finally:
        holder.kill()
        holder.wait()
    r = run_python("""
import json, time, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
deadline = time.monotonic() + 5
while n.nvmlDeviceGetMemoryInfo(h).used and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps([n.nvmlDeviceGetMemoryInfo(h).used, len(n.nvmlDeviceGetComputeRunningProcesses(h))]))
""", env)
    assert json.loads(r.stdout) == [0, 0]


def test_a_context_that_does_not_fit_on_the_device_is_out_of_memory(tmp_path):
    env = make_sim_env(tmp_path / "node", SIMGPU_CONTEXT_OVERHEAD="25Gi")
    r = cuda(OVERHEAD_VIEW + """
dev = ok(cu.cuDeviceGet(0))
print(json.dumps([rc(cu.cuDevicePrimaryCtxRetain(dev)), rc(cu.cuCtxCreate(None, 0, dev)), view()]))
""", env)
    assert r == [OUT_OF_MEMORY, OUT_OF_MEMORY, [[], 0]]


@pytest.mark.parametrize("value", ["lots", "-1", "5Xi", "1.5Gi", "99999999999Ti"])
def test_a_bad_context_overhead_fails_cuinit_naming_the_variable(tmp_path, value):
    result, stderr = init_result(make_sim_env(tmp_path / "node", SIMGPU_CONTEXT_OVERHEAD=value))
    assert result == [NO_DEVICE, NOT_INITIALIZED]
    assert f"SIMGPU_CONTEXT_OVERHEAD={value} is not a size" in stderr


# === memory: node-wide, across processes ===

@pytest.mark.parametrize("how", ["exit", "SIGKILL"])
def test_second_process_gets_out_of_memory_until_the_first_is_gone(agents, sim_env, how):
    a, b = agents(sim_env), agents(sim_env)
    total = a.ask("info")[1]
    assert a.ask("alloc", total - GiB) == ["CUDA_SUCCESS", 0]
    assert b.ask("info") == [GiB, total]
    assert b.ask("alloc", GiB + 1) == ["CUDA_ERROR_OUT_OF_MEMORY", None]
    assert b.ask("alloc", 512 * MiB) == ["CUDA_SUCCESS", 0]
    assert b.ask("alloc", 512 * MiB + 1) == ["CUDA_ERROR_OUT_OF_MEMORY", None]
    assert b.ask("free", 0) == "CUDA_SUCCESS"
    assert b.ask("alloc", GiB) == ["CUDA_SUCCESS", 1]   # exactly what is left
    assert b.ask("free", 1) == "CUDA_SUCCESS"

    if how == "exit":
        a.exit()
        assert b.ask("alloc", total - GiB) == ["CUDA_SUCCESS", 2]
    else:
        a.kill()
        deadline = time.monotonic() + 5
        result = b.ask("alloc", total - GiB)
        while result[0] != "CUDA_SUCCESS" and time.monotonic() < deadline:
            time.sleep(0.05)
            result = b.ask("alloc", total - GiB)
        assert result == ["CUDA_SUCCESS", 2]
    assert b.ask("info") == [GiB, total]


# === timing ===

@pytest.mark.timing     # simulated kernel time, measured by the wall clock
def test_kernels_on_one_stream_take_their_summed_simulated_time(sim_env):
    r = cuda("""
context()
fn = kernel("sim_25000us")
s = ok(cu.cuStreamCreate(0))
print(json.dumps(timed(s, lambda: [launch(fn, 1, s) for _ in range(8)])))
""", sim_env)
    assert r == ms(8 * 25)


@pytest.mark.timing     # simulated kernel time, measured by the wall clock
@pytest.mark.parametrize("profile", ["a10", "h200"])
def test_a_grid_one_block_larger_than_the_sm_count_takes_two_waves(tmp_path, profile):
    env = make_sim_env(tmp_path / "node", profile=profile)
    sms = PROFILES[profile].sm_count
    r = cuda(f"""
context()
fn = kernel("sim_20000us")
s = ok(cu.cuStreamCreate(0))
one_wave = timed(s, lambda: launch(fn, {sms}, s))
two_waves = timed(s, lambda: launch(fn, {sms + 1}, s))
# blocks count over all three grid dimensions
three_d = timed(s, lambda: ok(cu.cuLaunchKernel(fn, 1, {sms + 1}, 2, 32, 1, 1, 0, s, 0, 0)))
print(json.dumps([one_wave, two_waves, three_d]))
""", env)
    assert r == [ms(20), ms(40), ms(60)]


@pytest.mark.timing     # simulated kernel time, measured by the wall clock
def test_kernels_with_other_names_take_five_microseconds_per_wave(sim_env):
    r = cuda("""
context()
s = ok(cu.cuStreamCreate(0))
fn = kernel("vector_add")
print(json.dumps(timed(s, lambda: launch(fn, 72 * 2000, s))))
""", sim_env)
    assert r == ms(2000 * 0.005)


@pytest.mark.timing     # simulated kernel time, measured by the wall clock
def test_stream_synchronize_sleeps_until_the_work_is_done_without_spinning(sim_env):
    r = cuda("""
context()
fn = kernel("sim_50000us")
s = ok(cu.cuStreamCreate(0))
t0 = time.monotonic()
for _ in range(6):
    launch(fn, 1, s)
launched = time.monotonic() - t0
before = rc(cu.cuStreamQuery(s))
cpu0, wall0 = time.process_time(), time.monotonic()
ok(cu.cuStreamSynchronize(s))
sync_wall, sync_cpu = time.monotonic() - wall0, time.process_time() - cpu0
print(json.dumps([launched, before, time.monotonic() - t0, sync_wall, sync_cpu,
                  rc(cu.cuStreamQuery(s))]))
""", sim_env)
    launched, before, total, sync_wall, sync_cpu, after = r
    assert launched < 0.05          # launches return at once
    assert (before, after) == (NOT_READY, SUCCESS)
    assert total == ms(0.300)
    assert sync_cpu < 0.1 * sync_wall


@pytest.mark.timing     # simulated kernel time, measured by the wall clock
def test_events_complete_when_the_work_before_them_is_done(sim_env):
    r = cuda("""
context()
fn = kernel("sim_100000us")
s = ok(cu.cuStreamCreate(0))
start, end = ok(cu.cuEventCreate(0)), ok(cu.cuEventCreate(0))
ok(cu.cuEventRecord(start, s))
launch(fn, 1, s)
ok(cu.cuEventRecord(end, s))
pending = [rc(cu.cuEventQuery(end)), rc(cu.cuEventElapsedTime(start, end))]
t0 = time.monotonic()
ok(cu.cuEventSynchronize(end))
waited = time.monotonic() - t0
print(json.dumps([pending, rc(cu.cuEventQuery(end)), waited, ok(cu.cuEventElapsedTime(start, end))]))
""", sim_env)
    pending, done, waited, elapsed = r
    assert pending == [NOT_READY, NOT_READY]
    assert done == SUCCESS
    assert 0.08 < waited < 0.15    # slept until the 100 ms kernel was done
    assert elapsed == ms(100)


@pytest.mark.timing     # simulated kernel time, measured by the wall clock
def test_a_full_stream_queue_blocks_the_next_launch_until_the_oldest_finishes(sim_env):
    r = cuda("""
context()
fn = kernel("sim_100000us")
s = ok(cu.cuStreamCreate(0))
t0 = time.monotonic()
for _ in range(1024):
    launch(fn, 1, s)
queued = time.monotonic() - t0
for _ in range(3):
    launch(fn, 1, s)                  # each waits for the oldest pending kernel to end
print(json.dumps([queued, time.monotonic() - t0, rc(cu.cuStreamQuery(s))]))
""", sim_env)
    queued, blocked, query = r
    assert queued < 0.2               # 1024 launches (102 s of work) returned at once
    assert blocked == ms(0.300, rel=0.1)
    assert query == NOT_READY


SERIAL_WORKER = PRELUDE + """
context()
fn = kernel("sim_25000us")
s = ok(cu.cuStreamCreate(0))
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
for _ in range(8):
    launch(fn, 1, s)
ok(cu.cuStreamSynchronize(s))
print(json.dumps([t0, time.monotonic()]), flush=True)
"""


@pytest.mark.timing     # simulated kernel time, measured by the wall clock
def test_two_processes_launching_together_share_one_serial_timeline(sim_env):
    workers = [start_python(SERIAL_WORKER, sim_env) for _ in range(2)]
    try:
        for w in workers:
            assert w.stdout.readline().strip() == "ready", w.stderr.read()
        for w in workers:
            w.stdin.write("go\n")
            w.stdin.flush()
        spans = [json.loads(w.stdout.readline()) for w in workers]
    finally:
        for w in workers:
            w.kill()
            w.wait()
    first_start = min(s for s, _ in spans)
    last_end = max(e for _, e in spans)
    assert last_end - first_start == ms(2 * 8 * 0.025)   # not 0.2 s: one device, one timeline


UTIL_WORKER = PRELUDE + """
context()
fn = kernel("sim_10000us")
t0 = time.monotonic()
for i in range(125):                  # a 10 ms kernel every 20 ms, for 2.5 s
    delay = t0 + i * 0.020 - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    launch(fn)
    if i == 0:
        print("ready", flush=True)
ok(cu.cuCtxSynchronize())
print("done", flush=True)
sys.stdin.readline()
"""


def test_nvml_utilization_reports_a_half_busy_device_as_half_busy(sim_env):
    worker = start_python(UTIL_WORKER, sim_env)
    try:
        assert worker.stdout.readline().strip() == "ready", worker.stderr.read()
        r = json.loads(run_python("""
import json, time, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
time.sleep(1.1)
gpu = n.nvmlDeviceGetUtilizationRates(h).gpu
samples = [[s.pid, s.smUtil] for s in n.nvmlDeviceGetProcessUtilization(h, 0)]
print(json.dumps([gpu, samples]))
""", sim_env).stdout)
        assert worker.stdout.readline().strip() == "done"   # the window was inside the run
    finally:
        worker.kill()
        worker.wait()
    gpu, samples = r
    assert 40 <= gpu <= 60
    assert [pid for pid, _ in samples] == [worker.pid]
    assert 40 <= samples[0][1] <= 60


def test_a_sampling_driver_answers_the_average_of_a_processs_samples_since_the_callers_time(sim_env):
    """SIMGPU_PROCESS_SAMPLE_MS=100: a sample of each process every 100 ms, and a process's
    answer the average of its samples newer than lastSeenTimeStamp, stamped with the latest
    (nvml.h, nvmlDeviceGetProcessesUtilizationInfo: a timestamp of a previous query reads
    "utilization since the previous query").  Busy for 0.5 s, then idle for 0.2 s: over the
    last second its samples average about half, though the latest is idle; since 50 ms ago
    (one sample, of the 100 ms before it: idle), and after the latest stamp, there is no
    busy sample to answer with."""
    env = {**sim_env, "SIMGPU_PROCESS_SAMPLE_MS": "100"}
    now, whole, recent, again = cuda("""
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
context()
fn = kernel("sim_10000us")
time.sleep(0.25)
for i in range(50):                   # 0.5 s of 10 ms kernels, back to back
    launch(fn)
ok(cu.cuCtxSynchronize())
time.sleep(0.2)
now = int(time.time() * 1e6)

def since(t):
    try:
        return [[s.pid, s.smUtil, s.timeStamp] for s in n.nvmlDeviceGetProcessUtilization(h, t)]
    except n.NVMLError_NotFound:
        return None

whole = since(now - 1000000)
print(json.dumps([now, whole, since(now - 50000), whole and since(whole[0][2])]))
""", env)
    [[pid, util, stamp]] = whole
    assert pid > 0
    assert 30 <= util <= 70, util
    assert now - 100000 < stamp <= now + 100000   # its latest sample's time
    assert recent is None and again is None


@pytest.mark.timing     # simulated kernel time, measured by the wall clock
def test_captured_graph_takes_the_sum_of_its_kernels(sim_env):
    r = cuda("""
context()
f20, f10 = kernel("sim_20000us"), kernel("sim_10000us")
s = ok(cu.cuStreamCreate(0))
ok(cu.cuStreamBeginCapture(s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
capturing = int(ok(cu.cuStreamIsCapturing(s)))
for _ in range(3):
    launch(f20, 1, s)
launch(f10, 73, s)                    # two waves on an A10: 20 ms
graph = ok(cu.cuStreamEndCapture(s))
after_capture = [rc(cu.cuStreamQuery(s)), int(ok(cu.cuStreamIsCapturing(s)))]
exe = ok(cu.cuGraphInstantiate(graph, 0))   # cuda-bindings asks for cuGraphInstantiateWithFlags
once = timed(s, lambda: ok(cu.cuGraphLaunch(exe, s)))
twice = timed(s, lambda: [ok(cu.cuGraphLaunch(exe, s)) for _ in range(2)])
print(json.dumps([capturing, after_capture, once, twice]))
""", sim_env)
    capturing, after_capture, once, twice = r
    assert capturing == 1   # CU_STREAM_CAPTURE_STATUS_ACTIVE
    assert after_capture == [SUCCESS, 0]   # captured launches queued no work: nothing pending
    assert once == ms(80)
    assert twice == ms(160)



def test_an_event_recorded_in_a_capturing_stream_refuses_to_be_read_until_recorded_again(sim_env):
    """cuda.h: CUDA_ERROR_CAPTURED_EVENT, "the operation is not permitted on an event
    which was last recorded in a capturing stream" (cuThreadExchangeStreamCaptureMode
    names cuEventQuery on one).  cuda-bindings through simgpu."""
    r = cuda("""
context()
s = ok(cu.cuStreamCreate(0))
start, end = ok(cu.cuEventCreate(0)), ok(cu.cuEventCreate(0))
ok(cu.cuEventRecord(start, s))
ok(cu.cuStreamBeginCapture(s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
recorded = rc(cu.cuEventRecord(end, s))
launch(kernel("sim_1000us"), 1, s)
inside = [rc(cu.cuEventQuery(end)), rc(cu.cuEventSynchronize(end)), rc(cu.cuEventElapsedTime(start, end))]
graph = ok(cu.cuStreamEndCapture(s))
after = [rc(cu.cuEventQuery(end)), rc(cu.cuEventQuery(start))]
ok(cu.cuEventRecord(end, s))
again = [rc(cu.cuEventSynchronize(end)), rc(cu.cuEventQuery(end))]
print(json.dumps([recorded, inside, after, again]))
""", sim_env)
    recorded, inside, after, again = r
    assert recorded == SUCCESS
    assert inside == [907] * 3
    assert after == [907, SUCCESS]   # the capture's end does not clear it; the other event is untouched
    assert again == [SUCCESS, SUCCESS]


# === graphs: memory nodes and the graph memory reserve ===

GRAPH_MEM = POOL + """
G = cu.CUgraphMem_attribute
AUTO_FREE = cu.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH

def alloc_node(graph, size, device=0):
    params = cu.CUDA_MEM_ALLOC_NODE_PARAMS()
    params.poolProps.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    params.poolProps.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    params.poolProps.location.id = device
    params.bytesize = size
    node = ok(cu.cuGraphAddMemAllocNode(graph, None, 0, params))
    return node, params.dptr

def graph_mem(device=0):
    \"\"\"[used, used high, reserved, reserved high]\"\"\"
    return [int(ok(cu.cuDeviceGetGraphMemAttribute(device, a))) for a in (
        G.CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, G.CU_GRAPH_MEM_ATTR_USED_MEM_HIGH,
        G.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, G.CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)]
"""


def test_graph_allocations_take_device_memory_at_launch_and_stay_reserved_until_trimmed(sim_env):
    r = cuda(GRAPH_MEM + """
graph = ok(cu.cuGraphCreate(0))
node, p = alloc_node(graph, 48 << 20)
added = [graph_mem(), mine()]
exe = ok(cu.cuGraphInstantiate(graph, 0))
ok(cu.cuGraphLaunch(exe, s))
launched = [graph_mem(), mine()]
ok(cu.cuMemcpyHtoD(p, b"graph memory", 12))
back = bytearray(12)
ok(cu.cuMemcpyDtoH(back, p, 12))
relaunch = rc(cu.cuGraphLaunch(exe, s))        # its allocation is still live
ok(cu.cuMemFreeAsync(p, s))
ok(cu.cuStreamSynchronize(s))
freed = [graph_mem(), mine()]
ok(cu.cuGraphLaunch(exe, s))                   # once freed, it can run again: same address
ok(cu.cuMemFree(p))
ok(cu.cuGraphExecDestroy(exe))
ok(cu.cuGraphDestroy(graph))
destroyed = [graph_mem(), mine()]
ok(cu.cuDeviceGraphMemTrim(0))
print(json.dumps([added, launched, back.decode(), relaunch, freed, destroyed, [graph_mem(), mine()]]))
""", sim_env)
    added, launched, data, relaunch, freed, destroyed, trimmed = r
    assert added == [[0, 0, 0, 0], 0]                                   # nothing until launch
    assert launched == [[48 * MiB, 48 * MiB, 48 * MiB, 48 * MiB], 48 * MiB]
    assert data == "graph memory"
    assert relaunch == INVALID_VALUE
    assert freed == [[0, 48 * MiB, 48 * MiB, 48 * MiB], 48 * MiB]        # back in the reserve
    assert destroyed == [[0, 48 * MiB, 48 * MiB, 48 * MiB], 48 * MiB]    # kept past the graph
    assert trimmed == [[0, 48 * MiB, 0, 48 * MiB], 0]


def test_an_allocation_freed_inside_its_graph_only_raises_the_reserve(sim_env):
    r = cuda(GRAPH_MEM + """
graph = ok(cu.cuGraphCreate(0))
a, pa = alloc_node(graph, 16 << 20)
b, pb = alloc_node(graph, (8 << 20) + 1)       # a footprint of 10 MiB
ok(cu.cuGraphAddMemFreeNode(graph, [a], 1, pa))
twice = rc(cu.cuGraphAddMemFreeNode(graph, [a], 1, pa))
bogus = rc(cu.cuGraphAddMemFreeNode(graph, None, 0, cu.CUdeviceptr(0xdead0000)))
exe = ok(cu.cuGraphInstantiate(graph, 0))
second_exec = rc(cu.cuGraphInstantiate(graph, 0))
ok(cu.cuGraphLaunch(exe, s))
once = graph_mem()
outside = rc(cu.cuMemFree(pa))                 # the graph frees it: nobody else may
ok(cu.cuMemFree(pb))
ok(cu.cuGraphLaunch(exe, s))
print(json.dumps([twice, bogus, second_exec, once, outside, graph_mem(), mine()]))
""", sim_env)
    twice, bogus, second_exec, once, outside, again, nvml = r
    assert (twice, bogus, second_exec, outside) == (INVALID_VALUE,) * 4
    assert once == [10 * MiB, 26 * MiB, 26 * MiB, 26 * MiB]   # b stays; a lived only in the launch
    assert again == [10 * MiB, 26 * MiB, 26 * MiB, 26 * MiB]  # the reserve serves the relaunch
    assert nvml == 26 * MiB


def test_auto_free_on_launch_frees_the_previous_graph_launchs_allocations(sim_env):
    r = cuda(GRAPH_MEM + """
graph = ok(cu.cuGraphCreate(0))
node, p = alloc_node(graph, 32 << 20)
exe = ok(cu.cuGraphInstantiate(graph, AUTO_FREE))
out = []
for _ in range(3):
    ok(cu.cuGraphLaunch(exe, s))
    out.append(graph_mem()[::2])
params = ok(cu.cuGraphMemAllocNodeGetParams(node))
print(json.dumps([out, int(params.bytesize), int(params.dptr) == int(p)]))
""", sim_env)
    assert r == [[[32 * MiB, 32 * MiB]] * 3, 32 * MiB, True]


def test_a_graph_launch_that_does_not_fit_on_the_device_is_out_of_memory(sim_env):
    r = cuda(GRAPH_MEM + """
graph = ok(cu.cuGraphCreate(0))
alloc_node(graph, 16 << 30)
exe = ok(cu.cuGraphInstantiate(graph, 0))
hog = ok(cu.cuMemAlloc(10 << 30))
refused = [rc(cu.cuGraphLaunch(exe, s)), graph_mem(), mine()]
ok(cu.cuMemFree(hog))
print(json.dumps([refused, rc(cu.cuGraphLaunch(exe, s)), graph_mem()[2]]))
""", sim_env)
    refused, fits, reserved = r
    assert refused == [OUT_OF_MEMORY, [0, 0, 0, 0], 10 * GiB]
    assert (fits, reserved) == (SUCCESS, 16 * GiB)


def test_captured_stream_ordered_allocations_become_graph_memory_nodes(sim_env):
    r = cuda(GRAPH_MEM + """
ok(cu.cuStreamBeginCapture(s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
kept = ok(cu.cuMemAllocAsync(8 << 20, s))
scratch = ok(cu.cuMemAllocAsync(4 << 20, s))
ok(cu.cuMemFreeAsync(scratch, s))
graph = ok(cu.cuStreamEndCapture(s))
captured = [graph_mem(), mine()]                 # capturing allocates nothing
exe = ok(cu.cuGraphInstantiate(graph, 0))
ok(cu.cuGraphLaunch(exe, s))
print(json.dumps([captured, graph_mem(), mine()]))
""", sim_env)
    assert r == [[[0, 0, 0, 0], 0], [8 * MiB, 12 * MiB, 12 * MiB, 12 * MiB], 12 * MiB]


def test_a_graph_lists_its_nodes_and_their_types_as_cuda_h_documents(sim_env):
    """cuGraphGetNodes (cuda.h): nodes NULL gives the count; a longer array is filled and
    the rest set to NULL, the count the nodes obtained; a shorter one gets that many.
    cuGraphNodeGetType: each node's CUgraphNodeType, for nodes added and captured alike
    (the shim walks a graph's allocation nodes this way at instantiation)."""
    r = cuda(GRAPH_MEM + """
T = cu.CUgraphNodeType
graph = ok(cu.cuGraphCreate(0))
node, p = alloc_node(graph, 8 << 20)
ok(cu.cuGraphAddMemFreeNode(graph, [node], 1, p))
count = ok(cu.cuGraphGetNodes(graph))[1]
nodes, n = ok(cu.cuGraphGetNodes(graph, 4))
short, m = ok(cu.cuGraphGetNodes(graph, 1))
types = [int(ok(cu.cuGraphNodeGetType(x))) for x in nodes[:n]]
params = ok(cu.cuGraphMemAllocNodeGetParams(nodes[0]))
ok(cu.cuStreamBeginCapture(s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
q = ok(cu.cuMemAllocAsync(4 << 20, s))
ok(cu.cuMemFreeAsync(q, s))
captured = ok(cu.cuStreamEndCapture(s))
cnodes, cn = ok(cu.cuGraphGetNodes(captured, 2))
print(json.dumps([count, n, [x is None or int(x) == 0 for x in nodes], m, types, int(params.bytesize),
                  [int(ok(cu.cuGraphNodeGetType(x))) for x in cnodes[:cn]]]))
""", sim_env)
    count, n, empty, m, types, size, captured = r
    assert (count, n, empty, m) == (2, 2, [False, False, True, True], 1)
    assert types == [10, 11]               # CU_GRAPH_NODE_TYPE_MEM_ALLOC, CU_GRAPH_NODE_TYPE_MEM_FREE
    assert size == 8 * MiB and captured == [10, 11]


def test_graph_memory_watermarks_reset_to_zero_only(sim_env):
    r = cuda(GRAPH_MEM + """
graph = ok(cu.cuGraphCreate(0))
node, p = alloc_node(graph, 8 << 20)
exe = ok(cu.cuGraphInstantiate(graph, 0))
ok(cu.cuGraphLaunch(exe, s))
ok(cu.cuMemFree(p))
ok(cu.cuDeviceGraphMemTrim(0))
before = graph_mem()
refused = [rc(cu.cuDeviceSetGraphMemAttribute(0, G.CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, cu.cuuint64_t(1))),
           rc(cu.cuDeviceSetGraphMemAttribute(0, G.CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, cu.cuuint64_t(0)))]
for a in (G.CU_GRAPH_MEM_ATTR_USED_MEM_HIGH, G.CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH):
    ok(cu.cuDeviceSetGraphMemAttribute(0, a, cu.cuuint64_t(0)))
print(json.dumps([before, refused, graph_mem(), rc(cu.cuDeviceGraphMemTrim(7))]))
""", sim_env)
    assert r == [[0, 8 * MiB, 0, 8 * MiB], [INVALID_VALUE] * 2, [0, 0, 0, 0], INVALID_DEVICE]


@pytest.mark.timing     # simulated kernel time, measured by the wall clock
def test_launch_ex_and_cooperative_launch_take_simulated_time(sim_env):
    r = cuda("""
context()
fn = kernel("sim_10000us")
s = ok(cu.cuStreamCreate(0))
cfg = cu.CUlaunchConfig()
cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = 73, 1, 1
cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = 128, 1, 1
cfg.hStream = s
cfg.numAttrs = 0
ex = timed(s, lambda: ok(cu.cuLaunchKernelEx(cfg, fn, 0, 0)))
coop = timed(s, lambda: ok(cu.cuLaunchCooperativeKernel(fn, 3, 1, 1, 64, 1, 1, 0, s, 0)))
print(json.dumps([ex, coop]))
""", sim_env)
    assert r == [ms(20), ms(10)]


@pytest.mark.timing     # simulated kernel time, measured by the wall clock
def test_library_kernels_run_by_name(sim_env):
    r = cuda("""
context()
lib = ok(cu.cuLibraryLoadData(b"a cubin or PTX would go here", None, None, 0, None, None, 0))
k = ok(cu.cuLibraryGetKernel(lib, b"sim_15000us"))
fn = ok(cu.cuKernelGetFunction(k))
s = ok(cu.cuStreamCreate(0))
elapsed = timed(s, lambda: launch(fn, 1, s))
name = ok(cu.cuFuncGetName(fn)).decode()
ok(cu.cuLibraryUnload(lib))
print(json.dumps([name, elapsed]))
""", sim_env)
    assert r == ["sim_15000us", ms(15)]


# === cuGetProcAddress ===

def read_tsv_requests():
    rows = []
    for line in CUDART13_REQUESTS.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if fields == ["symbol", "version", "flags"]:
            continue
        rows.append([fields[0], int(fields[1]), int(fields[2])])
    return rows


def known_abis():
    """{base name: [(version, per_thread)]}, from the generated list of CUDA 13 ABIs."""
    abis = {}
    for m in re.finditer(r"X\((\w+), (\d+), ([01])\)", ENTRY_POINTS_H.read_text()):
        abis.setdefault(m[1], []).append((int(m[2]), int(m[3])))
    return abis


def exported_entry_points():
    nm = shutil.which("nm")
    if not nm:
        pytest.skip("nm (binutils) is needed to list libcuda.so.1's exports")
    out = subprocess.run([nm, "-D", "--defined-only", str(LIBCUDA)], capture_output=True,
                         text=True, check=True).stdout
    return sorted({line.split()[-1] for line in out.splitlines()
                   if line.split() and line.split()[-1].startswith("cu")})


def conventional_symbol(name, version, flags, abis):
    """The exported name of the ABI that (name, version, flags) selects, by CUDA's naming:
    the n-th default ABI of a name is name, name_v2, name_v3...; a per-thread ABI (chosen
    when flags ask for one and one is old enough) is the default ABI current at its version
    with _ptds (synchronous copies and sets) or _ptsz (everything else)."""
    defaults = sorted(v for v, pt in abis[name] if not pt)
    per_thread = [v for v, pt in abis[name] if pt and v <= version]
    pt = bool(flags & PER_THREAD and per_thread)
    chosen = max(per_thread) if pt else version
    older = [i for i, v in enumerate(defaults) if v <= chosen]
    if not older:
        return None
    symbol = name if older[-1] == 0 else f"{name}_v{older[-1] + 1}"
    if pt:
        sync_copy = name.startswith(("cuMemcpy", "cuMemset")) and not name.endswith("Async")
        symbol += "_ptds" if sync_copy else "_ptsz"
    return symbol


# Resolves requests in a child with ctypes only: each answer is [CUresult, status, the
# exported symbol the pointer is (or None), and, for a pointer that is not an export, what
# calling it with no arguments returns (or None)].
RESOLVER = """
import ctypes, json, sys
from ctypes import POINTER, byref, c_char_p, c_int, c_uint64, c_void_p
lib = ctypes.CDLL("libcuda.so.1")
v2 = lib.cuGetProcAddress_v2
v2.argtypes = [c_char_p, POINTER(c_void_p), c_int, c_uint64, POINTER(c_int)]
v2.restype = c_int
v1 = lib.cuGetProcAddress
v1.argtypes = [c_char_p, POINTER(c_void_p), c_int, c_uint64]
v1.restype = c_int
requests, exports = json.load(open(sys.argv[1]))
symbol_at = {ctypes.cast(getattr(lib, s), c_void_p).value: s for s in exports}

def answer(p):
    if not p:
        return [None, None]
    if p in symbol_at:
        return [symbol_at[p], None]
    return [None, ctypes.CFUNCTYPE(c_int)(p)()]

out = []
for name, version, flags, *old in requests:
    p, status = c_void_p(), c_int(-1)
    if old:
        res = v1(name.encode(), byref(p), version, flags)
        status.value = -1
    else:
        res = v2(name.encode(), byref(p), version, flags, byref(status))
    out.append([res, status.value, *answer(p.value)])
print(json.dumps(out))
"""


@pytest.fixture
def resolve(sim_env, tmp_path):
    """resolve([[name, version, flags(, "v1")], ...]) -> answers, as RESOLVER gives them."""
    exports = exported_entry_points()

    def run(requests):
        path = tmp_path / f"requests-{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps([requests, exports]))
        return json.loads(run_python(RESOLVER, sim_env, args=(str(path),)).stdout)

    return run


# Our own expectations, from CUDA 13's cuda.h and the cudaTypedefs.h ABI versions.
NAMED_ABIS = [
    ("cuMemAlloc", 3020, 0, "cuMemAlloc_v2"),
    ("cuMemAlloc", 13000, 0, "cuMemAlloc_v2"),
    ("cuDeviceTotalMem", 3020, 0, "cuDeviceTotalMem_v2"),
    ("cuDeviceGetUuid", 9020, 0, "cuDeviceGetUuid"),
    ("cuDeviceGetUuid", 11040, 0, "cuDeviceGetUuid_v2"),
    ("cuCtxCreate", 3020, 0, "cuCtxCreate_v2"),
    ("cuCtxCreate", 11040, 0, "cuCtxCreate_v3"),
    ("cuCtxCreate", 12050, 0, "cuCtxCreate_v4"),
    ("cuLaunchKernel", 4000, 0, "cuLaunchKernel"),
    ("cuLaunchKernel", 7000, 0, "cuLaunchKernel"),
    ("cuLaunchKernel", 7000, 1, "cuLaunchKernel"),             # legacy stream flag
    ("cuLaunchKernel", 7000, PER_THREAD, "cuLaunchKernel_ptsz"),
    ("cuMemcpyHtoD", 3020, 0, "cuMemcpyHtoD_v2"),
    ("cuMemcpyHtoD", 7000, PER_THREAD, "cuMemcpyHtoD_v2_ptds"),
    ("cuMemcpyHtoDAsync", 7000, PER_THREAD, "cuMemcpyHtoDAsync_v2_ptsz"),
    ("cuStreamSynchronize", 2000, 0, "cuStreamSynchronize"),
    ("cuStreamSynchronize", 7000, PER_THREAD, "cuStreamSynchronize_ptsz"),
    ("cuStreamBeginCapture", 10010, PER_THREAD, "cuStreamBeginCapture_v2_ptsz"),
    ("cuEventElapsedTime", 2000, 0, "cuEventElapsedTime"),
    ("cuEventElapsedTime", 12080, 0, "cuEventElapsedTime_v2"),
    ("cuGetProcAddress", 11030, 0, "cuGetProcAddress"),
    ("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2"),
    ("cuInit", 2000, PER_THREAD, "cuInit"),                      # no per-thread ABI: default
    ("cuMemAllocAsync", 11020, PER_THREAD, "cuMemAllocAsync_ptsz"),
]


def test_named_requests_resolve_to_the_abi_the_driver_gives(resolve):
    answers = resolve([[n, v, f] for n, v, f, _ in NAMED_ABIS])
    got = {(n, v, f): a for (n, v, f, _), a in zip(NAMED_ABIS, answers)}
    assert got == {(n, v, f): [SUCCESS, PROC_SUCCESS, sym, None] for n, v, f, sym in NAMED_ABIS}


def test_every_request_of_the_cuda13_runtime_succeeds(resolve):
    rows = read_tsv_requests()
    assert len(rows) > 400
    answers = resolve(rows)
    failed = [(row, a) for row, a in zip(rows, answers)
              if a[:2] != [SUCCESS, PROC_SUCCESS] or (a[2] is None and a[3] is None)]
    assert failed == []


def test_cuda13_runtime_requests_get_the_export_of_their_abi_or_a_not_supported_stub(resolve):
    rows = read_tsv_requests()
    abis, exports = known_abis(), set(exported_entry_points())
    answers = resolve(rows)
    expected, got = {}, {}
    for (name, version, flags), (_, _, symbol, called) in zip(rows, answers):
        want = conventional_symbol(name, version, flags, abis)
        expected[name, version, flags] = want if want in exports else NOT_SUPPORTED
        got[name, version, flags] = symbol if symbol else called
    assert got == expected
    # the runtime asks for entry points simgpu lacks; they must be stubs, not crashes
    assert got["cuDeviceGetP2PAttribute", 8000, 0] == NOT_SUPPORTED
    assert got["cuMemAlloc", 3020, 0] == "cuMemAlloc_v2"


def test_the_abi_table_is_in_strcmp_order_as_its_bisection_needs():
    """abi_resolve.h finds a symbol's first entry by bisection: an entry out of order would
    make names after it unknown to cuGetProcAddress (in simgpu and in the shim)."""
    names = [m[1].encode() for m in re.finditer(r"X\((\w+), \d+, [01]\)", ENTRY_POINTS_H.read_text())]
    assert len(names) > 600
    assert names == sorted(names)   # bytes compare as strcmp does


def test_every_known_abi_resolves_to_its_own_export_or_to_the_stub(resolve):
    abis, exports = known_abis(), set(exported_entry_points())
    requests = sorted({(name, version, PER_THREAD if pt else 0)
                       for name, versions in abis.items() for version, pt in versions}
                      | {(name, 13000, flags) for name in abis for flags in (0, PER_THREAD)})
    answers = resolve([list(r) for r in requests])
    wrong = []
    for (name, version, flags), (res, status, symbol, called) in zip(requests, answers):
        want = conventional_symbol(name, version, flags, abis)
        got = symbol if symbol else called
        if [res, status] != [SUCCESS, PROC_SUCCESS] or got != (want if want in exports
                                                                else NOT_SUPPORTED):
            wrong.append((name, version, flags, res, status, got, want))
    assert wrong == []


def test_every_exported_entry_point_is_reachable_through_get_proc_address(resolve):
    abis, exports = known_abis(), exported_entry_points()
    requests = sorted({(name, version, PER_THREAD if pt else 0)
                       for name, versions in abis.items() for version, pt in versions})
    reached = {a[2] for a in resolve([list(r) for r in requests]) if a[2]}
    assert [s for s in exports if s not in reached] == []


def test_unknown_names_and_too_old_versions_are_not_found(resolve):
    answers = resolve([["cuDefinitelyNotAFunction", 13000, 0],
                       ["cuMemAllocAsync", 11000, 0],
                       ["cuMemAllocAsync", 11000, PER_THREAD],
                       ["cuMemAlloc", 3020, 0, "v1"],
                       ["cuLaunchKernel", 7000, PER_THREAD, "v1"],
                       ["cuDefinitelyNotAFunction", 13000, 0, "v1"]])
    assert answers == [[NOT_FOUND, PROC_SYMBOL_NOT_FOUND, None, None],
                       [NOT_FOUND, PROC_VERSION_NOT_SUFFICIENT, None, None],
                       [NOT_FOUND, PROC_VERSION_NOT_SUFFICIENT, None, None],
                       [SUCCESS, -1, "cuMemAlloc_v2", None],
                       [SUCCESS, -1, "cuLaunchKernel_ptsz", None],
                       [NOT_FOUND, -1, None, None]]


# === bad input: errors, never crashes ===

BEFORE_INIT = """
import ctypes, json
from ctypes import byref, c_int, c_size_t, c_uint64, c_void_p
lib = ctypes.CDLL("libcuda.so.1")
i, p, u, u2 = c_int(), c_void_p(), c_uint64(), c_uint64()
name = ctypes.create_string_buffer(64)
host = ctypes.create_string_buffer(64)
desc = (c_size_t * 3)(16, 16, 0x20 | (1 << 32))    # CUDA_ARRAY_DESCRIPTOR, 16x16 float x1
"""


def test_calls_before_cuinit_are_not_initialized(sim_env):
    r = json.loads(run_python(BEFORE_INIT + """
version = c_int()
calls = {
    "cuDeviceGetCount": lambda: lib.cuDeviceGetCount(byref(i)),
    "cuDeviceGet": lambda: lib.cuDeviceGet(byref(i), 0),
    "cuDeviceGetName": lambda: lib.cuDeviceGetName(name, 64, 0),
    "cuDeviceTotalMem_v2": lambda: lib.cuDeviceTotalMem_v2(byref(u), 0),
    "cuDevicePrimaryCtxRetain": lambda: lib.cuDevicePrimaryCtxRetain(byref(p), 0),
    "cuCtxGetCurrent": lambda: lib.cuCtxGetCurrent(byref(p)),
    "cuMemGetInfo_v2": lambda: lib.cuMemGetInfo_v2(byref(u), byref(u2)),
    "cuMemAlloc_v2": lambda: lib.cuMemAlloc_v2(byref(u), c_size_t(16)),
    "cuMemFree_v2": lambda: lib.cuMemFree_v2(c_uint64(4096)),
    "cuMemsetD8_v2": lambda: lib.cuMemsetD8_v2(c_uint64(4096), 1, c_size_t(1)),
    "cuStreamCreate": lambda: lib.cuStreamCreate(byref(p), 0),
    "cuStreamSynchronize": lambda: lib.cuStreamSynchronize(None),
    "cuEventCreate": lambda: lib.cuEventCreate(byref(p), 0),
    "cuModuleLoadData": lambda: lib.cuModuleLoadData(byref(p), host),
    "cuLaunchKernel": lambda: lib.cuLaunchKernel(c_void_p(4096), 1, 1, 1, 1, 1, 1, 0, None, None, None),
    "cuArrayCreate_v2": lambda: lib.cuArrayCreate_v2(byref(p), desc),
    "cuCtxSynchronize": lambda: lib.cuCtxSynchronize(),
}
out = {k: call() for k, call in calls.items()}
out["cuDriverGetVersion"] = [lib.cuDriverGetVersion(byref(version)), version.value]
print(json.dumps(out))
""", sim_env).stdout)
    assert r.pop("cuDriverGetVersion") == [SUCCESS, 13000]   # the one call that needs no init
    assert r == {k: NOT_INITIALIZED for k in r}


def test_copies_and_argument_checked_calls_before_cuinit_are_not_initialized(sim_env):
    r = json.loads(run_python(BEFORE_INIT + """
calls = {
    "cuMemcpyHtoD_v2": lambda: lib.cuMemcpyHtoD_v2(c_uint64(4096), host, c_size_t(1)),
    "cuMemcpyDtoH_v2": lambda: lib.cuMemcpyDtoH_v2(host, c_uint64(4096), c_size_t(1)),
    "cuMemcpyDtoD_v2": lambda: lib.cuMemcpyDtoD_v2(c_uint64(4096), c_uint64(8192), c_size_t(1)),
    "cuMemcpyHtoDAsync_v2": lambda: lib.cuMemcpyHtoDAsync_v2(c_uint64(4096), host, c_size_t(1), None),
    "cuArrayCreate_v2": lambda: lib.cuArrayCreate_v2(byref(p), None),
    "cuLaunchKernelEx": lambda: lib.cuLaunchKernelEx(None, None, None, None),
    "cuModuleLoad": lambda: lib.cuModuleLoad(byref(p), b"/nonexistent/module.cubin"),
}
print(json.dumps({k: call() for k, call in calls.items()}))
""", sim_env).stdout)
    assert r == {k: NOT_INITIALIZED for k in r}


def test_calls_that_need_a_context_without_one_are_invalid_context(sim_env):
    r = cuda("""
ok(cu.cuInit(0))
dev = ok(cu.cuDeviceGet(0))
no_context = [rc(cu.cuMemAlloc(16)), rc(cu.cuMemGetInfo()), rc(cu.cuStreamCreate(0)),
              rc(cu.cuCtxSynchronize()), rc(cu.cuMemAllocManaged(16, 1))]
ctx = ok(cu.cuCtxCreate(None, 0, dev))
p = ok(cu.cuMemAlloc(16))
ok(cu.cuCtxDestroy(ctx))
after_destroy = [rc(cu.cuMemAlloc(16)), rc(cu.cuCtxSetCurrent(ctx)), rc(cu.cuCtxDestroy(ctx))]
print(json.dumps([no_context, after_destroy]))
""", sim_env)
    assert r == [[INVALID_CONTEXT] * 5, [INVALID_CONTEXT] * 3]


def test_bad_sizes_and_addresses_are_invalid_value(sim_env):
    r = cuda("""
context()
p = ok(cu.cuMemAlloc(4096))
host = ctypes.create_string_buffer(64)
host_addr = cu.CUdeviceptr(ctypes.addressof(host))
out = {
    "alloc 0": rc(cu.cuMemAlloc(0)),
    "free never allocated": rc(cu.cuMemFree(cu.CUdeviceptr(0xdead0000))),
    "free interior pointer": rc(cu.cuMemFree(dptr(p, 16))),
    "free host address": rc(cu.cuMemFree(host_addr)),
    "HtoD to host address": rc(cu.cuMemcpyHtoD(host_addr, b"x", 1)),
    "HtoD to unmapped address": rc(cu.cuMemcpyHtoD(cu.CUdeviceptr(0x1000), b"x", 1)),
    "HtoD past the end": rc(cu.cuMemcpyHtoD(dptr(p, 4095), b"xy", 2)),
    "DtoH from host address": rc(cu.cuMemcpyDtoH(bytearray(1), host_addr, 1)),
    "memset past the end": rc(cu.cuMemsetD32(dptr(p, 4092), 7, 2)),
}
ok(cu.cuMemFree(p))
out["double free"] = rc(cu.cuMemFree(p))
out["HtoD to freed memory"] = rc(cu.cuMemcpyHtoD(p, b"x", 1))
print(json.dumps(out))
""", sim_env)
    assert r == {k: INVALID_VALUE for k in r}


def test_bogus_and_destroyed_handles_are_invalid_handle(sim_env):
    r = cuda("""
context()
fn = kernel("sim_1000us")
good = int(fn)
bogus = {}
for label, value in [("12345", 12345), ("misaligned real handle", good + 8),
                     ("far away", 0x7ff000000000)]:
    bogus[label] = rc(cu.cuLaunchKernel(cu.CUfunction(value), 1, 1, 1, 1, 1, 1, 0, 0, 0, 0))
s = ok(cu.cuStreamCreate(0))
bogus["stream used as a function"] = rc(cu.cuLaunchKernel(cu.CUfunction(int(s)), 1, 1, 1, 1, 1, 1, 0, 0, 0, 0))
ok(cu.cuStreamDestroy(s))
e = ok(cu.cuEventCreate(0))
e2 = ok(cu.cuEventCreate(0))
ok(cu.cuEventRecord(e2, 0))
ok(cu.cuEventDestroy(e))
destroyed = {
    "sync stream": rc(cu.cuStreamSynchronize(s)),
    "query stream": rc(cu.cuStreamQuery(s)),
    "launch on stream": rc(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)),
    "destroy stream again": rc(cu.cuStreamDestroy(s)),
    "record event": rc(cu.cuEventRecord(e, 0)),
    "query event": rc(cu.cuEventQuery(e)),
    "sync event": rc(cu.cuEventSynchronize(e)),
    "elapsed with event": rc(cu.cuEventElapsedTime(e2, e)),
    "destroy event again": rc(cu.cuEventDestroy(e)),
}
print(json.dumps([bogus, destroyed]))
""", sim_env)
    bogus, destroyed = r
    assert bogus == {k: INVALID_HANDLE for k in bogus}
    assert destroyed == {k: INVALID_HANDLE for k in destroyed}


OVERFLOWING_SIZES = {
    "HtoD": "cu.cuMemcpyHtoD(dptr(p, 16), host, 2**64 - 8)",
    "DtoH": "cu.cuMemcpyDtoH(host, dptr(p, 16), 2**64 - 8)",
    "HtoDAsync": "cu.cuMemcpyHtoDAsync(dptr(p, 16), host, 2**64 - 8, 0)",
    "D8": "cu.cuMemsetD8(dptr(p, 16), 7, 2**64 - 8)",
    "D16": "cu.cuMemsetD16(p, 7, 2**63)",
    "D32": "cu.cuMemsetD32(p, 7, 2**62)",
}


@pytest.mark.parametrize("call", list(OVERFLOWING_SIZES))
def test_sizes_that_wrap_around_the_address_space_are_invalid_value_not_a_crash(sim_env, call):
    proc = run_python(PRELUDE + f"""
context()
p = ok(cu.cuMemAlloc(4096))
host = ctypes.addressof(ctypes.create_string_buffer(64))
print(json.dumps(rc({OVERFLOWING_SIZES[call]})))
""", sim_env, check=False)
    assert (proc.returncode, proc.stdout.strip()) == (0, str(INVALID_VALUE))


def test_stream_of_a_destroyed_context_is_an_error_not_a_crash(sim_env):
    proc = run_python(PRELUDE + """
ok(cu.cuInit(0))
dev = ok(cu.cuDeviceGet(0))
primary = ok(cu.cuDevicePrimaryCtxRetain(dev))
fn = kernel("sim_1000us")
ctx = ok(cu.cuCtxCreate(None, 0, dev))
s = ok(cu.cuStreamCreate(0))
ok(cu.cuEventDestroy(ok(cu.cuEventCreate(0))))   # a freed handle ahead in the free list
ok(cu.cuCtxDestroy(ctx))
ok(cu.cuCtxSetCurrent(primary))
print(json.dumps([rc(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)),
                  rc(cu.cuStreamSynchronize(s)), rc(cu.cuMemAllocAsync(1 << 20, s))]))
""", sim_env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert all(code in (INVALID_HANDLE, INVALID_CONTEXT) for code in json.loads(proc.stdout))


def test_address_free_with_a_size_other_than_the_reservation_is_invalid_value(sim_env):
    r = cuda(VMM + """
va = ok(cu.cuMemAddressReserve(gran, 0, 0, 0))
wrong = rc(cu.cuMemAddressFree(va, 2 * gran))
h = ok(cu.cuMemCreate(gran, prop, 0))
still_reserved = rc(cu.cuMemMap(va, gran, 0, h, 0))
print(json.dumps([wrong, still_reserved]))
""", sim_env)
    assert r == [INVALID_VALUE, SUCCESS]


def test_device_ordinals_out_of_range_are_invalid_device(sim_env):
    r = cuda("""
ok(cu.cuInit(0))
print(json.dumps([rc(cu.cuDeviceGet(99)), rc(cu.cuDeviceGet(1)), rc(cu.cuDeviceGet(-1)),
                  rc(cu.cuDeviceGetName(32, 5)), rc(cu.cuDeviceTotalMem(5)),
                  rc(cu.cuDevicePrimaryCtxRetain(5)), rc(cu.cuCtxCreate(None, 0, 5))]))
""", sim_env)
    assert r == [INVALID_DEVICE] * 7


INIT = """
import ctypes, json
lib = ctypes.CDLL("libcuda.so.1")
count = ctypes.c_int(-1)
print(json.dumps([lib.cuInit(0), lib.cuDeviceGetCount(ctypes.byref(count))]))
"""


def init_result(env):
    proc = run_python(INIT, env)
    return json.loads(proc.stdout), proc.stderr


def test_unknown_profile_fails_cuinit_naming_the_variable_and_the_profiles(tmp_path):
    result, stderr = init_result(make_sim_env(tmp_path / "node", profile="b200"))
    assert result == [NO_DEVICE, NOT_INITIALIZED]
    assert f"SIMGPU_PROFILE=b200 is not a known profile (known: {', '.join(PROFILES)})" in stderr


@pytest.mark.parametrize("devices", ["0", "9", "x"])
def test_bad_device_count_fails_cuinit_naming_simgpu_devices(tmp_path, devices):
    result, stderr = init_result(make_sim_env(tmp_path / "node", devices=devices))
    assert result == [NO_DEVICE, NOT_INITIALIZED]
    assert f"SIMGPU_DEVICES={devices} is not a device count between 1 and 8" in stderr


def test_unwritable_state_dir_fails_cuinit_naming_the_path(tmp_path):
    blocker = tmp_path / "plain-file"
    blocker.write_text("not a directory")
    result, stderr = init_result(make_sim_env(blocker / "node"))
    assert result == [NO_DEVICE, NOT_INITIALIZED]
    assert f"cannot create state directory {blocker / 'node'}" in stderr


def test_a_node_keeps_the_profile_and_device_count_it_was_created_with(tmp_path):
    state = tmp_path / "node"
    assert init_result(make_sim_env(state, profile="a10")) == ([SUCCESS, SUCCESS], "")
    result, stderr = init_result(make_sim_env(state, profile="h200"))
    assert result == [NO_DEVICE, NOT_INITIALIZED]
    assert "already simulates a10" in stderr
    result, stderr = init_result(make_sim_env(state, profile="a10", devices=2))
    assert result == [NO_DEVICE, NOT_INITIALIZED]
    assert "already simulates a10 x1" in stderr
    # without an explicit request, a process adopts what the node simulates
    env = make_sim_env(state)
    del env["SIMGPU_PROFILE"], env["SIMGPU_DEVICES"]
    r = cuda("""
ok(cu.cuInit(0))
print(json.dumps([ok(cu.cuDeviceGetCount()), ok(cu.cuDeviceGetName(32, 0)).split(b"\\0")[0].decode()]))
""", env)
    assert r == [1, "NVIDIA A10"]


# === fork: the driver is not usable in the child, and the child holds what its parent held ===

REFEREE = """
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
print(json.dumps([n.nvmlDeviceGetMemoryInfo(h).used,
                  sorted([p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(h)
                         if p.usedGpuMemory)]))
"""


def referee(env):
    """What the device holds, seen by NVML from a process of its own: [used, [[pid, bytes]]]."""
    return json.loads(run_python(REFEREE, env).stdout.strip().splitlines()[-1])


def shm_files(env):
    return sorted(p.name for p in Path(env["SIMGPU_STATE_DIR"]).iterdir() if p.name.startswith("shm-"))


class Stepper:
    """A child that prints one JSON line per step and waits for a line from the test."""

    def __init__(self, code, env, args=(), **popen):
        self.proc = subprocess.Popen([sys.executable, "-c", PRELUDE + STEP + code, *map(str, args)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, **popen)
        self.pid = self.proc.pid

    def read(self):
        line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            raise AssertionError(f"{self.pid} ended:\n{self.proc.stderr.read()}")
        return json.loads(line)

    def go(self):
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self

    def end(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            pipe.close()


STEP = """
MiB = 1 << 20

def step(obj):
    print(json.dumps(obj), flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def steppers():
    started = []

    def start(code, env, args=(), **popen):
        s = Stepper(code, env, args, **popen)
        started.append(s)
        return s

    yield start
    for s in started:
        s.end()


FORKED = """
release = sys.argv[1]
context()
held = ok(cu.cuMemAlloc(256 * MiB))
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.close(r)
    calls = [rc(cu.cuInit(0)), rc(cu.cuDeviceGetCount()), rc(cu.cuCtxGetCurrent()), rc(cu.cuMemAlloc(MiB)),
             rc(cu.cuMemFree(held)), rc(cu.cuMemGetInfo())]
    os.write(w, json.dumps(calls).encode())
    os.close(w)
    while not os.path.exists(release):   # a DataLoader worker outliving its parent
        time.sleep(0.02)
    os._exit(0)
os.close(w)
calls = json.loads(os.fdopen(r).read())
step({"parent": os.getpid(), "child": child, "child_calls": calls})
"""


@pytest.mark.parametrize("parent_ends", ["exit", "kill -9"])
def test_a_forked_child_cannot_use_cuda_and_holds_its_parents_memory_until_it_exits(sim_env, steppers,
                                                                                      tmp_path, parent_ends):
    release = tmp_path / "release"
    p = steppers(FORKED, sim_env, args=(release,))
    try:
        r = p.read()
        parent, child = r["parent"], r["child"]
        assert r["child_calls"] == [NOT_INITIALIZED] * 6   # forked after cuInit: CUDA_ERROR_NOT_INITIALIZED
        assert referee(sim_env) == [256 * MiB, [[parent, 256 * MiB]]]

        if parent_ends == "exit":
            p.proc.stdin.close()
            assert p.proc.wait(timeout=30) == 0
        else:
            p.proc.kill()
            p.proc.wait()
        # the parent is gone; its memory is not: the child holds it, listed under the parent's pid
        assert referee(sim_env) == [256 * MiB, [[parent, 256 * MiB]]]
    finally:
        release.touch()         # a failed run leaves no child waiting for it
    wait_gone(child)
    assert referee(sim_env) == [0, []]


def test_a_child_forked_before_cuInit_is_a_process_like_any_other(sim_env):
    r = cuda("""
r, w = os.pipe()
child = os.fork()
if child == 0:
    context()
    p = ok(cu.cuMemAlloc(1 << 20))
    os.write(w, json.dumps([rc(cu.cuMemFree(p))]).encode())
    os._exit(0)
os.close(w)
got = json.loads(os.fdopen(r).read())
os.waitpid(child, 0)
print(json.dumps(got))
""", sim_env)
    assert r == [SUCCESS]


# === memory shared between processes: IPC handles ===

IPC_EXPORTER = """
context()
p = ok(cu.cuMemAlloc(64 * MiB))
ok(cu.cuMemcpyHtoD(dptr(p, 1000), b"ping", 4))
h, again = ok(cu.cuIpcGetMemHandle(p)), ok(cu.cuIpcGetMemHandle(p))
raw = ctypes.string_at(h.getPtr(), 64)
capable = ok(cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p))
step({"pid": os.getpid(), "handle": raw.hex(), "same_handle": raw == ctypes.string_at(again.getPtr(), 64),
      "own_open": rc(cu.cuIpcOpenMemHandle(h, 1)), "capable": int(capable)})
back = bytearray(4)
ok(cu.cuMemcpyDtoH(back, dptr(p, 2000), 4))
ok(cu.cuMemFree(p))
step({"read": back.decode()})
"""

IPC_IMPORTER = """
context()
h = cu.CUipcMemHandle()
ctypes.memmove(h.getPtr(), bytes.fromhex(sys.argv[1]), 64)
p, p2 = ok(cu.cuIpcOpenMemHandle(h, 1)), ok(cu.cuIpcOpenMemHandle(h, 1))
got = bytearray(4)
ok(cu.cuMemcpyDtoH(got, dptr(p, 1000), 4))
ok(cu.cuMemcpyHtoD(dptr(p, 2000), b"pong", 4))
step({"pid": os.getpid(), "read": got.decode(), "same_pointer": int(p) == int(p2)})
closes = [rc(cu.cuIpcCloseMemHandle(p))]
step({"closes": closes})
closes += [rc(cu.cuIpcCloseMemHandle(p2)), rc(cu.cuIpcCloseMemHandle(p2))]
step({"closes": closes, "reopened": rc(cu.cuIpcOpenMemHandle(h, 1))})
"""


@pytest.mark.parametrize("exporter_ends", ["free", "kill -9"])
def test_ipc_memory_stays_on_the_device_until_its_last_holder_lets_go(sim_env, steppers, exporter_ends):
    e = steppers(IPC_EXPORTER, sim_env)
    er = e.read()
    assert (er["same_handle"], er["own_open"], er["capable"]) == (True, INVALID_CONTEXT, 1)
    i = steppers(IPC_IMPORTER, sim_env, args=(er["handle"],))
    ir = i.read()
    assert (ir["read"], ir["same_pointer"]) == ("ping", True)
    assert referee(sim_env) == [64 * MiB, [[e.pid, 64 * MiB]]]   # once, to the process that allocated it

    if exporter_ends == "free":
        assert e.go().read() == {"read": "pong"}   # the importer's write, seen by the exporter
    else:
        e.proc.kill()
        e.proc.wait()
    assert referee(sim_env) == [64 * MiB, [[e.pid, 64 * MiB]]]   # the importer keeps it alive

    assert i.go().read() == {"closes": [SUCCESS]}   # opened twice: still mapped
    assert referee(sim_env) == [64 * MiB, [[e.pid, 64 * MiB]]]
    assert i.go().read() == {"closes": [SUCCESS, SUCCESS, INVALID_VALUE], "reopened": INVALID_HANDLE}
    assert referee(sim_env) == [0, []]
    assert shm_files(sim_env) == []


def test_ipc_handles_follow_the_documented_rules(sim_env):
    r = cuda("""
context()
p = ok(cu.cuMemAlloc(4 << 20))
managed = ok(cu.cuMemAllocManaged(4 << 20, 1))
pooled = ok(cu.cuMemAllocAsync(4 << 20, 0))
out = [rc(cu.cuIpcGetMemHandle(cu.CUdeviceptr(int(p) + 4096))),   # not the base of an allocation
       rc(cu.cuIpcGetMemHandle(managed)), rc(cu.cuIpcGetMemHandle(pooled))]
h = ok(cu.cuIpcGetMemHandle(p))
out.append(rc(cu.cuIpcOpenMemHandle(h, 2)))                        # flags: CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
out.append(rc(cu.cuIpcOpenMemHandle(cu.CUipcMemHandle(), 1)))      # not a handle
out.append(rc(cu.cuIpcCloseMemHandle(p)))                          # not an opened handle
ok(cu.cuMemFree(p))
print(json.dumps(out))
""", sim_env)
    assert r == [INVALID_VALUE, INVALID_VALUE, INVALID_VALUE, INVALID_VALUE, INVALID_HANDLE, INVALID_VALUE]


# === memory shared between processes: shareable VMM handles ===

SHAREABLE = VMM + """
import socket
POSIX_FD = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
prop.requestedHandleTypes = POSIX_FD
size = 32 << 20
"""

VMM_EXPORTER = SHAREABLE + """
sock = socket.socket(fileno=int(sys.argv[1]))
h = ok(cu.cuMemCreate(size, prop, 0))
va = mapped(h, size)
ok(cu.cuMemcpyHtoD(dptr(va, 100), b"vmm!", 4))
fd = ok(cu.cuMemExportToShareableHandle(h, POSIX_FD, 0))
socket.send_fds(sock, [b"x"], [fd])
os.close(fd)
step({"pid": os.getpid()})
ok(cu.cuMemUnmap(va, size))
ok(cu.cuMemRelease(h))
step({})
"""

VMM_IMPORTER = SHAREABLE + """
sock = socket.socket(fileno=int(sys.argv[1]))
_, fds, _, _ = socket.recv_fds(sock, 1, 1)
h = ok(cu.cuMemImportFromShareableHandle(fds[0], POSIX_FD))
os.close(fds[0])
va = mapped(h, size)
got = bytearray(4)
ok(cu.cuMemcpyDtoH(got, dptr(va, 100), 4))
step({"read": got.decode()})
h2 = ok(cu.cuMemRetainAllocationHandle(va))
ok(cu.cuMemRelease(h))
step({"retained_same": int(h2) == int(h)})
ok(cu.cuMemUnmap(va, size))
step({})
ok(cu.cuMemRelease(h2))
step({})
"""


def test_shareable_vmm_memory_stays_while_any_handle_or_mapping_holds_it(sim_env, steppers):
    import socket
    a, b = socket.socketpair()
    with a, b:
        e = steppers(VMM_EXPORTER, sim_env, args=(a.fileno(),), pass_fds=(a.fileno(),))
        i = steppers(VMM_IMPORTER, sim_env, args=(b.fileno(),), pass_fds=(b.fileno(),))
        pid = e.read()["pid"]
        assert i.read() == {"read": "vmm!"}
    assert referee(sim_env) == [32 * MiB, [[pid, 32 * MiB]]]
    assert e.go().read() == {}   # the exporter released and unmapped it
    assert referee(sim_env) == [32 * MiB, [[pid, 32 * MiB]]]
    assert i.go().read() == {"retained_same": True}   # the import released; retained and mapped
    assert referee(sim_env) == [32 * MiB, [[pid, 32 * MiB]]]
    assert i.go().read() == {}   # unmapped; the retained reference holds it
    assert referee(sim_env) == [32 * MiB, [[pid, 32 * MiB]]]
    i.go().read()                # the retained reference released: the last holder
    assert referee(sim_env) == [0, []]
    assert shm_files(sim_env) == []


def test_an_open_shareable_handle_alone_keeps_the_memory(sim_env):
    r = cuda(SHAREABLE.replace("import socket", "") + """
f0 = free_bytes()
h = ok(cu.cuMemCreate(size, prop, 0))
fd = ok(cu.cuMemExportToShareableHandle(h, POSIX_FD, 0))
ok(cu.cuMemRelease(h))
held = f0 - free_bytes()
os.close(fd)
gone = f0 - free_bytes()
plain = cu.CUmemAllocationProp()
plain.type, plain.location.type, plain.location.id = prop.type, prop.location.type, 0
h = ok(cu.cuMemCreate(size, plain, 0))
not_shareable = rc(cu.cuMemExportToShareableHandle(h, POSIX_FD, 0))
fabric = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
plain.requestedHandleTypes = fabric
print(json.dumps([held, gone, not_shareable, rc(cu.cuMemCreate(size, plain, 0)),
                  rc(cu.cuMemExportToShareableHandle(h, fabric, 0))]))
""", sim_env)
    assert r == [32 * MiB, 0, INVALID_VALUE, NOT_SUPPORTED, NOT_SUPPORTED]


# === the ABI simgpu writes itself (csrc/cuda_abi.h) against NVIDIA's cuda.h ===

CUDA_INCLUDE = Path("/usr/local/cuda/include")


@pytest.mark.skipif(not (CUDA_INCLUDE / "cuda.h").exists(), reason="CUDA toolkit headers absent")
def test_pool_location_and_graph_memory_abi_matches_cuda_h(c_program, tmp_path):
    ours = c_program("abi_values")
    theirs = tmp_path / "abi_values_toolkit"
    subprocess.run(["cc", "-std=gnu11", "-Wall", "-Werror", "-DWITH_TOOLKIT", "-I", str(CUDA_INCLUDE),
                    str(ROOT / "tests" / "programs" / "abi_values.c"), "-o", str(theirs)], check=True)
    out = [subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
           for exe in (ours, theirs)]
    assert out[0] == out[1]
    assert "sizeof(CUDA_MEM_ALLOC_NODE_PARAMS)=" in out[0]


# === a C client through dlopen ===

def test_c_client_through_dlopen_runs_the_whole_cycle(sim_env, c_program):
    exe = c_program("dlopen_client")
    proc = subprocess.run([str(exe)], env=sim_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "ok"
    values = dict(line.split("=", 1) for line in lines[:-1])
    kernel_ms = float(values.pop("kernel_ms"))
    assert values == {"name": "NVIDIA A10", "total": str(24 * GiB), "alloc_drop": str(2 * MiB),
                      "free_restored": "1", "roundtrip": "1",
                      "bogus_launch": str(INVALID_HANDLE)}
    assert 1.0 <= kernel_ms < 100   # the sync waited for the 1 ms kernel (and not for ages)
