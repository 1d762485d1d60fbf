"""This node's GPUs as a resource.k8s.io/v1 ResourceSlice, and keeping it published.

Each GPU is one device with allowMultipleAllocations (KEP-5075 consumable capacity), so
the scheduler hands out parts of it: `memory` in bytes and `sm` in percent of SM time.
A claim that names no amount gets the requestPolicy default; amounts are rounded up to
the step.  The pool is the node's name; its generation goes up each time the devices
change, as the API asks.

A MIG-capable GPU is a partitionable device (KEP-4815): beside the whole-GPU device
(type "gpu", what software slices share) each GI profile at each of its placements is a
device (type "mig") that consumes the GPU's counters; the whole-GPU device consumes all
of them.  The counter sets sit in slices of their own, as the API requires from 1.35.
A GPU with MIG instances made by hand publishes those instances as they are instead
(type "mig", no counters, nothing created for them).  Without a MIG-capable GPU the pool
is one slice, as before.

Bodies go to the client as plain dicts, not model objects: every `kubernetes` release
the package allows takes them (34-36 have no `from_dict`; 37 validates the dict into its
model).  Answers are read through attributes both kinds of model have.

The kubelet deletes the node's slices when it starts and 30 s after losing the plugin;
Publisher.watch sees that (a watch on this node's slices of this driver) and wakes the
agent, which publishes again at once instead of on its next rescan.
"""
import random
from dataclasses import dataclass

from .. import mig, nvml
from . import versions

MEMORY_STEP = 256 << 20         # 256Mi
MEMORY_DEFAULT = 1 << 30        # 1Gi
SM_DEFAULT = 10          # percent: a claim naming only memory does not take a whole GPU's time


@dataclass(frozen=True)
class MigProfile:
    """A GPU instance profile as NVML lists it (mig.profiles)."""
    name: str            # "3g.40gb"
    id: int              # the GI profile ID (nvmlGpuInstanceProfileInfo_t.id)
    slices: int          # compute slices
    memory: int          # bytes
    multiprocessors: int
    instances: int       # instanceCount: at most this many at once
    placements: tuple    # ((start, size), ...) in memory slices


@dataclass(frozen=True)
class MigInstance:
    """A GPU instance this driver did not make (made by hand): published as it is."""
    gpu_instance: int
    profile: str
    profile_id: int
    start: int
    size: int
    memory: int          # bytes (the profile's)


@dataclass(frozen=True)
class Gpu:
    index: int
    model: str
    uuid: str
    memory: int          # bytes
    mig_profiles: tuple = ()     # MigProfile...: () for a GPU without MIG
    mig_instances: tuple = ()    # MigInstance...: instances made by hand (then no dynamic MIG here)

    @property
    def name(self) -> str:
        return f"gpu-{self.index}"

    @property
    def partitionable(self) -> bool:
        """Published with its MIG profiles at their placements, consuming its counters."""
        return bool(self.mig_profiles) and not self.mig_instances


def inventory(ours=frozenset()) -> list:
    """The usable GPUs NVML sees (simgpu's on a machine without one).  A GPU NVML cannot
    read (lost, no memory size) is left out: published with no capacity, the API server
    would refuse the whole slice.  ours: {(GPU UUID, GPU instance ID)} of the MIG
    instances this driver made (its checkpoint); any other instance on a GPU is one made
    by hand.  A MIG query that fails (not NOT_SUPPORTED) propagates: publishing such a
    GPU without its counters could hand it out twice."""
    out = []
    for d in nvml.devices():
        if not d["memory_total"]:
            continue
        uuid = d["uuid"] or f"index-{d['index']}"
        profiles, hand = _mig(d["index"], uuid, ours)
        out.append(Gpu(d["index"], d["name"], uuid, d["memory_total"], profiles, hand))
    return out


