"""simgpu's modules, linker, pointers, function attributes, occupancy and device limits,
driven through cuda-bindings in child processes (as in test_simgpu_cuda.py).

Images are real: PTX written here, compiled to cubins by NVIDIA's ptxas (the one Triton's
wheel ships, a test dependency) and packed into fatbins by the toolkit's fatbinary where
the CUDA toolkit is installed.
"""
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.simnode import make_sim_env, run_python

PTXAS_CANDIDATES = [Path("/usr/local/cuda/bin/ptxas")]
_triton = importlib.util.find_spec("triton")   # found, not imported: only its bundled ptxas is used
if _triton and _triton.origin:
    PTXAS_CANDIDATES.insert(0, Path(_triton.origin).parent / "backends" / "nvidia" / "bin" / "ptxas")
PTXAS = next((p for p in PTXAS_CANDIDATES if p.exists()), None)
FATBINARY = shutil.which("fatbinary") or ("/usr/local/cuda/bin/fatbinary"
                                          if Path("/usr/local/cuda/bin/fatbinary").exists() else None)
needs_ptxas = pytest.mark.skipif(PTXAS is None, reason="no ptxas (triton's wheel or the CUDA toolkit) installed")

SUCCESS, INVALID_VALUE, INVALID_IMAGE, NO_BINARY_FOR_GPU, INVALID_PTX = 0, 1, 200, 209, 218
UNSUPPORTED_PTX_VERSION, NOT_FOUND = 222, 500

PTX_SRC = """//
// two kernels: one that says how long it runs, one with a thread limit
//
.version 8.0
.target sm_{sm}
.address_size 64

.visible .entry {first}(
    .param .u64 {first}_param_0,
    .param .u32 {first}_param_1
)
{{
    .reg .pred  %p<2>;
    .reg .b32   %r<6>;
    .reg .f32   %f<3>;
    .reg .b64   %rd<5>;
    .shared .align 4 .b8 buf[1024];

    ld.param.u64    %rd1, [{first}_param_0];
    ld.param.u32    %r2, [{first}_param_1];
    mov.u32         %r3, %ctaid.x;
    mov.u32         %r4, %ntid.x;
    mov.u32         %r5, %tid.x;
    mad.lo.s32      %r1, %r3, %r4, %r5;
    setp.ge.s32     %p1, %r1, %r2;
    @%p1 bra        $L__BB0_2;
    cvta.to.global.u64  %rd2, %rd1;
    mul.wide.s32    %rd3, %r1, 4;
    add.s64         %rd4, %rd2, %rd3;
    mov.u32         %r5, buf;
    ld.shared.f32   %f1, [%r5];
    ld.global.f32   %f2, [%rd4];
    add.f32         %f2, %f1, %f2;
    st.global.f32   [%rd4], %f2;
    st.shared.f32   [%r5], %f2;
$L__BB0_2:
    ret;
}}

.visible .entry {other}()
.maxntid 128, 1, 1
{{
    ret;
}}
"""


def ptx(sm=86, other="limited", first="sim_300us"):
    return PTX_SRC.format(sm=sm, other=other, first=first)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """PTX, cubins for sm_80/86/90 and (with the toolkit) a fatbin, as files."""
    d = tmp_path_factory.mktemp("images")
    out = {}
    for sm in (80, 86, 90):
        (d / f"k{sm}.ptx").write_text(ptx(sm))
        out[f"ptx{sm}"] = d / f"k{sm}.ptx"
    if PTXAS:
        for sm in (80, 86, 90):
            subprocess.run([str(PTXAS), f"-arch=sm_{sm}", str(out[f"ptx{sm}"]), "-o", str(d / f"k{sm}.cubin")],
                           check=True)
            out[f"cubin{sm}"] = d / f"k{sm}.cubin"
        (d / "other.ptx").write_text(ptx(86, "second", "sim_100us"))
        subprocess.run([str(PTXAS), "-arch=sm_86", str(d / "other.ptx"), "-o", str(d / "other.cubin")], check=True)
        out["other_cubin"] = d / "other.cubin"
        if FATBINARY:
            subprocess.run([FATBINARY, f"--create={d / 'k.fatbin'}", f"--image3=kind=elf,sm=90,file={out['cubin90']}",
                            f"--image3=kind=elf,sm=80,file={out['cubin80']}",
                            f"--image3=kind=ptx,sm=86,file={out['ptx86']}"], check=True)
            out["fatbin"] = d / "k.fatbin"
    return out


