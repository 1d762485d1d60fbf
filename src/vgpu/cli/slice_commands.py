"""The slices: create, delete, list, resize, status, reap."""
import json
import sys
import time

import click

from .. import driverlimits, nvml
from .. import slices
from .. import status as status_mod
from ..quantities import SHARE_FULL, UNLIMITED, format_memory, format_share, format_utc
from . import common
from .common import (DURATION, NAME, Owner, UsageFailure, change_arrow, check_sim_state, dir_option, emit_json,
                     existing_node_dir, json_option, main, node_dir_for_create, print_warning, quota_options,
                     warn_sm_ceilings)


def devices_arg(device, memory, sm, request, limit, sm_request, sm_limit):
    q = slices.device_quota(UNLIMITED if memory is None else memory, SHARE_FULL if sm is None else sm,
                            request, limit, sm_request, sm_limit)
    return {d: q for d in (device or (0,))}


def describe_device(q: dict) -> str:
    def mem(v):
        return "max" if v is None else format_memory(v)
    return (f"memory.max {mem(q['memory_max'])} (request {mem(q['memory_request'])}, "
            f"limit {mem(q['memory_limit'])}), sm.max {format_share(q['sm_max'])}")


@main.command()
@click.argument("name", type=NAME)
@quota_options
@click.option("--device", type=click.IntRange(0, slices.MAX_DEVICES - 1), multiple=True,
              help="Device index the slice holds (repeat for several) [default: 0]; other devices are denied.")
@click.option("--user", "owner", type=Owner(),
              help="Make the usage file 0600 and owned by this user (the container's uid) instead of 0666.")
@click.option("--mig", "mig_profile", metavar="PROFILE",
              help="A MIG slice: a GPU instance of this profile (e.g. 3g.40gb; `vgpu-ctl mig profiles`) and a "
                   "compute instance over it, MIG mode turned on if off; --memory/--sm then cap within it.")
@click.option("--placement", type=click.IntRange(0), metavar="START",
              help="With --mig: the GPU instance's placement start (memory slice) [default: the driver's choice].")
@click.option("--parents", is_flag=True, help="Also create the node directory's missing parents.")
@dir_option
@json_option
def create(name, memory, sm, request, limit, sm_request, sm_limit, sm_mode, overcommit, device, owner, mig_profile,
           placement, parents, directory, as_json):
    """Create a slice: its quota and usage files under the node directory.

    The slice holds --device (default 0) with the given caps; in its quota every other
    device has memory.max 0, so the slice is denied the devices it was not given.
    Without --memory there is no memory cap (and nothing guaranteed); without --sm the
    share is 100%.  The node directory is made if its parent exists (with --parents,
    the whole path).  In burst mode (the default) a slice is guaranteed --sm-request and
    may use idle GPU time up to --sm; guaranteed shares adding up to more than 100% on a
    device are not guarantees any more, and a warning says so.

    With --mig the slice is a MIG instance of its own (hardware isolation,
    docs/mig.md): its programs see only it, as device 0; --memory and --sm are then a
    software slice inside it.  MIG mode is turned on if it is off (refused while
    processes run on the GPU).

    \b
    Example:
      vgpu-ctl create train --memory 8Gi --sm 50%
      vgpu-ctl create batch --sm 100% --sm-request 30%
      vgpu-ctl create infer --memory 4Gi --request 2Gi --limit 6Gi --device 1
      vgpu-ctl create tenant-a --mig 3g.40gb --device 1
    """
    node_dir_for_create(directory, parents)
    if mig_profile is not None or placement is not None:
        return _create_mig(name, mig_profile, placement, device, memory, sm, request, limit, sm_request, sm_limit,
                           sm_mode, overcommit, owner, directory, as_json)
    refuse_mig_mode(device or (0,))
    quota = slices.create(directory, name, devices_arg(device, memory, sm, request, limit, sm_request, sm_limit),
                          overcommit=overcommit, capacity=common.nvml_capacity, owner=owner,
                          count_hint=common.nvml_count_hint, sm_mode=sm_mode)
    if sm is not None or sm_request is not None:   # without --sm a slice has no SM cap: nothing to warn about by itself
        warn_sm_ceilings(directory, quota.held())
    files = slices.paths(directory, name)
    if as_json:
        emit_json({**quota.to_json(), "quota": files["quota"], "usage": files["usage"]})
        return
    click.echo(f"created {name}")
    for dq in quota.to_json()["devices"]:
        click.echo(f"  device {dq['index']}: {describe_device(dq)}")
    click.echo(f"  quota {files['quota']}\n  usage {files['usage']}")


