"""What `vgpu-ctl status` shows: per slice and per device, from the slice files, the
process table, psutil and NVML.  collect() returns data; render() makes the tables.

Pids in a usage file are as the container sees them.  The host pid of each process (what
NVML and psutil know) is found through the usage file itself: every process of the slice
has it mapped, so /proc/<pid>/maps names its inode, and /proc/<pid>/status's NSpid line
gives the pid inside the container.  No assumption that the two pid spaces agree.
"""
import time

from . import mig, nvml, podlabels, procfs
from .agent.state import annotate, describe_violation
from .quantities import format_duration_ns, format_memory, format_share
from .slices import CEILING, NotFound, VgpuError, has_mig, list_names, node_dir, read_all, read_mig, read_quota
from .slices.usage import COUNTERS
from .snapshot import SmUse, Snapshot, Totals


def _command(host_pid, comm):
    if host_pid is None:
        return comm
    try:
        import psutil
        cmd = psutil.Process(host_pid).cmdline()
        return " ".join(cmd) if cmd else comm
    except Exception:   # gone, or not ours to read
        return comm


# === collect ===

def collect(directory=None, name=None, previous=None, use_nvml=True) -> dict:
    """Everything status shows: the node's Snapshot, with each slice's processes, MIG
    instance and pod labels.  `previous`: the result of the last call (watch mode), so SM
    use can come from the usage file's GPU-time counters over the interval."""
    directory = node_dir(directory)
    if name is not None and name not in list_names(directory):
        raise NotFound(f"slice {name} not found in {directory}", "`vgpu-ctl list` shows the slices")
    now = time.monotonic()
    sm_use = (previous or {}).get("_sm_use") or SmUse()
    entries = [(cname, quota, usage, problem, has_mig(directory, cname))
               for cname, quota, usage, problem in read_all(directory)]
    snap = Snapshot(directory, entries, sm_use, now, use_nvml)
    ok, nv_devices = snap.nvml_ok, snap.nv_devices
    found = []   # all of them: a device's allocation is the whole node's, even when one is asked for
    for s in snap.slices:
        entry = {"name": s.name, "problem": s.problem, "generation": s.quota.generation if s.quota else None,
                 "labels": podlabels.read(directory, s.name), "devices": [], "processes": []}
        found.append(entry)
        if s.quota is None:
            continue
        mig = _mig_entry(directory, s.name) if s.mig else None
        if mig is not None:
            entry["mig"] = mig
        entry["sm_mode"] = s.quota.sm_mode
        layer, why = s.memory_layer
        entry["memory_layer"] = {"layer": layer, "why": why}   # who holds its memory cap (driverlimits.py)
        gpu = {"gpu": mig["device"]} if mig and mig.get("device") is not None else {}
        for f in s.devices:
            entry["devices"].append({"index": f.index, **gpu, **f.quota.to_json(),
                                     **(f.counters or dict.fromkeys(COUNTERS, 0)),
                                     "sm_used": f.sm_used, "sm_used_source": f.sm_used_source,
                                     "throttled_ns_per_s": f.throttled_ns_per_s,
                                     "sm_guaranteed": f.sm_guaranteed, "sm_allowance": f.sm_allowance})
        hosts = s.host_pids()
        entry["shared"] = []    # memory shared between processes, in shared slots: no process of its own
        my_ns = procfs.pid_ns()
        shown = [f.index for f in s.devices]
        for p in (s.usage.procs if s.usage else []):
            if p.shared:
                entry["shared"].append(_shared_entry(p, hosts, my_ns))
                continue
            host = hosts.get(p.pid) if p.alive else None
            # alive by its lock, but its process gone: a child it forked holds its slot (and its memory)
            gone = p.alive and host is None and bool(my_ns) and p.pid_ns == my_ns and _gone(p.pid, p.start_ticks)
            if gone:
                host = p.pid    # what NVML lists its memory under
            entry["processes"].append({
                **p.to_json(), "host_pid": host, "gone": gone,
                "command": _command(host, p.comm) if p.alive and not gone else p.comm,
                "sm_util": {str(d): snap.process_utilization(d).get(host, 0) * 100 for d in shown}
                if ok and host and not s.mig else None})

    # per device: what is promised against what there is
    # (a MIG slice's device 0 is its instance: counted apart, on its GPU)
    totals = snap.totals(lambda s, f: None if s.mig else f.index)
    indices = sorted(set(totals)
                     | {c["mig"]["device"] for c in found if c.get("mig", {}).get("device") is not None}
                     | ({d["index"] for d in nv_devices} if nv_devices else set()))
    devices = []
    for d in indices:
        nd = nv_devices[d] if nv_devices and d < len(nv_devices) else {}
        t = totals.get(d) or Totals()
        devices.append({
            "index": d, "name": nd.get("name"), "uuid": nd.get("uuid"),
            "memory_total": nd.get("memory_total"), "memory_used": nd.get("memory_used"),
            "gpu_util": None if nd.get("gpu_util") is None else nd["gpu_util"] * 100,
            "memory_allocated": t.memory_allocated, "memory_unlimited": t.memory_unlimited,
            "memory_guaranteed": t.memory_guaranteed, "memory_in_use": t.memory_in_use,
            "sm_allocated": t.sm_allocated, "sm_guaranteed": t.sm_guaranteed, "sm_ceilings": t.sm_ceilings,
            "slices": t.slices})
        migs = sum(1 for c in found if c.get("mig", {}).get("device") == d)
        if migs:   # MIG slices on the GPU (their instances, not in the figures above)
            devices[-1]["mig_slices"] = migs
    if name is not None:
        found = [c for c in found if c["name"] == name]
    driver = nvml.driver_version() if ok else None
    data = {"dir": directory, "nvml": {"available": ok, "note": snap.nvml_note, "driver": driver},
            "slices": found, "devices": devices, "_t": now, "_sm_use": sm_use}
    # the driver's view: who holds what, slices or not, and the agent's verdicts (a MIG
    # slice's driver figure: its processes on its MIG device)
    data = annotate(data, use_nvml=ok)
    return data


