"""The scheduler stand-in (tests/helpers/k8s/controllers.py) against hand-made ResourceSlices in the
fake API server, per Kubernetes release where the real allocator differs: consumable
capacity rounded to the device's requestPolicy and written as the allocator writes it; a
pod's claims all on one node or none; CEL selectors with capacity as Quantity objects;
the order slices are tried in; counters held by shared devices across scheduling cycles;
and 1.34's capacity check against the slice's first device and counters read from the
device's own slice only.  Each rule's source is named in helpers/k8s/controllers.py.

The slices mirror what the vgpu driver publishes (a whole GPU shared through consumable
capacity, MIG devices consuming its counters, counter sets in a slice of their own), cut
down: a GPU has two memory slices, and a 3g.40gb device at placement 0 or 4 takes one.
"""
import json
import urllib.request

import pytest
import yaml

from tests.helpers.k8s.controllers import (AllocationError, CelError, Quantity, Unschedulable, _consumed,
                                           _violates, instantiate_claims, release, schedule_pod)
from tests.helpers.k8s.defaults import stored
from tests.helpers.k8s.fake_api import FakeApiServer
from tests.helpers.k8s.models import roundtrip
from tests.helpers.paths import ROOT

DRIVER, NODE, NS = "vgpu.dev", "node-a", "team-a"
CLASSES = {d["metadata"]["name"]: d for d in yaml.safe_load_all((ROOT / "deploy/dra/deviceclass.yaml").read_text())
           if d}
# the driver's requestPolicy (src/vgpu/k8s/resourceslice.py), its numbers as it writes them
MEMORY_POLICY = {"default": "1073741824", "validRange": {"min": "268435456", "step": "268435456"}}
SM_POLICY = {"default": "10", "validRange": {"min": "1", "max": "100", "step": "1"}}
SOFT = {"deviceClassName": "gpu.vgpu.dev", "capacity": {"requests": {"memory": "4Gi"}}}
ISO = {"deviceClassName": "mig.vgpu.dev",
       "selectors": [{"cel": {"expression": 'device.attributes["vgpu.dev"].profile == "3g.40gb"'}}]}
BEFORE_FIX = ["1.35", "1.36.0", "1.36.1"]       # shared devices hold no counters across cycles
FIXED = ["1.36.2", "1.37"]


@pytest.fixture
def api():
    with FakeApiServer() as server:
        yield server


# === slices, pods ===

def gpu(i, memory="80Gi", model="NVIDIA H100 80GB HBM3", counters=True):
    """A whole GPU shared through consumable capacity; with counters, it consumes all of its set."""
    device = {"name": f"gpu-{i}", "allowMultipleAllocations": True,
              "attributes": {"type": {"string": "gpu"}, "model": {"string": model}, "index": {"int": i}},
              "capacity": {"memory": {"value": memory, "requestPolicy": MEMORY_POLICY},
                           "sm": {"value": "100", "requestPolicy": SM_POLICY}}}
    if counters:
        device["consumesCounters"] = [{"counterSet": f"gpu-{i}", "counters": {
            "memory-slice-0": {"value": "1"}, "memory-slice-1": {"value": "1"}}}]
    return device


def mig(i, start):
    return {"name": f"gpu-{i}-mig-3g40gb-{start}",
            "attributes": {"type": {"string": "mig"}, "profile": {"string": "3g.40gb"}, "index": {"int": i}},
            "capacity": {"memory": {"value": "40Gi"}},
            "consumesCounters": [{"counterSet": f"gpu-{i}",
                                  "counters": {f"memory-slice-{start // 4}": {"value": "1"}}}]}


def counter_set(i):
    return {"name": f"gpu-{i}", "counters": {"memory-slice-0": {"value": "1"}, "memory-slice-1": {"value": "1"}}}


def a_slice(suffix, count, devices=(), counters=()):
    spec = {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 1, "resourceSliceCount": count}}
    if devices:
        spec["devices"] = list(devices)
    if counters:
        spec["sharedCounters"] = list(counters)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{NODE}-{DRIVER}-{suffix}"}, "spec": spec}


def post(api, body):
    """Create the slice through the fake API server (its validation and canonical quantities)."""
    request = urllib.request.Request(f"{api.url}/apis/resource.k8s.io/v1/resourceslices", method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {api.token}",
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)


def store_as_134_would(api, body):
    """A slice with counter sets beside devices: a 1.34 API server took it; this one applies
    the 1.35 rule and refuses it, so it goes into the store directly."""
    with api._lock:
        api._slices[body["metadata"]["name"]] = stored(body)


