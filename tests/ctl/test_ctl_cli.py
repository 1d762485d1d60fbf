"""vgpu-ctl's commands through click's CliRunner: output, --json, exit codes, errors.

NVML is replaced by a fake A10 here (a pytest process must not bind to a simgpu node,
and the results must not depend on the machine); tests/ctl/test_ctl_e2e.py runs the real
command line against simgpu's NVML.
"""
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from vgpu import nvml, slices
from vgpu.cli import main
from vgpu.paths import SHIM
from vgpu.quantities import UNLIMITED

GiB, MiB = 1 << 30, 1 << 20
yaml = pytest.importorskip("yaml")


class FakeNvml:
    """One or more 24 GiB devices; `broken` makes NVML unavailable."""

    def __init__(self, count=1, broken=None):
        self.count, self.broken = count, broken

    def _check(self):
        if self.broken:
            raise nvml.NvmlUnavailable(self.broken)

    def install(self, monkeypatch):
        monkeypatch.setattr(nvml, "available", lambda: (False, self.broken) if self.broken else (True, None))
        monkeypatch.setattr(nvml, "device_count", lambda: (self._check(), self.count)[1])
        monkeypatch.setattr(nvml, "memory_total", lambda d: (self._check(), 24 * GiB)[1])
        monkeypatch.setattr(nvml, "devices", lambda: (self._check(), [
            {"index": i, "name": "Fake A10", "uuid": f"GPU-{i}", "memory_total": 24 * GiB,
             "memory_used": 3 * GiB, "gpu_util": 40} for i in range(self.count)])[1])
        monkeypatch.setattr(nvml, "process_utilization", lambda d, window_s=1.0: {})
        monkeypatch.setattr(nvml, "running_processes", lambda d: (self._check(), {})[1])   # nothing on the GPU
        monkeypatch.setattr(nvml, "driver_version", lambda: "fake")
        monkeypatch.setattr(nvml, "mig_mode", lambda d: None)      # no MIG on a fake A10
        return self


@pytest.fixture(autouse=True)
def fake_nvml(monkeypatch):
    return FakeNvml().install(monkeypatch)


@pytest.fixture
def ctl(tmp_path):
    """Invoke vgpu-ctl with --dir pointing at a fresh node directory."""
    node = tmp_path / "vgpu"

    def invoke(*args, input=None):
        return CliRunner().invoke(main, [*map(str, args), "--dir", str(node)], input=input)

    invoke.dir = node
    return invoke


def one_line_error(result, code, *parts):
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for p in parts:
        assert p in lines[0], lines[0]
    return lines[0]


# === create / list / delete ===

def test_create_prints_the_slice_and_json_matches_the_quota(ctl):
    r = ctl("create", "c1", "--memory", "4Gi", "--sm", "50%")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[:2] == ["created c1",
                                         "  device 0: memory.max 4Gi (request 4Gi, limit 4Gi), sm.max 50%"]
    data = json.loads(ctl("create", "c2", "--memory", "2Gi", "--request", "1Gi", "--limit", "3Gi",
                          "--sm", "25", "--sm-limit", "50%", "--json").stdout)
    assert data["devices"] == [{"index": 0, "memory_max": 2 * GiB, "memory_request": GiB, "memory_limit": 3 * GiB,
                                "sm_max": 2500, "sm_request": 2500, "sm_limit": 5000}]
    assert (data["name"], data["generation"], data["device_count"]) == ("c2", 2, 1)
    assert data["quota"] == str(ctl.dir / "c2" / "quota") and data["usage"] == str(ctl.dir / "c2" / "usage")


def test_create_without_memory_is_uncapped_and_guarantees_nothing(ctl, fake_nvml):
    fake_nvml.broken = "no driver"      # nothing guaranteed: no capacity check needed
    data = json.loads(ctl("create", "c1", "--json").stdout)
    assert data["devices"][0]["memory_max"] is None and data["devices"][0]["sm_max"] == 10000
    assert slices.read_quota(ctl.dir, "c1").devices[0].memory_max == UNLIMITED


def test_create_on_device_1_denies_device_0(ctl):
    assert ctl("create", "c1", "--memory", "1Gi", "--device", "1", "--overcommit").exit_code == 0
    q = slices.read_quota(ctl.dir, "c1")
    assert q.device_count == 2 and q.held() == [1]
    assert q.devices[0] == slices.DENIED and q.devices[1].memory_max == GiB


