"""Containers without a container engine: a process in its own mount namespace.

`Container(mounts, env, ...)` runs WORKLOAD with exactly the given bind mounts (read-only
where asked) and variables in an otherwise empty environment, as a runtime would from
`docker run -v/-e` flags or from a CDI spec's containerEdits; simgpu's libraries on
LD_LIBRARY_PATH play the GPU.  Paths that do not exist on this machine (/usr/local/lib/vgpu,
/run/vgpu) are made inside the namespace on an overlay, so nothing outside it changes.
Needs root and mount namespaces: `namespaces_work` says whether this machine has them.
"""
import json
import os
import select
import shlex
import subprocess
import sys

from vgpu.paths import simgpu_dir

SUCCESS, OUT_OF_MEMORY = 0, 2      # what WORKLOAD prints for each allocation (CUresult)
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
slice_dir = os.path.join(os.environ["VGPU_DIR"], os.environ["VGPU_SLICE"])

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
    """WORKLOAD in a mount namespace with `mounts` [(host, path, read_only)] and `env`."""

    def __init__(self, mounts, env, sim_env, scratch):
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