def mig_node(api, gpus):
    """The 1.35+ layout: the counter sets in a slice of their own, a slice per GPU."""
    post(api, a_slice("counters", gpus + 1, counters=[counter_set(i) for i in range(gpus)]))
    for i in range(gpus):
        post(api, a_slice(f"gpu-{i}", gpus + 1, devices=[gpu(i), mig(i, 0), mig(i, 4)]))


def make_pod(api, name, **requests):
    """Pod `name` with a claim per keyword (the request's `exactly`) through a template each,
    and the claims the resourceclaim controller makes for it."""
    for claim, exactly in requests.items():
        tmpl = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": f"{name}-{claim}", "namespace": NS},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}}
        roundtrip(tmpl)
        api._templates[(NS, f"{name}-{claim}")] = tmpl
    api.put_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
                 "spec": {"resourceClaims": [{"name": c, "resourceClaimTemplateName": f"{name}-{c}"} for c in requests],
                          "containers": [{"name": "c", "image": "cuda",
                                          "resources": {"claims": [{"name": c} for c in requests]}}]}})
    return instantiate_claims(api, NS, name)


def placed(claims) -> list:
    return [r["device"] for c in claims for r in c["status"]["allocation"]["devices"]["results"]]


def schedule(api, name, version, wait_s=10.0, **requests):
    """The pod's devices, or None when it is unschedulable (and then nothing was written)."""
    claims = make_pod(api, name, **requests)
    try:
        return placed(schedule_pod(api, NS, name, CLASSES, version=version, wait_s=wait_s))
    except Unschedulable:
        assert not any(api.claim(NS, c["metadata"]["name"]).get("status") for c in claims)
        assert not api.pod(NS, name)["spec"].get("nodeName")
        return None


# === consumable capacity ===

def test_capacity_is_rounded_up_to_the_next_step_and_written_as_the_allocator_writes_it(api):
    post(api, a_slice("gpus", 1, devices=[gpu(0, counters=False)]))
    claims = make_pod(api, "p", stepped={"deviceClassName": "gpu.vgpu.dev",
                                         "capacity": {"requests": {"memory": "1000Mi", "sm": "50"}}},
                      small={"deviceClassName": "gpu.vgpu.dev", "capacity": {"requests": {"memory": "100Mi"}}},
                      default={"deviceClassName": "gpu.vgpu.dev"})
    out = {c["metadata"]["annotations"]["resource.kubernetes.io/pod-claim-name"]:
           c["status"]["allocation"]["devices"]["results"][0] for c in schedule_pod(api, NS, "p", CLASSES)}
    assert {c["metadata"]["name"] for c in claims} == {c["metadata"]["name"] for c in api.claims()}
    # up to the next 256Mi step from the minimum (written binary), not down to 768Mi
    assert out["stepped"]["consumedCapacity"] == {"memory": "1Gi", "sm": "50"}
    # below the minimum: the minimum, as the slice writes it; nothing asked: the default, likewise
    assert out["small"]["consumedCapacity"] == {"memory": "268435456", "sm": "10"}
    assert out["default"]["consumedCapacity"] == {"memory": "1073741824", "sm": "10"}
    assert len({r["shareID"] for r in out.values()}) == 3


@pytest.mark.parametrize("asked, policy, consumed, violates", [
    ("1000Mi", MEMORY_POLICY, "1Gi", False),
    ("1G", MEMORY_POLICY, "1Gi", False),
    ("4Gi", MEMORY_POLICY, "4Gi", False),
    (None, MEMORY_POLICY, "1073741824", False),
    ("0.5", SM_POLICY, "1", False),
    ("101", SM_POLICY, "101", True),                       # above max
    ("3Gi", {"validValues": ["1Gi", "2Gi", "4Gi"]}, "4Gi", False),
    ("5Gi", {"validValues": ["1Gi", "2Gi", "4Gi"]}, "5Gi", True),
    ("300Mi", {"validRange": {"min": "256Mi"}}, "300Mi", False),
    ("3", {"default": "3", "validRange": {"min": "2", "step": "2"}}, "4", False),
    ("3Gi", None, "3Gi", False),
])
def test_a_request_is_consumed_as_the_policy_rounds_it(asked, policy, consumed, violates):
    capacity = {"value": "80Gi", **({"requestPolicy": policy} if policy else {})}
    got = _consumed(None if asked is None else Quantity.parse(asked), capacity)
    assert (str(got), _violates(got, policy)) == (consumed, violates)


