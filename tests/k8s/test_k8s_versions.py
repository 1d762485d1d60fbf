"""The DRA driver by Kubernetes version: `vgpu-ctl k8s-plugin` (a real process on simgpu's
MIG-capable H100s) against the fake API server answering /version as 1.34, 1.35, 1.36.x or
1.37 and validating slices by that release's rules (tests/helpers/k8s/fake_api.py), and the
scheduler stand-in at the same version (tests/helpers/k8s/controllers.py).

What is checked: the layout each version reads (1.34: a slice per GPU, its counter set
beside its devices; 1.35+: counter sets apart); where MIG beside software slices is unsafe
(up to 1.36.1) each GPU offers one or the other, as --mig-gpus says, and the log says so;
prepare never makes a MIG instance on a GPU that serves software slices.
"""
import pytest

from tests.helpers.k8s.controllers import Unschedulable, instantiate_claims, schedule_pod
from tests.helpers.k8s.fake_api import FakeApiServer, _validate_slice_spec
from tests.helpers.k8s.node import DRIVER, NODE, NS, Node
from tests.helpers.simnode import make_sim_env
from tests.k8s.test_k8s_mig import CLASSES, EXAMPLE, devices_of, mig_claim, nvml_state, pod_with_template, pool
from vgpu.k8s import resourceslice, versions

SOFT = {"deviceClassName": "gpu.vgpu.dev", "capacity": {"requests": {"memory": "4Gi"}}}


def node_at(tmp_path, version, devices=2, profile="h100-80g"):
    api = FakeApiServer(version=version).start()
    node = Node(tmp_path, api, make_sim_env(tmp_path / "simgpu", profile=profile, devices=devices))
    return api, node


def scheduled(node, name, exactly, version):
    """A pod `pod-<name>` asking `exactly`, through the resourceclaim controller and the
    scheduler of `version`: its one claim's (device, (namespace, uid, name))."""
    pod_with_template(node.api, name, exactly)
    instantiate_claims(node.api, NS, f"pod-{name}")
    [claim] = schedule_pod(node.api, NS, f"pod-{name}", CLASSES, version=version)
    [result] = claim["status"]["allocation"]["devices"]["results"]
    return result["device"], (NS, claim["metadata"]["uid"], claim["metadata"]["name"])


@pytest.fixture
def nodes():
    made = []
    yield lambda *a, **kw: made.append(node_at(*a, **kw)) or made[-1][1]
    for api, node in made:
        node.close()
        api.stop()


def kinds(devices):
    """{gpu index: sorted kinds of device it offers}"""
    out = {}
    for name in devices:
        kind, index = resourceslice.parse_device(name)
        out.setdefault(index, set()).add(kind)
    return {i: sorted(k) for i, k in out.items()}


@pytest.mark.parametrize("text, parsed", [("v1.35.2", (1, 35, 2)), ("v1.36.0-gke.1200", (1, 36, 0)),
                                          ("1.34", (1, 34, 0)), ("", None), ("devel", None)])
def test_server_versions_parse_from_git_version(text, parsed):
    got = versions.parse(text)
    assert (got and (got.major, got.minor, got.patch)) == parsed or got is parsed


@pytest.mark.parametrize("version, apart, both", [
    ("v1.34.3", False, False), ("v1.35.2", True, False), ("v1.36.0", True, False), ("v1.36.1", True, False),
    ("v1.36.2", True, True), ("v1.37.0", True, True)])
def test_each_version_gets_the_layout_it_reads_and_gpus_mix_mig_and_slices_only_where_safe(
        nodes, tmp_path, version, apart, both):
    node = nodes(tmp_path, version)
    agent = node.start()
    slices = pool(node)
    said = agent.wait_for(lambda e: e["event"] == "kubernetes_version", "the version line")
    assert said["version"] == version[1:] and said["mig_beside_slices"] is both
    assert ("warning" in said) is not both
    if apart:        # 1.35+: counter sets in slices of their own
        assert all(not (s["spec"].get("sharedCounters") and s["spec"].get("devices")) for s in slices.values())
    else:            # 1.34: a slice per GPU, its counter set (if any) beside its devices
        assert sorted(slices) == [f"{NODE}-{DRIVER}-gpu-0", f"{NODE}-{DRIVER}-gpu-1"]
    v = versions.parse(version)
    for s in slices.values():   # and the server of that version took them (its validation)
        assert _validate_slice_spec(s["spec"], (v.major, v.minor)) == []
    offered = kinds(devices_of(slices))
    assert offered == ({0: ["gpu", "mig"], 1: ["gpu", "mig"]} if both else {0: ["gpu"], 1: ["gpu"]})


def test_mig_gpus_choose_which_gpus_serve_mig_where_a_gpu_must_choose(nodes, tmp_path):
    node = nodes(tmp_path, "v1.35.2")
    node.start("--mig-gpus", "1")
    slices = pool(node)
    assert kinds(devices_of(slices)) == {0: ["gpu"], 1: ["mig"]}
    # gpu-1's MIG devices still consume its counter set; gpu-0 publishes no counters at all
    sets = [cs["name"] for s in slices.values() for cs in s["spec"].get("sharedCounters") or []]
    assert sets == ["gpu-1"]


