"""The DRA driver's main loop (`vgpu-ctl k8s-plugin`; the node agent, `vgpu-ctl agent`, is
vgpu.agent): publish the GPUs, serve the kubelet, keep both current.

Fail closed where a mistake would break isolation or lose claims (a checkpoint that
cannot be read, a socket another driver holds, no GPUs to publish: refuse to start);
carry on where the next round repairs it (the API server unreachable: logged and
retried every --rescan, the kubelet's calls keep working).

The slice is published at start, on every --rescan (GPUs that appeared or vanished), and
at once when the watch on it (resourceslice.Publisher.watch) sees it deleted or changed
by someone else, or when the kubelet registers the plugin (a kubelet that restarted has
deleted the node's slices).
"""
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field

from .. import install, slices
from ..quantities import format_utc
from . import cdi, checkpoint, claimstatus, resourceslice
from .devicehealth import DeviceHealth
from .driver import Driver


API_TIMEOUT = 10     # seconds per API request: a black-holed API server must not hold the driver's lock
API_RETRIES = 1      # urllib3 retries a failed connection once (a kept-alive one the server closed)


class PluginError(slices.VgpuError):
    pass


def default_plugin_dir(driver_name: str) -> str:
    """Where the kubelet expects a DRA driver's own socket."""
    return f"/var/lib/kubelet/plugins/{driver_name}"


@dataclass
class Config:
    node_name: str
    driver_name: str = "vgpu.dev"
    plugin_dir: str = "/var/lib/kubelet/plugins/vgpu.dev"
    registry_dir: str = "/var/lib/kubelet/plugins_registry"
    cdi_dir: str = "/var/run/cdi"
    cdi_version: str = cdi.CDI_VERSION
    slice_dir: str = slices.DEFAULT_DIR
    shim_dir: str = "/opt/vgpu"
    ld_so_preload: bool = False
    gpu_cdi_devices: list = field(default_factory=list)
    lend_memory: bool = False
    kubeconfig: str = None
    rescan: float = 30.0
    claim_status_interval: float = 5.0   # live figures into ResourceClaim.status.devices (0: off)
    mig_gpus: frozenset = frozenset()    # GPUs serving MIG where a GPU must choose (versions.GpuModes)

    @property
    def dra_socket(self):
        return os.path.join(self.plugin_dir, "dra.sock")

    @property
    def registration_socket(self):
        return os.path.join(self.registry_dir, f"{self.driver_name}-reg.sock")


def api_client(kubeconfig=None):
    """An ApiClient of its own (the kubernetes package's global default is left alone)."""
    from kubernetes import client, config
    configuration = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration)
    except (config.ConfigException, OSError) as e:
        raise PluginError(f"cannot configure the Kubernetes client: {e}",
                         "run it in a pod with a service account, or pass --kubeconfig") from None
    configuration.retries = API_RETRIES
    return client.ApiClient(configuration)


def claim_reader(api):
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    resource = client.ResourceV1Api(api)

    def read(namespace, name, timeout=API_TIMEOUT):
        # every attempt (the first and each retry) may take the whole timeout of one request
        each = max(0.1, min(API_TIMEOUT, timeout) / (API_RETRIES + 1))
        try:
            return api.sanitize_for_serialization(
                resource.read_namespaced_resource_claim(name, namespace, _request_timeout=each))
        except ApiException as e:
            if e.status == 404:
                return None
            raise OSError(f"reading ResourceClaim {namespace}/{name}: API server said {e.status} {e.reason}") \
                from None
        except Exception as e:   # unreachable (urllib3's MaxRetryError), or an answer the model refuses
            raise OSError(f"reading ResourceClaim {namespace}/{name}: {type(e).__name__}: {e}"[:500]) from None
    return read


def _shim_files(config):
    shim = os.path.join(os.path.abspath(config.shim_dir), install.SHIM_NAME)
    if not os.path.isfile(shim):
        raise PluginError(f"no shim in {config.shim_dir}", f"vgpu-ctl install-shim {config.shim_dir}")
    preload = None
    if config.ld_so_preload:
        preload = os.path.join(os.path.abspath(config.shim_dir), install.PRELOAD_NAME)
        if not os.path.isfile(preload):
            raise PluginError(f"no {install.PRELOAD_NAME} in {config.shim_dir}",
                             f"vgpu-ctl install-shim {config.shim_dir} --preload-file")
    return shim, preload


def _gpus(ours=frozenset()):
    try:
        return resourceslice.inventory(ours)
    except Exception as e:   # NvmlUnavailable, or an NVMLError from a driver in trouble
        raise PluginError(f"cannot list this node's GPUs: {e}",
                         "run on a GPU node with the NVIDIA runtime (NVIDIA_VISIBLE_DEVICES=all)") from None


