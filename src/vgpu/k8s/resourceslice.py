"""This node's GPUs as a resource.k8s.io/v1 ResourceSlice, and keeping it published.

Each GPU is one device with allowMultipleAllocations (KEP-5075 consumable capacity), so
the scheduler hands out parts of it: `memory` in bytes and `sm` in percent of SM time.
A claim that names no amount gets the requestPolicy default; amounts are rounded up to
the step.  The pool is the node's name, one slice per pool; its generation goes up each
time the devices change, as the API asks.

Bodies go to the client as plain dicts, not model objects: every `kubernetes` release
the package allows takes them (34-36 have no `from_dict`; 37 validates the dict into its
model).  Answers are read through attributes both kinds of model have.

The kubelet deletes the node's slices when it starts and 30 s after losing the plugin;
Publisher.watch sees that (a watch on this node's slices of this driver) and wakes the
agent, which publishes again at once instead of on its next rescan.
"""
import random
from dataclasses import dataclass

MEMORY_STEP = 256 << 20         # 256Mi
MEMORY_DEFAULT = 1 << 30        # 1Gi
SM_DEFAULT = 10          # percent: a claim naming only memory does not take a whole GPU's time


@dataclass(frozen=True)
class Gpu:
    index: int
    model: str
    uuid: str
    memory: int          # bytes

    @property
    def name(self) -> str:
        return f"gpu-{self.index}"


def inventory() -> list:
    """The usable GPUs NVML sees (simgpu's on a machine without one).  A GPU NVML cannot
    read (lost, no memory size) is left out: published with no capacity, the API server
    would refuse the whole slice."""
    from .. import nvml
    return [Gpu(d["index"], d["name"], d["uuid"] or f"index-{d['index']}", d["memory_total"])
            for d in nvml.devices() if d["memory_total"]]


def device(gpu: Gpu) -> dict:
    return {
        "name": gpu.name,
        "allowMultipleAllocations": True,
        "attributes": {"model": {"string": gpu.model}, "uuid": {"string": gpu.uuid}, "index": {"int": gpu.index}},
        "capacity": {
            "memory": {"value": str(gpu.memory),
                       "requestPolicy": {"default": str(MEMORY_DEFAULT),
                                         "validRange": {"min": str(MEMORY_STEP), "step": str(MEMORY_STEP)}}},
            "sm": {"value": "100",
                   "requestPolicy": {"default": str(SM_DEFAULT),
                                     "validRange": {"min": "1", "max": "100", "step": "1"}}},
        },
    }


def slice_name(node: str, driver: str) -> str:
    return f"{node}-{driver}"


def resource_slice(node: str, driver: str, gpus: list, generation: int, node_uid=None) -> dict:
    meta = {"name": slice_name(node, driver)}
    if node_uid:   # garbage-collected with the Node object
        meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid,
                                    "controller": True}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": meta,
            "spec": {"driver": driver, "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                     "devices": [device(g) for g in sorted(gpus, key=lambda g: g.index)]}}


def _comparable(devices: list):
    """Devices with every capacity quantity as a number: the API server may write "24Gi"
    for the "25769803776" we sent, which is the same slice."""
    from kubernetes.utils import parse_quantity

    def walk(v, in_capacity):
        if isinstance(v, dict):
            return {k: walk(x, in_capacity or k == "capacity") for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x, in_capacity) for x in v]
        return parse_quantity(v) if in_capacity and isinstance(v, str) else v
    return walk(devices, False)


WATCH_SECONDS = 290   # one watch request's length (the server ends it; the next one resumes)


class Publisher:
    """Keeps exactly one ResourceSlice for (node, driver) equal to the GPUs it is given."""

    def __init__(self, api_client, node: str, driver: str, log, timeout=10):
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

    def sync(self, gpus: list) -> str:
        """Publish `gpus`; returns "created", "updated" or "unchanged".  API errors propagate
        (the caller retries on its next round)."""
        existing = self.resource.list_resource_slice(field_selector=self.selector,
                                                     _request_timeout=self.timeout).items
        mine = slice_name(self.node, self.driver)
        for other in existing:
            if other.metadata.name != mine:    # e.g. left by an older agent under another name
                self.resource.delete_resource_slice(other.metadata.name, _request_timeout=self.timeout)
        current = next((s for s in existing if s.metadata.name == mine), None)
        if current is None:
            body = resource_slice(self.node, self.driver, gpus, 1, self._owner())
            stored = self.resource.create_resource_slice(body, _request_timeout=self.timeout)
            self._written(gpus, body, stored)
            self.log({"event": "resourceslice_created", "name": mine, "devices": [g.name for g in gpus]})
            return "created"
        have = _comparable(self._devices(current))
        want = resource_slice(self.node, self.driver, gpus, current.spec.pool.generation)
        if have == _comparable(want["spec"]["devices"]) or self.written == (tuple(gpus), have):
            return "unchanged"
        body = resource_slice(self.node, self.driver, gpus, current.spec.pool.generation + 1, self._owner())
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        stored = self.resource.replace_resource_slice(mine, body, _request_timeout=self.timeout)
        self._written(gpus, body, stored)
        self.log({"event": "resourceslice_updated", "name": mine, "generation": body["spec"]["pool"]["generation"],
                  "devices": [g.name for g in gpus]})
        return "updated"

    def _devices(self, model) -> list:
        return self.api_client.sanitize_for_serialization(model).get("spec", {}).get("devices") or []

    def _written(self, gpus, body, stored):
        kept = self._devices(stored)
        self.written = (tuple(gpus), _comparable(kept))
        self.written_version = stored.metadata.resource_version
        if _comparable(kept) != _comparable(body["spec"]["devices"]):
            self.log({"event": "resourceslice_fields_dropped",
                      "error": "the API server did not keep allowMultipleAllocations or the capacity request "
                               "policies: enable the DRAConsumableCapacity feature gate (API server, scheduler, "
                               "kubelet), or every claim gets a whole GPU"})

    def _news(self, kind, obj) -> bool:
        """Whether a watch event may need a sync: any deletion, any slice but our last write."""
        meta = (obj or {}).get("metadata") or {}
        return kind == "DELETED" or meta.get("name") != slice_name(self.node, self.driver) or \
            meta.get("resourceVersion") != self.written_version

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
                    mine = slice_name(self.node, self.driver)
                    if [s.metadata.name for s in listed.items] != [mine]:   # gone while we were not watching
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