def test_a_request_above_the_policy_max_or_past_what_is_left_fits_no_device(api):
    post(api, a_slice("gpus", 1, devices=[gpu(0, counters=False)]))
    too_much_sm = {"deviceClassName": "gpu.vgpu.dev", "capacity": {"requests": {"sm": "101"}}}
    assert schedule(api, "sm", "1.37", gpu=too_much_sm) is None
    half = {"deviceClassName": "gpu.vgpu.dev", "capacity": {"requests": {"memory": "40Gi"}}}
    assert schedule(api, "one", "1.37", gpu=half) == ["gpu-0"]
    assert schedule(api, "two", "1.37", gpu=half) == ["gpu-0"]
    assert schedule(api, "three", "1.37", gpu=half) is None


# === a pod's claims together ===

@pytest.mark.parametrize("version, expected", [
    ("1.34", ["gpu-0", "gpu-0-mig-3g40gb-0"]),      # counters in another slice: never checked
    *[(v, None) for v in BEFORE_FIX + FIXED]])
def test_a_pods_claims_all_fit_on_one_node_or_none_is_written(api, version, expected):
    mig_node(api, 1)
    assert schedule(api, "both", version, soft=SOFT, iso=ISO) == expected
    # either one alone fits the same GPU
    assert schedule(api, "soft", version, soft=SOFT) == ["gpu-0"]


