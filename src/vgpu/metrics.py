"""Prometheus metrics for a node's slices (`vgpu-ctl serve`, `vgpu-ctl autoscale --metrics-port`).

A custom collector: every scrape reads the slice files (kept open, see
vgpu.slices.reader.NodeReader) and, where it is there, NVML.  Nothing is sampled between
scrapes, so an idle exporter costs nothing.

Per slice and device (labels slice, device):
  vgpu_memory_used_bytes, vgpu_memory_peak_bytes        memory.current, its peak
  vgpu_memory_quota_bytes                               memory.max (+Inf: no cap)
  vgpu_memory_request_bytes, vgpu_memory_limit_bytes    autoscale floor and ceiling
  vgpu_memory_oom_refusals_total                        allocations refused by the cap
  vgpu_sm_quota_ratio, vgpu_sm_request_ratio, vgpu_sm_limit_ratio   sm.max etc. (1 = 100%)
  vgpu_sm_used_ratio                                    SM time used since the last scrape
                                                        (paced slices), else NVML's
                                                        per-process utilization
  vgpu_sm_gpu_time_seconds_total                        GPU time charged to paced launches
  vgpu_sm_throttled_seconds_total                       time launches waited at sm.max
  vgpu_sm_yielded_seconds_total                         burst mode: time they waited below sm.max,
                                                        for neighbours' guarantees
  vgpu_sm_guaranteed_ratio                              burst: sm.request; ceiling: sm.max
  vgpu_sm_allowance_ratio                               the share launches are paced at now
                                                        (the share board; while pacing)
  vgpu_launches_total                                   paced launches
Series of a slice the DRA driver made also carry namespace, pod and pod_container (the
pod's container).  Every series with a slice label also carries `container`, the label's
old name, with the same value: kept until the next release.
Per slice: vgpu_resize_events_total (quota writes: from the file's generation, so it
survives restarts), vgpu_processes (live processes), vgpu_sm_mode_info{slice,mode} (1).
Per device (label device): vgpu_device_memory_total_bytes, vgpu_device_memory_used_bytes,
  vgpu_device_utilization_ratio (NVML), vgpu_device_info{name,uuid};
  vgpu_device_memory_quota_bytes (sum of caps), vgpu_device_memory_guaranteed_bytes (sum
  of requests), vgpu_device_sm_quota_ratio (sum of sm.max), vgpu_device_slices
  (and vgpu_device_containers, its old name, until the next release).
  A MIG device is device="<gpu>/mig-<GI>-<CI>" (vgpu.agent.Place): a MIG slice's caps count
  there, never on the GPU its quota's index 0 would name.
The driver's view (vgpu.agent: each process NVML lists, attributed to a slice or not):
  vgpu_memory_driver_bytes{slice,device}   what the driver says the slice's processes hold
  vgpu_slice_device_info{slice,device,nvml_device,mig_uuid}   where NVML lists the slice's device
  vgpu_unsliced_memory_bytes{device}, vgpu_unsliced_processes{device}   GPU processes in no slice
  vgpu_unknown_processes{device}               GPU processes this agent cannot see (pid namespace)
With the node agent (`vgpu-ctl agent`): vgpu_violations_total{slice,kind} (slice
"" for an unsliced process), vgpu_violations_active{slice,kind},
vgpu_agent_actions_total{kind,action}, vgpu_agent_gaps_unjudged_total{slice,device},
vgpu_agent_reaped_slots_total,
vgpu_agent_iterations_total, vgpu_agent_iteration_cpu_seconds; vgpu_gpu_healthy{device},
vgpu_gpu_xid_errors_total{device,xid} (vgpu.health: NVML's XID events).
vgpu_nvml_up: 1 when NVML answered.  With the autoscaler: vgpu_autoscale_decisions_total
{slice,device,resource,action}, vgpu_autoscale_ticks_total,
vgpu_autoscale_tick_cpu_seconds.
"""
import collections
import math
import threading
import time

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import podlabels, slices
from .slices.reader import NodeReader
from .agent.model import record_place
from .agent.observe import Observer
from .quantities import SHARE_FULL, UNLIMITED
from .snapshot import SmUse, Snapshot

