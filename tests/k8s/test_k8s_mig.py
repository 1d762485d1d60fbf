"""MIG through the DRA driver: `vgpu-ctl k8s-plugin` as a real process on simgpu's
MIG-capable GPUs, the kubelet stand-in, the fake API server (which applies the API's
partitionable-device rules), and NVML (pynvml in a child process, without the shim) as
the referee of which instances exist.

What is checked: the published pool (counter sets in slices of their own, the whole GPU
and every profile at each placement consuming them) round-trips the client's models and
keeps the API's limits; a MIG claim's prepare makes the instance at the allocated
placement and a CDI spec that gives the container that instance alone, unprepare
destroys it; a restart in between; a pod of class mig.vgpu.dev asking for 3g.40gb through
the resourceclaim controller and scheduler stand-ins; instances made by hand published
as they are and never destroyed; an API server that drops counters gets no MIG devices.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.k8s.controllers import allocate_by_class, instantiate_claims
from tests.helpers.k8s.fake_api import FakeApiServer, _validate_slice_spec
from tests.helpers.k8s.models import roundtrip
from tests.helpers.k8s.node import DRIVER, NODE, NS, Node
from tests.helpers.paths import ROOT
from tests.helpers.simnode import make_sim_env, run_python, start_python
from vgpu.k8s import resourceslice

GiB, MiB = 1 << 30, 1 << 20
EXAMPLE = [d for d in yaml.safe_load_all((ROOT / "deploy/dra/example-pod-mig.yaml").read_text())
           if d and d["kind"] == "ResourceClaimTemplate"][0]["spec"]["spec"]["devices"]["requests"][0]["exactly"]
CLASSES = {d["metadata"]["name"]: d for d in yaml.safe_load_all((ROOT / "deploy/dra/deviceclass.yaml").read_text())
           if d}

NVML_STATE = """
import json, pynvml as n
n.nvmlInit()
out = []
for i in range(n.nvmlDeviceGetCount()):
    h = n.nvmlDeviceGetHandleByIndex(i)
    mode = n.nvmlDeviceGetMigMode(h)[0]
    migs = []
    if mode == 1:
        for k in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
            except n.NVMLError:
                continue
            gi = n.nvmlDeviceGetGpuInstanceById(h, n.nvmlDeviceGetGpuInstanceId(m))
            info = n.nvmlGpuInstanceGetInfo(gi)
            uuid = n.nvmlDeviceGetUUID(m)
            migs.append({"uuid": uuid.decode() if isinstance(uuid, bytes) else uuid, "gi": info.id,
                         "profile_id": info.profileId, "start": info.placement.start, "size": info.placement.size,
                         "memory": n.nvmlDeviceGetMemoryInfo(m).total})
    out.append({"mig_mode": mode, "instances": migs})
