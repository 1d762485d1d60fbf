"""The share board (csrc/vgpu_region.h, shim/board.c): <dir>/.sm-board, where the shims
of every slice on a device say what they are guaranteed, want and are allowed, so that a
burst-mode slice can use what the others leave idle.

The controller creates it with the first slice (slices.create) and it is mounted into
every container beside its slice's files (runtime.mounts).  Host tools only read it, with
pread: any tenant can write it, so what it says is a report (status, metrics), never an
input to a decision about another slice.
"""
import os
import time

from ._region import ffi, lib

BOARD = ".sm-board"
BOARD_SIZE = ffi.sizeof("struct vgpu_board")
_SLICE = ffi.sizeof("struct vgpu_board_slice")
_IDLE_NS = 20_000_000   # shim/board.c BOARD_IDLE_NS
_LIVE_NS = 40_000_000   # shim/board.c BOARD_LIVE_NS: paid-for time is published once a period


def slice_key(name: str) -> int:
    """The shim's key for a slice's entries (FNV-1a of its name, never 0)."""
    h = 14695981039346656037
    for b in name.encode():
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h | 1


def empty() -> bytes:
    b = ffi.new("struct vgpu_board *")
    b.magic, b.abi_version, b.size = lib.VGPU_BOARD_MAGIC, lib.VGPU_ABI_VERSION, BOARD_SIZE
    return bytes(ffi.buffer(b))


def _uuid_text(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def read(directory) -> dict:
    """slice key -> [entry], from the node's board; {} when there is none or it is not a
    board.  Each entry: uuid (as NVML writes a GPU's; a MIG device's reads the same way,
    with GPU- in front), guarantee, ceiling, demand, allowance (1/100 percent) and live
    (refreshed within the stale period and launches paid up to now)."""
    path = os.path.join(directory, BOARD)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        data = os.pread(fd, BOARD_SIZE + 1, 0)
    except OSError:
        return {}
    finally:
        os.close(fd)
    if len(data) != BOARD_SIZE:
        return {}
    b = ffi.from_buffer("struct vgpu_board *", data)
    if (b.magic, b.abi_version, b.size) != (lib.VGPU_BOARD_MAGIC, lib.VGPU_ABI_VERSION, BOARD_SIZE):
        return {}
    now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    out = {}
    for d in range(lib.VGPU_BOARD_DEVICES):
        dev = b.devices[d]
        if dev.claimed != 1:
            continue
        uuid = _uuid_text(bytes(ffi.buffer(dev.uuid)))
        for i in range(lib.VGPU_BOARD_SLICES):
            e = dev.slices[i]
            if not e.key:
                continue
            live = (e.period_ns <= now + _IDLE_NS and now - e.period_ns <= lib.VGPU_BOARD_STALE_NS
                    and e.paid_until_ns + _LIVE_NS >= now)
            out.setdefault(int(e.key), []).append(
                {"uuid": uuid, "guarantee": int(e.guarantee), "ceiling": int(e.ceiling), "demand": int(e.demand),
                 "allowance": int(e.allowance), "live": bool(live)})
    return out


def allowance(entries, nv_devices, d, mig):
    """A slice's share paced at now on its device d, from its board entries
    (board.read()[slice_key(name)]).  A software slice's device d is NVML's device d (by
    UUID); a MIG slice (mig true), or one read without NVML, has its only live entry.
    None: not pacing there now."""
    uuid = nv_devices[d].get("uuid") if not mig and nv_devices and d < len(nv_devices) else None
    live = [e for e in entries if e["live"]]
    if uuid is None:
        return live[0]["allowance"] if len(live) == 1 else None
    return next((e["allowance"] for e in live if e["uuid"].lower() == uuid.lower()), None)
