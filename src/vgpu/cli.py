"""vgpu-ctl: the operator's command line.

A thin click layer over plain functions (vgpu.slices, vgpu.status, vgpu.runtime); nothing
here touches NVML or the GPU at import, so `vgpu-ctl --help` works anywhere (the modules of
one command family -- the agent, autoscaler, metrics server, MIG, Kubernetes, installers --
are imported inside their commands, so a command loads only what it runs).  Errors are
one line with a hint: runtime failures exit 1, usage errors exit 2 (click's convention).
"""
import errno
import json
import os
import shlex
import sys
import time

import click

from . import __version__
from . import nvml
from . import overhead
from . import runtime
from . import sim as simgpu
from . import slices
from . import status as status_mod
from .k8s import cdi
from .paths import shim_path
from .quantities import UNLIMITED, format_memory, format_share, parse_memory, parse_share


# === errors ===

class UsageFailure(click.ClickException):
    """A usage error found after parsing (arguments that contradict the slice): exit 2."""
    exit_code = 2


def _line(e) -> str:
    return f"{e}; hint: {e.hint}" if getattr(e, "hint", None) else str(e)


def _usage_line(e: click.UsageError) -> str:
    """click's usage errors as one line with a hint (click prints usage, a blank line and
    the error over three or four)."""
    message = " ".join(e.format_message().split())
    if "hint:" in message:
        return message
    path = " ".join(["vgpu-ctl", *e.ctx.command_path.split()[1:]]) if e.ctx is not None else "vgpu-ctl"
    return f"{message.rstrip('.')}; hint: {path} --help shows the options and an example"


class CtlGroup(click.Group):
    """Turns every error into one line with a hint and the right exit code: usage 2,
    runtime 1, and no traceback, whatever went wrong."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":   # `vgpu-ctl` or `vgpu-ctl sim` alone: the help
                e.show()
            else:
                click.echo(f"Error: {_usage_line(e)}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except (click.Abort, KeyboardInterrupt, EOFError):
            click.echo("", err=True)
            sys.exit(130)
        except OSError as e:
            if e.errno == errno.EPIPE:   # `vgpu-ctl status | head`
                sys.stderr = open(os.devnull, "w")
                sys.stdout = open(os.devnull, "w")
                sys.exit(141)
            click.echo(f"Error: {_os_error(e)}", err=True)
            sys.exit(1)
        except Exception as e:   # a bug: still one line, the traceback on request
            if os.environ.get("VGPU_DEBUG"):
                raise
            click.echo(f"Error: internal error: {type(e).__name__}: {e}; hint: VGPU_DEBUG=1 shows the traceback "
                       "(please report it)", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except slices.InvalidRequest as e:
            raise UsageFailure(_line(e)) from None
        except slices.VgpuError as e:
            raise click.ClickException(_line(e)) from None
        except PermissionError as e:
            raise click.ClickException(
                f"{e.filename or 'a vgpu file'}: permission denied; hint: run as root, or point --dir / "
                "VGPU_DIR at a directory you can write") from None


def _os_error(e: OSError) -> str:
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e}; hint: check the path and its permissions"


def _shim():
    try:
        return shim_path()
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None


# === parameter types ===

class Memory(click.ParamType):
    name = "SIZE"

    def __init__(self, cap=False):
        self.cap = cap    # memory.max itself: 0 would make a slice that can allocate nothing

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            v = parse_memory(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if self.cap and v == 0:
            self.fail(f"{value!r} would make a slice that can allocate nothing (leave --memory out, or say "
                      "max, for no cap; e.g. 4Gi)", param, ctx)
        return v


class Share(click.ParamType):
    name = "PERCENT"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_share(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class Name(click.ParamType):
    name = "NAME"

    def shell_complete(self, ctx, param, incomplete):
        """Tab completion offers the node's slices (--dir / VGPU_DIR as typed so far)."""
        from click.shell_completion import CompletionItem
        try:
            names = slices.list_names(ctx.params.get("directory"))
        except Exception:   # completion must never fail loudly
            return []
        return [CompletionItem(n) for n in names if n.startswith(incomplete)]

    def convert(self, value, param, ctx):
        if not slices.valid_name(value):
            self.fail(f"{value!r} is not a valid container name (letters, digits, '-', '_', '.'; not starting "
                      "with '.' or '-'; under 64 characters)", param, ctx)
        return value


class Owner(click.ParamType):
    name = "UID[:GID]"

    def convert(self, value, param, ctx):
        import grp
        import pwd
        user, _, group = str(value).partition(":")
        try:
            uid = int(user) if user.isdigit() else pwd.getpwnam(user).pw_uid
            gid = (int(group) if group.isdigit() else grp.getgrnam(group).gr_gid) if group else \
                (pwd.getpwuid(uid).pw_gid if not user.isdigit() else uid)
        except KeyError:
            self.fail(f"{value!r}: no such user or group", param, ctx)
        return uid, gid


class Duration(click.ParamType):
    """Seconds: `30s`, `500ms`, `2m`, `1h`, or a plain number of seconds."""
    name = "DURATION"
    _UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)):
            return float(value)
        text = str(value).strip()
        unit = next((u for u in ("ms", "s", "m", "h") if text.endswith(u)), "")
        try:
            seconds = float(text[:len(text) - len(unit)]) * self._UNITS.get(unit, 1.0)
        except ValueError:
            self.fail(f"{value!r} is not a duration (e.g. 30s, 500ms, 2m)", param, ctx)
        if not seconds > 0 or seconds != seconds or seconds == float("inf"):
            self.fail(f"{value!r} must be a positive duration", param, ctx)
        return seconds


MEMORY, CAP, SHARE, NAME, DURATION = Memory(), Memory(cap=True), Share(), Name(), Duration()


def dir_option(f):
    return click.option("--dir", "directory", envvar="VGPU_DIR", default=slices.DEFAULT_DIR, show_default=True,
                        type=click.Path(file_okay=False),
                        help="Node directory holding the slices [env: VGPU_DIR].")(f)


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(f)


