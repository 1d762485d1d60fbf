"""Do no harm: honest processes that allocate and free as fast as they can are never a gap,
never killed.  The node agent reads the driver and the usage files at different moments;
a free between the two once looked like memory the shim did not count, and with
`--on-violation kill` honest processes died (9 in 5 of 10 runs of 40 s).  The agent now
judges a gap only from a look with the usage file read just before and just after the
driver, in which no charge moved (node.Observer.confirm_gap).

Two slices, 4 processes each (tests/programs/churn.c: 2 threads, 64 MiB .. 1 GiB blocks,
cuMemAlloc and cuMemAllocAsync), the agent looking every 100 ms with a 100 ms grace and
`--on-violation kill`; with and without a context overhead (simgpu's, 256 MiB on an A10,
as a real card charges one).  The suite runs one round of 10 s each way; the long hunt,
10 rounds of 40 s each way:
`VGPU_CHURN_ROUNDS=10 VGPU_CHURN_SECONDS=40 .venv/bin/python -m pytest tests/test_node_agent_churn.py -q`."""
import os
import subprocess

import pytest

from test_node_agent import Node, agents  # noqa: F401 (a fixture)

ROUNDS = int(os.environ.get("VGPU_CHURN_ROUNDS", "1"))
SECONDS = float(os.environ.get("VGPU_CHURN_SECONDS", "10"))


def churn_round(tmp_path, c_program, agents, seconds, overhead, seed=0):
    """(exit codes of the 8 churners, the agent's violation and action events)."""
    node_ = Node(tmp_path)
    node_.dir.mkdir()
    if overhead:
        node_.env["SIMGPU_CONTEXT_OVERHEAD"] = "profile"
    for name in ("a", "b"):
        node_.ctl("create", name, "--memory", "6Gi")
    agent = agents(node_, "--interval", "100ms", "--grace", "100ms", "--on-violation", "kill")
    exe = c_program("churn", ("-pthread",))
    procs = [subprocess.Popen([str(exe), str(seconds), "2", str(seed * 8 + i)], env=node_.shim_env("ab"[i % 2]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(8)]
    codes = []
    for p in procs:
        try:
            p.wait(timeout=seconds + 60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        codes.append(p.returncode)
        assert "allocations=" in p.stdout.read() or p.returncode != 0
    return codes, agent.events("violation"), agent.events("action")


@pytest.mark.parametrize("seed", range(ROUNDS))
@pytest.mark.parametrize("overhead", [False, True], ids=["no-context-overhead", "context-overhead"])
def test_honest_churn_is_never_a_gap_and_nobody_is_killed(tmp_path, c_program, agents, overhead, seed):
    codes, violations, actions = churn_round(tmp_path, c_program, agents, SECONDS, overhead, seed)
    assert actions == [], actions
    assert codes == [0] * 8, codes            # -9: the agent killed an honest process
    assert [v for v in violations if v.get("kind") in ("gap", "over-cap")] == [], violations
