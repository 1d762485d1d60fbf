"""Benchmarks: figures are ratios and differences measured side by side in one run."""
import os
import subprocess
from pathlib import Path

import pytest

from vgpu.paths import SHIM
from vgpu.sim import sim_environment

ROOT = Path(__file__).resolve().parent.parent


def shims_to_compare():
    """This shim, and another build of it where BENCH_BASELINE_SHIM names one (an older
    commit's, built aside: docs/benchmarks.md), to run side by side in the same rounds."""
    baseline = os.environ.get("BENCH_BASELINE_SHIM")
    if baseline and not os.path.isfile(baseline):   # (LD_PRELOAD only warns: it would measure no shim)
        pytest.exit(f"BENCH_BASELINE_SHIM={baseline} is no file: build it first (docs/benchmarks.md)", returncode=2)
    return {"this shim": SHIM, **({"baseline": baseline} if baseline else {})}


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


def _flatten(prefix, value, rows):
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix} / {k}" if prefix else str(k), v, rows)
    elif isinstance(value, (list, tuple)):
        rows.append((prefix, "  ".join(f"{x:.1f}" if isinstance(x, float) else str(x) for x in value)))
    else:
        rows.append((prefix, f"{value:.3g}" if isinstance(value, float) else str(value)))


def pytest_terminal_summary(terminalreporter, config):
    """All figures of the run in one table (the same as in the saved JSON's extra_info)."""
    session = getattr(config, "_benchmarksession", None)
    benchmarks = getattr(session, "benchmarks", None) or []
    rows = []
    for b in benchmarks:
        name = b.name.replace("test_", "", 1)
        for key, value in (b.extra_info or {}).items():
            _flatten(f"{name}: {key}", value, rows)
    if not rows:
        return
    width = max(len(r[0]) for r in rows)
    terminalreporter.write_sep("=", "vgpu benchmark figures (one run, side by side on simgpu)")
    for label, value in rows:
        terminalreporter.write_line(f"{label:<{width}}  {value}")
