"""`sim env` (a shell on simgpu) and `mig profiles` (what a GPU offers for `create --mig`)."""
import json
import os

import click

from .. import sim as simgpu
from .. import slices
from .. import status as status_mod
from .common import check_sim_state, dir_option, emit_json, json_option, main


@main.group()
def sim():
    """simgpu, the simulated GPU for machines without one.

    simgpu is two stand-in libraries (libcuda.so.1, libnvidia-ml.so.1) that CUDA
    programs, pynvml and vgpu-ctl itself use when LD_LIBRARY_PATH points at them.
    Processes sharing one state directory share one simulated node.

    \b
    Example:
      eval "$(vgpu-ctl sim env --profile a10 --state /tmp/node1)"
      vgpu-ctl create train --memory 8Gi --sm 50% --dir /tmp/vgpu
      vgpu-ctl run --sim --memory 2Gi -- python my_cuda_program.py
    """


@sim.command("env")
@click.option("--profile", default="a10", show_default=True,
              type=click.Choice(sorted(simgpu.PROFILES)), help="Simulated GPU model.")
@click.option("--devices", default=1, show_default=True,
              type=click.IntRange(1, simgpu.MAX_DEVICES), help="Number of simulated GPUs.")
@click.option("--state", "state_dir", type=click.Path(file_okay=False),
              help="State directory: processes sharing it share one simulated node "
                   "[default: /tmp/simgpu-$UID].")
@click.option("--json", "as_json", is_flag=True, help="Print the variables as JSON.")
def sim_env(profile, devices, state_dir, as_json):
    """Print the shell lines that point a program at simgpu.

    \b
    Example:
      eval "$(vgpu-ctl sim env --profile h200 --devices 2)"
      python my_cuda_program.py      # runs on two simulated H200s
    """
    try:
        env = simgpu.sim_environment(profile, devices, state_dir)
        simgpu.check_state_dir(env["SIMGPU_STATE_DIR"])
    except FileNotFoundError as e:
        raise click.ClickException(str(e))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--state'") from None
    click.echo(json.dumps(env, indent=2) if as_json else simgpu.shell_exports(env), nl=as_json)


@main.group("mig")
def mig_group():
    """MIG (Multi-Instance GPU): the profiles a GPU offers for `create --mig`.

    \b
    Example:
      vgpu-ctl mig profiles --device 0
      vgpu-ctl create tenant-a --mig 3g.40gb --device 0
    """


@mig_group.command("profiles")
@click.option("--device", type=click.IntRange(0, slices.MAX_DEVICES - 1), default=0, show_default=True,
              help="The GPU (NVML index).")
@dir_option
@json_option
def mig_profiles(device, directory, as_json):
    """The GPU instance profiles of a GPU, as `nvidia-smi mig -lgip` lists them.

    Per profile: its ID, instances free (while MIG mode is on) and in all, memory, SMs,
    copy engines, decoders/encoders/JPEG/OFA, P2P, and the placements (starts, in
    memory slices, : their size, as `nvidia-smi mig -lgipp`).  Then the GPU instances
    there are, and which slice holds each.

    \b
    Example:
      vgpu-ctl mig profiles --device 1
      vgpu-ctl mig profiles --json
    """
    from .. import mig
    check_sim_state()
    table = mig.profiles(device)
    owners = {}
    for n in slices.list_names(directory) if os.path.isdir(slices.node_dir(directory)) else []:
        try:
            rec = slices.read_mig(directory, n)
        except slices.VgpuError:
            continue
        if rec and rec.get("gpu_uuid") == table["uuid"]:
            owners[rec["gpu_instance"]] = n
    for gi in table["instances"]:
        gi["slice"] = owners.get(gi["id"])
    if as_json:
        emit_json(table)
        return
    on = table["mig_mode"][0] == 1
    rows = []
    for p in table["profiles"]:
        starts = ",".join(str(s) for s, _ in p["placements"] or [])
        rows.append([device, f"MIG {p['name']}", p["id"], f"{'-' if p['free'] is None else p['free']}/{p['instances']}",
                     f"{p['memory_mib'] / 1024:.2f}GiB", p["multiprocessors"], p["copy_engines"], p["decoders"],
                     p["encoders"], p["jpeg"], p["ofa"], "Yes" if p["p2p"] else "No",
                     f"{{{starts}}}:{p['placements'][0][1]}" if p["placements"] else "-"])
    click.echo(f"GPU {device}: {table['name']}, MIG mode {'on' if on else 'off'}"
               + (f" (pending {'on' if table['mig_mode'][1] else 'off'})" if table['mig_mode'][1] != table['mig_mode'][0]
                  else ""))
    click.echo(status_mod.table(["GPU", "NAME", "ID", "FREE/TOTAL", "MEMORY", "SM", "CE", "DEC", "ENC", "JPEG", "OFA",
                                 "P2P", "PLACEMENTS"], rows))
    if table["instances"]:
        click.echo("")
        click.echo(status_mod.table(["GPU-INSTANCE", "PROFILE", "PLACEMENT", "SLICE"],
                                    [[g["id"], g["profile"], f"{g['start']}:{g['size']}", g["slice"] or "- (not vgpu's)"]
                                     for g in table["instances"]]))
    if not on:
        click.echo(f"\nnote: MIG mode is off on device {device}: FREE is known once it is on (`vgpu-ctl create --mig "
                   "PROFILE` turns it on)")


def _simgpu_hook(name, *args):
    """Call one of simgpu's test hooks (simgpu/node.c) on the node the environment names."""
    import ctypes
    from ..paths import simgpu_dir
    if not os.environ.get("SIMGPU_STATE_DIR"):
        raise click.ClickException('no simulated node here: SIMGPU_STATE_DIR is not set '
                                   '(hint: eval "$(vgpu-ctl sim env)" first)')
    lib = ctypes.CDLL(str(simgpu_dir() / "libnvidia-ml.so.1"))
    if getattr(lib, name)(*map(ctypes.c_uint, args)) != 0:
        raise click.ClickException(f"simgpu has no GPU {args[0]} on the node at {os.environ['SIMGPU_STATE_DIR']}")


@sim.command("xid")
@click.argument("gpu", type=click.IntRange(0, simgpu.MAX_DEVICES - 1))
@click.argument("xid", type=click.IntRange(1, 999))
def sim_xid(gpu, xid):
    """Raise XID error XID on simulated GPU GPU: every NVML event set registered for XID
    critical errors there receives it (as the node agent's does).

    \b
    Example:
      vgpu-ctl sim xid 1 48        # a double-bit ECC error on GPU 1: unhealthy
      vgpu-ctl sim xid 0 13        # a graphics engine exception: logged, still healthy
    """
    _simgpu_hook("simgpuRaiseXid", gpu, xid)


@sim.command("lose")
@click.argument("gpu", type=click.IntRange(0, simgpu.MAX_DEVICES - 1))
def sim_lose(gpu):
    """Make simulated GPU GPU fall off the bus: NVML answers NVML_ERROR_GPU_IS_LOST for it
    from now on, and raises XID 79 there.  Until the state directory is made anew.

    \b
    Example:
      vgpu-ctl sim lose 1
    """
    _simgpu_hook("simgpuLoseGpu", gpu)
