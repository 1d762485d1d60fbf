"""Software vgpu did not write, run on simgpu under the shim, in a 4 GiB slice.

The tools people run inside a container (nvitop, gpustat, nvidia-ml-py's example.py) show
the slice and print no traceback; numba-cuda allocates to the cap, gets its
out-of-memory error beyond it and runs a @cuda.jit kernel paced at the slice's share;
Triton compiles and launches a kernel, paced likewise.  Kernels are simulated: a kernel
whose name is (or, mangled, holds) sim_<N>us takes N us per wave of blocks and changes no
memory.  The packages are pinned in pyproject's test extra; a test is skipped, saying so,
only where its package is not installed.
"""
import importlib.util
import json
import re
import subprocess
import sys

import pytest

from tests.helpers.simnode import make_sim_env, run_python, start_python
from vgpu.paths import SHIM

GiB, MiB = 1 << 30, 1 << 20


def have(module):
    """Is the package installed?  Found, not imported: its import may load NVML or the
    driver, which must never bind the pytest process to a simgpu node."""
    return importlib.util.find_spec(module) is not None


def slice_env(tmp_path, name="t", memory="4Gi", sm=None, **extra):
    env = make_sim_env(tmp_path / "node", LD_PRELOAD=str(SHIM), VGPU_DIR=tmp_path / "vgpu", VGPU_SLICE=name,
                       VGPU_MEMORY_LIMIT=memory, **extra)
    if sm:
        env["VGPU_SM_LIMIT"] = sm
    return env


HOLDER = """
import sys
from cuda.bindings import driver as cu
cu.cuInit(0)
_, ctx = cu.cuDevicePrimaryCtxRetain(0)
cu.cuCtxSetCurrent(ctx)
err, p = cu.cuMemAlloc(1 << 30)
assert int(err) == 0, err
print("holding", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path):
    """A process of the slice holding 1 GiB (so the tools have a process to show)."""
    p = start_python(HOLDER, slice_env(tmp_path))
    assert p.stdout.readline().strip() == "holding", p.stderr.read()
    yield p
    p.stdin.close()
    p.wait(timeout=30)


def tool(args, env, timeout=60):
    p = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0 and "Traceback" not in p.stderr, (p.returncode, p.stdout, p.stderr)
    return p


@pytest.mark.skipif(not have("gpustat"), reason="gpustat is not installed")
def test_gpustat_json_shows_the_slice(tmp_path, holder):
    out = json.loads(tool(["-m", "gpustat", "--json"], slice_env(tmp_path)).stdout)
    [gpu] = out["gpus"]
    assert gpu["name"] == "NVIDIA A10" and gpu["memory.total"] == 4096
    assert gpu["memory.used"] == 1024 and [p["pid"] for p in gpu["processes"]] == [holder.pid]
    assert gpu["temperature.gpu"] > 0 and gpu["enforced.power.limit"] == 150 and gpu["utilization.gpu"] == 0


@pytest.mark.skipif(not have("nvitop"), reason="nvitop is not installed")
def test_nvitop_once_and_its_api_show_the_slice(tmp_path, holder):
    env = slice_env(tmp_path)
    screen = tool(["-m", "nvitop", "--once"], dict(env, COLUMNS="100")).stdout
    assert "A10" in screen and "1024MiB / 4096MiB" in screen and "00000000:10:00.0" in screen
    assert re.search(rf"\b{holder.pid}\b", screen)   # its own process, with the slice's pid
    api = run_python("""
import json
from nvitop import Device
d = Device(0)
print(json.dumps([d.memory_total(), d.memory_used(), sorted(d.processes()), d.gpu_utilization(),
                  d.power_limit(), d.performance_state()]))
""", env).stdout.splitlines()[-1]
    total, used, pids, util, limit, pstate = json.loads(api)
    assert total == 4 * GiB and used == GiB and pids == [holder.pid] and util == 0
    assert limit == 150000 and pstate == "P0"


@pytest.mark.skipif(not have("nvitop"), reason="nvitop is not installed")
def test_nvitop_lists_every_process_of_the_slice_with_its_pid_and_memory(tmp_path, holder):
    # a second process: nvitop reads nvmlDeviceGetRunningProcessDetailList where the
    # driver exports it (R550+, and simgpu), whose entries must be read at their own size
    second = start_python(HOLDER.replace("1 << 30", "512 << 20"), slice_env(tmp_path))
    try:
        assert second.stdout.readline().strip() == "holding", second.stderr.read()
        screen = tool(["-m", "nvitop", "--once"], dict(slice_env(tmp_path), COLUMNS="120")).stdout
        rows = {int(m.group(1)): m.group(0) for m in re.finditer(r"\b(\d{2,})\b[^\n]*MiB", screen)
                if int(m.group(1)) in (holder.pid, second.pid)}
        assert set(rows) == {holder.pid, second.pid}, screen
        assert rows[holder.pid].endswith("1024MiB") and rows[second.pid].endswith("512.0MiB"), rows
        assert "No Such Process" not in screen and str(256 << 20) not in screen and "268435456" not in screen
    finally:
        second.stdin.close()
        second.wait(timeout=30)


def test_nvidia_ml_py_example_runs_through_under_the_shim(tmp_path):
    out = tool(["-m", "example"], slice_env(tmp_path)).stdout
    assert "<product_name>NVIDIA A10</product_name>" in out and "<serial>" in out
    assert "Function Not Found" not in out and "example.py:" not in out


NUMBA = """
import time, warnings
import numpy as np
warnings.simplefilter("ignore")
from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError

