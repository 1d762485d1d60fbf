"""A fake Kubernetes API server for the DRA node agent's tests, faked only at the HTTP boundary.

The agent talks to it with the real `kubernetes` client over real HTTP on loopback; the fake
serves just what the agent uses:

    GET    /version                                          (the `version` given, v1.37.0 by default)
    GET    /api/v1/nodes/{name}
    GET    /apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}
    GET    /apis/resource.k8s.io/v1/resourceslices          (fieldSelector, labelSelector; watch)
    POST   /apis/resource.k8s.io/v1/resourceslices
    DELETE /apis/resource.k8s.io/v1/resourceslices          (DeleteCollection, as the kubelet wipes)
    GET    /apis/resource.k8s.io/v1/resourceslices/{name}
    PUT    /apis/resource.k8s.io/v1/resourceslices/{name}
    DELETE /apis/resource.k8s.io/v1/resourceslices/{name}
    GET    /api/v1/nodes, /api/v1/pods, /api/v1/namespaces/{ns}/pods[/{name}]     (fieldSelector)
    GET    /api/v1/namespaces/{ns}/events (fieldSelector), POST (core/v1 Events)
    GET    /apis/resource.k8s.io/v1/resourceclaims, .../namespaces/{ns}/resourceclaims
    PUT    /apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}/status
    PATCH  /apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}/status  (server-side
           apply of status.devices only)
    POST   /apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates
    GET    /apis/resource.k8s.io/v1[/namespaces/{ns}]/resourceclaimtemplates      (labelSelector)
    GET, PATCH (merge: metadata only), DELETE (preconditions)
           /apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates/{name}

Identities: the kubeconfig's token is an admin (everything allowed).  `add_user(token,
username, node=..., rules=[PolicyRule...])` makes another whose every request RBAC checks
against its rules (apiGroups, resources with "res/subresource", verbs, resourceNames, "*"),
denied with the API server's 403 message.  A ResourceClaim status update follows the real
status strategy (pkg/registry/resource/resourceclaim, validation.go and utils.go of
kubernetes 1.36+): spec and metadata are kept from the stored claim; changing
status.allocation/reservedFor needs `update` on the synthetic `resourceclaims/binding`,
changing a driver's status.devices entries needs `associated-node:<verb>` on
`resourceclaims/driver` named by the driver -- tried only when the caller is a service
account whose node-name extra is the claim's one allocated node -- or else
`arbitrary-node:<verb>`; refused as a 422 with a Forbidden field error, as the strategy
does.  Each devices entry must name an allocated (driver, pool, device, shareID), have at
most 8 valid conditions and `data` a JSON object of at most 10 Ki (measured on the client's
own serialisation, json.dumps with default separators, which is what the kubernetes client
sends).

Anything else answers a 404 (405 for another method on a served path).  Errors are `Status`
objects, as a real API server sends them, so the client raises ApiException with the code.

Every resource.k8s.io object is stored as a real server stores it: defaulted, and its
quantities canonical (`helpers.k8s.defaults.stored`), so what a client reads back may differ from
what it sent.

Stricter than a real server on purpose: every POSTed/PUT body must survive
`helpers.k8s.models.roundtrip` (the official client's model), else 422 Invalid naming the field; a
real server, by default, drops an unknown field with only a warning header.  Not served:
any other PATCH, pagination (`limit` is ignored and everything comes back in one list).

Watches (`?watch=true`) stream ADDED/MODIFIED/DELETED events of ResourceSlices as chunked
JSON lines, from `resourceVersion` on (none or "0": the current objects as ADDED first),
until `timeoutSeconds`; a resourceVersion older than `compact()` left gets the ERROR
event with a 410 Status a real server sends.  `black_hole()` makes the port accept
connections and never answer (an API server behind a dead network path).

    with FakeApiServer() as api:
        api.write_kubeconfig(tmp_path / "kubeconfig")
        node_uid = api.add_node("node-a")
        api.put_claim(allocated_claim("default", "claim-1", DRIVER, "node-a", [...]))
        ... run the agent with --kubeconfig ...
        assert [s["spec"]["pool"]["name"] for s in api.slices()] == ["node-a"]
"""
import copy
import datetime
import http.server
import json
import random
import re
import secrets
import socket
import sys
import threading
import time
import uuid
from urllib.parse import parse_qsl, unquote, urlsplit

from tests.helpers.k8s.defaults import stored as defaulted
from tests.helpers.k8s.models import roundtrip

RESOURCE_API = "resource.k8s.io/v1"
_SLICES = "/apis/resource.k8s.io/v1/resourceslices"
_NODE_RE = re.compile(r"^/api/v1/nodes/([^/]+)$")
_CLAIM_RE = re.compile(r"^/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/resourceclaims/([^/]+)$")
_SLICE_RE = re.compile(r"^/apis/resource\.k8s\.io/v1/resourceslices/([^/]+)$")
_CLAIMS_RE = re.compile(r"^/apis/resource\.k8s\.io/v1(?:/namespaces/([^/]+))?/resourceclaims$")
_CLAIM_STATUS_RE = re.compile(r"^/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/resourceclaims/([^/]+)/status$")
_TEMPLATES_RE = re.compile(r"^/apis/resource\.k8s\.io/v1(?:/namespaces/([^/]+))?/resourceclaimtemplates$")
_TEMPLATE_RE = re.compile(r"^/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/resourceclaimtemplates/([^/]+)$")
_PODS_RE = re.compile(r"^/api/v1(?:/namespaces/([^/]+))?/pods$")
_POD_RE = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
_NODES = "/api/v1/nodes"
_EVENTS_RE = re.compile(r"^/api/v1/namespaces/([^/]+)/events$")
# the field selectors the API server supports on core Events (pkg/registry/core/event/strategy.go
# ToSelectableFields); `kubectl describe pod` asks name, namespace, kind and uid of the pod
# (client-go typed/core/v1/event_expansion.go GetFieldSelector), so an Event without the
# pod's uid is never shown there
_EVENT_FIELDS = {f"involvedObject.{k}": (lambda k: lambda o: (o.get("involvedObject") or {}).get(k))(k)
                 for k in ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")}
_EVENT_FIELDS.update({"reason": lambda o: o.get("reason"), "type": lambda o: o.get("type"),
                      "source": lambda o: (o.get("source") or {}).get("component"),
                      "metadata.name": lambda o: o["metadata"].get("name"),
                      "metadata.namespace": lambda o: o["metadata"].get("namespace")})
_POD_FIELDS = {
    "metadata.name": lambda o: o.get("metadata", {}).get("name"),
    "metadata.namespace": lambda o: o.get("metadata", {}).get("namespace"),
    "spec.nodeName": lambda o: o.get("spec", {}).get("nodeName"),
    "status.phase": lambda o: o.get("status", {}).get("phase"),
}
_CONDITION_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
DEVICE_STATUS_DATA_MAX = 10 * 1024           # resource.AllocatedDeviceStatusDataMaxLength
DEVICE_STATUS_MAX_CONDITIONS = 8             # resource.AllocatedDeviceStatusMaxConditions
_SLICE_FIELDS = {
    "metadata.name": lambda o: o.get("metadata", {}).get("name"),
    "spec.nodeName": lambda o: o.get("spec", {}).get("nodeName"),
    "spec.driver": lambda o: o.get("spec", {}).get("driver"),
}
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?$")
_GENERATE_CHARS = "bcdfghjklmnpqrstvwxz2456789"   # the alphabet the API server uses for generateName
_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
            405: "MethodNotAllowed", 409: "Conflict", 410: "Expired", 422: "Invalid",
            429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
            504: "Timeout"}


class ApiError(Exception):
    """An error answer: HTTP code, Status reason, message."""

    def __init__(self, code, message, reason=None, details=None):
        super().__init__(message)
        self.code, self.message = code, message
        self.reason = reason or _REASONS.get(code, "Unknown")
        self.details = details


