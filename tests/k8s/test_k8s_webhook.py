"""`vgpu-ctl k8s-webhook` as a real process over real HTTPS on loopback, with a certificate
from a throwaway CA made here (openssl), called the way the API server calls it: an
AdmissionReview v1 POSTed to /mutate over TLS with SNI and the server name checked against
the CA (vgpu-webhook.vgpu-system.svc).  The pods in the requests and the patched pods are
round-tripped through the kubernetes client's V1Pod model; the patch is applied with an
independent RFC 6902 implementation (jsonpatch).  Templates land in the fake API server.
"""
import base64
import copy
import json
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import urllib3
import yaml

from tests.helpers.k8s.fake_api import FakeApiServer
from tests.helpers.k8s.models import roundtrip
from tests.helpers.paths import ROOT
from tests.helpers.wait import wait_until

jsonpatch = pytest.importorskip("jsonpatch")
GiB, MiB = 1 << 30, 1 << 20
CTL = str(Path(sys.executable).parent / "vgpu-ctl")
SERVICE = "vgpu-webhook.vgpu-system.svc"
NS = "team-a"

# The AdmissionReview v1 fields (k8s.io/api admission/v1 types.go): what a response may carry.
RESPONSE_FIELDS = {"uid", "allowed", "status", "patch", "patchType", "auditAnnotations", "warnings"}


def doc_cert_steps() -> list:
    """The openssl steps of docs/kubernetes.md's walkthrough (step 2), as written there."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    [block] = [b for b in blocks if "openssl req -x509" in b]
    return [line.strip() for line in block.splitlines() if line.strip().startswith(("openssl ", "echo "))]


def make_certs(d: Path):
    """A CA, and a server certificate for the webhook's Service signed by it, made by the
    docs' own openssl steps."""
    if not shutil.which("openssl"):
        pytest.skip("no openssl to make a throwaway CA")
    for step in doc_cert_steps():
        subprocess.run(["bash", "-c", step], cwd=d, check=True, capture_output=True)
    return d / "ca.crt", d / "tls.crt", d / "tls.key"


