"""The node agent and `status` on memory whose process is gone but which a live process
keeps on the device (docs/shim.md "Memory shared between processes, and forked
children"): a forked child holding its dead parent's slot, an importer holding memory its
dead exporter shared.  simgpu's NVML lists that memory under the dead pid, as a real
driver does; the agent must count it in the slice (method held-slot), raise nothing for
it, and act on nothing.  Real processes on simgpu under the shim, the agent as its own
process (the pieces of tests/agent/test_node_agent.py), the programs of tests/shim/test_shim_memory.py.
"""
import json
import os
import signal
import struct
import time

import pytest

from tests.agent.test_node_agent import GiB, MiB, Node, agents, spawn  # noqa: F401 (agents, spawn: fixtures)
from tests.helpers.simnode import run_python
from tests.helpers.wait import process_state, wait_gone, wait_until
from tests.shim.test_shim_memory import (FORKED, IPC_EXPORTER, IPC_IMPORTER, OUT_OF_MEMORY, PARKER, SUCCESS,
                                         VMM_PARKING, Child)
from vgpu import slices
from vgpu.slices import usage


@pytest.fixture
def node_(tmp_path):
    n = Node(tmp_path)
    n.dir.mkdir()
    return n


@pytest.fixture
def children():
    started = []

    def start(code, env, args=()):
        started.append(Child(code, env, args))
        return started[-1]

    start.releases = []      # files a forked child waits for (touched at teardown: a failed test leaves none)
    yield start
    for release in start.releases:
        release.touch()
    for c in started:
        c.kill()


# the agent at its strictest: every GPU process must be in a slice, and every violation is a kill
STRICT = ("--require-slices", "--on-violation", "kill")


def _quiet(agent):
    """Nothing judged, nothing done: no violation, no action."""
    assert agent.events("violation") == [] and agent.events("action") == []


def _rows(node_):
    """The agent's rows of the GPU's processes, from one look by an Observer of its own."""
    out = run_python("import json, sys\nfrom vgpu.agent import Observer\no = Observer(sys.argv[1])\n"
                     "print(json.dumps([p.to_json() for p in o.observe().processes]))", node_.env,
                     args=[str(node_.dir)])
    return {p["host_pid"]: p for p in json.loads(out.stdout.splitlines()[-1])}


def _forked(node_, children, tmp_path, name="a"):
    """A parent of slice `name` holding 1 GiB, with a forked child that sleeps until
    `release` exists: (Child, parent pid, child pid, release)."""
    release = tmp_path / "release"
    children.releases.append(release)
    p = children(FORKED, node_.shim_env(name), args=(release,))
    r = p.read()
    return p, r["parent"], r["child"], release


def _driver_view(node_, name="a"):
    s = node_.status()
    (c,) = [c for c in s["slices"] if c["name"] == name]
    return s, c, c["devices"][0]


@pytest.mark.parametrize("parent_ends", ["exit", "kill -9", "kill -9, not waited for"])
def test_memory_a_forked_child_keeps_after_its_parent_ends_is_the_slice_s(node_, agents, children, tmp_path,
                                                                          parent_ends):
    """The parent allocates 1 GiB and forks a child that sleeps; the parent ends (exits,
    or is killed -9 and reaped, or killed -9 and left a zombie).  NVML lists 1 GiB under
    the parent's pid; the child holds the parent's slot: the slice's memory, the driver's
    figure of the slice, never an unknown or unsliced process, and nobody is killed."""
    node_.ctl("create", "a", "--memory", "2Gi")
    agent = agents(node_, *STRICT)
    p, parent, child, release = _forked(node_, children, tmp_path)
    if parent_ends == "exit":
        p.send()
        assert p.proc.wait(10) == 0
    elif parent_ends == "kill -9":
        p.kill()
    else:
        p.proc.send_signal(signal.SIGKILL)
        assert wait_until(lambda: process_state(parent) == "Z", 5)

    e = agent.wait_for(lambda e: e.get("event") == "held-slot" and e.get("pid") == parent, 10)
    assert (e["slice"], e["device"], e["memory_driver"], e["memory_charged"]) == ("a", 0, GiB, GiB)
    assert "forked child" in e["note"] and "never acted on" in e["note"]
    row = _rows(node_)[parent]
    assert (row["state"], row["slice"], row["method"], row["memory_driver"], row["memory_charged"]) == \
        ("sliced", "a", "held-slot", GiB, GiB)

    s, c, d = _driver_view(node_)
    assert (d["memory_current"], d["memory_driver"], d["driver_processes"]) == (GiB, GiB, [parent])
    assert s["unknown"] == [] and s["unsliced"] == [] and c["driver_only"] == []
    (proc,) = c["processes"]
    assert (proc["pid"], proc["alive"], proc["gone"], proc["host_pid"]) == (parent, True, True, parent)
    table = node_.ctl("status").stdout
    row = next(line for line in table.splitlines() if line.startswith("a ") and "(gone: held by a forked child)"
               in line)
    assert row.split()[1:4] == [str(parent), str(parent), "1Gi"]
    assert "(+1 held)" in next(line for line in table.splitlines() if line.startswith("a "))
    assert "(unknown)" not in table and "(unsliced)" not in table

    time.sleep(2)                                  # past the grace period, several looks
    _quiet(agent)
    assert process_state(child) not in (None, "Z")       # the child lives on, unharmed

    # the child lets go: the memory leaves the device and the slice
    release.touch()
    wait_gone(child)
    agent.wait_for(lambda e: e.get("event") == "reaped" and e.get("pid") == parent, 5)
    assert wait_until(lambda: node_.usage("a").devices[0]["memory_current"] == 0, 3)
    s, c, d = _driver_view(node_)
    assert d["memory_driver"] == 0 and d["driver_processes"] == [] and s["unknown"] == []
    _quiet(agent)


