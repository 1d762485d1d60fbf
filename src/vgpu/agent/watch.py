"""Watching without polling: inotify on the usage files, pidfds in an epoll set, a slice's kept files."""
import os
import select
import struct
import time

from .. import podlabels, slices
from .settings import RECENT_NS
from .usage import UsageReader


# === inotify: a process of a slice opening or closing its usage file ===

IN_OPEN, IN_CLOSE_WRITE, IN_IGNORED, IN_DONT_FOLLOW = 0x20, 0x8, 0x8000, 0x02000000
_EVENT = struct.Struct("iIII")


class Inotify:
    """Watches usage files for opens (a process joins the slice) and closes after writing
    (one left it: ended, or exec'd; every shim process opens its usage file read-write),
    so a dead process's slot is reaped when it goes, whatever pid namespace it lived in.
    None of this is needed for correctness -- every slice is also looked at every
    SWEEP_LOOKS looks -- only for speed; without inotify every look reads every slice."""

    def __init__(self):
        import ctypes
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.names = {}          # watch descriptor -> slice
        self.wds = {}            # slice -> watch descriptor

    def watch(self, name, path):
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), IN_OPEN | IN_CLOSE_WRITE | IN_DONT_FOLLOW)
        if wd < 0:
            return False
        self.unwatch(name)
        self.names[wd], self.wds[name] = name, wd
        return True

    def unwatch(self, name):
        wd = self.wds.pop(name, None)
        if wd is not None and self.names.pop(wd, None) is not None:
            self._libc.inotify_rm_watch(self.fd, wd)

    def events(self):
        """[(slice, mask)] of what happened since the last call."""
        out = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            at = 0
            while at + _EVENT.size <= len(data):
                wd, mask, _, n = _EVENT.unpack_from(data, at)
                at += _EVENT.size + n
                name = self.names.get(wd)
                if mask & IN_IGNORED:
                    if name is not None:
                        del self.names[wd]
                        self.wds.pop(name, None)
                elif name is not None:
                    out.append((name, mask))

    def close(self):
        os.close(self.fd)


def _inotify():
    try:
        return Inotify()
    except (OSError, AttributeError):
        return None


# === the observer ===

class _Poller:
    """epoll where there is one (Linux), else poll: register(fd), unregister(fd),
    poll(timeout in seconds) -> [(fd, events)]."""

    def __init__(self):
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._poll = None if self._epoll is not None else select.poll()

    def register(self, fd):
        if self._epoll is not None:
            self._epoll.register(fd, select.EPOLLIN)
        else:
            self._poll.register(fd, select.POLLIN)

    def unregister(self, fd):
        (self._epoll or self._poll).unregister(fd)

    def poll(self, timeout=0.0):
        if self._epoll is not None:
            return self._epoll.poll(timeout, 256)
        return self._poll.poll(timeout * 1000)

    def close(self):
        if self._epoll is not None:
            self._epoll.close()


class _SliceFiles:
    """A slice's files as the observer keeps them: the usage descriptor (the reader's),
    the usage and identity files' inodes."""
    __slots__ = ("view", "usage_inode", "identity_inode", "checked", "reader", "devices", "want_full", "same",
                 "index", "keys", "rw", "pod_uid", "gen", "places", "by_place", "dir_mtime")
    made = 0

    def __init__(self, view, directory):
        self.view = view
        self.reader = UsageReader()
        self.devices = tuple(d for d, _ in view.held)
        self.gen = view.gen
        self.want_full = False
        self.same = None         # (state, slots, table rows, watched, tracked version if all are): an unchanged look
        self.keys = ((), ())     # its keys in the observer's table and slot index
        self.rw = None           # a read-write descriptor for reaping, opened when first needed
        _SliceFiles.made += 1
        self.index = _SliceFiles.made   # spreads the sweeps of idle slices over the looks
        self.places = self.by_place = None   # {quota device: Place} and back, as of the last look at it
        self.dir_mtime = None
        self.usage_inode = None
        if view._ufd is not None:
            st = os.fstat(view._ufd)
            self.usage_inode = (st.st_dev, st.st_ino)
        self.identity_inode = None
        self.checked = None
        self.check_identity(directory)

    def close(self):
        if self.rw is not None:
            os.close(self.rw)
            self.rw = None

    def changed(self, directory) -> bool:
        """Has the slice's directory changed since the last check_identity (a file made in it:
        the identity file by `env`, the DRA driver's labels)?  One stat."""
        try:
            mtime = os.stat(os.path.join(directory, self.view.name), follow_symlinks=False).st_mtime_ns
        except OSError:
            return True
        return mtime != self.dir_mtime

    def check_identity(self, directory, now=None):
        try:
            self.dir_mtime = os.stat(os.path.join(directory, self.view.name), follow_symlinks=False).st_mtime_ns
            if time.time_ns() - self.dir_mtime < RECENT_NS:
                self.dir_mtime = None    # (timestamps are coarse: a file made in the same tick would go unseen)
        except OSError:
            self.dir_mtime = None
        try:
            st = os.stat(os.path.join(directory, self.view.name, slices.IDENTITY), follow_symlinks=False)
            self.identity_inode = (st.st_dev, st.st_ino)
        except OSError:
            self.identity_inode = None
        self.pod_uid = podlabels.read(directory, self.view.name).get("pod_uid")
        self.checked = now


def _lock_start(line, ino):
    """The first byte of the lock an fdinfo "lock:" line describes, if it is on inode `ino`
    ("lock:\t1: OFDLCK ADVISORY WRITE -1 fe:00:<ino> <start> <end>"); else None."""
    fields = line.split()
    for i, f in enumerate(fields[:-1]):
        if f.count(":") == 2 and f.rsplit(":", 1)[1] == str(ino) and fields[i + 1].isdigit():
            return int(fields[i + 1])
    return None