PRELUDE = """
import ctypes, json, sys, time
from cuda.bindings import driver as cu
args = json.loads(sys.argv[1])

def ok(res):
    res = res if isinstance(res, tuple) else (res,)
    if res[0] != cu.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"CUDA call failed: {res[0]!r}")
    return None if len(res) == 1 else res[1] if len(res) == 2 else res[1:]

def rc(res):
    return int((res if isinstance(res, tuple) else (res,))[0])

ok(cu.cuInit(0))
ctx = ok(cu.cuDevicePrimaryCtxRetain(ok(cu.cuDeviceGet(0))))
ok(cu.cuCtxSetCurrent(ctx))

def data(path):
    return open(path, "rb").read() + (b"\\0" if path.endswith(".ptx") else b"")

def attrs(fn):
    A = cu.CUfunction_attribute
    return {"regs": ok(cu.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_NUM_REGS, fn)),
            "shared": ok(cu.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn)),
            "local": ok(cu.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn)),
            "threads": ok(cu.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn))}
"""


def child(code, env, **args):
    out = run_python(PRELUDE + code, env, args=[json.dumps({k: str(v) for k, v in args.items()})]).stdout
    return json.loads(out.splitlines()[-1])


def test_a_ptx_module_holds_its_kernels_and_no_others(sim_env, images):
    got = child("""
m = ok(cu.cuModuleLoadData(data(args["ptx"])))
fn = ok(cu.cuModuleGetFunction(m, b"sim_300us"))
lim = ok(cu.cuModuleGetFunction(m, b"limited"))
print(json.dumps({"missing": rc(cu.cuModuleGetFunction(m, b"nope")), "count": ok(cu.cuModuleGetFunctionCount(m)),
                  "name": ok(cu.cuFuncGetName(fn)).decode(), "sim": attrs(fn), "limited": attrs(lim)}))
""", sim_env, ptx=images["ptx86"])
    assert got["missing"] == NOT_FOUND and got["count"] == 2 and got["name"] == "sim_300us"
    # PTX is not compiled here: no registers or local memory are known; .maxntid is
    assert got["limited"]["threads"] == 128 and got["sim"]["threads"] == 1024
    assert got["sim"]["regs"] == 0


@needs_ptxas
def test_a_cubin_reports_what_ptxas_recorded(sim_env, images):
    """Registers, static shared memory and the thread limit come from the cubin's
    .nv.info and .nv.shared sections, as cuobjdump shows them."""
    got = child("""
m = ok(cu.cuModuleLoadData(data(args["cubin"])))
print(json.dumps({"sim": attrs(ok(cu.cuModuleGetFunction(m, b"sim_300us"))),
                  "limited": attrs(ok(cu.cuModuleGetFunction(m, b"limited"))),
                  "missing": rc(cu.cuModuleGetFunction(m, b"nope"))}))
""", sim_env, cubin=images["cubin86"])
    assert got["missing"] == NOT_FOUND
    assert got["sim"]["shared"] >= 1024 and 4 <= got["sim"]["regs"] <= 32 and got["sim"]["local"] == 0
    assert got["limited"]["threads"] == 128 and got["limited"]["shared"] == 0


@needs_ptxas
@pytest.mark.parametrize("profile,sm,expected", [
    ("a10", 80, SUCCESS),             # sm_80 SASS runs on 8.6
    ("a10", 90, NO_BINARY_FOR_GPU),   # newer major
    ("a100-40g", 86, NO_BINARY_FOR_GPU),   # newer minor
    ("h100-80g", 90, SUCCESS),
])
def test_a_cubin_loads_only_on_a_gpu_that_runs_its_sass(tmp_path, images, profile, sm, expected):
    env = make_sim_env(tmp_path / "node", profile=profile)
    got = child("""print(json.dumps(rc(cu.cuModuleLoadData(data(args["cubin"])))))""", env, cubin=images[f"cubin{sm}"])
    assert got == expected


def test_ptx_newer_than_the_device_or_the_driver_is_refused(sim_env):
    got = child("""
newer_target = args["ptx"].replace(".target sm_86", ".target sm_90").encode() + b"\\0"
newer_isa = args["ptx"].replace(".version 8.0", ".version 9.5").encode() + b"\\0"
print(json.dumps([rc(cu.cuModuleLoadData(newer_target)), rc(cu.cuModuleLoadData(newer_isa))]))
""", sim_env, ptx=ptx(86))
    assert got == [NO_BINARY_FOR_GPU, UNSUPPORTED_PTX_VERSION]


