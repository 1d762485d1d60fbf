"""Putting programs in slices: shim-path, env, measure-context, run, install-shim."""
import os
import shlex

import click

from .. import driverlimits
from .. import nvml
from .. import overhead
from .. import runtime
from .. import sim as simgpu
from .. import slices
from ..paths import shim_path
from ..quantities import format_memory
from . import common
from .common import (CAP, MEMORY_HELP, NAME, SHARE, SHARE_HELP, UsageFailure, check_sim_state, dir_option,
                     emit_json, error_line, json_option, main, node_dir_for_create, package_shim, print_warning,
                     sim_capacity)
from .slice_commands import describe_device, devices_arg, refuse_mig_mode


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


@main.command()
@click.argument("name", type=NAME)
@click.option("--format", "fmt", type=click.Choice(["shell", "docker", "k8s", "json"]),
              help="Shell exports, docker run flags, a Kubernetes YAML snippet, or JSON (all three) "
                   "[default: shell].")
@click.option("--shim-dir", type=click.Path(file_okay=False), envvar="VGPU_SHIM_DIR",
              help="Host directory `install-shim` wrote: mount its libvgpu.so [default: the package's own "
                   "shim] [env: VGPU_SHIM_DIR].")
@click.option("--ld-so-preload", "ld_so_preload", is_flag=True,
              help="Load the shim through the container's /etc/ld.so.preload (the --shim-dir's ld.so.preload, "
                   "from `install-shim --preload-file`) instead of LD_PRELOAD.")
@click.option("--json", "as_json", is_flag=True, help="The same as --format json.")
@dir_option
def env(name, fmt, as_json, directory, shim_dir, ld_so_preload):
    """The variables and mounts that put a program or container in a slice.

    shell: exports for this host.  docker: `docker run` flags (shim and quota mounted
    read-only, usage read-write; with docker's --gpus all).  k8s: env and volumeMounts
    for the container and hostPath volumes for the pod; the pod also needs the GPUs
    (runtimeClassName: nvidia, or the DRA driver), which this snippet leaves to you.
    --json is --format json.

    \b
    Example:
      eval "$(vgpu-ctl env train)"; python train.py
      docker run $(vgpu-ctl env train --format docker) my-image python train.py
      vgpu-ctl env train --format k8s >> pod-patch.yaml
      vgpu-ctl env train --format docker --shim-dir /opt/vgpu --ld-so-preload   # after install-shim
    """
    if as_json and fmt not in (None, "json"):
        raise click.UsageError(f"--json is --format json, not --format {fmt}: pass one of them")
    fmt = "json" if as_json else (fmt or "shell")
    slices.read_quota(directory, name)   # it must exist (and be sound)
    record = slices.read_mig(directory, name)
    visible = record["uuid"] if record else None    # a MIG slice: its MIG device alone
    files = slices.paths(directory, name)
    if fmt != "shell":   # containers mount the identity file: a slice made before it had none gets one
        try:
            slices.ensure_identity(directory, name)
        except (PermissionError, slices.VgpuError):
            if not os.path.isfile(files["identity"]):
                raise click.ClickException(f"{files['identity']} is missing and cannot be made here; hint: run "
                                           f"`vgpu-ctl env {name}` once as root (it makes the file)") from None
    shim, preload = _installed_shim(shim_dir, ld_so_preload, fmt)
    # (a shell on this host is in its pid namespace: the shim measures a context there itself)
    cost = None if fmt == "shell" else overhead.for_slice(directory, name)
    if fmt == "shell":
        click.echo(runtime.shell(name, files, shim, visible), nl=False)
    elif fmt == "docker":
        click.echo(" ".join(shlex.quote(a) for a in runtime.docker(name, files, shim, preload, visible, cost)))
    elif fmt == "k8s":
        gpu = ("give the pod runtimeClassName: nvidia (NVIDIA_VISIBLE_DEVICES here names its MIG device)" if visible
               else "give the pod runtimeClassName: nvidia and NVIDIA_VISIBLE_DEVICES=all (or use the DRA driver)")
        click.echo(runtime.to_yaml(runtime.k8s(name, files, shim, preload, visible, cost),
                                   comment=f"vgpu slice {name}: env and volumeMounts go in the container, "
                                           f"volumes in the pod spec; the GPU itself is not here: {gpu}"), nl=False)
    else:
        emit_json({"variables": runtime.variables(name, slices.node_dir(directory), shim, visible),
                    "docker": runtime.docker(name, files, shim, preload, visible, cost),
                    "k8s": runtime.k8s(name, files, shim, preload, visible, cost)})


