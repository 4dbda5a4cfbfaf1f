"""Draft acceptance measured by earlier runs, per model and draft: what `--policy auto`
plans speculation with.

The paper's draft (N resident experts, others substituted) is accepted 10 % of the time
on one model and 90 % on another; no prior says which. A quantized draft routes exactly
and is predictable from its bits, but measured is still better than assumed. So every
speculative run records its per-token acceptance here, and the planner uses it next time.

File: ``<cache dir>/acceptance.json``::

    {"<model fingerprint>": {"int8": {"acceptance": 0.998, "drafted": 4210}, "none@4": {...}}}

Draft keys: ``int8``, ``int4``, ``int3`` (copies of every expert: N does not matter) and
``none@N`` (the paper's draft with N experts per block).
"""

from __future__ import annotations

from pathlib import Path

from ..base.paths import cache_dir, read_json, write_json

FILE = "acceptance.json"
MAX_WEIGHT = 20_000  # drafted tokens an entry remembers: newer runs keep moving it


def history_path() -> Path:
    return cache_dir() / FILE


def draft_key(draft_quant: str, draft_experts: int | None) -> str:
    return draft_quant if draft_quant != "none" else f"none@{draft_experts}"


def well_formed(data: dict) -> bool:
    """{fingerprint: {draft key: {"acceptance": 0..1, "drafted": count}}}"""
    return all(isinstance(entries, dict) and all(_entry_ok(e) for e in entries.values()) for entries in data.values())


def _entry_ok(entry) -> bool:
    if not isinstance(entry, dict):
        return False
    a, n = entry.get("acceptance"), entry.get("drafted")
    return _is_number(a) and 0 <= a <= 1 and isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def measured(fingerprint: str) -> dict[str, float]:
    """Draft key -> per-token acceptance measured for this model (empty when none)."""
    entries = read_json(FILE, well_formed).get(fingerprint, {})
    return {k: float(v["acceptance"]) for k, v in entries.items()}


def record(fingerprint: str, key: str, acceptance: float, drafted: int) -> None:
    """Merge a run's acceptance into the history (weighted by drafted tokens)."""
    if drafted <= 0 or not 0.0 <= acceptance <= 1.0:
        return
    data = read_json(FILE, well_formed)
    entry = data.setdefault(fingerprint, {}).get(key, {"acceptance": acceptance, "drafted": 0})
    weight = min(int(entry.get("drafted", 0)), MAX_WEIGHT)
    entry = {"acceptance": (entry["acceptance"] * weight + acceptance * drafted) / (weight + drafted),
             "drafted": weight + drafted}
    data[fingerprint][key] = entry
    write_json(FILE, data)  # a read-only cache dir: planning falls back to its priors
