"""CDI versions: the version the DRA driver writes (vgpu.k8s.cdi) against the runtime-side
model of the CDI library (tests/helpers/k8s/cdi.py), and that model against the library's rules.

The two minimum-version computations are written separately from the library's rules; a
spec the driver labels lower than the library computes would be refused by every runtime.
"""
import json

import pytest

from tests.helpers.k8s.cdi import RUNTIMES, Registry, UnresolvableDevices, known_versions, required_version
from vgpu import slices
from vgpu.k8s import cdi

MOUNT = {"hostPath": "/h", "containerPath": "/c"}


def spec_with(edits=None, devices=None, **top):
    return {"cdiVersion": "1.1.0", "kind": "vgpu.dev/slice",
            "devices": devices or [{"name": "a", "containerEdits": edits or {"env": ["A=1"]}}], **top}


CASES = {   # spec -> the version the library's minimum-version check gives it
    "env only": (spec_with(), "0.3.0"),
    "untyped mount": (spec_with({"mounts": [MOUNT]}), "0.3.0"),
    "typed mount": (spec_with({"mounts": [{**MOUNT, "type": "bind"}]}), "0.4.0"),
    "spec-level typed mount": (spec_with(containerEdits={"mounts": [{**MOUNT, "type": "bind"}]}), "0.4.0"),
    "name with a digit first": (spec_with(devices=[{"name": "0b7e", "containerEdits": {"env": ["A=1"]}}]), "0.5.0"),
    "device node hostPath": (spec_with({"deviceNodes": [{"path": "/dev/x", "hostPath": "/dev/y"}]}), "0.5.0"),
    "device annotations": (spec_with(devices=[{"name": "a", "annotations": {"k": "v"},
                                               "containerEdits": {"env": ["A=1"]}}]), "0.6.0"),
    "a dot in the class": ({**spec_with(), "kind": "vgpu.dev/slice.v2"}, "0.6.0"),
    "additional GIDs": (spec_with({"additionalGids": [5]}), "0.7.0"),
    "intelRdt": (spec_with({"intelRdt": {"closID": "x"}}), "0.7.0"),
    "intelRdt schemata": (spec_with({"intelRdt": {"schemata": ["L3:0=f"]}}), "1.1.0"),
    "net devices": (spec_with({"netDevices": [{"hostInterfaceName": "eth1", "name": "net0"}]}), "1.1.0"),
}


@pytest.mark.parametrize("case", CASES)
def test_the_drivers_minimum_version_is_the_cdi_librarys(case):
    spec, version = CASES[case]
    assert required_version(spec) == version
    assert cdi.min_version(spec) == version


def test_the_driver_writes_the_lowest_version_by_default_and_refuses_one_too_low(tmp_path):
    paths = slices.paths(str(tmp_path), "train-share-0")
    assert cdi.CDI_VERSION == cdi.AUTO
    assert cdi.spec("vgpu.dev", "train-share-0", paths, "/opt/vgpu/libvgpu.so")["cdiVersion"] == "0.4.0"
    uuid = "0b7e2c1a-95f4-4d1e-8a3b-5c6d7e8f9a0b"
    assert cdi.spec("vgpu.dev", uuid, slices.paths(str(tmp_path), uuid), "/s")["cdiVersion"] == "0.5.0"
    assert cdi.spec("vgpu.dev", "train-share-0", paths, "/s", version="1.0.0")["cdiVersion"] == "1.0.0"
    with pytest.raises(cdi.VersionTooLow, match="needs cdiVersion 0.5.0"):
        cdi.spec("vgpu.dev", uuid, slices.paths(str(tmp_path), uuid), "/s", version="0.4.0")


def write(directory, name, spec):
    directory.mkdir(exist_ok=True)
    (directory / name).write_text(json.dumps(spec))


def test_the_runtime_model_refuses_what_the_cdi_library_refuses(tmp_path):
    d = tmp_path / "cdi"
    good = {"cdiVersion": "0.4.0", "kind": "vgpu.dev/slice",
            "devices": [{"name": "ok", "containerEdits": {"mounts": [{**MOUNT, "type": "bind"}]}}]}
    write(d, "good.json", good)
    bad = {
        "unknown-version.json": {**good, "cdiVersion": "9.9.9", "devices": [{**good["devices"][0], "name": "v"}]},
        "too-low.json": {**good, "cdiVersion": "0.3.0", "devices": [{**good["devices"][0], "name": "low"}]},
        "unknown-field.json": {**good, "devices": [{**good["devices"][0], "name": "f", "extra": 1}]},
        "bad-class.json": {**good, "kind": "vgpu.dev/-slice", "devices": [{**good["devices"][0], "name": "c"}]},
        "bad-env.json": {**good, "devices": [{"name": "e", "containerEdits": {"env": ["=x"]}}]},
        "empty-edits.json": {**good, "devices": [{"name": "empty", "containerEdits": {}}]},
    }
    for name, spec in bad.items():
        write(d, name, spec)
    (d / "notes.txt").write_text("not a spec")
    registry = Registry([d], "containerd 2.0.0-2.0.4")
    assert sorted(registry.refresh()) == ["vgpu.dev/slice=ok"]
    why = {p.rsplit("/", 1)[1]: e for p, e in registry.errors.items()}
    assert why == {
        "unknown-version.json": 'invalid version "9.9.9"',
        "too-low.json": "the spec version must be at least v0.4.0",
        "unknown-field.json": 'failed to unmarshal CDI Spec: devices[0]: unknown field "extra"',
        "bad-class.json": 'invalid class. "-slice", should start with letter',
        "bad-env.json": "device e: invalid environment variable '=x'",
        "empty-edits.json": "failed add device 'empty': invalid device, empty device edits",
    }
    edits = registry.inject(["vgpu.dev/slice=ok"])
    assert edits["mounts"] == [{**MOUNT, "type": "bind"}]
    with pytest.raises(UnresolvableDevices, match=r"unresolvable CDI devices vgpu.dev/slice=v\b"):
        registry.inject(["vgpu.dev/slice=ok", "vgpu.dev/slice=v"])
    # one device in two specs of a directory: a conflict, neither is used
    write(d, "twin.json", good)
    assert Registry([d]).refresh() == {}


def test_which_versions_each_runtime_knows():
    assert known_versions("containerd 2.0.0-2.0.4")[-1] == "0.8.0"
    assert known_versions("containerd 2.0.5-2.2.0")[-1] == known_versions("CRI-O 1.33-1.34")[-1] == "1.0.0"
    assert known_versions("containerd 2.2.1+")[-1] == "1.1.0"
    # what the driver writes by default is known everywhere in the table
    assert all({"0.4.0", "0.5.0"} <= set(known_versions(r)) for r in RUNTIMES)
