"""The fake API server (tests/helpers/k8s/fake_api.py) against the real `kubernetes` client.

Real HTTP on loopback, the client configured from the kubeconfig the fake writes, into a
fresh Configuration (the client's global default is left alone).
"""
import json
import urllib.error
import urllib.request

import pytest
import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tests.helpers.k8s.fake_api import FakeApiServer, allocated_claim, check_model

DRIVER = "vgpu.example.com"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@pytest.fixture
def api():
    with FakeApiServer() as server:
        yield server


@pytest.fixture
def kube(api, tmp_path):
    """An ApiClient configured from the fake's kubeconfig (not the global default)."""
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(api.write_kubeconfig(tmp_path / "kubeconfig")),
                            client_configuration=cfg)
    with client.ApiClient(cfg) as api_client:
        yield api_client


def slice_model(node, node_uid, name=None, devices=("gpu-0",), generation=1, labels=None):
    return client.V1ResourceSlice(
        api_version="resource.k8s.io/v1", kind="ResourceSlice",
        metadata=client.V1ObjectMeta(
            name=name or f"{node}-{DRIVER}", labels=labels,
            owner_references=[client.V1OwnerReference(api_version="v1", kind="Node", name=node,
                                                      uid=node_uid, controller=True)]),
        spec=client.V1ResourceSliceSpec(
            driver=DRIVER, node_name=node,
            pool=client.V1ResourcePool(name=node, generation=generation, resource_slice_count=1),
            devices=[client.V1Device(name=d, allow_multiple_allocations=True,
                                     capacity={"memory": client.V1DeviceCapacity(value="24Gi"),
                                               "sm": client.V1DeviceCapacity(value="100")})
                     for d in devices]))


