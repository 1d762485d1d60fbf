"""Preparing and unpreparing ResourceClaims on this node: claims become slices.

A claim's devices from this driver become ONE slice (one VGPU_SLICE per container),
named by the share ID of its first device -- for the usual one-GPU claim, exactly its
share ID.  Each device's quota is what the scheduler allocated (consumedCapacity; a
device allocated without it is taken whole): memory.max = memory.request = the bytes,
sm.max = sm.request = the percent, so the shim enforces the scheduler's numbers.

Lending (the scheduler's accounting is fixed at allocation): sm.limit is 100%, so the
autoscaler may grow a throttled slice's SM share into time no claim holds; memory.limit
is the claim's memory unless lend_memory. When a claim is prepared on a GPU, every
claim's slice there that grew above its request is set back to it first, so the new
claim finds the capacity the scheduler promised it (slices made by hand are left alone).
SM time comes back at once; lent memory comes back only as its holder frees it (why
memory is not lent by default).

Everything is serialised by one lock and recorded in the checkpoint before it exists on
disk, so a restarted agent unprepares what it prepared; a claim found half-prepared, or
prepared but with its files gone (a reboot empties /run), is prepared afresh. Errors for
one claim are that claim's error string (the kubelet retries); the others proceed.

One kubelet call has a deadline for all its claims, the wait for the lock included:
CALL_BUDGET, or less when the caller's own deadline is nearer (the kubelet gives up on a
call after 45 s).  A claim the time does not reach is answered with an error, so the
kubelet gets an answer it can act on instead of a timed-out call.

What the kubelet is told per device: request_names without the "/<subrequest>" of a
firstAvailable claim's result (it matches them against a container's
`resources.claims[].request`, which names the main request), and the result's shareID.
"""
import os
import threading
import time

from .. import mig, nvml, overhead, podlabels, slices
from ..quantities import SHARE_FULL, format_memory
from . import CONTAINER_ANNOTATION, cdi, checkpoint, resourceslice


class ClaimError(Exception):
    """Why one claim cannot be prepared, as the kubelet (and `kubectl describe pod`) shows it."""


def _quantity(value, what, claim):
    from kubernetes.utils import parse_quantity
    try:
        return parse_quantity(value)
    except (ValueError, TypeError):
        raise ClaimError(f"claim {claim}: consumed {what} {value!r} is not a quantity") from None


_EXPECTED = (ClaimError, slices.VgpuError, OSError, nvml.DeviceError, nvml.NvmlUnavailable)

CALL_BUDGET = 40.0   # seconds for one prepare/unprepare call: under the kubelet's 45 s call timeout
MIN_CLAIM_TIME = 1.0  # a claim is not begun with less than this left (it could not read its claim)


def base_request(request: str) -> str:
    """The main request of an allocation result's `request` ("gpu" of "gpu/large")."""
    return request.split("/", 1)[0]


def claim_labels(obj) -> dict:
    """namespace, pod (the pod the claim is reserved for), container (the webhook's
    annotation) and claim, as far as the ResourceClaim says."""
    meta = obj.get("metadata") or {}
    reserved = [r for r in (obj.get("status") or {}).get("reservedFor") or []
                if r.get("resource") == "pods" and not r.get("apiGroup")]
    pods = [r.get("name") for r in reserved]
    return podlabels.clean({"namespace": meta.get("namespace"), "claim": meta.get("name"),
                            "pod": pods[0] if len(pods) == 1 else None,
                            # the node agent attributes the pod's processes (its cgroups name it) to the slice
                            "pod_uid": reserved[0].get("uid") if len(reserved) == 1 else None,
                            "container": (meta.get("annotations") or {}).get(CONTAINER_ANNOTATION)})


def _describe(e) -> str:
    if not isinstance(e, _EXPECTED):
        return f"internal error: {type(e).__name__}: {e}"
    return f"{e}; hint: {e.hint}" if getattr(e, "hint", None) else str(e)


