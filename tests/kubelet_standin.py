"""A stand-in for the kubelet's side of DRA, built from the same .proto files as the agent.

It does what the kubelet does with a DRA plugin: finds the registration socket, asks
GetInfo, checks the plugin type, picks the newest DRA version the plugin lists that it
knows (by the exact strings the kubelet compares), reports registration, then calls
NodePrepareResources / NodeUnprepareResources on the endpoint the plugin named -- all
over unix sockets with real gRPC.
"""
import grpc

from vgpu.k8s.protos import dra_v1_pb2 as dra
from vgpu.k8s.protos import pluginregistration_v1_pb2 as reg
from vgpu.k8s.protos import pluginregistration_v1_pb2_grpc as reg_grpc

# the kubelet's table, newest first: what a plugin lists at registration -> the gRPC
# service it then calls (k8s.io/kubelet/pkg/apis/dra/*: DRAPluginService and the proto package)
KNOWN_SERVICES = {"v1.DRAPlugin": "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
                  "v1beta1.DRAPlugin": "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"}


class Kubelet:
    def __init__(self, registration_socket, prefer=tuple(KNOWN_SERVICES)):
        self.registration_socket = registration_socket
        self.prefer = prefer
        self.info = self.service = None
        self.channels = []

    def _channel(self, path):
        channel = grpc.insecure_channel(f"unix://{path}")
        grpc.channel_ready_future(channel).result(timeout=10)
        self.channels.append(channel)
        return channel

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
        self.dra = self._channel(self.info.endpoint)
        return self.info

    def _call(self, method, request, response_class):
        call = self.dra.unary_unary(f"/{self.service}/{method}", request_serializer=type(request).SerializeToString,
                                    response_deserializer=response_class.FromString)
        return call(request, timeout=30)

    def prepare(self, *claims):
        """claims: (namespace, uid, name) -> {uid: NodePrepareResourceResponse}"""
        request = dra.NodePrepareResourcesRequest(claims=[dra.Claim(namespace=n, uid=u, name=m) for n, u, m in claims])
        return dict(self._call("NodePrepareResources", request, dra.NodePrepareResourcesResponse).claims)

    def unprepare(self, *claims):
        request = dra.NodeUnprepareResourcesRequest(claims=[dra.Claim(namespace=n, uid=u, name=m)
                                                            for n, u, m in claims])
        return dict(self._call("NodeUnprepareResources", request, dra.NodeUnprepareResourcesResponse).claims)

    def close(self):
        for c in self.channels:
            c.close()
