"""Reading pods and nodes: the openb CSVs, `kubectl get -o json` pods, ResourceClaims and
ResourceSlices."""
import csv
import json
import math

from ..errors import BadFile
from ..quantities import parse_memory
from .model import MIB, MILLI, Node, Pod


# === readers ===

def _rows(path, required):
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
            header = set(rows[0]) if rows else set()
    except OSError as e:
        raise BadFile(f"{path}: {e.strerror}", hint="give the path of an openb CSV file") from None
    missing = [c for c in required if c not in header]
    if missing:
        raise BadFile(f"{path}: no column {', '.join(missing)}",
                      hint=f"an openb CSV has the header {','.join(required)}")
    return rows


def _int(path, row, column):
    try:
        return int(float(row[column] or 0))
    except ValueError:
        raise BadFile(f"{path}: {column}={row[column]!r} in {row.get('name') or row.get('sn')} is not a number",
                      hint="the openb CSV columns hold integers") from None


def _time(path, row, column):
    """Seconds from the trace's start; None where the column is absent or empty."""
    if not row.get(column):
        return None
    try:
        return float(row[column])
    except ValueError:
        raise BadFile(f"{path}: {column}={row[column]!r} in {row.get('name')} is not a number",
                      hint="times are seconds from the trace's start") from None


