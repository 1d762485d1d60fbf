"""vgpu-ctl's errors, as an operator meets them: one line naming the problem with a hint,
exit 2 for usage, 1 for runtime, 126/127 for `run` as shells do, and never a traceback.

Most run through click's CliRunner with a fake one-GPU node (NVML replaced, as in
test_ctl_cli.py); the ones about processes and signals run the real `vgpu-ctl`.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.helpers.paths import ROOT
from tests.helpers.simnode import make_sim_env, write_usage_counters
from vgpu import nvml, slices, status as status_mod
from vgpu.cli import main

GiB = 1 << 30
CTL = str(Path(sys.executable).parent / "vgpu-ctl")


@pytest.fixture(autouse=True)
def fake_node(monkeypatch):
    """One 24 GiB device, so capacity checks pass without a driver."""
    monkeypatch.setattr(nvml, "available", lambda: (True, None))
    monkeypatch.setattr(nvml, "device_count", lambda: 1)
    monkeypatch.setattr(nvml, "memory_total", lambda d: 24 * GiB)
    monkeypatch.setattr(nvml, "devices", lambda: [{"index": 0, "name": "Fake A10", "uuid": "GPU-0",
                                                   "memory_total": 24 * GiB, "memory_used": 0, "gpu_util": 0}])
    monkeypatch.setattr(nvml, "process_utilization", lambda d, window_s=1.0: {})
    monkeypatch.setattr(nvml, "driver_version", lambda: "fake")


@pytest.fixture
def node(tmp_path):
    return tmp_path / "vgpu"


def ctl(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def one_line(result, code, *parts):
    """The result failed with `code` and one line on stderr containing each part and a hint."""
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ") and "; hint: " in lines[0], lines[0]
    for p in parts:
        assert p in lines[0], lines[0]
    assert "Traceback" not in result.output
    return lines[0]


# === usage errors: one line, exit 2 ===

@pytest.mark.parametrize("args,what", [
    (["--bogus"], "No such option '--bogus'; hint: vgpu-ctl --help"),
    (["statu"], "No such command 'statu'. Did you mean 'status'?; hint: vgpu-ctl --help"),
    (["create"], "Missing argument 'NAME'; hint: vgpu-ctl create --help"),
    (["create", "c1", "--memory", "4GB"], "'4GB' is not a memory size"),
    (["resize", "c1", "--sm", "half"], "'half' is not a share of the GPU"),
    (["status", "--interval", "fast"], "'fast' is not a duration"),
])
def test_usage_errors_are_one_line_with_a_hint_and_exit_2(node, args, what):
    r = ctl(*args, "--dir", node) if args[0] != "--bogus" else ctl(*args)
    one_line(r, 2, what)


def test_usage_errors_of_the_installed_command_print_no_usage_block(tmp_path):
    out = subprocess.run([CTL, "create", "c1", "--sm", "0", "--dir", str(tmp_path)], capture_output=True,
                         text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [
        "Error: Invalid value for '--sm': '0' is no share of the GPU: a slice needs more than 0% (1..100%, e.g. "
        "50%; 100% is the whole GPU); hint: vgpu-ctl create --help shows the options and an example"]


def test_the_bare_command_and_group_show_their_help():
    out = subprocess.run([CTL], capture_output=True, text=True)
    assert out.stderr.startswith("Usage: vgpu-ctl [OPTIONS] COMMAND") or out.stdout.startswith("Usage: vgpu-ctl")
    r = ctl("sim", "--help")
    assert r.exit_code == 0 and "Example:" in r.stdout and "vgpu-ctl sim env" in r.stdout


def test_a_bug_is_still_one_line_and_exit_1(node, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("simulated bug")
    monkeypatch.setattr(slices, "read_all", broken)
    node.mkdir()
    r = ctl("list", "--dir", node)
    one_line(r, 1, "internal error: RuntimeError: simulated bug", "VGPU_DEBUG=1")


def test_list_shows_a_slice_it_cannot_read_with_its_error(node):
    """A slice whose usage file its container cut short: `list` shows the others as ever and
    this one's row with its error (the error once fell in a cell past the headers, which the
    table drops: the row showed dashes and nothing else)."""
    for name in ("a", "b"):
        assert ctl("create", name, "--memory", "1Gi", "--dir", node).exit_code == 0
    with open(node / "b" / "usage", "r+b") as f:
        f.truncate(100)
    r = ctl("list", "--dir", node)
    assert r.exit_code == 0, r.output
    header, a, b = r.stdout.splitlines()
    assert header.split() == ["NAME", "DEVICE", "MEMORY", "REQUEST", "LIMIT", "SM", "SM-REQUEST", "SM-LIMIT",
                              "SM-MODE", "PROCESSES", "GEN"]
    assert a.split()[:3] == ["a", "0", "1Gi"]
    assert b.split()[:10] == ["b"] + ["-"] * 9 and "error:" in b and "has 100 bytes" in b, b


# === quantities ===

def test_sm_0_and_sm_above_100_say_what_a_share_is(node):
    one_line(ctl("create", "c1", "--sm", "0", "--dir", node), 2, "'0' is no share of the GPU", "more than 0%")
    one_line(ctl("create", "c1", "--sm", "101%", "--dir", node), 2, "'101%' is more than the whole GPU")
    assert not node.exists()


@pytest.mark.parametrize("cmd", [["create", "c1"], ["resize", "c1"], ["run", "--name", "c1"]])
def test_memory_0_is_refused_everywhere_it_sets_a_cap(node, cmd):
    assert ctl("create", "c1", "--memory", "1Gi", "--dir", node).exit_code == 0
    tail = ["--", "true"] if cmd[0] == "run" else []
    one_line(ctl(*cmd, "--memory", "0", "--dir", node, *tail), 2,
             "'0' would make a slice that can allocate nothing", "max")
    assert slices.read_quota(node, "c1").devices[0].memory_max == GiB
    # a request of 0 is a slice that is guaranteed nothing: allowed
    assert ctl("create", "c2", "--memory", "1Gi", "--request", "0", "--dir", node).exit_code == 0


# === the node directory ===

@pytest.mark.parametrize("cmd", [["list"], ["status"], ["reap"], ["status", "--json"]])
def test_a_node_directory_that_does_not_exist_is_an_error_not_an_empty_node(tmp_path, cmd):
    typo = tmp_path / "vgup"
    one_line(ctl(*cmd, "--dir", typo), 1, f"node directory {typo} does not exist", "check --dir / VGPU_DIR")
    one_line(ctl(*cmd, env={"VGPU_DIR": str(typo)}), 1, f"node directory {typo} does not exist")
    assert not typo.exists()


def test_create_makes_the_node_directory_but_its_parents_only_with_parents(tmp_path):
    deep = tmp_path / "a" / "b" / "vgpu"
    one_line(ctl("create", "c1", "--memory", "1Gi", "--dir", deep), 1,
             f"node directory {deep} does not exist, nor does its parent {deep.parent}", "--parents")
    assert not (tmp_path / "a").exists()
    r = ctl("create", "c1", "--memory", "1Gi", "--dir", deep, "--parents")
    assert r.exit_code == 0, r.output
    assert slices.read_quota(deep, "c1").devices[0].memory_max == GiB
    assert ctl("create", "c2", "--memory", "1Gi", "--dir", tmp_path / "leaf").exit_code == 0   # parent exists


def test_a_node_directory_that_is_a_file_is_named(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    one_line(ctl("list", "--dir", f), 2, f"Invalid value for '--dir': Directory '{f}' is a file")


# === run ===

def test_run_name_of_a_missing_slice_is_an_error_and_creates_nothing(node):
    node.mkdir()
    one_line(ctl("run", "--name", "typo", "--dir", node, "--", "true"), 1, "slice typo not found in",
             "--create")
    assert slices.list_names(node) == []
    one_line(ctl("run", "--create", "--dir", node, "--", "true"), 2, "--create needs --name")


def test_run_create_makes_a_kept_slice_and_a_rerun_of_the_same_command_works(node):
    args = ["run", "--name", "job", "--create", "--memory", "1Gi", "--sm", "50%", "--dir", node, "--", "true"]
    assert ctl(*args).exit_code == 0
    assert ctl(*args).exit_code == 0         # the same quota: no conflict
    q = slices.read_quota(node, "job").devices[0]
    assert (q.memory_max, q.sm_max) == (GiB, 5000)
    one_line(ctl("run", "--name", "job", "--create", "--memory", "2Gi", "--dir", node, "--", "true"), 2,
             "slice job exists with another quota", "vgpu-ctl resize job")


@pytest.mark.parametrize("make,code,what", [
    (lambda d: str(d / "missing"), 127, "command not found"),
    (lambda d: (d / "plain.txt").write_text("x") and str(d / "plain.txt"), 126, "not executable"),
    (lambda d: str(d), 126, "is a directory"),
    (lambda d: "no-such-command-vgpu", 127, "command not found"),
])
def test_run_exits_127_for_not_found_and_126_for_not_executable_and_cleans_up(tmp_path, make, code, what):
    node = tmp_path / "vgpu"
    out = subprocess.run([CTL, "run", "--memory", "1Gi", "--overcommit", "--dir", str(node), "--", make(tmp_path)],
                         capture_output=True, text=True, env=make_sim_env(tmp_path / "sim"))
    assert out.returncode == code, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and what in lines[0] and "hint:" in lines[0], out.stderr
    assert not node.exists()   # the temporary slice is gone, with the node directory and board it made


# === SM shares: ceilings ===

def test_sm_shares_over_100_percent_warn_on_create_and_resize_and_status_says_ceilings(node):
    r = ctl("create", "a", "--memory", "1Gi", "--sm", "60%", "--dir", node)
    assert r.exit_code == 0 and r.stderr == ""
    r = ctl("create", "b", "--memory", "1Gi", "--sm", "40%", "--dir", node)
    assert r.exit_code == 0 and r.stderr == ""                   # exactly 100%: no warning
    r = ctl("resize", "b", "--sm", "70%", "--dir", node)
    assert r.exit_code == 0
    assert r.stderr.strip() == ("warning: SM shares on device 0 add up to 130% (a 60%, b 70%): more than the "
                                "device, so they cannot all be guaranteed; when every slice wants its share at once, "
                                "each gets less")
    r = ctl("create", "c", "--memory", "1Gi", "--sm", "10%", "--dir", node)
    assert "add up to 140% (a 60%, b 70%, c 10%)" in r.stderr
    r = ctl("resize", "a", "--memory", "2Gi", "--dir", node)     # SM untouched: not repeated
    assert r.stderr == ""
    lines = ctl("status", "--dir", node).stdout.splitlines()
    device_row = lines[lines.index(next(x for x in lines if x.startswith("DEVICE"))) + 1]
    assert "140% (ceilings)" in device_row
    assert json.loads(ctl("status", "--json", "--dir", node).stdout)["devices"][0]["sm_ceilings"] is True
    ctl("resize", "b", "--sm", "20%", "--dir", node)
    assert "(ceilings)" not in ctl("status", "--dir", node).stdout
    r = ctl("create", "d", "--memory", "1Gi", "--dir", node)     # no --sm: no SM cap, no warning of its own
    assert r.exit_code == 0 and r.stderr == ""
    assert "190% (ceilings)" in ctl("status", "--dir", node).stdout
    # burst slices guaranteed less than their ceilings: the ceilings may add up past 100%
    r = ctl("create", "e", "--memory", "1Gi", "--sm", "100%", "--sm-request", "1%", "--dir", node)
    assert r.exit_code == 0 and "add up to 191%" in r.stderr     # its guarantee counts, not its 100% ceiling


# === shell completion, licence ===

def test_shell_completion_offers_commands_and_the_nodes_slices(tmp_path):
    node = tmp_path / "vgpu"
    env = {**os.environ, "LD_LIBRARY_PATH": "", "VGPU_DIR": str(node)}
    for name in ("train", "tiny", "infer"):
        subprocess.run([CTL, "create", name, "--memory", "1Gi", "--overcommit"], env=env, check=True,
                       capture_output=True)

    def complete(words, cword):
        out = subprocess.run([CTL], env={**env, "_VGPU_CTL_COMPLETE": "bash_complete", "COMP_WORDS": words,
                                         "COMP_CWORD": str(cword)}, capture_output=True, text=True, check=True)
        return out.stdout.split()

    assert complete("vgpu-ctl cre", 1) == ["plain,create"]
    assert complete("vgpu-ctl resize t", 2) == ["plain,tiny", "plain,train"]
    assert complete(f"vgpu-ctl status --dir {node} i", 4) == ["plain,infer"]
    script = subprocess.run([CTL], env={**env, "_VGPU_CTL_COMPLETE": "bash_source"}, capture_output=True,
                            text=True, check=True).stdout
    assert "complete -o nosort -F _vgpu_ctl_completion vgpu-ctl" in script


def test_the_licence_is_the_one_pyproject_names():
    root = ROOT
    text = (root / "LICENSE").read_text()
    assert 'license = "Apache-2.0"' in (root / "pyproject.toml").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 150


# === status --watch ===

def test_status_interval_takes_durations_and_plain_seconds(node):
    ctl("create", "c1", "--memory", "1Gi", "--dir", node)
    for interval in ("50ms", "0.05", "0.05s"):
        r = ctl("status", "-w", "--count", "2", "--interval", interval, "--json", "--dir", node)
        assert r.exit_code == 0, r.output
        assert len(r.stdout.splitlines()) == 2
    one_line(ctl("status", "-w", "--interval", "10ms", "--dir", node), 2, "0.01s is too short (at least 50ms)")


def test_watch_frames_show_throttling_as_a_rate_from_the_first_frame(node):
    ctl("create", "c1", "--memory", "1Gi", "--sm", "50%", "--dir", node)
    write_usage_counters(str(node), "c1", throttled_ns=7 * 10**9, gpu_time_ns=10**9)
    frames = ctl("status", "-w", "--count", "2", "--interval", "50ms", "--dir", node).stdout.split("\n\n\n")
    for frame in frames:
        row = next(line for line in frame.splitlines() if line.startswith("c1"))
        # nothing waited during the interval: 0ms/s (not the 7s since creation); whole percents
        assert row.split()[5:7] == ["0%/50%", "0ms/s"], row
    one = ctl("status", "--dir", node).stdout.splitlines()[1].split()
    assert one[5:7] == ["0%/50%", "7.0s"]                          # a single status: the total


def test_throttled_rate_is_the_wait_per_second_of_the_interval(node):
    ctl("create", "c1", "--memory", "1Gi", "--sm", "50%", "--dir", node)
    first = status_mod.collect(node, use_nvml=False)
    time.sleep(0.2)
    write_usage_counters(str(node), "c1", throttled_ns=10**8, gpu_time_ns=5 * 10**7)
    second = status_mod.collect(node, previous=first, use_nvml=False)
    dt = second["_t"] - first["_t"]
    d = second["slices"][0]["devices"][0]
    assert d["throttled_ns_per_s"] == round(10**8 / dt)
    assert d["sm_used"] == round(5 * 10**7 / (dt * 1e9) * 10000)
    row = status_mod.render(second).splitlines()[1].split()
    assert row[5:7] == [f"{round(d['sm_used'] / 100)}%/50%", f"{10**8 / dt / 1e6:.0f}ms/s"]


def test_ctrl_c_ends_a_watch_quietly_with_success(tmp_path):
    node = tmp_path / "vgpu"
    env = {**os.environ, "LD_LIBRARY_PATH": "", "PYTHONFAULTHANDLER": "1"}
    subprocess.run([CTL, "create", "c1", "--memory", "1Gi", "--overcommit", "--dir", str(node)], env=env,
                   check=True, capture_output=True)
    for extra in ([], ["--json"]):
        # as in a terminal's foreground: Ctrl-C at its default (a suite started in the
        # background of a shell inherits SIGINT ignored, and so would the watch)
        p = subprocess.Popen([CTL, "status", "--watch", "--interval", "100ms", "--dir", str(node), *extra], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        shown = ""                       # watching: its first frame shown (a fixed wait was not
        while "c1" not in shown:         # enough on a busy machine)
            line = p.stdout.readline()
            assert line, p.communicate(timeout=30)
            shown += line
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:    # where it is stuck: faulthandler's stacks on SIGABRT
            p.send_signal(signal.SIGABRT)
            raise AssertionError(f"no exit 30 s after Ctrl-C:\n{p.communicate(timeout=30)[1]}") from None
        assert p.returncode == 0, err
        assert err == ""


# === env ===

def test_env_json_is_format_json_and_a_contradiction_is_a_usage_error(node):
    ctl("create", "c1", "--memory", "1Gi", "--dir", node)
    a = ctl("env", "c1", "--json", "--dir", node)
    b = ctl("env", "c1", "--format", "json", "--dir", node)
    assert a.exit_code == b.exit_code == 0 and json.loads(a.stdout) == json.loads(b.stdout)
    assert ctl("env", "c1", "--json", "--format", "json", "--dir", node).exit_code == 0
    one_line(ctl("env", "c1", "--json", "--format", "docker", "--dir", node), 2, "--json is --format json")


def test_env_k8s_says_the_pod_still_needs_the_gpu(node):
    ctl("create", "c1", "--memory", "1Gi", "--dir", node)
    first = ctl("env", "c1", "--format", "k8s", "--dir", node).stdout.splitlines()[0]
    assert first.startswith("# vgpu slice c1: ") and "runtimeClassName: nvidia and NVIDIA_VISIBLE_DEVICES=all" in first


# === serve and autoscale ===

def test_serve_on_a_bad_address_or_a_busy_port_names_the_flag_to_change(node):
    node.mkdir()
    one_line(ctl("serve", "--address", "no-such-host.invalid", "--port", "0", "--dir", node), 1,
             "'no-such-host.invalid' is not an address of this host", "--address takes an IP address")
    one_line(ctl("serve", "--address", "192.0.2.1", "--port", "0", "--dir", node), 1,
             "hint: 192.0.2.1 is not an address of this host: pass --address 0.0.0.0")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        one_line(ctl("serve", "--address", "127.0.0.1", "--port", port, "--dir", node), 1,
                 f"cannot listen on 127.0.0.1:{port}", "pick another --port")
        one_line(ctl("autoscale", "--once", "--window", "1s", "--metrics-port", port, "--metrics-address",
                     "127.0.0.1", "--dir", node), 1, "pick another --metrics-port")


def test_autoscale_steps_and_marks_are_explained_in_flag_terms(node):
    one_line(ctl("autoscale", "--shrink-step", "100%", "--dir", node), 2,
             "Invalid value for '--shrink-step': 100% would let one shrink take a whole quota", "below 100%")
    one_line(ctl("autoscale", "--low", "80%", "--dir", node), 2,
             "--low 80% < --target 70% < --high 90% does not hold")


# === simgpu ===

def test_a_simgpu_state_directory_with_a_missing_parent_is_named_not_nvml(tmp_path):
    missing = tmp_path / "nope" / "node"
    one_line(ctl("sim", "env", "--state", missing), 2, f"simgpu state directory {missing} cannot be made",
             f"create {missing.parent} first")
    env = {**make_sim_env(missing), "VGPU_DIR": str(tmp_path / "vgpu")}
    out = subprocess.run([CTL, "create", "c1", "--memory", "1Gi"], env=env, capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        f"Error: SIMGPU_STATE_DIR: simgpu state directory {missing} cannot be made: {missing.parent} does not "
        f"exist; hint: create {missing.parent} first, or pick a directory whose parent exists"]
    assert "--overcommit" not in out.stderr
