"""The translation section of BENCHMARKS.md is made from its document: every ratio it
prints is computed from the runs in `benchmarks/translate_bench.py`'s JSON."""

from __future__ import annotations

from specmoe.bench.translate import PAPER, translate


def _run(tok_s: float, tokens: float = 1.0, per_token: float = 1e6) -> dict:
    return {"decode_tokens_per_s": tok_s, "tokens_per_step": tokens, "transfer_bytes_per_token": per_token}


def _doc() -> dict:
    at = {"ondemand": _run(10.0), "caching": _run(20.0), "specmoe": _run(35.0, 3.5, 4e5),
          "specmoe-int8": _run(25.0, 4.5, 6e5)}
    return {"gamma": 10, "max_tokens": 32, "sweep_s": 1.0, "tiers": {"disk": {"4": at}, "capped": {"4": at, "16": at}},
            "ablation": {"batch_size": 16, "runs": {"ondemand": _run(10.0), "N=2": _run(20.0, 2.0),
                                                    "N=4": _run(40.0, 3.0), "N=8": _run(30.0, 3.5)}}}


def test_ratios_are_computed_from_the_runs():
    text = translate(_doc())
    assert "| 16 | 10.0 | 20.0 | 35.0 | 3.50x | 1.75x | 3.50 | -60.0% | 25.0 (2.50x, 4.50) |" in text


def test_ablation_rows_are_relative_to_the_best_n_beside_the_papers():
    text = translate(_doc())
    paper_n2 = PAPER["ablation_tok_s"][2] / max(PAPER["ablation_tok_s"].values())
    assert f"| 2 | 20.0 | 2.00x | 2.00 | 0.500 | {paper_n2:.3f} |" in text


def test_paper_figures_stand_beside_ours_at_the_largest_capped_batch():
    text = translate(_doc())
    assert "| throughput × ondemand | 4.30x (B = 256) | 3.50x (B = 16) |" in text
    assert "| bytes moved per token vs ondemand | -76.73% | -60.00% |" in text
