"""`vgpu-ctl replay` (vgpu.replay): pods' memory and duty series, whole GPUs vs slices sized at
their peak vs autoscaled slices, on hand-made series whose answers are worked out by hand."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

from vgpu import replay

CTL = str(Path(sys.executable).parent / "vgpu-ctl")
GiB = 1 << 30
T0, STEP = 1000.0, 57.0

# GPUs of 10 GiB.  P and Q hold 4 GiB all along, R holds 1 GiB and then 9 at the last sample.
MEMORY = {"p": [4, 4, 4, 4], "q": [4, 4, 4, 4], "r": [1, 1, 1, 9]}
DUTY = {"p": [60, 60, 60, 60], "q": [30, 30, 30, 30], "r": [20, 20, 20, 20]}


def write(tmp_path, gz=True):
    mem = "timestamp_anon,value,container_ip\n" + "".join(
        f"{T0 + k * STEP},{v * GiB}.0,{pod}\n" for pod, vs in MEMORY.items() for k, v in enumerate(vs))
    duty = "value,timestamp_anon,container_ip\n" + "".join(
        f"{v}.0,{T0 + k * STEP},{pod}\n" for pod, vs in DUTY.items() for k, v in enumerate(vs) if (pod, k) != ("r", 2))
    paths = (tmp_path / ("mem.csv.gz" if gz else "mem.csv"), tmp_path / "duty.csv")
    if gz:
        with gzip.open(paths[0], "wt") as f:
            f.write(mem)
    else:
        paths[0].write_text(mem)
    paths[1].write_text(duty)
    return paths


def ctl(*args):
    return subprocess.run([CTL, "replay", *map(str, args)], capture_output=True, text=True, timeout=60)


def test_three_configurations_on_series_worked_out_by_hand(tmp_path):
    mem, duty = write(tmp_path)
    out = ctl("--memory", mem, "--duty", duty, "--gpu-memory", "10Gi", "--request-quantile", "0.5", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert (r["pods"], r["samples"], r["interval_s"]) == (3, 4, 57.0)
    whole, peak, auto = r["configs"]
    # whole: 3 GPUs; 9, 9, 9 and 17 GiB used of 30
    assert (whole["gpus"], whole["memory_occupancy_pct"]) == (3, round(100 * 11 / 30, 1))
    # peak: R (9 GiB, 20%) alone; P and Q (4 + 4 GiB, 60 + 30%) share the second GPU
    assert (peak["gpus"], peak["memory_occupancy_pct"], peak["oom_samples"], peak["sm_short_samples"]) == \
        (2, 55.0, 0, 0)
    # autoscaled at the median: requests 4, 4, 1 GiB share one GPU; when R asks for 9 GiB
    # P and Q hold at least their 4 GiB each, so R's cap is at most 2: one OOM sample, one
    # interval held below its demand; the GPU's pods ask for 110% of its time at every sample
    assert (auto["gpus"], auto["oom_samples"], auto["held_below_demand_s"], auto["sm_short_samples"]) == \
        (1, 1, 57, 12)
    assert 8 * 9 / 10 / 4 <= auto["memory_occupancy_pct"] / 10 <= 100    # at least P and Q's 8 GiB of 10
    text = ctl("--memory", mem, "--duty", duty, "--gpu-memory", "10Gi", "--request-quantile", "0.5")
    assert text.returncode == 0, text.stderr
    assert "3 pods, 4 samples every 57 s (0 h), GPUs of 10Gi" in text.stdout
    assert text.stdout.splitlines()[3].split()[:3] == ["peak", "2", "55.0%"]


def test_a_sample_a_pod_lacks_repeats_its_last_and_plain_csv_reads_too(tmp_path):
    mem, duty = write(tmp_path, gz=False)
    times, series = replay.read_series(mem, duty)
    assert times == [T0 + k * STEP for k in range(4)]
    r = next(s for s in series if s.name == "r")
    assert r.duty == [20.0, 20.0, 20.0, 20.0] and r.memory[3] == 9 * GiB and r.quantile(0.5) == GiB


def test_errors_are_one_line_with_a_hint(tmp_path):
    (tmp_path / "bad.csv").write_text("t,v\n1,2\n")
    out = ctl("--memory", tmp_path / "bad.csv")
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "no column" in out.stderr and "hint:" in out.stderr
    mem, _ = write(tmp_path)
    out = ctl("--memory", mem, "--gpu-memory", "8Gi")
    assert out.returncode == 2 and "pod r needs 9.0 GiB, more than a GPU's 8.0 GiB" in out.stderr and "hint: assume a larger GPU" in out.stderr
    (tmp_path / "nan.csv").write_text("timestamp_anon,value,container_ip\n1,x,p\n")
    out = ctl("--memory", tmp_path / "nan.csv")
    assert out.returncode == 1 and "nan.csv:2: memory 'x'" in out.stderr
