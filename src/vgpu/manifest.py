"""Declarative slices: a node's slices as a YAML file (`vgpu-ctl apply -f`, `export`).

    # /etc/vgpu/slices.yaml
    slices:
      train:
        memory: 10Gi          # memory.max; request and limit default to it
        sm: 50%
      infer:
        memory: 4Gi
        request: 2Gi
        limit: 6Gi
        sm: 20%
        sm-limit: 60%
      batch:
        sm: 100%
        sm-request: 30%       # burst mode (the default): guaranteed 30%, idle time up to 100%
      steady:
        sm: 40%
        sm-mode: ceiling      # never above 40%, idle GPU or not
      two-gpus:
        devices: [0, 1]       # the same quota on each; or a mapping, device -> fields
        memory: 8Gi

Fields are `vgpu-ctl create`'s options: memory, request, limit, sm, sm-request, sm-limit,
sm-mode, device or devices, user.  Values are read as the text written (`4Gi`, `50%`, `1000:1000`),
never as YAML's numbers or dates, and parsed as on the command line.

read() checks the whole file first -- every name, field and value, with the line it is on
-- and plan() compares it with the node, so a bad file or an impossible plan applies
nothing.  apply() changes the node in an order that never passes through an overcommitted
state (deletions, then what shrinks, then what grows, then new slices), each step through
the same functions as `create`, `resize` and `delete`.
"""
import grp
import os
import pwd
from dataclasses import dataclass, field
from typing import Optional

from . import slices
from .quantities import (SHARE_FULL, UNLIMITED, format_memory, format_memory_exact, format_share, parse_memory,
                         parse_share)

FIELDS = ("memory", "request", "limit", "sm", "sm-request", "sm-limit", "sm-mode", "device", "devices", "user")
_QUOTA_FIELDS = ("memory", "request", "limit", "sm", "sm-request", "sm-limit")


class FileError(slices.InvalidRequest):
    """A problem in the file, at a line: `vgpu-ctl apply` exits 2 and applies nothing."""

    def __init__(self, path, line, where, message, hint="fix the file and apply it again: nothing was changed"):
        loc = f"{path}:{line + 1}" if line is not None else path
        super().__init__(f"{loc}: {where + ': ' if where else ''}{message}", hint)


# === reading the file ===

@dataclass
class Wanted:
    """One slice the file asks for."""
    name: str
    devices: dict                  # index -> DeviceQuota
    owner: Optional[tuple] = None  # (uid, gid)
    line: int = 0
    sm_mode: str = slices.BURST


def _yaml():
    try:
        import yaml
    except ImportError:   # pragma: no cover - a dependency of the package
        raise slices.VgpuError("PyYAML is not installed", "pip install pyyaml") from None
    return yaml


def read(path, text=None) -> dict:
    """name -> Wanted, from the file at `path` (or `text`, shown as `path`)."""
    yaml = _yaml()
    shown = str(path)
    if text is None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise FileError(shown, None, "", "no such file", "give the path of a slices file, e.g. "
                            "/etc/vgpu/slices.yaml (vgpu-ctl export writes one)") from None
        except UnicodeDecodeError as e:
            raise FileError(shown, None, "", f"not UTF-8 text ({e.reason})") from None
        except IsADirectoryError:
            raise FileError(shown, None, "", "is a directory, not a file") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise FileError(shown, mark.line if mark else None, "", f"not valid YAML: {e.problem or e.context}",
                        "check the indentation and the colons") from None
    except yaml.YAMLError as e:
        raise FileError(shown, None, "", f"not valid YAML: {e}") from None
    if root is None:
        raise FileError(shown, None, "", "the file is empty",
                        "write `slices:` with the node's slices (`slices: {}` for none)")
    top = _mapping(root, shown, "", "a mapping with the key `slices`")
    for key, (kline, _) in top.items():
        if key not in ("slices", "version"):
            raise FileError(shown, kline, key, "unknown key (the file has `slices:` and optionally `version: 1`)")
    if "version" in top and _scalar(top["version"][1], shown, "version") != "1":
        raise FileError(shown, top["version"][1].start_mark.line, "version", "only version 1 is known")
    if "slices" not in top:
        raise FileError(shown, root.start_mark.line, "", "no `slices:` key",
                        "write `slices:` with the node's slices (`slices: {}` for none)")
    node = top["slices"][1]
    if _is_null(node):
        return {}
    wanted = {}
    for name, (line, spec) in _mapping(node, shown, "slices", "a mapping of slice names").items():
        if not slices.valid_name(name):
            raise FileError(shown, line, f"slices.{name}", "not a valid slice name",
                            "letters, digits, '-', '_' and '.', not starting with '.' or '-', under 64 characters")
        wanted[name] = _slice(name, line, spec, shown)
    return wanted


