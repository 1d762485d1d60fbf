"""The long-running services: autoscale, agent, serve, and the Kubernetes plugin and webhook."""
import errno
import json
import signal
import threading

import click

from .. import slices
from ..k8s import cdi
from ..quantities import format_utc
from .common import DURATION, MEMORY, UsageFailure, dir_option, error_line, main


# === autoscale and metrics ===

class Ratio(click.ParamType):
    """A fraction: `90%` or `0.9`."""
    name = "PERCENT"

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            return value
        text = str(value).strip()
        try:
            v = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            self.fail(f"{value!r} is not a percentage (e.g. 90% or 0.9)", param, ctx)
        if not 0 < v <= 1:
            self.fail(f"{value!r} is outside (0, 100%]", param, ctx)
        return v


RATIO = Ratio()


def _until_signalled(run=None):
    """run(stop) -- by default, wait -- until SIGTERM sets `stop` or Ctrl-C."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if run is not None:
            run(stop)
        else:
            while not stop.wait(3600):
                pass
    except KeyboardInterrupt:
        pass


def autoscale_policy_options(f):
    """The autoscaler's policy options (`autoscale`, and `agent --autoscale`)."""
    for opt in reversed([
        click.option("--window", type=DURATION, default="30s", show_default=True,
                     help="How long use must stay above the high mark (grow) or below the low mark (shrink)."),
        click.option("--cooldown", type=DURATION,
                     help="After a change, no further change for this long [default: the window]."),
        click.option("--high", type=RATIO, default="90%", show_default=True, help="Grow mark: use / quota."),
        click.option("--low", type=RATIO, default="50%", show_default=True, help="Shrink mark: use / quota."),
        click.option("--target", type=RATIO, default="70%", show_default=True,
                     help="Where a change puts use / quota (between the marks: hysteresis)."),
        click.option("--grow-step", type=RATIO, default="25%", show_default=True,
                     help="A grow adds at least this share of the quota (memory at least 256Mi, SM 5 points)."),
        click.option("--shrink-step", type=RATIO, default="25%", show_default=True,
                     help="A shrink takes at most this share of the quota."),
        click.option("--device-memory", type=MEMORY,
                     help="Each device's memory, where NVML cannot say [default: NVML's]; without either, memory "
                          "only shrinks."),
        click.option("--dry-run", is_flag=True, help="Log the decisions without applying them."),
    ]):
        f = opt(f)
    return f


def _autoscale_policy(window, interval, cooldown, high, low, target, grow_step, shrink_step):
    from ..policy import Policy
    if interval > window:
        raise UsageFailure(f"--interval {interval:g}s is longer than --window {window:g}s; hint: sample at least "
                           "once per window")
    if shrink_step >= 1:
        raise click.BadParameter(f"{shrink_step * 100:g}% would let one shrink take a whole quota: a shrink takes at "
                                 "most this share of it, so it must be below 100% (e.g. 25%)",
                                 param_hint="'--shrink-step'")
    if not low < target < high:
        raise click.UsageError(f"--low {low * 100:g}% < --target {target * 100:g}% < --high {high * 100:g}% "
                               "does not hold: a "
                               "change lands use at the target, between the marks, so it is not undone at once")
    try:
        return Policy(window=window, cooldown=cooldown, high=high, low=low, target=target, grow_step=grow_step,
                      shrink_step=shrink_step)
    except ValueError as e:
        raise UsageFailure(f"{e}; hint: see vgpu-ctl autoscale --help") from None