class Webhook:
    def __init__(self, tmp, api, *extra):
        self.ca, cert, key = make_certs(tmp)
        api.write_kubeconfig(tmp / "kubeconfig")
        self.log = tmp / f"webhook-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen([CTL, "k8s-webhook", "--tls-cert-file", str(cert), "--tls-private-key-file",
                                      str(key), "--port", "0", "--address", "127.0.0.1", "--kubeconfig",
                                      str(tmp / "kubeconfig"), *extra], stderr=open(self.log, "w"), text=True)
        self.port = self.wait_for("serving")["port"]
        self.pool = urllib3.HTTPSConnectionPool("127.0.0.1", self.port, ca_certs=str(self.ca),
                                                cert_reqs="CERT_REQUIRED", server_hostname=SERVICE,
                                                assert_hostname=SERVICE, timeout=10)

    def events(self):
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def wait_for(self, event, timeout=20):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events() if e["event"] == event]
            if found:
                return found[-1]
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.05)
        raise AssertionError(f"no {event}: {self.log.read_text()}")

    def review(self, pod, dry_run=False, operation="CREATE"):
        """POST an AdmissionReview for `pod` as the API server would; returns the response."""
        roundtrip(pod)
        request = {"uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
                   "resource": {"group": "", "version": "v1", "resource": "pods"},
                   "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                   "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                   "name": pod["metadata"].get("name", ""), "namespace": NS, "operation": operation,
                   "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
                   "object": pod, "oldObject": None, "dryRun": dry_run,
                   "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}}
        body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
        r = self.pool.request("POST", "/mutate?timeout=10s", body=json.dumps(body).encode(),
                              headers={"Content-Type": "application/json"})
        assert r.status == 200, r.data
        answer = json.loads(r.data)
        # what the API server checks before it uses an answer (VerifyAdmissionResponse)
        assert (answer["apiVersion"], answer["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
        response = answer["response"]
        assert set(response) <= RESPONSE_FIELDS, set(response) - RESPONSE_FIELDS
        assert response["uid"] == request["uid"]
        if "patch" in response:
            assert response["patchType"] == "JSONPatch"
        if "status" in response:
            roundtrip({"apiVersion": "v1", "kind": "Status", **response["status"]})
        for w in response.get("warnings", []):
            assert len(w) <= 120, w
        return response

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def patched(pod, response):
    ops = json.loads(base64.b64decode(response["patch"])) if response.get("patch") else []
    out = jsonpatch.JsonPatch(ops).apply(copy.deepcopy(pod))
    roundtrip(out)
    return out


def pod_of(*containers, init=(), **spec):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "train-", "namespace": NS},
            "spec": {"containers": list(containers), **({"initContainers": list(init)} if init else {}), **spec}}


def ctr(name, limits=None, requests=None, **extra):
    c = {"name": name, "image": "nvidia/cuda:12.6.3-base-ubuntu24.04", **extra}
    if limits is not None or requests is not None:
        c["resources"] = {}
        if limits is not None:
            c["resources"]["limits"] = limits
        if requests is not None:
            c["resources"]["requests"] = requests
    return c


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with FakeApiServer() as api:
        api.add_node("node-a")
        a10 = {"name": "gpu-0", "allowMultipleAllocations": True,
               "capacity": {"memory": {"value": str(24 * GiB)}, "sm": {"value": "100"}}}
        api._create_slice({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                           "metadata": {"name": "node-a-vgpu.dev"},
                           "spec": {"driver": "vgpu.dev", "nodeName": "node-a", "devices": [a10],
                                    "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1}}}, {})
        hook = Webhook(tmp_path_factory.mktemp("webhook"), api)
        yield api, hook
        hook.stop()


# === the mappings ===

def test_gpu_memory_and_utilization_limits_become_a_claim_from_a_template(cluster):
    api, hook = cluster
    pod = pod_of(ctr("train", limits={"vgpu.dev/gpu-memory": "4Gi", "vgpu.dev/gpu-utilization": "50", "cpu": "2"},
                     requests={"vgpu.dev/gpu-memory": "4Gi", "vgpu.dev/gpu-utilization": "50", "cpu": "1"}))
    response = hook.review(pod)
    assert response["allowed"] is True
    out = patched(pod, response)
    [c] = out["spec"]["containers"]
    assert c["resources"]["limits"] == {"cpu": "2"} and c["resources"]["requests"] == {"cpu": "1"}
    assert c["resources"]["claims"] == [{"name": "vgpu-train"}]
    [pc] = out["spec"]["resourceClaims"]
    assert pc["name"] == "vgpu-train"
    [tmpl] = [t for t in api.templates() if t["metadata"]["name"] == pc["resourceClaimTemplateName"]]
    roundtrip(tmpl)
    assert tmpl["metadata"]["namespace"] == NS
    assert tmpl["spec"]["metadata"]["annotations"] == {"vgpu.dev/container": "train"}
    [req] = tmpl["spec"]["spec"]["devices"]["requests"]
    assert req == {"name": "gpu", "exactly": {"deviceClassName": "vgpu.dev", "allocationMode": "ExactCount",
                                               "count": 1,     # the API server's defaults
                                               "capacity": {"requests": {"memory": "4Gi", "sm": "50"}}}}


def test_hami_names_map_mib_and_percent_and_take_the_gpu_count(cluster):
    api, hook = cluster
    pod = pod_of(ctr("infer", limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000",
                                      "nvidia.com/gpucores": "30"}))
    response = hook.review(pod)
    out = patched(pod, response)
    [c] = out["spec"]["containers"]
    assert c["resources"]["limits"] == {}          # nvidia.com/gpu went too: no whole GPU from a device plugin
    [pc] = out["spec"]["resourceClaims"]
    [tmpl] = [t for t in api.templates() if t["metadata"]["name"] == pc["resourceClaimTemplateName"]]
    caps = tmpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]
    assert caps == {"memory": "3000Mi", "sm": "30"}
    assert "infer: GPU memory 3000Mi, which is rounded up to 3Gi (steps of 256Mi)" in response["warnings"]   # 3000Mi is not a 256Mi step


def test_only_utilization_leaves_memory_to_the_class_default(cluster):
    api, hook = cluster
    pod = pod_of(ctr("nb", limits={"vgpu.dev/gpu-utilization": "20"}))
    out = patched(pod, hook.review(pod))
    name = out["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    [tmpl] = [t for t in api.templates() if t["metadata"]["name"] == name]
    assert tmpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"] == {"requests": {"sm": "20"}}


def test_two_containers_get_a_claim_each_and_others_are_left_alone(cluster):
    _, hook = cluster
    pod = pod_of(ctr("a", limits={"vgpu.dev/gpu-memory": "2Gi"}), ctr("sidecar"),
                 ctr("b", limits={"vgpu.dev/gpu-memory": "1Gi"}),
                 resourceClaims=[{"name": "other", "resourceClaimName": "shared-nic"}])
    out = patched(pod, hook.review(pod))
    assert [p["name"] for p in out["spec"]["resourceClaims"]] == ["other", "vgpu-a", "vgpu-b"]
    a, sidecar, b = out["spec"]["containers"]
    assert a["resources"]["claims"] == [{"name": "vgpu-a"}] and b["resources"]["claims"] == [{"name": "vgpu-b"}]
    assert "resources" not in sidecar


def test_a_pod_mutated_twice_is_unchanged_the_second_time(cluster):
    api, hook = cluster
    pod = pod_of(ctr("train", limits={"vgpu.dev/gpu-memory": "8Gi", "vgpu.dev/gpu-utilization": "25"}))
    once = patched(pod, hook.review(pod))
    templates = api.templates()
    second = hook.review(once)
    assert second["allowed"] is True and "patch" not in second
    assert patched(once, second) == once
    assert api.templates() == templates
    # the same ask again (another replica) reuses the template: nothing new is made
    again = patched(pod, hook.review(pod))
    assert again == once and api.templates() == templates


@pytest.mark.parametrize("memory, stored", [("4Gi", "4Gi"), ("1000000000", "1G"), ("1000M", "1G")])
def test_every_replica_of_a_deployment_is_admitted_though_the_server_defaults_and_canonicalizes(
        cluster, memory, stored):
    # kubernetes' defaulting adds allocationMode/count to the stored template and writes the
    # quantity canonically: the second replica meets a template that differs from what was sent
    api, hook = cluster
    pod = pod_of(ctr(f"replica-{stored.lower()}", limits={"vgpu.dev/gpu-memory": memory}))
    first = hook.review(pod)
    name = patched(pod, first)["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    [tmpl] = [t for t in api.templates() if t["metadata"]["name"] == name]
    assert tmpl["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"] == {"memory": stored}
    for _ in range(2):
        again = hook.review(pod)
        assert again["allowed"] is True, again.get("status")
        assert again["patch"] == first["patch"]


def test_applying_the_same_bare_pod_again_is_a_no_op_and_other_amounts_are_denied(cluster):
    # kubectl apply's three-way merge puts the limits the webhook took out back into the
    # update (they are in the file and in last-applied, not in the live pod)
    _, hook = cluster
    limits = {"vgpu.dev/gpu-memory": "4Gi", "vgpu.dev/gpu-utilization": "25"}
    pod = pod_of(ctr("again", limits={**limits, "cpu": "1"}))
    live = patched(pod, hook.review(pod))
    reapplied = copy.deepcopy(live)
    reapplied["spec"]["containers"][0]["resources"]["limits"].update(limits)
    response = hook.review(reapplied, operation="UPDATE")
    assert response["allowed"] is True and patched(reapplied, response) == live
    other = copy.deepcopy(live)
    other["spec"]["containers"][0]["resources"]["limits"].update({**limits, "vgpu.dev/gpu-memory": "8Gi"})
    denied = hook.review(other, operation="UPDATE")
    assert denied["allowed"] is False
    assert denied["status"]["message"] == ("container again: the GPU amounts of a pod cannot change (its claim "
                                           "vgpu-again keeps what it asked at creation); delete the pod and create "
                                           "it again")
    # an update that leaves the limits out (a label, an image) changes nothing of ours
    assert "patch" not in hook.review(live, operation="UPDATE")


def test_pods_asking_nothing_pass_untouched_and_other_operations_are_ignored(cluster):
    _, hook = cluster
    plain = pod_of(ctr("web", limits={"cpu": "1"}))
    response = hook.review(plain)
    assert set(response) == {"uid", "allowed"} and response["allowed"] is True
    asking = pod_of(ctr("train", limits={"vgpu.dev/gpu-memory": "4Gi"}))
    assert "patch" not in hook.review(asking, operation="UPDATE")


def test_a_dry_run_makes_no_template(cluster):
    api, hook = cluster
    before = api.templates()
    pod = pod_of(ctr("dry", limits={"vgpu.dev/gpu-memory": "5Gi"}))
    response = hook.review(pod, dry_run=True)
    assert response["allowed"] and response["patch"]
    assert api.templates() == before


# === the denials ===

@pytest.mark.parametrize("pod, message", [
    (pod_of(ctr("big", limits={"vgpu.dev/gpu-memory": "48Gi"})),
     "container big asks for 48Gi of GPU memory: more than the largest GPU here has (24Gi)"),
    (pod_of(ctr("zero", limits={"vgpu.dev/gpu-utilization": "0"})), "must be a whole percent from 1 to 100"),
    (pod_of(ctr("over", limits={"nvidia.com/gpucores": "150"})), "must be a whole percent from 1 to 100"),
    (pod_of(ctr("frac", limits={"vgpu.dev/gpu-utilization": "12.5"})), "must be a whole percent from 1 to 100"),
    (pod_of(ctr("mig", limits={"vgpu.dev/gpu-memory": "4Gi", "nvidia.com/mig-1g.10gb": "1"})),
     "asks for a MIG device (nvidia.com/mig-1g.10gb) and a GPU fraction"),
    (pod_of(ctr("claimed", limits={"vgpu.dev/gpu-memory": "4Gi"}),
            resourceClaims=[{"name": "mine", "resourceClaimTemplateName": "mig-1g"}]), None),
    (pod_of(ctr("main"), init=[ctr("warmup", limits={"vgpu.dev/gpu-memory": "1Gi"})]),
     "init container warmup asks for vgpu.dev/gpu-memory: init containers cannot have a GPU fraction"),
    (pod_of(ctr("two", limits={"nvidia.com/gpu": "2", "nvidia.com/gpumem": "1024"})),
     "asks nvidia.com/gpu: 2: a container gets one GPU fraction"),
    (pod_of(ctr("both", limits={"vgpu.dev/gpu-memory": "1Gi", "nvidia.com/gpumem": "1024"})),
     "asks with both vgpu.dev/gpu-memory and HAMi's nvidia.com/gpumem"),
])
def test_what_cannot_work_is_denied_with_a_message_naming_the_container(cluster, pod, message):
    _, hook = cluster
    if message is None:     # a container with a claim of its own and a fraction
        pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "mine"}]
        message = "container claimed already uses the ResourceClaim(s) mine"
    response = hook.review(pod)
    assert response["allowed"] is False
    assert message in response["status"]["message"], response["status"]["message"]
    assert response["status"]["code"] == 403 and "patch" not in response


def test_a_hand_edited_template_of_the_same_name_is_a_denial_not_a_silent_mismatch(cluster):
    api, hook = cluster
    pod = pod_of(ctr("edited", limits={"vgpu.dev/gpu-memory": "6Gi"}))
    out = patched(pod, hook.review(pod))
    name = out["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    with api._lock:
        api._templates[(NS, name)]["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = \
            {"requests": {"memory": "20Gi"}}
    response = hook.review(pod)
    assert response["allowed"] is False and "exists with other content" in response["status"]["message"]


def test_memory_is_checked_against_the_gpu_after_the_rounding_the_scheduler_applies(tmp_path):
    # a 23028Mi card (an A10G as NVML reports it): 23028Mi itself would round up to 23040Mi
    # and never fit, so it is refused at admission, not left Pending forever
    with FakeApiServer() as api:
        gpu = {"name": "gpu-0", "allowMultipleAllocations": True,
               "capacity": {"memory": {"value": "23028Mi"}, "sm": {"value": "100"}}}
        api._create_slice({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                           "metadata": {"name": "node-a-vgpu.dev"},
                           "spec": {"driver": "vgpu.dev", "nodeName": "node-a", "devices": [gpu],
                                    "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1}}}, {})
        hook = Webhook(tmp_path, api)
        try:
            refused = hook.review(pod_of(ctr("whole", limits={"vgpu.dev/gpu-memory": "23028Mi"})))
            assert refused["allowed"] is False
            assert refused["status"]["message"] == (
                "container whole asks for 23028Mi of GPU memory, which is rounded up to 23040Mi (steps of 256Mi): "
                "more than the largest GPU here has (23028Mi)")
            fits = hook.review(pod_of(ctr("most", limits={"vgpu.dev/gpu-memory": "22780Mi"})))
            assert fits["allowed"] is True
            assert fits["warnings"] == ["most: GPU memory 22780Mi, which is rounded up to 22784Mi (steps of 256Mi)"]
        finally:
            hook.stop()


def test_an_api_server_that_drops_capacity_gets_a_denial_not_a_pod_with_a_whole_gpu(tmp_path):
    # DRAConsumableCapacity off (the default on 1.34-1.35): the template is stored without its
    # amounts, and a claim made from it would take a whole GPU
    with FakeApiServer(consumable_capacity=False) as api:
        hook = Webhook(tmp_path, api)
        try:
            for limits in ({"vgpu.dev/gpu-memory": "4Gi"}, {"vgpu.dev/gpu-utilization": "20"}):
                response = hook.review(pod_of(ctr("train", limits=limits)))
                assert response["allowed"] is False
                assert "DRAConsumableCapacity feature gate is off" in response["status"]["message"]
                assert api.templates() == []          # not left for the next pod to find
            assert hook.review(pod_of(ctr("web", limits={"cpu": "1"})))["allowed"] is True
        finally:
            hook.stop()


# === names are configurable, HAMi can be switched off ===

def test_resource_names_are_configurable_and_hami_can_be_off(tmp_path):
    with FakeApiServer() as api:
        hook = Webhook(tmp_path, api, "--memory-resource", "example.com/gpu-mem", "--utilization-resource",
                       "example.com/gpu-sm", "--no-hami", "--device-class", "gpu.example.com")
        try:
            pod = pod_of(ctr("c", limits={"example.com/gpu-mem": "2Gi", "example.com/gpu-sm": "10"}))
            response = hook.review(pod)
            assert any("no vgpu.dev GPU is published" in w for w in response["warnings"])
            out = patched(pod, response)
            [tmpl] = api.templates()
            assert tmpl["spec"]["spec"]["devices"]["requests"][0]["exactly"] == {
                "deviceClassName": "gpu.example.com", "allocationMode": "ExactCount", "count": 1,
                "capacity": {"requests": {"memory": "2Gi", "sm": "10"}}}
            assert out["spec"]["containers"][0]["resources"]["limits"] == {}
            hami = pod_of(ctr("h", limits={"nvidia.com/gpumem": "1024"}))
            assert "patch" not in hook.review(hami)         # not ours with --no-hami
        finally:
            hook.stop()


# === HTTPS and the server itself ===

def test_the_server_speaks_only_tls_that_the_ca_vouches_for_under_the_service_name(cluster, tmp_path):
    _, hook = cluster
    r = hook.pool.request("GET", "/healthz")
    assert r.status == 200 and r.data == b"ok\n"
    wrong = urllib3.HTTPSConnectionPool("127.0.0.1", hook.port, ca_certs=str(hook.ca), cert_reqs="CERT_REQUIRED",
                                        server_hostname="other.svc", assert_hostname="other.svc", timeout=5,
                                        retries=False)
    with pytest.raises(urllib3.exceptions.SSLError):
        wrong.request("GET", "/healthz")
    plain = urllib3.HTTPConnectionPool("127.0.0.1", hook.port, timeout=5, retries=False)
    with pytest.raises((urllib3.exceptions.ProtocolError, urllib3.exceptions.ReadTimeoutError)):
        plain.request("GET", "/healthz")
    bad = hook.pool.request("POST", "/mutate", body=b'{"kind": "Pod"}', headers={"Content-Type": "application/json"})
    assert bad.status == 400


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path):
    with FakeApiServer() as api:
        cert_dir, renewed = tmp_path / "first", tmp_path / "renewed"
        cert_dir.mkdir()
        renewed.mkdir()
        hook = Webhook(cert_dir, api)
        try:
            new_ca, new_cert, new_key = make_certs(renewed)
            shutil.copy(new_key, cert_dir / "tls.key")
            shutil.copy(new_cert, cert_dir / "tls.crt")
            fresh = urllib3.HTTPSConnectionPool("127.0.0.1", hook.port, ca_certs=str(new_ca),
                                                cert_reqs="CERT_REQUIRED", server_hostname=SERVICE,
                                                assert_hostname=SERVICE, timeout=5, retries=False)
            assert fresh.request("GET", "/healthz").status == 200
        finally:
            hook.stop()


def test_a_template_the_api_server_refuses_is_a_denial_that_says_why(tmp_path):
    with FakeApiServer() as api:
        hook = Webhook(tmp_path, api)
        try:
            api.fail_next("POST", "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaimtemplates", 403,
                          message='resourceclaimtemplates.resource.k8s.io "x" is forbidden: ValidatingAdmissionPolicy '
                                  "'vgpu-claim-caps' denied request: a vgpu claim in namespace team-a may ask for at "
                                  "most 8Gi of GPU memory")
            response = hook.review(pod_of(ctr("c", limits={"vgpu.dev/gpu-memory": "16Gi"})))
            assert response["allowed"] is False
            assert "API server said 403: " in response["status"]["message"]
            assert "may ask for at most 8Gi of GPU memory" in response["status"]["message"]
        finally:
            hook.stop()


@pytest.mark.parametrize("outage", ["stopped", "black hole"])
def test_an_api_server_that_does_not_answer_is_a_one_line_denial_not_a_library_traceback(tmp_path, outage):
    with FakeApiServer() as api:
        hook = Webhook(tmp_path, api)
        try:
            api.stop() if outage == "stopped" else api.black_hole()
            response = hook.review(pod_of(ctr("c", limits={"vgpu.dev/gpu-memory": "4Gi"})))
            assert response["allowed"] is False
            message = response["status"]["message"]
            why = "connection refused" if outage == "stopped" else "timed out after 3 s"
            assert message.startswith("cannot create ResourceClaimTemplate team-a/vgpu-c-") and \
                message.endswith(f"the API server did not answer ({why}); create the pod again"), message
            assert "\n" not in message and "Pool" not in message and len(message) < 200
            assert hook.wait_for("api_unreachable")["error"]       # the details stay in the log
        finally:
            hook.stop()


def test_templates_no_pod_uses_go_after_the_grace_and_those_in_use_stay(tmp_path):
    # under the webhook's shipped RBAC; a round every 200 ms, a grace of 1.5 s
    rules = next(d for d in yaml.safe_load_all((ROOT / "deploy/dra/webhook.yaml").read_text())
                 if d and d["kind"] == "ClusterRole")["rules"]
    with FakeApiServer() as api:
        api.add_user("webhook-token", "system:serviceaccount:vgpu-system:vgpu-webhook", rules=rules)
        kubeconfig = api.write_user_kubeconfig(tmp_path / "webhook-kubeconfig", "webhook-token")
        hook = Webhook(tmp_path, api, "--kubeconfig", str(kubeconfig), "--template-gc-interval", "200ms",
                       "--template-gc-grace", "1500ms")
        try:
            def template_of(name, memory):
                out = patched(pod_of(ctr(name, limits={"vgpu.dev/gpu-memory": memory})),
                              hook.review(pod_of(ctr(name, limits={"vgpu.dev/gpu-memory": memory}))))
                return out, out["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
            names = lambda: {t["metadata"]["name"] for t in api.templates()}   # noqa: E731
            used, used_name = template_of("used", "2Gi")
            stored = api.put_pod({**used, "metadata": {"name": "used-0", "namespace": NS}})
            _, idle_name = template_of("idle", "3Gi")
            # a Deployment whose pods keep being admitted: reused, never stored yet, never taken
            _, busy_name = template_of("busy", "5Gi")
            deadline = time.monotonic() + 4.5
            while time.monotonic() < deadline:
                assert busy_name in names()
                template_of("busy", "5Gi")
                time.sleep(0.2)
            assert idle_name not in names()                    # gone after its grace
            assert used_name in names()                        # a pod names it
            api._pods.pop((NS, stored["metadata"]["name"]))    # the pod is deleted
            wait_until(lambda: used_name not in names() and busy_name not in names(), 20, "the unused templates to go")
            assert [e for e in hook.events() if e["event"] == "templates_deleted"]
            assert not [e for e in hook.events() if e["event"] == "template_collection_failed"]
        finally:
            hook.stop()


def test_its_log_lines_carry_ts_as_every_vgpu_json_line_does(cluster):
    _, hook = cluster
    hook.review(pod_of(ctr("stamped", limits={"vgpu.dev/gpu-memory": "1Gi"})))
    for event in hook.events():
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", event["ts"]), event
