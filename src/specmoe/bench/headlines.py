"""The ratios BENCHMARKS.md's sections report with their goals, for the summary at the
top of the page and README's headline table (summary.py): each computed from the
section's documents by the same code as the section's own tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import beyond_memory, draft_memory, draft_split, goals, gguf_tables, real_size, tables


@dataclass(frozen=True)
class Headline:
    """One ratio a section measured within one run; `front`: also a row of README's table."""
    what: str
    ratio: float
    goal: float | None = None  # what the section aims at: at least this (at most, where `at_most`)
    met: bool | None = None  # by the section's own rule (which may ask more than the median: every round)
    spread: str = ""  # e.g. "rounds 0.59-0.69"
    front: bool = False
    at_most: bool = False


def grid(docs: dict[str, dict]) -> list[Headline]:
    return [Headline(f"demo model: `--policy auto` ÷ the best fixed policy ({best}), B = {b}", ratio, tables.AUTO_GOAL,
                     verdict.met) for b, _, _, best, ratio, verdict in tables.auto_points(docs["grid.json"])[1]]


def real_size_runs(docs: dict[str, dict]) -> list[Headline]:
    warm = tables.warm_ratio(docs["real-size-runs.json"].get("warm_startup"))
    if warm is None:
        return []
    return [Headline("real-size model: SpecMoE's start-up from warm caches ÷ ondemand's (medians)", warm[1],
                     tables.WARM_STARTUP_GOAL, warm[1] <= tables.WARM_STARTUP_GOAL, at_most=True)]


def real_size_section(docs: dict[str, dict]) -> list[Headline]:
    """The real-size goals that ran, for the summary (README's: SpecMoE against ondemand)."""
    out, at = [], real_size.records_at([docs["real-size.json"], docs["real-size-64.json"]])
    for what, a, b, goal, front in real_size.goal_figures(at):
        if a is not None and b is not None:
            ratio = a["decode_tokens_per_s"] / b["decode_tokens_per_s"]
            met = None if goal is None else real_size.verdict(a, b, goal).met
            spread = goals.interval_text(a, b, a["interleaved"] and b["interleaved"])
            out.append(Headline(f"real-size model: {what}", ratio, goal, met, spread=spread, front=front))
    return out


def draft_memory_section(docs: dict[str, dict]) -> list[Headline]:
    """Per model, the allocator against the best single format at its lowest point (the
    goal: at least 1.0x at every point; the section says what more prompts gave)."""
    out = []
    for model, names in (("demo model", [f"draft-memory-{b}.json" for b in (1, 16, 64)]),
                         ("translation model", [f"draft-memory-translate-{b}.json" for b in (1, 16, 64)]),
                         ("real-size model", [f"draft-memory-real-size-{b}-{share}.json"
                                              for b, share, _, _ in draft_memory.REAL_SIZE_POINTS])):
        ratios = [p[7] for p in draft_memory.goal_points([docs[n] for n in names if n in docs]) if p[7] is not None]
        if ratios:
            met = sum(r >= 1.0 for r in ratios)
            out.append(Headline(f"{model}: the allocator's draft ÷ the best single copy format, tokens per step, "
                                "lowest point", min(ratios), 1.0, met == len(ratios),
                                spread=f"{met} of {len(ratios)} points at 1.0x or more"))
    return out


def draft_split_section(docs: dict[str, dict]) -> list[Headline]:
    out = []
    for model, name in (("demo model", "draft-split-1.json"), ("demo model", "draft-split-16.json"),
                        ("demo model", "draft-split-64.json"), ("real-size model", "draft-split-real-size-16.json")):
        if name not in docs:
            continue
        batch, _, planner, curve = draft_split.split_points(docs[name])
        if planner is not None and curve:
            best, ratio, same, verdict = draft_split.planner_against_best(planner, curve,
                                                                          draft_split.split_interleaved(docs[name]))
            spread = goals.interval_text(planner, best, draft_split.split_interleaved(docs[name]))
            out.append(Headline(f"{model}: the planner's draft split ÷ the curve's best point, B = {batch}", ratio,
                                draft_split.SPLIT_GOAL, verdict.met,
                                spread=spread + ("; the best point's draft and pool" if same else "")))
    return out


