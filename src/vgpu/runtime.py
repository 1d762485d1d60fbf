"""What a container runtime needs to put a program in a slice, and running one here.

The variables are the shim's (VGPU_DIR, VGPU_SLICE, LD_PRELOAD); the mounts give the
container the shim and its quota read-only and its usage file read-write.  Inside the
container the files always live at /run/vgpu/<name>/ and the shim at CONTAINER_SHIM,
wherever they are on the host.

CUDA_DEVICE_ORDER=PCI_BUS_ID makes the container's CUDA device ordinals follow NVML's
(PCI) order, so device N in the quota is the device the controller and NVML call N.  The
snippets assume the container sees the node's GPUs in host order (docker: --gpus all); a
slice's other devices are denied by its quota.

A MIG slice is given its MIG device alone (`visible`: its MIG UUID, as
CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES): CUDA's device 0 is then the instance,
which is the quota's device 0.
"""
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys

CONTAINER_DIR = "/run/vgpu"
CONTAINER_SHIM = "/usr/local/lib/vgpu/libvgpu.so"
# the loader reads it in every process, whatever the environment says (install-shim --preload-file)
CONTAINER_PRELOAD = "/etc/ld.so.preload"
# the slice's name, read by the shim before VGPU_SLICE (so does the node agent, through
# /proc/<pid>/root, to know which container is whose); beside the slices' files
CONTAINER_IDENTITY = "/run/vgpu/.slice"
# the node's share board (board.py), where burst-mode slices see each other's demand
CONTAINER_BOARD = "/run/vgpu/.sm-board"
# limit variables are for the shim's standalone mode; in a slice its quota file rules
_STANDALONE = re.compile(r"(VGPU_MEMORY_LIMIT|VGPU_SM_LIMIT|CUDA_DEVICE_MEMORY_LIMIT|CUDA_DEVICE_SM_LIMIT)(_\d+)?")


def add_preload(existing, shim) -> str:
    """LD_PRELOAD with the shim added in front of what is there (never replacing it): the
    first library to define dlsym wins it, and the shim's must, or programs that look the
    driver up by handle would bypass the caps."""
    entries = [e for e in re.split(r"[: ]", existing or "") if e and e != str(shim)]
    return ":".join([str(shim)] + entries)


def variables(name, directory, shim, visible=None) -> dict:
    # VGPU_CONTAINER: VGPU_SLICE's old name, written too until the next release, for an
    # image that carries an older shim (which reads only it)
    v = {"LD_PRELOAD": str(shim), "VGPU_DIR": str(directory), "VGPU_SLICE": name, "VGPU_CONTAINER": name,
         "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    if visible:
        v.update({"CUDA_VISIBLE_DEVICES": visible, "NVIDIA_VISIBLE_DEVICES": visible})
    return v


def child_environment(base, name, directory, shim, visible=None) -> dict:
    env = {k: v for k, v in base.items() if not _STANDALONE.fullmatch(k)}
    env.update(variables(name, directory, shim, visible))
    env["LD_PRELOAD"] = add_preload(base.get("LD_PRELOAD"), shim)
    return env


# === formats ===

def shell(name, paths, shim, visible=None) -> str:
    """Exports for a shell on this host (the shim goes in front of any LD_PRELOAD)."""
    v = variables(name, os.path.dirname(paths["dir"]), shim, visible)
    lines = [f'export LD_PRELOAD={shlex.quote(v.pop("LD_PRELOAD"))}"${{LD_PRELOAD:+:$LD_PRELOAD}}"']
    lines += [f"export {k}={shlex.quote(val)}" for k, val in v.items()]
    return "\n".join(lines) + "\n"


def mounts(name, paths, shim, preload_file=None) -> list:
    """(host path, container path, read-only) for the shim, quota and usage, the slice's
    identity file (its name, which the shim reads before the environment), the node's
    share board (read-write: every slice's shim writes its own entries), and with
    preload_file (an ld.so.preload naming CONTAINER_SHIM) that file at /etc/ld.so.preload."""
    inside = f"{CONTAINER_DIR}/{name}"
    return [(str(shim), CONTAINER_SHIM, True),
            (paths["quota"], f"{inside}/quota", True),    # the container must not raise its own cap
            (paths["usage"], f"{inside}/usage", False),
            (paths["identity"], CONTAINER_IDENTITY, True),
            (paths["board"], CONTAINER_BOARD, False)] + \
        ([(str(preload_file), CONTAINER_PRELOAD, True)] if preload_file else [])


def container_variables(name, preload_file, visible=None, context_overhead=None) -> dict:
    """The variables inside a container whose files are mounted as `mounts` says.
    context_overhead: a context's memory as measured on the node (overhead.py): in the
    container's own pid namespace the shim cannot measure it (NVML's pids are the host's)."""
    v = variables(name, CONTAINER_DIR, CONTAINER_SHIM, visible)
    if preload_file:   # the loader loads the shim; the image's own LD_PRELOAD stays as it is
        del v["LD_PRELOAD"]
    if context_overhead is not None:
        v["VGPU_CONTEXT_OVERHEAD"] = str(context_overhead)
    return v


def docker(name, paths, shim, preload_file=None, visible=None, context_overhead=None) -> list:
    """`docker run` arguments.  -e LD_PRELOAD replaces an image's own LD_PRELOAD: if the
    image sets one, add CONTAINER_SHIM to it instead (or use preload_file).  A MIG slice:
    --gpus device=<its MIG UUID>."""
    args = ["--gpus", f"device={visible}" if visible else "all"]
    for host, inside, ro in mounts(name, paths, shim, preload_file):
        args += ["-v", f"{host}:{inside}:{'ro' if ro else 'rw'}"]
    for k, v in container_variables(name, preload_file, visible, context_overhead).items():
        args += ["-e", f"{k}={v}"]
    return args


def volume_tag(name) -> str:
    """`name` as a part of a pod volume name (a DNS-1123 label of at most 63 characters):
    slice names may hold capitals, '_' and '.', and be longer; those get a hash suffix so
    two slices never share a tag."""
    tag = re.sub(r"[^a-z0-9-]", "-", name.lower()).strip("-")
    if tag != name or len(tag) > 50:
        tag = f"{tag[:41].rstrip('-')}-{hashlib.sha256(name.encode()).hexdigest()[:8]}".lstrip("-")
    return tag


def k8s(name, paths, shim, preload_file=None, visible=None, context_overhead=None) -> dict:
    """env and volumeMounts for the container, volumes for the pod (hostPath).  The shim's
    volumes are the same for every slice; the quota's and usage's carry the slice's name,
    so containers of one pod in different slices can be merged into one pod spec."""
    tag = volume_tag(name)
    names = ["vgpu-shim", f"vgpu-{tag}-quota", f"vgpu-{tag}-usage", f"vgpu-{tag}-slice", "vgpu-sm-board",
             "vgpu-preload"]
    ms = mounts(name, paths, shim, preload_file)
    return {
        "env": [{"name": k, "value": v}
                for k, v in container_variables(name, preload_file, visible, context_overhead).items()],
        "volumeMounts": [{"name": n, "mountPath": inside, "readOnly": ro}
                         for n, (_, inside, ro) in zip(names, ms)],
        "volumes": [{"name": n, "hostPath": {"path": host, "type": "File"}} for n, (host, _, _) in zip(names, ms)],
    }


# === a small YAML emitter (block style; enough for the k8s snippet, no PyYAML needed) ===

_PLAIN = re.compile(r"[A-Za-z_/.][A-Za-z0-9_./-]*")
_SPECIAL = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}


