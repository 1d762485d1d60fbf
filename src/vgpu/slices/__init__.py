"""A node's slices: the quota and usage files under the node directory.

    <dir>/<name>/quota   written here, mapped read-only by the shim (csrc/vgpu_region.h)
    <dir>/<name>/usage   written by the shim processes of the slice, read (and reaped) here

Plain functions that return data; vgpu.cli is the command line over them.

Safety rules, all enforced here:
  - names follow the shim's rule (letters, digits, '-', '_', '.', not starting with '.'
    or '-', under 64 characters), so a name is always one path component;
  - below the node directory nothing is followed: the slice directory and its files are
    opened relative to directory descriptors with O_NOFOLLOW, and a file that is not a
    plain, singly linked file of the right size is refused;
  - files appear atomically (written under a temporary name, then hard-linked into
    place, which never replaces an existing file);
  - a resize rewrites the quota IN PLACE: the shim (and a container's bind mount) holds
    the file's inode, so a rename would go unseen.  Writers take an flock on the quota
    file; the generation is odd while fields are being written and even when done, so
    readers that see an even, unchanged generation saw one consistent quota;
  - operations that check the whole node (overcommit) hold an flock on the node
    directory, so two controllers cannot both squeeze into the last free gigabyte.
"""
import contextlib
import errno
import fcntl
import json
import os
import stat
import time
from dataclasses import replace

from .. import board
from ..errors import (BadFile, Busy, CapacityUnknown, Changed, Exists, InvalidRequest, NotFound,  # noqa: F401
                      Overcommitted, VgpuError)   # (re-exported: callers name them slices.X)
from .._region import ffi, lib
from ..quantities import SHARE_FULL, UNLIMITED, format_memory, format_share
from .files import (BURST, CEILING, IDENTITY, LABELS, MAX_DEVICES, MAX_PROCS, MIG, QUOTA, QUOTA_SIZE, _RO, _RW,
                    USAGE, USAGE_SIZE, _check_header, check_name, _check_regular, _fd, list_names, _mapped,
                    node_dir, _new_node_locked, _node_lock, _open_in, _open_node, _open_slice, _permission,
                    _place, slot_alive)
from .quota import DeviceQuota, Owner, Quota, _fill_device, _quota_from, check_sm_mode, quota_bytes
from .usage import _read_slice_usage, read_usage
# re-exported: callers name these slices.X
from .files import DEFAULT_DIR, LOCK_BASE, SM_MODES, _flock_struct, auto_name, paths, valid_name  # noqa: F401
from .quota import DENIED  # noqa: F401
from .usage import Usage  # noqa: F401
from .reaping import _reap_slot, reap, reap_quietly, reap_slice  # noqa: F401


# === reading ===

def _read_quota_fd(fd, shown) -> Quota:
    """Seqlock read: an even generation, unchanged across the copy, is one whole write."""
    _check_regular(fd, shown, QUOTA_SIZE)
    with _mapped(fd, "struct vgpu_quota", QUOTA_SIZE, writable=False) as q:
        _check_header(q, lib.VGPU_QUOTA_MAGIC, QUOTA_SIZE, shown)
        gen_p = ffi.cast("uint64_t *", ffi.addressof(q, "generation"))
        deadline = time.monotonic() + 2.0
        while True:
            g1 = lib.vgpu_load_u64(gen_p)
            snap = ffi.new("struct vgpu_quota *")
            ffi.memmove(snap, q, QUOTA_SIZE)
            if g1 % 2 == 0 and lib.vgpu_load_u64(gen_p) == g1:
                break
            if g1 % 2 and _no_writer(fd):
                break   # a writer died half-way: its values are what there is (the next write evens it)
            if time.monotonic() > deadline:
                raise BadFile(f"{shown} keeps changing", "try again")
            time.sleep(0.0005)
    if snap.device_count > MAX_DEVICES:
        raise BadFile(f"{shown} claims {snap.device_count} devices (max {MAX_DEVICES})",
                      "delete the slice and create it again")
    return _quota_from(snap)


