"""MIG slices: a GPU instance and a compute instance over all of it, made through NVML
for one slice, and recorded beside its quota.

A MIG slice is a slice (quota, usage, identity) whose directory also holds `mig.json`
(slices.MIG): the GPU, the GPU instance (profile, placement, ID), the compute instance
and the MIG device's UUID.  Its program is given only that MIG device
(CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES = the MIG UUID), so CUDA's ordinal 0 in it
is the instance and the quota's device 0 is the software slice inside the instance (a
memory cap and an SM share within it; none by default).  The shim reads nothing new.

The NVML calls and their documented behaviour (nvml.h's Multi Instance GPU Management
group; ../shared/reference/nvml-mig.md):
  - nvmlDeviceGetMigMode: NOT_SUPPORTED on a GPU without MIG;
  - nvmlDeviceSetMigMode(ENABLE): activationStatus IN_USE when the GPU is not idle (the
    request then stays pending: it is withdrawn here); on some GPUs (A100) the new mode
    is pending until a GPU reset, which this module does not do;
  - profiles by enum index from 0 until INVALID_ARGUMENT (NOT_SUPPORTED: one this GPU
    lacks), placements with nvmlDeviceGetGpuInstancePossiblePlacements_v2, remaining
    capacity (NOT_SUPPORTED while MIG is off);
  - nvmlDeviceCreateGpuInstance(WithPlacement): INSUFFICIENT_RESOURCES when no room
    (an occupied placement too), then a compute instance of the profile whose slice
    count is the GPU instance's (the CI profile enum 1,2,3,4,7 slices -> 0..4), its ID
    from nvmlGpuInstanceGetComputeInstanceProfileInfo;
  - the MIG device: nvmlDeviceGetMigDeviceHandleByIndex up to GetMaxMigDeviceCount,
    matching GPU and compute instance IDs (NOT_FOUND: an empty index); its UUID;
  - destroy: GetGpuInstanceById -> GetComputeInstanceById -> destroy both (IN_USE while
    a process is on it); NOT_SUPPORTED (MIG off) or NOT_FOUND: already gone;
  - utilization is NOT_SUPPORTED on a MIG-enabled GPU: a MIG slice's use is its MIG
    device's memory and processes.
"""
import json
import time

from . import nvml
from . import slices
from .quantities import format_memory
from .slices import Busy, InvalidRequest, NotFound, Overcommitted, VgpuError

MiB = 1 << 20
RECORD_VERSION = 1
# the compute instance profile (enum index) over a whole GPU instance of n compute slices
FULL_CI_PROFILE = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}
NO_MIG_HINT = ("MIG needs an A30, A100, H100, H200 or a later data-center GPU; a software slice "
               "(--memory/--sm, no --mig) works on any GPU")


class NoMig(VgpuError):
    """The GPU has no MIG (a runtime failure: the node, not the arguments)."""


class NoRoom(VgpuError):
    """No placement of the profile is free on the GPU."""


def _nvml_here():
    """NVML is there to manage MIG with, or VgpuError with a hint."""
    try:
        nvml.device_count()
    except nvml.NvmlUnavailable as e:
        raise VgpuError(f"MIG needs NVML: {e}", "run on a node with NVIDIA's driver (or on simgpu: "
                        "eval \"$(vgpu-ctl sim env --profile h100-80g)\")") from None


def short_name(name) -> str:
    """`MIG 3g.40gb` -> `3g.40gb` (the name nvidia-smi and --mig use)."""
    name = name.strip()
    return name[4:] if name.lower().startswith("mig ") else name


def _check_device(index):
    count = nvml.device_count()
    if not 0 <= index < count:
        raise InvalidRequest(f"device {index} does not exist (this node has {count})", "pass a --device the node has")


def _gpu_name(index):
    try:
        return nvml.gpu_identity(index)[0]
    except nvml.DeviceError:
        return "?"