@pytest.mark.skipif(PTXAS is None or FATBINARY is None, reason="needs ptxas and the CUDA toolkit's fatbinary")
@pytest.mark.parametrize("profile,sass", [("a10", 80), ("a100-40g", 80), ("h100-80g", 90)])
def test_a_fatbin_gives_each_gpu_the_entry_the_driver_would_pick(tmp_path, images, profile, sass):
    """The fatbin holds SASS for sm_80 and sm_90 and PTX for sm_86: an A100 and an H100
    take their SASS; an A10 (8.6) takes the sm_80 SASS too (SASS that runs beats PTX)."""
    env = make_sim_env(tmp_path / "node", profile=profile)
    got = child("""
m = ok(cu.cuModuleLoadData(data(args["fatbin"])))
fn = ok(cu.cuModuleGetFunction(m, b"sim_300us"))
A = cu.CUfunction_attribute
print(json.dumps(dict(attrs(fn), binary=ok(cu.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_BINARY_VERSION, fn)))))
""", env, fatbin=images["fatbin"])
    assert got["binary"] == sass and got["shared"] >= 1024 and got["regs"] > 0


@needs_ptxas
def test_the_linker_joins_ptx_and_cubin_into_one_loadable_image(sim_env, images):
    """cuLinkCreate/AddData/AddFile/Complete: PTX and a cubin in, one cubin out that
    cuModuleLoadData loads with the kernels of both; the result is a CUDA ELF; the logs
    are written back through the option values."""
    got = child("""
J = cu.CUjit_option
info, err = bytearray(4096), bytearray(4096)
opts = [J.CU_JIT_INFO_LOG_BUFFER, J.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES, J.CU_JIT_ERROR_LOG_BUFFER,
        J.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, J.CU_JIT_LOG_VERBOSE]
vals = [info, 4096, err, 4096, 1]
state = ok(cu.cuLinkCreate(len(opts), opts, vals))
ok(cu.cuLinkAddData(state, cu.CUjitInputType.CU_JIT_INPUT_PTX, data(args["ptx"]), len(data(args["ptx"])),
                    b"first.ptx", 0, None, None))
ok(cu.cuLinkAddFile(state, cu.CUjitInputType.CU_JIT_INPUT_CUBIN, args["cubin"].encode(), 0, None, None))
dup = rc(cu.cuLinkAddData(state, cu.CUjitInputType.CU_JIT_INPUT_PTX, data(args["ptx"]), len(data(args["ptx"])),
                          b"again.ptx", 0, None, None))
err_after_dup = bytes(err).split(b"\\0")[0].decode()
cubin, size = ok(cu.cuLinkComplete(state))
image = ctypes.string_at(int(cubin), size)
m = ok(cu.cuModuleLoadData(image))
names = [ok(cu.cuFuncGetName(ok(cu.cuModuleGetFunction(m, n)))).decode() for n in (b"sim_300us", b"sim_100us", b"second")]
second = attrs(ok(cu.cuModuleGetFunction(m, b"second")))
ok(cu.cuLinkDestroy(state))
print(json.dumps({"elf": image[:4] == b"\\x7fELF", "names": names, "second": second, "dup": dup,
                  "dup_log": err_after_dup, "info": bytes(info).split(b"\\0")[0].decode(),
                  "count": ok(cu.cuModuleGetFunctionCount(m))}))
""", sim_env, ptx=images["ptx86"], cubin=images["other_cubin"])
    assert got["elf"] and got["names"] == ["sim_300us", "sim_100us", "second"] and got["count"] == 4
    assert got["second"]["threads"] == 128 and got["second"]["regs"] > 0   # carried over from ptxas's cubin
    assert got["dup"] == INVALID_IMAGE and "sim_300us defined twice" in got["dup_log"]
    assert "linked 4 kernel(s) from 2 input(s) for sm_86" in got["info"]


def test_the_linker_refuses_bad_ptx_and_says_why_in_the_error_log(sim_env):
    got = child("""
J = cu.CUjit_option
err = bytearray(1024)
state = ok(cu.cuLinkCreate(2, [J.CU_JIT_ERROR_LOG_BUFFER, J.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES], [err, 1024]))
bad = b"this is not ptx\\0"
r = rc(cu.cuLinkAddData(state, cu.CUjitInputType.CU_JIT_INPUT_PTX, bad, len(bad), b"bad.ptx", 0, None, None))
empty = rc(cu.cuLinkComplete(state))
print(json.dumps({"r": r, "log": bytes(err).split(b"\\0")[0].decode(), "empty": empty}))
""", sim_env)
    assert got["r"] == INVALID_PTX and "bad.ptx" in got["log"] and ".version" in got["log"]
    assert got["empty"] == INVALID_IMAGE   # nothing was added