def _no_writer(fd) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def read_quota(directory, name) -> Quota:
    with _fd(_open_node(directory, name=name)) as node_fd, _fd(_open_slice(node_fd, directory, name)) as cfd:
        return _read_slice_quota(cfd, directory, name)


def _open_quota(cfd, directory, name, flags):
    """(fd, shown path) of the slice's quota file; NotFound when it has none."""
    shown = os.path.join(node_dir(directory), name, QUOTA)
    try:
        return _open_in(cfd, QUOTA, flags, shown), shown
    except FileNotFoundError:
        raise NotFound(f"slice {name} has no quota file ({shown})",
                       "delete it and create it again") from None


def _read_slice_quota(cfd, directory, name):
    fd, shown = _open_quota(cfd, directory, name, _RO)
    with _fd(fd):
        return _read_quota_fd(fd, shown)


def has_mig(directory, name) -> bool:
    """Is `name` a MIG slice (its directory holds a MIG record)?"""
    try:
        os.stat(os.path.join(node_dir(directory), check_name(name), MIG), follow_symlinks=False)
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False


def read_mig(directory, name):
    """A MIG slice's record (vgpu.mig writes it), or None for a software slice."""
    with _fd(_open_node(directory, name=name)) as node_fd, _fd(_open_slice(node_fd, directory, name)) as cfd:
        shown = os.path.join(node_dir(directory), name, MIG)
        try:
            fd = _open_in(cfd, MIG, _RO, shown)
        except FileNotFoundError:
            return None
        with _fd(fd):
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size > 65536:
                raise BadFile(f"{shown} is not a plain file with one link of a MIG record; refusing it",
                              "remove it by hand; the MIG instance it named is left (nvidia-smi mig -lgi)")
            data = os.pread(fd, st.st_size, 0)
    try:
        record = json.loads(data)
        if not isinstance(record, dict) or not isinstance(record.get("uuid"), str):
            raise ValueError("not a MIG record")
    except ValueError as e:
        raise BadFile(f"{shown} is not a MIG record ({e})",
                      "remove it by hand; the MIG instance it named is left (nvidia-smi mig -lgi)") from None
    return record


def read_all(directory) -> list:
    """[(name, Quota or None, Usage or None, problem or None)] for every slice."""
    out = []
    for name in list_names(directory):
        quota = usage = problem = None
        try:
            quota = read_quota(directory, name)
            reap_quietly(directory, name)
            usage = read_usage(directory, name)
        except VgpuError as e:
            problem = str(e)
        out.append((name, quota, usage, problem))
    return out


# === overcommit ===

def _guaranteed_by_others(directory, exclude) -> dict:
    """device -> bytes guaranteed by every other slice (unreadable ones count as 0)."""
    total = {}
    for name in list_names(directory):
        if name == exclude or has_mig(directory, name):   # a MIG slice's device 0 is its instance
            continue
        try:
            q = read_quota(directory, name)
        except VgpuError:
            continue
        for d in q.held():
            total[d] = total.get(d, 0) + q.devices[d].guaranteed_memory
    return total


def _check_overcommit(directory, name, old: dict, new: dict, capacity):
    """Refuse growing any device's guaranteed memory above its capacity.  `old`/`new`:
    device -> DeviceQuota; `capacity(d)` -> bytes, None for a device the node does not
    have (nothing there to overcommit), or raises CapacityUnknown."""
    others = None
    for d, q in sorted(new.items()):
        before = old[d].guaranteed_memory if d in old else 0
        if q.guaranteed_memory <= before:
            continue    # shrinking (or equal) is always allowed, even on an overcommitted device
        if capacity is None:
            raise CapacityUnknown(f"cannot check device {d}'s capacity: no capacity source",
                                  "pass --overcommit to skip the check")
        cap = capacity(d)
        if cap is None:
            continue
        if others is None:
            others = _guaranteed_by_others(directory, name)
        want = others.get(d, 0) + q.guaranteed_memory
        if want > cap:
            raise Overcommitted(
                f"device {d} would be overcommitted: {format_memory(want)} guaranteed "
                f"({name} {format_memory(q.guaranteed_memory)} + others {format_memory(others.get(d, 0))}) "
                f"> {format_memory(cap)} physical",
                "shrink other slices, ask for less, or pass --overcommit")


