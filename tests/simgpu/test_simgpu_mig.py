"""simgpu's MIG, driven through NVIDIA's own clients: nvidia-ml-py (pynvml) for NVML and
cuda-bindings for CUDA, each in child processes bound to a fresh simgpu node.

What is checked comes from NVIDIA's published nvml.h (structs, constants, return codes of
the nvmlMultiInstanceGPU group), the MIG user guide and the recorded nvidia-smi output
collected in ../shared/reference/nvml-mig.md; simgpu/mig.c cites each source.
"""
import ctypes
import json
import os
import re
import subprocess
from pathlib import Path

import pynvml
import pytest

from tests.helpers.paths import PROGRAMS
from tests.helpers.simnode import make_sim_env, run_python, start_python

MiB = 1 << 20
SUCCESS, NOT_SUPPORTED, INVALID_ARGUMENT, NOT_FOUND = 0, 3, 2, 6
IN_USE, INSUFFICIENT_RESOURCES = 19, 23
MIG_UUID = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")

# GPU instance profiles: enum index -> (ID, name, compute slices, instances, SMs, copy engines,
# decoders, encoders, JPEG, OFA, memorySizeMB).  A100 and H100 memory and engines: the
# reference's -lgip captures; H100 SMs: an H100 SXM5 capture (simgpu's h100-80g is the
# 132-SM SXM5 board; the reference's 14/30/46/62/114 are the PCIe board's); H200: the MIG
# user guide's engines and instance counts, SMs and memory as mig.c says.
PROFILES = {
    "a100-40g": {
        0: (19, "1g.5gb", 1, 7, 14, 1, 0, 0, 0, 0, 4864),
        1: (14, "2g.10gb", 2, 3, 28, 2, 1, 0, 0, 0, 9984),
        2: (9, "3g.20gb", 3, 2, 42, 3, 2, 0, 0, 0, 20096),
        3: (5, "4g.20gb", 4, 1, 56, 4, 2, 0, 0, 0, 20096),
        4: (0, "7g.40gb", 7, 1, 98, 7, 5, 0, 1, 1, 40320),
        7: (20, "1g.5gb+me", 1, 1, 14, 1, 1, 0, 1, 1, 4864),
        9: (15, "1g.10gb", 1, 4, 14, 1, 1, 0, 0, 0, 9984),
    },
    "h100-80g": {
        0: (19, "1g.10gb", 1, 7, 16, 1, 1, 0, 1, 0, 9984),
        1: (14, "2g.20gb", 2, 3, 32, 2, 2, 0, 2, 0, 20096),
        2: (9, "3g.40gb", 3, 2, 60, 3, 3, 0, 3, 0, 40448),
        3: (5, "4g.40gb", 4, 1, 64, 4, 4, 0, 4, 0, 40448),
        4: (0, "7g.80gb", 7, 1, 132, 8, 7, 0, 7, 1, 81152),
        7: (20, "1g.10gb+me", 1, 1, 16, 1, 1, 0, 1, 1, 9984),
        9: (15, "1g.20gb", 1, 4, 26, 1, 1, 0, 1, 0, 20096),
    },
    "h200": {
        0: (19, "1g.18gb", 1, 7, 16, 1, 1, 0, 1, 0, 16384),
        1: (14, "2g.35gb", 2, 3, 32, 2, 2, 0, 2, 0, 33280),
        2: (9, "3g.71gb", 3, 2, 60, 3, 3, 0, 3, 0, 71424),
        3: (5, "4g.71gb", 4, 1, 64, 4, 4, 0, 4, 0, 71424),
        4: (0, "7g.141gb", 7, 1, 132, 8, 7, 0, 7, 1, 143360),
        7: (20, "1g.18gb+me", 1, 1, 16, 1, 1, 0, 1, 1, 16384),
        9: (15, "1g.35gb", 1, 4, 26, 1, 1, 0, 1, 0, 33280),
    },
}
# The Memory GiB column of the reference's nvidia-smi mig -lgip captures, by profile ID.
LGIP_GIB = {
    "a100-40g": {19: "4.75", 20: "4.75", 15: "9.75", 14: "9.75", 9: "19.62", 5: "19.62", 0: "39.38"},
    "h100-80g": {19: "9.75", 20: "9.75", 15: "19.62", 14: "19.62", 9: "39.50", 5: "39.50", 0: "79.25"},
}
# The H200 guide's memory fractions (of 8 memory slices) by profile ID.
H200_MEMORY_SLICES = {19: 1, 20: 1, 15: 2, 14: 2, 9: 4, 5: 4, 0: 8}
# nvidia-smi mig -lgipp as the MIG user guide gives it: profile ID -> ({starts}, memory slices).
PLACEMENTS = {19: ([0, 1, 2, 3, 4, 5, 6], 1), 20: ([0, 1, 2, 3, 4, 5, 6], 1), 15: ([0, 2, 4, 6], 2),
              14: ([0, 2, 4], 2), 9: ([0, 4], 4), 5: ([0], 4), 0: ([0], 8)}


def nvml(code, env, **kw):
    """Run `code` in a child after pynvml's import and nvmlInit; return the JSON it prints last."""
    prelude = """
import ctypes, json, os, sys, time
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)

def rc(call, *args):
    try:
        call(*args)
        return 0
    except n.NVMLError as e:
        return e.value

def enable():
    assert n.nvmlDeviceSetMigMode(h, n.NVML_DEVICE_MIG_ENABLE) == 0
    return n.nvmlDeviceGetMigMode(h)

def gi_info(gi):
    i = n.nvmlGpuInstanceGetInfo(gi)
    return [i.id, i.profileId, i.placement.start, i.placement.size]

def P(start, size):
    \"\"\"A placement argument: pynvml passes it on as given, and the call takes a pointer.\"\"\"
    return ctypes.byref(n.c_nvmlGpuInstancePlacement_t(start, size))

def CP(start, size):
    return ctypes.byref(n.c_nvmlComputeInstancePlacement_t(start, size))

MEMORY_SLICES = {19: 1, 20: 1, 15: 2, 14: 2, 9: 4, 5: 4, 0: 8}

def mig_device(gi_profile, placement_start=None):
    \"\"\"A GPU instance of `gi_profile` with one compute instance over all of it: its MIG UUID.\"\"\"
    if placement_start is None:
        gi = n.nvmlDeviceCreateGpuInstance(h, gi_profile)
    else:
        gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, gi_profile, P(placement_start, MEMORY_SLICES[gi_profile]))
    full = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[n.nvmlDeviceGetGpuInstanceProfileInfoById(h, gi_profile).sliceCount]
    ci = n.nvmlGpuInstanceCreateComputeInstance(gi, full)
    for i in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
        except n.NVMLError_NotFound:
            break
        if (n.nvmlDeviceGetGpuInstanceId(m) == n.nvmlGpuInstanceGetInfo(gi).id and
                n.nvmlDeviceGetComputeInstanceId(m) == n.nvmlComputeInstanceGetInfo(ci).id):
            return n.nvmlDeviceGetUUID(m)
    raise SystemExit("no MIG device for the new instance")
"""
    out = run_python(prelude + code, env, **kw)
    return json.loads(out.stdout.strip().splitlines()[-1])