def mig_mode(index):
    """[current, pending]; NoMig on a GPU without MIG."""
    try:
        return nvml.mig_modes(index)
    except nvml.DeviceError as e:
        if e.reason == "not_supported":
            raise NoMig(f"device {index} ({_gpu_name(index)}) does not support MIG", NO_MIG_HINT) from None
        raise VgpuError(f"device {index}: cannot read its MIG mode: {e}", "check the driver (nvidia-smi -q)") from None


# === profiles ===

def profiles(index=0) -> dict:
    """Device `index`'s GPU instance profiles, as `nvidia-smi mig -lgip` and -lgipp list
    them (free: remaining capacity, None while MIG mode is off)."""
    _nvml_here()
    _check_device(index)
    mode = mig_mode(index)
    try:
        name, uuid = nvml.gpu_identity(index)
        table = [p | {"name": short_name(p["name"])} for p in nvml.gpu_instance_profiles(index, mode[0] == 1)]
        return {"device": index, "name": name, "uuid": uuid, "mig_mode": mode,
                "profiles": sorted(table, key=lambda p: (p["slices"], p["memory_mib"], p["name"])),
                "instances": _instances(index=index) if mode[0] == 1 else []}
    except nvml.DeviceError as e:
        raise VgpuError(f"device {index}: cannot read its MIG profiles: {e}",
                        "run as root" if e.reason == "no_permission" else "check the driver "
                        "(nvidia-smi mig -lgip)") from None


def _instances(index=None, uuid=None):
    """The GPU instances on a MIG-enabled GPU: [{id, profile_id, profile, start, size}]."""
    return [g | {"profile": short_name(g["profile"])} for g in nvml.gpu_instances(index, uuid)]


def instances_on(gpu_uuid: str):
    """The GPU instances on the GPU with this UUID (as _instances), or None when it cannot
    be read."""
    _nvml_here()
    try:
        return _instances(uuid=gpu_uuid)
    except nvml.DeviceError:
        return None


def find_profile(table: dict, wanted: str) -> dict:
    want = short_name(wanted).lower()
    for p in table["profiles"]:
        if p["name"].lower() == want:
            return p
    names = ", ".join(p["name"] for p in table["profiles"])
    raise InvalidRequest(f"device {table['device']} ({table['name']}) has no MIG profile {short_name(wanted)!r} "
                         f"(it has {names})", f"pick one of them; vgpu-ctl mig profiles --device {table['device']} "
                                             "shows their memory and placements")


def _placements_text(placements) -> str:
    if placements is None:
        return "{?}"
    starts = ",".join(str(s) for s, _ in placements)
    return f"{{{starts}}}:{placements[0][1]}" if placements else "{}"


def _taken_text(instances) -> str:
    return ", ".join(f"GPU instance {g['id']} ({g['profile']}) at {g['start']}:{g['size']}" for g in instances) \
        or "none"


# === create ===

def _enable(index):
    """Turn MIG mode on, or say why not (and leave no request pending)."""
    try:
        pids = sorted(nvml.running_processes(index))
    except nvml.DeviceError:
        pids = []   # the driver's activation status still says IN_USE
    busy_hint = ("stop them (MIG mode changes only on an idle GPU), or pick another --device; "
                 "vgpu-ctl status shows who they are")
    if pids:
        raise Busy(f"device {index} has {len(pids)} process(es) on it (pid {', '.join(map(str, pids))}): MIG mode "
                   "can only be turned on while the GPU is idle", busy_hint)
    try:
        refused = nvml.set_mig_mode(index, True)
    except nvml.DeviceError as e:
        hint = "run as root" if e.reason == "no_permission" else "check the driver (nvidia-smi -q)"
        raise VgpuError(f"cannot turn MIG mode on on device {index}: {e}", hint) from None
    if refused is not None:
        _withdraw(index)
        if refused.reason == "in_use":
            raise Busy(f"device {index} is in use: MIG mode can only be turned on while the GPU is idle", busy_hint)
        raise VgpuError(f"device {index} did not turn MIG mode on (activation status {refused.code}: {refused})",
                        "check the driver (nvidia-smi -q); a GPU passed through to a VM may need a reset")
    current, pending = nvml.mig_modes(index)
    if current != 1:
        raise VgpuError(f"MIG mode is pending on device {index}: this GPU enters it after a reset",
                        f"reset the GPU while it is idle (nvidia-smi -r -i {index}), then create the slice again")


