"""The kubelet-facing gRPC services, on unix sockets.

- dra.sock: the DRA plugin service, as k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin and, for
  kubelets before 1.34, ...v1beta1.DRAPlugin (registered as "v1.DRAPlugin" and
  "v1beta1.DRAPlugin", the names the kubelet looks for).  The two versions' messages are identical
  on the wire, so v1beta1 is served with the v1 message classes under its own name.
- <driver>-reg.sock in the kubelet's plugins_registry: pluginregistration.Registration.
  The kubelet notices the socket, asks GetInfo, dials the endpoint it names and reports
  back with NotifyRegistrationStatus.  dra.sock is up before the registration socket
  appears, so the kubelet never dials an endpoint that is not there yet.  A successful
  registration calls on_registered: a kubelet that (re)started has deleted the node's
  ResourceSlices, so the agent publishes again.

Each call's deadline (the kubelet's 45 s) is handed to the driver, which answers within it.
dra.sock also serves the device health service (dra-health v1alpha1.DRAResourceHealth,
KEP-4680), which the kubelet watches to put each allocated device's health in its pods'
status (`allocatedResourcesStatus`).
"""
import os
import socket
import threading
import time
from concurrent import futures

import grpc

from .protos import dra_health_v1alpha1_pb2 as dra_health
from .protos import dra_health_v1alpha1_pb2_grpc as dra_health_grpc
from .protos import dra_v1_pb2 as dra
from .protos import dra_v1_pb2_grpc as dra_grpc
from .protos import pluginregistration_v1_pb2 as reg
from .protos import pluginregistration_v1_pb2_grpc as reg_grpc

DRA_V1 = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"                # gRPC service names (method paths)
DRA_V1BETA1 = "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
# what registration lists, newest first: the kubelet matches these exact strings (its
# drapb*.DRAPluginService constants), not the gRPC names, and picks the newest it knows
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
PLUGIN_TYPE = "DRAPlugin"


class SocketBusy(Exception):
    pass


def _claims(request):
    return [(c.namespace, c.uid, c.name) for c in request.claims]


class DraService(dra_grpc.DRAPluginServicer):
    def __init__(self, driver):
        self.driver = driver

    def NodePrepareResources(self, request, context):
        response = dra.NodePrepareResourcesResponse()
        for uid, result in self.driver.prepare(_claims(request), context.time_remaining()).items():
            one = response.claims[uid]
            if "error" in result:
                one.error = result["error"]
            for d in result.get("devices", []):
                one.devices.add(**d)
        return response

    def NodeUnprepareResources(self, request, context):
        response = dra.NodeUnprepareResourcesResponse()
        for uid, error in self.driver.unprepare(_claims(request), context.time_remaining()).items():
            response.claims[uid].error = error
        return response


class DeviceHealthFeed:
    """What the health service streams: `devices()` -> [(pool, device, healthy: True, False or
    None for unknown, message)], and a change count that `changed()` moves on."""

    def __init__(self, devices):
        self.devices = devices
        self.cond = threading.Condition()
        self.version = 0
        self.halted = False

    def changed(self):
        with self.cond:
            self.version += 1
            self.cond.notify_all()

    def halt(self):
        with self.cond:
            self.halted = True
            self.cond.notify_all()


class HealthService(dra_health_grpc.DRAResourceHealthServicer):
    """NodeWatchResources: every device's health at once, then again on each change and
    every HEARTBEAT_S, each with TIMEOUT_S (after which the kubelet takes a device's health as
    unknown: an agent that died is not taken for a healthy one)."""
    HEARTBEAT_S, TIMEOUT_S = 10.0, 30

    def __init__(self, feed):
        self.feed = feed

    def _response(self):
        now = int(time.time())
        status = {True: dra_health.HEALTHY, False: dra_health.UNHEALTHY, None: dra_health.UNKNOWN}
        return dra_health.NodeWatchResourcesResponse(devices=[
            dra_health.DeviceHealth(device=dra_health.DeviceIdentifier(pool_name=pool, device_name=name),
                                    health=status[healthy], last_updated_time=now,
                                    health_check_timeout_seconds=self.TIMEOUT_S, message=(message or "")[:1024])
            for pool, name, healthy, message in self.feed.devices()])

    def NodeWatchResources(self, request, context):
        feed, sent, at = self.feed, None, 0.0
        while context.is_active():
            with feed.cond:
                feed.cond.wait_for(lambda: feed.halted or feed.version != sent, timeout=1.0)
                if feed.halted:
                    return
                version = feed.version
            if version != sent or time.monotonic() - at >= self.HEARTBEAT_S:
                sent, at = version, time.monotonic()
                yield self._response()


def _v1beta1_handler(service):
    calls = {"NodePrepareResources": (service.NodePrepareResources, dra.NodePrepareResourcesRequest,
                                      dra.NodePrepareResourcesResponse),
             "NodeUnprepareResources": (service.NodeUnprepareResources, dra.NodeUnprepareResourcesRequest,
                                        dra.NodeUnprepareResourcesResponse)}
    return grpc.method_handlers_generic_handler(DRA_V1BETA1, {
        name: grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                  response_serializer=resp.SerializeToString)
        for name, (fn, req, resp) in calls.items()})


class RegistrationService(reg_grpc.RegistrationServicer):
    def __init__(self, driver_name, endpoint, log, on_registered=lambda: None):
        self.driver_name, self.endpoint, self.log, self.on_registered = driver_name, endpoint, log, on_registered

    def GetInfo(self, request, context):
        return reg.PluginInfo(type=PLUGIN_TYPE, name=self.driver_name, endpoint=self.endpoint,
                              supported_versions=list(SUPPORTED_VERSIONS))

    def NotifyRegistrationStatus(self, request, context):
        self.log({"event": "registration", "registered": request.plugin_registered, "error": request.error})
        if request.plugin_registered:
            self.on_registered()
        return reg.RegistrationStatusResponse()


def _claim_socket(path):
    """Remove a stale socket left by a dead agent; refuse one a live agent answers on."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), 0o750, exist_ok=True)
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise SocketBusy(f"{path} is in use by a running process (another vgpu k8s-plugin?)")


def _serve(path, add):
    _claim_socket(path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))   # (a kubelet's health stream holds one)
    add(server)
    if server.add_insecure_port(f"unix://{path}") == 0:
        raise SocketBusy(f"cannot listen on {path}")
    server.start()
    return server


class Servers:
    """Both services, started in the right order; stop() removes the sockets."""

    def __init__(self, driver, driver_name, dra_socket, registration_socket, log, on_registered=lambda: None,
                 health_feed=None):
        self.paths = (registration_socket, dra_socket)
        self.health_feed = health_feed or DeviceHealthFeed(lambda: [])
        service, health = DraService(driver), HealthService(self.health_feed)
        self.dra = _serve(dra_socket, lambda s: (dra_grpc.add_DRAPluginServicer_to_server(service, s),
                                                 s.add_generic_rpc_handlers((_v1beta1_handler(service),)),
                                                 dra_health_grpc.add_DRAResourceHealthServicer_to_server(health, s)))
        registration = RegistrationService(driver_name, dra_socket, log, on_registered)
        try:
            self.reg = _serve(registration_socket,
                              lambda s: reg_grpc.add_RegistrationServicer_to_server(registration, s))
        except BaseException:
            self.dra.stop(None)
            raise

    def stop(self, grace=5):
        self.health_feed.halt()     # (its streams end now, not at their next heartbeat)
        for server in (self.reg, self.dra):   # unregister first: the kubelet stops dialling
            server.stop(grace).wait()
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
