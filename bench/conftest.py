"""Benchmarks: figures are ratios and differences measured side by side in one run."""
import os
import subprocess
from pathlib import Path

import pytest

from vgpu.sim import sim_environment

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def bench_program(tmp_path_factory):
    """Compile bench/programs/<name>.c (or <directory>/<name>.c) optimised; return its path."""
    out = tmp_path_factory.mktemp("bench")

    def build(name, directory=ROOT / "bench" / "programs"):
        exe = out / name
        subprocess.run(["cc", "-std=gnu11", "-O2", "-Wall", "-Werror", "-I", str(ROOT / "csrc"),
                        str(Path(directory) / f"{name}.c"), "-o", str(exe), "-ldl", "-pthread"], check=True)
        return exe

    return build


def sim_env(state_dir, **extra):
    """A clean environment on a fresh simgpu A10 node (no vgpu variables inherited)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIMGPU_", "VGPU_", "CUDA_DEVICE_"))}
    env.update(sim_environment("a10", 1, str(state_dir), base_env=env))
    env.update({k: str(v) for k, v in extra.items()})
    return env
