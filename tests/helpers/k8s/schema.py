"""A small structural check of Kubernetes manifests: what `kubectl apply --dry-run=client`
would reject in the objects we write (no cluster here, and kubectl's client dry run needs
one).  It knows the fields of Pod, DaemonSet and the parts of a pod spec vgpu uses;
anything else is an error, so a typo (`readonly`, `mountpath`) or a value of the wrong
type (`value: 1` for an env variable) fails like it would against the API server's schema.
"""
import re

DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
HOST_PATH_TYPES = {"", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice",
                   "BlockDevice"}
VOLUME_SOURCES = {"hostPath", "emptyDir", "configMap", "secret", "persistentVolumeClaim", "projected",
                  "downwardAPI", "csi", "ephemeral"}
CAPABILITIES = {"ALL", "CHOWN", "DAC_OVERRIDE", "FOWNER", "SYS_PTRACE", "SYS_ADMIN", "NET_ADMIN", "SETUID",
                "SETGID", "KILL", "NET_BIND_SERVICE"}


class Invalid(AssertionError):
    pass


def _check(cond, where, what):
    if not cond:
        raise Invalid(f"{where}: {what}")


def _keys(obj, where, allowed, required=()):
    _check(isinstance(obj, dict), where, f"expected a mapping, got {type(obj).__name__}")
    unknown = set(obj) - set(allowed)
    _check(not unknown, where, f"unknown field(s) {sorted(unknown)}")
    missing = set(required) - set(obj)
    _check(not missing, where, f"missing field(s) {sorted(missing)}")


def _list(obj, where):
    _check(isinstance(obj, list), where, f"expected a list, got {type(obj).__name__}")
    return obj


def _str_map(obj, where):
    _check(isinstance(obj, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in obj.items()),
           where, "expected a map of strings to strings (quote numbers and booleans)")


def metadata(obj, where):
    _keys(obj, where, {"name", "namespace", "labels", "annotations", "generateName"}, {"name"})
    _check(isinstance(obj["name"], str) and DNS1123_SUBDOMAIN.fullmatch(obj["name"]), where,
           f"bad name {obj['name']!r}")
    for k in ("labels", "annotations"):
        if k in obj:
            _str_map(obj[k], f"{where}.{k}")


def security_context(obj, where):
    _keys(obj, where, {"runAsUser", "runAsGroup", "runAsNonRoot", "privileged", "allowPrivilegeEscalation",
                       "readOnlyRootFilesystem", "capabilities", "seccompProfile"})
    for k in ("runAsUser", "runAsGroup"):
        if k in obj:
            _check(isinstance(obj[k], int) and not isinstance(obj[k], bool), f"{where}.{k}", "expected an integer")
    for k in ("runAsNonRoot", "privileged", "allowPrivilegeEscalation", "readOnlyRootFilesystem"):
        if k in obj:
            _check(isinstance(obj[k], bool), f"{where}.{k}", "expected true or false")
    if "capabilities" in obj:
        _keys(obj["capabilities"], f"{where}.capabilities", {"add", "drop"})
        for k, caps in obj["capabilities"].items():
            for c in _list(caps, f"{where}.capabilities.{k}"):
                _check(c in CAPABILITIES, f"{where}.capabilities.{k}", f"unknown capability {c!r}")


def container(obj, where, volume_names):
    _keys(obj, where, {"name", "image", "command", "args", "env", "volumeMounts", "resources",
                       "securityContext", "imagePullPolicy", "workingDir", "ports"}, {"name", "image"})
    _check(DNS1123_LABEL.fullmatch(str(obj["name"])), where, f"bad container name {obj['name']!r}")
    for k in ("command", "args"):
        if k in obj:
            _check(all(isinstance(a, str) for a in _list(obj[k], f"{where}.{k}")), f"{where}.{k}",
                   "expected strings")
    names = set()
    for i, e in enumerate(_list(obj.get("env", []), f"{where}.env")):
        w = f"{where}.env[{i}]"
        _keys(e, w, {"name", "value", "valueFrom"}, {"name"})
        _check(ENV_NAME.fullmatch(e["name"]), w, f"bad variable name {e['name']!r}")
        _check(e["name"] not in names, w, f"duplicate variable {e['name']}")
        names.add(e["name"])
        if "value" in e:
            _check(isinstance(e["value"], str), w, f"value of {e['name']} must be a string")
    paths = set()
    for i, m in enumerate(_list(obj.get("volumeMounts", []), f"{where}.volumeMounts")):
        w = f"{where}.volumeMounts[{i}]"
        _keys(m, w, {"name", "mountPath", "readOnly", "subPath"}, {"name", "mountPath"})
        _check(m["name"] in volume_names, w, f"no volume named {m['name']!r} in the pod")
        _check(isinstance(m["mountPath"], str) and m["mountPath"].startswith("/"), w, "mountPath must be absolute")
        _check(m["mountPath"] not in paths, w, f"two mounts at {m['mountPath']}")
        paths.add(m["mountPath"])
        if "readOnly" in m:
            _check(isinstance(m["readOnly"], bool), w, "readOnly must be true or false")
    if "resources" in obj:
        _keys(obj["resources"], f"{where}.resources", {"requests", "limits"})
        for k, v in obj["resources"].items():
            _check(isinstance(v, dict) and all(isinstance(q, (str, int)) for q in v.values()),
                   f"{where}.resources.{k}", "expected quantities")
    if "securityContext" in obj:
        security_context(obj["securityContext"], f"{where}.securityContext")


