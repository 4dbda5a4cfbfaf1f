"""BENCHMARKS.md's draft-memory section: the curve of tokens per step against `--draft-memory`
for the allocator, each single format and the paper's draft (bench --ablation draft-memory),
its goals table and what its plot reads (plot.write_draft_memory_plot)."""

from __future__ import annotations

from .report import md_table
from .section import BENCH_SMOKE, Run, Section
from .tables import _f

# 96 tokens: tokens per step from enough steps at the default gamma (32 gave 2-5 steps a sequence)
DRAFT_MEMORY_RUN = "--repeats 1 --max-tokens 96 --threads 1 --anchors none"
DRAFT_MEMORY_RUN_64 = "--repeats 1 --max-tokens 48 --prompt-batches 1 --threads 1 --anchors none"


def draft_memory_points(doc: dict) -> tuple[int, dict, dict[tuple[float, str], dict]]:
    """(batch size, ondemand's record, (share, way) -> record) of a draft-memory ablation."""
    entry = next(e for e in doc["ablations"] if e["ablation"] == "draft-memory")
    ok = [r for r in entry["records"] if not r.get("skipped")]
    base = next((r for r in ok if r.get("policy") == "ondemand"), None)
    points = {(r["draft_memory_share"], r["draft_way"]): r for r in ok if "draft_way" in r}
    return entry["batch_size"], base, points


def draft_memory_goals(docs: list[dict]) -> str:
    """Per batch size and draft memory: the allocator's tokens per step against the best
    single format's and the paper's draft at the same bytes (goals: >= 1.0x and >= 2x),
    and each one's throughput as a multiple of ondemand in the same run."""
    rows = []
    for doc in docs:
        batch, base, points = draft_memory_points(doc)
        for share in sorted({s for s, _ in points}):
            at = {way: r for (s, way), r in points.items() if s == share}
            mine = at.get("allocated")
            singles = {w: r for w, r in at.items() if w not in ("allocated", "paper")}
            best = max(singles.items(), key=lambda kv: kv[1]["tokens_per_step"], default=(None, None))
            paper = at.get("paper")
            if mine is None:
                continue

            def x_ondemand(r):
                return f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x" if r and base else "–"

            vs_best = mine["tokens_per_step"] / best[1]["tokens_per_step"] if best[1] else None
            vs_paper = mine["tokens_per_step"] / paper["tokens_per_step"] if paper else None
            rows.append([str(batch), f"{share:.0%}", _f(mine["tokens_per_step"], "{:.2f}"),
                         _f(mine.get("acceptance_rate"), "{:.2f}"), x_ondemand(mine),
                         f"{best[0]} {_f(best[1]['tokens_per_step'], '{:.2f}')}" if best[1] else "–",
                         _f(vs_best, "{:.3f}x"), "yes" if vs_best is not None and vs_best >= 1.0 else "no",
                         _f(paper["tokens_per_step"], "{:.2f}") if paper else "does not fit",
                         _f(vs_paper, "{:.2f}x"),
                         "–" if vs_paper is None else ("yes" if vs_paper >= 2.0 else "no")])
    return md_table(["B", "draft memory", "allocated tok/step", "acceptance", "× ondemand", "best single format",
                     "allocated ÷ best", "≥ 1.0", "paper's tok/step", "allocated ÷ paper", "≥ 2"], rows) + "\n"


def draft_memory_section(docs: dict[str, dict]) -> str:
    """The goals per model and batch size, and the curves' picture."""
    parts = []
    for title, names in (("The demo model", [f"draft-memory-{b}.json" for b in (1, 16, 64)]),
                         ("The translation model (its decoder blocks draft)", ["draft-memory-translate-16.json"])):
        present = [docs[n] for n in names if n in docs]
        if present:
            parts.append(f"### {title}\n\n" + draft_memory_goals(present))
    parts.append("![the demo model: tokens per step and throughput against draft memory](docs/draft-memory.png)\n")
    return "\n".join(parts)


SECTION = Section("draft-memory", "The draft under a memory budget",
            "`--draft-memory`: the draft's bytes, as a share of all expert bytes, added to the run's budget (30 % of "
            "the expert bytes + non-expert + KV) so that verification keeps the same pool at every point; held-out "
            "prompts, real disk tier, one torch thread, each run beside ondemand in one rotation (B = 1: four "
            "prompts one after another; B = 64: 48 tokens and no 5 % point, for time). At each point: each "
            "expert's way chosen (allocated: full precision, int8 .. int2 copies or substitution), one format for "
            "the experts it can hold, most picked first, the rest substituted (int8 .. int2), and the paper's "
            "draft of full-precision experts (paper). The goals: the allocator's tokens per step at least the best "
            "single format's and twice the paper's. The demo model's curves: docs/draft-memory.png (python "
            "benchmarks/plot_draft_memory.py docs/draft-memory.png bench-results/draft-memory-{1,16,64}.json).",
            (*(Run(f"draft-memory-{b}.json", f"specmoe bench --no-grid --ablation draft-memory --ablation-draft-memory "
                   f"{shares} --ablation-batch-size {b} {run} --json {{out}}/draft-memory-{b}.json",
                   f"specmoe bench --no-grid --ablation draft-memory --ablation-draft-memory 20% --ablation-batch-size "
                   f"{smoke} {BENCH_SMOKE} --anchors none --json {{out}}/draft-memory-{b}.json")
               for b, smoke, shares, run in ((1, 1, "5%,10%,20%,40%", DRAFT_MEMORY_RUN + " --prompt-batches 4"),
                                             (16, 2, "5%,10%,20%,40%", DRAFT_MEMORY_RUN + " --prompt-batches 1"),
                                             (64, 4, "10%,20%,40%", DRAFT_MEMORY_RUN_64))),
             Run("draft-memory-translate-16.json", "specmoe bench --model specmoe-demo-translate --prompts-file "
                 "benchmarks/prompts/translate_heldout.jsonl --no-grid --ablation draft-memory --ablation-draft-memory "
                 f"5%,10%,20%,40% --ablation-batch-size 16 {DRAFT_MEMORY_RUN} --prompt-batches 1 "
                 "--json {out}/draft-memory-translate-16.json",
                 "specmoe bench --model specmoe-demo-translate --prompts-file benchmarks/prompts/translate_heldout.jsonl "
                 f"--no-grid --ablation draft-memory --ablation-draft-memory 20% --ablation-batch-size 2 {BENCH_SMOKE} "
                 "--anchors none --json {out}/draft-memory-translate-16.json")),
            draft_memory_section)