def same_file(docs: dict[str, dict]) -> list[Headline]:
    """Each file and batch size at the most threads measured (the machine's cores); the
    Q4_K_M rows are README's."""
    records = docs["same-file.json"]["records"]
    most = max((r["threads"] for r in records), default=0)
    # rounds interleaved by the script (specmoe first in even rounds); the low: the lowest round's ratio
    return [Headline(f"specmoe ÷ llama.cpp, the same {r['type']} file, every weight in memory, B = {r['batch_size']} "
                     f"({r['threads']} threads)", r["ratio_median"], 1.0,
                     goals.judge(r["ratio_low"], 1.0, r["rounds"], True).met,
                     spread=f"rounds {r['ratio_low']:.2f}-{r['ratio_high']:.2f}", front=r["type"] == "Q4_K_M")
            for r in records if r["threads"] == most]


def _repeats(record: dict, which: str) -> float:
    """A run's slowest or fastest repeat in decode tokens/s (its one figure when it ran once)."""
    return (record.get("over_repeats") or {}).get("decode_tokens_per_s", {}).get(which, record["decode_tokens_per_s"])


def gguf_disk(docs: dict[str, dict]) -> list[Headline]:
    """SpecMoE ÷ ondemand at each share and batch size with a goal, and ÷ llama.cpp where its goal is."""
    out = []
    for (share, batch), goal in gguf_tables.GGUF_DISK_GOALS.items():
        doc = docs.get(f"gguf-disk-{share}.json") or {}
        at = {(r["policy"], r["batch_size"]): r for r in doc.get("records", []) if not r.get("skipped")}
        if ("specmoe", batch) in at and ("ondemand", batch) in at:
            out.append(_disk_headline(doc, at["specmoe", batch], at["ondemand", batch], goal, "ondemand",
                                      f"at {share} % of its experts"))
        anchor = gguf_tables.llama_cpp_anchor(doc, batch)
        if (share, batch) == gguf_tables.GGUF_DISK_ANCHOR_GOAL[:2] and anchor and ("specmoe", batch) in at:
            out.append(_disk_headline(doc, at["specmoe", batch], anchor, gguf_tables.GGUF_DISK_ANCHOR_GOAL[2],
                                      "llama.cpp (the whole file in memory)", f"at {share} % of its experts"))
    return out


def _disk_headline(doc: dict, ours: dict, theirs: dict, goal: float, name: str, where: str) -> Headline:
    batch = ours["batch_size"]
    low = _repeats(ours, "min") / _repeats(theirs, "max")
    verdict = goals.judge_records(ours, theirs, goal, goals.interleaved(doc, f"B={batch}"))
    return Headline(f"SpecMoE ÷ {name}, the Q4_K_M file on the disk tier {where}, B = {batch}",
                    ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"], goal, verdict.met,
                    spread=f"slowest SpecMoE repeat ÷ fastest {name.split()[0]} one: {low:.2f}", front=batch == 16)


def beyond_memory_section(docs: dict[str, dict]) -> list[Headline]:
    """SpecMoE ÷ llama.cpp-mmap at the goal's cap, per batch size (the front table: B = 16)."""
    out = []
    for r in docs["beyond-memory.json"]["summary"]:
        goal = beyond_memory.GOALS.get(r["batch_size"]) if r["cap_share"] == beyond_memory.GOAL_CAP else None
        if goal is None or "ratio_median" not in r:
            continue
        out.append(Headline(f"SpecMoE ÷ llama.cpp-mmap, both in a memory cgroup capped at {r['cap_share']:.0%} of a "
                            f"4 GB Q4_K_M file, B = {r['batch_size']}", r["ratio_median"], goal,
                            beyond_memory.met(r), spread=f"rounds {r['ratio_low']:.2f}-{r['ratio_high']:.2f}",
                            front=r["batch_size"] == 16))
    return out


# section name -> its ratios from its documents ({output: document}), in the page's summary order
BY_SECTION: dict[str, Callable[[dict[str, dict]], list[Headline]]] = {
    "same-file": same_file, "gguf-disk": gguf_disk, "real-size": real_size_section, "real-size-runs": real_size_runs,
    "grid": grid, "draft-split": draft_split_section, "draft-memory": draft_memory_section,
    "beyond-memory": beyond_memory_section}
