"""How fast each policy really ran on this machine against what the cost model predicted:
`--policy auto` scales its predictions by it.

A cost model fitted on seconds of probing is off by tens of percent for some policy and
batch size (BENCHMARKS.md, validation); ranking policies whose predictions are that
close needs measurements. Every run of an offloading policy records measured / predicted
decode tokens/s per (model, tier, policy, batch size) in ``<cache dir>/feedback.json``
(the last RECENT runs); the planner multiplies each policy's prediction by the median
ratio recorded at the nearest batch size (1 where nothing is recorded: a fresh machine
plans from the model alone).
"""

from __future__ import annotations

import json
import math
import os
import statistics

from ..cache import cache_dir

RECENT = 8


def feedback_path():
    return cache_dir() / "feedback.json"


def _load() -> dict:
    try:
        return json.loads(feedback_path().read_text())
    except (OSError, ValueError):
        return {}


def record(fingerprint: str, tier: str, policy: str, batch: int, measured: float, predicted: float) -> None:
    if not (measured > 0 and predicted > 0):
        return
    data = _load()
    runs = data.setdefault(fingerprint, {}).setdefault(f"{tier}/{policy}", {}).setdefault(str(batch), [])
    runs.append(measured / predicted)
    del runs[:-RECENT]
    path = feedback_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache dir: plans use the model alone


def correction(fingerprint: str, tier: str, policy: str, batch: int) -> float:
    """Median measured/predicted ratio of `policy` at the recorded batch size nearest to
    `batch` (in log scale), or 1.0."""
    by_batch = _load().get(fingerprint, {}).get(f"{tier}/{policy}", {})
    runs = {int(b): r for b, r in by_batch.items() if r}
    if not runs:
        return 1.0
    nearest = min(runs, key=lambda b: abs(math.log(b) - math.log(batch)))
    return float(statistics.median(runs[nearest]))
