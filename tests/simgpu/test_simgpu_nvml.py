"""simgpu's libnvidia-ml.so.1, driven through NVIDIA's own client (nvidia-ml-py / pynvml).

Every check runs pynvml in a child process bound to a fresh simgpu node; the tests that
need a GPU process allocate through simgpu's libcuda with cuda-bindings in another child.
"""
import json
import signal
from pathlib import Path

import pytest

from tests.helpers import simnode
from tests.helpers.simnode import make_sim_env, run_python, start_python
from vgpu.paths import SIMGPU_DIR

GiB = 1 << 30
MiB = 1 << 20
HAVE_LIBCUDA = (SIMGPU_DIR / "libcuda.so.1").exists()
needs_libcuda = pytest.mark.skipif(not HAVE_LIBCUDA, reason="simgpu libcuda.so.1 not built yet")


@pytest.fixture(autouse=True)
def _nvml_without_libcuda(monkeypatch):
    """make_sim_env's simgpu_dir() insists on libcuda.so.1; NVML-only tests need just the dir."""
    if not HAVE_LIBCUDA:
        monkeypatch.setattr(simnode, "simgpu_dir", lambda: SIMGPU_DIR)


def nvml(code, env, **kw):
    """Run `code` after `import pynvml as n`; return the JSON it prints last."""
    out = run_python("import json, os, sys\nimport pynvml as n\n" + code, env, **kw)
    return json.loads(out.stdout.strip().splitlines()[-1])


# === init, devices, identity ===

def test_init_and_shutdown_are_reference_counted(sim_env):
    r = nvml("""
n.nvmlInit()
n.nvmlInit()
n.nvmlShutdown()
count_after_one_shutdown = n.nvmlDeviceGetCount()
n.nvmlShutdown()
errors = []
for call in (n.nvmlDeviceGetCount, n.nvmlShutdown):
    try:
        call()
    except n.NVMLError as e:
        errors.append(type(e).__name__)
print(json.dumps([count_after_one_shutdown, errors]))
""", sim_env)
    assert r == [1, ["NVMLError_Uninitialized", "NVMLError_Uninitialized"]]


@pytest.mark.parametrize("devices", [1, 2])
def test_device_count_follows_simgpu_devices(tmp_path, devices):
    env = make_sim_env(tmp_path / "node", devices=devices)
    r = nvml("n.nvmlInit()\nprint(json.dumps([n.nvmlDeviceGetCount(), "
             "[n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByIndex(i)) "
             "for i in range(n.nvmlDeviceGetCount())]]))", env)
    assert r == [devices, list(range(devices))]


@pytest.mark.parametrize("profile,name,memory,cc", [
    ("a10", "NVIDIA A10", 24 * GiB, [8, 6]),
    ("h200", "NVIDIA H200", 141 * GiB, [9, 0]),
])
def test_device_name_memory_and_capability_follow_the_profile(tmp_path, profile, name, memory, cc):
    env = make_sim_env(tmp_path / "node", profile=profile)
    r = nvml("""
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
print(json.dumps([n.nvmlDeviceGetName(h), n.nvmlDeviceGetMemoryInfo(h).total,
                  list(n.nvmlDeviceGetCudaComputeCapability(h))]))
""", env)
    assert r == [name, memory, cc]


UUIDS = """
n.nvmlInit()
print(json.dumps([n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(i))
                  for i in range(n.nvmlDeviceGetCount())]))
"""


def test_uuid_has_nvidia_format_and_is_stable_across_processes(tmp_path):
    env = make_sim_env(tmp_path / "node", devices=2)
    first, second = nvml(UUIDS, env), nvml(UUIDS, env)
    assert first == second
    assert len(set(first)) == 2
    for uuid in first:
        assert len(uuid) == 40
        assert uuid.startswith("GPU-")
        assert [len(part) for part in uuid[4:].split("-")] == [8, 4, 4, 4, 12]
        assert all(c in "0123456789abcdef" for c in uuid[4:].replace("-", ""))


def test_handle_by_uuid_round_trips_to_the_same_device(tmp_path):
    env = make_sim_env(tmp_path / "node", devices=2)
    r = nvml("""
n.nvmlInit()
out = []
for i in range(n.nvmlDeviceGetCount()):
    uuid = n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(i))
    h = n.nvmlDeviceGetHandleByUUID(uuid)
    out.append([n.nvmlDeviceGetIndex(h), n.nvmlDeviceGetUUID(h) == uuid])
try:
    n.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
except n.NVMLError as e:
    out.append(type(e).__name__)
print(json.dumps(out))
""", env)
    assert r == [[0, True], [1, True], "NVMLError_NotFound"]