def _check_exists(devices, capacity, count_hint):
    """A new slice's devices must exist, where the capacity source can tell."""
    for d in sorted(devices):
        try:
            missing = capacity is not None and capacity(d) is None
        except CapacityUnknown:
            return
        if missing:
            raise InvalidRequest(f"device {d} does not exist{count_hint()}", "pass a --device the node has")


def _check_order(d, q: DeviceQuota):
    if not q.memory_request <= q.memory_max <= q.memory_limit:
        raise InvalidRequest(
            f"device {d}: memory request {format_memory(q.memory_request)} <= max {format_memory(q.memory_max)}"
            f" <= limit {format_memory(q.memory_limit)} does not hold",
            "set --request / --limit so that request <= memory <= limit")
    if not q.sm_request <= q.sm_max <= q.sm_limit:
        raise InvalidRequest(
            f"device {d}: SM request {format_share(q.sm_request)} <= max {format_share(q.sm_max)}"
            f" <= limit {format_share(q.sm_limit)} does not hold",
            "set --sm-request / --sm-limit so that request <= sm <= limit")


def device_quota(memory=UNLIMITED, sm=SHARE_FULL, request=None, limit=None, sm_request=None, sm_limit=None):
    """A device's quota from command-line values: request and limit default to the cap."""
    return DeviceQuota(memory, memory if request is None else request, memory if limit is None else limit,
                       sm, sm if sm_request is None else sm_request, sm if sm_limit is None else sm_limit)


# === create / delete ===

def create(directory, name, devices: dict, overcommit=False, capacity=None, owner=None,
           count_hint=lambda: "", temporary: Owner = None, extra_files=None, sm_mode=None) -> Quota:
    """Create slice `name` holding `devices` (index -> DeviceQuota).

    Files: <dir>/<name>/ 0755, quota 0644 (only the controller writes it), usage 0666 so
    a container process of any uid can map it read-write -- or, with owner=(uid, gid),
    0600 owned by that user; identity 0644 (the name, mounted into containers).
    temporary: the Owner of a slice made for one command (the node agent removes it once
    the owner and the slice's processes are gone).  extra_files: {name: bytes} placed
    (0644) before the quota, so the slice never appears without them (a MIG slice's MIG).
    sm_mode: BURST (default) or CEILING.  The node's share board (board.py) is made with
    the first slice, 0666 like a usage file: every slice's shim writes its own entries."""
    check_name(name)
    check_sm_mode(sm_mode or BURST)
    if not devices:
        raise InvalidRequest("a slice needs at least one device", "pass --device")
    for d, q in devices.items():
        if not 0 <= d < MAX_DEVICES:
            raise InvalidRequest(f"device {d} is out of range (0..{MAX_DEVICES - 1})", "pass --device 0, 1, ...")
        if not q.held:
            raise InvalidRequest(f"device {d}: a memory cap and SM share of 0 hold nothing",
                                 "give it memory or a share, or leave the device out")
        _check_order(d, q)
    if not overcommit:
        _check_exists(devices, capacity, count_hint)
    path = node_dir(directory)
    with _new_node_locked(directory) as node_fd:
        if not overcommit:
            _check_overcommit(directory, name, {}, devices, capacity)
        if not _exists(node_fd, board.BOARD):
            with contextlib.suppress(FileExistsError):
                _place(node_fd, board.BOARD, board.empty(), 0o666, os.path.join(path, board.BOARD))
        try:
            os.mkdir(name, 0o755, dir_fd=node_fd)
        except FileExistsError:
            pass    # a left-over directory is reused; an existing quota is refused below
        except PermissionError:
            raise _permission(os.path.join(path, name), "create") from None
        with _fd(_open_slice(node_fd, directory, name)) as cfd:
            os.fchmod(cfd, 0o755)
            shown = os.path.join(path, name)
            if _exists(cfd, QUOTA):
                raise Exists(f"slice {name} already exists in {path}",
                             f"resize it (vgpu-ctl resize {name} ...) or delete it first")
            # usage first: the quota's appearance is what makes the slice usable
            usage = ffi.new("struct vgpu_usage *")
            usage.magic, usage.abi_version, usage.size = lib.VGPU_USAGE_MAGIC, lib.VGPU_ABI_VERSION, USAGE_SIZE
            try:
                _place(cfd, USAGE, bytes(ffi.buffer(usage)), 0o600 if owner else 0o666,
                       os.path.join(shown, USAGE), owner)
            except FileExistsError:
                _read_slice_usage(cfd, directory, name)   # a valid left-over is kept; anything else refused
            _ensure_identity(cfd, name, os.path.join(shown, IDENTITY))
            for extra, data in (extra_files or {}).items():
                with contextlib.suppress(FileNotFoundError):   # left by a create that died before its quota
                    os.unlink(extra, dir_fd=cfd)
                _place(cfd, extra, data, 0o644, os.path.join(shown, extra))
            # a MIG device's context is not a whole GPU's, and is not measured
            overheads = {} if MIG in (extra_files or {}) else _measured_context_overhead(directory)
            try:
                _place(cfd, QUOTA, quota_bytes(name, devices, temporary, sm_mode, overheads), 0o644,
                       os.path.join(shown, QUOTA))
            except FileExistsError:
                raise Exists(f"slice {name} already exists in {path}",
                             f"resize it (vgpu-ctl resize {name} ...) or delete it first") from None
            return _read_slice_quota(cfd, directory, name)


