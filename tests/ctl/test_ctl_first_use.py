"""vgpu-ctl as a new operator meets it (issue 28): numbers without units, `--dir` before the
command, `export -o` into a directory not made yet, a temporary slice that leaves the node as
it found it, and commands that say what they show and when.

The real command line, as its own process, on a one-GPU simgpu node (its NVML gives the
capacity checks something to check against).
"""
import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.simnode import make_sim_env
from vgpu import slices

GiB, MiB = 1 << 30, 1 << 20
CTL = str(Path(sys.executable).parent / "vgpu-ctl")


class Node:
    def __init__(self, root):
        self.root = root
        self.dir = root / "vgpu"
        self.env = make_sim_env(root / "sim")

    def ctl(self, *args, env=None, input=None, timeout=60):
        """`vgpu-ctl ARGS` (no --dir added: the tests say where it goes)."""
        return subprocess.run([CTL, *map(str, args)], env={**self.env, **(env or {})}, capture_output=True,
                              text=True, input=input, timeout=timeout)

    def ok(self, *args, **kw):
        out = self.ctl(*args, **kw)
        assert out.returncode == 0, f"vgpu-ctl {' '.join(map(str, args))} -> {out.returncode}\n{out.stdout}{out.stderr}"
        return out


@pytest.fixture
def node(tmp_path):
    return Node(tmp_path)


def one_line(out, code, *parts):
    """Failed with `code`, one line on stderr holding each part and a hint, nothing else."""
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "; hint: " in lines[0], out.stderr
    for p in parts:
        assert p in lines[0], lines[0]
    return lines[0]


# === 1. numbers without units ===

@pytest.mark.parametrize("args,what,meant", [
    (["--memory", "4"], "'4' has no unit, so it is 4 bytes", "hint: did you mean 4Gi?"),
    (["--memory", "512", "--sm", "50%"], "'512' has no unit", "hint: did you mean 512Mi?"),
    (["--sm", "0.5"], "'0.5' has no %, so it is 0.5% of the GPU", "hint: did you mean 50%?"),
    (["--memory", "4Gi", "--sm", "0.25"], "'0.25' has no %", "hint: did you mean 25%?"),
    (["--memory", "4Gi", "--request", "2"], "'2' has no unit", "hint: did you mean 2Gi?"),
    (["--sm", "100%", "--sm-request", "0.3"], "'0.3' has no %", "hint: did you mean 30%?"),
])
def test_create_refuses_a_number_that_lost_its_unit_and_says_what_was_meant(node, args, what, meant):
    """`create a --memory 4 --sm 0.5` made a 4-byte cap and a 0.5% share, exit 0."""
    one_line(node.ctl("create", "a", *args, "--dir", node.dir), 2, what, meant)
    assert not node.dir.exists()


def test_resize_and_run_refuse_it_too_and_valid_quantities_still_work(node):
    node.ok("create", "a", "--memory", "1048576", "--sm", "0.5%", "--request", "0", "--dir", node.dir)
    q = slices.read_quota(node.dir, "a").devices[0]
    assert (q.memory_max, q.sm_max, q.memory_request) == (MiB, 50, 0)
    one_line(node.ctl("resize", "a", "--memory", "8", "--dir", node.dir), 2, "did you mean 8Gi?")
    one_line(node.ctl("resize", "a", "--sm", "0.6", "--dir", node.dir), 2, "did you mean 60%?")
    assert slices.read_quota(node.dir, "a").devices[0] == q
    one_line(node.ctl("run", "--memory", "2", "--dir", node.dir, "--", "true"), 2, "did you mean 2Gi?")
    assert slices.list_names(node.dir) == ["a"]


@pytest.mark.parametrize("body,fixed,what,meant", [
    ("memory: 4", "memory: 4Gi", "<stdin>:5: slices.infer.memory: '4' has no unit", "hint: did you mean 4Gi?"),
    ("sm: 0.5", "sm: 0.5%", "<stdin>:5: slices.infer.sm: '0.5' has no %", "hint: did you mean 50%?"),
    ("memory: 8Gi\n    limit: 12", "memory: 8Gi\n    limit: 12Gi", "<stdin>:6: slices.infer.limit: '12' has no unit",
     "hint: did you mean 12Gi?"),
])
def test_a_slices_file_refuses_it_at_its_line_and_applies_nothing(node, body, fixed, what, meant):
    text = "slices:\n  ok:\n    memory: 1Gi\n  infer:\n    {}\n"
    one_line(node.ctl("apply", "-f", "-", "--dir", node.dir, input=text.format(body)), 2, what, meant,
             "nothing was changed")
    assert not node.dir.exists()
    node.ok("apply", "-f", "-", "--dir", node.dir, input=text.format(fixed))
    assert slices.list_names(node.dir) == ["infer", "ok"]


def test_help_says_the_rule_where_the_options_are():
    for cmd in (["create"], ["resize"], ["run"]):
        text = " ".join(subprocess.run([CTL, *cmd, "-h"], capture_output=True, text=True, check=True).stdout.split())
        assert "a number without a unit is bytes and must be at least 1Mi" in text, cmd
        assert "below 1 only with %" in text, cmd


