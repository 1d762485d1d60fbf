"""Declarative slices: `vgpu-ctl apply -f slices.yaml` makes the node match the file
(create, resize, --prune delete; --dry-run shows the diff; idempotent), a bad file names
its line and field and changes nothing, and `vgpu-ctl export` writes the node back as a
file that applies to the same node.  Judged from the slice files themselves.

NVML is a fake node of one or two 24 GiB devices (as in test_ctl_cli.py).
"""
import json
import os

import pytest
from click.testing import CliRunner

from tests.helpers.simnode import write_usage_counters
from vgpu import nvml, slices
from vgpu.cli import main
from vgpu.quantities import UNLIMITED

GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture(autouse=True)
def two_devices(monkeypatch):
    monkeypatch.setattr(nvml, "available", lambda: (True, None))
    monkeypatch.setattr(nvml, "device_count", lambda: 2)
    monkeypatch.setattr(nvml, "memory_total", lambda d: 24 * GiB)


@pytest.fixture
def node(tmp_path):
    return tmp_path / "vgpu"


def ctl(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def write(tmp_path, text, name="slices.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def snapshot(node):
    """Every file of the node, byte for byte (what `nothing changed` means)."""
    if not node.exists():
        return {}
    return {str(p.relative_to(node)): p.read_bytes() for p in sorted(node.rglob("*")) if p.is_file()}


def quota(node, name, d=0):
    return slices.read_quota(node, name).devices[d]


FILE = """\
# two slices
slices:
  train:
    memory: 10Gi
    sm: 50%
  infer:
    memory: 4Gi
    request: 2Gi
    limit: 6Gi
    sm: 20%
    sm-limit: 60%
"""


# === apply ===

def test_apply_creates_what_the_file_says_and_applying_again_changes_nothing(node, tmp_path):
    f = write(tmp_path, FILE)
    r = ctl("apply", "-f", f, "--dir", node)
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [
        "+ create    infer  device 0: memory.max 4Gi (request 2Gi, limit 6Gi), sm.max 20% (request 20%, limit 60%)",
        "+ create    train  device 0: memory.max 10Gi (request 10Gi, limit 10Gi), sm.max 50%",
        "applied: 2 created, 0 resized, 0 deleted, 0 unchanged"]
    t, i = quota(node, "train"), quota(node, "infer")
    assert (t.memory_max, t.memory_request, t.memory_limit, t.sm_max) == (10 * GiB, 10 * GiB, 10 * GiB, 5000)
    assert (i.memory_max, i.memory_request, i.memory_limit, i.sm_max, i.sm_request, i.sm_limit) == \
        (4 * GiB, 2 * GiB, 6 * GiB, 2000, 2000, 6000)
    before = snapshot(node)
    r = ctl("apply", "-f", f, "--dir", node)
    assert r.exit_code == 0
    assert r.stdout.splitlines() == ["= unchanged infer", "= unchanged train",
                                     "nothing to change: 0 created, 0 resized, 0 deleted, 2 unchanged"]
    assert snapshot(node) == before          # not even a generation bump


def test_apply_resizes_in_place_and_keeps_slices_the_file_does_not_name(node, tmp_path):
    ctl("apply", "-f", write(tmp_path, FILE), "--dir", node)
    ctl("create", "extra", "--memory", "1Gi", "--dir", node)
    inode = (node / "train" / "quota").stat().st_ino
    r = ctl("apply", "-f", write(tmp_path, FILE.replace("10Gi", "12Gi").replace("sm: 50%", "sm: 40%")), "--dir", node)
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [
        "  kept      extra  (not in the file; --prune deletes it)",
        "= unchanged infer",
        "~ resize    train  device 0: memory.max 10Gi → 12Gi, sm.max 50% → 40%",
        "applied: 0 created, 1 resized, 0 deleted, 1 unchanged"]
    assert (node / "train" / "quota").stat().st_ino == inode      # rewritten in place: the shim sees it
    assert (quota(node, "train").memory_max, quota(node, "train").sm_max) == (12 * GiB, 4000)
    assert slices.read_quota(node, "train").generation == 4
    assert quota(node, "extra").memory_max == GiB


def test_dry_run_shows_the_diff_and_changes_nothing(node, tmp_path):
    ctl("apply", "-f", write(tmp_path, FILE), "--dir", node)
    ctl("create", "old", "--memory", "1Gi", "--dir", node)
    before = snapshot(node)
    new = FILE.replace("memory: 4Gi", "memory: 5Gi") + "  notebook:\n    memory: 2Gi\n"
    r = ctl("apply", "-f", write(tmp_path, new), "--prune", "--dry-run", "--dir", node)
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [
        "~ resize    infer     device 0: memory.max 4Gi → 5Gi",
        "+ create    notebook  device 0: memory.max 2Gi (request 2Gi, limit 2Gi), sm.max 100%",
        "- delete    old       (not in the file)",
        "= unchanged train",
        "dry run: 1 to create, 1 to resize, 1 to delete, 1 unchanged; nothing changed"]
    assert snapshot(node) == before
    data = json.loads(ctl("apply", "-f", write(tmp_path, new), "--prune", "--dry-run", "--json", "--dir",
                          node).stdout)
    assert (data["dry_run"], data["applied"]) == (True, False)
    assert [(c["name"], c["action"]) for c in data["changes"]] == [
        ("infer", "resize"), ("notebook", "create"), ("old", "delete"), ("train", "unchanged")]
    assert data["changes"][0]["devices"] == [{"index": 0, "old": quota(node, "infer").to_json(),
                                              "new": {**quota(node, "infer").to_json(), "memory_max": 5 * GiB}}]


def test_prune_deletes_slices_not_in_the_file_but_not_ones_in_use(node, tmp_path):
    ctl("apply", "-f", write(tmp_path, FILE), "--dir", node)
    for name in ("old", "busy"):
        ctl("create", name, "--memory", "1Gi", "--dir", node)
    write_usage_counters(str(node), "busy", memory_current=MiB)     # a live process holds a slot
    before = snapshot(node)
    r = ctl("apply", "-f", write(tmp_path, FILE), "--prune", "--dir", node)
    assert r.exit_code == 1
    assert r.stderr.strip() == ("Error: busy is not in the file but has 1 live process(es); hint: stop them "
                                "first, or add the slice to the file")
    assert snapshot(node) == before           # "old" is not deleted either: the plan failed as a whole
    r = ctl("apply", "-f", write(tmp_path, FILE + "  busy:\n    memory: 1Gi\n"), "--prune", "--dir", node)
    assert r.exit_code == 0, r.output
    assert slices.list_names(node) == ["busy", "infer", "train"]


def test_apply_orders_changes_so_the_node_is_never_overcommitted(node, tmp_path):
    """a shrinks 20Gi -> 4Gi and b grows 2Gi -> 18Gi: growing b first would need 38Gi of 24Gi."""
    ctl("create", "a", "--memory", "20Gi", "--dir", node)
    ctl("create", "b", "--memory", "2Gi", "--dir", node)
    r = ctl("apply", "-f", write(tmp_path, "slices:\n  b: {memory: 18Gi}\n  a: {memory: 4Gi}\n  c: {memory: 2Gi}\n"),
            "--dir", node)
    assert r.exit_code == 0, r.output
    assert [quota(node, n).memory_max for n in "abc"] == [4 * GiB, 18 * GiB, 2 * GiB]


def test_a_file_that_would_overcommit_is_refused_before_anything_changes(node, tmp_path):
    ctl("create", "a", "--memory", "8Gi", "--dir", node)
    before = snapshot(node)
    r = ctl("apply", "-f", write(tmp_path, "slices:\n  b: {memory: 10Gi}\n  c: {memory: 10Gi}\n"), "--dir", node)
    assert r.exit_code == 1
    assert r.stderr.strip() == ("Error: device 0 would be overcommitted: 28Gi guaranteed there (the file's slices "
                                "and those it keeps) > 24Gi physical; nothing was changed; hint: ask for less, "
                                "--prune slices not in the file, or pass --overcommit")
    assert snapshot(node) == before
    assert ctl("apply", "-f", tmp_path / "slices.yaml", "--prune", "--dir", node).exit_code == 0   # a goes
    assert slices.list_names(node) == ["b", "c"]


def test_devices_lists_and_per_device_quotas(node, tmp_path):
    text = """\
slices:
  both:
    devices: [0, 1]
    memory: 2Gi
    sm: 30%
  mixed:
    memory: 1Gi
    devices:
      0: {}
      1: {memory: 3Gi, sm: 25%}
  second:
    device: 1
"""
    r = ctl("apply", "-f", write(tmp_path, text), "--dir", node)
    assert r.exit_code == 0, r.output
    assert [quota(node, "both", d).memory_max for d in (0, 1)] == [2 * GiB, 2 * GiB]
    assert (quota(node, "mixed", 0).memory_max, quota(node, "mixed", 1).memory_max, quota(node, "mixed", 1).sm_max,
            quota(node, "mixed", 0).sm_max) == (GiB, 3 * GiB, 2500, 10000)
    assert slices.read_quota(node, "second").held() == [1]
    assert quota(node, "second", 1).memory_max == UNLIMITED
    # the devices of an idle slice change by making it again
    r = ctl("apply", "-f", write(tmp_path, text.replace("device: 1", "device: 0")), "--dir", node)
    assert r.stdout.splitlines()[2] == ("± replace   second  device 0: memory.max max (request max, limit max), "
                                        "sm.max 100%")
    assert slices.read_quota(node, "second").held() == [0]
    write_usage_counters(str(node), "second", memory_current=MiB)
    r = ctl("apply", "-f", write(tmp_path, text), "--dir", node)
    assert r.exit_code == 1 and "second holds device(s) 0 and the file gives it 1" in r.stderr


@pytest.mark.parametrize("text,line,what", [
    ("slices:\n  a:\n    memory: 4GB\n", 3, "slices.a.memory: '4GB' is not a memory size"),
    ("slices:\n  a:\n    memroy: 4Gi\n", 3, "slices.a.memroy: unknown field (fields: memory, request,"),
    ("slices:\n  a:\n    memory: 4Gi\n    request: 8Gi\n", 3, "slices.a: memory request 8Gi <= max 4Gi <= limit"),
    ("slices:\n  a: {}\n  ../x:\n    memory: 1Gi\n", 3, "slices.../x: not a valid slice name"),
    ("slices:\n  a: {memory: 1Gi}\n  a: {memory: 2Gi}\n", 3, "slices.a: given twice (also on line 2)"),
    ("slices:\n  a:\n    memory: [1]\n", 3, "slices.a.memory: expected a value, found a sequence"),
    ("slice:\n  a: {}\n", 1, "slice: unknown key"),
    ("slices:\n  a:\n   memory: 1Gi\n  b: : :\n", 4, "not valid YAML: mapping values are not allowed here"),
    ("slices:\n  a:\n    devices: [0, 0]\n", 3, "slices.a.devices: device 0 given twice"),
    ("slices:\n  a:\n    devices: [16]\n", 3, "slices.a.devices: '16' is not a device index (0..15)"),
    ("slices:\n  a:\n    sm: 0\n", 3, "slices.a.sm: '0' is no share of the GPU"),
    ("slices:\n  a:\n    memory: 0\n", 3, "slices.a.memory: 0 would make a slice that can allocate nothing"),
    ("slices:\n  a:\n    user: no-such-user-here\n", 3, "slices.a.user: 'no-such-user-here': no such user"),
    ("slices:\n  a:\n    device: 0\n    devices: [1]\n", 4, "slices.a: both device and devices"),
    ("slices:\n  ok: {memory: 1Gi}\n  a:\n    devices:\n      0: {memory: 1Gi, size: 2}\n", 5,
     "slices.a.devices.0.size: unknown field"),
    ("version: 2\nslices: {}\n", 1, "version: only version 1 is known"),
    ("- a\n- b\n", 1, "expected a mapping with the key `slices`, found a sequence"),
])
def test_a_bad_file_names_its_line_and_field_and_changes_nothing(node, tmp_path, text, line, what):
    ctl("create", "keep", "--memory", "1Gi", "--dir", node)
    before = snapshot(node)
    r = ctl("apply", "-f", write(tmp_path, text), "--prune", "--dir", node)
    assert r.exit_code == 2, r.output
    (msg,) = r.stderr.strip().splitlines()
    assert msg.startswith(f"Error: {tmp_path / 'slices.yaml'}:{line}: {what}"), msg
    assert "; hint: " in msg
    assert snapshot(node) == before


def test_files_that_are_not_there_or_say_nothing(node, tmp_path):
    r = ctl("apply", "-f", tmp_path / "nope.yaml", "--dir", node)
    assert r.exit_code == 2 and "nope.yaml: no such file; hint:" in r.stderr
    r = ctl("apply", "-f", write(tmp_path, "# nothing\n"), "--dir", node)
    assert r.exit_code == 2 and "the file is empty; hint: write `slices:`" in r.stderr
    ctl("create", "a", "--memory", "1Gi", "--dir", node)
    r = ctl("apply", "-f", write(tmp_path, "slices: {}\n"), "--prune", "--dir", node)   # explicit: none
    assert r.exit_code == 0 and slices.list_names(node) == []


def test_apply_reads_standard_input(node):
    r = ctl("apply", "-f", "-", "--dir", node, input="slices:\n  a: {memory: 3Gi}\n")
    assert r.exit_code == 0, r.output
    assert quota(node, "a").memory_max == 3 * GiB
    r = ctl("apply", "-f", "-", "--dir", node, input="slices:\n  a: {memory: x}\n")
    assert r.exit_code == 2 and r.stderr.startswith("Error: <stdin>:2: slices.a.memory: 'x' is not a memory size")


def test_apply_warns_when_the_files_sm_shares_are_ceilings(node, tmp_path):
    r = ctl("apply", "-f", write(tmp_path, "slices:\n  a: {sm: 70%}\n  b: {sm: 60%}\n"), "--dir", node)
    assert r.exit_code == 0
    assert "warning: SM shares on device 0 add up to 130% (a 70%, b 60%)" in r.stderr


# === export ===

def test_export_writes_a_file_that_applies_to_the_same_node(node, tmp_path):
    ctl("create", "infer", "--memory", "4Gi", "--request", "2Gi", "--limit", "6Gi", "--sm", "20%", "--sm-limit",
        "60%", "--dir", node)
    ctl("create", "both", "--memory", "2Gi", "--device", "0", "--device", "1", "--dir", node)
    ctl("resize", "both", "--memory", "3Gi", "--device", "1", "--dir", node)
    ctl("create", "open", "--dir", node)
    ctl("create", "true", "--memory", "1Gi", "--sm", "12.5%", "--user", f"{os.getuid()}:{os.getgid()}", "--dir", node)
    slices.resize(node, "open", sm=3333, memory=2505048064, request=0, limit=UNLIMITED,
                  capacity=lambda d: 24 * GiB)  # as the autoscaler leaves it
    r = ctl("export", "--dir", node)
    assert r.exit_code == 0, r.output
    assert r.stdout == f"""\
# vgpu slices of {node}, from `vgpu-ctl export`
# make a node match it: vgpu-ctl apply -f FILE
slices:
  both:
    devices:
      0: {{memory: 2Gi}}
      1: {{memory: 3Gi}}
  infer:
    memory: 4Gi
    request: 2Gi
    limit: 6Gi
    sm: 20%
    sm-limit: 60%
  open:
    memory: 2505048064
    request: 0
    limit: max
    sm: 33.33%
  "true":
    memory: 1Gi
    sm: 12.5%
    user: "{os.getuid()}:{os.getgid()}"
"""
    exported = write(tmp_path, r.stdout)
    r = ctl("apply", "-f", exported, "--prune", "--dry-run", "--dir", node)
    assert [line.split()[1] for line in r.stdout.splitlines()[:-1]] == ["unchanged"] * 4
    other = tmp_path / "other"
    assert ctl("apply", "-f", exported, "--dir", other).exit_code == 0
    assert ctl("export", "--dir", other).stdout == exported.read_text().replace(str(node), str(other))
    assert (other / "true" / "usage").stat().st_mode & 0o777 == 0o600


def test_export_to_a_file_and_of_an_empty_or_missing_node(node, tmp_path):
    r = ctl("export", "--dir", node)
    assert r.exit_code == 1 and f"node directory {node} does not exist" in r.stderr
    node.mkdir()
    assert ctl("export", "--dir", node).stdout.splitlines()[-1] == "slices: {}"
    ctl("create", "a", "--memory", "1Gi", "--dir", node)
    out = tmp_path / "etc" / "slices.yaml"
    out.parent.mkdir()
    assert ctl("export", "-o", out, "--dir", node).exit_code == 0
    assert out.read_text().endswith("slices:\n  a:\n    memory: 1Gi\n")
    assert sorted(p.name for p in out.parent.iterdir()) == ["slices.yaml"]    # no temporary left


def test_export_leaves_out_a_slice_it_cannot_read_and_says_so(node, tmp_path):
    ctl("create", "good", "--memory", "1Gi", "--dir", node)
    ctl("create", "bad", "--memory", "1Gi", "--dir", node)
    (node / "bad" / "quota").write_bytes(b"\0" * 100)
    r = ctl("export", "--dir", node)
    assert r.exit_code == 0
    assert "  # bad: not readable (" in r.stdout and "  good:\n    memory: 1Gi\n" in r.stdout
    assert r.stderr.startswith("warning: bad left out: ")


def test_sm_mode_is_applied_switched_in_place_exported_and_checked(node, tmp_path):
    f = write(tmp_path, "slices:\n  batch: {sm: 100%, sm-request: 30%}\n  steady: {sm: 40%, sm-mode: ceiling}\n")
    assert ctl("apply", "-f", f, "--dir", node).exit_code == 0
    assert slices.read_quota(node, "batch").sm_mode == "burst"       # the default
    steady = slices.read_quota(node, "steady")
    assert steady.sm_mode == "ceiling"
    exported = ctl("export", "--dir", node).output
    assert "    sm-mode: ceiling" in exported and exported.count("sm-mode") == 1
    f2 = write(tmp_path, "slices:\n  batch: {sm: 100%, sm-request: 30%}\n  steady: {sm: 40%}\n", "b.yaml")
    r = ctl("apply", "-f", f2, "--dir", node)
    assert r.exit_code == 0 and "~ resize    steady  sm mode: ceiling" in r.output, r.output
    after = slices.read_quota(node, "steady")
    assert after.sm_mode == "burst" and after.generation > steady.generation   # in place: a live switch
    assert "nothing to change" in ctl("apply", "-f", f2, "--dir", node).output
    bad = write(tmp_path, "slices:\n  x:\n    sm-mode: fast\n", "bad.yaml")
    r = ctl("apply", "-f", bad, "--dir", node)
    assert r.exit_code == 2 and "bad.yaml:3: slices.x.sm-mode: 'fast' is not one of burst, ceiling" in r.output
    assert "x" not in slices.list_names(node)
