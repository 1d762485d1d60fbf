"""simgpu: the simulated GPU that tests, benchmarks and the demo run on.

simgpu is two shared libraries (libcuda.so.1, libnvidia-ml.so.1) built with the package;
a program uses them when LD_LIBRARY_PATH points at their directory.  Processes that
share SIMGPU_STATE_DIR share one simulated node: the same devices, memory and timeline.
"""
import os
import shlex
from dataclasses import dataclass

from .paths import SIMGPU_DIR, simgpu_dir  # noqa: F401 (SIMGPU_DIR: for callers)


@dataclass(frozen=True)
class Profile:
    id: str
    model: str
    memory_gib: int
    sm_count: int
    # Device memory a process's first context on a device costs when simgpu runs with
    # SIMGPU_CONTEXT_OVERHEAD=profile (default: 0 bytes).  A ballpark of what nvidia-smi
    # shows for a bare context on such a card, not a measurement.
    context_overhead_mib: int = 0


# Must match the table in simgpu/node.c (tests/simgpu/test_simgpu_cuda.py checks each).
PROFILES = {p.id: p for p in [
    Profile("a10", "NVIDIA A10", 24, 72, 256),
    Profile("a100-40g", "NVIDIA A100-SXM4-40GB", 40, 108, 384),
    Profile("h100-80g", "NVIDIA H100 80GB HBM3", 80, 132, 512),
    Profile("h200", "NVIDIA H200", 141, 132, 512),
]}
MAX_DEVICES = 8


def default_state_dir() -> str:
    return f"/tmp/simgpu-{os.getuid()}"


def sim_environment(profile="a10", devices=1, state_dir=None, base_env=None) -> dict:
    """The variables that point a program at simgpu (to merge into its environment)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown simgpu profile {profile!r} (known: {', '.join(PROFILES)})")
    if not 1 <= devices <= MAX_DEVICES:
        raise ValueError(f"device count must be 1..{MAX_DEVICES}, not {devices}")
    base_env = os.environ if base_env is None else base_env
    lib = str(simgpu_dir())
    old = base_env.get("LD_LIBRARY_PATH", "")
    return {
        "LD_LIBRARY_PATH": lib + (":" + old if old and old.split(":")[0] != lib else ""),
        "SIMGPU_PROFILE": profile,
        "SIMGPU_DEVICES": str(devices),
        "SIMGPU_STATE_DIR": os.path.abspath(state_dir or default_state_dir()),
    }


def check_state_dir(path):
    """simgpu makes its state directory, but not its parents: a missing parent is a
    ValueError that says so (simgpu would fail later, and NVML with it)."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    if os.path.exists(path):
        raise ValueError(f"{path} is not a directory; hint: point it at a directory (or a path to create)")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ValueError(f"simgpu state directory {path} cannot be made: {parent} does not exist; hint: create "
                         f"{parent} first, or pick a directory whose parent exists")


def shell_exports(env: dict) -> str:
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