@main.command()
@autoscale_policy_options
@click.option("--interval", type=DURATION, default="1s", show_default=True, help="Time between samples.")
@click.option("--once", is_flag=True, help="Watch one window, apply what it decides, exit.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="Also serve Prometheus metrics on this port.")
@click.option("--metrics-address", default="0.0.0.0", show_default=True, help="Address for --metrics-port.")
@dir_option
def autoscale(window, interval, cooldown, high, low, target, grow_step, shrink_step, device_memory, dry_run, once,
              metrics_port, metrics_address, directory):
    """Move each slice's memory.max and sm.max between its request and its limit.

    Every --interval the loop reads each slice's usage file; a slice whose use stays
    above --high of its quota for a whole --window grows (memory: at once after an
    allocation refused by the cap), one below --low for a whole window shrinks, never
    above its limit, below its request, or (memory) below its use plus a margin, and
    never beyond the device (memory: its physical memory; SM: 100% summed).  When
    several want more than is left, it is shared by request.  Decisions go through the
    same code path as `vgpu-ctl resize`; each is one JSON line on stdout with its reason.
    Slices whose request equals their limit are left alone.  No decision comes before a
    whole window has been watched (a line on stderr says so as it starts); --once exits
    once it has.

    \b
    Example:
      vgpu-ctl create infer --memory 4Gi --request 2Gi --limit 12Gi --sm 20% --sm-limit 60%
      vgpu-ctl autoscale --metrics-port 9400
      vgpu-ctl autoscale --window 1s --interval 200ms --dry-run --once
    """
    from .. import autoscale as autoscale_mod
    policy = _autoscale_policy(window, interval, cooldown, high, low, target, grow_step, shrink_step)
    scaler = autoscale_mod.Autoscaler(directory, policy, interval=interval, dry_run=dry_run,
                                      device_memory=device_memory)
    if metrics_port is not None:
        httpd = _listen(directory, metrics_port, metrics_address, "--metrics-port", "--metrics-address",
                        autoscaler=scaler)
        click.echo(f"serving metrics on http://{metrics_address}:{httpd.server_port}/metrics", err=True)
    # a window of silence is the policy at work, not a hang: say so before it starts
    wait = max(policy.window, policy.cooldown_s)
    click.echo(f"autoscale: a decision needs a whole --window of observations, so none comes before {wait:g}s"
               + ("; --once exits then" if once else ""), err=True)
    _until_signalled(lambda stop: scaler.run(once=once, stop=stop))


def _listen(directory, port, address, port_flag, address_flag, autoscaler=None, agent=None):
    """The metrics server, or one line saying which flag to change."""
    import socket
    from .. import metrics
    try:
        if agent is not None:
            return metrics.start(directory, port, address, autoscaler=autoscaler, agent=agent)
        return metrics.start(directory, port, address, autoscaler=autoscaler)
    except socket.gaierror as e:
        raise click.ClickException(f"cannot listen on {address}:{port}: {address!r} is not an address of this host "
                                   f"({e.strerror}); hint: {address_flag} takes an IP address, e.g. 0.0.0.0 (all) "
                                   "or 127.0.0.1 (this host only)") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            hint = f"something else listens there: pick another {port_flag} (0: any free one)"
        elif e.errno in (errno.EACCES, errno.EPERM):
            hint = f"ports below 1024 need root: pick a {port_flag} above 1023"
        elif e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            hint = f"{address} is not an address of this host: pass {address_flag} 0.0.0.0 (all) or 127.0.0.1"
        else:
            hint = f"check {address_flag} and {port_flag}"
        raise click.ClickException(f"cannot listen on {address}:{port}: {e.strerror or e}; hint: {hint}") from None


class OnViolation(click.ParamType):
    """`kill`, `gap=kill`, `compute=stop`: checked against the kinds and their actions."""
    name = "[KIND=]ACTION"

    def convert(self, value, param, ctx):
        from ..agent import settings as agent_settings
        try:
            agent_settings.parse_actions([value])
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return value


@main.command()
@click.option("--interval", type=DURATION, default="1s", show_default=True,
              help="Time between looks at the driver and the slices (dead slots are reaped at once when the agent "
                   "sees their process end, else within this).")
@click.option("--grace", type=DURATION, default="500ms", show_default=True,
              help="How long a memory or unsliced condition must last to be a violation (with --once: not at all, "
                   "there is one look).")
@click.option("--compute-window", type=DURATION, default="10s", show_default=True,
              help="A slice's NVML share must pass its sm.max by 10 points, unpaced, on average over this long.")
@click.option("--tolerance", type=MEMORY, default="64Mi", show_default=True,
              help="Memory the driver may hold beyond the shim's figure (and the cap) ...")
@click.option("--tolerance-ratio", type=RATIO, default="2%", show_default=True,
              help="... or this share of the cap, whichever is larger.")
@click.option("--process-overhead", type=MEMORY, default="0", show_default=True,
              help="Per process, added to the tolerance: device memory a context holds that the shim does not "
                   "charge (the shim charges it when it can measure it).")
@click.option("--context-allowance", type=MEMORY, default="512Mi", show_default=True,
              help="A process that has a context on a device and has charged nothing there yet (the shim "
                   "charges the context with its first allocation) may hold this much: not a gap.")
@click.option("--require-slices", is_flag=True,
              help="A GPU process in no slice is a violation (node configured to run GPU work in slices only).")
@click.option("--on-violation", "on_violation", type=OnViolation(), multiple=True,
              help="What to do: report (default), kill (SIGKILL the offending processes: only those of the "
                   "slice, or the unsliced one) or stop (compute: hold them to the share with SIGSTOP/SIGCONT); "
                   "for every kind, or per kind: over-cap=, gap=, forged=, unsliced=, compute=.  Repeatable.")
@click.option("--autoscale", "with_autoscale", is_flag=True,
              help="Also run the autoscaler (its options below), on the same reading of the slices.")
@autoscale_policy_options
@click.option("--metrics-port", type=click.IntRange(0, 65535), help="Also serve Prometheus metrics on this port.")
@click.option("--metrics-address", default="0.0.0.0", show_default=True, help="Address for --metrics-port.")
@click.option("--kubernetes-events", is_flag=True,
              help="Post a Kubernetes Event on the pod of a DRA slice for each violation and action (needs the "
                   "k8s extra, API access and --node-name).")
@click.option("--node-name", envvar="NODE_NAME", help="This node's name, the Events' source [env: NODE_NAME].")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), envvar="KUBECONFIG",
              help="Kubeconfig for --kubernetes-events [default: the pod's service account].")