def _measured_context_overhead(directory) -> dict:
    """{GPU index: bytes} as `vgpu-ctl measure-context` found them on this node; {} when never
    measured, or when its file is unreadable (the shim then measures, as without one)."""
    from .. import overhead   # (it reads slices)
    try:
        return overhead.read(directory)
    except (overhead.BadFigures, OSError):
        return {}


def absent_node_files(directory) -> dict:
    """Which of the node's own files do not exist yet: the node directory ("dir") and the
    share board ("board"), both made with a first slice.  Taken before a temporary slice
    is made, for tidy_node after it."""
    path = node_dir(directory)
    return {"dir": not os.path.isdir(path), "board": not os.path.lexists(os.path.join(path, board.BOARD))}


def tidy_node(directory, made: dict):
    """Take away what making a temporary slice added to the node (`made`: absent_node_files
    from before it), once no slice is left: the share board, then the node directory if
    nothing else is in it.  A temporary slice leaves the node as it found it.  Under the
    node lock, so a slice made meanwhile keeps both (a create that loses the directory
    makes it again)."""
    if not made.get("board"):
        return
    try:
        node_fd = _open_node(directory)
    except VgpuError:
        return
    with _fd(node_fd), _node_lock(node_fd):
        if any(valid_name(e.name) and e.is_dir(follow_symlinks=False) for e in os.scandir(node_fd)):
            return               # a slice (or one being made): the node is in use
        with contextlib.suppress(FileNotFoundError):
            os.unlink(board.BOARD, dir_fd=node_fd)
        if made.get("dir"):      # (a directory made then had no board either)
            with contextlib.suppress(OSError):   # not empty: something else lives there now
                os.rmdir(node_dir(directory))


def identity_bytes(name) -> bytes:
    return f"{check_name(name)}\n".encode()


def _ensure_identity(cfd, name, shown):
    try:
        _place(cfd, IDENTITY, identity_bytes(name), 0o644, shown)
    except FileExistsError:
        pass


def ensure_identity(directory, name) -> str:
    """The slice's identity file (made if a slice from before it has none); its path."""
    with _fd(_open_node(directory, name=name)) as node_fd, _fd(_open_slice(node_fd, directory, name)) as cfd:
        shown = os.path.join(node_dir(directory), name, IDENTITY)
        _ensure_identity(cfd, name, shown)
        return shown


