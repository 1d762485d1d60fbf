"""What the API server writes into a resource.k8s.io object before storing it: its defaults
and every quantity in canonical form.  The fake API server applies `stored()` to each such
body it stores, so a client that compares what it sent with what it reads back meets what
it would meet on a real cluster.

Rules, from kubernetes/kubernetes:
- pkg/apis/resource/v1/defaults.go and zz_generated.defaults.go: an `exactly` request and a
  `firstAvailable` subrequest get `allocationMode: ExactCount` when it is empty, and then
  `count: 1` when it is 0; every toleration (in requests and in allocation results) gets
  `operator: Equal` when empty; a device taint gets `timeAdded` (now, to the second) when
  unset.
- staging/src/k8s.io/apimachinery/pkg/api/resource/quantity.go (CanonicalizeBytes): a
  quantity keeps the format of its suffix (none or n/u/m/k/M/G/T/P/E: decimal SI;
  Ki..Ei: binary SI; an e/E exponent: decimal exponent) and is written as the shortest
  exact mantissa: decimal with an exponent that is a multiple of 3 ("1000000000" -> "1G",
  "1500" -> "1500", "0.5" -> "500m"), binary with a power of 1024 ("1024Mi" -> "1Gi");
  a binary value under 1024 in magnitude, or not whole, is written decimal ("512Ki" stays,
  "0.5Ki" -> "512").  Values are rounded up to nano units (scale -9) when parsed.
"""
import copy
import datetime
import re
from decimal import ROUND_CEILING, Decimal

_NUMBER = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(.*)$")
_DECIMAL_SUFFIX = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SUFFIX = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_EXPONENT = re.compile(r"^[eE]([+-]?\d+)$")


def parse(text):
    """(value as a Decimal rounded up to nano units, format) of a quantity string; ValueError
    when it is none."""
    m = _NUMBER.match(str(text).strip())
    if not m:
        raise ValueError(f"quantities must match the regular expression: {text!r}")
    number, suffix = Decimal(m.group(1)), m.group(2)
    if suffix in _DECIMAL_SUFFIX:
        value, form = number.scaleb(_DECIMAL_SUFFIX[suffix]), "DecimalSI"
    elif suffix in _BINARY_SUFFIX:
        value, form = number * (1 << _BINARY_SUFFIX[suffix]), "BinarySI"
    elif e := _EXPONENT.match(suffix):
        value, form = number.scaleb(int(e.group(1))), "DecimalExponent"
    else:
        raise ValueError(f"unable to parse quantity's suffix: {text!r}")
    return value.quantize(Decimal("1e-9"), rounding=ROUND_CEILING), form


def canonical(text) -> str:
    """The string a real API server stores for the quantity `text`."""
    value, form = parse(text)
    if value == 0:
        return "0"
    if form == "BinarySI" and abs(value) >= 1024 and value == value.to_integral_value():
        n, power = int(value), 0
        while power < 60 and n % 1024 == 0:
            n, power = n // 1024, power + 10
        return f"{n}{next((s for s, p in _BINARY_SUFFIX.items() if p == power), '')}"
    # decimal: the mantissa with the largest exponent (a multiple of 3) that keeps it whole
    n, exponent = int(value.scaleb(9)), -9
    while n % 1000 == 0 and exponent < 18:
        n, exponent = n // 1000, exponent + 3
    if form == "DecimalExponent":
        return f"{n}e{exponent}" if exponent else str(n)
    return f"{n}{next(s for s, p in _DECIMAL_SUFFIX.items() if p == exponent)}"


# === defaulting, by kind ===

def _request(r):
    if not r.get("allocationMode"):
        r["allocationMode"] = "ExactCount"
    if r["allocationMode"] == "ExactCount" and not r.get("count"):
        r["count"] = 1
    for t in r.get("tolerations") or []:
        t["operator"] = t.get("operator") or "Equal"
    requests = (r.get("capacity") or {}).get("requests") or {}
    for k, v in requests.items():
        requests[k] = canonical(v)


def _claim_spec(spec):
    for r in ((spec or {}).get("devices") or {}).get("requests") or []:
        if r.get("exactly"):
            _request(r["exactly"])
        for sub in r.get("firstAvailable") or []:
            _request(sub)


def _claim_status(status):
    for result in ((((status or {}).get("allocation") or {}).get("devices") or {}).get("results") or []):
        for t in result.get("tolerations") or []:
            t["operator"] = t.get("operator") or "Equal"
        consumed = result.get("consumedCapacity") or {}
        for k, v in consumed.items():
            consumed[k] = canonical(v)


def _counters(counters):
    for c in (counters or {}).values():
        c["value"] = canonical(c["value"])


def _slice_spec(spec):
    for cs in (spec or {}).get("sharedCounters") or []:
        _counters(cs.get("counters"))
    for device in (spec or {}).get("devices") or []:
        for capacity in (device.get("capacity") or {}).values():
            capacity["value"] = canonical(capacity["value"])
            policy = capacity.get("requestPolicy") or {}
            if policy.get("default") is not None:
                policy["default"] = canonical(policy["default"])
            valid = policy.get("validRange") or {}
            for k in ("min", "max", "step"):
                if valid.get(k) is not None:
                    valid[k] = canonical(valid[k])
            if policy.get("validValues"):
                policy["validValues"] = [canonical(v) for v in policy["validValues"]]
        for use in device.get("consumesCounters") or []:
            _counters(use.get("counters"))
        for taint in device.get("taints") or []:
            if not taint.get("timeAdded"):
                taint["timeAdded"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def stored(obj: dict) -> dict:
    """A copy of the resource.k8s.io object `obj` as the API server stores it."""
    obj = copy.deepcopy(obj)
    kind = obj.get("kind")
    if kind == "ResourceClaimTemplate":
        _claim_spec(((obj.get("spec") or {}).get("spec")))
    elif kind == "ResourceClaim":
        _claim_spec(obj.get("spec"))
        _claim_status(obj.get("status"))
    elif kind == "ResourceSlice":
        _slice_spec(obj.get("spec"))
    return obj