@pytest.mark.parametrize("exporter_ends", ["free", "kill -9"])
def test_ipc_memory_an_importer_keeps_after_its_exporter_lets_go_is_the_exporter_s_slice_s(node_, agents, children,
                                                                                           exporter_ends):
    """512 MiB exported over IPC and opened by a process of the same slice; the exporter
    frees it (and lives on) or is killed -9.  NVML lists it under the exporter's pid, the
    shim charges it in a shared slot: the slice's driver figure, a shared row in status
    (not a process with pid 0), no violation, nothing killed."""
    node_.ctl("create", "a", "--memory", "1Gi")
    agent = agents(node_, *STRICT)
    e = children(IPC_EXPORTER, node_.shim_env("a"))
    er = e.read()
    i = children(IPC_IMPORTER, node_.shim_env("a"), args=(er["handle"],))
    assert i.read()["open"] == SUCCESS
    exporter = er["pid"]

    def shared_seen():
        s, c, d = _driver_view(node_)
        return (d["memory_driver"] == d["memory_current"] == 512 * MiB and exporter in d["driver_processes"]) and c

    c = wait_until(shared_seen, 5)
    assert c, node_.status()
    (sh,) = c["shared"]
    assert (sh["exporter_pid"], sh["exporter_alive"], sh["held"], sh["memory"]) == (exporter, True, True,
                                                                                     {"0": 512 * MiB})
    assert sorted(p["pid"] for p in c["processes"]) == sorted([exporter, i.pid])     # no pid 0

    if exporter_ends == "free":
        assert e.call() == {"freed": True}
    else:
        e.kill()
    time.sleep(1.5)                                # a look or two after
    s, c, d = _driver_view(node_)
    assert (d["memory_current"], d["memory_driver"]) == (512 * MiB, 512 * MiB)
    assert exporter in d["driver_processes"] and s["unknown"] == [] and s["unsliced"] == []
    (sh,) = c["shared"]
    assert (sh["exporter_pid"], sh["held"], sh["exporter_alive"]) == (exporter, True, exporter_ends == "free")
    assert 0 not in [p["pid"] for p in c["processes"]]
    table = node_.ctl("status").stdout
    row = next(line for line in table.splitlines() if "(shared: exported by" in line)
    assert row.split()[:4] == ["a", "-", "-", "512Mi"]
    assert f"pid {exporter}" in row and (", gone" in row) == (exporter_ends == "kill -9")
    assert "(unknown)" not in table
    row = _rows(node_)[exporter]      # its own slot charges nothing now: the shared slot, under it, does
    assert (row["slice"], row["method"], row["memory_driver"], row["memory_charged"]) == \
        ("a", "usage-file" if exporter_ends == "free" else "held-slot", 512 * MiB, 512 * MiB)
    if exporter_ends == "kill -9":
        ev = agent.wait_for(lambda x: x.get("event") == "held-slot" and x.get("pid") == exporter, 5)
        assert (ev["slice"], ev["memory_driver"], ev["memory_charged"]) == ("a", 512 * MiB, 512 * MiB)
        assert "importer" in ev["note"]
    else:
        assert agent.events("held-slot") == []     # alive: attributed as ever, by its maps
    time.sleep(1)
    _quiet(agent)
    assert i.proc.poll() is None and (exporter_ends != "free" or e.proc.poll() is None)

    assert i.call() == {"close": SUCCESS}
    assert wait_until(lambda: node_.usage("a").devices[0]["memory_current"] == 0, 3)
    assert node_.status()["slices"][0]["shared"] == []
    _quiet(agent)