def _mig(index, uuid, ours):
    try:
        table = mig.profiles(index)
    except mig.NoMig:
        return (), ()
    profiles = tuple(MigProfile(p["name"], p["id"], p["slices"], p["memory_mib"] << 20, p["multiprocessors"],
                                p["instances"], tuple(tuple(x) for x in p["placements"]))
                     for p in table["profiles"] if p["placements"])
    memory = {p.id: p.memory for p in profiles}
    hand = tuple(MigInstance(g["id"], g["profile"], g["profile_id"], g["start"], g["size"],
                             memory.get(g["profile_id"], 0))
                 for g in table["instances"] if (uuid, g["profile_id"], g["start"]) not in ours)
    return profiles, hand


# === partitionable devices (KEP-4815) ===
# Per MIG-capable GPU one counter set, `gpu-N`: a counter per memory slice (value 1), the
# compute slices, and one per profile that allows fewer instances than it has placements
# (the +me profiles: one at a time).  A MIG device consumes the memory slices of its
# placement, its compute slices and, for such a profile, one of its instances; the
# whole-GPU device consumes all of them, so the scheduler never gives a GPU both to
# software slices and to a MIG instance.  The whole-GPU device allows multiple
# allocations: the scheduler charges its counters once, for the first share.

def _label(text) -> str:
    return "".join(c for c in text.lower() if c.isalnum())


def counter_set_name(gpu) -> str:
    return f"gpu-{gpu.index}"


def _memory_slices(gpu) -> int:
    return max(s + n for p in gpu.mig_profiles for s, n in p.placements)


def counters(gpu) -> dict:
    """The counter set's counters {name: value}."""
    out = {f"memory-slice-{i}": 1 for i in range(_memory_slices(gpu))}
    out["compute-slices"] = max(p.slices for p in gpu.mig_profiles)
    for p in gpu.mig_profiles:
        if p.instances < len(p.placements):
            out[f"{_label(p.name)}-instances"] = p.instances
    return out


def _consumes(gpu, amounts) -> list:
    return [{"counterSet": counter_set_name(gpu), "counters": {k: {"value": str(v)} for k, v in amounts.items()}}]


def mig_device_name(gpu, profile, start) -> str:
    return f"{gpu.name}-mig-{_label(profile.name)}-{start}"


def static_device_name(gpu, instance) -> str:
    return f"{gpu.name}-mig-gi{instance.gpu_instance}"


def _mig_attributes(gpu, profile, profile_id, start, size):
    return {"type": {"string": "mig"}, "profile": {"string": profile}, "profileID": {"int": profile_id},
            "placementStart": {"int": start}, "placementSize": {"int": size}, "index": {"int": gpu.index},
            "parentUUID": {"string": gpu.uuid}, "model": {"string": gpu.model}}


def mig_devices(gpu) -> list:
    """Every profile of a partitionable GPU at each of its placements."""
    out = []
    for p in gpu.mig_profiles:
        for start, size in p.placements:
            use = {f"memory-slice-{i}": 1 for i in range(start, start + size)}
            use["compute-slices"] = p.slices
            if p.instances < len(p.placements):
                use[f"{_label(p.name)}-instances"] = 1
            out.append({"name": mig_device_name(gpu, p, start),
                        "attributes": _mig_attributes(gpu, p.name, p.id, start, size),
                        "capacity": {"memory": {"value": str(p.memory)},
                                     "multiprocessors": {"value": str(p.multiprocessors)}},
                        "consumesCounters": _consumes(gpu, use)})
    return out


def static_devices(gpu) -> list:
    """The instances made by hand on a GPU, as they are (nothing is created for them)."""
    return [{"name": static_device_name(gpu, g),
             "attributes": {**_mig_attributes(gpu, g.profile, g.profile_id, g.start, g.size),
                            "gpuInstance": {"int": g.gpu_instance}},
             "capacity": {"memory": {"value": str(g.memory)}}}
            for g in sorted(gpu.mig_instances, key=lambda g: g.gpu_instance)]


