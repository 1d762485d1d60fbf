"""This node's GPUs as a resource.k8s.io/v1 ResourceSlice, and keeping it published.

Each GPU is one device with allowMultipleAllocations (KEP-5075 consumable capacity), so
the scheduler hands out parts of it: `memory` in bytes and `sm` in percent of SM time.
A claim that names no amount gets the requestPolicy default; amounts are rounded up to
the step.  The pool is the node's name, one slice per pool; its generation goes up each
time the devices change, as the API asks.
"""
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
        from kubernetes import client
        existing = self.resource.list_resource_slice(
            field_selector=f"spec.nodeName={self.node},spec.driver={self.driver}", _request_timeout=self.timeout).items
        mine = slice_name(self.node, self.driver)
        for other in existing:
            if other.metadata.name != mine:    # e.g. left by an older agent under another name
                self.resource.delete_resource_slice(other.metadata.name, _request_timeout=self.timeout)
        current = next((s for s in existing if s.metadata.name == mine), None)
        if current is None:
            body = resource_slice(self.node, self.driver, gpus, 1, self._owner())
            stored = self.resource.create_resource_slice(client.V1ResourceSlice.from_dict(body),
                                                         _request_timeout=self.timeout)
            self._written(gpus, body, stored)
            self.log({"event": "resourceslice_created", "name": mine, "devices": [g.name for g in gpus]})
            return "created"
        have = _comparable(self._devices(current))
        want = resource_slice(self.node, self.driver, gpus, current.spec.pool.generation)
        if have == _comparable(want["spec"]["devices"]) or self.written == (tuple(gpus), have):
            return "unchanged"
        body = resource_slice(self.node, self.driver, gpus, current.spec.pool.generation + 1, self._owner())
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        stored = self.resource.replace_resource_slice(mine, client.V1ResourceSlice.from_dict(body),
                                                      _request_timeout=self.timeout)
        self._written(gpus, body, stored)
        self.log({"event": "resourceslice_updated", "name": mine, "generation": body["spec"]["pool"]["generation"],
                  "devices": [g.name for g in gpus]})
        return "updated"

    def _devices(self, model) -> list:
        return self.api_client.sanitize_for_serialization(model).get("spec", {}).get("devices") or []

    def _written(self, gpus, body, stored):
        kept = self._devices(stored)
        self.written = (tuple(gpus), _comparable(kept))
        if _comparable(kept) != _comparable(body["spec"]["devices"]):
            self.log({"event": "resourceslice_fields_dropped",
                      "error": "the API server did not keep allowMultipleAllocations or the capacity request "
                               "policies: enable the DRAConsumableCapacity feature gate (API server, scheduler, "
                               "kubelet), or every claim gets a whole GPU"})
