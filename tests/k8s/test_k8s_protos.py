"""The DRA and registration protos: stubs in sync with them, wire names as the kubelet's.

The .proto files are written from the published kubelet API; what makes two programs
interoperate is the full service and method names and the field numbers and types,
checked here against that API (a wrong number would still "work" between two copies of
our own stubs, and fail against a real kubelet).
"""
import importlib.util
import sys

from google.protobuf.descriptor import FieldDescriptor as F

from tests.helpers.paths import ROOT
from vgpu.k8s.protos import dra_health_v1alpha1_pb2, dra_v1_pb2, pluginregistration_v1_pb2



def _fields(message):
    return {f.name: (f.number, f.type, f.is_repeated) for f in message.fields}


def test_dra_service_and_methods_are_the_kubelets():
    service = dra_v1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert service.full_name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    assert {m.name: (m.input_type.name, m.output_type.name) for m in service.methods} == {
        "NodePrepareResources": ("NodePrepareResourcesRequest", "NodePrepareResourcesResponse"),
        "NodeUnprepareResources": ("NodeUnprepareResourcesRequest", "NodeUnprepareResourcesResponse")}


def test_each_registered_version_names_a_service_the_plugin_serves():
    from vgpu.k8s import plugin
    # the kubelet lists "v1.DRAPlugin" and calls /k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/...
    served = {plugin.DRA_V1, plugin.DRA_V1BETA1}
    assert plugin.SUPPORTED_VERSIONS == ("v1.DRAPlugin", "v1beta1.DRAPlugin")
    assert {f"k8s.io.kubelet.pkg.apis.dra.{v}" for v in plugin.SUPPORTED_VERSIONS} == served
    assert plugin.DRA_V1 == dra_v1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].full_name


def test_dra_field_numbers_match_the_published_api():
    m = dra_v1_pb2.DESCRIPTOR.message_types_by_name
    S, MSG = F.TYPE_STRING, F.TYPE_MESSAGE
    assert _fields(m["Claim"]) == {"namespace": (1, S, False), "uid": (2, S, False), "name": (3, S, False)}
    assert _fields(m["Device"]) == {"request_names": (1, S, True), "pool_name": (2, S, False),
                                    "device_name": (3, S, False), "cdi_device_ids": (4, S, True),
                                    "share_id": (5, S, False)}
    # `optional string share_id = 5` (Kubernetes 1.35): presence is sent, unset is not ""
    assert m["Device"].fields_by_name["share_id"].has_presence
    assert _fields(m["NodePrepareResourceResponse"]) == {"devices": (1, MSG, True), "error": (2, S, False)}
    assert _fields(m["NodeUnprepareResourceResponse"]) == {"error": (1, S, False)}
    for request in ("NodePrepareResourcesRequest", "NodeUnprepareResourcesRequest"):
        assert _fields(m[request]) == {"claims": (1, MSG, True)}
    for response, value in (("NodePrepareResourcesResponse", "NodePrepareResourceResponse"),
                            ("NodeUnprepareResourcesResponse", "NodeUnprepareResourceResponse")):
        claims = m[response].fields_by_name["claims"]
        assert claims.number == 1 and claims.message_type.GetOptions().map_entry
        entry = {f.name: f for f in claims.message_type.fields}
        assert entry["key"].type == S and entry["value"].message_type.name == value


def test_registration_service_and_fields_match_the_published_api():
    d = pluginregistration_v1_pb2.DESCRIPTOR
    assert d.package == "pluginregistration"
    service = d.services_by_name["Registration"]
    assert service.full_name == "pluginregistration.Registration"
    assert [m.name for m in service.methods] == ["GetInfo", "NotifyRegistrationStatus"]
    m = d.message_types_by_name
    S = F.TYPE_STRING
    assert _fields(m["PluginInfo"]) == {"type": (1, S, False), "name": (2, S, False), "endpoint": (3, S, False),
                                        "supported_versions": (4, S, True)}
    assert _fields(m["RegistrationStatus"]) == {"plugin_registered": (1, F.TYPE_BOOL, False), "error": (2, S, False)}
    assert _fields(m["InfoRequest"]) == _fields(m["RegistrationStatusResponse"]) == {}


def test_health_service_and_fields_match_the_published_api():
    """k8s.io/kubelet pkg/apis/dra-health/v1alpha1/api.proto as tagged v0.36.1."""
    d = dra_health_v1alpha1_pb2.DESCRIPTOR
    assert d.package == "v1alpha1"
    service = d.services_by_name["DRAResourceHealth"]
    assert [(m.name, m.server_streaming) for m in service.methods] == [("NodeWatchResources", True)]
    m = d.message_types_by_name
    S, M = F.TYPE_STRING, F.TYPE_MESSAGE
    assert _fields(m["DeviceIdentifier"]) == {"pool_name": (1, S, False), "device_name": (2, S, False)}
    assert _fields(m["DeviceHealth"]) == {"device": (1, M, False), "health": (2, F.TYPE_ENUM, False),
                                          "last_updated_time": (3, F.TYPE_INT64, False),
                                          "health_check_timeout_seconds": (4, F.TYPE_INT64, False),
                                          "message": (5, S, False)}
    assert _fields(m["NodeWatchResourcesResponse"]) == {"devices": (1, M, True)}
    assert [(v.name, v.number) for v in d.enum_types_by_name["HealthStatus"].values] == \
        [("UNKNOWN", 0), ("HEALTHY", 1), ("UNHEALTHY", 2)]


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_stubs_are_what_the_protos_generate(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gen_protos
    finally:
        sys.path.pop(0)
    names = gen_protos.generate(str(tmp_path))
    assert names == ["dra_health_v1alpha1.proto", "dra_v1.proto", "pluginregistration_v1.proto"]
    # compare descriptors, not text: another grpcio-tools version words the file differently
    from google.protobuf import descriptor_pb2
    for name, checked_in in (("dra_v1", dra_v1_pb2), ("pluginregistration_v1", pluginregistration_v1_pb2),
                             ("dra_health_v1alpha1", dra_health_v1alpha1_pb2)):
        fresh = descriptor_pb2.FileDescriptorProto()
        source = (tmp_path / "vgpu" / "k8s" / "protos" / f"{name}_pb2.py").read_text()
        serialized = source.split("AddSerializedFile(", 1)[1].split(")\n", 1)[0]
        fresh.ParseFromString(eval(serialized))    # a bytes literal protoc wrote
        ours = descriptor_pb2.FileDescriptorProto()
        checked_in.DESCRIPTOR.CopyToProto(ours)
        assert fresh == ours, f"{name}_pb2.py is stale: run python tools/gen_protos.py"
        grpc_fresh = (tmp_path / "vgpu" / "k8s" / "protos" / f"{name}_pb2_grpc.py").read_text()
        grpc_ours = (ROOT / "src" / "vgpu" / "k8s" / "protos" / f"{name}_pb2_grpc.py").read_text()
        strip = lambda text: [l for l in text.splitlines() if "GENERATED_VERSION" not in l]  # noqa: E731
        assert strip(grpc_fresh) == strip(grpc_ours), f"{name}_pb2_grpc.py is stale: run python tools/gen_protos.py"