def status_object(code, message, reason=None, details=None) -> dict:
    """A `Status` failure body, as the API server sends with every error."""
    body = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason or _REASONS.get(code, "Unknown"), "code": code}
    if details:
        body["details"] = details
    return body


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_model(obj: dict):
    """`helpers.k8s.models.roundtrip(obj)` (AssertionError naming what the client's model would not keep)."""
    return roundtrip(obj)


def _validate_slice_spec(spec, version=(1, 37)) -> list:
    """What a real API server's validation would refuse in a ResourceSlice spec (a subset);
    version: (major, minor) of the server whose rules apply."""
    if not isinstance(spec, dict):
        return ["spec: Required value"]
    out = []
    driver = spec.get("driver")
    if not driver:
        out.append("spec.driver: Required value")
    elif not _DNS_SUBDOMAIN.match(driver):
        out.append(f"spec.driver: Invalid value: {driver!r}: must be a DNS subdomain")
    pool = spec.get("pool")
    if not isinstance(pool, dict):
        out.append("spec.pool: Required value")
    else:
        if not pool.get("name"):
            out.append("spec.pool.name: Required value")
        for key in ("generation", "resourceSliceCount"):
            if key not in pool or pool[key] is None:
                out.append(f"spec.pool.{key}: Required value")
        if isinstance(pool.get("resourceSliceCount"), int) and pool["resourceSliceCount"] < 1:
            out.append("spec.pool.resourceSliceCount: Invalid value: must be greater than zero")
        if isinstance(pool.get("generation"), int) and pool["generation"] < 0:
            out.append("spec.pool.generation: Invalid value: must be non-negative")
    placement = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
                 if spec.get(k) not in (None, False, "")]
    if len(placement) != 1:
        out.append("spec: Invalid value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
                   f"`perDeviceNodeSelection` is required (got {placement or 'none'})")
    seen = set()
    for i, dev in enumerate(spec.get("devices") or []):
        name = (dev or {}).get("name")
        if not name:
            out.append(f"spec.devices[{i}].name: Required value")
            continue
        if not _DNS_LABEL.match(name):
            out.append(f"spec.devices[{i}].name: Invalid value: {name!r}: must be a DNS label")
        if name in seen:
            out.append(f"spec.devices[{i}].name: Duplicate value: {name!r}")
        seen.add(name)
        for cap, val in ((dev or {}).get("capacity") or {}).items():
            value = (val or {}).get("value")
            if not isinstance(value, str) or not _QUANTITY.match(value):
                out.append(f"spec.devices[{i}].capacity[{cap}].value: Invalid value: {value!r}: "
                           "not a quantity")
    devices = spec.get("devices") or []
    if tuple(version) < (1, 35):
        if len(devices) > 128:     # ResourceSliceMaxDevices
            out.append(f"spec.devices: Too many: {len(devices)}: must have at most 128 items")
        return out + _validate_counters_134(spec, devices)
    advanced = any((d or {}).get("consumesCounters") or (d or {}).get("taints") for d in devices)
    limit = 64 if advanced else 128     # ResourceSliceMaxDevicesWithAdvancedFeatures / ResourceSliceMaxDevices
    if len(devices) > limit:
        out.append(f"spec.devices: Too many: {len(devices)}: must have at most {limit} items")
    out += _validate_counters(spec, devices)
    return out


def _validate_counters_134(spec, devices) -> list:
    """KEP-4815's rules as resource.k8s.io/v1 has them in 1.34 (kubernetes/api
    resource/v1/types.go at v0.34.0): counter sets sit in the slice whose devices use them
    ("available to be used by devices defined in the ResourceSlice"), at most 32 counters
    in all of a slice's sets (ResourceSliceMaxSharedCounters), per device one consumption
    per counter set of at most 32 counters (ResourceSliceMaxCountersPerDevice), at most 1024
    consumed counters in all of a slice's devices (ResourceSliceMaxDeviceCountersPerSlice)."""
    out = []
    shared = spec.get("sharedCounters") or []
    total = sum(len((cs or {}).get("counters") or {}) for cs in shared)
    if total > 32:
        out.append(f"spec.sharedCounters: Too many: {total}: must have at most 32 counters in all sets")
    names = {(cs or {}).get("name") for cs in shared}
    for i, cs in enumerate(shared):
        out += _check_counter_map((cs or {}).get("counters") or {}, f"spec.sharedCounters[{i}].counters")
    consumed = 0
    for i, dev in enumerate(devices):
        seen = set()
        for j, use in enumerate((dev or {}).get("consumesCounters") or []):
            where = f"spec.devices[{i}].consumesCounters[{j}]"
            cs = (use or {}).get("counterSet")
            if cs not in names:
                out.append(f"{where}.counterSet: Invalid value: {cs!r}: must reference a counter set of this slice")
            if cs in seen:
                out.append(f"{where}.counterSet: Duplicate value: {cs!r}")
            seen.add(cs)
            counters = (use or {}).get("counters") or {}
            consumed += len(counters)
            if len(counters) > 32:
                out.append(f"{where}.counters: Too many: {len(counters)}: must have at most 32 items")
            out += _check_counter_map(counters, f"{where}.counters")
    if consumed > 1024:
        out.append(f"spec.devices: Too many: {consumed} consumed counters: must have at most 1024")
    return out


def _validate_counters(spec, devices) -> list:
    """KEP-4815's rules as resource.k8s.io/v1 has them from 1.35 (types.go and the
    validation of ResourceSliceSpec): devices and sharedCounters never in one slice, at
    most 8 counter sets (unique DNS-label names) of at most 32 counters (DNS labels,
    quantities); per device at most 2 consumptions, one per counter set, of at most 32
    counters, and at most 32 attributes and capacities together.  That a consumption names
    a counter set of the pool is not checked here: the API server sees one slice at a
    time (the scheduler checks the pool)."""
    out = []
    shared = spec.get("sharedCounters") or []
    if shared and devices:
        out.append("spec: Invalid value: only one of `devices` and `sharedCounters` may be set")
    if len(shared) > 8:
        out.append(f"spec.sharedCounters: Too many: {len(shared)}: must have at most 8 items")
    names = set()
    for i, cs in enumerate(shared):
        where = f"spec.sharedCounters[{i}]"
        name = (cs or {}).get("name")
        if not name or not _DNS_LABEL.match(name):
            out.append(f"{where}.name: Invalid value: {name!r}: must be a DNS label")
        elif name in names:
            out.append(f"{where}.name: Duplicate value: {name!r}")
        names.add(name)
        counters = (cs or {}).get("counters") or {}
        if not counters:
            out.append(f"{where}.counters: Required value")
        if len(counters) > 32:
            out.append(f"{where}.counters: Too many: {len(counters)}: must have at most 32 items")
        out += _check_counter_map(counters, f"{where}.counters")
    for i, dev in enumerate(devices):
        where = f"spec.devices[{i}]"
        dev = dev or {}
        if len(dev.get("attributes") or {}) + len(dev.get("capacity") or {}) > 32:
            out.append(f"{where}: Too many: attributes and capacities must have at most 32 items together")
        uses = dev.get("consumesCounters") or []
        if len(uses) > 2:
            out.append(f"{where}.consumesCounters: Too many: {len(uses)}: must have at most 2 items")
        sets = set()
        for j, use in enumerate(uses):
            cs = (use or {}).get("counterSet")
            if not cs or not _DNS_LABEL.match(cs):
                out.append(f"{where}.consumesCounters[{j}].counterSet: Invalid value: {cs!r}: must be a DNS label")
            elif cs in sets:
                out.append(f"{where}.consumesCounters[{j}].counterSet: Duplicate value: {cs!r}")
            sets.add(cs)
            counters = (use or {}).get("counters") or {}
            if not counters:
                out.append(f"{where}.consumesCounters[{j}].counters: Required value")
            if len(counters) > 32:
                out.append(f"{where}.consumesCounters[{j}].counters: Too many: {len(counters)}: must have at most "
                           "32 items")
            out += _check_counter_map(counters, f"{where}.consumesCounters[{j}].counters")
    return out