def _is_null(node):
    return node.tag == "tag:yaml.org,2002:null" or (getattr(node, "value", None) in ("", "~", "null")
                                                     and node.id == "scalar" and not node.style)


def _mapping(node, shown, where, what) -> dict:
    """key -> (line, value node); duplicate keys are an error."""
    if node.id != "mapping":
        raise FileError(shown, node.start_mark.line, where, f"expected {what}, found a {node.id}")
    out = {}
    for k, v in node.value:
        if k.id != "scalar":
            raise FileError(shown, k.start_mark.line, where, "keys must be plain names")
        if k.value in out:
            raise FileError(shown, k.start_mark.line, f"{where + '.' if where else ''}{k.value}",
                            f"given twice (also on line {out[k.value][0] + 1})")
        out[k.value] = (k.start_mark.line, v)
    return out


def _scalar(node, shown, where) -> str:
    if node.id != "scalar":
        raise FileError(shown, node.start_mark.line, where, f"expected a value, found a {node.id}")
    return str(node.value).strip()


def _device_index(node, shown, where) -> int:
    text = _scalar(node, shown, where)
    if not text.isdigit() or not 0 <= int(text) < slices.MAX_DEVICES:
        raise FileError(shown, node.start_mark.line, where,
                        f"{text!r} is not a device index (0..{slices.MAX_DEVICES - 1})")
    return int(text)


def _quota(fields: dict, shown, where, base: dict) -> slices.DeviceQuota:
    """A device's quota from fields (name -> (line, node)) over `base` (parsed values)."""
    values = dict(base)
    for key in _QUOTA_FIELDS:
        if key not in fields:
            continue
        line, node = fields[key]
        text = _scalar(node, shown, f"{where}.{key}")
        try:
            v = parse_share(text) if key.startswith("sm") else parse_memory(text)
        except ValueError as e:
            if getattr(e, "hint", None):   # what was probably meant (4Gi for a bare 4)
                raise FileError(shown, line, f"{where}.{key}", str(e),
                                f"{e.hint} (nothing was changed: fix the file and apply it again)") from None
            raise FileError(shown, line, f"{where}.{key}", str(e)) from None
        if key == "memory" and v == 0:
            raise FileError(shown, line, f"{where}.{key}", "0 would make a slice that can allocate nothing",
                            "leave memory out, or write max, for no cap")
        values[key] = (line, v)
    memory = values.get("memory", (None, UNLIMITED))[1]
    sm = values.get("sm", (None, SHARE_FULL))[1]
    q = slices.device_quota(memory, sm, *(values[k][1] if k in values else None
                                          for k in ("request", "limit", "sm-request", "sm-limit")))
    try:
        slices._check_order(0, q)
    except slices.InvalidRequest as e:
        line = min(ln for ln, _ in values.values()) if values else None
        raise FileError(shown, line, where, str(e).split(": ", 1)[1],
                        "set request and limit so that request <= memory <= limit (and the same for sm)") from None
    return q, values


