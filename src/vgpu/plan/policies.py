"""Placement policies: each picks (node, GPUs) among the nodes a pod fits on."""

from .fgd import fgd
from .model import MIG_PROFILES, MILLI, Pod, select_host


# === MIG: a request rounded up to the smallest MIG profile of its GPU ===

def mig_profile(pod, model, need_mib):
    """The smallest profile of `model` (fewest memory slices, then compute) whose compute
    share covers the pod's SM share and whose memory covers `need_mib`; None where the
    model has no MIG or no profile is large enough (then the pod takes whole GPUs)."""
    fits = [p for p in MIG_PROFILES.get(model, ()) if p[1] * MILLI >= pod.gpu_milli * 7 and p[3] >= need_mib]
    return min(fits, key=lambda p: (p[2], p[1]), default=None)


def _mig_start(cluster, i, g, profile):
    """The lowest free placement of `profile` on GPU g of node i, or None."""
    _, _, slices, _, starts = profile
    busy = cluster.mig[i][g]
    for start in starts:
        if not busy & (((1 << slices) - 1) << start):
            return start
    return None


def mig_place(cluster, pod, order):
    """First fit as the DRA allocator walks the nodes' MIG devices: on each node the pod
    fits (CPU, memory, model) in `order`, a shared pod on a MIG-capable model takes the
    first GPU with a free placement of its profile; anything else takes whole idle GPUs.
    Returns (pod as placed, node, gpus, (start, memory slices) or None) or None."""
    cpu, mem = cluster.cpu, cluster.mem
    allowed = set(i for m in pod.gpu_spec for i in cluster.by_model.get(m, ())) if pod.gpu_spec else None
    whole = _as_whole(pod)
    for i in order:
        if (allowed is not None and i not in allowed) or cpu[i] < pod.cpu_milli or mem[i] < pod.memory_mib:
            continue
        model = cluster.nodes[i].model
        profile = mig_profile(pod, model, cluster.gpu_memory_of(pod, i) or 0) if pod.shared else None
        if profile is not None and profile[1] < 7:
            for g in range(cluster.nodes[i].gpus):
                start = _mig_start(cluster, i, g, profile)
                if start is not None:
                    placed = Pod(**{**pod.__dict__, "gpu_milli": -(-profile[1] * MILLI // 7),
                                    "gpu_memory_mib": profile[3]})
                    return placed, i, [g], (start, profile[2])
            continue
        gpus = [g for g, free in enumerate(cluster.gfree[i]) if free == MILLI][:whole.num_gpu]
        if whole.num_gpu and len(gpus) == whole.num_gpu and (whole.gpu_memory_mib is None or cluster.fitting_gpus(whole, i)):
            return whole, i, gpus, None
        if not whole.num_gpu:
            return whole, i, [], None
    return None


# === policies: each picks (node, gpus) among the nodes the pod fits on ===

def _first_gpus(cluster, pod, i):
    return cluster.fitting_gpus(pod, i)[:pod.num_gpu]


def _tightest_gpus(cluster, pod, i):
    """A shared pod goes on the GPU with the least free share it fits (then the lowest
    index); whole GPUs are the first idle ones."""
    fits = cluster.fitting_gpus(pod, i)
    if pod.shared:
        free = cluster.gfree[i]
        return [min(fits, key=lambda g: (free[g], g))]
    return fits[:pod.num_gpu]


def first_fit(cluster, pod, found, rng):
    # node order then device order, as the DRA allocator's first fit walks them
    i = found[0]
    return i, _first_gpus(cluster, pod, i)


# The paper's artifact (hkust-adsl/kubernetes-scheduler-simulator) normalises its scores by
# cluster-wide constants, the largest node's spec (open-gpu-share/utils/const.go MaxSpecCpu,
# MaxSpecGpu: 128 cores, 8 GPUs), and breaks ties with its selectHost (model.select_host).
MAX_SPEC_CPU, MAX_SPEC_GPU = 128000, 8 * MILLI


# Best-fit as the artifact scores it (best_fit_score.go): CPU and GPU only, weights 0.5
# each, free-after-placing normalised by MAX_SPEC_*, the score cut to an integer 0-100.
# Ties here go at random, as a stock kube-scheduler breaks them (not the artifact's
# selectHost; docs/plan.md, Fidelity).


def best_fit(cluster, pod, found, rng):
    """The node left with the least CPU and GPU (see above); ties broken at random."""
    cpu, gtotal, need = cluster.cpu, cluster.free_total, pod.gpu_request

    def score(i):
        left = 0.5 * (cpu[i] - pod.cpu_milli) / MAX_SPEC_CPU + 0.5 * (gtotal[i] - need) / MAX_SPEC_GPU
        return int((1.0 - left) * 100)

    scores = [score(i) for i in found]
    top = max(scores)
    i = rng.choice([i for i, s in zip(found, scores) if s == top])
    return i, _tightest_gpus(cluster, pod, i)


def best_fit_exact(cluster, pod, found, rng):
    """Best-fit without the artifact's rounding: least CPU+GPU left (same weights), node
    order breaking ties; deterministic."""
    cpu, gtotal, need = cluster.cpu, cluster.free_total, pod.gpu_request
    i = min(found, key=lambda i: (cpu[i] - pod.cpu_milli) / MAX_SPEC_CPU + (gtotal[i] - need) / MAX_SPEC_GPU)
    return i, _tightest_gpus(cluster, pod, i)


def dot_product(cluster, pod, found, rng):
    """Tetris' alignment score as the artifact runs it (dot_product_score.go with the
    experiments' -dimext merge -norm max, utils.GenerateSchedulingMatchGroups): the node's
    free (CPU, total GPU share) and the pod's ask, each divided by MAX_SPEC_*; score =
    100 x (1 - dot / 2) cut to an integer, so the node whose free resources align least
    with the ask (the fullest, roughly) wins; ties by selectHost.  The GPU: -gpusel best
    (open_gpu_share.go allocateGpuIdBasedOnBestFit), the tightest that fits."""
    cpu, gtotal = cluster.cpu, cluster.free_total
    pc, pg = pod.cpu_milli / MAX_SPEC_CPU, pod.gpu_request / MAX_SPEC_GPU
    # (float operations in the artifact's order: each vector normalised, products summed, / 2)
    i = select_host(cluster, ((int(100 * (1 - (cpu[i] / MAX_SPEC_CPU * pc + gtotal[i] / MAX_SPEC_GPU * pg) / 2)), i)
                              for i in found))
    return i, _tightest_gpus(cluster, pod, i)


def gpu_packing_score(cluster, pod, i):
    """gpu_packing_score.go getPackingScore, its three cases from high to low: (1) the pod
    fits on GPUs already in use: 100 - (their free shares in percent, summed) / 10, at
    least 50; (2) it needs idle GPUs of a node in use: 50 - how many, at least 33; (3) the
    node is wholly idle: 33 - its GPU count (at least that count).  A pod asking no GPU
    scores 0 everywhere.  The GPUs it would take: those that fit, least free first."""
    if pod.gpu_request <= 0:
        return 0
    free, idle = cluster.gfree[i], cluster.idle[i]
    if idle == len(free):
        return max(100 // 3 - idle, idle)
    taken = sorted(free[g] for g in cluster.fitting_gpus(pod, i))[:pod.num_gpu]
    fresh = sum(1 for f in taken if f == MILLI)
    if fresh:
        return max(100 // 2 - fresh, 100 // 3)
    return max(100 - sum(f * 100 // MILLI for f in taken) // 10, 100 // 2)


def gpu_packing(cluster, pod, found, rng):
    """GPU packing (the paper's baseline; gpu_packing_score.go): shared GPUs first, then
    idle GPUs of nodes in use, then idle nodes, the smallest first; ties by selectHost.
    The GPU: the artifact's default -gpusel best, the tightest that fits."""
    i = select_host(cluster, ((gpu_packing_score(cluster, pod, i), i) for i in found))
    return i, _tightest_gpus(cluster, pod, i)


def random_fit(cluster, pod, found, rng):
    """Any node the pod fits on, uniformly; a shared pod on any GPU it fits on."""
    i = rng.choice(found)
    fits = cluster.fitting_gpus(pod, i)
    return i, ([rng.choice(fits)] if pod.shared else fits[:pod.num_gpu])


# kube-scheduler's own node choice for a pod whose GPUs come from DRA claims, 1.34-1.36
# (kubernetes/kubernetes pkg/scheduler): the DynamicResources plugin filters the nodes where
# the allocator finds devices and scores only prioritized-list choices (computeScore: 0 for
# plain requests), so the default profile's other scores decide: NodeResourcesFit's
# LeastAllocated over cpu and memory (weights 1: ((allocatable - requested) * 100 /
# allocatable) per resource, integer, averaged) plus NodeResourcesBalancedAllocation
# ((1 - |cpu fraction - memory fraction| / 2) * 100, fractions capped at 1), requested
# counting the pod; the top score wins, ties at random (selectHost).  Filtering stops once
# numFeasibleNodesToFind feasible nodes are found, starting where the last cycle stopped
# (schedule_one.go; parallel filtering may check a few more: not modelled).
MIN_FEASIBLE_NODES, MIN_FEASIBLE_PERCENT = 100, 5


def feasible_nodes_to_find(all_nodes):
    """schedule_one.go numFeasibleNodesToFind with percentageOfNodesToScore unset (0)."""
    if all_nodes < MIN_FEASIBLE_NODES:
        return all_nodes
    percent = max(50 - all_nodes // 125, MIN_FEASIBLE_PERCENT)
    return max(all_nodes * percent // 100, MIN_FEASIBLE_NODES)


def scheduler_score(cluster, pod, i):
    node = cluster.nodes[i]
    total = 0
    fractions = []
    for cap, free, ask in ((node.cpu_milli, cluster.cpu[i], pod.cpu_milli),
                           (node.memory_mib, cluster.mem[i], pod.memory_mib)):
        requested = cap - free + ask
        total += 0 if not cap or requested > cap else (cap - requested) * 100 // cap
        fractions.append(min(requested / cap, 1.0) if cap else 0.0)
    least_allocated = total // 2
    balanced = int((1 - abs(fractions[0] - fractions[1]) / 2) * 100)
    return least_allocated + balanced


def scheduler_node(cluster, pod, found, rng):
    """The node kube-scheduler binds the pod to, among `found` (the nodes its filters pass)."""
    n = len(cluster.nodes)
    want, feasible = feasible_nodes_to_find(n), set(found)
    start, chosen, checked = cluster.next_start, [], 0
    while checked < n and len(chosen) < want:
        i = (start + checked) % n
        checked += 1
        if i in feasible:
            chosen.append(i)
    cluster.next_start = (start + checked) % n
    scores = [scheduler_score(cluster, pod, i) for i in chosen]
    top = max(scores)
    return rng.choice([i for i, s in zip(chosen, scores) if s == top])


def k8s_default(cluster, pod, found, rng):
    """What a cluster does today: kube-scheduler's node (above), then the DRA allocator's
    first fit over the devices in the order vgpu's driver publishes them (GPU index)."""
    i = scheduler_node(cluster, pod, found, rng)
    return i, _first_gpus(cluster, pod, i)


def k8s_tightest(cluster, pod, found, rng):
    """What the DRA driver can do alone: the same node, and devices published least free
    share first, so the allocator's first fit takes the tightest GPU that fits."""
    i = scheduler_node(cluster, pod, found, rng)
    return i, _tightest_gpus(cluster, pod, i)


_PICK = {"whole-gpu": first_fit, "first-fit": first_fit, "best-fit": best_fit,
         "best-fit-exact": best_fit_exact, "random": random_fit, "dot-product": dot_product, "gpu-packing": gpu_packing,
         "k8s-default": k8s_default, "k8s-tightest": k8s_tightest, "fgd": fgd,
         "vgpu": fgd}   # (FGD's placement over vgpu's measure: run._cluster gives the cluster its measure)


def choose(cluster, pod, policy, rng):
    """Where `pod` goes under `policy`: (pod as placed, node, gpus, MIG instance (start,
    memory slices) or None), or None when it fits nowhere."""
    if policy == "mig":
        return mig_place(cluster, pod, cluster.all)
    placed_as = _as_whole(pod) if policy == "whole-gpu" else pod
    found = cluster.candidates(placed_as)
    if not found:
        return None
    i, gpus = _PICK[policy](cluster, placed_as, found, rng)
    return placed_as, i, gpus, None


def take(cluster, placement, sign=1):
    """Place (sign 1) or give back (-1) a placement."""
    placed_as, i, gpus, instance = placement
    cluster.take(placed_as, i, gpus, sign)
    if instance is not None:
        start, slices = instance
        cluster.mig[i][gpus[0]] ^= ((1 << slices) - 1) << start


def _as_whole(pod):
    """The pod as it is placed without sharing: whole GPUs (a share rounded up to one)."""
    if not pod.num_gpu or pod.gpu_milli == MILLI:
        return pod
    whole = Pod(**pod.__dict__)
    whole.gpu_milli = MILLI
    return whole
