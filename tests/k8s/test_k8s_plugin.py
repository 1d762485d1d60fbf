"""The DRA node agent end to end: `vgpu-ctl k8s-plugin` as a real process on simgpu,
the kubelet played by tests/helpers/k8s/kubelet.py over unix sockets, the API server faked
at its HTTP boundary (tests/helpers/k8s/fake_api.py) and talked to by the official client.

Judged from outside: what the stand-in gets back, the quota and CDI files on disk,
`vgpu-ctl status`, the ResourceSlice the fake API server received.
"""
import json
import os
import signal
import subprocess
import threading
import time

import pytest
from google.protobuf import unknown_fields

from tests.agent.test_node_agent import CTL
from tests.helpers.containers import OUT_OF_MEMORY, SUCCESS, Container, namespaces_work
from tests.helpers.k8s.cdi import CONTAINERD_2_0, RUNTIMES, Registry, UnresolvableDevices
from tests.helpers.k8s.fake_api import FakeApiServer
from tests.helpers.k8s.kubelet import CALL_TIMEOUT
from tests.helpers.k8s.models import roundtrip
from tests.helpers.k8s.node import DRIVER, NODE, NS, Agent, Node
from tests.helpers.simnode import make_sim_env
from tests.helpers.wait import wait_until
from vgpu.k8s import driver as dra_driver

GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture
def node(tmp_path):
    with FakeApiServer() as api:
        n = Node(tmp_path, api, make_sim_env(tmp_path / "simgpu", profile="a10", devices=2))
        yield n
        n.close()


def cdi_spec(node, uid):
    return json.loads((node.cdi_dir / f"{DRIVER}-{uid}.json").read_text())


# === registration and the ResourceSlice ===

def test_registers_with_the_kubelet_as_a_dra_plugin_of_both_api_versions(node):
    agent = node.start()
    info = node.kubelet().info
    assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, str(node.plugin_dir / "dra.sock"))
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    assert agent.wait_for(lambda e: e["event"] == "registration", "registration")["registered"] is True


def test_publishes_each_gpu_once_with_consumable_memory_and_sm(node):
    node.start()
    deadline = time.monotonic() + 10
    while not node.api.slices() and time.monotonic() < deadline:
        time.sleep(0.05)
    [published] = node.api.slices()
    roundtrip(published)
    spec = published["spec"]
    assert (spec["driver"], spec["nodeName"], spec["pool"]["name"], spec["pool"]["resourceSliceCount"]) == \
        (DRIVER, NODE, NODE, 1)
    assert published["metadata"]["ownerReferences"][0]["kind"] == "Node"
    assert [d["name"] for d in spec["devices"]] == ["gpu-0", "gpu-1"]
    for i, d in enumerate(spec["devices"]):
        assert d["allowMultipleAllocations"] is True
        assert d["attributes"]["index"] == {"int": i}
        assert d["attributes"]["model"]["string"] == "NVIDIA A10"
        assert d["attributes"]["uuid"]["string"].startswith("GPU-")
        assert int(d["capacity"]["memory"]["value"]) == 24 * GiB
        assert d["capacity"]["sm"]["value"] == "100"
        assert d["capacity"]["sm"]["requestPolicy"]["validRange"] == {"min": "1", "max": "100", "step": "1"}
    # unchanged GPUs: later rounds write nothing
    time.sleep(1.0)
    writes = [r for r in node.api.requests if r[0] in ("POST", "PUT", "DELETE")]
    assert len(writes) == 1, writes


# === prepare and unprepare ===