def _slice(name, line, spec, shown) -> Wanted:
    where = f"slices.{name}"
    if _is_null(spec):
        fields = {}
    else:
        fields = _mapping(spec, shown, where, "a mapping of fields (memory, sm, ...)")
    for key, (kline, _) in fields.items():
        if key not in FIELDS:
            raise FileError(shown, kline, f"{where}.{key}", f"unknown field (fields: {', '.join(FIELDS)})")
    if "device" in fields and "devices" in fields:
        raise FileError(shown, fields["devices"][0], where, "both device and devices", "give one of them")
    common, base = _quota(fields, shown, where, {})
    devices = {}
    if "devices" in fields:
        dline, dnode = fields["devices"]
        if dnode.id == "sequence":
            for item in dnode.value:
                d = _device_index(item, shown, f"{where}.devices")
                if d in devices:
                    raise FileError(shown, item.start_mark.line, f"{where}.devices", f"device {d} given twice")
                devices[d] = common
        elif dnode.id == "mapping":
            for key, (kline, sub) in _mapping(dnode, shown, f"{where}.devices", "device -> fields").items():
                if not key.isdigit() or not 0 <= int(key) < slices.MAX_DEVICES:
                    raise FileError(shown, kline, f"{where}.devices",
                                    f"{key!r} is not a device index (0..{slices.MAX_DEVICES - 1})")
                sub_fields = {} if _is_null(sub) else _mapping(sub, shown, f"{where}.devices.{key}",
                                                                "a mapping of fields")
                for k, (fl, _) in sub_fields.items():
                    if k not in _QUOTA_FIELDS:
                        raise FileError(shown, fl, f"{where}.devices.{key}.{k}",
                                        f"unknown field (a device has: {', '.join(_QUOTA_FIELDS)})")
                devices[int(key)], _ = _quota(sub_fields, shown, f"{where}.devices.{key}", base)
        else:
            raise FileError(shown, dline, f"{where}.devices", "expected a list of device indices or a mapping "
                            "of device -> fields")
        if not devices:
            raise FileError(shown, dline, f"{where}.devices", "no devices", "leave it out for device 0")
    elif "device" in fields:
        devices[_device_index(fields["device"][1], shown, f"{where}.device")] = common
    else:
        devices[0] = common
    owner = None
    if "user" in fields:
        uline, unode = fields["user"]
        owner = _owner(_scalar(unode, shown, f"{where}.user"), shown, uline, f"{where}.user")
    mode = slices.BURST
    if "sm-mode" in fields:
        mline, mnode = fields["sm-mode"]
        mode = _scalar(mnode, shown, f"{where}.sm-mode")
        if mode not in slices.SM_MODES:
            raise FileError(shown, mline, f"{where}.sm-mode", f"{mode!r} is not one of {', '.join(slices.SM_MODES)}")
    return Wanted(name, devices, owner, line, mode)


def _owner(text, shown, line, where):
    user, _, group = text.partition(":")
    try:
        uid = int(user) if user.isdigit() else pwd.getpwnam(user).pw_uid
        if group:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        else:
            gid = uid if user.isdigit() else pwd.getpwuid(uid).pw_gid
    except KeyError:
        raise FileError(shown, line, where, f"{text!r}: no such user or group", "write UID[:GID]") from None
    return uid, gid


# === comparing with the node ===

@dataclass
class Change:
    name: str
    action: str                       # create, resize, replace, delete, unchanged, kept
    old: dict = field(default_factory=dict)    # index -> DeviceQuota (what the node has)
    new: dict = field(default_factory=dict)    # index -> DeviceQuota (what the file says)
    owner: Optional[tuple] = None
    note: str = ""
    sm_mode: tuple = (None, None)     # (the node's, the file's)

    def to_json(self):
        return {"name": self.name, "action": self.action, "note": self.note or None,
                "sm_mode": {"old": self.sm_mode[0], "new": self.sm_mode[1]},
                "devices": [{"index": d, "old": self.old[d].to_json() if d in self.old else None,
                             "new": self.new[d].to_json() if d in self.new else None}
                            for d in sorted(set(self.old) | set(self.new))]}


