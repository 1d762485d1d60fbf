"""Stand-ins for the two control-plane steps between an admitted pod and the kubelet, working
on the fake API server's store with the real components' rules:

- the resourceclaim controller (kubernetes pkg/controller/resourceclaim): for each of a
  pod's resourceClaims that names a template, a ResourceClaim with the template's spec,
  the template's labels and annotations plus `resource.kubernetes.io/pod-claim-name`, a
  generateName of `<pod>-<claim>-` (both shortened in proportion past 57 characters), the
  pod as its controlling owner; and `pod.status.resourceClaimStatuses` naming it;
- kube-scheduler's DRA allocation (the dynamicresources plugin and its structured
  allocator), as a given Kubernetes release (`version`, e.g. "1.34", "1.36.2"; a minor
  alone is its .0) does it: all of a pod's claims on one node or none; devices chosen by
  the class's and the request's CEL selectors (capacity as Quantity objects), consumable
  capacity (KEP-5075) rounded to the device's requestPolicy, counters (KEP-4815); first
  fit with backtracking, in pool, slice and device order.

Sources, named beside each rule: DRA/ is kubernetes/kubernetes
staging/src/k8s.io/dynamic-resource-allocation/, read at the tags of its published copy
k8s.io/dynamic-resource-allocation (v0.N.P there is Kubernetes v1.N.P); commits are
kubernetes/kubernetes commits.  The allocator taken is the one these devices need:
DRAConsumableCapacity and DRAPartitionableDevices on -- DRA/structured/internal/
experimental in 1.34 and 1.35 (where only it supports consumable capacity), incubating
from 1.36 (DRA/structured/allocator.go and each variant's SupportedFeatures).

Not modelled (NotImplementedError where a claim or device uses it): allocationMode All,
firstAvailable, constraints, admin access, device taints, per-device node selection,
config in the results; between nodes the scheduler scores, this takes the first node by
name that fits.
"""
import copy
import random
import time
import uuid
from dataclasses import dataclass, field

from tests.helpers.k8s.cel import CelError, Quantity, cel_device, matches
from tests.helpers.k8s.fake_api import RESOURCE_API

GEN_CHARS = "bcdfghjklmnpqrstvwxz2456789"
NEWEST = "1.37"


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


class Unschedulable(AssertionError):
    """No node has devices for all of the pod's (or the claim's) requests: nothing was written."""


class AllocationError(Exception):
    """The allocator returned an error, not "does not fit" (or a helpers.k8s.cel.CelError): the pod
    stays unscheduled and nothing was written."""


# === Kubernetes releases ===

