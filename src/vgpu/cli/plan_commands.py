"""`plan`: how many GPUs pods need under each placement policy, shared or whole (vgpu.plan)."""
import click

from ..errors import InvalidRequest
from ..quantities import parse_memory
from .common import emit_json, json_option, main

_DEFAULT_POLICIES = ("whole-gpu", "k8s-default", "first-fit", "best-fit", "fgd", "vgpu", "random")


def _gpu_memory(values):
    out = {}
    for v in values:
        model, sep, size = v.partition("=")
        try:
            if not (sep and model):
                raise ValueError(v)
            out[model] = parse_memory(size) >> 20
        except ValueError:
            raise click.BadParameter(f"{v!r} is not MODEL=SIZE (e.g. G2=32Gi)", param_hint="'--gpu-memory'") from None
    return out


def _pct(v):
    return "-" if v is None else f"{v:.1f}%"


@main.command("plan")
@click.option("--pods", "pods_path", required=True, type=click.Path(dir_okay=False),
              help="Pods: an openb pod CSV, `kubectl get pods -A -o json` or `kubectl get resourceclaims -A -o json`.")
@click.option("--nodes", "nodes_path", required=True, type=click.Path(dir_okay=False),
              help="Nodes: an openb node CSV (sn, cpu_milli, memory_mib, gpu, model), or `kubectl get "
              "resourceslices -o json` (each node's GPUs as vgpu's DRA driver publishes them).")
@click.option("--policy", "policies", multiple=True, help="Placement policy, repeatable "
              "[default: whole-gpu, k8s-default, first-fit, best-fit, fgd, vgpu, random; also mig, k8s-tightest, "
              "best-fit-exact, dot-product, gpu-packing].")
@click.option("--seed", default=0, show_default=True, help="Seed of the random choices.")
@click.option("--gpu-memory", "gpu_memory", multiple=True, metavar="MODEL=SIZE",
              help="GPU memory of a model the built-in table lacks (G1-G3 are undisclosed), e.g. G2=32Gi.")
@click.option("--paper", is_flag=True, help="The FGD paper's protocol instead: the workload scaled to 130% of "
              "the cluster's GPUs, pods in random order, nothing leaves; prints the unallocated GPU share at "
              "100% arrived load, mean and std over --seeds.")
@click.option("--departures", is_flag=True, help="Pods arrive at creation_time and leave at deletion_time: "
              "prints the GPUs each policy needs (the most in use at once) and uses on average over time.")
@click.option("--seeds", default=10, show_default=True, type=click.IntRange(1, 1000), help="Seeds for --paper.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="--paper: also draw the unallocated "
              "share against arrived load (50% to 100%), a line per policy, into this PNG (needs matplotlib).")
@click.option("--order", "how", type=click.Choice(["shuffle", "arrival", "artifact"]), default="shuffle",
              show_default=True, help="--paper: pod order (the paper's artifact shuffles; arrival is creation_time "
              "order; artifact: the trace's pods shuffled, then the copies that scale it, as the artifact orders them).")