def test_prepare_makes_the_slice_and_cdi_spec_unprepare_removes_both(node):
    node.start()
    kubelet = node.kubelet()
    claim = node.claim("train")
    [(uid, answer)] = kubelet.prepare(claim).items()
    assert answer.error == ""
    [device] = answer.devices
    assert (list(device.request_names), device.pool_name, device.device_name) == (["gpu"], NODE, "gpu-0")
    assert list(device.cdi_device_ids) == [f"{DRIVER}/slice=train-share-0"]

    # the quota is what the scheduler allocated, seen by the controller
    seen = node.status()["train-share-0"]["devices"]
    assert [(d["index"], d["memory_max"], d["sm_max"]) for d in seen] == [(0, 4 * GiB, 5000)]
    [listed] = json.loads(node.ctl("list", "--json"))
    [q] = listed["devices"]
    # the claim is guaranteed (request), SM time may be lent up to 100%, memory is not lent
    assert (q["memory_request"], q["memory_limit"], q["sm_request"], q["sm_limit"]) == (4 * GiB, 4 * GiB, 5000, 10000)

    spec = cdi_spec(node, uid)
    assert (spec["cdiVersion"], spec["kind"]) == ("0.4.0", f"{DRIVER}/slice")   # what a typed mount needs
    [cdev] = spec["devices"]
    assert cdev["name"] == "train-share-0"
    env = dict(e.split("=", 1) for e in cdev["containerEdits"]["env"])
    assert env["VGPU_SLICE"] == env["VGPU_CONTAINER"] == "train-share-0"
    assert env["LD_PRELOAD"] == "/usr/local/lib/vgpu/libvgpu.so"
    mounts = {m["containerPath"]: m for m in cdev["containerEdits"]["mounts"]}
    assert "ro" in mounts["/run/vgpu/train-share-0/quota"]["options"]
    assert "rw" in mounts["/run/vgpu/train-share-0/usage"]["options"]
    for m in mounts.values():
        assert os.path.isfile(m["hostPath"]), m

    assert kubelet.unprepare(claim)[uid].error == ""
    assert not (node.cdi_dir / f"{DRIVER}-{uid}.json").exists()
    assert node.status() == {}
    assert json.loads(node.checkpoint.read_text())["claims"] == {}


def test_a_share_id_as_the_scheduler_makes_it_names_the_slice_and_an_older_cdi_version_is_written(node):
    node.start("--cdi-version", "0.5.0")
    share = "0b7e2c1a-95f4-4d1e-8a3b-5c6d7e8f9a0b"             # a UID: may start with a digit
    claim = node.claim("uid-named", results=[{"device": "gpu-1", "memory": "3Gi", "sm": "25", "share_id": share}])
    [device] = node.kubelet().prepare(claim)[claim[1]].devices
    assert list(device.cdi_device_ids) == [f"{DRIVER}/slice={share}"]
    spec = cdi_spec(node, claim[1])
    assert spec["cdiVersion"] == "0.5.0" and spec["devices"][0]["name"] == share
    seen = node.status()[share]["devices"]
    assert [(d["index"], d["memory_max"], d["sm_max"]) for d in seen] == [(1, 3 * GiB, 2500)]


def test_prepare_twice_gives_the_same_answer_and_unprepare_twice_is_fine(node):
    node.start()
    kubelet = node.kubelet()
    claim = node.claim("infer")
    first = kubelet.prepare(claim)[claim[1]]
    again = kubelet.prepare(claim)[claim[1]]
    assert first == again and first.error == ""
    assert list(node.status()) == ["infer-share-0"]
    assert kubelet.unprepare(claim)[claim[1]].error == ""
    assert kubelet.unprepare(claim)[claim[1]].error == ""


def test_a_restarted_agent_unprepares_what_it_prepared(node):
    agent = node.start()
    claim = node.claim("train")
    assert node.kubelet().prepare(claim)[claim[1]].error == ""
    agent.stop(signal.SIGKILL)                     # no goodbye: sockets and all left behind
    node.api.delete_claim(NS, "train")             # gone from the API: only the checkpoint knows it
    node.start()
    kubelet = node.kubelet()
    again = kubelet.prepare(claim)[claim[1]]       # still prepared, same answer, no API needed
    assert again.error == "" and [d.device_name for d in again.devices] == ["gpu-0"]
    assert kubelet.unprepare(claim)[claim[1]].error == ""
    assert node.status() == {} and not list(node.cdi_dir.glob("*.json"))


def test_clear_errors_for_unknown_claims_wrong_uids_and_a_full_gpu(node):
    node.start()
    kubelet = node.kubelet()
    assert "not found" in kubelet.prepare((NS, "0000-missing", "ghost"))["0000-missing"].error

    ns, uid, name = node.claim("renamed")
    wrong = kubelet.prepare((ns, "1111-old-uid", name))["1111-old-uid"].error
    assert f"has UID {uid}, not 1111-old-uid" in wrong

    big = [{"device": "gpu-1", "memory": "16Gi", "sm": "40"}]
    first, second = node.claim("big-a", results=big), node.claim("big-b", results=big)
    answers = kubelet.prepare(first, second)
    assert answers[first[1]].error == ""
    assert "does not fit" in answers[second[1]].error and "device 1" in answers[second[1]].error
    assert not answers[second[1]].devices
    # the failed claim left nothing behind: no slice, no CDI spec, no checkpoint entry
    assert sorted(node.status()) == ["big-a-share-0"]
    assert sorted(p.name for p in node.cdi_dir.glob("*.json")) == [f"{DRIVER}-{first[1]}.json"]
    assert list(json.loads(node.checkpoint.read_text())["claims"]) == [first[1]]

    other_pool = node.claim("elsewhere", results=[{"device": "gpu-0", "memory": "1Gi", "sm": "10"}], pool="node-b")
    assert "not this node's (node-a)" in kubelet.prepare(other_pool)[other_pool[1]].error

    nowhere = node.claim("nowhere", results=[{"device": "gpu-7", "memory": "1Gi", "sm": "10"}])
    assert "gpu-7 is not on this node (it has gpu-0, gpu-1)" in kubelet.prepare(nowhere)[nowhere[1]].error