# === 3. export -o into a directory not made yet ===

def test_export_makes_the_directory_of_its_file_and_names_the_users_path_when_it_cannot(node):
    """The README's boot step, `export -o /etc/vgpu/slices.yaml`, on a node without /etc/vgpu
    failed naming an internal `slices.yaml.NNNN.tmp`."""
    node.ok("create", "a", "--memory", "1Gi", "--dir", node.dir)
    etc = node.root / "etc"
    etc.mkdir()
    target = etc / "vgpu" / "slices.yaml"
    node.ok("export", "-o", target, "--dir", node.dir)
    assert target.read_text().endswith("slices:\n  a:\n    memory: 1Gi\n")
    assert sorted(p.name for p in target.parent.iterdir()) == ["slices.yaml"]
    assert (target.parent.stat().st_mode & 0o777) == 0o755

    deep = node.root / "nowhere" / "vgpu" / "slices.yaml"
    line = one_line(node.ctl("export", "-o", deep, "--dir", node.dir), 1, f"cannot write {deep}",
                    f"its directory {deep.parent} does not exist", f"mkdir -p {deep.parent}")
    assert ".tmp" not in line and not (node.root / "nowhere").exists()


# === 4. --dir before the command ===

def test_dir_before_the_command_is_taken_by_every_command_that_has_one(node):
    """`vgpu-ctl --dir X list` said "No such option '--dir'" though every command takes it."""
    d = str(node.dir)
    node.ok("--dir", d, "create", "a", "--memory", "1Gi", "--request", "512Mi", "--limit", "2Gi")
    assert slices.list_names(node.dir) == ["a"]
    assert [c["name"] for c in json.loads(node.ok("--dir", d, "list", "--json").stdout)] == ["a"]
    assert json.loads(node.ok("--dir", d, "status", "--json").stdout)["slices"][0]["name"] == "a"
    assert "VGPU_SLICE=a" in node.ok("--dir", d, "env", "a").stdout
    assert node.ok("--dir", d, "resize", "a", "--memory", "2Gi").stdout.splitlines()[-1] == "generation 4"
    assert node.ok("--dir", d, "reap").stdout == "nothing to reap\n"
    assert node.ok("--dir", d, "export").stdout.endswith("  a:\n    memory: 2Gi\n    request: 512Mi\n")
    node.ok("--dir", d, "apply", "-f", "-", input="slices:\n  b:\n    memory: 1Gi\n")
    assert node.ok("--dir", d, "run", "--name", "b", "--", "printenv", "VGPU_DIR").stdout == f"{d}\n"
    assert node.ok("--dir", d, "autoscale", "--once", "--window", "100ms", "--interval", "50ms").returncode == 0
    assert node.ok("--dir", d, "agent", "--once").returncode == 0
    node.ok("--dir", d, "delete", "b")
    assert slices.list_names(node.dir) == ["a"]


def test_the_commands_own_dir_wins_then_the_one_before_it_then_vgpu_dir(node):
    for name in ("here", "there", "env"):
        node.ok("create", "a", "--memory", "1Gi", "--dir", node.root / name, "--overcommit")
        node.ok("create", name, "--memory", "1Gi", "--dir", node.root / name, "--overcommit")

    def names(*args, env=None):
        return [c["name"] for c in json.loads(node.ok(*args, "--json", env=env).stdout)]
    vgpu_dir = {"VGPU_DIR": str(node.root / "env")}
    assert names("list", env=vgpu_dir) == ["a", "env"]
    assert names("--dir", node.root / "here", "list", env=vgpu_dir) == ["a", "here"]
    assert names("--dir", node.root / "here", "list", "--dir", node.root / "there", env=vgpu_dir) == ["a", "there"]
    one_line(node.ctl("--dir", node.root / "typo", "list"), 1, f"node directory {node.root / 'typo'} does not exist")


def test_every_command_with_a_dir_option_takes_it_from_before_the_command():
    """A command added later gets --dir through dir_option, or this names it."""
    from vgpu.cli import common, main

    def commands(group, path=()):
        for name, cmd in group.commands.items():
            yield (*path, name), cmd
            if hasattr(cmd, "commands"):
                yield from commands(cmd, (*path, name))
    missing = [" ".join(path) for path, cmd in commands(main)
               for p in cmd.params if "--dir" in getattr(p, "opts", ()) and p.callback is not common._group_dir]
    assert missing == []


# === 5. a temporary slice leaves the node as it found it ===

def test_run_leaves_no_node_directory_and_no_board_it_made(node):
    """As root without VGPU_DIR, `run --memory` left /run/vgpu/.sm-board (430 KB) behind."""
    out = node.ok("run", "--memory", "1Gi", "--dir", node.dir, "--", "ls", "-A", node.dir)
    assert sorted(out.stdout.split())[0] == ".sm-board"          # there while the command ran
    assert not node.dir.exists()

    node.dir.mkdir()                                               # a node directory it did not make
    node.ok("run", "--memory", "1Gi", "--dir", node.dir, "--", "true")
    assert list(node.dir.iterdir()) == []                          # kept, without the board run made

    one_line(node.ctl("run", "--memory", "100Gi", "--dir", node.root / "refused", "--", "true"), 1,
             "would be overcommitted")
    assert not (node.root / "refused").exists()                   # a refused run makes nothing either


