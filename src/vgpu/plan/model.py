"""The planner's model: GPU models (memory, MIG profiles), pods, nodes, and the cluster
they are placed on."""
from dataclasses import dataclass


MILLI = 1000
MIB = 1 << 20

# GPU memory per model, MiB (public specs).  G1-G3 are undisclosed internal codes in the
# trace: their memory is unknown, so a pod asking for memory explicitly does not fit them
# unless `gpu_memory` (the CLI's --gpu-memory) names it.
MODEL_MEMORY_MIB = {
    "P100": 16 * 1024, "T4": 16 * 1024, "V100M16": 16 * 1024, "V100M32": 32 * 1024,
    "A10": 24 * 1024, "A100-40G": 40 * 1024, "A100-80G": 80 * 1024, "H100-80G": 80 * 1024,
}

POLICIES = ("whole-gpu", "mig", "first-fit", "k8s-default", "k8s-tightest", "best-fit", "best-fit-exact", "random",
            "dot-product", "gpu-packing", "fgd", "vgpu")

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
        self.free_total = [n.gpus * MILLI for n in nodes]   # per node: the sum of its GPUs' free shares
        self.by_model = {}
        for i, n in enumerate(nodes):
            self.by_model.setdefault(n.model, []).append(i)
        self.all = list(range(len(nodes)))
        self.next_start = 0                            # kube-scheduler's next filtering start
        self.fragmentation = None                      # the fgd policy's measure (set by a run)
        self.touched = [0] * len(nodes)                # per node: how often take() changed it
        self.name_order = {i: r for r, i in enumerate(sorted(range(len(nodes)), key=lambda i: nodes[i].name))}
        self.capacity = sum(n.gpus for n in nodes) * MILLI
        self.allocated = 0

    def random_names(self, rng):
        """Order the nodes' names at random (what select_host breaks ties by): the paper's
        simulator prefixes each node's name with a random index ("%04d-", simulator.go
        syncClusterResourceList), so its name order is a random node order per run."""
        ranks = list(range(len(self.nodes)))
        rng.shuffle(ranks)
        self.name_order = dict(enumerate(ranks))

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
        self.touched[i] += 1
        self.cpu[i] -= sign * pod.cpu_milli
        self.mem[i] -= sign * pod.memory_mib
        need = self.gpu_memory_of(pod, i) or 0
        for g in gpus:
            self.gfree[i][g] -= sign * pod.gpu_milli
            self.gmem[i][g] -= sign * need
        self.maxfree[i] = max(self.gfree[i], default=0)
        self.idle[i] = sum(1 for f in self.gfree[i] if f == MILLI)
        self.free_total[i] = sum(self.gfree[i])
        self.allocated += sign * pod.gpu_request


def select_host(cluster, scored):
    """The node with the top score among (score, node) pairs, ties to the node whose name
    sorts first: the FGD paper's artifact's selectHost (its vendored kube-scheduler,
    pkg/scheduler/core/generic_scheduler.go, patched "for reproducibility" from a random
    choice), which every score plugin of its experiments goes through."""
    names = cluster.name_order
    return max(scored, key=lambda s: (s[0], -names[s[1]]))[1]