def test_a_share_id_already_in_use_is_refused_by_name(node):
    node.start()
    kubelet = node.kubelet()
    node.ctl("create", "taken", "--memory", "1Gi", "--device", "0")      # made by hand
    by_hand = node.claim("x", results=[{"device": "gpu-0", "memory": "1Gi", "sm": "10", "share_id": "taken"}])
    assert "a slice named taken already exists on this node" in kubelet.prepare(by_hand)[by_hand[1]].error
    first = node.claim("y", results=[{"device": "gpu-1", "memory": "1Gi", "sm": "10", "share_id": "twice"}])
    second = node.claim("z", results=[{"device": "gpu-1", "memory": "1Gi", "sm": "10", "share_id": "twice"}])
    answers = kubelet.prepare(first, second)
    assert answers[first[1]].error == ""
    assert f"slice twice already belongs to claim {first[1]}" in answers[second[1]].error
    assert node.status()["taken"]["devices"][0]["memory_max"] == 1 << 30     # untouched


def test_v1beta1_kubelets_are_served_too(node):
    node.start()
    kubelet = node.kubelet(prefer=("v1beta1.DRAPlugin",))
    claim = node.claim("old")
    assert kubelet.prepare(claim)[claim[1]].devices[0].cdi_device_ids == [f"{DRIVER}/slice=old-share-0"]
    assert kubelet.unprepare(claim)[claim[1]].error == ""


def test_a_new_claim_takes_back_the_sm_share_lent_to_a_neighbour(node):
    node.start()
    kubelet = node.kubelet()
    first = node.claim("lender", results=[{"device": "gpu-0", "memory": "2Gi", "sm": "30"}])
    assert kubelet.prepare(first)[first[1]].error == ""
    # what autoscale does for a busy slice: the cap grows, the request stays the claim
    node.ctl("resize", "lender-share-0", "--sm", "80%", "--sm-request", "30%")
    second = node.claim("late", results=[{"device": "gpu-0", "memory": "2Gi", "sm": "60"}])
    assert kubelet.prepare(second)[second[1]].error == ""
    shares = {n: c["devices"][0]["sm_max"] for n, c in node.status().items()}
    assert shares == {"lender-share-0": 3000, "late-share-0": 6000}


def test_give_back_leaves_slices_made_by_hand_alone(node):
    node.start()
    node.ctl("create", "by-hand", "--memory", "2Gi", "--sm", "20%", "--sm-request", "10%", "--device", "0")
    claim = node.claim("dra", results=[{"device": "gpu-0", "memory": "2Gi", "sm": "50"}])
    assert node.kubelet().prepare(claim)[claim[1]].error == ""
    assert node.status()["by-hand"]["devices"][0]["sm_max"] == 2000


# === an agent that died, a node that rebooted ===

def test_a_claim_left_half_prepared_by_a_dead_agent_is_prepared_again(node):
    agent = node.start()
    claim = node.claim("half")
    assert node.kubelet().prepare(claim)[claim[1]].error == ""
    agent.stop(signal.SIGKILL)
    # as the agent leaves it when killed after making the slice, before the CDI spec
    saved = json.loads(node.checkpoint.read_text())
    saved["claims"][claim[1]]["state"] = "preparing"
    node.checkpoint.write_text(json.dumps(saved))
    (node.cdi_dir / f"{DRIVER}-{claim[1]}.json").unlink()
    node.start()
    kubelet = node.kubelet()
    answer = kubelet.prepare(claim)[claim[1]]
    assert answer.error == "" and list(answer.devices[0].cdi_device_ids) == [f"{DRIVER}/slice=half-share-0"]
    assert list(node.status()) == ["half-share-0"] and cdi_spec(node, claim[1])["devices"][0]["name"] == "half-share-0"
    assert json.loads(node.checkpoint.read_text())["claims"][claim[1]]["state"] == "prepared"


