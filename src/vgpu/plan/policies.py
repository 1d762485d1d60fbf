"""Placement policies: each picks (node, GPUs) among the nodes a pod fits on."""

from .fgd import fgd
from .model import MIG_PROFILES, MILLI, Pod


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


# Best-fit as the paper's artifact scores it (hkust-adsl/kubernetes-scheduler-simulator,
# best_fit_score.go): CPU and GPU only, weights 0.5 each, free-after-placing normalised by
# cluster-wide constants (128 cores, 8 GPUs), the score cut to an integer 0-100, and the
# kube-scheduler choosing at random among the nodes with the top score.
BEST_FIT_CPU, BEST_FIT_GPU = 128000, 8 * MILLI


def best_fit(cluster, pod, found, rng):
    """The node left with the least CPU and GPU (see above); ties broken at random."""
    cpu, gfree, need = cluster.cpu, cluster.gfree, pod.gpu_request

    def score(i):
        left = 0.5 * (cpu[i] - pod.cpu_milli) / BEST_FIT_CPU + 0.5 * (sum(gfree[i]) - need) / BEST_FIT_GPU
        return int((1.0 - left) * 100)

    scores = [score(i) for i in found]
    top = max(scores)
    i = rng.choice([i for i, s in zip(found, scores) if s == top])
    return i, _tightest_gpus(cluster, pod, i)


def best_fit_exact(cluster, pod, found, rng):
    """Best-fit without the artifact's rounding: least CPU+GPU left (same weights), node
    order breaking ties; deterministic."""
    cpu, gfree, need = cluster.cpu, cluster.gfree, pod.gpu_request
    i = min(found, key=lambda i: (cpu[i] - pod.cpu_milli) / BEST_FIT_CPU + (sum(gfree[i]) - need) / BEST_FIT_GPU)
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
         "best-fit-exact": best_fit_exact, "random": random_fit,
         "k8s-default": k8s_default, "k8s-tightest": k8s_tightest, "fgd": fgd}


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
