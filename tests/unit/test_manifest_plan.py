"""A slices file's plan (vgpu.manifest.plan and apply), called directly on a node directory:
which change each slice gets, the capacity rule, and the order apply takes.  test_apply.py
runs the same through `vgpu-ctl apply` and `export`."""
import pytest

from tests.helpers.simnode import write_usage_counters
from vgpu import manifest, slices
from vgpu.slices import DeviceQuota

GiB = 1 << 30
CAPACITY = {0: 24 * GiB, 1: 24 * GiB}.get     # two 24 GiB GPUs


@pytest.fixture
def node(tmp_path):
    return str(tmp_path / "vgpu")


def make(node, name, memory, device=0, **kw):
    slices.create(node, name, {device: DeviceQuota(memory_max=memory, memory_request=memory, memory_limit=memory)},
                  overcommit=True, **kw)


def plan(node, text, **kw):
    return manifest.plan(node, manifest.read("slices.yaml", text), capacity=kw.pop("capacity", CAPACITY), **kw)


def actions(changes):
    return {c.name: c.action for c in changes}


def test_each_slice_gets_the_change_that_makes_the_node_match_the_file(node):
    make(node, "same", 4 * GiB)
    make(node, "grows", 2 * GiB)
    make(node, "moves", 2 * GiB)
    make(node, "unnamed", 2 * GiB)
    text = ("slices:\n  same: {memory: 4Gi}\n  grows: {memory: 6Gi}\n  moves: {memory: 2Gi, device: 1}\n"
            "  new: {memory: 1Gi}\n")
    assert actions(plan(node, text)) == {"same": "unchanged", "grows": "resize", "moves": "replace",
                                         "new": "create", "unnamed": "kept"}
    assert actions(plan(node, text, prune=True))["unnamed"] == "delete"
    [grows] = [c for c in plan(node, text) if c.name == "grows"]
    assert (grows.old[0].memory_max, grows.new[0].memory_max) == (2 * GiB, 6 * GiB)


def test_a_slice_with_live_processes_is_neither_pruned_nor_moved(node):
    make(node, "busy", 2 * GiB)
    write_usage_counters(node, "busy", memory_current=GiB)        # a live process holds a slot
    with pytest.raises(slices.Busy, match="busy is not in the file but has 1 live process"):
        plan(node, "slices: {}\n", prune=True)
    with pytest.raises(slices.Busy, match="a slice's devices change only by making it again"):
        plan(node, "slices:\n  busy: {memory: 2Gi, device: 1}\n")
    assert actions(plan(node, "slices:\n  busy: {memory: 3Gi}\n")) == {"busy": "resize"}    # in place: allowed


def test_the_guarantees_may_not_grow_past_a_device_but_may_stay_or_shrink_on_an_overcommitted_one(node):
    make(node, "a", 20 * GiB)
    with pytest.raises(slices.Overcommitted, match=r"device 0 would be overcommitted: 25Gi guaranteed there"):
        plan(node, "slices:\n  a: {memory: 20Gi}\n  b: {memory: 5Gi}\n")
    assert actions(plan(node, "slices:\n  a: {memory: 20Gi}\n  b: {memory: 4Gi}\n"))["b"] == "create"  # 24 of 24
    make(node, "over", 10 * GiB)                                    # made with --overcommit: 30 of 24
    assert actions(plan(node, "slices:\n  a: {memory: 20Gi}\n  over: {memory: 8Gi}\n")) == \
        {"a": "unchanged", "over": "resize"}                        # shrinking: allowed though still over
    with pytest.raises(slices.Overcommitted):
        plan(node, "slices:\n  a: {memory: 20Gi}\n  over: {memory: 11Gi}\n")
    assert plan(node, "slices:\n  a: {memory: 20Gi}\n  over: {memory: 11Gi}\n", overcommit=True)


def test_growth_needs_a_capacity_source_and_a_device_the_node_has(node):
    with pytest.raises(slices.CapacityUnknown):
        plan(node, "slices:\n  a: {memory: 1Gi}\n", capacity=None)
    with pytest.raises(slices.InvalidRequest, match=r"device 3 does not exist on this node \(asked for by a\)"):
        plan(node, "slices:\n  a: {memory: 1Gi, device: 3}\n")


def test_apply_deletes_then_shrinks_then_grows_then_creates(node):
    """a shrinks 20Gi -> 4Gi, b grows 2Gi -> 18Gi: in the other order b's resize is refused
    (38Gi of 24Gi), and each step is checked against the capacity."""
    make(node, "a", 20 * GiB)
    make(node, "b", 2 * GiB)
    make(node, "gone", 1 * GiB, device=1)
    make(node, "moves", 1 * GiB, device=1)
    changes = plan(node, "slices:\n  b: {memory: 18Gi}\n  a: {memory: 4Gi}\n  c: {memory: 1Gi}\n"
                         "  moves: {memory: 1Gi, device: 0}\n", prune=True)
    done = []
    assert manifest.apply(node, changes, capacity=CAPACITY, log=lambda c: done.append((c.name, c.action))) == []
    assert done == [("gone", "delete"), ("a", "resize"), ("b", "resize"), ("c", "create"), ("moves", "replace")]
    assert {n: slices.read_quota(node, n).devices[0].memory_max for n in slices.list_names(node)} == \
        {"a": 4 * GiB, "b": 18 * GiB, "c": GiB, "moves": GiB}           # 24 of 24