def _current(directory) -> dict:
    """name -> (Quota or None, problem or None, live process count)."""
    out = {}
    for name in slices.list_names(directory):
        if slices.has_mig(directory, name):   # MIG slices are made and deleted by create/delete --mig only
            continue
        try:
            quota = slices.read_quota(directory, name)
        except slices.VgpuError as e:
            out[name] = (None, str(e), 0)
            continue
        if quota.temporary is not None:     # `vgpu-ctl run`'s, for one command: not the file's to manage
            continue
        try:
            usage = slices.read_usage(directory, name)
            live = sum(1 for p in usage.procs if p.alive) if usage else 0
        except slices.VgpuError:
            live = 0
        out[name] = (quota, None, live)
    return out


def plan(directory, wanted: dict, prune=False, capacity=None, overcommit=False) -> list:
    """The changes that make the node match `wanted`, checked as a whole (names, live
    processes, device capacity) before anything is done.  Raises VgpuError."""
    current = _current(directory)
    for name in wanted:
        if slices.has_mig(directory, name):
            raise slices.InvalidRequest(f"{name} is a MIG slice: slices files do not describe MIG slices, and apply "
                                        "leaves them alone", f"leave {name} out of the file (vgpu-ctl create --mig / "
                                                             "delete manage it)")
    changes = []
    for name in sorted(set(current) | set(wanted)):
        want = wanted.get(name)
        quota, problem, live = current.get(name, (None, None, 0))
        if want is None:
            if not prune:
                changes.append(Change(name, "kept", note="not in the file; --prune deletes it"))
                continue
            if live:
                raise slices.Busy(f"{name} is not in the file but has {live} live process(es)",
                                  "stop them first, or add the slice to the file")
            changes.append(Change(name, "delete", old={d: quota.devices[d] for d in quota.held()} if quota else {},
                                  note="not in the file" + (f" ({problem})" if problem else "")))
            continue
        if name not in current:
            changes.append(Change(name, "create", new=want.devices, owner=want.owner, sm_mode=(None, want.sm_mode)))
            continue
        if quota is None:
            raise slices.BadFile(f"{name} cannot be read ({problem})",
                                 f"delete it (vgpu-ctl delete {name} --force), then apply again")
        held = quota.held()
        old = {d: quota.devices[d] for d in held}
        if sorted(want.devices) != held:
            if live:
                raise slices.Busy(
                    f"{name} holds device(s) {', '.join(map(str, held))} and the file gives it "
                    f"{', '.join(map(str, sorted(want.devices)))}: a slice's devices change only by making it "
                    f"again, and it has {live} live process(es)", "stop them first, or keep its devices")
            changes.append(Change(name, "replace", old=old, new=want.devices, owner=want.owner,
                                  note="other devices: deleted and created again",
                                  sm_mode=(quota.sm_mode, want.sm_mode)))
        else:
            same = all(old[d] == want.devices[d] for d in held) and quota.sm_mode == want.sm_mode
            changes.append(Change(name, "unchanged" if same else "resize", old=old, new=want.devices,
                                  sm_mode=(quota.sm_mode, want.sm_mode)))
            if want.owner and want.owner != _usage_owner(directory, name):
                changes[-1].note = (f"user {want.owner[0]}:{want.owner[1]} applies when a slice is created: "
                                    f"delete {name} to make it so")
    if not overcommit:
        _check_capacity(current, changes, capacity)
    return changes