@main.command("measure-context")
@dir_option
@json_option
def measure_context(directory, as_json):
    """Measure the device memory a CUDA context costs on each GPU, for containers.

    The shim charges a context's memory on a process's first allocation.  In a
    container's own pid namespace it cannot find it (NVML names host pids); with this
    measurement kept in the node directory, every slice (those there now, and each
    one made afterwards) carries it in its quota, and `env --format docker|k8s` and
    the DRA driver's CDI specs set VGPU_CONTEXT_OVERHEAD from it.  Run it as root on
    each node, with no other work starting on it, and again after a driver upgrade.

    \b
    Example:
      vgpu-ctl measure-context
    """
    check_sim_state()
    try:
        results = overhead.measure(directory)
    except nvml.NvmlUnavailable as e:
        raise click.ClickException(f"NVML unavailable ({e}); hint: run it on a GPU node with the driver "
                                   f"loaded") from None
    if as_json:
        emit_json({str(i): v for i, v in results.items()})
        return
    for i, v in results.items():
        click.echo(f"device {i}: " + (f"a context costs {format_memory(v)}" if isinstance(v, int) else
                                      f"not measured ({v})"))
    click.echo(f"kept in {overhead.path(directory)}")


def _installed_shim(shim_dir, ld_so_preload, fmt):
    """(host path of the shim, host path of the ld.so.preload file or None) for `env`."""
    from .. import install
    if ld_so_preload and not shim_dir:
        raise click.UsageError("--ld-so-preload needs --shim-dir (a directory made by `install-shim DIR "
                               "--preload-file`)")
    if ld_so_preload and fmt == "shell":
        raise click.UsageError("--ld-so-preload is for containers (docker, k8s, json): this host's "
                               "/etc/ld.so.preload would put every process of the host under the shim")
    if not shim_dir:
        return package_shim(), None
    shim = os.path.join(os.path.abspath(shim_dir), install.SHIM_NAME)
    if not os.path.isfile(shim):
        raise click.ClickException(f"no shim in {shim_dir}; hint: vgpu-ctl install-shim {shim_dir}")
    if not ld_so_preload:
        return shim, None
    preload = os.path.join(os.path.abspath(shim_dir), install.PRELOAD_NAME)
    try:
        with open(preload, "rb") as f:
            ok = f.read() == install.preload_line()
    except FileNotFoundError:
        raise click.ClickException(f"no {install.PRELOAD_NAME} in {shim_dir}; hint: vgpu-ctl install-shim "
                                   f"{shim_dir} --preload-file") from None
    if not ok:
        raise click.ClickException(f"{preload} does not name {runtime.CONTAINER_SHIM}; hint: rewrite it with "
                                   f"vgpu-ctl install-shim {shim_dir} --preload-file")
    return shim, preload


@main.command(context_settings={"allow_interspersed_args": False})
@click.option("--memory", type=CAP, help=f"memory.max of the slice [default: no cap]: {MEMORY_HELP}")
@click.option("--sm", type=SHARE, help=f"sm.max of the slice [default: 100%]: {SHARE_HELP}")
@click.option("--device", type=click.IntRange(0, slices.MAX_DEVICES - 1), multiple=True,
              help="Device(s) the slice holds [default: 0].")
@click.option("--name", type=NAME, help="Run in this existing slice [default: a temporary one].")
@click.option("--create", "create_slice", is_flag=True,
              help="Create the --name slice (with --memory/--sm/--device) if it does not exist; it is kept.")
