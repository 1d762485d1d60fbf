"""The runbook, end to end, without Docker: two "containers" on one simulated GPU.

Each container is a process in its own mount namespace (`unshare --mount`), given exactly
what `vgpu-ctl env NAME --format docker --shim-dir DIR` says: every `-v HOST:PATH:ro|rw`
becomes a bind mount (read-only where it says ro), every `-e` a variable, in an otherwise
empty environment; `--gpus all` is played by simgpu's libraries on LD_LIBRARY_PATH.
Paths that do not exist on this machine (/usr/local/lib/vgpu, /run/vgpu) are made inside
the namespace on an overlay, so nothing outside it changes.  One container loads the shim
through LD_PRELOAD, the other through /etc/ld.so.preload.  Judged from inside (what CUDA
reports and refuses, what is writable) and from outside (`vgpu-ctl status`).
Needs root and mount namespaces; skipped elsewhere.
"""
import json
import os
import select
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_sim_env
from vgpu.paths import simgpu_dir

GiB, MiB = 1 << 30, 1 << 20
SUCCESS, OUT_OF_MEMORY = 0, 2
CTL = str(Path(sys.executable).parent / "vgpu-ctl")

WORKLOAD = r"""
import ctypes, errno, json, os, sys
cuda = ctypes.CDLL("libcuda.so.1")
def check(rc, what):
    if rc != 0:
        raise SystemExit(f"{what} -> {rc}")
check(cuda.cuInit(0), "cuInit")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
free, total = ctypes.c_size_t(), ctypes.c_size_t()
check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
slice_dir = os.path.join(os.environ["VGPU_DIR"], os.environ["VGPU_CONTAINER"])

def writable(path):
    try:
        open(path, "r+b").close()
        return "yes"
    except OSError as e:
        return errno.errorcode[e.errno]

print(json.dumps({"pid": os.getpid(), "total": total.value, "ld_preload": os.environ.get("LD_PRELOAD"),
                  "shim": sorted({l.split()[-1] for l in open("/proc/self/maps") if "libvgpu" in l}),
                  "quota_writable": writable(os.path.join(slice_dir, "quota")),
                  "usage_writable": writable(os.path.join(slice_dir, "usage"))}), flush=True)
held = []
for line in sys.stdin:
    size = int(line)
    ptr = ctypes.c_uint64()
    rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))
    if rc == 0:
        held.append(ptr)
    print(rc, flush=True)
"""


def namespaces_work(scratch):
    if os.geteuid() != 0:
        return False
    lower, upper, work = (scratch / n for n in ("lower", "upper", "work"))
    for d in (lower, upper, work):
        d.mkdir(parents=True)
    probe = (f"mount -t overlay overlay -o lowerdir={lower},upperdir={upper},workdir={work} {lower} && "
             f"touch {lower}/x && mount --bind /dev/null {lower}/x && mount -o remount,bind,ro {lower}/x")
    try:
        ok = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", probe],
                            capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return ok and not (lower / "x").exists()


def mount_script(mounts, scratch):
    """Shell lines that make each (host, path, read_only) bind mount inside the namespace;
    a path missing here is created on an overlay of its nearest existing ancestor."""
    lines, overlaid = ["set -e"], []
    for n, (host, path, read_only) in enumerate(mounts):
        if not os.path.exists(path):
            if not any(path.startswith(o + "/") for o in overlaid):
                ancestor = os.path.dirname(path)
                while not os.path.isdir(ancestor):
                    ancestor = os.path.dirname(ancestor)
                upper, work = scratch / f"upper{n}", scratch / f"work{n}"
                upper.mkdir(parents=True)
                work.mkdir()
                lines.append(f"mount -t overlay overlay -o lowerdir={ancestor},upperdir={upper},workdir={work} "
                             f"{ancestor}")
                overlaid.append(ancestor)
            lines.append(f"mkdir -p {shlex.quote(os.path.dirname(path))} && touch {shlex.quote(path)}")
        lines.append(f"mount --bind {shlex.quote(host)} {shlex.quote(path)}")
        if read_only:
            lines.append(f"mount -o remount,bind,ro {shlex.quote(path)}")
    return "\n".join(lines) + "\n"


