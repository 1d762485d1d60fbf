"""CDI specs: how the container runtime puts a prepared claim's slice into a container.

One spec file per claim (the runtime reads every *.json in the CDI directory), one CDI
device per slice.  Its containerEdits are exactly what `vgpu-ctl env --format docker`
gives: the shim and the quota mounted read-only, the usage file read-write, the shim's
variables (vgpu.runtime is the one place that knows them).
"""
import json
import os

from .. import install, runtime

# A runtime's CDI library refuses a spec whose cdiVersion it does not know ("invalid
# version") and one whose content needs a later version than it names.  containerd
# 2.0.0-2.0.4 vendor a library that knows up to 0.8.0; containerd 2.0.5-2.2.0 and CRI-O
# 1.33-1.34 one that knows up to 1.0.0.  So by default ("auto") a spec names the lowest
# version its content needs -- what the library's own minimum-required-version check
# computes (min_version): 0.4.0, or 0.5.0 for a share ID starting with a digit -- which
# every library since 0.5 (containerd 1.7.0) accepts.
AUTO = "auto"
CDI_VERSION = AUTO
CDI_VERSIONS = (AUTO, "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")   # what --cdi-version may name
CLASS = "slice"


def kind(driver: str) -> str:
    return f"{driver}/{CLASS}"


def device_id(driver: str, name: str) -> str:
    """The fully qualified CDI device name the kubelet hands to the runtime."""
    return f"{kind(driver)}={name}"


def spec_path(cdi_dir: str, driver: str, claim_uid: str) -> str:
    return os.path.join(cdi_dir, f"{driver}-{claim_uid}.json")


def _key(version: str):
    return tuple(int(p) for p in version.lstrip("v").split("."))


def min_version(spec: dict) -> str:
    """The lowest CDI version whose fields `spec` uses, by the rules of the CDI library's
    minimum-required-version check (newest rule first; 0.3.0 when none applies)."""
    devices = spec.get("devices") or []
    edits = [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in devices]
    rdt = [e["intelRdt"] for e in edits if e.get("intelRdt") is not None]
    if any(e.get("netDevices") for e in edits) or \
            any(r.get("schemata") is not None or r.get("enableMonitoring") for r in rdt):
        return "1.1.0"
    if rdt or any(e.get("additionalGids") for e in edits):
        return "0.7.0"
    vendor_class = spec.get("kind", "").split("/", 1)
    if spec.get("annotations") or any(d.get("annotations") for d in devices) or \
            (len(vendor_class) == 2 and "." in vendor_class[1]):
        return "0.6.0"
    if any(d.get("name", "")[:1].isdigit() for d in devices) or \
            any(n.get("hostPath") for e in edits for n in e.get("deviceNodes") or []):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts") or []):
        return "0.4.0"
    return "0.3.0"


class VersionTooLow(ValueError):
    pass


def spec(driver: str, name: str, paths: dict, shim: str, preload_file=None, version=CDI_VERSION,
         context_overhead=None) -> dict:
    """A CDI spec with one device, `name`, giving a container slice `name`.  version: AUTO
    for the lowest the content needs, else that version (VersionTooLow if the content needs
    a later one: the runtime would refuse the spec).  context_overhead: the node's measured
    context cost (runtime.container_variables)."""
    mounts = [{"hostPath": host, "containerPath": inside, "type": "bind",
               "options": ["bind", "ro" if read_only else "rw", "nosuid", "nodev"]}
              for host, inside, read_only in runtime.mounts(name, paths, shim, preload_file)]
    env = [f"{k}={v}" for k, v in runtime.container_variables(name, preload_file, None, context_overhead).items()]
    out = {"cdiVersion": None, "kind": kind(driver),
           "devices": [{"name": name, "containerEdits": {"env": env, "mounts": mounts}}]}
    return _versioned(out, name, version)


MIG_CLASS = "mig"


def mig_device_id(driver: str, name: str) -> str:
    return f"{driver}/{MIG_CLASS}={name}"


def mig_spec(driver: str, name: str, uuids: list, device_nodes=(), version=CDI_VERSION) -> dict:
    """A CDI spec with one device, `name`, giving a container the MIG devices `uuids`
    (MIG-<uuid>) and nothing else: NVIDIA_VISIBLE_DEVICES for the NVIDIA Container
    Toolkit, which takes MIG UUIDs there, and CUDA_VISIBLE_DEVICES for CUDA itself (so
    the instance is CUDA's device 0 even where the toolkit's CDI device gives every GPU);
    device_nodes: the instances' /dev/nvidia-caps nodes (mig_device_nodes)."""
    visible = ",".join(uuids)
    edits = {"env": [f"NVIDIA_VISIBLE_DEVICES={visible}", f"CUDA_VISIBLE_DEVICES={visible}"]}
    if device_nodes:
        edits["deviceNodes"] = [{"path": p} for p in device_nodes]
    out = {"cdiVersion": None, "kind": f"{driver}/{MIG_CLASS}", "devices": [{"name": name, "containerEdits": edits}]}
    return _versioned(out, name, version)


MIG_MINORS = "/proc/driver/nvidia-caps/mig-minors"


def mig_device_nodes(gpu_minor: int, gpu_instance: int, compute_instance: int, minors_file=MIG_MINORS) -> list:
    """The capability device nodes a process needs to use one MIG device, from the
    driver's table of lines `gpu<minor>/gi<id>/access <n>` and `gpu<minor>/gi<id>/ci<id>/access
    <n>` (device /dev/nvidia-caps/nvidia-cap<n>); [] where the file is absent (simgpu)."""
    try:
        with open(minors_file) as f:
            table = dict(line.split() for line in f if len(line.split()) == 2)
    except OSError:
        return []
    keys = [f"gpu{gpu_minor}/gi{gpu_instance}/access", f"gpu{gpu_minor}/gi{gpu_instance}/ci{compute_instance}/access"]
    return [f"/dev/nvidia-caps/nvidia-cap{table[k]}" for k in keys if k in table]


def _versioned(out: dict, name: str, version) -> dict:
    needed = min_version(out)
    if version != AUTO and _key(version) < _key(needed):
        raise VersionTooLow(f"CDI spec for {name} needs cdiVersion {needed} or later, not {version} "
                            "(--cdi-version)")
    out["cdiVersion"] = needed if version == AUTO else version
    return out


def write(path: str, content: dict):
    """Atomically (the runtime may read the directory at any moment)."""
    directory, name = os.path.split(path)
    os.makedirs(directory, 0o755, exist_ok=True)
    install.place(directory, name, (json.dumps(content, indent=2) + "\n").encode(), 0o644)


def remove(path: str):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
