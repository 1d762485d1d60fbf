"""A stand-in for the kubelet's side of DRA that applies the kubelet's own rules, not the
plugin's idea of them.  Written from the kubelet (pkg/kubelet/cm/dra: manager.go,
claiminfo.go, plugin/: registration, the plugin manager, the 45 s call timeout) and the
published DRA gRPC API, over unix sockets with real gRPC:

- start(): as a starting kubelet, it deletes every ResourceSlice of its node (all
  drivers: none has registered yet) with one DeleteCollection, then registers plugins.
- register(): finds the registration socket, asks GetInfo, checks the plugin type, picks
  the newest DRA service the plugin lists that it knows (by the exact strings the kubelet
  compares), reports registration, then dials the endpoint the plugin named.
- prepare()/unprepare(): NodePrepareResources / NodeUnprepareResources with the kubelet's
  45 s deadline.  An answer for a claim it did not ask about, or one left out, is an error
  (KubeletError), as the kubelet fails the pod's start on it.  For each prepared claim it
  records every device as the kubelet's claim info does: pool, device, request_names as
  sent, the CDI device IDs, and share_id (None when the plugin sent none).
- cdi_devices(uid, request): the IDs a container gets from one of its
  `resources.claims[]` entries: `request` is what the container names (a main request:
  the Pod API has no subrequests there; "" for the whole claim); a device serves it when
  it lists no request names or lists that one exactly.
- container(*refs): what the runtime then does with those IDs: resolve them with the CDI
  library of `runtime` (tests/helpers/k8s/cdi.py), or fail with "unresolvable CDI devices".
- watch_health(): as a kubelet with ResourceHealthStatus (KEP-4680; beta, on by default in
  1.36) does once a plugin registered, it opens the plugin's NodeWatchResources stream
  (dra-health v1alpha1) on the plugin's endpoint and keeps each device's last health; a
  plugin answering UNIMPLEMENTED reports none.  health(uid) is what the pod's
  `allocatedResourcesStatus` would say for a prepared claim's devices: the last health
  sent, "Unknown" once its health_check_timeout_seconds passed without an update.

`api_level`: "1.35" (v1 with share_id), "1.34" (v1 as 1.34 had it: no share_id, so the
field arrives as an unknown one) or, with prefer=("v1beta1.DRAPlugin",), a v1beta1
kubelet.  The older message classes are made here from the v1 descriptor, minus share_id,
under their own package: what matters on the wire is that they lack field 5.
"""
import threading
import time

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from tests.helpers.k8s.cdi import CONTAINERD_2_0, Registry
from vgpu.k8s.protos import dra_health_v1alpha1_pb2 as dra_health
from vgpu.k8s.protos import dra_health_v1alpha1_pb2_grpc as dra_health_grpc
from vgpu.k8s.protos import dra_v1_pb2 as dra
from vgpu.k8s.protos import pluginregistration_v1_pb2 as reg
from vgpu.k8s.protos import pluginregistration_v1_pb2_grpc as reg_grpc

# the kubelet's table, newest first: what a plugin lists at registration -> the gRPC
# service it then calls (k8s.io/kubelet/pkg/apis/dra/*: DRAPluginService and the proto package)
KNOWN_SERVICES = {"v1.DRAPlugin": "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
                  "v1beta1.DRAPlugin": "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"}
CALL_TIMEOUT = 45.0      # seconds: the kubelet's timeout for every call to a DRA plugin


class KubeletError(AssertionError):
    """What the kubelet refuses in a plugin's answer (the pod does not start)."""