class Container:
    """`docker run FLAGS python WORKLOAD`, played with a mount namespace."""

    def __init__(self, flags, sim_env, scratch):
        mounts, env, it = [], {}, iter(flags)
        for flag in it:
            if flag == "--gpus":
                next(it)                     # simgpu is the GPU: LD_LIBRARY_PATH below
            elif flag == "-v":
                host, path, mode = next(it).split(":")
                mounts.append((host, path, mode == "ro"))
            elif flag == "-e":
                k, v = next(it).split("=", 1)
                env[k] = v
            else:
                raise AssertionError(f"a docker flag the runbook did not promise: {flag}")
        self.mounts, self.env = mounts, env
        scratch.mkdir(parents=True)
        inner = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(simgpu_dir()),
                 **{k: v for k, v in sim_env.items() if k.startswith("SIMGPU_")}, **env}
        script = mount_script(mounts, scratch) + 'exec env -i "$@"\n'
        argv = ["unshare", "--mount", "--propagation", "private", "bash", "-c", script, "container",
                *(f"{k}={v}" for k, v in inner.items()), sys.executable, "-c", WORKLOAD]
        self.proc = subprocess.Popen(argv, env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.hello = json.loads(self.read())

    def read(self, timeout=60):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise AssertionError(f"container said nothing: {self.proc.stderr.read()}")
        return line

    def alloc(self, size):
        self.proc.stdin.write(f"{size}\n")
        self.proc.stdin.flush()
        return int(self.read())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def test_two_containers_from_the_runbook_each_held_to_its_slice(tmp_path):
    if not namespaces_work(tmp_path / "probe"):
        pytest.skip("needs root, mount namespaces and overlayfs")
    sim = make_sim_env(tmp_path / "node")
    run_dir, shim_dir = tmp_path / "run-vgpu", tmp_path / "opt-vgpu"

    def ctl(*args):
        out = subprocess.run([CTL, *map(str, args)], env=sim, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"vgpu-ctl {args}: {out.stderr}"
        return out.stdout

    # the runbook, steps 2-4a
    ctl("install-shim", shim_dir, "--preload-file")
    ctl("create", "train", "--memory", "1Gi", "--sm", "60%", "--dir", run_dir)
    ctl("create", "infer", "--memory", "2Gi", "--sm", "30%", "--dir", run_dir)
    flags = {name: shlex.split(ctl("env", name, "--format", "docker", "--dir", run_dir, "--shim-dir", shim_dir,
                                   *extra))
             for name, extra in (("train", ()), ("infer", ("--ld-so-preload",)))}
    started = []
    try:
        for name in ("train", "infer"):
            started.append(Container(flags[name], sim, tmp_path / f"scratch-{name}"))
        train, infer = started

        # inside: each sees its own slice, loaded from the mounted shim, and cannot raise it
        assert train.hello["total"] == GiB and infer.hello["total"] == 2 * GiB
        assert train.hello["shim"] == infer.hello["shim"] == ["/usr/local/lib/vgpu/libvgpu.so"]
        assert train.hello["ld_preload"] == "/usr/local/lib/vgpu/libvgpu.so"
        assert infer.hello["ld_preload"] is None                  # /etc/ld.so.preload loaded it
        for c in started:
            assert (c.hello["quota_writable"], c.hello["usage_writable"]) == ("EROFS", "yes")

        assert train.alloc(768 * MiB) == SUCCESS
        assert train.alloc(512 * MiB) == OUT_OF_MEMORY            # 1.25 GiB > its 1 GiB
        assert infer.alloc(1536 * MiB) == SUCCESS                 # more than train may have: its own cap
        assert infer.alloc(768 * MiB) == OUT_OF_MEMORY

        # outside: the controller sees both slices and their processes
        status = json.loads(ctl("status", "--json", "--dir", run_dir))
        seen = {c["name"]: (c["devices"][0]["memory_current"], [p["host_pid"] for p in c["processes"]])
                for c in status["containers"]}
        assert seen == {"train": (768 * MiB, [train.hello["pid"]]), "infer": (1536 * MiB, [infer.hello["pid"]])}
    finally:
        for c in started:
            c.stop()
    # nothing was made outside the namespaces
    assert not Path("/usr/local/lib/vgpu").exists() and not Path("/run/vgpu/train").exists()
