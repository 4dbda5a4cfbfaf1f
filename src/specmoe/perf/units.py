"""Sizes on the command line: byte sizes ('256MiB', '2GiB', '1.5GB', '4096' <-> numbers)
and batch-size lists ('1,4,16')."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'256MiB' -> 268435456. Decimal (kB, MB, GB) and binary (KiB, MiB, GiB) units."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r}: expected a number with an optional unit, e.g. 256MiB or 2GB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"bad size {text!r}: must be positive")
    return value


def parse_batch_sizes(text: str) -> list[int]:
    """'16,1,4' -> [1, 4, 16] (sorted, without repeats)."""
    try:
        sizes = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"bad --batch-sizes {text!r}: give positive integers separated by commas, e.g. 1,4,16,64")
    return sorted(set(sizes))


def format_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"