def test_run_leaves_a_node_in_use_as_it_was(node):
    node.ok("create", "kept", "--memory", "1Gi", "--dir", node.dir)
    board = (node.dir / ".sm-board").read_bytes()
    node.ok("run", "--memory", "1Gi", "--dir", node.dir, "--", "true")
    assert sorted(p.name for p in node.dir.iterdir()) == [".sm-board", "kept"]
    assert (node.dir / ".sm-board").read_bytes() == board

    # a slice made while a temporary one runs keeps the board and directory the run made
    # (--overcommit: under the shim, this create's NVML sees the run's 1Gi slice as the GPU)
    other = node.root / "other"
    out = node.ok("run", "--memory", "1Gi", "--dir", other, "--", CTL, "create", "late", "--memory", "1Gi",
                  "--overcommit", "--dir", other)
    assert "created late" in out.stdout
    assert sorted(p.name for p in other.iterdir()) == [".sm-board", "late"]


# === 6. list, autoscale and status say what they show, and when ===

def test_list_shows_the_sm_request_limit_and_mode_as_its_json_does(node):
    d = node.dir
    node.ok("create", "burst", "--sm", "100%", "--sm-request", "30%", "--dir", d)
    node.ok("create", "steady", "--memory", "2Gi", "--sm", "40%", "--sm-limit", "60%", "--sm-mode", "ceiling",
            "--dir", d)
    header, *rows = node.ok("list", "--dir", d).stdout.splitlines()
    assert header.split() == ["NAME", "DEVICE", "MEMORY", "REQUEST", "LIMIT", "SM", "SM-REQUEST", "SM-LIMIT",
                              "SM-MODE", "PROCESSES", "GEN"]
    assert [r.split() for r in rows] == [["burst", "0", "max", "max", "max", "100%", "30%", "100%", "burst", "0", "2"],
                                         ["steady", "0", "2Gi", "2Gi", "2Gi", "40%", "40%", "60%", "ceiling", "0",
                                          "2"]]
    data = json.loads(node.ok("list", "--json", "--dir", d).stdout)
    assert [(c["name"], c["sm_mode"], [(x["sm_max"], x["sm_request"], x["sm_limit"]) for x in c["devices"]])
            for c in data] == [("burst", "burst", [(10000, 3000, 10000)]), ("steady", "ceiling", [(4000, 4000, 6000)])]


def test_autoscale_says_on_stderr_that_it_decides_only_after_a_window(node):
    """`autoscale --dry-run --once` was silent for a whole window (30 s by default)."""
    node.ok("create", "idle", "--memory", "2Gi", "--request", "1Gi", "--limit", "4Gi", "--dir", node.dir)
    proc = subprocess.Popen([CTL, "autoscale", "--dry-run", "--once", "--window", "300ms", "--interval", "100ms",
                             "--dir", str(node.dir)], env=node.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        first = proc.stderr.readline()        # before the window has passed: as it starts
        assert proc.poll() is None or proc.returncode == 0
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert first == ("autoscale: a decision needs a whole --window of observations, so none comes before 0.3s; "
                     "--once exits then\n")
    assert proc.returncode == 0 and err == ""
    events = [json.loads(line)["event"] for line in out.splitlines()]
    assert events == ["start", "dry-run"]


def _utc(stamp):
    assert stamp.endswith("Z") and len(stamp) == len("2026-12-01T10:42:07.118Z"), stamp
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc)


def test_status_json_lines_carry_when_they_were_read_as_the_agents_do(node):
    node.ok("create", "a", "--memory", "1Gi", "--dir", node.dir)
    before = datetime.datetime.now(datetime.timezone.utc)
    out = node.ok("status", "--json", "--watch", "--count", "3", "--interval", "100ms", "--dir", node.dir)
    after = datetime.datetime.now(datetime.timezone.utc)
    stamps = [_utc(json.loads(line)["ts"]) for line in out.stdout.splitlines()]
    assert len(stamps) == 3 and stamps == sorted(stamps)
    assert before - datetime.timedelta(seconds=1) <= stamps[0] and stamps[-1] <= after + datetime.timedelta(seconds=1)
    assert (stamps[-1] - stamps[0]).total_seconds() >= 0.15      # one per interval, not one time for all
    one = json.loads(node.ok("status", "--json", "--dir", node.dir).stdout)
    assert _utc(one["ts"]) >= stamps[-1] and one["slices"][0]["name"] == "a"
    agent = node.ok("agent", "--once", "--dir", node.dir).stdout.splitlines()
    assert all(_utc(json.loads(line)["ts"]) for line in agent)   # one format for all
