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
import time
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


# === the scheduler's allocator for classes, selectors and counters (KEP-4815) ===
# As k8s.io/dynamic-resource-allocation structured/internal/incubating/allocator_incubating.go
# does it, for one-device `exactly` requests: a device is a candidate when the class's and
# the request's CEL selectors hold (an attribute without a domain is the driver's), it is
# not allocated already (unless it allows multiple allocations), and the counters it
# consumes are still available in its pool -- counted once per allocated device, and not
# checked again for a multi-allocatable device whose capacity is already in use (the
# allocator's skipCounterCheck).  Only the pool's highest generation counts.  First fit,
# in slice and device order.

def _cel_device(driver, dev):
    import celpy
    attrs, caps = {}, {}
    for name, value in (dev.get("attributes") or {}).items():
        domain, _, short = name.rpartition("/")
        attrs.setdefault(domain or driver, {})[short] = next(iter(value.values()))
    for name, value in (dev.get("capacity") or {}).items():
        domain, _, short = name.rpartition("/")
        caps.setdefault(domain or driver, {})[short] = int(parse_quantity(value["value"]))
    return celpy.json_to_cel({"driver": driver, "attributes": attrs, "capacity": caps,
                              "allowMultipleAllocations": bool(dev.get("allowMultipleAllocations"))})


def _selected(expressions, device) -> bool:
    import celpy
    env = celpy.Environment()
    return all(bool(env.program(env.compile(e)).evaluate({"device": device})) for e in expressions)


def _pool(api, node, wait_s=10.0):
    """The node's pool at its newest generation.  A generation with fewer slices than its
    resourceSliceCount is one the driver is still publishing: its counter sets may be in
    slices not written yet, so this stand-in does not allocate from it, and waits (up to
    wait_s) as the scheduler retries a claim it cannot place yet."""
    deadline = time.monotonic() + wait_s
    while True:
        slices = [s for s in api.slices() if s["spec"].get("nodeName") == node]
        top = max((s["spec"]["pool"]["generation"] for s in slices), default=None)
        slices = [s for s in slices if s["spec"]["pool"]["generation"] == top]
        if slices and len(slices) == slices[0]["spec"]["pool"]["resourceSliceCount"]:
            return slices
        assert time.monotonic() < deadline, "the pool is incomplete"
        time.sleep(0.05)


def allocate_by_class(api, namespace, claim_name, node, classes):
    """Allocate the claim on `node` as the scheduler would, choosing its devices by class
    (`classes`: {name: DeviceClass}), selectors and counters; AssertionError when nothing
    fits.  Returns the stored claim."""
    claim = api.claim(namespace, claim_name)
    slices = _pool(api, node)
    driver = slices[0]["spec"]["driver"]
    pool = slices[0]["spec"]["pool"]["name"]
    available = {cs["name"]: {k: parse_quantity(v["value"]) for k, v in cs["counters"].items()}
                 for s in slices for cs in s["spec"].get("sharedCounters") or []}
    devices = [d for s in slices for d in s["spec"].get("devices") or []]
    by_name = {d["name"]: d for d in devices}
    in_use, capacity_used = set(), {}
    for other in api.claims():
        for r in (((other.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []:
            if r["driver"] == driver and r["pool"] == pool:
                in_use.add(r["device"])
                for k, v in (r.get("consumedCapacity") or {}).items():
                    capacity_used.setdefault(r["device"], {}).setdefault(k, 0)
                    capacity_used[r["device"]][k] += parse_quantity(v)
    for name in in_use:   # each allocated device's counters once
        for use in by_name.get(name, {}).get("consumesCounters") or []:
            for k, v in use["counters"].items():
                available[use["counterSet"]][k] -= parse_quantity(v["value"])
    results = []
    for req in claim["spec"]["devices"]["requests"]:
        exactly = req["exactly"]
        cls = classes[exactly["deviceClassName"]]
        expressions = [s["cel"]["expression"] for s in cls["spec"].get("selectors") or []] + \
            [s["cel"]["expression"] for s in exactly.get("selectors") or []]
        asked = (exactly.get("capacity") or {}).get("requests") or {}
        chosen = None
        for dev in devices:
            multi = bool(dev.get("allowMultipleAllocations"))
            if (dev["name"] in in_use and not multi) or not _selected(expressions, _cel_device(driver, dev)):
                continue
            consumed = {}
            if multi:
                for cap, info in (dev.get("capacity") or {}).items():
                    want = parse_quantity(asked[cap]) if cap in asked else None
                    consumed[cap] = _round(want, info.get("requestPolicy"), info["value"])
                used = capacity_used.get(dev["name"], {})
                if any(used.get(c, 0) + v > parse_quantity(dev["capacity"][c]["value"]) for c, v in consumed.items()):
                    continue
            skip_counters = multi and dev["name"] in capacity_used
            uses = [] if skip_counters else dev.get("consumesCounters") or []
            if any(available[u["counterSet"]][k] < parse_quantity(v["value"]) for u in uses
                   for k, v in u["counters"].items()):
                continue
            for u in uses:
                for k, v in u["counters"].items():
                    available[u["counterSet"]][k] -= parse_quantity(v["value"])
            chosen = (dev, consumed)
            break
        assert chosen, f"claim {claim_name}: no device on {node} fits request {req['name']}"
        dev, consumed = chosen
        in_use.add(dev["name"])
        result = {"request": req["name"], "driver": driver, "pool": pool, "device": dev["name"]}
        if consumed:
            result["consumedCapacity"] = {k: _quantity(v) for k, v in consumed.items()}
            result["shareID"] = str(uuid.uuid4())
            for k, v in consumed.items():
                capacity_used.setdefault(dev["name"], {}).setdefault(k, 0)
                capacity_used[dev["name"]][k] += v
        results.append(result)
    claim["status"] = {"allocation": {"devices": {"results": results},
                                      "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                                          {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
    owner = next((r for r in claim["metadata"].get("ownerReferences") or [] if r["kind"] == "Pod"), None)
    if owner:
        claim["status"]["reservedFor"] = [{"resource": "pods", "name": owner["name"], "uid": owner["uid"]}]
    return api.put_claim(claim)