def _gone(pid, start_ticks) -> bool:
    """Is the process that claimed a slot of our pid namespace gone (or a zombie)?"""
    if start_ticks and not procfs.same_process(pid, start_ticks):
        return True
    return procfs.state(pid) in (None, "Z", "X")


def _shared_entry(p, hosts, my_ns) -> dict:
    """A shared slot as status shows it: memory of the slice that processes share, under
    its exporter (as NVML lists it), held while `held`."""
    host = hosts.get(p.exporter)
    if host is None and my_ns and p.pid_ns == my_ns:
        host = p.exporter
    alive = p.exporter in hosts     # (its own slot is live: it runs the shim still)
    return {"slot": p.slot, "exporter_pid": p.exporter, "exporter_host_pid": host, "exporter_alive": alive,
            "memory": {str(d): b for d, b in p.memory.items()}, "held": p.alive, "comm": p.comm,
            "started_ns": p.started_ns, "pid_ns": p.pid_ns}


def _mig_entry(directory, name):
    """A MIG slice's record and its instance as NVML sees it (memory, processes)."""
    try:
        record = read_mig(directory, name)
    except VgpuError as e:
        return {"problem": str(e), "device": None, "present": False}
    try:
        seen = mig.view(record)
    except (KeyError, TypeError) as e:   # a record without the fields vgpu.mig writes
        return {"problem": f"{name}'s MIG record lacks {e}", "device": None, "present": False}
    return {**record, **seen, "processes": [{"host_pid": pid, "memory": mem} for pid, mem in
                                            sorted(seen["processes"].items())]}


def sm_shares(directory) -> dict:
    """device -> {slice: guaranteed share} over the node's readable slices (burst:
    sm.request, ceiling: sm.max), for the warning that they add up to more than 100%."""
    out = {}
    for name in list_names(directory):
        try:
            quota = read_quota(directory, name)
        except VgpuError:
            continue
        if has_mig(directory, name):   # its share is of its MIG instance, not of the GPU
            continue
        for d in quota.held():
            out.setdefault(d, {})[name] = quota.guaranteed_sm(d)
    return out


def public(data: dict) -> dict:
    """The JSON form (no private fields)."""
    return {k: v for k, v in data.items() if not k.startswith("_")}


# === render ===

def table(headers, rows) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in [headers, *rows]]
    return "\n".join(lines)


def _mem(v):
    return "max" if v is None else format_memory(v)


def _percent(v):
    """A measured share (1/100 percent) in whole percent, whatever its source, so the
    columns keep one format from frame to frame; None -> `-`."""
    return "-" if v is None else f"{round(v / 100)}%"


def _describe_violation(v):
    return describe_violation(v)


