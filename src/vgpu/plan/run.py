"""A run: placing pods in order (the FGD paper's protocol, or with departures), and what it
used."""
import random
import statistics
from dataclasses import dataclass, field

from ..errors import InvalidRequest
from .model import MILLI, POLICIES, Cluster, Pod
from .fgd import CapacityFragmentation, Fragmentation
from .policies import choose, take


# === a run ===

def _cluster(pods, nodes, policy, gpu_memory):
    cluster = Cluster(nodes, gpu_memory)
    if policy in ("fgd", "vgpu"):      # their measures are of the workload's typical pods
        cluster.fragmentation = (Fragmentation if policy == "fgd" else CapacityFragmentation)(pods)
    return cluster


@dataclass
class Run:
    policy: str
    cluster: Cluster
    placed: list = field(default_factory=list)       # (pod, node index, gpus)
    unplaced: list = field(default_factory=list)     # pods
    checkpoints: dict = field(default_factory=dict)  # arrived % -> unallocated %
    unplaced_at: dict = field(default_factory=dict)  # arrived % -> GPU asked by pods that did not fit, %
    asked: int = 0                                   # GPU milli the pods asked for (as given)
    asked_unplaced: int = 0                          # ... by the pods that did not fit


def simulate(pods, nodes, policy, seed=0, gpu_memory=None, checkpoints=(), stop_after=None, random_names=False):
    """Place pods in the given order under `policy`; nothing leaves.  `checkpoints` are
    arrived loads (percent of the cluster's GPU capacity, counting what the pods ask for)
    at which the unallocated share is recorded; `stop_after` ends the run at that load
    (placements after it cannot change a figure recorded before it).  `random_names`: ties
    go by a random node order drawn from `seed`, not by the nodes' names (the paper's
    simulator, Cluster.random_names)."""
    if policy not in POLICIES:
        raise InvalidRequest(f"unknown policy {policy!r}", hint=f"one of: {', '.join(POLICIES)}")
    cluster = _cluster(pods, nodes, policy, gpu_memory)
    if random_names:
        cluster.random_names(random.Random(f"{seed}-names"))
    if not cluster.capacity:
        raise InvalidRequest("the nodes have no GPUs", hint="give the openb GPU node list")
    run = Run(policy, cluster)
    rng = random.Random(f"{seed}-policy")
    marks = sorted(checkpoints)
    for pod in pods:
        run.asked += pod.gpu_request
        placement = choose(cluster, pod, policy, rng)
        if placement:
            take(cluster, placement)
            run.placed.append(placement[:3])
        else:
            run.unplaced.append(pod)
            run.asked_unplaced += pod.gpu_request
        arrived = 100.0 * run.asked / cluster.capacity
        while marks and arrived >= marks[0]:
            run.unplaced_at[marks[0]] = 100.0 * run.asked_unplaced / cluster.capacity
            run.checkpoints[marks.pop(0)] = 100.0 * (cluster.capacity - cluster.allocated) / cluster.capacity
        if stop_after is not None and arrived >= stop_after:
            break
    return run


@dataclass
class OverTime:
    """A run with departures: GPUs in use (any share allocated) after each event."""
    policy: str
    cluster: Cluster
    times: list = field(default_factory=list)        # event times, seconds
    gpus_in_use: list = field(default_factory=list)  # after each
    unplaced: list = field(default_factory=list)     # pods that did not fit when they arrived

    def summary(self):
        span = self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0
        weighted = sum(g * (b - a) for g, a, b in zip(self.gpus_in_use, self.times, self.times[1:]))
        return {"policy": self.policy, "gpus": sum(n.gpus for n in self.cluster.nodes),
                "gpus_needed_peak": max(self.gpus_in_use, default=0),
                "gpus_in_use_mean": round(weighted / span, 1) if span else float(max(self.gpus_in_use, default=0)),
                "pods_unplaced": len(self.unplaced), "hours": round(span / 3600, 1)}


