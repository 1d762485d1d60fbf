"""simgpu's answers to the driver API and NVML entry points real clients look up that it
once lacked (the v1 ABIs of the primary-context calls and of cuCtxPush/PopCurrent, stream
capture queries, stream ids and devices, module and library globals, kernel node
parameters, 2D copies, prefetches, stream memory operations, cache configuration, peer
access, tensor maps; NVML's NvLink and fabric queries).

Each is checked three ways, in child processes bound to a fresh simgpu node (as in
test_simgpu_cuda.py): the library exports it (dlsym finds it), cuGetProcAddress hands out
that export for the versions and flags where cuda.h / cudaTypedefs.h of CUDA 13 place the
ABI, and a real call does what cuda.h / nvml.h document.
"""
import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers.simnode import make_sim_env, run_python
from tests.simgpu.test_simgpu_cuda import PRELUDE

SUCCESS, INVALID_VALUE, NOT_INITIALIZED, INVALID_DEVICE, INVALID_CONTEXT = 0, 1, 3, 101, 201
INVALID_HANDLE, NOT_FOUND, NOT_READY, NOT_SUPPORTED = 400, 500, 600, 801
STREAM_CAPTURE_UNSUPPORTED, STREAM_CAPTURE_IMPLICIT = 900, 906
PROC_SUCCESS, PROC_VERSION_NOT_SUFFICIENT = 0, 2
PER_THREAD = 2   # CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM

PTXAS_CANDIDATES = [Path("/usr/local/cuda/bin/ptxas")]
_triton = importlib.util.find_spec("triton")   # found, not imported: only its bundled ptxas is used
if _triton and _triton.origin:
    PTXAS_CANDIDATES.insert(0, Path(_triton.origin).parent / "backends" / "nvidia" / "bin" / "ptxas")
PTXAS = next((p for p in PTXAS_CANDIDATES if p.exists()), None)
needs_ptxas = pytest.mark.skipif(PTXAS is None, reason="no ptxas (triton's wheel or the CUDA toolkit) installed")

# A child's ctypes toolkit: libcuda.so.1 itself, a CUresult checker, a context.
CTYPES = """
import ctypes, json, os, sys, threading, time
from ctypes import (POINTER, byref, c_char, c_char_p, c_int, c_size_t, c_uint, c_uint16, c_uint32, c_uint64,
                    c_ulonglong, c_void_p)
cuda = ctypes.CDLL("libcuda.so.1")

def ok(r):
    if r != 0:
        raise SystemExit(f"CUDA call failed: {r}")

def context(ordinal=0):
    ok(cuda.cuInit(0))
    ctx = c_void_p()
    ok(cuda.cuDevicePrimaryCtxRetain(byref(ctx), ordinal))
    ok(cuda.cuCtxSetCurrent(ctx))
    return ctx

def alloc(n):
    p = c_uint64()
    ok(cuda.cuMemAlloc_v2(byref(p), c_size_t(n)))
    return p.value

def stream(flags=0):
    s = c_void_p()
    ok(cuda.cuStreamCreate(byref(s), flags))
    return s

def module(image):
    m = c_void_p()
    ok(cuda.cuModuleLoadData(byref(m), image))
    return m

def function(m, name):
    f = c_void_p()
    ok(cuda.cuModuleGetFunction(byref(f), m, name.encode()))
    return f
"""

# The same through NVIDIA's cuda-bindings (which resolve each call with cuGetProcAddress):
# test_simgpu_cuda's child toolkit, and a kernel of the stand-in image.
BINDINGS = PRELUDE + """
import threading

def kernel(name):
    return ok(cu.cuModuleGetFunction(ok(cu.cuModuleLoadData(b"stand-in image")), name.encode()))
"""


def run(code, env, args=()):
    return json.loads(run_python(code, env, args=args).stdout.splitlines()[-1])


# === exported, and handed out by cuGetProcAddress as the driver hands them out ===

# (name, cudaVersion, flags, the export cuGetProcAddress gives): the ABIs and the versions
# that introduced them are cudaTypedefs.h's (PFN_<name>_v<version>[_ptsz]); the exported
# name of each is the one cuda.h declares for it.
GAP_ABIS = [
    ("cuDevicePrimaryCtxRelease", 7000, 0, "cuDevicePrimaryCtxRelease"),
    ("cuDevicePrimaryCtxRelease", 11000, 0, "cuDevicePrimaryCtxRelease_v2"),
    ("cuDevicePrimaryCtxReset", 7000, 0, "cuDevicePrimaryCtxReset"),
    ("cuDevicePrimaryCtxReset", 10020, 0, "cuDevicePrimaryCtxReset"),
    ("cuDevicePrimaryCtxReset", 11000, 0, "cuDevicePrimaryCtxReset_v2"),
    ("cuStreamGetCaptureInfo", 10010, 0, "cuStreamGetCaptureInfo"),
    ("cuStreamGetCaptureInfo", 10010, PER_THREAD, "cuStreamGetCaptureInfo_ptsz"),
    ("cuStreamGetCaptureInfo", 11030, 0, "cuStreamGetCaptureInfo_v2"),
    ("cuStreamGetCaptureInfo", 11030, PER_THREAD, "cuStreamGetCaptureInfo_v2_ptsz"),
    ("cuStreamGetCaptureInfo", 12020, 0, "cuStreamGetCaptureInfo_v2"),
    ("cuStreamGetCaptureInfo", 12030, 0, "cuStreamGetCaptureInfo_v3"),
    ("cuStreamGetCaptureInfo", 13000, PER_THREAD, "cuStreamGetCaptureInfo_v3_ptsz"),
    ("cuThreadExchangeStreamCaptureMode", 10010, 0, "cuThreadExchangeStreamCaptureMode"),
    ("cuThreadExchangeStreamCaptureMode", 13000, PER_THREAD, "cuThreadExchangeStreamCaptureMode"),
    ("cuStreamGetId", 12000, 0, "cuStreamGetId"),
    ("cuStreamGetId", 12000, PER_THREAD, "cuStreamGetId_ptsz"),
    ("cuStreamGetDevice", 12080, 0, "cuStreamGetDevice"),
    ("cuStreamGetDevice", 13000, PER_THREAD, "cuStreamGetDevice_ptsz"),
    ("cuLibraryGetGlobal", 12000, 0, "cuLibraryGetGlobal"),
    ("cuModuleGetGlobal", 3020, 0, "cuModuleGetGlobal_v2"),
    ("cuModuleGetGlobal", 13000, 0, "cuModuleGetGlobal_v2"),
    ("cuTensorMapEncodeTiled", 12000, 0, "cuTensorMapEncodeTiled"),
    ("cuCtxPushCurrent", 2000, 0, "cuCtxPushCurrent"),
    ("cuCtxPushCurrent", 4000, 0, "cuCtxPushCurrent_v2"),
    ("cuCtxPopCurrent", 3020, 0, "cuCtxPopCurrent"),
    ("cuCtxPopCurrent", 4000, 0, "cuCtxPopCurrent_v2"),
    ("cuGraphInstantiate", 10000, 0, "cuGraphInstantiate"),
    ("cuGraphInstantiate", 11000, 0, "cuGraphInstantiate_v2"),
    ("cuGraphKernelNodeGetParams", 10000, 0, "cuGraphKernelNodeGetParams"),
    ("cuGraphKernelNodeGetParams", 12000, 0, "cuGraphKernelNodeGetParams_v2"),
    ("cuKernelGetLibrary", 12050, 0, "cuKernelGetLibrary"),
    ("cuMemPrefetchAsync", 8000, 0, "cuMemPrefetchAsync"),
    ("cuMemPrefetchAsync", 8000, PER_THREAD, "cuMemPrefetchAsync_ptsz"),
    ("cuMemPrefetchAsync", 12020, 0, "cuMemPrefetchAsync_v2"),
    ("cuMemPrefetchAsync", 12020, PER_THREAD, "cuMemPrefetchAsync_v2_ptsz"),
    ("cuStreamBatchMemOp", 8000, 0, "cuStreamBatchMemOp"),
    ("cuStreamBatchMemOp", 8000, PER_THREAD, "cuStreamBatchMemOp_ptsz"),
    ("cuStreamBatchMemOp", 11070, 0, "cuStreamBatchMemOp_v2"),
    ("cuStreamBatchMemOp", 11070, PER_THREAD, "cuStreamBatchMemOp_v2_ptsz"),
    ("cuStreamWaitValue32", 8000, 0, "cuStreamWaitValue32"),
    ("cuStreamWaitValue32", 8000, PER_THREAD, "cuStreamWaitValue32_ptsz"),
    ("cuStreamWaitValue32", 11070, 0, "cuStreamWaitValue32_v2"),
    ("cuStreamWaitValue32", 12000, PER_THREAD, "cuStreamWaitValue32_v2_ptsz"),
    ("cuStreamWriteValue32", 8000, 0, "cuStreamWriteValue32"),
    ("cuStreamWriteValue32", 8000, PER_THREAD, "cuStreamWriteValue32_ptsz"),
    ("cuStreamWriteValue32", 11070, 0, "cuStreamWriteValue32_v2"),
    ("cuStreamWriteValue32", 12000, PER_THREAD, "cuStreamWriteValue32_v2_ptsz"),
    ("cuMemcpy2DAsync", 3020, 0, "cuMemcpy2DAsync_v2"),
    ("cuMemcpy2DAsync", 7000, PER_THREAD, "cuMemcpy2DAsync_v2_ptsz"),
    ("cuCtxGetCacheConfig", 3020, 0, "cuCtxGetCacheConfig"),
    ("cuCtxSetCacheConfig", 3020, 0, "cuCtxSetCacheConfig"),
    ("cuDeviceCanAccessPeer", 4000, 0, "cuDeviceCanAccessPeer"),
]
NVML_GAPS = ["nvmlDeviceGetNvLinkRemoteDeviceType", "nvmlDeviceGetNvLinkRemotePciInfo_v2",
             "nvmlDeviceGetGpuFabricInfoV"]