def volume(obj, where):
    _check(isinstance(obj, dict), where, "expected a mapping")
    sources = set(obj) - {"name"}
    _check("name" in obj and DNS1123_LABEL.fullmatch(str(obj["name"])) and len(obj["name"]) <= 63, where,
           "bad or missing name (a DNS-1123 label of at most 63 characters)")
    _check(len(sources) == 1 and sources <= VOLUME_SOURCES, where, f"needs exactly one volume source, got "
           f"{sorted(sources)}")
    if "hostPath" in obj:
        hp = obj["hostPath"]
        _keys(hp, f"{where}.hostPath", {"path", "type"}, {"path"})
        _check(isinstance(hp["path"], str) and hp["path"].startswith("/"), f"{where}.hostPath", "path must be absolute")
        _check(hp.get("type", "") in HOST_PATH_TYPES, f"{where}.hostPath", f"bad type {hp.get('type')!r}")


def pod_spec(obj, where):
    _keys(obj, where, {"containers", "initContainers", "volumes", "nodeSelector", "nodeName", "tolerations",
                       "priorityClassName", "runtimeClassName", "hostPID", "serviceAccountName",
                       "restartPolicy", "securityContext", "terminationGracePeriodSeconds",
                       "automountServiceAccountToken"}, {"containers"})
    vols = _list(obj.get("volumes", []), f"{where}.volumes")
    names = [v.get("name") for v in vols]
    _check(len(names) == len(set(names)), f"{where}.volumes", "duplicate volume names")
    for i, v in enumerate(vols):
        volume(v, f"{where}.volumes[{i}]")
    cnames = []
    for kind in ("initContainers", "containers"):
        for i, c in enumerate(_list(obj.get(kind, []), f"{where}.{kind}")):
            container(c, f"{where}.{kind}[{i}]", set(names))
            cnames.append(c["name"])
    _check(obj["containers"], f"{where}.containers", "at least one container")
    _check(len(cnames) == len(set(cnames)), where, "duplicate container names")
    if "nodeSelector" in obj:
        _str_map(obj["nodeSelector"], f"{where}.nodeSelector")
    for i, t in enumerate(_list(obj.get("tolerations", []), f"{where}.tolerations")):
        _keys(t, f"{where}.tolerations[{i}]", {"key", "operator", "value", "effect", "tolerationSeconds"})
        _check(t.get("operator", "Equal") in ("Equal", "Exists"), f"{where}.tolerations[{i}]", "bad operator")
        _check(t.get("effect", "NoSchedule") in ("NoSchedule", "PreferNoSchedule", "NoExecute"),
               f"{where}.tolerations[{i}]", "bad effect")


def manifest(obj, where="manifest"):
    """Check one object (Namespace, Pod or DaemonSet); raise Invalid naming the field."""
    _check(isinstance(obj, dict), where, "expected a mapping")
    kind = obj.get("kind")
    where = f"{kind or where}"
    if kind == "Namespace":
        _keys(obj, where, {"apiVersion", "kind", "metadata"}, {"apiVersion", "kind", "metadata"})
        _check(obj["apiVersion"] == "v1", where, "apiVersion must be v1")
        metadata(obj["metadata"], f"{where}.metadata")
    elif kind == "Pod":
        _keys(obj, where, {"apiVersion", "kind", "metadata", "spec"}, {"apiVersion", "kind", "metadata", "spec"})
        _check(obj["apiVersion"] == "v1", where, "apiVersion must be v1")
        metadata(obj["metadata"], f"{where}.metadata")
        pod_spec(obj["spec"], f"{where}.spec")
    elif kind == "DaemonSet":
        _keys(obj, where, {"apiVersion", "kind", "metadata", "spec"}, {"apiVersion", "kind", "metadata", "spec"})
        _check(obj["apiVersion"] == "apps/v1", where, "apiVersion must be apps/v1")
        metadata(obj["metadata"], f"{where}.metadata")
        spec = obj["spec"]
        _keys(spec, f"{where}.spec", {"selector", "template", "updateStrategy", "minReadySeconds"},
              {"selector", "template"})
        _keys(spec["selector"], f"{where}.spec.selector", {"matchLabels"}, {"matchLabels"})
        _keys(spec["template"], f"{where}.spec.template", {"metadata", "spec"}, {"metadata", "spec"})
        labels = spec["template"]["metadata"].get("labels", {})
        _check(spec["selector"]["matchLabels"].items() <= labels.items(), f"{where}.spec.selector",
               "selector does not match the template's labels")
        pod_spec(spec["template"]["spec"], f"{where}.spec.template.spec")
    else:
        raise Invalid(f"{where}: kind {kind!r} is not one this check knows")