def _share_text(c, cd) -> str:
    """sm.max, or in burst mode with a guarantee below it guarantee-ceiling and, while it
    paces, what it is allowed now: 30-100% (now 72%)."""
    g = cd.get("sm_guaranteed", cd["sm_max"])
    if c.get("sm_mode") == CEILING or g >= cd["sm_max"]:
        return format_share(cd["sm_max"])
    now = cd.get("sm_allowance")
    return f"{format_share(g).rstrip('%')}-{format_share(cd['sm_max'])}" + \
        ("" if now is None else f" (now {format_share(now)})")


def render(data: dict, wide=True) -> str:
    out = []
    rows = []
    # slices the DRA driver made say whose they are: namespace/pod/container
    pods = any(podlabels.shown(c.get("labels") or {}) for c in data["slices"])
    for c in data["slices"]:
        pod = [podlabels.shown(c.get("labels") or {}) or "-"] if pods else []
        if c["problem"]:
            rows.append([c["name"], *pod, "-", "-", "-", "-", "-", "-", "-", f"error: {c['problem']}"])
            continue
        live = sum(1 for p in c["processes"] if p["alive"] and not p.get("gone"))
        held = sum(1 for p in c["processes"] if p.get("gone"))
        dead = len(c["processes"]) - live - held
        for cd in c["devices"]:
            mem_cap = cd["memory_max"]
            gpu_mem = f"{format_memory(cd['memory_current'])}/{_mem(mem_cap)}"
            if mem_cap:
                gpu_mem += f" ({cd['memory_current'] * 100 // mem_cap}%)"
            util = f"{_percent(cd['sm_used'])}/{_share_text(c, cd)}"
            procs = str(live) + (f" (+{held} held)" if held else "") + (f" (+{dead} dead)" if dead else "")
            rate = cd.get("throttled_ns_per_s")
            throttled = format_duration_ns(cd["throttled_ns"]) if rate is None else f"{rate / 1e6:.0f}ms/s"
            driver = "-" if cd.get("memory_driver") is None else format_memory(cd["memory_driver"])
            where = f"{cd['gpu']}:{c['mig'].get('profile', 'MIG')}" if "gpu" in cd else cd["index"]
            rows.append([c["name"], *pod, where, gpu_mem, driver, util, throttled, cd["oom_refusals"], procs,
                         c["generation"]])
    if rows:
        out.append(table(["SLICE", *(["POD"] if pods else []), "DEVICE", "GPU-MEMORY", "DRIVER", "GPU-UTIL",
                          "THROTTLED", "OOM", "PROCESSES", "GEN"], rows))
    else:
        out.append(f"no slices in {data['dir']}")
    held = [c["name"] for c in data["slices"] if (c.get("memory_layer") or {}).get("layer") == "driver+shim"]
    if held:   # said only where the driver's per-cgroup limits are in use at all
        alone = [f"{c['name']} ({c['memory_layer']['why']})" for c in data["slices"]
                 if (c.get("memory_layer") or {}).get("layer") == "shim"]
        out.append(f"memory capped by the driver too: {', '.join(held)}" +
                   (f"; by the shim alone: {', '.join(alone)}" if alone else ""))

    prow = []
    for c in data["slices"]:
        for p in c["processes"]:
            mem = ", ".join(f"{format_memory(b)}" + (f" on {d}" if len(p["memory"]) > 1 else "")
                            for d, b in p["memory"].items()) or "0"
            sm = "-" if p["sm_util"] is None else ", ".join(_percent(v) for v in p["sm_util"].values())
            cmd = p["command"] if p["alive"] else f"{p['command']} (dead: vgpu-ctl reap)"
            if p.get("gone"):
                cmd = f"(gone: held by a forked child) {p['command']}"
            prow.append([c["name"], p["pid"], p["host_pid"] if p["host_pid"] is not None else "-", mem, sm,
                         cmd if len(cmd) <= 60 else cmd[:57] + "..."])
        for s in c.get("shared", []):   # memory its processes share: under its exporter, held by them
            mem = ", ".join(f"{format_memory(b)}" + (f" on {d}" if len(s["memory"]) > 1 else "")
                            for d, b in s["memory"].items()) or "0"
            by = f"pid {s['exporter_pid']}" + ("" if s["exporter_alive"] else ", gone")
            cmd = f"(shared: exported by {by})" if s["held"] else f"(shared, not held: vgpu-ctl reap) by {by}"
            prow.append([c["name"], "-", "-", mem, "-", cmd if len(cmd) <= 60 else cmd[:57] + "..."])
        for p in c.get("driver_only", []):   # the driver lists it as the slice's; it holds no slot (no shim)
            mem = "-" if p["memory_driver"] is None else format_memory(p["memory_driver"])
            cmd = f"(no slot: by {p['method']}) {p.get('command') or p.get('comm') or '?'}"
            prow.append([c["name"], "-", p["host_pid"], mem, _percent(p["sm_util"]),
                         cmd if len(cmd) <= 60 else cmd[:57] + "..."])
    # GPU processes in no slice (or that this host cannot see): the driver's figures
    for p in data.get("unsliced", []) + data.get("unknown", []):
        what = {"unsliced": "(unsliced)", "ambiguous": "(ambiguous)", "unknown": "(unknown)"}[p["state"]]
        mem = "-" if p["memory_driver"] is None else format_memory(p["memory_driver"])
        cmd = p.get("command") or p.get("comm") or "?"
        if p["state"] == "ambiguous":
            cmd = f"{cmd} (claimed by {', '.join(p.get('candidates', []))})"
        where = p.get("nvml_device") or str(p["device"])          # (a MIG device: "0/mig-2-0")
        on = len(data["devices"]) > 1 or "/" in where
        prow.append([what, "-", p["host_pid"], mem + (f" on {where}" if on else ""),
                     _percent(p["sm_util"]), cmd if len(cmd) <= 60 else cmd[:57] + "..."])
    if prow and wide:
        out.append("")
        out.append(table(["SLICE", "PID", "HOST-PID", "GPU-MEMORY", "GPU-UTIL", "COMMAND"], prow))

    drow = []
    for d in data["devices"]:
        alloc = format_memory(d["memory_allocated"]) + (f" + {d['memory_unlimited']} uncapped"
                                                       if d["memory_unlimited"] else "")
        total = d["memory_total"]
        drow.append([d["index"], d["name"] or "-",
                     f"{alloc}/{format_memory(total)}" if total else alloc,
                     format_memory(d["memory_guaranteed"]),
                     f"{format_memory(d['memory_used'])}/{format_memory(total)}" if total else "-",
                     format_share(d["sm_allocated"]) + (" (ceilings)" if d["sm_ceilings"] else ""),
                     _percent(d["gpu_util"]),
                     str(d["slices"]) + (f" + {d['mig_slices']} MIG" if d.get("mig_slices") else "")])
    if drow:
        out.append("")
        out.append(table(["DEVICE", "NAME", "MEMORY-ALLOCATED", "GUARANTEED", "MEMORY-USED", "SM-ALLOCATED",
                           "GPU-UTIL", "SLICES"], drow))
    mrows = []
    for c in data["slices"]:
        m = c.get("mig")
        if not m:
            continue
        if m.get("problem"):
            mrows.append([c["name"], "-", "-", "-", "-", "-", f"error: {m['problem']}", "-", "-"])
            continue
        used = (f"{format_memory(m['memory_used'])}/{format_memory(m['memory_total'])}" if m["present"]
                and m["memory_used"] is not None else "instance not found" if not m["present"] else "-")
        mrows.append([c["name"], m["device"], m["profile"], f"{m['placement']['start']}:{m['placement']['size']}",
                      m["gpu_instance"], m["compute_instance"], used, len(m["processes"]) if m["present"] else "-",
                      m["uuid"]])
    if mrows:
        out.append("")
        out.append(table(["MIG-SLICE", "DEVICE", "PROFILE", "PLACEMENT", "GI", "CI", "MEMORY-USED", "PROCESSES",
                          "UUID"], mrows))
    sick = [d for d in data.get("devices") or [] if (d.get("health") or {}).get("healthy") is False]
    if sick:
        out.append("")
        out.append(table(["UNHEALTHY-GPU", "SINCE", "WHY"], [
            [d["index"], d["health"].get("since") or "-",
             d["health"].get("reason") or "-"] for d in sick]))
    vrows = [[v["kind"], v.get("slice") or "-", v.get("device", "-"), _describe_violation(v)]
             for v in data.get("violations") or []]
    if vrows:
        out.append("")
        out.append(table(["VIOLATION", "SLICE", "DEVICE", "WHAT"], vrows))
    if not data["nvml"]["available"]:
        out.append("")
        out.append(f"note: NVML unavailable ({data['nvml']['note']}): no device capacity, real usage or "
                   "per-process GPU-UTIL")
    return "\n".join(out)
