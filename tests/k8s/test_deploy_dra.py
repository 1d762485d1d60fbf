"""deploy/dra/: the DRA driver's manifests, checked against the fields and types of the
official kubernetes client's models (tests/helpers/k8s/models.py) and against vgpu-ctl itself:
the containers' arguments are parsed by the same click commands the image runs.
"""
import copy
import os
import re
from pathlib import Path
from unittest import mock

import click
import pytest
import yaml
from kubernetes.utils import parse_quantity

from tests.helpers.k8s.models import roundtrip
from tests.helpers.paths import ROOT
from vgpu import cli
from vgpu.k8s.plugin_main import default_plugin_dir

DRA = ROOT / "deploy" / "dra"
NODE_AGENT = ROOT / "deploy" / "daemonset.yaml"
FILES = ("daemonset.yaml", "deviceclass.yaml", "rbac.yaml", "webhook.yaml", "metrics-service.yaml", "example-pod.yaml",
         "example-pod-limits.yaml", "example-pod-mig.yaml", "kustomization.yaml")
NODE = "gpu-node-1"      # what the downward API's spec.nodeName gives the pod in these tests
GiB = 1 << 30


def load(path):
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]


DOCS = [(path.name, i, doc) for path in sorted(DRA.glob("*.yaml")) if path.name != "kustomization.yaml"
        for i, doc in enumerate(load(path))]


def one(kind, file=None):
    """The only document of `kind` (in `file`, if given) under deploy/dra/."""
    found = [d for f, _, d in DOCS if d.get("kind") == kind and file in (None, f)]
    assert len(found) == 1, f"{len(found)} {kind} documents in deploy/dra/{file or '*.yaml'}"
    return found[0]


def pod_spec():
    return one("DaemonSet")["spec"]["template"]["spec"]


def container(name, spec=None):
    spec = spec or pod_spec()
    found = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"{len(found)} containers named {name}"
    return found[0]


def container_env(c):
    """The container's environment as the kubelet sets it (literal values and the node name)."""
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
            env[e["name"]] = NODE
        else:
            raise AssertionError(f"{c['name']}: env {e['name']} comes from somewhere this test cannot resolve")
    return env


def parse(c):
    """(subcommand, its parameter values) as `vgpu-ctl ARGS` sees them in container `c`: its
    $(VAR) references expanded the kubelet's way and only its own environment visible (click
    also reads options from environment variables).  An unknown option, a missing required
    one or a bad value raises click's UsageError; a $(VAR) with no such variable, an
    AssertionError."""
    assert "command" not in c, f"{c['name']}: the image's entrypoint (vgpu-ctl) must stay"
    env = container_env(c)
    args = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), a) for a in c["args"]]
    unresolved = [a for a in args if re.search(r"\$\([A-Za-z_]", a)]
    assert not unresolved, f"{c['name']}: the kubelet would pass {unresolved} on literally (no such env)"
    name, rest = args[0], args[1:]
    assert name in cli.main.commands, f"{c['name']}: vgpu-ctl has no command {name!r}"
    with mock.patch.dict(os.environ, env, clear=True):
        ctx = cli.main.commands[name].make_context(f"vgpu-ctl {name}", rest)
    return name, ctx.params


def option(command, name):
    return next(p for p in cli.main.commands[command].params if p.name == name)


def plugin_dir(params):
    # k8s-plugin's own default when --plugin-dir is not given (see cli.k8s_plugin)
    return params["plugin_dir"] or default_plugin_dir(params["driver_name"])