def _json_items(path, hint):
    """The items of a `kubectl get ... -o json` file (a list, or one object); None when the
    file is not JSON at all (a CSV)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise BadFile(f"{path}: {e.strerror}", hint=hint) from None
    if not text.lstrip().startswith("{"):
        return None
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise BadFile(f"{path}: not JSON ({e})", hint=hint) from None
    items = doc.get("items", [doc]) if isinstance(doc, dict) else None
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise BadFile(f"{path}: no list of objects", hint=hint)
    return items


# CPU and memory of a node whose GPUs come from ResourceSlices (which say nothing of them):
# never the limit, so only GPUs decide.
UNBOUNDED = 1 << 40
VGPU_DRIVER = "vgpu.dev"


def read_resource_slices(path, items):
    """`kubectl get resourceslices -o json`: each node's whole GPUs as vgpu's DRA driver
    publishes them (a device of type gpu: its model, its memory capacity).  Returns the
    nodes and {model: MiB}."""
    gpus, memory = {}, {}
    for s in items:
        spec = s.get("spec") or {}
        if spec.get("driver") != VGPU_DRIVER or not spec.get("nodeName"):
            continue
        for d in spec.get("devices") or []:
            attrs = {k: next(iter(v.values()), None) for k, v in (d.get("attributes") or {}).items() if isinstance(v, dict)}
            if attrs.get("type") != "gpu":
                continue
            model = str(attrs.get("model") or "")
            gpus.setdefault(spec["nodeName"], []).append(model)
            cap = ((d.get("capacity") or {}).get("memory") or {}).get("value")
            if cap is not None:
                try:
                    memory[model] = parse_memory(str(cap)) >> 20
                except ValueError:
                    raise BadFile(f"{path}: device {d.get('name')} has memory {cap!r}",
                                  hint="capacities are Kubernetes quantities") from None
    if not gpus:
        raise BadFile(f"{path}: no GPU of driver {VGPU_DRIVER} in these ResourceSlices",
                      hint="kubectl get resourceslices -o json > slices.json")
    nodes = []
    for name in sorted(gpus):
        for model in sorted(set(gpus[name])):     # a node of two models: one Node per model
            n = gpus[name].count(model)
            nodes.append(Node(name if len(set(gpus[name])) == 1 else f"{name}/{model}", UNBOUNDED, UNBOUNDED, n, model))
    return nodes, memory


def read_nodes(path, memory_out=None):
    """The openb node CSV (sn, cpu_milli, memory_mib, gpu, model), or vgpu's ResourceSlices as
    `kubectl get resourceslices -o json` prints them (their GPU memory into memory_out)."""
    items = _json_items(path, "give an openb node CSV or kubectl get resourceslices -o json")
    if items is not None:
        nodes, memory = read_resource_slices(path, items)
        if memory_out is not None:
            memory_out.update(memory)
        return nodes
    rows = _rows(path, ("sn", "cpu_milli", "memory_mib", "gpu", "model"))
    return [Node(r["sn"], _int(path, r, "cpu_milli"), _int(path, r, "memory_mib"), _int(path, r, "gpu"),
                 r["model"] or "") for r in rows]


def read_pods(path):
    """Pods from an openb pod CSV, or from `kubectl get pods -o json` or `kubectl get
    resourceclaims -o json` (a file that starts with `{`)."""
    items = _json_items(path, "give an openb pod CSV, or kubectl get pods -A -o json > pods.json")
    if items is not None:
        if items and all(i.get("kind") == "ResourceClaim" for i in items):
            return read_claims(path, items)
        return read_k8s_pods(path, items)
    rows = _rows(path, ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"))
    pods = []
    for r in rows:
        num_gpu, milli = _int(path, r, "num_gpu"), _int(path, r, "gpu_milli")
        if num_gpu and not 0 < milli <= MILLI:
            raise BadFile(f"{path}: gpu_milli={milli} in {r['name']} is not 1-1000", hint="gpu_milli is the share of one GPU")
        spec = tuple(s for s in (r.get("gpu_spec") or "").split("|") if s)
        pods.append(Pod(r["name"], _int(path, r, "cpu_milli"), _int(path, r, "memory_mib"), num_gpu,
                        milli if num_gpu else 0, None, spec, _time(path, r, "creation_time") or 0.0,
                        _time(path, r, "deletion_time")))
    return pods


def _cpu_milli(text):
    text = str(text)
    return int(math.ceil(float(text[:-1]))) if text.endswith("m") else int(math.ceil(float(text) * MILLI))


def _in_arrival_order(pods):
    """Pods sorted by their creationTimestamp (kept in creation_time, then replaced by the
    arrival rank): Kubernetes objects arrive in that order."""
    pods = [pods[i] for i in sorted(range(len(pods)), key=lambda i: (pods[i].creation_time, i))]
    for i, p in enumerate(pods):
        p.creation_time = float(i)
    return pods


def read_k8s_pods(path, items):
    """`kubectl get pods -o json` (its items): vgpu's resources (vgpu.dev/gpu-memory bytes,
    vgpu.dev/gpu-utilization percent) or HAMi's (nvidia.com/gpu count, nvidia.com/gpumem
    MiB, nvidia.com/gpucores percent); limits win over requests, as the device plugins read
    them.  Pods in arrival order by metadata.creationTimestamp."""
    pods = []
    for n, item in enumerate(items):
        meta, spec = item.get("metadata", {}), item.get("spec", {})
        name = meta.get("name") or f"pod-{n}"
        cpu = mem = num_gpu = milli = 0
        gmem = None
        try:
            for c in spec.get("containers", []):
                res = c.get("resources", {})
                want = {**res.get("requests", {}), **res.get("limits", {})}
                cpu += _cpu_milli(want["cpu"]) if "cpu" in want else 0
                mem += parse_memory(str(want["memory"])) // MIB if "memory" in want else 0
                if "vgpu.dev/gpu-memory" in want or "vgpu.dev/gpu-utilization" in want:
                    num_gpu = max(num_gpu, 1)
                    if "vgpu.dev/gpu-memory" in want:
                        gmem = (gmem or 0) + -(-parse_memory(str(want["vgpu.dev/gpu-memory"])) // MIB)
                    milli = min(MILLI, milli + int(want.get("vgpu.dev/gpu-utilization", 100)) * 10)
                elif "nvidia.com/gpu" in want:
                    count = int(want["nvidia.com/gpu"])
                    num_gpu += count
                    share = int(want.get("nvidia.com/gpucores", 100)) * 10 if count == 1 else MILLI
                    milli = max(milli, min(MILLI, share))
                    if "nvidia.com/gpumem" in want:
                        gmem = int(want["nvidia.com/gpumem"])
        except (ValueError, TypeError) as e:
            raise BadFile(f"{path}: pod {name}: {e}", hint="resources must be Kubernetes quantities") from None
        if num_gpu > 1:
            milli = MILLI   # a multi-GPU pod takes whole GPUs
        pods.append(Pod(name, cpu, mem, num_gpu, milli if num_gpu else 0, gmem, (),
                        meta.get("creationTimestamp") or ""))
    return _in_arrival_order(pods)


def read_claims(path, items):
    """`kubectl get resourceclaims -A -o json`: each claim of a vgpu device class as a pod
    asking what its requests ask -- per request `count` GPUs (ExactCount; 1 by default) of
    `capacity.requests` memory and SM share (`sm` percent; the whole GPU when absent), in
    creationTimestamp order.  resource.k8s.io/v1 puts a request's fields under `exactly`;
    v1beta1 beside its name: both are read.  A claim of another driver's class is left out."""
    pods = []
    for n, c in enumerate(items):
        meta = c.get("metadata") or {}
        name = f"{meta.get('namespace', 'default')}/{meta.get('name') or f'claim-{n}'}"
        num_gpu, milli, gmem = 0, 0, None
        for r in ((c.get("spec") or {}).get("devices") or {}).get("requests") or []:
            req = r.get("exactly") or r
            if not str(req.get("deviceClassName", "")).endswith(VGPU_DRIVER):
                continue
            wants = (req.get("capacity") or {}).get("requests") or {}
            try:
                count = int(req.get("count", 1)) if req.get("allocationMode", "ExactCount") == "ExactCount" else 1
                share = int(math.ceil(float(str(wants["sm"])) * 10)) if "sm" in wants else MILLI
                if "memory" in wants:
                    gmem = max(gmem or 0, -(-parse_memory(str(wants["memory"])) // MIB))
            except (TypeError, ValueError) as e:
                raise BadFile(f"{path}: claim {name}: {e}", hint="capacity requests are Kubernetes quantities") from None
            num_gpu += count
            milli = max(milli, min(MILLI, share))
        if not num_gpu:
            continue
        if num_gpu > 1:
            milli = MILLI
        pods.append(Pod(name, 0, 0, num_gpu, milli, gmem, (), meta.get("creationTimestamp") or ""))
    return _in_arrival_order(pods)
