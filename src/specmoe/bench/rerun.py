"""Runs made again after a change to the allocator, beside the runs on BENCHMARKS.md they
keep: whether the draft held the same copies (then the same tokens follow and the page's
runs stand)."""

from __future__ import annotations

from .report import md_table
from .tables import _f


def ablation_records(doc: dict) -> dict[str, dict]:
    """A bench document's ablation records by label."""
    return {r["label"]: r for e in doc["ablations"] for r in e["records"]}


def _held(r: dict) -> str:
    return ", ".join(f"{way} {n}" for way, n in sorted(r["draft_held"].items())) if r.get("draft_held") else "–"


def same_holdings(pairs: list[tuple[str, dict, dict]]) -> str:
    """(point, the page's run, the run made again): for every SpecMoE record both made (by
    label), what the draft held and its tokens per step in each."""
    rows = []
    for point, before, again in pairs:
        then = ablation_records(before)
        for label, r in ablation_records(again).items():
            old = then.get(label)
            if old is None or not r.get("draft_held"):
                continue
            same = "yes" if old.get("draft_held") == r["draft_held"] else "no"
            rows.append([point, label, _held(old), _held(r), same, _f(old["tokens_per_step"], "{:.3f}"),
                         _f(r["tokens_per_step"], "{:.3f}")])
    return md_table(["point", "run", "the page's run held", "held again", "same", "tok/step (page)",
                     "tok/step (again)"], rows) + "\n"
