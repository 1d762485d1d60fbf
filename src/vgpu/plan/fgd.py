"""Fragmentation gradient descent (FGD), the ATC '23 paper's policy, as its artifact scores it
(hkust-adsl/kubernetes-scheduler-simulator: fgd_score.go, utils/frag.go; the algorithm
restated here, not its code).

A node's fragmentation, for the workload's typical pods: for each typical pod, weighted by
its share of the workload, the free GPU share of the node that pod could not use -- all of
it where the pod cannot go there at all (GPU model, CPU, too few GPUs with room), else the
free share of the GPUs too full for it.  A pod goes where placing it grows that measure
least: score = sigmoid((before - after) / 1000) x 100 (milli-GPUs) cut to an integer, the
top score wins, ties to the node whose name sorts first (the artifact's selectHost, changed from the
scheduler's random choice "for reproducibility"); a shared pod takes the GPU with the best
score (the lowest index of equals), whole GPUs the first idle ones.

Typical pods: the workload's pods (CPU-only ones too) grouped by (CPU, GPU share, GPU
count, models), most common first, taken one kind at a time until they cover 95% of the
pods, weights renormalised (the settings below).  To a CPU-only pod all free GPU share is
fragment.  Memory is not part of the measure (the artifact's node resource has CPU and
GPUs only).

vgpu's own policy (`vgpu`) is the same placement over another measure,
CapacityFragmentation: a typical pod's room counts only the GPUs that copies of it can
still get CPU and memory for on the node (below).
"""
import math
import statistics
from bisect import bisect_left, bisect_right
from collections import Counter

from .model import MILLI, select_host

# typicalPodsConfig of the artifact's experiments (scripts/generate_config_and_run.py):
# isInvolvedCpuPods true, podPopularityThreshold 95, podIncreaseStep 1, gpuResWeight 0
POPULARITY, STEP = 95, 1


def typical_pods(pods):
    """[(cpu_milli, gpu_milli, num_gpu, models or None, weight)] of the workload: its pod
    kinds, most common first, until they cover POPULARITY% of its pods."""
    kinds = Counter(_kind(p) for p in pods)
    total = sum(kinds.values())
    ranked = kinds.most_common()
    taken, covered = 0, 0
    while covered < POPULARITY * total / 100 and taken < len(ranked):
        for kind, n in ranked[taken:taken + STEP]:
            covered += n
        taken = min(taken + STEP, len(ranked))
    return [(*kind, n / covered) for kind, n in ranked[:taken]]


class Fragmentation:
    """A node's fragmentation for one workload, remembered per node state (nodes alike in
    model, free CPU and free GPU shares are alike in it).  A node state: (model, the
    resources the measure sees besides GPUs (here free CPU), free GPU shares in
    ascending order)."""

    def __init__(self, pods):
        self.typical = typical_pods(pods)
        self._cpus = sorted({t[0] for t in self.typical})   # free CPU matters only against these
        self._memo = {}
        self._keys = {}      # node -> (its Cluster.touched count, its state)
        self._scores = {}    # pod kind -> {node state: (score, the free shares of the GPUs that earn it)}

    def resources(self, cluster, i):
        return (cluster.cpu[i],)

    def asks(self, pod):
        return (pod.cpu_milli,)

    def of(self, model, resources, free):
        cpu, = resources
        key = (model, bisect_right(self._cpus, cpu), free)
        f = self._memo.get(key)
        if f is None:
            total = sum(free)
            f = 0.0
            for t_cpu, t_milli, t_num, t_models, weight in self.typical:
                if t_milli == 0:                 # a CPU pod: all free GPU is fragment to it
                    f += weight * total
                    continue
                room = sum(1 for x in free if x >= t_milli)
                if (t_models is None or model in t_models) and room >= t_num and cpu >= t_cpu:
                    f += weight * sum(x for x in free if x < t_milli)
                else:
                    f += weight * total
            self._memo[key] = f
        return f

    def state(self, cluster, i):
        """Node i's state (above), kept until the node changes."""
        kept = self._keys.get(i)
        if kept is None or kept[0] != cluster.touched[i]:
            kept = self._keys[i] = (cluster.touched[i], (cluster.nodes[i].model, self.resources(cluster, i),
                                                         tuple(sorted(cluster.gfree[i]))))
        return kept[1]

    def scores(self, pod):
        """{node state: score} remembered for pods of this one's kind (see score)."""
        return self._scores.setdefault((self.asks(pod), pod.gpu_milli, pod.num_gpu), {})

    def score(self, pod, state, scores=None):
        """(score, free shares of the GPUs that earn it: one value for a shared pod, else
        None) of placing `pod` on a node in `state`; `scores`: self.scores(pod)."""
        scores = self.scores(pod) if scores is None else scores
        got = scores.get(state)
        if got is None:
            asks = self.asks(pod)
            model, resources, free = state
            before = self.of(model, resources, free)
            left = tuple(r - a for r, a in zip(resources, asks))
            if pod.shared:
                got = None
                for value in sorted(set(x for x in free if x >= pod.gpu_milli)):
                    after = list(free)
                    after[after.index(value)] -= pod.gpu_milli
                    s = _score(before, self.of(model, left, tuple(sorted(after))))
                    if got is None or s > got[0]:
                        got = (s, {value})
                    elif s == got[0]:
                        got[1].add(value)
            else:
                after = list(free)
                for k in range(pod.num_gpu):     # (ascending: the idle GPUs are the last ones)
                    after[-1 - k] = 0
                got = (_score(before, self.of(model, left, tuple(sorted(after)))), None)
            scores[state] = got
        return got


