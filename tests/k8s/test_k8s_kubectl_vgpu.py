"""`kubectl vgpu` against the fake API server, after the walk a cluster user takes
(docs/kubernetes.md): a pod asking `vgpu.dev/gpu-memory: 4Gi` is admitted through the real
webhook process (over HTTPS, with the webhook's shipped RBAC), its claim made by the
resourceclaim controller's rules from the template and allocated by the scheduler's rules
(tests/helpers/k8s/controllers.py) on the GPU the real agent published, prepared by the agent for
the kubelet stand-in, and its live figures written by the agent under the plugin's shipped
RBAC.  Then `kubectl vgpu` -- the console script, and through the real kubectl as a plugin.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.k8s.controllers import allocate, instantiate_claims
from tests.helpers.k8s.fake_api import FakeApiServer
from tests.helpers.k8s.models import roundtrip
from tests.helpers.paths import ROOT
from tests.helpers.simnode import write_usage_counters
from tests.helpers.wait import wait_until
from tests.k8s.test_k8s_claim_status import plugin_node, shipped_rules
from tests.k8s.test_k8s_webhook import Webhook, patched

BIN = Path(sys.executable).parent
PLUGIN = str(BIN / "kubectl-vgpu")
NS = "team-a"
GiB = 1 << 30


def webhook_rules():
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/dra/webhook.yaml").read_text()) if d]
    return next(d for d in docs if d["kind"] == "ClusterRole")["rules"]


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("walk")
    with FakeApiServer() as api:
        node, hook = plugin_node(tmp, api, shipped_rules()), None
        try:
            agent = node.start("--claim-status-interval", "200ms")
            kubelet = node.kubelet()
            node.published()
            # the webhook as its own service account, with the rules webhook.yaml grants
            api.add_user("webhook-token", "system:serviceaccount:vgpu-system:vgpu-webhook", rules=webhook_rules())
            (tmp / "wh").mkdir()
            hook = Webhook(tmp / "wh", api, "--kubeconfig",
                           str(api.write_user_kubeconfig(tmp / "webhook-kubeconfig", "webhook-token")))
            # 1. the user's pod, as deploy/dra/example-pod-limits.yaml writes it, through admission
            pod = yaml.safe_load((ROOT / "deploy/dra/example-pod-limits.yaml").read_text())
            pod["metadata"]["namespace"] = NS
            response = hook.review(pod)
            assert response["allowed"], response
            pod = api.put_pod(patched(pod, response))
            # 2. the control plane: a claim from the template, allocated on node-a's gpu-0
            [claim] = instantiate_claims(api, NS, "cuda-4gi")
            allocated = allocate(api, NS, claim["metadata"]["name"], "node-a", "gpu-0")
            share = allocated["status"]["allocation"]["devices"]["results"][0]["shareID"]
            # 3. the kubelet prepares it; the agent makes the slice and writes its figures
            answer = kubelet.prepare((NS, claim["metadata"]["uid"], claim["metadata"]["name"]))
            assert answer[claim["metadata"]["uid"]].error == ""
            wait_until(lambda: (api.claim(NS, claim["metadata"]["name"])["status"].get("devices")), 20, "figures")
            write_usage_counters(node.slice_dir, share, 0, memory_current=GiB + (GiB >> 1))
            wait_until(lambda: api.claim(NS, claim["metadata"]["name"])["status"]["devices"][0]["data"]
                       ["memory.current"] == GiB + (GiB >> 1), 20, "memory.current 1.5Gi")
            kubeconfig = tmp / "user-kubeconfig"
            api.write_kubeconfig(kubeconfig, namespace=NS)
            yield {"api": api, "node": node, "claim": api.claim(NS, claim["metadata"]["name"]), "share": share,
                   "kubeconfig": kubeconfig, "agent": agent, "tmp": tmp}
        finally:     # what the node started (its agent, the kubelet stand-in) ends with the module
            if hook:
                hook.stop()
            node.close()


def vgpu(walked, *args, via_kubectl=False, env=None):
    cmd = ([str(BIN / "kubectl"), "vgpu"] if via_kubectl else [PLUGIN]) + list(args)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}",
                              "KUBECONFIG": str(walked["kubeconfig"]), **(env or {})})
    return out


def test_the_pod_from_limits_got_a_claim_owned_by_it_with_the_4gi_asked(walked):
    claim = walked["claim"]
    roundtrip(claim)
    pod = walked["api"].pod(NS, "cuda-4gi")
    assert claim["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]
    assert claim["metadata"]["annotations"]["vgpu.dev/container"] == "cuda"
    result = claim["status"]["allocation"]["devices"]["results"][0]
    assert result["consumedCapacity"] == {"memory": "4Gi", "sm": "50"}
    assert pod["spec"]["containers"][0]["resources"] == {"limits": {}, "claims": [{"name": "vgpu-cuda"}]}


def test_get_pods_shows_the_container_its_gpu_memory_used_of_its_cap_and_share(walked):
    out = vgpu(walked, "get", "pods")
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()
    assert header.split() == ["POD", "CONTAINER", "NODE", "GPU", "GPU-MEMORY", "GPU-UTIL", "STATUS"]
    assert row.split() == ["cuda-4gi", "cuda", "node-a", "gpu-0", "1.5Gi/4Gi", "0%/50%", "Ready"]
    # kubectl's layout: each column starts where its header does, three spaces after the widest cell
    starts = [header.index(h) for h in header.split()]
    assert [row[s - 1] if s else " " for s in starts] == [" "] * len(starts)
    assert header.index("CONTAINER") == len("cuda-4gi") + 3


def test_kubectl_finds_it_as_a_plugin(walked):
    out = vgpu(walked, "get", "pods", via_kubectl=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == vgpu(walked, "get", "pods").stdout


def test_all_namespaces_puts_namespace_first_and_wide_adds_claim_share_and_counters(walked):
    out = vgpu(walked, "get", "pods", "-A", "-o", "wide")
    header, row = out.stdout.splitlines()
    assert header.split() == ["NAMESPACE", "POD", "CONTAINER", "NODE", "GPU", "GPU-MEMORY", "GPU-UTIL", "STATUS",
                              "CLAIM", "SHARE-ID", "DRIVER-MEMORY", "THROTTLED", "OOM", "PROCESSES"]
    cells = row.split()
    assert cells[0] == NS and cells[8] == walked["claim"]["metadata"]["name"] and cells[9] == walked["share"]
    # one process: the slot this test holds to stage 1.5Gi in use; NVML (simgpu's) lists it on no GPU
    assert cells[10:] == ["0", "0s", "0", "1"]


def test_json_and_yaml_carry_the_figures_as_numbers(walked):
    as_json = json.loads(vgpu(walked, "get", "pods", "-o", "json").stdout)
    [item] = as_json["items"]
    assert (as_json["kind"], item["pod"], item["container"], item["gpu"]) == ("List", "cuda-4gi", "cuda", "gpu-0")
    assert item["memory"]["max"] == 4 * GiB and item["memory"]["current"] == GiB + (GiB >> 1)
    assert item["sm"] == {"max": 50, "used": 0} and item["status"] == "Ready"   # simgpu: no kernel ran
    assert yaml.safe_load(vgpu(walked, "get", "pods", "-o", "yaml").stdout) == as_json


def test_another_namespace_has_nothing_in_kubectls_words(walked):
    out = vgpu(walked, "get", "pods", "-n", "default")
    assert out.returncode == 0 and out.stdout.strip() == "No resources found in default namespace."
    out = vgpu(walked, "get", "pods", "nope")
    assert out.returncode == 1 and 'pods "nope" not found' in out.stderr


def test_describe_node_shows_each_gpu_handed_out_and_used_and_its_claims(walked):
    out = vgpu(walked, "describe", "node", "node-a")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "Name:               node-a" in text
    gpu0 = text.split("  gpu-0:")[1].split("  gpu-1:")[0]
    assert "Model:            NVIDIA A10" in gpu0
    assert "Memory:           24Gi total, 4Gi handed out (16%), 1.5Gi used" in gpu0
    assert "SM:               50% handed out of 100%, 0% used" in gpu0
    assert "MIG instances:    <none>" in gpu0
    claim_line = [line for line in gpu0.splitlines() if walked["claim"]["metadata"]["name"] in line][0].split()
    assert claim_line == [NS, walked["claim"]["metadata"]["name"], "cuda-4gi", "cuda", "1.5Gi/4Gi", "0%/50%"]
    gpu1 = text.split("  gpu-1:")[1]
    assert "24Gi total, 0 handed out (0%), 0 used" in gpu1 and "Claims:           <none>" in gpu1
    missing = vgpu(walked, "describe", "node", "node-z")
    assert missing.returncode == 1 and "publishes no vgpu.dev GPUs" in missing.stderr


def test_top_refreshes_get_pods(walked):
    out = vgpu(walked, "top", "--interval", "0.2", "--count", "2")
    assert out.returncode == 0, out.stderr
    frames = [f for f in out.stdout.split("\n\n") if f.strip()]
    assert len(frames) == 2
    for f in frames:
        stamp, header, row = f.strip().splitlines()
        assert stamp.endswith("every 0.2s") and row.split()[0] == "cuda-4gi"


def test_context_and_kubeconfig_flags_are_kubectls(walked, tmp_path):
    config = json.loads(walked["kubeconfig"].read_text())
    dead = json.loads(json.dumps(config["clusters"][0]))
    dead["name"], dead["cluster"]["server"] = "dead", "http://127.0.0.1:1"
    config["clusters"].append(dead)
    config["contexts"].append({"name": "elsewhere", "context": {"cluster": "dead", "user": "fake-user"}})
    config["current-context"] = "elsewhere"
    path = tmp_path / "two-contexts"
    path.write_text(json.dumps(config))
    out = vgpu(walked, "get", "pods", "--kubeconfig", str(path))
    assert out.returncode == 1 and "cannot reach the API server" in out.stderr
    out = vgpu(walked, "get", "pods", "--kubeconfig", str(path), "--context", "fake")
    assert out.returncode == 0 and "cuda-4gi" in out.stdout          # the context's namespace, team-a
    out = vgpu(walked, "get", "pods", "--kubeconfig", str(tmp_path / "none"))
    assert out.returncode == 1 and "cannot load the kubeconfig" in out.stderr


def test_a_user_without_claim_read_access_gets_the_api_servers_refusal(walked, tmp_path):
    api = walked["api"]
    api.add_user("viewer", "bob", rules=[{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}])
    api.write_user_kubeconfig(tmp_path / "kc", "viewer", namespace=NS)
    out = vgpu(walked, "get", "pods", "--kubeconfig", str(tmp_path / "kc"))
    assert out.returncode == 1
    assert 'listing resourceclaims: resourceclaims.resource.k8s.io is forbidden: User "bob" cannot list' in out.stderr


def test_a_pod_whose_claim_is_not_allocated_yet_shows_pending(walked):
    api = walked["api"]
    pod = yaml.safe_load((ROOT / "deploy/dra/example-pod-limits.yaml").read_text())
    pod["metadata"].update(name="waiting", namespace=NS)
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "vgpu-cuda"}]}
    tmpl = api.pod(NS, "cuda-4gi")["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    pod["spec"]["resourceClaims"] = [{"name": "vgpu-cuda", "resourceClaimTemplateName": tmpl}]
    api.put_pod(pod)
    rows = {r.split()[0]: r.split() for r in vgpu(walked, "get", "pods").stdout.splitlines()[1:]}
    assert rows["waiting"][-1] == "WaitingForClaim"
    instantiate_claims(api, NS, "waiting")
    rows = {r.split()[0]: r.split() for r in vgpu(walked, "get", "pods").stdout.splitlines()[1:]}
    assert rows["waiting"][1:] == ["cuda", "<none>", "<none>", "<none>", "<none>", "Pending"]

