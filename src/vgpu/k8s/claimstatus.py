"""Live figures of each prepared claim, written into `ResourceClaim.status.devices[]`.

For every claim this node's driver prepared, one entry per allocated device (driver, pool,
device, shareID -- the tuple the API server requires to match status.allocation) with:

    data:  slice, memory.max, memory.current, memory.peak (bytes, the shim's count),
           memory.driver (bytes the NVIDIA driver holds for the slice's processes, when NVML
           answers), sm.max, sm.used (percent of the GPU's SM time, sm.used over the last
           interval), throttled.seconds (time
           launches waited for the share, in all), oom.refusals, and processes: [{pid,
           memory, command}] as the slice's usage file and NVML tell them
    conditions: Ready (True once the slice serves the claim) and, while the node agent
           (`vgpu-ctl agent`) runs, Violating (its verdict on the slice: over-cap, gap,
           compute, with the action it took)

`kubectl vgpu` reads them (and `kubectl describe resourceclaim` prints them).  The writer
runs in the k8s-plugin process; every --claim-status-interval it reads the node's slices
once (vgpu.status.collect, the model status and metrics use) and writes a claim only if its
figures changed since the last write, and at most once per interval.  `data` is kept within
the API's 10 Ki (processes are left out from the end, `processes.omitted` says how many).

Written with server-side apply of this driver's status.devices entries only (field manager
vgpu-claim-status; the list is keyed by driver, pool, device and shareID, so the scheduler's
allocation and reservedFor, other drivers' entries and any field newer than this client stay
as the API server has them, and nothing is read first).  A MIG claim's entry names its
instance (uuid, profile, placement) and is Ready while NVML finds it.  A refusal -- 403 from
RBAC without patch on resourceclaims/status, 422 from the status strategy when the caller
lacks `associated-node:patch` on resourceclaims/driver (1.36+) -- is logged once per claim
and kind of refusal and retried with a backoff up to 5 minutes; it never touches preparing
claims.  A condition's lastTransitionTime is kept from this process's last write (a restart
starts it again).
"""
import copy
import datetime
import json
import threading
import time

from .. import mig, nvml, status as status_mod
from ..agent.state import describe_violation

DATA_MAX = 10 * 1024       # bytes of `data`, as the client serialises it (json.dumps, default separators)
API_TIMEOUT = 10
MAX_BACKOFF = 300.0
FIELD_MANAGER = "vgpu-claim-status"   # owns this driver's status.devices entries (server-side apply)
COMMAND_MAX = 80


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def device_index(device_name: str):
    """gpu-3 -> 3 (the driver names its devices after the GPU index)."""
    head, _, tail = device_name.rpartition("-")
    return int(tail) if head == "gpu" and tail.isdigit() else None


def figures(found: dict, index: int, driver_memory=None) -> dict:
    """A slice's live figures on one GPU (a vgpu.status.collect slice entry);
    driver_memory: {host pid: bytes} as NVML lists the GPU's processes, None without NVML."""
    row = next((d for d in found.get("devices") or [] if d["index"] == index), None)
    data = {"slice": found["name"]}
    if found.get("problem"):
        data["problem"] = found["problem"][:500]
    if row is None:
        return data
    data.update({"memory.max": row["memory_max"], "memory.current": row["memory_current"],
                 "memory.peak": row["memory_peak"], "sm.max": row["sm_max"] / 100,
                 "throttled.seconds": round(row["throttled_ns"] / 1e9, 3), "oom.refusals": row["oom_refusals"]})
    if row.get("sm_used") is not None:
        data["sm.used"] = round(row["sm_used"] / 100, 1)
    if "memory_driver" in row:      # the node-truth model's figure (vgpu.agent): what the driver holds
        if row["memory_driver"] is not None:
            data["memory.driver"] = row["memory_driver"]
    elif driver_memory is not None:   # else NVML's own list, for the slice's processes
        hosts = [p.get("host_pid") for p in found.get("processes") or [] if p.get("alive")]
        data["memory.driver"] = sum(driver_memory.get(h) or 0 for h in hosts if h is not None)
    layer = found.get("memory_layer") or {}
    if layer.get("layer"):      # who holds the cap: driver+shim, or shim and why (vgpu.driverlimits)
        data["memory.layer"] = layer["layer"]
        if layer.get("why"):
            data["memory.layer.why"] = layer["why"][:200]
    procs = []
    for p in found.get("processes") or []:
        if not p.get("alive"):
            continue
        memory = (p.get("memory") or {}).get(str(index), (p.get("memory") or {}).get(index, 0))
        procs.append({"pid": p["pid"], "memory": memory, "command": (p.get("command") or "")[:COMMAND_MAX]})
    data["processes"] = procs
    return fit(data)