def simulate_over_time(pods, nodes, policy, seed=0, gpu_memory=None):
    """Pods arrive at creation_time and leave at deletion_time (at one instant, departures
    first); a pod that does not fit when it arrives is not tried again (the scheduler
    would keep it pending: it is counted, not placed later).  GPUs in use after each event."""
    if policy not in POLICIES:
        raise InvalidRequest(f"unknown policy {policy!r}", hint=f"one of: {', '.join(POLICIES)}")
    cluster = _cluster(pods, nodes, policy, gpu_memory)
    run = OverTime(policy, cluster)
    rng = random.Random(f"{seed}-policy")
    events = [(p.creation_time, 1, n) for n, p in enumerate(pods)]
    events += [(p.deletion_time, 0, n) for n, p in enumerate(pods)
               if p.deletion_time is not None and p.deletion_time >= p.creation_time]
    where = {}
    for t, arrives, n in sorted(events):
        pod = pods[n]
        if not arrives:
            if n in where:
                take(cluster, where.pop(n), -1)
        else:
            placement = choose(cluster, pod, policy, rng)
            if placement:
                take(cluster, placement)
                where[n] = placement
            else:
                run.unplaced.append(pod)
        if run.times and run.times[-1] == t:
            run.gpus_in_use[-1] = cluster.gpus_in_use()
        else:
            run.times.append(t)
            run.gpus_in_use.append(cluster.gpus_in_use())
    return run


def _resample(pods, ratio, capacity_milli, seed):
    """The paper's workload scaling: copies of pods drawn at random (with replacement) are
    added, or pods drawn at random are dropped, until what the pods ask for reaches
    `ratio` of the cluster's GPU capacity.  Returns (the pods kept, in their order; the
    copies, in the order drawn)."""
    rng = random.Random(f"{seed}-workload")
    target = ratio * capacity_milli
    total = sum(p.gpu_request for p in pods)
    if total < target:
        copies = []
        while total < target:
            p = rng.choice(pods)
            copy = Pod(**p.__dict__)
            copy.name = f"{p.name}-copy{len(copies)}"
            copies.append(copy)
            total += p.gpu_request
        return list(pods), copies
    keep = set(range(len(pods)))
    for j in rng.sample(range(len(pods)), len(pods)):
        if total - pods[j].gpu_request < target:
            continue
        keep.discard(j)
        total -= pods[j].gpu_request
        if total <= target:
            break
    return [p for j, p in enumerate(pods) if j in keep], []


def tune(pods, ratio, capacity_milli, seed):
    """The workload scaled to `ratio` (_resample), in creation order: a copy arrives with
    its original."""
    kept, copies = _resample(pods, ratio, capacity_milli, seed)
    return sorted(kept + copies, key=lambda p: p.creation_time) if copies else kept


def order(pods, how, seed):
    """'arrival': creation_time order (the README's protocol); 'shuffle': a random order per
    seed (the paper's artifact runs with --shuffle-pod=true)."""
    if how == "arrival":
        return sorted(pods, key=lambda p: p.creation_time)
    if how == "shuffle":
        out = list(pods)
        random.Random(f"{seed}-order").shuffle(out)
        return out
    raise InvalidRequest(f"unknown order {how!r}", hint="arrival, shuffle or artifact")


def workload(pods, ratio, capacity_milli, seed, how):
    """The protocol's pods, scaled to `ratio`, in arrival order `how`: 'arrival' or
    'shuffle' (order() of tune()), or 'artifact', the order the paper's simulator gives
    them: the trace's pods (sorted by name) shuffled, then the copies in the order drawn
    (simulator.go: SortClusterPods shuffles before TunePodsByNodeTotalResource appends), so
    at 100% arrived nearly all of the trace and few copies have come."""
    if how != "artifact":
        return order(tune(pods, ratio, capacity_milli, seed), how, seed)
    kept, copies = _resample(pods, ratio, capacity_milli, seed)
    kept = sorted(kept, key=lambda p: p.name)
    random.Random(f"{seed}-order").shuffle(kept)
    return kept + copies


