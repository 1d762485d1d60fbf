"""Declarative slices: apply and export."""
import os
import sys

import click

from . import common
from .common import (change_arrow, check_sim_state, dir_option, emit_json, existing_node_dir, json_option, main,
                     node_dir_for_create, print_warning, warn_sm_ceilings)
from .slice_commands import describe_changes


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
    from .. import manifest
    if path == "-":
        wanted = manifest.read("<stdin>", sys.stdin.read())
    else:
        wanted = manifest.read(path)
    check_sim_state()
    changes = manifest.plan(directory, wanted, prune=prune, capacity=common.nvml_capacity, overcommit=overcommit)
    todo = [c for c in changes if c.action not in ("unchanged", "kept")]
    if not dry_run and todo:
        if any(c.action in ("create", "replace") for c in todo):
            node_dir_for_create(directory, parents)
        for w in manifest.apply(directory, changes, capacity=common.nvml_capacity, overcommit=overcommit):
            print_warning(w)
        if any(c.action != "delete" and any(d not in c.old or c.new[d].sm_max != c.old[d].sm_max for d in c.new)
               for c in todo):
            warn_sm_ceilings(directory, sorted({d for c in todo for d in c.new}))
    if as_json:
        emit_json({"dry_run": dry_run, "applied": bool(todo) and not dry_run,
                    "changes": [c.to_json() for c in changes]})
        return
    width = max((len(c.name) for c in changes), default=0)
    arrow = change_arrow()
    for c in changes:
        head = f"{_SIGN[c.action]} {c.action:<9} {c.name:<{width}}"
        if c.action in ("create", "replace"):
            details = [f"device {d}: {manifest.describe(c.new[d])}" for d in sorted(c.new)]
        elif c.action == "resize":
            details = [f"device {d}: {describe_changes(c.old[d].to_json(), c.new[d].to_json(), arrow)}"
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
              help="Write the file here (atomically: complete or not at all) instead of to standard output; its "
                   "directory is made if that directory's parent exists.")
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
    from .. import manifest
    existing_node_dir(directory)
    text, problems = manifest.export(directory)
    for name, problem in problems:
        print_warning(f"{name} left out: {problem}")
    if output is None:
        click.echo(text, nl=False)
        return
    _write_file(output, text)


def _write_file(output, text):
    """Write `text` to `output` atomically, making its directory if that directory's parent
    exists (`-o /etc/vgpu/slices.yaml` on a node without /etc/vgpu); a failure names
    `output`, not the temporary file beside it."""
    target = os.path.abspath(output)
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        if not os.path.isdir(os.path.dirname(parent)):
            raise click.ClickException(f"cannot write {output}: its directory {parent} does not exist, nor does "
                                       f"{os.path.dirname(parent)}; hint: check the path, or make it first "
                                       f"(mkdir -p {parent})")
        try:
            os.mkdir(parent, 0o755)
        except FileExistsError:
            pass   # made meanwhile
        except OSError as e:
            raise click.ClickException(f"cannot write {output}: cannot make its directory {parent} "
                                       f"({e.strerror}); hint: run as root, or pick a directory you can "
                                       "write") from None
    tmp = f"{target}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        raise click.ClickException(f"cannot write {output}: {e.strerror or e}; hint: check the path and its "
                                   "permissions") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