def fit(data: dict, limit=DATA_MAX) -> dict:
    """`data` within `limit` bytes as the client will send it: processes dropped from the end."""
    if len(json.dumps(data)) <= limit:
        return data
    data = dict(data, processes=list(data.get("processes") or []))
    total = len(data["processes"])
    while data["processes"] and len(json.dumps({**data, "processes.omitted": total})) > limit:
        data["processes"].pop()
    data["processes.omitted"] = total - len(data["processes"])
    if len(json.dumps(data)) > limit:    # cannot happen with a 64-character slice name; stay valid anyway
        data = {"slice": data.get("slice", "")[:64], "problem": "figures too large for status.devices[].data"}
    return data


def ready_condition(ready: bool, previous=None, message="", mig_device=False) -> dict:
    status = "True" if ready else "False"
    since = previous.get("lastTransitionTime") if previous and previous.get("status") == status else None
    reason = ("MigInstancePrepared" if ready else "MigInstanceMissing") if mig_device else \
        ("SlicePrepared" if ready else "SliceMissing")
    return {"type": "Ready", "status": status, "reason": reason, "message": message[:1000],
            "lastTransitionTime": since or _now()}


def mig_entry(record) -> dict:
    """data, ready and message of a prepared MIG device (its mig.create_instance record, None
    when the claim has no record of it): ready while NVML finds the instance."""
    if record is None:
        return {"data": {"mig": {}, "problem": "no MIG instance is recorded for this device"}, "ready": False,
                "message": "no MIG instance is recorded for this device"}
    seen = mig.view(record)
    placement = record.get("placement")
    data = {"mig": {"uuid": record.get("uuid"), "profile": record.get("profile"),
                    "placement": placement.get("start") if isinstance(placement, dict) else placement,
                    "gpu_instance": record.get("gpu_instance")}}
    if seen["memory_total"] is not None:
        data.update({"memory.max": seen["memory_total"], "memory.current": seen["memory_used"]})
    message = f"MIG device {record.get('uuid')}" if seen["present"] else \
        f"MIG device {record.get('uuid')} is gone: {seen.get('note', '')}".rstrip(": ")
    if not seen["present"]:
        data["problem"] = message
    return {"data": data, "ready": seen["present"], "message": message}


def _key(d) -> tuple:
    """A status.devices entry's key (the list-map keys of AllocatedDeviceStatus)."""
    return (d["driver"], d["pool"], d["device"], d.get("shareID") or "")


def violating_condition(violations, previous=None) -> dict:
    """Violating: True while the node agent (vgpu-ctl agent) judges the slice in violation on
    this GPU (over-cap, gap, compute: see vgpu.agent), with what it saw and did."""
    status = "True" if violations else "False"
    since = previous.get("lastTransitionTime") if previous and previous.get("status") == status else None
    if violations:
        reason = "".join(w.capitalize() for w in str(violations[0].get("kind", "unknown")).split("-"))
        try:
            message = "; ".join(f"{v.get('kind')}: {describe_violation(v)}" for v in violations)
        except (KeyError, TypeError, ValueError):   # a verdict of a newer agent: its kinds at least
            message = ", ".join(str(v.get("kind")) for v in violations)
    else:
        reason, message = "NoViolation", "the node agent finds the slice within its quota"
    return {"type": "Violating", "status": status, "reason": reason if reason.isalnum() else "Violation",
            "message": message[:1000], "lastTransitionTime": since or _now()}