def _exists(dir_fd, name):
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _live_pids(cfd, directory, name) -> list:
    """Pids of the live processes of a slice; judged by the slot locks alone when the
    usage file is damaged (pid then -1), so a broken slice can still be deleted safely."""
    try:
        usage = _read_slice_usage(cfd, directory, name)
        return [p.pid for p in usage.procs if p.alive] if usage else []
    except BadFile:
        with _fd(_open_in(cfd, USAGE, _RO, USAGE)) as fd:
            return [-1 for i in range(MAX_PROCS) if slot_alive(fd, i)]


def delete(directory, name, force=False) -> dict:
    """Remove slice `name`.  Refused while processes use it, unless force (they keep
    running on the unlinked files, invisible to the controller)."""
    with _fd(_open_node(directory, name=name)) as node_fd, _node_lock(node_fd):
        with _fd(_open_slice(node_fd, directory, name)) as cfd:
            live = _live_pids(cfd, directory, name)
            if live and not force:
                raise Busy(f"slice {name} has {len(live)} live process(es) (pid {', '.join(map(str, live))})",
                           "stop them first, or pass --force")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(IDENTITY, dir_fd=cfd)
            for entry in os.scandir(cfd):
                if entry.name in (QUOTA, USAGE, LABELS, MIG) or \
                        (entry.name.startswith(".") and entry.name.endswith(".tmp")):
                    try:
                        os.unlink(entry.name, dir_fd=cfd)
                    except PermissionError:
                        raise _permission(os.path.join(node_dir(directory), name, entry.name), "remove") from None
        try:
            os.rmdir(name, dir_fd=node_fd)
        except OSError as e:
            if e.errno != errno.ENOTEMPTY:
                raise
            raise VgpuError(f"{os.path.join(node_dir(directory), name)} holds files vgpu did not make; "
                            "left in place", "remove them by hand") from None
    return {"name": name, "deleted": True, "live_processes": live}


# === resize ===

def resize(directory, name, devices=None, memory=None, sm=None, request=None, limit=None,
           sm_request=None, sm_limit=None, overcommit=False, capacity=None, expect_generation=None,
           sm_mode=None) -> dict:
    """Change a slice's quota in place (devices: indices, default every device it holds).

    Request and limit follow the cap while they equal it, so a slice created with one
    number keeps one number.  Returns old and new quotas per device, the generation, and
    warnings (memory shrunk below what the slice holds: its allocations fail until its use
    drops below the new cap -- nothing is taken away).  sm_mode: switch the slice between
    BURST and CEILING (None: keep it), live like the rest."""
    if sm_mode is not None:
        check_sm_mode(sm_mode)
    with _fd(_open_node(directory, name=name)) as node_fd, _node_lock(node_fd), \
            _fd(_open_slice(node_fd, directory, name)) as cfd:
        fd, shown = _open_quota(cfd, directory, name, _RW)
        with _fd(fd):
            fcntl.flock(fd, fcntl.LOCK_EX)
            current = _read_quota_fd(fd, shown)
            if expect_generation is not None and current.generation != expect_generation:
                # someone (an operator's resize) changed it after the caller decided
                raise Changed(f"slice {name}'s quota changed (generation {expect_generation} -> "
                              f"{current.generation}) since it was read", "decide again from the new quota")
            held = current.held()
            targets = held if devices is None else list(devices)
            for d in targets:
                if d not in held:
                    raise InvalidRequest(f"slice {name} does not hold device {d} (it holds "
                                         f"{', '.join(map(str, held)) or 'none'})",
                                         "resize one of its devices, or create a slice for that device")
            old = {d: current.devices[d] for d in targets}
            new = {d: _resized(old[d], memory, sm, request, limit, sm_request, sm_limit) for d in targets}
            for d, q in new.items():
                if not q.held:
                    raise InvalidRequest(f"device {d}: a memory cap and SM share of 0 hold nothing",
                                         f"delete the slice (vgpu-ctl delete {name}) instead")
                _check_order(d, q)
            if not overcommit:
                _check_overcommit(directory, name, old, new, capacity)
            generation = current.generation
            mode = current.sm_mode if sm_mode is None else sm_mode
            if any(new[d] != old[d] for d in targets) or mode != current.sm_mode:
                generation = _write_devices(fd, new, mode)
            reap_quietly(directory, name)   # the warning is about what live processes hold
            usage = _read_slice_usage(cfd, directory, name)
    warnings = []
    for d in targets:
        used = usage.devices[d]["memory_current"] if usage else 0
        if new[d].memory_max < old[d].memory_max and used > new[d].memory_max:
            warnings.append(f"{name} device {d} holds {format_memory(used)}, above the new memory.max "
                            f"{format_memory(new[d].memory_max)}: its allocations fail until its use drops "
                            "below it")
    return {"name": name, "generation": generation,
            "devices": [{"index": d, "old": old[d].to_json(), "new": new[d].to_json()} for d in targets],
            "sm_mode": {"old": current.sm_mode, "new": mode},
            "changes": [{"device": d, "field": f, "old": old[d].to_json()[f], "new": new[d].to_json()[f]}
                        for d in targets for f in DeviceQuota.__dataclass_fields__
                        if getattr(old[d], f) != getattr(new[d], f)],
            "warnings": warnings}


