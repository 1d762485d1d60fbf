"""Kubernetes objects checked against the official client's models (no cluster here).

`roundtrip(obj)` loads a manifest-shaped dict into the `kubernetes` client's model for its
apiVersion/kind and serialises it back: a misspelled field is dropped by the model and a
value of the wrong type is refused, so either shows up as an error naming the path.  The
same check guards the fake API server's HTTP boundary and the manifests in deploy/.
"""
import datetime

from kubernetes import client

_API = client.ApiClient()


def model_class(api_version: str, kind: str):
    """The client's model class for apiVersion/kind: V1DaemonSet for apps/v1 DaemonSet, or
    with the group in front where two groups share a kind (ResourceV1ResourceClaim, and
    CoreV1Event for the core group's)."""
    group, _, version = api_version.rpartition("/")
    version = version[:1].upper() + version[1:]
    names = [version + kind, (group.split(".")[0] or "core").capitalize() + version + kind]   # CoreV1Event
    cls = next((getattr(client, n) for n in names if hasattr(client, n)), None)
    if cls is None:
        raise AssertionError(f"the kubernetes client has no model {' or '.join(names)} for {api_version} {kind}")
    return cls


def _differences(want, got, path="") -> list:
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in want:
            if k not in got:
                out.append(f"{path}.{k}: unknown field (the model dropped it)")
            else:
                out += _differences(want[k], got[k], f"{path}.{k}")
        out += [f"{path}.{k}: appeared in the model's output" for k in got if k not in want]
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: {len(want)} items became {len(got)}"]
        return [d for i, (w, g) in enumerate(zip(want, got)) for d in _differences(w, g, f"{path}[{i}]")]
    if isinstance(want, (datetime.datetime, datetime.date)):
        want = want.isoformat()
    if isinstance(want, str) and isinstance(got, str) and _same_time(want, got):
        return []
    if want != got and not (isinstance(got, str) and str(want) == got and not isinstance(want, (bool, int, float))):
        return [f"{path}: {want!r} became {got!r}"]
    return []


def _same_time(a: str, b: str) -> bool:
    """"...Z" comes back as "...+00:00": the same instant."""
    try:
        return datetime.datetime.fromisoformat(a) == datetime.datetime.fromisoformat(b)
    except ValueError:
        return False


def roundtrip(obj: dict):
    """The model for `obj`; AssertionError listing every field the model did not keep."""
    cls = model_class(obj.get("apiVersion", ""), obj.get("kind", ""))
    try:
        model = cls.from_dict(obj)
    except Exception as e:   # pydantic's ValidationError names the field and the type
        raise AssertionError(f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}: {e}") from None
    back = _API.sanitize_for_serialization(model)
    problems = _differences(obj, back)
    if problems:
        raise AssertionError(f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}: " + "; ".join(problems))
    return model
