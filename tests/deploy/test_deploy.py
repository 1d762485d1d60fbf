"""Kubernetes and docker artefacts: deploy/daemonset.yaml, `env --format k8s|docker` with
an installed shim, and the runbook's examples (docs/containers.md), checked against each other
and against the fields and types the API server accepts (tests/helpers/k8s/schema.py).
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.helpers.k8s import schema as k8s_schema
from tests.helpers.paths import ROOT
from vgpu import cli
from vgpu.runtime import CONTAINER_SHIM

yaml = pytest.importorskip("yaml")
DAEMONSET = ROOT / "deploy" / "daemonset.yaml"
CTL = str(Path(sys.executable).parent / "vgpu-ctl")
GiB = 1 << 30


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A node directory with slices train (16Gi) and infer (6Gi) and the shim installed
    (with its ld.so.preload); NVML is a fake 24 GiB device (the pytest process must not
    load a real or simulated one)."""
    monkeypatch.setattr(cli.common, "nvml_capacity", lambda d: 24 * GiB if d == 0 else None)
    monkeypatch.setattr(cli.common, "nvml_count_hint", lambda: "")
    directory, shim_dir = tmp_path / "run-vgpu", tmp_path / "opt-vgpu"

    def ctl(*args):
        r = CliRunner().invoke(cli.main, [*map(str, args)])
        assert r.exit_code == 0, r.output
        return r.stdout

    ctl("install-shim", shim_dir, "--preload-file")
    ctl("create", "train", "--memory", "16Gi", "--sm", "60%", "--dir", directory)
    ctl("create", "infer", "--memory", "6Gi", "--sm", "30%", "--dir", directory)

    def env(name, fmt, *extra):
        """`vgpu-ctl env` with this node's paths shown as the runbook's (/run/vgpu, /opt/vgpu)."""
        out = ctl("env", name, "--format", fmt, "--dir", directory, "--shim-dir", shim_dir, *extra)
        return out.replace(str(directory), "/run/vgpu").replace(str(shim_dir), "/opt/vgpu")

    env.ctl, env.dir, env.shim_dir = ctl, directory, shim_dir
    return env


