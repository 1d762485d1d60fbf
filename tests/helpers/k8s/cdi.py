"""The container runtime's side of CDI, as the CDI library that containerd and CRI-O
vendor (tags.cncf.io/container-device-interface) does it: read every spec in the CDI
directories, refuse the ones it cannot accept, resolve the kubelet's fully qualified
device names against the rest and collect their container edits.

Written from that library's rules, not from vgpu's: the driver's own idea of what a spec
needs cannot vouch for itself.  The rules, per library release:
- a spec is read strictly: a field the library's types do not have fails the whole spec;
- its cdiVersion must be one the library knows ("invalid version"), and not lower than
  what its content needs (the library's minimum-required-version check, newest rule first:
  1.1.0 network devices or intelRdt schemata/enableMonitoring; 0.7.0 intelRdt or
  additionalGids; 0.6.0 annotations or a "." in the class; 0.5.0 a device name starting
  with a digit or a device node's hostPath; 0.4.0 a mount's type; else 0.3.0);
- vendor and class: a letter first, a letter or digit last, letters, digits, "_", "-",
  "." between; a device name: a letter or digit first and last, and "_", "-", ".", ":"
  between; each device has some edits, every env entry has a name before its "=", every
  mount a host and a container path, no device name twice in a spec;
- a device that two specs of one directory both define is dropped (a conflict);
- injecting a name no accepted spec defines fails the container: "unresolvable CDI
  devices ...".
"""
import json
import os

import yaml

# library release -> the newest spec version it knows (its version table)
LIBRARY_NEWEST = {"0.5": "0.5.0", "0.6": "0.6.0", "0.7": "0.7.0", "0.8": "0.8.0", "1.0": "1.0.0", "1.1": "1.1.0"}
RUNTIMES = {   # runtime releases -> the CDI library release they vendor (each release's go.mod)
    "containerd 1.7.0-1.7.11": "0.5",
    "containerd 1.7.12-1.7.15": "0.6",
    "containerd 1.7.16-1.7.26": "0.7",
    "containerd 1.7.27+": "0.8",
    "containerd 2.0.0-2.0.4": "0.8",
    "containerd 2.0.5-2.2.0": "1.0",
    "containerd 2.2.1+": "1.1",
    "CRI-O 1.30": "0.7",
    "CRI-O 1.31-1.32": "0.8",
    "CRI-O 1.33-1.34": "1.0",
    "CRI-O 1.35+": "1.1",
}
CONTAINERD_2_0 = "containerd 2.0.0-2.0.4"
ALL_VERSIONS = ("0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")


def _v(version):
    return tuple(int(p) for p in version.lstrip("v").split("."))


def known_versions(runtime):
    newest = LIBRARY_NEWEST[RUNTIMES[runtime]]
    return [v for v in ALL_VERSIONS if _v(v) <= _v(newest)]


# --- the fields the library's spec types have (unknown ones fail the strict read) ---
_MOUNT = {"hostPath", "containerPath", "options", "type"}
_NODE = {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}
_HOOK = {"hookName", "path", "args", "env", "timeout"}
_RDT = {"closID", "l3CacheSchema", "memBwSchema", "enableCMT", "enableMBM"}
_RDT_1_1 = {"closID", "schemata", "l3CacheSchema", "memBwSchema", "enableMonitoring", "enableCMT", "enableMBM"}
_NET = {"hostInterfaceName", "name"}


def _edit_fields(newest):
    base = {"env", "deviceNodes", "hooks", "mounts"}
    if _v(newest) >= _v("0.7.0"):
        base |= {"intelRdt", "additionalGids"}
    if _v(newest) >= _v("1.1.0"):
        base |= {"netDevices"}
    return base


class SpecError(ValueError):
    pass


def _strict(obj, allowed, where):
    if not isinstance(obj, dict):
        raise SpecError(f"{where}: expected an object")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise SpecError(f'failed to unmarshal CDI Spec: {where}: unknown field "{unknown[0]}"')


