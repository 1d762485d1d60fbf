"""Usage replay: how many GPUs do serving pods need, and what does it cost, given each pod
a whole GPU, a slice sized at its peak, or a slice whose memory vgpu's autoscaler moves
between a request and a limit?

Input: per-pod series of GPU memory used (bytes) and duty cycle (percent of time a kernel
ran), one sample per interval, in the format of the GenAI serving trace (Alibaba GenTD26,
../shared/traces/genai: `timestamp_anon,value,container_ip` and `value,timestamp_anon,
container_ip`, gzip or plain).  Nothing here talks to a GPU.

The three configurations, on GPUs of `gpu_bytes` each:
  whole:      one GPU per pod;
  peak:       a static slice per pod: memory = its peak, SM share = its peak duty; slices
              packed first-fit decreasing (memory, then SM summing to at most 100%);
  autoscaled: a slice per pod with request = a quantile of its memory (the size packed,
              the floor it never goes below) and limit = its GPU's memory, packed first-fit
              decreasing by request; each GPU then runs vgpu.policy.Simulation, the code
              `vgpu-ctl autoscale` decides with, on the samples: a pod whose use would pass
              its slice's memory.max at a sample is an OOM sample (its allocation refused:
              the autoscaler sees the refusal and the held memory, never the demand) and is
              held at its cap until it has grown.
Both slice configurations know each pod's whole series in advance (its peak, its
quantile): what an operator would size from a previous day of the same service.
SM: burst shares lend idle time, so duty is served while a GPU's pods ask for at most
100% in all; samples where they ask for more are counted as GPU time short.
"""
import csv
import gzip
import math
from dataclasses import dataclass

from . import policy as pol
from .errors import BadFile, InvalidRequest

MiB = 1 << 20
CONFIGS = ("whole", "peak", "autoscaled")


@dataclass
class Series:
    name: str
    memory: list           # bytes used at each sample of the common grid
    duty: list             # percent at each sample

    @property
    def peak(self) -> int:
        return max(self.memory)

    def quantile(self, q) -> int:
        s = sorted(self.memory)
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _open(path):
    try:
        return gzip.open(path, "rt", newline="") if str(path).endswith(".gz") else open(path, newline="")
    except OSError as e:
        raise BadFile(f"{path}: {e.strerror}", hint="give the GenAI trace's CSV files (.csv or .csv.gz)") from None


def _read(path, what):
    """{pod: {t: value}} from one of the trace's files."""
    out = {}
    try:
        with _open(path) as f:
            reader = csv.DictReader(f)
            missing = {"timestamp_anon", "value", "container_ip"} - set(reader.fieldnames or ())
            if missing:
                raise BadFile(f"{path}: no column {', '.join(sorted(missing))}",
                              hint="the GenAI trace's files have timestamp_anon, value and container_ip")
            for n, r in enumerate(reader, 2):
                try:
                    out.setdefault(r["container_ip"], {})[float(r["timestamp_anon"])] = float(r["value"])
                except (TypeError, ValueError):
                    raise BadFile(f"{path}:{n}: {what} {r.get('value')!r} at {r.get('timestamp_anon')!r} is not a number",
                                  hint="the trace's values and timestamps are numbers") from None
    except (OSError, EOFError) as e:
        raise BadFile(f"{path}: {e}", hint="give the GenAI trace's CSV files (.csv or .csv.gz)") from None
    return out


def read_series(memory_path, duty_path=None):
    """Each pod's series on the common grid of sample times (a missing sample repeats the
    pod's last one; before its first, its first).  Returns (times, [Series])."""
    memory = _read(memory_path, "memory")
    duty = _read(duty_path, "duty") if duty_path else {}
    if not memory:
        raise BadFile(f"{memory_path}: no samples", hint="give the GenAI trace's memory file")
    times = sorted({t for s in memory.values() for t in s})
    out = []
    for name in sorted(memory):
        mem, d = memory[name], duty.get(name, {})
        first_m, first_d = mem[min(mem)], (d[min(d)] if d else 0.0)
        ms, ds, lm, ld = [], [], first_m, first_d
        for t in times:
            lm, ld = mem.get(t, lm), d.get(t, ld)
            ms.append(int(lm))
            ds.append(float(ld))
        out.append(Series(name, ms, ds))
    return times, out


# === packing ===