def test_the_layouts_are_refused_by_the_other_release(tmp_path):
    gpus = [resourceslice.Gpu(0, "NVIDIA H100 80GB HBM3", "GPU-0", 80 << 30, _h100_profiles(tmp_path))]
    apart = resourceslice.resource_slices(NODE, DRIVER, gpus, 1)
    together = resourceslice.resource_slices(NODE, DRIVER, gpus, 1, gpu_per_slice=True)
    [one] = together
    assert one["spec"]["sharedCounters"] and one["spec"]["devices"]
    assert any("only one of" in p for p in _validate_slice_spec(one["spec"], (1, 35)))
    device_slice = next(s for s in apart if s["spec"].get("devices"))
    assert any("must reference a counter set of this slice" in p
               for p in _validate_slice_spec(device_slice["spec"], (1, 34)))


def _h100_profiles(tmp_path):
    import json

    from tests.helpers.simnode import run_python
    out = run_python("from vgpu import mig; import json; print(json.dumps(mig.profiles(0)))",
                     make_sim_env(tmp_path / "simgpu-profiles", profile="h100-80g"))
    return tuple(resourceslice.MigProfile(p["name"], p["id"], p["slices"], p["memory_mib"] << 20,
                                          p["multiprocessors"], p["instances"], tuple(tuple(x) for x in p["placements"]))
                 for p in json.loads(out.stdout)["profiles"] if p["placements"])


def test_prepare_refuses_a_mig_instance_on_a_gpu_that_serves_software_slices(nodes, tmp_path):
    # what a 1.35 scheduler could allocate from a stale or mixed pool: refused, nothing made
    node = nodes(tmp_path, "v1.37.0", devices=1)
    node.start()
    pool(node)
    kubelet = node.kubelet()
    soft = node.claim("soft", results=[{"device": "gpu-0", "memory": "4Gi", "sm": "50"}])
    assert kubelet.prepare(soft)[soft[1]].error == ""
    iso = mig_claim(node, "iso", "gpu-0-mig-3g40gb-4")
    error = kubelet.prepare(iso)[iso[1]].error
    assert "gpu-0 serves software slices" in error and "not made" in error, error
    assert nvml_state(node.env)[0] == {"mig_mode": 0, "instances": []}
    # once the slice is gone the same claim is made
    assert kubelet.unprepare(soft)[soft[1]].error == ""
    assert kubelet.prepare(iso)[iso[1]].error == ""
    assert len(nvml_state(node.env)[0]["instances"]) == 1
    assert kubelet.unprepare(iso)[iso[1]].error == ""


@pytest.mark.parametrize("version", ["v1.35.2", "v1.36.1", "v1.36.2"])
def test_a_software_slice_and_a_mig_instance_never_share_a_gpu_on_each_schedulers_rules(nodes, tmp_path, version):
    node = nodes(tmp_path, version)
    unsafe = not versions.parse(version).mig_beside_slices_safe
    node.start(*(["--mig-gpus", "1"] if unsafe else []))
    pool(node)
    kubelet = node.kubelet()
    soft, soft_ref = scheduled(node, "soft", SOFT, version)
    iso, iso_ref = scheduled(node, "iso", EXAMPLE, version)      # scheduled in a later cycle
    assert soft == "gpu-0" and iso.startswith("gpu-1-mig-3g40gb-"), (soft, iso)
    assert kubelet.prepare(soft_ref)[soft_ref[1]].error == ""
    assert kubelet.prepare(iso_ref)[iso_ref[1]].error == ""
    state = nvml_state(node.env)
    assert state[0]["instances"] == [] and len(state[1]["instances"]) == 1


@pytest.mark.parametrize("version", ["1.35", "1.36.0", "1.36.1"])
def test_where_an_older_scheduler_puts_mig_beside_a_slice_prepare_refuses_it(nodes, tmp_path, version):
    # a pool that offers both on every GPU (what this driver published before it read the
    # version) and a scheduler with the counter bug: the MIG claim lands on gpu-0
    node = nodes(tmp_path, "v1.37.0", devices=1)
    node.start()
    pool(node)
    kubelet = node.kubelet()
    soft, soft_ref = scheduled(node, "soft", SOFT, version)
    iso, iso_ref = scheduled(node, "iso", EXAMPLE, version)
    assert (soft, iso[:6]) == ("gpu-0", "gpu-0-")
    assert kubelet.prepare(soft_ref)[soft_ref[1]].error == ""
    assert "gpu-0 serves software slices" in kubelet.prepare(iso_ref)[iso_ref[1]].error
    assert nvml_state(node.env)[0]["instances"] == []


@pytest.mark.parametrize("server, placed", [("v1.34.3", ["gpu-0", "gpu-1"]), ("v1.37.0", ["gpu-0", None])])
def test_on_1_34_each_gpu_is_a_slice_so_its_scheduler_judges_a_claim_against_that_gpu(nodes, tmp_path, server, placed):
    # two A10s (24Gi) and two 16Gi claims: 1.34's allocator checks a request against the
    # first device of the slice too; with every GPU in one slice (the 1.35+ layout) the
    # second claim fits nowhere, with a slice per GPU it goes to gpu-1
    node = nodes(tmp_path, server, profile="a10")
    node.start()
    pool(node)
    got = []
    for name in ("one", "two"):
        try:
            got.append(scheduled(node, name, {"deviceClassName": "vgpu.dev",
                                              "capacity": {"requests": {"memory": "16Gi"}}}, "1.34")[0])
        except Unschedulable:
            got.append(None)
    assert got == placed
