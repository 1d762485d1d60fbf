"""The node agent's attribution rules (vgpu.agent.attribute): whose slice a GPU process is,
from what the kernel says of it, on hand-made processes.  The end-to-end tests
(test_node_agent.py, test_node_agent_held.py) show them on simgpu with real containers."""
import os
from types import SimpleNamespace

from vgpu.agent.attribute import Attributing
from vgpu.agent.model import Attribution

POD_A = "0f3c2a8e-1d4b-4c5e-9a7f-2b6d8e1c3a5f"
POD_B = "7d1e9b2c-3a4f-4b8d-8c6e-5f2a1b3d4c6e"
HOST_NS = 4026531836            # the agent's own pid and mount namespaces
MISSING_PID = 2 ** 22 + 1       # above pid_max: never a process


class Node(Attributing):
    """The state attribution reads of the Observer: the processes it tracks."""

    def __init__(self, *tracked):
        self.tracked = {t.pid: t for t in tracked}
        self.my_pid_ns = self.my_mnt_ns = HOST_NS
        self._version = self._files_version = 0
        self._groups_cache = None


def process(pid, usage=frozenset(), identity=None, cgroup="/", pid_ns=HOST_NS, mnt_ns=HOST_NS, maps_ok=True,
            start=1000):
    """A tracked process as the kernel describes it (vgpu.agent.model.Tracked)."""
    return SimpleNamespace(pid=pid, visible=True, usage=frozenset(usage), identity=identity, cgroup=cgroup,
                           pid_ns=pid_ns, mnt_ns=mnt_ns, maps_ok=maps_ok, start=start)


def attribute(t, by_identity=None, pods=None, node=None):
    node = node or Node(t)
    return node._attribute(t, by_identity or {}, pods or {}, node._groups(by_identity or {}))


def slot(name_pid, start_ticks=0, shared=False):
    return SimpleNamespace(pid=name_pid, start_ticks=start_ticks, shared=shared)


# === a live process ===

def test_the_usage_file_it_maps_names_its_slice_and_outranks_the_identity_file():
    a = attribute(process(10, usage={"train"}, identity="id-infer"), by_identity={"id-infer": "infer"})
    assert (a.slice, a.method, a.state, a.certain) == ("train", "usage-file", "sliced", True)
    assert a.note == "its container was given slice infer"
    a = attribute(process(10, identity="id-infer"), by_identity={"id-infer": "infer"})
    assert (a.slice, a.method, a.state) == ("infer", "identity-file", "sliced")


def test_the_usage_files_of_two_slices_make_it_ambiguous_never_certain():
    a = attribute(process(10, usage={"b", "a"}))
    assert (a.slice, a.state, a.candidates, a.certain) == (None, "ambiguous", ("a", "b"), False)


def test_a_pod_cgroup_names_its_slice_in_either_cgroup_driver_spelling():
    pods = {POD_A: "train", POD_B: "infer"}
    cgroupfs = f"/kubepods/burstable/pod{POD_A}/0123abcd"
    systemd = f"/kubepods.slice/kubepods-pod{POD_B.replace('-', '_')}.slice/cri-containerd-0123.scope"
    assert (attribute(process(10, cgroup=cgroupfs), pods=pods).slice,
            attribute(process(10, cgroup=systemd), pods=pods).slice) == ("train", "infer")
    assert attribute(process(10, cgroup=cgroupfs), pods=pods).method == "pod"
    both = attribute(process(10, cgroup=f"/x/pod{POD_A}/pod{POD_B}"), pods=pods)
    assert (both.state, both.candidates) == ("ambiguous", ("infer", "train"))


def test_a_process_with_no_file_of_its_own_takes_the_slice_of_its_container_from_its_neighbours():
    """A process in a container (its own namespaces) that maps a slice's usage file vouches
    for its cgroup and its pid namespace; one that is not in a container vouches for none."""
    sliced = process(11, usage={"train"}, cgroup="/box/1", pid_ns=77, mnt_ns=78)
    helper = process(12, cgroup="/box/1", pid_ns=99, mnt_ns=98)       # same cgroup, no usage file
    sibling = process(13, cgroup="/elsewhere", pid_ns=77, mnt_ns=79)   # same pid namespace
    node = Node(sliced, helper, sibling)
    assert (attribute(helper, node=node).slice, attribute(helper, node=node).method) == ("train", "cgroup")
    assert (attribute(sibling, node=node).slice, attribute(sibling, node=node).method) == ("train", "pid-namespace")
    on_the_host = process(14, usage={"train"}, cgroup="/box/1")        # the agent's own namespaces
    assert attribute(helper, node=Node(on_the_host, helper)).state == "unsliced"


def test_a_container_holding_processes_of_two_slices_vouches_for_no_one():
    a = process(11, usage={"a"}, cgroup="/box/1", pid_ns=77, mnt_ns=78)
    b = process(12, usage={"b"}, cgroup="/box/1", pid_ns=77, mnt_ns=78)
    helper = process(13, cgroup="/box/1", pid_ns=77, mnt_ns=78)
    got = attribute(helper, node=Node(a, b, helper))
    assert (got.state, got.candidates, got.certain) == ("ambiguous", ("a", "b"), False)


def test_nothing_to_go_by_is_unsliced_unless_its_maps_could_not_be_read():
    assert attribute(process(10)).state == "unsliced"
    unread = attribute(process(10, maps_ok=False))
    assert (unread.state, unread.certain) == ("unknown", False)
    assert Node()._attribute(None, {}, {}, {}).state == "unknown"      # not visible from here


# === a pid NVML lists that is gone, or reused ===

def test_a_gone_pid_whose_slot_is_held_is_its_slices_held_slot_and_two_slices_make_it_ambiguous():
    node = Node()
    a, own = node._held(MISSING_PID, None, [("train", slot(MISSING_PID))])
    assert (a.slice, a.method, a.state) == ("train", "held-slot", "sliced")
    assert own == [slot(MISSING_PID)]
    a, _ = node._held(MISSING_PID, None, [("train", slot(MISSING_PID)), ("infer", slot(MISSING_PID, shared=True))])
    assert (a.state, a.candidates) == ("ambiguous", ("infer", "train"))
    assert node._held(MISSING_PID, None, []) is None
    # a live process is not gone: the attribution it has stands
    me = SimpleNamespace(visible=True, start=None)
    assert node._held(os.getpid(), me, [("train", slot(os.getpid()))]) is None


def test_a_live_pid_that_an_ended_processs_slot_also_names():
    node = Node()
    t = process(10, start=5000)
    mine = Attribution("train", "usage-file", "sliced")
    # a slot of its own start, of a time it ran at (the shim's claim), or one that records
    # none: its own, nothing earlier
    assert node._reused(10, t, mine, [("train", slot(10, start_ticks=5000)), ("train", slot(10, start_ticks=5042)),
                                      ("train", slot(10))]) is None
    # an earlier process's slot in its own slice: counted as its own
    a, earlier = node._reused(10, t, mine, [("train", slot(10, start_ticks=4000))])
    assert (a.slice, a.method, a.state, a.reused) == ("train", "usage-file", "sliced", True)
    assert earlier == [slot(10, start_ticks=4000)]
    # in another slice: no one's figure to judge
    a, earlier = node._reused(10, t, mine, [("infer", slot(10, start_ticks=4000))])
    assert (a.state, a.candidates, a.reused, earlier) == ("ambiguous", ("infer", "train"), True, [])
