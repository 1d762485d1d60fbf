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
"""
import math
from bisect import bisect_right
from collections import Counter

from .model import select_host

# typicalPodsConfig of the artifact's experiments (scripts/generate_config_and_run.py):
# isInvolvedCpuPods true, podPopularityThreshold 95, podIncreaseStep 1, gpuResWeight 0
POPULARITY, STEP = 95, 1


def typical_pods(pods):
    """[(cpu_milli, gpu_milli, num_gpu, models or None, weight)] of the workload: its pod
    kinds, most common first, until they cover POPULARITY% of its pods."""
    kinds = Counter((p.cpu_milli, p.gpu_milli if p.num_gpu else 0, p.num_gpu, tuple(sorted(p.gpu_spec)) or None)
                    for p in pods)
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
    model, free CPU and free GPU shares are alike in it)."""

    def __init__(self, pods):
        self.typical = typical_pods(pods)
        self._cpus = sorted({t[0] for t in self.typical})   # free CPU matters only against these
        self._memo = {}
        self._keys = {}      # node -> (its Cluster.touched count, its state)
        self._scores = {}    # (pod kind, node state) -> (score, the free shares of the GPUs that earn it)

    def of(self, model, cpu, free):
        key = (model, bisect_right(self._cpus, cpu), tuple(sorted(free)))
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
        """Node i's state: (model, free CPU, free GPU shares in order)."""
        kept = self._keys.get(i)
        if kept is None or kept[0] != cluster.touched[i]:
            kept = self._keys[i] = (cluster.touched[i], (cluster.nodes[i].model, cluster.cpu[i],
                                                         tuple(sorted(cluster.gfree[i]))))
        return kept[1]

    def score(self, pod, state):
        """(score, free shares of the GPUs that earn it: one value for a shared pod, else
        None) of placing `pod` on a node in `state`."""
        key = ((pod.cpu_milli, pod.gpu_milli, pod.num_gpu), state)
        got = self._scores.get(key)
        if got is None:
            model, cpu, free = state
            before = self.of(model, cpu, free)
            left = cpu - pod.cpu_milli
            if pod.shared:
                got = None
                for value in sorted(set(x for x in free if x >= pod.gpu_milli)):
                    after = list(free)
                    after[after.index(value)] -= pod.gpu_milli
                    s = _score(before, self.of(model, left, after))
                    if got is None or s > got[0]:
                        got = (s, {value})
                    elif s == got[0]:
                        got[1].add(value)
            else:
                after = list(free)
                for k in range(pod.num_gpu):     # (sorted: the idle GPUs are the last ones)
                    after[-1 - k] = 0
                got = (_score(before, self.of(model, left, after)), None)
            self._scores[key] = got
        return got


def _score(before, after):
    return int(100 / (1 + math.exp(-(before - after) / 1000)))


def fgd(cluster, pod, found, rng):
    frag, names = cluster.fragmentation, cluster.name_order
    alike = {}       # node state -> its node whose name sorts first (alike nodes score alike)
    for i in found:
        st = frag.state(cluster, i)
        if st not in alike or names[i] < names[alike[st]]:
            alike[st] = i
    i = select_host(cluster, ((frag.score(pod, st)[0], i) for st, i in alike.items()))
    values = frag.score(pod, frag.state(cluster, i))[1]
    if values is None:
        return i, cluster.fitting_gpus(pod, i)[:pod.num_gpu]
    return i, [next(g for g in cluster.fitting_gpus(pod, i) if cluster.gfree[i][g] in values)]