RESOLVE = CTYPES + """
nvml = ctypes.CDLL("libnvidia-ml.so.1")
gpa = cuda.cuGetProcAddress_v2
gpa.argtypes = [c_char_p, POINTER(c_void_p), c_int, c_uint64, POINTER(c_int)]
requests, nvml_names = json.loads(sys.argv[1])
missing = [n for n in {r[3] for r in requests} if not hasattr(cuda, n)] + \\
          [n for n in nvml_names if not hasattr(nvml, n)]
symbol_at = {ctypes.cast(getattr(cuda, r[3]), c_void_p).value: r[3] for r in requests if hasattr(cuda, r[3])}
out = []
for name, version, flags, _ in requests:
    p, status = c_void_p(), c_int(-1)
    res = gpa(name.encode(), byref(p), version, flags, byref(status))
    out.append([res, status.value, symbol_at.get(p.value, p.value and "something else")])
print(json.dumps([sorted(missing), out]))
"""


def test_every_gap_is_exported_and_resolved_to_its_abi(sim_env):
    missing, answers = run(RESOLVE, sim_env, args=(json.dumps([GAP_ABIS, NVML_GAPS]),))
    assert missing == []
    assert {(n, v, f): a for (n, v, f, _), a in zip(GAP_ABIS, answers)} == \
           {(n, v, f): [SUCCESS, PROC_SUCCESS, sym] for n, v, f, sym in GAP_ABIS}


def test_the_abis_are_not_handed_out_before_their_version(sim_env):
    too_old = [("cuStreamGetCaptureInfo", 10000, 0, "cuStreamGetCaptureInfo"),
               ("cuStreamGetId", 11080, PER_THREAD, "cuStreamGetId"),
               ("cuStreamGetDevice", 12070, 0, "cuStreamGetDevice"),
               ("cuKernelGetLibrary", 12040, 0, "cuKernelGetLibrary"),
               ("cuMemPrefetchAsync", 7050, 0, "cuMemPrefetchAsync")]
    _, answers = run(RESOLVE, sim_env, args=(json.dumps([too_old, []]),))
    assert answers == [[500, PROC_VERSION_NOT_SUFFICIENT, None]] * len(too_old)


def test_cuda_bindings_resolve_every_gap_to_an_implemented_abi(tmp_path):
    """NVIDIA's cuda-bindings ask cuGetProcAddress for the newest ABIs: none is a stub."""
    env = make_sim_env(tmp_path / "node", SIMGPU_LOG="1")
    proc = run_python(BINDINGS + """
context()
s = ok(cu.cuStreamCreate(0))
for call in (lambda: cu.cuStreamGetCaptureInfo(s), lambda: cu.cuStreamGetId(s), lambda: cu.cuStreamGetDevice(s),
             lambda: cu.cuCtxGetCacheConfig(), lambda: cu.cuDeviceCanAccessPeer(0, 0),
             lambda: cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL),
             lambda: cu.cuStreamWriteValue32(s, 0, 0, 0), lambda: cu.cuStreamWaitValue32(s, 0, 0, 0),
             lambda: cu.cuMemcpy2DAsync(cu.CUDA_MEMCPY2D(), s), lambda: cu.cuKernelGetLibrary(0),
             lambda: cu.cuModuleGetGlobal(0, b"x"), lambda: cu.cuLibraryGetGlobal(0, b"x"),
             lambda: cu.cuGraphKernelNodeGetParams(0)):
    call()
print("done")
""", env)
    asked = re.findall(r"cuGetProcAddress\((\w+), \d+, \d+\) -> v\d+.*", proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if "cuGetProcAddress(" in line]
    gaps = {n for n, *_ in GAP_ABIS}
    assert "cuStreamGetCaptureInfo" in asked
    assert [line for line in lines if "not implemented" in line
            and re.search(r"cuGetProcAddress\((\w+),", line)[1] in gaps] == []


# === the primary context, and the context stack, through their v1 ABIs ===

def test_the_v1_primary_context_calls_behave_as_the_v2_ones(sim_env):
    """cuda.h (one text for both ABIs): release drops a reference and resets the context at
    the last one; releasing one not retained is CUDA_ERROR_INVALID_CONTEXT; reset frees its
    allocations and keeps the context; a bad ordinal is CUDA_ERROR_INVALID_DEVICE."""
    r = run(CTYPES + """
ctx = context()
state = lambda: (lambda f, a: (cuda.cuDevicePrimaryCtxGetState(0, byref(f), byref(a)), a.value)[1])(c_uint(), c_int())
free = lambda: (lambda f, t: (ok(cuda.cuMemGetInfo_v2(byref(f), byref(t))), f.value)[1])(c_size_t(), c_size_t())
before = free()
alloc(64 << 20)
held = before - free()
reset = cuda.cuDevicePrimaryCtxReset(0)
after_reset = [state(), before - free()]
again = c_void_p()
ok(cuda.cuDevicePrimaryCtxRetain(byref(again), 0))
releases = [cuda.cuDevicePrimaryCtxRelease(0), state(), cuda.cuDevicePrimaryCtxRelease(0), state(),
            cuda.cuDevicePrimaryCtxRelease(0)]
print(json.dumps([held, reset, after_reset, again.value == ctx.value, releases,
                  cuda.cuDevicePrimaryCtxRelease(7), cuda.cuDevicePrimaryCtxReset(7)]))
""", sim_env)
    assert r == [64 << 20, SUCCESS, [0, 0], True, [SUCCESS, 1, SUCCESS, 0, INVALID_CONTEXT],
                 INVALID_DEVICE, INVALID_DEVICE]


def test_the_v1_push_and_pop_move_the_context_stack(sim_env):
    r = run(CTYPES + """
ctx = context()
ok(cuda.cuCtxSetCurrent(None))
cur = lambda: (lambda c: (ok(cuda.cuCtxGetCurrent(byref(c))), c.value)[1])(c_void_p())
pushed = cuda.cuCtxPushCurrent(ctx)
on_top = cur() == ctx.value
popped = c_void_p()
pop = cuda.cuCtxPopCurrent(byref(popped))
print(json.dumps([pushed, on_top, pop, popped.value == ctx.value, cur(), cuda.cuCtxPopCurrent(None),
                  cuda.cuCtxPushCurrent(c_void_p(0x1234))]))
""", sim_env)
    assert r == [SUCCESS, True, SUCCESS, True, None, INVALID_CONTEXT, INVALID_CONTEXT]


# === cache configuration, peer access ===

def test_the_context_cache_configuration_round_trips(sim_env):
    """cuCtxSetCacheConfig / cuCtxGetCacheConfig: the current context's preference
    (PREFER_NONE by default), values 0-3; no context: CUDA_ERROR_INVALID_CONTEXT."""
    r = run(BINDINGS + """
C = cu.CUfunc_cache
ok(cu.cuInit(0))
no_ctx = [rc(cu.cuCtxGetCacheConfig()), rc(cu.cuCtxSetCacheConfig(C.CU_FUNC_CACHE_PREFER_L1))]
context()
first = int(ok(cu.cuCtxGetCacheConfig()))
seen = []
for c in (C.CU_FUNC_CACHE_PREFER_SHARED, C.CU_FUNC_CACHE_PREFER_L1, C.CU_FUNC_CACHE_PREFER_EQUAL):
    ok(cu.cuCtxSetCacheConfig(c))
    seen.append(int(ok(cu.cuCtxGetCacheConfig())))
lib = ctypes.CDLL("libcuda.so.1")
bad = lib.cuCtxSetCacheConfig(4)
kept = int(ok(cu.cuCtxGetCacheConfig()))
ok(cu.cuDevicePrimaryCtxReset(ok(cu.cuDeviceGet(0))))
print(json.dumps([no_ctx, first, seen, bad, kept, lib.cuCtxGetCacheConfig(None), int(ok(cu.cuCtxGetCacheConfig()))]))
""", sim_env)
    assert r == [[INVALID_CONTEXT, INVALID_CONTEXT], 0, [1, 2, 3], INVALID_VALUE, 3, INVALID_VALUE, 0]


def test_no_device_can_access_a_peer(tmp_path):
    """cuDeviceCanAccessPeer: simgpu models no peer access, so 0 for two devices and for a
    device and itself; a bad ordinal is CUDA_ERROR_INVALID_DEVICE."""
    r = run(BINDINGS + """
ok(cu.cuInit(0))
d0, d1 = ok(cu.cuDeviceGet(0)), ok(cu.cuDeviceGet(1))
lib = ctypes.CDLL("libcuda.so.1")
print(json.dumps([ok(cu.cuDeviceCanAccessPeer(d0, d1)), ok(cu.cuDeviceCanAccessPeer(d1, d0)),
                  ok(cu.cuDeviceCanAccessPeer(d0, d0)), lib.cuDeviceCanAccessPeer(ctypes.byref(ctypes.c_int()), 0, 2),
                  lib.cuDeviceCanAccessPeer(None, 0, 1)]))
""", make_sim_env(tmp_path / "node", devices=2))
    assert r == [0, 0, 0, INVALID_DEVICE, INVALID_VALUE]