def _trace(e) -> dict:
    """The traceback of an error nobody expected, for the log."""
    if isinstance(e, _EXPECTED):
        return {}
    import traceback
    return {"traceback": "".join(traceback.format_exception(e))[-2000:]}


class Driver:
    def __init__(self, driver_name, node_name, plugin_dir, cdi_dir, slice_dir, shim, preload_file, read_claim,
                 gpus, gpu_cdi_devices=(), lend_memory=False, cdi_version=cdi.CDI_VERSION, log=lambda event: None):
        """read_claim(namespace, name, timeout) -> the ResourceClaim as an API dict, or None
        when it does not exist, within `timeout` seconds; gpus() -> this node's Gpu list
        (vgpu.k8s.resourceslice)."""
        self.driver, self.node = driver_name, node_name
        self.checkpoint_path = os.path.join(plugin_dir, "checkpoint.json")
        self.cdi_dir, self.slice_dir, self.shim, self.preload_file = cdi_dir, slice_dir, shim, preload_file
        self.read_claim, self.gpus, self.log = read_claim, gpus, log
        self.gpu_cdi_devices, self.lend_memory, self.cdi_version = list(gpu_cdi_devices), lend_memory, cdi_version
        self.lock = threading.Lock()
        self.claims = checkpoint.load(self.checkpoint_path)   # CheckpointError: refuse to start
        self.unhealthy = {}      # GPU index -> why (vgpu.health): gpus() leaves it out; a claim on it is told why

    # === the kubelet's two calls ===

    @staticmethod
    def _deadline(time_left):
        """The monotonic time by which a call must be answered: CALL_BUDGET from now, or
        sooner when the caller leaves less (time_left: seconds, None for no deadline)."""
        budget = CALL_BUDGET if time_left is None else min(CALL_BUDGET, time_left - max(1.0, 0.1 * time_left))
        return time.monotonic() + budget

    def _locked(self, claims, deadline, what):
        """Take the lock before the deadline, or None with each claim's error."""
        if self.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return None
        text = f"not {what}: the driver was busy with another call for all of this call's time; the kubelet retries"
        return {uid: text for _, uid, _ in claims}

    def prepare(self, claims, time_left=None) -> dict:
        """claims: [(namespace, uid, name)] -> {uid: {"devices": [...]} or {"error": text}},
        within time_left seconds (the caller's deadline) and never more than CALL_BUDGET."""
        deadline = self._deadline(time_left)
        busy = self._locked(claims, deadline, "prepared")
        if busy:
            return {uid: {"error": text} for uid, text in busy.items()}
        out = {}
        try:
            for namespace, uid, name in claims:
                try:
                    out[uid] = {"devices": self._prepare(namespace, uid, name, deadline)}
                except Exception as e:   # one claim's failure is its own; the others go on
                    text = _describe(e)
                    self.log({"event": "prepare_failed", "claim": f"{namespace}/{name}", "uid": uid, "error": text,
                              **_trace(e)})
                    out[uid] = {"error": text}
        finally:
            self.lock.release()
        return out

    def unprepare(self, claims, time_left=None) -> dict:
        """claims: [(namespace, uid, name)] -> {uid: error text, "" when done}."""
        busy = self._locked(claims, self._deadline(time_left), "unprepared")
        if busy:
            return busy
        out = {}
        try:
            for namespace, uid, name in claims:
                try:
                    self._unprepare(uid)
                    out[uid] = ""
                except Exception as e:
                    out[uid] = _describe(e)
                    self.log({"event": "unprepare_failed", "claim": f"{namespace}/{name}", "uid": uid,
                              "error": out[uid], **_trace(e)})
        finally:
            self.lock.release()
        return out

    # === prepare ===

    def _prepare(self, namespace, uid, name, deadline):
        shown = f"{namespace}/{name}"
        entry = self.claims.get(uid)
        if entry and entry["state"] == "prepared" and self._files_present(entry):
            # the kubelet retries; the answer does not change (but the main request only,
            # also for a claim an agent before that fix recorded with the subrequest's)
            return [{**d, "request_names": [base_request(n) for n in d["request_names"]]} for d in entry["devices"]]
        if entry:   # an agent died half-way, or the files are gone (a reboot empties /run): start over
            self._remove_files(entry)
            del self.claims[uid]
            checkpoint.save(self.checkpoint_path, self.claims)
        left = deadline - time.monotonic()
        if left < MIN_CLAIM_TIME:
            raise ClaimError(f"ResourceClaim {shown} not read: the call's time went to the claims before it "
                             "(the API server is slow or unreachable); the kubelet retries")
        obj = self.read_claim(namespace, name, left)
        if obj is None:
            raise ClaimError(f"ResourceClaim {shown} not found")
        have_uid = obj.get("metadata", {}).get("uid")
        if have_uid != uid:
            raise ClaimError(f"ResourceClaim {shown} has UID {have_uid}, not {uid}: "
                             "it was deleted and made again since the kubelet asked")
        allocation = (obj.get("status") or {}).get("allocation")
        if not allocation:
            raise ClaimError(f"ResourceClaim {shown} is not allocated")
        results = [r for r in (allocation.get("devices") or {}).get("results") or [] if r.get("driver") == self.driver]
        if not results:
            return []
        if any(r.get("adminAccess") for r in results):
            raise ClaimError(f"claim {shown} asks for admin access, which vgpu does not support yet "
                             "(a slice would hold the GPU's capacity that admin access must not consume)")
        migs = [r for r in results if (resourceslice.parse_device(r.get("device", "")) or ("",))[0] == "mig"]
        if migs:
            if len(migs) != len(results):
                raise ClaimError(f"claim {shown} asks for MIG devices and whole GPUs together: vgpu gives a "
                                 "container one or the other (use two claims)")
            return self._prepare_mig(namespace, uid, name, shown, migs)
        quota = self._quota(shown, results)
        slice_name = results[0].get("shareID") or f"claim-{uid}"
        if not slices.valid_name(slice_name):
            raise ClaimError(f"claim {shown}: share ID {slice_name!r} cannot name a slice")
        owner = next((u for u, e in self.claims.items() if e["slice"] == slice_name), None)
        if owner:
            raise ClaimError(f"claim {shown}: slice {slice_name} already belongs to claim {owner}")
        if slice_name in slices.list_names(self.slice_dir):   # before the checkpoint names it ours
            raise ClaimError(f"claim {shown}: a slice named {slice_name} already exists on this node "
                             "(made by hand?)")
        spec_path = cdi.spec_path(self.cdi_dir, self.driver, uid)
        ids = [cdi.device_id(self.driver, slice_name)] + self.gpu_cdi_devices
        answer, seen_requests = [], set()
        for r in results:   # the IDs once per request: the runtime gets each device once
            request = base_request(r.get("request", ""))
            device = {"request_names": [request] if request else [], "pool_name": r["pool"],
                      "device_name": r["device"], "cdi_device_ids": [] if request in seen_requests else ids}
            if r.get("shareID"):
                device["share_id"] = r["shareID"]
            answer.append(device)
            seen_requests.add(request)
        entry = {"namespace": namespace, "name": name, "state": "preparing", "slice": slice_name,
                 "cdi_spec": spec_path, "devices": answer}
        self.claims[uid] = entry
        checkpoint.save(self.checkpoint_path, self.claims)
        created = False
        try:
            self._give_back(quota)
            slices.create(self.slice_dir, slice_name, quota, capacity=self._capacity)
            created = True
            paths = slices.paths(self.slice_dir, slice_name)
            cdi.write(spec_path, cdi.spec(self.driver, slice_name, paths, self.shim, self.preload_file,
                                          self.cdi_version, self._context_overhead(shown, quota)))
        except BaseException as e:
            cdi.remove(spec_path)
            if created:
                slices.delete(self.slice_dir, slice_name, force=True)
            del self.claims[uid]
            checkpoint.save(self.checkpoint_path, self.claims)
            if isinstance(e, slices.Exists):   # made by hand in the moment since the check above
                raise ClaimError(f"claim {shown}: a slice named {slice_name} already exists on this node "
                                 "(made by hand?)") from None
            if isinstance(e, slices.Overcommitted):
                raise ClaimError(f"claim {shown} does not fit: {e}") from None
            if isinstance(e, cdi.VersionTooLow):
                raise ClaimError(f"claim {shown}: {e}") from None
            raise
        labels = claim_labels(obj)
        try:   # for status and metrics only: a failure here is logged, the claim still runs
            podlabels.write(self.slice_dir, slice_name, labels)
        except OSError as e:
            self.log({"event": "labels_not_written", "slice": slice_name, "error": str(e)})
        entry["state"] = "prepared"
        checkpoint.save(self.checkpoint_path, self.claims)
        self.log({"event": "prepared", "claim": shown, "uid": uid, "slice": slice_name,
                  "devices": {str(d): q.to_json() for d, q in quota.items()}})
        return answer

    def _context_overhead(self, shown, quota):
        """The node's measured context cost for the claim's GPUs (overhead.py), or None.  A
        bad measurement file fails open: the pod starts, its shim charges no context (as
        with none measured), and the log says why."""
        try:
            return overhead.for_devices(self.slice_dir, list(quota))
        except slices.VgpuError as e:
            self.log({"event": "context_overhead_unread", "claim": shown, "error": str(e), "hint": e.hint})
            return None

    def _quota(self, shown, results):
        """{index: DeviceQuota} for the results, checked against this node and summed per
        GPU (two requests of one claim may share one GPU)."""
        gpus = {g.name: g for g in self.gpus()}
        memory, sm = {}, {}
        for r in results:
            if r.get("pool") != self.node:
                raise ClaimError(f"claim {shown}: device {r.get('device')} was allocated from pool "
                                 f"{r.get('pool')}, not this node's ({self.node})")
            gpu = gpus.get(r.get("device"))
            sick = resourceslice.parse_device(str(r.get("device")))
            if gpu is None and sick and sick[1] in self.unhealthy:
                raise ClaimError(f"claim {shown}: device {r.get('device')} is unhealthy "
                                 f"({self.unhealthy[sick[1]]}): it takes no new claims")
            if gpu is None:
                raise ClaimError(f"claim {shown}: device {r.get('device')} is not on this node "
                                 f"(it has {', '.join(sorted(gpus)) or 'no GPUs'})")
            if gpu.mig_profiles and _mig_mode_on(gpu.index):
                raise ClaimError(f"claim {shown}: device {gpu.name} is in MIG mode (a MIG instance is on it, or "
                                 "turning MIG mode off waits for a GPU reset): a software slice needs the whole GPU")
            consumed = r.get("consumedCapacity") or {}
            mem = int(_quantity(consumed["memory"], "memory", shown)) if "memory" in consumed else gpu.memory
            share = int(_quantity(consumed["sm"], "sm", shown) * 100) if "sm" in consumed else SHARE_FULL
            memory[gpu.index] = memory.get(gpu.index, 0) + mem
            sm[gpu.index] = min(SHARE_FULL, sm.get(gpu.index, 0) + share)
        quota = {}
        for d in memory:
            if memory[d] <= 0 or sm[d] <= 0:
                raise ClaimError(f"claim {shown}: device gpu-{d} was given {format_memory(memory[d])} and "
                                 f"{sm[d] / 100:g}% SM: nothing to run on")
            lent = max(memory[d], self._capacity(d) or 0) if self.lend_memory else memory[d]
            quota[d] = slices.DeviceQuota(memory_max=memory[d], memory_request=memory[d], memory_limit=lent,
                                          sm_max=sm[d], sm_request=sm[d], sm_limit=SHARE_FULL)
        return quota

    def _capacity(self, d):
        return next((g.memory for g in self.gpus() if g.index == d), None)

    def _give_back(self, quota):
        """This driver's slices that grew above their claim on these GPUs go back to it
        (slices made by hand are the operator's).  A slice that cannot be resized is
        logged, not fatal: the new claim is not its fault."""
        for name in sorted(e["slice"] for e in self.claims.values() if e["state"] == "prepared"):
            try:
                q = slices.read_quota(self.slice_dir, name)
                for d in set(q.held()) & set(quota):
                    dq = q.devices[d]
                    memory = dq.memory_request if dq.memory_max > dq.memory_request else None
                    sm = dq.sm_request if dq.sm_max > dq.sm_request else None
                    if memory is None and sm is None:
                        continue
                    r = slices.resize(self.slice_dir, name, devices=[d], memory=memory, sm=sm,
                                      request=dq.memory_request, limit=dq.memory_limit, sm_request=dq.sm_request,
                                      sm_limit=dq.sm_limit, overcommit=True)
                    self.log({"event": "gave_back", "slice": name, "device": d, "changes": r["changes"],
                              "warnings": r["warnings"]})
            except (slices.VgpuError, OSError) as e:
                self.log({"event": "give_back_failed", "slice": name, "error": str(e)})

    def _files_present(self, entry) -> bool:
        if "mig" in entry:   # the spec, and every instance (a reboot takes them all)
            return os.path.isfile(entry["cdi_spec"]) and \
                all(r.get("static") or mig.view(r)["present"] for r in entry["mig"])
        return os.path.isfile(entry["cdi_spec"]) and \
            os.path.isfile(slices.paths(self.slice_dir, entry["slice"])["quota"])

    # === unprepare ===

    def _unprepare(self, uid):
        entry = self.claims.get(uid)
        if entry is None:
            return                   # never prepared here, or already unprepared: nothing to undo
        self._remove_files(entry)
        del self.claims[uid]
        checkpoint.save(self.checkpoint_path, self.claims)
        self.log({"event": "unprepared", "claim": f"{entry['namespace']}/{entry['name']}", "uid": uid,
                  "slice": entry["slice"]})

    def _remove_files(self, entry):
        if "mig" in entry:
            return self._remove_mig(entry)
        cdi.remove(entry["cdi_spec"])
        try:   # the pod is gone when the kubelet unprepares; a straggler keeps its unlinked files
            slices.delete(self.slice_dir, entry["slice"], force=True)
        except slices.NotFound:
            pass

    # === MIG claims ===

    def mig_instances(self) -> frozenset:
        """{(GPU UUID, GI profile ID, placement start)} of the instances this driver made or
        is making (the checkpoint): the inventory does not take them for instances made by hand."""
        return frozenset((i["gpu_uuid"], i["profile_id"], i["start"])
                         for e in self.claims.values() for i in e.get("mig_intent") or [])

    def _mig_target(self, shown, r, gpus):
        """(Gpu, MigProfile, start) for a dynamic MIG device, (Gpu, MigInstance, None) for one
        made by hand."""
        if r.get("pool") != self.node:
            raise ClaimError(f"claim {shown}: device {r.get('device')} was allocated from pool "
                             f"{r.get('pool')}, not this node's ({self.node})")
        _, index = resourceslice.parse_device(r["device"])
        gpu = next((g for g in gpus if g.index == index), None)
        if gpu is not None:
            for p in gpu.mig_profiles:
                for start, _ in p.placements:
                    if resourceslice.mig_device_name(gpu, p, start) == r["device"] and gpu.partitionable:
                        return gpu, p, start
            for g in gpu.mig_instances:
                if resourceslice.static_device_name(gpu, g) == r["device"]:
                    return gpu, g, None
        raise ClaimError(f"claim {shown}: MIG device {r['device']} is not published by this node now "
                         "(its GPU's instances changed since the scheduler allocated it); the kubelet retries")

    def _prepare_mig(self, namespace, uid, name, shown, results):
        """Make each allocated MIG device's instance (at the allocated placement; an instance
        made by hand is used as it is) and a CDI spec exposing exactly those instances."""
        gpus = self.gpus()
        targets = [self._mig_target(shown, r, gpus) for r in results]
        for gpu, _, start in targets:
            serving = self._slices_on(gpu.index) if start is not None else []
            if serving:   # a scheduler up to 1.36.1 can place MIG beside slices (versions.py): never make it
                raise ClaimError(f"claim {shown}: {gpu.name} serves software slices ({', '.join(serving[:3])}): "
                                 "a MIG instance there would take memory and SMs they were promised; not made")
        spec_path = cdi.spec_path(self.cdi_dir, self.driver, uid)
        ids = [cdi.mig_device_id(self.driver, uid)] + self.gpu_cdi_devices
        answer, seen_requests = [], set()
        for r in results:
            request = base_request(r.get("request", ""))
            device = {"request_names": [request] if request else [], "pool_name": r["pool"],
                      "device_name": r["device"], "cdi_device_ids": [] if request in seen_requests else ids}
            if r.get("shareID"):
                device["share_id"] = r["shareID"]
            answer.append(device)
            seen_requests.add(request)
        intent = [{"gpu_uuid": g.uuid, "device": g.index, "profile_id": p.id, "start": start}
                  for g, p, start in targets if start is not None]
        entry = {"namespace": namespace, "name": name, "state": "preparing", "slice": None, "mig": [],
                 "mig_intent": intent, "cdi_spec": spec_path, "devices": answer}
        self.claims[uid] = entry
        checkpoint.save(self.checkpoint_path, self.claims)   # before any instance exists
        try:
            for gpu, target, start in targets:
                if start is None:
                    entry["mig"].append(_static_record(gpu, target))
                else:
                    entry["mig"].append(mig.create_instance(gpu.index, target.name, placement=start))
                checkpoint.save(self.checkpoint_path, self.claims)
            nodes = [n for rec in entry["mig"] for n in cdi.mig_device_nodes(
                _minor(rec["device"]), rec["gpu_instance"], rec["compute_instance"])]
            cdi.write(spec_path, cdi.mig_spec(self.driver, uid, [rec["uuid"] for rec in entry["mig"]], nodes,
                                              self.cdi_version))
        except BaseException as e:
            try:
                self._remove_mig(entry)
            except Exception as undo:   # left in the checkpoint: the next prepare or unprepare retries
                self.log({"event": "mig_undo_failed", "claim": shown, "error": str(undo)})
                raise ClaimError(f"claim {shown}: {e}; undoing it failed too: {undo}") from None
            del self.claims[uid]
            checkpoint.save(self.checkpoint_path, self.claims)
            if isinstance(e, (slices.VgpuError, cdi.VersionTooLow, nvml.DeviceError, nvml.NvmlUnavailable)):
                raise ClaimError(f"claim {shown}: {_describe(e)}") from None
            raise
        entry["state"] = "prepared"
        checkpoint.save(self.checkpoint_path, self.claims)
        self.log({"event": "prepared", "claim": shown, "uid": uid,
                  "mig": [{k: rec.get(k) for k in ("device", "profile", "placement", "gpu_instance", "uuid",
                                                    "static")} for rec in entry["mig"]]})
        return answer

    def _slices_on(self, index) -> list:
        """Names of the software slices holding GPU `index` (one whose quota cannot be read
        counts: it may be one being made)."""
        out = []
        for name in slices.list_names(self.slice_dir):
            try:
                if slices.has_mig(self.slice_dir, name) or index not in slices.read_quota(self.slice_dir, name).held():
                    continue
            except slices.VgpuError:
                pass
            out.append(name)
        return out

    def _remove_mig(self, entry):
        """Destroy the instances the entry made (not those made by hand), also one an agent
        made but died before recording (found by its intended placement); then the spec.
        Busy (a process still on an instance) propagates: the kubelet retries."""
        made = [r for r in entry["mig"] if not r.get("static")]
        recorded = {(r["gpu_uuid"], r["profile_id"], r["placement"]["start"]) for r in made}
        for i in entry.get("mig_intent") or []:
            if (i["gpu_uuid"], i["profile_id"], i["start"]) not in recorded:
                found = _instance_at(i)
                if found:
                    made.append(found)
        others = {(i["gpu_uuid"]) for e in self.claims.values() if e is not entry
                  for i in e.get("mig_intent") or []}
        for record in made:
            result = mig.destroy_instance(record, disable_mig=record["gpu_uuid"] not in others)
            self.log({"event": "mig_destroyed", "device": record["device"], "gpu_instance": record["gpu_instance"],
                      "destroyed": result["destroyed"], "mig_mode_off": result.get("mig_mode_off"),
                      "warnings": result["warnings"]})
            entry["mig"] = [r for r in entry["mig"] if r is not record]
            entry["mig_intent"] = [i for i in entry.get("mig_intent") or []
                                   if (i["gpu_uuid"], i["profile_id"], i["start"]) !=
                                   (record["gpu_uuid"], record["profile_id"], record["placement"]["start"])]
        cdi.remove(entry["cdi_spec"])


