"""MIG slices through the real command line: `vgpu-ctl create --mig`, `delete`, `list`,
`status`, `env`, `mig profiles`, on simgpu's MIG-capable a100-40g, h100-80g and h200 (and
the a10 without MIG).

vgpu-ctl runs as its own process on a fresh simgpu node; what it did is judged from
outside: by pynvml in another process (the instances NVML lists), by cuda-bindings
processes run with what `vgpu-ctl env` prints (under the shim), and by the exit codes and
one-line errors.  The expected profile tables are the published ones that
tests/simgpu/test_simgpu_mig.py holds.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.children import JsonChild
from tests.helpers.simnode import make_sim_env
from tests.simgpu.test_simgpu_mig import PLACEMENTS, PROFILES, holder, nvml, release

GiB, MiB = 1 << 30, 1 << 20
CTL = str(Path(sys.executable).parent / "vgpu-ctl")
SUCCESS, OUT_OF_MEMORY = 0, 2
# the 3g profile of each board: (name, memory in MiB, SMs)
THREE_G = {"a100-40g": ("3g.20gb", 20096, 42), "h100-80g": ("3g.40gb", 40448, 60), "h200": ("3g.71gb", 71424, 60)}

# What NVML says of the node, from a process of its own: MIG mode, the GPU instances
# (ID, profile ID, placement) with their compute instances, and the MIG devices' UUIDs.
INSTANCES = """
out = {"mode": n.nvmlDeviceGetMigMode(h), "gis": [], "uuids": []}
if out["mode"][0] == 1:
    for pid in sorted(MEMORY_SLICES):
        arr = (n.c_nvmlGpuInstance_t * 8)()
        count = ctypes.c_uint()
        n.nvmlDeviceGetGpuInstances(h, pid, arr, ctypes.byref(count))
        for i in range(count.value):
            cis = (n.c_nvmlComputeInstance_t * 8)()
            ccount = ctypes.c_uint()
            full = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[n.nvmlDeviceGetGpuInstanceProfileInfoById(h, pid).sliceCount]
            n.nvmlGpuInstanceGetComputeInstances(arr[i], full, cis, ctypes.byref(ccount))
            out["gis"].append(gi_info(arr[i]) + [[n.nvmlComputeInstanceGetInfo(cis[j]).id for j in range(ccount.value)]])
    for i in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            out["uuids"].append(n.nvmlDeviceGetUUID(n.nvmlDeviceGetMigDeviceHandleByIndex(h, i)))
        except n.NVMLError_NotFound:
            pass
out["gis"].sort()
out["uuids"].sort()
print(json.dumps(out))
"""

# A workload: cuda-bindings on device 0, taking commands on stdin.
WORKLOAD = r"""
import json, os, sys
from cuda.bindings import driver as cu

def rc(r):
    return int((r if isinstance(r, tuple) else (r,))[0])

assert rc(cu.cuInit(0)) == 0
dev = cu.cuDeviceGet(0)[1]
assert rc(cu.cuCtxSetCurrent(cu.cuDevicePrimaryCtxRetain(dev)[1])) == 0
uuid = bytes(cu.cuDeviceGetUuid(dev)[1].bytes).hex()
free, total = [int(x) for x in cu.cuMemGetInfo()[1:]]
sms = cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)[1]
print(json.dumps({"pid": os.getpid(), "count": cu.cuDeviceGetCount()[1],
                  "name": cu.cuDeviceGetName(96, dev)[1].split(b"\0")[0].decode(), "uuid": uuid,
                  "total": total, "device_total": int(cu.cuDeviceTotalMem(dev)[1]), "sms": sms}), flush=True)
held = []
for line in sys.stdin:
    cmd, arg = json.loads(line)
    if cmd == "alloc":
        r = cu.cuMemAlloc(arg)
        if rc(r) == 0:
            held.append(r[1])
        out = rc(r)
    elif cmd == "nvml":             # what NVML shows this process of its own device, by its UUID
        import pynvml as n
        n.nvmlInit()
        u = "MIG-" + "-".join(uuid[i:j] for i, j in ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32)))
        m = n.nvmlDeviceGetHandleByUUID(u)
        mem = n.nvmlDeviceGetMemoryInfo(m)
        out = [u, mem.total, mem.used]
    print(json.dumps(out), flush=True)