def carry_context_overhead(directory, figures: dict) -> list:
    """Write a context's measured cost ({GPU index: bytes}) into the quota of every software
    slice holding that GPU, as create does for slices made after the measurement (a MIG
    slice's device is not a whole GPU: left alone).  One atomic store per device, read by
    the shim at a process's first allocation there; the limits and generation are not
    touched.  Returns the names of the slices written."""
    written = []
    for name in list_names(directory):
        try:
            if has_mig(directory, name):
                continue
            with _fd(_open_node(directory, name=name)) as node_fd, _node_lock(node_fd), \
                    _fd(_open_slice(node_fd, directory, name)) as cfd:
                fd, shown = _open_quota(cfd, directory, name, _RW)
                with _fd(fd):
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    held = [d for d in _read_quota_fd(fd, shown).held() if d in figures]
                    with _mapped(fd, "struct vgpu_quota", QUOTA_SIZE, writable=True) as q:
                        for d in held:
                            lib.vgpu_store_u64(ffi.addressof(q.devices[d], "context_overhead"), figures[d])
            if held:
                written.append(name)
        except VgpuError:
            continue   # gone meanwhile, or unreadable: status says why; its processes measure as before
    return written


def _follow(old_value, old_max, new_max, given):
    if given is not None:
        return given
    return new_max if old_value == old_max else old_value


def _resized(q: DeviceQuota, memory, sm, request, limit, sm_request, sm_limit) -> DeviceQuota:
    mem = q.memory_max if memory is None else memory
    share = q.sm_max if sm is None else sm
    return replace(q, memory_max=mem,
                   memory_request=_follow(q.memory_request, q.memory_max, mem, request),
                   memory_limit=_follow(q.memory_limit, q.memory_max, mem, limit),
                   sm_max=share,
                   sm_request=_follow(q.sm_request, q.sm_max, share, sm_request),
                   sm_limit=_follow(q.sm_limit, q.sm_max, share, sm_limit))


def _write_devices(fd, new: dict, sm_mode=None) -> int:
    """Write device quotas (and the SM mode) in place (caller holds the file's flock).
    Each field is one aligned atomic store, which the shim reads with one atomic load: a
    live resize."""
    with _mapped(fd, "struct vgpu_quota", QUOTA_SIZE, writable=True) as q:
        gen_p = ffi.cast("uint64_t *", ffi.addressof(q, "generation"))
        g = lib.vgpu_load_u64(gen_p)
        odd = g + 1 if g % 2 == 0 else g + 2     # after a writer that died half-way, stay odd
        lib.vgpu_store_u64(gen_p, odd)
        for d, dq in new.items():
            _fill_device(q.devices[d], dq)
        if sm_mode is not None:
            flags = (q.flags & ~lib.VGPU_QUOTA_SM_CEILING) | (lib.VGPU_QUOTA_SM_CEILING if sm_mode == CEILING else 0)
            lib.vgpu_store_u32(ffi.addressof(q, "flags"), flags)
        lib.vgpu_store_u64(gen_p, odd + 1)
        return odd + 1
