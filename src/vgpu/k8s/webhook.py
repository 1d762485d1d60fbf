"""`vgpu-ctl k8s-webhook`: pods that ask for GPU fractions in `resources.limits` get DRA claims.

A mutating admission webhook (admission.k8s.io/v1, HTTPS).  A container written the way the
device-plugin world writes it,

    resources:
      limits:
        vgpu.dev/gpu-memory: 4Gi          # bytes, any quantity
        vgpu.dev/gpu-utilization: "50"    # percent of the GPU's SM time, 1-100

(or HAMi's `nvidia.com/gpumem: 4096` in MiB and `nvidia.com/gpucores: 50`, with its
`nvidia.com/gpu: 1`) leaves admission with those resources removed, a pod-level
`resourceClaims` entry `vgpu-<container>` naming a ResourceClaimTemplate, and that entry in
the container's `resources.claims`.  The template asks the vgpu DeviceClass for exactly that
capacity (`memory`, `sm`); the scheduler then places the claim like any other.

Why a ResourceClaimTemplate and not a ResourceClaim per container made here: at admission a
pod made by a controller (a Deployment's ReplicaSet, a Job) has no name and no UID yet (the
API server generates both after the mutating webhooks run), so a claim made now could not
be owner-referenced to it, and would leak whenever a later admission step refused the pod.
A template is what Kubernetes itself turns into one claim per pod, owned by the pod and
deleted with it (the resourceclaim controller).  Templates are made here on first use, one
per (namespace, container name, amounts), named by a hash of their content, so making one
again is a no-op and pods that ask alike share it; one no pod names any more is deleted after
a grace (Admitter.collect_templates).  The container's name travels in the
template's claim metadata (annotation vgpu.dev/container), so the driver can label the
slice with it.

Denied, with a message naming the container: memory above the largest GPU the driver
publishes, a utilization outside 1-100 or not whole, a fraction together with a MIG
resource or a claim of its own, an init container asking, more than one GPU, both naming
schemes in one container, an API server that drops the template's amounts (its
DRAConsumableCapacity gate off).  Idempotent: a pod that already went through has nothing left to
map, and gets an empty patch.  A dry-run request makes no template (sideEffects:
NoneOnDryRun).
"""
import base64
import hashlib
import json
import os
import ssl
import threading
import time
from dataclasses import dataclass, field

from . import CONTAINER_ANNOTATION

GiB, MiB = 1 << 30, 1 << 20
MANAGED_BY = {"app.kubernetes.io/managed-by": "vgpu-webhook"}
MEMORY_STEP = 256 * MiB        # the ResourceSlice's requestPolicy step (resourceslice.MEMORY_STEP)
REQUEST = "gpu"                # the request's name in every template
MAX_BODY = 8 << 20
HAMI_MEMORY, HAMI_CORES, HAMI_GPU = "nvidia.com/gpumem", "nvidia.com/gpucores", "nvidia.com/gpu"
HAMI_UNSUPPORTED = ("nvidia.com/gpumem-percentage",)
MIG_PREFIXES = ("nvidia.com/mig-",)
API_TIMEOUT = 3.0              # seconds per API call: the API server gives the webhook 10 s in all
LAST_USED = "vgpu.dev/last-used"   # a template's annotation: when the webhook last gave it to a pod


class Denied(Exception):
    """The pod cannot work as asked: admission is refused with this message."""


@dataclass
class Config:
    driver_name: str = "vgpu.dev"
    device_class: str = "vgpu.dev"
    memory_resource: str = "vgpu.dev/gpu-memory"
    utilization_resource: str = "vgpu.dev/gpu-utilization"
    hami: bool = True              # also nvidia.com/gpumem (MiB), gpucores (%), gpu (count)
    mig_prefixes: tuple = MIG_PREFIXES
    sizes_ttl: float = 30.0        # how long the largest GPU's size is cached
    template_grace: float = 3600.0  # a template no pod names is deleted once unused this long

    def names(self) -> list:
        """Every resource name the webhook maps (what its matchConditions must catch)."""
        out = [self.memory_resource, self.utilization_resource]
        return out + ([HAMI_MEMORY, HAMI_CORES] if self.hami else [])


# === quantities ===