@click.option("--sim", is_flag=True, help="Run on simgpu (its SIMGPU_* variables, or an A10 by default).")
@click.option("--overcommit", is_flag=True, help="Allow guaranteed memory above the device's memory.")
@dir_option
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def run(ctx, memory, sm, device, name, create_slice, sim, overcommit, directory, command):
    """Run COMMAND under the shim in a slice; exit with its exit status.

    Without --name a temporary slice is made and deleted afterwards, with the share board
    and the node directory if it made them: the node is left as it was.  --name runs in a
    slice that exists (a typo is an error, not an unlimited new slice); with --create it
    is made if missing, and kept.  The shim is added to LD_PRELOAD (never replacing what
    is there).  Exit status: the command's (128+N if signal N killed it), 127 if it is
    not found, 126 if it cannot be executed, as shells do.

    \b
    Example:
      vgpu-ctl run --memory 4Gi --sm 50% -- python train.py
      vgpu-ctl run --name train -- python train.py
      vgpu-ctl run --name job --create --memory 2Gi -- python job.py
      vgpu-ctl run --sim --memory 2Gi -- python -c "import torch; ..."
    """
    if create_slice and name is None:
        raise click.UsageError("--create needs --name (without --name the slice is temporary)")
    base = dict(os.environ)
    capacity = common.nvml_capacity
    if sim:
        profile = base.get("SIMGPU_PROFILE", "a10")
        if profile not in simgpu.PROFILES:
            raise UsageFailure(f"SIMGPU_PROFILE={profile} is not a simgpu profile ({', '.join(simgpu.PROFILES)})")
        try:
            ndev = int(base.get("SIMGPU_DEVICES", "1"))
            base.update(simgpu.sim_environment(profile, ndev, base.get("SIMGPU_STATE_DIR"), base_env=base))
        except ValueError as e:
            raise UsageFailure(f"{e}; hint: fix SIMGPU_DEVICES") from None
        try:
            simgpu.check_state_dir(base["SIMGPU_STATE_DIR"])
        except ValueError as e:
            raise click.ClickException(f"SIMGPU_STATE_DIR: {e}") from None
        capacity = sim_capacity(profile, ndev)
    shim = package_shim()
    temporary = name is None
    name = name or slices.auto_name()
    exists = not temporary and name in slices.list_names(directory)
    if not temporary and not exists and not create_slice:
        raise click.ClickException(
            f"slice {name} not found in {slices.node_dir(directory)}; hint: `vgpu-ctl list` shows the "
            f"slices; pass --create to make it (kept afterwards), or leave --name out for a temporary slice")
    if exists and (memory is not None or sm is not None or device):
        _same_quota_or_fail(directory, name, memory, sm, device)
    made = {}
    if not exists:
        node_dir_for_create(directory)
        if not sim:   # (with --sim, the node is the child's, not this process's NVML)
            refuse_mig_mode(device or (0,))
        if temporary:   # what its making adds to the node goes with it
            made = slices.absent_node_files(directory)
        try:
            slices.create(directory, name, devices_arg(device, memory, sm, None, None, None, None),
                          overcommit=overcommit, capacity=capacity,
                          count_hint=(lambda: f" on the simulated node ({ndev})") if sim else common.nvml_count_hint,
                          temporary=_run_owner() if temporary else None)
        except slices.VgpuError:   # (refused after making the node directory: overcommit)
            slices.tidy_node(directory, made)
            raise
    cgroup = None
    try:
        record = None if temporary else slices.read_mig(directory, name)   # a MIG slice: its MIG device alone
        env = runtime.child_environment(base, name, slices.node_dir(directory), shim,
                                        record["uuid"] if record else None)
        if not sim:   # (with --sim, the node's driver is the child's: nothing to set from here)
            cgroup = _driver_layer(directory, name, record is not None)
        try:
            rc = runtime.run_child(list(command), env, cgroup)
        except FileNotFoundError:
            click.echo(f"Error: {command[0]}: command not found; hint: check the name and PATH", err=True)
            rc = 127
        except (PermissionError, IsADirectoryError, NotADirectoryError) as e:
            what = "is a directory" if os.path.isdir(command[0]) else "not executable"
            click.echo(f"Error: {command[0]}: {what} ({e.strerror}); hint: check its mode (chmod +x) or the "
                       "name", err=True)
            rc = 126
        except OSError as e:   # ENOEXEC (no interpreter line), ETXTBSY, ...
            click.echo(f"Error: {command[0]}: cannot execute ({e.strerror}); hint: check the file", err=True)
            rc = 126
    finally:
        if cgroup is not None:   # its limits go with it (the driver forgets a removed cgroup's)
            driverlimits.release(directory, name, slices.read_quota(directory, name) if name in slices.list_names(directory)
                                 else None)
        if temporary:
            try:
                if not slices.delete(directory, name, force=True)["live_processes"]:
                    slices.tidy_node(directory, made)   # (processes it left hold the board: it stays)
            except slices.VgpuError as e:   # the child's exit status matters more
                print_warning(f"could not delete the temporary slice: {error_line(e)}")
    ctx.exit(rc)


