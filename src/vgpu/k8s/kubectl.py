"""`kubectl vgpu`: pods' and nodes' GPU fractions, from the API server alone.

Installed as the console script `kubectl-vgpu`, so kubectl runs it as a plugin
(`kubectl vgpu get pods`).  It reads what every user of the cluster may read: Pods,
ResourceClaims (their allocation, and the live figures the node agent writes into
status.devices[].data, see vgpu.k8s.claimstatus) and ResourceSlices -- no access to the
nodes themselves.

    kubectl vgpu get pods [-n NS | -A] [-o wide|json|yaml]
    kubectl vgpu describe node NODE
    kubectl vgpu top [-n NS | -A] [--interval 2s]

Flags as kubectl's own: --kubeconfig (else $KUBECONFIG, else ~/.kube/config), --context,
-n/--namespace (else the context's namespace, else default), -A/--all-namespaces.  Tables
are laid out as kubectl lays them out (columns padded by three spaces, NAMESPACE first only
with -A, `No resources found in NS namespace.` when there is nothing).
"""
import datetime
import json
import sys
import time

import click

from ..quantities import format_memory

DRIVER = "vgpu.dev"


# === the cluster's view ===

class Cluster:
    def __init__(self, kubeconfig=None, context=None, namespace=None, driver=DRIVER):
        from kubernetes import client, config
        configuration = client.Configuration()
        try:
            config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
            _, active = config.list_kube_config_contexts(config_file=kubeconfig)
            if context:
                contexts, _ = config.list_kube_config_contexts(config_file=kubeconfig)
                active = next((c for c in contexts if c["name"] == context), active)
        except (config.ConfigException, OSError, TypeError) as e:
            raise click.ClickException(f"cannot load the kubeconfig: {e}; hint: pass --kubeconfig, or set "
                                       "KUBECONFIG") from None
        self.namespace = namespace or (active or {}).get("context", {}).get("namespace") or "default"
        self.api = client.ApiClient(configuration)
        self.core, self.resource = client.CoreV1Api(self.api), client.ResourceV1Api(self.api)
        self.driver = driver

    def _call(self, what, f, *args, **kw):
        from kubernetes.client.exceptions import ApiException
        try:
            return self.api.sanitize_for_serialization(f(*args, _request_timeout=15, **kw))
        except ApiException as e:
            try:
                message = json.loads(e.body)["message"]
            except (TypeError, ValueError, KeyError):
                message = f"{e.status} {e.reason}"
            raise click.ClickException(f"{what}: {message}") from None
        except Exception as e:   # unreachable
            raise click.ClickException(f"{what}: cannot reach the API server ({type(e).__name__}); hint: check "
                                       "the kubeconfig's server and your network") from None

    def pods(self, all_namespaces):
        if all_namespaces:
            return self._call("listing pods", self.core.list_pod_for_all_namespaces)["items"]
        return self._call("listing pods", self.core.list_namespaced_pod, self.namespace)["items"]

    def claims(self, all_namespaces):
        if all_namespaces:
            items = self._call("listing resourceclaims", self.resource.list_resource_claim_for_all_namespaces)
        else:
            items = self._call("listing resourceclaims", self.resource.list_namespaced_resource_claim,
                               self.namespace)
        return {(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in items["items"]}

    def slices(self, node=None):
        selector = f"spec.driver={self.driver}" + (f",spec.nodeName={node}" if node else "")
        return self._call("listing resourceslices", self.resource.list_resource_slice,
                          field_selector=selector)["items"]


# === rows ===

def _quantity(v):
    if v is None:
        return None
    from kubernetes.utils import parse_quantity
    try:
        return parse_quantity(v)
    except (ValueError, TypeError):
        return None


def _pod_claims(pod) -> dict:
    """pod claim name -> ResourceClaim name (a template's claim from the pod's status)."""
    out = {}
    generated = {s["name"]: s.get("resourceClaimName") for s in (pod.get("status") or {}).get(
        "resourceClaimStatuses") or []}
    for pc in (pod.get("spec") or {}).get("resourceClaims") or []:
        out[pc["name"]] = pc.get("resourceClaimName") or generated.get(pc["name"])
    return out


def rows(pods, claims, driver=DRIVER) -> list:
    """One row per (pod, container, vgpu device) from the claims' allocation and status."""
    out = []
    for pod in pods:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        ns = meta.get("namespace", "default")
        names = _pod_claims(pod)
        for c in spec.get("containers") or []:
            for ref in (c.get("resources") or {}).get("claims") or []:
                claim_name = names.get(ref["name"])
                claim = claims.get((ns, claim_name)) if claim_name else None
                base = {"namespace": ns, "pod": meta["name"], "container": c["name"], "node": spec.get("nodeName"),
                        "claim": claim_name, "podClaim": ref["name"], "phase": (pod.get("status") or {}).get("phase")}
                if claim is None:
                    if claim_name is None and not any(pc["name"] == ref["name"] and pc.get("resourceClaimTemplateName")
                                                      for pc in spec.get("resourceClaims") or []):
                        continue
                    out.append({**base, "status": "WaitingForClaim"})
                    continue
                results = [r for r in ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {})
                                       .get("results") or []) if r.get("driver") == driver]
                requests = (claim.get("spec") or {}).get("devices", {}).get("requests") or []
                if not results:
                    ours = any((r.get("exactly") or {}).get("deviceClassName") for r in requests)
                    if ours and claim.get("status", {}).get("allocation") is None:
                        out.append({**base, "status": "Pending"})
                    continue
                entries = {(d.get("pool"), d.get("device"), d.get("shareID")): d
                           for d in (claim.get("status") or {}).get("devices") or [] if d.get("driver") == driver}
                for r in results:
                    entry = entries.get((r.get("pool"), r.get("device"), r.get("shareID"))) or {}
                    data = entry.get("data") or {}
                    consumed = r.get("consumedCapacity") or {}
                    ready = next((x for x in entry.get("conditions") or [] if x.get("type") == "Ready"), None)
                    if ready is None:
                        status = "Allocated"
                    elif ready.get("status") == "True":
                        status = "Ready"
                    else:
                        status = ready.get("reason") or "NotReady"
                    mem_cap = data.get("memory.max")
                    if mem_cap is None:
                        mem_cap = _quantity(consumed.get("memory"))
                    sm_cap = data.get("sm.max")
                    if sm_cap is None:
                        sm_cap = _quantity(consumed.get("sm"))
                    out.append({**base, "node": base["node"] or r.get("pool"), "gpu": r.get("device"),
                                "shareID": r.get("shareID"), "status": status,
                                "memory": {"max": None if mem_cap is None else int(mem_cap),
                                           "current": data.get("memory.current"), "driver": data.get("memory.driver"),
                                           "peak": data.get("memory.peak")},
                                "sm": {"max": None if sm_cap is None else float(sm_cap), "used": data.get("sm.used")},
                                "throttledSeconds": data.get("throttled.seconds"),
                                "oomRefusals": data.get("oom.refusals"),
                                "processes": data.get("processes")})
    return sorted(out, key=lambda r: (r["namespace"], r["pod"], r["container"], r.get("gpu") or ""))


