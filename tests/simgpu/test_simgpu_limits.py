"""simgpu's per-cgroup device memory limits, as nvml.h (CUDA 13.5) documents
nvmlDeviceSetMemoryLimits_v1 and nvmlDeviceGetMemoryLimits_v1 (simgpu/limits.c):
real processes in real cgroup v2 directories (made here as root), pynvml setting and
reading the limits, cuda-bindings allocating without the shim.
"""
import json
import os
import uuid
from pathlib import Path

import pytest

from tests.helpers.simnode import make_sim_env, run_python

GiB, MiB = 1 << 30, 1 << 20
LIMIT_MAX = 0xFFFFFFFFFFFFFFFF


def cgroup2_root():
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if " - cgroup2 " in line and fields[3] == "/":
            return Path(fields[4])
    return None


ROOT = cgroup2_root()
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or ROOT is None or not os.access(ROOT, os.W_OK),
                                reason="needs root and a writable cgroup v2 hierarchy")


@pytest.fixture
def cgroups():
    """cgroups(parent=None): a new cgroup v2 directory (under `parent`), removed at teardown."""
    made = []

    def make(parent=None):
        path = (parent or ROOT) / f"vgpu-test-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        made.append(path)
        return path
    yield make
    for path in reversed(made):
        try:
            path.rmdir()
        except OSError:
            pass


SET = """
import ctypes, json, sys
import pynvml as n
n.nvmlInit()
class Limits(ctypes.Structure):
    _fields_ = [("nameSpace", ctypes.c_char_p), ("softLimit", ctypes.c_ulonglong), ("hardLimit", ctypes.c_ulonglong),
                ("currentUsed", ctypes.c_ulonglong)]
lib = n.nvmlLib if hasattr(n, "nvmlLib") else ctypes.CDLL("libnvidia-ml.so.1")
h = n.nvmlDeviceGetHandleByIndex(0)
out = []
for op, path, soft, hard in json.loads(sys.argv[1]):
    l = Limits(path.encode(), soft, hard, 0)
    fn = getattr(lib, "nvmlDeviceSetMemoryLimits_v1" if op == "set" else "nvmlDeviceGetMemoryLimits_v1")
    rc = fn(h, ctypes.byref(l))
    out.append([rc, l.softLimit, l.hardLimit, l.currentUsed])
print(json.dumps(out))
"""


def nvml(env, *ops):
    return json.loads(run_python(SET, env, args=(json.dumps(ops),)).stdout.strip().splitlines()[-1])


ALLOC = """
import json, sys
from cuda.bindings import driver as cu
import pynvml as n
assert cu.cuInit(0)[0] == 0
assert cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1])[0] == 0
got = [int(cu.cuMemAlloc(int(size))[0]) for size in sys.argv[1:]]
n.nvmlInit()
m = n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetHandleByIndex(0), n.nvmlMemory_v2)
print(json.dumps({"alloc": got, "free": m.free}))
"""


def in_cgroup(env, cgroup, *sizes):
    """ALLOC run by a process that moved itself into `cgroup` first."""
    code = f"open({str(cgroup / 'cgroup.procs')!r}, 'w').write(str(__import__('os').getpid()))\n" + ALLOC
    return json.loads(run_python(code, env, args=[str(s) for s in sizes]).stdout.strip().splitlines()[-1])


def test_the_hard_limit_holds_for_the_cgroup_and_its_children_and_no_one_else(tmp_path, cgroups):
    env = make_sim_env(tmp_path / "node")          # an A10: 24 GiB
    a, b = cgroups(), cgroups()
    child = cgroups(a)                             # below a
    assert nvml(env, ["set", str(a), 256 * MiB, GiB])[0][0] == 0
    got = in_cgroup(env, a, 512 * MiB)
    assert got["alloc"] == [0]
    # a process of a's child cgroup: counted against a, refused past the hard limit
    over = in_cgroup(env, child, 256 * MiB, 2 * GiB)
    assert over["alloc"] == [0, 2]                 # CUDA_ERROR_OUT_OF_MEMORY past 1 GiB
    assert over["free"] <= GiB - 256 * MiB         # memory info v2 in the cgroup: what it may still take
    assert in_cgroup(env, b, 2 * GiB)["alloc"] == [0]   # a sibling is not limited
    [[rc, soft, hard, used]] = nvml(env, ["get", str(a), 0, 0])
    assert (rc, soft, hard, used) == (0, 256 * MiB, GiB, 0)   # the processes are gone: nothing held


def test_errors_and_clearing_are_as_the_header_says(tmp_path, cgroups):
    env = make_sim_env(tmp_path / "node")
    a = cgroups()
    got = nvml(env, ["get", str(a), 0, 0],                       # none set: NOT_FOUND
               ["set", str(a), 2 * GiB, GiB],                    # soft > hard: INVALID_ARGUMENT
               ["set", str(a), 0, 64 * GiB],                     # above the device: INVALID_ARGUMENT
               ["set", str(a / "nothing"), 0, GiB],              # cannot be opened: OPERATING_SYSTEM
               ["set", str(a), 0, GiB], ["set", str(a), 0, LIMIT_MAX],   # set, then clear
               ["get", str(a), 0, 0])
    assert [r[0] for r in got] == [6, 2, 2, 17, 0, 0, 6]
    off = nvml(dict(env, SIMGPU_MEMORY_LIMITS="0"), ["set", str(a), 0, GiB], ["get", str(a), 0, 0])
    assert [r[0] for r in off] == [3, 3]                          # an older driver: NOT_SUPPORTED


def test_removing_the_cgroup_clears_its_limit_even_when_made_again(tmp_path, cgroups):
    env = make_sim_env(tmp_path / "node")
    a = cgroups()
    assert nvml(env, ["set", str(a), 0, 256 * MiB])[0][0] == 0
    assert in_cgroup(env, a, 512 * MiB)["alloc"] == [2]
    a.rmdir()
    a.mkdir()
    assert nvml(env, ["get", str(a), 0, 0])[0][0] == 6
    assert in_cgroup(env, a, 512 * MiB)["alloc"] == [0]