def refuse_mig_mode(devices):
    """A software slice on a GPU in MIG mode would get whichever MIG device CUDA lists
    first, not the GPU: refused."""
    check_sim_state()
    for d in devices:
        if nvml.mig_mode(d):
            raise click.ClickException(
                f"device {d} is in MIG mode: a software slice there would not get the GPU, only a MIG device "
                "of it; hint: make it inside an instance of its own (--mig PROFILE --memory ...), or pick another "
                "--device")


def _create_mig(name, profile, placement, device, memory, sm, request, limit, sm_request, sm_limit, sm_mode,
                overcommit, owner, directory, as_json):
    from .. import mig
    if profile is None:
        raise click.UsageError("--placement needs --mig PROFILE")
    if len(device) > 1:
        raise click.UsageError(f"a MIG slice is one instance on one GPU: pass one --device, not {len(device)}")
    check_sim_state()
    index = device[0] if device else 0
    quota = devices_arg((0,), memory, sm, request, limit, sm_request, sm_limit)[0]
    made = mig.create_slice(directory, name, index, profile, quota, placement=placement, overcommit=overcommit,
                            owner=owner, sm_mode=sm_mode, software_on=lambda d: _software_slices_on(directory, d))
    record, files = made["mig"], slices.paths(directory, name)
    if as_json:
        emit_json({**made["quota"].to_json(), "mig": record, "quota": files["quota"], "usage": files["usage"]})
        return
    click.echo(f"created {name}")
    if record["enabled_mig_mode"]:
        click.echo(f"  device {index}: MIG mode turned on")
    click.echo(f"  device {index}: {_describe_mig(record)}")
    click.echo(f"  in the instance: {describe_device(made['quota'].to_json()['devices'][0])}")
    click.echo(f"  quota {files['quota']}\n  usage {files['usage']}")


def _describe_mig(record) -> str:
    where = f"{record['placement']['start']}:{record['placement']['size']}"
    return (f"MIG {record['profile']} at {where} (GPU instance {record['gpu_instance']}, compute instance "
            f"{record['compute_instance']}), {format_memory(record['memory_total'])}, "
            f"{record['multiprocessors']} SMs, {record['uuid']}")


def _software_slices_on(directory, d) -> list:
    """The node's software slices holding device d."""
    out = []
    for n in slices.list_names(directory):
        try:
            if not slices.has_mig(directory, n) and d in slices.read_quota(directory, n).held():
                out.append(n)
        except slices.VgpuError:
            continue
    return out


@main.command()
@click.argument("name", type=NAME)
@click.option("--force", is_flag=True, help="Delete even while processes use the slice.")
@click.option("--disable-mig", is_flag=True,
              help="A MIG slice: also turn MIG mode off on its GPU when no other GPU instance is left there.")
@dir_option
@json_option
def delete(name, force, disable_mig, directory, as_json):
    """Delete a slice (refused while its processes run, unless --force).

    A MIG slice's compute and GPU instance are destroyed first; MIG mode stays on
    unless --disable-mig.

    \b
    Example:
      vgpu-ctl delete train
      vgpu-ctl delete tenant-a --disable-mig
    """
    if slices.has_mig(directory, name):
        return _delete_mig(name, force, disable_mig, directory, as_json)
    if disable_mig:
        slices.read_quota(directory, name)   # it must exist
        raise UsageFailure(f"--disable-mig is for MIG slices, and {name} is a software slice; hint: leave it out")
    quota = slices.read_quota(directory, name)
    result = slices.delete(directory, name, force=force)
    driverlimits.release(directory, name, quota)   # the driver's limit on its cgroup goes too
    if result["live_processes"]:
        print_warning(f"{name} still had {len(result['live_processes'])} live process(es); they keep their last limits")
    if as_json:
        emit_json(result)
    else:
        click.echo(f"deleted {name}")