def pod_around(name, fragment):
    """The fragment `env --format k8s` prints, placed in a pod the way the runbook says."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": name, "image": "my-image", "env": fragment["env"],
                                     "volumeMounts": fragment["volumeMounts"]}],
                     "volumes": fragment["volumes"]}}


# === env --format k8s / docker with an installed shim ===

def test_env_k8s_with_an_installed_shim_makes_a_valid_pod(node):
    fragment = yaml.safe_load(node("train", "k8s"))
    k8s_schema.manifest(pod_around("train", fragment))
    mounts = {m["name"]: (m["mountPath"], m["readOnly"]) for m in fragment["volumeMounts"]}
    assert mounts == {"vgpu-shim": (CONTAINER_SHIM, True), "vgpu-train-quota": ("/run/vgpu/train/quota", True),
                      "vgpu-train-usage": ("/run/vgpu/train/usage", False),
                      "vgpu-train-slice": ("/run/vgpu/.slice", True),
                      "vgpu-sm-board": ("/run/vgpu/.sm-board", False)}
    assert {v["name"]: v["hostPath"]["path"] for v in fragment["volumes"]}["vgpu-shim"] == "/opt/vgpu/libvgpu.so"
    assert {e["name"]: e["value"] for e in fragment["env"]}["LD_PRELOAD"] == CONTAINER_SHIM


def test_two_slices_fit_in_one_pod_whatever_their_names(node):
    """Containers of one pod in different slices: their volumes merge without a clash, and
    names that are not DNS labels (capitals, '_', '.', 63 characters) still give valid ones."""
    odd = ["Train_A.v2", "train-a-v2", "x" * 40 + "_" + "y" * 22]
    for name in odd:
        node.ctl("create", name, "--memory", "1Gi", "--dir", node.dir, "--overcommit")
    fragments = {n: yaml.safe_load(node(n, "k8s")) for n in ["train", *odd]}
    volumes = {}
    for f in fragments.values():
        for v in f["volumes"]:
            assert volumes.setdefault(v["name"], v) == v, f"two different volumes named {v['name']}"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "many"},
           "spec": {"containers": [{"name": f"c{i}", "image": "my-image", "env": f["env"],
                                    "volumeMounts": f["volumeMounts"]} for i, f in enumerate(fragments.values())],
                    "volumes": list(volumes.values())}}
    k8s_schema.manifest(pod)                      # every volume name a DNS-1123 label
    assert len(volumes) == 2 + 3 * len(fragments)  # one shim and one board; a quota, a usage and an identity per slice


def test_env_k8s_with_ld_so_preload_mounts_it_read_only_and_leaves_ld_preload_alone(node):
    fragment = yaml.safe_load(node("infer", "k8s", "--ld-so-preload"))
    k8s_schema.manifest(pod_around("infer", fragment))
    mounts = {m["name"]: (m["mountPath"], m["readOnly"]) for m in fragment["volumeMounts"]}
    assert mounts["vgpu-preload"] == ("/etc/ld.so.preload", True)
    assert {v["name"]: v["hostPath"] for v in fragment["volumes"]}["vgpu-preload"] == {
        "path": "/opt/vgpu/ld.so.preload", "type": "File"}
    assert [e["name"] for e in fragment["env"]] == ["VGPU_DIR", "VGPU_SLICE", "VGPU_CONTAINER", "CUDA_DEVICE_ORDER"]


def test_env_docker_with_ld_so_preload(node):
    args = node("infer", "docker", "--ld-so-preload").split()
    assert [args[i + 1] for i, a in enumerate(args) if a == "-v"] == [
        f"/opt/vgpu/libvgpu.so:{CONTAINER_SHIM}:ro", "/run/vgpu/infer/quota:/run/vgpu/infer/quota:ro",
        "/run/vgpu/infer/usage:/run/vgpu/infer/usage:rw", "/run/vgpu/infer/identity:/run/vgpu/.slice:ro",
        "/run/vgpu/.sm-board:/run/vgpu/.sm-board:rw", "/opt/vgpu/ld.so.preload:/etc/ld.so.preload:ro"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "-e"] == [
        "VGPU_DIR=/run/vgpu", "VGPU_SLICE=infer", "VGPU_CONTAINER=infer", "CUDA_DEVICE_ORDER=PCI_BUS_ID"]


def test_env_json_carries_the_installed_shim_too(node):
    data = json.loads(node("train", "json", "--ld-so-preload"))
    assert data["variables"]["LD_PRELOAD"] == "/opt/vgpu/libvgpu.so"     # for this host's shell
    assert "-e" in data["docker"] and "/opt/vgpu/ld.so.preload:/etc/ld.so.preload:ro" in data["docker"]
    assert [v["name"] for v in data["k8s"]["volumes"]][-1] == "vgpu-preload"


def invoke(*args):
    return CliRunner().invoke(cli.main, [*map(str, args)])


def test_env_shim_dir_errors(node, tmp_path):
    d = ["--dir", node.dir]
    r = invoke("env", "train", "--ld-so-preload", "--format", "docker", *d)
    assert r.exit_code == 2 and "--ld-so-preload needs --shim-dir" in r.stderr
    r = invoke("env", "train", "--ld-so-preload", "--shim-dir", node.shim_dir, *d)      # shell format
    assert r.exit_code == 2 and "is for containers" in r.stderr
    r = invoke("env", "train", "--shim-dir", tmp_path / "empty", *d)
    assert r.exit_code == 1 and "hint: vgpu-ctl install-shim" in r.stderr
    bare = tmp_path / "bare"
    node.ctl("install-shim", bare)                                                      # no --preload-file
    r = invoke("env", "train", "--format", "k8s", "--ld-so-preload", "--shim-dir", bare, *d)
    assert r.exit_code == 1 and r.stderr.strip().endswith(f"install-shim {bare} --preload-file")
    (bare / "ld.so.preload").write_text("/somewhere/else.so\n")
    r = invoke("env", "train", "--format", "k8s", "--ld-so-preload", "--shim-dir", bare, *d)
    assert r.exit_code == 1 and f"does not name {CONTAINER_SHIM}" in r.stderr


def test_env_takes_the_shim_dir_from_the_environment(node, monkeypatch):
    monkeypatch.setenv("VGPU_SHIM_DIR", str(node.shim_dir))
    r = invoke("env", "train", "--format", "docker", "--dir", node.dir)
    assert f"{node.shim_dir}/libvgpu.so:{CONTAINER_SHIM}:ro" in r.stdout.split()


# === the runbook's examples ===

def runbook():
    text = (ROOT / "docs" / "containers.md").read_text()
    start = text.index("## Running in containers: the runbook")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_runbook_pod_is_valid_and_is_what_env_prints(node):
    (block,) = re.findall(r"```yaml\n(.*?)```", runbook(), re.S)
    pod = yaml.safe_load(block)
    k8s_schema.manifest(pod)
    (container,) = pod["spec"]["containers"]
    fragment = yaml.safe_load(node("train", "k8s"))
    extra = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]   # the runbook's addition: all GPUs
    assert container["env"] == fragment["env"] + extra
    assert container["volumeMounts"] == fragment["volumeMounts"]
    assert pod["spec"]["volumes"] == fragment["volumes"]


def test_runbook_docker_flags_are_what_env_prints(node):
    text = runbook()
    m = re.search(r"\$ vgpu-ctl env train --format docker +# one line; wrapped here\n(.*?)\n\$ ", text, re.S)
    assert m.group(1).split() == node("train", "docker").split()


def test_runbook_install_output_is_what_install_shim_prints(node):
    m = re.search(r"install-shim /opt/vgpu --preload-file\n((?:installed|hint).*\n)+", runbook())
    shown = [re.sub(r"\(\d+ bytes, sha256 [0-9a-f]+\)", "(N)", line) for line in m.group(0).splitlines()[1:]]
    printed = CliRunner().invoke(cli.main, ["install-shim", str(node.shim_dir.parent / "fresh"), "--preload-file"])
    got = [re.sub(r"\(\d+ bytes, sha256 [0-9a-f]+\)", "(N)", line).replace(str(node.shim_dir.parent / "fresh"),
                                                                           "/opt/vgpu")
           for line in printed.stdout.splitlines()]
    assert shown == got


# === deploy/daemonset.yaml ===

@pytest.fixture(scope="module")
def daemonset():
    docs = list(yaml.safe_load_all(DAEMONSET.read_text()))
    for doc in docs:
        k8s_schema.manifest(doc)
    assert [d["kind"] for d in docs] == ["Namespace", "DaemonSet"]
    assert docs[1]["metadata"]["namespace"] == docs[0]["metadata"]["name"]
    return docs[1]


def containers(ds):
    spec = ds["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def test_daemonset_installs_the_shim_first_and_mounts_host_paths_at_the_same_paths(daemonset):
    spec = daemonset["spec"]["template"]["spec"]
    c = containers(daemonset)
    assert [i["name"] for i in spec["initContainers"]] == ["install-shim"]
    assert c["install-shim"]["args"] == ["install-shim", "/opt/vgpu", "--preload-file"]
    volumes = {v["name"]: v["hostPath"] for v in spec["volumes"]}
    assert volumes == {"vgpu-dir": {"path": "/run/vgpu", "type": "DirectoryOrCreate"},
                       "shim-dir": {"path": "/opt/vgpu", "type": "DirectoryOrCreate"}}
    for container in c.values():      # host path == path inside: what `env` prints is true on the host
        for m in container["volumeMounts"]:
            assert m["mountPath"] == volumes[m["name"]]["path"]
    agent = c["agent"]
    env = {e["name"]: e["value"] for e in agent["env"]}
    assert env["VGPU_DIR"] == "/run/vgpu" and env["VGPU_SHIM_DIR"] == "/opt/vgpu"
    assert {m["name"]: m.get("readOnly", False) for m in agent["volumeMounts"]} == {"vgpu-dir": False,
                                                                                   "shim-dir": True}
    assert {m["name"]: m.get("readOnly", False) for m in c["install-shim"]["volumeMounts"]} == {"shim-dir": False}
    assert len({x["image"] for x in c.values()}) == 1
    assert agent["args"] == ["agent", "--autoscale", "--metrics-port", "9400"]
    assert agent["ports"] == [{"name": "metrics", "containerPort": 9400}]


def test_daemonset_asks_for_no_more_privilege_than_it_needs(daemonset):
    spec = daemonset["spec"]["template"]["spec"]
    # the node agent sees the GPU's processes by their host pids, and reads other users'
    # /proc/<pid>/maps and /proc/<pid>/root (SYS_PTRACE); it acts on none by default (no KILL)
    assert spec["hostPID"] is True and spec.get("automountServiceAccountToken") is False
    for name, c in containers(daemonset).items():
        sc = c["securityContext"]
        assert sc.get("privileged", False) is False, name
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, name
        assert sc["capabilities"]["drop"] == ["ALL"], name
        assert set(sc["capabilities"].get("add", [])) <= ({"CHOWN", "SYS_PTRACE"} if name == "agent" else set()), name


def test_daemonset_commands_run(daemonset, tmp_path):
    c = containers(daemonset)
    # the init container's command, into a stand-in for the host's /opt/vgpu
    args = [a.replace("/opt/vgpu", str(tmp_path / "opt-vgpu")) for a in c["install-shim"]["args"]]
    r = CliRunner().invoke(cli.main, args)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "opt-vgpu" / "ld.so.preload").read_text() == CONTAINER_SHIM + "\n"
    # the agent's command, for one look (a free port for its metrics; no NVML here)
    env = {"PATH": "/usr/bin:/bin", "VGPU_DIR": str(tmp_path / "run-vgpu")}
    (tmp_path / "run-vgpu").mkdir()
    args = [a if a != "9400" else "0" for a in c["agent"]["args"]]
    out = subprocess.run([CTL, *args, "--once", "--window", "1s", "--interval", "0.2s"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [json.loads(line)["event"] for line in out.stdout.splitlines()] == ["start", "nvml", "stopped"]


def test_the_schema_check_catches_what_kubectl_would_reject():
    pod = pod_around("p", {"env": [{"name": "A", "value": "1"}], "volumeMounts": [], "volumes": []})
    k8s_schema.manifest(pod)
    for breakage, message in [
        (lambda p: p["spec"]["containers"][0]["env"][0].update(value=1), "must be a string"),
        (lambda p: p["spec"]["containers"][0].update(volumeMounts=[{"name": "x", "mountPath": "/x"}]),
         "no volume named 'x'"),
        (lambda p: p["spec"].update(volumes=[{"name": "x", "hostPath": {"path": "/x", "type": "file"}}]),
         "bad type 'file'"),
        (lambda p: p["spec"]["containers"][0].update(volumeMount=[]), "unknown field(s) ['volumeMount']"),
    ]:
        broken = json.loads(json.dumps(pod))
        breakage(broken)
        with pytest.raises(k8s_schema.Invalid, match=re.escape(message)):
            k8s_schema.manifest(broken)
