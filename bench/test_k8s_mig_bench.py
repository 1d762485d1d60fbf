"""The DRA prepare path of a MIG claim: NodePrepareResources for a claim allocated one
MIG device (the claim read from the API server, the checkpoint, the GPU and compute
instance made through NVML at the allocated placement, the CDI spec) and its unprepare
(instance destroyed, MIG mode back off), through the kubelet stand-in, side by side with
vgpu.mig.create_instance / destroy_instance alone on the same simgpu h100-80g.  Measured,
not asserted: the figures go to the benchmark's extra_info.
"""
import json
import statistics
import subprocess
import sys
import time

from tests.helpers.k8s.fake_api import FakeApiServer
from tests.helpers.k8s.node import Node

from vgpu.sim import sim_environment

ROUNDS = 10
PLACEMENTS = ("gpu-0-mig-3g40gb-0", "gpu-0-mig-3g40gb-4")

DIRECT = """
import json, sys, time
from vgpu import mig
out = {"create": [], "destroy": []}
for i in range(int(sys.argv[1])):
    t = time.monotonic_ns(); rec = mig.create_instance(0, "3g.40gb", placement=4 * (i % 2))
    out["create"].append(time.monotonic_ns() - t)
    t = time.monotonic_ns(); mig.destroy_instance(rec, disable_mig=True)
    out["destroy"].append(time.monotonic_ns() - t)
print(json.dumps(out))
"""


def h100_env(state_dir):
    """A clean environment on a fresh simgpu node with one H100 80GB."""
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIMGPU_", "VGPU_", "CUDA_DEVICE_"))
           and k != "CUDA_VISIBLE_DEVICES"}
    env.update(sim_environment("h100-80g", 1, str(state_dir), base_env=env))
    return env


def _ms(samples):
    return statistics.median(samples) / 1e6, max(samples) / 1e6


def test_mig_claim_prepare_and_unprepare_latency(tmp_path, benchmark):
    with FakeApiServer() as api:
        node = Node(tmp_path, api, h100_env(tmp_path / "simgpu"))
        agent = node.start("--rescan", "5s")
        try:
            kubelet = node.kubelet()
            prepare, unprepare = [], []
            for i in range(ROUNDS):
                c = node.claim(f"m{i}", results=[{"device": PLACEMENTS[i % 2], "share_id": None, "memory": None,
                                                  "sm": None}])
                t = time.monotonic_ns()
                assert kubelet.prepare(c)[c[1]].error == ""
                prepare.append(time.monotonic_ns() - t)
                t = time.monotonic_ns()
                assert kubelet.unprepare(c)[c[1]].error == ""
                unprepare.append(time.monotonic_ns() - t)
        finally:
            for k in node.kubelets:
                k.close()
            agent.stop()
        direct = json.loads(subprocess.run([sys.executable, "-c", DIRECT, str(ROUNDS)], env=node.env, check=True,
                                           capture_output=True, text=True).stdout)
    rows = {"prepare (gRPC: claim read, checkpoint, MIG mode on, GI+CI, CDI spec)": _ms(prepare),
            "mig.create_instance alone (MIG mode on, GI+CI)": _ms(direct["create"]),
            "unprepare (gRPC: CI+GI destroyed, MIG mode off, CDI spec, checkpoint)": _ms(unprepare),
            "mig.destroy_instance alone (CI+GI, MIG mode off)": _ms(direct["destroy"])}
    print(f"\n{'per MIG claim, ' + str(ROUNDS) + ' rounds, simgpu h100-80g':72} {'median ms':>10} {'max ms':>10}")
    for label, (median, worst) in rows.items():
        print(f"{label:72} {median:10.2f} {worst:10.2f}")
    keys = ("prepare_median_ms", "create_instance_median_ms", "unprepare_median_ms", "destroy_instance_median_ms")
    benchmark.extra_info.update({k: v[0] for k, v in zip(keys, rows.values())})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