def parse_device(name: str):
    """("gpu", index) for a whole-GPU device name, ("mig", index) for a MIG one, else None."""
    parts = name.split("-")
    if len(parts) >= 2 and parts[0] == "gpu" and parts[1].isdigit():
        return ("gpu" if len(parts) == 2 else "mig" if len(parts) >= 4 and parts[2] == "mig" else None), \
            int(parts[1])
    return None


def device(gpu: Gpu, partitionable=True) -> dict:
    out = {
        "name": gpu.name,
        "allowMultipleAllocations": True,
        "attributes": {"type": {"string": "gpu"}, "model": {"string": gpu.model}, "uuid": {"string": gpu.uuid},
                       "index": {"int": gpu.index}},
        "capacity": {
            "memory": {"value": str(gpu.memory),
                       "requestPolicy": {"default": str(MEMORY_DEFAULT),
                                         "validRange": {"min": str(MEMORY_STEP), "step": str(MEMORY_STEP)}}},
            "sm": {"value": "100",
                   "requestPolicy": {"default": str(SM_DEFAULT),
                                     "validRange": {"min": "1", "max": "100", "step": "1"}}},
        },
    }
    if partitionable and gpu.partitionable:
        out["consumesCounters"] = _consumes(gpu, counters(gpu))
    return out


def slice_name(node: str, driver: str) -> str:
    return f"{node}-{driver}"


# the API's limits (resource.k8s.io/v1 types.go, 1.35+)
MAX_DEVICES = 128
MAX_DEVICES_ADVANCED = 64          # when a device consumes counters (or has taints)
MAX_COUNTER_SETS = 8
MAX_COUNTERS_PER_SET = 32
MAX_CONSUMPTIONS_PER_DEVICE = 2
MAX_COUNTERS_PER_CONSUMPTION = 32
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_DEVICE_COUNTERS_PER_SLICE_134 = 1024   # 1.34: ResourceSliceMaxDeviceCountersPerSlice


def _gpu_devices(g, partitionable, modes) -> tuple:
    """(counter set or None, devices) of one GPU: a partitionable GPU offers software slices
    (the whole-GPU device) and/or MIG devices as `modes` says; the whole GPU consumes the
    counters only when MIG devices stand beside it."""
    if not (partitionable and g.partitionable):
        return None, static_devices(g) if g.mig_instances else [device(g, partitionable=False)]
    mig, soft = modes.serves_mig(g.index), modes.serves_slices(g.index)
    devices = ([device(g, partitionable=mig)] if soft else []) + (mig_devices(g) if mig else [])
    counter_set = {"name": counter_set_name(g), "counters": {c: {"value": str(v)} for c, v in counters(g).items()}}
    return (counter_set if mig else None), devices


def resource_slices(node: str, driver: str, gpus: list, generation: int, node_uid=None,
                    partitionable=True, modes=versions.GpuModes(exclusive=False), gpu_per_slice=False) -> list:
    """The pool's ResourceSlices.  Without counters to publish: one slice, every GPU in it.
    With them (1.35+ layout): the counter sets in slices of their own (at most 8 a slice;
    the API allows no devices beside them), a slice per GPU with counters (its devices: at
    most 64), and one for the rest.  gpu_per_slice (the 1.34 layout, versions.py): a slice
    per GPU, holding its counter set beside its devices.  partitionable=False: no counters
    and no dynamic MIG devices (an API server without DRAPartitionableDevices would drop
    the counters and hand a GPU out twice).  modes: which GPUs offer MIG, which software
    slices (versions.GpuModes)."""
    per_gpu = [(g, *_gpu_devices(g, partitionable, modes)) for g in sorted(gpus, key=lambda g: g.index)]
    specs = []
    if gpu_per_slice:
        specs = [(g.name, {**({"sharedCounters": [cs]} if cs else {}), "devices": devs}) for g, cs, devs in per_gpu]
    elif not any(cs for _, cs, _ in per_gpu):
        specs.append(("", {"devices": [d for _, _, devs in per_gpu for d in devs]}))
    else:
        parted = [(g, cs, devs) for g, cs, devs in per_gpu if cs]
        for k in range(0, len(parted), MAX_COUNTER_SETS):
            specs.append((f"counters-{k // MAX_COUNTER_SETS}",
                          {"sharedCounters": [cs for _, cs, _ in parted[k:k + MAX_COUNTER_SETS]]}))
        specs += [(g.name, {"devices": devs}) for g, _, devs in parted]
        plain = [d for _, cs, devs in per_gpu if not cs for d in devs]
        if plain:
            specs.append(("", {"devices": plain}))
    out = []
    for suffix, body in specs:
        meta = {"name": slice_name(node, driver) + (f"-{suffix}" if suffix else "")}
        if node_uid:   # garbage-collected with the Node object
            meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid,
                                        "controller": True}]
        out.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": meta,
                    "spec": {"driver": driver, "nodeName": node,
                             "pool": {"name": node, "generation": generation, "resourceSliceCount": len(specs)},
                             **body}})
    problems = check_limits(out, counters_in_device_slice=gpu_per_slice)
    if problems:
        raise ValueError("; ".join(problems))
    return out


