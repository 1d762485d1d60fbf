"""Every way a program reaches the driver lands in the shim.

1. direct linking, 2. dlopen + dlsym, 3. cuGetProcAddress / _v2 (what libcudart, NCCL,
PyTorch and cuda-python use), 4. NVML via dlopen + dlsym — plus NVIDIA's own clients
(cuda-bindings, pynvml, the real libcudart) and the recorded cudart request sequence.
"""
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers.paths import CUDART13_REQUESTS as FIXTURE, ROOT
from tests.helpers.simnode import make_sim_env, run_python
from vgpu.paths import SHIM, SIMGPU_DIR

GiB = 1 << 30
CUDART = Path("/usr/local/cuda/lib64/libcudart.so.13")
CUDA_INCLUDE = Path("/usr/local/cuda/include")

# Oracle, written from cuda.h / cudaTypedefs.h: which exported symbol the driver hands out
# for each (name, cudaVersion, flags) the shim hooks.  Everything else must be the driver's.
HOOKED = {
    ("cuInit", 2000, 0): "cuInit",
    ("cuCtxDestroy", 4000, 0): "cuCtxDestroy_v2",
    ("cuDevicePrimaryCtxReset", 7000, 0): "cuDevicePrimaryCtxReset",
    ("cuDevicePrimaryCtxReset", 11000, 0): "cuDevicePrimaryCtxReset_v2",
    ("cuDevicePrimaryCtxRelease", 7000, 0): "cuDevicePrimaryCtxRelease",
    ("cuDevicePrimaryCtxRelease", 11000, 0): "cuDevicePrimaryCtxRelease_v2",
    ("cuGetProcAddress", 11030, 0): "cuGetProcAddress",
    ("cuGetProcAddress", 12000, 0): "cuGetProcAddress_v2",
    ("cuDeviceTotalMem", 3020, 0): "cuDeviceTotalMem_v2",
    ("cuMemGetInfo", 3020, 0): "cuMemGetInfo_v2",
    ("cuMemAlloc", 3020, 0): "cuMemAlloc_v2",
    ("cuMemAllocPitch", 3020, 0): "cuMemAllocPitch_v2",
    ("cuMemAllocManaged", 6000, 0): "cuMemAllocManaged",
    ("cuMemFree", 3020, 0): "cuMemFree_v2",
    ("cuMemAllocAsync", 11020, 0): "cuMemAllocAsync",
    ("cuMemAllocAsync", 11020, 2): "cuMemAllocAsync_ptsz",
    ("cuMemAllocFromPoolAsync", 11020, 0): "cuMemAllocFromPoolAsync",
    ("cuMemAllocFromPoolAsync", 11020, 2): "cuMemAllocFromPoolAsync_ptsz",
    ("cuMemFreeAsync", 11020, 0): "cuMemFreeAsync",
    ("cuMemFreeAsync", 11020, 2): "cuMemFreeAsync_ptsz",
    ("cuArrayCreate", 3020, 0): "cuArrayCreate_v2",
    ("cuArray3DCreate", 3020, 0): "cuArray3DCreate_v2",
    ("cuArrayDestroy", 2000, 0): "cuArrayDestroy",
    ("cuMipmappedArrayCreate", 5000, 0): "cuMipmappedArrayCreate",
    ("cuMipmappedArrayDestroy", 5000, 0): "cuMipmappedArrayDestroy",
    ("cuMemPoolCreate", 11020, 0): "cuMemPoolCreate",
    ("cuDeviceGetDefaultMemPool", 11020, 0): "cuDeviceGetDefaultMemPool",
    ("cuDeviceGetMemPool", 11020, 0): "cuDeviceGetMemPool",
    ("cuMemPoolTrimTo", 11020, 0): "cuMemPoolTrimTo",
    ("cuMemPoolSetAttribute", 11020, 0): "cuMemPoolSetAttribute",
    ("cuMemPoolDestroy", 11020, 0): "cuMemPoolDestroy",
    ("cuStreamSynchronize", 2000, 0): "cuStreamSynchronize",
    ("cuStreamSynchronize", 7000, 2): "cuStreamSynchronize_ptsz",
    ("cuEventSynchronize", 2000, 0): "cuEventSynchronize",
    ("cuCtxSynchronize", 2000, 0): "cuCtxSynchronize",
    ("cuDeviceGraphMemTrim", 11040, 0): "cuDeviceGraphMemTrim",
    ("cuStreamSynchronize", 12000, 2): "cuStreamSynchronize_ptsz",
    ("cuMemCreate", 12000, 0): "cuMemCreate",
    ("cuMemMap", 12000, 0): "cuMemMap",
    ("cuMemUnmap", 12000, 0): "cuMemUnmap",
    ("cuMemRelease", 12000, 0): "cuMemRelease",
    ("cuIpcGetMemHandle", 4010, 0): "cuIpcGetMemHandle",
    ("cuIpcOpenMemHandle", 4010, 0): "cuIpcOpenMemHandle",
    ("cuIpcOpenMemHandle", 11000, 0): "cuIpcOpenMemHandle_v2",
    ("cuIpcCloseMemHandle", 4010, 0): "cuIpcCloseMemHandle",
    ("cuMemAlloc", 13000, 0): "cuMemAlloc_v2",
    ("cuMemGetInfo", 12000, 2): "cuMemGetInfo_v2",   # no per-thread variant: the default one
    ("cuMemAllocAsync", 11020, 1): "cuMemAllocAsync",  # legacy stream: the default variant
    ("cuLaunchKernel", 4000, 0): "cuLaunchKernel",
    ("cuLaunchKernel", 7000, 2): "cuLaunchKernel_ptsz",
    ("cuLaunchCooperativeKernel", 9000, 0): "cuLaunchCooperativeKernel",
    ("cuLaunchCooperativeKernel", 9000, 2): "cuLaunchCooperativeKernel_ptsz",
    ("cuLaunchKernelEx", 11060, 0): "cuLaunchKernelEx",
    ("cuLaunchKernelEx", 11060, 2): "cuLaunchKernelEx_ptsz",
    ("cuGraphLaunch", 10000, 0): "cuGraphLaunch",
    ("cuGraphLaunch", 10000, 2): "cuGraphLaunch_ptsz",
    ("cuGraphInstantiate", 10000, 0): "cuGraphInstantiate",
    ("cuGraphInstantiate", 11000, 0): "cuGraphInstantiate_v2",
    ("cuGraphInstantiateWithFlags", 11040, 0): "cuGraphInstantiateWithFlags",
    ("cuGraphInstantiateWithParams", 12000, 0): "cuGraphInstantiateWithParams",
    ("cuGraphInstantiateWithParams", 12000, 2): "cuGraphInstantiateWithParams_ptsz",
    ("cuGraphExecDestroy", 10000, 0): "cuGraphExecDestroy",
    ("cuLaunchKernel", 12000, 2): "cuLaunchKernel_ptsz",
    # not asked for by cudart
    ("cuMemExportToShareableHandle", 10020, 0): "cuMemExportToShareableHandle",
    ("cuMemImportFromShareableHandle", 10020, 0): "cuMemImportFromShareableHandle",
    ("cuMemRetainAllocationHandle", 11000, 0): "cuMemRetainAllocationHandle",
}
# Older ABIs of hooked entry points are not the hook's ABI: they must not get the hook.
NOT_HOOKED = [("cuMemAlloc", 2000, 0), ("cuMemGetInfo", 2000, 0), ("cuDeviceTotalMem", 2000, 0),
              ("cuMemAllocAsync", 11010, 2), ("cuLaunchKernel", 3000, 0), ("cuCtxSynchronize", 13000, 0),
              ("", 12000, 0),
              ("cuGetExportTable", 12000, 0)]