free, total = cuda.current_context().get_memory_info()
held = [cuda.device_array(256 << 20, dtype=np.uint8) for _ in range(3)]   # 768 MiB of the 1 GiB cap
try:
    cuda.device_array(512 << 20, dtype=np.uint8)
    oom = None
except CudaAPIError as e:
    oom = e.code

@cuda.jit
def sim_2000us(x):
    i = cuda.grid(1)
    if i < x.size:
        x[i] += 1

x = cuda.to_device(np.zeros(64, dtype=np.float32))
sim_2000us[1, 64](x)                      # compile and a first, measured launch
cuda.synchronize()
t = time.monotonic()
for _ in range(250):                       # 0.5 s of GPU time
    sim_2000us[1, 64](x)
cuda.synchronize()
print(json.dumps({"total": total, "oom": oom, "elapsed": time.monotonic() - t,
                  "unchanged": float(x.copy_to_host().sum())}))
"""


@pytest.mark.skipif(not have("numba_cuda"), reason="numba-cuda is not installed")
def test_numba_cuda_allocates_to_the_cap_and_its_kernels_are_paced(tmp_path):
    """1 GiB slice at 50%: numba sees 1 GiB, its 512 MiB allocation past 768 MiB held is
    CUDA_ERROR_OUT_OF_MEMORY (numba's CudaAPIError, code 2), and 250 launches of a 2 ms
    kernel (0.5 s of GPU time) take about 1 s.  The kernel's body does not run: its
    output is its input (simgpu runs no device code)."""
    env = slice_env(tmp_path, memory="1Gi", sm="50%", NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS="0")
    r = json.loads(run_python("import json\n" + NUMBA, env, timeout=120).stdout.splitlines()[-1])
    assert r["total"] == GiB and r["oom"] == 2
    assert 0.85 <= r["elapsed"] <= 1.4, r["elapsed"]
    assert r["unchanged"] == 0.0


TRITON = """
import json, time
import triton
import triton.language as tl
from cuda.bindings import driver as cu

@triton.jit
def sim_2000us(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(x_ptr + offs, x + 1, mask=offs < n)

class Buffer:                              # what Triton asks of a tensor argument
    dtype = tl.float32
    def __init__(self, ptr): self.ptr = ptr
    def data_ptr(self): return self.ptr

cu.cuInit(0)
_, ctx = cu.cuDevicePrimaryCtxRetain(0)
cu.cuCtxSetCurrent(ctx)
_, p = cu.cuMemAlloc(1 << 20)
x = Buffer(int(p))
sim_2000us[(1,)](x, 1024, BLOCK=1024)       # compile, load, first launch
cu.cuCtxSynchronize()
t = time.monotonic()
for _ in range(250):
    sim_2000us[(1,)](x, 1024, BLOCK=1024)
cu.cuCtxSynchronize()
print(json.dumps({"elapsed": time.monotonic() - t}))
"""


@pytest.mark.skipif(not have("triton"), reason="triton is not installed")
def test_triton_compiles_and_launches_a_paced_kernel(tmp_path):
    """Triton's compiler (its own ptxas), its launcher (built with the C compiler against
    simgpu's libcuda) and the driver calls behind them (cuPointerGetAttribute on every
    pointer argument, cuModuleLoadData of its cubin, cuFuncGetAttribute, cuLaunchKernelEx)
    run under the shim; at 50% the 0.5 s of GPU time takes about 1 s."""
    env = slice_env(tmp_path, sm="50%", TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),
                    TRITON_DEFAULT_FP_FUSION="1")
    script = tmp_path / "triton_kernel.py"   # Triton reads a kernel's source from its file
    script.write_text(TRITON)
    r = json.loads(tool([str(script)], env, timeout=180).stdout.splitlines()[-1])
    assert 0.85 <= r["elapsed"] <= 1.4, r["elapsed"]