def host_path(c, path, spec=None):
    """(host path, read-only) behind `path` in container `c`: the mount holding it must be a
    hostPath volume of the same path (the CDI specs the plugin writes name host paths)."""
    spec = spec or pod_spec()
    volumes = {v["name"]: v for v in spec["volumes"]}
    holders = [m for m in c.get("volumeMounts", [])
               if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert holders, f"{c['name']}: nothing is mounted at {path}"
    m = max(holders, key=lambda m: len(m["mountPath"]))
    assert "hostPath" in volumes[m["name"]], f"{c['name']}: {m['mountPath']} is not a host path"
    host = volumes[m["name"]]["hostPath"]["path"]
    assert host == m["mountPath"], f"{c['name']}: host {host} is mounted at {m['mountPath']}, not the same path"
    return host + path[len(m["mountPath"]):], bool(m.get("readOnly", False))


# === the manifests are what the API server accepts ===

def test_deploy_dra_holds_the_four_manifests():
    assert sorted(p.name for p in DRA.glob("*.yaml")) == sorted(FILES)


@pytest.mark.parametrize("doc", [d for _, _, d in DOCS],
                         ids=[f"{f}-{i}-{d.get('kind')}" for f, i, d in DOCS])
def test_every_document_round_trips_through_the_client_models(doc):
    roundtrip(doc)


def _rename(d, old, new):
    d[new] = d.pop(old)


MUTATIONS = {
    "misspelled-securityContext-field": ("DaemonSet", lambda d: _rename(
        container("plugin", d["spec"]["template"]["spec"])["securityContext"],
        "readOnlyRootFilesystem", "readOnlyRootFileSystem"), "readOnlyRootFileSystem"),
    "misspelled-capacity": (("ResourceClaimTemplate", "example-pod.yaml"), lambda d: _rename(
        d["spec"]["spec"]["devices"]["requests"][0]["exactly"], "capacity", "capacities"), "capacities"),
    "containerPort-as-a-name": ("DaemonSet", lambda d: container("agent", d["spec"]["template"]["spec"])
                                ["ports"][0].__setitem__("containerPort", "metrics"), "containerPort"),
    "verbs-as-a-string": (("ClusterRole", "rbac.yaml"), lambda d: d["rules"][0].__setitem__("verbs", "get"),
                          "verbs"),
}


@pytest.mark.parametrize("case", MUTATIONS)
def test_roundtrip_catches_a_misspelled_field_or_a_wrongly_typed_value(case):
    kind, mutate, field = MUTATIONS[case]
    doc = one(*kind) if isinstance(kind, tuple) else one(kind)
    roundtrip(doc)                      # as written, it passes...
    bad = copy.deepcopy(doc)
    mutate(bad)
    assert bad != doc
    with pytest.raises(AssertionError, match=rf"\b{field}\b"):
        roundtrip(bad)                  # ...and the one change is caught, by name


# === the DaemonSet runs real vgpu-ctl commands on the right host paths ===

def test_plugin_args_are_options_of_vgpu_ctl_k8s_plugin():
    name, params = parse(container("plugin"))
    assert name == "k8s-plugin"
    assert params["node_name"] == NODE                  # the downward API's spec.nodeName
    assert params["shim_dir"] == "/opt/vgpu"
    assert params["directory"] == "/run/vgpu"


def test_the_argument_check_refuses_unknown_options_and_missing_required_ones():
    plugin = container("plugin")
    unknown = copy.deepcopy(plugin)
    unknown["args"].append("--no-such-option")
    with pytest.raises(click.NoSuchOption):
        parse(unknown)
    no_node = copy.deepcopy(plugin)
    no_node["env"] = [e for e in no_node["env"] if e["name"] != "NODE_NAME"]
    with pytest.raises(AssertionError, match=r"\$\(NODE_NAME\)"):   # would be the node's name
        parse(no_node)
    no_args = copy.deepcopy(plugin)
    no_args["args"] = ["k8s-plugin"]
    with pytest.raises(click.MissingParameter):
        parse(no_args)


def test_agent_args_are_options_of_vgpu_ctl_agent_on_the_plugins_slices():
    agent = container("agent")
    name, params = parse(agent)
    assert name == "agent" and params["with_autoscale"] and params["on_violation"] == ()   # reports only
    assert params["directory"] == parse(container("plugin"))[1]["directory"]
    assert params["metrics_port"] in [p["containerPort"] for p in agent["ports"]]
    # it sees the GPU's processes by host pid, and other users' /proc/<pid>/maps
    assert pod_spec()["hostPID"] is True and agent["securityContext"]["capabilities"]["add"] == ["SYS_PTRACE"]


def test_init_container_installs_the_shim_where_the_plugin_takes_it_from():
    name, params = parse(container("install-shim"))
    assert name == "install-shim" and params["preload_file"]
    assert params["dest"] == parse(container("plugin"))[1]["shim_dir"]
    assert host_path(container("install-shim"), params["dest"]) == (params["dest"], False)


def test_every_host_path_the_plugin_needs_is_mounted_at_the_same_path():
    plugin = container("plugin")
    _, p = parse(plugin)
    writable = [plugin_dir(p), p["registry_dir"], p["cdi_dir"], p["directory"]]
    for path in writable:
        assert host_path(plugin, path) == (path, False), path
    assert host_path(plugin, p["shim_dir"])[0] == p["shim_dir"]          # read-only is enough
    agent = container("agent")
    assert host_path(agent, parse(agent)[1]["directory"]) == (p["directory"], False)
    for v in pod_spec()["volumes"]:
        assert v["hostPath"].get("type") in ("Directory", "DirectoryOrCreate"), v["name"]


def test_the_plugins_cdi_specs_are_accepted_by_every_runtime_with_its_defaults(tmp_path):
    from tests.helpers.k8s.cdi import RUNTIMES, Registry
    from vgpu import slices
    from vgpu.k8s import cdi
    _, p = parse(container("plugin"))
    assert p["cdi_version"] == cdi.AUTO              # the lowest the content needs, not the newest
    names = ["train-share-0", "0b7e2c1a-95f4-4d1e-8a3b-5c6d7e8f9a0b"]   # a share ID may start with a digit
    for name in names:
        spec = cdi.spec(p["driver_name"], name, slices.paths(p["directory"], name), p["shim_dir"] + "/libvgpu.so",
                        version=p["cdi_version"])
        cdi.write(str(tmp_path / f"{name}.json"), spec)
    for runtime in RUNTIMES:   # containerd 1.7 and 2.x, CRI-O 1.30 on: see tests/helpers/k8s/cdi.py
        Registry([tmp_path], runtime).inject([cdi.device_id(p["driver_name"], n) for n in names])


def test_plugin_sockets_are_where_the_kubelet_looks():
    _, p = parse(container("plugin"))
    assert plugin_dir(p) == "/var/lib/kubelet/plugins/vgpu.dev"     # dra.sock, checkpoint
    assert p["registry_dir"] == "/var/lib/kubelet/plugins_registry"  # vgpu.dev-reg.sock
    assert p["cdi_dir"] == "/var/run/cdi"


def test_dra_daemonset_runs_where_the_node_agent_does_with_nvml():
    agent = next(d for d in load(NODE_AGENT) if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    spec = pod_spec()
    for key in ("nodeSelector", "tolerations", "priorityClassName", "runtimeClassName"):
        assert spec.get(key) == agent.get(key), key
    for name in ("plugin", "agent"):
        env = container_env(container(name))
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility", name


# === DeviceClass, claim template and pod ===

def device_class(name=None):
    """The class of software slices, named as the driver (or the class `name`)."""
    name = name or option("k8s-plugin", "driver_name").default
    [cls] = [d for f, _, d in DOCS if d.get("kind") == "DeviceClass" and d["metadata"]["name"] == name]
    return cls


def test_deviceclass_selects_the_driver_name_k8s_plugin_defaults_to():
    default = option("k8s-plugin", "driver_name").default
    assert parse(container("plugin"))[1]["driver_name"] == default      # the plugin publishes under it
    classes = [d for f, _, d in DOCS if d.get("kind") == "DeviceClass"]
    assert sorted(c["metadata"]["name"] for c in classes) == sorted([default, f"gpu.{default}", f"mig.{default}"])
    for cls in classes:
        expressions = [s["cel"]["expression"] for s in cls["spec"]["selectors"]]
        drivers = [m for e in expressions for m in re.findall(r'device\.driver\s*==\s*["\']([^"\']*)["\']', e)]
        domains = [m for e in expressions for m in re.findall(r'device\.attributes\["([^"]*)"\]', e)]
        assert drivers == [default] and domains == [default], expressions


def test_claim_template_asks_4Gi_memory_and_50_sm_of_the_vgpu_class():
    template = one("ResourceClaimTemplate", "example-pod.yaml")
    assert template["metadata"]["name"] == "half-gpu"
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["name"] == "gpu"
    exactly = request["exactly"]
    assert exactly["deviceClassName"] == device_class()["metadata"]["name"]
    requests = exactly["capacity"]["requests"]
    assert set(requests) == {"memory", "sm"}
    assert parse_quantity(requests["memory"]) == 4 * GiB
    assert parse_quantity(requests["sm"]) == 50


def test_pod_references_the_template_and_its_container_the_claim():
    template, pod = one("ResourceClaimTemplate", "example-pod.yaml"), one("Pod", "example-pod.yaml")
    assert pod["metadata"]["name"] == "cuda-half-gpu"
    assert pod["metadata"].get("namespace") == template["metadata"].get("namespace")
    claims = {c["name"]: c for c in pod["spec"]["resourceClaims"]}
    uses = [n for n, c in claims.items() if c.get("resourceClaimTemplateName") == template["metadata"]["name"]]
    assert len(uses) == 1
    (cuda,) = pod["spec"]["containers"]
    assert [c["name"] for c in cuda["resources"]["claims"]] == uses


def test_the_mig_example_asks_the_mig_class_for_a_profile_its_selector_and_the_published_devices_agree_on():
    template, pod = one("ResourceClaimTemplate", "example-pod-mig.yaml"), one("Pod", "example-pod-mig.yaml")
    [request] = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == device_class("mig.vgpu.dev")["metadata"]["name"]
    [selector] = request["exactly"]["selectors"]
    assert selector["cel"]["expression"] == 'device.attributes["vgpu.dev"].profile == "3g.40gb"'
    assert pod["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": template["metadata"]["name"]}]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": "gpu"}]


# === RBAC, admission and privileges ===

def test_rbac_grants_exactly_the_plugins_verbs_and_nothing_else():
    role = one("ClusterRole", "rbac.yaml")
    granted = {}
    for rule in role["rules"]:
        assert not rule.get("nonResourceURLs"), rule
        names = tuple(rule.get("resourceNames") or ())
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource, names), set()).update(rule["verbs"])
    driver = option("k8s-plugin", "driver_name").default
    assert granted == {
        ("resource.k8s.io", "resourceclaims", ()): {"get"},
        ("resource.k8s.io", "resourceclaims/status", ()): {"get", "update", "patch"},
        # status.devices of this driver only, in claims allocated on the caller's own node (1.36+)
        ("resource.k8s.io", "resourceclaims/driver", (driver,)): {"associated-node:update", "associated-node:patch"},
        ("resource.k8s.io", "resourceslices", ()): {"get", "list", "watch", "create", "update", "patch", "delete"},
        ("", "nodes", ()): {"get"},
        ("", "events", ()): {"create"},      # the node agent's Events on pods in violation
    }
    ds, sa, binding = one("DaemonSet"), one("ServiceAccount", "rbac.yaml"), one("ClusterRoleBinding", "rbac.yaml")
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"] == "vgpu-dra-plugin"
    assert sa["metadata"]["namespace"] == ds["metadata"]["namespace"] == "vgpu-system"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]