def _pack(series, items, gpu_bytes):
    """First-fit decreasing: items (pod index, bytes, sm percent) onto GPUs of gpu_bytes and
    100% SM; returns [[pod index, ...] per GPU].  A pod larger than a GPU is refused."""
    gpus, room = [], []
    for key, size, sm in sorted(items, key=lambda it: (-it[1], -it[2], it[0])):
        if size > gpu_bytes:
            raise InvalidRequest(f"pod {series[key].name} needs {size / 2**30:.1f} GiB, more than a GPU's {gpu_bytes / 2**30:.1f} GiB",
                                 hint="assume a larger GPU (--gpu-memory)")
        for g, (free, sm_free) in enumerate(room):
            if free >= size and sm_free >= sm:
                gpus[g].append(key)
                room[g] = (free - size, sm_free - sm)
                break
        else:
            gpus.append([key])
            room.append((gpu_bytes - size, 100.0 - sm))
    return gpus


def _sm_short(series, gpus, samples):
    """Samples (pod-samples) at which a GPU's pods asked for more than 100% of its time."""
    short = 0
    for members in gpus:
        for k in range(samples):
            if sum(series[i].duty[k] for i in members) > 100.0:
                short += len(members)
    return short


# === the configurations ===

def _mean_used(series):
    """Bytes the pods use together, on average over the samples."""
    return sum(sum(s.memory) for s in series) / len(series[0].memory)


def whole(series, gpu_bytes):
    n = len(series)
    return {"config": "whole", "gpus": n, "memory_occupancy_pct": round(100.0 * _mean_used(series) / (n * gpu_bytes), 1),
            "oom_samples": 0, "oom_pct": 0.0, "held_below_demand_s": 0, "sm_short_samples": 0}


def peak(series, gpu_bytes):
    gpus = _pack(series, [(i, _align(s.peak), math.ceil(max(s.duty))) for i, s in enumerate(series)], gpu_bytes)
    return {"config": "peak", "gpus": len(gpus),
            "memory_occupancy_pct": round(100.0 * _mean_used(series) / (len(gpus) * gpu_bytes), 1),
            "oom_samples": 0, "oom_pct": 0.0, "held_below_demand_s": 0,
            "sm_short_samples": _sm_short(series, gpus, len(series[0].memory))}


def autoscaled(series, gpu_bytes, interval, times, request_quantile=0.5, policy=None):
    policy = policy or pol.Policy()
    samples = len(series[0].memory)
    requests = [_align(s.quantile(request_quantile)) for s in series]
    gpus = _pack(series, [(i, requests[i], 0) for i in range(len(series))], gpu_bytes)
    oom = served = 0       # OOM samples (each holds its pod below its demand for an interval); bytes served
    for members in gpus:
        names = {i: series[i].name for i in members}
        sim = pol.Simulation(policy, {pol.MEMORY: gpu_bytes},
                             {(names[i], pol.MEMORY): pol.Bounds(requests[i], gpu_bytes) for i in members},
                             {(names[i], pol.MEMORY): requests[i] for i in members}, start=times[0] - interval)
        for k, t in enumerate(times):
            batch = {}
            for i in members:
                key = (names[i], pol.MEMORY)
                cap, want = sim.quotas[key], series[i].memory[k]
                refused = want > cap
                oom += refused
                served += min(want, cap)
                batch[key] = pol.Sample(t, min(want, cap), cap, 1 if refused else 0)
            sim.step(t, batch)
    return {"config": "autoscaled", "request_quantile": request_quantile, "gpus": len(gpus),
            "memory_occupancy_pct": round(100.0 * served / samples / (len(gpus) * gpu_bytes), 1),
            "oom_samples": oom, "oom_pct": round(100.0 * oom / (samples * len(series)), 2),
            "held_below_demand_s": round(oom * interval),
            "sm_short_samples": _sm_short(series, gpus, samples)}


def _align(n):
    return -(-n // MiB) * MiB


def replay(times, series, gpu_bytes, request_quantiles=(0.5,), policy=None):
    """The three configurations (autoscaled once per request quantile): GPUs needed, mean
    memory occupancy of those GPUs, and the costs."""
    if len(times) < 2:
        raise InvalidRequest("the series need at least two samples", hint="give the whole trace")
    interval = (times[-1] - times[0]) / (len(times) - 1)
    out = [whole(series, gpu_bytes), peak(series, gpu_bytes)]
    out += [autoscaled(series, gpu_bytes, interval, times, q, policy) for q in request_quantiles]
    return {"pods": len(series), "samples": len(times), "interval_s": round(interval, 1),
            "hours": round((times[-1] - times[0]) / 3600, 1), "gpu_memory": gpu_bytes, "configs": out}