def _delete_mig(name, force, disable_mig, directory, as_json):
    from .. import mig
    check_sim_state()
    result = mig.delete_slice(directory, name, force=force, disable_mig=disable_mig)
    if result["live_processes"]:
        print_warning(f"{name} still had {len(result['live_processes'])} live process(es); they keep their last limits")
    for w in result["warnings"]:
        print_warning(w)
    if as_json:
        emit_json(result)
        return
    click.echo(f"deleted {name}")
    record = result["mig"]
    if result["destroyed"]:
        click.echo(f"  destroyed MIG {record['profile']} at {record['placement']['start']}:"
                   f"{record['placement']['size']} (GPU instance {record['gpu_instance']}) on device {record['device']}")
    if result["mig_mode_off"]:
        click.echo(f"  device {record['device']}: MIG mode turned off")


@main.command("list")
@dir_option
@json_option
def list_cmd(directory, as_json):
    """List the slices and their quotas (no NVML needed).

    Per slice and device: memory.max, its request and limit; sm.max, its request (the
    guarantee) and limit; the SM mode (burst: idle time lent up to sm.max; ceiling:
    sm.max always); live processes; the quota's generation.  --json has the same
    fields (memory in bytes, SM in 1/100 percent).

    \b
    Example:
      vgpu-ctl list --json
    """
    existing_node_dir(directory)
    out = []
    for name, quota, usage, problem in slices.read_all(directory):
        out.append({"name": name, "problem": problem,
                    **({} if quota is None else quota.to_json()),
                    "processes": sum(1 for p in usage.procs if p.alive) if usage else 0})
        if slices.has_mig(directory, name):   # a MIG slice: its instance (its device 0 is the instance)
            try:
                out[-1]["mig"] = slices.read_mig(directory, name)
            except slices.VgpuError as e:
                out[-1]["problem"] = out[-1]["problem"] or str(e)
    if as_json:
        emit_json(out)
        return
    if not out:
        click.echo(f"no slices in {slices.node_dir(directory)}")
        return
    rows = []
    migs = any("mig" in c for c in out)   # a MIG column only where there are MIG slices
    for c in out:
        if c["problem"]:     # (the error in the last column: a cell past the headers would not show)
            rows.append([c["name"], "-", *(["-"] if migs else []), "-", "-", "-", "-", "-", "-", "-", "-",
                         f"error: {c['problem']}"])
            continue
        for d in c["devices"]:
            m = [("max" if v is None else format_memory(v)) for v in
                 (d["memory_max"], d["memory_request"], d["memory_limit"])]
            rec = c.get("mig")
            where = [rec["device"], f"{rec['profile']} at {rec['placement']['start']}:{rec['placement']['size']}"] \
                if rec else [d["index"], *(["-"] if migs else [])]
            rows.append([c["name"], *where, *m, *(format_share(d[k]) for k in ("sm_max", "sm_request", "sm_limit")),
                         c["sm_mode"], c["processes"], c["generation"]])
    click.echo(status_mod.table(["NAME", "DEVICE", *(["MIG"] if migs else []), "MEMORY", "REQUEST", "LIMIT", "SM",
                                 "SM-REQUEST", "SM-LIMIT", "SM-MODE", "PROCESSES", "GEN"], rows))


@main.command()
@click.argument("name", type=NAME)
@quota_options
@click.option("--device", type=click.IntRange(0, slices.MAX_DEVICES - 1), multiple=True,
              help="Device to resize (repeatable) [default: every device the slice holds].")