print(json.dumps(out))
"""

MAKE_BY_HAND = """
import ctypes, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
n.nvmlDeviceSetMigMode(h, n.NVML_DEVICE_MIG_ENABLE)
gi = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 14, ctypes.byref(n.c_nvmlGpuInstancePlacement_t(0, 2)))
ci = n.nvmlGpuInstanceCreateComputeInstance(gi, 1)
print(n.nvmlGpuInstanceGetInfo(gi).id)
"""


def nvml_state(env):
    return json.loads(run_python(NVML_STATE, env).stdout)


@pytest.fixture
def mig_node(tmp_path, request):
    profile, devices = getattr(request, "param", ("h100-80g", 1))
    with FakeApiServer() as api:
        n = Node(tmp_path, api, make_sim_env(tmp_path / "simgpu", profile=profile, devices=devices))
        yield n
        n.close()


def mig_claim(node, name, device):
    """A claim allocated one MIG device (no shareID and no capacity: a device of its own)."""
    return node.claim(name, results=[{"device": device, "share_id": None, "memory": None, "sm": None}])


def pool(node):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        slices = node.published()
        if len(slices) == slices[0]["spec"]["pool"]["resourceSliceCount"]:
            return {s["metadata"]["name"]: s for s in slices}
        time.sleep(0.05)
    raise AssertionError("the pool stayed incomplete")


def devices_of(slices):
    return {d["name"]: d for s in slices.values() for d in s["spec"].get("devices") or []}


def container_env(kubelet, uid):
    _, edits = kubelet.container((uid, ""))
    return dict(e.split("=", 1) for e in edits.get("env") or [])


# === what is published ===

def test_the_pool_of_a_mig_gpu_holds_counters_apart_and_every_profile_at_each_placement_consuming_them(mig_node):
    agent = mig_node.start()
    slices = pool(mig_node)
    assert sorted(slices) == [f"{NODE}-{DRIVER}-counters-0", f"{NODE}-{DRIVER}-gpu-0"]
    for s in slices.values():
        roundtrip(s)
        assert _validate_slice_spec(s["spec"]) == []
    assert resourceslice.check_limits(list(slices.values())) == []
    [counter_set] = slices[f"{NODE}-{DRIVER}-counters-0"]["spec"]["sharedCounters"]
    total = {k: int(v["value"]) for k, v in counter_set["counters"].items()}
    assert total == {**{f"memory-slice-{i}": 1 for i in range(8)}, "compute-slices": 7, "1g10gbme-instances": 1}
    devices = devices_of(slices)
    # the whole GPU consumes everything; 7+7+4+3+2+1+1 profile placements of an H100
    whole = devices.pop("gpu-0")
    assert whole["attributes"]["type"] == {"string": "gpu"} and whole["allowMultipleAllocations"] is True
    assert {k: int(v["value"]) for k, v in whole["consumesCounters"][0]["counters"].items()} == total
    assert len(devices) == 25
    three = devices["gpu-0-mig-3g40gb-4"]
    assert three["attributes"]["type"] == {"string": "mig"} and three["attributes"]["profile"] == {"string": "3g.40gb"}
    assert (three["attributes"]["placementStart"], three["attributes"]["placementSize"]) == ({"int": 4}, {"int": 4})
    assert int(three["capacity"]["memory"]["value"]) == int(39.5 * GiB)
    assert {k: int(v["value"]) for k, v in three["consumesCounters"][0]["counters"].items()} == \
        {"memory-slice-4": 1, "memory-slice-5": 1, "memory-slice-6": 1, "memory-slice-7": 1, "compute-slices": 3}
    assert devices["gpu-0-mig-1g10gbme-2"]["consumesCounters"][0]["counters"]["1g10gbme-instances"] == {"value": "1"}
    assert agent.wait_for(lambda e: e["event"] == "serving", "serving")["mig"] == {"gpu-0": "dynamic"}


def test_eight_mig_gpus_fit_the_api_limits_in_nine_slices_and_round_trip_the_client_models(tmp_path):
    out = run_python("from vgpu import mig; import json; print(json.dumps(mig.profiles(0)))",
                     make_sim_env(tmp_path / "simgpu", profile="a100-40g", devices=8))
    table = json.loads(out.stdout)
    profiles = tuple(resourceslice.MigProfile(p["name"], p["id"], p["slices"], p["memory_mib"] * MiB,
                                              p["multiprocessors"], p["instances"],
                                              tuple(tuple(x) for x in p["placements"])) for p in table["profiles"])
    gpus = [resourceslice.Gpu(i, "NVIDIA A100-SXM4-40GB", f"GPU-{i}", 40 * GiB, profiles) for i in range(9)]
    slices = resourceslice.resource_slices(NODE, DRIVER, gpus, 3)
    # 9 GPUs: two counter slices (8 sets at most each), a device slice per GPU
    assert [len(s["spec"].get("sharedCounters") or []) for s in slices[:2]] == [8, 1]
    assert all(len(s["spec"]["devices"]) == 26 for s in slices[2:]) and len(slices) == 11
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {11}
    for s in slices:
        roundtrip(s)
        assert _validate_slice_spec(s["spec"]) == [], s["metadata"]["name"]
    assert resourceslice.check_limits(slices) == []
    # the limits are the API's: a ninth counter set in one slice, or devices beside counters, are refused
    bad = json.loads(json.dumps(slices[0]))
    bad["spec"]["sharedCounters"] += slices[1]["spec"]["sharedCounters"]
    assert any("at most 8" in p for p in _validate_slice_spec(bad["spec"]))
    assert any("at most 8" in p for p in resourceslice.check_limits([bad]))
    bad["spec"]["devices"] = slices[2]["spec"]["devices"]
    assert any("only one of" in p for p in _validate_slice_spec(bad["spec"]))
    assert any("only one of" in p for p in resourceslice.check_limits([bad]))


def test_an_api_server_without_partitionable_devices_gets_whole_gpus_only(tmp_path):
    with FakeApiServer(partitionable_devices=False) as api:
        node = Node(tmp_path, api, make_sim_env(tmp_path / "simgpu", profile="h100-80g"))
        agent = node.start()
        try:
            agent.wait_for(lambda e: e["event"] == "resourceslice_fields_dropped" and
                           "DRAPartitionableDevices" in e["error"], "counters dropped")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                slices = node.published()
                if [d["name"] for s in slices for d in s["spec"].get("devices") or []] == ["gpu-0"]:
                    break
                time.sleep(0.05)
            [only] = slices
            assert only["metadata"]["name"] == f"{NODE}-{DRIVER}" and not only["spec"].get("sharedCounters")
        finally:
            agent.stop()


# === prepare and unprepare ===

def test_prepare_creates_the_instance_at_the_allocated_placement_and_unprepare_destroys_it(mig_node):
    mig_node.start()
    pool(mig_node)
    kubelet = mig_node.kubelet()
    claim = mig_claim(mig_node, "isolated", "gpu-0-mig-3g40gb-4")
    answer = kubelet.prepare(claim)[claim[1]]
    assert answer.error == ""
    [device] = answer.devices
    assert (device.device_name, list(device.cdi_device_ids)) == ("gpu-0-mig-3g40gb-4", [f"{DRIVER}/mig={claim[1]}"])
    [gpu] = nvml_state(mig_node.env)
    assert gpu["mig_mode"] == 1
    [inst] = gpu["instances"]
    assert (inst["profile_id"], inst["start"], inst["size"]) == (9, 4, 4)
    # the container is given that instance and nothing else
    env = container_env(kubelet, claim[1])
    assert env["NVIDIA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == inst["uuid"]
    assert inst["uuid"].startswith("MIG-")
    seen = run_python("""