def quota_options(f):
    for opt in reversed([
        click.option("--memory", type=CAP, help="memory.max: bytes, Ki/Mi/Gi/Ti, K/M/G/T (decimal), or max."),
        click.option("--sm", type=SHARE, help="sm.max: share of SM time, 1..100 (50% or 50)."),
        click.option("--request", type=MEMORY, help="Guaranteed memory (autoscale floor) [default: the cap]."),
        click.option("--limit", type=MEMORY, help="Memory ceiling for autoscale [default: the cap]."),
        click.option("--sm-request", type=SHARE, help="Guaranteed SM share [default: the share]."),
        click.option("--sm-limit", type=SHARE, help="SM ceiling for autoscale [default: the share]."),
        click.option("--sm-mode", type=click.Choice(slices.SM_MODES),
                     help="burst: guaranteed --sm-request, idle GPU time lent up to --sm; ceiling: --sm always "
                          "[create default: burst; resize: unchanged]."),
        click.option("--overcommit", is_flag=True,
                     help="Allow guaranteed memory on a device above its physical memory."),
    ]):
        f = opt(f)
    return f


def _arrow():
    enc = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "→".encode(enc)
        return "→"
    except (UnicodeEncodeError, LookupError):
        return "->"


def _emit_json(data):
    click.echo(json.dumps(data, indent=2))


def _warn(text):
    click.echo(f"warning: {text}", err=True)


# === the node directory ===

def _existing_node_dir(directory) -> str:
    """The node directory of a command that reads it: it must exist, so that a typo in
    --dir is an error rather than an empty node."""
    path = slices.node_dir(directory)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise click.ClickException(f"{path} is not a directory; hint: point --dir / VGPU_DIR at the node "
                                   "directory")
    raise click.ClickException(f"node directory {path} does not exist; hint: check --dir / VGPU_DIR "
                               "(`vgpu-ctl create` makes it with the node's first slice)")


def _node_dir_for_create(directory, parents=False) -> str:
    """create, run and apply make the node directory itself, but its parent only with
    --parents: a typo in --dir should not grow a tree of directories."""
    path = slices.node_dir(directory)
    parent = os.path.dirname(path)
    if not os.path.isdir(path) and not os.path.isdir(parent):
        if not parents:
            raise click.ClickException(f"node directory {path} does not exist, nor does its parent {parent}; "
                                       "hint: check --dir / VGPU_DIR, or pass --parents to create the path")
        os.makedirs(parent, 0o755, exist_ok=True)
    return path


def _warn_sm_ceilings(directory, devices):
    """Guaranteed SM shares (burst: sm.request; ceiling: sm.max) summed over 100% on a
    device cannot all be given at once: say so."""
    for d, shares in sorted(status_mod.sm_shares(directory).items()):
        total = sum(shares.values())
        if d in devices and total > 10000:
            each = ", ".join(f"{n} {format_share(v)}" for n, v in sorted(shares.items()))
            _warn(f"SM shares on device {d} add up to {format_share(total)} ({each}): more than the device, so "
                  "they cannot all be guaranteed; when every slice wants its share at once, each gets less")


# === capacity (for overcommit checks) ===

def check_sim_state():
    """A program pointed at simgpu whose state directory cannot be made gets no NVML;
    say why, rather than "NVML unavailable ... pass --overcommit"."""
    state = os.environ.get("SIMGPU_STATE_DIR")
    lib_dirs = os.environ.get("LD_LIBRARY_PATH", "").split(":")
    if not state or str(simgpu.SIMGPU_DIR) not in lib_dirs:
        return
    try:
        simgpu.check_state_dir(state)
    except ValueError as e:
        raise click.ClickException(f"SIMGPU_STATE_DIR: {e}") from None


def nvml_capacity(d):
    """Bytes of device d; None if the node has no device d."""
    check_sim_state()
    try:
        if d >= nvml.device_count():
            return None
        return nvml.memory_total(d)
    except nvml.NvmlUnavailable as e:
        raise slices.CapacityUnknown(f"cannot check device {d}'s capacity: NVML unavailable ({e})",
                                     "pass --overcommit to skip the check") from None


def nvml_count_hint():
    try:
        return f" (this node has {nvml.device_count()})"
    except nvml.NvmlUnavailable:
        return ""


def sim_capacity(profile, devices):
    def capacity(d):
        return simgpu.PROFILES[profile].memory_gib << 30 if d < devices else None
    return capacity


# === commands ===

def _version_text() -> str:
    from ._region import lib
    # the ABI is the quota and usage files' layout: a shim and a controller work together
    # only when theirs agree
    return f"vgpu-ctl {__version__}, shim ABI {lib.VGPU_ABI_VERSION}"