def test_admission_policy_holds_the_plugins_slice_writes_to_its_own_node():
    policy, binding, sa = one("ValidatingAdmissionPolicy"), one("ValidatingAdmissionPolicyBinding"), \
        one("ServiceAccount", "rbac.yaml")
    spec = policy["spec"]
    assert spec.get("failurePolicy", "Fail") == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["resource.k8s.io"] and rule["resources"] == ["resourceslices"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    user = f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
    assert any(user in c["expression"] and "request.userInfo.username" in c["expression"]
               for c in spec["matchConditions"])
    cel = " ".join([v["expression"] for v in spec.get("variables", [])] +
                   [v["expression"] for v in spec["validations"]])
    for needed in ("object.spec.nodeName", "oldObject.spec.nodeName", "request.userInfo.extra", "DELETE"):
        assert needed in cel, needed
    # the node name set on pod-bound tokens, and no other (misspelled) extra key
    assert set(re.findall(r"""["'](authentication\.kubernetes\.io/[^"']*)["']""", cel)) == {
        "authentication.kubernetes.io/node-name"}
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert "Deny" in binding["spec"]["validationActions"]


def test_no_container_is_privileged_drops_all_capabilities_and_cannot_escalate():
    spec = pod_spec()
    assert not any(spec.get(k) for k in ("hostNetwork", "hostIPC"))
    assert spec["hostPID"] is True                               # the node agent's view of the GPU's processes
    assert spec["automountServiceAccountToken"] is True          # the plugin's API calls
    for c in spec["initContainers"] + spec["containers"]:
        sc = c["securityContext"]
        # only the agent gets one back: SYS_PTRACE, to read other users' /proc/<pid>/maps
        assert sc["capabilities"] == ({"drop": ["ALL"], "add": ["SYS_PTRACE"]} if c["name"] == "agent" else
                                      {"drop": ["ALL"]}), c["name"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert not sc.get("privileged"), c["name"]


PLUGIN_USER = "system:serviceaccount:vgpu-system:vgpu-dra-plugin"


def admit(op, caller_extra, new_node, old_node, user=PLUGIN_USER):
    """The policy's verdict on a ResourceSlice write, evaluated by cel-python: None when its
    matchConditions leave the request alone, else whether the validation allows it.
    `caller_extra` is the token's node-name extra (a list; None: no extra at all); a node of
    None is a slice without spec.nodeName; new_node on DELETE, old_node on CREATE are unused."""
    celpy = pytest.importorskip("celpy", reason="cel-python is not installed: the policy's CEL is not run")
    from celpy import celtypes, json_to_cel
    spec = one("ValidatingAdmissionPolicy")["spec"]
    env = celpy.Environment()
    user_info = {"username": user}
    if caller_extra is not None:     # the API server leaves an empty extra out altogether
        user_info["extra"] = {"authentication.kubernetes.io/node-name": caller_extra}

    def slice_(node):
        return {"spec": {"driver": "vgpu.dev", **({"nodeName": node} if node is not None else {"allNodes": True})}}

    activation = {"request": json_to_cel({"operation": op, "userInfo": user_info}),
                  "object": json_to_cel(None if op == "DELETE" else slice_(new_node)),
                  "oldObject": json_to_cel(None if op == "CREATE" else slice_(old_node))}

    def run(expression):
        return env.program(env.compile(expression)).evaluate(activation)

    if not all(run(c["expression"]) for c in spec.get("matchConditions", [])):
        return None
    variables = {}
    for v in spec.get("variables", []):
        activation["variables"] = celtypes.MapType({celtypes.StringType(k): x for k, x in variables.items()})
        variables[v["name"]] = run(v["expression"])
    activation["variables"] = celtypes.MapType({celtypes.StringType(k): x for k, x in variables.items()})
    return all(bool(run(v["expression"])) for v in spec["validations"])


@pytest.mark.parametrize("op, caller, new, old, allowed", [
    ("CREATE", ["node-a"], "node-a", None, True),
    ("CREATE", ["node-a"], "node-b", None, False),         # another node's slice
    ("CREATE", ["node-a"], None, None, False),             # a slice for no one node
    ("CREATE", None, "node-a", None, False),               # a token with no node in it
    ("CREATE", None, None, None, False),                   # neither: '' is no node
    ("CREATE", ["node-a", "node-b"], "node-a", None, False),
    ("UPDATE", ["node-a"], "node-a", "node-a", True),
    ("UPDATE", ["node-a"], "node-b", "node-a", False),     # moving its slice away
    ("UPDATE", ["node-a"], "node-a", "node-b", False),     # taking another node's slice
    ("DELETE", ["node-a"], None, "node-a", True),
    ("DELETE", ["node-a"], None, "node-b", False),
    ("DELETE", None, None, "node-a", False),
])
def test_admission_policy_cel_lets_the_plugin_write_only_its_own_nodes_slices(op, caller, new, old, allowed):
    assert admit(op, caller, new, old) is allowed


def test_admission_policy_cel_leaves_other_users_alone():
    assert admit("CREATE", None, "node-b", None, user="system:serviceaccount:kube-system:other") is None