# === streams: ids, devices ===

def test_stream_ids_are_unique_and_stable_and_streams_know_their_device(tmp_path):
    r = run(BINDINGS + """
context(0)
a, b = ok(cu.cuStreamCreate(0)), ok(cu.cuStreamCreate(0))
ids = [int(ok(cu.cuStreamGetId(a))), int(ok(cu.cuStreamGetId(b))), int(ok(cu.cuStreamGetId(a)))]
legacy = [int(ok(cu.cuStreamGetId(cu.CUstream(0)))), int(ok(cu.cuStreamGetId(cu.CU_STREAM_LEGACY))),
          int(ok(cu.cuStreamGetId(cu.CUstream(0))))]
per_thread = int(ok(cu.cuStreamGetId(cu.CU_STREAM_PER_THREAD)))
ok(cu.cuStreamDestroy(a))
c = ok(cu.cuStreamCreate(0))          # may take a's handle: never its id
reused = int(c) == int(a)
new_id = int(ok(cu.cuStreamGetId(c)))
context(1)
on1 = ok(cu.cuStreamCreate(0))
devices = [int(ok(cu.cuStreamGetDevice(b))), int(ok(cu.cuStreamGetDevice(on1))),
           int(ok(cu.cuStreamGetDevice(cu.CUstream(0))))]
lib = ctypes.CDLL("libcuda.so.1")
errors = [lib.cuStreamGetId(ctypes.c_void_p(int(b)), None), lib.cuStreamGetDevice(ctypes.c_void_p(0x7), None)]
ok(cu.cuCtxSetCurrent(cu.CUcontext(0)))
errors.append(lib.cuStreamGetDevice(None, ctypes.byref(ctypes.c_int())))
print(json.dumps([ids, legacy, per_thread, new_id, devices, errors]))
""", make_sim_env(tmp_path / "node", devices=2))
    ids, legacy, per_thread, new_id, devices, errors = r
    assert ids[0] != ids[1] and ids[0] == ids[2]
    assert legacy[0] == legacy[1] == legacy[2] and legacy[0] not in ids
    assert per_thread not in ids + [legacy[0]]
    assert new_id not in ids + [legacy[0], per_thread]
    assert devices == [0, 1, 1]
    assert errors == [INVALID_VALUE, INVALID_HANDLE, INVALID_CONTEXT]


def test_the_per_thread_stream_entry_points_name_the_threads_stream(sim_env):
    """_ptsz: NULL names the calling thread's default stream, not the legacy stream."""
    r = run(CTYPES + """
context()
ident = lambda fn, h: (lambda v: (ok(getattr(cuda, fn)(h, byref(v))), v.value)[1])(c_ulonglong())
print(json.dumps([ident("cuStreamGetId", None), ident("cuStreamGetId_ptsz", None),
                  ident("cuStreamGetId", c_void_p(2)), ident("cuStreamGetId", c_void_p(1))]))
""", sim_env)
    legacy, per_thread, per_thread_handle, legacy_handle = r
    assert per_thread == per_thread_handle and legacy == legacy_handle and legacy != per_thread


# === stream capture ===

def test_capture_info_says_whether_a_stream_captures_and_into_what(sim_env):
    """cuStreamGetCaptureInfo (_v3, as the bindings resolve it): NONE for a stream not
    capturing; while capturing ACTIVE, a sequence id unique in the process, the graph being
    captured (the one cuStreamEndCapture returns), and the node the next one depends on."""
    r = run(BINDINGS + """
context()
S = cu.CUstreamCaptureStatus
s = ok(cu.cuStreamCreate(0))
idle = ok(cu.cuStreamGetCaptureInfo(s))
ok(cu.cuStreamBeginCapture(s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
status, cid, graph, deps, edges, n = ok(cu.cuStreamGetCaptureInfo(s))
start = [status == S.CU_STREAM_CAPTURE_STATUS_ACTIVE, int(cid) > 0, int(n)]
ok(cu.cuLaunchKernel(kernel("sim_10us"), 1, 1, 1, 1, 1, 1, 0, s, 0, 0))
_, cid2, graph2, deps2, edges2, n2 = ok(cu.cuStreamGetCaptureInfo(s))
nodes = ok(cu.cuGraphGetNodes(graph2, 4))[0]
after_launch = [int(cid2) == int(cid), int(graph2) == int(graph), int(n2), int(deps2[0]) == int(nodes[0]),
                [edges2[0].from_port, edges2[0].to_port, edges2[0].type]]
ended = ok(cu.cuStreamEndCapture(s))
after = ok(cu.cuStreamGetCaptureInfo(s))[0] == S.CU_STREAM_CAPTURE_STATUS_NONE
ok(cu.cuStreamBeginCapture(s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
cid3 = int(ok(cu.cuStreamGetCaptureInfo(s))[1])
print(json.dumps([idle[0] == S.CU_STREAM_CAPTURE_STATUS_NONE, start, after_launch, int(ended) == int(graph),
                  after, cid3 not in (0, int(cid))]))
""", sim_env)
    assert r == [True, [True, True, 0], [True, True, 1, True, [0, 0, 0]], True, True, True]


CAPTURE_ABIS = CTYPES + """
context()
blocking, nonblocking = stream(0), stream(1)
status, cid = c_int(-1), c_uint64()
def v1(name, h):
    r = getattr(cuda, name)(h, byref(status), byref(cid))
    return [r, status.value]
graph, deps, n = c_void_p(), c_void_p(), c_size_t(7)
def v2(name, h):
    r = getattr(cuda, name)(h, byref(status), byref(cid), byref(graph), byref(deps), byref(n))
    return [r, status.value, n.value]
out = {"idle": [v1("cuStreamGetCaptureInfo", blocking), v2("cuStreamGetCaptureInfo_v2", blocking)]}
ok(cuda.cuStreamBeginCapture_v2(nonblocking, 0))
out["nonblocking capturing, legacy asked"] = v1("cuStreamGetCaptureInfo", None)
ok(cuda.cuStreamBeginCapture_v2(blocking, 0))
out["blocking capturing, legacy asked"] = [v1("cuStreamGetCaptureInfo", None), v1("cuStreamGetCaptureInfo", c_void_p(1)),
                                            v2("cuStreamGetCaptureInfo_v2", None)]
out["per-thread stream asked"] = v1("cuStreamGetCaptureInfo_ptsz", None)
out["capturing"] = [v1("cuStreamGetCaptureInfo", blocking), v2("cuStreamGetCaptureInfo_v2_ptsz", blocking)]
edges = c_void_p()
out["errors"] = [cuda.cuStreamGetCaptureInfo(blocking, None, None),
                 cuda.cuStreamGetCaptureInfo_v3(blocking, byref(status), None, None, None, byref(edges), None),
                 cuda.cuStreamGetCaptureInfo_v3_ptsz(c_void_p(0x99), byref(status), None, None, None, None, None)]
print(json.dumps(out))
"""


def test_every_capture_info_abi_answers_and_the_legacy_stream_is_refused_while_a_blocking_stream_captures(sim_env):
    """The 10.1 and 11.3 ABIs give status (and dependencies) as _v3 does; "If called on
    CU_STREAM_LEGACY (the null stream) while a stream not created with CU_STREAM_NON_BLOCKING
    is capturing, returns CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"; captureStatus_out is required;
    edgeData_out needs dependencies_out."""
    r = run(CAPTURE_ABIS, sim_env)
    assert r == {"idle": [[SUCCESS, 0], [SUCCESS, 0, 0]],
                 "nonblocking capturing, legacy asked": [SUCCESS, 0],
                 "blocking capturing, legacy asked": [[STREAM_CAPTURE_IMPLICIT, 0]] * 2 + [[STREAM_CAPTURE_IMPLICIT, 0, 0]],
                 "per-thread stream asked": [SUCCESS, 0],
                 "capturing": [[SUCCESS, 1], [SUCCESS, 1, 0]],
                 "errors": [INVALID_VALUE, INVALID_VALUE, INVALID_HANDLE]}


def test_the_capture_mode_is_exchanged_per_thread(sim_env):
    """cuThreadExchangeStreamCaptureMode: sets the calling thread's mode and gives back the
    previous one (GLOBAL by default); another thread keeps its own."""
    r = run(CTYPES + """
before_init = cuda.cuThreadExchangeStreamCaptureMode(byref(c_int(0)))
ok(cuda.cuInit(0))
mode = c_int(2)                                     # RELAXED
first = [cuda.cuThreadExchangeStreamCaptureMode(byref(mode)), mode.value]
other = []
def elsewhere():
    m = c_int(1)
    other.append([cuda.cuThreadExchangeStreamCaptureMode(byref(m)), m.value])
t = threading.Thread(target=elsewhere)
t.start(); t.join()
mode.value = 1
second = [cuda.cuThreadExchangeStreamCaptureMode(byref(mode)), mode.value]
print(json.dumps([before_init, first, other[0], second, cuda.cuThreadExchangeStreamCaptureMode(byref(c_int(3))),
                  cuda.cuThreadExchangeStreamCaptureMode(None)]))
""", sim_env)
    assert r == [NOT_INITIALIZED, [SUCCESS, 0], [SUCCESS, 0], [SUCCESS, 2], INVALID_VALUE, INVALID_VALUE]