@click.option("--once", is_flag=True,
              help="Look once (attribute, reap, log what is wrong now), exit: a check.  What it sees is judged as it "
                   "is (no --grace: there is no second look; compute needs a --compute-window, so is not judged); "
                   "exit status 1 if it logged a violation (or the look failed), else 0.")
@click.option("--no-reap", is_flag=True, hidden=True, help="Leave dead slots alone (benchmarks, tests).")
@dir_option
@click.pass_context
def agent(ctx, interval, grace, compute_window, tolerance, tolerance_ratio, process_overhead, context_allowance,
          require_slices,
          on_violation, with_autoscale, window, cooldown, high, low, target, grow_step, shrink_step, device_memory,
          dry_run, metrics_port, metrics_address, kubernetes_events, node_name, kubeconfig, once, no_reap, directory):
    """The node agent: check every slice against the driver, and see everything on the GPU.

    Every --interval it attributes each process NVML lists on each GPU to a slice (the
    usage file it maps, the identity file its container was given, its pod, cgroup or
    pid namespace) or marks it unsliced; compares each slice's driver-measured memory
    with its memory.current and cap; reaps dead slots; removes the temporary slices of
    `vgpu-ctl run`s that died; and logs one JSON line per violation: over-cap (the
    driver says it holds more than its cap), gap (the driver says more than the shim),
    forged (a slot charging more than any device holds, or a row summing past 2^64: the
    usage file written by hand), unsliced (with --require-slices), compute (NVML's share
    above sm.max by 10 points, unpaced, over --compute-window).  By --on-violation it acts, only on processes it
    attributed with certainty, and logs every action.  `vgpu-ctl status` shows what it
    judged.  --once is a check: one look, judged as it is, exit status 1 if it logged a
    violation.

    \b
    Example:
      vgpu-ctl agent --metrics-port 9400
      vgpu-ctl agent --autoscale --metrics-port 9400 --on-violation gap=kill
      vgpu-ctl agent --require-slices --on-violation unsliced=kill --on-violation compute=stop
      vgpu-ctl agent --once --require-slices > /dev/null || echo "something on the GPU is wrong"
    """
    from ..agent import Agent, Settings, parse_actions
    # --once: the one look is all there is, so a condition it sees is judged at once rather
    # than left pending for a second look that never comes
    settings = Settings(tolerance=tolerance, tolerance_ratio=tolerance_ratio, process_overhead=process_overhead,
                        context_allowance=context_allowance, grace=0.0 if once else grace, window=compute_window,
                        require_slices=require_slices, actions=parse_actions(on_violation))
    scaler = None
    if with_autoscale:
        from .. import autoscale as autoscale_mod
        policy = _autoscale_policy(window, interval, cooldown, high, low, target, grow_step, shrink_step)
        scaler = autoscale_mod.Autoscaler(directory, policy, interval=interval, dry_run=dry_run,
                                          device_memory=device_memory)
    sink = None
    if kubernetes_events:
        if not node_name:
            raise click.UsageError("--kubernetes-events needs --node-name (or NODE_NAME): the Events' source")
        from ..k8s import plugin_main
        try:
            plugin_main._require_extras()
            from ..k8s import events
            sink = events.EventSink(slices.node_dir(directory), node_name, api=plugin_main.api_client(kubeconfig),
                                    log=lambda e: click.echo(json.dumps(e), err=True))
        except slices.VgpuError as e:
            raise click.ClickException(error_line(e)) from None
    the_agent = Agent(directory, settings, interval=interval, autoscaler=scaler, reap=not no_reap,
                           on_violation=sink.violation if sink else None, on_action=sink.action if sink else None)
    if metrics_port is not None:
        httpd = _listen(directory, metrics_port, metrics_address, "--metrics-port", "--metrics-address",
                        autoscaler=scaler, agent=the_agent)
        click.echo(f"serving metrics on http://{metrics_address}:{httpd.server_port}/metrics", err=True)
    _until_signalled(lambda stop: the_agent.run(stop=stop, once=once))
    if once and (the_agent.judge.counts or the_agent.failed_looks):
        ctx.exit(1)      # a check: what it logged is wrong on the node