@dataclass(frozen=True)
class Release:
    """Where one release's allocator differs from the newest."""
    number: tuple        # (1, 36, 2)

    @property
    def slices_by_name(self) -> bool:
        # DRA/structured/internal/{incubating,experimental}/pools_*.go GatherPools/buildPool,
        # v1.36.0 (commit 761fc9d4): pools sorted by driver then pool name, a pool's slices by
        # name.  Before, in the order the scheduler's informer lists them (a Go map's order for
        # pools): here, the fake API server's store order.
        return self.number >= (1, 36, 0)

    @property
    def shared_devices_hold_counters(self) -> bool:
        # DRA/structured/internal/{incubating,experimental}/allocator_*.go checkAvailableCounters:
        # the counters already used are rebuilt from the devices allocated in earlier cycles.
        # Up to v1.36.1 (and in every 1.35.x and 1.34.x) only AllocatedDevices counts, which the
        # scheduler fills with results without a shareID (pkg/scheduler/framework/plugins/
        # dynamicresources/allocateddevices.go): a device shared through consumable capacity
        # holds no counters once its claim is written.  Commit 37349f7b (v1.36.2; on master
        # d2c2de72, v1.37.0-alpha.1) counts shared and capacity-consuming devices too
        # (DRA/structured/internal/allocatedstate.go IsDeviceAllocated).
        return self.number >= (1, 36, 2)

    @property
    def skips_counters_of_a_shared_device_in_use(self) -> bool:
        # DRA/structured/internal/experimental/allocator_experimental.go allocateDevice,
        # v1.35.0 (commit fb228c47; incubating from v1.36.0): a device allowing multiple
        # allocations whose capacity is already in use (earlier cycles or this one) does not
        # consume its counters again.  v1.34.x consumes them at every allocation.
        return self.number >= (1, 35, 0)

    @property
    def counters_per_slice(self) -> bool:
        # DRA/structured/internal/experimental/allocator_experimental.go checkAvailableCounters,
        # v1.34.x: a device's counter sets are looked up in its own slice only, and only the
        # sets found there are checked -- counters kept in another slice (the 1.35+ layout)
        # are never checked.  v1.35.0 (commit 38b5750e) pools the counter sets of all slices.
        return self.number < (1, 35, 0)

    @property
    def next_device_after_previous(self) -> bool:
        # DRA/structured/internal/*/allocator_*.go allocateOne, v1.36.0 (commit 9562aa8b): the
        # next device of a request is searched after the one just taken (combinations); before,
        # from the first device again.
        return self.number >= (1, 36, 0)

    @property
    def allocates_from_incomplete_pools(self) -> bool:
        # DRA/structured/internal/experimental/allocator_experimental.go allocateOne, v1.34.x:
        # an incomplete pool is allocated from (only allocationMode All refuses it) and reaching
        # an invalid pool is the allocation's error; from v1.35.0 both are skipped, and an
        # invalid one only fails the node when nothing else fits.
        return self.number < (1, 35, 0)

    @property
    def capacity_checked_on_slice_device_by_request_index(self) -> bool:
        # DRA/structured/internal/experimental/allocator_experimental.go allocateDevice,
        # v1.34.x: the capacity check passes the request's device index (0 for a one-device
        # request) as an index into the candidate's slice, so a request must also fit the
        # slice's first device.  Fixed by commit 81e3dbdc (v1.35.0), not in any 1.34.x.
        return self.number < (1, 35, 0)


def release(version=NEWEST) -> Release:
    parts = [int(p) for p in str(version).removeprefix("v").split(".")]
    if len(parts) not in (2, 3) or parts[:2] < [1, 34]:
        raise ValueError(f"version {version!r}: 1.34 or later, as MAJOR.MINOR[.PATCH]")
    return Release(tuple(parts + [0] * (3 - len(parts))))


# DRA/structured/internal/{experimental,incubating}/consumable_capacity.go (v1.34.0 to v1.37
# alike): what a request consumes of one of a device's capacities, and whether that breaks
# the capacity's requestPolicy.