class Writer:
    """Writes the figures of driver.claims' prepared claims (see the module docstring)."""

    def __init__(self, api, driver, slice_dir, interval=5.0, log=lambda event: None, use_nvml=True):
        from kubernetes import client
        self.resource = client.ResourceV1Api(api)
        self.api = api
        self.driver, self.slice_dir, self.interval, self.log = driver, slice_dir, interval, log
        self.use_nvml = use_nvml
        self.written = {}      # uid -> the device entries last written (less lastTransitionTime)
        self.conditions = {}   # uid -> {entry key: the conditions last written}
        self.next_at = {}      # uid -> monotonic time before which it is not written again
        self.backoff = {}      # uid -> seconds
        self.refused = {}      # uid -> the kind of the last refusal logged
        self.previous = None   # the last collect(), for SM rates over the interval
        self.writes = 0

    def _prepared(self) -> dict:
        if not self.driver.lock.acquire(timeout=1.0):   # a long prepare: figures can wait a round
            return {}
        try:
            return {uid: copy.deepcopy(e) for uid, e in self.driver.claims.items() if e["state"] == "prepared"}
        finally:
            self.driver.lock.release()

    def run(self, stop):
        while not stop.wait(self.interval):
            try:
                self.round()
            except Exception as e:   # never let the figures take the driver down
                self.log({"event": "claim_status_failed", "error": f"{type(e).__name__}: {e}"[:500]})

    def round(self):
        claims = self._prepared()
        for uid in set(self.written) - set(claims):     # unprepared: forget
            for d in (self.written, self.conditions, self.next_at, self.backoff, self.refused):
                d.pop(uid, None)
        if not claims:
            return
        data = status_mod.collect(self.slice_dir, previous=self.previous, use_nvml=self.use_nvml)
        self.previous = data
        by_slice = {c["name"]: c for c in data["slices"]}
        self._violations = data.get("violations")   # None: no node agent (vgpu-ctl agent) judging
        self._driver_memory = {}
        self._nvml = data["nvml"]["available"]
        now = time.monotonic()
        for uid, entry in sorted(claims.items()):
            if now < self.next_at.get(uid, 0):
                continue
            devices = self.entries(entry, by_slice.get(entry["slice"]))
            if self.written.get(uid) == devices:
                continue
            self.write(uid, entry, devices)

    def entries(self, entry, found) -> list:
        """Our status.devices entries of a prepared claim, each with `ready` and `message`
        (what its Ready condition says) and, while the node agent judges, `violations`."""
        out = []
        records = entry.get("mig") or []   # a MIG claim's instances, in the order of its devices
        for i, d in enumerate(entry["devices"]):
            e = {"driver": self.driver.driver, "pool": d["pool_name"], "device": d["device_name"]}
            if d.get("share_id"):
                e["shareID"] = d["share_id"]
            if "mig" in entry:       # a MIG claim: its instance, not a slice
                e.update(mig_entry(records[i] if i < len(records) else None))
                out.append(e)
                continue
            index = device_index(d["device_name"])
            if found is not None and index is not None:
                e.update(data=figures(found, index, self.driver_memory(index)), ready=True,
                         message=f"slice {entry['slice']}")
            else:
                e.update(data={"slice": entry["slice"], "problem": "the slice is gone from this node"}, ready=False,
                         message="the slice is gone from this node")
            if self._violations is not None:
                e["violations"] = [v for v in self._violations if v.get("slice") == entry["slice"] and
                                   v.get("device", index) == index]
            out.append(e)
        return out

    def driver_memory(self, index):
        """{host pid: bytes} of the GPU's processes from NVML, once per round (None without it)."""
        if not getattr(self, "_nvml", False):
            return None
        if index not in self._driver_memory:
            try:
                self._driver_memory[index] = nvml.running_processes(index)
            except Exception:     # the GPU does not answer: no driver figure this round
                self._driver_memory[index] = None
        return self._driver_memory[index]

    def write(self, uid, entry, devices):
        """Apply our entries of the claim's status.devices (server-side apply, field manager
        FIELD_MANAGER): only that field is sent, nothing is read first, so the scheduler's
        allocation, other drivers' entries and fields newer than this client are untouched."""
        from kubernetes.client.exceptions import ApiException
        ns, name = entry["namespace"], entry["name"]
        body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": ns},
                "status": {"devices": self.applied(uid, devices)}}
        try:
            response = self.resource.patch_namespaced_resource_claim_status(
                name, ns, body, field_manager=FIELD_MANAGER, force=True,
                _content_type="application/apply-patch+yaml", _preload_content=False, _request_timeout=API_TIMEOUT)
            response.release_conn()
        except ApiException as e:
            if e.status == 404:
                return self._forget(uid)
            return self._refused(uid, ns, name, e)
        except Exception as e:          # unreachable, timed out
            return self._refused(uid, ns, name, e)
        self.written[uid] = devices
        self.conditions[uid] = {_key(d): d["conditions"] for d in body["status"]["devices"]}
        self.writes += 1
        self.backoff.pop(uid, None)
        if self.refused.pop(uid, None):
            self.log({"event": "claim_status_written_again", "claim": f"{ns}/{name}"})
        self.next_at[uid] = time.monotonic() + self.interval
        return None

    def applied(self, uid, devices) -> list:
        """The entries as applied: conditions instead of ready/message/violations; a condition
        keeps its lastTransitionTime while its status stays (as this writer last wrote it)."""
        out = []
        for d in devices:
            before = (self.conditions.get(uid) or {}).get(_key(d)) or []
            was = lambda kind: next((c for c in before if c.get("type") == kind), None)   # noqa: E731
            conditions = [ready_condition(d["ready"], was("Ready"), d["message"], mig_device="mig" in d["data"])]
            if "violations" in d:
                conditions.append(violating_condition(d["violations"], was("Violating")))
            out.append({**{k: v for k, v in d.items() if k not in ("ready", "message", "violations")},
                        "conditions": conditions})
        return out

    def _forget(self, uid):
        self.written.pop(uid, None)
        self.next_at[uid] = time.monotonic() + MAX_BACKOFF     # the kubelet unprepares it soon
        return None

    def _refused(self, uid, ns, name, e):
        from kubernetes.client.exceptions import ApiException
        if isinstance(e, ApiException):
            try:
                message = json.loads(e.body).get("message", "")
            except (TypeError, ValueError, AttributeError):
                message = e.reason or ""
            kind, text = e.status, f"API server said {e.status} {e.reason}: {message}"
        else:
            kind, text = type(e).__name__, f"{type(e).__name__}: {e}"
        hint = ""
        if kind in (403, 422) and ("forbidden" in text.lower()):
            hint = ("grant patch on resourceclaims/status and associated-node:patch on resourceclaims/driver "
                    f"named {self.driver.driver} (deploy/dra/rbac.yaml)")
        if self.refused.get(uid) != kind:
            self.refused[uid] = kind
            self.log({"event": "claim_status_refused", "claim": f"{ns}/{name}", "error": text[:600],
                      **({"hint": hint} if hint else {})})
        self.backoff[uid] = min(MAX_BACKOFF, max(self.interval, 2 * self.backoff.get(uid, self.interval / 2)))
        self.next_at[uid] = time.monotonic() + self.backoff[uid]
        return None


def start(api, driver, slice_dir, interval, stop, log, use_nvml=True):
    """The writer in a daemon thread (None when interval is 0: figures off)."""
    if not interval:
        return None
    writer = Writer(api, driver, slice_dir, interval, log, use_nvml)
    threading.Thread(target=writer.run, args=(stop,), name="claim-status", daemon=True).start()
    return writer