@main.command()
@click.option("--port", type=click.IntRange(0, 65535), default=9400, show_default=True,
              help="TCP port (0: any free one; the line on stderr says which).")
@click.option("--address", default="0.0.0.0", show_default=True, help="Address to listen on.")
@dir_option
def serve(port, address, directory):
    """Serve Prometheus metrics for the node's slices at /metrics.

    Per slice and device: memory used/quota/request/limit (bytes), SM share
    used/quota (ratio), throttled and GPU seconds, launches, OOM refusals; per slice:
    resize events and processes; per device: capacity and NVML's usage.  Read on each
    scrape, nothing in between.

    \b
    Example:
      vgpu-ctl serve --port 9400
      curl -s localhost:9400/metrics | grep vgpu_memory_used_bytes
    """
    httpd = _listen(directory, port, address, "--port", "--address")
    click.echo(f"serving metrics on http://{address}:{httpd.server_port}/metrics", err=True)
    _until_signalled()
    httpd.shutdown()


@main.command("k8s-plugin")
@click.option("--node-name", envvar="NODE_NAME", required=True,
              help="This node's name: the ResourceSlice's nodeName and pool [env: NODE_NAME].")
@click.option("--driver-name", envvar="VGPU_DRIVER_NAME", default="vgpu.dev", show_default=True,
              help="The DRA driver name (DeviceClass selectors, CDI vendor) [env: VGPU_DRIVER_NAME].")
@click.option("--plugin-dir", type=click.Path(file_okay=False),
              help="Where dra.sock and the checkpoint live [default: /var/lib/kubelet/plugins/DRIVER].")
@click.option("--registry-dir", type=click.Path(file_okay=False), default="/var/lib/kubelet/plugins_registry",
              show_default=True, help="The kubelet's plugin registration directory (DRIVER-reg.sock).")
@click.option("--cdi-dir", type=click.Path(file_okay=False), default="/var/run/cdi", show_default=True,
              help="Where the container runtime reads CDI specs.")