def test_a_gap_on_memory_a_gone_process_left_is_reported_and_nothing_killed(node_, agents, children, tmp_path):
    """The dead parent's slot, held by its child, rewritten to charge nothing: the slice's
    driver figure is 1 GiB above the shim's, a gap -- with kill as the action, nothing is
    killed: the process whose memory it is is gone (and the log says so), its child lives."""
    node_.ctl("create", "a", "--memory", "2Gi")
    agent = agents(node_, *STRICT)
    p, parent, child, release = _forked(node_, children, tmp_path)
    p.kill()
    agent.wait_for(lambda e: e.get("event") == "held-slot" and e.get("pid") == parent, 10)
    fd = os.open(node_.dir / "a" / "usage", os.O_RDWR)
    try:
        (slot,) = [x.slot for x in node_.usage("a").procs if x.pid == parent]
        os.pwrite(fd, struct.pack("<Q", 0), usage.charge_offset(0, slot))
    finally:
        os.close(fd)
    v = agent.wait_for(lambda e: e.get("event") == "violation" and e.get("kind") == "gap", 5)
    assert (v["slice"], v["memory_driver"], v["memory_current"], v["offenders"], v["gone"]) == \
        ("a", GiB, 0, [], [parent])
    (held,) = [x for x in v["processes"] if x["host_pid"] == parent]
    assert (held["method"], held["memory_charged"]) == ("held-slot", 0)
    acts = [agent.wait_for(lambda e: e.get("event") == "action" and "gone" in e.get("result", ""), 5),
            agent.wait_for(lambda e: e.get("event") == "action" and "reported only" in e.get("result", ""), 5)]
    assert acts[0]["pid"] == parent and acts[0]["result"].startswith("not killed")
    time.sleep(1)
    assert all(not e.get("result", "").startswith("killed") for e in agent.events("action"))
    assert process_state(child) not in (None, "Z")
    release.touch()
    wait_gone(child)
    agent.wait_for(lambda e: e.get("event") == "violation-end" and e.get("kind") == "gap", 5)


def _tenant_under_pid(node_, spawn, pid, name):
    """A tenant of slice `name` with host pid `pid`: the kernel's last pid set through
    ns_last_pid (root only) just before its shell forks it.  Another process may take the
    pid first: tried again."""
    for _ in range(20):
        t = spawn(node_.shim_env(name), prefix=["sh", "-c", f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid && "$@"',
                                                "sh"])
        if t.host_pid == pid:
            return t
        t.kill()
    raise AssertionError(f"pid {pid} was never given to the tenant")