def _mem(v):
    return "-" if v is None else format_memory(int(v))


def _pct(v):
    if v is None:
        return "-"
    return f"{v:g}%" if v == int(v) else f"{v:.1f}%"


def table(headers, body) -> str:
    """kubectl's table layout (text/tabwriter: minwidth 6, padding 3)."""
    cells = [headers] + [[str(x) for x in r] for r in body]
    widths = [max(6, max(len(r[i]) for r in cells) + 3) for i in range(len(headers))]
    return "\n".join("".join(x.ljust(w) for x, w in zip(r[:-1], widths)) + r[-1] for r in cells)


def render_pods(found, all_namespaces, wide) -> str:
    headers = (["NAMESPACE"] if all_namespaces else []) + ["POD", "CONTAINER", "NODE", "GPU", "GPU-MEMORY",
                                                           "GPU-UTIL", "STATUS"]
    if wide:
        headers += ["CLAIM", "SHARE-ID", "DRIVER-MEMORY", "THROTTLED", "OOM", "PROCESSES"]
    body = []
    for r in found:
        mem, sm = r.get("memory") or {}, r.get("sm") or {}
        line = ([r["namespace"]] if all_namespaces else []) + [
            r["pod"], r["container"], r.get("node") or "<none>", r.get("gpu") or "<none>",
            f"{_mem(mem.get('current'))}/{_mem(mem.get('max'))}" if mem else "<none>",
            f"{_pct(sm.get('used'))}/{_pct(sm.get('max'))}" if sm else "<none>", r["status"]]
        if wide:
            procs = r.get("processes")
            line += [r.get("claim") or "<none>", r.get("shareID") or "<none>", _mem(mem.get("driver")),
                     "-" if r.get("throttledSeconds") is None else f"{r['throttledSeconds']:g}s",
                     "-" if r.get("oomRefusals") is None else r["oomRefusals"],
                     "-" if procs is None else len(procs)]
        body.append(line)
    return table(headers, body)


