"""The agent's state file, and what `status` shows of the agent's view."""
import fcntl
import json
import os
import time

from .. import driverlimits, procfs, slices
from ..quantities import format_memory
from .observe import Observer
from .settings import STATE_FILE


# === the state file (status reads what the agent judged) ===

def _state_path(directory):
    return os.path.join(slices.node_dir(directory), STATE_FILE)


def write_state(directory, state):
    """Rewrite the agent's state in place (not by rename: the node directory's mtime, which
    readers watch for new slices, stays put), under an exclusive flock."""
    data = (json.dumps(state, separators=(",", ":")) + "\n").encode()
    fd = os.open(_state_path(directory), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


def read_state(directory):
    """The agent's last state, or None without one (or a broken one)."""
    try:
        fd = os.open(_state_path(directory), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        data = os.read(fd, 1 << 22)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        state = json.loads(data)
    except ValueError:
        return None
    return state if isinstance(state, dict) else None


def agent_running(state, now=None) -> bool:
    """Is the agent that wrote `state` alive and current?"""
    if not state:
        return False
    now = time.time() if now is None else now
    fresh = now - state.get("updated", 0) <= max(5.0, 3 * state.get("interval_s", 1.0))
    return fresh and procfs.same_process(state.get("pid"), state.get("pid_start"))


# === for status ===

def annotate(data: dict, use_nvml=True):
    """Add the driver's view to `vgpu-ctl status`'s data: per slice device
    memory_driver, per process how it was attributed; unsliced and unknown GPU processes;
    and the agent's violations (when an agent runs)."""
    obs = Observer(data["dir"], use_nvml=use_nvml and data["nvml"]["available"])
    try:
        snap = obs.observe()
    finally:
        obs.close()
    for c in data["slices"]:
        c["driver_only"] = []    # its processes the driver lists that hold no slot of its own (no shim)
        for cd in c["devices"]:
            sd = snap.slices.get((c["name"], cd["index"]))
            cd["memory_driver"] = sd.driver if sd is not None else None
            cd["nvml_device"] = sd.place.label if sd is not None and sd.place is not None else None
            cd["driver_processes"] = [p.host_pid for p in sd.processes] if sd is not None else []
            if sd is not None:
                c["driver_only"] += [p.to_json() | {"command": procfs.cmdline(p.host_pid) or p.comm}
                                     for p in sd.processes if p.slot is None]
    procs = [p.to_json() | {"command": procfs.cmdline(p.host_pid) or p.comm}
             for p in snap.processes if p.attribution.state != "sliced"]
    data["unsliced"] = [p for p in procs if p["state"] in ("unsliced", "ambiguous")]
    data["unknown"] = [p for p in procs if p["state"] == "unknown"]
    state = read_state(data["dir"])
    running = agent_running(state)
    data["agent"] = {"running": running, "pid": state.get("pid") if running else None}
    data["violations"] = state.get("violations", []) if running else None
    limits = state.get("driver_limits") if running and isinstance(state.get("driver_limits"), dict) else {}
    for c in data["slices"]:
        mine, layer = limits.get(c["name"]), c.get("memory_layer")
        if not isinstance(mine, dict) or not layer or layer.get("layer") != "shim" or \
                layer.get("why") != "no cgroup of its own":
            continue
        if isinstance(mine.get("cgroup"), str):      # its container's cgroup, limited by the agent
            caps = {int(d["index"]): d["memory_max"] for d in c["devices"] if d.get("memory_max")}
            got, why = driverlimits.layer(data["dir"], c["name"], caps, cgroup=mine["cgroup"])
            c["memory_layer"] = {"layer": got, "why": why, "cgroup": mine["cgroup"]}
        elif isinstance(mine.get("why"), str):
            c["memory_layer"] = {"layer": "shim", "why": mine["why"]}
    gpus = state.get("gpus") if running and isinstance(state.get("gpus"), dict) else {}
    for d in data.get("devices") or []:
        h = gpus.get(str(d.get("index")))
        d["health"] = h if isinstance(h, dict) else None    # None: no agent watching it
    return data


def describe_violation(v: dict) -> str:
    what = {"over-cap": "holds more than its cap (driver)", "gap": "driver figure above the shim's",
            "unsliced": "a GPU process in no slice", "compute": "SM share above sm.max, unpaced",
            "forged": "usage file written by hand"}[v["kind"]]
    parts = [what]
    if v["kind"] == "forged":
        parts.append(", ".join(f"slot {s['slot']} charges {s['charge']}" for s in v.get("slots", ())) or
                     "charges sum past 2^64")
    if v.get("memory_driver") is not None and v["kind"] in ("over-cap", "gap"):
        parts.append(f"driver {format_memory(v['memory_driver'])}, shim {format_memory(v['memory_current'])}"
                     + (f", cap {format_memory(v['memory_max'])}" if v.get("memory_max") is not None else ""))
    if v["kind"] == "compute":
        parts.append(f"NVML {v['sm_nvml'] / 100:.0f}% vs sm.max {v['sm_max'] / 100:.0f}%")
    if v.get("offenders"):
        parts.append("pid " + ", ".join(map(str, v["offenders"])))
    parts.append(f"action {v['action']}")
    return "; ".join(parts)