def test_after_a_reboot_a_prepared_claim_gets_its_files_back(node):
    agent = node.start()
    claim = node.claim("rebooted")
    first = node.kubelet().prepare(claim)[claim[1]]
    agent.stop(signal.SIGKILL)
    node.ctl("delete", "rebooted-share-0", "--force")           # /run and /var/run are tmpfs: gone
    (node.cdi_dir / f"{DRIVER}-{claim[1]}.json").unlink()
    node.start()
    again = node.kubelet().prepare(claim)[claim[1]]
    assert again == first
    assert list(node.status()) == ["rebooted-share-0"] and cdi_spec(node, claim[1])


# === refusing to start ===

def test_a_corrupt_checkpoint_stops_the_agent_and_is_kept(node):
    node.plugin_dir.mkdir(parents=True)
    node.checkpoint.write_text("{not json")
    agent = Agent(node)
    assert agent.proc.wait(30) == 1
    assert "checkpoint" in agent.log_path.read_text() and "hint:" in agent.log_path.read_text()
    assert node.checkpoint.read_text() == "{not json"


def test_a_second_agent_on_the_same_sockets_is_refused(node):
    node.start()
    second = Agent(node)
    assert second.proc.wait(30) == 1
    assert "in use" in second.log_path.read_text()
    assert node.kubelet().info.name == DRIVER                 # the first one still serves


# === a workload in the container the CDI spec describes ===

def cdi_edits(spec, name):
    """(mounts, env) of CDI device `name`'s containerEdits, as a runtime applies them."""
    [device] = [d for d in spec["devices"] if d["name"] == name]
    edits = device["containerEdits"]
    assert set(edits) <= {"env", "mounts"}, f"edits this test does not apply: {set(edits)}"
    mounts = []
    for m in edits["mounts"]:
        assert m["type"] == "bind" and "bind" in m["options"], m
        mounts.append((m["hostPath"], m["containerPath"], "ro" in m["options"]))
    return mounts, dict(e.split("=", 1) for e in edits["env"])


def test_a_workload_started_with_the_cdi_edits_is_held_to_its_claim(node, tmp_path):
    if not namespaces_work(tmp_path / "probe"):
        pytest.skip("needs root, mount namespaces and overlayfs")
    node.start()
    kubelet = node.kubelet()
    claim = node.claim("pod-a", results=[{"device": "gpu-0", "memory": "1Gi", "sm": "50"}])
    assert kubelet.prepare(claim)[claim[1]].error == ""
    # the IDs the kubelet gives a container naming the claim's request, resolved by the
    # runtime's CDI library; the same edits as the spec's one device
    [cdi_id], edits = kubelet.container((claim[1], "gpu"))
    kind, name = cdi_id.split("=")
    spec = cdi_spec(node, claim[1])
    assert spec["kind"] == kind
    mounts, env = cdi_edits(spec, name)
    assert (edits["env"], len(edits["mounts"])) == ([f"{k}={v}" for k, v in env.items()], len(mounts))
    container = Container(mounts, env, node.env, tmp_path / "scratch")
    try:
        assert container.hello["total"] == GiB                       # cuMemGetInfo shows the claim
        assert container.hello["shim"] == ["/usr/local/lib/vgpu/libvgpu.so"]
        assert (container.hello["quota_writable"], container.hello["usage_writable"]) == ("EROFS", "yes")
        assert container.alloc(768 * MiB) == SUCCESS
        assert container.alloc(512 * MiB) == OUT_OF_MEMORY           # 1.25 GiB > the claim's 1 GiB
        seen = node.status()[name]
        assert seen["devices"][0]["memory_current"] == 768 * MiB
        assert [p["host_pid"] for p in seen["processes"]] == [container.hello["pid"]]
    finally:
        container.stop()
    assert kubelet.unprepare(claim)[claim[1]].error == ""