def _dump(obj, output):
    if output == "json":
        return json.dumps(obj, indent=4)
    import yaml
    return yaml.safe_dump(obj, sort_keys=False).rstrip("\n")


def get_pods_text(cluster, all_namespaces, output, name=None) -> str:
    found = rows(cluster.pods(all_namespaces), cluster.claims(all_namespaces), cluster.driver)
    if name:
        found = [r for r in found if r["pod"] == name]
        if not found:
            raise click.ClickException(f'pods "{name}" not found (or it has no vgpu claim) in the '
                                       f'{cluster.namespace} namespace')
    if output in ("json", "yaml"):
        return _dump({"apiVersion": "v1", "kind": "List", "items": found, "metadata": {}}, output)
    if not found:
        return "No resources found" + ("" if all_namespaces else f" in {cluster.namespace} namespace") + "."
    return render_pods(found, all_namespaces, output == "wide")


# === describe node ===

def describe_node(cluster, node) -> str:
    published = cluster.slices(node)
    if not published:
        raise click.ClickException(f'node "{node}" publishes no {cluster.driver} GPUs (no ResourceSlice); hint: is '
                                   "the vgpu DaemonSet running there?")
    devices = [d for s in published for d in s["spec"].get("devices") or []]
    claims = cluster.claims(True)
    pods = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in cluster.pods(True)}
    on = {}        # device -> [(claim, result, data)]
    for (ns, name), claim in sorted(claims.items()):
        status = claim.get("status") or {}
        entries = {(d.get("pool"), d.get("device"), d.get("shareID")): d for d in status.get("devices") or []
                   if d.get("driver") == cluster.driver}
        for r in (((status.get("allocation") or {}).get("devices") or {}).get("results") or []):
            if r.get("driver") == cluster.driver and r.get("pool") == node:
                data = (entries.get((r.get("pool"), r.get("device"), r.get("shareID"))) or {}).get("data") or {}
                on.setdefault(r.get("device"), []).append((claim, r, data))
    lines = [f"Name:               {node}", f"Driver:             {cluster.driver}", "GPUs:"]
    whole = {(d.get("attributes") or {}).get("uuid", {}).get("string") for d in devices
             if (d.get("attributes") or {}).get("type", {}).get("string") != "mig"}
    for d in sorted(devices, key=lambda d: (d.get("attributes", {}).get("index", {}).get("int", 0), d["name"])):
        attrs = {k: next(iter(v.values())) for k, v in (d.get("attributes") or {}).items()}
        if attrs.get("type") == "mig" and attrs.get("parentUUID") in whole:
            continue      # a placement of a partitionable GPU: listed under it when allocated
        caps = {k: _quantity(v.get("value")) for k, v in (d.get("capacity") or {}).items()}
        held = on.get(d["name"], [])
        mem_out = sum(_quantity((r.get("consumedCapacity") or {}).get("memory")) or 0 for _, r, _ in held)
        sm_out = sum(_quantity((r.get("consumedCapacity") or {}).get("sm")) or 0 for _, r, _ in held)
        mem_used = sum(x.get("memory.current") or 0 for _, _, x in held)
        sm_used = [x.get("sm.used") for _, _, x in held if x.get("sm.used") is not None]
        lines.append(f"  {d['name']}:")
        lines.append(f"    Model:            {attrs.get('model', '<unknown>')}")
        lines.append(f"    UUID:             {attrs.get('uuid', '<unknown>')}")
        if caps.get("memory") is not None:
            lines.append(f"    Memory:           {_mem(caps['memory'])} total, {_mem(mem_out)} handed out "
                         f"({int(mem_out * 100 // caps['memory'])}%), {_mem(mem_used)} used")
        if caps.get("sm") is not None:
            used = f"{_pct(sum(sm_used))} used" if sm_used else "use not reported"
            lines.append(f"    SM:               {_pct(float(sm_out))} handed out of {_pct(float(caps['sm']))}, {used}")
        mig = [x for x in devices if (x.get("attributes") or {}).get("parentUUID", {}).get("string") ==
               attrs.get("uuid") and (x["name"] in on or not x.get("consumesCounters"))]   # allocated, or by hand
        lines.append(f"    MIG instances:    {', '.join(x['name'] for x in mig) if mig else '<none>'}")
        lines.append(f"    Claims:           {len(held) if held else '<none>'}")
        if held:
            body = []
            for claim, r, data in held:
                m = claim["metadata"]
                pod = next((x["name"] for x in (claim.get("status") or {}).get("reservedFor") or []
                            if x.get("resource") == "pods"), None)
                container = (m.get("annotations") or {}).get("vgpu.dev/container") or \
                    _container_of(pods.get((m["namespace"], pod)), m["name"])
                consumed = r.get("consumedCapacity") or {}
                body.append([m["namespace"], m["name"], pod or "<none>", container or "<none>",
                             f"{_mem(data.get('memory.current'))}/{_mem(_quantity(consumed.get('memory')))}",
                             f"{_pct(data.get('sm.used'))}/{_pct(_sm(consumed.get('sm')))}"])
            lines += ["      " + line for line in table(["NAMESPACE", "CLAIM", "POD", "CONTAINER", "GPU-MEMORY",
                                                          "GPU-UTIL"], body).splitlines()]
    return "\n".join(lines)


