"""What the API server's Kubernetes version can do safely, read once from its /version.

Three differences between releases decide how the DRA driver publishes its GPUs (see
docs/kubernetes-versions.md for the whole support matrix):

- Where counter sets live.  1.34 reads a device's counters from its own ResourceSlice
  (kubernetes/api resource/v1/types.go at v0.34.0: a CounterSet is "available to be used
  by devices defined in the ResourceSlice", and its allocator looks there only); from 1.35
  they are the pool's, and the API refuses them beside devices (types.go at v0.35.0).
  So on 1.34 each GPU is a slice of its own, holding its counter set and its devices --
  which also keeps 1.34's allocator from judging a request against another GPU's
  capacity: it checks the slice's first device (fixed in 1.35.0, kubernetes commit
  81e3dbdc, not backported), and here that is the only whole GPU in the slice.
- MIG beside software slices.  Up to 1.36.1 the allocator rebuilds a GPU's free counters
  from exclusively allocated devices only: a software slice (a shared allocation) leaves
  the GPU's counters looking free, and a MIG claim in a later scheduling cycle lands on
  the same GPU (fixed in kubernetes commit 37349f7b: 1.36.2 and 1.37, no 1.35.x).  There
  a GPU serves either MIG or software slices, never both (`GpuModes`).
- Nothing is known (the API server did not answer /version): the driver assumes the
  newest rules for the layout but keeps GPUs exclusive, the safe side of the second rule.
"""
import re
from dataclasses import dataclass

_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True, order=True)
class ServerVersion:
    major: int
    minor: int
    patch: int = 0

    def __str__(self):
        return f"{self.major}.{self.minor}.{self.patch}"

    @property
    def counters_in_device_slice(self) -> bool:
        """1.34: a device's counter set must be in its own slice (one GPU per slice)."""
        return (self.major, self.minor) < (1, 35)

    @property
    def mig_beside_slices_safe(self) -> bool:
        """The allocator counts shared allocations against a GPU's counters (1.36.2+)."""
        return (self.major, self.minor, self.patch) >= (1, 36, 2)


def parse(text):
    """A ServerVersion from a gitVersion ("v1.35.2", "v1.36.0-gke.1200"); None when it is none."""
    m = _VERSION.match(str(text or "").strip())
    return ServerVersion(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def read(api_client, timeout=10):
    """The API server's version (GET /version); None when it does not say.  Errors reaching
    it propagate (the caller retries)."""
    from kubernetes import client
    return parse(client.VersionApi(api_client).get_code(_request_timeout=timeout).git_version)


def parse_mig_gpus(text) -> frozenset:
    """--mig-gpus: "" or "none" (no GPU serves MIG where a GPU must choose), "all", or a
    comma list of GPU indexes ("1,3").  ValueError naming what is wrong."""
    text = (text or "").strip().lower()
    if text in ("", "none"):
        return frozenset()
    if text == "all":
        return frozenset({"all"})
    out = set()
    for part in text.split(","):
        if not part.strip().isdigit():
            raise ValueError(f"--mig-gpus {text!r}: expected none, all or GPU indexes like 0,2")
        out.add(int(part))
    return frozenset(out)


@dataclass(frozen=True)
class GpuModes:
    """Which MIG-capable GPUs serve MIG and which software slices.  exclusive=False (a server
    where both are safe): every GPU offers both, the counters keep them apart."""
    exclusive: bool = True
    mig_gpus: frozenset = frozenset()     # indexes, or {"all"}

    def serves_mig(self, index) -> bool:
        return not self.exclusive or "all" in self.mig_gpus or index in self.mig_gpus

    def serves_slices(self, index) -> bool:
        return not self.exclusive or not ("all" in self.mig_gpus or index in self.mig_gpus)


def modes_for(version, mig_gpus=frozenset()) -> GpuModes:
    """The modes for a server of `version` (None: unknown, taken as unsafe)."""
    return GpuModes(exclusive=version is None or not version.mig_beside_slices_safe, mig_gpus=mig_gpus)