def _logger(log):
    """One JSON line per event, as every vgpu-ctl JSON line; one at a time (threads emit too:
    the watch, claim status, the gRPC servers, the GPU health watcher)."""
    lock = threading.Lock()

    def emit(event):
        line = json.dumps({"ts": format_utc(), **event})
        with lock:
            log(line)
    return emit


def _require_extras():
    import importlib.util

    def absent(module):
        try:
            return importlib.util.find_spec(module) is None
        except ModuleNotFoundError:    # its parent package is missing
            return True
    missing = [m for m in ("grpc", "kubernetes", "google.protobuf") if absent(m)]
    if missing:
        raise PluginError(f"the DRA driver needs the k8s extra ({', '.join(missing)} missing)",
                         "pip install 'vgpu[k8s]'")


def run(config: Config, stop, log=lambda line: print(line, file=sys.stderr, flush=True), api=None):
    """Serve until `stop` (a threading.Event) is set."""
    _require_extras()
    from . import plugin      # (here, after the check: it needs grpc, of the k8s extra)
    emit = _logger(log)
    shim, preload = _shim_files(config)
    api = api or api_client(config.kubeconfig)
    gpus = []     # the driver reads the same list; its MIG instances (checkpoint) are not taken for hand-made ones
    kick = threading.Event()     # publish now: set by the watch, a registration, an unhealthy GPU, or stop
    gpu_health = DeviceHealth(config.node_name, gpus, emit, kick.set)
    try:
        driver = Driver(config.driver_name, config.node_name, config.plugin_dir, config.cdi_dir, config.slice_dir,
                        shim, preload, claim_reader(api), gpu_health.healthy, gpu_cdi_devices=config.gpu_cdi_devices,
                        lend_memory=config.lend_memory, cdi_version=config.cdi_version, log=emit)
    except checkpoint.CheckpointError as e:
        raise PluginError(str(e), e.hint) from None
    driver.unhealthy, gpu_health.driver = gpu_health.sick, driver
    gpus[:] = _gpus(driver.mig_instances())
    if not gpus:
        raise PluginError("this node has no GPUs to publish", "run the DRA driver on GPU nodes only (nodeSelector)")
    publisher = resourceslice.Publisher(api, config.node_name, config.driver_name, emit, timeout=API_TIMEOUT,
                                        mig_gpus=config.mig_gpus)
    threading.Thread(target=lambda: (stop.wait(), kick.set()), name="stop", daemon=True).start()
    try:
        servers = plugin.Servers(driver, config.driver_name, config.dra_socket, config.registration_socket, emit,
                                 on_registered=kick.set, health_feed=gpu_health.feed)
    except plugin.SocketBusy as e:
        raise PluginError(str(e), "stop the other DRA driver first") from None
    claimstatus.start(api, driver, config.slice_dir, config.claim_status_interval, stop, emit)
    emit({"event": "serving", "driver": config.driver_name, "node": config.node_name,
          "dra_socket": config.dra_socket, "registration_socket": config.registration_socket,
          "gpus": [g.name for g in gpus], "prepared_claims": len(driver.claims),
          "mig": {g.name: "static" if g.mig_instances else "dynamic" for g in gpus if g.mig_profiles}})
    watcher, rescanned = None, time.monotonic()
    gpu_health.start()
    try:
        while not stop.is_set():
            kick.clear()
            try:
                publisher.sync(gpu_health.healthy())
            except Exception as e:   # the API server is down or refused: the next round retries
                emit({"event": "publish_failed", "error": f"{type(e).__name__}: {e}"[:500]})
            if watcher is None:      # after the first round, so that round sees the API server first
                watcher = threading.Thread(target=publisher.watch, args=(stop, kick.set), name="watch", daemon=True)
                watcher.start()
            kick.wait(max(0.0, rescanned + config.rescan - time.monotonic()))
            if stop.is_set():
                break
            if time.monotonic() - rescanned >= config.rescan:
                rescanned = time.monotonic()
                try:   # GPUs that appeared or vanished, MIG instances made or destroyed by hand; under the
                    with driver.lock:   # driver's lock, so an instance being made is already in its checkpoint
                        gpus[:] = _gpus(driver.mig_instances())
                except PluginError as e:  # keep the last good list: claims on healthy GPUs go on
                    emit({"event": "rescan_failed", "error": str(e)})
    finally:
        gpu_health.stop()
        servers.stop()
        emit({"event": "stopped"})