@pytest.mark.parametrize("where", ["another slice", "its own slice"])
def test_a_pid_reused_while_a_held_slot_names_it_is_never_held_against_the_new_process(node_, agents, children,
                                                                                      spawn, tmp_path, where):
    """P (slice a) holds 1 GiB and forks a child that keeps it (a DataLoader worker); P
    exits; Q, a process of another slice (or of a), is given P's pid and allocates 256 MiB.
    NVML lists 1.25 GiB under the pid.  Before, the agent put it all in Q's slice and, with
    kill, killed Q for a gap of 1 GiB.  Now a held slot naming the pid for an earlier
    process decides: of another slice, the figure is no one's to judge (ambiguous, never
    acted on); of Q's own slice, that slot's charge counts as Q's (no gap)."""
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("needs root: the next pid is set through /proc/sys/kernel/ns_last_pid")
    node_.ctl("create", "a", "--memory", "2Gi")
    node_.ctl("create", "b", "--memory", "2Gi")
    agent = agents(node_, *STRICT)
    p, parent, child, release = _forked(node_, children, tmp_path)
    p.send()
    assert p.proc.wait(10) == 0
    agent.wait_for(lambda e: e.get("event") == "held-slot" and e.get("pid") == parent, 10)

    q_slice = "b" if where == "another slice" else "a"
    q = _tenant_under_pid(node_, spawn, parent, q_slice)
    assert q.call(alloc=256 * MiB) == 0
    # nor does Q's shim take P's gigabyte for its context's cost: two rows under its pid
    # are not its own alone (shim/memory.c measure_overhead)
    held_before = GiB if q_slice == "a" else 0
    assert node_.usage(q_slice).devices[0]["memory_current"] == held_before + 256 * MiB
    e = agent.wait_for(lambda e: e.get("event") == "pid-reused" and e.get("pid") == parent, 10)
    row = wait_until(lambda: (lambda r: r["memory_driver"] == GiB + 256 * MiB and r)(_rows(node_)[parent]), 5)
    assert row, _rows(node_)
    if where == "another slice":
        assert (e["state"], e["candidates"], e.get("slice")) == ("ambiguous", ["a", "b"], None), e
        assert "never acted on" in e["note"]
        assert (row["state"], row["candidates"], row["memory_charged"]) == ("ambiguous", ["a", "b"], None)
    else:
        assert (e["state"], e["slice"]) == ("sliced", "a"), e
        assert (row["state"], row["slice"], row["memory_charged"]) == ("sliced", "a", GiB + 256 * MiB), row
    time.sleep(2)                                  # past the grace period, several looks
    _quiet(agent)
    assert q.alive() and process_state(child) not in (None, "Z")

    # the child lets go: the pid is Q's alone again, judged as any other
    release.touch()
    wait_gone(child)
    agent.wait_for(lambda e: e.get("event") == "reaped" and e.get("pid") == parent, 5)
    assert wait_until(lambda: (lambda r: (r["state"], r["memory_driver"], r["memory_charged"]))(_rows(node_)[parent])
                      == ("sliced", 256 * MiB, 256 * MiB), 5)
    _quiet(agent)


def test_memory_a_descriptor_parked_outside_cuda_keeps_after_its_exporter_ends_is_the_slice_s(node_, agents, children,
                                                                                              tmp_path):
    """1 GiB exported as a POSIX descriptor to a process with no CUDA (no slot); the
    exporter releases its handle and exits.  The driver keeps the memory for the
    descriptor and NVML lists it under the gone exporter: the agent counts it in the slice
    through the export's shared slot, which the reapers keep charged (no process holds it)
    while the driver does -- the slice's figure, a shared row in status, no violation,
    nothing killed -- and drains once the parker closes it."""
    node_.ctl("create", "a", "--memory", "1Gi")
    agent = agents(node_, *STRICT)
    path = tmp_path / "sock"
    e = children(VMM_PARKING, node_.shim_env("a"), args=(path,))
    exporter = e.read()["pid"]
    parker = children(PARKER, node_.env, args=(path,))
    assert parker.read() == {"connected": True}
    assert e.call() == {"created": [SUCCESS, OUT_OF_MEMORY, OUT_OF_MEMORY]}
    assert e.call() == {"again": OUT_OF_MEMORY}
    e.proc.stdin.close()
    e.proc.wait(30)

    def parked_seen():
        s, c, d = _driver_view(node_)
        return (d["memory_driver"] == d["memory_current"] == GiB and exporter in d["driver_processes"]) and c

    c = wait_until(parked_seen, 5)
    assert c, node_.status()
    (sh,) = c["shared"]
    assert (sh["exporter_pid"], sh["exporter_alive"], sh["held"], sh["memory"]) == (exporter, False, False,
                                                                                     {"0": GiB})
    ev = agent.wait_for(lambda x: x.get("event") == "held-slot" and x.get("pid") == exporter, 5)
    assert (ev["slice"], ev["memory_driver"], ev["memory_charged"]) == ("a", GiB, GiB)
    assert "descriptor" in ev["note"]
    time.sleep(1)                                  # looks go by: still nothing to judge
    _quiet(agent)
    assert parker.proc.poll() is None

    parker.proc.stdin.close()
    parker.proc.wait(30)
    assert wait_until(lambda: node_.usage("a").devices[0]["memory_current"] == 0, 5), node_.status()
    assert node_.status()["slices"][0]["shared"] == []
    _quiet(agent)