def _withdraw(index):
    """A refused SetMigMode(ENABLE) leaves the request pending: ask for the mode it has."""
    try:
        if nvml.mig_modes(index)[0] == 0:
            nvml.set_mig_mode(index, False)
    except nvml.DeviceError:
        pass


def _disable(index):
    """Turn MIG mode off; returns a warning, or None when it is off."""
    try:
        refused = nvml.set_mig_mode(index, False)
        current, pending = nvml.mig_modes(index)
    except nvml.DeviceError as e:
        return f"MIG mode left on on device {index}: {e}"
    if refused is not None:
        if current == 1 and pending == 0:   # withdraw the refused request: a later reset must not drop the mode
            try:
                nvml.set_mig_mode(index, True)
            except nvml.DeviceError:
                pass
        return f"MIG mode left on on device {index} ({refused}: processes still on the GPU?)"
    if current != 0:
        return f"MIG mode on device {index} turns off at the GPU's next reset (nvidia-smi -r -i {index})"
    return None


def check_profile(index, profile, placement=None) -> dict:
    """The profile `profile` of device `index` (and that `placement` is one of its
    starts): its table row, with the device's table.  Changes nothing."""
    table = profiles(index)
    p = find_profile(table, profile)
    if placement is not None and p["placements"] is None:
        raise VgpuError(f"device {index}: the driver does not say where {p['name']} can go", "run as root, or "
                        "leave --placement out")
    if placement is not None and placement not in [s for s, _ in p["placements"]]:
        raise InvalidRequest(f"placement {placement} is not one of {p['name']}'s on device {index} "
                             f"({_placements_text(p['placements'])}: starts in memory slices)",
                             "pass one of those starts, or leave --placement out")
    return {"table": table, "profile": p}


def create_instance(index, profile, placement=None, checked=None) -> dict:
    """Make a GPU instance of `profile` (at `placement`, else the driver's choice) and a
    compute instance over all of it on device `index`, turning MIG mode on if it is off.
    Returns the record that mig.json holds.  Everything made is undone on failure."""
    checked = checked or check_profile(index, profile, placement)
    p = checked["profile"]
    _nvml_here()
    _check_device(index)
    enabled_here = False
    if mig_mode(index)[0] != 1:
        _enable(index)
        enabled_here = True
    gi = ci = None
    try:
        try:
            where = None if placement is None else [placement, dict(p["placements"])[placement]]
            gi = nvml.create_gpu_instance(index, p["id"], where)
        except nvml.DeviceError as e:
            if e.reason != "insufficient_resources":
                raise VgpuError(f"cannot create a {p['name']} GPU instance on device {index}: {e}",
                                "check the driver (nvidia-smi mig -lgi)") from None
            taken = _taken_text(_instances(index=index))
            where = f"at placement {placement}" if placement is not None else "at any placement"
            raise NoRoom(f"no room for {p['name']} on device {index} {where} (placements "
                         f"{_placements_text(p['placements'])}; taken: {taken})",
                         "delete a MIG slice there (vgpu-ctl list), pick another placement or --device, or a "
                         "smaller profile (vgpu-ctl mig profiles)") from None
        try:
            ci = nvml.create_compute_instance(gi, FULL_CI_PROFILE[p["slices"]])
        except (nvml.DeviceError, KeyError) as e:
            raise VgpuError(f"cannot create the compute instance of {p['name']} on device {index}: {e}",
                            "check the driver (nvidia-smi mig -lcip)") from None
        try:
            listed = nvml.mig_devices(index)
        except nvml.DeviceError:
            listed = []
        m = next((x for x in listed if (x.gpu_instance, x.compute_instance) == (gi.id, ci.id)), None)
        if m is None:
            raise VgpuError(f"device {index}: the new MIG device (GPU instance {gi.id}, compute instance "
                            f"{ci.id}) is not listed by NVML", "check the driver (nvidia-smi -L)")
        memory = nvml.mig_memory(m)
        if memory is None:
            raise nvml.DeviceError("its memory cannot be read")
        gpu_name, gpu_uuid = nvml.gpu_identity(index)
        return {"version": RECORD_VERSION, "device": index, "gpu_uuid": gpu_uuid,
                "gpu_name": gpu_name, "profile": p["name"], "profile_id": gi.profile_id,
                "placement": {"start": gi.start, "size": gi.size},
                "gpu_instance": gi.id, "compute_instance": ci.id,
                "compute_profile_id": ci.profile_id, "uuid": m.uuid,
                "name": m.name, "memory_total": memory[0],
                "multiprocessors": ci.multiprocessors, "enabled_mig_mode": enabled_here,
                "created": time.time()}
    except nvml.DeviceError as e:
        _undo(index, ci, gi, enabled_here)
        raise VgpuError(f"device {index}: making the {p['name']} instance failed: {e}",
                        "check the driver (nvidia-smi mig -lgi)") from None
    except BaseException:
        _undo(index, ci, gi, enabled_here)
        raise