def test_the_measured_context_cost_goes_into_the_cdi_spec_and_a_bad_measurement_fails_open(node):
    """`vgpu-ctl measure-context` on the node (simgpu's A10 context: 256 MiB): the CDI
    spec sets VGPU_CONTEXT_OVERHEAD, which the shim in the container's pid namespace cannot
    measure.  A measurement file that is not one: the claim is still prepared (the pod
    starts; its shim charges no context), without the variable, and the log says why."""
    node.env["SIMGPU_CONTEXT_OVERHEAD"] = "profile"
    agent = node.start()
    out = node.ctl("measure-context", "--json")
    assert json.loads(out) == {"0": 256 * MiB, "1": 256 * MiB}
    kubelet = node.kubelet()
    claim = node.claim("measured")
    [(uid, answer)] = kubelet.prepare(claim).items()
    assert answer.error == ""
    _, env = cdi_edits(cdi_spec(node, uid), "measured-share-0")
    assert env["VGPU_CONTEXT_OVERHEAD"] == str(256 * MiB)

    (node.slice_dir / ".context-overhead").write_text("{not json")
    claim = node.claim("unmeasured")
    [(uid, answer)] = kubelet.prepare(claim).items()
    assert answer.error == ""
    _, env = cdi_edits(cdi_spec(node, uid), "unmeasured-share-0")
    assert "VGPU_CONTEXT_OVERHEAD" not in env
    e = agent.wait_for(lambda e: e.get("event") == "context_overhead_unread", "the unread measurement", 5)
    assert "is not a measurement" in e["error"] and e["hint"] == "run vgpu-ctl measure-context again"


# === keeping the ResourceSlice current ===

def test_the_slice_follows_gpus_that_appear_and_vanish(tmp_path):
    from vgpu.k8s.plugin_main import api_client
    from vgpu.k8s.resourceslice import Gpu, Publisher
    gpus = [Gpu(0, "NVIDIA H200", "GPU-0", 141 * GiB), Gpu(1, "NVIDIA H200", "GPU-1", 141 * GiB)]
    events = []
    with FakeApiServer() as api:
        api.add_node(NODE)
        publisher = Publisher(api_client(str(api.write_kubeconfig(tmp_path / "kubeconfig"))), NODE, DRIVER,
                              events.append)
        assert publisher.sync(gpus) == "created"
        assert publisher.sync(gpus) == "unchanged"
        assert publisher.sync(gpus[1:]) == "updated"               # gpu-0 fell off the bus
        [published] = api.slices()
        assert [d["name"] for d in published["spec"]["devices"]] == ["gpu-1"]
        assert published["spec"]["pool"]["generation"] == 2
        assert publisher.sync(gpus) == "updated"                   # and came back
        assert api.slices()[0]["spec"]["pool"]["generation"] == 3
    assert [e["event"] for e in events] == ["kubernetes_version", "resourceslice_created", "resourceslice_updated",
                                            "resourceslice_updated"]
    assert events[0] == {"event": "kubernetes_version", "version": "1.37.0", "layout": "counters-apart",
                         "mig_beside_slices": True}


def test_a_server_without_consumable_capacity_is_told_once_not_rewritten_forever(tmp_path):
    from vgpu.k8s.plugin_main import api_client
    from vgpu.k8s.resourceslice import Gpu, Publisher
    gpus = [Gpu(0, "NVIDIA H200", "GPU-0", 141 * GiB)]
    events = []
    with FakeApiServer(consumable_capacity=False) as api:
        publisher = Publisher(api_client(str(api.write_kubeconfig(tmp_path / "kubeconfig"))), NODE, DRIVER,
                              events.append)
        assert publisher.sync(gpus) == "created"
        assert "allowMultipleAllocations" not in api.slices()[0]["spec"]["devices"][0]
        assert [publisher.sync(gpus) for _ in range(3)] == ["unchanged"] * 3
    dropped = [e for e in events if e["event"] == "resourceslice_fields_dropped"]
    assert len(dropped) == 1 and "DRAConsumableCapacity" in dropped[0]["error"]


def test_an_api_server_outage_is_retried_and_prepared_claims_keep_working(node):
    node.api.fail_next("GET", "/apis/resource.k8s.io/v1/resourceslices", 503, times=3)
    agent = node.start()
    failed = agent.wait_for(lambda e: e["event"] == "publish_failed", "publish_failed")
    assert "503" in failed["error"]
    agent.wait_for(lambda e: e["event"] == "resourceslice_created", "resourceslice_created")
    assert len(node.api.slices()) == 1

    kubelet = node.kubelet()
    prepared, new = node.claim("before"), node.claim("during")
    assert kubelet.prepare(prepared)[prepared[1]].error == ""
    node.api.fail_next("*", "/", 503, times=10_000)               # the API server is down
    assert kubelet.prepare(prepared)[prepared[1]].error == ""      # the checkpoint answers
    assert "503" in kubelet.prepare(new)[new[1]].error             # a new claim says why it waits
    assert kubelet.unprepare(prepared)[prepared[1]].error == ""
    assert node.status() == {}


