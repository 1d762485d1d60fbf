"""Live figures in ResourceClaim.status.devices[], written by `vgpu-ctl k8s-plugin` itself (a
real process on simgpu) into the fake API server under the RBAC of deploy/dra/rbac.yaml;
and the pod labels DRA-made slices carry in `vgpu-ctl status` and in the metrics.
"""
import json
import subprocess
import time
import urllib.request
import uuid

import pytest
import yaml

from tests.helpers import exposition
from tests.helpers.k8s.fake_api import FakeApiServer, allocated_claim
from tests.helpers.k8s.node import CTL, DRIVER, NODE, NS, Node
from tests.helpers.paths import ROOT
from tests.helpers.simnode import make_sim_env
from tests.helpers.wait import wait_until
from vgpu import metrics, podlabels, slices
from vgpu.k8s import claimstatus

GiB = 1 << 30
SA = "system:serviceaccount:vgpu-system:vgpu-dra-plugin"


def shipped_rules():
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/dra/rbac.yaml").read_text()) if d]
    [role] = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "vgpu-dra-plugin"]
    return role["rules"]


def plugin_node(tmp_path, api, rules, node=NODE, token="plugin-token"):
    """A Node whose agent talks to the API server as the plugin's service account, with the
    node name bound into its token, under `rules`."""
    api.add_user(token, SA, node=node, rules=rules)
    n = Node(tmp_path, api, make_sim_env(tmp_path / "simgpu", profile="a10", devices=2))
    # the agent's own identity (the kubelet stand-in keeps the admin's kubeconfig)
    n.args += ["--kubeconfig", str(api.write_user_kubeconfig(tmp_path / "plugin-kubeconfig", token))]
    _NODES.append(n)
    return n


_NODES = []   # every node a test made: its agents are stopped when the test ends, pass or fail


@pytest.fixture(autouse=True)
def _stop_nodes():
    yield
    while _NODES:
        _NODES.pop().close()


def pod_claim(node, name, pod="train-0", container="train", memory="4Gi", sm="50"):
    share = str(uuid.uuid4())
    obj = allocated_claim(NS, name, DRIVER, NODE, [{"request": "gpu", "device": "gpu-0", "share_id": share,
                                                    "memory": memory, "sm": sm}])
    obj["metadata"]["annotations"] = {"vgpu.dev/container": container,
                                      "resource.kubernetes.io/pod-claim-name": f"vgpu-{container}"}
    obj["status"]["reservedFor"] = [{"resource": "pods", "name": pod, "uid": str(uuid.uuid4())}]
    stored = node.api.put_claim(obj)
    return (NS, stored["metadata"]["uid"], name), share


def our_entries(api, name):
    claim = api.claim(NS, name)
    return [d for d in (claim.get("status") or {}).get("devices") or [] if d["driver"] == DRIVER]


@pytest.fixture
def api():
    with FakeApiServer() as a:
        yield a