def slice_dict(**spec_changes):
    spec = {"driver": DRIVER, "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}]}
    spec.update(spec_changes)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": "raw"}, "spec": spec}


def post_raw(kube, body, method="POST", path=SLICES):
    """Send `body` as is (the typed methods would validate a dict into a model first)."""
    request = kube.param_serialize(method=method, resource_path=path, body=body,
                                   header_params={"Content-Type": "application/json",
                                                  "Accept": "application/json"},
                                   auth_settings=["BearerToken"])
    response = kube.call_api(*request)
    response.read()
    return kube.response_deserialize(response, {"200": "V1ResourceSlice",
                                                "201": "V1ResourceSlice"}).data


def status_of(exc: ApiException) -> dict:
    body = json.loads(exc.body)
    assert (body["apiVersion"], body["kind"], body["status"]) == ("v1", "Status", "Failure")
    assert body["code"] == exc.status
    return body


def test_kubeconfig_configures_a_fresh_client(api, kube):
    assert kube.configuration.host == api.url
    assert client.Configuration.get_default_copy().host != api.url
    uid = api.add_node("node-a")
    node = client.CoreV1Api(kube).read_node("node-a")
    assert node.metadata.uid == uid and node.metadata.name == "node-a"
    assert api.requests[-1] == ("GET", "/api/v1/nodes/node-a", {})


def test_slice_create_list_replace_delete(api, kube):
    res = client.ResourceV1Api(kube)
    uid_a, uid_b = api.add_node("node-a"), api.add_node("node-b")
    made = res.create_resource_slice(slice_model("node-a", uid_a))
    res.create_resource_slice(slice_model("node-b", uid_b))
    res.create_resource_slice(client.V1ResourceSlice(
        metadata=client.V1ObjectMeta(name="other-driver"),
        spec=client.V1ResourceSliceSpec(driver="other.example.com", node_name="node-a",
                                        pool=client.V1ResourcePool(name="node-a", generation=1,
                                                                   resource_slice_count=1))))
    assert made.metadata.uid and made.metadata.resource_version and made.metadata.generation == 1
    assert made.metadata.creation_timestamp is not None
    assert made.spec.devices[0].capacity["memory"].value == "24Gi"

    listed = res.list_resource_slice(field_selector=f"spec.nodeName=node-a,spec.driver={DRIVER}",
                                     timeout_seconds=5, resource_version="0")
    assert [s.metadata.name for s in listed.items] == [f"node-a-{DRIVER}"]
    assert int(listed.metadata.resource_version) >= int(made.metadata.resource_version)
    assert api.requests[-1][2] == {"fieldSelector": f"spec.nodeName=node-a,spec.driver={DRIVER}",
                                   "timeoutSeconds": "5", "resourceVersion": "0"}
    assert {s.metadata.name for s in res.list_resource_slice().items} == {
        f"node-a-{DRIVER}", f"node-b-{DRIVER}", "other-driver"}
    assert [s.metadata.name for s in res.list_resource_slice(
        field_selector="spec.driver!=vgpu.example.com").items] == ["other-driver"]

    # replace what was read: resourceVersion bumps, generation follows the spec
    current = res.read_resource_slice(made.metadata.name)
    current.spec.devices.append(client.V1Device(name="gpu-1"))
    current.spec.pool.generation = 2
    replaced = res.replace_resource_slice(current.metadata.name, current)
    assert int(replaced.metadata.resource_version) > int(made.metadata.resource_version)
    assert replaced.metadata.uid == made.metadata.uid and replaced.metadata.generation == 2
    assert [d["name"] for d in api.slices()[0]["spec"]["devices"]] == ["gpu-0", "gpu-1"]

    # the stale copy is refused, and nothing changes
    with pytest.raises(ApiException) as e:
        res.replace_resource_slice(made.metadata.name, made)
    assert e.value.status == 409 and status_of(e.value)["reason"] == "Conflict"
    assert len(api.slices()[0]["spec"]["devices"]) == 2

    with pytest.raises(ApiException) as e:
        res.create_resource_slice(slice_model("node-a", uid_a))
    assert e.value.status == 409 and status_of(e.value)["reason"] == "AlreadyExists"

    gone = res.delete_resource_slice(made.metadata.name)
    assert gone.metadata.uid == made.metadata.uid
    assert f"node-a-{DRIVER}" not in [s["metadata"]["name"] for s in api.slices()]
    for call in (res.delete_resource_slice, res.read_resource_slice):
        with pytest.raises(ApiException) as e:
            call(made.metadata.name)
        assert e.value.status == 404 and status_of(e.value)["reason"] == "NotFound"
    with pytest.raises(ApiException) as e:
        res.replace_resource_slice(made.metadata.name, replaced)
    assert e.value.status == 404


def test_list_selectors(api, kube):
    res = client.ResourceV1Api(kube)
    uid = api.add_node("node-a")
    res.create_resource_slice(slice_model("node-a", uid, name="s1", labels={"tier": "gold"}))
    res.create_resource_slice(slice_model("node-a", uid, name="s2", labels={"tier": "tin"}))
    names = lambda **kw: [s.metadata.name for s in res.list_resource_slice(**kw).items]  # noqa: E731
    assert names(label_selector="tier=gold") == ["s1"]
    assert names(label_selector="tier!=gold") == ["s2"]
    assert names(field_selector="metadata.name=s2") == ["s2"]
    assert names(field_selector="spec.nodeName=node-b") == []
    with pytest.raises(ApiException) as e:
        res.list_resource_slice(field_selector="spec.pool.name=node-a")
    assert e.value.status == 400 and "not supported" in status_of(e.value)["message"]
    # list items carry no apiVersion/kind, as from a real server; the list itself does
    raw = res.list_resource_slice_with_http_info(_preload_content=False)
    body = json.loads(raw.data)
    assert body["kind"] == "ResourceSliceList" and "kind" not in body["items"][0]


def test_generate_name_and_dry_run(api, kube):
    res = client.ResourceV1Api(kube)
    uid = api.add_node("node-a")
    model = slice_model("node-a", uid)
    model.metadata.name, model.metadata.generate_name = None, "node-a-vgpu-"
    a, b = res.create_resource_slice(model), res.create_resource_slice(model)
    assert a.metadata.name.startswith("node-a-vgpu-") and a.metadata.name != b.metadata.name
    assert a.metadata.uid != b.metadata.uid
    res.create_resource_slice(slice_model("node-a", uid, name="dry"), dry_run="All")
    assert sorted(s["metadata"]["name"] for s in api.slices()) == sorted(
        [a.metadata.name, b.metadata.name])


def test_read_allocated_claim(api, kube):
    claim = allocated_claim("team-a", "claim-1", DRIVER, "node-a", [
        {"request": "gpu", "device": "gpu-0", "share_id": "4b1d6a3e-0000-4000-8000-000000000001",
         "memory": "4Gi", "sm": "50"},
        {"request": "gpu", "device": "gpu-1", "share_id": None, "memory": "2Gi", "sm": None},
    ])
    stored = api.put_claim(claim)
    assert stored["metadata"]["uid"] == claim["metadata"]["uid"]
    assert stored["metadata"]["resourceVersion"]
    got = client.ResourceV1Api(kube).read_namespaced_resource_claim("claim-1", "team-a")
    assert got.metadata.uid == claim["metadata"]["uid"]
    first, second = got.status.allocation.devices.results
    assert (first.request, first.driver, first.pool, first.device) == ("gpu", DRIVER, "node-a",
                                                                       "gpu-0")
    assert first.share_id == "4b1d6a3e-0000-4000-8000-000000000001"
    assert first.consumed_capacity == {"memory": "4Gi", "sm": "50"}
    assert second.share_id is None and second.consumed_capacity == {"memory": "2Gi"}
    request = got.spec.devices.requests[0]
    assert request.name == "gpu" and request.exactly.device_class_name == DRIVER
    assert request.exactly.capacity.requests == {"memory": "4Gi", "sm": "50"}
    assert request.exactly.count == 2
    term = got.status.allocation.node_selector.node_selector_terms[0]
    assert term.match_fields[0].key == "metadata.name" and term.match_fields[0].values == ["node-a"]

    api.delete_claim("team-a", "claim-1")
    with pytest.raises(ApiException) as e:
        client.ResourceV1Api(kube).read_namespaced_resource_claim("claim-1", "team-a")
    assert e.value.status == 404


def test_allocated_claim_is_exactly_the_model():
    claim = allocated_claim("ns", "c", DRIVER, "pool-a",
                            [{"request": "r", "device": "d", "share_id": "s", "memory": "1Gi",
                              "sm": "10"}], node="node-x")
    check_model(claim)   # the client's model keeps every field
    assert claim["spec"]["devices"]["requests"] == [
        {"name": "r", "exactly": {"deviceClassName": DRIVER,
                                  "capacity": {"requests": {"memory": "1Gi", "sm": "10"}}}}]
    assert claim["status"]["allocation"]["devices"]["results"] == [
        {"request": "r", "driver": DRIVER, "pool": "pool-a", "device": "d", "shareID": "s",
         "consumedCapacity": {"memory": "1Gi", "sm": "10"}}]
    assert claim["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0][
        "matchFields"][0]["values"] == ["node-x"]
    bad = allocated_claim("ns", "c", DRIVER, "p", [{"request": "r", "device": "d"}])
    bad["status"]["allocation"]["devices"]["results"][0]["shareId"] = "s"
    with pytest.raises(AssertionError, match="shareId"):
        check_model(bad)


def test_unknown_objects_and_paths_404(api, kube):
    with pytest.raises(ApiException) as e:
        client.ResourceV1Api(kube).read_namespaced_resource_claim("nope", "default")
    assert e.value.status == 404
    assert status_of(e.value)["message"] == 'resourceclaims.resource.k8s.io "nope" not found'
    with pytest.raises(ApiException) as e:
        client.CoreV1Api(kube).read_node("nope")
    assert e.value.status == 404
    with pytest.raises(ApiException) as e:
        client.CoreV1Api(kube).list_namespaced_config_map("default")
    assert e.value.status == 404 and status_of(e.value)["reason"] == "NotFound"


@pytest.mark.parametrize("spec, message", [
    ({"nodeNmae": "node-a"}, "spec.nodeNmae: unknown field"),
    ({"pool": {"name": "node-a", "generation": "1", "resourceSliceCount": 1}}, "generation"),
    ({"pool": {"name": "node-a", "resourceSliceCount": 1}}, "spec.pool.generation: Required"),
    ({"pool": {"name": "node-a", "generation": 1}}, "spec.pool.resourceSliceCount: Required"),
    ({"driver": None}, "spec.driver: Required"),
    ({"devices": [{"name": "gpu-0"}, {"name": "gpu-0"}]}, "Duplicate value: 'gpu-0'"),
    ({"devices": [{"name": "gpu-0", "capacity": {"memory": {"value": "4 GiB"}}}]},
     "not a quantity"),
    ({"allNodes": True}, "exactly one of"),
])
def test_invalid_slice_is_422(api, kube, spec, message):
    body = slice_dict(**spec)
    with pytest.raises(ApiException) as e:
        post_raw(kube, body)
    assert e.value.status == 422
    status = status_of(e.value)
    assert status["reason"] == "Invalid" and message in status["message"], status["message"]
    assert api.slices() == []
    # the same mistake in a replace is refused too
    assert post_raw(kube, slice_dict()).metadata.name == "raw"
    with pytest.raises(ApiException) as e:
        post_raw(kube, body, method="PUT", path=f"{SLICES}/raw")
    assert e.value.status == 422
    assert api.slices()[0]["spec"] == slice_dict()["spec"]


def test_raw_json_is_served_too(api):
    """Without the client (urllib): the valid body is stored, a body naming a field the model
    drops is a 422 Status."""
    def send(body):
        req = urllib.request.Request(api.url + SLICES, data=json.dumps(body).encode(),
                                     method="POST",
                                     headers={"Authorization": f"Bearer {api.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.load(r)
    status, made = send(slice_dict())
    assert status == 201 and made["metadata"]["uid"]
    typo = slice_dict()
    typo["metadata"] = {"name": "typo", "lables": {"a": "b"}}
    with pytest.raises(urllib.error.HTTPError) as e:
        send(typo)
    assert e.value.code == 422
    assert "metadata.lables: unknown field" in json.load(e.value)["message"]


def test_auth(api, kube):
    api.add_node("node-a")
    for cfg_token in (None, "wrong"):
        cfg = client.Configuration(host=api.url)
        if cfg_token:
            cfg.api_key = {"BearerToken": cfg_token}
            cfg.api_key_prefix = {"BearerToken": "Bearer"}
        with client.ApiClient(cfg) as anonymous:
            with pytest.raises(ApiException) as e:
                client.CoreV1Api(anonymous).read_node("node-a")
        assert e.value.status == 401 and status_of(e.value)["reason"] == "Unauthorized"
    assert client.CoreV1Api(kube).read_node("node-a").metadata.name == "node-a"


def test_fail_next(api, kube):
    res = client.ResourceV1Api(kube)
    uid = api.add_node("node-a")
    api.fail_next("GET", SLICES, 500)
    with pytest.raises(ApiException) as e:
        res.list_resource_slice()
    assert e.value.status == 500 and status_of(e.value)["reason"] == "InternalError"
    assert res.list_resource_slice().items == []

    api.fail_next("POST", SLICES, 409, times=2)
    for _ in range(2):
        with pytest.raises(ApiException) as e:
            res.create_resource_slice(slice_model("node-a", uid))
        assert e.value.status == 409
    assert api.slices() == []            # an injected failure changes nothing
    res.create_resource_slice(slice_model("node-a", uid))
    assert len(api.slices()) == 1

    api.fail_next("*", "/api/v1/nodes/", 503)
    res.list_resource_slice()            # another path is not affected
    with pytest.raises(ApiException) as e:
        client.CoreV1Api(kube).read_node("node-a")
    assert e.value.status == 503
    assert client.CoreV1Api(kube).read_node("node-a").metadata.uid == uid


def test_delete_preconditions_and_garbage_collection(api, kube):
    res = client.ResourceV1Api(kube)
    uid = api.add_node("node-a")
    made = res.create_resource_slice(slice_model("node-a", uid))
    orphan = res.create_resource_slice(slice_model("node-a", "not-the-node-uid", name="orphan"))
    with pytest.raises(ApiException) as e:
        res.delete_resource_slice(made.metadata.name, body=client.V1DeleteOptions(
            preconditions=client.V1Preconditions(resource_version="1")))
    assert e.value.status == 409
    assert api.garbage_collect() == [orphan.metadata.name]
    assert [s["metadata"]["name"] for s in api.slices()] == [made.metadata.name]
    api.delete_node("node-a")
    api.add_node("node-a")                   # same name, new uid: the old slice is orphaned
    assert api.garbage_collect() == [made.metadata.name]


def test_stop_and_restart_keep_the_store(api, kube):
    res = client.ResourceV1Api(kube)
    uid = api.add_node("node-a")
    res.create_resource_slice(slice_model("node-a", uid))
    url = api.url
    api.stop()
    with pytest.raises(urllib3.exceptions.MaxRetryError):   # the pooled connection is closed too
        res.list_resource_slice(_request_timeout=2)
    api.start()
    assert api.url == url
    assert len(res.list_resource_slice(_request_timeout=5).items) == 1


def test_watch_streams_each_change_from_a_resource_version(api, kube):
    from kubernetes import watch
    res = client.ResourceV1Api(kube)
    uid = api.add_node("node-a")
    res.create_resource_slice(slice_model("node-a", uid))
    listed = res.list_resource_slice(field_selector="spec.nodeName=node-a")
    res.create_resource_slice(slice_model("node-b", api.add_node("node-b")))     # not selected
    current = res.read_resource_slice(f"node-a-{DRIVER}")
    current.spec.pool.generation = 2
    res.replace_resource_slice(current.metadata.name, current)
    api.delete_slice(current.metadata.name)
    events = [(e["type"], e["raw_object"]["metadata"]["name"], e["raw_object"]["metadata"]["resourceVersion"])
              for e in watch.Watch().stream(res.list_resource_slice, field_selector="spec.nodeName=node-a",
                                            resource_version=listed.metadata.resource_version, timeout_seconds=1)]
    assert [(t, n) for t, n, _ in events] == [("MODIFIED", f"node-a-{DRIVER}"), ("DELETED", f"node-a-{DRIVER}")]
    assert int(events[1][2]) > int(events[0][2]) > int(listed.metadata.resource_version)
    # from no version: what is there now comes as ADDED
    now = [(e["type"], e["raw_object"]["metadata"]["name"])
           for e in watch.Watch().stream(res.list_resource_slice, timeout_seconds=1)]
    assert now == [("ADDED", f"node-b-{DRIVER}")]


def test_a_watch_sees_a_change_made_while_it_waits_and_old_versions_are_gone(api, kube):
    import threading

    from kubernetes import watch
    res = client.ResourceV1Api(kube)
    uid = api.add_node("node-a")
    version = res.list_resource_slice().metadata.resource_version
    threading.Timer(0.3, lambda: res.create_resource_slice(slice_model("node-a", uid))).start()
    w = watch.Watch()
    for event in w.stream(res.list_resource_slice, resource_version=version, timeout_seconds=10):
        assert (event["type"], event["object"].metadata.name) == ("ADDED", f"node-a-{DRIVER}")
        w.stop()
    api.add_node("node-b")                 # the store's version moves on
    api.compact()
    with pytest.raises(ApiException) as e:
        list(watch.Watch().stream(res.list_resource_slice, resource_version=version, timeout_seconds=1))
    assert e.value.status == 410


def test_delete_collection_deletes_what_the_selector_matches(api, kube):
    res = client.ResourceV1Api(kube)
    res.create_resource_slice(slice_model("node-a", api.add_node("node-a")))
    res.create_resource_slice(slice_model("node-a", "x", name="other"))
    res.create_resource_slice(slice_model("node-b", api.add_node("node-b")))
    res.delete_collection_resource_slice(field_selector="spec.nodeName=node-a")   # as a starting kubelet does
    assert [s["metadata"]["name"] for s in api.slices()] == [f"node-b-{DRIVER}"]
    assert api.requests[-1] == ("DELETE", SLICES, {"fieldSelector": "spec.nodeName=node-a"})


def test_black_hole_answers_nothing_until_started_again(api, kube):
    res = client.ResourceV1Api(kube)
    api.black_hole()
    with pytest.raises(urllib3.exceptions.MaxRetryError, match="timed out"):
        res.list_resource_slice(_request_timeout=0.5)
    api.start()
    assert res.list_resource_slice(_request_timeout=5).items == []


# === what the server writes into a stored resource.k8s.io object (helpers.k8s.defaults) ===

@pytest.mark.parametrize("sent, stored", [
    ("1000000000", "1G"), ("1000M", "1G"), ("1500", "1500"), ("0.5", "500m"), ("2000m", "2"), ("100", "100"),
    ("1024Mi", "1Gi"), ("1.5Gi", "1536Mi"), ("512Ki", "512Ki"), ("0.5Ki", "512"), ("1536", "1536"),
    ("1e3", "1e3"), ("0", "0"), ("25769803776", "25769803776")])
def test_quantities_are_stored_canonically_as_apimachinery_writes_them(sent, stored):
    from tests.helpers.k8s.defaults import canonical
    assert canonical(sent) == stored


def test_a_template_is_stored_with_the_request_defaults_and_canonical_quantities(api, kube):
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "t", "namespace": "default"},
            "spec": {"spec": {"devices": {"requests": [
                {"name": "a", "exactly": {"deviceClassName": "c", "capacity": {"requests": {"memory": "1000000000"}},
                                          "tolerations": [{"key": "k", "effect": "NoSchedule"}]}},
                {"name": "b", "exactly": {"deviceClassName": "c", "allocationMode": "All"}},
                {"name": "c", "firstAvailable": [{"name": "x", "deviceClassName": "c", "count": 2}]}]}}}}
    made = client.ResourceV1Api(kube).create_namespaced_resource_claim_template("default", body)
    a, b, c = kube.sanitize_for_serialization(made)["spec"]["spec"]["devices"]["requests"]
    assert a["exactly"]["allocationMode"] == "ExactCount" and a["exactly"]["count"] == 1
    assert a["exactly"]["capacity"]["requests"] == {"memory": "1G"}
    assert a["exactly"]["tolerations"][0]["operator"] == "Equal"
    assert b["exactly"]["allocationMode"] == "All" and "count" not in b["exactly"]
    assert c["firstAvailable"][0]["allocationMode"] == "ExactCount" and c["firstAvailable"][0]["count"] == 2


def test_server_side_apply_of_status_devices_merges_by_key_and_owns_what_each_manager_applied(api, kube):
    api.put_claim(allocated_claim("default", "c", "gpu.example.com", "node-a",
                                  [{"request": "a", "device": "gpu-0"}, {"request": "b", "device": "gpu-1"}]))
    resource = client.ResourceV1Api(kube)

    def apply(manager, devices, force=False):
        body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c"},
                "status": {"devices": [{"driver": "gpu.example.com", "pool": "node-a", "device": d,
                                        "data": {"by": manager}} for d in devices]}}
        resource.patch_namespaced_resource_claim_status("c", "default", body, field_manager=manager, force=force,
                                                        _content_type="application/apply-patch+yaml")
        return [(d["device"], d["data"]["by"]) for d in api.claim("default", "c")["status"].get("devices") or []]

    assert apply("one", ["gpu-0", "gpu-1"]) == [("gpu-0", "one"), ("gpu-1", "one")]
    assert apply("one", ["gpu-1"]) == [("gpu-1", "one")]           # what it leaves out now is removed
    assert apply("two", ["gpu-0"]) == [("gpu-1", "one"), ("gpu-0", "two")]
    with pytest.raises(ApiException) as e:                          # another manager's entry: a conflict
        apply("two", ["gpu-0", "gpu-1"])
    assert e.value.status == 409
    assert json.loads(e.value.body)["message"].startswith('Apply failed with 1 conflict: conflict with "one"')
    assert apply("two", ["gpu-0", "gpu-1"], force=True) == [("gpu-1", "two"), ("gpu-0", "two")]
    assert apply("one", []) == [("gpu-1", "two"), ("gpu-0", "two")]     # nothing of one's is left to remove
    with pytest.raises(ApiException) as e:
        resource.patch_namespaced_resource_claim_status(
            "c", "default", {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c"}},
            _content_type="application/apply-patch+yaml")
    assert e.value.status == 400 and "fieldManager is required" in e.value.body