class CapacityFragmentation(Fragmentation):
    """vgpu's measure: FGD's, counting how many of each typical pod the node's free CPU and
    memory can still hold.  FGD takes a typical pod's room as all GPUs wide enough for it
    as soon as the node has its CPU once; here it is only as many of those GPUs (widest
    first; for a pod of k whole GPUs, k idle GPUs a copy) as copies of the pod fit in the
    node's free CPU and memory, and the rest is fragment too.  So a node with idle GPUs and
    too little CPU or memory left to use them counts them as lost, and a pod that eats
    CPU or memory next to GPUs that need it scores lower.  Typical pods as FGD's, each
    with the median memory of its kind's pods."""

    def __init__(self, pods):
        super().__init__(pods)
        memory = {}
        for p in pods:
            memory.setdefault(_kind(p), []).append(p.memory_mib)
        self.typical = [(cpu, statistics.median_low(memory[(cpu, milli, num, models)]), milli, num, models, weight)
                        for cpu, milli, num, models, weight in self.typical]

    def resources(self, cluster, i):
        return (cluster.cpu[i], cluster.mem[i])

    def asks(self, pod):
        return (pod.cpu_milli, pod.memory_mib)

    def of(self, model, resources, free):
        key = (model, resources, free)
        f = self._memo.get(key)
        if f is None:
            cpu, mem = resources
            n = len(free)
            widest = [0]                         # widest[c]: the free share of the c widest GPUs
            for x in reversed(free):
                widest.append(widest[-1] + x)
            total = widest[-1]
            idle = n - bisect_left(free, MILLI)
            f = 0.0
            for t_cpu, t_mem, t_milli, t_num, t_models, weight in self.typical:
                if t_milli == 0 or not (t_models is None or model in t_models):
                    f += weight * total          # (a CPU pod, or a GPU model it may not use)
                    continue
                # copies of it the node's CPU and memory hold (more than GPUs never matter)
                copies = min(cpu // t_cpu if t_cpu else n, mem // t_mem if t_mem else n)
                if t_milli < MILLI:              # its room: the widest GPUs it fits, one a copy
                    f += weight * (total - widest[min(copies, n - bisect_left(free, t_milli))])
                else:
                    f += weight * (total - min(idle // t_num, copies) * t_num * MILLI)
            self._memo[key] = f
        return f


def _kind(p):
    return p.cpu_milli, p.gpu_milli if p.num_gpu else 0, p.num_gpu, tuple(sorted(p.gpu_spec)) or None


def _score(before, after):
    return int(100 / (1 + math.exp(-(before - after) / 1000)))


def fgd(cluster, pod, found, rng):
    """FGD's placement with the cluster's measure (Fragmentation for `fgd`,
    CapacityFragmentation for `vgpu`): the node whose score is top, ties by select_host; a
    shared pod on the first GPU with the best score's free share, whole GPUs the first idle."""
    frag, names = cluster.fragmentation, cluster.name_order
    kept, touched = frag._keys, cluster.touched
    alike = {}       # node state -> its node whose name sorts first (alike nodes score alike)
    for i in found:
        k = kept.get(i)
        st = k[1] if k is not None and k[0] == touched[i] else frag.state(cluster, i)   # (inlined: the hot loop)
        j = alike.get(st)
        if j is None or names[i] < names[j]:
            alike[st] = i
    scores = frag.scores(pod)
    i = select_host(cluster, (((scores.get(st) or frag.score(pod, st, scores))[0], i) for st, i in alike.items()))
    values = scores[frag.state(cluster, i)][1]
    if values is None:
        return i, cluster.fitting_gpus(pod, i)[:pod.num_gpu]
    return i, [next(g for g in cluster.fitting_gpus(pod, i) if cluster.gfree[i][g] in values)]
