"""vgpu-ctl: version, and `sim env` whose output really points a program at simgpu."""
import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from tests.helpers.paths import ROOT

from vgpu import __version__
from vgpu.cli import main
from vgpu.paths import SHIM, SIMGPU_DIR


def test_version_prints_package_version_and_the_shims_abi():
    from vgpu._region import lib
    for flag in ("--version", "-V"):
        r = CliRunner().invoke(main, [flag])
        assert r.exit_code == 0
        assert r.output == f"vgpu-ctl {__version__}, shim ABI {lib.VGPU_ABI_VERSION}\n"
    # the ABI the built shim enforces is the header's: it refuses files of any other version
    header = (ROOT / "csrc" / "vgpu_region.h").read_text()
    assert f"#define VGPU_ABI_VERSION {lib.VGPU_ABI_VERSION}\n" in header


def test_sim_env_prints_exports_for_profile_devices_and_state(tmp_path):
    r = CliRunner().invoke(main, ["sim", "env", "--profile", "h200", "--devices", "2",
                                  "--state", str(tmp_path / "n")])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert lines[0].startswith(f"export LD_LIBRARY_PATH={SIMGPU_DIR}")
    assert "export SIMGPU_PROFILE=h200" in lines
    assert "export SIMGPU_DEVICES=2" in lines
    assert f"export SIMGPU_STATE_DIR={tmp_path / 'n'}" in lines


def test_sim_env_json_is_parseable(tmp_path):
    r = CliRunner().invoke(main, ["sim", "env", "--json", "--state", str(tmp_path)])
    assert r.exit_code == 0
    env = json.loads(r.output)
    assert env["SIMGPU_PROFILE"] == "a10" and env["SIMGPU_DEVICES"] == "1"


def test_sim_env_rejects_unknown_profile_and_bad_device_count_as_usage_errors():
    r = CliRunner().invoke(main, ["sim", "env", "--profile", "v100"])
    assert r.exit_code == 2 and "v100" in r.output and "a10" in r.output
    r = CliRunner().invoke(main, ["sim", "env", "--devices", "9"])
    assert r.exit_code == 2 and "--devices" in r.output


def test_shell_sourcing_sim_env_runs_pynvml_on_simgpu(tmp_path):
    """What an operator does: eval the output, then run an unmodified NVML client."""
    script = (f'eval "$(vgpu-ctl sim env --profile a100-40g --devices 3 --state {tmp_path})"; '
              'python -c "import pynvml; pynvml.nvmlInit(); '
              'print(pynvml.nvmlDeviceGetCount(), '
              'pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(2)))"')
    bindir = Path(sys.executable).parent
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                         env={"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path)}).stdout
    assert out.strip() == "3 NVIDIA A100-SXM4-40GB"


def test_shim_path_prints_the_built_shim():
    r = CliRunner().invoke(main, ["shim-path"])
    assert r.exit_code == 0
    assert r.output.strip() == str(SHIM) and SHIM.exists()


def test_gpu_check_ends_cleanly_without_a_gpu(tmp_path):
    """bench/gpu_check.py is for machines with an NVIDIA GPU; elsewhere it says so, exit 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"gpu": None, "message": "no GPU found: this check needs an NVIDIA GPU, "
                                      "its driver and nvidia-ml-py; nothing was run"}