def _driver_layer(directory, name, mig):
    """The cgroup run's command goes in, with the slice's memory cap set there by the
    driver too (driverlimits.py), so a process that bypasses the shim is held as well;
    None, and one warning line saying why, where the driver cannot hold it (the shim alone
    still does: failing open)."""
    if mig:   # MIG handles take no driver limits: the instance is the hardware's boundary already
        return None
    driverlimits.tidy(directory)   # cgroups of runs killed before they could remove theirs
    try:
        return driverlimits.hold(directory, name, slices.read_quota(directory, name))
    except driverlimits.NoDriver:   # no cap, or no driver here: nothing falls back
        return None
    except driverlimits.Unavailable as e:
        print_warning(f"slice {name}: memory held by the shim alone ({e})")
        return None


def _run_owner():
    """This process, as the owner of a temporary slice: if it dies without deleting it
    (kill -9), the node agent does once the slice's processes are gone."""
    from .. import procfs
    return slices.Owner(os.getpid(), procfs.start_ticks(os.getpid()) or 0, procfs.pid_ns() or 0)


def _same_quota_or_fail(directory, name, memory, sm, device):
    """`run --name X --memory ...` of a slice that exists: fine if the quota already says
    so (a rerun of the same command), else the slice's quota would silently win."""
    quota = slices.read_quota(directory, name)
    held = quota.held()
    same = (not device or sorted(set(device)) == held) and all(
        (memory is None or quota.devices[d].memory_max == memory) and (sm is None or quota.devices[d].sm_max == sm)
        for d in held)
    if not same:
        now = "; ".join(f"device {d}: {describe_device(quota.devices[d].to_json())}" for d in held)
        raise UsageFailure(f"slice {name} exists with another quota ({now}); hint: change it with "
                           f"`vgpu-ctl resize {name}`, or run without --memory/--sm/--device")


@main.command("install-shim")
@click.argument("dest", type=click.Path(file_okay=False))
@click.option("--preload-file", is_flag=True,
              help=f"Also write DEST/ld.so.preload naming the shim's path in containers "
                   f"({runtime.CONTAINER_SHIM}); mount it read-only at /etc/ld.so.preload.")
@json_option
def install_shim_cmd(dest, preload_file, as_json):
    """Copy the shim to a host directory that containers mount read-only.

    Atomic: each file is written under a temporary name in DEST, flushed and renamed into
    place, so a container or process never sees a half-copied library, and processes
    holding the old one keep it.  Files already up to date are not rewritten.  DEST is
    created if its parent exists.

    \b
    Example:
      vgpu-ctl install-shim /opt/vgpu --preload-file
      docker run $(vgpu-ctl env train --shim-dir /opt/vgpu --format docker) my-image python train.py
    """
    from .. import install
    try:
        result = install.install_shim(dest, preload_file=preload_file)
    except install.InstallError as e:
        raise click.ClickException(error_line(e)) from None
    if as_json:
        emit_json(result)
        return
    for f in result["files"]:
        what = "installed" if f["changed"] else "unchanged"
        click.echo(f"{what} {f['path']} ({f['bytes']} bytes, sha256 {f['sha256'][:12]})")
    click.echo(f"hint: mount {result['files'][0]['path']} read-only at {runtime.CONTAINER_SHIM}: "
               f"vgpu-ctl env NAME --shim-dir {result['dest']} --format docker|k8s")