# A CUDA process: `context()` makes the primary context of device 0 current.
CUDA = """
import json, os, sys, time
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

def kernel(name):
    module = ok(cu.cuModuleLoadData(b"any image: simgpu runs kernels by name"))
    return ok(cu.cuModuleGetFunction(module, name.encode()))

def timed(fn, blocks):
    \"\"\"Milliseconds of simulated time one launch takes, between events around it.\"\"\"
    start, end = ok(cu.cuEventCreate(0)), ok(cu.cuEventCreate(0))
    ok(cu.cuEventRecord(start, 0))
    ok(cu.cuLaunchKernel(fn, blocks, 1, 1, 1, 1, 1, 0, 0, 0, 0))
    ok(cu.cuEventRecord(end, 0))
    ok(cu.cuEventSynchronize(end))
    return ok(cu.cuEventElapsedTime(start, end))
"""


def cuda(code, env, **kw):
    out = run_python(CUDA + code, env, **kw)
    return json.loads(out.stdout.strip().splitlines()[-1])


def holder(env, allocate=0):
    """A CUDA process holding a context (and `allocate` bytes) on device 0 until stdin closes."""
    proc = start_python(CUDA + f"""
context()
if {allocate}:
    ok(cu.cuMemAlloc({allocate}))
print(json.dumps(os.getpid()), flush=True)
sys.stdin.readline()
""", env)
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    return proc


def release(proc):
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0, proc.stderr.read()


@pytest.fixture
def node(tmp_path):
    """make(profile) -> environment of a fresh node of that simgpu profile."""
    counter = iter(range(100))
    return lambda profile, **extra: make_sim_env(tmp_path / f"node{next(counter)}", profile=profile, **extra)


# === the ABI ===

class GpuInstanceProfileInfoV3(ctypes.Structure):
    """nvmlGpuInstanceProfileInfo_v3_t, field by field as nvml.h declares it (pynvml has no v3)."""
    _fields_ = [("version", ctypes.c_uint), ("id", ctypes.c_uint), ("sliceCount", ctypes.c_uint),
                ("instanceCount", ctypes.c_uint), ("multiprocessorCount", ctypes.c_uint),
                ("copyEngineCount", ctypes.c_uint), ("decoderCount", ctypes.c_uint),
                ("encoderCount", ctypes.c_uint), ("jpegCount", ctypes.c_uint), ("ofaCount", ctypes.c_uint),
                ("memorySizeMB", ctypes.c_ulonglong), ("name", ctypes.c_char * 96),
                ("capabilities", ctypes.c_uint)]


class ComputeInstanceProfileInfoV3(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint) for f in ("version", "id", "sliceCount", "instanceCount", "multiprocessorCount",
                                              "sharedCopyEngineCount", "sharedDecoderCount", "sharedEncoderCount",
                                              "sharedJpegCount", "sharedOfaCount")] + [
        ("name", ctypes.c_char * 96), ("capabilities", ctypes.c_uint)]


def abi_values(c_program, extra=()):
    exe = c_program("mig_abi", extra_flags=list(extra))
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return dict(line.split("=") for line in out.split())


def test_struct_layouts_and_constants_agree_with_nvidia_ml_py(c_program):
    c = abi_values(c_program)
    p = pynvml
    structs = {"nvmlGpuInstancePlacement_t": p.c_nvmlGpuInstancePlacement_t,
               "nvmlGpuInstanceProfileInfo_t": p.c_nvmlGpuInstanceProfileInfo_t,
               "nvmlGpuInstanceProfileInfo_v2_t": p.c_nvmlGpuInstanceProfileInfo_v2_t,
               "nvmlGpuInstanceProfileInfo_v3_t": GpuInstanceProfileInfoV3,
               "nvmlGpuInstanceInfo_t": p.c_nvmlGpuInstanceInfo_t,
               "nvmlComputeInstancePlacement_t": p.c_nvmlComputeInstancePlacement_t,
               "nvmlComputeInstanceProfileInfo_t": p.c_nvmlComputeInstanceProfileInfo_t,
               "nvmlComputeInstanceProfileInfo_v2_t": p.c_nvmlComputeInstanceProfileInfo_v2_t,
               "nvmlComputeInstanceProfileInfo_v3_t": ComputeInstanceProfileInfoV3,
               "nvmlComputeInstanceInfo_t": p.c_nvmlComputeInstanceInfo_t,
               "nvmlDeviceAttributes_t": p.c_nvmlDeviceAttributes}
    for name, cls in structs.items():
        assert int(c[f"sizeof({name})"]) == ctypes.sizeof(cls), name
        for key, offset in c.items():
            if key.startswith(name + "."):
                assert int(offset) == getattr(cls, key.split(".")[1]).offset, key
    # constants: pynvml's where it has them, nvml.h's figures for the ones it lacks
    lacking = {"NVML_GPU_INSTANCE_PROFILE_CAPS_P2P": 1, "NVML_GPU_INSTANCE_PROFILE_CAPS_GFX": 2,
               "NVML_COMPUTE_INSTANCE_PROFILE_CAPS_GFX": 1}
    for key, value in c.items():
        if key.startswith("NVML_"):
            assert int(value) == lacking.get(key, getattr(p, key, None)), key
    assert int(c["nvmlGpuInstanceProfileInfo_v2"]) == p.nvmlGpuInstanceProfileInfo_v2
    assert int(c["nvmlComputeInstanceProfileInfo_v2"]) == p.nvmlComputeInstanceProfileInfo_v2
    # the versions nvml.h builds with NVML_STRUCT_VERSION(data, ver): sizeof | ver << 24
    assert int(c["nvmlGpuInstanceProfileInfo_v3"]) == 3 << 24 | ctypes.sizeof(GpuInstanceProfileInfoV3) == 0x03000098
    assert int(c["nvmlComputeInstanceProfileInfo_v3"]) == 3 << 24 | ctypes.sizeof(ComputeInstanceProfileInfoV3) == 0x0300008C
    assert int(c["sizeof(nvmlComputeInstanceProfileInfo_v3_t)"]) == ctypes.sizeof(ComputeInstanceProfileInfoV3)
    assert p.nvmlGpuInstanceProfileInfo_v2 == 2 << 24 | ctypes.sizeof(p.c_nvmlGpuInstanceProfileInfo_v2_t)