def _check_fields(raw, newest):
    _strict(raw, {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}, "spec")
    edits_allowed = _edit_fields(newest)
    rdt_allowed = _RDT_1_1 if _v(newest) >= _v("1.1.0") else _RDT

    def edits(e, where):
        _strict(e, edits_allowed, where)
        for m in e.get("mounts") or []:
            _strict(m, _MOUNT, f"{where}.mounts")
        for n in e.get("deviceNodes") or []:
            _strict(n, _NODE, f"{where}.deviceNodes")
        for h in e.get("hooks") or []:
            _strict(h, _HOOK, f"{where}.hooks")
        for n in e.get("netDevices") or []:
            _strict(n, _NET, f"{where}.netDevices")
        if e.get("intelRdt") is not None:
            _strict(e["intelRdt"], rdt_allowed, f"{where}.intelRdt")

    edits(raw.get("containerEdits") or {}, "containerEdits")
    for i, d in enumerate(raw.get("devices") or []):
        _strict(d, {"name", "annotations", "containerEdits"}, f"devices[{i}]")
        edits(d.get("containerEdits") or {}, f"devices[{i}].containerEdits")


# --- the minimum version a spec's content needs: newest rule first ---
def _all_edits(spec):
    return [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec.get("devices") or []]


def _needs_1_1(spec):
    for e in _all_edits(spec):
        rdt = e.get("intelRdt")
        if e.get("netDevices") or (rdt is not None and ("schemata" in rdt or rdt.get("enableMonitoring"))):
            return True
    return False


def _needs_0_7(spec):
    return any(e.get("intelRdt") is not None or e.get("additionalGids") for e in _all_edits(spec))


def _needs_0_6(spec):
    if spec.get("annotations") or any(d.get("annotations") for d in spec.get("devices") or []):
        return True
    vendor, _, cls = (spec.get("kind") or "").partition("/")
    return bool(vendor and cls) and "." in cls


def _needs_0_5(spec):
    if any((d.get("name") or "x")[0] in "0123456789" for d in spec.get("devices") or []):
        return True
    return any(n.get("hostPath") for e in _all_edits(spec) for n in e.get("deviceNodes") or [])


def _needs_0_4(spec):
    return any(m.get("type") for e in _all_edits(spec) for m in e.get("mounts") or [])


_RULES = (("1.1.0", _needs_1_1), ("0.7.0", _needs_0_7), ("0.6.0", _needs_0_6), ("0.5.0", _needs_0_5),
          ("0.4.0", _needs_0_4))


def required_version(spec):
    return next((v for v, needs in _RULES if needs(spec)), "0.3.0")


# --- names and edits ---
def _alnum(c):
    return c.isascii() and c.isalnum()


def _vendor_or_class(name, what):
    if not name:
        raise SpecError(f"invalid {what}. empty name")
    if not (name[0].isascii() and name[0].isalpha()):
        raise SpecError(f'invalid {what}. "{name}", should start with letter')
    if any(not (_alnum(c) or c in "_-.") for c in name[1:-1]):
        raise SpecError(f'invalid {what}. invalid character in name "{name}"')
    if not _alnum(name[-1]):
        raise SpecError(f'invalid {what}. "{name}", should end with a letter or digit')


def _device_name(name):
    if not name or not _alnum(name[0]) or not _alnum(name[-1]) or \
            any(not (_alnum(c) or c in "_-.:") for c in name[1:-1]):
        raise SpecError(f"invalid device name {name!r}")


def _edits(e, where):
    for v in e.get("env") or []:
        if v.find("=") <= 0:
            raise SpecError(f"{where}: invalid environment variable {v!r}")
    for m in e.get("mounts") or []:
        if not m.get("hostPath") or not m.get("containerPath"):
            raise SpecError(f"{where}: invalid mount, empty host or container path")