from cuda.bindings import driver as d
assert d.cuInit(0)[0] == 0
print(d.cuDeviceGetCount()[1], d.cuDeviceTotalMem(d.cuDeviceGet(0)[1])[1])
""", {**mig_node.env, "CUDA_VISIBLE_DEVICES": env["CUDA_VISIBLE_DEVICES"]}).stdout.split()
    assert [int(x) for x in seen] == [1, inst["memory"]]
    assert kubelet.unprepare(claim)[claim[1]].error == ""
    [gpu] = nvml_state(mig_node.env)
    assert gpu == {"mig_mode": 0, "instances": []}       # it turned MIG mode on, and off again
    assert not (mig_node.cdi_dir / f"{DRIVER}-{claim[1]}.json").exists()
    assert json.loads(mig_node.checkpoint.read_text())["claims"] == {}
    assert kubelet.unprepare(claim)[claim[1]].error == ""


def test_a_prepared_mig_claim_is_ready_in_its_status_naming_its_instance(mig_node):
    mig_node.start("--claim-status-interval", "200ms")
    pool(mig_node)
    claim = mig_claim(mig_node, "isolated", "gpu-0-mig-3g40gb-4")
    assert mig_node.kubelet().prepare(claim)[claim[1]].error == ""
    [inst] = nvml_state(mig_node.env)[0]["instances"]
    deadline = time.monotonic() + 20
    while not (entries := (mig_node.api.claim(NS, "isolated").get("status") or {}).get("devices")):
        assert time.monotonic() < deadline, "no status.devices entry"
        time.sleep(0.05)
    [entry] = entries
    assert entry["device"] == "gpu-0-mig-3g40gb-4"
    assert entry["data"]["mig"] == {"uuid": inst["uuid"], "profile": "3g.40gb", "placement": 4,
                                    "gpu_instance": inst["gi"]}
    assert entry["data"]["memory.max"] == inst["memory"]
    [ready] = entry["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "MigInstancePrepared")
    assert ready["message"] == f"MIG device {inst['uuid']}"


def test_a_restart_between_prepare_and_unprepare_destroys_the_instance_it_made(mig_node):
    agent = mig_node.start()
    pool(mig_node)
    kubelet = mig_node.kubelet()
    claim = mig_claim(mig_node, "survives", "gpu-0-mig-2g20gb-2")
    first = kubelet.prepare(claim)[claim[1]]
    assert first.error == ""
    [inst] = nvml_state(mig_node.env)[0]["instances"]
    agent.stop(signal.SIGKILL)
    mig_node.start()
    # still published as the driver's own (dynamic), not as an instance made by hand
    devices = devices_of(pool(mig_node))
    assert "gpu-0-mig-2g20gb-2" in devices and not any("-gi" in n for n in devices)
    again = mig_node.kubelet(wipe=False)
    assert again.prepare(claim)[claim[1]] == first               # answered from the checkpoint
    assert nvml_state(mig_node.env)[0]["instances"] == [inst]    # no second instance
    assert again.unprepare(claim)[claim[1]].error == ""
    assert nvml_state(mig_node.env)[0] == {"mig_mode": 0, "instances": []}


def test_unprepare_is_refused_while_a_process_holds_the_instance_and_done_once_it_is_gone(mig_node):
    mig_node.start()
    pool(mig_node)
    kubelet = mig_node.kubelet()
    claim = mig_claim(mig_node, "busy", "gpu-0-mig-1g10gb-0")
    assert kubelet.prepare(claim)[claim[1]].error == ""
    env = container_env(kubelet, claim[1])
    holder = start_python("""
