"""The vgpu demo: isolation on a simulated GPU.

Part 1: a CUDA program runs unchanged on simgpu: it allocates, copies and launches kernels
through NVIDIA's cuda-python driver bindings, while NVML (pynvml, in a second process)
reports what the simulated GPU sees.
Part 2: two tenants share the GPU.  Without vgpu a greedy one takes all the memory and the
other gets out-of-memory; with vgpu each runs under its own cap, sees only its slice, and
the greedy one hits its own limit while the other keeps working.  Run with `make demo`.
"""
import os
import subprocess
import sys
import tempfile
import time

from vgpu.paths import shim_path
from vgpu.sim import sim_environment

GiB = 1 << 30


def check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise SystemExit(f"CUDA call failed: {err!r}")
    return rest[0] if len(rest) == 1 else rest


def cuda_program():
    from cuda.bindings import driver as cu

    check(cu.cuInit(0))
    dev = check(cu.cuDeviceGet(0))
    name = check(cu.cuDeviceGetName(64, dev)).split(b"\0")[0].decode()
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev))
    check(cu.cuCtxSetCurrent(ctx))
    free, total = check(cu.cuMemGetInfo())
    print(f"[cuda]  device 0: {name}, {total / 2**30:.0f} GiB, {free / 2**30:.1f} GiB free")

    size = 4 << 30
    buf = check(cu.cuMemAlloc(size))
    data = bytes(range(256)) * 4096
    check(cu.cuMemcpyHtoD(buf, data, len(data)))
    back = bytearray(len(data))
    check(cu.cuMemcpyDtoH(back, buf, len(data)))
    print(f"[cuda]  allocated 4 GiB; copied 1 MiB there and back: "
          f"{'identical' if bytes(back) == data else 'MISMATCH'}")

    module = check(cu.cuModuleLoadData(b"any image: simgpu runs kernels by name"))
    kernel = check(cu.cuModuleGetFunction(module, b"sim_5000us"))
    stream = check(cu.cuStreamCreate(0))
    start, end = check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))
    check(cu.cuEventRecord(start, stream))
    for _ in range(400):   # 400 kernels x 5 ms = 2 s of simulated GPU time
        check(cu.cuLaunchKernel(kernel, 72, 1, 1, 128, 1, 1, 0, stream, 0, 0))
    check(cu.cuEventRecord(end, stream))
    print("[cuda]  launched 400 x sim_5000us (one wave each) on a stream")

    # Meanwhile NVML, in another process, sees this process and its work.
    time.sleep(1.2)
    subprocess.run([sys.executable, __file__, "--nvml", str(os.getpid())], check=True)

    check(cu.cuStreamSynchronize(stream))
    print(f"[cuda]  stream done: events measure {check(cu.cuEventElapsedTime(start, end)):.1f} ms "
          "(expected 2000 ms)")
    check(cu.cuMemFree(buf))


def nvml_view(pid):
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
    util = pynvml.nvmlDeviceGetUtilizationRates(h)
    print(f"[nvml]  {pynvml.nvmlDeviceGetName(h)} {pynvml.nvmlDeviceGetUUID(h)}")
    print(f"[nvml]  memory used {mem.used / 2**30:.1f} of {mem.total / 2**30:.0f} GiB; "
          f"utilization over the last second {util.gpu}%")
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
        me = " (the demo)" if p.pid == pid else ""
        print(f"[nvml]  process {p.pid}{me} holds {p.usedGpuMemory / 2**30:.1f} GiB")
    pynvml.nvmlShutdown()


def tenant(role):
    """One tenant: 'greedy' grabs 1 GiB at a time until refused; 'steady' then needs 6 GiB."""
    from cuda.bindings import driver as cu

    check(cu.cuInit(0))
    check(cu.cuCtxSetCurrent(check(cu.cuDevicePrimaryCtxRetain(0))))
    free, total = check(cu.cuMemGetInfo())
    held = []
    want = 64 if role == "greedy" else 6
    for _ in range(want):
        err, ptr = cu.cuMemAlloc(GiB)
        if int(err) != 0:
            break
        held.append(ptr)
    print(f"{role:6}  sees {total / GiB:4.0f} GiB, got {len(held):2} of {want:2} GiB"
          f"{'' if len(held) == want else '  <- CUDA_ERROR_OUT_OF_MEMORY'}", flush=True)
    if role == "greedy":
        sys.stdin.readline()   # hold the memory until the other tenant has tried


def two_tenants(title, env_for):
    print(f"\n== {title}")
    greedy = subprocess.Popen([sys.executable, __file__, "--tenant", "greedy"], env=env_for("greedy"),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    print(greedy.stdout.readline(), end="")   # it has taken what it could
    subprocess.run([sys.executable, __file__, "--tenant", "steady"], env=env_for("steady"), check=True)
    greedy.communicate("done\n")


def isolation(base_env, vgpu_dir):
    two_tenants("without vgpu: both tenants share the whole 24 GiB", lambda role: base_env)

    def capped(role):
        cap = {"greedy": "8Gi", "steady": "12Gi"}[role]
        return {**base_env, "LD_PRELOAD": str(shim_path()), "VGPU_DIR": vgpu_dir,
                "VGPU_CONTAINER": role, "VGPU_MEMORY_LIMIT": cap}
    two_tenants("with vgpu: greedy capped at 8 GiB, steady at 12 GiB", capped)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--nvml"]:
        nvml_view(int(sys.argv[2]))
    elif sys.argv[1:2] == ["--tenant"]:
        tenant(sys.argv[2])
    elif sys.argv[1:2] == ["--cuda"]:
        cuda_program()
    else:
        with tempfile.TemporaryDirectory(prefix="vgpu-demo-") as state:
            env = {**os.environ, **sim_environment("a10", 1, state)}
            print("simgpu: one simulated NVIDIA A10 (24 GiB, 72 SMs); state in", state)
            print("\n== a CUDA program, unchanged, on simgpu")
            subprocess.run([sys.executable, __file__, "--cuda"], env=env, check=True)
            isolation(env, os.path.join(state, "vgpu"))