def test_an_unreachable_api_server_is_a_claim_error_and_sigterm_leaves_cleanly(node):
    agent = node.start()
    kubelet = node.kubelet()
    claim = node.claim("lonely")
    node.api.stop()                                            # nothing listens there any more
    error = kubelet.prepare(claim)[claim[1]].error
    assert "reading ResourceClaim team-a/lonely" in error and node.status() == {}
    assert agent.stop(signal.SIGTERM) == 0
    assert agent.events()[-1]["event"] == "stopped"
    assert not node.registration_socket.exists() and not (node.plugin_dir / "dra.sock").exists()
    assert not node.checkpoint.exists()                       # nothing was ever prepared


# === the kubelet's rules: request names, CDI versions, share IDs ===

def test_a_first_available_claim_gives_its_devices_to_the_container_naming_the_main_request(node):
    node.start()
    kubelet = node.kubelet()
    # firstAvailable: "whole" was tried first, "half" got allocated: results say "gpu/half"
    claim = node.claim("prio", results=[{"request": "gpu/half", "tried": ["whole"], "device": "gpu-0",
                                         "memory": "4Gi", "sm": "50"},
                                        {"request": "gpu/half", "device": "gpu-1", "memory": "4Gi", "sm": "50"}])
    devices = kubelet.prepare(claim)[claim[1]].devices
    assert [list(d.request_names) for d in devices] == [["gpu"], ["gpu"]]
    # a container's resources.claims[].request names the main request, matched exactly
    ids, edits = kubelet.container((claim[1], "gpu"))
    assert ids == [f"{DRIVER}/slice=prio-share-0"]             # once, though two devices serve "gpu"
    assert dict(e.split("=", 1) for e in edits["env"])["VGPU_SLICE"] == "prio-share-0"
    assert kubelet.cdi_devices(claim[1]) == ids                # naming only the claim: the same
    assert kubelet.cdi_devices(claim[1], "other") == []
    seen = node.status()["prio-share-0"]["devices"]
    assert [(d["index"], d["memory_max"]) for d in seen] == [(0, 4 * GiB), (1, 4 * GiB)]


def test_the_default_cdi_spec_is_accepted_by_containerd_2_0s_cdi_library(node):
    node.start()                                               # no --cdi-version, as deploy/dra runs it
    kubelet = node.kubelet(runtime=CONTAINERD_2_0)
    uuid_share = "0b7e2c1a-95f4-4d1e-8a3b-5c6d7e8f9a0b"      # the scheduler's share IDs are UUIDs
    named = node.claim("named", results=[{"device": "gpu-0", "memory": "1Gi", "sm": "10"}])
    numbered = node.claim("numbered", results=[{"device": "gpu-1", "memory": "1Gi", "sm": "10",
                                                "share_id": uuid_share}])
    answers = kubelet.prepare(named, numbered)
    assert [answers[c[1]].error for c in (named, numbered)] == ["", ""]
    # the lowest version the content needs: typed mounts (0.4.0); a name starting with a digit (0.5.0)
    assert [cdi_spec(node, c[1])["cdiVersion"] for c in (named, numbered)] == ["0.4.0", "0.5.0"]
    ids, edits = kubelet.container((named[1], "gpu"), (numbered[1], "gpu"))
    assert ids == [f"{DRIVER}/slice=named-share-0", f"{DRIVER}/slice={uuid_share}"]
    assert {dict(e.split("=", 1) for e in edits["env"][i * 5:i * 5 + 5]).get("VGPU_SLICE")
            for i in range(2)} >= {"named-share-0"}
    for runtime in RUNTIMES:                                  # and by every runtime in the table
        assert Registry([node.cdi_dir], runtime).inject(ids), runtime


def test_a_1_1_0_spec_is_refused_by_containerd_2_0_as_its_library_would(node):
    node.start("--cdi-version", "1.1.0")
    claim = node.claim("new", results=[{"device": "gpu-0", "memory": "1Gi", "sm": "10"}])
    old_runtime = node.kubelet(runtime=CONTAINERD_2_0)
    assert old_runtime.prepare(claim)[claim[1]].error == ""
    with pytest.raises(UnresolvableDevices, match=r"unresolvable CDI devices vgpu.dev/slice=new-share-0.*"
                                                  r"invalid version \"1.1.0\""):
        old_runtime.container((claim[1], "gpu"))
    assert Registry([node.cdi_dir], "containerd 2.2.1+").inject([f"{DRIVER}/slice=new-share-0"])


