"""The DRA driver's claim state machine (vgpu.k8s.driver.Driver), in this process, on
directories and a hand-made claim: not prepared -> preparing -> prepared -> unprepared,
recorded in the checkpoint before it is on disk.  test_k8s_plugin.py runs the same through
the real agent, the kubelet stand-in and the fake API server."""
import json

import pytest

from vgpu import slices
from vgpu.k8s import checkpoint
from vgpu.k8s.driver import Driver
from vgpu.k8s.resourceslice import Gpu
from vgpu.quantities import SHARE_FULL

DRIVER, NODE, NS = "vgpu.dev", "node-a", "team-a"
GiB = 1 << 30
UID = "2f9d6c1e-8a3b-4e7f-9c2d-1b5a4e6f8d3c"
SHARE = "9a1b2c3d-0000-4000-8000-00000000aaaa"


def claim(uid=UID, name="c1", share=SHARE, memory="4Gi", sm="50", device="gpu-0", allocated=True):
    result = {"driver": DRIVER, "pool": NODE, "device": device, "request": "gpu", "shareID": share,
              "consumedCapacity": {"memory": memory, "sm": sm}}
    status = {"allocation": {"devices": {"results": [result]}}} if allocated else {}
    return {"metadata": {"namespace": NS, "name": name, "uid": uid}, "status": status}


class Cluster:
    """The API server's claims as Driver.read_claim reads them, and what the driver logs."""

    def __init__(self, *claims):
        self.claims = {(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in claims}
        self.events = []

    def read(self, namespace, name, timeout):
        return self.claims.get((namespace, name))


@pytest.fixture
def node(tmp_path):
    def make(*claims):
        cluster = Cluster(*claims)
        driver = Driver(DRIVER, NODE, str(tmp_path / "plugin"), str(tmp_path / "cdi"), str(tmp_path / "slices"),
                        "/opt/vgpu/libvgpu.so", None, cluster.read, lambda: [Gpu(0, "A10", "GPU-0", 24 * GiB)],
                        log=cluster.events.append)
        driver.cluster = cluster
        return driver
    (tmp_path / "slices").mkdir()
    return make


def checkpointed(d):
    return checkpoint.load(d.checkpoint_path)


def test_a_claim_becomes_a_slice_with_the_allocated_quota_and_is_recorded_prepared(node):
    d = node(claim())
    [answer] = d.prepare([(NS, UID, "c1")])[UID]["devices"]
    assert (answer["device_name"], answer["share_id"], answer["request_names"]) == ("gpu-0", SHARE, ["gpu"])
    assert answer["cdi_device_ids"] == [f"{DRIVER}/slice={SHARE}"]
    q = slices.read_quota(d.slice_dir, SHARE).devices[0]
    assert (q.memory_max, q.memory_request, q.memory_limit) == (4 * GiB, 4 * GiB, 4 * GiB)
    assert (q.sm_max, q.sm_request, q.sm_limit) == (5000, 5000, SHARE_FULL)
    entry = checkpointed(d)[UID]
    assert (entry["state"], entry["slice"], entry["name"]) == ("prepared", SHARE, "c1")
    with open(entry["cdi_spec"]) as f:
        assert json.load(f)["devices"][0]["name"] == SHARE
    assert [e["event"] for e in d.cluster.events] == ["prepared"]


def test_preparing_again_answers_the_same_and_changes_nothing(node):
    d = node(claim())
    first = d.prepare([(NS, UID, "c1")])
    d.cluster.claims.clear()          # a retry is answered from the checkpoint: the claim is not read
    assert d.prepare([(NS, UID, "c1")]) == first
    assert [e["event"] for e in d.cluster.events] == ["prepared"]


def test_unprepare_removes_slice_spec_and_record_and_again_is_a_no_op(node):
    d = node(claim())
    d.prepare([(NS, UID, "c1")])
    spec = checkpointed(d)[UID]["cdi_spec"]
    assert d.unprepare([(NS, UID, "c1")]) == {UID: ""}
    assert slices.list_names(d.slice_dir) == [] and checkpointed(d) == {}
    with pytest.raises(FileNotFoundError):
        open(spec)
    assert d.unprepare([(NS, UID, "c1")]) == {UID: ""}
    assert [e["event"] for e in d.cluster.events] == ["prepared", "unprepared"]


@pytest.mark.parametrize("left_behind", ["preparing", "prepared, files gone"])
def test_a_claim_left_half_prepared_or_without_its_files_is_prepared_afresh(node, left_behind):
    d = node(claim())
    d.prepare([(NS, UID, "c1")])
    entry = checkpointed(d)[UID]
    if left_behind == "preparing":     # an agent that died between the record and the end
        checkpoint.save(d.checkpoint_path, {UID: {**entry, "state": "preparing"}})
    else:                              # a reboot emptied /run
        slices.delete(d.slice_dir, SHARE, force=True)
    again = node(claim())              # a restarted agent: the checkpoint read again
    assert again.prepare([(NS, UID, "c1")])[UID]["devices"][0]["share_id"] == SHARE
    assert checkpointed(again)[UID]["state"] == "prepared"
    assert slices.list_names(again.slice_dir) == [SHARE]
    assert [e["event"] for e in again.cluster.events] == ["prepared"]


def test_a_claim_that_cannot_be_prepared_is_its_own_error_and_leaves_nothing(node):
    other_uid, other_share = "5e4d3c2b-1a09-4876-9543-21fedcba9876", "9a1b2c3d-0000-4000-8000-00000000bbbb"
    d = node(claim(), claim(uid=other_uid, name="c2", share=other_share, allocated=False))
    out = d.prepare([(NS, other_uid, "c2"), (NS, UID, "c1"), (NS, "no-such-uid", "c3")])
    assert out[other_uid] == {"error": f"ResourceClaim {NS}/c2 is not allocated"}
    assert out["no-such-uid"] == {"error": f"ResourceClaim {NS}/c3 not found"}
    assert out[UID]["devices"][0]["share_id"] == SHARE       # the others go on
    assert list(checkpointed(d)) == [UID] and slices.list_names(d.slice_dir) == [SHARE]


def test_a_claim_made_again_under_its_name_is_refused_for_its_old_uid(node):
    d = node(claim(uid="11111111-2222-4333-8444-555555555555"))
    [error] = d.prepare([(NS, UID, "c1")])[UID].values()
    assert "it was deleted and made again" in error
    assert checkpointed(d) == {} and slices.list_names(d.slice_dir) == []


def test_a_claim_that_does_not_fit_the_gpu_is_refused_and_its_record_dropped(node):
    d = node(claim(memory="30Gi"))
    [error] = d.prepare([(NS, UID, "c1")])[UID].values()
    assert error.startswith(f"claim {NS}/c1 does not fit")
    assert checkpointed(d) == {} and slices.list_names(d.slice_dir) == []


def test_a_share_id_already_serving_another_claim_is_refused(node):
    second_uid = "3c2b1a09-8765-4432-9210-fedcba987654"
    d = node(claim(), claim(uid=second_uid, name="c2", memory="1Gi"))
    d.prepare([(NS, UID, "c1")])
    [error] = d.prepare([(NS, second_uid, "c2")])[second_uid].values()
    assert error == f"claim {NS}/c2: slice {SHARE} already belongs to claim {UID}"
    assert list(checkpointed(d)) == [UID]
