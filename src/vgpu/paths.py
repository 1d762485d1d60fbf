"""Where the C libraries built with the package live."""
from pathlib import Path

LIB_DIR = Path(__file__).resolve().parent / "_lib"
SIMGPU_DIR = LIB_DIR / "simgpu"
SHIM = LIB_DIR / "libvgpu.so"


def simgpu_dir() -> Path:
    """Directory holding simgpu's libcuda.so.1 and libnvidia-ml.so.1."""
    if not (SIMGPU_DIR / "libcuda.so.1").exists():
        raise FileNotFoundError(
            f"simgpu libraries not found in {SIMGPU_DIR}: the package was not built "
            "(run `pip install -e .` or `make venv`)")
    return SIMGPU_DIR


def shim_path() -> Path:
    """The LD_PRELOAD library (libvgpu.so)."""
    if not SHIM.exists():
        raise FileNotFoundError(
            f"shim not found at {SHIM}: the package was not built "
            "(run `pip install -e .` or `make venv`)")
    return SHIM