def test_create_twice_is_refused_and_leaves_the_first(ctl):
    ctl("create", "c1", "--memory", "1Gi")
    r = ctl("create", "c1", "--memory", "2Gi")
    one_line_error(r, 1, "slice c1 already exists", "hint: resize it")
    assert slices.read_quota(ctl.dir, "c1").devices[0].memory_max == GiB


@pytest.mark.parametrize("args,what", [
    (["--memory", "4GB"], "'4GB' is not a memory size"),
    (["--memory", "-1"], "is not a memory size"),
    (["--sm", "150%"], "'150%' is more than the whole GPU (1..100%"),
    (["--sm", "0"], "'0' is no share of the GPU: a slice needs more than 0%"),
    (["--memory", "0"], "'0' would make a slice that can allocate nothing"),
    (["--device", "16"], "--device"),
])
def test_bad_quantities_are_usage_errors(ctl, args, what):
    r = ctl("create", "c1", *args)
    assert r.exit_code == 2
    assert what in r.stderr
    assert not (ctl.dir / "c1").exists()


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "-x", "", "x" * 64, "a b", "ä"])
def test_names_with_path_tricks_are_usage_errors_and_create_nothing(ctl, name):
    r = CliRunner().invoke(main, ["create", "--dir", str(ctl.dir), "--memory", "1Gi", "--", name])
    assert r.exit_code == 2, r.output
    assert "not a valid slice name" in r.stderr
    assert not ctl.dir.exists() or [p.name for p in ctl.dir.iterdir()] in ([], [".sm-board"])   # the node's share board stays


def test_create_that_would_overcommit_is_refused(ctl):
    ctl("create", "big", "--memory", "20Gi")
    r = ctl("create", "c1", "--memory", "8Gi")
    one_line_error(r, 1, "device 0 would be overcommitted: 28Gi guaranteed (c1 8Gi + others 20Gi) > 24Gi physical",
                   "hint:", "--overcommit")
    assert ctl("create", "c1", "--memory", "8Gi", "--overcommit").exit_code == 0


def test_without_nvml_a_guarantee_needs_overcommit(ctl, fake_nvml):
    fake_nvml.broken = "libnvidia-ml.so.1 not found (no NVIDIA driver here)"
    r = ctl("create", "c1", "--memory", "4Gi")
    one_line_error(r, 1, "cannot check device 0's capacity: NVML unavailable (libnvidia-ml.so.1 not found",
                   "hint: pass --overcommit")
    assert ctl("create", "c1", "--memory", "4Gi", "--overcommit").exit_code == 0


def test_create_on_a_device_the_node_lacks_is_refused(ctl):
    one_line_error(ctl("create", "c1", "--memory", "1Gi", "--device", "3"), 2,
                   "device 3 does not exist (this node has 1)")


def test_list_shows_each_slice_and_device(ctl):
    ctl.dir.mkdir()
    assert ctl("list").stdout.strip() == f"no slices in {ctl.dir}"
    assert json.loads(ctl("list", "--json").stdout) == []
    ctl("create", "b", "--memory", "2Gi", "--request", "1Gi", "--sm", "30%")
    ctl("create", "a", "--memory", "1Gi")
    lines = ctl("list").stdout.splitlines()
    assert [line.split() for line in lines] == [
        ["NAME", "DEVICE", "MEMORY", "REQUEST", "LIMIT", "SM", "SM-REQUEST", "SM-LIMIT", "SM-MODE", "PROCESSES",
         "GEN"],
        ["a", "0", "1Gi", "1Gi", "1Gi", "100%", "100%", "100%", "burst", "0", "2"],
        ["b", "0", "2Gi", "1Gi", "2Gi", "30%", "30%", "30%", "burst", "0", "2"]]
    data = json.loads(ctl("list", "--json").stdout)
    assert [(c["name"], c["processes"], c["problem"]) for c in data] == [("a", 0, None), ("b", 0, None)]


def test_delete_removes_the_slice(ctl):
    ctl("create", "c1", "--memory", "1Gi")
    (ctl.dir / "c1" / ".quota.123.abcd.tmp").write_bytes(b"left over by a crashed controller")
    r = ctl("delete", "c1", "--json")
    assert json.loads(r.stdout) == {"name": "c1", "deleted": True, "live_processes": []}
    assert [p.name for p in ctl.dir.iterdir()] == [".sm-board"]   # the node's, not the slice's
    one_line_error(ctl("delete", "c1"), 1, f"slice c1 not found in {ctl.dir}", "hint: `vgpu-ctl list`")


