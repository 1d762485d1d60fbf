"""inotify on slices' usage files, through libc: who learns of a process of a slice
opening or closing its usage file without reading every file (the node agent, the
autoscaler's reaps).  Every shim process opens its usage file read-write, so a close
after writing is a process that left the slice (ended, or exec'd): its slot may be dead.
The event comes before its lock is let go (the kernel's __fput notifies, then removes
the file's locks), so whoever acts on one looks again a moment later."""
import os
import struct

# <sys/inotify.h>
IN_OPEN, IN_CLOSE_WRITE, IN_Q_OVERFLOW, IN_IGNORED = 0x20, 0x8, 0x4000, 0x8000
IN_DONT_FOLLOW = 0x02000000
_EVENT = struct.Struct("iIII")


class Inotify:
    """Watches for `mask` on files, each under a name (a slice); events() says which."""

    def __init__(self, mask):
        import ctypes
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.mask = mask
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.names = {}          # watch descriptor -> name
        self.wds = {}            # name -> watch descriptor
        self.overflowed = False  # events were lost (the queue was full) since the last events()

    def watch(self, name, path, follow=False):
        """Watch the file at `path` (a symbolic link itself unless `follow`: a container
        could point one anywhere) as `name`, instead of what `name` watched before."""
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), self.mask | (0 if follow else IN_DONT_FOLLOW))
        if wd < 0:
            return False
        if self.wds.get(name) != wd:     # (the same file watched again has the same descriptor: kept)
            self.unwatch(name)
        self.names[wd], self.wds[name] = name, wd
        return True

    def watch_fd(self, name, fd):
        """Watch the file open on descriptor `fd`: exactly the file read through it, even
        where another has been put at its path since."""
        return self.watch(name, f"/proc/self/fd/{fd}", follow=True)

    def unwatch(self, name):
        wd = self.wds.pop(name, None)
        if wd is not None and self.names.pop(wd, None) is not None:
            self._libc.inotify_rm_watch(self.fd, wd)

    def events(self):
        """[(name, mask)] of what happened since the last call (overflowed: some were lost)."""
        out = []
        self.overflowed = False
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
                if mask & IN_Q_OVERFLOW:
                    self.overflowed = True
                elif mask & IN_IGNORED:
                    if name is not None:
                        del self.names[wd]
                        self.wds.pop(name, None)
                elif name is not None:
                    out.append((name, mask))

    def close(self):
        if getattr(self, "fd", -1) >= 0:     # (-1, or unset: __init__ failed)
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:   # (at interpreter exit a module's names may be gone already)
            pass


def open_inotify(mask):
    """An Inotify, or None where there is none (not Linux, or no instance left to make)."""
    try:
        return Inotify(mask)
    except (OSError, AttributeError):
        return None
