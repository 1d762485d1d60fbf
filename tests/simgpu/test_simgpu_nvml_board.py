"""simgpu's NVML board queries (what nvidia-smi -q, nvitop and gpustat ask), per profile,
through nvidia-ml-py in child processes.

The static figures are each board's (simgpu/node.c says where they come from); what
a real board of that kind does not support is NVML_ERROR_NOT_SUPPORTED; dynamic figures
(temperature, power, clocks, P-state) follow the device's timeline as documented in
simgpu/nvml_board.c.
"""
import json

import pytest

from tests.helpers.simnode import make_sim_env, run_python, start_python

# profile: PCI device id, max power (W), max SM clock, max memory clock (MHz), bus width,
#          PCIe generation, has NVENC, NVDEC count, HBM (a memory temperature threshold)
BOARDS = {
    "a10": (0x2236, 150, 1695, 6251, 384, 4, True, 2, False),
    "a100-40g": (0x20B0, 400, 1410, 1215, 5120, 4, False, 5, True),
    "h100-80g": (0x2330, 700, 1980, 2619, 5120, 5, False, 7, True),
    "h200": (0x2335, 700, 1980, 3201, 6144, 5, False, 7, True),
}

QUERY = """
import json
import pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
def q(f, *a):
    try:
        return f(h, *a)
    except n.NVMLError as e:
        return "NOT_SUPPORTED" if e.value == n.NVML_ERROR_NOT_SUPPORTED else repr(e)
pci = n.nvmlDeviceGetPciInfo_v3(h)
bar1 = n.nvmlDeviceGetBAR1MemoryInfo(h)
out = {
  "pci": [pci.busId.decode() if isinstance(pci.busId, bytes) else pci.busId, pci.pciDeviceId, pci.pciSubSystemId],
  "power_limit": q(n.nvmlDeviceGetEnforcedPowerLimit), "constraints": list(q(n.nvmlDeviceGetPowerManagementLimitConstraints)),
  "power": q(n.nvmlDeviceGetPowerUsage), "temp": q(n.nvmlDeviceGetTemperature, n.NVML_TEMPERATURE_GPU),
  "thresholds": [q(n.nvmlDeviceGetTemperatureThreshold, t) for t in range(5)],
  "max_clocks": [q(n.nvmlDeviceGetMaxClockInfo, c) for c in range(4)],
  "clocks": [q(n.nvmlDeviceGetClockInfo, c) for c in range(4)],
  "pstate": q(n.nvmlDeviceGetPerformanceState), "bus_width": q(n.nvmlDeviceGetMemoryBusWidth),
  "pcie": [q(n.nvmlDeviceGetCurrPcieLinkGeneration), q(n.nvmlDeviceGetMaxPcieLinkWidth)],
  "fan": q(n.nvmlDeviceGetFanSpeed), "fans": q(n.nvmlDeviceGetNumFans),
  "enc": q(n.nvmlDeviceGetEncoderUtilization), "dec": q(n.nvmlDeviceGetDecoderUtilization),
  "ecc": list(q(n.nvmlDeviceGetEccMode)), "ecc_errors": q(n.nvmlDeviceGetTotalEccErrors, 1, 0),
  "modes": [q(n.nvmlDeviceGetComputeMode), q(n.nvmlDeviceGetPersistenceMode), q(n.nvmlDeviceGetDisplayMode)],
  "bar1": [bar1.bar1Total, bar1.bar1Used + bar1.bar1Free == bar1.bar1Total],
  "reasons": q(n.nvmlDeviceGetCurrentClocksEventReasons), "vbios": q(n.nvmlDeviceGetVbiosVersion),
  "brand": q(n.nvmlDeviceGetBrand), "serial": q(n.nvmlDeviceGetSerial), "arch": q(n.nvmlDeviceGetArchitecture),
  "cores": q(n.nvmlDeviceGetNumGpuCores), "remapped": list(q(n.nvmlDeviceGetRemappedRows)),
  "gsp": [list(q(n.nvmlDeviceGetGspFirmwareMode)), (lambda v: v.decode() if isinstance(v, bytes) else v)(q(n.nvmlDeviceGetGspFirmwareVersion))],
  "gom": q(n.nvmlDeviceGetGpuOperationMode),
}
print(json.dumps(out))
"""


