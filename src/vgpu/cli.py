"""vgpu-ctl: the operator's command line.

A thin click layer over plain functions; nothing here touches NVML or the GPU at import,
so `vgpu-ctl --help` works anywhere.  Errors are one line with a hint (exit 1); usage
errors exit 2 (click's convention).
"""
import json

import click

from . import __version__
from . import sim as simgpu
from .paths import shim_path


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vgpu-ctl")
def main():
    """Fractional GPUs for containers: memory caps, SM share and live resize."""


@main.group()
def sim():
    """simgpu, the simulated GPU for machines without one."""


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
    except FileNotFoundError as e:
        raise click.ClickException(str(e))
    click.echo(json.dumps(env, indent=2) if as_json else simgpu.shell_exports(env), nl=as_json)


@main.command("shim-path")
def shim_path_cmd():
    """Print the path of the shim library (for LD_PRELOAD).

    \b
    Example:
      LD_PRELOAD=$(vgpu-ctl shim-path) VGPU_MEMORY_LIMIT=4Gi python train.py
    """
    try:
        click.echo(str(shim_path()))
    except FileNotFoundError as e:
        raise click.ClickException(str(e))