# NVIDIA's nvml.h where it is installed (NVML_INCLUDE_DIR: a directory holding a downloaded one)
NVML_H_DIRS = [Path(d) for d in (os.environ.get("NVML_INCLUDE_DIR"), "/usr/local/cuda/include", "/usr/include",
                                 "/usr/local/include") if d]


@pytest.mark.skipif(not any((d / "nvml.h").exists() for d in NVML_H_DIRS), reason="no NVIDIA nvml.h installed")
def test_the_abi_header_gives_what_nvidia_nvml_h_gives(c_program):
    include = next(d for d in NVML_H_DIRS if (d / "nvml.h").exists())
    assert abi_values(c_program) == abi_values_with(c_program, include)


def abi_values_with(c_program, include):
    exe = Path(c_program("mig_abi")).with_name("mig_abi_nvml_h")
    src = PROGRAMS / "mig_abi.c"
    subprocess.run(["cc", "-std=gnu11", "-DWITH_NVML_H", "-I", str(include), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return dict(line.split("=") for line in out.split())


# === a GPU without MIG ===

def test_the_a10_has_no_mig_as_a_real_a10(node):
    r = nvml("""
count = ctypes.c_uint()
print(json.dumps([
    rc(n.nvmlDeviceGetMigMode, h), rc(n.nvmlDeviceSetMigMode, h, 1),
    [rc(n.nvmlDeviceGetGpuInstanceProfileInfo, h, i) for i in range(n.NVML_GPU_INSTANCE_PROFILE_COUNT)],
    rc(n.nvmlDeviceGetGpuInstanceProfileInfoById, h, 19),
    rc(n.nvmlDeviceGetGpuInstancePossiblePlacements, h, 19, None, ctypes.byref(count)),
    rc(n.nvmlDeviceCreateGpuInstance, h, 19), rc(n.nvmlDeviceCreateGpuInstanceWithPlacement, h, 19, P(0, 1)),
    rc(n.nvmlDeviceGetGpuInstanceRemainingCapacity, h, 19),
    n.nvmlDeviceGetMaxMigDeviceCount(h), n.nvmlDeviceIsMigDeviceHandle(h).value,
    rc(n.nvmlDeviceGetMigDeviceHandleByIndex, h, 0), rc(n.nvmlDeviceGetGpuInstanceId, h),
    n.nvmlDeviceGetUtilizationRates(h).gpu]))
""", node("a10"))
    assert r == [NOT_SUPPORTED, NOT_SUPPORTED, [NOT_SUPPORTED] * 18, NOT_SUPPORTED, NOT_SUPPORTED,
                 NOT_SUPPORTED, NOT_SUPPORTED, NOT_SUPPORTED, 0, 0, NOT_SUPPORTED, NOT_SUPPORTED, 0]


# === profiles and placements ===

PROFILE_DUMP = """
def v1(i):
    x = n.nvmlDeviceGetGpuInstanceProfileInfo(h, i, version=1)
    return [x.id, x.sliceCount, x.instanceCount, x.multiprocessorCount, x.copyEngineCount, x.decoderCount,
            x.encoderCount, x.jpegCount, x.ofaCount, x.memorySizeMB, x.isP2pSupported]

def v2(x):
    return [x.version, x.id, x.name.decode() if isinstance(x.name, bytes) else x.name, x.sliceCount,
            x.instanceCount, x.multiprocessorCount, x.copyEngineCount, x.decoderCount, x.encoderCount,
            x.jpegCount, x.ofaCount, x.memorySizeMB, x.isP2pSupported]

class V3(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint) for f in ("version", "id", "sliceCount", "instanceCount", "multiprocessorCount",
                "copyEngineCount", "decoderCount", "encoderCount", "jpegCount", "ofaCount")] + [
               ("memorySizeMB", ctypes.c_ulonglong), ("name", ctypes.c_char * 96), ("capabilities", ctypes.c_uint)]

def v3(i):
    x = V3(version=0x03000098)
    r = n._nvmlGetFunctionPointer("nvmlDeviceGetGpuInstanceProfileInfoV")(h, i, ctypes.byref(x))
    return [r, x.id, x.name.decode(), x.sliceCount, x.memorySizeMB, x.capabilities]

def placements(pid):
    count = ctypes.c_uint()
    n.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid, None, ctypes.byref(count))
    arr = (n.c_nvmlGpuInstancePlacement_t * count.value)()
    n.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid, arr, ctypes.byref(count))
    return [count.value, [[p.start, p.size] for p in arr]]

out = {"mode": n.nvmlDeviceGetMigMode(h), "index": {}, "errors": {}}
for i in range(n.NVML_GPU_INSTANCE_PROFILE_COUNT + 1):
    try:
        info = n.nvmlDeviceGetGpuInstanceProfileInfo(h, i)
    except n.NVMLError as e:
        out["errors"][i] = e.value
        continue
    out["index"][i] = {"v1": v1(i), "v2": v2(info), "v3": v3(i), "byid": v2(n.nvmlDeviceGetGpuInstanceProfileInfoById(h, info.id)),
                       "placements": placements(info.id)}
bad = n.c_nvmlGpuInstanceProfileInfo_v2_t()
bad.version = 0x01000098
out["bad_version"] = n._nvmlGetFunctionPointer("nvmlDeviceGetGpuInstanceProfileInfoV")(h, 0, ctypes.byref(bad))
out["unknown_id"] = [rc(n.nvmlDeviceGetGpuInstanceProfileInfoById, h, 99),
                     rc(n.nvmlDeviceGetGpuInstancePossiblePlacements, h, 99, None, ctypes.byref(ctypes.c_uint()))]
print(json.dumps(out))
"""


@pytest.mark.parametrize("profile", ["a100-40g", "h100-80g", "h200"])
def test_gpu_instance_profiles_and_placements_are_the_published_tables(node, profile):
    r = nvml(PROFILE_DUMP, node(profile))
    assert r["mode"] == [0, 0]   # queried with MIG off: "immutable throughout the lifetime of a MIG mode"
    table = PROFILES[profile]
    assert sorted(int(i) for i in r["index"]) == sorted(table)
    # every other index below COUNT is unsupported, COUNT ends the enumeration
    assert r["errors"] == {str(i): NOT_SUPPORTED for i in range(18) if i not in table} | {"18": INVALID_ARGUMENT}
    for index, (pid, name, slices, inst, sms, ce, dec, enc, jpeg, ofa, mib) in table.items():
        got = r["index"][str(index)]
        assert got["v1"] == [pid, slices, inst, sms, ce, dec, enc, jpeg, ofa, mib, 0]
        assert got["v2"] == [pynvml.nvmlGpuInstanceProfileInfo_v2, pid, f"MIG {name}", slices, inst, sms, ce, dec,
                             enc, jpeg, ofa, mib, 0]
        assert got["byid"] == got["v2"]
        assert got["v3"] == [0, pid, f"MIG {name}", slices, mib, 0]
        starts, size = PLACEMENTS[pid]
        assert got["placements"] == [len(starts), [[s, size] for s in starts]]
        if profile in LGIP_GIB:
            assert f"{mib / 1024:.2f}" == LGIP_GIB[profile][pid]
        else:   # H200: the guide's memory fractions hold between profiles
            assert mib / table[4][-1] == pytest.approx(H200_MEMORY_SLICES[pid] / 8, abs=0.02)
    assert r["bad_version"] == INVALID_ARGUMENT
    assert r["unknown_id"] == [INVALID_ARGUMENT, INVALID_ARGUMENT]


# === MIG mode ===

def test_mig_mode_is_refused_while_a_process_holds_a_context_and_set_once_the_gpu_is_idle(node):
    env = node("h100-80g")
    proc = holder(env)
    try:
        busy = nvml("""
print(json.dumps([n.nvmlDeviceSetMigMode(h, n.NVML_DEVICE_MIG_ENABLE), n.nvmlDeviceGetMigMode(h),
                  n.nvmlDeviceGetMaxMigDeviceCount(h), rc(n.nvmlDeviceCreateGpuInstance, h, 19)]))
""", env)
    finally:
        release(proc)
    # activationStatus IN_USE, the mode left pending ("the caller ... is expected to idle the device and retry")
    assert busy == [IN_USE, [0, 1], 0, NOT_SUPPORTED]
    idle = nvml("""
first = [n.nvmlDeviceSetMigMode(h, n.NVML_DEVICE_MIG_ENABLE), n.nvmlDeviceGetMigMode(h), n.nvmlDeviceGetMaxMigDeviceCount(h)]
gi = n.nvmlDeviceCreateGpuInstance(h, 19)
with_instance = [n.nvmlDeviceSetMigMode(h, n.NVML_DEVICE_MIG_DISABLE), n.nvmlDeviceGetMigMode(h)]
n.nvmlGpuInstanceDestroy(gi)
off = [n.nvmlDeviceSetMigMode(h, n.NVML_DEVICE_MIG_DISABLE), n.nvmlDeviceGetMigMode(h)]
bad = rc(n.nvmlDeviceSetMigMode, h, 2)
print(json.dumps([first, with_instance, off, bad, n.nvmlDeviceGetUtilizationRates(h).gpu]))
""", env)
    assert idle == [[SUCCESS, [1, 1], 7], [IN_USE, [1, 0]], [SUCCESS, [0, 0]], INVALID_ARGUMENT, 0]


# === GPU instances ===

def test_gpu_instance_ids_and_default_placements_are_the_ones_an_a100_gives(node):
    r = nvml("""
enable()
out = {}
def make(*profiles):
    gis = [n.nvmlDeviceCreateGpuInstance(h, p) for p in profiles]
    return gis, [gi_info(g) for g in gis]
# the reference's observations: 4g.20gb, 2g.10gb, 1g.5gb one after the other
gis, out["4g_2g_1g"] = make(5, 14, 19)
for g in reversed(gis):
    n.nvmlGpuInstanceDestroy(g)
gis, infos = make(*[19] * 7)
out["seven_1g"] = sorted([i[2], i[0]] for i in infos)
out["eighth_1g"] = rc(n.nvmlDeviceCreateGpuInstance, h, 19)
for g in gis:
    n.nvmlGpuInstanceDestroy(g)
gis, out["two_3g"] = make(9, 9)
for g in gis:
    n.nvmlGpuInstanceDestroy(g)
gi, = make(5)[0]
out["1g_left_after_4g"] = n.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19)
out["2g_left_after_4g"] = n.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 14)
out["7g_left_after_4g"] = n.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 0)
print(json.dumps(out))
""", node("a100-40g"))
    assert r["4g_2g_1g"] == [[2, 5, 0, 4], [3, 14, 4, 2], [9, 19, 6, 1]]   # GI 2 at 0:4, GI 3 at 4:2, GI 9 at 6:1
    assert r["seven_1g"] == [[0, 11], [1, 12], [2, 13], [3, 14], [4, 7], [5, 8], [6, 9]]
    assert r["eighth_1g"] == INSUFFICIENT_RESOURCES
    assert r["two_3g"] == [[2, 9, 0, 4], [1, 9, 4, 4]]
    assert r["1g_left_after_4g"] == 3    # -lgip "Free" drops from 7/7 to 3/7
    assert (r["2g_left_after_4g"], r["7g_left_after_4g"]) == (1, 0)   # 2g only at 4:2, no 7g


def test_creating_at_a_placement_takes_exactly_that_placement_or_fails_as_the_driver_does(node):
    r = nvml("""
enable()
out = {}
gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 14, P(2, 2))
out["placed"] = gi_info(gi)
out["not_a_placement"] = rc(n.nvmlDeviceCreateGpuInstanceWithPlacement, h, 14, P(1, 2))
out["wrong_size"] = rc(n.nvmlDeviceCreateGpuInstanceWithPlacement, h, 14, P(4, 1))
out["occupied"] = rc(n.nvmlDeviceCreateGpuInstanceWithPlacement, h, 19, P(3, 1))
out["overlapping"] = rc(n.nvmlDeviceCreateGpuInstanceWithPlacement, h, 9, P(0, 4))
out["unknown_profile"] = rc(n.nvmlDeviceCreateGpuInstance, h, 99)
me = n.nvmlDeviceCreateGpuInstance(h, 20)
out["second_me"] = rc(n.nvmlDeviceCreateGpuInstance, h, 20)     # the +me profile has one instance
out["by_id"] = gi_info(n.nvmlDeviceGetGpuInstanceById(h, gi_info(gi)[0]))
out["missing_id"] = rc(n.nvmlDeviceGetGpuInstanceById, h, 0)
count = ctypes.c_uint()
arr = (n.c_nvmlGpuInstance_t * 3)()
n.nvmlDeviceGetGpuInstances(h, 14, arr, ctypes.byref(count))
out["listed"] = [gi_info(arr[i]) for i in range(count.value)]
n.nvmlGpuInstanceDestroy(gi)
out["stale_handle"] = [rc(n.nvmlGpuInstanceGetInfo, gi), rc(n.nvmlGpuInstanceDestroy, gi)]
print(json.dumps(out))
""", node("h200"))
    assert r["placed"] == [6, 14, 2, 2]
    assert (r["not_a_placement"], r["wrong_size"]) == (INVALID_ARGUMENT, INVALID_ARGUMENT)
    assert (r["occupied"], r["overlapping"]) == (INSUFFICIENT_RESOURCES, INSUFFICIENT_RESOURCES)
    assert r["unknown_profile"] == INVALID_ARGUMENT
    assert r["second_me"] == INSUFFICIENT_RESOURCES
    assert r["by_id"] == [6, 14, 2, 2] and r["missing_id"] == NOT_FOUND
    assert r["listed"] == [[6, 14, 2, 2]]
    assert r["stale_handle"] == [INVALID_ARGUMENT, INVALID_ARGUMENT]


# === compute instances ===

def test_compute_instance_profiles_placements_and_creation(node):
    r = nvml("""
enable()
gi = n.nvmlDeviceCreateGpuInstance(h, 9)          # 3g.40gb
out = {"profiles": {}, "errors": {}}
for i in range(n.NVML_COMPUTE_INSTANCE_PROFILE_COUNT + 1):
    try:
        x = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, i, 0)
        y = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, i, 0, version=1)
    except n.NVMLError as e:
        out["errors"][i] = e.value
        continue
    count = ctypes.c_uint()
    n.nvmlGpuInstanceGetComputeInstancePossiblePlacements(gi, x.id, None, ctypes.byref(count))
    arr = (n.c_nvmlComputeInstancePlacement_t * count.value)()
    n.nvmlGpuInstanceGetComputeInstancePossiblePlacements(gi, x.id, arr, ctypes.byref(count))
    out["profiles"][i] = [x.id, x.name, x.sliceCount, x.instanceCount, x.multiprocessorCount,
                          x.sharedCopyEngineCount, x.sharedDecoderCount, x.sharedJpegCount, x.sharedOfaCount,
                          [x.id, x.sliceCount, x.instanceCount, x.multiprocessorCount] == [y.id, y.sliceCount, y.instanceCount, y.multiprocessorCount],
                          [[p.start, p.size] for p in arr]]
out["eng_profile"] = rc(n.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, 0, 1)
cis = [n.nvmlGpuInstanceCreateComputeInstance(gi, 0) for _ in range(3)]
def ci(c):
    i = n.nvmlComputeInstanceGetInfo(c)
    return [i.id, i.profileId, i.placement.start, i.placement.size, gi_info(i.gpuInstance),
            n.nvmlDeviceGetIndex(i.device)]
out["three_1c"] = [ci(c) for c in cis]
out["fourth_1c"] = rc(n.nvmlGpuInstanceCreateComputeInstance, gi, 0)
out["left"] = [n.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, p) for p in (0, 1, 2)]
out["gi_busy"] = rc(n.nvmlGpuInstanceDestroy, gi)                     # compute instances exist
out["mig_devices"] = [n.nvmlDeviceGetName(n.nvmlDeviceGetMigDeviceHandleByIndex(h, i)) for i in range(3)]
for c in cis:
    n.nvmlComputeInstanceDestroy(c)
out["stale_ci"] = rc(n.nvmlComputeInstanceGetInfo, cis[0])
out["placed_2c"] = ci(n.nvmlGpuInstanceCreateComputeInstanceWithPlacement(gi, 1, CP(0, 2)))
out["2c_bad_start"] = rc(n.nvmlGpuInstanceCreateComputeInstanceWithPlacement, gi, 1, CP(1, 2))
out["1c_on_2c"] = rc(n.nvmlGpuInstanceCreateComputeInstanceWithPlacement, gi, 0, CP(1, 1))
out["1c_beside"] = ci(n.nvmlGpuInstanceCreateComputeInstance(gi, 0))
out["by_id"] = ci(n.nvmlGpuInstanceGetComputeInstanceById(gi, 1))
out["missing_id"] = rc(n.nvmlGpuInstanceGetComputeInstanceById, gi, 5)
print(json.dumps(out))
""", node("h100-80g"))
    gi_info = [2, 9, 0, 4]   # the first 3g takes 0:4: GI 2
    # 1c.3g.40gb x3 at 0,1,2; 2c.3g.40gb at 0; the whole GI (3g.40gb, profile 2) at 0; engines shared
    assert r["profiles"] == {
        "0": [0, "MIG 1c.3g.40gb", 1, 3, 16, 3, 3, 3, 0, True, [[0, 1], [1, 1], [2, 1]]],
        "1": [1, "MIG 2c.3g.40gb", 2, 1, 32, 3, 3, 3, 0, True, [[0, 2]]],
        "2": [2, "MIG 3g.40gb", 3, 1, 60, 3, 3, 3, 0, True, [[0, 3]]]}
    assert r["errors"] == {str(i): NOT_SUPPORTED for i in range(3, 9)} | {"9": INVALID_ARGUMENT}
    assert r["eng_profile"] == INVALID_ARGUMENT
    assert r["three_1c"] == [[c, 0, c, 1, gi_info, 0] for c in range(3)]
    assert r["fourth_1c"] == INSUFFICIENT_RESOURCES and r["left"] == [0, 0, 0]
    assert r["gi_busy"] == IN_USE
    assert r["mig_devices"] == ["NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb"] * 3
    assert r["stale_ci"] == INVALID_ARGUMENT
    assert r["placed_2c"] == [0, 1, 0, 2, gi_info, 0]
    assert (r["2c_bad_start"], r["1c_on_2c"]) == (INVALID_ARGUMENT, INSUFFICIENT_RESOURCES)
    assert r["1c_beside"] == [1, 0, 2, 1, gi_info, 0] and r["by_id"] == r["1c_beside"]
    assert r["missing_id"] == NOT_FOUND


# === MIG device handles ===

def test_mig_device_handles_uuids_and_their_parent(node):
    env = node("a100-40g")
    r = nvml("""
enable()
uuid = mig_device(9)
out = {"max": n.nvmlDeviceGetMaxMigDeviceCount(h)}
m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
a = n.nvmlDeviceGetAttributes_v2(m)
mem = n.nvmlDeviceGetMemoryInfo(m)
out["mig"] = [n.nvmlDeviceIsMigDeviceHandle(m).value, n.nvmlDeviceGetGpuInstanceId(m), n.nvmlDeviceGetComputeInstanceId(m),
              n.nvmlDeviceGetUUID(m), n.nvmlDeviceGetName(m), n.nvmlDeviceGetIndex(m), [mem.total, mem.used, mem.free],
              [a.multiprocessorCount, a.sharedCopyEngineCount, a.sharedDecoderCount, a.gpuInstanceSliceCount,
               a.computeInstanceSliceCount, a.memorySizeMB], list(n.nvmlDeviceGetCudaComputeCapability(m))]
p = n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
out["parent"] = [n.nvmlDeviceGetUUID(p) == n.nvmlDeviceGetUUID(h), n.nvmlDeviceGetIndex(p),
                 n.nvmlDeviceIsMigDeviceHandle(h).value, rc(n.nvmlDeviceGetGpuInstanceId, h),
                 rc(n.nvmlDeviceGetAttributes_v2, h), rc(n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, h),
                 rc(n.nvmlDeviceGetUtilizationRates, h), rc(n.nvmlDeviceGetProcessUtilization, h, 0),
                 rc(n.nvmlDeviceGetMigMode, m)]
v2 = n.c_nvmlMemory_v2_t()
v2.version = n.nvmlMemory_v2
assert n._nvmlGetFunctionPointer("nvmlDeviceGetMemoryInfo_v2")(m, ctypes.byref(v2)) == 0
out["memory_v2"] = [v2.total, v2.reserved, v2.used, v2.free]
by_uuid = n.nvmlDeviceGetHandleByUUID(uuid)
legacy = n.nvmlDeviceGetHandleByUUID("MIG-" + n.nvmlDeviceGetUUID(h) + "/2/0")
out["by_uuid"] = [n.nvmlDeviceGetGpuInstanceId(by_uuid), n.nvmlDeviceGetComputeInstanceId(by_uuid),
                  n.nvmlDeviceGetHandleByUUID(uuid.upper()) is not None, n.nvmlDeviceGetUUID(legacy) == uuid,
                  rc(n.nvmlDeviceGetHandleByUUID, "MIG-" + n.nvmlDeviceGetUUID(h) + "/2/1")]
out["indices"] = [rc(n.nvmlDeviceGetMigDeviceHandleByIndex, h, 1), rc(n.nvmlDeviceGetMigDeviceHandleByIndex, h, 7),
                  rc(n.nvmlDeviceGetHandleByUUID, "MIG-00000000-0000-4000-8000-000000000000")]
out["uuid"] = uuid
print(json.dumps(out))
""", env)
    assert r["max"] == 7
    uuid = r["uuid"]
    assert MIG_UUID.match(uuid)
    assert r["mig"] == [1, 2, 0, uuid, "NVIDIA A100-SXM4-40GB MIG 3g.20gb", 0, [20096 * MiB, 0, 20096 * MiB],
                        [42, 3, 2, 3, 3, 20096], [8, 0]]
    # the GPU's own handle: not a MIG device; utilization "not currently supported" on a MIG-enabled GPU
    assert r["parent"] == [True, 0, 0, NOT_SUPPORTED, NOT_SUPPORTED, INVALID_ARGUMENT, NOT_SUPPORTED,
                           NOT_SUPPORTED, INVALID_ARGUMENT]
    assert r["memory_v2"] == [20096 * MiB, 0, 0, 20096 * MiB]
    assert r["by_uuid"] == [2, 0, True, True, NOT_FOUND]   # also MIG-<GPU UUID>/<GI>/<CI>, as before R470
    assert r["indices"] == [NOT_FOUND, INVALID_ARGUMENT, NOT_FOUND]
    # another process sees the same instance with the same UUID (state in the node file)
    seen = nvml("""
arr = (n.c_nvmlGpuInstance_t * 2)()
count = ctypes.c_uint()
n.nvmlDeviceGetGpuInstances(h, 9, arr, ctypes.byref(count))
m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
print(json.dumps([n.nvmlDeviceGetMigMode(h), [gi_info(arr[i]) for i in range(count.value)], n.nvmlDeviceGetUUID(m)]))
""", env)
    assert seen == [[1, 1], [[2, 9, 0, 4]], uuid]


def test_destroy_is_refused_while_a_process_runs_on_the_instance(node):
    env = node("a100-40g")
    uuid = nvml("enable()\nprint(json.dumps(mig_device(19)))", env)
    proc = holder(dict(env, CUDA_VISIBLE_DEVICES=uuid), allocate=64 * MiB)
    try:
        busy = nvml("""
gi = n.nvmlDeviceGetGpuInstanceById(h, 11)
ci = n.nvmlGpuInstanceGetComputeInstanceById(gi, 0)
m = n.nvmlDeviceGetHandleByUUID(sys.argv[1])
procs = [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in n.nvmlDeviceGetComputeRunningProcesses(m)]
print(json.dumps([rc(n.nvmlComputeInstanceDestroy, ci), rc(n.nvmlGpuInstanceDestroy, gi),
                  n.nvmlDeviceSetMigMode(h, 0), n.nvmlDeviceGetMemoryInfo(m).used, procs]))
""", env, args=[uuid])
        pid = proc.pid
    finally:
        proc.kill()   # kill -9: the kernel drops its slot lock, its instance is free again
        proc.wait()
    assert busy == [IN_USE, IN_USE, IN_USE, 64 * MiB, [[pid, 64 * MiB, 11, 0]]]
    after = nvml("""
gi = n.nvmlDeviceGetGpuInstanceById(h, 11)
ci = n.nvmlGpuInstanceGetComputeInstanceById(gi, 0)
m = n.nvmlDeviceGetHandleByUUID(sys.argv[1])
used = n.nvmlDeviceGetMemoryInfo(m).used
print(json.dumps([used, rc(n.nvmlComputeInstanceDestroy, ci), rc(n.nvmlGpuInstanceDestroy, gi),
                  n.nvmlDeviceSetMigMode(h, 0), n.nvmlDeviceGetMigMode(h)]))
""", env, args=[uuid])
    assert after == [0, SUCCESS, SUCCESS, SUCCESS, [0, 0]]


# === CUDA ===

@pytest.mark.timing     # (it times kernels by the wall clock: run alone, not beside 4 workers)
def test_cuda_sees_a_mig_device_as_device_0_with_its_memory_and_sms(node):
    env = node("h200")
    uuid, gpu_uuid = nvml("enable()\nmig_device(19)\nprint(json.dumps([mig_device(9), n.nvmlDeviceGetUUID(h)]))", env)
    r = cuda("""
import ctypes
ok(cu.cuInit(0))
legacy = ctypes.create_string_buffer(16)   # the unversioned export: the CUDA 9.2 ABI
assert ctypes.CDLL("libcuda.so.1").cuDeviceGetUuid(legacy, 0) == 0
d = ok(cu.cuDeviceGet(0))
attr = lambda a: ok(cu.cuDeviceGetAttribute(a, d))
A = cu.CUdevice_attribute
ctx = context()
free, total = ok(cu.cuMemGetInfo())
fn = kernel("sim_10000us")
sms = attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
print(json.dumps([ok(cu.cuDeviceGetCount()), ok(cu.cuDeviceGetName(96, d)).split(b"\\0")[0].decode(),
                  int(ok(cu.cuDeviceTotalMem(d))), sms, bytes(ok(cu.cuDeviceGetUuid(d)).bytes).hex(),
                  [int(free), int(total)], round(timed(fn, sms)), round(timed(fn, sms + 1)),
                  rc(cu.cuDeviceGet(1)), legacy.raw.hex()]))
""", dict(env, CUDA_VISIBLE_DEVICES=uuid))
    hex_uuid = uuid[4:].replace("-", "")
    # one wave is as many blocks as the instance has SMs (60 for 3g.71gb); cuDeviceGetUuid_v2
    # (what cuda-bindings calls) gives the MIG UUID, the CUDA 9.2 ABI its GPU's
    assert r == [1, "NVIDIA H200 MIG 3g.71gb", 71424 * MiB, 60, hex_uuid, [71424 * MiB] * 2, 10, 20, 101,
                 gpu_uuid[4:].replace("-", "")]


def test_cuda_visible_devices_selects_gpus_and_mig_devices_as_cuda_does(node):
    env = node("a100-40g", devices=2)
    uuids = nvml("""
enable()
first = mig_device(9, 4)     # GI 1 at 4:4
second = mig_device(19, 0)   # GI 11 at 0:1
print(json.dumps([first, second, n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(1)), n.nvmlDeviceGetUUID(h)]))
""", env)
    names = """
ok(cu.cuInit(0))
print(json.dumps([ok(cu.cuDeviceGetName(96, ok(cu.cuDeviceGet(i)))).split(b"\\0")[0].decode()[22:]
                  for i in range(ok(cu.cuDeviceGetCount()))]))
"""
    seen = {}
    for label, visible in {"unset": None, "gpu_index": "0", "gpu_uuid": uuids[2],
                           "mig_uuids": f"{uuids[1]},{uuids[0]}", "stops_at_a_bad_entry": f"{uuids[0]},7,1",
                           "mig_prefix": uuids[1][:10], "before_r470": f"MIG-{uuids[3]}/11/0"}.items():
        e = dict(env)
        if visible is not None:
            e["CUDA_VISIBLE_DEVICES"] = visible
        seen[label] = cuda(names, e)
    # a GPU in MIG mode stands for its MIG devices (one per GPU instance, by GI ID); others as they are
    assert seen["unset"] == ["MIG 3g.20gb", "MIG 1g.5gb", ""]
    assert seen["gpu_index"] == ["MIG 3g.20gb", "MIG 1g.5gb"]
    assert seen["gpu_uuid"] == [""]
    assert seen["mig_uuids"] == ["MIG 1g.5gb", "MIG 3g.20gb"]
    assert seen["stops_at_a_bad_entry"] == ["MIG 3g.20gb"]
    assert seen["mig_prefix"] == ["MIG 1g.5gb"]
    assert seen["before_r470"] == ["MIG 1g.5gb"]   # MIG-<GPU UUID>/<GI>/<CI>
    nothing = [cuda("print(json.dumps(rc(cu.cuInit(0))))", dict(env, CUDA_VISIBLE_DEVICES=v)) for v in ("", "-1", "MIG-zz")]
    assert nothing == [100, 100, 100]   # CUDA_ERROR_NO_DEVICE


ALLOCATOR = CUDA + """
context()
held = 0
step = int(sys.argv[1])
while rc(cu.cuMemAlloc(step)) == 0:
    held += step
free, total = ok(cu.cuMemGetInfo())
print(json.dumps([held, int(free), int(total), rc(cu.cuMemAlloc(2 * 1024 * 1024))]), flush=True)
sys.stdin.readline()
"""


def test_an_instance_allocates_from_its_own_memory_only(node):
    env = node("a100-40g")
    small, big = nvml("enable()\nprint(json.dumps([mig_device(19), mig_device(9)]))", env)
    procs = []
    try:
        for uuid in (small, big):   # fill the 1g.5gb first; the 3g.20gb still has all of its memory
            procs.append(start_python(ALLOCATOR, dict(env, CUDA_VISIBLE_DEVICES=uuid), args=[str(256 * MiB)]))
            line = procs[-1].stdout.readline()
            assert line, procs[-1].stderr.read()
            procs[-1].report = json.loads(line)
        seen = nvml("""
out = []
for uuid in sys.argv[1:]:
    m = n.nvmlDeviceGetHandleByUUID(uuid)
    mem = n.nvmlDeviceGetMemoryInfo(m)
    out.append([mem.total, mem.used, [[p.pid, p.usedGpuMemory, p.gpuInstanceId] for p in n.nvmlDeviceGetComputeRunningProcesses(m)]])
whole = n.nvmlDeviceGetMemoryInfo(h)
out.append([whole.total, whole.used, sorted([p.pid, p.gpuInstanceId, p.computeInstanceId] for p in n.nvmlDeviceGetComputeRunningProcesses(h))])
print(json.dumps(out))
""", env, args=[small, big])
    finally:
        for p in procs:
            p.kill()
            p.wait()
    a, b = (p.report for p in procs)
    # 1g.5gb: 4864 MiB (19 steps of 256 MiB), then out of memory though the GPU has 35 GiB free
    assert a == [4864 * MiB, 0, 4864 * MiB, 2]
    assert b == [20096 * MiB - 128 * MiB, 128 * MiB, 20096 * MiB, 0]
    pa, pb = (p.pid for p in procs)
    assert seen == [[4864 * MiB, 4864 * MiB, [[pa, 4864 * MiB, 11]]],
                    [20096 * MiB, 19968 * MiB + 2 * MiB, [[pb, 19970 * MiB, 1]]],
                    [40960 * MiB, (4864 + 19970) * MiB, sorted([[pa, 11, 0], [pb, 1, 0]])]]


# === timelines ===

# Kernels of 30 ms (one wave: as many blocks as the device has SMs), kept three deep in the
# stream: the next is queued before waiting for the one two before, so on a timeline of its
# own each starts the moment the previous ends, and the simulated time between two kernels'
# end events is exactly one kernel, whatever the host does in between (up to 60 ms).  The phases given as
# arguments run one after the other, each after a line on stdin.
LOOP = CUDA + """
context()
fn = kernel("sim_30000us")
sms = ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, ok(cu.cuDeviceGet(0))))

def pipelined(count, first):
    ev = [ok(cu.cuEventCreate(0)) for _ in range(count)]
    done = []

    def wait_oldest():
        ok(cu.cuEventSynchronize(ev[len(done)]))
        done.append(time.monotonic_ns())
        if first and len(done) == 1:
            print(json.dumps("running"), flush=True)

    for i in range(count):
        ok(cu.cuLaunchKernel(fn, sms, 1, 1, 1, 1, 1, 0, 0, 0, 0))
        ok(cu.cuEventRecord(ev[i], 0))
        if i + 1 - len(done) == 3:   # three queued: wait for the oldest
            wait_oldest()
    while len(done) < count:
        wait_oldest()
    # [host time the previous kernel was seen done, ms between the two kernels' ends, host time this one was]
    return [[done[i - 1], ok(cu.cuEventElapsedTime(ev[i - 1], ev[i])), done[i]] for i in range(1, count)]

print(json.dumps("ready"), flush=True)
spans = []
for phase, count in enumerate(int(a) for a in sys.argv[1:]):
    if phase:
        print(json.dumps("paused"), flush=True)
    sys.stdin.readline()
    spans += pipelined(count, phase == 0)
print(json.dumps(spans), flush=True)
"""


def run_side_by_side(env_a, env_b):
    """A runs 11 kernels alone, then 11 more once B has started 24 of its own: both processes'
    spans (A's first 10 are from before B started)."""
    a = start_python(LOOP, env_a, args=["11", "11"])
    b = start_python(LOOP, env_b, args=["24"])
    try:
        def say(p):
            p.stdin.write("\n")
            p.stdin.flush()

        def hear(p):
            line = p.stdout.readline()
            assert line, p.stderr.read()
            return json.loads(line)

        assert hear(a) == "ready" and hear(b) == "ready"
        say(a)
        assert hear(a) == "running" and hear(a) == "paused"
        say(b)
        assert hear(b) == "running"
        say(a)          # A's second phase runs while B's kernels run
        return hear(a), hear(b)
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def overlapping(spans, others):
    """The spans that ran (as the host saw them) while some of `others` did."""
    start, end = min(o[0] for o in others), max(o[2] for o in others)
    return [s for s in spans if s[0] < end and start < s[2]]


def test_two_instances_run_saturating_kernels_side_by_side_without_slowing_each_other(node):
    env = node("h100-80g")
    a_uuid, b_uuid = nvml("enable()\nprint(json.dumps([mig_device(9), mig_device(9)]))", env)
    a, b = run_side_by_side(dict(env, CUDA_VISIBLE_DEVICES=a_uuid), dict(env, CUDA_VISIBLE_DEVICES=b_uuid))
    assert len(overlapping(a[10:], b)) >= 5, "B never ran while A did"
    # one kernel every 30 ms of each instance's timeline, before B starts, while both run, after
    assert [round(s[1], 1) for s in a] == [30.0] * 20, a
    assert [round(s[1], 1) for s in b] == [30.0] * 23, b


def test_without_mig_the_same_two_processes_queue_behind_each_other(node):
    env = node("h100-80g")
    a, b = run_side_by_side(env, env)   # the control: one GPU, one timeline
    shared = overlapping(a[10:], b)
    assert len(shared) >= 5, (a, b)
    assert [round(s[1], 1) for s in a[:10]] == [30.0] * 10, a
    # while B runs, A gets the timeline half the time: 60 ms per kernel on average
    assert sum(s[1] for s in shared) / len(shared) > 1.5 * 30.0, (a, b)