def _check_counter_map(counters, where) -> list:
    out = []
    for name, c in counters.items():
        if not _DNS_LABEL.match(name):
            out.append(f"{where}[{name}]: Invalid value: {name!r}: must be a DNS label")
        value = (c or {}).get("value")
        if not isinstance(value, str) or not _QUANTITY.match(value):
            out.append(f"{where}[{name}].value: Invalid value: {value!r}: not a quantity")
    return out


def _stored_for_write(stored, resource, name, meta):
    """The stored object a write of `meta` is for: 404 when there is none, 409 when the
    write's uid or resourceVersion (its preconditions) is not the stored one's."""
    details = {"name": name, "group": "resource.k8s.io", "kind": resource}
    if stored is None:
        raise ApiError(404, f'{resource}.resource.k8s.io "{name}" not found', details=details)
    old = stored["metadata"]
    if meta.get("uid") and meta["uid"] != old["uid"]:
        raise ApiError(409, f"Precondition failed: UID in precondition: {meta['uid']}, UID in object meta: "
                            f"{old['uid']}")
    if meta.get("resourceVersion") and meta["resourceVersion"] != old["resourceVersion"]:
        raise ApiError(409, f'Operation cannot be fulfilled on {resource}.resource.k8s.io "{name}": the object has '
                            'been modified; please apply your changes to the latest version and try again',
                       reason="Conflict", details=details)
    return stored


def _drop_capacity_requests(claim_spec):
    """What the claim and template strategies drop from a new object while DRAConsumableCapacity
    is off (kubernetes pkg/api/resourceclaimspec/util.go,
    dropDisabledDRAResourceClaimConsumableCapacityFields): every request's and subrequest's
    `capacity`, and the constraints' distinctAttribute."""
    for c in ((claim_spec or {}).get("devices") or {}).get("constraints") or []:
        c.pop("distinctAttribute", None)
    for r in ((claim_spec or {}).get("devices") or {}).get("requests") or []:
        for one in ([r["exactly"]] if r.get("exactly") else []) + list(r.get("firstAvailable") or []):
            one.pop("capacity", None)


def _parse_selector(text, what):
    """[(key, op, value)] from `k=v,k==v,k!=v` (what a field or simple label selector holds)."""
    terms = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        m = re.match(r"^([^=!\s]+)\s*(==|=|!=)\s*([^=!\s]*)$", part)
        if not m:
            raise ApiError(400, f"unable to parse requirement: {part!r} in {what} {text!r} "
                                "(the fake serves only k=v, k==v, k!=v)")
        key, op, value = m.groups()
        terms.append((key, "!=" if op == "!=" else "=", value))
    return terms


def _matches(terms, get) -> bool:
    for key, op, value in terms:
        have = get(key)
        have = "" if have is None else str(have)
        if (have == value) != (op == "="):
            return False
    return True


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"     # keep-alive, as urllib3's connection pool expects
    # headers and body leave in separate writes: with Nagle on, each answer on a kept-alive
    # connection would wait ~40 ms for the client's delayed ACK (a real API server sets TCP_NODELAY)
    disable_nagle_algorithm = True
    server_version = "vgpu-fake-apiserver"

    def log_message(self, format, *args):   # quiet: pytest shows failures, not traffic
        pass

    def setup(self):
        super().setup()
        self.server.fake._track(self.connection, True)

    def finish(self):
        try:
            super().finish()
        finally:
            self.server.fake._track(self.connection, False)

    def _serve(self):
        fake = self.server.fake
        url = urlsplit(self.path)
        path = unquote(url.path)
        query = dict(parse_qsl(url.query, keep_blank_values=True))
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            code, body = fake._handle(self.command, path, query, self.headers, raw)
        except ApiError as e:
            code, body = e.code, status_object(e.code, e.message, e.reason, e.details)
        except Exception as e:   # a bug in the fake: say so rather than hang the client
            code, body = 500, status_object(500, f"fake API server error: {e!r}")
        if not isinstance(body, dict):    # a watch: one JSON line per event, chunked
            self._stream(code, body)
            return
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, code, events):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in events:
                line = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError:          # the client went away, or stop() cut the connection
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):   # stop() cut it
            super().handle_error(request, client_address)