"""


class Node:
    def __init__(self, root, profile, devices=1):
        root.mkdir()
        self.dir = root / "vgpu"
        self.env = make_sim_env(root / "node", profile=profile, devices=devices)

    def ctl(self, *args, ok=True):
        """vgpu-ctl ARGS (the node directory from VGPU_DIR: `run` passes what follows -- on)."""
        out = subprocess.run([CTL, *map(str, args)], env={**self.env, "VGPU_DIR": str(self.dir)},
                             capture_output=True, text=True, timeout=60)
        if ok and out.returncode != 0:
            raise AssertionError(f"vgpu-ctl {' '.join(map(str, args))} -> {out.returncode}\n{out.stdout}{out.stderr}")
        return out

    def ctl_json(self, *args):
        return json.loads(self.ctl(*args, "--json").stdout)

    def fails(self, code, *args):
        """vgpu-ctl ARGS exits `code` with one line on stderr: that line."""
        out = self.ctl(*args, ok=False)
        assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: ") and "; hint: " in lines[0], out.stderr
        return lines[0]

    def nvml_view(self):
        return nvml(INSTANCES, self.env)

    def slice_env(self, name):
        """The environment `vgpu-ctl env NAME` gives a program on this host."""
        return {**self.env, **self.ctl_json("env", name)["variables"]}


class Workload(JsonChild):
    def __init__(self, env):
        super().__init__(WORKLOAD, env, "workload")
        self.info = self.read(60)
        self.pid = self.info["pid"]


@pytest.fixture
def node(tmp_path):
    counter = iter(range(100))
    return lambda profile, **kw: Node(tmp_path / f"n{next(counter)}", profile, **kw)


@pytest.fixture
def workloads():
    started = []

    def start(env):
        started.append(Workload(env))
        return started[-1]

    yield start
    for w in started:
        w.kill()


def hex_of(uuid):
    return uuid[4:].replace("-", "")


# === mig profiles ===

@pytest.mark.parametrize("profile", ["a100-40g", "h100-80g", "h200"])
def test_mig_profiles_lists_the_published_table_with_placements(node, profile):
    n = node(profile)
    table = n.ctl_json("mig", "profiles")
    assert table["mig_mode"] == [0, 0] and table["instances"] == []
    want = {pid: (name, slices, inst, sms, ce, dec, enc, jpeg, ofa, mib)
            for pid, name, slices, inst, sms, ce, dec, enc, jpeg, ofa, mib in PROFILES[profile].values()}
    got = {p["id"]: (p["name"], p["slices"], p["instances"], p["multiprocessors"], p["copy_engines"], p["decoders"],
                     p["encoders"], p["jpeg"], p["ofa"], p["memory_mib"]) for p in table["profiles"]}
    assert got == want
    for p in table["profiles"]:
        starts, size = PLACEMENTS[p["id"]]
        assert p["placements"] == [[s, size] for s in starts]
        assert p["free"] is None          # remaining capacity is NOT_SUPPORTED while MIG mode is off
    text = n.ctl("mig", "profiles").stdout.splitlines()
    assert text[0].startswith("GPU 0: NVIDIA ") and text[0].endswith("MIG mode off")
    assert text[1].split() == ["GPU", "NAME", "ID", "FREE/TOTAL", "MEMORY", "SM", "CE", "DEC", "ENC", "JPEG", "OFA",
                               "P2P", "PLACEMENTS"]
    rows = [line.split() for line in text[2:2 + len(want)]]
    # as nvidia-smi mig -lgip orders them: by compute slices, then memory
    assert [r[:2] for r in rows] == [["0", "MIG"]] * len(want)
    assert [r[2] for r in rows] == [p["name"] for p in sorted(table["profiles"],
                                                              key=lambda p: (p["slices"], p["memory_mib"], p["name"]))]
    three_g = next(r for r in rows if r[2] == THREE_G[profile][0])
    assert three_g[3:6] == ["9", "-/2", f"{THREE_G[profile][1] / 1024:.2f}GiB"] and three_g[-1] == "{0,4}:4"
    assert "MIG mode is off" in text[-1]


def test_mig_profiles_after_a_create_counts_free_instances_and_names_the_slice(node):
    n = node("a100-40g")
    n.ctl("create", "big", "--mig", "4g.20gb")
    table = n.ctl_json("mig", "profiles")
    free = {p["name"]: p["free"] for p in table["profiles"]}
    # one 4g.20gb at 0:4 leaves the 1g.5gb at 4, 5, 6 (the -lgip capture: 7/7 -> 3/7), one 2g.10gb, no 7g
    assert (free["1g.5gb"], free["2g.10gb"], free["3g.20gb"], free["4g.20gb"], free["7g.40gb"]) == (3, 1, 1, 0, 0)
    assert table["instances"] == [{"id": 2, "profile_id": 5, "profile": "4g.20gb", "start": 0, "size": 4,
                                   "slice": "big"}]
    text = n.ctl("mig", "profiles").stdout
    assert "\n2             4g.20gb  0:4        big\n" in text + "\n"


def test_a_gpu_without_mig_and_bad_devices_are_one_line_errors(node):
    n = node("a10")
    line = n.fails(1, "mig", "profiles")
    assert "device 0 (NVIDIA A10) does not support MIG" in line and "software slice" in line
    line = n.fails(1, "create", "t", "--mig", "1g.5gb")
    assert "does not support MIG" in line
    assert "device 3 does not exist (this node has 1)" in n.fails(2, "mig", "profiles", "--device", "3")
    assert not n.dir.exists() or not (n.dir / "t").exists()


# === create and delete ===

@pytest.mark.parametrize("profile", ["a100-40g", "h100-80g", "h200"])
def test_create_makes_the_instance_and_delete_destroys_it(node, profile):
    n = node(profile)
    name, mib, sms = THREE_G[profile]
    out = n.ctl("create", "tenant", "--mig", name).stdout.splitlines()
    assert out[0] == "created tenant" and out[1] == "  device 0: MIG mode turned on"
    assert out[2].startswith(f"  device 0: MIG {name} at 0:4 (GPU instance 2, compute instance 0), ")
    rec = n.ctl_json("list")[0]["mig"]
    seen = n.nvml_view()
    # NVML, from another process: MIG on, GI 2 (the ID an A100 gives 0:4) of profile 9 with its CI 0
    assert seen == {"mode": [1, 1], "gis": [[2, 9, 0, 4, [0]]], "uuids": [rec["uuid"]]}
    assert (rec["profile"], rec["profile_id"], rec["gpu_instance"], rec["compute_instance"], rec["placement"],
            rec["memory_total"], rec["multiprocessors"], rec["enabled_mig_mode"]) == \
        (name, 9, 2, 0, {"start": 0, "size": 4}, mib * MiB, sms, True)
    listed = n.ctl("list").stdout.splitlines()
    assert listed[0].split() == ["NAME", "DEVICE", "MIG", "MEMORY", "REQUEST", "LIMIT", "SM", "SM-REQUEST", "SM-LIMIT",
                                 "SM-MODE", "PROCESSES", "GEN"]
    assert listed[1].split() == ["tenant", "0", name, "at", "0:4", "max", "max", "max", "100%", "100%", "100%", "burst",
                                 "0", "2"]

    out = n.ctl("delete", "tenant").stdout.splitlines()
    assert out == ["deleted tenant", f"  destroyed MIG {name} at 0:4 (GPU instance 2) on device 0"]
    assert n.nvml_view() == {"mode": [1, 1], "gis": [], "uuids": []}   # MIG mode left as it is
    assert not (n.dir / "tenant").exists()

    n.ctl("create", "again", "--mig", name, "--placement", "4")
    assert n.nvml_view()["gis"] == [[1, 9, 4, 4, [0]]]
    out = n.ctl("delete", "again", "--disable-mig").stdout.splitlines()
    assert out[-1] == "  device 0: MIG mode turned off"
    assert n.nvml_view() == {"mode": [0, 0], "gis": [], "uuids": []}


def test_mig_mode_is_refused_while_a_process_holds_a_context(node):
    n = node("h100-80g")
    proc = holder(n.env)
    try:
        line = n.fails(1, "create", "tenant", "--mig", "3g.40gb")
        seen = n.nvml_view()
    finally:
        release(proc)
    assert f"device 0 has 1 process(es) on it (pid {proc.pid})" in line and "idle" in line
    assert seen["mode"] == [0, 0]          # nothing left pending
    assert not (n.dir / "tenant").exists()
    n.ctl("create", "tenant", "--mig", "3g.40gb")   # once the GPU is idle
    assert n.nvml_view()["mode"] == [1, 1]


def test_two_mig_slices_side_by_side_each_sees_its_own_instance(node, workloads):
    n = node("h100-80g")
    n.ctl("create", "a", "--mig", "3g.40gb")
    n.ctl("create", "b", "--mig", "3g.40gb")
    recs = {c["name"]: c["mig"] for c in n.ctl_json("list")}
    assert (recs["a"]["placement"], recs["b"]["placement"]) == ({"start": 0, "size": 4}, {"start": 4, "size": 4})
    assert recs["a"]["uuid"] != recs["b"]["uuid"]
    wa, wb = workloads(n.slice_env("a")), workloads(n.slice_env("b"))
    for w, name in ((wa, "a"), (wb, "b")):
        assert (w.info["count"], w.info["uuid"], w.info["total"]) == (1, hex_of(recs[name]["uuid"]), 40448 * MiB)
    assert wa.call("alloc", 30 * GiB) == SUCCESS
    assert wb.call("alloc", 30 * GiB) == SUCCESS       # the other instance's memory is its own
    assert wb.call("alloc", 10 * GiB) == OUT_OF_MEMORY  # ... and bounded by it
    status = n.ctl_json("status")
    migs = {c["name"]: c["mig"] for c in status["slices"]}
    assert migs["a"]["memory_used"] == 30 * GiB and [p["host_pid"] for p in migs["a"]["processes"]] == [wa.pid]
    assert migs["b"]["memory_used"] == 30 * GiB and [p["host_pid"] for p in migs["b"]["processes"]] == [wb.pid]
    assert [d.get("mig_slices") for d in status["devices"]] == [2]
    text = n.ctl("status").stdout
    assert "MIG-SLICE  DEVICE  PROFILE  PLACEMENT  GI  CI  MEMORY-USED  PROCESSES  UUID" in text
    assert f"a          0       3g.40gb  0:4        2   0   30Gi/39.5Gi  1          {recs['a']['uuid']}" in text
    # no room for a third, at any placement or a given one; a placement the profile lacks
    line = n.fails(1, "create", "c", "--mig", "3g.40gb")
    assert "no room for 3g.40gb on device 0 at any placement" in line and "GPU instance 2 (3g.40gb) at 0:4" in line
    assert "at placement 4" in n.fails(1, "create", "c", "--mig", "1g.10gb", "--placement", "4")
    assert "placement 2 is not one of 3g.40gb's on device 0 ({0,4}:4" in \
        n.fails(2, "create", "c", "--mig", "3g.40gb", "--placement", "2")
    line = n.fails(2, "create", "c", "--mig", "3g.20gb")
    assert "has no MIG profile '3g.20gb' (it has 1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb" in line
    assert "vgpu-ctl mig profiles" in line
    assert sorted(c["name"] for c in n.ctl_json("list")) == ["a", "b"]
    assert len(n.nvml_view()["gis"]) == 2   # the failed creates left nothing behind


def test_env_exposes_only_the_instance_and_cuda_sees_it_as_device_0(node, workloads):
    n = node("h200", devices=2)
    n.ctl("create", "t", "--mig", "3g.71gb", "--device", "1")
    (entry,) = n.ctl_json("list")
    rec = entry["mig"]
    assert (rec["device"], [d["index"] for d in entry["devices"]]) == (1, [0])   # the quota's device 0: the instance
    v = n.ctl_json("env", "t")
    assert v["variables"]["CUDA_VISIBLE_DEVICES"] == v["variables"]["NVIDIA_VISIBLE_DEVICES"] == rec["uuid"]
    docker = v["docker"]
    assert docker[:2] == ["--gpus", f"device={rec['uuid']}"] and f"CUDA_VISIBLE_DEVICES={rec['uuid']}" in docker
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": rec["uuid"]} in v["k8s"]["env"]
    shell = n.ctl("env", "t").stdout
    assert f"export CUDA_VISIBLE_DEVICES={rec['uuid']}\n" in shell
    w = workloads(n.slice_env("t"))
    assert w.info == {**w.info, "count": 1, "name": "NVIDIA H200 MIG 3g.71gb", "uuid": hex_of(rec["uuid"]),
                      "total": 71424 * MiB, "device_total": 71424 * MiB, "sms": 60}
    # `run --name` gives its command the same device
    out = n.ctl("run", "--name", "t", "--", sys.executable, "-c",
                "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])").stdout
    assert out.strip() == rec["uuid"]


def test_a_software_slice_inside_an_instance_is_capped_within_it(node, workloads):
    n = node("a100-40g")
    assert "would overcommit it" in n.fails(1, "create", "t", "--mig", "3g.20gb", "--memory", "30Gi")
    out = n.ctl("create", "t", "--mig", "3g.20gb", "--memory", "4Gi", "--sm", "50%").stdout
    assert "  in the instance: memory.max 4Gi (request 4Gi, limit 4Gi), sm.max 50%" in out
    w = workloads(n.slice_env("t"))
    assert (w.info["total"], w.info["device_total"], w.info["name"]) == \
        (4 * GiB, 4 * GiB, "NVIDIA A100-SXM4-40GB MIG 3g.20gb")
    assert w.call("alloc", 3 * GiB) == SUCCESS
    assert w.call("alloc", 2 * GiB) == OUT_OF_MEMORY      # the shim's cap, well inside the 19.6 GiB instance
    uuid, total, used = w.call("nvml")
    assert (uuid, total, used) == (n.ctl_json("list")[0]["mig"]["uuid"], 4 * GiB, 3 * GiB)   # its MIG handle
    (c,) = n.ctl_json("status")["slices"]
    (d,) = c["devices"]
    assert (d["index"], d["gpu"], d["memory_max"], d["memory_current"], d["memory_driver"], d["sm_used"]) == \
        (0, 0, 4 * GiB, 3 * GiB, 3 * GiB, None)   # no utilization on a MIG GPU
    assert [(p["host_pid"], p["sm_util"]) for p in c["processes"]] == [(w.pid, None)]
    # resized live, within the instance
    assert "would overcommit it" in n.fails(1, "resize", "t", "--memory", "25Gi")
    n.ctl("resize", "t", "--memory", "8Gi")
    assert w.call("alloc", 2 * GiB) == SUCCESS
    # delete waits for its process
    assert "has 1 live process(es)" in n.fails(1, "delete", "t")
    w.kill()
    n.ctl("delete", "t")
    assert n.nvml_view()["gis"] == []


def test_delete_is_refused_while_a_process_outside_the_shim_uses_the_instance(node):
    n = node("a100-40g")
    n.ctl("create", "t", "--mig", "1g.5gb")
    uuid = n.ctl_json("list")[0]["mig"]["uuid"]
    proc = holder(dict(n.env, CUDA_VISIBLE_DEVICES=uuid), allocate=64 * MiB)   # no shim: no slot in the slice
    try:
        line = n.fails(1, "delete", "t")
        assert f"GPU instance 11 (1g.5gb at 0:1) on device 0 is in use (pid {proc.pid})" in line
        assert [c["name"] for c in n.ctl_json("list")] == ["t"]   # nothing deleted
        out = n.ctl("delete", "t", "--force")
        assert "the instance is left in place; destroy it by hand" in out.stderr
        assert n.nvml_view()["gis"] == [[11, 19, 0, 1, [0]]]
    finally:
        release(proc)


# === MIG and software slices on one node ===

def test_software_slices_and_mig_mode_do_not_share_a_gpu(node):
    n = node("h100-80g", devices=2)
    n.ctl("create", "soft", "--memory", "4Gi", "--device", "0")
    line = n.fails(1, "create", "t", "--mig", "3g.40gb", "--device", "0")
    assert "device 0 holds software slices (soft)" in line
    assert n.nvml_view()["mode"] == [0, 0]
    n.ctl("create", "t", "--mig", "3g.40gb", "--device", "1")
    line = n.fails(1, "create", "soft2", "--memory", "4Gi", "--device", "1")
    assert "device 1 is in MIG mode" in line and "--mig PROFILE" in line
    # the MIG slice's quota device 0 is its instance: not counted against GPU 0
    n.ctl("create", "soft3", "--memory", "76Gi", "--device", "0")
    assert "--device" in n.fails(2, "create", "x", "--mig", "1g.10gb", "--device", "0", "--device", "1")
    assert "--placement needs --mig" in n.fails(2, "create", "x", "--placement", "0")
    assert "is a software slice" in n.fails(2, "delete", "soft", "--disable-mig")


def test_apply_and_export_leave_mig_slices_alone(node, tmp_path):
    n = node("h100-80g")
    n.ctl("create", "t", "--mig", "1g.10gb")
    text = n.ctl("export").stdout
    assert "# t: a MIG slice, left out" in text and "slices: {}" in text
    empty = tmp_path / "empty.yaml"
    empty.write_text("slices: {}\n")
    out = n.ctl("apply", "-f", empty, "--prune").stdout
    assert "nothing to change" in out and [c["name"] for c in n.ctl_json("list")] == ["t"]
    named = tmp_path / "named.yaml"
    named.write_text("slices:\n  t:\n    memory: 1Gi\n")
    assert "t is a MIG slice" in n.fails(2, "apply", "-f", named)
    assert len(n.nvml_view()["gis"]) == 1


def test_an_instance_destroyed_by_hand_is_reported_and_another_in_its_place_is_never_touched(node):
    n = node("a100-40g")
    n.ctl("create", "t", "--mig", "3g.20gb")      # GPU instance 2 at 0:4
    # someone destroys it with the driver's tools and makes a 4g.20gb there: GPU instance 2 again
    nvml("""
