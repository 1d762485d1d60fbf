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

The package: model (GPU models, pods, nodes, the cluster), readers (the trace and
Kubernetes files), policies (placement), run (a run, the paper's protocol, the report).
"""
from .model import MIB, MIG_PROFILES, MILLI, MODEL_MEMORY_MIB, PAPER_UNALLOCATED_PCT, POLICIES, Cluster, Node, Pod
from .policies import feasible_nodes_to_find, mig_profile, scheduler_score
from .readers import read_claims, read_k8s_pods, read_nodes, read_pods, read_resource_slices
from .run import (OverTime, Run, mean_std, order, paper_curves, paper_protocol, plot_curves, report, simulate,
                  simulate_over_time, tune, workload)

__all__ = ["MIB", "MIG_PROFILES", "MILLI", "MODEL_MEMORY_MIB", "PAPER_UNALLOCATED_PCT", "POLICIES", "Cluster", "Node",
           "OverTime", "Pod", "Run", "feasible_nodes_to_find", "mean_std", "mig_profile", "order", "paper_curves",
           "paper_protocol", "plot_curves", "read_claims", "read_k8s_pods", "read_nodes", "read_pods",
           "read_resource_slices", "report", "scheduler_score", "simulate", "simulate_over_time", "tune", "workload"]
