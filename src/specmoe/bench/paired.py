"""Two engines a benchmark script times in alternating rounds (benchmarks/same_file.py:
specmoe against llama.cpp; benchmarks/quantized_as_stored.py: the block kernels against
the path before): the ratio round by round and its spread, the share of tokens they agree
on, a progress line, and the script's document rewritten after each record, so that an
interrupted run keeps what it measured."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from .machine import machine_info


def compare(ours: list[float], theirs: list[float], our_tokens: list[list[int]],
            their_tokens: list[list[int]]) -> dict:
    """Tokens/s of each round (the same rounds, in order) and each engine's token ids ->
    the ratio's median, lowest and highest round, and the share of equal tokens."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    same = sum(x == y for a, b in zip(our_tokens, their_tokens) for x, y in zip(a, b))
    total = sum(len(a) for a in our_tokens)
    return {"ratio_median": statistics.median(ratios), "ratio_low": min(ratios), "ratio_high": max(ratios),
            "tokens_equal": same / total if total else None}


def keep(records: list[dict], rec: dict, started: float, json_path: Path | None, line: str) -> None:
    """Add `rec` (its wall seconds since `started`), print `line`, rewrite the document."""
    rec["seconds"] = round(time.time() - started, 1)
    records.append(rec)
    print(line, flush=True)
    if json_path:
        doc = {"command": " ".join(sys.argv), "machine": machine_info("cpu"), "records": records}
        json_path.write_text(json.dumps(doc, indent=1))


def summary(rec: dict, ours: str, theirs: str, our_label: str, their_label: str) -> str:
    """`rec`'s medians of tokens/s (keys ours / theirs) and its ratio, for the progress line."""
    return (f"{our_label} {statistics.median(rec[ours]):.1f} tok/s, {their_label} "
            f"{statistics.median(rec[theirs]):.1f}: {rec['ratio_median']:.2f}x ({rec['ratio_low']:.2f}-"
            f"{rec['ratio_high']:.2f}), tokens equal {rec['tokens_equal']:.0%}")