# === module and library globals ===

GLOBALS_PTX = """
.version 8.0
.target sm_86
.address_size 64

.visible .global .align 4 .b32 counter;
.visible .global .align 8 .u64 table[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
.visible .const .align 4 .f32 coeff[4] = {0f3F800000, 0f40000000, 0f40400000, 0f40800000};
.global .align 4 .b32 hidden = 7;

.visible .entry sim_300us(
    .param .u64 out,
    .param .u32 n,
    .param .align 8 .b8 blob[24],
    .param .u16 tag
)
{
    .reg .b64 %rd<3>;
    .reg .b32 %r<4>;
    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [n];
    ld.global.u32 %r2, [counter];
    add.u32 %r1, %r1, %r2;
    ld.const.u32 %r3, [coeff];
    add.u32 %r1, %r1, %r3;
    ld.global.u32 %r2, [hidden];
    add.u32 %r1, %r1, %r2;
    ld.global.u64 %rd2, [table];
    st.global.u32 [%rd1], %r1;
    st.global.u64 [%rd1+8], %rd2;
    ret;
}
"""


@pytest.fixture(scope="module")
def globals_cubin(tmp_path_factory):
    if PTXAS is None:
        pytest.skip("no ptxas (triton's wheel or the CUDA toolkit) installed")
    d = tmp_path_factory.mktemp("globals")
    (d / "g.ptx").write_text(GLOBALS_PTX)
    subprocess.run([str(PTXAS), "-arch=sm_86", str(d / "g.ptx"), "-o", str(d / "g.cubin")], check=True)
    return d / "g.cubin"


def test_module_and_library_globals_have_their_symbols_size_and_initial_values(sim_env, globals_cubin):
    """cuModuleGetGlobal_v2 / cuLibraryGetGlobal: the variable's address and its ELF
    symbol's st_size; its memory holds the image's initial bytes (zeros for .nv.global) and
    round-trips copies; a name that is no variable is CUDA_ERROR_NOT_FOUND."""
    r = run(BINDINGS + """
import struct
context()
image = open(sys.argv[1], "rb").read()
mod = ok(cu.cuModuleLoadData(image))
def read(ptr, n):
    buf = bytearray(n)
    ok(cu.cuMemcpyDtoH(buf, ptr, n))
    return bytes(buf)
out = {}
for name in ("counter", "table", "coeff", "hidden"):
    ptr, size = ok(cu.cuModuleGetGlobal(mod, name.encode()))
    out[name] = [int(size), read(ptr, int(size)).hex()]
ptr, size = ok(cu.cuModuleGetGlobal(mod, b"counter"))
ok(cu.cuMemcpyHtoD(ptr, struct.pack("<I", 41), 4))
out["written"] = struct.unpack("<I", read(ptr, 4))[0]
out["ptr attrs"] = [int(ok(cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr))),
                    rc(cu.cuMemFree(ptr))]
out["missing"] = [rc(cu.cuModuleGetGlobal(mod, b"nothing")), rc(cu.cuModuleGetGlobal(mod, b"sim_300us"))]
lib = ok(cu.cuLibraryLoadData(image, None, None, 0, None, None, 0))
lptr, lsize = ok(cu.cuLibraryGetGlobal(lib, b"table"))
out["library"] = [int(lsize), read(lptr, 16).hex(), rc(cu.cuLibraryGetGlobal(lib, b"nothing"))]
raw = ctypes.CDLL("libcuda.so.1")
only_size = ctypes.c_size_t()
out["one of the two"] = [raw.cuModuleGetGlobal_v2(None, ctypes.byref(only_size), ctypes.c_void_p(int(mod)), b"coeff"),
                         only_size.value,
                         raw.cuModuleGetGlobal_v2(None, None, ctypes.c_void_p(int(mod)), b"coeff"),
                         raw.cuModuleGetGlobal_v2(ctypes.byref(ctypes.c_uint64()), None, ctypes.c_void_p(0x10), b"coeff"),
                         raw.cuLibraryGetGlobal(ctypes.byref(ctypes.c_uint64()), None, ctypes.c_void_p(0x10), b"x")]
ok(cu.cuModuleUnload(mod))
out["after unload"] = rc(cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr))
stand_in = ok(cu.cuModuleLoadData(b"stand-in image"))
out["stand-in"] = rc(cu.cuModuleGetGlobal(stand_in, b"counter"))
print(json.dumps(out))
""", sim_env, args=(str(globals_cubin),))
    table = b"".join(i.to_bytes(8, "little") for i in range(1, 11)).hex()
    floats = bytes.fromhex("0000803f000000400000404000008040").hex()
    assert r == {"counter": [4, "00000000"], "table": [80, table], "coeff": [16, floats], "hidden": [4, "07000000"],
                 "written": 41, "ptr attrs": [2, INVALID_VALUE],          # CU_MEMORYTYPE_DEVICE; not cuMemAlloc's
                 "missing": [NOT_FOUND, NOT_FOUND],
                 "library": [80, table[:32], NOT_FOUND],
                 "one of the two": [SUCCESS, 16, INVALID_VALUE, INVALID_HANDLE, INVALID_HANDLE],
                 "after unload": INVALID_VALUE, "stand-in": NOT_FOUND}


def test_library_globals_need_a_current_context(sim_env, globals_cubin):
    r = run(BINDINGS + """
context()
lib = ok(cu.cuLibraryLoadData(open(sys.argv[1], "rb").read(), None, None, 0, None, None, 0))
ok(cu.cuCtxSetCurrent(cu.CUcontext(0)))
print(json.dumps(rc(cu.cuLibraryGetGlobal(lib, b"table"))))
""", sim_env, args=(str(globals_cubin),))
    assert r == INVALID_CONTEXT


def test_a_kernel_knows_its_library(sim_env):
    """cuKernelGetLibrary: the library a kernel came from; a function of a module loaded with
    cuModuleLoadData is no library's kernel."""
    r = run(BINDINGS + """
context()
lib = ok(cu.cuLibraryLoadData(b"stand-in image", None, None, 0, None, None, 0))
k = ok(cu.cuLibraryGetKernel(lib, b"sim_5us"))
raw = ctypes.CDLL("libcuda.so.1")
print(json.dumps([int(ok(cu.cuKernelGetLibrary(k))) == int(lib),
                  raw.cuKernelGetLibrary(ctypes.byref(ctypes.c_void_p()), ctypes.c_void_p(int(kernel("sim_5us")))),
                  raw.cuKernelGetLibrary(None, ctypes.c_void_p(int(k))),
                  raw.cuKernelGetLibrary(ctypes.byref(ctypes.c_void_p()), ctypes.c_void_p(0x40))]))
""", sim_env)
    assert r == [True, INVALID_HANDLE, INVALID_VALUE, INVALID_HANDLE]


# === graphs: the v1 instantiate, kernel node parameters ===

