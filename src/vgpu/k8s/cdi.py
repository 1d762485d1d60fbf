"""CDI specs: how the container runtime puts a prepared claim's slice into a container.

One spec file per claim (the runtime reads every *.json in the CDI directory), one CDI
device per slice.  Its containerEdits are exactly what `vgpu-ctl env --format docker`
gives: the shim and the quota mounted read-only, the usage file read-write, the shim's
variables (vgpu.runtime is the one place that knows them).
"""
import json
import os

from .. import install, runtime

CDI_VERSION = "1.1.0"
# what the spec's content needs: bind mounts with a type (0.4.0), device names that may
# start with a digit, as share IDs do (0.5.0); a runtime whose CDI library predates 1.1.0
# refuses a 1.1.0 spec, so older versions can be asked for
CDI_VERSIONS = ("0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
CLASS = "slice"


def kind(driver: str) -> str:
    return f"{driver}/{CLASS}"


def device_id(driver: str, name: str) -> str:
    """The fully qualified CDI device name the kubelet hands to the runtime."""
    return f"{kind(driver)}={name}"


def spec_path(cdi_dir: str, driver: str, claim_uid: str) -> str:
    return os.path.join(cdi_dir, f"{driver}-{claim_uid}.json")


def spec(driver: str, name: str, paths: dict, shim: str, preload_file=None, version=CDI_VERSION) -> dict:
    """A CDI spec with one device, `name`, giving a container slice `name`."""
    mounts = [{"hostPath": host, "containerPath": inside, "type": "bind",
               "options": ["bind", "ro" if read_only else "rw", "nosuid", "nodev"]}
              for host, inside, read_only in runtime.mounts(name, paths, shim, preload_file)]
    env = [f"{k}={v}" for k, v in runtime.container_variables(name, preload_file).items()]
    return {"cdiVersion": version, "kind": kind(driver),
            "devices": [{"name": name, "containerEdits": {"env": env, "mounts": mounts}}]}


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
