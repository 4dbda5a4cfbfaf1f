"""Run statistics of replicated runs: each replica's chunks added up, and all replicas.

A merged dict has the keys of one engine's `last_stats`: counts and times are summed,
ratios recomputed from the summed counts with the engine's own formulas
(`engine.stats.rates`), settings kept where every chunk agrees. `wall_s` is the caller's:
a replica's busy time, or the driver's clock for the whole run; `tokens_per_s` is
generated tokens over it (for the whole run: the cluster's throughput).
"""

from __future__ import annotations

import hashlib
import json

from ..engine.stats import RunCounters, rates
from .replica import ChunkRun

SUMMED = {
    "num_requests", "prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "draft_s", "verify_s",
    "compute_s", "steps", "transfer_bytes", "experts_fetched", "transfer_wait_s", "offload_read_s",
    "host_expert_tokens", "activation_bytes", "refresh_bytes",
}
LARGEST = {"batch_size", "device_memory", "device_peak_bytes", "host_peak_bytes"}


def merge_runs(runs: list[ChunkRun], wall_s: float) -> dict:
    stats = [run.stats for run in runs]
    merged = {}
    for key in dict.fromkeys(k for s in stats for k in s):  # every key, in first-seen order
        merged[key] = _merge_values(key, [s.get(key) for s in stats], [s["generated_tokens"] for s in stats])
    counters = RunCounters.total([run.counters for run in runs])
    generated, transfer = merged["generated_tokens"], merged.get("transfer_bytes", 0)
    merged.update(rates(counters, requests=merged["num_requests"], generated=generated, wall_s=wall_s,
                        transfer=transfer))
    merged.update(wall_s=wall_s, tokens_per_s=generated / wall_s if wall_s else 0.0)
    return merged


def _merge_values(key: str, values: list, weights: list[int]):
    present = [v for v in values if v is not None]
    if key in SUMMED:
        return sum(present)
    if key in LARGEST:
        return max(present, default=None)
    if all(v == values[0] for v in values):
        return values[0]
    if present and all(isinstance(v, float) for v in present):
        # a ratio the chunks do not count separately (cache_hit_rate, ttft_s, ...): their
        # mean, weighted by the tokens each chunk generated
        pairs = [(v, w) for v, w in zip(values, weights) if v is not None]
        total = sum(w for _, w in pairs)
        return sum(v * w for v, w in pairs) / total if total else sum(present) / len(present)
    return None  # settings that differ (e.g. gamma tuned per chunk under auto): no one value


def replica_stats(index: int, first_worker: str, runs: list[ChunkRun]) -> dict:
    """One replica's statistics over its chunks. `restarts`: how often the process that
    ran its chunks changed during the run (Ray restarts a dead replica in a new process),
    starting from `first_worker`, the process it ran in before."""
    workers = list(dict.fromkeys([first_worker] + [run.worker for run in runs]))
    stats = merge_runs(runs, sum(run.stats["wall_s"] for run in runs)) if runs else {}
    return {"replica": index, "chunks": len(runs), "restarts": len(workers) - 1, "workers": workers, **stats}


class TokenHash:
    """`token_ids_sha256` of outputs fed one at a time, in input order, none kept: the
    same digest as `engine.stats.token_ids_sha256` of the whole list."""

    def __init__(self):
        self._sha = hashlib.sha256(b"[")
        self._count = 0

    def add(self, token_ids: list[int]) -> None:
        self._sha.update((b"," if self._count else b"") + json.dumps(token_ids, separators=(",", ":")).encode())
        self._count += 1

    def hexdigest(self) -> str:
        sha = self._sha.copy()
        sha.update(b"]")
        return sha.hexdigest()
