"""deploy/systemd/vgpu-agent.service: the unit parses (and passes `systemd-analyze verify`
where systemd's tools are installed), and its commands do what it says when run as
written -- the slices of deploy/systemd/slices.yaml appear, a reload changes nothing, a
reboot that empties the node directory gets them back, the agent serves metrics and a
stop (SIGTERM) ends it with success.  Run on simgpu, with the unit's paths moved into a
temporary directory: /usr/local/bin/vgpu-ctl is this environment's, /etc/vgpu and
/run/vgpu are temporary, and the metrics port is 0 (any free one) so runs never collide.
"""
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.paths import ROOT
from tests.helpers.simnode import make_sim_env
from vgpu import slices

UNIT = ROOT / "deploy" / "systemd" / "vgpu-agent.service"
EXAMPLE = ROOT / "deploy" / "systemd" / "slices.yaml"
CTL = str(Path(sys.executable).parent / "vgpu-ctl")
GiB = 1 << 30


def parse_unit(text):
    """systemd's unit syntax: [Section], Key=Value, # and ; comments, \\ continuations;
    a key may repeat (a list).  Returns {section: {key: [values]}}."""
    sections, current, pending = {}, None, ""
    for n, raw in enumerate(text.splitlines(), 1):
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        m = re.fullmatch(r"\[([A-Za-z]+)\]", line)
        if m:
            current = sections.setdefault(m.group(1), {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None and re.fullmatch(r"[A-Za-z]+", key.strip()), f"line {n}: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


@pytest.fixture(scope="module")
def unit():
    return parse_unit(UNIT.read_text())


def test_the_unit_has_what_a_boot_needs(unit):
    assert set(unit) == {"Unit", "Service", "Install"}
    s = unit["Service"]
    assert s["ExecStartPre"] == ["/usr/local/bin/vgpu-ctl apply -f /etc/vgpu/slices.yaml"]
    assert s["ExecReload"] == s["ExecStartPre"]
    assert s["ExecStart"] == ["/usr/local/bin/vgpu-ctl agent --autoscale --metrics-port 9400"]
    assert s["Environment"] == ["VGPU_DIR=/run/vgpu"]
    assert s["RuntimeDirectory"] == ["vgpu"] and s["RuntimeDirectoryPreserve"] == ["yes"]   # kept across stops
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    assert {"docker.service", "containerd.service", "kubelet.service"} <= set(unit["Unit"]["Before"][0].split())
    assert unit["Unit"]["ConditionPathExists"] == ["/etc/vgpu/slices.yaml"]


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed here")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    """systemd's own check, with vgpu-ctl where this environment has it (verify also
    checks that each command is executable)."""
    copy = tmp_path / "vgpu-agent.service"
    copy.write_text(UNIT.read_text().replace("/usr/local/bin/vgpu-ctl", CTL))
    out = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "" and out.stdout == "", out.stderr
    bad = tmp_path / "bad.service"            # and that the check is one: a typo is reported
    bad.write_text(copy.read_text().replace("Restart=on-failure", "Restart=on-failur"))
    out = subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True, text=True, timeout=60)
    assert "Failed to parse service restart specifier" in out.stderr


def as_run_here(command, tmp):
    """The unit's command line with its paths moved into tmp (and the port to 0)."""
    command = command.replace("/usr/local/bin/vgpu-ctl", CTL).replace("/etc/vgpu", str(tmp / "etc" / "vgpu"))
    return shlex.split(command.replace("--metrics-port 9400", "--metrics-port 0"))


def test_the_units_commands_bring_the_slices_back_after_a_reboot_and_run_the_agent(unit, tmp_path):
    (tmp_path / "etc" / "vgpu").mkdir(parents=True)
    shutil.copy(EXAMPLE, tmp_path / "etc" / "vgpu" / "slices.yaml")
    run_dir = tmp_path / "run" / "vgpu"
    run_dir.mkdir(parents=True)                          # RuntimeDirectory=vgpu makes it
    env = make_sim_env(tmp_path / "node")
    for assignment in unit["Service"]["Environment"]:
        k, v = assignment.split("=", 1)
        env[k] = v.replace("/run/vgpu", str(run_dir))
    pre, = unit["Service"]["ExecStartPre"]
    out = subprocess.run(as_run_here(pre, tmp_path), env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "applied: 2 created, 0 resized, 0 deleted, 0 unchanged"
    infer = slices.read_quota(run_dir, "infer").devices[0]
    assert (infer.memory_max, infer.memory_request, infer.memory_limit, infer.sm_max, infer.sm_limit) == \
        (4 * GiB, 2 * GiB, 6 * GiB, 2000, 4000)
    assert slices.read_quota(run_dir, "train").devices[0].memory_max == 16 * GiB

    reload_, = unit["Service"]["ExecReload"]
    out = subprocess.run(as_run_here(reload_, tmp_path), env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.splitlines()[-1].startswith("nothing to change:"), out.stdout

    shutil.rmtree(run_dir)                               # a reboot empties /run
    run_dir.mkdir()
    out = subprocess.run(as_run_here(pre, tmp_path), env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and slices.list_names(run_dir) == ["infer", "train"]

    start, = unit["Service"]["ExecStart"]
    agent = subprocess.Popen(as_run_here(start, tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        line = agent.stderr.readline()
        m = re.fullmatch(r"serving metrics on http://0\.0\.0\.0:(\d+)/metrics\n", line)
        assert m, line
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/metrics", timeout=5) as r:
                    text = r.read().decode()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        quota = {s.labels["slice"]: s.value for f in text_string_to_metric_families(text)
                 for s in f.samples if s.name == "vgpu_memory_quota_bytes"}
        assert quota == {"train": 16 * GiB, "infer": 4 * GiB}
        agent.send_signal(signal.SIGTERM)                # systemctl stop
        assert agent.wait(20) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