NODE_PARAMS = CTYPES + """
class Params(ctypes.Structure):      # CUDA_KERNEL_NODE_PARAMS (_v2); _v1 stops before kern
    _fields_ = [("func", c_void_p), ("grid", c_uint * 3), ("block", c_uint * 3), ("shared", c_uint),
                ("kernelParams", POINTER(c_void_p)), ("extra", POINTER(c_void_p)), ("kern", c_void_p),
                ("ctx", c_void_p)]
class ParamsV1(ctypes.Structure):
    _fields_ = Params._fields_[:6]

context()
image = open(sys.argv[1], "rb").read() if len(sys.argv) > 1 else GLOBALS_PTX.encode()
fn = function(module(image), "sim_300us")
out_arg, n_arg = c_uint64(0xdead0000), c_uint32(1234)
blob, tag = (c_char * 24)(*b"abcdefghijklmnopqrstuvwx"), c_uint16(77)
args = (c_void_p * 4)(ctypes.addressof(out_arg), ctypes.addressof(n_arg), ctypes.addressof(blob), ctypes.addressof(tag))
graph = c_void_p()
ok(cuda.cuGraphCreate(byref(graph), 0))
node = c_void_p()
as_array = lambda a: ctypes.cast(a, POINTER(c_void_p))
p = Params(fn, (c_uint * 3)(4, 2, 1), (c_uint * 3)(32, 1, 1), 256, as_array(args), None, None, None)
ok(cuda.cuGraphAddKernelNode_v2(byref(node), graph, None, 0, byref(p)))
out_arg.value, n_arg.value, tag.value = 0, 0, 0          # the node owns copies of the arguments
blob[0] = b"Z"
args[0] = None

def read(kp):
    return [ctypes.cast(kp[0], POINTER(c_uint64))[0], ctypes.cast(kp[1], POINTER(c_uint32))[0],
            ctypes.string_at(kp[2], 24).decode(), ctypes.cast(kp[3], POINTER(c_uint16))[0]]

got, got1 = Params(), ParamsV1()
ok(cuda.cuGraphKernelNodeGetParams_v2(node, byref(got)))
ok(cuda.cuGraphKernelNodeGetParams(node, byref(got1)))
added = [got.func == fn.value, list(got.grid), list(got.block), got.shared, read(got.kernelParams),
         bool(got.extra), got1.func == fn.value, read(got1.kernelParams)]

# a launch captured from a stream: its parameters too
s = stream()
ok(cuda.cuStreamBeginCapture_v2(s, 0))
n_arg.value, out_arg.value, tag.value = 99, 0xbeef, 5
args[0] = ctypes.addressof(out_arg)
ok(cuda.cuLaunchKernel(fn, 3, 1, 1, 64, 1, 1, 128, s, args, None))
captured = c_void_p()
ok(cuda.cuStreamEndCapture(s, byref(captured)))
nodes, count = (c_void_p * 2)(), c_size_t(2)
ok(cuda.cuGraphGetNodes(captured, nodes, byref(count)))
n_arg.value = 0
ok(cuda.cuGraphKernelNodeGetParams_v2(c_void_p(nodes[0]), byref(got)))
launched = [list(got.grid), list(got.block), got.shared, read(got.kernelParams)]

# an extra buffer: copied too
buf = (c_char * 16)(*b"0123456789abcdef")
size = c_size_t(16)
extra = (c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 0)
p2 = Params(fn, (c_uint * 3)(1, 1, 1), (c_uint * 3)(1, 1, 1), 0, None, as_array(extra), None, None)
node2 = c_void_p()
ok(cuda.cuGraphAddKernelNode_v2(byref(node2), graph, None, 0, byref(p2)))
buf[0] = b"X"
ok(cuda.cuGraphKernelNodeGetParams_v2(node2, byref(got)))
e = got.extra
from_extra = [bool(got.kernelParams), e[0], ctypes.string_at(e[1], 16).decode(), ctypes.cast(e[3], POINTER(c_size_t))[0], e[4]]

# not a kernel node, no node, no output
class AllocParams(ctypes.Structure):   # CUDA_MEM_ALLOC_NODE_PARAMS: CUmemPoolProps is 88 bytes
    _fields_ = [("props", ctypes.c_ubyte * 88), ("accessDescs", c_void_p), ("accessDescCount", c_size_t),
                ("bytesize", c_size_t), ("dptr", c_uint64)]
ap = AllocParams((ctypes.c_ubyte * 88)(1, 0, 0, 0, 0, 0, 0, 0, 1), None, 0, 1 << 20, 0)   # PINNED, on device 0
mem_node = c_void_p()
ok(cuda.cuGraphAddMemAllocNode(byref(mem_node), graph, None, 0, byref(ap)))
errors = [cuda.cuGraphKernelNodeGetParams_v2(mem_node, byref(got)), cuda.cuGraphKernelNodeGetParams(c_void_p(0x10), byref(got1)),
          cuda.cuGraphKernelNodeGetParams_v2(node, None)]
print(json.dumps([added, launched, from_extra, errors]))
"""


def _node_params_expected():
    blob = "abcdefghijklmnopqrstuvwx"
    return [[True, [4, 2, 1], [32, 1, 1], 256, [0xdead0000, 1234, blob, 77], False, True,
             [0xdead0000, 1234, blob, 77]],
            [[3, 1, 1], [64, 1, 1], 128, [0xbeef, 99, "Zbcdefghijklmnopqrstuvwx", 5]],
            [False, 1, "0123456789abcdef", 16, None],
            [INVALID_VALUE, INVALID_VALUE, INVALID_VALUE]]


def test_kernel_nodes_keep_their_parameters_read_from_ptx(sim_env):
    """cuGraphKernelNodeGetParams (both ABIs): the node's dimensions, shared memory and
    function, and "the argument values ... are owned by the node" (sized from the PTX .param
    list), for added and for captured kernels; an extra buffer is kept as well."""
    r = run(NODE_PARAMS.replace("GLOBALS_PTX.encode()", repr(GLOBALS_PTX.encode())), sim_env)
    assert r == _node_params_expected()


def test_kernel_nodes_keep_their_parameters_read_from_a_cubin(sim_env, globals_cubin):
    """The same, sized from the cubin's EIATTR_KPARAM_INFO records."""
    r = run(NODE_PARAMS.replace("GLOBALS_PTX.encode()", "None"), sim_env, args=(str(globals_cubin),))
    assert r == _node_params_expected()


def test_the_v1_graph_instantiate_makes_an_executable_graph(sim_env):
    """cuGraphInstantiate (the 10.0 ABI): as _v2, no error node and an empty log."""
    r = run(CTYPES + """
context()
graph, execg, err = c_void_p(), c_void_p(), c_void_p(0x77)
ok(cuda.cuGraphCreate(byref(graph), 0))
log = ctypes.create_string_buffer(b"junk", 16)
res = cuda.cuGraphInstantiate(byref(execg), graph, byref(err), log, c_size_t(16))
print(json.dumps([res, bool(execg.value), err.value, log.value.decode(), cuda.cuGraphLaunch(execg, None),
                  cuda.cuGraphInstantiate(byref(execg), c_void_p(0x10), None, None, c_size_t(0))]))
""", sim_env)
    assert r == [SUCCESS, True, None, "", SUCCESS, INVALID_VALUE]


# === 2D copies ===

def test_2d_copies_move_rows_between_host_device_and_arrays(sim_env):
    """cuMemcpy2DAsync (_v2): WidthInBytes x Height from (srcXInBytes, srcY) at srcPitch to
    (dstXInBytes, dstY) at dstPitch, for host, device, unified and array memory."""
    r = run(BINDINGS + """
context()
s = ok(cu.cuStreamCreate(0))
M = cu.CUmemorytype
rows, width = 4, 24
host = bytes(range(256)) * 2                                   # 8 rows of 64 bytes
dev, pitch = ok(cu.cuMemAllocPitch(width + 8, rows, 4))
def copy(**kw):
    c = cu.CUDA_MEMCPY2D()
    for k, v in kw.items():
        setattr(c, k, v)
    return rc(cu.cuMemcpy2DAsync(c, s))
up = copy(srcMemoryType=M.CU_MEMORYTYPE_HOST, srcHost=host, srcPitch=64, srcXInBytes=5, srcY=2,
          dstMemoryType=M.CU_MEMORYTYPE_DEVICE, dstDevice=dev, dstPitch=pitch, dstXInBytes=8,
          WidthInBytes=width, Height=rows)
back = bytearray(rows * width)
down = copy(srcMemoryType=M.CU_MEMORYTYPE_UNIFIED, srcDevice=dev, srcPitch=pitch, srcXInBytes=8,
            dstMemoryType=M.CU_MEMORYTYPE_HOST, dstHost=back, dstPitch=width, WidthInBytes=width, Height=rows)
ok(cu.cuStreamSynchronize(s))
want = b"".join(host[64 * (2 + r) + 5: 64 * (2 + r) + 5 + width] for r in range(rows))
desc = cu.CUDA_ARRAY_DESCRIPTOR()
desc.Width, desc.Height, desc.NumChannels = 16, 4, 2                # 16 x 4 elements of 2 x uint16: 64-byte rows
desc.Format = cu.CUarray_format.CU_AD_FORMAT_UNSIGNED_INT16
arr = ok(cu.cuArrayCreate(desc))
to_array = copy(srcMemoryType=M.CU_MEMORYTYPE_HOST, srcHost=host, srcPitch=64, dstMemoryType=M.CU_MEMORYTYPE_ARRAY,
                dstArray=arr, dstXInBytes=8, dstY=1, WidthInBytes=16, Height=3)
from_array = bytearray(3 * 16)
out_of_array = copy(srcMemoryType=M.CU_MEMORYTYPE_ARRAY, srcArray=arr, srcXInBytes=8, srcY=1,
                    dstMemoryType=M.CU_MEMORYTYPE_HOST, dstHost=from_array, dstPitch=16, WidthInBytes=16, Height=3)
errors = [
    copy(srcMemoryType=M.CU_MEMORYTYPE_HOST, srcHost=host, srcPitch=16, srcXInBytes=4,   # pitch < width + x
         dstMemoryType=M.CU_MEMORYTYPE_HOST, dstHost=back, dstPitch=64, WidthInBytes=16, Height=2),
    copy(srcMemoryType=M.CU_MEMORYTYPE_DEVICE, srcDevice=dev, srcPitch=pitch, srcY=rows,  # past the allocation
         dstMemoryType=M.CU_MEMORYTYPE_HOST, dstHost=back, dstPitch=width, WidthInBytes=width, Height=1),
    copy(srcMemoryType=M.CU_MEMORYTYPE_DEVICE, srcDevice=int(ctypes.addressof(ctypes.c_char.from_buffer(back))),
         srcPitch=width, dstMemoryType=M.CU_MEMORYTYPE_HOST, dstHost=back, dstPitch=width,   # not device memory
         WidthInBytes=width, Height=1),
    copy(srcMemoryType=M.CU_MEMORYTYPE_ARRAY, srcArray=arr, srcXInBytes=3, dstMemoryType=M.CU_MEMORYTYPE_HOST,
         dstHost=back, dstPitch=16, WidthInBytes=4, Height=1),                              # X not whole elements
    copy(srcMemoryType=M.CU_MEMORYTYPE_ARRAY, srcArray=arr, srcY=2, dstMemoryType=M.CU_MEMORYTYPE_HOST,
         dstHost=back, dstPitch=64, WidthInBytes=64, Height=3),                             # rows past the array
    copy(srcMemoryType=M.CU_MEMORYTYPE_HOST, srcHost=host, srcPitch=1 << 31, dstMemoryType=M.CU_MEMORYTYPE_HOST,
         dstHost=back, dstPitch=64, WidthInBytes=8, Height=1),                              # pitch > MAX_PITCH
    copy(srcMemoryType=M.CU_MEMORYTYPE_HOST, srcHost=host, srcPitch=64, dstMemoryType=M.CU_MEMORYTYPE_ARRAY,
         dstArray=cu.CUarray(0x40), WidthInBytes=8, Height=1),                               # not an array
]
raw = ctypes.CDLL("libcuda.so.1")
errors.append(raw.cuMemcpy2DAsync_v2(None, None))
print(json.dumps([up, down, bytes(back) == want, to_array, out_of_array,
                  bytes(from_array) == b"".join(host[64 * r: 64 * r + 16] for r in range(3)), errors]))
""", sim_env)
    assert r == [SUCCESS, SUCCESS, True, SUCCESS, SUCCESS, True,
                 [INVALID_VALUE] * 6 + [INVALID_HANDLE, INVALID_VALUE]]