@dir_option
@json_option
def resize(name, memory, sm, request, limit, sm_request, sm_limit, sm_mode, overcommit, device, directory, as_json):
    """Change a slice's quota while it runs (in place; the shim sees it on its next call).

    Request and limit follow the cap while they equal it.  Growing what is guaranteed on
    a device beyond its physical memory is refused unless --overcommit.  Shrinking below
    what the slice holds takes nothing away: its allocations fail until use drops.

    \b
    Example:
      vgpu-ctl resize train --memory 6Gi --sm 60%
    """
    if all(v is None for v in (memory, sm, request, limit, sm_request, sm_limit, sm_mode)):
        raise click.UsageError("nothing to change: pass --memory, --sm, --request, --limit, --sm-request, "
                               "--sm-limit or --sm-mode")
    capacity = common.nvml_capacity
    if slices.has_mig(directory, name):   # a software slice inside a MIG instance: the instance is its device
        device, overcommit = _mig_resize_check(directory, name, device, memory, sm, request, limit, sm_request,
                                               sm_limit, overcommit)
    result = slices.resize(directory, name, devices=device or None, memory=memory, sm=sm, request=request,
                           limit=limit, sm_request=sm_request, sm_limit=sm_limit, overcommit=overcommit,
                           capacity=capacity, sm_mode=sm_mode)
    why = driverlimits.follow(directory, name, slices.read_quota(directory, name), slices.has_mig(directory, name))
    if why:
        result["warnings"].append(f"the driver's limit on {name}'s cgroup did not follow ({why}): the shim holds "
                                  "the new quota alone")
    for w in result["warnings"]:
        print_warning(w)
    if sm is not None or sm_request is not None or sm_mode is not None:
        warn_sm_ceilings(directory, [dev["index"] for dev in result["devices"]])
    if as_json:
        emit_json(result)
        return
    arrow = change_arrow()
    for dev in result["devices"]:
        click.echo(f"{name} device {dev['index']}: " + (describe_changes(dev["old"], dev["new"], arrow) or "unchanged"))
    if result["sm_mode"]["old"] != result["sm_mode"]["new"]:
        click.echo(f"{name} sm mode: {result['sm_mode']['old']} {arrow} {result['sm_mode']['new']}")
    click.echo(f"generation {result['generation']}")


def _mig_resize_check(directory, name, device, memory, sm, request, limit, sm_request, sm_limit, overcommit):
    """A MIG slice's quota device 0 is its instance: what it guarantees is checked against
    the instance's memory, not the GPU's (other slices are not in it).  Returns the
    (devices, overcommit) to resize with."""
    record = slices.read_mig(directory, name)
    if device and set(device) != {record["device"]}:
        raise UsageFailure(f"{name} is a MIG slice on device {record['device']}; hint: leave --device out")
    old = slices.read_quota(directory, name).devices[0]
    new = slices._resized(old, memory, sm, request, limit, sm_request, sm_limit)
    if not overcommit and new.guaranteed_memory > max(old.guaranteed_memory, record["memory_total"]):
        raise click.ClickException(
            f"{name}'s MIG instance ({record['profile']}) holds {format_memory(record['memory_total'])}: guaranteeing "
            f"{format_memory(new.guaranteed_memory)} in it would overcommit it; hint: ask for less, or pass "
            "--overcommit")
    return (), True


def describe_changes(old, new, arrow) -> str:
    """`memory.max 4Gi → 6Gi, sm.max 50% → 60%`; a request or limit that just followed
    its cap is not repeated."""
    def mem(v):
        return "max" if v is None else format_memory(v)
    parts = []
    for kind, fmt in (("memory", mem), ("sm", format_share)):
        top = f"{kind}_max"
        for field in (top, f"{kind}_request", f"{kind}_limit"):
            o, n = old[field], new[field]
            followed = field != top and o == old[top] and n == new[top]
            if o != n and not followed:
                parts.append(f"{kind}.{field.split('_')[1]} {fmt(o)} {arrow} {fmt(n)}")
    return ", ".join(parts)


