"""Prometheus metrics (`vgpu-ctl serve`, `autoscale --metrics-port`), scraped over HTTP on
loopback and parsed with prometheus_client's own parser."""
import re
import select
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.exposition import series
from tests.helpers.simnode import make_sim_env, write_usage_counters
from vgpu import metrics, slices
from vgpu.paths import SHIM

GiB, MiB = 1 << 30, 1 << 20
CTL = str(Path(sys.executable).parent / "vgpu-ctl")


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return fams, series(text)




def cd(name, device=0):
    return (("device", str(device)), ("slice", name))


@pytest.fixture
def server(tmp_path):
    started = []

    def start(directory, **kw):
        httpd = metrics.start(directory, 0, "127.0.0.1", use_nvml=False, **kw)
        started.append(httpd)
        return httpd.server_port

    yield start
    for h in started:
        h.shutdown()
        h.server_close()


def test_scrape_reports_every_slice_and_device_from_the_slice_files(tmp_path, server):
    d = tmp_path / "vgpu"
    slices.create(d, "train", {0: slices.device_quota(10 * GiB, 5000, request=8 * GiB, limit=12 * GiB,
                                                      sm_request=2500, sm_limit=7500)}, overcommit=True)
    slices.create(d, "notebook", {0: slices.device_quota()}, overcommit=True)      # no cap at all
    slices.resize(d, "train", memory=11 * GiB, request=8 * GiB, limit=12 * GiB, overcommit=True)
    slices.resize(d, "train", sm=6000, sm_request=2500, sm_limit=7500, overcommit=True)
    write_usage_counters(d, "train", memory_current=3 * GiB, memory_peak=4 * GiB, oom_refusals=2, launches=1234,
         gpu_time_ns=5_500_000_000, throttled_ns=1_250_000_000)
    port = server(d)

    t0 = time.monotonic()
    fams, v = scrape(port)
    t1 = time.monotonic()
    assert v[("vgpu_memory_used_bytes", cd("train"))] == 3 * GiB
    assert v[("vgpu_memory_peak_bytes", cd("train"))] == 4 * GiB
    assert v[("vgpu_memory_quota_bytes", cd("train"))] == 11 * GiB
    assert v[("vgpu_memory_request_bytes", cd("train"))] == 8 * GiB
    assert v[("vgpu_memory_limit_bytes", cd("train"))] == 12 * GiB
    assert v[("vgpu_memory_quota_bytes", cd("notebook"))] == float("inf")
    assert (v[("vgpu_sm_quota_ratio", cd("train"))], v[("vgpu_sm_request_ratio", cd("train"))],
            v[("vgpu_sm_limit_ratio", cd("train"))]) == (0.6, 0.25, 0.75)
    assert v[("vgpu_memory_oom_refusals_total", cd("train"))] == 2
    assert v[("vgpu_launches_total", cd("train"))] == 1234
    assert v[("vgpu_sm_gpu_time_seconds_total", cd("train"))] == 5.5
    assert v[("vgpu_sm_throttled_seconds_total", cd("train"))] == 1.25
    assert v[("vgpu_resize_events_total", (("slice", "train"),))] == 2
    assert v[("vgpu_resize_events_total", (("slice", "notebook"),))] == 0
    assert v[("vgpu_processes", (("slice", "train"),))] == 1   # the test, holding the staged memory
    dev = (("device", "0"),)
    assert v[("vgpu_device_memory_quota_bytes", dev)] == 11 * GiB          # the uncapped one adds nothing
    assert v[("vgpu_device_memory_guaranteed_bytes", dev)] == 8 * GiB
    assert v[("vgpu_device_sm_quota_ratio", dev)] == 1.6
    assert v[("vgpu_device_slices", dev)] == 2
    assert v[("vgpu_nvml_up", ())] == 0
    assert ("vgpu_sm_used_ratio", cd("train")) not in v       # no earlier scrape, no NVML: not known yet

    # SM use: GPU time charged between two scrapes over the time between them
    write_usage_counters(d, "train", gpu_time_ns=5_500_000_000 + 300_000_000)
    time.sleep(0.5)
    t2 = time.monotonic()
    _, v = scrape(port)
    t3 = time.monotonic()
    assert 0.3 / (t3 - t0) <= v[("vgpu_sm_used_ratio", cd("train"))] <= 0.3 / (t2 - t1)

    # Prometheus conventions: a vgpu_ prefix, units in the names, counters end in _total
    for name, f in fams.items():
        assert name.startswith("vgpu_") and f.documentation
        if f.type == "counter":
            assert all(s.name.endswith("_total") for s in f.samples), name
        if "memory" in name and f.type == "gauge" and not name.endswith(("slices", "containers", "_info")):
            assert name.endswith("_bytes"), name
        if name.startswith(("vgpu_sm_", "vgpu_device_sm", "vgpu_device_util")) and f.type == "gauge" and \
                not name.endswith("_info"):
            assert name.endswith("_ratio"), name