def _scalar(v) -> str:
    if v is True or v is False:
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, int):
        return str(v)
    s = str(v)
    if _PLAIN.fullmatch(s) and s.lower() not in _SPECIAL:
        return s
    return json.dumps(s)   # a JSON string is a valid double-quoted YAML scalar


def _emit(obj, indent) -> list:
    pad = " " * indent
    lines = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{k}:")
                lines += _emit(v, indent if isinstance(v, list) else indent + 2)
            else:
                lines.append(f"{pad}{k}: {'[]' if v == [] else '{}' if v == {} else _scalar(v)}")
    else:
        for item in obj:
            if isinstance(item, (dict, list)) and item:
                sub = _emit(item, indent + 2)
                lines.append(f"{pad}- {sub[0][indent + 2:]}")
                lines += sub[1:]
            else:
                lines.append(f"{pad}- {_scalar(item)}")
    return lines


def to_yaml(obj, comment=None) -> str:
    head = [f"# {line}" for line in comment.splitlines()] if comment else []
    return "\n".join(head + _emit(obj, 0)) + "\n"


# === run ===

def run_child(argv, env, cgroup=None) -> int:
    """Run argv and return its exit status as a shell reports it (128 + N for signal N).
    SIGTERM/SIGHUP reaching vgpu-ctl are passed on; Ctrl-C already reaches the child
    (same process group), so vgpu-ctl only waits for it to end.  cgroup: a cgroup v2
    directory the child joins before it runs anything (driverlimits.join_cgroup)."""
    from .driverlimits import join_cgroup
    try:
        proc = subprocess.Popen(argv, env=env, preexec_fn=(lambda: join_cgroup(cgroup)) if cgroup else None)
    except subprocess.SubprocessError:   # the cgroup could not be joined: the shim alone holds it
        print(f"warning: {argv[0]}: not in its slice's cgroup {cgroup}: memory held by the shim alone",
              file=sys.stderr)
        proc = subprocess.Popen(argv, env=env)
    forwarded = {signal.SIGTERM: None, signal.SIGHUP: None, signal.SIGINT: None}
    try:
        for sig in forwarded:
            forwarded[sig] = signal.signal(sig, (lambda s, _f: proc.send_signal(s)) if sig != signal.SIGINT
                                           else signal.SIG_IGN)
    except ValueError:
        forwarded = {}   # not the main thread: no handlers
    try:
        rc = proc.wait()
    finally:
        for sig, old in forwarded.items():
            signal.signal(sig, old)
    return 128 - rc if rc < 0 else rc