@click.group(cls=CtlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", message=_version_text())
def main():
    """Fractional GPUs for containers: memory caps, SM share and live resize.

    \b
    Example:
      vgpu-ctl create train --memory 8Gi --sm 50%
      docker run $(vgpu-ctl env train --format docker) my-image python train.py
      vgpu-ctl status
      vgpu-ctl resize train --memory 12Gi
    """


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
    from . import mig
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
        _emit_json(table)
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


def _devices_arg(device, memory, sm, request, limit, sm_request, sm_limit):
    q = slices.device_quota(UNLIMITED if memory is None else memory, 10000 if sm is None else sm,
                            request, limit, sm_request, sm_limit)
    return {d: q for d in (device or (0,))}


def _describe_device(q: dict) -> str:
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
    device has memory.max 0, so the container is denied the devices it was not given.
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
    _node_dir_for_create(directory, parents)
    if mig_profile is not None or placement is not None:
        return _create_mig(name, mig_profile, placement, device, memory, sm, request, limit, sm_request, sm_limit,
                           sm_mode, overcommit, owner, directory, as_json)
    _refuse_mig_mode(device or (0,))
    quota = slices.create(directory, name, _devices_arg(device, memory, sm, request, limit, sm_request, sm_limit),
                          overcommit=overcommit, capacity=nvml_capacity, owner=owner, count_hint=nvml_count_hint,
                          sm_mode=sm_mode)
    if sm is not None or sm_request is not None:   # without --sm a slice has no SM cap: nothing to warn about by itself
        _warn_sm_ceilings(directory, quota.held())
    files = slices.paths(directory, name)
    if as_json:
        _emit_json({**quota.to_json(), "quota": files["quota"], "usage": files["usage"]})
        return
    click.echo(f"created {name}")
    for dq in quota.to_json()["devices"]:
        click.echo(f"  device {dq['index']}: {_describe_device(dq)}")
    click.echo(f"  quota {files['quota']}\n  usage {files['usage']}")


def _refuse_mig_mode(devices):
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
    from . import mig
    if profile is None:
        raise click.UsageError("--placement needs --mig PROFILE")
    if len(device) > 1:
        raise click.UsageError(f"a MIG slice is one instance on one GPU: pass one --device, not {len(device)}")
    check_sim_state()
    index = device[0] if device else 0
    quota = _devices_arg((0,), memory, sm, request, limit, sm_request, sm_limit)[0]
    made = mig.create_slice(directory, name, index, profile, quota, placement=placement, overcommit=overcommit,
                            owner=owner, sm_mode=sm_mode, software_on=lambda d: _software_slices_on(directory, d))
    record, files = made["mig"], slices.paths(directory, name)
    if as_json:
        _emit_json({**made["quota"].to_json(), "mig": record, "quota": files["quota"], "usage": files["usage"]})
        return
    click.echo(f"created {name}")
    if record["enabled_mig_mode"]:
        click.echo(f"  device {index}: MIG mode turned on")
    click.echo(f"  device {index}: {_describe_mig(record)}")
    click.echo(f"  in the instance: {_describe_device(made['quota'].to_json()['devices'][0])}")
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
    result = slices.delete(directory, name, force=force)
    if result["live_processes"]:
        _warn(f"{name} still had {len(result['live_processes'])} live process(es); they keep their last limits")
    if as_json:
        _emit_json(result)
    else:
        click.echo(f"deleted {name}")


def _delete_mig(name, force, disable_mig, directory, as_json):
    from . import mig
    check_sim_state()
    result = mig.delete_slice(directory, name, force=force, disable_mig=disable_mig)
    if result["live_processes"]:
        _warn(f"{name} still had {len(result['live_processes'])} live process(es); they keep their last limits")
    for w in result["warnings"]:
        _warn(w)
    if as_json:
        _emit_json(result)
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

    \b
    Example:
      vgpu-ctl list --json
    """
    _existing_node_dir(directory)
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
        _emit_json(out)
        return
    if not out:
        click.echo(f"no containers in {slices.node_dir(directory)}")
        return
    rows = []
    migs = any("mig" in c for c in out)   # a MIG column only where there are MIG slices
    for c in out:
        if c["problem"]:     # (the error in the last column: a cell past the headers would not show)
            rows.append([c["name"], "-", *(["-"] if migs else []), "-", "-", "-", "-", "-",
                         f"error: {c['problem']}"])
            continue
        for d in c["devices"]:
            m = [("max" if v is None else format_memory(v)) for v in
                 (d["memory_max"], d["memory_request"], d["memory_limit"])]
            rec = c.get("mig")
            where = [rec["device"], f"{rec['profile']} at {rec['placement']['start']}:{rec['placement']['size']}"] \
                if rec else [d["index"], *(["-"] if migs else [])]
            rows.append([c["name"], *where, *m, format_share(d["sm_max"]), c["processes"], c["generation"]])
    click.echo(status_mod.table(["NAME", "DEVICE", *(["MIG"] if migs else []), "MEMORY", "REQUEST", "LIMIT", "SM",
                                 "PROCESSES", "GEN"], rows))


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
    capacity = nvml_capacity
    if slices.has_mig(directory, name):   # a software slice inside a MIG instance: the instance is its device
        device, overcommit = _mig_resize_check(directory, name, device, memory, sm, request, limit, sm_request,
                                               sm_limit, overcommit)
    result = slices.resize(directory, name, devices=device or None, memory=memory, sm=sm, request=request,
                           limit=limit, sm_request=sm_request, sm_limit=sm_limit, overcommit=overcommit,
                           capacity=capacity, sm_mode=sm_mode)
    for w in result["warnings"]:
        _warn(w)
    if sm is not None or sm_request is not None or sm_mode is not None:
        _warn_sm_ceilings(directory, [dev["index"] for dev in result["devices"]])
    if as_json:
        _emit_json(result)
        return
    arrow = _arrow()
    for dev in result["devices"]:
        click.echo(f"{name} device {dev['index']}: " + (_changes(dev["old"], dev["new"], arrow) or "unchanged"))
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


def _changes(old, new, arrow) -> str:
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
    """Who uses what: per container and per device, like `kubectl get -o wide`.

    Per container and device: GPU-MEMORY used/cap, GPU-UTIL (SM time used/cap over the
    last window), time throttled, allocations refused (OOM), processes; then each
    process (pid in the container, host pid, command); then each device: memory and SM
    allocated against capacity, and what NVML says is really used.  Without NVML the
    slice files still tell most of it (a note says what is missing).  THROTTLED is the
    time launches waited for their share: in total, or with --watch per second of the
    last interval.  With --json and --watch, one JSON object per line.  Memory in bytes
    (null: no cap); SM shares in 1/100 percent, as in the quota.  SM-ALLOCATED says
    "(ceilings)" where the shares on a device add up to more than 100%.

    \b
    Example:
      vgpu-ctl status
      vgpu-ctl status train --watch
    """
    if interval < 0.05:
        raise click.BadParameter(f"{interval:g}s is too short (at least 50ms)", param_hint="'--interval'")
    _existing_node_dir(directory)
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
        if as_json:
            click.echo(json.dumps(status_mod.public(data), indent=None if watch else 2))
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
    _existing_node_dir(directory)
    for name in names:   # unknown names are errors, not silently nothing to reap
        slices.read_quota(directory, name)
    reaped = slices.reap(directory, list(names) or None)
    if as_json:
        _emit_json(reaped)
        return
    if not reaped:
        click.echo("nothing to reap")
    for r in reaped:
        if "error" in r:
            click.echo(f"{r['container']}: not reaped: {r['error']}", err=True)
            continue
        mem = ", ".join(f"{format_memory(b)} on device {d}" for d, b in r["memory"].items()) or "no memory"
        click.echo(f"{r['container']}: slot {r['slot']} pid {r['pid']} ({r['comm']}) gone; returned {mem}")


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
        _emit_json({"variables": runtime.variables(name, slices.node_dir(directory), shim, visible),
                    "docker": runtime.docker(name, files, shim, preload, visible, cost),
                    "k8s": runtime.k8s(name, files, shim, preload, visible, cost)})


@main.command("measure-context")
@dir_option
@json_option
def measure_context(directory, as_json):
    """Measure the device memory a CUDA context costs on each GPU, for containers.

    The shim charges a context's memory on a process's first allocation.  In a
    container's own pid namespace it cannot find it (NVML names host pids); with this
    measurement kept in the node directory, `env --format docker|k8s` and the DRA
    driver's CDI specs set VGPU_CONTEXT_OVERHEAD from it.  Run it as root on each node,
    with no other work starting on it, and again after a driver upgrade.

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
        _emit_json({str(i): v for i, v in results.items()})
        return
    for i, v in results.items():
        click.echo(f"device {i}: " + (f"a context costs {format_memory(v)}" if isinstance(v, int) else
                                      f"not measured ({v})"))
    click.echo(f"kept in {overhead.path(directory)}")


def _installed_shim(shim_dir, ld_so_preload, fmt):
    """(host path of the shim, host path of the ld.so.preload file or None) for `env`."""
    from . import install
    if ld_so_preload and not shim_dir:
        raise click.UsageError("--ld-so-preload needs --shim-dir (a directory made by `install-shim DIR "
                               "--preload-file`)")
    if ld_so_preload and fmt == "shell":
        raise click.UsageError("--ld-so-preload is for containers (docker, k8s, json): this host's "
                               "/etc/ld.so.preload would put every process of the host under the shim")
    if not shim_dir:
        return _shim(), None
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
@click.option("--memory", type=CAP, help="memory.max of the slice [default: no cap].")
@click.option("--sm", type=SHARE, help="sm.max of the slice [default: 100%].")
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

    Without --name a temporary slice is made and deleted afterwards.  --name runs in a
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
    capacity = nvml_capacity
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
    shim = _shim()
    temporary = name is None
    name = name or slices.auto_name()
    exists = not temporary and name in slices.list_names(directory)
    if not temporary and not exists and not create_slice:
        raise click.ClickException(
            f"container {name} not found in {slices.node_dir(directory)}; hint: `vgpu-ctl list` shows the "
            f"containers; pass --create to make it (kept afterwards), or leave --name out for a temporary slice")
    if exists and (memory is not None or sm is not None or device):
        _same_quota_or_fail(directory, name, memory, sm, device)
    if not exists:
        _node_dir_for_create(directory)
        if not sim:   # (with --sim, the node is the child's, not this process's NVML)
            _refuse_mig_mode(device or (0,))
        slices.create(directory, name, _devices_arg(device, memory, sm, None, None, None, None),
                      overcommit=overcommit, capacity=capacity,
                      count_hint=(lambda: f" on the simulated node ({ndev})") if sim else nvml_count_hint,
                      temporary=_run_owner() if temporary else None)
    try:
        record = None if temporary else slices.read_mig(directory, name)   # a MIG slice: its MIG device alone
        env = runtime.child_environment(base, name, slices.node_dir(directory), shim,
                                        record["uuid"] if record else None)
        try:
            rc = runtime.run_child(list(command), env)
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
        if temporary:
            try:
                slices.delete(directory, name, force=True)
            except slices.VgpuError as e:   # the child's exit status matters more
                _warn(f"could not delete the temporary slice: {_line(e)}")
    ctx.exit(rc)


def _run_owner():
    """This process, as the owner of a temporary slice: if it dies without deleting it
    (kill -9), the node agent does once the slice's processes are gone."""
    from . import procfs
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
        now = "; ".join(f"device {d}: {_describe_device(quota.devices[d].to_json())}" for d in held)
        raise UsageFailure(f"container {name} exists with another quota ({now}); hint: change it with "
                           f"`vgpu-ctl resize {name}`, or run without --memory/--sm/--device")


# === declarative slices ===

_SIGN = {"create": "+", "resize": "~", "replace": "±", "delete": "-", "unchanged": "=", "kept": " "}


@main.command("apply")
@click.option("-f", "--file", "path", required=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="The slices file ('-': standard input).")
@click.option("--prune", is_flag=True, help="Also delete the node's slices the file does not name.")
@click.option("--dry-run", is_flag=True, help="Show what would change, and change nothing.")
@click.option("--overcommit", is_flag=True, help="Allow guaranteed memory on a device above its physical memory.")
@click.option("--parents", is_flag=True, help="Also create the node directory's missing parents.")
@dir_option
@json_option
def apply_cmd(path, prune, dry_run, overcommit, parents, directory, as_json):
    """Make the node's slices what a file says: create, resize (live), --prune delete.

    The whole file is checked first -- names, fields, values, request <= memory <=
    limit, the devices' capacity -- and an error names its line and field and changes
    nothing.  Then slices are deleted, shrunk, grown and created in that order (so the
    node is never overcommitted on the way), through the same code as create, resize
    and delete.  Applying the same file again changes nothing.  A slice whose devices
    change is deleted and created again (refused while its processes run); `user`
    applies when a slice is created.  The file's format: `vgpu-ctl export` writes one.

    \b
    Example:
      vgpu-ctl export > slices.yaml
      vgpu-ctl apply -f slices.yaml --dry-run
      vgpu-ctl apply -f /etc/vgpu/slices.yaml --prune
    """
    from . import manifest
    if path == "-":
        wanted = manifest.read("<stdin>", sys.stdin.read())
    else:
        wanted = manifest.read(path)
    check_sim_state()
    changes = manifest.plan(directory, wanted, prune=prune, capacity=nvml_capacity, overcommit=overcommit)
    todo = [c for c in changes if c.action not in ("unchanged", "kept")]
    if not dry_run and todo:
        if any(c.action in ("create", "replace") for c in todo):
            _node_dir_for_create(directory, parents)
        for w in manifest.apply(directory, changes, capacity=nvml_capacity, overcommit=overcommit):
            _warn(w)
        if any(c.action != "delete" and any(d not in c.old or c.new[d].sm_max != c.old[d].sm_max for d in c.new)
               for c in todo):
            _warn_sm_ceilings(directory, sorted({d for c in todo for d in c.new}))
    if as_json:
        _emit_json({"dry_run": dry_run, "applied": bool(todo) and not dry_run,
                    "changes": [c.to_json() for c in changes]})
        return
    width = max((len(c.name) for c in changes), default=0)
    arrow = _arrow()
    for c in changes:
        head = f"{_SIGN[c.action]} {c.action:<9} {c.name:<{width}}"
        if c.action in ("create", "replace"):
            details = [f"device {d}: {manifest.describe(c.new[d])}" for d in sorted(c.new)]
        elif c.action == "resize":
            details = [f"device {d}: {_changes(c.old[d].to_json(), c.new[d].to_json(), arrow)}"
                       for d in sorted(c.new) if c.new[d] != c.old[d]]
            if c.sm_mode[0] != c.sm_mode[1]:
                details.append(f"sm mode: {c.sm_mode[0]} {arrow} {c.sm_mode[1]}")
        else:
            details = []
        notes = [f"({c.note})"] if c.note else []
        lines = details + notes or [""]
        click.echo(f"{head}  {lines[0]}".rstrip())
        for more in lines[1:]:
            click.echo(f"{'':{len(head)}}  {more}")
    counts = {a: sum(1 for c in changes if c.action == a) for a in _SIGN}
    counts["create"] += counts.pop("replace")
    if dry_run:
        words = [f"{counts['create']} to create", f"{counts['resize']} to resize", f"{counts['delete']} to delete",
                 f"{counts['unchanged']} unchanged"]
        click.echo(f"dry run: {', '.join(words)}; nothing changed")
    else:
        words = [f"{counts['create']} created", f"{counts['resize']} resized", f"{counts['delete']} deleted",
                 f"{counts['unchanged']} unchanged"]
        click.echo(f"{'applied' if todo else 'nothing to change'}: {', '.join(words)}")


@main.command("export")
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Write the file here (atomically: complete or not at all) instead of to standard output.")
@dir_option
def export_cmd(output, directory):
    """Write the node's slices as a slices file, for `vgpu-ctl apply -f`.

    Each slice with its devices and quotas, leaving out what is the default (request and
    limit equal to the cap, no cap, 100%).  A slice that cannot be read is a comment in
    the file and a warning.

    \b
    Example:
      vgpu-ctl export -o /etc/vgpu/slices.yaml
      vgpu-ctl export | ssh other-node vgpu-ctl apply -f - --dry-run
    """
    from . import manifest
    _existing_node_dir(directory)
    text, problems = manifest.export(directory)
    for name, problem in problems:
        _warn(f"{name} left out: {problem}")
    if output is None:
        click.echo(text, nl=False)
        return
    target = os.path.abspath(output)
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
    from . import install
    try:
        result = install.install_shim(dest, preload_file=preload_file)
    except install.InstallError as e:
        raise click.ClickException(_line(e)) from None
    if as_json:
        _emit_json(result)
        return
    for f in result["files"]:
        what = "installed" if f["changed"] else "unchanged"
        click.echo(f"{what} {f['path']} ({f['bytes']} bytes, sha256 {f['sha256'][:12]})")
    click.echo(f"hint: mount {result['files'][0]['path']} read-only at {runtime.CONTAINER_SHIM}: "
               f"vgpu-ctl env NAME --shim-dir {result['dest']} --format docker|k8s")


# === autoscale and metrics ===

class Ratio(click.ParamType):
    """A fraction: `90%` or `0.9`."""
    name = "PERCENT"

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            return value
        text = str(value).strip()
        try:
            v = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            self.fail(f"{value!r} is not a percentage (e.g. 90% or 0.9)", param, ctx)
        if not 0 < v <= 1:
            self.fail(f"{value!r} is outside (0, 100%]", param, ctx)
        return v


RATIO = Ratio()


def _until_signalled(stop):
    import signal
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(3600):
            pass
    except KeyboardInterrupt:
        pass


def autoscale_policy_options(f):
    """The autoscaler's policy options (`autoscale`, and `agent --autoscale`)."""
    for opt in reversed([
        click.option("--window", type=DURATION, default="30s", show_default=True,
                     help="How long use must stay above the high mark (grow) or below the low mark (shrink)."),
        click.option("--cooldown", type=DURATION,
                     help="After a change, no further change for this long [default: the window]."),
        click.option("--high", type=RATIO, default="90%", show_default=True, help="Grow mark: use / quota."),
        click.option("--low", type=RATIO, default="50%", show_default=True, help="Shrink mark: use / quota."),
        click.option("--target", type=RATIO, default="70%", show_default=True,
                     help="Where a change puts use / quota (between the marks: hysteresis)."),
        click.option("--grow-step", type=RATIO, default="25%", show_default=True,
                     help="A grow adds at least this share of the quota (memory at least 256Mi, SM 5 points)."),
        click.option("--shrink-step", type=RATIO, default="25%", show_default=True,
                     help="A shrink takes at most this share of the quota."),
        click.option("--device-memory", type=MEMORY,
                     help="Each device's memory, where NVML cannot say [default: NVML's]; without either, memory "
                          "only shrinks."),
        click.option("--dry-run", is_flag=True, help="Log the decisions without applying them."),
    ]):
        f = opt(f)
    return f


def _autoscale_policy(window, interval, cooldown, high, low, target, grow_step, shrink_step):
    from .policy import Policy
    if interval > window:
        raise UsageFailure(f"--interval {interval:g}s is longer than --window {window:g}s; hint: sample at least "
                           "once per window")
    if shrink_step >= 1:
        raise click.BadParameter(f"{shrink_step * 100:g}% would let one shrink take a whole quota: a shrink takes at "
                                 "most this share of it, so it must be below 100% (e.g. 25%)",
                                 param_hint="'--shrink-step'")
    if not low < target < high:
        raise click.UsageError(f"--low {low * 100:g}% < --target {target * 100:g}% < --high {high * 100:g}% "
                               "does not hold: a "
                               "change lands use at the target, between the marks, so it is not undone at once")
    try:
        return Policy(window=window, cooldown=cooldown, high=high, low=low, target=target, grow_step=grow_step,
                      shrink_step=shrink_step)
    except ValueError as e:
        raise UsageFailure(f"{e}; hint: see vgpu-ctl autoscale --help") from None


@main.command()
@autoscale_policy_options
@click.option("--interval", type=DURATION, default="1s", show_default=True, help="Time between samples.")
@click.option("--once", is_flag=True, help="Watch one window, apply what it decides, exit.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="Also serve Prometheus metrics on this port.")
@click.option("--metrics-address", default="0.0.0.0", show_default=True, help="Address for --metrics-port.")
@dir_option
def autoscale(window, interval, cooldown, high, low, target, grow_step, shrink_step, device_memory, dry_run, once,
              metrics_port, metrics_address, directory):
    """Move each slice's memory.max and sm.max between its request and its limit.

    Every --interval the loop reads each slice's usage file; a slice whose use stays
    above --high of its quota for a whole --window grows (memory: at once after an
    allocation refused by the cap), one below --low for a whole window shrinks, never
    above its limit, below its request, or (memory) below its use plus a margin, and
    never beyond the device (memory: its physical memory; SM: 100% summed).  When
    several want more than is left, it is shared by request.  Decisions go through the
    same code path as `vgpu-ctl resize`; each is one JSON line on stdout with its reason.
    Slices whose request equals their limit are left alone.

    \b
    Example:
      vgpu-ctl create infer --memory 4Gi --request 2Gi --limit 12Gi --sm 20% --sm-limit 60%
      vgpu-ctl autoscale --metrics-port 9400
      vgpu-ctl autoscale --window 1s --interval 200ms --dry-run --once
    """
    from . import autoscale as autoscale_mod
    policy = _autoscale_policy(window, interval, cooldown, high, low, target, grow_step, shrink_step)
    scaler = autoscale_mod.Autoscaler(directory, policy, interval=interval, dry_run=dry_run,
                                      device_memory=device_memory)
    if metrics_port is not None:
        httpd = _listen(directory, metrics_port, metrics_address, "--metrics-port", "--metrics-address",
                        autoscaler=scaler)
        click.echo(f"serving metrics on http://{metrics_address}:{httpd.server_port}/metrics", err=True)
    import signal
    import threading
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        scaler.run(once=once, stop=stop)
    except KeyboardInterrupt:
        pass


def _listen(directory, port, address, port_flag, address_flag, autoscaler=None, agent=None):
    """The metrics server, or one line saying which flag to change."""
    import socket
    from . import metrics
    try:
        if agent is not None:
            return metrics.start(directory, port, address, autoscaler=autoscaler, agent=agent)
        return metrics.start(directory, port, address, autoscaler=autoscaler)
    except socket.gaierror as e:
        raise click.ClickException(f"cannot listen on {address}:{port}: {address!r} is not an address of this host "
                                   f"({e.strerror}); hint: {address_flag} takes an IP address, e.g. 0.0.0.0 (all) "
                                   "or 127.0.0.1 (this host only)") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            hint = f"something else listens there: pick another {port_flag} (0: any free one)"
        elif e.errno in (errno.EACCES, errno.EPERM):
            hint = f"ports below 1024 need root: pick a {port_flag} above 1023"
        elif e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            hint = f"{address} is not an address of this host: pass {address_flag} 0.0.0.0 (all) or 127.0.0.1"
        else:
            hint = f"check {address_flag} and {port_flag}"
        raise click.ClickException(f"cannot listen on {address}:{port}: {e.strerror or e}; hint: {hint}") from None


class OnViolation(click.ParamType):
    """`kill`, `gap=kill`, `compute=stop`: checked against the kinds and their actions."""
    name = "[KIND=]ACTION"

    def convert(self, value, param, ctx):
        from .agent import settings as agent_settings
        try:
            agent_settings.parse_actions([value])
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return value


@main.command()
@click.option("--interval", type=DURATION, default="1s", show_default=True,
              help="Time between looks at the driver and the slices (dead slots are reaped at once when the agent "
                   "sees their process end, else within this).")
@click.option("--grace", type=DURATION, default="500ms", show_default=True,
              help="How long a memory or unsliced condition must last to be a violation.")
@click.option("--compute-window", type=DURATION, default="10s", show_default=True,
              help="A slice's NVML share must pass its sm.max by 10 points, unpaced, on average over this long.")
@click.option("--tolerance", type=MEMORY, default="64Mi", show_default=True,
              help="Memory the driver may hold beyond the shim's figure (and the cap) ...")
@click.option("--tolerance-ratio", type=RATIO, default="2%", show_default=True,
              help="... or this share of the cap, whichever is larger.")
@click.option("--process-overhead", type=MEMORY, default="0", show_default=True,
              help="Per process, added to the tolerance: device memory a context holds that the shim does not "
                   "charge (the shim charges it when it can measure it).")
@click.option("--context-allowance", type=MEMORY, default="512Mi", show_default=True,
              help="A process that has a context on a device and has charged nothing there yet (the shim "
                   "charges the context with its first allocation) may hold this much: not a gap.")
@click.option("--require-slices", is_flag=True,
              help="A GPU process in no slice is a violation (node configured to run GPU work in slices only).")
@click.option("--on-violation", "on_violation", type=OnViolation(), multiple=True,
              help="What to do: report (default), kill (SIGKILL the offending processes: only those of the "
                   "slice, or the unsliced one) or stop (compute: hold them to the share with SIGSTOP/SIGCONT); "
                   "for every kind, or per kind: over-cap=, gap=, forged=, unsliced=, compute=.  Repeatable.")
@click.option("--autoscale", "with_autoscale", is_flag=True,
              help="Also run the autoscaler (its options below), on the same reading of the slices.")
@autoscale_policy_options
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="Also serve Prometheus metrics on this port.")
@click.option("--metrics-address", default="0.0.0.0", show_default=True, help="Address for --metrics-port.")
@click.option("--kubernetes-events", is_flag=True,
              help="Post a Kubernetes Event on the pod of a DRA slice for each violation and action (needs the "
                   "k8s extra, API access and --node-name).")
@click.option("--node-name", envvar="NODE_NAME", help="This node's name, the Events' source [env: NODE_NAME].")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), envvar="KUBECONFIG",
              help="Kubeconfig for --kubernetes-events [default: the pod's service account].")
