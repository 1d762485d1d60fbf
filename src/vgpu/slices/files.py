"""The node directory's files, opened safely: names, paths, the layout's constants, and the
low-level handling every reader and writer goes through (see the package's rules)."""
import contextlib
import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
import struct

from .. import board
from ..errors import BadFile, InvalidRequest, NotFound, VgpuError
from .._region import ffi, lib


DEFAULT_DIR = "/run/vgpu"
QUOTA, USAGE = "quota", "usage"
# The slice's name, mounted read-only into its containers at /run/vgpu/.slice
# (vgpu.runtime.CONTAINER_IDENTITY): the shim reads it there before the environment (so
# children that clear theirs stay in the slice), and the node agent attributes any process
# that has it to the slice.
IDENTITY = "identity"
LABELS = "labels.json"      # who a DRA-made slice serves (vgpu.podlabels)
# A MIG slice's GPU and compute instance (vgpu.mig), placed once at create before the
# quota; the shim never reads it (its quota's device 0 is the instance, CUDA's ordinal 0)
MIG = "mig.json"
BURST, CEILING = "burst", "ceiling"   # --sm-mode
SM_MODES = (BURST, CEILING)
QUOTA_SIZE = ffi.sizeof("struct vgpu_quota")
USAGE_SIZE = ffi.sizeof("struct vgpu_usage")
MAX_DEVICES = lib.VGPU_MAX_DEVICES
MAX_PROCS = lib.VGPU_MAX_PROCS
LOCK_BASE = 1 << 40          # usage slot i is owned by an OFD lock on byte LOCK_BASE + i (shim.c)
_FLOCK = "hhqqi4x"           # struct flock on Linux (64-bit off_t)
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_RW = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_RO = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _permission(path, action):
    return VgpuError(f"cannot {action} {path}: permission denied",
                     "run as root, or point --dir / VGPU_DIR at a directory you can write")


# === names and paths ===

def valid_name(name: str) -> bool:
    return 0 < len(name) < lib.VGPU_NAME_MAX and bool(_NAME.fullmatch(name))


def check_name(name: str) -> str:
    if not valid_name(name):
        raise InvalidRequest(f"{name!r} is not a valid slice name",
                             "use letters, digits, '-', '_' and '.', not starting with '.' or '-', "
                             f"under {lib.VGPU_NAME_MAX} characters")
    return name


def node_dir(path=None) -> str:
    return os.path.abspath(path or os.environ.get("VGPU_DIR") or DEFAULT_DIR)


def paths(directory, name) -> dict:
    base = os.path.join(node_dir(directory), check_name(name))
    return {"dir": base, "quota": os.path.join(base, QUOTA), "usage": os.path.join(base, USAGE),
            "identity": os.path.join(base, IDENTITY), "board": os.path.join(node_dir(directory), board.BOARD)}


def auto_name(prefix="run") -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(2)}"


# === low-level file handling ===

def _flock_struct(kind, slot):
    return struct.pack(_FLOCK, kind, os.SEEK_SET, LOCK_BASE + slot, 1, 0)


def slot_alive(fd, slot) -> bool:
    """Does a live process own usage slot `slot`?  (Its OFD lock is held; works on a
    read-only descriptor.)"""
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock_struct(fcntl.F_WRLCK, slot))
    return struct.unpack(_FLOCK, res)[0] != fcntl.F_UNLCK


@contextlib.contextmanager
def _mapped(fd, ctype, size, writable):
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    buf = ffi.from_buffer(mm, require_writable=writable)
    try:
        yield ffi.cast(ctype + " *", buf)
    finally:
        ffi.release(buf)
        mm.close()


@contextlib.contextmanager
def _fd(fd):
    try:
        yield fd
    finally:
        os.close(fd)


def _open_node(directory, create=False, name=None):
    path = node_dir(directory)
    try:
        if create:
            os.makedirs(path, 0o755, exist_ok=True)
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFound(f"{f'slice {name} not found: ' if name else ''}node directory {path} does not exist",
                       "create a slice first (vgpu-ctl create), or set --dir / VGPU_DIR") from None
    except PermissionError:
        raise _permission(path, "create" if create else "open") from None
    except NotADirectoryError:
        raise BadFile(f"{path} is not a directory", "point --dir / VGPU_DIR at a directory") from None


def _open_in(dir_fd, name, flags, shown, mode=0o600):
    """os.open relative to dir_fd, never following a symbolic link."""
    try:
        return os.open(name, flags, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = "directory" if flags & os.O_DIRECTORY else "file"
            raise BadFile(f"{shown} is a symbolic link or not a {kind}; refusing it",
                          "vgpu never follows links inside the node directory: remove it") from None
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise _permission(shown, "open") from None
        raise


def _open_slice(node_fd, directory, name):
    check_name(name)
    shown = os.path.join(node_dir(directory), name)
    try:
        return _open_in(node_fd, name, _DIR, shown)
    except FileNotFoundError:
        raise NotFound(f"slice {name} not found in {node_dir(directory)}",
                       "`vgpu-ctl list` shows the slices; `vgpu-ctl create` makes one") from None


def _check_regular(fd, shown, size):
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        raise BadFile(f"{shown} is not a plain file with one link; refusing it",
                      "remove it and create the slice again")
    if st.st_size != size:
        raise BadFile(f"{shown} has {st.st_size} bytes, not {size}: not a vgpu file of ABI version "
                      f"{lib.VGPU_ABI_VERSION}", "delete the slice and create it again")


def _check_header(p, magic, size, shown):
    if (p.magic, p.abi_version, p.size) != (magic, lib.VGPU_ABI_VERSION, size):
        raise BadFile(f"{shown} is not a vgpu file of ABI version {lib.VGPU_ABI_VERSION} "
                      f"(magic {p.magic:#x}, version {p.abi_version})",
                      "delete the slice and create it again")


@contextlib.contextmanager
def _node_lock(node_fd):
    fcntl.flock(node_fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(node_fd, fcntl.LOCK_UN)


@contextlib.contextmanager
def _new_node_locked(directory):
    """The node directory, made if missing, open and locked, for a create.  A temporary
    slice's end may remove the directory (slices.tidy_node) between its making and the
    lock: then it is made again."""
    for _ in range(10):
        try:
            fd = _open_node(directory, create=True)
        except NotFound:
            continue             # removed between the makedirs and the open
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink > 0:
            break
        os.close(fd)             # removed before the lock came (closing lets go of it)
    else:
        raise VgpuError(f"node directory {node_dir(directory)} keeps vanishing", "try again")
    try:
        yield fd
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _place(dir_fd, name, data, mode, shown, owner=None):
    """Write `data` under a temporary name and link it to `name`: it appears complete or
    not at all, and an existing `name` is never replaced (FileExistsError)."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = _open_in(dir_fd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, shown, mode)
    try:
        with _fd(fd):
            os.fchmod(fd, mode)          # not subject to the umask
            if owner is not None:
                os.fchown(fd, *owner)
            os.write(fd, data)
            os.fsync(fd)
        os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    finally:
        os.unlink(tmp, dir_fd=dir_fd)


def list_names(directory) -> list:
    """Names of the slices in the node directory (sorted); none if it does not exist."""
    try:
        node_fd = _open_node(directory)
    except NotFound:
        return []
    with _fd(node_fd):
        names = []
        for entry in os.scandir(node_fd):
            if valid_name(entry.name) and entry.is_dir(follow_symlinks=False):
                try:
                    os.stat(f"{entry.name}/{QUOTA}", dir_fd=node_fd, follow_symlinks=False)
                except OSError:
                    continue
                names.append(entry.name)
        return sorted(names)