def test_the_agent_writes_each_claims_figures_into_its_status_under_the_shipped_rbac(tmp_path, api):
    node = plugin_node(tmp_path, api, shipped_rules())
    agent = node.start("--claim-status-interval", "200ms")
    kubelet = node.kubelet()
    claim, share = pod_claim(node, "train-0-vgpu-train-abcde")
    [(uid, answer)] = kubelet.prepare(claim).items()
    assert answer.error == ""
    [entry] = wait_until(lambda: our_entries(api, claim[2]), 20, "status.devices entry")
    assert (entry["pool"], entry["device"], entry["shareID"]) == (NODE, "gpu-0", share)
    data = entry["data"]
    assert data["slice"] == share
    assert (data["memory.max"], data["memory.current"], data["sm.max"]) == (4 * GiB, 0, 50)
    assert (data["oom.refusals"], data["throttled.seconds"], data["processes"]) == (0, 0, [])
    assert data["memory.driver"] == 0          # NVML (simgpu's) answers: no process holds GPU memory yet
    # who holds the cap: no container has run yet, so no cgroup the node agent could limit
    assert (data["memory.layer"], data["memory.layer.why"]) == ("shim", "no cgroup of its own")
    [ready] = entry["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "SlicePrepared")
    # the claim is otherwise as the scheduler left it: allocation and reservedFor untouched
    stored = api.claim(NS, claim[2])
    assert stored["status"]["allocation"]["devices"]["results"][0]["shareID"] == share
    assert stored["status"]["reservedFor"][0]["name"] == "train-0"
    # nothing changes: nothing more is written
    writes = lambda: [r for r in api.requests if r[0] == "PATCH" and r[1].endswith("/status")]   # noqa: E731
    n = len(writes())
    time.sleep(1.0)
    assert len(writes()) == n
    # memory in use changes the figures: written again, within the interval
    slice_dir = node.slice_dir
    from tests.helpers.simnode import write_usage_counters
    write_usage_counters(slice_dir, share, 0, memory_current=GiB, oom_refusals=2)
    wait_until(lambda: our_entries(api, claim[2])[0]["data"].get("memory.current") == GiB, 20, "memory.current 1Gi")
    assert our_entries(api, claim[2])[0]["data"]["oom.refusals"] == 2
    assert our_entries(api, claim[2])[0]["conditions"][0]["lastTransitionTime"] == ready["lastTransitionTime"]
    assert not [e for e in agent.events() if e["event"] == "claim_status_refused"]


def test_only_our_status_entries_are_written_and_fields_newer_than_the_client_survive(tmp_path, api):
    # a claim as a newer API server has it: an allocation field this client's models do not
    # know, and another driver's device with a status entry of its own
    node = plugin_node(tmp_path, api, shipped_rules())
    node.start("--claim-status-interval", "200ms")
    claim, share = pod_claim(node, "mixed")
    with api._lock:
        stored = api._claims[(NS, "mixed")]
        allocation = stored["status"]["allocation"]
        allocation["devices"]["results"].append({"request": "nic", "driver": "nic.example.com", "pool": NODE,
                                                 "device": "nic-0"})
        allocation["futureField"] = {"from": "a newer release"}
        stored["status"]["devices"] = [{"driver": "nic.example.com", "pool": NODE, "device": "nic-0",
                                        "data": {"link": "up"}}]
    node.kubelet().prepare(claim)
    reads = lambda: [r for r in api.requests if r[1].endswith("/mixed") and r[0] == "GET"]   # noqa: E731
    before = len(reads())          # the kubelet's, when it prepared the claim
    wait_until(lambda: our_entries(api, "mixed"), 20, "our status.devices entry")
    status = api.claim(NS, "mixed")["status"]
    assert status["allocation"]["futureField"] == {"from": "a newer release"}
    assert [d["driver"] for d in status["devices"]] == ["nic.example.com", DRIVER]
    assert status["devices"][0]["data"] == {"link": "up"}
    assert len(reads()) == before          # the writer read nothing first


def test_writes_are_rate_limited_to_one_per_interval_per_claim(tmp_path, api):
    node = plugin_node(tmp_path, api, shipped_rules())
    node.start("--claim-status-interval", "1s")
    claim, share = pod_claim(node, "busy")
    node.kubelet().prepare(claim)
    wait_until(lambda: our_entries(api, "busy"), 20, "the first write")
    from tests.helpers.simnode import write_usage_counters
    t0 = time.monotonic()
    for i in range(30):      # the figures change every 100 ms for 3 s
        write_usage_counters(node.slice_dir, share, 0, oom_refusals=i + 1)
        time.sleep(0.1)
    puts = [r for r in api.requests if r[0] == "PATCH" and r[1].endswith("/busy/status")]
    assert 2 <= len(puts) <= 2 + int(time.monotonic() - t0) + 1, len(puts)


def test_without_the_driver_rule_the_status_strategy_refuses_and_the_agent_says_so_once(tmp_path, api):
    rules = [r for r in shipped_rules() if "resourceclaims/driver" not in r["resources"]]
    node = plugin_node(tmp_path, api, rules)
    agent = node.start("--claim-status-interval", "200ms")
    claim, _ = pod_claim(node, "no-driver-rule")
    assert node.kubelet().prepare(claim)[claim[1]].error == ""       # preparing is not affected
    refused = agent.wait_for(lambda e: e["event"] == "claim_status_refused", "refusal")
    assert "422" in refused["error"] and 'resource="resourceclaims/driver"' in refused["error"]
    assert "associated-node:patch" in refused["hint"]
    time.sleep(1.5)
    assert len([e for e in agent.events() if e["event"] == "claim_status_refused"]) == 1
    assert our_entries(api, "no-driver-rule") == []


def test_without_status_rbac_the_403_is_logged_once_and_backed_off(tmp_path, api):
    rules = [r for r in shipped_rules() if not any(x.startswith("resourceclaims/") for x in r["resources"])]
    node = plugin_node(tmp_path, api, rules)
    agent = node.start("--claim-status-interval", "200ms")
    claim, _ = pod_claim(node, "no-status-rbac")
    node.kubelet().prepare(claim)
    refused = agent.wait_for(lambda e: e["event"] == "claim_status_refused", "refusal")
    assert "403" in refused["error"] and 'cannot patch resource "resourceclaims/status"' in refused["error"]
    time.sleep(2.0)
    puts = [r for r in api.requests if r[0] == "PATCH" and r[1].endswith("/no-status-rbac/status")]
    assert 1 <= len(puts) <= 4, len(puts)        # 0.2 s, then doubling: not ten tries in 2 s
    assert len([e for e in agent.events() if e["event"] == "claim_status_refused"]) == 1


def test_an_agent_on_another_node_is_refused_the_associated_node_verb(tmp_path, api):
    # the token says node-b, the claim is allocated on node-a: only arbitrary-node would do
    node = plugin_node(tmp_path, api, shipped_rules(), node="node-b")
    agent = node.start("--claim-status-interval", "200ms")
    claim, _ = pod_claim(node, "elsewhere")
    node.kubelet().prepare(claim)
    refused = agent.wait_for(lambda e: e["event"] == "claim_status_refused", "refusal")
    assert "arbitrary-node:patch" in refused["error"]


def test_figures_are_kept_within_10_ki_dropping_processes_from_the_end():
    procs = [{"pid": 1000 + i, "memory": i << 20, "command": "python train.py --epochs 100 " + "x" * 40}
             for i in range(200)]
    data = claimstatus.fit({"slice": "s", "memory.max": 4 * GiB, "processes": procs})
    raw = json.dumps(data)
    assert len(raw) <= 10 * 1024
    assert data["processes"] == procs[:len(data["processes"])] and data["processes.omitted"] == \
        200 - len(data["processes"]) > 0
    small = {"slice": "s", "processes": procs[:3]}
    assert claimstatus.fit(small) is small


def test_the_fake_api_server_refuses_data_over_10_ki_as_the_real_one_does(tmp_path, api):
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    share = str(uuid.uuid4())
    stored = api.put_claim(allocated_claim(NS, "big", DRIVER, NODE, [{"request": "gpu", "device": "gpu-0",
                                                                       "share_id": share}]))
    api.write_kubeconfig(tmp_path / "kc")
    c = client.Configuration()
    config.load_kube_config(config_file=str(tmp_path / "kc"), client_configuration=c)
    kube = client.ResourceV1Api(client.ApiClient(c))
    entry = {"driver": DRIVER, "pool": NODE, "device": "gpu-0", "shareID": share, "data": {"x": "y" * 10300}}
    stored["status"]["devices"] = [entry]
    with pytest.raises(ApiException) as e:
        kube.replace_namespaced_resource_claim_status("big", NS, stored)
    assert e.value.status == 422 and "may not be more than 10240 bytes" in e.value.body
    entry["data"] = {"x": "y" * 10000}
    entry["device"] = "gpu-1"                                     # not what was allocated
    with pytest.raises(ApiException) as e:
        kube.replace_namespaced_resource_claim_status("big", NS, stored)
    assert e.value.status == 422 and "must be an allocated device in the claim" in e.value.body
    entry["device"] = "gpu-0"
    kube.replace_namespaced_resource_claim_status("big", NS, stored)
    assert api.claim(NS, "big")["status"]["devices"][0]["data"] == {"x": "y" * 10000}


# === pod labels in status and metrics ===

def test_a_prepared_claim_labels_its_slice_with_namespace_pod_and_container(tmp_path, api):
    node = plugin_node(tmp_path, api, shipped_rules())
    node.start("--claim-status-interval", "0")
    claim, share = pod_claim(node, "train-0-vgpu-train-x2b4d", pod="train-0", container="trainer")
    node.kubelet().prepare(claim)
    uid = api.claim(NS, "train-0-vgpu-train-x2b4d")["status"]["reservedFor"][0]["uid"]
    assert podlabels.read(node.slice_dir, share) == {"namespace": NS, "pod": "train-0", "container": "trainer",
                                                     "claim": "train-0-vgpu-train-x2b4d", "pod_uid": uid}
    out = subprocess.run([CTL, "status", "--dir", str(node.slice_dir)], env=node.env, capture_output=True,
                         text=True, timeout=60)
    header, row = out.stdout.splitlines()[:2]
    assert header.split()[:3] == ["SLICE", "POD", "DEVICE"]
    assert row.split()[:2] == [share, f"{NS}/train-0/trainer"]
    [c] = json.loads(node.ctl("status", "--json"))["slices"]
    assert c["labels"]["pod"] == "train-0"
    # unprepare removes the slice with its labels
    node.kubelets[0].unprepare(claim)
    assert slices.list_names(node.slice_dir) == []


def test_the_agents_events_name_the_pods_uid_so_kubectl_describe_pod_shows_them(tmp_path, api):
    from kubernetes import client, config
    from vgpu.k8s import events
    node = plugin_node(tmp_path, api, shipped_rules())
    node.start("--claim-status-interval", "0")
    claim, share = pod_claim(node, "train-0-vgpu-train-q7k2m", pod="train-0")
    node.kubelet().prepare(claim)
    owner = api.claim(NS, claim[2])["status"]["reservedFor"][0]
    api.put_pod({"metadata": {"name": "train-0", "namespace": NS, "uid": owner["uid"]},
                 "spec": {"containers": [{"name": "train", "image": "cuda"}]}})
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(api.write_kubeconfig(tmp_path / "admin")),
                            client_configuration=configuration)
    sink = events.EventSink(slices.node_dir(node.slice_dir), NODE, api=client.ApiClient(configuration))
    sink.action(share, "over-cap", "kill", 4242, "killed")
    sink.queue.join()
    assert (sink.sent, sink.dropped) == (1, 0)
    [shown] = api.events_of(NS, "train-0")       # what kubectl describe pod lists
    assert (shown["reason"], shown["type"]) == ("VgpuAction", "Warning")
    assert shown["message"] == "kill pid 4242 (over-cap): killed"
    # a pod of the same name made again (another uid) does not inherit it
    api.put_pod({"metadata": {"name": "train-0", "namespace": NS, "uid": str(uuid.uuid4())},
                 "spec": {"containers": [{"name": "train", "image": "cuda"}]}})
    assert api.events_of(NS, "train-0") == []