def test_a_stand_in_image_still_runs_any_kernel_by_name(sim_env):
    """simgpu's own convention (the rest of the suite loads "image" and launches
    sim_<N>us) is kept for images that are not PTX, ELF or fatbin."""
    got = child("""
m = ok(cu.cuModuleLoadData(b"image\\0"))
print(json.dumps(rc(cu.cuModuleGetFunction(m, b"sim_5us")[0])))
""", sim_env)
    assert got == SUCCESS


@pytest.mark.parametrize("name", ["sim_20000us", "_ZN6cudapy8__main__11sim_20000usB2v1E", "sim_20000us_extra"])
def test_a_kernel_named_sim_n_us_runs_n_us_also_when_mangled(sim_env, name):
    """numba mangles kernel names; the identifier sim_<N>us inside the mangled name
    still sets the simulated time.  A longer identifier does not (5 us default).  Timed
    on the device's own timeline: events around the kernel, behind a 300 ms kernel that
    keeps the stream busy (the wall clock around a launch and a sync read 17 ms for the
    5 us kernel once, in a CI run of four workers on two cores)."""
    got = child("""
m = ok(cu.cuModuleLoadData(b"image\\0"))
fn, pad = (ok(cu.cuModuleGetFunction(m, n)) for n in (args["name"].encode(), b"sim_300000us"))
start, end = ok(cu.cuEventCreate(0)), ok(cu.cuEventCreate(0))
ok(cu.cuLaunchKernel(pad, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0))
ok(cu.cuEventRecord(start, 0))
ok(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0))
ok(cu.cuEventRecord(end, 0))
ok(cu.cuEventSynchronize(end))
print(json.dumps(ok(cu.cuEventElapsedTime(start, end))))
""", sim_env, name=name)
    if name.endswith("extra"):
        assert got < 0.1
    else:
        assert 19.9 <= got <= 20.1


def test_pointer_attributes_describe_each_kind_of_memory(sim_env):
    got = child("""
P = cu.CUpointer_attribute
dev = ok(cu.cuMemAlloc(1 << 20))
host = ok(cu.cuMemHostAlloc(4096, 0))
managed = ok(cu.cuMemAllocManaged(4096, 1))
def get(attr, p):
    return ok(cu.cuPointerGetAttribute(attr, p))
out = {
  "dev_type": int(get(P.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dev)),
  "dev_ptr": int(get(P.CU_POINTER_ATTRIBUTE_DEVICE_POINTER, int(dev) + 100)) - int(dev),
  "dev_range": [int(get(P.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, int(dev) + 100)) - int(dev),
                int(get(P.CU_POINTER_ATTRIBUTE_RANGE_SIZE, int(dev) + 100))],
  "dev_ordinal": get(P.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, dev),
  "dev_ctx": int(get(P.CU_POINTER_ATTRIBUTE_CONTEXT, dev)) == int(ctx),
  "dev_host_ptr": rc(cu.cuPointerGetAttribute(P.CU_POINTER_ATTRIBUTE_HOST_POINTER, dev)),
  "host_type": int(get(P.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, host)),
  "managed": [int(get(P.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, managed)), get(P.CU_POINTER_ATTRIBUTE_IS_MANAGED, managed)],
  "unknown": rc(cu.cuPointerGetAttribute(P.CU_POINTER_ATTRIBUTE_DEVICE_POINTER, 12345)),
  "freed": None,
}
ok(cu.cuMemFree(dev))
out["freed"] = rc(cu.cuPointerGetAttribute(P.CU_POINTER_ATTRIBUTE_DEVICE_POINTER, dev))
print(json.dumps(out))
""", sim_env)
    DEVICE, HOST = 2, 1
    assert got["dev_type"] == DEVICE and got["dev_ptr"] == 100 and got["dev_range"] == [0, 1 << 20]
    assert got["dev_ordinal"] == 0 and got["dev_ctx"] and got["dev_host_ptr"] == INVALID_VALUE
    assert got["host_type"] == HOST and got["managed"] == [DEVICE, True]
    assert got["unknown"] == INVALID_VALUE and got["freed"] == INVALID_VALUE


