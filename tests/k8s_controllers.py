"""Stand-ins for the two control-plane steps between an admitted pod and the kubelet, working
on the fake API server's store with the real components' rules:

- the resourceclaim controller (kubernetes pkg/controller/resourceclaim): for each of a
  pod's resourceClaims that names a template, a ResourceClaim with the template's spec,
  the template's labels and annotations plus `resource.kubernetes.io/pod-claim-name`, a
  generateName of `<pod>-<claim>-` (both shortened in proportion past 57 characters), the
  pod as its controlling owner; and `pod.status.resourceClaimStatuses` naming it;
- the scheduler's DRA allocation for consumable capacity (KEP-5075): each request's
  capacity raised to the device's requestPolicy (the default when not asked, the minimum
  when below it, up to the next step), a shareID (a UUID), the node in a one-term
  matchFields nodeSelector, and the pod in reservedFor.
"""
import random
import uuid

from kubernetes.utils import parse_quantity

from k8s_fake_api import RESOURCE_API

GEN_CHARS = "bcdfghjklmnpqrstvwxz2456789"


def generate_name(pod_name, claim_name):
    base = f"{pod_name}-{claim_name}-"
    if len(base) > 57:
        n = len(base)
        base = pod_name[:len(pod_name) * 57 // n] + "-" + claim_name[:len(claim_name) * 57 // n]
    return base


def instantiate_claims(api, namespace, pod_name) -> list:
    """What the resourceclaim controller does for the pod; returns the claims made."""
    pod = api.pod(namespace, pod_name)
    made, statuses = [], []
    for pc in pod["spec"].get("resourceClaims") or []:
        if not pc.get("resourceClaimTemplateName"):
            continue
        [tmpl] = [t for t in api.templates() if t["metadata"]["namespace"] == namespace and
                  t["metadata"]["name"] == pc["resourceClaimTemplateName"]]
        meta = tmpl["spec"].get("metadata") or {}
        name = generate_name(pod_name, pc["name"]) + "".join(random.choices(GEN_CHARS, k=5))
        claim = {"apiVersion": RESOURCE_API, "kind": "ResourceClaim",
                 "metadata": {"name": name, "namespace": namespace,
                              "labels": dict(meta.get("labels") or {}),
                              "annotations": {**(meta.get("annotations") or {}),
                                              "resource.kubernetes.io/pod-claim-name": pc["name"]},
                              "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod_name,
                                                   "uid": pod["metadata"]["uid"], "controller": True,
                                                   "blockOwnerDeletion": True}]},
                 "spec": tmpl["spec"]["spec"]}
        made.append(api.put_claim(claim))
        statuses.append({"name": pc["name"], "resourceClaimName": name})
    pod.setdefault("status", {})["resourceClaimStatuses"] = statuses
    api.put_pod(pod)
    return made


def _round(requested, policy, value):
    """The capacity the scheduler consumes for a request (None: the policy default)."""
    if requested is None:
        return parse_quantity(policy["default"]) if policy else parse_quantity(value)
    if not policy:
        return requested
    valid = policy.get("validRange") or {}
    low = parse_quantity(valid.get("min", "0"))
    if requested < low:
        return low
    step = valid.get("step")
    if step:
        step = parse_quantity(step)
        return low + -(-(requested - low) // step) * step
    return requested


def _quantity(n):
    n = int(n)
    for suffix, scale in (("Gi", 1 << 30), ("Mi", 1 << 20)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


def allocate(api, namespace, claim_name, node, device="gpu-0", share_id=None):
    """Allocate the claim on `device` of `node`'s published slice, reserved for its owning pod,
    as the scheduler would.  Returns the stored claim."""
    claim = api.claim(namespace, claim_name)
    [rs] = [s for s in api.slices() if s["spec"].get("nodeName") == node]
    [dev] = [d for d in rs["spec"]["devices"] if d["name"] == device]
    results = []
    for req in claim["spec"]["devices"]["requests"]:
        exactly = req["exactly"]
        asked = (exactly.get("capacity") or {}).get("requests") or {}
        consumed = {}
        for cap, info in (dev.get("capacity") or {}).items():
            want = parse_quantity(asked[cap]) if cap in asked else None
            consumed[cap] = _quantity(_round(want, info.get("requestPolicy"), info["value"]))
        results.append({"request": req["name"], "driver": rs["spec"]["driver"], "pool": rs["spec"]["pool"]["name"],
                        "device": device, "shareID": share_id or str(uuid.uuid4()), "consumedCapacity": consumed})
    owner = next(r for r in claim["metadata"].get("ownerReferences") or [] if r["kind"] == "Pod")
    claim["status"] = {
        "allocation": {"devices": {"results": results},
                       "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                           {"key": "metadata.name", "operator": "In", "values": [node]}]}]}},
        "reservedFor": [{"resource": "pods", "name": owner["name"], "uid": owner["uid"]}]}
    stored = api.put_claim(claim)
    pod = api.pod(namespace, owner["name"])
    pod["spec"]["nodeName"] = node
    pod.setdefault("status", {})["phase"] = "Running"
    api.put_pod(pod)
    return stored
