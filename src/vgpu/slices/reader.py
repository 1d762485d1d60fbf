"""Every slice of a node, read cheaply and often: the autoscaler, the node agent and the
metrics share one NodeReader.  A slice's quota is mapped read-only (only the controller
writes it) and read as a seqlock; its usage file is read with pread on a kept descriptor
(never mapped: see vgpu.slices.usage).  A loop over 1,000 slices costs a load and a read per
slice, not file opens."""
import math
import mmap
import os
import time

from .. import slices
from . import usage
from .._region import ffi, lib
from ..policy import Bounds
from ..quantities import UNLIMITED

RESCAN_S = 30.0        # look for new / removed slices at least this often (and when the directory changes)
RECENT_NS = 100_000_000   # a directory changed this recently (0.1 s: timestamps move by the jiffy) is scanned again next time

_UNREAD = object()
_NO_COUNTERS = (0,) * len(usage.COUNTERS)


class SliceView:
    """One slice's files, kept open: the quota mapped read-only (only the controller
    writes it; containers mount it read-only), the usage file read with pread on a kept
    descriptor -- never mapped, because a container can truncate its own usage file, and
    touching a mapping beyond the end of a file is SIGBUS: that would end the node's
    autoscaler and metrics."""

    def __init__(self, directory, node_fd, name):
        self.name = name
        shown = os.path.join(slices.node_dir(directory), name)
        self._ufd = None
        cfd = slices._open_slice(node_fd, directory, name)
        try:
            qfd = slices._open_in(cfd, slices.QUOTA, slices._RO, os.path.join(shown, slices.QUOTA))
            try:
                self.quota = slices._read_quota_fd(qfd, os.path.join(shown, slices.QUOTA))
                st = os.fstat(qfd)
                self.ident = (st.st_dev, st.st_ino)
                self._qmm = mmap.mmap(qfd, slices.QUOTA_SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
            finally:
                os.close(qfd)
            try:
                ufd = slices._open_in(cfd, slices.USAGE, slices._RO, os.path.join(shown, slices.USAGE))
            except FileNotFoundError:
                ufd = None
            if ufd is not None:
                try:
                    slices._check_regular(ufd, os.path.join(shown, slices.USAGE), slices.USAGE_SIZE)
                    usage.check_header(os.pread(ufd, usage.HEADER.size, 0), os.path.join(shown, slices.USAGE))
                except BaseException:
                    os.close(ufd)
                    raise
                self._ufd = ufd
        finally:
            os.close(cfd)
        ust = os.fstat(self._ufd) if self._ufd is not None else None
        self.usage_ident = (ust.st_dev, ust.st_ino) if ust else None   # the usage file it reads
        self._q = ffi.cast("struct vgpu_quota *", ffi.from_buffer(self._qmm))
        self._gen_p = ffi.cast("uint64_t *", ffi.addressof(self._q, "generation"))
        self.gen = self.quota.generation
        self.state = {}          # the autoscaler's per-device state (autoscale._Dev)
        self.host_pids = None    # (when, [host pids]) for NVML's per-process view
        self.directory = directory
        self._mig = _UNREAD
        self._held()

    @property
    def mig(self):
        """The slice's MIG record (vgpu.mig) or None for a software slice; {} for a record
        that cannot be read.  Read once: the record is placed before the quota and never
        changes (a slice made again is a new view).  A MIG slice's quota device 0 is its
        MIG device, not the node's GPU 0."""
        if self._mig is _UNREAD:
            try:                 # (one stat for a software slice: a node's first look opens 1,000 of them)
                os.stat(os.path.join(slices.node_dir(self.directory), self.name, slices.MIG), follow_symlinks=False)
                self._mig = slices.read_mig(self.directory, self.name)
            except (FileNotFoundError, NotADirectoryError, slices.NotFound):
                self._mig = None
            except (slices.VgpuError, OSError):
                self._mig = {}
        return self._mig

    def _held(self):
        self.held = [(d, self.quota.devices[d]) for d in self.quota.held()]
        # what the autoscaler moves: a capped memory (or a share) whose request is below its limit
        self.rows = [(d, q, 0 < q.memory_max != UNLIMITED and q.memory_request < q.memory_limit,
                      q.sm_max > 0 and q.sm_request < q.sm_limit,
                      Bounds(q.memory_request, q.memory_limit), Bounds(q.sm_request, q.sm_limit))
                     for d, q in self.held]
        self.managed = {r[0] for r in self.rows if r[2] or r[3]}

    def refresh_quota(self) -> bool:
        """Re-read the quota if its generation moved (seqlock read of the mapping).
        True when it changed."""
        g = lib.vgpu_load_u64(self._gen_p)
        if g == self.gen or g % 2:
            return False     # unchanged, or a write in progress: next time
        snap = ffi.new("struct vgpu_quota *")
        ffi.memmove(snap, self._q, slices.QUOTA_SIZE)
        if lib.vgpu_load_u64(self._gen_p) != g or snap.device_count > slices.MAX_DEVICES:
            return False
        self.quota = slices._quota_from(snap)
        self.gen = g
        self._held()
        return True

    def read(self, d):
        """Device d's counters, a tuple in usage.COUNTERS order; zeros without a usage file;
        None when the file has been cut short (its container's doing: skip it)."""
        return _NO_COUNTERS if self._ufd is None else usage.read_counters(self._ufd, d)

    def has_dead_slot(self) -> bool:
        """Has a process of the slice ended (or is it ending) without its slot reaped yet?
        Asked of the usage file as this view opened it; True without one (the reap looks)."""
        return self._ufd is None or usage.has_dead_slot(self._ufd)

    def watch_closes(self, inotify) -> bool:
        """Have `inotify` (vgpu.inotify) report the closes of the usage file this view reads."""
        return self._ufd is not None and inotify.watch_fd(self.name, self._ufd)

    def close(self):
        if getattr(self, "_ufd", None) is not None:     # (unset: __init__ failed)
            os.close(self._ufd)
            self._ufd = None
        self._q = self._gen_p = None      # the mapping goes when its last reference does

    def __del__(self):
        # a view dropped without close() (its reader forgotten) must not keep its descriptor:
        # a long-lived process making readers would run out of them
        try:
            self.close()
        except Exception:   # (at interpreter exit a module's names may be gone already)
            pass


def _raise_open_files_limit():
    """One descriptor per slice is kept open: let the soft limit go up to the hard one."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    except (ImportError, ValueError, OSError):
        pass


class NodeReader:
    """Every slice of a node directory, opened once; new and removed slices are found
    when the directory changes (and every RESCAN_S), and so is a usage file made again
    under a slice (a view reads the file it opened)."""

    def __init__(self, directory):
        _raise_open_files_limit()
        self.directory = slices.node_dir(directory)
        self.views = {}          # name -> SliceView
        self.problems = {}       # name -> why it cannot be read
        self.changes = 0         # counts the views made and dropped (a view made again is both)
        self._mtime = None
        self._scanned = -math.inf

    def refresh(self, now=None):
        now = time.monotonic() if now is None else now
        try:
            mtime = os.stat(self.directory).st_mtime_ns
        except FileNotFoundError:
            mtime = None
        if mtime == self._mtime and now - self._scanned < RESCAN_S:
            return self.views
        # (timestamps are coarse: a slice made within the same tick as the scan would leave
        # the mtime as it was, so a recent one is not trusted and the next call scans again)
        self._mtime = None if mtime is not None and time.time_ns() - mtime < RECENT_NS else mtime
        self._scanned = now
        found = {}               # name -> (st_dev, st_ino) of its quota file
        node_fd = None
        if mtime is not None:
            try:
                node_fd = slices._open_node(self.directory)
            except slices.NotFound:
                node_fd = None
        if node_fd is None:
            for gone in list(self.views):
                self.views.pop(gone).close()
                self.changes += 1
            self.problems = {}
            return self.views
        try:
            for entry in os.scandir(node_fd):      # as slices.list_names, one stat per slice
                if not (slices.valid_name(entry.name) and entry.is_dir(follow_symlinks=False)):
                    continue
                try:
                    st = os.stat(f"{entry.name}/{slices.QUOTA}", dir_fd=node_fd, follow_symlinks=False)
                except OSError:
                    continue
                try:     # (a container can remove its usage file; its shim makes another)
                    ust = os.stat(f"{entry.name}/{slices.USAGE}", dir_fd=node_fd, follow_symlinks=False)
                    usage_ident = (ust.st_dev, ust.st_ino)
                except OSError:
                    usage_ident = None
                found[entry.name] = ((st.st_dev, st.st_ino), usage_ident)
            for gone in set(self.views) - set(found):
                self.views.pop(gone).close()
                self.changes += 1
            self.problems = {k: v for k, v in self.problems.items() if k in found}
            for name, (ident, usage_ident) in sorted(found.items()):
                v = self.views.get(name)
                if v is not None and v.ident == ident and v.usage_ident == usage_ident:
                    continue
                if v is not None:    # the slice made again, or its usage file: a new view, read from the start
                    self.views.pop(name).close()
                    self.changes += 1
                try:
                    self.views[name] = SliceView(self.directory, node_fd, name)
                    self.changes += 1
                    self.problems.pop(name, None)
                except (slices.VgpuError, OSError) as e:
                    self.problems[name] = str(e)
        finally:
            os.close(node_fd)
        return self.views