def resource_slice(node: str, driver: str, gpus: list, generation: int, node_uid=None) -> dict:
    """The one slice of a pool without partitionable GPUs."""
    [only] = resource_slices(node, driver, gpus, generation, node_uid, partitionable=False)
    return only


def check_limits(slices: list, counters_in_device_slice=False) -> list:
    """What the API server's validation refuses in one pool's slices, as far as counters
    and sizes go: counter sets and devices never in one slice, at most 8 counter sets of
    at most 32 counters, at most 128 devices (64 when one consumes counters), at most 2
    consumptions of at most 32 counters per device, 32 attributes and capacities, each
    consumption naming a counter set and counters of the pool.  counters_in_device_slice:
    1.34's rules instead (kubernetes/api resource/v1/types.go at v0.34.0): counter sets
    beside the devices that use them, in the same slice, at most 32 counters in all of a
    slice's sets and 1024 consumed counters in all of its devices."""
    if counters_in_device_slice:
        return _check_limits_134(slices)
    out, sets = [], {}
    for s in slices:
        for cs in s["spec"].get("sharedCounters") or []:
            if cs["name"] in sets:
                out.append(f"counter set {cs['name']} defined twice in the pool")
            sets[cs["name"]] = set(cs["counters"])
    for s in slices:
        name, spec = s["metadata"]["name"], s["spec"]
        devices, shared = spec.get("devices") or [], spec.get("sharedCounters") or []
        if devices and shared:
            out.append(f"{name}: only one of devices and sharedCounters may be set")
        if len(shared) > MAX_COUNTER_SETS:
            out.append(f"{name}: {len(shared)} counter sets, at most {MAX_COUNTER_SETS}")
        out += [f"{name}: counter set {cs['name']} has {len(cs['counters'])} counters, at most "
                f"{MAX_COUNTERS_PER_SET}" for cs in shared if len(cs["counters"]) > MAX_COUNTERS_PER_SET]
        limit = MAX_DEVICES_ADVANCED if any(d.get("consumesCounters") or d.get("taints") for d in devices) \
            else MAX_DEVICES
        if len(devices) > limit:
            out.append(f"{name}: {len(devices)} devices, at most {limit}")
        for d in devices:
            uses = d.get("consumesCounters") or []
            if len(uses) > MAX_CONSUMPTIONS_PER_DEVICE:
                out.append(f"{name}: device {d['name']} consumes from {len(uses)} counter sets, at most "
                           f"{MAX_CONSUMPTIONS_PER_DEVICE}")
            if len(d.get("attributes") or {}) + len(d.get("capacity") or {}) > MAX_ATTRIBUTES_AND_CAPACITIES:
                out.append(f"{name}: device {d['name']} has more than {MAX_ATTRIBUTES_AND_CAPACITIES} attributes "
                           "and capacities")
            for u in uses:
                if len(u["counters"]) > MAX_COUNTERS_PER_CONSUMPTION:
                    out.append(f"{name}: device {d['name']} consumes {len(u['counters'])} counters of "
                               f"{u['counterSet']}, at most {MAX_COUNTERS_PER_CONSUMPTION}")
                out += _unknown_counters(name, d, u, sets, "which the pool does not define")
    return out