def _check_capacity(current, changes, capacity):
    """The node after the changes must not guarantee a device more memory than it has,
    where the guarantees grow (as `create` and `resize` refuse)."""
    before, after = {}, {}
    for name, (quota, _, _) in current.items():
        if quota is not None:
            for d in quota.held():
                before[d] = before.get(d, 0) + quota.devices[d].guaranteed_memory
    final = {c.name: c.new if c.action in ("create", "resize", "replace", "unchanged") else
             ({} if c.action == "delete" else None) for c in changes}
    for name, devs in final.items():
        if devs is None:    # kept as it is
            quota = current[name][0]
            devs = {d: quota.devices[d] for d in quota.held()} if quota else {}
        for d, q in devs.items():
            after[d] = after.get(d, 0) + q.guaranteed_memory
    for d in sorted(after):
        if after[d] <= before.get(d, 0):
            continue     # not growing: allowed, even on an overcommitted device
        if capacity is None:
            raise slices.CapacityUnknown(f"cannot check device {d}'s capacity: no capacity source",
                                         "pass --overcommit to skip the check")
        cap = capacity(d)
        if cap is None:
            news = [c.name for c in changes if c.action in ("create", "replace") and d in c.new]
            if news:
                raise slices.InvalidRequest(f"device {d} does not exist on this node (asked for by {', '.join(news)})",
                                            "give the slice a device the node has")
            continue
        if after[d] > cap:
            raise slices.Overcommitted(
                f"device {d} would be overcommitted: {format_memory(after[d])} guaranteed there (the file's slices"
                f"{'' if all(c.action != 'kept' for c in changes) else ' and those it keeps'}) > "
                f"{format_memory(cap)} physical; nothing was changed",
                "ask for less, --prune slices not in the file, or pass --overcommit")


# === applying ===

def apply(directory, changes, capacity=None, overcommit=False, log=lambda change: None) -> list:
    """Carry out a plan.  Order: deletions, then devices whose guarantee shrinks, then
    those that grow, then new slices -- so no intermediate state needs more than the
    final one.  `log(change)` is called as each slice is done.  Returns resize's
    warnings (memory shrunk below what a slice holds)."""
    done, warnings = [], []

    def finish(c):
        if c not in done:
            done.append(c)
            log(c)

    for c in changes:
        if c.action in ("delete", "replace"):
            slices.delete(directory, c.name, force=False)
            if c.action == "delete":
                finish(c)
    steps = [(c, d) for c in changes if c.action == "resize" for d in sorted(c.new) if c.new[d] != c.old[d]]
    steps.sort(key=lambda cd: cd[0].new[cd[1]].guaranteed_memory > cd[0].old[cd[1]].guaranteed_memory)
    for c, d in steps:
        q = c.new[d]
        result = slices.resize(directory, c.name, devices=[d], memory=q.memory_max, sm=q.sm_max,
                               request=q.memory_request, limit=q.memory_limit, sm_request=q.sm_request,
                               sm_limit=q.sm_limit, overcommit=overcommit, capacity=capacity)
        warnings += result["warnings"]
    for c in changes:
        if c.action == "resize" and c.sm_mode[0] != c.sm_mode[1]:   # the mode alone: no capacity at stake
            slices.resize(directory, c.name, sm_mode=c.sm_mode[1], overcommit=True)
    for c in changes:
        if c.action == "resize":
            finish(c)
    for c in changes:
        if c.action in ("create", "replace"):
            slices.create(directory, c.name, c.new, overcommit=overcommit, capacity=capacity, owner=c.owner,
                          sm_mode=c.sm_mode[1])
            finish(c)
    return warnings


# === describing and exporting ===

def describe(q: slices.DeviceQuota) -> str:
    def mem(v):
        return "max" if v == UNLIMITED else format_memory(v)
    return (f"memory.max {mem(q.memory_max)} (request {mem(q.memory_request)}, limit {mem(q.memory_limit)}), "
            f"sm.max {format_share(q.sm_max)}" +
            (f" (request {format_share(q.sm_request)}, limit {format_share(q.sm_limit)})"
             if (q.sm_request, q.sm_limit) != (q.sm_max, q.sm_max) else ""))