def parse_quantity(value, what) -> float:
    from kubernetes.utils import parse_quantity as parse
    try:
        return parse(value)
    except (ValueError, TypeError):
        raise Denied(f"{what} {value!r} is not a quantity") from None


def canonical_memory(n: int) -> str:
    """Bytes as the shortest exact Kubernetes quantity: 4294967296 -> "4Gi"."""
    for suffix, scale in (("Ti", 1 << 40), ("Gi", GiB), ("Mi", MiB), ("Ki", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


# === what one container asks ===

@dataclass
class Ask:
    container: str
    memory: int = None            # bytes
    sm: int = None                # percent
    names: list = field(default_factory=list)    # the resource names to remove


def _resources(c) -> dict:
    r = c.get("resources") or {}
    return {**(r.get("requests") or {}), **(r.get("limits") or {})}   # limits win (requests equal them)


def container_ask(c, config: Config, init=False):
    """The container's Ask, None when it asks nothing of vgpu; Denied when it cannot work."""
    name = c.get("name", "?")
    have = _resources(c)
    ours = [n for n in (config.memory_resource, config.utilization_resource) if n in have]
    hami = [n for n in (HAMI_MEMORY, HAMI_CORES) if n in have] if config.hami else []
    if not ours and not hami:
        return None
    where = f"{'init container' if init else 'container'} {name}"
    if init:
        raise Denied(f"{where} asks for {', '.join(ours + hami)}: init containers cannot have a GPU fraction "
                     "(its slice would be held for the pod's whole life); give it to a regular container")
    if ours and hami:
        raise Denied(f"{where} asks with both {', '.join(ours)} and HAMi's {', '.join(hami)}: use one of the two")
    for n in HAMI_UNSUPPORTED:
        if config.hami and n in have:
            raise Denied(f"{where}: {n} is not supported; ask {HAMI_MEMORY} in MiB instead")
    mig = sorted(n for n in have if any(n.startswith(p) for p in config.mig_prefixes))
    if mig:
        raise Denied(f"{where} asks for a MIG device ({', '.join(mig)}) and a GPU fraction: a MIG slice is a "
                     "fixed profile; ask for one or the other")
    claims = [x.get("name") for x in (c.get("resources") or {}).get("claims") or []]
    if claims:
        raise Denied(f"{where} already uses the ResourceClaim(s) {', '.join(claims)} and asks for a GPU fraction "
                     "in its limits: one vgpu claim per container; put the amounts in that claim instead")
    ask = Ask(name)
    if hami:
        mem_name, sm_name, mib = HAMI_MEMORY, HAMI_CORES, True
        count = have.get(HAMI_GPU)
        if count is not None:
            if parse_quantity(count, f"{where}: {HAMI_GPU}") != 1:
                raise Denied(f"{where} asks {HAMI_GPU}: {count}: a container gets one GPU fraction; "
                             "for several GPUs write a ResourceClaim")
            ask.names.append(HAMI_GPU)
    else:
        mem_name, sm_name, mib = config.memory_resource, config.utilization_resource, False
    if mem_name in have:
        value = parse_quantity(have[mem_name], f"{where}: {mem_name}")
        memory = value * MiB if mib else value
        if memory != int(memory) or memory <= 0:
            raise Denied(f"{where}: {mem_name} {have[mem_name]} must be a positive whole number of "
                         f"{'MiB' if mib else 'bytes'}")
        ask.memory = int(memory)
        ask.names.append(mem_name)
    if sm_name in have:
        value = parse_quantity(have[sm_name], f"{where}: {sm_name}")
        if value != int(value) or not 1 <= value <= 100:
            raise Denied(f"{where}: {sm_name} {have[sm_name]} must be a whole percent from 1 to 100")
        ask.sm = int(value)
        ask.names.append(sm_name)
    return ask


# === the template ===

def claim_name(container: str) -> str:
    """The pod's resourceClaims entry for a container (a DNS label, at most 63 characters)."""
    name = f"vgpu-{container}"
    if len(name) <= 63:
        return name
    return f"vgpu-{container[:47].rstrip('-')}-{hashlib.sha256(container.encode()).hexdigest()[:8]}"


def template(namespace, ask: Ask, config: Config) -> dict:
    requests = {}
    if ask.memory is not None:
        requests["memory"] = canonical_memory(ask.memory)
    if ask.sm is not None:
        requests["sm"] = str(ask.sm)
    exactly = {"deviceClassName": config.device_class}
    if requests:
        exactly["capacity"] = {"requests": requests}
    spec = {"metadata": {"annotations": {CONTAINER_ANNOTATION: ask.container}, "labels": dict(MANAGED_BY)},
            "spec": {"devices": {"requests": [{"name": REQUEST, "exactly": exactly}]}}}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    prefix = f"vgpu-{ask.container[:40].rstrip('-.')}"
    shown = {config.memory_resource: requests.get("memory", "default"),
             config.utilization_resource: requests.get("sm", "default")}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": f"{prefix}-{digest}", "namespace": namespace, "labels": dict(MANAGED_BY),
                         "annotations": {"vgpu.dev/asks": json.dumps(shown, sort_keys=True)}},
            "spec": spec}