def _unknown_counters(name, d, use, sets, missing) -> list:
    """A consumption's counter set or counters that `sets` ({set: counter names}) lack."""
    if use["counterSet"] not in sets:
        return [f"{name}: device {d['name']} consumes from counter set {use['counterSet']}, {missing}"]
    return [f"{name}: device {d['name']} consumes counter {c} that {use['counterSet']} lacks"
            for c in set(use["counters"]) - sets[use["counterSet"]]]


def _check_limits_134(slices: list) -> list:
    out = []
    for s in slices:
        name, spec = s["metadata"]["name"], s["spec"]
        devices, shared = spec.get("devices") or [], spec.get("sharedCounters") or []
        sets = {cs["name"]: set(cs["counters"]) for cs in shared}
        total = sum(len(cs["counters"]) for cs in shared)
        if total > MAX_COUNTERS_PER_SET:
            out.append(f"{name}: {total} counters in its counter sets, at most {MAX_COUNTERS_PER_SET}")
        if len(devices) > MAX_DEVICES:
            out.append(f"{name}: {len(devices)} devices, at most {MAX_DEVICES}")
        consumed = sum(len(u["counters"]) for d in devices for u in d.get("consumesCounters") or [])
        if consumed > MAX_DEVICE_COUNTERS_PER_SLICE_134:
            out.append(f"{name}: its devices consume {consumed} counters, at most {MAX_DEVICE_COUNTERS_PER_SLICE_134}")
        for d in devices:
            if len(d.get("attributes") or {}) + len(d.get("capacity") or {}) > MAX_ATTRIBUTES_AND_CAPACITIES:
                out.append(f"{name}: device {d['name']} has more than {MAX_ATTRIBUTES_AND_CAPACITIES} attributes "
                           "and capacities")
            for u in d.get("consumesCounters") or []:
                out += _unknown_counters(name, d, u, sets, "which is not in its slice")
    return out


def _comparable(devices: list):
    """Devices with every capacity quantity as a number: the API server may write "24Gi"
    for the "25769803776" we sent, which is the same slice."""
    from kubernetes.utils import parse_quantity

    def walk(v, in_capacity):
        if isinstance(v, dict):
            return {k: walk(x, in_capacity or k in ("capacity", "counters")) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x, in_capacity) for x in v]
        return parse_quantity(v) if in_capacity and isinstance(v, str) else v
    return walk(devices, False)


WATCH_SECONDS = 290   # one watch request's length (the server ends it; the next one resumes)