def test_system_versions_and_error_strings(sim_env):
    r = nvml("""
n.nvmlInit()
print(json.dumps([n.nvmlSystemGetDriverVersion(), n.nvmlSystemGetNVMLVersion(),
                  n.nvmlSystemGetCudaDriverVersion(), n.nvmlSystemGetCudaDriverVersion_v2(),
                  n.nvmlErrorString(n.NVML_ERROR_ARGUMENT_VERSION_MISMATCH),
                  n.nvmlErrorString(n.NVML_ERROR_UNINITIALIZED),
                  n.nvmlSystemGetProcessName(os.getpid()),
                  open("/proc/self/comm").read().strip()]))
""", sim_env)
    driver, nvml_version, cuda, cuda_v2, mismatch, uninit, name, comm = r
    assert nvml_version == "13." + driver
    assert cuda == cuda_v2 == 13000
    assert (mismatch, uninit) == ("Argument version mismatch", "Uninitialized")
    assert name == comm


# === memory ===

def test_memory_info_v1_and_v2_agree_on_a_fresh_node(sim_env):
    r = nvml("""
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
m1, m2 = n.nvmlDeviceGetMemoryInfo(h), n.nvmlDeviceGetMemoryInfo(h, n.nvmlMemory_v2)
try:
    n.nvmlDeviceGetMemoryInfo(h, 0x01000028)
    wrong = None
except n.NVMLError as e:
    wrong = type(e).__name__
print(json.dumps([[m1.total, m1.free, m1.used], [m2.total, m2.reserved, m2.free, m2.used], wrong]))
""", sim_env)
    assert r == [[24 * GiB, 24 * GiB, 0], [24 * GiB, 0, 24 * GiB, 0],
                 "NVMLError_ArgumentVersionMismatch"]


def test_idle_node_reports_no_processes_and_no_utilization(sim_env):
    r = nvml("""
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
u = n.nvmlDeviceGetUtilizationRates(h)
try:
    n.nvmlDeviceGetProcessUtilization(h, 0)
    samples = "samples"
except n.NVMLError as e:
    samples = type(e).__name__
print(json.dumps([n.nvmlDeviceGetComputeRunningProcesses(h),
                  n.nvmlDeviceGetComputeRunningProcesses_v2(h),
                  n.nvmlDeviceGetGraphicsRunningProcesses(h), [u.gpu, u.memory], samples]))
""", sim_env)
    assert r == [[], [], [], [0, 0], "NVMLError_NotFound"]


# === errors ===

def test_calls_before_init_are_uninitialized(sim_env):
    # pynvml raises Uninitialized itself until the library is loaded: load it without
    # nvmlInit so that the answer comes from simgpu.
    r = nvml("""
n._LoadNvmlLibrary()
out = []
for call in (n.nvmlDeviceGetCount, lambda: n.nvmlDeviceGetHandleByIndex(0),
             n.nvmlSystemGetDriverVersion, n.nvmlShutdown):
    try:
        call()
        out.append("ok")
    except n.NVMLError as e:
        out.append(type(e).__name__)
print(json.dumps(out))
""", sim_env)
    assert r == ["NVMLError_Uninitialized"] * 4


def test_bad_index_or_handle_is_invalid_argument(sim_env):
    r = nvml("""
import ctypes
n.nvmlInit()
try:
    n.nvmlDeviceGetHandleByIndex(1)
    bad_index = "ok"
except n.NVMLError as e:
    bad_index = type(e).__name__
good = n.nvmlDeviceGetHandleByIndex(0)
name = ctypes.create_string_buffer(96)
fn = n.nvmlLib.nvmlDeviceGetName
stray = fn(ctypes.c_void_p(ctypes.cast(good, ctypes.c_void_p).value + 4), name, 96)
null = fn(None, name, 96)
small = fn(good, name, 4)
mem = n.nvmlLib.nvmlDeviceGetMemoryInfo(good, None)
print(json.dumps([bad_index, stray, null, small, mem]))
""", sim_env)
    assert r == ["NVMLError_InvalidArgument", 2, 2, 7, 2]


def test_unknown_profile_fails_init_with_a_message_naming_the_variable(tmp_path):
    env = make_sim_env(tmp_path / "node", profile="nope")
    proc = run_python("""
import pynvml as n
try:
    n.nvmlInit()
except n.NVMLError as e:
    print(type(e).__name__)
""", env)
    assert proc.stdout.strip() == "NVMLError_DriverNotLoaded"
    assert ("SIMGPU_PROFILE=nope is not a known profile (known: a10, a100-40g, h100-80g, h200)"
            in proc.stderr)