def paper_curves(pods, nodes, policy, seeds=range(10), ratio=1.3, how="shuffle", points=(100.0,), gpu_memory=None,
                 metric="unallocated"):
    """{arrived load %: [per seed]} for each of `points`: the unallocated GPU share (percent
    of capacity) when the pods that have arrived ask that much; with metric="unplaced", the
    GPU asked by pods that did not fit by then (percent of capacity): the two agree when
    pods take what they ask, not under whole-gpu, which rounds up.  Ties between nodes go
    by a random node order per seed, as the paper's simulator breaks them (random_names)."""
    capacity = sum(n.gpus for n in nodes) * MILLI
    out = {at: [] for at in points}
    for seed in seeds:
        run = simulate(workload(pods, ratio, capacity, seed, how), nodes, policy, seed, gpu_memory,
                       checkpoints=points, stop_after=max(points), random_names=True)
        for at in points:
            if at not in run.checkpoints:
                raise InvalidRequest(f"the workload never reaches {at}% of the cluster's GPUs",
                                     hint="scale it with a larger ratio")
            out[at].append(run.checkpoints[at] if metric == "unallocated" else run.unplaced_at[at])
    return out


def paper_protocol(pods, nodes, policy, seeds=range(10), ratio=1.3, how="shuffle", at=100.0, gpu_memory=None,
                   metric="unallocated"):
    """paper_curves at one point: one figure per seed."""
    return paper_curves(pods, nodes, policy, seeds, ratio, how, (at,), gpu_memory, metric)[at]


# === the report ===

def report(run):
    """What a run used, per GPU model and in all: GPUs used (any share allocated), the
    unallocated share of GPU capacity, SM and memory occupancy of the GPUs used, and the
    pods that did not fit."""
    c = run.cluster
    models = {}
    for i, n in enumerate(c.nodes):
        m = models.setdefault(n.model, {"nodes": 0, "gpus": 0, "gpus_used": 0, "sm_allocated": 0,
                                        "memory_mib": 0, "memory_allocated_mib": 0, "memory_known": True})
        m["nodes"] += 1
        m["gpus"] += n.gpus
        for g, free in enumerate(c.gfree[i]):
            if free < MILLI:
                m["gpus_used"] += 1
                m["sm_allocated"] += MILLI - free
                if c.gmem_cap[i] is None:
                    m["memory_known"] = False
                else:
                    m["memory_mib"] += c.gmem_cap[i]
                    m["memory_allocated_mib"] += c.gmem_cap[i] - c.gmem[i][g]

    def summary(m):
        used = m["gpus_used"]
        return {
            "nodes": m["nodes"], "gpus": m["gpus"], "gpus_used": used,
            "unallocated_pct": round(100.0 * (m["gpus"] * MILLI - m["sm_allocated"]) / (m["gpus"] * MILLI), 2)
            if m["gpus"] else None,
            "sm_occupancy_pct": round(100.0 * m["sm_allocated"] / (used * MILLI), 2) if used else None,
            "memory_occupancy_pct": round(100.0 * m["memory_allocated_mib"] / m["memory_mib"], 2)
            if used and m["memory_known"] and m["memory_mib"] else None,
        }

    total = {k: sum(m[k] for m in models.values()) for k in ("nodes", "gpus", "gpus_used", "sm_allocated",
                                                              "memory_mib", "memory_allocated_mib")}
    total["memory_known"] = all(m["memory_known"] for m in models.values())
    kinds = {"cpu_only": 0, "shared": 0, "whole": 0}
    for p in run.unplaced:
        kinds["cpu_only" if not p.num_gpu else "shared" if p.shared else "whole"] += 1
    return {
        "policy": run.policy,
        "pods": len(run.placed) + len(run.unplaced),
        "pods_placed": len(run.placed),
        "pods_unplaced": len(run.unplaced),
        "unplaced_by_kind": kinds,
        "unplaced": [p.name for p in run.unplaced],
        "gpu_asked": round(run.asked / MILLI, 3),
        "gpu_allocated": round(c.allocated / MILLI, 3),
        **summary(total),
        "models": {name: summary(m) for name, m in sorted(models.items())},
    }


def plot_curves(curves, path, title):
    """The paper's kind of figure: unallocated GPU share against arrived load, a line per
    policy (mean over seeds).  `curves`: {policy: {arrived %: [per seed]}}.  Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidRequest("--plot needs matplotlib, which is not installed",
                             hint="pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for policy, points in curves.items():
        xs = sorted(points)
        ax.plot(xs, [statistics.fmean(points[x]) for x in xs], marker="o", markersize=3, label=policy)
    ax.set_xlabel("arrived load (% of the cluster's GPUs asked)")
    ax.set_ylabel("unallocated GPU share (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def mean_std(values):
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)