def template_meaning(spec):
    """A template's spec as the API server means it, to compare what was sent with what is
    stored: the server fills in its defaults (kubernetes pkg/apis/resource/v1/defaults.go:
    an empty allocationMode is ExactCount, and then a count of 0 is 1; an empty toleration
    operator is Equal, zz_generated.defaults.go) and writes quantities canonically ("1G" for
    the "1000000000" sent), so both sides get the defaults and every quantity becomes a number."""
    from kubernetes.utils import parse_quantity
    spec = json.loads(json.dumps(spec or {}))

    def request(r):
        r["allocationMode"] = r.get("allocationMode") or "ExactCount"
        if r["allocationMode"] == "ExactCount":
            r["count"] = r.get("count") or 1
        for t in r.get("tolerations") or []:
            t["operator"] = t.get("operator") or "Equal"
        asked = (r.get("capacity") or {}).get("requests") or {}
        for k, v in asked.items():
            asked[k] = parse_quantity(v)
    for r in ((spec.get("spec") or {}).get("devices") or {}).get("requests") or []:
        for one in ([r["exactly"]] if r.get("exactly") else []) + list(r.get("firstAvailable") or []):
            request(one)
    return spec


# === the patch ===

def _pointer(*parts) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def mutation(pod: dict, config: Config, largest_gpu=None):
    """(JSON Patch operations, templates to make, warnings) for a pod; Denied when it cannot work.
    largest_gpu: bytes of the largest GPU published, None when unknown."""
    spec = pod.get("spec") or {}
    for c in spec.get("initContainers") or []:
        container_ask(c, config, init=True)
    asks = [(i, container_ask(c, config)) for i, c in enumerate(spec.get("containers") or [])]
    asks = [(i, a) for i, a in asks if a]
    if not asks:
        return [], [], []
    warnings = []
    if largest_gpu is None:
        warnings.append(f"no {config.driver_name} GPU is published yet: GPU memory not checked against GPU sizes")
    namespace = (pod.get("metadata") or {}).get("namespace") or ""
    existing = {c.get("name") for c in spec.get("resourceClaims") or []}
    ops, templates = [], []
    if "resourceClaims" not in spec:
        ops.append({"op": "add", "path": "/spec/resourceClaims", "value": []})
    for i, ask in asks:
        if ask.memory is not None:
            # what the scheduler will consume: the slice's requestPolicy (min and step 256Mi)
            # rounds up first, and it is the rounded amount that must fit on a GPU
            up = max(MEMORY_STEP, -(-ask.memory // MEMORY_STEP) * MEMORY_STEP)
            rounded = f", which is rounded up to {canonical_memory(up)} (steps of 256Mi)" if up != ask.memory else ""
            if largest_gpu is not None and up > largest_gpu:
                raise Denied(f"container {ask.container} asks for {canonical_memory(ask.memory)} of GPU memory"
                             f"{rounded}: more than the largest GPU here has ({canonical_memory(largest_gpu)})")
            if rounded:
                warnings.append(f"{ask.container}: GPU memory {canonical_memory(ask.memory)}{rounded}")
        name = claim_name(ask.container)
        if name in existing:
            raise Denied(f"container {ask.container}: the pod already has a resourceClaims entry {name!r}; "
                         "rename it, or write the claim instead of the limits")
        existing.add(name)
        tmpl = template(namespace, ask, config)
        templates.append(tmpl)
        ops.append({"op": "add", "path": "/spec/resourceClaims/-",
                    "value": {"name": name, "resourceClaimTemplateName": tmpl["metadata"]["name"]}})
        c = spec["containers"][i]
        resources = c.get("resources") or {}
        if "resources" not in c:
            ops.append({"op": "add", "path": _pointer("spec", "containers", i, "resources"), "value": {}})
        for part in ("limits", "requests"):
            for n in ask.names:
                if n in (resources.get(part) or {}):
                    ops.append({"op": "remove", "path": _pointer("spec", "containers", i, "resources", part, n)})
        if "claims" not in resources:
            ops.append({"op": "add", "path": _pointer("spec", "containers", i, "resources", "claims"),
                        "value": [{"name": name}]})
        else:
            ops.append({"op": "add", "path": _pointer("spec", "containers", i, "resources", "claims", "-"),
                        "value": {"name": name}})
    return ops, templates, warnings


# === the AdmissionReview ===

def _timestamp(when=None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))


def _last_used(tmpl) -> float:
    """When a template was last given to a pod (its LAST_USED, else its creation), epoch seconds."""
    import datetime
    meta = tmpl.get("metadata") or {}
    for text in ((meta.get("annotations") or {}).get(LAST_USED), meta.get("creationTimestamp")):
        try:
            return datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
    return 0.0


def collect_templates_every(admitter, interval, stop):
    """Admitter.collect_templates every `interval` seconds until `stop` (a threading.Event) is
    set, in a daemon thread; a round that fails is logged and the next one tries again."""
    def run():
        while not stop.wait(interval):
            try:
                deleted = admitter.collect_templates()
                if deleted:
                    admitter.log({"event": "templates_deleted", "templates": deleted})
            except Exception as e:
                admitter.log({"event": "template_collection_failed", "error": f"{type(e).__name__}: {e}"[:300]})
    threading.Thread(target=run, name="template-gc", daemon=True).start()


def unreachable(e) -> str:
    """Why a request to the API server got no answer, in a few words."""
    text = f"{type(e).__name__} {e}".lower()
    if "timed out" in text or "timeout" in text:
        return f"timed out after {API_TIMEOUT:g} s"
    if "refused" in text:
        return "connection refused"
    if "name or service not known" in text or "resolution" in text:
        return "its name does not resolve"
    return type(e).__name__


def review_response(uid, allowed=True, patch=None, message=None, warnings=(), code=403) -> dict:
    response = {"uid": uid, "allowed": allowed}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    if not allowed:
        response["status"] = {"code": code, "message": message, "reason": "Forbidden" if code == 403 else
                              "InternalError"}
    if warnings:
        response["warnings"] = list(warnings)
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


class Admitter:
    """Answers AdmissionReviews.  `api`: a kubernetes ApiClient (None: no templates are made
    and no GPU size is known, for tests of the mapping alone)."""

    def __init__(self, config: Config, api=None, log=lambda event: None):
        self.config, self.api, self.log = config, api, log
        self._largest, self._largest_at = None, None
        self._lock = threading.Lock()

    def largest_gpu(self):
        """The largest `memory` capacity the driver publishes, cached for sizes_ttl; None when
        there is none or the API server cannot say (the webhook then warns, not denies)."""
        if self.api is None:
            return None
        with self._lock:
            if self._largest_at is not None and time.monotonic() - self._largest_at < self.config.sizes_ttl:
                return self._largest
        from kubernetes import client
        from kubernetes.utils import parse_quantity as parse
        try:
            slices = client.ResourceV1Api(self.api).list_resource_slice(
                field_selector=f"spec.driver={self.config.driver_name}", _request_timeout=API_TIMEOUT)
            sizes = [int(parse(d.capacity["memory"].value)) for s in slices.items for d in s.spec.devices or []
                     if d.capacity and "memory" in d.capacity and "sm" in d.capacity]   # whole GPUs, not MIG
            largest = max(sizes) if sizes else None
        except Exception as e:   # the API server busy or down: admit, unchecked, and say so
            self.log({"event": "gpu_sizes_unknown", "error": f"{type(e).__name__}: {e}"[:300]})
            return None
        with self._lock:
            self._largest, self._largest_at = largest, time.monotonic()
        return largest

    def ensure_template(self, tmpl):
        """Make the template, or find it made already with the same content."""
        from kubernetes import client
        resource = client.ResourceV1Api(self.api)
        meta = tmpl["metadata"]
        shown = f"ResourceClaimTemplate {meta['namespace']}/{meta['name']}"
        stamped = {**tmpl, "metadata": {**meta, "annotations": {**meta["annotations"], LAST_USED: _timestamp()}}}
        made = self._api_call("create", shown, lambda: resource.create_namespaced_resource_claim_template(
            meta["namespace"], stamped, _request_timeout=API_TIMEOUT), exists_ok=True)
        if made is not None:
            self.log({"event": "template_created", "namespace": meta["namespace"], "name": meta["name"]})
            self._capacity_kept(resource, tmpl, made)
            return
        have = self._api_call("read", shown, lambda: resource.read_namespaced_resource_claim_template(
            meta["name"], meta["namespace"], _request_timeout=API_TIMEOUT))
        self._capacity_kept(resource, tmpl, have)
        if template_meaning(have.get("spec")) != template_meaning(tmpl["spec"]):
            raise Denied(f"{shown} exists with other content (edited by hand?): delete it and create the pod again")
        if time.time() - _last_used(have) > self.config.template_grace / 4:   # in use: not for collect_templates
            try:
                resource.patch_namespaced_resource_claim_template(
                    meta["name"], meta["namespace"], {"metadata": {"annotations": {LAST_USED: _timestamp()}}},
                    _content_type="application/merge-patch+json", _request_timeout=API_TIMEOUT)
            except Exception as e:   # the pod still gets it; the grace covers many failed refreshes
                self.log({"event": "template_touch_failed", "template": shown, "error": f"{type(e).__name__}"})

    def collect_templates(self) -> list:
        """Delete the webhook's templates that no pod in their namespace names and that were
        last given to a pod more than template_grace ago (a Deployment scaled to zero, a
        finished Job): the grace covers a pod admitted but not yet stored, and every reuse
        refreshes LAST_USED.  The delete carries the resourceVersion read, so a template
        refreshed meanwhile stays.  Returns the namespace/names deleted."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException
        resource, core = client.ResourceV1Api(self.api), client.CoreV1Api(self.api)
        selector = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())
        listed = self.api.sanitize_for_serialization(resource.list_resource_claim_template_for_all_namespaces(
            label_selector=selector, _request_timeout=API_TIMEOUT))
        by_namespace = {}
        for t in listed.get("items") or []:
            by_namespace.setdefault(t["metadata"]["namespace"], []).append(t)
        deleted = []
        for namespace, templates in sorted(by_namespace.items()):
            pods = self.api.sanitize_for_serialization(core.list_namespaced_pod(namespace, _request_timeout=API_TIMEOUT))
            named = {pc.get("resourceClaimTemplateName") for p in pods.get("items") or []
                     for pc in (p.get("spec") or {}).get("resourceClaims") or []}
            for t in templates:
                meta = t["metadata"]
                if meta["name"] in named or time.time() - _last_used(t) < self.config.template_grace:
                    continue
                try:
                    resource.delete_namespaced_resource_claim_template(
                        meta["name"], namespace, body={"preconditions": {"resourceVersion": meta["resourceVersion"]}},
                        _request_timeout=API_TIMEOUT)
                except ApiException as e:
                    if e.status in (404, 409):      # gone already, or given to a pod just now
                        continue
                    raise
                deleted.append(f"{namespace}/{meta['name']}")
        return deleted

    def _api_call(self, verb, shown, call, exists_ok=False):
        """call()'s answer as a dict; Denied in one line when the API server refuses (saying
        why) or does not answer (the client library's text goes to the log only).  With
        exists_ok a 409 AlreadyExists is None."""
        from kubernetes.client.exceptions import ApiException
        try:
            return self.api.sanitize_for_serialization(call())
        except ApiException as e:
            if e.status == 409 and exists_ok:
                return None
            try:            # e.g. refused by a quota or the claim-caps policy: say why
                why = json.loads(e.body).get("message") or e.reason
            except (TypeError, ValueError, AttributeError):
                why = e.reason
            raise Denied(f"cannot {verb} {shown}: API server said {e.status}: {why}") from None
        except Exception as e:    # unreachable, timed out
            self.log({"event": "api_unreachable", "template": shown, "error": f"{type(e).__name__}: {e}"[:500]})
            raise Denied(f"cannot {verb} {shown}: the API server did not answer ({unreachable(e)}); "
                         "create the pod again") from None

    def _capacity_kept(self, resource, sent, stored):
        """Denied when the API server stored the template without the capacity asked: its
        DRAConsumableCapacity gate is off (the default on 1.34-1.35) and it drops the field
        without an error, so every pod would silently get a whole GPU.  The stored template is
        deleted (best effort): made again once the gate is on, it keeps the amounts."""
        def asked(spec):
            return [(r.get("exactly") or {}).get("capacity") for r in
                    (((spec or {}).get("spec") or {}).get("devices") or {}).get("requests") or []]
        if asked(sent["spec"]) == [None] * len(asked(sent["spec"])) or \
                all(a is not None for a in asked(stored.get("spec"))):
            return
        meta = sent["metadata"]
        try:
            resource.delete_namespaced_resource_claim_template(meta["name"], meta["namespace"],
                                                               _request_timeout=API_TIMEOUT)
        except Exception as e:     # still denied; the log says what is left behind
            self.log({"event": "template_delete_failed", "name": meta["name"], "error": f"{type(e).__name__}"})
        self.log({"event": "capacity_dropped", "namespace": meta["namespace"], "name": meta["name"]})
        raise Denied("the API server dropped the GPU amounts from the claim template (its DRAConsumableCapacity "
                     "feature gate is off: turn it on for the API server, scheduler and kubelet, or use "
                     "Kubernetes 1.36+); without them every pod would get a whole GPU")

    def review(self, body: dict) -> dict:
        """An AdmissionReview request in, an AdmissionReview response out."""
        request = body.get("request") if isinstance(body, dict) else None
        if body.get("apiVersion") != "admission.k8s.io/v1" or body.get("kind") != "AdmissionReview" or \
                not isinstance(request, dict) or not request.get("uid"):
            raise ValueError("expected an admission.k8s.io/v1 AdmissionReview with a request and its uid")
        uid = request["uid"]
        kind = request.get("kind") or {}
        operation = request.get("operation")
        if (kind.get("group"), kind.get("kind")) != ("", "Pod") or operation not in ("CREATE", "UPDATE") or \
                request.get("subResource"):
            return review_response(uid)       # registered for pods only; anything else passes untouched
        pod = request.get("object") or {}
        pod = {**pod, "metadata": {**(pod.get("metadata") or {}),
                                   "namespace": (pod.get("metadata") or {}).get("namespace") or
                                   request.get("namespace")}}
        shown = f"{request.get('namespace')}/{pod['metadata'].get('name') or pod['metadata'].get('generateName')}"
        if operation == "UPDATE":
            return self._review_update(uid, pod, shown)
        try:
            if not mutation(pod, self.config)[0]:     # nothing to map: no API call at all
                return review_response(uid)
            ops, templates, warnings = mutation(pod, self.config, self.largest_gpu())
            if self.api is not None and not request.get("dryRun"):
                for tmpl in templates:
                    self.ensure_template(tmpl)
        except Denied as e:
            self.log({"event": "denied", "pod": shown, "message": str(e)})
            return review_response(uid, allowed=False, message=str(e))
        self.log({"event": "mutated", "pod": shown, "templates": [t["metadata"]["name"] for t in templates],
                  "dry_run": bool(request.get("dryRun"))})
        return review_response(uid, patch=ops, warnings=warnings)

    def _review_update(self, uid, pod, shown) -> dict:
        """A pod updated with the limits the webhook took out at creation back in (`kubectl
        apply` of the same file again: its three-way merge restores them): taken out again
        when they ask what the container's claim template asks, so the update is the no-op
        it means; other amounts are denied (a running pod's claim cannot change).  A
        container that never went through the webhook (no claim entry of ours) is left
        alone, so labelling an old pod still works."""
        spec = pod.get("spec") or {}
        entries = {c.get("name"): c.get("resourceClaimTemplateName") for c in spec.get("resourceClaims") or []}
        namespace = pod["metadata"].get("namespace") or ""
        ops = []
        try:
            for i, c in enumerate(spec.get("containers") or []):
                ask = container_ask({**c, "resources": {k: v for k, v in (c.get("resources") or {}).items()
                                                        if k != "claims"}}, self.config)
                name = claim_name(c.get("name", ""))
                if ask is None or name not in entries:
                    continue
                if entries[name] != template(namespace, ask, self.config)["metadata"]["name"]:
                    raise Denied(f"container {ask.container}: the GPU amounts of a pod cannot change (its claim "
                                 f"{name} keeps what it asked at creation); delete the pod and create it again")
                resources = c.get("resources") or {}
                ops += [{"op": "remove", "path": _pointer("spec", "containers", i, "resources", part, n)}
                        for part in ("limits", "requests") for n in ask.names if n in (resources.get(part) or {})]
        except Denied as e:
            self.log({"event": "denied", "pod": shown, "message": str(e)})
            return review_response(uid, allowed=False, message=str(e))
        if ops:
            self.log({"event": "limits_taken_out_again", "pod": shown})
        return review_response(uid, patch=ops)


# === HTTPS ===

class _Certs:
    """The server certificate from files, reloaded when they change (cert-manager rotates them)."""

    def __init__(self, cert_file, key_file):
        self.cert_file, self.key_file = cert_file, key_file
        self._stamp, self.context = None, None
        self._lock = threading.Lock()
        self.load()

    def _mtimes(self):
        return tuple(os.stat(p).st_mtime_ns for p in (self.cert_file, self.key_file))

    def load(self):
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_file, self.key_file)
        context.sni_callback = self._sni
        with self._lock:
            self.context, self._stamp = context, self._mtimes()

    def _sni(self, sock, server_name, context):
        try:
            if self._mtimes() != self._stamp:
                self.load()
            sock.context = self.context
        except (OSError, ssl.SSLError):
            pass      # half-written files: keep serving the last good certificate
        return None


def serve(admitter: Admitter, cert_file, key_file, address="0.0.0.0", port=8443):
    """Serve POST /mutate (and GET /healthz) over HTTPS in a background thread; returns the
    server (server_port is the port)."""
    import http.server
    certs = _Certs(cert_file, key_file)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "vgpu-webhook"

        def log_message(self, format, *args):
            pass

        def _answer(self, code, body, kind="application/json"):
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.split("?")[0] in ("/healthz", "/readyz"):
                self._answer(200, b"ok\n", "text/plain")
            else:
                self._answer(404, b"not found\n", "text/plain")

        def do_POST(self):
            if self.path.split("?")[0] not in ("/mutate", "/"):
                return self._answer(404, b"not found\n", "text/plain")
            length = int(self.headers.get("Content-Length") or 0)
            if length <= 0 or length > MAX_BODY:
                return self._answer(400, b"an AdmissionReview body is required\n", "text/plain")
            if (self.headers.get("Content-Type") or "").split(";")[0].strip() != "application/json":
                return self._answer(415, b"Content-Type must be application/json\n", "text/plain")
            try:
                body = json.loads(self.rfile.read(length))
                answer = admitter.review(body)
            except (ValueError, AttributeError) as e:
                return self._answer(400, f"{e}\n".encode(), "text/plain")
            except Exception as e:   # a bug: refuse this pod, keep serving
                admitter.log({"event": "internal_error", "error": f"{type(e).__name__}: {e}"[:300]})
                uid = body.get("request", {}).get("uid", "") if isinstance(body, dict) else ""
                answer = review_response(uid, allowed=False, code=500,
                                         message=f"vgpu webhook internal error ({type(e).__name__}): its log "
                                                 "(event internal_error) has the details")
            self._answer(200, answer)

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True

        def get_request(self):
            sock, addr = super().get_request()
            sock.settimeout(10)    # a client that stalls in the handshake holds only its own thread
            return certs.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

        def handle_error(self, request, client_address):
            pass     # a client that went away, a failed handshake: nothing to do

    httpd = Server((address, port), Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="webhook",
                     daemon=True).start()
    return httpd