def test_pointer_attributes_of_an_unknown_address_are_defaults_not_errors(tmp_path):
    """cuPointerGetAttributes, as documented, never fails on a pointer it does not know."""
    env = make_sim_env(tmp_path / "node")
    got = run_python("""
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
ctx = ctypes.c_void_p()
assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
attrs = (ctypes.c_int * 3)(2, 3, 9)   # MEMORY_TYPE, DEVICE_POINTER, DEVICE_ORDINAL
mtype, dptr, ordinal = ctypes.c_uint(7), ctypes.c_ulonglong(7), ctypes.c_int(7)
data = (ctypes.c_void_p * 3)(ctypes.addressof(mtype), ctypes.addressof(dptr), ctypes.addressof(ordinal))
print(cuda.cuPointerGetAttributes(3, attrs, data, ctypes.c_ulonglong(12345)), mtype.value, dptr.value, ordinal.value)
""", env).stdout.split()
    assert got == ["0", "0", "0", "-2"]


def test_occupancy_follows_the_per_sm_limits(sim_env, images):
    """A kernel of no registers (PTX) on an A10 (1536 threads, 16 blocks and 100 KiB of
    shared memory per SM, 1 KiB reserved per block): 256 threads -> 6 blocks (threads);
    32 threads -> 16 (blocks); 48 KiB of dynamic shared memory -> 2 (shared memory);
    the opt-in limit is 99 KiB per block."""
    got = child("""
m = ok(cu.cuModuleLoadData(data(args["ptx"])))
fn = ok(cu.cuModuleGetFunction(m, b"sim_300us"))
occ = lambda block, smem: ok(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, block, smem))
A = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
grid, block = ok(cu.cuOccupancyMaxPotentialBlockSize(fn, None, 0, 0))
print(json.dumps({"256": occ(256, 0), "32": occ(32, 0), "smem": occ(128, 48 << 10),
                  "set_99k": rc(cu.cuFuncSetAttribute(fn, A, (99 << 10) - 1024)),
                  "set_100k": rc(cu.cuFuncSetAttribute(fn, A, 100 << 10)),
                  "potential": [grid, block]}))
""", sim_env, ptx=images["ptx86"])
    assert got["256"] == 6 and got["32"] == 16 and got["smem"] == 2
    # the PTX kernel declares 1 KiB of static shared memory that simgpu cannot see without
    # compiling, so 98 KiB dynamic fits and 100 KiB does not
    assert got["set_99k"] == SUCCESS and got["set_100k"] == INVALID_VALUE
    assert got["potential"][1] % 32 == 0 and got["potential"][0] == 72 * (1536 // got["potential"][1])


# Per-profile limits (node.c says where each figure comes from).
LIMITS = {
    #           SMs  cc   smem/SM  optin   thr/SM blk/SM  L2       clock    memclock  bus
    "a10":      (72, 86, 102400, 101376, 1536, 16, 6 << 20, 1695000, 6251000, 384),
    "a100-40g": (108, 80, 167936, 166912, 2048, 32, 40 << 20, 1410000, 1215000, 5120),
    "h100-80g": (132, 90, 233472, 232448, 2048, 32, 50 << 20, 1980000, 2619000, 5120),
    "h200":     (132, 90, 233472, 232448, 2048, 32, 50 << 20, 1980000, 3201000, 6144),
}


@pytest.mark.parametrize("profile", sorted(LIMITS))
def test_every_profile_reports_its_boards_limits(tmp_path, profile):
    env = make_sim_env(tmp_path / "node", profile=profile)
    got = child("""
D = cu.CUdevice_attribute
g = lambda a: ok(cu.cuDeviceGetAttribute(a, 0))
every = [rc(cu.cuDeviceGetAttribute(a, 0)) for a in D if 0 < int(a) < 148]
print(json.dumps({"limits": [g(D.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
  g(D.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) * 10 + g(D.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
  g(D.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR), g(D.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
  g(D.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR), g(D.CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR),
  g(D.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE), g(D.CU_DEVICE_ATTRIBUTE_CLOCK_RATE), g(D.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE),
  g(D.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)],
  "every_ok": all(r == 0 for r in every), "n": len(every),
  "past_the_end": rc(cu.cuDeviceGetAttribute(148, 0)),
  "cluster": g(D.CU_DEVICE_ATTRIBUTE_CLUSTER_LAUNCH),
  "pci": g(D.CU_DEVICE_ATTRIBUTE_GPU_PCI_DEVICE_ID) & 0xffff}))
""", env)
    assert got["limits"] == list(LIMITS[profile])
    assert got["every_ok"] and got["n"] >= 140 and got["past_the_end"] == INVALID_VALUE
    assert got["cluster"] == (LIMITS[profile][1] >= 90) and got["pci"] == 0x10DE