def test_each_device_carries_its_share_id_and_older_kubelets_read_the_rest(node):
    node.start()
    claim = node.claim("shared", results=[{"device": "gpu-0", "memory": "1Gi", "sm": "10", "share_id": "s-0"},
                                          {"device": "gpu-1", "memory": "1Gi", "sm": "10", "share_id": "s-1"}])
    unshared = node.claim("unshared", results=[{"device": "gpu-1", "memory": "1Gi", "sm": "10", "share_id": None}])
    current = node.kubelet()                                  # 1.35+: records share_id
    answers = current.prepare(claim, unshared)
    assert [answers[c[1]].error for c in (claim, unshared)] == ["", ""]
    assert [d["share_id"] for d in current.prepared[claim[1]]] == ["s-0", "s-1"]
    assert [d["share_id"] for d in current.prepared[unshared[1]]] == [None]   # none sent, not ""
    assert not answers[unshared[1]].devices[0].HasField("share_id")
    for old in (node.kubelet(api_level="1.34", wipe=False), node.kubelet(prefer=("v1beta1.DRAPlugin",), wipe=False)):
        [again] = old.prepare(claim).values()                 # field 5 is unknown there: skipped
        assert [(d.pool_name, d.device_name, list(d.request_names), list(d.cdi_device_ids)) for d in again.devices] \
            == [(NODE, "gpu-0", ["gpu"], [f"{DRIVER}/slice=s-0"]), (NODE, "gpu-1", ["gpu"], [])]
        assert "share_id" not in again.devices[0].DESCRIPTOR.fields_by_name
        assert [(f.field_number, f.data) for f in unknown_fields.UnknownFieldSet(again.devices[0])] == [(5, b"s-0")]
        assert [d["share_id"] for d in old.prepared[claim[1]]] == [None, None]


# === keeping the ResourceSlice published ===

def test_a_starting_kubelet_deletes_the_slice_and_it_is_back_within_seconds(node):
    node.start("--rescan", "60s")                             # the rescan is not what brings it back
    [before] = node.published()
    node.kubelet()                                            # deletes the node's slices, then registers
    assert ("DELETE", "/apis/resource.k8s.io/v1/resourceslices", {"fieldSelector": f"spec.nodeName={NODE}"}) \
        in node.api.requests
    [after] = node.published(timeout=5)
    assert after["metadata"]["uid"] != before["metadata"]["uid"]       # a new one, not the old one kept
    assert after["spec"]["devices"] == before["spec"]["devices"]


def test_a_slice_deleted_by_anyone_is_republished_by_the_watch_even_after_api_restarts(node):
    agent = node.start("--rescan", "60s")
    [before] = node.published()
    name = before["metadata"]["name"]
    node.api.delete_slice(name)                               # no kubelet registration involved
    [again] = node.published(timeout=5)
    assert again["metadata"]["uid"] != before["metadata"]["uid"]
    # the API server restarts and forgets the watch history: the agent's watch from its old
    # resourceVersion gets 410 Gone, and it lists and watches afresh
    node.claim("moves-the-resource-version-on")
    node.api.compact()
    seen = len(node.api.requests)
    node.api.stop()
    node.api.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        since = [r for r in node.api.requests[seen:] if r[1] == "/apis/resource.k8s.io/v1/resourceslices"]
        relisted = [i for i, r in enumerate(since) if r[0] == "GET" and "watch" not in r[2]]
        if relisted and any(r[2].get("watch") for r in since[relisted[0]:]):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"no new list and watch after the restart: {node.api.requests[seen:]}")
    node.api.delete_slice(name)
    [third] = node.published(timeout=5)
    assert third["metadata"]["uid"] != again["metadata"]["uid"]
    # the agent logs a creation once the API server answered it: the slice may be seen first
    agent.wait_for(lambda e: e["event"] == "resourceslice_created", "the third creation", count=3)
    assert len([e for e in agent.events() if e["event"] == "resourceslice_created"]) == 3


# === bounded calls ===