@pytest.mark.parametrize("profile", sorted(BOARDS))
def test_an_idle_board_reports_its_specification(tmp_path, profile):
    dev_id, watts, sm_mhz, mem_mhz, bus, gen, nvenc, nvdec, hbm = BOARDS[profile]
    r = json.loads(run_python(QUERY, make_sim_env(tmp_path / "node", profile=profile)).stdout.splitlines()[-1])
    assert r["pci"][0] == "00000000:10:00.0" and r["pci"][1] == dev_id << 16 | 0x10DE
    assert r["power_limit"] == watts * 1000 and r["constraints"][1] == watts * 1000
    assert 0 < r["constraints"][0] < r["power_limit"] and 0 < r["power"] < r["power_limit"] / 2   # idle
    assert r["max_clocks"][:3] == [sm_mhz, sm_mhz, mem_mhz] and r["bus_width"] == bus
    assert r["clocks"][0] < sm_mhz and r["clocks"][2] == mem_mhz and r["pstate"] == 8   # idle
    assert r["pcie"] == [gen, 16]
    assert r["fan"] == "NOT_SUPPORTED" and r["fans"] == 0   # passively cooled
    assert (r["enc"] == "NOT_SUPPORTED") == (not nvenc) and r["dec"] == [0, 1000000]
    assert (r["thresholds"][2] == "NOT_SUPPORTED") == (not hbm) and r["thresholds"][4] == "NOT_SUPPORTED"
    assert r["thresholds"][0] > r["thresholds"][1] > r["temp"]
    assert r["ecc"] == [1, 1] and r["ecc_errors"] == 0 and r["remapped"] == [0, 0, 0, 0]
    assert r["modes"] == [0, 0, 0] and r["bar1"][1] and r["bar1"][0] >= 32 << 30
    assert r["reasons"] == 1   # GPU idle
    assert r["vbios"] == "NOT_SUPPORTED" and r["brand"] == 14 and len(r["serial"]) == 13
    assert r["arch"] == (9 if profile.startswith("h") else 7) and r["cores"] > 6000
    assert r["gsp"] == [[1, 1], "580.65.06"] and r["gom"] == "NOT_SUPPORTED"


def test_a_busy_board_clocks_up_warms_up_and_draws_power(tmp_path):
    env = make_sim_env(tmp_path / "node")
    busy = start_python("""
from cuda.bindings import driver as cu
cu.cuInit(0)
_, ctx = cu.cuDevicePrimaryCtxRetain(0)
cu.cuCtxSetCurrent(ctx)
_, m = cu.cuModuleLoadData(b"image\\0")
_, f = cu.cuModuleGetFunction(m, b"sim_1000us")
print("ready", flush=True)
while True:
    for _ in range(100):
        cu.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)
    cu.cuCtxSynchronize()
""", env)
    try:
        assert busy.stdout.readline().strip() == "ready"
        run_python("import time; time.sleep(1.1)", env)
        r = json.loads(run_python(QUERY, env).stdout.splitlines()[-1])
    finally:
        busy.kill()
        busy.wait()
    assert r["pstate"] == 0 and r["clocks"][0] == 1695 and r["reasons"] == 0
    assert r["temp"] >= 65 and r["power"] >= 140000


def test_nvml_example_py_runs_through(sim_env):
    """nvidia-ml-py's own example.py (installed with it as the module `example`) queries
    PCI info, brand, serial, UUID and virtualization mode: every field gets a value."""
    out = run_python("import runpy; runpy.run_module('example', run_name='__main__')", sim_env).stdout
    assert "<product_name>NVIDIA A10</product_name>" in out and "<gpu id=\"00000000:10:00.0\">" in out
    assert "<product_brand>NVIDIA</product_brand>" in out and "<virtualization_mode>None" in out
    assert "Function Not Found" not in out and "example.py:" not in out
