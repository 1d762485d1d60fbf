"""install-shim: put the shim in a host directory that containers mount read-only.

Each file is written to a temporary name in the destination directory, flushed to disk
and renamed over the old one.  A rename swaps the directory entry in one step: a container
starting, or a process dlopening the library, finds the old file or the new one, never a
half-written one; and processes (and file bind mounts) that hold the old library keep its
inode, whose pages nobody rewrites.  (`cp` over a mapped library rewrites those pages
under the processes using it: at best they crash.)  A file that already has the right
contents is left alone, so running the install again — every time the node agent
starts — changes nothing.
"""
import errno
import hashlib
import os
import stat
import tempfile

from .paths import shim_path
from .runtime import CONTAINER_SHIM

SHIM_NAME = "libvgpu.so"
PRELOAD_NAME = "ld.so.preload"


class InstallError(Exception):
    def __init__(self, message, hint=None):
        super().__init__(message)
        self.hint = hint


def preload_line(container_path=CONTAINER_SHIM) -> bytes:
    """The contents of an ld.so.preload naming the shim at its path in the container."""
    if not os.path.isabs(container_path) or any(c in container_path for c in " \t\n:"):
        raise InstallError(f"{container_path!r} cannot be named in ld.so.preload",
                           "an absolute path without blanks or ':'")
    return (container_path + "\n").encode()


def _same(path, data) -> bool:
    """Is path a plain file holding exactly data?"""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != len(data):
            return False
        with open(path, "rb") as f:
            return f.read() == data
    except FileNotFoundError:
        return False


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def place(dest, name, data: bytes, mode=0o644) -> dict:
    """Write data to dest/name atomically (temporary file, fsync, rename); unchanged
    contents are not rewritten (only the mode is corrected)."""
    target = os.path.join(dest, name)
    info = {"path": target, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if _same(target, data):
        if stat.S_IMODE(os.stat(target).st_mode) != mode:
            os.chmod(target, mode)
        return {**info, "changed": False}
    fd, tmp = tempfile.mkstemp(dir=dest, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(dest)
    return {**info, "changed": True}


def install_shim(dest, preload_file=False, source=None, container_path=CONTAINER_SHIM) -> dict:
    """Copy the shim (default: the one built into this package) to dest/libvgpu.so and,
    with preload_file, write dest/ld.so.preload naming container_path (where the shim is
    mounted in containers).  Creates dest (0755) if its parent exists."""
    source = str(source or shim_path())
    dest = os.path.abspath(dest)
    try:
        with open(source, "rb") as f:
            lib = f.read()
    except OSError as e:
        raise InstallError(f"cannot read the shim {source}: {e.strerror}",
                           "reinstall vgpu (`pip install vgpu`, or `make venv` in a checkout)") from None
    line = preload_line(container_path) if preload_file else None
    try:
        if not os.path.isdir(dest):
            if os.path.lexists(dest):
                raise InstallError(f"{dest} exists and is not a directory", "choose a directory")
            os.mkdir(dest, 0o755)
        files = [place(dest, SHIM_NAME, lib, 0o755)]
        if line is not None:
            files.append(place(dest, PRELOAD_NAME, line, 0o644))
    except PermissionError:
        raise InstallError(f"cannot write {dest}: permission denied",
                           "run as root (a node's shim directory, e.g. /opt/vgpu, is root's) "
                           "or choose a directory you can write") from None
    except FileNotFoundError as e:
        if not os.path.isdir(os.path.dirname(dest)):
            raise InstallError(f"cannot create {dest}: its parent directory does not exist",
                               f"create {os.path.dirname(dest)} first") from None
        raise InstallError(f"cannot write {dest}: {e.strerror}", "choose a writable directory on the host") from None
    except OSError as e:
        what = "read-only file system" if e.errno == errno.EROFS else (e.strerror or str(e))
        raise InstallError(f"cannot write {dest}: {what}",
                           "choose a writable directory on the host") from None
    return {"dest": dest, "source": source, "container_path": container_path, "files": files}
