"""Which device is which: the shim's NVML view matches a handle to the slice's device by
UUID, because CUDA numbers the devices it sees (CUDA_VISIBLE_DEVICES reorders and hides
GPUs; a MIG instance is a device of its own) while NVML numbers the node's GPUs.

Real processes under the shim on simgpu, through cuda-bindings and pynvml.
"""
import json

from tests.helpers.simnode import make_sim_env, run_python
from tests.simgpu.test_simgpu_mig import nvml
from vgpu.paths import SHIM

GiB, MiB = 1 << 30, 1 << 20

VIEW = """
import json
from cuda.bindings import driver as cu
import pynvml as n
assert cu.cuInit(0)[0] == 0
d = cu.cuDeviceGet(0)[1]
assert cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(d)[1])[0] == 0
assert cu.cuMemAlloc(256 << 20)[0] == 0
n.nvmlInit()
uuid = "-".join([bytes(cu.cuDeviceGetUuid(d)[1].bytes).hex()[i:j] for i, j in ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32))])
out = {"cuda": [int(x) for x in cu.cuMemGetInfo()[1:]], "gpus": []}
for i in range(n.nvmlDeviceGetCount()):
    h = n.nvmlDeviceGetHandleByIndex(i)
    out["gpus"].append([n.nvmlDeviceGetUUID(h), n.nvmlDeviceGetMemoryInfo(h).total,
                        len(n.nvmlDeviceGetComputeRunningProcesses(h))])
for prefix in ("GPU-", "MIG-"):
    try:
        h = n.nvmlDeviceGetHandleByUUID(prefix + uuid)
    except n.NVMLError:
        continue
    out["mine"] = [prefix + uuid, n.nvmlDeviceGetMemoryInfo(h).total, n.nvmlDeviceGetMemoryInfo(h).used,
                   [p.usedGpuMemory for p in n.nvmlDeviceGetComputeRunningProcesses(h)]]
print(json.dumps(out))
"""


def shim_env(env, tmp_path, **extra):
    return dict(env, LD_PRELOAD=str(SHIM), VGPU_DIR=str(tmp_path / "vgpu"), VGPU_SLICE="c1",
                VGPU_MEMORY_LIMIT="1Gi", **extra)


def test_cuda_visible_devices_1_caps_nvml_s_second_gpu_not_its_first(tmp_path):
    """CUDA_VISIBLE_DEVICES=1: the slice's device 0 is the node's second GPU.  NVML shows
    that one as the slice and the first as the driver has it."""
    env = make_sim_env(tmp_path / "node", profile="a10", devices=2)
    r = json.loads(run_python(VIEW, shim_env(env, tmp_path, CUDA_VISIBLE_DEVICES="1")).stdout.strip().splitlines()[-1])
    assert r["cuda"] == [GiB - 256 * MiB, GiB]
    (first, first_total, first_procs), (second, second_total, _) = r["gpus"]
    assert r["mine"] == [second, GiB, 256 * MiB, [256 * MiB]]   # NVML's index 1 is the slice
    assert (first_total, second_total) == (24 * GiB, GiB)        # index 0 as the driver has it
    assert first_procs == 0                                      # and its process list too


def test_a_slice_inside_a_mig_instance_is_shown_on_the_instance_s_handle(tmp_path):
    """CUDA_VISIBLE_DEVICES=MIG-<uuid>: device 0 is the instance; its NVML handle shows
    the slice (a 1 GiB cap within a 3g.71gb instance), the parent GPU the whole card."""
    env = make_sim_env(tmp_path / "node", profile="h200")
    uuid = nvml("enable()\nprint(json.dumps(mig_device(9)))", env)
    r = json.loads(run_python(VIEW, shim_env(env, tmp_path, CUDA_VISIBLE_DEVICES=uuid)).stdout.strip().splitlines()[-1])
    assert r["cuda"] == [GiB - 256 * MiB, GiB]
    assert r["mine"] == [uuid, GiB, 256 * MiB, [256 * MiB]]
    ((parent, total, procs),) = r["gpus"]
    assert total > 100 * GiB                               # the H200 itself, as the driver has it
    assert procs == 1                                      # its list, as the driver gives it
