"""The DRA driver's cost: a claim prepared and unprepared through the kubelet's gRPC,
side by side with the same slice made and removed by slices.create/delete directly, and
the agent's CPU while idle (publishing every --rescan).

The agent, the kubelet stand-in and the fake API server are the tests' own
(tests/helpers/k8s/node.py); the API server is in this process, on loopback.
"""
import statistics
import time

import psutil

from conftest import sim_env
from tests.helpers.k8s.fake_api import FakeApiServer
from tests.helpers.k8s.node import Node

from vgpu import slices

CLAIMS = 40
GiB = 1 << 30


def _ms(samples):
    return statistics.median(samples) / 1e6, max(samples) / 1e6


def test_prepare_and_unprepare_latency_and_idle_cpu(tmp_path, benchmark):
    with FakeApiServer() as api:
        node = Node(tmp_path, api, sim_env(tmp_path / "simgpu", SIMGPU_DEVICES=2))
        agent = node.start("--rescan", "1s")
        try:
            kubelet = node.kubelet()
            claims = [node.claim(f"c{i}", results=[{"device": f"gpu-{i % 2}", "memory": "256Mi", "sm": "2"}])
                      for i in range(CLAIMS)]
            prepare, unprepare = [], []
            for c in claims:
                t = time.monotonic_ns()
                assert kubelet.prepare(c)[c[1]].error == ""
                prepare.append(time.monotonic_ns() - t)
            for c in claims:
                t = time.monotonic_ns()
                assert kubelet.unprepare(c)[c[1]].error == ""
                unprepare.append(time.monotonic_ns() - t)

            direct_create, direct_delete = [], []
            for i in range(CLAIMS):
                quota = {i % 2: slices.device_quota(GiB // 4, sm=200, sm_limit=10000)}
                t = time.monotonic_ns()
                slices.create(node.slice_dir, f"direct-{i}", quota, overcommit=True)
                direct_create.append(time.monotonic_ns() - t)
            for i in range(CLAIMS):
                t = time.monotonic_ns()
                slices.delete(node.slice_dir, f"direct-{i}")
                direct_delete.append(time.monotonic_ns() - t)

            proc = psutil.Process(agent.proc.pid)
            before, t0 = proc.cpu_times(), time.monotonic()
            time.sleep(5)
            after, elapsed = proc.cpu_times(), time.monotonic() - t0
            idle_cpu = (after.user + after.system - before.user - before.system) / elapsed * 100
        finally:
            for k in node.kubelets:
                k.close()
            agent.stop()

    rows = {"prepare (gRPC: claim read, slice, CDI spec, checkpoint)": _ms(prepare),
            "slices.create alone": _ms(direct_create),
            "unprepare (gRPC: slice, CDI spec, checkpoint)": _ms(unprepare),
            "slices.delete alone": _ms(direct_delete)}
    print(f"\n{'per claim, ' + str(CLAIMS) + ' claims':58} {'median ms':>10} {'max ms':>10}")
    for label, (median, worst) in rows.items():
        print(f"{label:58} {median:10.2f} {worst:10.2f}")
    ratio = rows["prepare (gRPC: claim read, slice, CDI spec, checkpoint)"][0] / rows["slices.create alone"][0]
    print(f"prepare / create: {ratio:.1f}x; agent idle CPU with --rescan 1s: {idle_cpu:.2f}% of a core")
    benchmark.extra_info.update({
        "prepare_median_ms": rows["prepare (gRPC: claim read, slice, CDI spec, checkpoint)"][0],
        "create_alone_median_ms": rows["slices.create alone"][0],
        "unprepare_median_ms": rows["unprepare (gRPC: slice, CDI spec, checkpoint)"][0],
        "delete_alone_median_ms": rows["slices.delete alone"][0],
        "agent_idle_cpu_percent_rescan_1s": idle_cpu})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
