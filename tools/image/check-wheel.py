"""Check a vgpu wheel holds the compiled libraries, and say which glibc they need.

usage: python tools/image/check-wheel.py WHEEL

Run by build-wheel.sh after every build.  The glibc figure matters to operators: the shim
is loaded into other people's images, and it loads only where their glibc is at least the
newest symbol version it was linked against (the build stage's glibc sets that floor).
"""
import re
import sys
import zipfile

REQUIRED = ("vgpu/_lib/libvgpu.so", "vgpu/_lib/simgpu/libcuda.so.1", "vgpu/_lib/simgpu/libnvidia-ml.so.1")
STUBS = ("vgpu/k8s/protos/dra_v1_pb2.py", "vgpu/k8s/protos/pluginregistration_v1_pb2_grpc.py")   # the DRA driver's


def glibc_floor(elf: bytes) -> str:
    """The newest GLIBC_x.y version the library names (its .dynstr lists them)."""
    versions = {tuple(map(int, m.group(1).split(b"."))) for m in re.finditer(rb"GLIBC_(\d+\.\d+(?:\.\d+)?)\0", elf)}
    return ".".join(map(str, max(versions))) if versions else "unknown"


def check(path) -> list:
    problems, lines = [], []
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
        problems += [f"{member} missing" for member in STUBS if member not in names]
        for member in REQUIRED:
            if member not in names:
                problems.append(f"{member} missing")
                continue
            data = zf.read(member)
            if data[:4] != b"\x7fELF":
                problems.append(f"{member} is not an ELF file")
                continue
            lines.append(f"  {member}: {len(data)} bytes, needs glibc >= {glibc_floor(data)}")
    if problems:
        raise SystemExit(f"{path}: " + "; ".join(problems))
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: check-wheel.py WHEEL")
    print(f"{sys.argv[1]}: ok")
    print("\n".join(check(sys.argv[1])))