@json_option
def plan_cmd(pods_path, nodes_path, policies, seed, gpu_memory, paper, departures, seeds, plot_path, how, as_json):
    """Place pods on nodes under each policy; report GPUs used, unallocated GPU capacity,
    SM and memory occupancy and the pods that did not fit, per GPU model.

    Memory of openb pods (the trace has none) is the same fraction of the GPU model's
    memory as their gpu_milli is of the GPU; SM share is gpu_milli.

    \b
    Example:
      vgpu-ctl plan --pods openb_pod_list_default.csv --nodes openb_node_list_gpu_node.csv
      vgpu-ctl plan --pods pods.json --nodes nodes.csv --policy first-fit --json
      vgpu-ctl plan --paper --policy best-fit --pods ... --nodes ...
      vgpu-ctl plan --departures --pods ... --nodes ...
    """
    from .. import plan   # (imported here: only `plan` needs it)

    policies = policies or _DEFAULT_POLICIES
    for p in policies:
        if p not in plan.POLICIES:
            raise InvalidRequest(f"unknown policy {p!r}", hint=f"one of: {', '.join(plan.POLICIES)}")
    if paper and departures:
        raise InvalidRequest("--paper and --departures are two protocols", hint="choose one")
    if plot_path and not paper:
        raise InvalidRequest("--plot draws the --paper protocol's curve", hint="add --paper")
    published = {}                       # GPU memory per model, from ResourceSlices
    nodes = plan.read_nodes(nodes_path, published)
    memory = {**published, **_gpu_memory(gpu_memory)}
    pods = plan.read_pods(pods_path)
    if departures:
        rows = [plan.simulate_over_time(pods, nodes, p, seed, memory).summary() for p in policies]
        if as_json:
            emit_json({"protocol": {"departures": True}, "policies": rows})
            return
        click.echo(f"pods arrive and leave as the trace says ({rows[0]['hours']:g} h); a pod that does not fit "
                   "when it arrives is not placed later")
        click.echo(f"{'policy':<16}{'GPUs':>6}{'needed':>8}{'mean in use':>13}{'did not fit':>13}")
        for r in rows:
            click.echo(f"{r['policy']:<16}{r['gpus']:>6}{r['gpus_needed_peak']:>8}{r['gpus_in_use_mean']:>13.1f}"
                       f"{r['pods_unplaced']:>13}")
        return
    if paper:
        rows, curves = [], {}
        points = tuple(float(x) for x in range(50, 101, 5)) if plot_path else (100.0,)
        for p in policies:
            curves[p] = plan.paper_curves(pods, nodes, p, seeds=range(seeds), how=how, points=points,
                                          gpu_memory=memory)
            values = curves[p][100.0]
            mean, std = plan.mean_std(values)
            rows.append({"policy": p, "unallocated_pct_mean": round(mean, 2), "unallocated_pct_std": round(std, 2),
                         "per_seed": [round(v, 2) for v in values], "paper_pct": plan.PAPER_UNALLOCATED_PCT.get(p)})
        if plot_path:
            plan.plot_curves(curves, plot_path, f"scaled to 130%, order {how}, mean of {seeds} seeds")
        if as_json:
            emit_json({"protocol": {"scale": 1.3, "order": how, "at_arrived_pct": 100, "seeds": seeds},
                       "policies": rows, **({"plot": plot_path} if plot_path else {})})
            return
        click.echo(f"unallocated GPU capacity at 100% arrived load (scaled to 130%, order {how}, {seeds} seeds)")
        click.echo(f"{'policy':<16}{'measured':>16}{'paper':>8}")
        for r in rows:
            paper_pct = "-" if r["paper_pct"] is None else f"{r['paper_pct']:.1f}%"
            click.echo(f"{r['policy']:<16}{r['unallocated_pct_mean']:>9.2f}±{r['unallocated_pct_std']:.2f}%{paper_pct:>8}")
        if plot_path:
            click.echo(f"plot: {plot_path}")
        return
    reports = [plan.report(plan.simulate(pods, nodes, p, seed, memory)) for p in policies]
    if as_json:
        emit_json({"policies": reports})
        return
    click.echo(f"{'policy':<16}{'model':<10}{'GPUs':>6}{'used':>6}{'unalloc':>9}{'SM occ':>8}{'mem occ':>9}")
    for r in reports:
        for name, m in [*r["models"].items(), ("all", r)]:
            click.echo(f"{r['policy']:<16}{name:<10}{m['gpus']:>6}{m['gpus_used']:>6}{_pct(m['unallocated_pct']):>9}"
                       f"{_pct(m['sm_occupancy_pct']):>8}{_pct(m['memory_occupancy_pct']):>9}")
        k = r["unplaced_by_kind"]
        click.echo(f"{r['policy']:<16}{r['pods_placed']} of {r['pods']} pods placed; did not fit: {r['pods_unplaced']} "
                   f"(shared {k['shared']}, whole-GPU {k['whole']}, CPU-only {k['cpu_only']})")


@main.command("replay")
@click.option("--memory", "memory_path", required=True, type=click.Path(dir_okay=False),
              help="GPU memory used per pod: timestamp_anon,value,container_ip (the GenAI trace's file; .gz read as is).")
@click.option("--duty", "duty_path", type=click.Path(dir_okay=False),
              help="GPU duty cycle per pod, percent: value,timestamp_anon,container_ip.")
@click.option("--gpu-memory", "gpu_memory", default="80Gi", show_default=True,
              help="Memory of the GPU model assumed (the trace's peaks reach 47 GiB: an 80 GB card).")
@click.option("--request-quantile", "quantiles", multiple=True, type=click.FloatRange(0, 1, min_open=True),
              help="Autoscaled slices: the quantile of a pod's memory its request is sized at, repeatable "
              "[default: 0.5, 0.9, 0.99].")
@json_option
def replay_cmd(memory_path, duty_path, gpu_memory, quantiles, as_json):
    """Replay pods' memory and duty series: GPUs needed and memory occupancy with a whole GPU
    per pod, with a slice per pod sized at its peak, and with slices whose memory the
    autoscaler moves (the policy `vgpu-ctl autoscale` runs, at its defaults), with what that
    costs: samples where a pod would have been refused memory (OOM) and GPU time short.

    \b
    Example:
      vgpu-ctl replay --memory pod_gpu_memory_used_bytes_anon.csv.gz --duty pod_gpu_duty_cycle_anon.csv.gz
    """
    from .. import replay   # (imported here: only `replay` needs it)

    try:
        gpu_bytes = parse_memory(gpu_memory)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--gpu-memory'") from None
    times, series = replay.read_series(memory_path, duty_path)
    result = replay.replay(times, series, gpu_bytes, quantiles or (0.5, 0.9, 0.99))
    if as_json:
        emit_json(result)
        return
    click.echo(f"{result['pods']} pods, {result['samples']} samples every {result['interval_s']:g} s "
               f"({result['hours']:g} h), GPUs of {gpu_memory}")
    click.echo(f"{'config':<18}{'GPUs':>6}{'mem occ':>9}{'OOM samples':>13}{'of all':>8}{'held below':>12}"
               f"{'SM short':>10}")
    for c in result["configs"]:
        name = c["config"] + (f" p{c['request_quantile'] * 100:g}" if "request_quantile" in c else "")
        click.echo(f"{name:<18}{c['gpus']:>6}{c['memory_occupancy_pct']:>8.1f}%{c['oom_samples']:>13}"
                   f"{c['oom_pct']:>7.2f}%{c['held_below_demand_s'] / 3600:>11.1f}h{c['sm_short_samples']:>10}")