def shim_env(tmp_path, limit="4Gi", **extra):
    return make_sim_env(tmp_path / "node", LD_PRELOAD=str(SHIM), VGPU_DIR=tmp_path / "vgpu",
                        VGPU_SLICE="c1", VGPU_MEMORY_LIMIT=limit, **extra)


def fixture_rows():
    rows = []
    for line in FIXTURE.read_text().splitlines():
        if line.startswith("#") or line.startswith("symbol") or not line.strip():
            continue
        name, version, flags = line.split("\t")
        rows.append((name, int(version), int(flags)))
    return rows


@pytest.mark.parametrize("mode", ["link", "dlsym", "procaddress", "procaddress_v1"])
def test_each_driver_path_is_capped(tmp_path, c_program, mode):
    flags = ("-DLINKED", f"-L{SIMGPU_DIR}", "-l:libcuda.so.1") if mode == "link" else ()
    exe = c_program("paths_client", flags) if mode != "link" else _build_linked(tmp_path, c_program)
    out = subprocess.run([str(exe), mode], env=shim_env(tmp_path), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    expected = f"alloc3=0 alloc2=2 total={4 * GiB}"
    if mode.startswith("procaddress"):   # asked for itself, cuGetProcAddress returns the hook
        expected = "self=1 self1=1 " + expected
    assert out.stdout.strip() == expected


def _build_linked(tmp_path, c_program):
    exe = tmp_path / "paths_client_linked"
    subprocess.run(["cc", "-std=gnu11", "-Wall", "-Werror", "-DLINKED", "-I", str(ROOT / "csrc"),
                    str(ROOT / "tests" / "programs" / "paths_client.c"), "-o", str(exe),
                    f"-L{SIMGPU_DIR}", "-l:libcuda.so.1", "-ldl"], check=True)
    return exe


def test_nvml_through_dlopen_and_dlsym_shows_the_slice(tmp_path, c_program):
    exe = c_program("paths_client")
    out = subprocess.run([str(exe), "nvml"], env=shim_env(tmp_path, "3Gi"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"nvml total={3 * GiB} used=0 free={3 * GiB}"


def test_cuda_bindings_and_pynvml_are_capped_unchanged(tmp_path):
    """NVIDIA's own Python clients resolve through cuGetProcAddress_v2 and dlsym."""
    out = run_python("""
        from cuda.bindings import driver as cu
        import pynvml
        cu.cuInit(0)
        _, ctx = cu.cuDevicePrimaryCtxRetain(0)
        cu.cuCtxSetCurrent(ctx)
        e1, p = cu.cuMemAlloc(3 << 30)
        e2, _ = cu.cuMemAlloc(2 << 30)
        _, free, total = cu.cuMemGetInfo()
        pynvml.nvmlInit()
        m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        print(int(e1), int(e2), total, free, m.total, m.used)
    """, shim_env(tmp_path)).stdout.split()
    assert [int(x) for x in out] == [0, 2, 4 * GiB, GiB, 4 * GiB, 3 * GiB]


def _resolve_in_child(tmp_path, requests):
    """Resolve (name, version, flags) through cuGetProcAddress_v2 under the shim; for each,
    report the CUresult, the status, and which library the pointer lies in (and its symbol)."""
    code = r"""
        import ctypes, json, sys
        class Dl_info(ctypes.Structure):
            _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                        ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]
        libc = ctypes.CDLL(None)
        libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(Dl_info)]
        cuda = ctypes.CDLL("libcuda.so.1")
        gpa = cuda.cuGetProcAddress_v2
        gpa.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                        ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
        out = []
        for name, version, flags in json.loads(sys.argv[1]):
            p, st = ctypes.c_void_p(), ctypes.c_int(-1)
            r = gpa(name.encode(), ctypes.byref(p), version, flags, ctypes.byref(st))
            info = Dl_info()
            lib = sym = None
            if p.value and libc.dladdr(p.value, ctypes.byref(info)):
                lib = info.dli_fname.decode().rsplit("/", 1)[-1]
                sym = info.dli_sname.decode() if info.dli_sname and info.dli_saddr == p.value else None
            out.append([r, st.value, lib, sym])
        print(json.dumps(out))
    """
    import json
    out = run_python(code, shim_env(tmp_path), args=[json.dumps(requests)]).stdout
    return json.loads(out)


def test_recorded_cudart_sequence_gets_hooks_exactly_for_hooked_abis(tmp_path):
    rows = fixture_rows()
    assert len(rows) > 400
    results = _resolve_in_child(tmp_path, rows)
    hooked_seen = 0
    for (name, version, flags), (r, status, lib, sym) in zip(rows, results):
        assert (r, status) == (0, 0), (name, version, flags)
        want = HOOKED.get((name, version, flags))
        if want:
            hooked_seen += 1
            assert (lib, sym) == ("libvgpu.so", want), (name, version, flags)
        else:
            assert lib == "libcuda.so.1", (name, version, flags, lib, sym)
    assert hooked_seen == 51   # every hooked entry point cudart asks for (the primary context v1 ABIs at 7000 too)


def test_hooks_only_for_their_own_abi_and_unknown_names_untouched(tmp_path):
    requests = [list(k) for k in HOOKED] + [list(k) for k in NOT_HOOKED]
    results = _resolve_in_child(tmp_path, requests)
    for (name, version, flags), (r, status, lib, sym) in zip(requests, results):
        want = HOOKED.get((name, version, flags))
        if want:
            assert (r, status, lib, sym) == (0, 0, "libvgpu.so", want), (name, version, flags)
        elif (name, version) == ("cuMemAllocAsync", 11010):
            # older than the entry point: the driver's answer (VERSION_NOT_SUFFICIENT) stands
            assert (r, status, lib) == (500, 2, None)
        else:
            # forwarded untouched: whatever the driver says, never a hook
            assert lib in ("libcuda.so.1", None), (name, version, flags, lib, sym)


@pytest.mark.skipif(not CUDART.exists(), reason="CUDA toolkit's libcudart.so.13 not installed")
def test_real_libcudart_is_handed_the_right_hook_for_every_hooked_entry_point(tmp_path):
    """NVIDIA's runtime resolves ~440 entry points, then stops at a private export table
    simgpu does not provide; every hooked one it asked for must have got our wrapper."""
    env = shim_env(tmp_path, VGPU_LOG="debug")
    proc = run_python(f"""
        import ctypes
        rt = ctypes.CDLL("{CUDART}")
        n = ctypes.c_int(-1)
        print("cudaGetDeviceCount", rt.cudaGetDeviceCount(ctypes.byref(n)))
    """, env)
    asked = re.findall(r"cuGetProcAddress\((\w+), (\d+), (\d+)\) -> (hook (\w+)|driver)", proc.stderr)
    assert len(asked) > 400, proc.stderr[-2000:]
    hooked = {(n, int(v), int(f)): h for n, v, f, _, h in asked if h}
    for (n, v, f), h in hooked.items():
        assert HOOKED.get((n, v, f)) == h, (n, v, f, h)
    bases = {k[0] for k in HOOKED}
    for n, v, f, _, h in asked:
        if (n, int(v), int(f)) in HOOKED:
            assert h == HOOKED[(n, int(v), int(f))]
        else:
            assert not h or n not in bases
    assert len(hooked) == 51


@pytest.mark.skipif(not (CUDA_INCLUDE / "cudaTypedefs.h").exists(), reason="CUDA toolkit headers absent")
def test_every_hook_signature_equals_nvidias_pfn_typedef(tmp_path):
    """Compile-time: each hook's parameter list == PFN_<base>_v<version>[_ptsz]."""
    src = ROOT / "tests" / "programs" / "hook_signatures.c"
    subprocess.run(["cc", "-std=gnu11", "-Wall", "-Werror", "-c", "-I", str(CUDA_INCLUDE),
                    "-I", str(ROOT / "shim"), str(src), "-o", str(tmp_path / "sig.o")], check=True)
