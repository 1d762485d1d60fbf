"""Capacity planning: how many GPUs do pods need under a placement policy, with and without
sharing a GPU.

One plain-Python model: pods (openb CSV or `kubectl get pods -o json`), nodes (openb node
CSV), GPUs with an SM share (milli-GPU, 1000 = the whole GPU) and memory, the placement
policies, the protocol of the FGD paper (Weng et al., "Beware of Fragmentation", USENIX
ATC '23: pods never leave, the workload scaled to 130% of the cluster's GPUs, seeds), a
mode in which pods leave at their deletion time, and the metrics.  Nothing here talks to
a GPU or a cluster.

Memory of openb pods: the trace has none, so a pod asking `gpu_milli` of a GPU is given
the same fraction of that GPU model's memory (floor, in MiB).  Memory then never binds
for openb pods by itself (it is proportional to the SM share); it binds for pods that ask
for memory explicitly (Kubernetes pods).
"""
import csv
import json
import math
import random
import statistics
from dataclasses import dataclass, field

from .errors import BadFile, InvalidRequest
from .quantities import parse_memory

MILLI = 1000
MIB = 1 << 20

# GPU memory per model, MiB (public specs).  G1-G3 are undisclosed internal codes in the
# trace: their memory is unknown, so a pod asking for memory explicitly does not fit them
# unless `gpu_memory` (the CLI's --gpu-memory) names it.
MODEL_MEMORY_MIB = {
    "P100": 16 * 1024, "T4": 16 * 1024, "V100M16": 16 * 1024, "V100M32": 32 * 1024,
    "A10": 24 * 1024, "A100-40G": 40 * 1024, "A100-80G": 80 * 1024, "H100-80G": 80 * 1024,
}

POLICIES = ("whole-gpu", "mig", "first-fit", "k8s-default", "k8s-tightest", "best-fit", "best-fit-exact", "random")

# MIG: every MIG-capable model has 7 compute slices and 8 memory slices; a profile takes
# `compute` of the 7 and `memory` of the 8 memory slices, starting at one of `starts`
# (NVIDIA's MIG user guide, supported-mig-profiles; ../shared/reference/nvml-mig.md).
# MiB: what nvidia-smi -lgip shows (GiB x 1024, rounded down) on the A100-40GB and the
# H100 80GB; the A100 80GB has the H100's geometry and sizes.  (compute, memory, starts)
_MIG_GEOMETRY = ((1, 1, (0, 1, 2, 3, 4, 5, 6)), (1, 2, (0, 2, 4, 6)), (2, 2, (0, 2, 4)), (3, 4, (0, 4)),
                 (4, 4, (0,)), (7, 8, (0,)))
_H100_80G = (("1g.10gb", 9984), ("1g.20gb", 20090), ("2g.20gb", 20090), ("3g.40gb", 40448), ("4g.40gb", 40448),
             ("7g.80gb", 81152))
_MIG_SIZES = {"A100-40G": (("1g.5gb", 4864), ("1g.10gb", 9984), ("2g.10gb", 9984), ("3g.20gb", 20090),
                           ("4g.20gb", 20090), ("7g.40gb", 40325)),
              "A100-80G": _H100_80G, "H100-80G": _H100_80G}
# model -> ((name, compute, memory slices, MiB, starts), ...)
MIG_PROFILES = {model: tuple((name, c, m, mib, starts) for (c, m, starts), (name, mib) in zip(_MIG_GEOMETRY, sizes))
                for model, sizes in _MIG_SIZES.items()}

# The paper's figures: unallocated GPU share at 100% arrived load, default trace, mean of
# 10 seeds (Weng et al., ATC '23; ../shared/traces/README.md).
PAPER_UNALLOCATED_PCT = {"random": 13.7, "dot-product": 9.4, "gpu-packing": 8.2,
                         "best-fit": 7.1, "fgd": 4.8}


@dataclass
class Pod:
    name: str
    cpu_milli: int = 0
    memory_mib: int = 0
    num_gpu: int = 0
    gpu_milli: int = 0            # per GPU; < 1000 only for num_gpu == 1 (a shared GPU)
    gpu_memory_mib: int = None    # per GPU, when the pod says; None: derived from gpu_milli
    gpu_spec: tuple = ()          # GPU models allowed; () any
    creation_time: float = 0.0
    deletion_time: float = None   # None: never leaves

    @property
    def gpu_request(self):
        """GPU asked for, in milli-GPUs (the unit the paper's capacity counts)."""
        return self.num_gpu * self.gpu_milli

    @property
    def shared(self):
        return self.num_gpu == 1 and self.gpu_milli < MILLI