def test_delete_leaves_files_it_did_not_make(ctl):
    ctl("create", "c1", "--memory", "1Gi")
    (ctl.dir / "c1" / "notes.txt").write_text("mine")
    one_line_error(ctl("delete", "c1"), 1, "holds files vgpu did not make")
    assert (ctl.dir / "c1" / "notes.txt").read_text() == "mine"


# === resize ===

def test_resize_prints_old_and_new_and_bumps_the_generation(ctl):
    ctl("create", "c1", "--memory", "4Gi", "--sm", "50%")
    r = ctl("resize", "c1", "--memory", "6Gi", "--sm", "60%")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == ["c1 device 0: memory.max 4Gi → 6Gi, sm.max 50% → 60%", "generation 4"]
    data = json.loads(ctl("resize", "c1", "--memory", "5Gi", "--json").stdout)
    assert data["generation"] == 6 and data["warnings"] == []
    assert data["changes"] == [{"device": 0, "field": f, "old": 6 * GiB, "new": 5 * GiB}
                               for f in ("memory_max", "memory_request", "memory_limit")]
    assert json.loads(ctl("resize", "c1", "--memory", "5Gi", "--json").stdout)["generation"] == 6   # no change


def test_resize_keeps_an_explicit_request_and_limit(ctl):
    ctl("create", "c1", "--memory", "4Gi", "--request", "2Gi", "--limit", "8Gi")
    assert ctl("resize", "c1", "--memory", "6Gi").stdout.splitlines()[0] == "c1 device 0: memory.max 4Gi → 6Gi"
    q = slices.read_quota(ctl.dir, "c1").devices[0]
    assert (q.memory_max, q.memory_request, q.memory_limit) == (6 * GiB, 2 * GiB, 8 * GiB)
    one_line_error(ctl("resize", "c1", "--memory", "10Gi"), 2,
                   "memory request 2Gi <= max 10Gi <= limit 8Gi does not hold", "hint: set --request / --limit")
    one_line_error(ctl("resize", "c1", "--request", "7Gi"), 2, "does not hold")
    assert ctl("resize", "c1", "--request", "3Gi").stdout.splitlines()[0] == \
        "c1 device 0: memory.request 2Gi → 3Gi"


def test_resize_errors(ctl):
    one_line_error(ctl("resize", "nope", "--memory", "1Gi"), 1, "slice nope not found: node directory",
                   "hint:")
    ctl("create", "other")
    one_line_error(ctl("resize", "nope", "--memory", "1Gi"), 1, f"slice nope not found in {ctl.dir}", "hint:")
    ctl("create", "c1", "--memory", "1Gi")
    r = ctl("resize", "c1")
    assert r.exit_code == 2 and "nothing to change" in r.stderr
    one_line_error(ctl("resize", "c1", "--memory", "2Gi", "--device", "1"), 2,
                   "slice c1 does not hold device 1 (it holds 0)")
    one_line_error(ctl("resize", "c1", "--memory", "25Gi"), 1, "would be overcommitted")
    assert ctl("resize", "c1", "--memory", "25Gi", "--overcommit").exit_code == 0


# === status ===

def test_status_reports_slices_and_devices_as_json(ctl):
    ctl("create", "c1", "--memory", "4Gi", "--sm", "50%")
    ctl("create", "c2", "--memory", "2Gi", "--request", "1Gi", "--sm", "20%")
    data = json.loads(ctl("status", "--json").stdout)
    assert [c["name"] for c in data["slices"]] == ["c1", "c2"]
    d = data["slices"][0]["devices"][0]
    assert (d["index"], d["memory_max"], d["memory_current"], d["sm_max"], d["sm_used"], d["throttled_ns"]) == \
        (0, 4 * GiB, 0, 5000, 0, 0)
    assert data["devices"] == [{"index": 0, "name": "Fake A10", "uuid": "GPU-0", "memory_total": 24 * GiB,
                                "memory_used": 3 * GiB, "gpu_util": 4000, "memory_allocated": 6 * GiB,
                                "memory_unlimited": 0, "memory_guaranteed": 5 * GiB, "memory_in_use": 0,
                                "sm_allocated": 7000, "sm_guaranteed": 7000, "sm_ceilings": False,
                                "slices": 2, "health": None}]   # (health: no agent watching)
    only = json.loads(ctl("status", "c2", "--json").stdout)
    assert [c["name"] for c in only["slices"]] == ["c2"]
    assert only["devices"] == data["devices"]          # a device's allocation is always the whole node's


