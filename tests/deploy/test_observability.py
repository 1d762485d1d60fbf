"""What operators look at: the Grafana dashboards (deploy/grafana), the alert rules
(deploy/prometheus) and their copies for Kubernetes, checked with the real tools.

The rules pass `promtool check rules` and their unit tests (`promtool test rules`).  Then
a real Prometheus (Debian's package: helpers/prometheus.py) scrapes a running node agent on
simgpu, with workloads under the shim in slices that carry a pod's labels as the DRA
driver writes them: a training job and an inference service busy on the GPU, a notebook
refused by its memory cap, a tenant that hides memory from the shim and goes over its cap
(killed), a GPU process in no slice, SM guarantees adding up to 140%, and a second target
that answers nothing.  Every panel's and annotation's query of every dashboard, and every
template variable's, is evaluated through Prometheus' HTTP API and must return series
carrying the labels its legend and variables use; the rules, loaded by that Prometheus,
evaluate without error and each alert that this node should raise goes pending or firing.

VGPU_DASHBOARD_DATA=DIR keeps the node running VGPU_DASHBOARD_SECONDS more (default 90)
and writes every panel's range query results to DIR, for tools/render_dashboards.py.
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.paths import PROGRAMS, ROOT
from tests.helpers.prometheus import Prometheus, promtool, tools
from tests.helpers.simnode import make_sim_env
from tests.test_docs import _anchors
from vgpu import podlabels
from vgpu.paths import SHIM

DASHBOARDS = sorted((ROOT / "deploy" / "grafana").glob("*.json"))
RULES = ROOT / "deploy" / "prometheus" / "vgpu-rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "vgpu-rules.test.yaml"
CTL = str(Path(sys.executable).parent / "vgpu-ctl")
TENANT = str(PROGRAMS / "tenant.py")
GiB, MiB = 1 << 30, 1 << 20
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's $__rate_interval: max($__interval + the scrape interval, 4 x the scrape interval)
# (its Prometheus data source's docs): 10 s for this 1 s scrape seen at a 9 s step
RATE_INTERVAL = "10s"
JOB = "vgpu-metrics"


def load(path):
    return json.loads(path.read_text())


def panels(dashboard):
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def queries(dashboard):
    """(what, expr, legend) of every panel target and annotation."""
    out = [(f"{p['title']} {t['refId']}", t["expr"], t["legendFormat"]) for p in panels(dashboard)
           for t in p["targets"]]
    return out + [(f"annotation {a['name']}", a["expr"], a["textFormat"]) for a in dashboard["annotations"]["list"]]


def legend_labels(legend):
    return set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))


def expand(dashboard, expr):
    """`expr` as Grafana sends it with every variable at All and $__rate_interval at RATE_INTERVAL."""
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            expr = expr.replace(f"${v['name']}", v["allValue"])
    return expr.replace("$__rate_interval", RATE_INTERVAL)


def selected_labels(expr):
    """Labels the expression selects with a dashboard variable (instance=~"$instance")."""
    return set(re.findall(r'(\w+)=~"\$\w+"', expr))


def metric_names(expr):
    return set(re.findall(r"\b(vgpu_\w+)", expr))


# === the dashboards as Grafana reads them ===

@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_a_dashboard_is_a_grafana_dashboard_on_a_chosen_prometheus(path):
    d = load(path)
    # the classic dashboard JSON model; 42 is its last schema version (Grafana's
    # apps/dashboard/pkg/migration/schemaversion/README.md)
    assert d["schemaVersion"] == 42 and d["id"] is None and d["uid"] == path.stem
    [ds] = [v for v in d["templating"]["list"] if v["name"] == "datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    names = {v["name"] for v in d["templating"]["list"]}
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"] == DATASOURCE and v["query"] == v["definition"]
            assert v["includeAll"] and v["allValue"] in (".*", ".+")
    # no data source named but through the variable: the only uids are the dashboard's own
    uids = re.findall(r'"uid":\s*"([^"]*)"', path.read_text())
    assert uids == [path.stem] + ["${datasource}"] * (len(uids) - 1)
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in panels(d):
        assert p["type"] == "timeseries" and p["datasource"] == DATASOURCE and p["title"] and p["description"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]      # Grafana's grid is 24 columns wide
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["datasource"] == DATASOURCE for t in p["targets"])
        for o in p["fieldConfig"]["overrides"]:
            assert o["matcher"]["id"] == "byFrameRefID" and o["matcher"]["options"] in refs
    for a in d["annotations"]["list"]:
        assert a["datasource"] == DATASOURCE and a["enable"]
    for what, expr, _ in queries(d):
        used = set(re.findall(r"\$(\w+)", expr)) - {"__rate_interval"}
        assert used <= names, f"{what}: {used - names} is no variable of the dashboard"


# === the alert rules ===

def test_the_rules_pass_promtool_check_and_their_unit_tests():
    out = promtool("check", "rules", RULES)
    assert out.returncode == 0 and "SUCCESS: 8 rules found" in out.stdout, out.stdout + out.stderr
    out = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert tested == alerts
    # each alert is tested firing and not firing
    tests = [t for case in yaml.safe_load(RULE_TESTS.read_text())["tests"] for t in case["alert_rule_test"]]
    for name in alerts:
        assert {bool(t["exp_alerts"]) for t in tests if t["alertname"] == name} == {True, False}, name


def test_every_alert_has_a_severity_and_a_runbook_section():
    page = ROOT / "docs" / "observability.md"
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in ("warning", "critical")
            path, _, anchor = rule["annotations"]["runbook"].partition("#")
            assert (ROOT / path) == page and anchor == rule["alert"].lower() and anchor in _anchors(page)


def test_the_kubernetes_copies_of_the_rules_and_dashboards_are_fresh():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gen_monitoring
    finally:
        sys.path.remove(str(ROOT / "tools"))
    for path, text in gen_monitoring.outputs().items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run python tools/gen_monitoring.py"
    rule = yaml.safe_load((ROOT / "deploy" / "monitoring" / "prometheusrule.yaml").read_text())
    assert rule["spec"] == yaml.safe_load(RULES.read_text())


# === a real Prometheus scraping a node agent with workloads ===

class Tenant:
    """tests/programs/tenant.py: one JSON command a line, one JSON answer."""

    def __init__(self, env):
        self.proc = subprocess.Popen([sys.executable, TENANT], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self.hello = self.read()

    def read(self):
        line = self.proc.stdout.readline()
        assert line, "the tenant died"
        return json.loads(line)

    def call(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()


SLICES = {   # name: (vgpu-ctl create flags, the pod it serves)
    "train": (["--memory", "8Gi", "--sm", "90%", "--sm-request", "60%"], ("team-a", "trainer-0", "main")),
    "infer": (["--memory", "4Gi", "--request", "2Gi", "--limit", "6Gi", "--sm", "40%"],
              ("team-b", "infer-0", "server")),
    "notebook": (["--memory", "1Gi", "--sm", "30%"], ("team-b", "notebook-0", "jupyter")),
    "etl": (["--memory", "2Gi", "--sm", "10%"], ("team-a", "etl-0", "worker")),
}
# the alerts this node raises, each with a label naming what it is about
EXPECTED_ALERTS = {("VgpuSliceOutOfMemory", "slice", "notebook"), ("VgpuSliceStarved", "slice", "train"),
                   ("VgpuViolation", "kind", "unsliced"), ("VgpuViolation", "kind", "over-cap"),
                   ("VgpuUnslicedProcess", "device", "0"), ("VgpuSmGuaranteesOvercommitted", "device", "0"),
                   ("VgpuGpuUnhealthy", "device", "0")}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A simgpu node, its slices and workloads, the agent, and Prometheus scraping it."""
    tools()                     # or skip before starting anything
    root = tmp_path_factory.mktemp("observed")
    d, env = root / "vgpu", make_sim_env(root / "node")
    started = []

    def tenant(name=None):
        t = Tenant(env if name is None else {**env, "LD_PRELOAD": str(SHIM), "VGPU_DIR": str(d),
                                             "VGPU_SLICE": name})
        started.append(t.proc)
        return t
    try:
        for name, (flags, (namespace, pod, container)) in SLICES.items():
            subprocess.run([CTL, "create", name, *flags, "--dir", str(d)], env=env, check=True, capture_output=True)
            podlabels.write(d, name, {"namespace": namespace, "pod": pod, "container": container})
        t = {name: tenant(name) for name in SLICES}
        for name, held in (("train", 6 * GiB), ("infer", GiB), ("notebook", 768 * MiB), ("etl", 3 * GiB // 2)):
            assert t[name].call(alloc=held) == 0
        for name in ("train", "infer", "notebook"):
            t[name].call(hog=5000)            # 5 ms kernels back to back: the GPU is full
        log = root / "agent.err"
        agent = subprocess.Popen([CTL, "agent", "--autoscale", "--window", "4s", "--interval", "500ms",
                                  "--require-slices", "--on-violation", "over-cap=kill", "--metrics-port", "0",
                                  "--metrics-address", "127.0.0.1", "--dir", str(d)], env=env,
                                 stdout=subprocess.DEVNULL, stderr=log.open("w"))
        started.append(agent)
        port = _listening(agent, log)
        # a double-bit ECC error on the GPU (NVIDIA: reset the GPU): unhealthy from now on
        subprocess.run([CTL, "sim", "xid", "0", "48"], env=env, check=True, capture_output=True)
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(RULES)],
                  "scrape_configs": [{"job_name": JOB, "honor_labels": True, "static_configs": [
                      {"targets": [f"127.0.0.1:{port}", f"127.0.0.1:{_closed_port()}"]}]}]}
        with Prometheus(root / "prometheus", config) as prom:
            start = time.time()
            prom.wait_for(f'count(vgpu_memory_oom_refusals_total{{job="{JOB}"}}) == {len(SLICES)}')
            assert t["notebook"].call(alloc=512 * MiB) == 2                   # refused by its cap
            loose = tenant()                                                   # in no slice
            assert loose.call(alloc=512 * MiB) == 0
            assert t["etl"].call(hide=GiB // 2, usage=str(d / "etl" / "usage"))["old"] == 3 * GiB // 2
            assert t["etl"].call(alloc=GiB) == 0      # the shim thinks 1.5Gi of 2Gi; the driver has 2.5Gi
            for done in ('vgpu_memory_oom_refusals_total{slice="notebook"} > 0',
                         'vgpu_agent_actions_total{kind="over-cap", action="kill"} > 0',
                         'vgpu_resize_events_total{slice="infer"} > 0',
                         'vgpu_violations_active{kind="unsliced"} > 0',
                         f'count_over_time(vgpu_nvml_up[{RATE_INTERVAL}]) >= 8'):
                prom.wait_for(done)
            t["etl"].proc.wait(10)                                             # the agent killed it
            prom.wait_for('ALERTS{alertstate=~"pending|firing"}', lambda r: EXPECTED_ALERTS <= {
                (a["metric"]["alertname"], k, a["metric"].get(k)) for a in r for _, k, _ in EXPECTED_ALERTS})
            if os.environ.get("VGPU_DASHBOARD_DATA"):
                def halfway():      # the process in no slice ends; an operator resizes train
                    loose.proc.terminate()
                    loose.proc.wait(10)
                    subprocess.run([CTL, "resize", "train", "--sm", "70%", "--dir", str(d)], env=env, check=True,
                                   capture_output=True)
                _keep_running(float(os.environ.get("VGPU_DASHBOARD_SECONDS", "90")), t["notebook"], halfway)
            yield prom, start
    finally:
        for p in started:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)