@dataclass
class Node:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


# === readers ===

def _rows(path, required):
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
            header = set(rows[0]) if rows else set()
    except OSError as e:
        raise BadFile(f"{path}: {e.strerror}", hint="give the path of an openb CSV file") from None
    missing = [c for c in required if c not in header]
    if missing:
        raise BadFile(f"{path}: no column {', '.join(missing)}",
                      hint=f"an openb CSV has the header {','.join(required)}")
    return rows


def _int(path, row, column):
    try:
        return int(float(row[column] or 0))
    except ValueError:
        raise BadFile(f"{path}: {column}={row[column]!r} in {row.get('name') or row.get('sn')} is not a number",
                      hint="the openb CSV columns hold integers") from None


def _time(path, row, column):
    """Seconds from the trace's start; None where the column is absent or empty."""
    if not row.get(column):
        return None
    try:
        return float(row[column])
    except ValueError:
        raise BadFile(f"{path}: {column}={row[column]!r} in {row.get('name')} is not a number",
                      hint="times are seconds from the trace's start") from None


def _json_items(path, hint):
    """The items of a `kubectl get ... -o json` file (a list, or one object); None when the
    file is not JSON at all (a CSV)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise BadFile(f"{path}: {e.strerror}", hint=hint) from None
    if not text.lstrip().startswith("{"):
        return None
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise BadFile(f"{path}: not JSON ({e})", hint=hint) from None
    items = doc.get("items", [doc]) if isinstance(doc, dict) else None
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise BadFile(f"{path}: no list of objects", hint=hint)
    return items


# CPU and memory of a node whose GPUs come from ResourceSlices (which say nothing of them):
# never the limit, so only GPUs decide.
UNBOUNDED = 1 << 40
VGPU_DRIVER = "vgpu.dev"


def read_resource_slices(path, items):
    """`kubectl get resourceslices -o json`: each node's whole GPUs as vgpu's DRA driver
    publishes them (a device of type gpu: its model, its memory capacity).  Returns the
    nodes and {model: MiB}."""
    gpus, memory = {}, {}
    for s in items:
        spec = s.get("spec") or {}
        if spec.get("driver") != VGPU_DRIVER or not spec.get("nodeName"):
            continue
        for d in spec.get("devices") or []:
            attrs = {k: next(iter(v.values()), None) for k, v in (d.get("attributes") or {}).items() if isinstance(v, dict)}
            if attrs.get("type") != "gpu":
                continue
            model = str(attrs.get("model") or "")
            gpus.setdefault(spec["nodeName"], []).append(model)
            cap = ((d.get("capacity") or {}).get("memory") or {}).get("value")
            if cap is not None:
                try:
                    memory[model] = parse_memory(str(cap)) >> 20
                except ValueError:
                    raise BadFile(f"{path}: device {d.get('name')} has memory {cap!r}",
                                  hint="capacities are Kubernetes quantities") from None
    if not gpus:
        raise BadFile(f"{path}: no GPU of driver {VGPU_DRIVER} in these ResourceSlices",
                      hint="kubectl get resourceslices -o json > slices.json")
    nodes = []
    for name in sorted(gpus):
        for model in sorted(set(gpus[name])):     # a node of two models: one Node per model
            n = gpus[name].count(model)
            nodes.append(Node(name if len(set(gpus[name])) == 1 else f"{name}/{model}", UNBOUNDED, UNBOUNDED, n, model))
    return nodes, memory


def read_nodes(path, memory_out=None):
    """The openb node CSV (sn, cpu_milli, memory_mib, gpu, model), or vgpu's ResourceSlices as
    `kubectl get resourceslices -o json` prints them (their GPU memory into memory_out)."""
    items = _json_items(path, "give an openb node CSV or kubectl get resourceslices -o json")
    if items is not None:
        nodes, memory = read_resource_slices(path, items)
        if memory_out is not None:
            memory_out.update(memory)
        return nodes
    rows = _rows(path, ("sn", "cpu_milli", "memory_mib", "gpu", "model"))
    return [Node(r["sn"], _int(path, r, "cpu_milli"), _int(path, r, "memory_mib"), _int(path, r, "gpu"),
                 r["model"] or "") for r in rows]


def read_pods(path):
    """Pods from an openb pod CSV, or from `kubectl get pods -o json` or `kubectl get
    resourceclaims -o json` (a file that starts with `{`)."""
    items = _json_items(path, "give an openb pod CSV, or kubectl get pods -A -o json > pods.json")
    if items is not None:
        if items and all(i.get("kind") == "ResourceClaim" for i in items):
            return read_claims(path, items)
        return read_k8s_pods(path, items)
    rows = _rows(path, ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"))
    pods = []
    for r in rows:
        num_gpu, milli = _int(path, r, "num_gpu"), _int(path, r, "gpu_milli")
        if num_gpu and not 0 < milli <= MILLI:
            raise BadFile(f"{path}: gpu_milli={milli} in {r['name']} is not 1-1000", hint="gpu_milli is the share of one GPU")
        spec = tuple(s for s in (r.get("gpu_spec") or "").split("|") if s)
        pods.append(Pod(r["name"], _int(path, r, "cpu_milli"), _int(path, r, "memory_mib"), num_gpu,
                        milli if num_gpu else 0, None, spec, _time(path, r, "creation_time") or 0.0,
                        _time(path, r, "deletion_time")))
    return pods


def _cpu_milli(text):
    text = str(text)
    return int(math.ceil(float(text[:-1]))) if text.endswith("m") else int(math.ceil(float(text) * MILLI))


def _in_arrival_order(pods):
    """Pods sorted by their creationTimestamp (kept in creation_time, then replaced by the
    arrival rank): Kubernetes objects arrive in that order."""
    pods = [pods[i] for i in sorted(range(len(pods)), key=lambda i: (pods[i].creation_time, i))]
    for i, p in enumerate(pods):
        p.creation_time = float(i)
    return pods


def read_k8s_pods(path, items):
    """`kubectl get pods -o json` (its items): vgpu's resources (vgpu.dev/gpu-memory bytes,
    vgpu.dev/gpu-utilization percent) or HAMi's (nvidia.com/gpu count, nvidia.com/gpumem
    MiB, nvidia.com/gpucores percent); limits win over requests, as the device plugins read
    them.  Pods in arrival order by metadata.creationTimestamp."""
    pods = []
    for n, item in enumerate(items):
        meta, spec = item.get("metadata", {}), item.get("spec", {})
        name = meta.get("name") or f"pod-{n}"
        cpu = mem = num_gpu = milli = 0
        gmem = None
        try:
            for c in spec.get("containers", []):
                res = c.get("resources", {})
                want = {**res.get("requests", {}), **res.get("limits", {})}
                cpu += _cpu_milli(want["cpu"]) if "cpu" in want else 0
                mem += parse_memory(str(want["memory"])) // MIB if "memory" in want else 0
                if "vgpu.dev/gpu-memory" in want or "vgpu.dev/gpu-utilization" in want:
                    num_gpu = max(num_gpu, 1)
                    if "vgpu.dev/gpu-memory" in want:
                        gmem = (gmem or 0) + -(-parse_memory(str(want["vgpu.dev/gpu-memory"])) // MIB)
                    milli = min(MILLI, milli + int(want.get("vgpu.dev/gpu-utilization", 100)) * 10)
                elif "nvidia.com/gpu" in want:
                    count = int(want["nvidia.com/gpu"])
                    num_gpu += count
                    share = int(want.get("nvidia.com/gpucores", 100)) * 10 if count == 1 else MILLI
                    milli = max(milli, min(MILLI, share))
                    if "nvidia.com/gpumem" in want:
                        gmem = int(want["nvidia.com/gpumem"])
        except (ValueError, TypeError) as e:
            raise BadFile(f"{path}: pod {name}: {e}", hint="resources must be Kubernetes quantities") from None
        if num_gpu > 1:
            milli = MILLI   # a multi-GPU pod takes whole GPUs
        pods.append(Pod(name, cpu, mem, num_gpu, milli if num_gpu else 0, gmem, (),
                        meta.get("creationTimestamp") or ""))
    return _in_arrival_order(pods)


def read_claims(path, items):
    """`kubectl get resourceclaims -A -o json`: each claim of a vgpu device class as a pod
    asking what its requests ask -- per request `count` GPUs (ExactCount; 1 by default) of
    `capacity.requests` memory and SM share (`sm` percent; the whole GPU when absent), in
    creationTimestamp order.  resource.k8s.io/v1 puts a request's fields under `exactly`;
    v1beta1 beside its name: both are read.  A claim of another driver's class is left out."""
    pods = []
    for n, c in enumerate(items):
        meta = c.get("metadata") or {}
        name = f"{meta.get('namespace', 'default')}/{meta.get('name') or f'claim-{n}'}"
        num_gpu, milli, gmem = 0, 0, None
        for r in ((c.get("spec") or {}).get("devices") or {}).get("requests") or []:
            req = r.get("exactly") or r
            if not str(req.get("deviceClassName", "")).endswith(VGPU_DRIVER):
                continue
            wants = (req.get("capacity") or {}).get("requests") or {}
            try:
                count = int(req.get("count", 1)) if req.get("allocationMode", "ExactCount") == "ExactCount" else 1
                share = int(math.ceil(float(str(wants["sm"])) * 10)) if "sm" in wants else MILLI
                if "memory" in wants:
                    gmem = max(gmem or 0, -(-parse_memory(str(wants["memory"])) // MIB))
            except (TypeError, ValueError) as e:
                raise BadFile(f"{path}: claim {name}: {e}", hint="capacity requests are Kubernetes quantities") from None
            num_gpu += count
            milli = max(milli, min(MILLI, share))
        if not num_gpu:
            continue
        if num_gpu > 1:
            milli = MILLI
        pods.append(Pod(name, 0, 0, num_gpu, milli, gmem, (), meta.get("creationTimestamp") or ""))
    return _in_arrival_order(pods)


# === the cluster ===

class Cluster:
    """Free CPU, memory and per-GPU SM share and memory of every node, with the two
    summaries that make the feasibility scan cheap: the largest free share on one GPU and
    the number of idle GPUs."""

    def __init__(self, nodes, gpu_memory=None):
        memory = {**MODEL_MEMORY_MIB, **(gpu_memory or {})}
        self.nodes = nodes
        self.cpu = [n.cpu_milli for n in nodes]
        self.mem = [n.memory_mib for n in nodes]
        self.gfree = [[MILLI] * n.gpus for n in nodes]
        self.gmem_cap = [memory.get(n.model) for n in nodes]   # per GPU, None: unknown
        self.gmem = [[memory.get(n.model) or 0] * n.gpus for n in nodes]
        self.maxfree = [MILLI if n.gpus else 0 for n in nodes]
        self.mig = [[0] * n.gpus for n in nodes]      # memory slices MIG instances hold (mig policy)
        self.idle = [n.gpus for n in nodes]
        self.by_model = {}
        for i, n in enumerate(nodes):
            self.by_model.setdefault(n.model, []).append(i)
        self.all = list(range(len(nodes)))
        self.next_start = 0                            # kube-scheduler's next filtering start
        self.capacity = sum(n.gpus for n in nodes) * MILLI
        self.allocated = 0

    def gpu_memory_of(self, pod, i):
        """MiB of GPU memory the pod takes on each GPU of node i (None: cannot be known)."""
        if pod.gpu_memory_mib is not None:
            return pod.gpu_memory_mib if self.gmem_cap[i] is not None else None
        return (self.gmem_cap[i] or 0) * pod.gpu_milli // MILLI

    def candidates(self, pod):
        """Nodes the pod fits on, in node order."""
        nodes = self.all
        if pod.gpu_spec:
            nodes = [i for m in pod.gpu_spec for i in self.by_model.get(m, ())]
            nodes.sort()
        cpu, mem, cf, mf = pod.cpu_milli, pod.memory_mib, self.cpu, self.mem
        if pod.num_gpu == 0:
            return [i for i in nodes if cf[i] >= cpu and mf[i] >= mem]
        if pod.shared:
            g, mx = pod.gpu_milli, self.maxfree
            found = [i for i in nodes if mx[i] >= g and cf[i] >= cpu and mf[i] >= mem]
        else:
            k, idle = pod.num_gpu, self.idle
            found = [i for i in nodes if idle[i] >= k and cf[i] >= cpu and mf[i] >= mem]
        if pod.gpu_memory_mib is not None:   # explicit memory: check it on the GPUs themselves
            found = [i for i in found if self.fitting_gpus(pod, i)]
        return found

    def fitting_gpus(self, pod, i):
        """GPU indices of node i that can take (one GPU's worth of) the pod."""
        need = self.gpu_memory_of(pod, i)
        if need is None:
            return []
        want = pod.gpu_milli if pod.shared else MILLI
        return [g for g, free in enumerate(self.gfree[i]) if free >= want and self.gmem[i][g] >= need]

    def gpus_in_use(self):
        return sum(1 for free in self.gfree for f in free if f < MILLI)

    def take(self, pod, i, gpus, sign=1):
        """Take what the pod asks on node i's `gpus` (sign -1: give it back)."""
        self.cpu[i] -= sign * pod.cpu_milli
        self.mem[i] -= sign * pod.memory_mib
        need = self.gpu_memory_of(pod, i) or 0
        for g in gpus:
            self.gfree[i][g] -= sign * pod.gpu_milli
            self.gmem[i][g] -= sign * need
        self.maxfree[i] = max(self.gfree[i], default=0)
        self.idle[i] = sum(1 for f in self.gfree[i] if f == MILLI)
        self.allocated += sign * pod.gpu_request


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
         "k8s-default": k8s_default, "k8s-tightest": k8s_tightest}


def _placement(cluster, pod, policy, rng):
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


def _take(cluster, placement, sign=1):
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


# === a run ===

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


def simulate(pods, nodes, policy, seed=0, gpu_memory=None, checkpoints=(), stop_after=None):
    """Place pods in the given order under `policy`; nothing leaves.  `checkpoints` are
    arrived loads (percent of the cluster's GPU capacity, counting what the pods ask for)
    at which the unallocated share is recorded; `stop_after` ends the run at that load
    (placements after it cannot change a figure recorded before it)."""
    if policy not in POLICIES:
        raise InvalidRequest(f"unknown policy {policy!r}", hint=f"one of: {', '.join(POLICIES)}")
    cluster = Cluster(nodes, gpu_memory)
    if not cluster.capacity:
        raise InvalidRequest("the nodes have no GPUs", hint="give the openb GPU node list")
    run = Run(policy, cluster)
    rng = random.Random(f"{seed}-policy")
    marks = sorted(checkpoints)
    for pod in pods:
        run.asked += pod.gpu_request
        placement = _placement(cluster, pod, policy, rng)
        if placement:
            _take(cluster, placement)
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
    cluster = Cluster(nodes, gpu_memory)
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
                _take(cluster, where.pop(n), -1)
        else:
            placement = _placement(cluster, pod, policy, rng)
            if placement:
                _take(cluster, placement)
                where[n] = placement
            else:
                run.unplaced.append(pod)
        if run.times and run.times[-1] == t:
            run.gpus_in_use[-1] = cluster.gpus_in_use()
        else:
            run.times.append(t)
            run.gpus_in_use.append(cluster.gpus_in_use())
    return run


def tune(pods, ratio, capacity_milli, seed):
    """The paper's workload scaling: copies of pods drawn at random (with replacement) are
    added, or pods drawn at random are dropped, until what the pods ask for reaches
    `ratio` of the cluster's GPU capacity.  A copy arrives with its original."""
    rng = random.Random(f"{seed}-workload")
    target = ratio * capacity_milli
    total = sum(p.gpu_request for p in pods)
    out = list(pods)
    if total < target:
        n = 0
        while total < target:
            p = rng.choice(pods)
            copy = Pod(**p.__dict__)
            copy.name = f"{p.name}-copy{n}"
            n += 1
            out.append(copy)
            total += p.gpu_request
        out.sort(key=lambda p: p.creation_time)   # stable: a copy follows its original
    else:
        keep = set(range(len(out)))
        for j in rng.sample(range(len(out)), len(out)):
            if total - out[j].gpu_request < target:
                continue
            keep.discard(j)
            total -= out[j].gpu_request
            if total <= target:
                break
        out = [p for j, p in enumerate(out) if j in keep]
    return out


def order(pods, how, seed):
    """'arrival': creation_time order (the README's protocol); 'shuffle': a random order per
    seed (the paper's artifact runs with --shuffle-pod=true)."""
    if how == "arrival":
        return sorted(pods, key=lambda p: p.creation_time)
    if how == "shuffle":
        out = list(pods)
        random.Random(f"{seed}-order").shuffle(out)
        return out
    raise InvalidRequest(f"unknown order {how!r}", hint="arrival or shuffle")


def paper_curves(pods, nodes, policy, seeds=range(10), ratio=1.3, how="shuffle", points=(100.0,), gpu_memory=None,
                 metric="unallocated"):
    """{arrived load %: [per seed]} for each of `points`: the unallocated GPU share (percent
    of capacity) when the pods that have arrived ask that much; with metric="unplaced", the
    GPU asked by pods that did not fit by then (percent of capacity): the two agree when
    pods take what they ask, not under whole-gpu, which rounds up."""
    capacity = sum(n.gpus for n in nodes) * MILLI
    out = {at: [] for at in points}
    for seed in seeds:
        workload = order(tune(pods, ratio, capacity, seed), how, seed)
        run = simulate(workload, nodes, policy, seed, gpu_memory, checkpoints=points, stop_after=max(points))
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