def test_status_table_has_kubectl_style_columns(ctl):
    ctl("create", "c1", "--memory", "4Gi", "--sm", "50%")
    lines = ctl("status").stdout.splitlines()
    assert lines[0].split() == ["SLICE", "DEVICE", "GPU-MEMORY", "DRIVER", "GPU-UTIL", "THROTTLED", "OOM",
                                "PROCESSES", "GEN"]
    assert lines[1].split() == ["c1", "0", "0/4Gi", "(0%)", "0", "0%/50%", "0s", "0", "0", "2"]
    assert lines[3].split()[:3] == ["DEVICE", "NAME", "MEMORY-ALLOCATED"]
    assert lines[4].split() == ["0", "Fake", "A10", "4Gi/24Gi", "4Gi", "3Gi/24Gi", "50%", "40%", "1"]


def test_status_without_nvml_says_so_and_still_works(ctl, fake_nvml):
    fake_nvml.broken = "libnvidia-ml.so.1 not found (no NVIDIA driver here)"
    ctl("create", "c1", "--memory", "4Gi", "--overcommit")
    r = ctl("status")
    assert r.exit_code == 0
    assert r.stdout.splitlines()[1].split()[:4] == ["c1", "0", "0/4Gi", "(0%)"]
    assert r.stdout.splitlines()[-1] == ("note: NVML unavailable (libnvidia-ml.so.1 not found (no NVIDIA driver "
                                         "here)): no device capacity, real usage or per-process GPU-UTIL")
    data = json.loads(ctl("status", "--json").stdout)
    assert data["nvml"] == {"available": False, "note": fake_nvml.broken, "driver": None}
    assert data["slices"][0]["devices"][0]["sm_used"] is None


def test_status_watch_refreshes_count_times(ctl):
    ctl("create", "c1", "--memory", "1Gi")
    r = ctl("status", "--watch", "--count", "3", "--interval", "0.05", "--json")
    assert r.exit_code == 0
    frames = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(frames) == 3 and all(f["slices"][0]["name"] == "c1" for f in frames)
    text = ctl("status", "-w", "--count", "2", "--interval", "0.05").stdout
    assert text.count("SLICE  DEVICE") == 2


def test_status_of_an_unknown_container_is_an_error(ctl):
    ctl.dir.mkdir()
    one_line_error(ctl("status", "nope"), 1, "slice nope not found", "hint:")


def test_status_shows_a_damaged_slice_as_an_error_row(ctl):
    ctl("create", "good", "--memory", "1Gi")
    ctl("create", "bad", "--memory", "1Gi")
    (ctl.dir / "bad" / "quota").write_bytes(b"\0" * 100)
    r = ctl("status")
    assert r.exit_code == 0
    rows = {line.split()[0]: line for line in r.stdout.splitlines()[1:3]}
    assert "error:" in rows["bad"] and "has 100 bytes" in rows["bad"]
    assert rows["good"].split()[2] == "0/1Gi"


# === reap ===

def test_reap_with_nothing_dead(ctl):
    ctl("create", "c1", "--memory", "1Gi")
    assert ctl("reap").stdout.strip() == "nothing to reap"
    assert json.loads(ctl("reap", "--json").stdout) == []
    one_line_error(ctl("reap", "nope"), 1, "slice nope not found")


def test_reap_returns_a_dead_slots_memory(ctl):
    """A slot whose pid is set but whose lock nobody holds is a dead process's."""
    from vgpu._region import ffi, lib
    ctl("create", "c1", "--memory", "4Gi")
    path = ctl.dir / "c1" / "usage"
    data = bytearray(path.read_bytes())
    u = ffi.cast("struct vgpu_usage *", ffi.from_buffer(data))
    u.procs[5].pid, u.charge[0][5], u.procs[5].comm = 4242, GiB, b"python3"
    u.procs[7].pid, u.charge[0][7] = 4343, 2 * GiB
    path.write_bytes(bytes(data))
    r = ctl("reap")
    assert r.stdout.splitlines() == ["c1: slot 5 pid 4242 (python3) gone; returned 1Gi on device 0",
                                     "c1: slot 7 pid 4343 () gone; returned 2Gi on device 0"]
    after = bytearray(path.read_bytes())
    u = ffi.cast("struct vgpu_usage *", ffi.from_buffer(after))
    assert (sum(u.charge[0]), u.procs[5].pid, u.procs[7].pid) == (0, 0, 0)
    assert u.magic == lib.VGPU_USAGE_MAGIC