def _listening(agent, log, timeout=30):
    deadline = time.monotonic() + timeout
    while not (m := re.search(r"serving metrics on http://127\.0\.0\.1:(\d+)/metrics", log.read_text())):
        assert agent.poll() is None and time.monotonic() < deadline, f"the agent does not serve: {log.read_text()}"
        time.sleep(0.05)
    return int(m.group(1))


def _closed_port():
    """A loopback port nothing listens on: the target of an agent that is down."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keep_running(seconds, notebook, halfway):
    """For the pictures: more history, the notebook asking past its cap every 8 s, and
    halfway() halfway through."""
    now = time.monotonic()
    end, half = now + seconds, now + seconds / 2
    while time.monotonic() < end:
        notebook.call(alloc=512 * MiB)
        if halfway and time.monotonic() >= half:
            halfway()
            halfway = None
        time.sleep(min(8, max(0, end - time.monotonic())))


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_every_query_of_a_dashboard_returns_series_with_the_labels_it_shows(node, path):
    prom, start = node
    d = load(path)
    end = time.time()
    data = {}
    for what, expr, legend in queries(d):
        series = prom.query_range(expand(d, expr), start, end, 1)
        assert series, f"{what}: no series for {expand(d, expr)}"
        need = legend_labels(legend) | selected_labels(expr)
        for s in series:
            assert need <= set(s["metric"]), f"{what}: {s['metric']} lacks {need - set(s['metric'])}"
        data[what] = series
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"])
            assert m, v["query"]
            assert prom.api(f"label/{m.group(2)}/values", **{"match[]": expand(d, m.group(1))}), v["name"]
    out = os.environ.get("VGPU_DASHBOARD_DATA")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{path.stem}.json").write_text(json.dumps({"start": start, "end": end, "queries": data}))


def test_every_metric_the_dashboards_and_rules_name_is_served(node):
    prom, _ = node
    served = set(prom.api("label/__name__/values"))
    named = set()
    for path in DASHBOARDS:
        d = load(path)
        named |= {n for _, expr, _ in queries(d) for n in metric_names(expr)}
        named |= {n for v in d["templating"]["list"] if v["type"] == "query" for n in metric_names(v["query"])}
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    named |= {n for r in rules for n in metric_names(r["expr"])}
    assert named and named <= served, named - served


def test_the_rules_evaluate_on_the_node_and_its_alerts_go_off(node):
    prom, _ = node
    [group] = prom.api("rules")["groups"]
    assert group["file"] == str(RULES)
    for rule in group["rules"]:
        assert (rule["health"], rule.get("lastError", "")) == ("ok", ""), rule["name"]
        prom.query(rule["query"])                    # and each evaluates through the query API
    going = {(a["labels"]["alertname"], k, a["labels"].get(k)) for a in prom.api("alerts")["alerts"]
             if a["state"] in ("pending", "firing") for _, k, _ in EXPECTED_ALERTS}
    assert EXPECTED_ALERTS <= going
    # the target that answers nothing: down, so VgpuAgentDown, and not absent
    [down] = prom.query(f'up{{job="{JOB}"}} == 0')
    assert ("VgpuAgentDown", "instance", down["metric"]["instance"]) in {
        (a["labels"]["alertname"], "instance", a["labels"].get("instance")) for a in prom.api("alerts")["alerts"]}
    assert prom.query(f'absent(up{{job="{JOB}"}})') == []
