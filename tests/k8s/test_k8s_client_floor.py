"""The DRA driver on the lowest `kubernetes` client pyproject.toml allows.

The client changed its models at 37 (pydantic, `from_dict`); 34-36 are the older
generator's.  This runs the real agent process against the fake API server with the
lowest allowed release: installed on its own (pip --target, with what that release asks
for) under build/ and kept for later runs, then laid over the test venv on PYTHONPATH --
the client and only those of its dependencies the venv does not satisfy (urllib3 < 2.4,
six, google-auth ...), so the agent's other imports (cffi, grpc, click) stay the venv's.
It publishes, reads a claim to prepare it, and republishes, through its watch, the slice
a starting kubelet deleted.  Without a reachable package index the test is skipped, and
says so.
"""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.k8s.fake_api import FakeApiServer
from tests.helpers.k8s.node import Node
from tests.helpers.paths import ROOT
from tests.helpers.simnode import make_sim_env

LOWEST = "34.1.0"        # the first release of the floor's major version (there is no 34.0.x)
CACHE = ROOT / "build" / f"test-kubernetes-{LOWEST}"
OFFLINE = re.compile(r"NewConnectionError|Temporary failure in name resolution|Network is unreachable|"
                     r"ConnectTimeout|ReadTimeout|ProxyError|Could not fetch URL|No matching distribution found|"
                     r"Failed to establish a new connection|Max retries exceeded")


def floor_major() -> int:
    text = (ROOT / "pyproject.toml").read_text()
    [floor] = re.findall(r'"kubernetes>=(\d+)[^"]*"', text)
    return int(floor)


def lowest_client() -> Path:
    """The release and its dependencies, installed once into build/ (pip --target)."""
    if (CACHE / ".installed").exists():
        return CACHE
    partial = CACHE.with_name(CACHE.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-input",
                          "--disable-pip-version-check", "--retries", "1", "--timeout", "30",
                          "--target", str(partial), f"kubernetes=={LOWEST}"],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        if OFFLINE.search(out.stdout + out.stderr):
            pytest.skip(f"no package index reachable to install kubernetes=={LOWEST}: "
                        f"{(out.stderr.strip().splitlines() or [''])[-1][:200]}")
        raise AssertionError(f"pip could not install kubernetes=={LOWEST}:\n{out.stdout}\n{out.stderr}")
    shutil.rmtree(CACHE, ignore_errors=True)
    partial.rename(CACHE)
    (CACHE / ".installed").touch()
    return CACHE


def overlay(installed: Path, view: Path) -> Path:
    """A directory of links to the installed distributions the running venv cannot stand
    in for: the client itself, and each one the venv lacks or has at a version some
    installed distribution's requirements exclude."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    venv = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    there = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=[str(installed)])}
    wanted = {}
    for d in there.values():
        for text in d.requires or []:
            r = Requirement(text)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                wanted.setdefault(canonicalize_name(r.name), []).append(r.specifier)
    needed = [n for n in there if n == "kubernetes" or n not in venv or
              not all(spec.contains(venv[n], prereleases=True) for spec in wanted.get(n, []))]
    view.mkdir()
    for name in needed:
        for top in {Path(str(f)).parts[0] for f in there[name].files or []} - {"..", "bin", "__pycache__"}:
            if not (view / top).exists():
                (view / top).symlink_to(installed / top)
    return view


def test_the_lowest_tested_client_is_the_floor_of_pyproject():
    assert int(LOWEST.split(".")[0]) == floor_major()


def test_the_agent_publishes_prepares_and_republishes_with_the_lowest_allowed_client(tmp_path):
    view = overlay(lowest_client(), tmp_path / "kubernetes-client")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(view), os.environ.get("PYTHONPATH")]))}
    probe = subprocess.run([sys.executable, "-c", "import cffi, kubernetes, urllib3; from kubernetes import client; "
                            "print(kubernetes.__version__, urllib3.__version__, "
                            "hasattr(client.V1ResourceSlice, 'from_dict'), cffi.__file__)"],
                           env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    version, urllib3_version, from_dict, cffi_file = probe.stdout.split()
    assert (version, from_dict) == (LOWEST, "False"), probe.stderr      # the old models, no from_dict
    assert int(urllib3_version.split(".")[1]) < 4 and not cffi_file.startswith(str(view))   # its urllib3, our cffi
    with FakeApiServer() as api:
        node = Node(tmp_path, api, make_sim_env(tmp_path / "simgpu", profile="a10", devices=2))
        agent = node.start("--rescan", "60s", env=env)
        try:
            [first] = node.published()
            assert [d["name"] for d in first["spec"]["devices"]] == ["gpu-0", "gpu-1"]
            kubelet = node.kubelet()                   # deletes the node's slices: the watch brings it back
            [again] = node.published(timeout=5)
            assert again["metadata"]["uid"] != first["metadata"]["uid"]
            claim = node.claim("old-client")
            answer = kubelet.prepare(claim)[claim[1]]  # the claim is read with the old client
            assert answer.error == "" and kubelet.cdi_devices(claim[1], "gpu") == ["vgpu.dev/slice=old-client-share-0"]
            # consumedCapacity survived the old client's model: the slice holds the claim, not the GPU
            [seen] = node.status()["old-client-share-0"]["devices"]
            assert (seen["memory_max"], seen["sm_max"]) == (4 << 30, 5000)
            assert kubelet.unprepare(claim)[claim[1]].error == ""
            kubelet.close()
        finally:
            assert agent.stop() == 0
        failed = [e for e in agent.events() if e["event"].endswith("_failed")]
        assert not failed, failed
        assert [e["event"] for e in agent.events()].count("resourceslice_created") == 2


def test_the_lowest_allowed_client_keeps_counters_and_mig_devices_and_prepares_a_mig_claim(tmp_path):
    """The 34 models know sharedCounters and consumesCounters (and a slice without
    devices): the agent reads back what it wrote, so it sees no field dropped and keeps
    publishing MIG devices, and a MIG claim read with the old client is prepared."""
    view = overlay(lowest_client(), tmp_path / "kubernetes-client")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(view), os.environ.get("PYTHONPATH")]))}
    with FakeApiServer() as api:
        node = Node(tmp_path, api, make_sim_env(tmp_path / "simgpu", profile="h100-80g"))
        agent = node.start("--rescan", "60s", env=env)
        try:
            deadline = time.monotonic() + 10
            while len(api.slices()) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            slices = {s["metadata"]["name"]: s for s in api.slices()}
            assert sorted(slices) == ["node-a-vgpu.dev-counters-0", "node-a-vgpu.dev-gpu-0"]
            devices = slices["node-a-vgpu.dev-gpu-0"]["spec"]["devices"]
            assert len(devices) == 26 and all(d["consumesCounters"] for d in devices)
            kubelet = node.kubelet(wipe=False)
            claim = node.claim("old-mig", results=[{"device": "gpu-0-mig-3g40gb-0", "share_id": None,
                                                    "memory": None, "sm": None}])
            answer = kubelet.prepare(claim)[claim[1]]
            assert answer.error == "" and kubelet.cdi_devices(claim[1]) == [f"vgpu.dev/mig={claim[1]}"]
            assert kubelet.unprepare(claim)[claim[1]].error == ""
            kubelet.close()
        finally:
            assert agent.stop() == 0
        events = agent.events()
        assert not [e for e in events if e["event"].endswith("_failed") or e["event"] == "resourceslice_fields_dropped"]
        assert [e["event"] for e in events].count("resourceslice_created") == 2