def _messages_without_share_id(package):
    """The DRA messages as a kubelet before 1.35 (or v1beta1) compiled them."""
    proto = descriptor_pb2.FileDescriptorProto()
    dra.DESCRIPTOR.CopyToProto(proto)
    old = proto.package
    proto.name, proto.package = f"standin/{package}.proto", package
    for message in proto.message_type:
        if message.name == "Device":
            keep = [f for f in message.field if f.name != "share_id"]
            del message.field[:]
            message.field.extend(keep)
            del message.oneof_decl[:]          # proto3 `optional` is a synthetic oneof

    def fields(messages):
        for m in messages:
            yield from m.field
            yield from fields(m.nested_type)
    for field in fields(proto.message_type):
        if field.type_name:
            field.type_name = field.type_name.replace(f".{old}.", f".{package}.")
    del proto.service[:]
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {m.name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{m.name}"))
            for m in proto.message_type}


_CURRENT = {n: getattr(dra, n) for n in ("NodePrepareResourcesRequest", "NodePrepareResourcesResponse",
                                         "NodeUnprepareResourcesRequest", "NodeUnprepareResourcesResponse", "Claim")}


class Kubelet:
    def __init__(self, registration_socket, prefer=tuple(KNOWN_SERVICES), api=None, node=None, cdi_dirs=(),
                 runtime=CONTAINERD_2_0, api_level="1.35", timeout=CALL_TIMEOUT):
        """api: an ApiClient (the kubelet's own credentials) for start()'s wipe; node: its
        node name; cdi_dirs and runtime: where and how container() resolves CDI devices."""
        self.registration_socket = registration_socket
        self.prefer, self.api, self.node, self.timeout = prefer, api, node, timeout
        self.runtime = Registry(cdi_dirs, runtime)
        self.api_level = api_level
        self.info = self.service = None
        self.channels = []
        self.prepared = {}         # claim uid -> [Device], as the kubelet's claim info holds them
        self.messages = _CURRENT

    def _channel(self, path):
        channel = grpc.insecure_channel(f"unix://{path}")
        grpc.channel_ready_future(channel).result(timeout=10)
        self.channels.append(channel)
        return channel

    # === start and registration ===

    def start(self):
        """A kubelet starting: its node's ResourceSlices go (every driver's), then plugins
        register.  Returns the plugin info."""
        if self.api is not None:
            from kubernetes import client
            client.ResourceV1Api(self.api).delete_collection_resource_slice(
                field_selector=f"spec.nodeName={self.node}", _request_timeout=10)
        return self.register()

    def register(self):
        stub = reg_grpc.RegistrationStub(self._channel(self.registration_socket))
        self.info = stub.GetInfo(reg.InfoRequest(), timeout=10)
        if self.info.type != "DRAPlugin":
            error = f"plugin type {self.info.type!r} is not DRAPlugin"
        else:
            version = next((v for v in self.prefer if v in self.info.supported_versions), None)
            self.service = KNOWN_SERVICES.get(version)
            error = "" if self.service else (f"none of services supported by the plugin "
                                             f"{list(self.info.supported_versions)} are supported by the kubelet")
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=not error, error=error), timeout=10)
        if error:
            raise AssertionError(error)
        if self.service.endswith(".v1beta1.DRAPlugin"):
            self.messages = _messages_without_share_id("k8s.io.kubelet.pkg.apis.dra.v1beta1")
        elif self.api_level == "1.34":
            self.messages = _messages_without_share_id("k8s.io.kubelet.pkg.apis.dra.v1")
        self.dra = self._channel(self.info.endpoint)
        return self.info

    # === the DRA calls ===

    def _call(self, method, request, response_class, timeout):
        call = self.dra.unary_unary(f"/{self.service}/{method}", request_serializer=type(request).SerializeToString,
                                    response_deserializer=response_class.FromString)
        return call(request, timeout=self.timeout if timeout is None else timeout)

    def _request(self, kind, claims):
        m = self.messages
        return m[kind](claims=[m["Claim"](namespace=n, uid=u, name=c) for n, u, c in claims])

    @staticmethod
    def _check_answer(method, asked, answered):
        unknown = sorted(set(answered) - asked)
        if unknown:
            raise KubeletError(f"{method} returned result for unknown claim UID {unknown[0]}")
        if len(asked - set(answered)):
            raise KubeletError(f"{method} left out {len(asked - set(answered))} claims")

    def prepare(self, *claims, timeout=None):
        """claims: (namespace, uid, name) -> {uid: NodePrepareResourceResponse}"""
        response = self._call("NodePrepareResources", self._request("NodePrepareResourcesRequest", claims),
                              self.messages["NodePrepareResourcesResponse"], timeout)
        answers = dict(response.claims)
        self._check_answer("NodePrepareResources", {u for _, u, _ in claims}, answers)
        for uid, answer in answers.items():
            if answer.error:
                continue
            self.prepared[uid] = [
                {"pool": d.pool_name, "device": d.device_name, "request_names": list(d.request_names),
                 "cdi_device_ids": list(d.cdi_device_ids),
                 "share_id": d.share_id if "share_id" in d.DESCRIPTOR.fields_by_name and d.HasField("share_id")
                 else None}
                for d in answer.devices]
        return answers

    def unprepare(self, *claims, timeout=None):
        response = self._call("NodeUnprepareResources", self._request("NodeUnprepareResourcesRequest", claims),
                              self.messages["NodeUnprepareResourcesResponse"], timeout)
        answers = dict(response.claims)
        self._check_answer("NodeUnprepareResources", {u for _, u, _ in claims}, answers)
        for uid, answer in answers.items():
            if not answer.error:
                self.prepared.pop(uid, None)
        return answers

    # === what a container gets ===

    def cdi_devices(self, uid, request=""):
        """The CDI IDs a container referencing claim `uid` (and `request` of it, "" for the
        whole claim) is given, in the kubelet's order; KubeletError if not prepared."""
        if uid not in self.prepared:
            raise KubeletError(f"internal error: unable to get claim info for ResourceClaim {uid}")
        return [i for d in self.prepared[uid] if not request or not d["request_names"] or
                request in d["request_names"] for i in d["cdi_device_ids"]]

    # === device health (dra-health v1alpha1) ===

    def watch_health(self):
        """Open the plugin's health stream in a thread; self.devices_health: (pool, device) ->
        (health name, message, when received, timeout s); self.health_stream: "open",
        "unimplemented" or the code that ended it."""
        self.devices_health, self.health_stream = {}, "open"
        stream = dra_health_grpc.DRAResourceHealthStub(self.dra).NodeWatchResources(
            dra_health.NodeWatchResourcesRequest())
        self._health_call = stream

        def pump():
            try:
                for response in stream:
                    for d in response.devices:
                        self.devices_health[(d.device.pool_name, d.device.device_name)] = (
                            dra_health.HealthStatus.Name(d.health), d.message, time.monotonic(),
                            d.health_check_timeout_seconds or 30)
            except grpc.RpcError as e:
                self.health_stream = "unimplemented" if e.code() == grpc.StatusCode.UNIMPLEMENTED else \
                    e.code().name.lower()
        threading.Thread(target=pump, daemon=True).start()

    def health(self, uid):
        """[(pool, device, "HEALTHY" | "UNHEALTHY" | "UNKNOWN", message)] of a prepared claim's devices."""
        out = []
        for d in self.prepared.get(uid, []):
            health, message, at, timeout = self.devices_health.get((d["pool"], d["device"]), ("UNKNOWN", "", 0, 0))
            if health != "UNKNOWN" and time.monotonic() - at > timeout:
                health, message = "UNKNOWN", ""
            out.append((d["pool"], d["device"], health, message))
        return out

    def container(self, *refs):
        """refs: (uid, request) per `resources.claims[]` entry of one container -> (the CDI
        IDs, the edits the runtime applies); k8s_cdi.UnresolvableDevices if it cannot."""
        ids = [i for uid, request in refs for i in self.cdi_devices(uid, request)]
        return ids, self.runtime.inject(ids)

    def close(self):
        if getattr(self, "_health_call", None) is not None:
            self._health_call.cancel()
        for c in self.channels:
            c.close()
