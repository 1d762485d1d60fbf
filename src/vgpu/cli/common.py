"""What every command shares: errors as one line and a hint, the parameter types and
options, the node directory, capacity for overcommit checks, and the `vgpu-ctl` group."""
import errno
import json
import os
import sys

import click

from .. import __version__
from .. import nvml
from .. import sim as simgpu
from .. import slices
from .. import status as status_mod
from ..paths import shim_path
from ..quantities import SHARE_FULL, format_share, parse_memory, parse_share


# === errors ===

class UsageFailure(click.ClickException):
    """A usage error found after parsing (arguments that contradict the slice): exit 2."""
    exit_code = 2


def error_line(e) -> str:
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
            raise UsageFailure(error_line(e)) from None
        except slices.VgpuError as e:
            raise click.ClickException(error_line(e)) from None
        except PermissionError as e:
            raise click.ClickException(
                f"{e.filename or 'a vgpu file'}: permission denied; hint: run as root, or point --dir / "
                "VGPU_DIR at a directory you can write") from None


def _os_error(e: OSError) -> str:
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e}; hint: check the path and its permissions"


def package_shim():
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
            self.fail(error_line(e), param, ctx)
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
            self.fail(error_line(e), param, ctx)


class Name(click.ParamType):
    name = "NAME"

    def shell_complete(self, ctx, param, incomplete):
        """Tab completion offers the node's slices (--dir / VGPU_DIR as typed so far)."""
        from click.shell_completion import CompletionItem
        try:
            names = slices.list_names(ctx.params.get("directory") or ctx.find_root().params.get("directory"))
        except Exception:   # completion must never fail loudly
            return []
        return [CompletionItem(n) for n in names if n.startswith(incomplete)]

    def convert(self, value, param, ctx):
        if not slices.valid_name(value):
            self.fail(f"{value!r} is not a valid slice name (letters, digits, '-', '_', '.'; not starting "
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
# what --memory and --sm take, said once for every command that has them
MEMORY_HELP = ("Ki/Mi/Gi/Ti, K/M/G/T (decimal), max, or bytes: a number without a unit is bytes and must be at "
               "least 1Mi (4 is refused: 4Gi?).")
SHARE_HELP = "1..100 (50% or 50); below 1 only with % (0.5 is refused: 50%? or 0.5%)."


def _node_dir_option(**kw):
    return click.option("--dir", "directory", type=click.Path(file_okay=False), **kw)


def _group_dir(ctx, param, value):
    """A command's --dir, else the one given before the command (`vgpu-ctl --dir X list`),
    else VGPU_DIR, else /run/vgpu."""
    if value is not None:
        return value
    return ctx.find_root().params.get("directory") or os.environ.get("VGPU_DIR") or slices.DEFAULT_DIR


def dir_option(f):
    # (no envvar or default of its own for click to fill in: they would win over a --dir
    # given before the command)
    return _node_dir_option(callback=_group_dir,
                            help=f"Node directory holding the slices [env: VGPU_DIR; default: {slices.DEFAULT_DIR}; "
                                 "also before the command: vgpu-ctl --dir DIR COMMAND].")(f)


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(f)


def quota_options(f):
    for opt in reversed([
        click.option("--memory", type=CAP, help=f"memory.max: {MEMORY_HELP}"),
        click.option("--sm", type=SHARE, help=f"sm.max: share of SM time, {SHARE_HELP}"),
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


def change_arrow():
    enc = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "→".encode(enc)
        return "→"
    except (UnicodeEncodeError, LookupError):
        return "->"


def emit_json(data):
    click.echo(json.dumps(data, indent=2))


def print_warning(text):
    click.echo(f"warning: {text}", err=True)


# === the node directory ===

def existing_node_dir(directory) -> str:
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


def node_dir_for_create(directory, parents=False) -> str:
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


def warn_sm_ceilings(directory, devices):
    """Guaranteed SM shares (burst: sm.request; ceiling: sm.max) summed over 100% on a
    device cannot all be given at once: say so."""
    for d, shares in sorted(status_mod.sm_shares(directory).items()):
        total = sum(shares.values())
        if d in devices and total > SHARE_FULL:
            each = ", ".join(f"{n} {format_share(v)}" for n, v in sorted(shares.items()))
            print_warning(f"SM shares on device {d} add up to {format_share(total)} ({each}): more than the device, so "
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
    from .._region import lib
    # the ABI is the quota and usage files' layout: a shim and a controller work together
    # only when theirs agree
    return f"vgpu-ctl {__version__}, shim ABI {lib.VGPU_ABI_VERSION}"


@click.group(cls=CtlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", message=_version_text())
@_node_dir_option(help=f"Node directory holding the slices, for every command that takes --dir (a command's "
                       f"own --dir wins) [default: VGPU_DIR, else {slices.DEFAULT_DIR}].")
def main(directory):
    """Fractional GPUs for containers: memory caps, SM share and live resize.

    \b
    Example:
      vgpu-ctl create train --memory 8Gi --sm 50%
      docker run $(vgpu-ctl env train --format docker) my-image python train.py
      vgpu-ctl status
      vgpu-ctl resize train --memory 12Gi
    """