@click.option("--cdi-version", type=click.Choice(cdi.CDI_VERSIONS), default=cdi.CDI_VERSION, show_default=True,
              help="cdiVersion of the specs written: a runtime whose CDI library is older than the version "
                   "refuses the spec (the content needs 0.5.0).")
@click.option("--shim-dir", type=click.Path(file_okay=False), envvar="VGPU_SHIM_DIR", required=True,
              help="Host directory made by `vgpu-ctl install-shim` [env: VGPU_SHIM_DIR].")
@click.option("--ld-so-preload", is_flag=True,
              help="Load the shim through the container's /etc/ld.so.preload instead of LD_PRELOAD.")
@click.option("--gpu-cdi-device", default="nvidia.com/gpu=all", show_default=True,
              help="A CDI device returned with every vgpu device, giving the container the GPU device nodes "
                   "and driver libraries (NVIDIA container toolkit's spec); '' for none.")
@click.option("--lend-memory", is_flag=True,
              help="Let autoscale grow a slice's memory into memory no claim holds (given back when a claim "
                   "is prepared, but only as its holder frees it).  SM share is always lent.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), envvar="KUBECONFIG",
              help="Kubeconfig to reach the API server [default: the pod's service account].")
@click.option("--rescan", type=DURATION, default="30s", show_default=True,
              help="How often to look for GPUs that appeared or vanished.")
@click.option("--claim-status-interval", default="5s", show_default=True,
              callback=lambda ctx, param, v: 0.0 if str(v).strip() in ("0", "0s") else DURATION.convert(v, param, ctx),
              help="How often each prepared claim's live figures may be written into its "
                   "status.devices (only when they changed); 0 for never.")
@click.option("--mig-gpus", envvar="VGPU_MIG_GPUS", default="none", show_default=True,
              help="On Kubernetes up to 1.36.1, where MIG beside software slices on one GPU is unsafe: the "
                   "MIG-capable GPUs that serve MIG (comma list of indexes, 'all' or 'none'); the others "
                   "serve software slices.  From 1.36.2 every GPU offers both [env: VGPU_MIG_GPUS].")
@dir_option
def k8s_plugin(node_name, driver_name, plugin_dir, registry_dir, cdi_dir, cdi_version, shim_dir, ld_so_preload,
               gpu_cdi_device, lend_memory, kubeconfig, rescan, claim_status_interval, mig_gpus, directory):
    """Run the Kubernetes DRA driver for this node (a DaemonSet's container).

    Publishes this node's GPUs as one ResourceSlice (resource.k8s.io/v1, consumable
    `memory` and `sm` capacity), registers with the kubelet, and serves its DRA gRPC API:
    preparing a claim creates a slice with what the scheduler allocated and a CDI spec
    that mounts the shim and the slice's files into the pod; unpreparing removes both.

    \b
    Example (what deploy/dra/daemonset.yaml runs):
      vgpu-ctl k8s-plugin --node-name "$NODE_NAME" --shim-dir /opt/vgpu
    """
    from ..k8s import plugin_main, versions
    try:
        mig_gpus = versions.parse_mig_gpus(mig_gpus)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--mig-gpus") from None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    config = plugin_main.Config(node_name=node_name, driver_name=driver_name,
                          plugin_dir=plugin_dir or plugin_main.default_plugin_dir(driver_name),
                          registry_dir=registry_dir, cdi_dir=cdi_dir, cdi_version=cdi_version,
                          slice_dir=slices.node_dir(directory),
                          shim_dir=shim_dir, ld_so_preload=ld_so_preload,
                          gpu_cdi_devices=[gpu_cdi_device] if gpu_cdi_device else [],
                          lend_memory=lend_memory, kubeconfig=kubeconfig, rescan=rescan,
                          claim_status_interval=claim_status_interval, mig_gpus=mig_gpus)
    try:
        plugin_main.run(config, stop, log=lambda line: click.echo(line, err=True))
    except plugin_main.PluginError as e:
        raise click.ClickException(error_line(e)) from None
    except KeyboardInterrupt:
        pass