def test_the_old_label_and_the_old_device_metric_are_still_served_with_the_same_values(tmp_path, server):
    # renamed in this release, the old names kept until the next: label container (now
    # slice) and vgpu_device_containers (now vgpu_device_slices)
    d = tmp_path / "vgpu"
    slices.create(d, "train", {0: slices.device_quota(10 * GiB, 5000)}, overcommit=True)
    slices.create(d, "infer", {0: slices.device_quota(4 * GiB, 2000), 1: slices.device_quota(GiB)},
                  overcommit=True)
    with urllib.request.urlopen(f"http://127.0.0.1:{server(d)}/metrics", timeout=10) as r:
        fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    sliced = [s for f in fams.values() for s in f.samples if "slice" in s.labels]
    assert {s.labels["slice"] for s in sliced} == {"train", "infer"}
    assert all(s.labels["container"] == s.labels["slice"] for s in sliced)
    assert not [s for f in fams.values() for s in f.samples if "container" in s.labels and "slice" not in s.labels]
    quota = {(s.labels["container"], s.labels["device"]): s.value for s in fams["vgpu_memory_quota_bytes"].samples}
    assert quota == {("train", "0"): 10 * GiB, ("infer", "0"): 4 * GiB, ("infer", "1"): GiB}
    assert "container: the old name of slice" in fams["vgpu_memory_quota_bytes"].documentation
    old = {s.labels["device"]: s.value for s in fams["vgpu_device_containers"].samples}
    assert old == {s.labels["device"]: s.value for s in fams["vgpu_device_slices"].samples} == {"0": 2, "1": 1}
    assert "old name of vgpu_device_slices" in fams["vgpu_device_containers"].documentation


def test_slices_that_come_and_go_appear_and_disappear(tmp_path, server):
    d = tmp_path / "vgpu"
    port = server(d)                           # the node directory does not exist yet
    _, v = scrape(port)
    assert v == {("vgpu_nvml_up", ()): 0}
    slices.create(d, "a", {0: slices.device_quota(GiB)}, overcommit=True)
    _, v = scrape(port)
    assert v[("vgpu_memory_quota_bytes", cd("a"))] == GiB
    slices.delete(d, "a")
    slices.create(d, "a", {1: slices.device_quota(2 * GiB)}, overcommit=True)      # same name, new files
    _, v = scrape(port)
    assert v[("vgpu_memory_quota_bytes", cd("a", 1))] == 2 * GiB
    assert ("vgpu_memory_quota_bytes", cd("a", 0)) not in v                        # device 0 is denied now


def _listening(proc, timeout=30):
    ready, _, _ = select.select([proc.stderr], [], [], timeout)
    line = proc.stderr.readline() if ready else ""
    m = re.search(r"serving metrics on http://127\.0\.0\.1:(\d+)/metrics", line)
    assert m, f"no listening line: {line!r}"
    return int(m.group(1))


HOLDER = """
import sys
from cuda.bindings import driver as cu
cu.cuInit(0)
cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(cu.cuDeviceGet(0)[1])[1])
assert int(cu.cuMemAlloc(int(sys.argv[1]))[0]) == 0
print("ready", flush=True)
sys.stdin.read()
"""


def test_serve_on_simgpu_reports_the_device_from_nvml_and_the_slice_from_its_files(tmp_path):
    d = tmp_path / "vgpu"
    env = make_sim_env(tmp_path / "node")
    subprocess.run([CTL, "create", "c1", "--memory", "2Gi", "--dir", str(d)], env=env, check=True,
                   capture_output=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(GiB)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**env, "LD_PRELOAD": str(SHIM), "VGPU_DIR": str(d), "VGPU_SLICE": "c1"})
    serve = subprocess.Popen([CTL, "serve", "--port", "0", "--address", "127.0.0.1", "--dir", str(d)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        _, v = scrape(_listening(serve))
        dev = (("device", "0"),)
        assert v[("vgpu_nvml_up", ())] == 1
        assert v[("vgpu_device_memory_total_bytes", dev)] == 24 * GiB
        assert v[("vgpu_device_memory_used_bytes", dev)] == GiB
        assert 0 <= v[("vgpu_device_utilization_ratio", dev)] <= 1
        info = [k for k in v if k[0] == "vgpu_device_info"]
        assert len(info) == 1 and ("name", "NVIDIA A10") in info[0][1]
        assert v[("vgpu_memory_used_bytes", cd("c1"))] == GiB
        assert v[("vgpu_memory_quota_bytes", cd("c1"))] == 2 * GiB
        assert v[("vgpu_processes", (("slice", "c1"),))] == 1
        assert v[("vgpu_sm_used_ratio", cd("c1"))] == 0          # at 100%: NVML's per-process view
    finally:
        holder.stdin.close()
        for p in (holder, serve):
            p.terminate()
            p.wait(10)
    assert serve.returncode in (0, -15)


def test_autoscale_serves_its_decisions_alongside_the_slices(tmp_path):
    d = tmp_path / "vgpu"
    env = make_sim_env(tmp_path / "node")
    subprocess.run([CTL, "create", "idle", "--memory", "2Gi", "--request", "1Gi", "--limit", "4Gi", "--dir", str(d)],
                   env=env, check=True, capture_output=True)
    proc = subprocess.Popen([CTL, "autoscale", "--window", "300ms", "--interval", "100ms", "--metrics-port", "0",
                             "--metrics-address", "127.0.0.1", "--dir", str(d)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = _listening(proc)
        deadline = time.monotonic() + 20
        while slices.read_quota(d, "idle").devices[0].memory_max == 2 * GiB:
            assert time.monotonic() < deadline, "no shrink"
            time.sleep(0.05)
        _, v = scrape(port)
    finally:
        proc.terminate()
        proc.wait(10)
    assert v[("vgpu_autoscale_decisions_total", (("action", "shrink"), ("device", "0"), ("resource", "memory"),
                                                ("slice", "idle")))] >= 1
    assert v[("vgpu_resize_events_total", (("slice", "idle"),))] >= 1
    assert v[("vgpu_autoscale_ticks_total", ())] >= 3
    assert 0 <= v[("vgpu_autoscale_tick_cpu_seconds", ())] < 1