def _mig_mode_on(index) -> bool:
    try:
        return bool(nvml.mig_enabled(index))
    except (nvml.DeviceError, nvml.NvmlUnavailable):
        return False


def _minor(index) -> int:
    """The GPU's minor number (/dev/nvidia<minor>, `gpu<minor>` in mig-minors)."""
    try:
        return nvml.minor_number(index)
    except (nvml.DeviceError, nvml.NvmlUnavailable):
        return index


def _mig_devices(index):
    """{GPU instance ID: (compute instance ID, MIG UUID)} of a GPU's MIG devices."""
    out = {}
    for m in nvml.mig_devices(index):
        out.setdefault(m.gpu_instance, (m.compute_instance, m.uuid))
    return out


def _static_record(gpu, instance) -> dict:
    """The record of an instance made by hand: its MIG device as it is (never destroyed)."""
    found = _mig_devices(gpu.index).get(instance.gpu_instance)
    if found is None:
        raise ClaimError(f"GPU instance {instance.gpu_instance} on {gpu.name} has no compute instance (no MIG "
                         "device to give)")
    return {"static": True, "device": gpu.index, "gpu_uuid": gpu.uuid, "profile": instance.profile,
            "profile_id": instance.profile_id, "placement": {"start": instance.start, "size": instance.size},
            "gpu_instance": instance.gpu_instance, "compute_instance": found[0], "uuid": found[1]}


def _instance_at(intent):
    """A record for the instance at an intended placement (made by an agent that died
    before recording it), or None."""
    index = nvml.index_of(intent["gpu_uuid"])
    table = mig.instances_on(intent["gpu_uuid"]) if index is not None else None
    if table is None:
        return None
    gi = next((g for g in table if (g["profile_id"], g["start"]) == (intent["profile_id"], intent["start"])), None)
    if gi is None:
        return None
    try:
        ci, uuid = _mig_devices(index).get(gi["id"], (0, ""))
    except nvml.DeviceError:
        ci, uuid = 0, ""
    return {"device": intent["device"], "gpu_uuid": intent["gpu_uuid"], "profile": gi["profile"],
            "profile_id": gi["profile_id"], "placement": {"start": gi["start"], "size": gi["size"]},
            "gpu_instance": gi["id"], "compute_instance": ci, "uuid": uuid}