_CD = ["slice", "device"]
# Names changed in this release, the old ones still served until the next: every series
# with a `slice` label also carries `container` (its old name, same value), and
# vgpu_device_containers repeats vgpu_device_slices.
OLD_LABEL = "container"
_OLD = " Label container: the old name of slice, kept until the next release."


def _inf(v):
    return math.inf if v == UNLIMITED else float(v)


class NodeCollector:
    """Collects a node directory's metrics on each scrape (thread-safe)."""

    def __init__(self, directory=None, use_nvml=True, autoscaler=None, agent=None):
        self.directory = slices.node_dir(directory)
        self.use_nvml = use_nvml
        self.autoscaler = autoscaler
        self.agent = agent
        self._observer = None    # without an agent: the driver's view is taken on each scrape
        self.reader = NodeReader(self.directory)
        self._sm_use = SmUse()   # SM use between two scrapes
        self._lock = threading.Lock()

    def describe(self):
        return []                # no collect() at registration

    def _driver_view(self, ok):
        """The driver's figures (the agent's last snapshot, or one taken now) and the
        agent's violations and actions."""
        snap = None
        if self.agent is not None:
            snap = self.agent.latest
        elif ok:
            if self._observer is None:
                self._observer = Observer(self.directory, use_nvml=self.use_nvml)
            try:
                snap = self._observer.observe()
            except Exception:   # a slice vanishing mid-look: the next scrape tries again
                snap = None
        out = []
        if snap is not None and snap.nvml_ok:
            drv = GaugeMetricFamily("vgpu_memory_driver_bytes", "Device memory the slice's processes hold, as the "
                                    "driver (NVML) says.", labels=_CD)
            where = GaugeMetricFamily("vgpu_slice_device_info", "Where NVML lists a slice's device: nvml_device "
                                      "is the GPU's index, or <gpu>/mig-<GI>-<CI> for a MIG device (a MIG slice's "
                                      "device 0), as the per-device series name it.",
                                      labels=[*_CD, "nvml_device", "mig_uuid"])
            for (name, d), sd in sorted(snap.slices.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
                if sd.driver is not None:
                    drv.add_metric([name, str(d)], sd.driver)
                if sd.place is not None:
                    where.add_metric([name, str(d), sd.place.label, sd.place.mig or ""], 1)
            mem = GaugeMetricFamily("vgpu_unsliced_memory_bytes", "Device memory held by processes in no slice "
                                    "(NVML).", labels=["device"])
            cnt = GaugeMetricFamily("vgpu_unsliced_processes", "GPU processes in no slice.", labels=["device"])
            unk = GaugeMetricFamily("vgpu_unknown_processes", "GPU processes NVML lists that this agent cannot "
                                    "see (another pid namespace): neither attributed nor acted on.",
                                    labels=["device"])
            # per device NVML lists processes on: a GPU ("0"), a MIG device ("1/mig-2-0")
            for place in snap.places:
                un = [p for p in snap.unsliced() if p.place == place]
                mem.add_metric([place.label], sum(p.driver or 0 for p in un))
                cnt.add_metric([place.label], len(un))
                unk.add_metric([place.label], sum(1 for p in snap.unknown() if p.place == place))
            out += [drv, where, mem, cnt, unk]
        a = self.agent
        if a is not None:
            total = CounterMetricFamily("vgpu_violations", "Violations the node agent found (one per start), by "
                                        "slice (\"\" for an unsliced process) and kind." + _OLD, labels=["slice", "kind"])
            for (name, kind), n in sorted(a.judge.counts.items()):
                total.add_metric([name or "", kind], n)
            active = GaugeMetricFamily("vgpu_violations_active", "Violations going on now." + _OLD,
                                       labels=["slice", "kind"])
            now = collections.Counter((v.slice or "", v.kind) for v in list(a.judge.active.values()))
            for (name, kind), n in sorted(now.items()):
                active.add_metric([name, kind], n)
            acts = CounterMetricFamily("vgpu_agent_actions", "Actions the node agent took on processes.",
                                       labels=["kind", "action"])
            for (kind, action), n in sorted(a.actions_total.items()):
                acts.add_metric([kind, action], n)
            unjudged = CounterMetricFamily("vgpu_agent_gaps_unjudged", "Gaps the node agent left unjudged in a "
                                           "look: the slice's charges moved in each bracketed look at the driver." + _OLD,
                                           labels=["slice", "device"])
            for (name, d), n in sorted(a.judge.unjudged.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
                unjudged.add_metric([name, str(d)], n)
            reaped = CounterMetricFamily("vgpu_agent_reaped_slots", "Dead processes' slots the agent reaped.")
            reaped.add_metric([], a.reaped_total)
            its = CounterMetricFamily("vgpu_agent_iterations", "Node agent loop iterations.")
            its.add_metric([], a.iterations)
            cpu = GaugeMetricFamily("vgpu_agent_iteration_cpu_seconds", "CPU time of the agent's last iteration.")
            cpu.add_metric([], a.last_iteration_cpu_s)
            out += [total, active, acts, unjudged, reaped, its, cpu]
            if a.health is not None and a.health.ready.is_set() and a.health.unavailable is None:
                healthy = GaugeMetricFamily("vgpu_gpu_healthy", "1 while the GPU takes new slices; 0 after an XID "
                                            "NVIDIA says needs a reset, or once it fell off the bus.",
                                            labels=["device"])
                xids = CounterMetricFamily("vgpu_gpu_xid_errors", "XID errors NVML reported on the GPU, by XID.",
                                           labels=["device", "xid"])
                for i, h in a.health.gpus().items():
                    healthy.add_metric([str(i)], 1 if h["healthy"] else 0)
                    for x, n in h["xids"].items():
                        xids.add_metric([str(i), x], n)
                out += [healthy, xids]
        return out

    def collect(self):
        with self._lock:
            return self._collect()

    def _collect(self):
        now = time.monotonic()
        views = self.reader.refresh(now)

        g = {name: GaugeMetricFamily(f"vgpu_{name}", doc + _OLD, labels=_CD) for name, doc in (
            ("memory_used_bytes", "Device memory the slice holds (memory.current)."),
            ("memory_peak_bytes", "Most device memory the slice has held."),
            ("memory_quota_bytes", "The slice's memory cap (memory.max); +Inf: no cap."),
            ("memory_request_bytes", "Guaranteed memory: the autoscaler's floor."),
            ("memory_limit_bytes", "The autoscaler's memory ceiling."),
            ("sm_quota_ratio", "The slice's share of SM time (sm.max; 1 = the whole GPU)."),
            ("sm_request_ratio", "Guaranteed SM share: the autoscaler's floor."),
            ("sm_limit_ratio", "The autoscaler's SM share ceiling."),
            ("sm_used_ratio", "SM time the slice used over the last interval, as a share of the GPU."),
            ("sm_guaranteed_ratio", "The SM share guaranteed when every slice wants its own (burst: sm.request; "
                                    "ceiling: sm.max)."),
            ("sm_allowance_ratio", "The SM share the slice's launches are paced at now (burst: its guarantee "
                                   "plus idle time lent, up to sm.max)."),
        )}
        c = {name: CounterMetricFamily(f"vgpu_{name}", doc + _OLD, labels=_CD) for name, doc in (
            ("memory_oom_refusals", "Allocations refused because they would exceed memory.max."),
            ("sm_gpu_time_seconds", "GPU time charged to the slice's paced launches (sm.max < 100%)."),
            ("sm_throttled_seconds", "Time the slice's launches waited at its SM ceiling (sm.max)."),
            ("sm_yielded_seconds", "Time the slice's launches waited below sm.max, for other slices' "
                                   "guarantees (burst mode)."),
            ("launches", "Kernel launches paced against sm.max (none are counted at 100%)."),
        )}
        resizes = CounterMetricFamily("vgpu_resize_events", "Quota changes since the slice was created "
                                      "(resize and autoscale)." + _OLD, labels=["slice"])
        procs = GaugeMetricFamily("vgpu_processes", "Live processes of the slice." + _OLD, labels=["slice"])
        modes = GaugeMetricFamily("vgpu_sm_mode_info", "The slice's SM mode (burst or ceiling): 1." + _OLD,
                                  labels=["slice", "mode"])
        layers = GaugeMetricFamily("vgpu_memory_layer_info", "Who holds the slice's memory cap: 1 for "
                                   "driver+shim (the driver's per-cgroup limit too) or shim." + _OLD,
                                   labels=["slice", "layer"])
        listed = None            # MIG devices as the agent last saw them: {UUID: Place}
        if self.agent is not None:
            listed = self.agent.observer.mig_places
        elif self._observer is not None:
            listed = self._observer.mig_places
        entries, where = [], {}
        for name, v in sorted(views.items()):
            v.refresh_quota()
            record = v.mig       # a MIG slice's device 0 is its MIG device: counted there, never as GPU 0
            where[name] = None if record is None else record_place(record, listed).label
            usage, problem = None, None
            try:
                if self.agent is None:     # the node agent reaps (at once, as processes end)
                    slices.reap_quietly(self.directory, name)
                usage = slices.read_usage(self.directory, name)
            except (slices.VgpuError, OSError) as e:
                problem = str(e)
            entries.append((name, v.quota, usage, problem, record is not None))
            resizes.add_metric([name], max(0, (v.gen - 2) // 2))
        cgroups = {}
        if self.agent is not None and self.agent.cgroup_limits is not None:
            cgroups = {name: applied[0] for name, applied in self.agent.cgroup_limits.applied.items() if applied}
        snap = Snapshot(self.directory, entries, self._sm_use, now, self.use_nvml, cgroups)
        ok, nv_devices = snap.nvml_ok, snap.nv_devices
        for s in snap.slices:
            name = s.name
            procs.add_metric([name], sum(1 for p in s.usage.procs if p.alive) if s.usage else 0)
            modes.add_metric([name, s.quota.sm_mode], 1)
            layers.add_metric([name, s.memory_layer[0]], 1)
            for f in s.devices:
                lab, q = [name, str(f.index)], f.quota
                g["memory_quota_bytes"].add_metric(lab, _inf(q.memory_max))
                g["memory_request_bytes"].add_metric(lab, _inf(q.memory_request))
                g["memory_limit_bytes"].add_metric(lab, _inf(q.memory_limit))
                g["sm_quota_ratio"].add_metric(lab, q.sm_max / SHARE_FULL)
                g["sm_request_ratio"].add_metric(lab, q.sm_request / SHARE_FULL)
                g["sm_limit_ratio"].add_metric(lab, q.sm_limit / SHARE_FULL)
                g["sm_guaranteed_ratio"].add_metric(lab, f.sm_guaranteed / SHARE_FULL)
                if f.sm_allowance is not None:
                    g["sm_allowance_ratio"].add_metric(lab, f.sm_allowance / SHARE_FULL)
                k = f.counters
                if k is None:
                    continue     # its usage file cannot be read: no counters rather than wrong ones
                g["memory_used_bytes"].add_metric(lab, k["memory_current"])
                g["memory_peak_bytes"].add_metric(lab, k["memory_peak"])
                c["memory_oom_refusals"].add_metric(lab, k["oom_refusals"])
                c["sm_gpu_time_seconds"].add_metric(lab, k["gpu_time_ns"] / 1e9)
                c["sm_throttled_seconds"].add_metric(lab, k["throttled_ns"] / 1e9)
                c["sm_yielded_seconds"].add_metric(lab, k["yielded_ns"] / 1e9)
                c["launches"].add_metric(lab, k["launches"])
                if f.sm_used is not None:
                    g["sm_used_ratio"].add_metric(lab, f.sm_used / SHARE_FULL)
        per_dev = snap.totals(lambda s, f: str(f.index) if where[s.name] is None else where[s.name])

        out = [*g.values(), *c.values(), resizes, procs, modes, layers]
        dev = {name: GaugeMetricFamily(f"vgpu_device_{name}", doc, labels=["device"]) for name, doc in (
            ("memory_quota_bytes", "Sum of the memory caps handed out on the device."),
            ("memory_guaranteed_bytes", "Sum of the memory requests (guarantees) on the device."),
            ("sm_quota_ratio", "Sum of the SM shares handed out on the device (1 = the whole GPU)."),
            ("slices", "Slices holding the device."),
            ("containers", "Slices holding the device: the old name of vgpu_device_slices, kept until the next "
                           "release."),
        )}
        for d, t in sorted(per_dev.items()):
            dev["memory_quota_bytes"].add_metric([d], t.memory_allocated)
            dev["memory_guaranteed_bytes"].add_metric([d], t.memory_guaranteed)
            dev["sm_quota_ratio"].add_metric([d], t.sm_allocated / SHARE_FULL)
            dev["slices"].add_metric([d], t.slices)
            dev["containers"].add_metric([d], t.slices)
        out += dev.values()
        up = GaugeMetricFamily("vgpu_nvml_up", "1 when NVML answered this scrape.")
        up.add_metric([], 1 if ok else 0)
        out.append(up)
        out += self._driver_view(ok)
        if ok and nv_devices:
            total = GaugeMetricFamily("vgpu_device_memory_total_bytes", "Physical memory of the device (NVML).",
                                      labels=["device"])
            used = GaugeMetricFamily("vgpu_device_memory_used_bytes", "Memory in use on the device, all "
                                     "processes (NVML).", labels=["device"])
            util = GaugeMetricFamily("vgpu_device_utilization_ratio", "Share of time the device was busy "
                                     "(NVML).", labels=["device"])
            info = GaugeMetricFamily("vgpu_device_info", "The device's name and UUID.",
                                     labels=["device", "name", "uuid"])
            for nd in nv_devices:
                lab = [str(nd["index"])]
                if nd["memory_total"] is not None:
                    total.add_metric(lab, nd["memory_total"])
                if nd["memory_used"] is not None:
                    used.add_metric(lab, nd["memory_used"])
                if nd["gpu_util"] is not None:
                    util.add_metric(lab, nd["gpu_util"] / 100)
                info.add_metric([*lab, nd["name"] or "", nd["uuid"] or ""], 1)
            out += [total, used, util, info]
        a = self.autoscaler
        if a is not None:
            dec = CounterMetricFamily("vgpu_autoscale_decisions", "Autoscale decisions (hold: wanted to change, "
                                      "could not; counted once a window)." + _OLD,
                                      labels=["slice", "device", "resource", "action"])
            for (name, d, r, action), n in sorted(a.decisions_total.items()):
                dec.add_metric([name, str(d), r, action], n)
            ticks = CounterMetricFamily("vgpu_autoscale_ticks", "Autoscale loop iterations.")
            ticks.add_metric([], a.ticks)
            cpu = GaugeMetricFamily("vgpu_autoscale_tick_cpu_seconds", "CPU time of the last loop iteration.")
            cpu.add_metric([], a.last_tick_s)
            out += [dec, ticks, cpu]
        return _with_old_label(_with_pod_labels(out, self.directory, views))


POD_LABELS = {"namespace": "namespace", "pod": "pod", "container": "pod_container"}   # podlabels key -> label


def _with_pod_labels(families, directory, names):
    """Every series of a slice the DRA driver made also carries namespace, pod and
    pod_container (the pod's container; `slice` is the slice's name); a slice made by hand keeps its
    labels as they were."""
    extra = {}
    for name in names:
        known = podlabels.read(directory, name)
        if known.get("pod"):
            extra[name] = {label: known.get(key, "") for key, label in POD_LABELS.items()}
    if extra:
        for f in families:
            f.samples = [s._replace(labels={**s.labels, **extra[s.labels["slice"]]})
                         if s.labels.get("slice") in extra else s for s in f.samples]
    return families


def _with_old_label(families):
    """Every series with a slice label also carries it as `container`, its old name
    (kept until the next release)."""
    for f in families:
        f.samples = [s._replace(labels={**s.labels, OLD_LABEL: s.labels["slice"]}) if "slice" in s.labels else s
                     for s in f.samples]
    return families


def start(directory=None, port=9400, address="0.0.0.0", use_nvml=True, autoscaler=None, agent=None):
    """Serve /metrics in a background thread; returns the HTTP server (its
    server_port is the port, also when 0 asked for any free one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(directory, use_nvml=use_nvml, autoscaler=autoscaler, agent=agent))
    httpd, _ = start_http_server(port, address, registry=registry)
    return httpd