def _sm(v):
    q = _quantity(v)
    return None if q is None else float(q)


def _container_of(pod, claim_name):
    if not pod:
        return None
    names = {v: k for k, v in _pod_claims(pod).items()}
    ref = names.get(claim_name)
    return next((c["name"] for c in pod["spec"].get("containers") or []
                 for x in (c.get("resources") or {}).get("claims") or [] if x["name"] == ref), None)


# === the command line ===

def _common(f):
    f = click.option("--kubeconfig", type=click.Path(dir_okay=False), envvar="KUBECONFIG",
                     help="Path to the kubeconfig file.")(f)
    f = click.option("--context", help="The kubeconfig context to use.")(f)
    f = click.option("-n", "--namespace", help="The namespace [default: the context's, else default].")(f)
    f = click.option("--driver-name", default=DRIVER, show_default=True, envvar="VGPU_DRIVER_NAME",
                     help="The vgpu DRA driver's name.")(f)
    return f


def _cluster(kubeconfig, context, namespace, driver_name):
    return Cluster(kubeconfig, context, namespace, driver_name)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """GPU fractions of pods and nodes (the vgpu DRA driver), as kubectl shows things.

    \b
      kubectl vgpu get pods -A
      kubectl vgpu describe node gpu-node-1
      kubectl vgpu top -n team-a
    """


@main.group()
def get():
    """Display pods with vgpu claims."""


@get.command("pods")
@click.argument("name", required=False)
@_common
@click.option("-A", "--all-namespaces", is_flag=True, help="Pods of every namespace.")
@click.option("-o", "--output", type=click.Choice(["wide", "json", "yaml"]), help="Output format.")
def get_pods(name, kubeconfig, context, namespace, driver_name, all_namespaces, output):
    """Each pod's containers with their GPU, memory (used/cap), SM time (used/share) and status."""
    click.echo(get_pods_text(_cluster(kubeconfig, context, namespace, driver_name), all_namespaces, output, name))


get.add_command(get_pods, "pod")
get.add_command(get_pods, "po")


@main.group()
def describe():
    """Show a node's GPUs in detail."""


@describe.command("node")
@click.argument("node")
@_common
def describe_node_cmd(node, kubeconfig, context, namespace, driver_name):
    """Each GPU of NODE: model, memory and SM handed out vs used, MIG instances, the claims on it."""
    click.echo(describe_node(_cluster(kubeconfig, context, namespace, driver_name), node))


describe.add_command(describe_node_cmd, "nodes")
describe.add_command(describe_node_cmd, "no")


@main.command()
@_common
@click.option("-A", "--all-namespaces", is_flag=True, help="Pods of every namespace.")
@click.option("--interval", type=float, default=2.0, show_default=True, help="Seconds between refreshes.")
@click.option("--count", type=int, default=0, help="Stop after this many refreshes (0: until Ctrl-C).")
def top(kubeconfig, context, namespace, driver_name, all_namespaces, interval, count):
    """`get pods`, refreshed: the live figures as the node agents write them."""
    cluster = _cluster(kubeconfig, context, namespace, driver_name)
    n = 0
    try:
        while True:
            text = get_pods_text(cluster, all_namespaces, None)
            stamp = datetime.datetime.now().strftime("%H:%M:%S")
            if sys.stdout.isatty():
                click.echo("\x1b[H\x1b[2J", nl=False)
            click.echo(f"{stamp}  every {interval:g}s\n{text}")
            n += 1
            if count and n >= count:
                break
            if not sys.stdout.isatty():
                click.echo("")
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