class FakeApiServer:
    """An in-memory API server on 127.0.0.1 (a random free port unless `port` is given).

    Use as a context manager, or start()/stop().  stop() closes open client connections too,
    and a later start() serves the same store on the same port (an API server restart).
    """

    def __init__(self, port=0, token=None, consumable_capacity=True, partitionable_devices=True,
                 version="v1.37.0"):
        """consumable_capacity=False: the DRAConsumableCapacity feature gate is off, and
        ResourceSlices are stored without allowMultipleAllocations and requestPolicy,
        ResourceClaimTemplates without their requests' capacity.
        version: the server's gitVersion; ResourceSlices are validated by its rules (1.34's
        counter sets beside their devices, 1.35's apart).
        partitionable_devices=False: DRAPartitionableDevices is off (1.35 by default), and
        they are stored without sharedCounters and consumesCounters (the strategy drops
        fields of a disabled gate, as for any new object)."""
        self.version = version           # what GET /version says, and whose slice validation applies
        self.token = token or secrets.token_hex(16)
        self.consumable_capacity = consumable_capacity
        self.partitionable_devices = partitionable_devices
        self.requests = []          # (method, path, query dict), every request, in order
        self._port = port
        self._lock = threading.RLock()
        self._rv = 0
        self._nodes = {}            # name -> Node
        self._claims = {}           # (namespace, name) -> ResourceClaim
        self._slices = {}           # name -> ResourceSlice
        self._pods = {}             # (namespace, name) -> Pod
        self._templates = {}        # (namespace, name) -> ResourceClaimTemplate
        self._device_owners = {}    # (namespace, name) -> {status.devices key: fieldManager}
        self._core_events = []      # core/v1 Events, as created
        self._users = {}            # token -> {"username", "extra", "rules"}
        self._failures = []         # [method, path prefix, code, times left]
        self._events = []           # (resourceVersion, type, ResourceSlice) for watches
        self._compacted = 0         # watches from at or below this resourceVersion get 410
        self._changed = threading.Condition(self._lock)
        self._conns = set()
        self._httpd = None
        self._thread = None
        self._hole = None

    # --- lifecycle -------------------------------------------------------------------------
    def start(self):
        if self._httpd is not None:
            return self
        self._close_hole()
        httpd = _Server(("127.0.0.1", self._port), _Handler)
        httpd.daemon_threads = True
        httpd.fake = self
        self._port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"fake-apiserver-{self._port}", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        self._close_hole()
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        self._thread.join(timeout=5)
        with self._lock:
            conns = list(self._conns)
            self._changed.notify_all()       # open watches look at the server and end
        for conn in conns:   # keep-alive connections would otherwise still be served
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def black_hole(self):
        """Stop serving, but keep the port listening without ever accepting: a client's
        connection and request go through and no answer ever comes (start() undoes it)."""
        self.stop()
        hole = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        hole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        hole.bind(("127.0.0.1", self._port))
        hole.listen(64)
        self._hole = hole

    def _close_hole(self):
        hole, self._hole = self._hole, None
        if hole is not None:
            hole.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def write_kubeconfig(self, path, namespace="default"):
        """A kubeconfig for this server (bearer token auth); returns the path."""
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake-user", "user": {"token": self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake-user",
                                                      "namespace": namespace}}],
            "current-context": "fake",
        }
        with open(path, "w") as f:
            json.dump(config, f, indent=2)   # JSON is YAML
        return path

    # --- helpers for tests -----------------------------------------------------------------
    def add_node(self, name, labels=None) -> str:
        """Store a Node; returns its uid."""
        with self._lock:
            node = {"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name,
                                 "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
                    "spec": {}, "status": {}}
            self._stamp(node)
            self._nodes[name] = node
            return node["metadata"]["uid"]

    def delete_node(self, name):
        with self._lock:
            self._nodes.pop(name, None)

    def put_claim(self, obj) -> dict:
        """Store (or replace) a ResourceClaim dict as given (AssertionError unless the client's
        model keeps every field: see check_model); fills uid and creationTimestamp if absent
        and sets a fresh resourceVersion, as the server would.  Returns a copy of what is
        stored."""
        obj = defaulted({"apiVersion": RESOURCE_API, "kind": "ResourceClaim", **obj})
        check_model(obj)
        meta = obj.setdefault("metadata", {})
        with self._lock:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", _now())
            meta["resourceVersion"] = self._next_rv()
            self._claims[(meta.get("namespace", "default"), meta["name"])] = obj
            return copy.deepcopy(obj)

    def claim(self, namespace, name) -> dict:
        with self._lock:
            return copy.deepcopy(self._claims.get((namespace, name)))

    def claims(self) -> list:
        with self._lock:
            return [copy.deepcopy(self._claims[k]) for k in sorted(self._claims)]

    def put_pod(self, obj) -> dict:
        """Store (or replace) a Pod as given (checked against the client's model); fills uid,
        creationTimestamp and resourceVersion.  Returns a copy of what is stored."""
        obj = copy.deepcopy(obj)
        obj.setdefault("apiVersion", "v1")
        obj.setdefault("kind", "Pod")
        check_model(obj)
        meta = obj.setdefault("metadata", {})
        with self._lock:
            meta.setdefault("namespace", "default")
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", _now())
            meta["resourceVersion"] = self._next_rv()
            self._pods[(meta["namespace"], meta["name"])] = obj
            return copy.deepcopy(obj)

    def pod(self, namespace, name) -> dict:
        with self._lock:
            return copy.deepcopy(self._pods.get((namespace, name)))

    def templates(self) -> list:
        with self._lock:
            return [copy.deepcopy(self._templates[k]) for k in sorted(self._templates)]

    def add_user(self, token, username, node=None, rules=()):
        """Another identity: `username` (e.g. system:serviceaccount:NS:NAME), the node bound
        into its token (the authentication.kubernetes.io/node-name extra) and its RBAC rules
        (PolicyRule dicts, as a ClusterRole's `rules`)."""
        extra = {"authentication.kubernetes.io/node-name": [node]} if node else {}
        with self._lock:
            self._users[token] = {"username": username, "extra": extra, "rules": [dict(r) for r in rules]}

    def write_user_kubeconfig(self, path, token, namespace="default"):
        self.write_kubeconfig(path, namespace)
        config = json.loads(open(path).read())
        config["users"][0]["user"]["token"] = token
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
        return path

    def delete_claim(self, namespace, name):
        with self._lock:
            self._claims.pop((namespace, name), None)
            self._device_owners.pop((namespace, name), None)

    def slices(self) -> list:
        """Copies of the stored ResourceSlices, by name."""
        with self._lock:
            return [copy.deepcopy(self._slices[n]) for n in sorted(self._slices)]

    def delete_slice(self, name):
        """Delete a ResourceSlice as another client would (watches see it)."""
        self._delete_slice(name, None, {})

    def compact(self):
        """Forget the watch history so far, as etcd compaction does: a watch from an older
        resourceVersion gets 410 Gone."""
        with self._lock:
            self._compacted = self._rv
            self._events = [e for e in self._events if e[0] > self._compacted]

    def fail_next(self, method, path_prefix, code, times=1, message=None):
        """The next `times` requests with this method (or "*") whose path starts with
        `path_prefix` get an error `code` (a Status body) instead of being served."""
        with self._lock:
            self._failures.append([method.upper(), path_prefix, code, times, message])

    def garbage_collect(self) -> list:
        """What the garbage collector would do: delete ResourceSlices owned by a Node that is
        gone (no stored node has the ownerReference's name and uid).  Returns their names."""
        with self._lock:
            gone = []
            for name, obj in list(self._slices.items()):
                refs = [r for r in obj["metadata"].get("ownerReferences") or []
                        if r.get("kind") == "Node"]
                if refs and all(self._nodes.get(r.get("name"), {}).get("metadata", {}).get("uid")
                                != r.get("uid") for r in refs):
                    self._record("DELETED", self._slices.pop(name), deleted=True)
                    gone.append(name)
            return gone

    # --- the API -----------------------------------------------------------------------------
    def _minor_version(self) -> tuple:
        major, minor = re.match(r"^v(\d+)\.(\d+)", self.version).groups()
        return int(major), int(minor)

    def _track(self, conn, alive):
        with self._lock:
            (self._conns.add if alive else self._conns.discard)(conn)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _record(self, kind, obj, deleted=False):
        """A watch event (the caller holds the lock); a deletion gets a resourceVersion of its own."""
        obj = copy.deepcopy(obj)
        if deleted:
            obj["metadata"]["resourceVersion"] = self._next_rv()
        self._events.append((int(obj["metadata"]["resourceVersion"]), kind, obj))
        self._changed.notify_all()

    def _stamp(self, obj):
        meta = obj.setdefault("metadata", {})
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = self._next_rv()
        meta["creationTimestamp"] = _now()

    def _handle(self, method, path, query, headers, raw):
        with self._lock:
            self.requests.append((method, path, dict(query)))
        user = None
        if headers.get("Authorization") != f"Bearer {self.token}":
            with self._lock:
                user = self._users.get((headers.get("Authorization") or "").removeprefix("Bearer "))
            if user is None:
                raise ApiError(401, "Unauthorized")
            if path.rstrip("/") != "/version":   # a non-resource URL every identity may read
                self._authorize(user, method, path, query)   # (the system:public-info-viewer role)
        with self._lock:
            for failure in self._failures:
                fmethod, prefix, code, times, message = failure
                if fmethod in ("*", method) and path.startswith(prefix) and times > 0:
                    failure[3] -= 1
                    if failure[3] == 0:
                        self._failures.remove(failure)
                    raise ApiError(code, message or f"injected failure {code} for {method} {path}")

        if path.rstrip("/") == "/version":
            self._only(method, "GET")
            major, minor = self._minor_version()
            return 200, {"major": str(major), "minor": str(minor), "gitVersion": self.version,
                         "gitCommit": "0" * 40, "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
                         "goVersion": "go1.25.0", "compiler": "gc", "platform": "linux/amd64"}
        if m := _NODE_RE.match(path):
            self._only(method, "GET")
            return 200, self._get(self._nodes, m.group(1), "nodes", m.group(1))
        if path.rstrip("/") == _NODES:
            self._only(method, "GET")
            return 200, self._list("v1", "NodeList", self._nodes.values(), lambda o: True)
        if m := _EVENTS_RE.match(path):
            self._only(method, "GET", "POST")
            if method == "POST":
                return 201, self._create_event(m.group(1), self._body(raw))
            fields = _parse_selector(query.get("fieldSelector"), "field selector")
            if unknown := [k for k, _, _ in fields if k not in _EVENT_FIELDS]:
                raise ApiError(400, f'"{unknown[0]}" is not a known field selector: only "involvedObject.kind", ...')
            return 200, self._list("v1", "EventList", self._core_events,
                                   lambda o: o["metadata"]["namespace"] == m.group(1) and
                                   _matches(fields, lambda k: _EVENT_FIELDS[k](o)))
        if m := _PODS_RE.match(path):
            self._only(method, "GET")
            return 200, self._list("v1", "PodList", self._pods.values(), self._pod_filter(query, m.group(1)))
        if m := _POD_RE.match(path):
            self._only(method, "GET")
            return 200, self._get(self._pods, (m.group(1), m.group(2)), "pods", m.group(2))
        if m := _CLAIMS_RE.match(path):
            self._only(method, "GET")
            ns = m.group(1)
            return 200, self._list(RESOURCE_API, "ResourceClaimList", self._claims.values(),
                                   lambda o: ns is None or o["metadata"].get("namespace") == ns)
        if m := _CLAIM_STATUS_RE.match(path):
            self._only(method, "GET", "PUT", "PATCH")
            key = (m.group(1), m.group(2))
            if method == "GET":
                return 200, self._get(self._claims, key, "resourceclaims.resource.k8s.io", key[1])
            if method == "PATCH":
                return 200, self._apply_claim_status(key, self._body(raw), user, query, headers.get("Content-Type"))
            return 200, self._replace_claim_status(key, self._body(raw), user, query)
        if m := _TEMPLATES_RE.match(path):
            self._only(method, "GET", *(("POST",) if m.group(1) else ()))
            if method == "GET":
                labels = _parse_selector(query.get("labelSelector"), "label selector")
                return 200, self._list(RESOURCE_API, "ResourceClaimTemplateList", self._templates.values(),
                                       lambda o: m.group(1) in (None, o["metadata"].get("namespace")) and
                                       _matches(labels, lambda k: (o["metadata"].get("labels") or {}).get(k)))
            return 201, self._create_template(m.group(1), self._body(raw), query)
        if m := _TEMPLATE_RE.match(path):
            self._only(method, "GET", "PATCH", "DELETE")
            key = (m.group(1), m.group(2))
            if method == "PATCH":
                return 200, self._patch_template(key, self._body(raw), headers.get("Content-Type"))
            if method == "DELETE":
                return 200, self._delete_template(key, self._body(raw) if raw else None)
            return 200, self._get(self._templates, key, "resourceclaimtemplates.resource.k8s.io", m.group(2))
        if m := _CLAIM_RE.match(path):
            self._only(method, "GET")
            return 200, self._get(self._claims, (m.group(1), m.group(2)),
                                  "resourceclaims.resource.k8s.io", m.group(2))
        if path.rstrip("/") == _SLICES:
            self._only(method, "GET", "POST", "DELETE")
            if method == "GET" and query.get("watch") not in (None, "", "0", "false"):
                return 200, self._watch_slices(query)
            if method == "GET":
                return 200, self._list_slices(query)
            if method == "DELETE":
                return 200, self._delete_slices(query)
            return 201, self._create_slice(self._body(raw), query)
        if m := _SLICE_RE.match(path):
            name = m.group(1)
            self._only(method, "GET", "PUT", "DELETE")
            if method == "GET":
                return 200, self._get(self._slices, name, "resourceslices.resource.k8s.io", name)
            if method == "PUT":
                return 200, self._replace_slice(name, self._body(raw), query)
            return 200, self._delete_slice(name, self._body(raw) if raw else None, query)
        raise ApiError(404, "the server could not find the requested resource")

    # --- RBAC, as the authorizer sees a request ---------------------------------------------
    @staticmethod
    def _attributes(method, path, query):
        """(verb, apiGroup, resource, subresource, namespace, name) of a resource request."""
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["api"]:
            group, rest = "", parts[2:]
        else:
            group, rest = parts[1], parts[3:]
        namespace = None
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        resource = rest[0] if rest else ""
        name = rest[1] if len(rest) > 1 else ""
        sub = rest[2] if len(rest) > 2 else ""
        watching = query.get("watch") not in (None, "", "0", "false")
        verb = {"GET": "watch" if watching else ("get" if name else "list"), "POST": "create", "PUT": "update",
                "PATCH": "patch", "DELETE": "delete" if name else "deletecollection"}[method]
        return verb, group, resource, sub, namespace, name

    @staticmethod
    def _allows(rules, verb, group, resource, name) -> bool:
        """Whether RBAC PolicyRules grant verb on group/resource(/sub) named name."""
        def has(values, v):
            return "*" in values or v in values
        for r in rules:
            if has(r.get("verbs") or [], verb) and has(r.get("apiGroups") or [], group) and \
                    has(r.get("resources") or [], resource) and \
                    (not r.get("resourceNames") or name in r["resourceNames"]):
                return True
        return False

    def _authorize(self, user, method, path, query):
        verb, group, resource, sub, namespace, name = self._attributes(method, path, query)
        full = f"{resource}/{sub}" if sub else resource
        if self._allows(user["rules"], verb, group, full, name):
            return
        kind = f"{resource}.{group}" if group else resource
        what = f'{kind} "{name}"' if name else kind
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        raise ApiError(403, f'{what} is forbidden: User "{user["username"]}" cannot {verb} resource "{full}" '
                            f'in API group "{group}" {scope}',
                       details={"name": name, "group": group, "kind": resource})

    def _synthetic(self, user, verb, sub, namespace, name) -> bool:
        """The status strategy's check of a synthetic subresource (the admin may do anything)."""
        return user is None or self._allows(user["rules"], verb, "resource.k8s.io", f"resourceclaims/{sub}", name)

    # --- lists, pods, templates, claim status ------------------------------------------------
    def _list(self, api_version, kind, objects, wanted):
        with self._lock:
            items = []
            for obj in sorted(objects, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"])):
                if wanted(obj):
                    item = copy.deepcopy(obj)
                    item.pop("apiVersion", None)
                    item.pop("kind", None)
                    items.append(item)
            return {"apiVersion": api_version, "kind": kind, "metadata": {"resourceVersion": str(self._rv)},
                    "items": items}

    @staticmethod
    def _pod_filter(query, namespace):
        fields = _parse_selector(query.get("fieldSelector"), "field selector")
        for key, _, _ in fields:
            if key not in _POD_FIELDS:
                raise ApiError(400, f'field label not supported: {key}')
        labels = _parse_selector(query.get("labelSelector"), "label selector")
        return lambda o: ((namespace is None or o["metadata"].get("namespace") == namespace) and
                          _matches(fields, lambda k: _POD_FIELDS[k](o)) and
                          _matches(labels, lambda k: (o["metadata"].get("labels") or {}).get(k)))

    def _create_event(self, namespace, body):
        """A core/v1 Event, validated as pkg/apis/core/validation/events.go does for one
        without eventTime (the legacy path): the involved object's namespace is the Event's."""
        body.setdefault("apiVersion", "v1")
        body.setdefault("kind", "Event")
        meta = body.setdefault("metadata", {})
        meta.setdefault("namespace", namespace)
        try:
            check_model(body)
        except AssertionError as e:
            raise ApiError(422, f"Event is invalid: {e}")
        involved = body.get("involvedObject") or {}
        if meta["namespace"] != namespace or involved.get("namespace") != namespace:
            raise ApiError(422, f'Event "{meta.get("name") or meta.get("generateName")}" is invalid: '
                                f'involvedObject.namespace: Invalid value: "{involved.get("namespace")}": does not '
                                "match event.namespace")
        with self._lock:
            if not meta.get("name"):
                meta["name"] = (meta.get("generateName") or "") + "".join(random.choices(_GENERATE_CHARS, k=5))
            self._stamp(body)
            self._core_events.append(body)
            return copy.deepcopy(body)

    def events_of(self, namespace, name) -> list:
        """The Events `kubectl describe pod` shows for pod namespace/name: those naming the
        stored pod's uid (its field selector; see _EVENT_FIELDS)."""
        pod = self.pod(namespace, name)
        with self._lock:
            return [copy.deepcopy(e) for e in self._core_events
                    if e["involvedObject"].get("kind") == "Pod" and e["involvedObject"].get("name") == name and
                    e["involvedObject"].get("namespace") == namespace and
                    e["involvedObject"].get("uid") == pod["metadata"]["uid"]]

    def _create_template(self, namespace, body, query):
        body.setdefault("apiVersion", RESOURCE_API)
        body.setdefault("kind", "ResourceClaimTemplate")
        meta = body.setdefault("metadata", {})
        name = meta.get("name") or ""
        invalid = lambda msg: ApiError(   # noqa: E731
            422, f'ResourceClaimTemplate.resource.k8s.io "{name}" is invalid: {msg}',
            details={"name": name, "group": "resource.k8s.io", "kind": "ResourceClaimTemplate"})
        if meta.get("namespace", namespace) != namespace:
            raise ApiError(400, "the namespace of the provided object does not match the namespace sent on the "
                                "request")
        meta["namespace"] = namespace
        if not _DNS_SUBDOMAIN.match(name):
            raise invalid(f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain must consist "
                          "of lower case alphanumeric characters, '-' or '.'")
        try:
            check_model(body)
        except AssertionError as e:
            raise invalid(str(e))
        requests = (((body.get("spec") or {}).get("spec") or {}).get("devices") or {}).get("requests") or []
        for i, r in enumerate(requests):
            if not _DNS_LABEL.match(r.get("name") or ""):
                raise invalid(f"spec.spec.devices.requests[{i}].name: Invalid value: {r.get('name')!r}")
            if bool(r.get("exactly")) == bool(r.get("firstAvailable")):
                raise invalid(f"spec.spec.devices.requests[{i}]: Required value: exactly one of `exactly` or "
                              "`firstAvailable` is required")
        body = defaulted(body)
        if not self.consumable_capacity:   # the strategy drops a disabled gate's fields of a new object
            _drop_capacity_requests(body["spec"].get("spec"))
        with self._lock:
            if (namespace, name) in self._templates:
                raise ApiError(409, f'resourceclaimtemplates.resource.k8s.io "{name}" already exists',
                               reason="AlreadyExists",
                               details={"name": name, "group": "resource.k8s.io", "kind": "resourceclaimtemplates"})
            self._stamp(body)
            if query.get("dryRun") != "All":
                self._templates[(namespace, name)] = body
            return copy.deepcopy(body)

    def _patch_template(self, key, body, content_type):
        """A JSON merge patch (RFC 7386) of a template's metadata labels and annotations; the
        spec is immutable (pkg/apis/resource/validation ValidateResourceClaimTemplateUpdate)."""
        if (content_type or "").split(";")[0].strip() not in ("application/merge-patch+json",
                                                               "application/strategic-merge-patch+json"):
            raise ApiError(415, f"the fake serves merge patches of templates only, not {content_type}")
        if set(body) - {"metadata"} or set(body.get("metadata") or {}) - {"labels", "annotations"}:
            raise ApiError(422, f'ResourceClaimTemplate.resource.k8s.io "{key[1]}" is invalid: spec: Invalid '
                                "value: field is immutable (the fake patches metadata labels and annotations only)")
        with self._lock:
            stored = self._get(self._templates, key, "resourceclaimtemplates.resource.k8s.io", key[1])
            for part, changes in (body.get("metadata") or {}).items():
                merged = {**(stored["metadata"].get(part) or {}), **(changes or {})}
                stored["metadata"][part] = {k: v for k, v in merged.items() if v is not None}
            stored["metadata"]["resourceVersion"] = self._next_rv()
            self._templates[key] = stored
            return copy.deepcopy(stored)

    def _delete_template(self, key, options):
        with self._lock:
            stored = self._get(self._templates, key, "resourceclaimtemplates.resource.k8s.io", key[1])
            pre = (options or {}).get("preconditions") or {}
            for k in ("uid", "resourceVersion"):
                if pre.get(k) and pre[k] != stored["metadata"][k]:
                    raise ApiError(409, f"Precondition failed: {k} in precondition: {pre[k]}, "
                                        f"{k} in object meta: {stored['metadata'][k]}", reason="Conflict")
            del self._templates[key]
            return stored

    @staticmethod
    def _node_of(allocation) -> str:
        """nodeNameFromAllocation: the one node of a one-term, one-matchFields metadata.name In selector."""
        terms = ((allocation or {}).get("nodeSelector") or {}).get("nodeSelectorTerms") or []
        if len(terms) != 1 or terms[0].get("matchExpressions") or len(terms[0].get("matchFields") or []) != 1:
            return ""
        f = terms[0]["matchFields"][0]
        if f.get("key") != "metadata.name" or f.get("operator") != "In" or len(f.get("values") or []) != 1:
            return ""
        return f["values"][0]

    @staticmethod
    def _device_key(d):
        return (d.get("driver"), d.get("pool"), d.get("device"), d.get("shareID") or "")

    def _modified_drivers(self, new, old) -> set:
        olds = {self._device_key(d): d for d in old.get("devices") or []}
        out = set()
        for d in new.get("devices") or []:
            before = olds.pop(self._device_key(d), None)
            if before is None or before != d:
                out.add(d.get("driver"))
        return out | {d.get("driver") for d in olds.values()}

    def _validate_device_status(self, status) -> list:
        allocated = {(r.get("driver"), r.get("pool"), r.get("device"), r.get("shareID") or "")
                     for r in (((status.get("allocation") or {}).get("devices") or {}).get("results") or [])}
        out, seen = [], set()
        for i, d in enumerate(status.get("devices") or []):
            where = f"status.devices[{i}]"
            for key in ("driver", "pool", "device"):
                if not d.get(key):
                    out.append(f"{where}.{key}: Required value")
            if d.get("device") and not _DNS_LABEL.match(d["device"]):
                out.append(f"{where}.device: Invalid value: {d['device']!r}: must be a DNS label")
            if d.get("shareID") is not None and not _UUID.match(d["shareID"]):
                out.append(f"{where}.shareID: Invalid value: {d['shareID']!r}: uid must be in RFC 4122 normalized "
                           "form, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` with lowercase hexadecimal characters")
            key = self._device_key(d)
            if key in seen:
                out.append(f"{where}: Duplicate value: {key}")
            seen.add(key)
            if key not in allocated:
                out.append(f"{where}: Invalid value: {'/'.join(key).rstrip('/')}: must be an allocated device in "
                           "the claim")
            conditions = d.get("conditions") or []
            if len(conditions) > DEVICE_STATUS_MAX_CONDITIONS:
                out.append(f"{where}.conditions: Too many: {len(conditions)}: must have at most "
                           f"{DEVICE_STATUS_MAX_CONDITIONS} items")
            for j, c in enumerate(conditions):
                cw = f"{where}.conditions[{j}]"
                if not c.get("type"):
                    out.append(f"{cw}.type: Required value")
                if c.get("status") not in ("True", "False", "Unknown"):
                    out.append(f"{cw}.status: Unsupported value: {c.get('status')!r}")
                if not c.get("lastTransitionTime"):
                    out.append(f"{cw}.lastTransitionTime: Required value: must be set")
                if not c.get("reason"):
                    out.append(f"{cw}.reason: Required value")
                elif not _CONDITION_REASON.match(c["reason"]) or len(c["reason"]) > 1024:
                    out.append(f"{cw}.reason: Invalid value: {c['reason']!r}")
                if len(c.get("message") or "") > 32768:
                    out.append(f"{cw}.message: Too long")
            if "data" in d and d["data"] is not None:
                raw = json.dumps(d["data"])
                if len(raw) > DEVICE_STATUS_DATA_MAX:
                    out.append(f"{where}.data: Too long: may not be more than {DEVICE_STATUS_DATA_MAX} bytes")
                elif not isinstance(d["data"], dict):
                    out.append(f"{where}.data: Invalid value: \"<value omitted>\": must be a valid JSON object")
        return out

    def _claim_invalid(self, name, msg):
        return ApiError(422, f'ResourceClaim.resource.k8s.io "{name}" is invalid: {msg}',
                        details={"name": name, "group": "resource.k8s.io", "kind": "ResourceClaim"})

    def _stored_claim(self, key, meta):
        """The stored claim a status write is for (the caller holds the lock), after the uid and
        resourceVersion preconditions a write carries."""
        return _stored_for_write(self._claims.get(key), "resourceclaims", key[1], meta)

    def _store_claim_status(self, key, stored, new_status, user, verb, query):
        """The status strategy on a write of `verb` (update or patch), then the new status
        stored (the caller holds the lock)."""
        namespace, name = key
        old_status = stored.get("status") or {}
        problems = []
        if old_status.get("allocation") and new_status.get("allocation") != old_status["allocation"]:
            problems.append("status.allocation: Forbidden: field is immutable after it has been set")
        if (new_status.get("allocation") != old_status.get("allocation") or
                new_status.get("reservedFor") != old_status.get("reservedFor")) and \
                not self._synthetic(user, verb, "binding", namespace, ""):
            problems.append('status: Forbidden: changing status.allocation or status.reservedFor requires '
                            f'resource="resourceclaims/binding", verb="{verb}" permission')
        drivers = self._modified_drivers(new_status, old_status)
        if drivers and user is not None:
            node = self._node_of(new_status.get("allocation"))
            extra = user["extra"].get("authentication.kubernetes.io/node-name") or []
            associated = bool(node) and user["username"].startswith("system:serviceaccount:") and \
                len(extra) == 1 and extra[0] == node
            verbs = ([f"associated-node:{verb}"] if associated else []) + [f"arbitrary-node:{verb}"]
            for driver in sorted(drivers):
                if not any(self._allows(user["rules"], v, "resource.k8s.io", "resourceclaims/driver", driver)
                           for v in verbs):
                    problems.append(f'status.devices: Forbidden: changing status.devices requires '
                                    f'resource="resourceclaims/driver", verb="{verbs}" permission: '
                                    f'driver {driver}')
        problems += self._validate_device_status(new_status)
        if problems:
            raise self._claim_invalid(name, "; ".join(problems))
        obj = copy.deepcopy(stored)      # the status strategy: spec and metadata stay as stored
        obj["status"] = new_status
        obj["metadata"]["resourceVersion"] = self._next_rv()
        if query.get("dryRun") != "All":
            self._claims[key] = obj
        return copy.deepcopy(obj)

    def _replace_claim_status(self, key, body, user, query):
        name = key[1]
        meta = body.get("metadata") or {}
        if meta.get("name") != name:
            raise ApiError(400, f"the name of the object ({meta.get('name')}) does not match the name on the URL "
                                f"({name})")
        checked = copy.deepcopy(body)
        checked.setdefault("apiVersion", RESOURCE_API)
        checked.setdefault("kind", "ResourceClaim")
        checked["metadata"].pop("creationTimestamp", None)
        try:
            check_model(checked)
        except AssertionError as e:
            raise self._claim_invalid(name, str(e))
        with self._lock:
            stored = self._stored_claim(key, meta)
            new_status = defaulted({"kind": "ResourceClaim", "status": body.get("status") or {}})["status"]
            owners = self._device_owners.setdefault(key, {})
            for d in new_status.get("devices") or []:     # an update owns what it wrote (as managedFields)
                k = self._device_key(d)
                if d not in ((stored.get("status") or {}).get("devices") or []):
                    owners[k] = query.get("fieldManager") or "update"
            return self._store_claim_status(key, stored, new_status, user, "update", query)

    def _apply_claim_status(self, key, body, user, query, content_type):
        """Server-side apply of status.devices entries (list-map keyed by driver, pool, device,
        shareID: k8s.io/api resource/v1 types.go AllocatedDeviceStatus): the applied entries
        replace their namesakes, and the entries this fieldManager applied before and leaves out
        now are removed; an entry another manager owns is a 409 conflict unless force=true.
        Only status.devices is served: anything else applied is refused."""
        name = key[1]
        if (content_type or "").split(";")[0].strip() != "application/apply-patch+yaml":
            raise ApiError(415, f"the fake serves only server-side apply on resourceclaims/status, not "
                                f"{content_type}")
        manager = query.get("fieldManager")
        if not manager:
            raise ApiError(400, "PATCH, fieldManager is required for apply requests")
        meta = body.get("metadata") or {}
        if (body.get("apiVersion"), body.get("kind")) != (RESOURCE_API, "ResourceClaim") or meta.get("name") != name:
            raise ApiError(400, "an apply patch must be a resource.k8s.io/v1 ResourceClaim with the URL's name")
        if set(body.get("status") or {}) - {"devices"} or set(body) - {"apiVersion", "kind", "metadata", "status"}:
            raise self._claim_invalid(name, "the fake applies status.devices only")
        applied = defaulted({"kind": "ResourceClaim", "status": body.get("status") or {}})["status"].get("devices") or []
        force = query.get("force") in ("true", "1")
        with self._lock:
            stored = self._stored_claim(key, meta)
            owners = dict(self._device_owners.get(key) or {})
            live = {self._device_key(d): d for d in (stored.get("status") or {}).get("devices") or []}
            wanted = {self._device_key(d): d for d in applied}
            for k, d in wanted.items():
                other = owners.get(k, manager)
                if other != manager and live.get(k) not in (None, d) and not force:
                    raise ApiError(409, f'Apply failed with 1 conflict: conflict with "{other}": .status.devices'
                                        f'[driver="{k[0]}",pool="{k[1]}",device="{k[2]}"]', reason="Conflict")
            devices = [d for k, d in live.items() if k in wanted or owners.get(k) != manager]
            devices = [wanted.get(self._device_key(d), d) for d in devices] + \
                [d for k, d in wanted.items() if k not in live]
            for k in live:
                if k not in wanted and owners.get(k) == manager:
                    owners.pop(k)
            owners.update({k: manager for k in wanted})
            new_status = {**copy.deepcopy(stored.get("status") or {}), "devices": devices}
            if not devices:
                new_status.pop("devices")
            out = self._store_claim_status(key, stored, new_status, user, "patch", query)
            if query.get("dryRun") != "All":
                self._device_owners[key] = owners
            return out

    @staticmethod
    def _only(method, *allowed):
        if method not in allowed:
            raise ApiError(405, f"the server does not allow this method on the requested resource "
                                f"({method}; the fake serves {', '.join(allowed)})")

    @staticmethod
    def _body(raw):
        try:
            body = json.loads(raw or b"null")
        except ValueError as e:
            raise ApiError(400, f"the body of the request was in an unknown format: {e}")
        if not isinstance(body, dict):
            raise ApiError(400, "the body of the request must be a JSON object")
        return body

    def _get(self, store, key, resource, name):
        with self._lock:
            if key not in store:
                raise ApiError(404, f'{resource} "{name}" not found',
                               details={"name": name, "kind": resource.split(".")[0]})
            return copy.deepcopy(store[key])

    @staticmethod
    def _slice_filter(query):
        """A predicate for the query's field and label selectors (400 for what is not served)."""
        fields = _parse_selector(query.get("fieldSelector"), "field selector")
        for key, _, _ in fields:
            if key not in _SLICE_FIELDS:
                raise ApiError(400, f'field label not supported: {key}')
        labels = _parse_selector(query.get("labelSelector"), "label selector")
        return lambda obj: (_matches(fields, lambda k: _SLICE_FIELDS[k](obj)) and
                            _matches(labels, lambda k: (obj["metadata"].get("labels") or {}).get(k)))

    def _watch_slices(self, query):
        """The events a watch sends, as a generator the handler streams (see the docstring)."""
        wanted = self._slice_filter(query)
        try:
            seconds = float(query.get("timeoutSeconds") or 1800)
            start = int(query.get("resourceVersion") or 0)
        except ValueError:
            raise ApiError(400, "timeoutSeconds and resourceVersion must be numbers")
        with self._lock:
            if start and start < self._compacted:
                gone = status_object(410, f"too old resource version: {start} ({self._compacted})", "Expired")
                return iter([{"type": "ERROR", "object": gone}])
            if not start:     # the current state first, then what changes
                initial = [{"type": "ADDED", "object": copy.deepcopy(o)} for _, o in sorted(self._slices.items())
                           if wanted(o)]
                start = self._rv
            else:
                initial = []

        def events():
            yield from initial
            seen, deadline = start, time.monotonic() + seconds
            while True:
                with self._lock:
                    fresh = [(rv, k, o) for rv, k, o in self._events if rv > seen]
                    if not fresh:
                        left = deadline - time.monotonic()
                        if left <= 0 or self._httpd is None:
                            return
                        self._changed.wait(min(left, 0.5))
                        continue
                for rv, kind, obj in fresh:
                    seen = rv
                    if wanted(obj):
                        yield {"type": kind, "object": copy.deepcopy(obj)}
        return events()

    def _delete_slices(self, query):
        """DeleteCollection: every slice the selectors match; the list of what went."""
        wanted = self._slice_filter(query)
        with self._lock:
            gone = [self._slices[n] for n in sorted(self._slices) if wanted(self._slices[n])]
            items = []
            for obj in gone:
                del self._slices[obj["metadata"]["name"]]
                self._record("DELETED", obj, deleted=True)
                item = copy.deepcopy(obj)
                item.pop("apiVersion", None)
                item.pop("kind", None)
                items.append(item)
            return {"apiVersion": RESOURCE_API, "kind": "ResourceSliceList",
                    "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _list_slices(self, query):
        wanted = self._slice_filter(query)
        with self._lock:
            items = []
            for name in sorted(self._slices):
                obj = self._slices[name]
                if wanted(obj):
                    item = copy.deepcopy(obj)
                    # a real server's JSON list items carry no apiVersion/kind
                    item.pop("apiVersion", None)
                    item.pop("kind", None)
                    items.append(item)
            return {"apiVersion": RESOURCE_API, "kind": "ResourceSliceList",
                    "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _checked_slice(self, body, name_hint):
        body.setdefault("apiVersion", RESOURCE_API)
        body.setdefault("kind", "ResourceSlice")
        if (body["apiVersion"], body["kind"]) != (RESOURCE_API, "ResourceSlice"):
            raise ApiError(400, f"expected {RESOURCE_API} ResourceSlice, got "
                                f"{body['apiVersion']} {body['kind']}")
        meta = body.get("metadata")
        if not isinstance(meta, dict):
            meta = body["metadata"] = {}
        # the server sets creationTimestamp itself; a client echoing one back may write it
        # in another (equally valid) format, which is no error
        checked = copy.deepcopy(body)
        checked["metadata"].pop("creationTimestamp", None)
        invalid = lambda msg: ApiError(   # noqa: E731
            422, f'ResourceSlice.resource.k8s.io "{meta.get("name") or name_hint}" is invalid: {msg}',
            details={"name": meta.get("name") or name_hint, "group": "resource.k8s.io",
                     "kind": "ResourceSlice"})
        problems = []
        try:
            problems += _validate_slice_spec(body.get("spec"), self._minor_version())
        except Exception:    # a mistyped spec: the model check below names the field
            pass
        try:
            check_model(checked)
        except AssertionError as e:
            problems.append(str(e))
        if problems:
            raise invalid("; ".join(problems))
        body.update(defaulted(body))
        if not self.partitionable_devices:   # the DRAPartitionableDevices gate off: dropped, no error
            (body.get("spec") or {}).pop("sharedCounters", None)
            for device in (body.get("spec") or {}).get("devices") or []:
                device.pop("consumesCounters", None)
        if not self.consumable_capacity:   # as an API server with the feature gate off: dropped, no error
            for device in (body.get("spec") or {}).get("devices") or []:
                device.pop("allowMultipleAllocations", None)
                for capacity in (device.get("capacity") or {}).values():
                    capacity.pop("requestPolicy", None)
        return body

    def _create_slice(self, body, query):
        body = self._checked_slice(body, "")
        meta = body["metadata"]
        with self._lock:
            if not meta.get("name"):
                if not meta.get("generateName"):
                    raise ApiError(422, 'ResourceSlice.resource.k8s.io "" is invalid: metadata.name: '
                                        "Required value: name or generateName is required")
                while True:
                    name = meta["generateName"] + "".join(random.choices(_GENERATE_CHARS, k=5))
                    if name not in self._slices:
                        break
                meta["name"] = name
            name = meta["name"]
            if name in self._slices:
                raise ApiError(409, f'resourceslices.resource.k8s.io "{name}" already exists',
                               reason="AlreadyExists",
                               details={"name": name, "group": "resource.k8s.io",
                                        "kind": "resourceslices"})
            self._stamp(body)
            meta["generation"] = 1
            if query.get("dryRun") != "All":
                self._slices[name] = body
                self._record("ADDED", body)
            return copy.deepcopy(body)

    def _replace_slice(self, name, body, query):
        body = self._checked_slice(body, name)
        meta = body["metadata"]
        if meta.get("name") != name:
            raise ApiError(400, f"the name of the object ({meta.get('name')}) does not match the "
                                f"name on the URL ({name})")
        with self._lock:
            stored = _stored_for_write(self._slices.get(name), "resourceslices", name, meta)
            old = stored["metadata"]
            meta["uid"] = old["uid"]
            meta["creationTimestamp"] = old["creationTimestamp"]
            meta["generation"] = old["generation"] + (body.get("spec") != stored.get("spec"))
            meta["resourceVersion"] = self._next_rv()
            if query.get("dryRun") != "All":
                self._slices[name] = body
                self._record("MODIFIED", body)
            return copy.deepcopy(body)

    def _delete_slice(self, name, options, query):
        with self._lock:
            stored = self._slices.get(name)
            if stored is None:
                raise ApiError(404, f'resourceslices.resource.k8s.io "{name}" not found',
                               details={"name": name, "kind": "resourceslices"})
            pre = (options or {}).get("preconditions") or {}
            for key in ("uid", "resourceVersion"):
                if pre.get(key) and pre[key] != stored["metadata"][key]:
                    raise ApiError(409, f"Precondition failed: {key} in precondition: {pre[key]}, "
                                        f"{key} in object meta: {stored['metadata'][key]}")
            if query.get("dryRun") != "All":
                del self._slices[name]
                self._record("DELETED", stored, deleted=True)
            return copy.deepcopy(stored)


def allocated_claim(namespace, name, driver, pool, results, node=None) -> dict:
    """A resource.k8s.io/v1 ResourceClaim as the scheduler leaves it once allocated.

    `results`: [{request, device, share_id, memory: "4Gi", sm: "50"}, ...]; None (or a
    missing key) leaves that field out.  One spec request per distinct request name, for
    the driver's device class (`deviceClassName` = driver) with the capacity asked for; a
    request "main/sub" is a firstAvailable request `main` whose subrequest `sub` was
    allocated, after the subrequests named in the result's "tried" (not allocated).
    `status.allocation` holds a result per entry and a nodeSelector for `node` (the pool's
    name unless given).
    """
    requests, order = {}, []
    for r in results:
        req, _, sub = r["request"].partition("/")
        caps = {k: r[k] for k in ("memory", "sm") if r.get(k) is not None}
        exactly = {"deviceClassName": driver}
        if caps:
            exactly["capacity"] = {"requests": caps}
        if req not in requests:
            order.append(req)
            if sub:
                tried = [{"name": t, "deviceClassName": driver} for t in r.get("tried") or []]
                requests[req] = {"name": req, "firstAvailable": tried + [{"name": sub, **exactly}]}
            else:
                requests[req] = {"name": req, "exactly": exactly}
        else:
            held = requests[req]["firstAvailable"][-1] if sub else requests[req]["exactly"]
            held["allocationMode"] = "ExactCount"
            held["count"] = held.get("count", 1) + 1
    out_results = []
    for r in results:
        res = {"request": r["request"], "driver": driver, "pool": pool, "device": r["device"]}
        if r.get("share_id") is not None:
            res["shareID"] = r["share_id"]
        caps = {k: r[k] for k in ("memory", "sm") if r.get(k) is not None}
        if caps:
            res["consumedCapacity"] = caps
        out_results.append(res)
    return {
        "apiVersion": RESOURCE_API, "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())},
        "spec": {"devices": {"requests": [requests[q] for q in order]}},
        "status": {"allocation": {
            "devices": {"results": out_results},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node or pool]}]}]},
        }},
    }