gi = n.nvmlDeviceGetGpuInstanceById(h, 2)
n.nvmlComputeInstanceDestroy(n.nvmlGpuInstanceGetComputeInstanceById(gi, 0))
n.nvmlGpuInstanceDestroy(gi)
n.nvmlDeviceCreateGpuInstance(h, 5)
print(json.dumps(0))
""", n.env)
    assert n.nvml_view()["gis"] == [[2, 5, 0, 4, []]]
    (c,) = n.ctl_json("status")["slices"]
    assert c["mig"]["present"] is False
    assert "t          0       3g.20gb  0:4        2   0   instance not found" in n.ctl("status").stdout
    out = n.ctl("delete", "t")
    assert out.stdout == "deleted t\n"
    assert "GPU instance 2 (3g.20gb at 0:4) on device 0 is gone already" in out.stderr
    assert n.nvml_view()["gis"] == [[2, 5, 0, 4, []]]     # the other instance is left as it is


def test_a_create_that_fails_after_the_instance_was_made_destroys_it_and_puts_mig_mode_back(node):
    n = node("h200")
    n.dir.mkdir()
    (n.dir / "t").symlink_to(n.dir.parent)     # the slice's files cannot be made there
    line = n.fails(1, "create", "t", "--mig", "1g.18gb")
    assert "symbolic link" in line
    assert n.nvml_view() == {"mode": [0, 0], "gis": [], "uuids": []}


# === what simgpu does not model: a GPU that enters MIG mode only after a reset ===

class PendingGpu:
    """The NVML calls `create --mig` makes before it would create anything, answered as
    an A100 does when MIG mode needs a reset: SetMigMode succeeds, the mode stays pending
    (nvml.h: the mode is "pending" until the next activation trigger)."""
    NVML_SUCCESS, NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT = 0, 3, 2
    NVML_ERROR_IN_USE, NVML_ERROR_NO_PERMISSION, NVML_DEVICE_MIG_ENABLE, NVML_DEVICE_MIG_DISABLE = 19, 4, 1, 0

    class NVMLError(Exception):
        def __init__(self, value):
            self.value = value

    class c_nvmlGpuInstancePlacement_t:
        def __init__(self):
            self.start, self.size = 0, 0

    def __init__(self):
        self.mode, self.calls = [0, 0], []

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return "gpu0"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return "gpu0"

    def nvmlDeviceGetName(self, h):
        return "NVIDIA A100-SXM4-40GB"

    def nvmlDeviceGetUUID(self, h):
        return "GPU-0"

    def nvmlDeviceGetMigMode(self, h):
        return list(self.mode)

    busy = False      # a process came between the check of the GPU's processes and the call

    def nvmlDeviceSetMigMode(self, h, mode):
        self.calls.append(("SetMigMode", mode))
        self.mode[1] = mode
        return self.NVML_ERROR_IN_USE if self.busy else self.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h, index):
        if index:
            raise self.NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        from types import SimpleNamespace
        return SimpleNamespace(name="MIG 1g.5gb", id=19, sliceCount=1, instanceCount=7, memorySizeMB=4864,
                               multiprocessorCount=14, copyEngineCount=1, decoderCount=0, encoderCount=0,
                               jpegCount=0, ofaCount=0, isP2pSupported=0)

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, h, pid, placements, count):
        raise self.NVMLError(self.NVML_ERROR_NO_PERMISSION)   # privileged: the table shows none

    def __getattr__(self, name):   # anything else would be creating an instance
        raise AssertionError(f"{name} called on a GPU whose MIG mode is pending")


def test_a_gpu_that_needs_a_reset_is_left_pending_and_nothing_is_created(monkeypatch, tmp_path):
    from vgpu import mig, nvml as vnvml, slices
    fake = PendingGpu()
    monkeypatch.setattr(vnvml, "_nvml", lambda: fake)
    monkeypatch.setattr(vnvml, "running_processes", lambda index: {})
    with pytest.raises(slices.VgpuError) as e:
        mig.create_slice(tmp_path, "t", 0, "1g.5gb", slices.device_quota())
    assert str(e.value) == "MIG mode is pending on device 0: this GPU enters it after a reset"
    assert e.value.hint == "reset the GPU while it is idle (nvidia-smi -r -i 0), then create the slice again"
    assert fake.calls == [("SetMigMode", 1)] and fake.mode == [0, 1]
    assert slices.list_names(tmp_path) == []
    with pytest.raises(slices.VgpuError, match="does not say where 1g.5gb can go"):
        mig.check_profile(0, "1g.5gb", placement=0)


def test_an_in_use_activation_status_is_refused_and_the_request_withdrawn(monkeypatch, tmp_path):
    from vgpu import mig, nvml as vnvml, slices
    fake = PendingGpu()
    fake.busy = True
    monkeypatch.setattr(vnvml, "_nvml", lambda: fake)
    monkeypatch.setattr(vnvml, "running_processes", lambda index: {})
    with pytest.raises(slices.Busy, match="device 0 is in use: MIG mode can only be turned on while the GPU is idle"):
        mig.create_slice(tmp_path, "t", 0, "1g.5gb", slices.device_quota())
    assert fake.calls == [("SetMigMode", 1), ("SetMigMode", 0)] and fake.mode == [0, 0]   # nothing left pending