@click.option("--once", is_flag=True, help="Look once (attribute, reap, log what is wrong now), exit.")
@click.option("--no-reap", is_flag=True, hidden=True, help="Leave dead slots alone (benchmarks, tests).")
@dir_option
def agent(interval, grace, compute_window, tolerance, tolerance_ratio, process_overhead, context_allowance,
          require_slices,
          on_violation, with_autoscale, window, cooldown, high, low, target, grow_step, shrink_step, device_memory,
          dry_run, metrics_port, metrics_address, kubernetes_events, node_name, kubeconfig, once, no_reap, directory):
    """The node agent: check every slice against the driver, and see everything on the GPU.

    Every --interval it attributes each process NVML lists on each GPU to a slice (the
    usage file it maps, the identity file its container was given, its pod, cgroup or
    pid namespace) or marks it unsliced; compares each slice's driver-measured memory
    with its memory.current and cap; reaps dead slots; removes the temporary slices of
    `vgpu-ctl run`s that died; and logs one JSON line per violation: over-cap (the
    driver says it holds more than its cap), gap (the driver says more than the shim),
    forged (a slot charging more than any device holds, or a row summing past 2^64: the
    usage file written by hand), unsliced (with --require-slices), compute (NVML's share
    above sm.max by 10 points, unpaced, over --compute-window).  By --on-violation it acts, only on processes it
    attributed with certainty, and logs every action.  `vgpu-ctl status` shows what it
    judged.

    \b
    Example:
      vgpu-ctl agent --metrics-port 9400
      vgpu-ctl agent --autoscale --metrics-port 9400 --on-violation gap=kill
      vgpu-ctl agent --require-slices --on-violation unsliced=kill --on-violation compute=stop
    """
    import signal
    import threading
    from .agent import Agent, Settings, parse_actions
    settings = Settings(tolerance=tolerance, tolerance_ratio=tolerance_ratio, process_overhead=process_overhead,
                             context_allowance=context_allowance, grace=grace, window=compute_window,
                             require_slices=require_slices, actions=parse_actions(on_violation))
    scaler = None
    if with_autoscale:
        from . import autoscale as autoscale_mod
        policy = _autoscale_policy(window, interval, cooldown, high, low, target, grow_step, shrink_step)
        scaler = autoscale_mod.Autoscaler(directory, policy, interval=interval, dry_run=dry_run,
                                          device_memory=device_memory)
    sink = None
    if kubernetes_events:
        if not node_name:
            raise click.UsageError("--kubernetes-events needs --node-name (or NODE_NAME): the Events' source")
        from .k8s import agent as k8s_agent
        try:
            k8s_agent._require_extras()
            from .k8s import events
            sink = events.EventSink(slices.node_dir(directory), node_name, api=k8s_agent.api_client(kubeconfig),
                                    log=lambda e: click.echo(json.dumps(e), err=True))
        except slices.VgpuError as e:
            raise click.ClickException(_line(e)) from None
    the_agent = Agent(directory, settings, interval=interval, autoscaler=scaler, reap=not no_reap,
                           on_violation=sink.violation if sink else None, on_action=sink.action if sink else None)
    if metrics_port is not None:
        httpd = _listen(directory, metrics_port, metrics_address, "--metrics-port", "--metrics-address",
                        autoscaler=scaler, agent=the_agent)
        click.echo(f"serving metrics on http://{metrics_address}:{httpd.server_port}/metrics", err=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        the_agent.run(stop=stop, once=once)
    except KeyboardInterrupt:
        pass


@main.command()
@click.option("--port", type=click.IntRange(0, 65535), default=9400, show_default=True,
              help="TCP port (0: any free one; the line on stderr says which).")
@click.option("--address", default="0.0.0.0", show_default=True, help="Address to listen on.")
@dir_option
def serve(port, address, directory):
    """Serve Prometheus metrics for the node's slices at /metrics.

    Per container and device: memory used/quota/request/limit (bytes), SM share
    used/quota (ratio), throttled and GPU seconds, launches, OOM refusals; per container:
    resize events and processes; per device: capacity and NVML's usage.  Read on each
    scrape, nothing in between.

    \b
    Example:
      vgpu-ctl serve --port 9400
      curl -s localhost:9400/metrics | grep vgpu_memory_used_bytes
    """
    import threading
    httpd = _listen(directory, port, address, "--port", "--address")
    click.echo(f"serving metrics on http://{address}:{httpd.server_port}/metrics", err=True)
    _until_signalled(threading.Event())
    httpd.shutdown()


@main.command("k8s-plugin")
@click.option("--node-name", envvar="NODE_NAME", required=True,
              help="This node's name: the ResourceSlice's nodeName and pool [env: NODE_NAME].")
@click.option("--driver-name", envvar="VGPU_DRIVER_NAME", default="vgpu.dev", show_default=True,
              help="The DRA driver name (DeviceClass selectors, CDI vendor) [env: VGPU_DRIVER_NAME].")
@click.option("--plugin-dir", type=click.Path(file_okay=False),
              help="Where dra.sock and the checkpoint live [default: /var/lib/kubelet/plugins/DRIVER].")
@click.option("--registry-dir", type=click.Path(file_okay=False), default="/var/lib/kubelet/plugins_registry",
              show_default=True, help="The kubelet's plugin registration directory (DRIVER-reg.sock).")
@click.option("--cdi-dir", type=click.Path(file_okay=False), default="/var/run/cdi", show_default=True,
              help="Where the container runtime reads CDI specs.")
@click.option("--cdi-version", type=click.Choice(cdi.CDI_VERSIONS), default=cdi.CDI_VERSION, show_default=True,
              help="cdiVersion of the specs written: a runtime whose CDI library is older than the version "
                   "refuses the spec (the content needs 0.5.0).")
@click.option("--shim-dir", type=click.Path(file_okay=False), envvar="VGPU_SHIM_DIR", required=True,
              help="Host directory made by `vgpu-ctl install-shim` [env: VGPU_SHIM_DIR].")
@click.option("--ld-so-preload", is_flag=True,
              help="Load the shim through the container's /etc/ld.so.preload instead of LD_PRELOAD.")
@click.option("--gpu-cdi-device", default="nvidia.com/gpu=all", show_default=True,
              help="A CDI device returned with every vgpu device, giving the container the GPU device nodes "
                   "and driver libraries (NVIDIA container toolkit's spec); '' for none.")
@click.option("--lend-memory", is_flag=True,
              help="Let autoscale grow a slice's memory into memory no claim holds (given back when a claim "
                   "is prepared, but only as its holder frees it).  SM share is always lent.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), envvar="KUBECONFIG",
              help="Kubeconfig to reach the API server [default: the pod's service account].")
@click.option("--rescan", type=DURATION, default="30s", show_default=True,
              help="How often to look for GPUs that appeared or vanished.")
@click.option("--claim-status-interval", default="5s", show_default=True,
              callback=lambda ctx, param, v: 0.0 if str(v).strip() in ("0", "0s") else DURATION.convert(v, param, ctx),
              help="How often each prepared claim's live figures may be written into its "
                   "status.devices (only when they changed); 0 for never.")
@dir_option
def k8s_plugin(node_name, driver_name, plugin_dir, registry_dir, cdi_dir, cdi_version, shim_dir, ld_so_preload,
               gpu_cdi_device, lend_memory, kubeconfig, rescan, claim_status_interval, directory):
    """Run the Kubernetes DRA driver for this node (a DaemonSet's container).

    Publishes this node's GPUs as one ResourceSlice (resource.k8s.io/v1, consumable
    `memory` and `sm` capacity), registers with the kubelet, and serves its DRA gRPC API:
    preparing a claim creates a slice with what the scheduler allocated and a CDI spec
    that mounts the shim and the slice's files into the pod; unpreparing removes both.

    \b
    Example (what deploy/dra/daemonset.yaml runs):
      vgpu-ctl k8s-plugin --node-name "$NODE_NAME" --shim-dir /opt/vgpu
    """
    import signal
    import threading
    from .k8s import agent
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    config = agent.Config(node_name=node_name, driver_name=driver_name,
                          plugin_dir=plugin_dir or agent.default_plugin_dir(driver_name),
                          registry_dir=registry_dir, cdi_dir=cdi_dir, cdi_version=cdi_version,
                          slice_dir=slices.node_dir(directory),
                          shim_dir=shim_dir, ld_so_preload=ld_so_preload,
                          gpu_cdi_devices=[gpu_cdi_device] if gpu_cdi_device else [],
                          lend_memory=lend_memory, kubeconfig=kubeconfig, rescan=rescan,
                          claim_status_interval=claim_status_interval)
    try:
        agent.run(config, stop, log=lambda line: click.echo(line, err=True))
    except agent.AgentError as e:
        raise click.ClickException(_line(e)) from None
    except KeyboardInterrupt:
        pass


@main.command("k8s-webhook")
@click.option("--tls-cert-file", type=click.Path(dir_okay=False), required=True,
              help="The server certificate (PEM, with its chain), e.g. from the webhook's Secret.")
@click.option("--tls-private-key-file", type=click.Path(dir_okay=False), required=True,
              help="Its private key (PEM).  Both files are read again when they change.")
@click.option("--port", type=click.IntRange(0, 65535), default=8443, show_default=True, help="HTTPS port.")
@click.option("--address", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--driver-name", envvar="VGPU_DRIVER_NAME", default="vgpu.dev", show_default=True,
              help="The DRA driver whose ResourceSlices give the GPUs' sizes [env: VGPU_DRIVER_NAME].")
@click.option("--device-class", default="vgpu.dev", show_default=True,
              help="The DeviceClass the claims ask (deploy/dra/deviceclass.yaml).")
@click.option("--memory-resource", default="vgpu.dev/gpu-memory", show_default=True,
              help="The extended resource name for GPU memory in bytes (any quantity: 4Gi).")
@click.option("--utilization-resource", default="vgpu.dev/gpu-utilization", show_default=True,
              help="The extended resource name for the SM share in percent (1-100).")
@click.option("--hami/--no-hami", default=True, show_default=True,
              help="Also map HAMi's nvidia.com/gpumem (MiB), nvidia.com/gpucores (%) and nvidia.com/gpu: 1.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), envvar="KUBECONFIG",
              help="Kubeconfig to reach the API server [default: the pod's service account].")
def k8s_webhook(tls_cert_file, tls_private_key_file, port, address, driver_name, device_class, memory_resource,
                utilization_resource, hami, kubeconfig):
    """Run the mutating admission webhook that turns GPU fractions in resources.limits into DRA claims.

    A container asking `vgpu.dev/gpu-memory: 4Gi` (and `vgpu.dev/gpu-utilization: "50"`)
    gets a ResourceClaimTemplate of the vgpu class with that capacity, the pod's
    resourceClaims and the container's resources.claims, and the extended resources
    removed.  What cannot work is refused with a message (docs/kubernetes.md).

    \b
    Example (what deploy/dra/webhook.yaml runs):
      vgpu-ctl k8s-webhook --tls-cert-file /tls/tls.crt --tls-private-key-file /tls/tls.key
    """
    import ssl
    import threading
    from .k8s import agent, webhook
    agent._require_extras()
    config = webhook.Config(driver_name=driver_name, device_class=device_class, memory_resource=memory_resource,
                            utilization_resource=utilization_resource, hami=hami)
    try:
        api = agent.api_client(kubeconfig)
    except agent.AgentError as e:
        raise click.ClickException(_line(e)) from None

    def log(event):
        click.echo(json.dumps({"time": round(time.time(), 3), **event}), err=True)
    try:
        httpd = webhook.serve(webhook.Admitter(config, api, log), tls_cert_file, tls_private_key_file, address, port)
    except (OSError, ssl.SSLError) as e:
        raise click.ClickException(f"cannot serve HTTPS on {address}:{port} with {tls_cert_file}: {e}; hint: check "
                                   "the certificate and key files (PEM) and that the port is free") from None
    log({"event": "serving", "address": address, "port": httpd.server_port, "resources": config.names()})
    _until_signalled(threading.Event())
    httpd.shutdown()