@main.command("k8s-webhook")
@click.option("--tls-cert-file", type=click.Path(dir_okay=False), required=True,
              help="The server certificate (PEM, with its chain), e.g. from the webhook's Secret.")
@click.option("--tls-private-key-file", type=click.Path(dir_okay=False), required=True,
              help="Its private key (PEM).  Both files are read again when they change.")
@click.option("--port", type=click.IntRange(0, 65535), default=8443, show_default=True, help="HTTPS port.")
@click.option("--address", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--driver-name", envvar="VGPU_DRIVER_NAME", default="vgpu.dev", show_default=True,
              help="The DRA driver whose ResourceSlices give the GPUs' sizes [env: VGPU_DRIVER_NAME].")
@click.option("--device-class", default="vgpu.dev", show_default=True,
              help="The DeviceClass the claims ask (deploy/dra/deviceclass.yaml).")
@click.option("--memory-resource", default="vgpu.dev/gpu-memory", show_default=True,
              help="The extended resource name for GPU memory in bytes (any quantity: 4Gi).")
@click.option("--utilization-resource", default="vgpu.dev/gpu-utilization", show_default=True,
              help="The extended resource name for the SM share in percent (1-100).")
@click.option("--hami/--no-hami", default=True, show_default=True,
              help="Also map HAMi's nvidia.com/gpumem (MiB), nvidia.com/gpucores (%) and nvidia.com/gpu: 1.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), envvar="KUBECONFIG",
              help="Kubeconfig to reach the API server [default: the pod's service account].")
@click.option("--template-gc-interval", default="10m", show_default=True,
              callback=lambda ctx, param, v: 0.0 if str(v).strip() in ("0", "0s") else DURATION.convert(v, param, ctx),
              help="How often to delete the claim templates it made that no pod uses any more; 0 for never.")
@click.option("--template-gc-grace", type=DURATION, default="1h", show_default=True,
              help="How long a template no pod names is kept after it was last given to a pod.")
def k8s_webhook(tls_cert_file, tls_private_key_file, port, address, driver_name, device_class, memory_resource,
                utilization_resource, hami, kubeconfig, template_gc_interval, template_gc_grace):
    """Run the mutating admission webhook that turns GPU fractions in resources.limits into DRA claims.

    A container asking `vgpu.dev/gpu-memory: 4Gi` (and `vgpu.dev/gpu-utilization: "50"`)
    gets a ResourceClaimTemplate of the vgpu class with that capacity, the pod's
    resourceClaims and the container's resources.claims, and the extended resources
    removed.  What cannot work is refused with a message (docs/kubernetes.md).

    \b
    Example (what deploy/dra/webhook.yaml runs):
      vgpu-ctl k8s-webhook --tls-cert-file /tls/tls.crt --tls-private-key-file /tls/tls.key
    """
    import ssl
    from ..k8s import plugin_main, webhook
    plugin_main._require_extras()
    config = webhook.Config(driver_name=driver_name, device_class=device_class, memory_resource=memory_resource,
                            utilization_resource=utilization_resource, hami=hami, template_grace=template_gc_grace)
    try:
        api = plugin_main.api_client(kubeconfig)
    except plugin_main.PluginError as e:
        raise click.ClickException(error_line(e)) from None

    def log(event):
        click.echo(json.dumps({"ts": format_utc(), **event}), err=True)
    admitter = webhook.Admitter(config, api, log)
    try:
        httpd = webhook.serve(admitter, tls_cert_file, tls_private_key_file, address, port)
    except (OSError, ssl.SSLError) as e:
        raise click.ClickException(f"cannot serve HTTPS on {address}:{port} with {tls_cert_file}: {e}; hint: check "
                                   "the certificate and key files (PEM) and that the port is free") from None
    log({"event": "serving", "address": address, "port": httpd.server_port, "resources": config.names()})
    def run(stop):
        if template_gc_interval:
            webhook.collect_templates_every(admitter, template_gc_interval, stop)
        while not stop.wait(3600):
            pass
    _until_signalled(run)
    httpd.shutdown()