# === env ===

def test_env_shell_exports_put_the_shim_in_front_of_ld_preload(ctl):
    ctl("create", "c1", "--memory", "1Gi")
    out = ctl("env", "c1").stdout
    assert out.splitlines() == [f'export LD_PRELOAD={SHIM}"${{LD_PRELOAD:+:$LD_PRELOAD}}"',
                                f"export VGPU_DIR={ctl.dir}", "export VGPU_SLICE=c1", "export VGPU_CONTAINER=c1",
                                "export CUDA_DEVICE_ORDER=PCI_BUS_ID"]
    for before, after in [("", f"{SHIM}"), ("libm.so.6", f"{SHIM}:libm.so.6")]:
        got = subprocess.run(["bash", "-c", out + 'printf "%s|%s" "$LD_PRELOAD" "$VGPU_SLICE"'],
                             env={"PATH": "/usr/bin:/bin", "LD_PRELOAD": before}, capture_output=True,
                             text=True).stdout
        assert got == f"{after}|c1"


def test_env_docker_mounts_shim_and_quota_read_only_and_usage_writable(ctl):
    ctl("create", "c1", "--memory", "1Gi")
    args = ctl("env", "c1", "--format", "docker").stdout.split()
    mounts = [args[i + 1] for i, a in enumerate(args) if a == "-v"]
    envs = [args[i + 1] for i, a in enumerate(args) if a == "-e"]
    assert mounts == [f"{SHIM}:/usr/local/lib/vgpu/libvgpu.so:ro", f"{ctl.dir}/c1/quota:/run/vgpu/c1/quota:ro",
                      f"{ctl.dir}/c1/usage:/run/vgpu/c1/usage:rw", f"{ctl.dir}/c1/identity:/run/vgpu/.slice:ro",
                      f"{ctl.dir}/.sm-board:/run/vgpu/.sm-board:rw"]
    assert envs == ["LD_PRELOAD=/usr/local/lib/vgpu/libvgpu.so", "VGPU_DIR=/run/vgpu", "VGPU_SLICE=c1",
                    "VGPU_CONTAINER=c1", "CUDA_DEVICE_ORDER=PCI_BUS_ID"]


