"""Hardware profiles: the handful of rates the cost model needs, as data.

Built-in profiles live in ``hardware.json`` next to this file (effective rates derived
from public spec sheets; each profile says how in its ``source``). Profiles measured by
``specmoe calibrate`` are saved as ``<cache dir>/profiles/NAME.json`` and load by name
or by path. The cache dir is ``$SPECMOE_CACHE_DIR`` or ``~/.cache/specmoe``.

Units: bytes, bytes/s, FLOP/s (dense bf16 matmul), seconds.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..base.files import publish
from ..base.paths import cache_dir  # re-exported: the perf modules import it from here

_BUILTIN_FILE = Path(__file__).with_name("hardware.json")
SLOW_TIERS = ("host", "disk")
# Keys a profile file may carry besides the dataclass fields (kept, not interpreted).
_METADATA_KEYS = {"name", "measurements", "_comment"}
_MAY_BE_ZERO = {"sequence_overhead_s"}
_MAY_BE_NONE = {"h2d_pageable_bw", "disk_sequential_bw", "disk_random_bw"}
_OPTIONAL = _MAY_BE_NONE | {"transfer_overlap"} | _MAY_BE_ZERO


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    source: str
    device_matmul_flops: float  # compute device, dense bf16 matmul, attainable
    device_mem_bw: float  # compute device memory (HBM; DRAM when the device is the CPU)
    device_memory_bytes: int  # compute device memory capacity
    h2d_bw: float  # host -> device copy, pinned memory
    slow_tier: str  # where offloaded experts live: "host" (DRAM) or "disk" (NVMe)
    slow_tier_read_bw: float  # read bandwidth of that tier (host tier: = h2d_bw)
    host_mem_bw: float  # host DRAM bandwidth (STREAM-like)
    host_matmul_flops: float  # host CPU dense matmul (bf16 where the CPU has it)
    transfer_latency_s: float  # fixed cost per expert transfer (one request)
    kernel_launch_s: float  # fixed cost per kernel / operator the engine dispatches
    h2d_pageable_bw: float | None = None  # host -> device from pageable memory, if known
    # Host-side engine work per sequence in a pass that is not an operator: sampling,
    # scheduling, bookkeeping. Measured by `specmoe calibrate`; 0 in the built-in profiles
    # (unknown there, and small next to a big model's transfers).
    sequence_overhead_s: float = 0.0
    # Share of the slow tier's rate left while the device computes: 1 where copies run on
    # their own engines (PCIe DMA); below 1 where the CPU that computes also moves the
    # bytes (experts read from disk on a CPU-only machine). Measured by `specmoe calibrate`.
    transfer_overlap: float = 1.0
    # The disk's read rates as `specmoe calibrate` measured them (None: not measured):
    # large reads in file order, and expert-sized reads at random offsets with the disk
    # tier's reads in flight. Reported beside the rate a run's disk tier achieved.
    disk_sequential_bw: float | None = None
    disk_random_bw: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("hardware profile: name must not be empty")
        if self.slow_tier not in SLOW_TIERS:
            raise ValueError(
                f"hardware profile {self.name}: slow_tier must be one of {', '.join(SLOW_TIERS)}, "
                f"got {self.slow_tier!r}"
            )
        for f in fields(self):
            if f.name in ("name", "description", "source", "slow_tier"):
                continue
            v = getattr(self, f.name)
            if v is None and f.name in _MAY_BE_NONE:
                continue
            if f.name in _MAY_BE_ZERO and isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0:
                continue
            if f.name == "transfer_overlap" and isinstance(v, (int, float)) and not 0 < v <= 1:
                raise ValueError(f"hardware profile {self.name}: transfer_overlap must be in (0, 1], got {v!r}")
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"hardware profile {self.name}: {f.name} must be a positive number, got {v!r}")

    @property
    def fetch_bw(self) -> float:
        """Bytes/s at which an offloaded expert reaches the device pool.

        Host tier: one PCIe copy. Disk tier: disk -> host -> device, limited by the slower
        link (the two stages pipeline over chunks, so the slower one sets the rate)."""
        if self.slow_tier == "host":
            return self.h2d_bw
        return min(self.slow_tier_read_bw, self.h2d_bw)

    @property
    def host_expert_read_bw(self) -> float:
        """Bytes/s at which the host CPU can stream expert weights for host compute."""
        if self.slow_tier == "host":
            return self.host_mem_bw
        return min(self.slow_tier_read_bw, self.host_mem_bw)

    def to_dict(self) -> dict:
        return asdict(self)




def profiles_dir() -> Path:
    """Where calibrated profiles are saved (``<cache dir>/profiles``)."""
    return cache_dir() / "profiles"


def _builtin_table() -> dict[str, dict]:
    with open(_BUILTIN_FILE) as f:
        return json.load(f)["profiles"]


def builtin_profile_names() -> list[str]:
    return sorted(_builtin_table())


def _user_profile_names() -> list[str]:
    d = profiles_dir()
    if not d.is_dir():
        return []
    return sorted(p.stem for p in d.glob("*.json"))


def list_profiles() -> list[str]:
    """Names loadable by :func:`load_profile`: built-in ones, then calibrated ones."""
    builtin = builtin_profile_names()
    return builtin + [n for n in _user_profile_names() if n not in builtin]


def profile_from_dict(d: dict, name: str | None = None) -> HardwareProfile:
    if not isinstance(d, dict):
        raise ValueError(f"hardware profile {name or '?'}: expected a JSON object, got {type(d).__name__}")
    known = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(d) - known - _METADATA_KEYS)
    if unknown:
        raise ValueError(
            f"hardware profile {name or d.get('name', '?')}: unknown key {unknown[0]!r} "
            f"(known: {', '.join(sorted(known))})"
        )
    values = {k: v for k, v in d.items() if k in known}
    values["name"] = name or d.get("name") or ""
    missing = sorted(known - set(values) - _OPTIONAL)
    if missing:
        raise ValueError(f"hardware profile {values['name'] or '?'}: missing key {missing[0]!r}")
    if isinstance(values.get("device_memory_bytes"), float) and math.isfinite(values["device_memory_bytes"]):
        values["device_memory_bytes"] = int(values["device_memory_bytes"])
    return HardwareProfile(**values)


def _load_file(path: Path) -> HardwareProfile:
    try:
        with open(path, "rb") as f:
            d = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON and UTF-8 errors
        raise ValueError(f"cannot read hardware profile {path}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"hardware profile {path}: expected a JSON object")
    if "profiles" in d:  # a table like hardware.json: must hold exactly one profile
        if not isinstance(d["profiles"], dict) or len(d["profiles"]) != 1:
            raise ValueError(f"hardware profile file {path}: \"profiles\" must map one name to one profile")
        (name, body), = d["profiles"].items()
        return profile_from_dict(body, name)
    return profile_from_dict(d, d.get("name") or path.stem)


def load_profile(name_or_path: str | os.PathLike) -> HardwareProfile:
    """A built-in or calibrated profile by name, or a profile JSON file by path."""
    s = str(name_or_path)
    table = _builtin_table()
    if s in table:
        return profile_from_dict(table[s], s)
    user = profiles_dir() / f"{s}.json"
    if "/" not in s and user.is_file():
        return _load_file(user)
    p = Path(s).expanduser()
    if p.is_file():
        return _load_file(p)
    raise ValueError(f"unknown hardware profile {s!r}: use one of {', '.join(list_profiles())} or a path to a profile .json")


def save_profile(profile: HardwareProfile, measurements: dict | None = None, directory: Path | None = None) -> Path:
    """Save a (calibrated) profile as ``NAME.json`` in the user profile dir; return the path."""
    if profile.name in _builtin_table():
        raise ValueError(f"profile name {profile.name!r} is a built-in profile: choose another --name")
    d = directory or profiles_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{profile.name}.json"
    body = profile.to_dict()
    if measurements:
        body["measurements"] = measurements
    publish(path, lambda tmp: tmp.write_text(json.dumps(body, indent=2) + "\n"))
    return path
