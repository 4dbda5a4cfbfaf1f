"""BENCHMARKS.md's real-size section: each of its goals as a ratio of two figures of one
run, judged by goals.py's rule (the lower end of the ratio's interval over 3 or more
interleaved repeats), and the paper's draft beside the default."""

from __future__ import annotations

from .goals import Verdict, interleaved, judge_records, ratio_interval
from .report import md_table
from .tables import _f


def _speeds(doc: dict) -> dict[tuple[str, int], dict]:
    """(policy or anchor, B) -> its record, skipped runs left out."""
    recs = [r for r in doc["records"] + doc.get("anchors", []) if not r.get("skipped")]
    # each record says whether its batch size's runners ran side by side, rounds interleaved
    return {(r.get("anchor") or r["policy"], r["batch_size"]): {**r, "interleaved": interleaved(doc, f"B={r['batch_size']}")}
            for r in recs}


def goal_figures(at: dict) -> list[tuple[str, dict | None, dict | None, float | None, bool]]:
    """(figure, its record, the record it is divided by, goal, on README's table) for each
    real-size goal; a record is None where it did not run."""
    goals = []
    for b in (1, 16):
        goals.append((f"resident ÷ llama.cpp, B = {b}", ("resident", b), ("llama.cpp", b), 1.0, False))
        goals.append((f"resident ÷ transformers, B = {b}", ("resident", b), ("transformers", b), None, False))
    for b, goal in ((1, None), (16, 4.0), (64, 2.5)):
        goals.append((f"specmoe (disk, 30 %) ÷ ondemand, B = {b}", ("specmoe", b), ("ondemand", b), goal, goal is not None))
    goals.append(("specmoe (disk, 30 %) ÷ llama.cpp (all in memory), B = 16", ("specmoe", 16), ("llama.cpp", 16), 1.0,
                  False))
    return [(what, at.get(num), at.get(den), goal, front) for what, num, den, goal, front in goals]


def verdict(a: dict, b: dict, goal: float) -> Verdict:
    """a ÷ b against `goal` by goals.py's rule: the records' repeats, both interleaved."""
    return judge_records(a, b, goal, a.get("interleaved", True) and b.get("interleaved", True))


def _goal_row(what: str, a: dict | None, b: dict | None, goal: float | None) -> list[str]:
    if a is None or b is None:
        return [what, "–", "–", "–", "–", _f(goal, "{:.1f}x"), "not measured"]
    ratio = a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
    low, high, repeats = ratio_interval(a, b)
    met = "–" if goal is None else str(verdict(a, b, goal))
    return [what, _f(a["decode_tokens_per_s"]), _f(b["decode_tokens_per_s"]), f"{ratio:.2f}x",
            f"{low:.2f}-{high:.2f} ({repeats})", _f(goal, "{:.1f}x"), met]


def records_at(grids: list[dict]) -> dict:
    return {key: r for grid in grids for key, r in _speeds(grid).items()}  # each batch size from one document


def real_size_goals(grids: list[dict], paper: dict) -> str:
    """Each of the real-size goals as a ratio of two figures of one run, then the paper's
    draft beside the default (each against its own run's ondemand). Peak RSS per policy is
    the real-size-runs section's (one process a policy: a bench process's peak only grows)."""
    at = records_at(grids)
    rows = [_goal_row(what, a, b, goal) for what, a, b, goal, _ in goal_figures(at)]
    text = md_table(["figure", "tok/s", "against tok/s", "ratio", "range over repeats (how many)", "goal", "met"],
                    rows) + "\n"
    theirs = _speeds(paper)
    drafts = []
    for b in sorted({key[1] for key in at}):
        default, own, base, own_base = at.get(("specmoe", b)), theirs.get(("specmoe", b)), at.get(
            ("ondemand", b)), theirs.get(("ondemand", b))
        if not (default and own and base and own_base):
            continue
        drafts.append([str(b), _f(default["decode_tokens_per_s"]), _f(default["tokens_per_step"], "{:.2f}"),
                       f"{default['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x",
                       _f(own["decode_tokens_per_s"]), _f(own["tokens_per_step"], "{:.2f}"),
                       f"{own['decode_tokens_per_s'] / own_base['decode_tokens_per_s']:.2f}x"])
    if drafts:
        text += ("\nQuantized copies of every expert (`--draft-quant auto`'s rule, the default draft when measured) "
                 "against the paper's (`--draft-quant none`: resident full-precision draft experts and substitutes), each against "
                 "ondemand in its own run:\n\n" + md_table(
                     ["B", "default tok/s", "tok/step", "× ondemand", "paper's tok/s", "tok/step", "× ondemand"],
                     drafts) + "\n")
    return text
