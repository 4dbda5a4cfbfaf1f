"""Sizes and rates as users type them, and as specmoe prints them. One parser, one
formatter, the same meaning in every command.

Suffixes (case-insensitive): decimal ``kB MB GB TB`` (10^3 ...), binary ``KiB MiB GiB TiB``
(2^10 ...), and the bare letters ``K M G T``, which are binary, as in most memory flags
(``--device-memory 24G`` is 24 GiB). A rate is a size per second: ``200MB/s``.
"""

from __future__ import annotations

import math
import re

from .errors import SpecMoEError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str | int, what: str = "size") -> int:
    """'512MiB', '2GiB', '24G', '1.5GB', '1073741824' or an int -> bytes (positive)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = _as_float(text)
    else:
        match = _NUMBER.fullmatch(str(text))
        unit = match and _UNITS.get(match.group(2).lower())
        if not match or unit is None:
            raise SpecMoEError(f"{what} {text!r} is not a size; use bytes or a unit, e.g. 512MiB, 24G (GiB), 1.5GB")
        value = float(match.group(1)) * unit
    if not math.isfinite(value):
        raise SpecMoEError(f"{what} {text!r} is not a finite size")
    if value < 1:
        raise SpecMoEError(f"{what} {text!r} must be at least one byte")
    return int(value)


def parse_rate(text: str | int | float, what: str = "--offload-bandwidth") -> float:
    """'200MB/s', '1.6GB/s', '1GiB' -> bytes per second (positive)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = _as_float(text)
        if not math.isfinite(value) or value <= 0:
            raise SpecMoEError(f"{what} {text!r} must be a positive finite number of bytes per second")
        return value
    return float(parse_size(re.sub(r"/s$", "", str(text).strip()), what))


def _as_float(n: int | float) -> float:
    """float(n), or an infinity where an int is beyond float's range (float() would raise)."""
    try:
        return float(n)
    except OverflowError:
        return math.inf if n > 0 else -math.inf


def format_bytes(n: float) -> str:
    """Binary units, as the parser reads them back: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_size_at_least(n: int) -> str:
    """The smallest size with three significant digits, in the unit format_bytes would
    use, that parse_size reads back as at least `n` bytes: 1_300_235 -> '1.25 MiB'. For
    errors that name a budget that works: rounding to nearest could name one that fails."""
    scale, unit = 1, "B"
    for name in ("KiB", "MiB", "GiB", "TiB"):
        if n < scale * 1024:
            break
        scale, unit = scale * 1024, name
    if unit == "B":
        return f"{n} B"
    decimals = 2 if n < 10 * scale else 1 if n < 100 * scale else 0
    step = 10 ** -decimals
    value = math.ceil(n / scale / step) * step
    while parse_size(f"{value:.{decimals}f} {unit}") < n:  # float rounding of value * scale
        value += step
    return f"{value:.{decimals}f} {unit}"


def format_rate(bytes_per_s: float) -> str:
    return f"{format_bytes(bytes_per_s)}/s"


def parse_batch_sizes(text: str, what: str = "--batch-sizes") -> list[int]:
    """'16,1,4' -> [1, 4, 16] (sorted, without repeats)."""
    try:
        sizes = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 for b in sizes):
        raise SpecMoEError(f"{what} {text!r}: give positive integers separated by commas, e.g. 1,4,16,64")
    return sorted(set(sizes))
