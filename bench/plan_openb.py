"""The FGD paper's headline figure, measured with vgpu.plan on the same public trace.

Trace: Alibaba openb (cluster-trace-gpu-v2023), from Weng et al., "Beware of Fragmentation:
Scheduling GPU-Sharing Workloads with Fragmentation Gradient Descent", USENIX ATC '23
(../shared/traces/README.md).  Protocol: the default pod list scaled to 130% of the
cluster's GPUs (seeded resampling), nothing leaves; the figure is the unallocated share of
GPU capacity when the pods that have arrived ask for 100% of it; mean ± std over seeds
0..N-1, beside the paper's figures (mean of 10 seeds).  Pod orders: the paper's artifact
shuffles the pods (--shuffle-pod=true), the README says creation_time; "artifact" is the
order the artifact's simulator really gives them (the trace shuffled, then the copies).
Ties between nodes go by a random node order per seed, as the artifact's simulator breaks
them.
"Unplaced demand" is the GPU asked by pods that did not fit by then: the same figure for
policies that give pods what they ask, the comparable one for whole-gpu (which rounds a
share up to a GPU, so it leaves few GPUs unallocated while turning more pods away).

Run: .venv/bin/python bench/plan_openb.py [--seeds 10] [--policy P] [--node-list all_node] [--traces DIR]
         [--pod-list gpushare40] [--orders shuffle,arrival,artifact] [--no-unplaced] [--first-seed 10]
"""
import argparse
import sys
import time
from pathlib import Path

from vgpu import plan

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("random", "dot-product", "gpu-packing", "best-fit", "best-fit-exact", "first-fit", "fgd", "whole-gpu")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--traces", default=str(ROOT.parent / "shared" / "traces" / "openb"))
    ap.add_argument("--policy", action="append", help="policies to run [default: all]")
    ap.add_argument("--node-list", choices=("gpu_node", "all_node"), default="gpu_node",
                    help="all_node adds the trace's 310 CPU-only nodes")
    ap.add_argument("--pod-list", default="default",
                    help="which openb pod list: default, gpushare20 ... gpushare100, multigpu50, ...")
    ap.add_argument("--orders", default="shuffle,arrival", help="pod orders to measure (shuffle, arrival, artifact)")
    ap.add_argument("--no-unplaced", action="store_true", help="skip the unplaced-demand column (a second run "
                    "per seed; it equals the unallocated share for every policy but whole-gpu)")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first..first+N-1 (held-out seeds: 10)")
    args = ap.parse_args(argv)
    nodes = plan.read_nodes(Path(args.traces) / f"openb_node_list_{args.node_list}.csv")
    pods = plan.read_pods(Path(args.traces) / f"openb_pod_list_{args.pod_list}.csv")
    orders = args.orders.split(",")
    print(f"openb {args.pod_list} trace: {len(pods)} pods, {len(nodes)} nodes, "
          f"{sum(n.gpus for n in nodes)} GPUs; scaled to 130%, unallocated GPU % at 100% arrived, "
          f"seeds {args.first_seed}-{args.first_seed + args.seeds - 1}")
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    print(f"{'':<16}{'unallocated GPU %':^56}{'unplaced demand %':^20}")
    print(f"{'policy':<16}{'shuffled order':>16}{'creation order':>16}{'artifact order':>16}{'paper':>8}"
          f"{'shuffled':>20}{'s/seed':>8}")
    for p in args.policy or POLICIES:
        cells = []
        t = time.perf_counter()
        for how in ("shuffle", "arrival", "artifact"):
            if how not in orders:
                cells.append("-")
                continue
            mean, std = plan.mean_std(plan.paper_protocol(pods, nodes, p, seeds=seeds, how=how))
            cells.append(f"{mean:.2f} ± {std:.2f}")
        per_seed = (time.perf_counter() - t) / (len(orders) * args.seeds)
        if args.no_unplaced:
            cells.append("-")
        else:
            mean, std = plan.mean_std(plan.paper_protocol(pods, nodes, p, seeds=seeds, how="shuffle",
                                                          metric="unplaced"))
            cells.append(f"{mean:.2f} ± {std:.2f}")
        paper = plan.PAPER_UNALLOCATED_PCT.get(p) if args.pod_list == "default" else None
        print(f"{p:<16}{cells[0]:>16}{cells[1]:>16}{cells[2]:>16}{'-' if paper is None else paper:>8}{cells[3]:>20}"
              f"{per_seed:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