def test_metrics_of_a_dra_slice_carry_namespace_pod_and_pod_container(tmp_path):
    d = tmp_path / "vgpu"
    slices.create(d, "c0ffee00-0000-4000-8000-000000000001", {0: slices.device_quota(4 * GiB, 5000)},
                  overcommit=True)
    slices.create(d, "by-hand", {0: slices.device_quota(2 * GiB, 2500)}, overcommit=True)
    podlabels.write(d, "c0ffee00-0000-4000-8000-000000000001",
                    {"namespace": "team-a", "pod": "train-0", "container": "trainer", "claim": "x"})
    httpd = metrics.start(str(d), 0, "127.0.0.1", use_nvml=False)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{httpd.server_port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        httpd.shutdown()
        httpd.server_close()
    series = exposition.series(text)
    dra = (("device", "0"), ("namespace", "team-a"), ("pod", "train-0"), ("pod_container", "trainer"),
           ("slice", "c0ffee00-0000-4000-8000-000000000001"))
    assert series[("vgpu_memory_quota_bytes", dra)] == 4 * GiB
    assert series[("vgpu_processes", tuple(x for x in dra if x[0] != "device"))] == 0
    assert series[("vgpu_memory_quota_bytes", (("device", "0"), ("slice", "by-hand")))] == 2 * GiB


def test_labels_files_that_are_hostile_are_no_labels(tmp_path):
    d = tmp_path / "vgpu"
    slices.create(d, "s", {0: slices.device_quota(GiB, 5000)}, overcommit=True)
    path = d / "s" / "labels.json"
    for content in (b"not json", b"[1, 2]", json.dumps({"pod": 7}).encode(), b"{" + b" " * 5000 + b"}"):
        path.write_bytes(content)
        assert podlabels.read(d, "s") == {}
    path.unlink()
    path.symlink_to("/etc/passwd")
    assert podlabels.read(d, "s") == {}
    path.unlink()
    podlabels.write(d, "s", {"namespace": "a", "pod": "p", "container": "c", "extra": "dropped"})
    assert podlabels.read(d, "s") == {"namespace": "a", "pod": "p", "container": "c"}
    slices.delete(d, "s")
    assert not (d / "s").exists()


def test_the_node_agents_verdict_becomes_the_violating_condition(tmp_path, api):
    import os
    import threading
    from vgpu import agent as node_truth, procfs
    n = plugin_node(tmp_path, api, shipped_rules())
    n.start("--claim-status-interval", "200ms")
    claim, share = pod_claim(n, "judged")
    n.kubelet().prepare(claim)
    violations = [{"kind": "gap", "slice": share, "device": 0, "action": "report", "offenders": [],
                   "memory_driver": 2 * GiB, "memory_current": GiB, "memory_max": 4 * GiB}]
    stop = threading.Event()

    def agent_state():   # what a running `vgpu-ctl agent` keeps writing (vgpu.agent.write_state)
        while not stop.is_set():
            node_truth.write_state(n.slice_dir, {"version": 1, "pid": os.getpid(),
                                                 "pid_start": procfs.start_ticks(os.getpid()),
                                                 "updated": time.time(), "interval_s": 0.2,
                                                 "violations": list(violations)})
            stop.wait(0.2)
    t = threading.Thread(target=agent_state, daemon=True)
    t.start()
    try:
        def violating():
            entries = our_entries(api, "judged")
            c = [x for x in entries[0]["conditions"] if x["type"] == "Violating"] if entries else []
            return c[0] if c else None
        v = wait_until(lambda: (c := violating()) and c["status"] == "True" and c, 20, "Violating True")
        assert v["reason"] == "Gap" and "driver 2Gi, shim 1Gi" in v["message"]
        violations.clear()
        v = wait_until(lambda: (c := violating()) and c["status"] == "False" and c, 20, "Violating False")
        assert v["reason"] == "NoViolation"
    finally:
        stop.set()
        t.join(5)