class Publisher:
    """Keeps the ResourceSlices of (node, driver) -- one pool, the node's name -- equal to
    the GPUs it is given."""

    def __init__(self, api_client, node: str, driver: str, log, timeout=10, partitionable=True,
                 mig_gpus=frozenset()):
        from kubernetes import client
        self.resource = client.ResourceV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.api_client = api_client
        self.node, self.driver, self.log = node, driver, log
        self.timeout = timeout
        self.node_uid = None
        # (the GPUs we last wrote, the devices as the server stored them): a server that
        # keeps less than we sent (consumable capacity switched off) is not rewritten forever
        self.written = None
        self.written_version = None   # resourceVersion of our last write: its watch event is no news
        self.written_versions = {}    # every slice of our last write: name -> resourceVersion
        self.partitionable = partitionable   # publish counters and MIG devices (off once the server drops them)
        self.mig_gpus = mig_gpus             # --mig-gpus: where a GPU must choose, these serve MIG
        self.server = None                   # (version, GpuModes, gpu_per_slice) once /version answered

    @property
    def selector(self) -> str:
        return f"spec.nodeName={self.node},spec.driver={self.driver}"

    def _owner(self):
        if self.node_uid is None:
            from kubernetes.client.exceptions import ApiException
            try:
                self.node_uid = self.core.read_node(self.node, _request_timeout=self.timeout).metadata.uid
            except ApiException as e:
                self.log({"event": "no_owner_reference", "node": self.node, "status": e.status,
                          "reason": e.reason})
                self.node_uid = ""
        return self.node_uid

    def learn_server(self):
        """Read the API server's version once and settle the layout and the GPU modes it
        allows (versions.py); API errors propagate (the next round asks again)."""
        if self.server is not None:
            return self.server
        version = versions.read(self.api_client, self.timeout)
        modes = versions.modes_for(version, self.mig_gpus)
        self.server = (version, modes, bool(version and version.counters_in_device_slice))
        event = {"event": "kubernetes_version", "version": str(version) if version else "unknown",
                 "layout": "gpu-per-slice" if self.server[2] else "counters-apart",
                 "mig_beside_slices": not modes.exclusive}
        if modes.exclusive:
            event["warning"] = ("MIG beside software slices on one GPU is unsafe on this Kubernetes version (fixed "
                                "in 1.36.2): a GPU serves either; --mig-gpus names those serving MIG")
        self.log(event)
        return self.server

    def sync(self, gpus: list) -> str:
        """Publish `gpus`; returns "created", "updated" or "unchanged".  API errors propagate
        (the caller retries on its next round).  Every slice of the pool carries one
        generation, raised on any change; slices no longer wanted go after the new ones
        are written."""
        _, modes, gpu_per_slice = self.learn_server()
        existing = self.resource.list_resource_slice(field_selector=self.selector,
                                                     _request_timeout=self.timeout).items
        current = {s.metadata.name: s for s in existing}
        generation = max((s.spec.pool.generation for s in existing), default=0)
        have = {n: _comparable(self._spec(s)) for n, s in current.items()}
        key = (tuple(gpus), self.partitionable)
        layout = {"partitionable": self.partitionable, "modes": modes, "gpu_per_slice": gpu_per_slice}
        want = resource_slices(self.node, self.driver, gpus, generation, **layout)
        if have == {b["metadata"]["name"]: _comparable(b["spec"]) for b in want} or self.written == (key, have):
            self.written_versions = {n: s.metadata.resource_version for n, s in current.items()}
            return "unchanged"
        bodies = resource_slices(self.node, self.driver, gpus, generation + 1, self._owner(), **layout)
        stored, created = {}, []
        for body in bodies:
            name = body["metadata"]["name"]
            if name in current:
                body["metadata"]["resourceVersion"] = current[name].metadata.resource_version
                stored[name] = self.resource.replace_resource_slice(name, body, _request_timeout=self.timeout)
            else:
                stored[name] = self.resource.create_resource_slice(body, _request_timeout=self.timeout)
                created.append(name)
        for name in sorted(set(current) - set(stored)):   # e.g. left by an older agent under another name
            self.resource.delete_resource_slice(name, _request_timeout=self.timeout)
        dropped = self._written(key, bodies, stored)
        for body in bodies:
            name = body["metadata"]["name"]
            devices = [d["name"] for d in body["spec"].get("devices") or []]
            if name in created:
                self.log({"event": "resourceslice_created", "name": name, "devices": devices})
            else:
                self.log({"event": "resourceslice_updated", "name": name,
                          "generation": body["spec"]["pool"]["generation"], "devices": devices})
        if dropped:     # without counters the MIG devices and the whole GPU could both be handed out
            self.partitionable = False
            return self.sync(gpus)
        return "updated" if not created or current else "created"

    def _spec(self, model) -> dict:
        return self.api_client.sanitize_for_serialization(model).get("spec", {})

    def _devices(self, model) -> list:
        return self._spec(model).get("devices") or []

    def _written(self, key, bodies, stored) -> bool:
        """Record what the server kept; True when it dropped the counters (its
        DRAPartitionableDevices gate is off)."""
        kept = {n: _comparable(self._spec(m)) for n, m in stored.items()}
        self.written = (key, kept)
        self.written_versions = {n: m.metadata.resource_version for n, m in stored.items()}
        self.written_version = next(iter(self.written_versions.values()), None)
        sent_counters = kept_counters = 0
        capacity_dropped = False
        for body in bodies:
            name, spec = body["metadata"]["name"], body["spec"]
            got = kept[name]
            sent_counters += len(spec.get("sharedCounters") or []) + \
                sum(bool(d.get("consumesCounters")) for d in spec.get("devices") or [])
            kept_counters += len(got.get("sharedCounters") or []) + \
                sum(bool(d.get("consumesCounters")) for d in got.get("devices") or [])
            strip = lambda ds: [{k: v for k, v in d.items() if k != "consumesCounters"} for d in ds]  # noqa: E731
            if strip(_comparable(spec.get("devices") or [])) != strip(got.get("devices") or []):
                capacity_dropped = True
        if capacity_dropped:
            self.log({"event": "resourceslice_fields_dropped",
                      "error": "the API server did not keep allowMultipleAllocations or the capacity request "
                               "policies: enable the DRAConsumableCapacity feature gate (API server, scheduler, "
                               "kubelet), or every claim gets a whole GPU"})
        if sent_counters and kept_counters < sent_counters:
            self.log({"event": "resourceslice_fields_dropped",
                      "error": "the API server did not keep sharedCounters/consumesCounters: enable the "
                               "DRAPartitionableDevices feature gate (API server, scheduler; beta and on by default "
                               "since 1.36); until then MIG devices are not published, only whole GPUs"})
            return True
        return False

    def _news(self, kind, obj) -> bool:
        """Whether a watch event may need a sync: any deletion, any slice but our last write."""
        meta = (obj or {}).get("metadata") or {}
        name = meta.get("name")
        return kind == "DELETED" or name not in self.written_versions or \
            meta.get("resourceVersion") != self.written_versions[name]

    def watch(self, stop, kick, seconds=WATCH_SECONDS):
        """Until `stop` (a threading.Event) is set, call kick() whenever this node's slices
        of this driver change other than by our own writes -- above all when the kubelet
        deletes them.  Lists, then watches from the list's resourceVersion; after an error
        (the API server down, 410 Gone) it waits a little, lists again and carries on."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException
        version, failures = None, 0
        while not stop.is_set():
            try:
                if version is None:
                    listed = self.resource.list_resource_slice(field_selector=self.selector,
                                                               _request_timeout=self.timeout)
                    version = listed.metadata.resource_version
                    if {s.metadata.name: s.metadata.resource_version for s in listed.items} != \
                            self.written_versions:   # gone or changed while we were not watching
                        kick()
                w = watch.Watch()
                for event in w.stream(self.resource.list_resource_slice, field_selector=self.selector,
                                      resource_version=version, allow_watch_bookmarks=True, timeout_seconds=seconds,
                                      _request_timeout=(self.timeout, seconds + self.timeout)):
                    failures = 0
                    raw = event.get("raw_object") or {}
                    version = (raw.get("metadata") or {}).get("resourceVersion") or version
                    if event["type"] != "BOOKMARK" and self._news(event["type"], raw):
                        kick()
                    if stop.is_set():
                        w.stop()
                        break
            except Exception as e:   # ApiException (410: too old; 5xx), or the connection dropped
                version, failures = None, failures + 1
                gone = isinstance(e, ApiException) and e.status == 410
                if not gone:
                    self.log({"event": "resourceslice_watch_failed", "error": f"{type(e).__name__}: {e}"[:300]})
                stop.wait(0 if gone and failures == 1 else min(30.0, 0.5 * 2 ** failures) * random.uniform(0.8, 1.2))