def test_unwritable_state_dir_fails_init_with_a_message_naming_the_path(tmp_path):
    blocker = tmp_path / "plain-file"
    blocker.write_text("not a directory")
    state = blocker / "node"
    proc = run_python("""
import pynvml as n
try:
    n.nvmlInit()
except n.NVMLError as e:
    print(type(e).__name__)
""", make_sim_env(state))
    assert proc.stdout.strip() == "NVMLError_DriverNotLoaded"
    assert f"cannot create state directory {state}" in proc.stderr


# === processes (need simgpu's libcuda) ===

HOLDER = """
import sys
from cuda.bindings import driver as cu

def ok(res):
    res = res if isinstance(res, tuple) else (res,)
    if res[0] != cu.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"CUDA call failed: {res[0]}")
    return res[1] if len(res) > 1 else None

ok(cu.cuInit(0))
dev = ok(cu.cuDeviceGet(0))
ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
ok(cu.cuCtxSetCurrent(ctx))
ptr = ok(cu.cuMemAlloc(256 << 20))
print("ready", flush=True)
sys.stdin.readline()
"""

# Every process-list ABI: pynvml's own _v3 / _v2 wrappers, and each export through ctypes
# with this file's struct definitions (v1: pid, usedGpuMemory; v2 and v3: + instance ids).
PROCESS_VIEW = """
import ctypes
class P1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]
class P2(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]

def raw(name, struct, h):
    fn = getattr(n.nvmlLib, name)
    count = ctypes.c_uint(0)
    size_query = fn(h, ctypes.byref(count), None)
    needed = count.value
    infos = (struct * 8)()
    count.value = 8
    ret = fn(h, ctypes.byref(count), infos)
    return [size_query, needed, ret, [[p.pid, p.usedGpuMemory] for p in infos[:count.value]]]

def view():
    h = n.nvmlDeviceGetHandleByIndex(0)
    m1, m2 = n.nvmlDeviceGetMemoryInfo(h), n.nvmlDeviceGetMemoryInfo(h, n.nvmlMemory_v2)
    return {
        "v3": [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId]
               for p in n.nvmlDeviceGetComputeRunningProcesses(h)],
        "v2": [[p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses_v2(h)],
        "raw_v1": raw("nvmlDeviceGetComputeRunningProcesses", P1, h),
        "raw_v2": raw("nvmlDeviceGetComputeRunningProcesses_v2", P2, h),
        "raw_v3": raw("nvmlDeviceGetComputeRunningProcesses_v3", P2, h),
        "used": [m1.used, m2.used], "free": [m1.free, m2.free], "total": m1.total,
    }
n.nvmlInit()
"""


@needs_libcuda
def test_cuda_process_and_its_memory_are_seen_by_every_process_list_abi(sim_env):
    holder = start_python(HOLDER, sim_env)
    try:
        assert holder.stdout.readline().strip() == "ready"
        pid = holder.pid
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        r = nvml(PROCESS_VIEW + f"v = view(); v['name'] = n.nvmlSystemGetProcessName({pid})\n"
                 "print(json.dumps(v))", sim_env)
    finally:
        holder.kill()
        holder.wait()
    na = 0xFFFFFFFF
    assert r["v3"] == [[pid, 256 * MiB, na, na]]
    assert r["v2"] == [[pid, 256 * MiB]]
    for abi in ("raw_v1", "raw_v2", "raw_v3"):
        assert r[abi] == [7, 1, 0, [[pid, 256 * MiB]]], abi   # INSUFFICIENT_SIZE, then SUCCESS
    assert r["used"] == [256 * MiB, 256 * MiB]
    assert r["free"] == [r["total"] - 256 * MiB] * 2
    assert r["name"] == comm


@needs_libcuda
def test_killed_cuda_process_leaves_the_lists_and_frees_its_memory_within_5s(sim_env):
    holder = start_python(HOLDER, sim_env)
    try:
        assert holder.stdout.readline().strip() == "ready"
        before = nvml(PROCESS_VIEW + "print(json.dumps(view()))", sim_env)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert before["v3"][0][0] == holder.pid
    after = nvml(PROCESS_VIEW + """
import time
deadline = time.monotonic() + 5
v = view()
while (v["v3"] or v["used"] != [0, 0]) and time.monotonic() < deadline:
    time.sleep(0.05)
    v = view()
print(json.dumps(v))
""", sim_env)
    assert after["v3"] == [] and after["v2"] == []
    for abi in ("raw_v1", "raw_v2", "raw_v3"):
        assert after[abi] == [0, 0, 0, []], abi   # nothing running: SUCCESS with count 0
    assert after["used"] == [0, 0]
    assert after["free"] == [after["total"]] * 2
