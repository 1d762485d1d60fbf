"""Watching without polling: pidfds in an epoll set (with the inotify descriptor: vgpu.inotify), a slice's kept files."""
import os
import select
import time

from .. import podlabels, slices
from .settings import RECENT_NS
from .usage import UsageReader


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