def _exact_memory(v):
    """Memory as the file writes it: short when that is exact, else what reads back as v."""
    return "max" if v == UNLIMITED else format_memory_exact(v)


def _fields(q: slices.DeviceQuota) -> list:
    """(key, text) of a device quota, leaving out what would be the default."""
    out = []
    if q.memory_max != UNLIMITED:
        out.append(("memory", _exact_memory(q.memory_max)))
    if q.memory_request != q.memory_max:
        out.append(("request", _exact_memory(q.memory_request)))
    if q.memory_limit != q.memory_max:
        out.append(("limit", _exact_memory(q.memory_limit)))
    if q.sm_max != SHARE_FULL:
        out.append(("sm", format_share(q.sm_max)))
    if q.sm_request != q.sm_max:
        out.append(("sm-request", format_share(q.sm_request)))
    if q.sm_limit != q.sm_max:
        out.append(("sm-limit", format_share(q.sm_limit)))
    return out


def _key(name):
    """A slice name as a YAML key: quoted when YAML would read it as something else."""
    yaml = _yaml()
    try:
        plain = isinstance(yaml.safe_load(f"{name}: 0"), dict) and list(yaml.safe_load(f"{name}: 0")) == [name]
    except yaml.YAMLError:
        plain = False
    return name if plain else f'"{name}"'


def export(directory) -> tuple:
    """(the node's slices as a slices file, [slices that could not be read])."""
    lines = [f"# vgpu slices of {slices.node_dir(directory)}, from `vgpu-ctl export`",
             "# make a node match it: vgpu-ctl apply -f FILE", "slices:"]
    problems = []
    names = slices.list_names(directory)
    for name in names:
        if slices.has_mig(directory, name):
            lines.append(f"  # {name}: a MIG slice, left out (apply leaves MIG slices alone; vgpu-ctl create --mig "
                         "makes one)")
            continue
        try:
            quota = slices.read_quota(directory, name)
        except slices.VgpuError as e:
            problems.append((name, str(e)))
            lines.append(f"  # {name}: not readable ({e})")
            continue
        if quota.temporary is not None:
            lines.append(f"  # {name}: a temporary slice of `vgpu-ctl run`, left out (it goes with its command)")
            continue
        held = quota.held()
        devs = {d: quota.devices[d] for d in held}
        same = all(devs[d] == devs[held[0]] for d in held)
        body = []
        if same:
            body += [f"    {k}: {v}" for k, v in _fields(devs[held[0]])]
            if held != [0]:
                body.append(f"    device: {held[0]}" if len(held) == 1 else
                            f"    devices: [{', '.join(map(str, held))}]")
        else:
            body.append("    devices:")
            for d in held:
                f = _fields(devs[d])
                body.append(f"      {d}: {{{', '.join(f'{k}: {v}' for k, v in f)}}}" if f else f"      {d}: {{}}")
        if quota.sm_mode != slices.BURST:
            body.append(f"    sm-mode: {quota.sm_mode}")
        owner = _usage_owner(directory, name)
        if owner:
            body.append(f'    user: "{owner[0]}:{owner[1]}"')
        lines.append(f"  {_key(name)}:" + ("" if body else " {}"))
        lines += body
    if not any(line.startswith("  ") and not line.startswith("  #") for line in lines):
        lines[2] = "slices: {}"   # none written (comments only, or no slices)
    return "\n".join(lines) + "\n", problems


def _usage_owner(directory, name):
    """(uid, gid) of a slice made with --user (its usage file 0600), else None."""
    try:
        st = os.stat(slices.paths(directory, name)["usage"], follow_symlinks=False)
    except OSError:
        return None
    return (st.st_uid, st.st_gid) if st.st_mode & 0o777 == 0o600 else None
