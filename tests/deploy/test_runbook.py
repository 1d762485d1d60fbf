"""The runbook, end to end, without Docker: two "containers" on one simulated GPU.

Each container is a process in its own mount namespace (`unshare --mount`), given exactly
what `vgpu-ctl env NAME --format docker --shim-dir DIR` says: every `-v HOST:PATH:ro|rw`
becomes a bind mount (read-only where it says ro), every `-e` a variable, in an otherwise
empty environment; `--gpus all` is played by simgpu's libraries on LD_LIBRARY_PATH.
Paths that do not exist on this machine (/usr/local/lib/vgpu, /run/vgpu) are made inside
the namespace on an overlay, so nothing outside it changes (tests/helpers/containers.py).  One container loads the shim
through LD_PRELOAD, the other through /etc/ld.so.preload.  Judged from inside (what CUDA
reports and refuses, what is writable) and from outside (`vgpu-ctl status`).
Needs root and mount namespaces; skipped elsewhere.
"""
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.containers import OUT_OF_MEMORY, SUCCESS, Container, namespaces_work
from tests.helpers.simnode import make_sim_env

GiB, MiB = 1 << 30, 1 << 20
CTL = str(Path(sys.executable).parent / "vgpu-ctl")


def docker_edits(flags):
    """(mounts, env) of `docker run` flags, refusing any the runbook does not promise."""
    mounts, env, it = [], {}, iter(flags)
    for flag in it:
        if flag == "--gpus":
            next(it)                     # simgpu is the GPU: LD_LIBRARY_PATH in the container
        elif flag == "-v":
            host, path, mode = next(it).split(":")
            mounts.append((host, path, mode == "ro"))
        elif flag == "-e":
            k, v = next(it).split("=", 1)
            env[k] = v
        else:
            raise AssertionError(f"a docker flag the runbook did not promise: {flag}")
    return mounts, env


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
            started.append(Container(*docker_edits(flags[name]), sim, tmp_path / f"scratch-{name}"))
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
                for c in status["slices"]}
        assert seen == {"train": (768 * MiB, [train.hello["pid"]]), "infer": (1536 * MiB, [infer.hello["pid"]])}
    finally:
        for c in started:
            c.stop()
    # nothing was made outside the namespaces
    assert not Path("/usr/local/lib/vgpu").exists() and not Path("/run/vgpu/train").exists()