def _undo(index, ci, gi, enabled_here):
    for instance in (ci, gi):
        if instance is not None:
            try:
                nvml.destroy(instance)
            except nvml.DeviceError:
                pass
    if enabled_here:
        _disable(index)


# === look-up and destroy ===

def _ours(record):
    """(GPU instance, compute instance) when they are still the record's, else (None, None)
    (MIG off, or the IDs now name other instances).  DeviceError when the record's GPU is
    not on this node (by UUID: indices may change across boots; else by index)."""
    gi, ci = nvml.instances_by_id(record["gpu_instance"], record["compute_instance"], uuid=record.get("gpu_uuid"),
                                  index=record.get("device"))
    if gi is None or (gi.profile_id, gi.start) != (record["profile_id"], record["placement"]["start"]):
        return None, None
    return gi, ci


def view(record) -> dict:
    """A MIG slice's instance as NVML sees it now: present, memory total/used (bytes) and
    its processes {host pid: bytes or None}."""
    out = {"present": False, "memory_total": None, "memory_used": None, "processes": {}}
    try:
        nvml.device_count()
    except nvml.NvmlUnavailable as e:
        return out | {"note": str(e)}
    try:
        m = nvml.mig_device(record["uuid"])
    except nvml.DeviceError as e:
        return out | {"note": f"not found ({e})"}
    if (m.gpu_instance, m.compute_instance) != (record["gpu_instance"], record["compute_instance"]):
        return out | {"note": "its UUID names another instance now"}
    out["present"] = True
    memory = nvml.mig_memory(m)
    if memory is not None:
        out["memory_total"], out["memory_used"] = memory
    try:
        out["processes"] = nvml.mig_processes(m)
    except nvml.DeviceError:
        pass
    return out


def destroy_instance(record, disable_mig=False) -> dict:
    """Destroy the record's compute and GPU instance.  Busy while a process is on it.
    Returns {"destroyed": bool, "warnings": [...]} (not destroyed: it was gone already)."""
    _nvml_here()
    index = record.get("device")
    warnings = []
    try:
        gi, ci = _ours(record)
    except nvml.DeviceError:
        return {"destroyed": False, "warnings": [f"device {index} ({record.get('gpu_uuid')}) is not on this node: "
                                                 "nothing to destroy"]}
    where = (f"GPU instance {record['gpu_instance']} ({record['profile']} at {record['placement']['start']}:"
             f"{record['placement']['size']}) on device {index}")
    if gi is None:
        warnings.append(f"{where} is gone already")
    else:
        for instance, what in ((ci, "compute instance"), (gi, "GPU instance")):
            if instance is None:
                continue
            try:
                nvml.destroy(instance)
            except nvml.DeviceError as e:
                if e.reason == "in_use":
                    pids = sorted(view(record)["processes"])
                    raise Busy(f"{where} is in use" + (f" (pid {', '.join(map(str, pids))})" if pids else ""),
                               "stop its processes first") from None
                raise VgpuError(f"cannot destroy the {what} of {where}: {e}", "check the driver "
                                "(nvidia-smi mig -lgi)") from None
    turned_off = False
    if disable_mig and mig_mode(index)[0] == 1:
        left = _instances(index=index)
        if left:
            warnings.append(f"MIG mode left on on device {index}: {len(left)} other GPU instance(s) remain "
                            f"({_taken_text(left)})")
        else:
            w = _disable(index)
            warnings += [w] if w else []
            turned_off = w is None
    return {"destroyed": gi is not None, "mig_mode_off": turned_off, "warnings": warnings}