def _consumed(requested, capacity) -> Quantity:
    """calculateConsumedCapacity: nothing asked -> the policy default, else the whole value;
    no policy -> as asked; a validRange -> below min: min, else up to the next step from min
    (written in binary SI); validValues -> the first at least as large (else as asked)."""
    policy = capacity.get("requestPolicy")
    if requested is None:
        default = (policy or {}).get("default")
        return Quantity.parse(default if default is not None else capacity["value"])
    if not policy:
        return requested
    valid = policy.get("validRange")
    if valid and valid.get("min") is not None:
        low = Quantity.parse(valid["min"])
        if requested.value < low.value:
            return low
        if valid.get("step") is None:
            return requested
        step, added = Quantity.parse(valid["step"]).whole(), requested.whole() - low.whole()
        return Quantity(low.whole() + step * -(-added // step), "BinarySI")
    if policy.get("validValues") is not None:
        return next((q for q in map(Quantity.parse, policy["validValues"]) if requested.value <= q.value), requested)
    return requested


def _violates(consumed, policy) -> bool:
    """violatesPolicy: above validRange.max, off its step from min, or not one of validValues;
    the default itself never violates (Go compares the Quantity structs: value and format
    here)."""
    if not policy:
        return False
    if policy.get("default") is not None:
        default = Quantity.parse(policy["default"])
        if (default.value, default.form) == (consumed.value, consumed.form):
            return False
    valid = policy.get("validRange")
    if valid is not None:
        if valid.get("max") is not None and consumed.value > Quantity.parse(valid["max"]).value:
            return True
        return valid.get("step") is not None and \
            (consumed.whole() - Quantity.parse(valid["min"]).whole()) % Quantity.parse(valid["step"]).whole() != 0
    if policy.get("validValues"):
        return all(consumed.value != Quantity.parse(v).value for v in policy["validValues"])
    return False


def _asked(request) -> dict:
    return {k: Quantity.parse(v) for k, v in ((request.get("capacity") or {}).get("requests") or {}).items()}


# === the pools on a node ===

@dataclass
class _Pool:
    driver: str
    name: str
    device_slices: list
    counter_sets: dict = field(default_factory=dict)   # name -> {counter: Decimal}
    incomplete: bool = False
    invalid: str = ""                                    # why


def _listed_slices(api) -> list:
    """The stored ResourceSlices in the order they were stored (api.slices() sorts them)."""
    with api._lock:
        return copy.deepcopy(list(api._slices.values()))


def _gather(slices, node, rel) -> list:
    """GatherPools (DRA/structured/internal/*/pools_*.go): the node's slices (from 1.35 also
    every slice with counter sets), the newest generation of each pool, which is incomplete
    when it has fewer than resourceSliceCount slices (from 1.35 counting the pool's slices of
    other nodes too, and ignoring it when one of those is newer)."""
    pools = {}
    for s in slices:
        spec = s["spec"]
        if not (spec.get("nodeName") == node or spec.get("allNodes") or
                not rel.counters_per_slice and spec.get("sharedCounters")):
            continue
        group = pools.setdefault((spec["driver"], spec["pool"]["name"]), [])
        generation = spec["pool"]["generation"]
        if group and generation > group[0]["spec"]["pool"]["generation"]:
            group.clear()
        if not group or generation == group[0]["spec"]["pool"]["generation"]:
            group.append(s)
    out = []
    for (driver, name), group in pools.items():
        generation, count = group[0]["spec"]["pool"]["generation"], group[0]["spec"]["pool"]["resourceSliceCount"]
        incomplete = len(group) != count
        if incomplete and not rel.allocates_from_incomplete_pools:     # 1.35+: checkSlicesInPool
            same = [s for s in slices if (s["spec"]["driver"], s["spec"]["pool"]["name"]) == (driver, name)]
            if any(s["spec"]["pool"]["generation"] > generation for s in same):
                continue                           # being replaced: ignored
            incomplete = sum(s["spec"]["pool"]["generation"] == generation for s in same) != count
            if incomplete:
                out.append(_Pool(driver, name, [], incomplete=True))
                continue
        if rel.slices_by_name:
            group = sorted(group, key=lambda s: s["metadata"]["name"])
        out.append(_build_pool(driver, name, group, rel))
        out[-1].incomplete = incomplete
    if rel.slices_by_name:
        out.sort(key=lambda p: (p.driver, p.name))
    return out


def _build_pool(driver, name, group, rel) -> _Pool:
    """buildPool: duplicate device names make a pool invalid; from 1.35 its counter sets are
    pooled, and a duplicate set or a device consuming a set or counter not there does too."""
    counters = [] if rel.counters_per_slice else [s for s in group if s["spec"].get("sharedCounters")]
    pool = _Pool(driver, name, [s for s in group if s not in counters])
    names = [d["name"] for s in pool.device_slices for d in s["spec"].get("devices") or []]
    if len(names) != len(set(names)):
        pool.invalid = "duplicate device name"
    for cs in (cs for s in counters for cs in s["spec"]["sharedCounters"]):
        if cs["name"] in pool.counter_sets:
            pool.invalid = f"duplicate counter set name {cs['name']}"
        pool.counter_sets[cs["name"]] = {k: Quantity.parse(v["value"]).value for k, v in cs["counters"].items()}
    if not rel.counters_per_slice:
        for d in (d for s in pool.device_slices for d in s["spec"].get("devices") or []):
            for use in d.get("consumesCounters") or []:
                have = pool.counter_sets.get(use["counterSet"])
                if have is None or any(k not in have for k in use["counters"]):
                    pool.invalid = f"{d['name']} consumes counters of {use['counterSet']} that are not there"
    return pool


def _pools(api, node, rel, wait_s) -> list:
    """The node's pools; while there are none (a starting kubelet deleted the node's slices
    and the driver has not published them again) or one is incomplete (a driver still
    publishing) this waits up to wait_s, as the scheduler retries a pod it cannot place yet
    (so that no outcome here depends on timing)."""
    deadline = time.monotonic() + wait_s
    while True:
        pools = _gather(_listed_slices(api), node, rel)
        if (pools and not any(p.incomplete for p in pools)) or time.monotonic() >= deadline:
            return pools
        time.sleep(0.05)


def _allocated_state(api) -> dict:
    """What the scheduler knows is allocated (kubernetes/kubernetes pkg/scheduler/framework/
    plugins/dynamicresources/allocateddevices.go foreachAllocatedDevice, with
    DRAConsumableCapacity): a result with a shareID is a shared device and its
    consumedCapacity adds up per device; any other (but admin access) is a device allocated
    exclusively."""
    state = {"devices": set(), "shared": set(), "capacity": {}}
    for claim in api.claims():
        for r in ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []):
            if r.get("adminAccess"):
                continue
            device = (r["driver"], r["pool"], r["device"])
            if r.get("shareID") is None:
                state["devices"].add(device)
                continue
            state["shared"].add(device)
            if r.get("consumedCapacity") is not None:
                used = state["capacity"].setdefault(device, {})
                for k, v in r["consumedCapacity"].items():
                    used[k] = used.get(k, 0) + Quantity.parse(v).value
    return state


# === the allocator: DRA/structured/internal/*/allocator_*.go Allocate, allocateOne, allocateDevice ===

@dataclass
class _Candidate:
    pool: _Pool
    slice: dict
    index: int          # in the slice
    device: dict        # None: the place of an invalid pool (1.34)

    @property
    def id(self):
        return (self.pool.driver, self.pool.name, self.device["name"])


class _Allocator:
    def __init__(self, rel, classes, pools, state, claims):
        self.rel, self.classes, self.state, self.claims = rel, classes, state, claims
        self.candidates = []
        for p in pools:
            if p.invalid and rel.allocates_from_incomplete_pools:
                self.candidates.append(_Candidate(p, {}, 0, None))
            elif not (p.invalid or p.incomplete) or rel.allocates_from_incomplete_pools:
                self.candidates += [_Candidate(p, s, i, d) for s in p.device_slices
                                    for i, d in enumerate(s["spec"].get("devices") or [])]
        self.allocating = {}            # device -> {claim index}: exclusive, this cycle
        self.allocating_capacity = {}   # device -> {capacity: Decimal}: shared, this cycle
        self.available = {}             # counter key -> {set: {counter: Decimal}}
        self.consumed = {}              # counter key -> {set: {counter: Decimal}}: this cycle
        self.matches = {}
        self.cel_devices = {}
        self.results = [[] for _ in claims]

    def run(self) -> bool:
        for claim in self.claims:
            for req in claim["spec"]["devices"]["requests"]:
                exactly = req.get("exactly")
                if exactly is None or exactly.get("allocationMode", "ExactCount") != "ExactCount" or \
                        exactly.get("adminAccess") or exactly.get("tolerations"):
                    raise NotImplementedError(f"request {req['name']}: only `exactly`, ExactCount, "
                                              "no admin access or tolerations")
                if exactly["deviceClassName"] not in self.classes:
                    raise ValueError(f"request {req['name']}: could not retrieve device class "
                                     f"{exactly['deviceClassName']}")
                if self.classes[exactly["deviceClassName"]]["spec"].get("config"):
                    raise NotImplementedError(f"class {exactly['deviceClassName']}: config")
            if claim["spec"]["devices"].get("constraints") or claim["spec"]["devices"].get("config"):
                raise NotImplementedError("claim constraints and config")
        return self._one(0, 0, 0, 0)

    def _one(self, ci, ri, di, start) -> bool:
        """The first full solution: claims, their requests and each request's devices in
        turn, candidates in order, backtracking when a later one finds nothing."""
        if ci == len(self.claims):
            return True
        requests = self.claims[ci]["spec"]["devices"]["requests"]
        if ri == len(requests):
            return self._one(ci + 1, 0, 0, 0)
        exactly = requests[ri]["exactly"]
        if di >= exactly.get("count", 1):
            return self._one(ci, ri + 1, 0, 0)
        for at in range(start, len(self.candidates)):
            c = self.candidates[at]
            if c.device is None:
                raise AllocationError(f"pool {c.pool.name} is invalid: {c.pool.invalid}")
            if self._in_use(c.id) or not self._selectable(ci, ri, c) or not self._fits(exactly, c.id, c.device):
                continue
            undo = self._allocate_device(ci, ri, di, c)
            if undo is None:
                continue
            if self._one(ci, ri, di + 1, at + 1 if self.rel.next_device_after_previous else 0):
                return True
            undo()
        return False

    def _in_use(self, device) -> bool:
        return device in self.state["devices"] or bool(self.allocating.get(device))

    def _selectable(self, ci, ri, c) -> bool:
        """The class's selectors, then the request's (isSelectable; cached per device and
        request); a CEL error is the allocation's error."""
        key = (c.id, ci, ri)
        if key not in self.matches:
            claim = self.claims[ci]
            exactly = claim["spec"]["devices"]["requests"][ri]["exactly"]
            cls = self.classes[exactly["deviceClassName"]]
            if c.id not in self.cel_devices:
                self.cel_devices[c.id] = cel_device(c.pool.driver, c.device)
            device = self.cel_devices[c.id]
            for owner, selectors in ((f"class {cls['metadata']['name']}", cls["spec"].get("selectors") or []),
                                     (f"claim {claim['metadata']['name']}", exactly.get("selectors") or [])):
                for i, sel in enumerate(selectors):
                    try:
                        ok = matches(sel["cel"]["expression"], device)
                    except CelError as e:
                        raise CelError(f"{owner}: selector #{i}: {e}") from e
                    if not ok:
                        self.matches[key] = False
                        return False
            self.matches[key] = True
        return self.matches[key]

    def _fits(self, request, device, dev) -> bool:
        """CmpRequestOverCapacity: every capacity of the device, as the request consumes it,
        within its policy and, added to what earlier cycles and this one took, within its
        value; asking for a capacity the device lacks skips it."""
        asked = _asked(request)
        capacity = dev.get("capacity") or {}
        if any(k not in capacity for k in asked):
            return False
        earlier, now = self.state["capacity"].get(device, {}), self.allocating_capacity.get(device, {})
        for name, cap in capacity.items():
            consumed = _consumed(asked.get(name), cap)
            if _violates(consumed, cap.get("requestPolicy")):
                return False
            if earlier.get(name, 0) + consumed.value + now.get(name, 0) > Quantity.parse(cap["value"]).value:
                return False
        return True

    def _allocate_device(self, ci, ri, di, c):
        """allocateDevice; returns how to take it back, or None.  As there, what it counted
        before finding the device unusable stays counted for this cycle."""
        request = self.claims[ci]["spec"]["devices"]["requests"][ri]
        dev, multi = c.device, bool(c.device.get("allowMultipleAllocations"))
        if self._in_use(c.id):
            return None
        skip = multi and self.rel.skips_counters_of_a_shared_device_in_use and \
            (c.id in self.state["capacity"] or c.id in self.allocating_capacity)
        if dev.get("consumesCounters") and not skip and not self._take_counters(c):
            return None
        if dev.get("taints"):
            raise NotImplementedError(f"device {dev['name']}: taints")
        if not multi:
            self.allocating.setdefault(c.id, set()).add(ci)
        checked = c
        if self.rel.capacity_checked_on_slice_device_by_request_index:
            checked = _Candidate(c.pool, c.slice, di, c.slice["spec"]["devices"][di])   # IndexError: Go panics
        if not self._fits(request["exactly"], checked.id, checked.device):
            return None
        result = {"request": request["name"], "driver": c.pool.driver, "pool": c.pool.name, "device": dev["name"]}
        consumed = {}
        if multi:
            asked = _asked(request["exactly"])
            consumed = {k: _consumed(asked.get(k), cap) for k, cap in (dev.get("capacity") or {}).items()}
            result["shareID"] = str(uuid.uuid4())
            if consumed:
                result["consumedCapacity"] = {k: str(q) for k, q in consumed.items()}
            taken = self.allocating_capacity.setdefault(c.id, {})
            for k, q in consumed.items():
                taken[k] = taken.get(k, 0) + q.value
        self.results[ci].append(result)

        def undo():
            self.results[ci].pop()
            self.allocating.get(c.id, set()).discard(ci)
            if multi:      # its counters stay taken for this cycle, as the allocator's rollback leaves them
                taken = self.allocating_capacity.get(c.id, {})
                for k, q in consumed.items():
                    taken[k] -= q.value
                if not any(taken.values()):
                    self.allocating_capacity.pop(c.id, None)
            elif dev.get("consumesCounters"):
                self._give_counters(c)
        return undo

    def _counter_key(self, c):
        # keyed by the pool's name alone from 1.35 (its driver is not part of the key)
        return c.slice["metadata"]["name"] if self.rel.counters_per_slice else c.pool.name

    def _holds_counters(self, device) -> bool:
        return device in self.state["devices"] or self.rel.shared_devices_hold_counters and \
            (device in self.state["shared"] or device in self.state["capacity"])

    def _available(self, c) -> dict:
        """The counters left by earlier cycles (computed once): the sets of the pool (1.34:
        of the device's slice) less what its allocated devices consume; negative is none."""
        key = self._counter_key(c)
        if key not in self.available:
            if self.rel.counters_per_slice:
                sets = {cs["name"]: {k: Quantity.parse(v["value"]).value for k, v in cs["counters"].items()}
                        for cs in c.slice["spec"].get("sharedCounters") or []}
                devices = c.slice["spec"].get("devices") or []
            else:
                sets = copy.deepcopy(c.pool.counter_sets)
                devices = [d for s in c.pool.device_slices for d in s["spec"].get("devices") or []]
            for d in devices:
                if self._holds_counters((c.pool.driver, c.pool.name, d["name"])):
                    for use in d.get("consumesCounters") or []:
                        have = sets.get(use["counterSet"], {})
                        for k, v in use["counters"].items():
                            if k in have:
                                have[k] -= Quantity.parse(v["value"]).value
            self.available[key] = sets
        return self.available[key]

    def _take_counters(self, c) -> bool:
        """checkAvailableCounters: add the device's use, then every available counter of the
        pool must cover what this cycle takes (sets not there are not checked)."""
        available = self._available(c)
        taken = self.consumed.setdefault(self._counter_key(c), {})
        for use in c.device["consumesCounters"]:
            in_set = taken.setdefault(use["counterSet"], {})
            for k, v in use["counters"].items():
                in_set[k] = in_set.get(k, 0) + Quantity.parse(v["value"]).value
        if any(have < taken.get(s, {}).get(k, 0) for s, counters in available.items() for k, have in counters.items()):
            self._give_counters(c)
            return False
        return True

    def _give_counters(self, c):
        taken = self.consumed[self._counter_key(c)]
        for use in c.device["consumesCounters"]:
            for k, v in use["counters"].items():
                taken[use["counterSet"]][k] -= Quantity.parse(v["value"]).value




def _solve(api, node, claims, classes, rel, wait_s):
    """One Allocate call on one node: a result list per claim, or (None, why)."""
    pools = _pools(api, node, rel, wait_s)
    allocator = _Allocator(rel, classes, pools, _allocated_state(api), claims)
    if allocator.run():
        return allocator.results, ""
    unusable = [f"pool {p.name} is " + (f"invalid: {p.invalid}" if p.invalid else "incomplete")
                for p in pools if p.invalid or p.incomplete]
    return None, "; ".join(unusable)


def _allocation(results, node):
    return {"devices": {"results": results},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}


def _node_of(claim):
    for term in ((claim.get("status") or {}).get("allocation") or {}).get("nodeSelector", {}).get(
            "nodeSelectorTerms") or []:
        for f in term.get("matchFields") or []:
            if f["key"] == "metadata.name" and f["operator"] == "In":
                return f["values"][0]
    return None


def schedule_pod(api, namespace, pod_name, classes, version=NEWEST, node=None, wait_s=10.0) -> list:
    """What the scheduler does for a pod whose claims exist (instantiate_claims first): all
    its unallocated claims together on one node (`node`, else the first by name that fits),
    each then allocated and reserved for the pod, and the pod bound to the node; else
    Unschedulable, with nothing written.  `classes`: {name: DeviceClass}.  Returns the
    pod's claims as stored."""
    rel = release(version)
    pod = api.pod(namespace, pod_name)
    made = {s["name"]: s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []}
    claims = []
    for pc in pod["spec"].get("resourceClaims") or []:
        name = pc.get("resourceClaimName") or made.get(pc["name"])
        claim = api.claim(namespace, name) if name else None
        assert claim, f"pod {pod_name}: claim {pc['name']} does not exist (yet)"
        claims.append(claim)
    todo = [c for c in claims if not (c.get("status") or {}).get("allocation")]
    bound = {_node_of(c) for c in claims if c not in todo} - {None}
    if node:
        nodes = [node]
    else:
        # a pod no node can take yet stays pending and is tried again (the scheduler's
        # backoff queue): a node whose slices a starting kubelet just deleted republishes them
        deadline = time.monotonic() + wait_s
        while True:
            nodes = sorted({s["spec"]["nodeName"] for s in _listed_slices(api) if s["spec"].get("nodeName")})
            if nodes or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    nodes = [n for n in nodes if not bound or bound == {n}]
    why = {}
    for n in nodes:
        results, why[n] = _solve(api, n, todo, classes, rel, wait_s) if todo else ([], "")
        if results is not None:
            break
    else:
        raise Unschedulable(f"pod {namespace}/{pod_name}: cannot allocate all claims on any of {nodes}"
                            + "".join(f"; {n}: {w}" for n, w in why.items() if w))
    reserved = {"resource": "pods", "name": pod_name, "uid": pod["metadata"]["uid"]}
    stored = []
    for claim in claims:
        status = claim.setdefault("status", {})
        if claim in todo:
            status["allocation"] = _allocation(results[todo.index(claim)], n)
        if reserved not in status.setdefault("reservedFor", []):
            status["reservedFor"].append(reserved)
        stored.append(api.put_claim(claim))
    pod["spec"]["nodeName"] = n
    api.put_pod(pod)
    return stored


def allocate_by_class(api, namespace, claim_name, node, classes, version=NEWEST, wait_s=10.0):
    """Allocate the one claim on `node` as the scheduler would (alone in its cycle), reserved
    for its owning pod if it has one; Unschedulable (an AssertionError) when nothing fits.
    Returns the stored claim."""
    claim = api.claim(namespace, claim_name)
    results, why = _solve(api, node, [claim], classes, release(version), wait_s)
    if results is None:
        raise Unschedulable(f"claim {claim_name}: no device on {node} fits its requests" + (f" ({why})" if why else ""))
    claim["status"] = {"allocation": _allocation(results[0], node)}
    owner = next((r for r in claim["metadata"].get("ownerReferences") or [] if r["kind"] == "Pod"), None)
    if owner:
        claim["status"]["reservedFor"] = [{"resource": "pods", "name": owner["name"], "uid": owner["uid"]}]
    return api.put_claim(claim)


def allocate(api, namespace, claim_name, node, device="gpu-0", share_id=None):
    """Allocate the claim on `device` of `node`'s published slice as a share (consumable
    capacity, rounded as the allocator rounds it), reserved for its owning pod, which is
    bound to the node and running.  No selectors or limits are checked: the placement is
    the caller's.  Returns the stored claim."""
    claim = api.claim(namespace, claim_name)
    [rs] = [s for s in api.slices() if s["spec"].get("nodeName") == node]
    [dev] = [d for d in rs["spec"]["devices"] if d["name"] == device]
    results = []
    for req in claim["spec"]["devices"]["requests"]:
        asked = _asked(req["exactly"])
        consumed = {k: str(_consumed(asked.get(k), cap)) for k, cap in (dev.get("capacity") or {}).items()}
        results.append({"request": req["name"], "driver": rs["spec"]["driver"], "pool": rs["spec"]["pool"]["name"],
                        "device": device, "shareID": share_id or str(uuid.uuid4()), "consumedCapacity": consumed})
    owner = next(r for r in claim["metadata"].get("ownerReferences") or [] if r["kind"] == "Pod")
    claim["status"] = {"allocation": _allocation(results, node),
                       "reservedFor": [{"resource": "pods", "name": owner["name"], "uid": owner["uid"]}]}
    stored = api.put_claim(claim)
    pod = api.pod(namespace, owner["name"])
    pod["spec"]["nodeName"] = node
    pod.setdefault("status", {})["phase"] = "Running"
    api.put_pod(pod)
    return stored
