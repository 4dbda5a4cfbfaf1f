"""CI's soak: benchmarks/soak.py for 15 s at concurrency 8 on a tiny checkpoint.

The issue asks CI for a one-minute soak; the whole suite must stay within its 3-minute
budget on 2 cores, so this one runs 15 s: soak.py's 5 s warm-up, then 10 s over which
resident memory must stay flat (some 1200 requests of every kind on an idle machine,
several hundred on a busy one). The full soak (20 minutes at concurrency 32 on the demo
model) is run for BENCHMARKS.md, not here. Every request is answered as its kind
expects, no sequence is left in the server, and resident memory stays flat."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("transformers")

from serving import served_checkpoint  # noqa: E402

from specmoe.bench import tables  # noqa: E402

pytestmark = pytest.mark.slow  # a long scenario: .ci/run runs it after make test

DURATION_S = 15
SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


def test_a_short_soak_answers_every_request_and_keeps_memory_flat(tmp_path):
    model = served_checkpoint(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--model", str(model), "--duration", str(DURATION_S), "--concurrency", "8",
         "--max-rss-growth", "32", "--json", "--", "--device", "cpu"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode in (0, 1), proc.stderr
    result = json.loads(proc.stdout)
    assert result["errors"] == {}, result
    assert result["wall_s"] >= DURATION_S, result  # the load ran for the whole time
    assert all(result["requests"].get(kind, 0) > 0 for kind in ("stream", "plain", "cancel", "invalid")), result
    assert result["leftover_sequences"] == 0 and result["served"] > 0, result
    assert result["rss_growth_mib"] <= 32, result
    assert proc.returncode == 0
    row = tables.soak(result).splitlines()[-1]  # BENCHMARKS.md's row, from this document
    assert f"| {result['served']} | none |" in row and f"({result['rss_growth_mib']:+.1f})" in row