# === prefetch ===

def test_prefetch_takes_managed_memory_to_a_device_or_the_host(sim_env):
    """cuMemPrefetchAsync (_v2): "The memory range must refer to managed memory"; a device
    location names a valid ordinal (CUDA_ERROR_INVALID_DEVICE), a host NUMA node a real one;
    flags must be 0.  The 8.0 ABI takes a device ordinal or CU_DEVICE_CPU."""
    r = run(BINDINGS + """
context()
s = ok(cu.cuStreamCreate(0))
managed = ok(cu.cuMemAllocManaged(1 << 20, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL))
plain = ok(cu.cuMemAlloc(1 << 20))
T = cu.CUmemLocationType
def at(t, i=0):
    loc = cu.CUmemLocation()
    loc.type, loc.id = t, i
    return loc
def pf(ptr, n, loc, flags=0):
    return rc(cu.cuMemPrefetchAsync(ptr, n, loc, flags, s))
v2 = [pf(managed, 1 << 20, at(T.CU_MEM_LOCATION_TYPE_DEVICE)), pf(managed, 4096, at(T.CU_MEM_LOCATION_TYPE_HOST, 9)),
      pf(managed, 100, at(T.CU_MEM_LOCATION_TYPE_HOST_NUMA, 0)), pf(managed, 100, at(T.CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT)),
      pf(plain, 4096, at(T.CU_MEM_LOCATION_TYPE_DEVICE)), pf(managed, (1 << 20) + 1, at(T.CU_MEM_LOCATION_TYPE_DEVICE)),
      pf(managed, 4096, at(T.CU_MEM_LOCATION_TYPE_DEVICE, 3)), pf(managed, 4096, at(T.CU_MEM_LOCATION_TYPE_HOST_NUMA, 1)),
      pf(managed, 4096, at(T.CU_MEM_LOCATION_TYPE_DEVICE), 1), pf(managed, 0, at(T.CU_MEM_LOCATION_TYPE_DEVICE))]
ok(cu.cuStreamSynchronize(s))
raw = ctypes.CDLL("libcuda.so.1")
v1 = [raw.cuMemPrefetchAsync(ctypes.c_uint64(int(managed)), ctypes.c_size_t(4096), 0, None),
      raw.cuMemPrefetchAsync(ctypes.c_uint64(int(managed)), ctypes.c_size_t(4096), -1, None),      # CU_DEVICE_CPU
      raw.cuMemPrefetchAsync(ctypes.c_uint64(int(managed)), ctypes.c_size_t(4096), -2, None),
      raw.cuMemPrefetchAsync_ptsz(ctypes.c_uint64(int(plain)), ctypes.c_size_t(4096), 0, None),
      raw.cuMemPrefetchAsync(ctypes.c_uint64(int(managed)), ctypes.c_size_t(4096), 0, ctypes.c_void_p(0x50))]
print(json.dumps([v2, v1]))
""", sim_env)
    assert r == [[SUCCESS] * 4 + [INVALID_VALUE, INVALID_VALUE, INVALID_DEVICE, INVALID_VALUE, INVALID_VALUE,
                                  INVALID_VALUE],
                 [SUCCESS, SUCCESS, INVALID_DEVICE, INVALID_VALUE, INVALID_HANDLE]]


# === stream memory operations ===

MEMOPS = BINDINGS + """
ctx = context()
raw = ctypes.CDLL("libcuda.so.1")
flag = int(ok(cu.cuMemAlloc(64)))
ok(cu.cuMemsetD8(flag, 0, 64))
host = ok(cu.cuMemHostAlloc(64, 0))                      # page-locked: its device pointer is its address
word = lambda i: ctypes.c_uint32.from_address(int(host) + 4 * i)
for i in range(16):
    word(i).value = 0
dhost = int(ok(cu.cuMemHostGetDevicePointer(host, 0)))
def dread(ptr):
    b = bytearray(4)
    ok(cu.cuMemcpyDtoH(b, ptr, 4))
    return int.from_bytes(b, "little")
def dwrite(ptr, v):
    ok(cu.cuMemcpyHtoD(ptr, v.to_bytes(4, "little"), 4))
def until(cond, limit=5.0):
    t = time.monotonic()
    while not cond() and time.monotonic() - t < limit:
        time.sleep(0.001)
    return cond()
class W:   # CUstreamWaitValue_flags, as the ints the bindings take
    CU_STREAM_WAIT_VALUE_GEQ, CU_STREAM_WAIT_VALUE_EQ, CU_STREAM_WAIT_VALUE_AND, CU_STREAM_WAIT_VALUE_NOR = 0, 1, 2, 3
    CU_STREAM_WAIT_VALUE_FLUSH = 1 << 30
def attribute(a):
    v = ctypes.c_int(-1)
    raw.cuDeviceGetAttribute(ctypes.byref(v), a, 0)
    return v.value
"""


def test_a_wait_holds_the_stream_until_its_condition_holds(sim_env):
    """cuStreamWaitValue32 (v2): "Work ordered after the operation will block until the
    given condition on the memory is satisfied": the stream is not done (NOT_READY, and
    synchronisation waits) until the memory says so; a write after it is not done before."""
    r = run(MEMOPS + """
s = ok(cu.cuStreamCreate(0))
ok(cu.cuStreamWaitValue32(s, flag, 1, W.CU_STREAM_WAIT_VALUE_GEQ))
ok(cu.cuStreamWriteValue32(s, dhost, 5, 0))          # ordered after the wait
waiting = [rc(cu.cuStreamQuery(s)), word(0).value]
time.sleep(0.05)
still = [rc(cu.cuStreamQuery(s)), word(0).value]
def later():
    time.sleep(0.2)
    ok(cu.cuCtxSetCurrent(ctx))      # a thread of its own: the context is per thread
    dwrite(flag, 1)
threading.Thread(target=later).start()
t = time.monotonic()
ok(cu.cuStreamSynchronize(s))
waited = time.monotonic() - t
print(json.dumps([waiting, still, waited >= 0.15, rc(cu.cuStreamQuery(s)), word(0).value]))
""", sim_env)
    assert r == [[NOT_READY, 0], [NOT_READY, 0], True, SUCCESS, 5]


def test_queued_operations_complete_without_a_driver_call(sim_env):
    """A write queued behind a wait lands once another stream's write satisfies the wait,
    seen by a host thread that polls page-locked memory and calls nothing."""
    r = run(MEMOPS + """
a, b = ok(cu.cuStreamCreate(0)), ok(cu.cuStreamCreate(0))
ok(cu.cuStreamWaitValue32(a, dhost + 4, 7, W.CU_STREAM_WAIT_VALUE_EQ))
ok(cu.cuStreamWriteValue32(a, dhost, 1, 0))
early = word(0).value
ok(cu.cuStreamWriteValue32(b, dhost + 4, 7, 0))
print(json.dumps([early, until(lambda: word(0).value == 1), word(1).value]))
""", sim_env)
    assert r == [0, True, 7]


def test_a_write_lands_after_the_work_queued_before_it(sim_env):
    """A write follows the stream's earlier work: after a 500 ms kernel, not before."""
    r = run(MEMOPS + """
s = ok(cu.cuStreamCreate(0))
ok(cu.cuLaunchKernel(kernel("sim_500000us"), 1, 1, 1, 1, 1, 1, 0, s, 0, 0))
t = time.monotonic()
ok(cu.cuStreamWriteValue32(s, dhost, 9, 0))
right_away = word(0).value
landed = until(lambda: word(0).value == 9)
print(json.dumps([right_away, landed, time.monotonic() - t >= 0.4]))
""", sim_env)
    assert r == [0, True, True]