def parse_spec(data: bytes, path, newest):
    """(vendor, class, {device name: edits}, spec edits) of an accepted spec; SpecError why not."""
    try:
        raw = json.loads(data) if path.endswith(".json") else yaml.safe_load(data)
    except ValueError as e:
        raise SpecError(f"failed to parse CDI Spec {path}: {e}") from None
    _check_fields(raw, newest)
    version = str(raw.get("cdiVersion") or "")
    if version.lstrip("v") not in [v for v in ALL_VERSIONS if _v(v) <= _v(newest)]:
        raise SpecError(f'invalid version "{version}"')
    needed = required_version(raw)
    if _v(needed) > _v(version):
        raise SpecError(f"the spec version must be at least v{needed}")
    vendor, _, cls = (raw.get("kind") or "").partition("/")
    _vendor_or_class(vendor, "vendor")
    _vendor_or_class(cls, "class")
    _edits(raw.get("containerEdits") or {}, "containerEdits")
    devices = {}
    for d in raw.get("devices") or []:
        name, edits = d.get("name") or "", d.get("containerEdits") or {}
        _device_name(name)
        if not any(edits.get(k) for k in ("env", "deviceNodes", "hooks", "mounts", "intelRdt", "additionalGids",
                                           "netDevices")):
            raise SpecError(f"failed add device {name!r}: invalid device, empty device edits")
        _edits(edits, f"device {name}")
        if name in devices:
            raise SpecError(f"invalid spec, multiple device {name!r}")
        devices[name] = edits
    return vendor, cls, devices, raw.get("containerEdits") or {}


class UnresolvableDevices(Exception):
    pass


class Registry:
    """The CDI cache of one runtime over `dirs` (the first has the lowest priority)."""

    def __init__(self, dirs, runtime=CONTAINERD_2_0):
        self.dirs, self.runtime = [str(d) for d in dirs], runtime
        self.newest = LIBRARY_NEWEST[RUNTIMES[runtime]]
        self.devices, self.errors = {}, {}

    def refresh(self):
        """Read every spec again: {qualified name: (spec path, device edits, spec edits)}."""
        self.devices, self.errors = {}, {}
        for priority, d in enumerate(self.dirs):
            found, conflicts = {}, set()
            for entry in sorted(os.listdir(d)) if os.path.isdir(d) else []:
                path = os.path.join(d, entry)
                if not entry.endswith((".json", ".yaml")) or not os.path.isfile(path):
                    continue
                try:
                    with open(path, "rb") as f:
                        vendor, cls, devices, spec_edits = parse_spec(f.read(), path, self.newest)
                except SpecError as e:
                    self.errors[path] = str(e)
                    continue
                for name, edits in devices.items():
                    qualified = f"{vendor}/{cls}={name}"
                    if qualified in found:
                        conflicts.add(qualified)
                    found[qualified] = (path, edits, spec_edits)
            for q in conflicts:
                del found[q]
            self.devices.update(found)     # a later directory overrides an earlier one
        return self.devices

    def inject(self, names):
        """The edits for `names` as the runtime applies them: each spec's own edits once,
        then each device's.  UnresolvableDevices if any name is not defined."""
        self.refresh()
        unresolved = [n for n in names if n not in self.devices]
        if unresolved:
            why = "; ".join(f"{p}: {e}" for p, e in sorted(self.errors.items()))
            raise UnresolvableDevices(f"unresolvable CDI devices {', '.join(unresolved)}" +
                                      (f" (specs refused: {why})" if why else ""))
        out, specs = {"env": [], "mounts": [], "deviceNodes": []}, set()
        for n in names:
            path, edits, spec_edits = self.devices[n]
            parts = [edits] if path in specs else [spec_edits, edits]
            specs.add(path)
            for e in parts:
                for key in out:
                    out[key] += e.get(key) or []
        return out