def test_a_prepare_batch_answers_within_the_kubelets_deadline_while_the_api_server_hangs(node):
    node.start()
    kubelet = node.kubelet()
    claims = [node.claim(f"slow-{i}") for i in range(3)]
    late = node.claim("late")
    node.api.black_hole()                                     # connections go through, answers never come
    answers, took = {}, {}

    def call(key, *batch, timeout):
        start = time.monotonic()
        answers[key] = kubelet.prepare(*batch, timeout=timeout)
        took[key] = time.monotonic() - start

    batch = threading.Thread(target=call, args=("batch", *claims), kwargs={"timeout": 8})
    batch.start()
    time.sleep(0.5)
    call("late", late, timeout=4)                             # waits for the lock behind the batch
    batch.join()
    assert took["batch"] < 8 and took["late"] < 4, took      # answered, not timed out
    first, *rest = (answers["batch"][c[1]].error for c in claims)
    assert "reading ResourceClaim team-a/slow-0" in first
    assert rest and all("not read: the call's time went to the claims before it" in e for e in rest), rest
    assert "driver was busy" in answers["late"][late[1]].error
    assert dra_driver.CALL_BUDGET + 1 < CALL_TIMEOUT         # with no nearer deadline: within the kubelet's 45 s
    assert node.status() == {} and not json.loads(node.checkpoint.read_text() if node.checkpoint.exists()
                                                   else '{"claims": {}}')["claims"]


def test_a_gpu_with_a_fatal_xid_leaves_the_slice_and_takes_no_new_claim_while_its_neighbour_does(node):
    """XID 48 (double-bit ECC: NVIDIA says reset the GPU) on gpu-1 of two: the agent logs it,
    publishes the slice again without gpu-1 (gpu-0 as it was), and a claim the scheduler put
    on gpu-1 before it knew is refused by name; one on gpu-0 is prepared.  An XID 13 (an
    application's error) on gpu-0 changes nothing but a log line."""
    agent = node.start()
    assert wait_until(lambda: [d["name"] for s in node.api.slices() for d in s["spec"]["devices"]] ==
                      ["gpu-0", "gpu-1"], 10)
    subprocess.run([CTL, "sim", "xid", "0", "13"], env=node.env, check=True, capture_output=True)
    assert agent.wait_for(lambda e: e["event"] == "xid", "xid")["device"] == 0
    subprocess.run([CTL, "sim", "xid", "1", "48"], env=node.env, check=True, capture_output=True)
    bad = agent.wait_for(lambda e: e["event"] == "gpu_unhealthy", "gpu_unhealthy")
    assert bad["device"] == 1 and "XID 48" in bad["reason"]
    assert wait_until(lambda: [d["name"] for s in node.api.slices() for d in s["spec"]["devices"]] == ["gpu-0"], 10)
    [published] = node.api.slices()
    roundtrip(published)
    assert published["spec"]["pool"]["generation"] == 2
    kubelet = node.kubelet()
    sick = node.claim("on-sick", results=({"device": "gpu-1", "memory": "1Gi", "sm": "50"},))
    refused = kubelet.prepare(sick)[sick[1]].error
    assert "device gpu-1 is unhealthy (XID 48: Double Bit ECC Error" in refused, refused
    well = node.claim("on-well", results=({"device": "gpu-0", "memory": "1Gi", "sm": "50"},))
    assert not kubelet.prepare(well)[well[1]].error
    assert [e["device"] for e in agent.events() if e["event"] == "gpu_unhealthy"] == [1]


def test_the_kubelet_s_health_stream_says_a_prepared_claim_s_gpu_turned_unhealthy(node):
    """KEP-4680: the kubelet watches the plugin's NodeWatchResources (dra-health v1alpha1).
    Claims on gpu-0 and gpu-1 prepared and both HEALTHY; XID 95 (uncontained ECC) on gpu-1:
    within 2 s the stream says UNHEALTHY for gpu-1, with the XID in its message, and gpu-0
    stays HEALTHY: what `kubectl describe pod` shows in allocatedResourcesStatus."""
    node.start()
    node.published()
    kubelet = node.kubelet()
    a = node.claim("on-0", results=({"device": "gpu-0", "memory": "1Gi", "sm": "50"},))
    b = node.claim("on-1", results=({"device": "gpu-1", "memory": "1Gi", "sm": "50"},))
    assert not any(r.error for r in kubelet.prepare(a, b).values())
    kubelet.watch_health()
    assert wait_until(lambda: [h for _, _, h, _ in kubelet.health(a[1]) + kubelet.health(b[1])] ==
                      ["HEALTHY", "HEALTHY"], 5), kubelet.devices_health
    t0 = time.monotonic()
    subprocess.run([CTL, "sim", "xid", "1", "95"], env=node.env, check=True, capture_output=True)
    assert wait_until(lambda: kubelet.health(b[1])[0][2] == "UNHEALTHY", 5), kubelet.devices_health
    assert time.monotonic() - t0 <= 2.0
    assert "XID 95: Uncontained ECC error" in kubelet.health(b[1])[0][3]
    assert kubelet.health(a[1]) == [(NODE, "gpu-0", "HEALTHY", "")]
    assert kubelet.health_stream == "open"
