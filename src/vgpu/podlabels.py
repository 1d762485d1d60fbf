"""Who a slice made by the DRA driver serves: namespace, pod, container and claim.

Kept beside the slice's quota and usage as `<dir>/<name>/labels.json`, written once by the
driver when it prepares the claim (from the claim's `status.reservedFor` and the webhook's
annotation), read by `vgpu-ctl status` and the metrics.  It is not mounted into the pod
(the CDI spec mounts the quota and usage files only).  A slice made by hand has none.

Read softly: a missing, oversized or malformed file is "no labels", never an error, and only
the four known keys with short string values are kept, so a hostile file cannot break a
report.  Written atomically (a temporary file renamed into place) without following links.
"""
import json
import os

from .slices import check_name, node_dir

FILE = "labels.json"      # slices.LABELS: removed with the slice
KEYS = ("namespace", "pod", "container", "claim", "pod_uid")   # pod_uid: the node agent finds the pod's cgroups by it
MAX_BYTES = 4096
MAX_VALUE = 253           # a DNS subdomain: the longest name any of these can have

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def clean(labels: dict) -> dict:
    """The known keys with non-empty short string values."""
    return {k: v for k in KEYS if isinstance(v := (labels or {}).get(k), str) and 0 < len(v) <= MAX_VALUE}


def _slice_dir_fd(directory, name):
    return os.open(os.path.join(node_dir(directory), check_name(name)), _DIR)


def write(directory, name, labels: dict):
    """Record `labels` for slice `name` (which must exist)."""
    data = json.dumps(clean(labels), sort_keys=True).encode()
    fd = _slice_dir_fd(directory, name)
    try:
        tmp = f".{FILE}.{os.getpid()}.tmp"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
        try:
            os.write(out, data)
            os.fsync(out)
        finally:
            os.close(out)
        os.rename(tmp, FILE, src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        os.close(fd)


def read(directory, name) -> dict:
    """The labels of slice `name`, {} when it has none (or they cannot be read)."""
    try:
        fd = _slice_dir_fd(directory, name)
    except Exception:   # no such slice, a bad name (InvalidRequest), a link
        return {}
    try:
        f = os.open(FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        return {}
    finally:
        os.close(fd)
    try:
        import stat
        if not stat.S_ISREG(os.fstat(f).st_mode):
            return {}
        raw = os.read(f, MAX_BYTES + 1)
    except OSError:
        return {}
    finally:
        os.close(f)
    if len(raw) > MAX_BYTES:
        return {}
    try:
        return clean(json.loads(raw))
    except (ValueError, AttributeError, TypeError):
        return {}


def remove(directory, name):
    """Forget the labels (before the slice is deleted)."""
    try:
        fd = _slice_dir_fd(directory, name)
    except Exception:
        return
    try:
        os.unlink(FILE, dir_fd=fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def shown(labels: dict) -> str:
    """namespace/pod/container, as far as known ('' for a slice with none)."""
    if not labels.get("pod"):
        return ""
    return "/".join(labels[k] for k in ("namespace", "pod", "container") if labels.get(k))