# === MIG slices ===

def create_slice(directory, name, index, profile, quota, placement=None, overcommit=False, owner=None,
                 software_on=lambda d: [], sm_mode=None) -> dict:
    """A MIG slice: the instance, then the slice's files with its record (quota device 0 =
    the instance, holding `quota`).  `software_on(d)`: names of software slices on device
    d (MIG mode must not be turned on under them).  Undoes the instance on failure."""
    slices.check_name(name)
    if name in slices.list_names(directory):
        raise slices.Exists(f"slice {name} already exists in {slices.node_dir(directory)}",
                            f"delete it first (vgpu-ctl delete {name})")
    slices._check_order(0, quota)
    checked = check_profile(index, profile, placement)
    p, table = checked["profile"], checked["table"]
    size = p["memory_mib"] * MiB
    if not overcommit and quota.guaranteed_memory > size:
        raise Overcommitted(f"{p['name']} holds {format_memory(size)}: guaranteeing {name} "
                            f"{format_memory(quota.guaranteed_memory)} in it would overcommit it",
                            "ask for less (--memory / --request), a bigger profile, or pass --overcommit")
    if table["mig_mode"][0] != 1:
        others = software_on(index)
        if others:
            raise Busy(f"device {index} holds software slices ({', '.join(others)}): turning MIG mode on would "
                       "take the whole GPU from them", "delete them, or pick another --device")
    record = create_instance(index, profile, placement, checked)
    try:
        made = slices.create(directory, name, {0: quota}, overcommit=True, owner=owner, sm_mode=sm_mode,
                             extra_files={slices.MIG: (json.dumps(record, indent=2) + "\n").encode()})
    except BaseException:
        try:
            destroy_instance(record, disable_mig=record["enabled_mig_mode"])
        except VgpuError:
            pass    # the slice's own error says more
        raise
    return {"quota": made, "mig": record}


def delete_slice(directory, name, force=False, disable_mig=False) -> dict:
    """Destroy a MIG slice's instance, then its files.  Refused while its processes run
    (--force: the files go, and the instance stays while a process is on it)."""
    record = slices.read_mig(directory, name)
    if record is None:
        raise NotFound(f"slice {name} is not a MIG slice", f"vgpu-ctl delete {name}")
    usage = slices.read_usage(directory, name)
    live = [p.pid for p in usage.procs if p.alive] if usage else []
    if live and not force:
        raise Busy(f"slice {name} has {len(live)} live process(es) (pid {', '.join(map(str, live))})",
                   "stop them first, or pass --force")
    warnings, result = [], {"destroyed": False, "mig_mode_off": False}
    try:
        result = destroy_instance(record, disable_mig=disable_mig)
        warnings += result["warnings"]
    except VgpuError as e:   # in use, or no NVML to destroy it with
        if not force:
            raise
        warnings.append(f"{e}: the instance is left in place; destroy it by hand (nvidia-smi mig -dci -ci "
                        f"{record['compute_instance']} -gi {record['gpu_instance']} -i {record['device']}; "
                        f"nvidia-smi mig -dgi -gi {record['gpu_instance']} -i {record['device']})")
    deleted = slices.delete(directory, name, force=force)
    return {**deleted, "mig": record, "destroyed": result["destroyed"], "mig_mode_off": result["mig_mode_off"],
            "warnings": warnings}