@main.command()
@click.argument("name", type=NAME, required=False)
@click.option("--watch", "-w", is_flag=True, help="Refresh every --interval until interrupted (Ctrl-C).")
@click.option("--interval", default="1s", show_default=True, type=DURATION,
              help="Time between refreshes: 2s, 500ms, or plain seconds.")
@click.option("--count", type=click.IntRange(1), hidden=True, help="Stop --watch after N refreshes (tests).")
@dir_option
@json_option
def status(name, watch, interval, count, directory, as_json):
    """Who uses what: per slice and per device, like `kubectl get -o wide`.

    Per slice and device: GPU-MEMORY used/cap, GPU-UTIL (SM time used/cap over the
    last window), time throttled, allocations refused (OOM), processes; then each
    process (pid in its container, host pid, command); then each device: memory and SM
    allocated against capacity, and what NVML says is really used.  Without NVML the
    slice files still tell most of it (a note says what is missing).  THROTTLED is the
    time launches waited for their share: in total, or with --watch per second of the
    last interval.  With --json and --watch, one JSON object per line; each has "ts",
    when it was read (ISO 8601, UTC, as the agent's lines).  Memory in bytes
    (null: no cap); SM shares in 1/100 percent, as in the quota.  SM-ALLOCATED says
    "(ceilings)" where the shares on a device add up to more than 100%.

    \b
    Example:
      vgpu-ctl status
      vgpu-ctl status train --watch
    """
    if interval < 0.05:
        raise click.BadParameter(f"{interval:g}s is too short (at least 50ms)", param_hint="'--interval'")
    existing_node_dir(directory)
    check_sim_state()
    try:
        _status_loop(directory, name, watch, interval, count, as_json)
    except KeyboardInterrupt:    # Ctrl-C is how a watch ends: quietly, with success
        if not watch:
            raise
        if not as_json:
            click.echo("")


def _status_loop(directory, name, watch, interval, count, as_json):
    # with --watch, every frame (the first too) shows rates over an interval: one sample
    # before the first frame, at most a second before it
    previous = status_mod.collect(directory, name) if watch else None
    if watch:
        time.sleep(min(interval, 1.0))
    n = 0
    while True:
        data = status_mod.collect(directory, name, previous)
        if as_json:   # stamped as the agent's and autoscaler's lines are: a watch's lines are a time series
            click.echo(json.dumps({"ts": format_utc(), **status_mod.public(data)}, indent=None if watch else 2))
        else:
            if watch and sys.stdout.isatty():
                click.echo("\x1b[H\x1b[2J", nl=False)
            if watch:
                click.echo(time.strftime("%H:%M:%S") + f"  every {interval:g}s\n")
            click.echo(status_mod.render(data))
        n += 1
        if not watch or (count and n >= count):
            return
        previous = data
        time.sleep(interval)
        if not as_json and not sys.stdout.isatty():
            click.echo("")


@main.command()
@click.argument("names", type=NAME, nargs=-1)
@dir_option
@json_option
def reap(names, directory, as_json):
    """Clear dead processes' slots and return their memory to their slices.

    The shim does this itself on a refused allocation or a memory query; reap does it
    now, for slices whose processes are all gone.

    \b
    Example:
      vgpu-ctl reap
    """
    existing_node_dir(directory)
    for name in names:   # unknown names are errors, not silently nothing to reap
        slices.read_quota(directory, name)
    reaped = slices.reap(directory, list(names) or None)
    driverlimits.tidy(directory)   # and the cgroups of killed runs
    if as_json:
        emit_json(reaped)
        return
    if not reaped:
        click.echo("nothing to reap")
    for r in reaped:
        if "error" in r:
            click.echo(f"{r['slice']}: not reaped: {r['error']}", err=True)
            continue
        mem = ", ".join(f"{format_memory(b)} on device {d}" for d, b in r["memory"].items()) or "no memory"
        click.echo(f"{r['slice']}: slot {r['slot']} pid {r['pid']} ({r['comm']}) gone; returned {mem}")