def test_env_k8s_is_yaml_with_read_only_shim_and_quota(ctl):
    ctl("create", "c1", "--memory", "1Gi")
    doc = yaml.safe_load(ctl("env", "c1", "--format", "k8s").stdout)
    mounts = {m["name"]: m for m in doc["volumeMounts"]}
    assert mounts["vgpu-shim"]["readOnly"] is True and mounts["vgpu-c1-quota"]["readOnly"] is True
    assert mounts["vgpu-c1-usage"].get("readOnly", False) is False
    assert mounts["vgpu-c1-quota"]["mountPath"] == "/run/vgpu/c1/quota"
    assert {v["name"]: v["hostPath"] for v in doc["volumes"]} == {
        "vgpu-shim": {"path": str(SHIM), "type": "File"},
        "vgpu-c1-quota": {"path": f"{ctl.dir}/c1/quota", "type": "File"},
        "vgpu-c1-usage": {"path": f"{ctl.dir}/c1/usage", "type": "File"},
        "vgpu-c1-slice": {"path": f"{ctl.dir}/c1/identity", "type": "File"},
        "vgpu-sm-board": {"path": f"{ctl.dir}/.sm-board", "type": "File"}}
    assert {e["name"]: e["value"] for e in doc["env"]} == {
        "LD_PRELOAD": "/usr/local/lib/vgpu/libvgpu.so", "VGPU_DIR": "/run/vgpu", "VGPU_SLICE": "c1",
        "VGPU_CONTAINER": "c1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_k8s_yaml_quotes_values_that_would_change_type():
    from vgpu.runtime import to_yaml
    doc = {"env": [{"name": "A", "value": v} for v in ("true", "0", "1.5", "null", "a: b", "-x", "~", "")]}
    assert [e["value"] for e in yaml.safe_load(to_yaml(doc))["env"]] == \
        ["true", "0", "1.5", "null", "a: b", "-x", "~", ""]


def test_env_json_and_unknown_container(ctl):
    ctl("create", "c1", "--memory", "1Gi")
    data = json.loads(ctl("env", "c1", "--json").stdout)
    assert data["variables"] == {"LD_PRELOAD": str(SHIM), "VGPU_DIR": str(ctl.dir), "VGPU_SLICE": "c1",
                                 "VGPU_CONTAINER": "c1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert set(data) == {"variables", "docker", "k8s"}
    one_line_error(ctl("env", "nope"), 1, "slice nope not found")


# === run ===

def test_run_exits_with_the_childs_code_and_removes_its_temporary_slice(ctl):
    code = "import os, sys; sys.exit(3 if os.environ['VGPU_SLICE'].startswith('run-') else 9)"
    r = CliRunner().invoke(main, ["run", "--dir", str(ctl.dir), "--", sys.executable, "-c", code])
    assert r.exit_code == 3, r.output
    assert not ctl.dir.exists()   # with the node directory and share board it made


def test_run_in_a_named_slice_keeps_it(ctl):
    r = CliRunner().invoke(main, ["run", "--dir", str(ctl.dir), "--name", "keep", "--create", "--memory", "1Gi",
                                  "--", sys.executable, "-c", "pass"])
    assert r.exit_code == 0, r.output
    assert slices.read_quota(ctl.dir, "keep").devices[0].memory_max == GiB
    r = CliRunner().invoke(main, ["run", "--dir", str(ctl.dir), "--name", "keep", "--memory", "2Gi", "--", "true"])
    one_line_error(r, 2, "slice keep exists with another quota (device 0: memory.max 1Gi")
    r = CliRunner().invoke(main, ["run", "--dir", str(ctl.dir), "--name", "keep", "--", "/nonexistent/prog"])
    one_line_error(r, 127, "/nonexistent/prog: command not found")


# === the command line itself ===

def test_help_works_without_nvml_being_loaded():
    code = ("import sys\nfrom vgpu.cli import main\n"
            "for cmd in ([], ['create'], ['delete'], ['list'], ['resize'], ['status'], ['reap'], ['env'],\n"
            "            ['run'], ['shim-path'], ['sim', 'env'], ['sim'], ['apply'], ['export']):\n"
            "    try:\n        main(cmd + ['--help'])\n"
            "    except SystemExit as e:\n        assert e.code == 0, cmd\n"
            "assert 'pynvml' not in sys.modules\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "LD_LIBRARY_PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok") and "Example:" in out.stdout


def test_a_slice_made_by_a_standalone_shim_is_listed_shown_and_resizable(ctl):
    """The shim, with VGPU_MEMORY_LIMIT and no controller, writes a quota holding all 16
    device indices; the controller shows the devices that exist and resizes them."""
    from vgpu._region import ffi, lib
    q = ffi.new("struct vgpu_quota *")
    q.magic, q.abi_version, q.size = lib.VGPU_QUOTA_MAGIC, lib.VGPU_ABI_VERSION, ffi.sizeof(q[0])
    q.generation, q.device_count, q.name = 2, lib.VGPU_MAX_DEVICES, b"solo"
    for d in range(lib.VGPU_MAX_DEVICES):
        dev = q.devices[d]
        dev.memory_max = dev.memory_request = dev.memory_limit = 4 * GiB
        dev.sm_max = dev.sm_request = dev.sm_limit = 10000
    (ctl.dir / "solo").mkdir(parents=True)
    (ctl.dir / "solo" / "quota").write_bytes(bytes(ffi.buffer(q)))
    assert [line.split()[:3] for line in ctl("status").stdout.splitlines()[:2]] == \
        [["SLICE", "DEVICE", "GPU-MEMORY"], ["solo", "0", "0/4Gi"]]
    r = ctl("resize", "solo", "--memory", "6Gi")        # devices 1..15 do not exist: nothing to overcommit
    assert r.exit_code == 0, r.output
    assert len(r.stdout.splitlines()) == lib.VGPU_MAX_DEVICES + 1
    assert slices.read_quota(ctl.dir, "solo").devices[15].memory_max == 6 * GiB