import sys
from cuda.bindings import driver as d
assert d.cuInit(0)[0] == 0
err, ctx = d.cuDevicePrimaryCtxRetain(d.cuDeviceGet(0)[1])
assert err == 0 and d.cuCtxSetCurrent(ctx)[0] == 0
print("ready", flush=True); sys.stdin.read()
""", {**mig_node.env, "CUDA_VISIBLE_DEVICES": env["CUDA_VISIBLE_DEVICES"]})
    try:
        assert holder.stdout.readline().strip() == "ready"
        error = kubelet.unprepare(claim)[claim[1]].error
        assert "in use" in error and str(holder.pid) in error
        assert len(nvml_state(mig_node.env)[0]["instances"]) == 1
    finally:
        holder.kill()
        holder.wait()
    assert kubelet.unprepare(claim)[claim[1]].error == ""
    assert nvml_state(mig_node.env)[0]["instances"] == []


@pytest.mark.parametrize("mig_node", [("a100-40g", 1)], indirect=True)
def test_a_claim_on_a_placement_already_taken_gets_an_error_and_leaves_nothing_behind(mig_node):
    mig_node.start()
    pool(mig_node)
    kubelet = mig_node.kubelet()
    first = mig_claim(mig_node, "first", "gpu-0-mig-3g20gb-0")
    assert kubelet.prepare(first)[first[1]].error == ""
    overlapping = mig_claim(mig_node, "second", "gpu-0-mig-2g10gb-2")   # memory slices 2-3: inside 0:4
    error = kubelet.prepare(overlapping)[overlapping[1]].error
    assert "no room for 2g.10gb" in error, error
    assert len(nvml_state(mig_node.env)[0]["instances"]) == 1
    assert list(json.loads(mig_node.checkpoint.read_text())["claims"]) == [first[1]]
    assert not (mig_node.cdi_dir / f"{DRIVER}-{overlapping[1]}.json").exists()


# === a pod through the control-plane stand-ins ===

def pod_with_template(api, name, exactly):
    """A ResourceClaimTemplate `name` with one request `gpu`, and pod `pod-<name>` using it
    (the template is stored as the API server would have it after a create)."""
    tmpl = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}}
    roundtrip(tmpl)
    api._templates[(NS, name)] = tmpl
    api.put_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pod-{name}", "namespace": NS},
                 "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": name}],
                          "containers": [{"name": "c", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}]}})

@pytest.mark.parametrize("mig_node", [("h100-80g", 2)], indirect=True)
def test_a_pod_of_class_mig_asking_for_3g40gb_gets_its_own_instance_and_whole_gpus_and_mig_never_share(mig_node):
    mig_node.start()
    pool(mig_node)
    kubelet = mig_node.kubelet()
    api = mig_node.api
    # a software slice first: the scheduler stand-in puts it on gpu-0, whose counters it then holds
    for name, request in (("soft", {"deviceClassName": "gpu.vgpu.dev", "capacity": {"requests": {"memory": "4Gi"}}}),
                          ("iso", EXAMPLE)):     # deploy/dra/example-pod-mig.yaml's request
        pod_with_template(api, name, request)
    answers = {}
    for name in ("soft", "iso"):
        [claim] = instantiate_claims(api, NS, f"pod-{name}")
        stored = allocate_by_class(api, NS, claim["metadata"]["name"], NODE, CLASSES)
        [result] = stored["status"]["allocation"]["devices"]["results"]
        ref = (NS, stored["metadata"]["uid"], stored["metadata"]["name"])
        answers[name] = (result["device"], kubelet.prepare(ref)[ref[1]], ref)
    assert answers["soft"][0] == "gpu-0"
    device, answer, ref = answers["iso"]
    assert device == "gpu-1-mig-3g40gb-0" and answer.error == ""     # not on gpu-0: its counters are held
    state = nvml_state(mig_node.env)
    assert state[0] == {"mig_mode": 0, "instances": []}
    [inst] = state[1]["instances"]
    assert (inst["profile_id"], inst["start"], inst["memory"]) == (9, 0, int(39.5 * GiB))
    assert container_env(kubelet, ref[1])["CUDA_VISIBLE_DEVICES"] == inst["uuid"]
    # a second 3g.40gb fits on gpu-1 at placement 4; a third fits nowhere
    for i, expected in ((2, "gpu-1-mig-3g40gb-4"), (3, None)):
        pod_with_template(api, f"iso{i}", EXAMPLE)
        [claim] = instantiate_claims(api, NS, f"pod-iso{i}")
        if expected is None:
            with pytest.raises(AssertionError, match="no device"):
                allocate_by_class(api, NS, claim["metadata"]["name"], NODE, CLASSES)
        else:
            stored = allocate_by_class(api, NS, claim["metadata"]["name"], NODE, CLASSES)
            assert stored["status"]["allocation"]["devices"]["results"][0]["device"] == expected
    # kubectl vgpu describe node: each GPU once, its allocated MIG devices under it
    out = subprocess.run([str(Path(sys.executable).parent / "kubectl-vgpu"), "describe", "node", NODE],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "KUBECONFIG": str(mig_node.tmp / "kubeconfig")})
    assert out.returncode == 0, out.stderr
    entries = [line.strip() for line in out.stdout.splitlines() if line.startswith("  ") and
               not line.startswith("   ")]
    assert entries == ["gpu-0:", "gpu-1:"], out.stdout
    gpu0, gpu1 = out.stdout.split("  gpu-1:")
    assert "MIG instances:    <none>" in gpu0 and "4Gi handed out" in gpu0
    assert "MIG instances:    gpu-1-mig-3g40gb-0, gpu-1-mig-3g40gb-4" in gpu1
    assert kubelet.unprepare(ref)[ref[1]].error == ""
    assert nvml_state(mig_node.env)[1] == {"mig_mode": 0, "instances": []}


# === instances made by hand ===

def test_instances_made_by_hand_are_published_as_they_are_and_never_destroyed(mig_node):
    gi = int(run_python(MAKE_BY_HAND, mig_node.env).stdout)
    agent = mig_node.start()
    slices = pool(mig_node)
    [only] = slices.values()              # no counters: nothing is made on this GPU
    assert only["metadata"]["name"] == f"{NODE}-{DRIVER}" and not only["spec"].get("sharedCounters")
    [dev] = only["spec"]["devices"]       # no whole-GPU device either: the GPU is in MIG mode
    assert dev["name"] == f"gpu-0-mig-gi{gi}" and dev["attributes"]["profile"] == {"string": "2g.20gb"}
    assert (dev["attributes"]["type"], dev["attributes"]["gpuInstance"]) == ({"string": "mig"}, {"int": gi})
    assert "consumesCounters" not in dev
    roundtrip(only)
    assert agent.wait_for(lambda e: e["event"] == "serving", "serving")["mig"] == {"gpu-0": "static"}
    kubelet = mig_node.kubelet()
    claim = mig_claim(mig_node, "by-hand", dev["name"])
    assert kubelet.prepare(claim)[claim[1]].error == ""
    [inst] = nvml_state(mig_node.env)[0]["instances"]
    assert container_env(kubelet, claim[1])["CUDA_VISIBLE_DEVICES"] == inst["uuid"]
    assert kubelet.unprepare(claim)[claim[1]].error == ""
    assert nvml_state(mig_node.env)[0]["instances"] == [inst]     # still there, MIG mode still on


def test_an_instance_made_by_an_agent_that_died_before_recording_it_is_destroyed_on_the_retry(mig_node):
    """The checkpoint names the placement before the instance exists: an agent killed
    between making it and recording it leaves an entry in state preparing with the
    placement and no instance (staged here from a prepared claim, as the file would be)."""
    agent = mig_node.start()
    pool(mig_node)
    kubelet = mig_node.kubelet()
    claim = mig_claim(mig_node, "half-done", "gpu-0-mig-4g40gb-0")
    assert kubelet.prepare(claim)[claim[1]].error == ""
    [made] = nvml_state(mig_node.env)[0]["instances"]
    agent.stop(signal.SIGKILL)
    data = json.loads(mig_node.checkpoint.read_text())
    entry = data["claims"][claim[1]]
    assert entry["mig_intent"] == [{"gpu_uuid": entry["mig"][0]["gpu_uuid"], "device": 0, "profile_id": 5,
                                    "start": 0}]
    entry["state"], entry["mig"] = "preparing", []
    mig_node.checkpoint.write_text(json.dumps(data))
    mig_node.start()
    devices = devices_of(pool(mig_node))
    assert "gpu-0-mig-4g40gb-0" in devices and not any("-gi" in n for n in devices)   # still the driver's
    again = mig_node.kubelet(wipe=False)
    assert again.prepare(claim)[claim[1]].error == ""
    [now] = nvml_state(mig_node.env)[0]["instances"]          # the leftover went, one instance was made
    assert (now["profile_id"], now["start"]) == (5, 0) and now["uuid"] != made["uuid"]
    assert again.unprepare(claim)[claim[1]].error == ""
    assert nvml_state(mig_node.env)[0] == {"mig_mode": 0, "instances": []}


def test_a_software_slice_is_refused_on_a_gpu_left_in_mig_mode(mig_node):
    run_python("import pynvml as n; n.nvmlInit(); "
               "n.nvmlDeviceSetMigMode(n.nvmlDeviceGetHandleByIndex(0), n.NVML_DEVICE_MIG_ENABLE)", mig_node.env)
    mig_node.start()
    assert "gpu-0" in devices_of(pool(mig_node))        # no instance on it: still published whole and partitioned
    kubelet = mig_node.kubelet()
    claim = mig_node.claim("soft", results=[{"device": "gpu-0", "memory": "4Gi", "sm": "50"}])
    error = kubelet.prepare(claim)[claim[1]].error
    assert "is in MIG mode" in error, error
    assert mig_node.status() == {}


def test_the_capability_nodes_of_an_instance_come_from_the_drivers_mig_minors_table(tmp_path):
    # the table's shape as the MIG user guide's "Device Nodes and Capabilities" shows it
    table = tmp_path / "mig-minors"
    table.write_text("config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\ngpu0/gi9/access 66\n"
                     "gpu0/gi9/ci0/access 67\ngpu1/gi9/access 201\ngpu1/gi9/ci0/access 202\n")
    from vgpu.k8s import cdi
    assert cdi.mig_device_nodes(0, 9, 0, table) == ["/dev/nvidia-caps/nvidia-cap66", "/dev/nvidia-caps/nvidia-cap67"]
    assert cdi.mig_device_nodes(1, 9, 0, table) == ["/dev/nvidia-caps/nvidia-cap201", "/dev/nvidia-caps/nvidia-cap202"]
    assert cdi.mig_device_nodes(0, 9, 0, tmp_path / "absent") == []       # simgpu: no such file
    spec = cdi.mig_spec(DRIVER, "0b7e2c1a-claim", ["MIG-abc"], cdi.mig_device_nodes(0, 9, 0, table))
    assert spec["kind"] == f"{DRIVER}/mig" and spec["cdiVersion"] == "0.5.0"     # a name starting with a digit
    assert spec["devices"][0]["containerEdits"] == {
        "env": ["NVIDIA_VISIBLE_DEVICES=MIG-abc", "CUDA_VISIBLE_DEVICES=MIG-abc"],
        "deviceNodes": [{"path": "/dev/nvidia-caps/nvidia-cap66"}, {"path": "/dev/nvidia-caps/nvidia-cap67"}]}
