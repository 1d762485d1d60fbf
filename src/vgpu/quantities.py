"""Quantities on the command line: memory sizes and SM shares, parsed and printed.

Memory follows Kubernetes: `4Gi` (binary), `4G` (decimal, 4e9), plain bytes, and `max`
(cgroup's word for "no cap").  SM shares are percent, `50%` or `50`, kept in the quota
in 1/100 percent (10000 = 100%).

A number without a unit is taken at its word only where no one means it otherwise: as
bytes from 1Mi up (or 0), as percent from 1 up.  `--memory 4` (4 bytes) and `--sm 0.5`
(half a percent) are what an operator who meant 4Gi or 50% types, so they are refused
with what was probably meant; `4Ki` and `0.5%` say it is meant.
"""
import re
import time

from ._region import lib

UNLIMITED = lib.VGPU_UNLIMITED
SHARE_FULL = 10000   # 100% of a device's SM time in the quota's unit (1/100 percent): the one name for it
                     # (SM shares and SM use alike; csrc/vgpu_region.h states the unit in a comment)

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {"k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_MEMORY = re.compile(r"(\d+(?:\.\d+)?)([KMGTPE]i|[kKMGTPE])?")
_SHARE = re.compile(r"(\d+(?:\.\d{1,2})?)(%?)")
_BARE_MEMORY_MIN = 1 << 20   # a size without a unit below this is refused (0 excepted)
_BARE_SHARE_MIN = 100        # a share without % below 1% is refused (1/100 percent)


class QuantityError(ValueError):
    """A value that is not a size or share; `hint`: what was probably meant, or None."""

    def __init__(self, message, hint=None):
        super().__init__(message)
        self.hint = hint


def parse_memory(text: str) -> int:
    """Bytes from `4Gi`, `512Mi`, `4G`, `1073741824` or `max` (-> UNLIMITED).

    Raises ValueError with a message that says what is accepted."""
    t = text.strip()
    if t in ("max", "unlimited"):
        return UNLIMITED
    m = _MEMORY.fullmatch(t)
    if not m:
        raise QuantityError(f"{text!r} is not a memory size (use bytes, Ki/Mi/Gi/Ti, K/M/G/T or max; e.g. 4Gi)")
    number, unit = m.groups()
    if unit is None and 0 < float(number) < _BARE_MEMORY_MIN:
        # GPU memory in bytes below a MiB is a unit left out, not a size anyone wants
        guess = f"{number}Gi" if float(number) <= 256 else f"{number}Mi"
        raise QuantityError(f"{text!r} has no unit, so it is {number} bytes: a size without a unit must be at "
                            f"least 1Mi (1048576)", f"did you mean {guess}?")
    scale = _BINARY.get(unit) or _DECIMAL.get(unit) or 1
    if "." in number:
        # exact decimal arithmetic: 1.5Gi is exactly 1610612736 bytes
        whole, frac = number.split(".")
        value = (int(whole) * 10**len(frac) + int(frac)) * scale
        if value % 10**len(frac):
            raise QuantityError(f"{text!r} is not a whole number of bytes")
        value //= 10**len(frac)
    else:
        value = int(number) * scale
    if value >= UNLIMITED:
        raise QuantityError(f"{text!r} is too large (use max for no cap)")
    return value


def parse_share(text: str) -> int:
    """1/100 percent from `50%`, `50` or `12.5%`; must be in (0, 100], and below 1% only
    with its `%` (`0.5` is a fraction meant as 50%, not half a percent)."""
    m = _SHARE.fullmatch(text.strip())
    if not m:
        raise QuantityError(f"{text!r} is not a share of the GPU (use 1..100 percent, e.g. 50%)")
    number, percent = m.groups()
    whole, _, frac = number.partition(".")
    value = int(whole) * 100 + int((frac + "00")[:2])
    if value == 0:
        raise QuantityError(f"{text!r} is no share of the GPU: a slice needs more than 0% (1..100%, e.g. 50%; "
                            "100% is the whole GPU)")
    if value > SHARE_FULL:
        raise QuantityError(f"{text!r} is more than the whole GPU (1..100%, e.g. 50%)")
    if not percent and value < _BARE_SHARE_MIN:
        raise QuantityError(f"{text!r} has no %, so it is {format_share(value)} of the GPU: a share without % must "
                            "be at least 1 (1..100)", f"did you mean {format_share(value * 100)}?")
    return value


def format_memory(value: int) -> str:
    """`4Gi`, `1.5Gi`, `512Mi`, `123` bytes, or `max`; exact when short, else 3 digits."""
    if value == UNLIMITED:
        return "max"
    for unit in ("Ti", "Gi", "Mi", "Ki"):
        scale = _BINARY[unit]
        if value >= scale:
            if value % scale == 0:
                return f"{value // scale}{unit}"
            return f"{value / scale:.3g}{unit}" if value / scale < 1000 else f"{value / scale:.0f}{unit}"
    return str(value)


def format_memory_exact(value: int) -> str:
    """Memory as parse_memory reads it back to the same value: `4Gi` when that is exact,
    else bytes, and below 1Mi (where bytes need a unit) decimal kilobytes (`1.001k`)."""
    short = format_memory(value)
    try:
        if parse_memory(short) == value:
            return short
    except ValueError:
        pass
    if value >= _BARE_MEMORY_MIN:
        return str(value)
    return f"{value // 1000}.{value % 1000:03d}k".replace(".000k", "k")


def format_share(value) -> str:
    """`50%`, `12.5%`; None -> `-`."""
    if value is None:
        return "-"
    return f"{value // 100}%" if value % 100 == 0 else f"{value / 100:g}%"


def format_duration_ns(ns: int) -> str:
    """A cumulative time, short: `0s`, `350ms`, `12.3s`, `4m05s`."""
    if ns < 1_000_000:
        return "0s" if ns == 0 else f"{ns / 1000:.0f}us"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.0f}ms"
    s = ns / 1e9
    if s < 60:
        return f"{s:.1f}s"
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def format_utc(t=None) -> str:
    """A wall-clock time as every JSON line vgpu-ctl writes stamps it (`ts`): ISO 8601,
    UTC, milliseconds: `2026-12-01T10:42:07.118Z`."""
    t = time.time() if t is None else t
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"