def test_wait_conditions_are_the_documented_comparisons(sim_env):
    """GEQ is cyclic ((int32_t)(*addr - value) >= 0), EQ is equality, AND is a non-zero
    intersection; each holds at once, or leaves the stream NOT_READY."""
    r = run(MEMOPS + """
def holds(mem, value, cond):
    s = ok(cu.cuStreamCreate(0))
    word(2).value = mem
    ok(cu.cuStreamWaitValue32(s, dhost + 8, value, cond))
    r = rc(cu.cuStreamQuery(s)) == 0
    word(2).value = value if cond != W.CU_STREAM_WAIT_VALUE_AND else 0xffffffff   # let it go
    ok(cu.cuStreamSynchronize(s))
    return r
G, E, A = W.CU_STREAM_WAIT_VALUE_GEQ, W.CU_STREAM_WAIT_VALUE_EQ, W.CU_STREAM_WAIT_VALUE_AND
print(json.dumps([holds(5, 5, G), holds(6, 5, G), holds(4, 5, G), holds(5, 0xfffffff0, G), holds(0xfffffff0, 5, G),
                  holds(3, 3, E), holds(4, 3, E), holds(6, 2, A), holds(4, 3, A)]))
""", sim_env)
    assert r == [True, True, False, True, False, True, False, True, False]


def test_batches_run_in_order_and_refuse_what_the_device_does_not_support(sim_env):
    """cuStreamBatchMemOp (v2): operations "enqueued in the order they appear"; count "less
    than 256", flags 0; 64-bit operations, NOR waits and remote-write flushes are not
    supported here (their device attributes read 0), nor NO_MEMORY_BARRIER in v2; managed,
    unknown and unaligned addresses are invalid."""
    r = run(MEMOPS + """
OP = cu.CUstreamBatchMemOpType
def op(kind, addr=0, value=0, flags=0):
    p = cu.CUstreamBatchMemOpParams()
    if kind in (OP.CU_STREAM_MEM_OP_WAIT_VALUE_32, OP.CU_STREAM_MEM_OP_WAIT_VALUE_64):
        p.waitValue.operation, p.waitValue.address, p.waitValue.value, p.waitValue.flags = kind, addr, value, flags
    elif kind in (OP.CU_STREAM_MEM_OP_WRITE_VALUE_32, OP.CU_STREAM_MEM_OP_WRITE_VALUE_64):
        p.writeValue.operation, p.writeValue.address, p.writeValue.value, p.writeValue.flags = kind, addr, value, flags
    else:
        p.memoryBarrier.operation, p.memoryBarrier.flags = kind, flags
    return p
s = ok(cu.cuStreamCreate(0))
batch = [op(OP.CU_STREAM_MEM_OP_WRITE_VALUE_32, dhost + 12, 3), op(OP.CU_STREAM_MEM_OP_BARRIER, flags=1),
         op(OP.CU_STREAM_MEM_OP_WAIT_VALUE_32, dhost + 12, 3, W.CU_STREAM_WAIT_VALUE_EQ),
         op(OP.CU_STREAM_MEM_OP_WRITE_VALUE_32, flag, 8)]
ran = [rc(cu.cuStreamBatchMemOp(s, len(batch), batch, 0)), rc(cu.cuStreamSynchronize(s)), word(3).value, dread(flag)]
managed = ok(cu.cuMemAllocManaged(64, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL))
one = lambda p, n=1, flags=0: rc(cu.cuStreamBatchMemOp(s, n, [p] * n, flags))
refused = [one(op(OP.CU_STREAM_MEM_OP_WRITE_VALUE_32, flag, 1), 256), one(op(OP.CU_STREAM_MEM_OP_WRITE_VALUE_32, flag, 1), 1, 1),
           one(op(OP.CU_STREAM_MEM_OP_WAIT_VALUE_64, flag, 1)), one(op(OP.CU_STREAM_MEM_OP_WRITE_VALUE_64, flag, 1)),
           one(op(OP.CU_STREAM_MEM_OP_WAIT_VALUE_32, flag, 1, W.CU_STREAM_WAIT_VALUE_NOR)),
           one(op(OP.CU_STREAM_MEM_OP_WAIT_VALUE_32, flag, 0, W.CU_STREAM_WAIT_VALUE_FLUSH)),
           one(op(OP.CU_STREAM_MEM_OP_FLUSH_REMOTE_WRITES)),
           one(op(OP.CU_STREAM_MEM_OP_WRITE_VALUE_32, flag, 1, 1)),               # NO_MEMORY_BARRIER
           one(op(OP.CU_STREAM_MEM_OP_WRITE_VALUE_32, managed, 1)), one(op(OP.CU_STREAM_MEM_OP_WRITE_VALUE_32, flag + 2, 1)),
           one(op(OP.CU_STREAM_MEM_OP_WRITE_VALUE_32, 0x1000, 1)), one(op(OP.CU_STREAM_MEM_OP_WRITE_VALUE_32, flag + 64, 1)),
           one(op(OP.CU_STREAM_MEM_OP_BARRIER, flags=2))]
untouched = dread(flag)
partial = [op(OP.CU_STREAM_MEM_OP_WRITE_VALUE_32, flag, 11), op(OP.CU_STREAM_MEM_OP_WAIT_VALUE_64, flag, 1)]
all_or_nothing = [rc(cu.cuStreamBatchMemOp(s, 2, partial, 0)), dread(flag)]
attrs = [attribute(a) for a in (92, 122, 123, 98)]
print(json.dumps([ran, refused, untouched, all_or_nothing, attrs]))
""", sim_env)
    assert r == [[SUCCESS, SUCCESS, 3, 8],
                 [INVALID_VALUE, INVALID_VALUE] + [NOT_SUPPORTED] * 5 + [INVALID_VALUE] * 6,
                 8, [NOT_SUPPORTED, 8], [0, 0, 0, 0]]


def test_the_v1_memory_operations_are_not_supported(sim_env):
    """The unversioned (8.0) ABIs are the v1 API, which CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1
    (0 here, as on a driver without NVreg_EnableStreamMemOPs=1) says is not supported."""
    r = run(MEMOPS + """
p = ctypes.c_uint64(int(flag))
print(json.dumps([raw.cuStreamWaitValue32(None, p, 0, 0), raw.cuStreamWriteValue32(None, p, 1, 0),
                  raw.cuStreamBatchMemOp(None, 0, None, 0), raw.cuStreamWaitValue32_ptsz(None, p, 0, 0),
                  raw.cuStreamWriteValue32(ctypes.c_void_p(0x60), p, 1, 0), dread(flag)]))
""", sim_env)
    assert r == [NOT_SUPPORTED] * 4 + [INVALID_HANDLE, 0]


def test_pending_operations_survive_their_stream_and_hold_context_synchronisation(sim_env):
    """A destroyed stream's pending operations still complete ("resources ... released
    automatically once the device has completed all work"); cuCtxSynchronize waits for them."""
    r = run(MEMOPS + """
s = ok(cu.cuStreamCreate(0))
ok(cu.cuStreamWaitValue32(s, dhost + 16, 1, W.CU_STREAM_WAIT_VALUE_GEQ))
ok(cu.cuStreamWriteValue32(s, dhost + 20, 2, 0))
ok(cu.cuStreamDestroy(s))
def later():
    time.sleep(0.2)
    word(4).value = 1
threading.Thread(target=later).start()
t = time.monotonic()
ok(cu.cuCtxSynchronize())
print(json.dumps([time.monotonic() - t >= 0.15, word(5).value]))
""", sim_env)
    assert r == [True, 2]


def test_a_context_reset_drops_its_pending_operations(sim_env):
    """cuDevicePrimaryCtxReset "reset[s] all state on the primary context" and frees its
    memory: what waited on its streams is dropped, so nothing touches that memory later and
    the stream is done."""
    r = run(MEMOPS + """
ok(cu.cuStreamWaitValue32(cu.CUstream(0), dhost + 24, 1, W.CU_STREAM_WAIT_VALUE_GEQ))
ok(cu.cuStreamWriteValue32(cu.CUstream(0), flag, 3, 0))
waiting = rc(cu.cuStreamQuery(cu.CUstream(0)))
ok(cu.cuDevicePrimaryCtxReset(ok(cu.cuDeviceGet(0))))      # frees host and flag
time.sleep(0.05)
print(json.dumps([waiting, rc(cu.cuStreamQuery(cu.CUstream(0))), rc(cu.cuCtxSynchronize())]))
""", sim_env)
    assert r == [NOT_READY, SUCCESS, SUCCESS]


def test_memory_operations_are_refused_while_capturing(sim_env):
    r = run(MEMOPS + """
s = ok(cu.cuStreamCreate(0))
ok(cu.cuStreamBeginCapture(s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
print(json.dumps(rc(cu.cuStreamWriteValue32(s, flag, 1, 0))))
""", sim_env)
    assert r == STREAM_CAPTURE_UNSUPPORTED


# === tensor maps ===

TENSOR_MAP = CTYPES + """
context()
store = (ctypes.c_char * 512)()
base = (ctypes.addressof(store) + 127) // 128 * 128
u64s, u32s = lambda *v: (c_uint64 * len(v))(*v), lambda *v: (c_uint32 * len(v))(*v)
cuda.cuTensorMapEncodeTiled.argtypes = [c_void_p, c_int, c_uint32, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
                                        c_int, c_int, c_int, c_int]
gaddr = alloc(1 << 20)
def enc(at=base, dtype=6, rank=2, addr=gaddr, dims=(256, 128), strides=(512,), box=(64, 32), estr=(1, 1),
        interleave=0, swizzle=3, l2=2, oob=0):
    return cuda.cuTensorMapEncodeTiled(at, dtype, rank, addr, u64s(*dims), u64s(*strides) if strides else None,
                                       u32s(*box), u32s(*estr), interleave, swizzle, l2, oob)
"""


