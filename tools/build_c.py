"""Compile vgpu's C libraries with the system C compiler.

Used by setup.py (so `pip install` builds them into the package) and directly during
development: `python tools/build_c.py src/vgpu/_lib`.  No CUDA headers and no Python
headers are needed: the C parts define the ABI they use themselves (csrc/*_abi.h).
Include paths: csrc/ (the shared ABI headers) and the repository root (simgpu's own
headers, as "simgpu/node.h").
"""
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFLAGS = ["-std=gnu11", "-O2", "-g", "-fPIC", "-pthread", "-Wall", "-Wextra", "-Werror",
          "-fvisibility=hidden", "-I" + os.path.join(ROOT, "csrc"), "-I" + ROOT]
# -Bsymbolic-functions: a library's calls to its own exported functions stay inside it
# (as in the real driver), so a preloaded shim sees each program call exactly once.
LDFLAGS = ["-shared", "-pthread", "-Wl,-z,defs", "-Wl,-z,now", "-Wl,-Bsymbolic-functions"]

# output path (relative to the _lib dir) -> (sources, soname, extra link flags)
LIBRARIES = {
    "simgpu/libcuda.so.1": (["simgpu/node.c", "simgpu/mig.c", "simgpu/limits.c",
                             "simgpu/image.c", "simgpu/cuda.c", "simgpu/cuda_memory.c",
                             "simgpu/cuda_streams.c", "simgpu/cuda_copy.c", "simgpu/cuda_modules.c",
                             "simgpu/cuda_graphs.c"], "libcuda.so.1", []),
    "simgpu/libnvidia-ml.so.1": (["simgpu/node.c", "simgpu/mig.c", "simgpu/limits.c",
                                  "simgpu/nvml.c", "simgpu/nvml_board.c",
                                  "simgpu/nvml_mig.c"], "libnvidia-ml.so.1", []),
    "libvgpu.so": (["shim/shim.c", "shim/memory.c", "shim/pools.c", "shim/vmm.c", "shim/shared_memory.c",
                    "shim/compute.c", "shim/board.c", "shim/view.c"], "libvgpu.so", []),
}


def compiler():
    return shlex.split(os.environ.get("CC", "cc"))


def build_all(out_dir, only=()):
    for rel, (sources, soname, extra) in LIBRARIES.items():
        if only and not any(name in rel for name in only):
            continue
        if not all(os.path.exists(os.path.join(ROOT, s)) for s in sources):
            continue
        out = os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cmd = (compiler() + CFLAGS + [os.path.join(ROOT, s) for s in sources]
               + LDFLAGS + ["-Wl,-soname," + soname, "-o", out + ".tmp"] + extra + ["-ldl", "-lrt"])
        print(" ".join(cmd), flush=True)
        subprocess.check_call(cmd)
        os.replace(out + ".tmp", out)  # never leave a half-written library in place


if __name__ == "__main__":
    # usage: build_c.py [OUT_DIR [NAME...]]  (NAME filters libraries, e.g. libcuda)
    build_all(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "src", "vgpu", "_lib"),
              sys.argv[2:])
