"""vgpu.plan and `vgpu-ctl plan` on hand-made traces whose answers are worked out by hand."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vgpu import plan
from vgpu.errors import BadFile, InvalidRequest

CTL = str(Path(sys.executable).parent / "vgpu-ctl")

# a few lines of the real files' format (openb, cluster-trace-gpu-v2023)
NODES_CSV = """sn,cpu_milli,memory_mib,gpu,model
openb-node-0000,64000,262144,2,P100
openb-node-0001,8000,32768,1,V100M16
openb-node-0002,96000,393216,8,G2
"""
PODS_CSV = """name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
openb-pod-0001,6000,12288,1,460,,LS,Running,427061,12902960,427061
openb-pod-0000,12000,16384,1,1000,,LS,Running,0,12537496,0
openb-pod-0002,4000,8192,0,0,,BE,Running,500000,900000,500000
openb-pod-0003,88000,327680,8,1000,V100M16|V100M32,LS,Running,600000,700000,600000
"""


def node(name, gpus=2, model="T4", cpu=8000, mem=32768):
    return plan.Node(name, cpu, mem, gpus, model)


def pod(name, milli=1000, num_gpu=1, cpu=1000, mem=1024, **kw):
    return plan.Pod(name, cpu, mem, num_gpu, milli if num_gpu else 0, **kw)


def where(run):
    return {p.name: (run.cluster.nodes[i].name, gpus) for p, i, gpus in run.placed}


def test_four_half_gpu_pods_take_two_shared_gpus_or_four_whole_ones():
    nodes = [node("a"), node("b")]
    pods = [pod(f"p{k}", 500) for k in range(4)]
    shared = plan.simulate(pods, nodes, "first-fit")
    assert where(shared) == {"p0": ("a", [0]), "p1": ("a", [0]), "p2": ("a", [1]), "p3": ("a", [1])}
    whole = plan.simulate(pods, nodes, "whole-gpu")
    assert plan.report(shared)["gpus_used"] == 2 and plan.report(whole)["gpus_used"] == 4
    r = plan.report(shared)
    assert r["unallocated_pct"] == 50.0 and r["sm_occupancy_pct"] == 100.0
    assert r["memory_occupancy_pct"] == 100.0   # derived memory: half of a T4's 16 GiB each
    assert plan.report(whole)["unallocated_pct"] == 0.0 and plan.report(whole)["gpu_asked"] == 2.0


def test_best_fit_takes_the_tightest_gpu_first_fit_the_first():
    nodes = [node("a")]
    pods = [pod("half", 500), pod("big", 800), pod("small", 200)]
    assert where(plan.simulate(pods, nodes, "first-fit"))["small"] == ("a", [0])   # GPU 0 has 500 free
    for policy in ("best-fit", "best-fit-exact"):
        assert where(plan.simulate(pods, nodes, policy))["small"] == ("a", [1])   # GPU 1 has 200 free


def test_best_fit_packs_onto_the_node_already_in_use():
    nodes = [node("a", gpus=1), node("b", gpus=1), node("c", gpus=1)]
    for seed in range(5):
        run = plan.simulate([pod("p1", 400), pod("p2", 500)], nodes, "best-fit", seed=seed)
        assert where(run)["p1"] == where(run)["p2"]


def test_random_spreads_and_is_reproducible_per_seed():
    nodes = [node(f"n{k}", gpus=1) for k in range(8)]
    pods = [pod(f"p{k}", 100) for k in range(8)]
    runs = [where(plan.simulate(pods, nodes, "random", seed=s)) for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert len({n for n, _ in runs[0].values()}) > 1


def test_pods_that_do_not_fit_are_reported_by_kind():
    nodes = [node("a", gpus=1, cpu=4000)]
    pods = [pod("fits", 600), pod("no-share-left", 600), pod("two-gpus", num_gpu=2),
            pod("too-much-cpu", 100, cpu=5000), pod("cpu-only", num_gpu=0, cpu=3000),
            pod("cpu-only-too-big", num_gpu=0, cpu=3500)]
    r = plan.report(plan.simulate(pods, nodes, "first-fit"))
    assert r["unplaced"] == ["no-share-left", "two-gpus", "too-much-cpu", "cpu-only-too-big"]
    assert r["unplaced_by_kind"] == {"cpu_only": 1, "shared": 2, "whole": 1}
    assert r["pods_placed"] == 2


def test_gpu_spec_and_explicit_memory_constrain_placement():
    nodes = [node("t4", gpus=1, model="T4"), node("v100", gpus=1, model="V100M32"), node("g2", gpus=1, model="G2")]
    run = plan.simulate([pod("pinned", 300, gpu_spec=("V100M32",))], nodes, "first-fit")
    assert where(run) == {"pinned": ("v100", [0])}
    # 12 GiB each: one on a 16 GiB T4, two on a 32 GiB V100, none on G2 (memory undisclosed)
    pods = [pod(f"m{k}", 300, gpu_memory_mib=12288) for k in range(4)]
    run = plan.simulate(pods, nodes, "first-fit")
    assert where(run) == {"m0": ("t4", [0]), "m1": ("v100", [0]), "m2": ("v100", [0])}
    assert [p.name for p in run.unplaced] == ["m3"]
    run = plan.simulate(pods, nodes, "first-fit", gpu_memory={"G2": 16384})
    assert where(run)["m3"] == ("g2", [0])


def test_openb_csv_readers(tmp_path):
    (tmp_path / "n.csv").write_text(NODES_CSV)
    (tmp_path / "p.csv").write_text(PODS_CSV)
    nodes = plan.read_nodes(tmp_path / "n.csv")
    assert [(n.name, n.cpu_milli, n.memory_mib, n.gpus, n.model) for n in nodes] == [
        ("openb-node-0000", 64000, 262144, 2, "P100"), ("openb-node-0001", 8000, 32768, 1, "V100M16"),
        ("openb-node-0002", 96000, 393216, 8, "G2")]
    pods = plan.read_pods(tmp_path / "p.csv")
    assert pods[0] == plan.Pod("openb-pod-0001", 6000, 12288, 1, 460, None, (), 427061.0, 12902960.0)
    assert pods[2].num_gpu == 0 and pods[2].gpu_request == 0
    assert pods[3].gpu_spec == ("V100M16", "V100M32") and pods[3].gpu_request == 8000
    # arrival order is creation_time, whatever the file's order
    assert [p.name for p in plan.order(pods, "arrival", 0)][:2] == ["openb-pod-0000", "openb-pod-0001"]


def test_csv_errors_are_one_line_with_a_hint(tmp_path):
    (tmp_path / "bad.csv").write_text("sn,cpu_milli\nx,1\n")
    with pytest.raises(BadFile, match="no column memory_mib, gpu, model") as e:
        plan.read_nodes(tmp_path / "bad.csv")
    assert "sn,cpu_milli,memory_mib,gpu,model" in e.value.hint
    with pytest.raises(BadFile, match="No such file"):
        plan.read_pods(tmp_path / "missing.csv")
    with pytest.raises(InvalidRequest, match="unknown policy"):
        plan.simulate([], [node("a")], "worst-fit")


def test_kubectl_json_reader(tmp_path):
    def item(name, t, limits, requests=None):
        return {"metadata": {"name": name, "creationTimestamp": t},
                "spec": {"containers": [{"name": "c", "resources": {"limits": limits, "requests": requests or {}}}]}}
    doc = {"kind": "List", "items": [
        item("hami", "2026-01-01T00:00:02Z", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "3000",
                                              "nvidia.com/gpucores": "30"}, {"cpu": "500m", "memory": "1Gi"}),
        item("vgpu", "2026-01-01T00:00:01Z", {"vgpu.dev/gpu-memory": "4Gi", "vgpu.dev/gpu-utilization": "50"},
             {"cpu": "2"}),
        item("two", "2026-01-01T00:00:03Z", {"nvidia.com/gpu": "2"}),
        item("cpu", "2026-01-01T00:00:04Z", {"cpu": "1", "memory": "512Mi"}),
    ]}
    (tmp_path / "pods.json").write_text(json.dumps(doc))
    pods = plan.read_pods(tmp_path / "pods.json")
    assert [(p.name, p.cpu_milli, p.memory_mib, p.num_gpu, p.gpu_milli, p.gpu_memory_mib) for p in pods] == [
        ("vgpu", 2000, 0, 1, 500, 4096), ("hami", 500, 1024, 1, 300, 3000),
        ("two", 0, 0, 2, 1000, None), ("cpu", 1000, 512, 0, 0, None)]


def test_tune_scales_the_workload_to_the_ratio():
    pods = [pod(f"p{k}", 500, creation_time=float(k)) for k in range(10)]   # asks 5 GPUs
    up = plan.tune(pods, 1.3, 10 * 1000, seed=3)                          # to 13 GPUs
    assert sum(p.gpu_request for p in up) == 13000 and len(up) == 26
    assert [p.creation_time for p in up] == sorted(p.creation_time for p in up)
    down = plan.tune(pods, 1.3, 2 * 1000, seed=3)                          # to 2.6 GPUs
    assert sum(p.gpu_request for p in down) == 3000 and len(down) == 6    # the first total >= 2.6
    assert plan.tune(pods, 1.3, 10 * 1000, seed=3) == up                   # seeded


def test_unallocated_is_recorded_when_arrived_load_reaches_the_checkpoint():
    nodes = [node("a", gpus=1), node("b", gpus=1)]
    # arrived 30%, 60%, 90%, 100%: x and y take a GPU each, z fits neither, w joins x;
    # at 50% arrived (after y) 1.2 of 2 GPUs are allocated, at 100% (after w) 1.4
    pods = [pod("x", 600), pod("y", 600), pod("z", 600), pod("w", 200)]
    run = plan.simulate(pods, nodes, "first-fit", checkpoints=(50, 100))
    assert run.checkpoints == {50: pytest.approx(40.0), 100: pytest.approx(30.0)}
    assert run.unplaced_at == {50: 0.0, 100: pytest.approx(30.0)}   # z asked 0.6 of 2 GPUs
    # without sharing, x and y take both GPUs whole and z and w are turned away
    whole = plan.simulate(pods, nodes, "whole-gpu", checkpoints=(100,))
    assert whole.checkpoints == {100: 0.0} and whole.unplaced_at == {100: pytest.approx(40.0)}
    assert [p.name for p in run.unplaced] == ["z"]


def _ctl(*args):
    return subprocess.run([CTL, "plan", *args], capture_output=True, text=True, timeout=60)


def test_cli_json_through_vgpu_ctl(tmp_path):
    (tmp_path / "n.csv").write_text(NODES_CSV)
    (tmp_path / "p.csv").write_text(PODS_CSV)
    out = _ctl("--pods", str(tmp_path / "p.csv"), "--nodes", str(tmp_path / "n.csv"), "--json")
    assert out.returncode == 0, out.stderr
    got = {r["policy"]: r for r in json.loads(out.stdout)["policies"]}
    assert list(got) == ["whole-gpu", "k8s-default", "first-fit", "best-fit", "fgd", "vgpu", "random"]
    ff = got["first-fit"]
    # the 8-GPU pod wants V100s: the only one has 1 GPU; the 1.0 and 0.46 pods share nothing
    assert ff["unplaced"] == ["openb-pod-0003"] and ff["gpus"] == 11 and ff["gpu_asked"] == 9.46
    assert ff["models"]["P100"]["gpus_used"] == 2 and ff["models"]["P100"]["sm_occupancy_pct"] == 73.0
    text = _ctl("--pods", str(tmp_path / "p.csv"), "--nodes", str(tmp_path / "n.csv"), "--policy", "first-fit")
    assert "first-fit       P100           2     2    27.0%   73.0%    73.0%" in text.stdout
    assert "3 of 4 pods placed; did not fit: 1 (shared 0, whole-GPU 1, CPU-only 0)" in text.stdout


def test_cli_paper_protocol_json(tmp_path):
    (tmp_path / "n.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,96000,393216,8,G2\n")
    (tmp_path / "p.csv").write_text(PODS_CSV)
    out = _ctl("--pods", str(tmp_path / "p.csv"), "--nodes", str(tmp_path / "n.csv"), "--paper", "--seeds", "3",
               "--policy", "random", "--json")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)["policies"][0]
    assert row["policy"] == "random" and len(row["per_seed"]) == 3 and row["paper_pct"] == 13.7


def test_cli_errors_are_one_line(tmp_path):
    (tmp_path / "n.csv").write_text(NODES_CSV)
    out = _ctl("--pods", str(tmp_path / "nope.csv"), "--nodes", str(tmp_path / "n.csv"))
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "hint:" in out.stderr
    out = _ctl("--pods", str(tmp_path / "n.csv"), "--nodes", str(tmp_path / "n.csv"), "--policy", "worst-fit")
    assert out.returncode != 0 and "unknown policy 'worst-fit'; hint: one of" in out.stderr
    out = _ctl("--pods", str(tmp_path / "n.csv"), "--nodes", str(tmp_path / "n.csv"), "--gpu-memory", "G2")
    assert out.returncode == 2 and "is not MODEL=SIZE" in out.stderr and out.stderr.count("\n") == 1


def test_departures_free_what_pods_took_and_gpus_in_use_are_followed_over_time(tmp_path):
    """One node of 2 GPUs.  a (half a GPU, 0-10 s), b (half, 5-15), c (a whole one, 12-19),
    d (a whole one at 13, never leaving: no GPU is idle then, and it is not tried again)."""
    (tmp_path / "n.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,2,T4\n")
    (tmp_path / "p.csv").write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
        "a,1000,1024,1,500,,LS,Running,0,10,0\nb,1000,1024,1,500,,LS,Running,5,15,5\n"
        "c,1000,1024,1,1000,,LS,Running,12,19,12\nd,1000,1024,1,1000,,LS,Running,13,,13\n")
    out = _ctl("--pods", str(tmp_path / "p.csv"), "--nodes", str(tmp_path / "n.csv"), "--departures",
               "--policy", "first-fit", "--policy", "whole-gpu", "--json")
    assert out.returncode == 0, out.stderr
    ff, whole = json.loads(out.stdout)["policies"]
    # first-fit: a and b share gpu-0 (1 in use), c takes gpu-1 (2), then 1, then 0 at 19
    run = plan.simulate_over_time(plan.read_pods(tmp_path / "p.csv"), plan.read_nodes(tmp_path / "n.csv"), "first-fit")
    assert (run.times, run.gpus_in_use) == ([0, 5, 10, 12, 13, 15, 19], [1, 1, 1, 2, 2, 1, 0])
    assert (ff["gpus_needed_peak"], ff["gpus_in_use_mean"], ff["pods_unplaced"]) == (2, round(22 / 19, 1), 1)
    # whole-gpu: b takes a GPU of its own while a runs
    assert (whole["gpus_needed_peak"], whole["gpus_in_use_mean"], whole["pods_unplaced"]) == (2, round(27 / 19, 1), 1)
    text = _ctl("--pods", str(tmp_path / "p.csv"), "--nodes", str(tmp_path / "n.csv"), "--departures", "--paper")
    assert text.returncode == 2 and "two protocols; hint: choose one" in text.stderr


def test_mig_rounds_each_request_up_to_its_gpus_smallest_profile_at_a_free_placement():
    """H100 80GB: 7 compute and 8 memory slices (NVIDIA's MIG user guide).  0.3 of a GPU with
    0.3 of its memory (24 GiB) is a 3g.40gb at start 0; 0.1 (8 GiB) a 1g.10gb at the first
    free start, 4; a second 3g.40gb finds starts 0 and 4 taken and goes to the A10, which
    has no MIG: a whole GPU there, as whole-gpu would."""
    nodes = [plan.Node("h", 64000, 262144, 1, "H100-80G"), plan.Node("a", 64000, 262144, 1, "A10")]
    pods = [pod("x", 300), pod("y", 100), pod("z", 300)]
    run = plan.simulate(pods, nodes, "mig")
    assert [(p.name, p.gpu_milli, p.gpu_memory_mib, i, g) for p, i, g in run.placed] == [
        ("x", 429, 40448, 0, [0]), ("y", 143, 9984, 0, [0]), ("z", 1000, None, 1, [0])]
    assert run.cluster.mig[0][0] == 0b11111 and run.cluster.allocated == 429 + 143 + 1000
    assert plan.mig_profile(pod("w", 1000), "H100-80G", 81152)[0] == "7g.80gb"
    assert plan.mig_profile(pod("w", 100), "T4", 0) is None
    # x leaves: its placement is free again for the next 3g.40gb
    timed = [pod("x", 300, creation_time=0, deletion_time=5), pod("y", 100, creation_time=1),
             pod("z", 300, creation_time=6)]
    over = plan.simulate_over_time(timed, nodes[:1], "mig")
    assert over.unplaced == [] and over.gpus_in_use == [1, 1, 1, 1]


def test_k8s_default_is_kube_schedulers_own_node_choice_then_the_drivers_device_order():
    """kube-scheduler 1.34-1.36 (schedule_one.go, noderesources): the DRA plugin scores 0 for
    plain requests, so LeastAllocated + BalancedAllocation over CPU and memory pick the node:
    the emptiest, where first-fit takes the first in node order."""
    nodes = [node("small", cpu=8000), node("big", cpu=16000)]
    x = pod("x", 500, cpu=2000)
    cluster = plan.Cluster(nodes)
    # small: cpu (6000*100)//8000 = 75, memory (31744*100)//32768 = 96 -> 85; balanced 1 - (0.25 - 1/32)/2 -> 89
    # big:   cpu 87, memory 96 -> 91; balanced 1 - (0.125 - 1/32)/2 -> 95
    assert [plan.scheduler_score(cluster, x, i) for i in (0, 1)] == [85 + 89, 91 + 95]
    assert where(plan.simulate([x], nodes, "k8s-default"))["x"] == ("big", [0])
    assert where(plan.simulate([x], nodes, "first-fit"))["x"] == ("small", [0])
    # the driver's order decides the GPU: first fit takes GPU 0, tightest-first the fuller one
    busy = [pod("w", 700, cpu=1000), pod("v", 400, cpu=1000), pod("u", 300, cpu=1000)]
    one = [node("only", gpus=2, cpu=64000)]
    assert where(plan.simulate(busy, one, "k8s-default"))["u"] == ("only", [0])     # 0 has 300 free, 1 has 600
    assert where(plan.simulate(busy[:2] + [pod("u", 300, cpu=1000)], one, "k8s-tightest"))["u"] == ("only", [0])
    tight = [pod("w", 400, cpu=1000), pod("v", 800, cpu=1000), pod("u", 200, cpu=1000)]
    assert where(plan.simulate(tight, one, "k8s-default"))["u"] == ("only", [0])      # 600 free on 0, 200 on 1
    assert where(plan.simulate(tight, one, "k8s-tightest"))["u"] == ("only", [1])


def test_kube_scheduler_filters_only_part_of_a_large_cluster_from_where_it_stopped():
    assert [plan.feasible_nodes_to_find(n) for n in (50, 100, 250, 1213, 5000)] == [50, 100, 120, 497, 500]
    nodes = [node(f"n{i:03}", cpu=64000) for i in range(250)]
    run = plan.simulate([pod("a", 500), pod("b", 500)], nodes, "k8s-default")
    got = where(run)
    assert int(got["a"][0][1:]) < 120 <= int(got["b"][0][1:]) < 240      # nodes 0-119, then 120-239
    assert run.cluster.next_start == 240


def test_nodes_from_vgpus_resource_slices_and_pods_from_resource_claims(tmp_path):
    """The cluster's own objects: each node's GPUs as vgpu's DRA driver publishes them (the
    driver's own code makes the slices here), claims of its device class as pods."""
    from vgpu.k8s.resourceslice import Gpu, resource_slices
    a10 = [Gpu(i, "NVIDIA A10", f"GPU-a{i}", 24 << 30) for i in range(2)]
    h100 = [Gpu(0, "NVIDIA H100 80GB HBM3", "GPU-h0", 80 << 30)]
    items = resource_slices("node-a", "vgpu.dev", a10, 1) + resource_slices("node-h", "vgpu.dev", h100, 1)
    items.append({"kind": "ResourceSlice", "spec": {"driver": "gpu.nvidia.com", "nodeName": "node-x",
                                                     "devices": [{"name": "gpu-0", "attributes": {"type": {"string": "gpu"}}}]}})
    (tmp_path / "slices.json").write_text(json.dumps({"kind": "List", "items": items}))

    def claim(name, created, *requests):
        return {"kind": "ResourceClaim", "metadata": {"name": name, "namespace": "team", "creationTimestamp": created},
                "spec": {"devices": {"requests": [{"name": f"r{i}", "exactly": r} for i, r in enumerate(requests)]}}}
    claims = [claim("big", "2026-12-02T10:00:02Z", {"deviceClassName": "gpu.vgpu.dev",
                                                   "capacity": {"requests": {"memory": "40Gi", "sm": "50"}}}),
              claim("half", "2026-12-02T10:00:01Z", {"deviceClassName": "gpu.vgpu.dev",
                                                    "capacity": {"requests": {"memory": "12Gi", "sm": "50"}}}),
              claim("two", "2026-12-02T10:00:03Z", {"deviceClassName": "gpu.vgpu.dev", "count": 2}),
              claim("other", "2026-12-02T10:00:00Z", {"deviceClassName": "gpu.nvidia.com"})]
    (tmp_path / "claims.json").write_text(json.dumps({"kind": "List", "items": claims}))
    memory = {}
    nodes = plan.read_nodes(tmp_path / "slices.json", memory)
    assert [(n.name, n.gpus, n.model) for n in nodes] == [("node-a", 2, "NVIDIA A10"), ("node-h", 1, "NVIDIA H100 80GB HBM3")]
    assert memory == {"NVIDIA A10": 24 * 1024, "NVIDIA H100 80GB HBM3": 80 * 1024}
    pods = plan.read_pods(tmp_path / "claims.json")
    assert [(p.name, p.num_gpu, p.gpu_milli, p.gpu_memory_mib) for p in pods] == [
        ("team/half", 1, 500, 12 * 1024), ("team/big", 1, 500, 40 * 1024), ("team/two", 2, 1000, None)]
    out = _ctl("--pods", str(tmp_path / "claims.json"), "--nodes", str(tmp_path / "slices.json"),
               "--policy", "first-fit", "--json")
    assert out.returncode == 0, out.stderr
    [r] = json.loads(out.stdout)["policies"]
    # half on an A10; big (40Gi) only fits the H100; two wants 2 idle GPUs: node-a has 1 left
    assert r["pods_placed"] == 2 and r["unplaced"] == ["team/two"]
    assert r["models"]["NVIDIA H100 80GB HBM3"]["memory_occupancy_pct"] == 50.0


def test_paper_curves_follow_the_arrived_load_and_plot_where_matplotlib_is(tmp_path):
    nodes = [node(f"n{i}", gpus=1, cpu=64000) for i in range(4)]
    pods = [pod(f"p{i}", 500) for i in range(12)]
    curves = plan.paper_curves(pods, nodes, "first-fit", seeds=range(2), points=(50.0, 100.0))
    # first fit packs two halves a GPU: whatever has arrived is allocated, the rest is not
    assert curves == {50.0: [50.0, 50.0], 100.0: [0.0, 0.0]}
    (tmp_path / "n.csv").write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,96000,393216,8,G2\n")
    (tmp_path / "p.csv").write_text(PODS_CSV)
    png = tmp_path / "curve.png"
    out = _ctl("--pods", str(tmp_path / "p.csv"), "--nodes", str(tmp_path / "n.csv"), "--paper", "--seeds", "2",
               "--policy", "random", "--plot", str(png))
    try:
        import matplotlib  # noqa: F401
        assert out.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", out.stderr
    except ImportError:
        assert out.returncode == 2 and out.stderr == ("Error: --plot needs matplotlib, which is not installed; "
                                                      "hint: pip install matplotlib\n")
    out = _ctl("--pods", str(tmp_path / "p.csv"), "--nodes", str(tmp_path / "n.csv"), "--plot", str(png))
    assert out.returncode == 2 and "--plot draws the --paper protocol's curve; hint: add --paper" in out.stderr


def test_fgd_keeps_room_for_the_workloads_typical_pods_where_best_fit_leaves_a_sliver():
    # the workload: mostly half-GPU pods.  After the 400 on a, a 500 on a would leave 100,
    # which none of them can use (fragmentation grows by 100); on b it leaves 500, which fits one
    nodes = [node("a", gpus=1), node("b", gpus=1)]
    pods = [pod("p400", 400), pod("p500", 500), pod("q500", 500), pod("r500", 500)]
    fgd = where(plan.simulate(pods, nodes, "fgd"))
    assert fgd["p400"] == ("a", [0]) and fgd["p500"] == ("b", [0])
    assert where(plan.simulate(pods, nodes, "best-fit-exact"))["p500"] == ("a", [0])


def test_fgd_breaks_ties_by_node_name_as_the_papers_simulator_does():
    nodes = [node("z", gpus=1), node("y", gpus=2)]     # unlike, but alike in score for this pod
    for seed in range(3):
        assert where(plan.simulate([pod("p", 300)], nodes, "fgd", seed=seed))["p"] == ("y", [0])


def test_fgd_typical_pods_cover_95_percent_of_the_workload():
    from vgpu.plan.fgd import typical_pods
    assert typical_pods([pod(f"a{k}", 500) for k in range(19)] + [pod("b", 300)]) == [(1000, 500, 1, None, 1.0)]
    kinds = typical_pods([pod(f"a{k}", 500) for k in range(18)] + [pod("b", 300), pod("c", 300)])
    assert kinds == [(1000, 500, 1, None, 0.9), (1000, 300, 1, None, 0.1)]


def test_dot_product_takes_the_node_its_ask_aligns_with_least_cut_to_an_integer_ties_by_name():
    """dot_product_score.go (-dimext merge -norm max): 100 x (1 - (free . ask) / 2), each
    vector over 128 cores and 8 GPUs, cut to an integer; selectHost takes the first name."""
    small, big = node("b-small", gpus=2, cpu=8000), node("a-big", gpus=8, cpu=64000)
    # a-big: 100 x (1 - (1/2 * 1/128 + 1 * 1/8) / 2) = 93.55 -> 93; b-small: (1/16 * 1/128 + 1/4 * 1/8) -> 98.41 -> 98
    assert where(plan.simulate([pod("p", 1000, cpu=1000)], [big, small], "dot-product"))["p"] == ("b-small", [0])
    # z has less CPU free than a: 98.416 against 98.413, both cut to 98, and the name decides
    z, a = node("z", gpus=2, cpu=7000), node("a", gpus=2, cpu=8000)
    assert where(plan.simulate([pod("p", 1000, cpu=1000)], [z, a], "dot-product"))["p"] == ("a", [0])
    # the GPU: the tightest that fits (the artifact's -gpusel best): 300 free on 1, 400 on 0
    run = plan.simulate([pod("x", 600), pod("y", 700), pod("s", 200)], [node("n", gpus=2)], "dot-product")
    assert where(run)["s"] == ("n", [1])


def test_gpu_packing_scores_used_gpus_then_used_nodes_then_the_smallest_idle_node():
    """gpu_packing_score.go: (1) shared GPUs 100 - their free percent / 10, at least 50;
    (2) idle GPUs of a node in use 50 - how many, at least 33; (3) an idle node 33 - its
    GPUs; a pod asking no GPU 0."""
    from vgpu.plan.policies import gpu_packing_score
    c = plan.Cluster([node("n2", gpus=2, cpu=64000), node("n8", gpus=8, cpu=64000)])
    c.take(pod("used", 350), 0, [0])                        # n2: GPU 0 has 650 free
    c.take(pod("used", 1000, num_gpu=3), 1, [0, 1, 2])      # n8: 5 idle GPUs
    share, whole, two, cpu_only = pod("s", 500), pod("w", 1000), pod("t", 1000, num_gpu=2), pod("c", num_gpu=0)
    assert [gpu_packing_score(c, share, i) for i in (0, 1)] == [100 - 65 // 10, 49]
    assert [gpu_packing_score(c, whole, i) for i in (0, 1)] == [49, 49]
    assert gpu_packing_score(c, two, 1) == 48 and gpu_packing_score(c, cpu_only, 0) == 0
    idle = plan.Cluster([node("n1", gpus=1), node("n8", gpus=8, cpu=64000)])
    assert [gpu_packing_score(idle, share, i) for i in (0, 1)] == [32, 25]
    # placement: the small idle node first, then onto its used GPU, then the used node's idle GPU
    nodes = [node("a8", gpus=8, cpu=64000), node("b2", gpus=2, cpu=64000)]
    run = plan.simulate([pod("p", 300), pod("q", 300), pod("r", 1000), pod("s", 1000)], nodes, "gpu-packing")
    assert where(run) == {"p": ("b2", [0]), "q": ("b2", [0]), "r": ("b2", [1]), "s": ("a8", [0])}


def test_the_paper_protocol_breaks_ties_by_a_random_node_order_per_seed_as_its_simulator_names_nodes():
    nodes = [node(f"n{k}", gpus=1) for k in range(6)]
    firsts = set()
    for seed in range(8):
        runs = [plan.simulate([pod("p", 500)], nodes, "gpu-packing", seed=seed, random_names=True) for _ in (0, 1)]
        assert where(runs[0]) == where(runs[1])                               # seeded
        firsts.add(where(runs[0])["p"][0])
    assert len(firsts) > 1
    assert where(plan.simulate([pod("p", 500)], nodes, "gpu-packing"))["p"] == ("n0", [0])   # else by name


def test_artifact_order_is_the_trace_shuffled_then_the_copies_that_scale_it():
    pods = [pod(f"p{k}", 500, creation_time=float(k)) for k in range(10)]    # asks 5 GPUs
    got = plan.workload(pods, 1.3, 10 * 1000, seed=3, how="artifact")      # to 13 GPUs
    assert sorted(p.name for p in got[:10]) == sorted(p.name for p in pods) and got[:10] != pods
    assert all("-copy" in p.name for p in got[10:]) and len(got) == 26
    assert sorted(p.name for p in plan.workload(pods, 1.3, 10 * 1000, 3, "shuffle")) == sorted(p.name for p in got)


@pytest.mark.parametrize("short", ["cpu", "memory"])
def test_vgpu_keeps_cpu_and_memory_next_to_idle_gpus_that_need_them_where_fgd_does_not(short):
    """The workload: 1-GPU pods asking 4 cores and 4 GiB, and a CPU-only pod asking the
    same.  On `a` (2 idle GPUs, CPU or memory for 2 of those pods) the CPU-only pod leaves
    room for one: FGD sees the typical pod still fits (no fragmentation; memory it does not
    see at all) and, tied, takes `a` by name; vgpu counts the second idle GPU as lost and
    takes `b`, which has room to spare.  Then FGD turns the last GPU pod away."""
    ample = dict(cpu=64000, mem=65536)
    tight = dict(cpu=8000, mem=65536) if short == "cpu" else dict(cpu=64000, mem=8192)
    nodes = [node("a", gpus=2, **tight), node("b", gpus=2, **ample)]
    pods = [pod("c", num_gpu=0, cpu=4000, mem=4096)] + [pod(f"g{k}", cpu=4000, mem=4096) for k in range(4)]
    fgd, vgpu = plan.simulate(pods, nodes, "fgd"), plan.simulate(pods, nodes, "vgpu")
    assert where(fgd)["c"][0] == "a" and where(vgpu)["c"][0] == "b"
    assert not vgpu.unplaced and [p.name for p in fgd.unplaced] == ["g3"]