def test_a_tiled_tensor_map_is_encoded_on_hopper_after_the_documented_checks(tmp_path):
    """cuTensorMapEncodeTiled: each documented requirement refused with
    CUDA_ERROR_INVALID_VALUE; a valid map written (an opaque value: here the address is in it)."""
    r = run(TENSOR_MAP + """
good = enc()
words = [c_uint64.from_address(base + 8 * i).value for i in range(16)]
bad = [enc(at=base + 32), enc(dtype=16), enc(rank=0), enc(rank=6, dims=(2,) * 6, strides=(512,) * 5, box=(8,) * 6,
       estr=(1,) * 6), enc(interleave=1, rank=2), enc(addr=gaddr + 8), enc(dims=(0, 128)), enc(dims=((1 << 32) + 1, 4)),
       enc(strides=(520,)), enc(strides=(1 << 40,)), enc(box=(257, 1)), enc(box=(4, 32), swizzle=0),
       enc(estr=(1, 9)), enc(estr=(0, 1)), enc(swizzle=1), enc(interleave=2, rank=3, dims=(64, 4, 4), strides=(256, 1024),
       box=(16, 4, 4), estr=(1, 1, 1), swizzle=0), enc(swizzle=7), enc(l2=4), enc(oob=1, dtype=0, box=(64, 32)),
       enc(oob=2), enc(dtype=14, dims=(100, 4), box=(128, 4), swizzle=0), enc(dtype=15, swizzle=1, dims=(256, 4),
       box=(128, 4)), enc(dtype=13, dims=(255, 4), box=(64, 4), swizzle=0), enc(strides=None)]
interleaved = enc(interleave=2, rank=3, dims=(64, 4, 4), strides=(256, 1024), box=(16, 4, 4), estr=(1, 1, 1), swizzle=1)
packed = enc(dtype=15, dims=(256, 4), strides=(256,), box=(128, 4), swizzle=3, oob=0)
ok(cuda.cuCtxSetCurrent(None))
print(json.dumps([good, words[0] == gaddr, any(words[1:]), bad, interleaved, packed, enc()]))
""", make_sim_env(tmp_path / "node", profile="h100-80g"))
    good, has_address, more, bad, interleaved, packed, no_context = r
    assert [good, has_address, more, interleaved, packed] == [SUCCESS, True, True, SUCCESS, SUCCESS]
    assert bad == [INVALID_VALUE] * len(bad)
    assert no_context == INVALID_CONTEXT


def test_tensor_maps_are_not_supported_before_hopper(sim_env):
    """"Tensor map objects are only supported on devices of compute capability 9.0 or higher":
    on the A10 (8.6) a valid request is CUDA_ERROR_NOT_SUPPORTED; a bad one still INVALID_VALUE."""
    r = run(TENSOR_MAP + """
print(json.dumps([enc(), enc(rank=0)]))
""", sim_env)
    assert r == [NOT_SUPPORTED, INVALID_VALUE]


# === NVML: NvLink and the fabric ===

NVML = """
import ctypes, json
from ctypes import byref, c_int, c_uint, c_void_p
nvml = ctypes.CDLL("libnvidia-ml.so.1")
class Fabric(ctypes.Structure):          # nvmlGpuFabricInfo_v3_t
    _fields_ = [("version", c_uint), ("clusterUuid", ctypes.c_ubyte * 16), ("status", c_int), ("cliqueId", c_uint),
                ("state", ctypes.c_ubyte), ("healthMask", c_uint), ("healthSummary", ctypes.c_ubyte)]
V2, V3 = 2 << 24 | 36, 3 << 24 | 40
out = {"uninitialized": [nvml.nvmlDeviceGetNvLinkRemoteDeviceType(None, 0, byref(c_int())),
                         nvml.nvmlDeviceGetGpuFabricInfoV(None, byref(Fabric(V3)))]}
assert nvml.nvmlInit_v2() == 0
h = c_void_p()
assert nvml.nvmlDeviceGetHandleByIndex_v2(0, byref(h)) == 0
kind, pci = c_int(-1), (ctypes.c_char * 68)()
out["nvlink"] = [nvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, 0, byref(kind)), kind.value,
                 nvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, 35, byref(kind)),
                 nvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, 36, byref(kind)),
                 nvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, 0, None),
                 nvml.nvmlDeviceGetNvLinkRemoteDeviceType(c_void_p(0x10), 0, byref(kind)),
                 nvml.nvmlDeviceGetNvLinkRemotePciInfo_v2(h, 0, pci), nvml.nvmlDeviceGetNvLinkRemotePciInfo_v2(h, 36, pci),
                 nvml.nvmlDeviceGetNvLinkRemotePciInfo_v2(h, 0, None)]
fabric = []
for version in (V2, V3):
    f = Fabric(version, (ctypes.c_ubyte * 16)(*[0xff] * 16), 5, 9, 7, 9, 7)
    fabric.append([nvml.nvmlDeviceGetGpuFabricInfoV(h, byref(f)), f.version == version, list(f.clusterUuid) == [0] * 16,
                   f.status, f.cliqueId, f.state, f.healthMask, f.healthSummary])
out["fabric"] = fabric
out["fabric errors"] = [nvml.nvmlDeviceGetGpuFabricInfoV(h, byref(Fabric(4 << 24 | 40))),
                        nvml.nvmlDeviceGetGpuFabricInfoV(h, None), nvml.nvmlDeviceGetGpuFabricInfoV(c_void_p(0x10), byref(Fabric(V3)))]
print(json.dumps(out))
"""
NVML_SUCCESS, NVML_UNINITIALIZED, NVML_INVALID_ARGUMENT, NVML_NOT_SUPPORTED, NVML_VERSION_MISMATCH = 0, 1, 2, 3, 25


def test_nvml_says_a_board_without_nvlink_has_no_nvlink(sim_env):
    """nvmlDeviceGetNvLinkRemoteDeviceType / nvmlDeviceGetNvLinkRemotePciInfo_v2: a link
    index past NVML_NVLINK_MAX_LINKS (36), a bad handle or a NULL output is
    NVML_ERROR_INVALID_ARGUMENT; any link of a board without NvLink NVML_ERROR_NOT_SUPPORTED.
    The A10 predates the fabric: nvmlDeviceGetGpuFabricInfoV is NVML_ERROR_NOT_SUPPORTED."""
    r = run(NVML, sim_env)
    assert r["uninitialized"] == [NVML_UNINITIALIZED, NVML_UNINITIALIZED]
    assert r["nvlink"] == [NVML_NOT_SUPPORTED, -1, NVML_NOT_SUPPORTED, NVML_INVALID_ARGUMENT, NVML_INVALID_ARGUMENT,
                           NVML_INVALID_ARGUMENT, NVML_NOT_SUPPORTED, NVML_INVALID_ARGUMENT, NVML_INVALID_ARGUMENT]
    assert [f[0] for f in r["fabric"]] == [NVML_NOT_SUPPORTED, NVML_NOT_SUPPORTED]
    assert r["fabric errors"] == [NVML_VERSION_MISMATCH, NVML_INVALID_ARGUMENT, NVML_INVALID_ARGUMENT]


def test_nvml_fabric_state_of_a_hopper_board_outside_an_nvswitch_system(tmp_path):
    """nvmlDeviceGetGpuFabricInfoV on Hopper ("For Hopper or newer"): success, with the probe
    state NVML_GPU_FABRIC_STATE_NOT_SUPPORTED (0) and nothing else to report, in the v2 and
    v3 layouts; another version is NVML_ERROR_ARGUMENT_VERSION_MISMATCH."""
    r = run(NVML, make_sim_env(tmp_path / "node", profile="h200"))
    # v2 ends at healthMask: the v3 healthSummary byte is the caller's, untouched
    assert r["fabric"] == [[NVML_SUCCESS, True, True, 0, 0, 0, 0, 7], [NVML_SUCCESS, True, True, 0, 0, 0, 0, 0]]
    assert r["fabric errors"] == [NVML_VERSION_MISMATCH, NVML_INVALID_ARGUMENT, NVML_INVALID_ARGUMENT]
    assert r["nvlink"][0] == NVML_NOT_SUPPORTED


def test_the_nvml_structs_match_nvidia_ml_py():
    """nvmlGpuFabricInfo_v2_t / _v3_t as csrc/nvml_abi.h lays them out (its static asserts:
    36 and 40 bytes, versions 0x02000024 and 0x03000028) are NVIDIA's nvidia-ml-py layouts."""
    pynvml = pytest.importorskip("pynvml")
    import ctypes
    assert ctypes.sizeof(pynvml.c_nvmlGpuFabricInfo_v2_t) == 36 and pynvml.nvmlGpuFabricInfo_v2 == 0x02000024
    assert ctypes.sizeof(pynvml.c_nvmlGpuFabricInfo_v3_t) == 40 and pynvml.nvmlGpuFabricInfo_v3 == 0x03000028
    assert pynvml.c_nvmlGpuFabricInfo_v3_t.state.offset == 28 and pynvml.c_nvmlGpuFabricInfo_v3_t.healthSummary.offset == 36
    assert pynvml.NVML_NVLINK_MAX_LINKS == 36