def test_a_pod_is_bound_to_the_node_its_claims_are_allocated_on_and_reserves_them(api):
    mig_node(api, 2)
    claims = make_pod(api, "both", soft=SOFT, iso=ISO)
    got = schedule_pod(api, NS, "both", CLASSES)
    assert placed(got) == ["gpu-0", "gpu-1-mig-3g40gb-0"]
    pod = api.pod(NS, "both")
    assert pod["spec"]["nodeName"] == NODE
    for c in got:
        assert c["status"]["reservedFor"] == [{"resource": "pods", "name": "both", "uid": pod["metadata"]["uid"]}]
        assert c["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [NODE]
    assert sorted(c["metadata"]["name"] for c in got) == sorted(c["metadata"]["name"] for c in claims)
    [mig_result] = [r for c in got for r in c["status"]["allocation"]["devices"]["results"] if "mig" in r["device"]]
    assert "shareID" not in mig_result and "consumedCapacity" not in mig_result   # a device of its own


@pytest.mark.parametrize("version", BEFORE_FIX + FIXED)
def test_a_shared_device_keeps_its_counters_in_the_cycle_when_the_allocator_backtracks(api, version):
    """The allocator's rollback of a device allowing multiple allocations gives back its
    capacity but not its counters: with the software slice tried on gpu-0 first, a MIG
    device that only gpu-0 may give finds gpu-0's counters taken even after the software
    slice moved to gpu-1.  In the other order the same two claims fit."""
    mig_node(api, 2)
    gpu0 = {"cel": {"expression": 'device.attributes["vgpu.dev"].index == 0'}}
    on_gpu0 = {**ISO, "selectors": ISO["selectors"] + [gpu0]}
    assert schedule(api, "soft-first", version, a_soft=SOFT, b_iso=on_gpu0) is None
    assert schedule(api, "iso-first", version, a_iso=on_gpu0, b_soft=SOFT) == ["gpu-0-mig-3g40gb-0", "gpu-1"]


@pytest.mark.parametrize("version, expected", [("1.34", ["gpu-0", "gpu-0"]), ("1.35", ["gpu-0", "gpu-0"]),
                                               ("1.36.0", ["gpu-0", "gpu-1"]), ("1.37", ["gpu-0", "gpu-1"])])
def test_from_1_36_a_requests_next_device_is_searched_after_the_one_it_took(api, version, expected):
    post(api, a_slice("gpus", 1, devices=[gpu(0, counters=False), gpu(1, counters=False)]))
    two = {"deviceClassName": "gpu.vgpu.dev", "count": 2, "capacity": {"requests": {"memory": "4Gi"}}}
    assert schedule(api, "two", version, gpu=two) == expected


@pytest.mark.parametrize("version, expected", [("1.34", ["gpu-0"]), ("1.35", None), ("1.37", None)])
def test_1_34_allocates_from_a_pool_still_being_published(api, version, expected):
    post(api, a_slice("gpus", 2, devices=[gpu(0, counters=False)]))       # one slice of two
    assert schedule(api, "soft", version, wait_s=0, soft=SOFT) == expected


@pytest.mark.parametrize("version", ["1.34", "1.35", "1.37"])
def test_an_invalid_pool_is_an_error_in_1_34_and_a_node_that_does_not_fit_after(api, version):
    post(api, a_slice("a", 2, devices=[gpu(0, counters=False)]))
    post(api, a_slice("b", 2, devices=[gpu(0, counters=False)]))           # the same device name twice
    make_pod(api, "soft", soft=SOFT)
    error = AllocationError if version == "1.34" else Unschedulable
    with pytest.raises(error, match="invalid: duplicate device name"):
        schedule_pod(api, NS, "soft", CLASSES, version=version)


# === CEL ===

def two_sizes(api):
    post(api, a_slice("gpus", 1, devices=[gpu(0, "24Gi", "NVIDIA A10", counters=False),
                                          gpu(1, "80Gi", counters=False)]))


@pytest.mark.parametrize("expression", [
    'device.capacity["vgpu.dev"].memory.compareTo(quantity("40Gi")) >= 0',
    'device.capacity["vgpu.dev"].memory.isGreaterThan(quantity("40Gi"))',
    '!device.capacity["vgpu.dev"].memory.isLessThan(quantity("40Gi"))',
    'device.capacity["vgpu.dev"].memory.sub(quantity("40Gi")).asApproximateFloat() > 0.0',
    'device.capacity["vgpu.dev"].memory == quantity("80Gi")',
    'device.capacity["vgpu.dev"].memory.asInteger() > 40 * 1024 * 1024 * 1024',
    'sign(device.capacity["vgpu.dev"].memory.sub(quantity("40Gi"))) == 1',
])
def test_capacity_in_a_selector_is_a_quantity(api, expression):
    two_sizes(api)
    big = {"deviceClassName": "gpu.vgpu.dev", "selectors": [{"cel": {"expression": expression}}]}
    assert schedule(api, "big", "1.37", gpu=big) == ["gpu-1"]


@pytest.mark.parametrize("expression", [
    'device.capacity["vgpu.dev"].memory > 1000',             # no operators on a Quantity
    '1000 < device.capacity["vgpu.dev"].memory',
    'device.capacity["vgpu.dev"].memory == 85899345920',
    'device.capacity["vgpu.dev"].memory.sign() == 1',        # sign is a function, not a method
    'compareTo(device.capacity["vgpu.dev"].memory, quantity("1")) > 0',
    'device.capacity["vgpu.dev"].memory.compareTo(1) > 0',
    'device.attributes["vgpu.dev"].profile == "3g.40gb"',    # the GPU has none: a runtime error
])
def test_a_selector_in_error_fails_the_allocation_loudly_and_writes_nothing(api, expression):
    two_sizes(api)
    claims = make_pod(api, "bad", gpu={"deviceClassName": "gpu.vgpu.dev",
                                       "selectors": [{"cel": {"expression": expression}}]})
    with pytest.raises(CelError, match=rf"claim {claims[0]['metadata']['name']}: selector #0: CEL"):
        schedule_pod(api, NS, "bad", CLASSES)
    assert not api.claim(NS, claims[0]["metadata"]["name"]).get("status")
    assert not api.pod(NS, "bad")["spec"].get("nodeName")


def test_a_class_selector_is_tried_before_the_claims_and_a_domain_not_there_is_an_empty_map(api):
    mig_node(api, 2)
    # on gpu-0 the class fails first, so the claim's lookup of `profile` never runs there
    assert schedule(api, "iso", "1.37", iso=ISO) == ["gpu-0-mig-3g40gb-0"]
    nowhere = {"deviceClassName": "gpu.vgpu.dev",
               "selectors": [{"cel": {"expression": 'size(device.attributes["other.example.com"]) == 0'}}]}
    assert schedule(api, "nowhere", "1.37", gpu=nowhere) == ["gpu-1"]      # gpu-0's counters are held


# === the order slices are tried in ===

@pytest.mark.parametrize("version, expected", [("1.34", "gpu-0"), ("1.35", "gpu-0"), ("1.36.0", "gpu-1"),
                                               ("1.37", "gpu-1")])
def test_from_1_36_slices_are_tried_by_name_before_in_the_order_they_come(api, version, expected):
    # stored H100 first; by name the A10's slice comes first
    post(api, a_slice("h100", 2, devices=[gpu(0, "80Gi", counters=False)]))
    post(api, a_slice("a10", 2, devices=[gpu(1, "24Gi", "NVIDIA A10", counters=False)]))
    assert schedule(api, "soft", version, soft=SOFT) == [expected]


# === counters ===

@pytest.mark.parametrize("version, mig_on", [("1.34", "gpu-0"), *[(v, "gpu-0") for v in BEFORE_FIX],
                                             *[(v, "gpu-1") for v in FIXED]])
def test_a_software_slice_written_in_an_earlier_cycle_holds_its_gpus_counters_from_1_36_2(api, version, mig_on):
    mig_node(api, 2)
    assert schedule(api, "soft", version, soft=SOFT) == ["gpu-0"]
    assert schedule(api, "iso", version, iso=ISO) == [f"{mig_on}-mig-3g40gb-0"]
    # more software slices keep coming to gpu-0: its counters are not asked for again
    assert schedule(api, "soft2", version, soft=SOFT) == ["gpu-0"]
    assert schedule(api, "two-softs", version, a=SOFT, b=SOFT) == ["gpu-0", "gpu-0"]


def test_a_pool_an_older_scheduler_oversubscribed_takes_no_device_with_counters_from_1_36_2(api):
    """1.35 put a MIG device on gpu-0 under a software slice; 1.36.2 counts both, gpu-0's set
    goes below zero, and the allocator, which checks every set of the pool, then finds
    none of the pool's counters enough -- gpu-1's MIG devices included."""
    mig_node(api, 2)
    assert schedule(api, "soft", "1.35", soft=SOFT) == ["gpu-0"]
    assert schedule(api, "iso", "1.35", iso=ISO) == ["gpu-0-mig-3g40gb-0"]
    assert schedule(api, "iso2", "1.37", iso=ISO) is None
    assert schedule(api, "iso3", "1.35", iso=ISO) == ["gpu-0-mig-3g40gb-4"]
    assert schedule(api, "soft2", "1.37", soft=SOFT) == ["gpu-0"]      # its counters are not checked again


# === 1.34 ===

@pytest.mark.parametrize("version, expected", [
    ("1.34", ["gpu-0"] * 3 + [None] * 4),
    *[(v, ["gpu-0"] * 3 + ["gpu-1"] * 3 + [None]) for v in ["1.35", "1.36.2", "1.37"]]])
def test_1_34_checks_a_request_also_against_the_first_device_of_the_slice(api, version, expected):
    post(api, a_slice("gpus", 1, devices=[gpu(0, "24Gi", "NVIDIA A10", counters=False),
                                          gpu(1, "24Gi", "NVIDIA A10", counters=False)]))
    third = {"deviceClassName": "gpu.vgpu.dev", "capacity": {"requests": {"memory": "8Gi"}}}
    got = [schedule(api, f"p{i}", version, gpu=third) for i in range(7)]
    assert [g and g[0] for g in got] == expected


@pytest.mark.parametrize("version", ["1.34", "1.34.9"])
def test_1_34_reads_counters_from_the_devices_own_slice_and_takes_them_at_every_allocation(api, version):
    store_as_134_would(api, a_slice("gpus", 1, devices=[gpu(0), mig(0, 0), mig(0, 4)], counters=[counter_set(0)]))
    assert schedule(api, "soft", version, soft=SOFT) == ["gpu-0"]
    # in one cycle: the whole GPU's counters once, then nothing is left for anything on it
    assert schedule(api, "both", version, soft=SOFT, iso=ISO) is None
    assert schedule(api, "two-softs", version, a=SOFT, b=SOFT) is None
    # across cycles a shared device holds none
    assert schedule(api, "iso", version, iso=ISO) == ["gpu-0-mig-3g40gb-0"]


def test_from_1_35_a_slice_with_counter_sets_offers_no_devices(api):
    store_as_134_would(api, a_slice("gpus", 1, devices=[gpu(0), mig(0, 0), mig(0, 4)], counters=[counter_set(0)]))
    assert schedule(api, "soft", "1.35", soft=SOFT) is None


def test_versions_name_a_release_and_a_minor_alone_is_its_first():
    assert release("1.36").number == (1, 36, 0) and release("v1.36.2").number == (1, 36, 2)
    assert release("1.35.9").shared_devices_hold_counters is False
    assert release("1.36.1").shared_devices_hold_counters is False
    assert release("1.36.2").shared_devices_hold_counters is True
    assert release().number >= (1, 37, 0)
    with pytest.raises(ValueError):
        release("1.33")
