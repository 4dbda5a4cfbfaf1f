"""BENCHMARKS.md's draft-memory section: the curve of tokens per step against `--draft-memory`
for the allocator, each single format and the paper's draft (bench --ablation draft-memory),
its goals table and what its plot reads (plot.write_draft_memory_plot)."""

from __future__ import annotations

import random

from ..experts.quant import BITS
from ..policies.specmoe.allocation import pick_cost
from .report import md_table
from .section import BENCH_SMOKE, REAL_SIZE_MODEL, REAL_SIZE_SMOKE_MODEL, Run, Section, ablation_run
from .rerun import same_holdings
from .tables import _f

# 96 tokens: tokens per step from enough steps at the default gamma (32 gave 2-5 steps a sequence)
DRAFT_MEMORY_RUN = "--repeats 1 --max-tokens 96 --threads 1 --anchors none"
DRAFT_MEMORY_RUN_64 = "--repeats 1 --max-tokens 48 --prompt-batches 1 --threads 1 --anchors none"
# at real size the formats with a fused kernel here and the paper's draft: int3 and int2 copies take
# the portable path (about 1 tok/s at B = 16), two hours a curve; on every smaller curve they held
# fewer tokens per step than int4 at 20 and 40 %. One run per draft memory: a run holds every
# variant's engine for its rotation, and seven real-size engines outgrow 24 GiB
# (B, draft memory in %, tokens, prompt batches); B = 1: four prompts one after another. About half an
# hour a run here; at B = 1 and 64 the variants do not fit side by side (the kernel killed the first
# B = 64 try) and run one at a time
REAL_SIZE_POINTS = ((1, 20, 48, 4), (1, 40, 48, 4), (16, 20, 32, 1), (16, 40, 32, 1), (64, 20, 32, 1),
                    (64, 40, 32, 1))
REAL_SIZE_WAYS = "allocated,int8,int4,paper"
# The real-size points again with the allocator alone, once its pick cost became a square (a cube
# before): where it holds what the curve's run held, the same tokens follow and that run stands.
# A few minutes a point, against half an hour for the curve's.
REAL_SIZE_AGAIN = "draft-memory-real-size-allocated"
TRANSLATE = "--model specmoe-demo-translate --prompts-file benchmarks/prompts/translate_heldout.jsonl "
# The scarce points again with more prompts: where the draft is scarce, the ways come within a few %
# of each other, closer than one run's sampling error (at B = 1 the four prompts' winner among the
# formats changed with the next twelve). Tokens per step alone, so the host tier (the draft and
# verification compute the same on any tier) and the ways that came near the allocator there. The
# demo's B = 1 and 16 eight times the curve's prompts: with four, the allocator was below the best
# single format with 1.0 inside the interval at both. B = 16 at 5 % also on the next two sets of
# 128 prompts: on the first set the allocator was below int2 with the interval below 1.0 (before it
# weighed blocks by their share of the residual stream). The translation model at B = 1, 5 % also on
# its next two sets of 64 (its 64 first: the allocator 0.958x int3, 1.0 inside the interval; on
# prompts 201-232, where its cost model was tried, 1.12x): the sets are pooled too.
# (file stem, model options, B, draft memories, tokens, prompt batches, ways)
NEAR_WAYS = "allocated,int4,int3,int2"
SAMPLE_POINTS = (("draft-memory-sample", "", 1, "5%,10%", 96, 32, "allocated,int3,int2"),
                 ("draft-memory-sample", "", 16, "5%,10%", 96, 8, "allocated,int3,int2"),
                 *((f"draft-memory-sample-skip{skip}", f"--prompts-skip {skip} ", 16, "5%", 96, 8,
                    "allocated,int3,int2") for skip in (128, 256)),
                 ("draft-memory-sample", "", 64, "10%", 96, 2, NEAR_WAYS),
                 ("draft-memory-sample-translate", TRANSLATE, 1, "5%,10%", 96, 64, NEAR_WAYS),
                 *((f"draft-memory-sample-translate-skip{skip}", f"{TRANSLATE}--prompts-skip {skip} ", 1, "5%", 96,
                    64, NEAR_WAYS) for skip in (64, 128)))


def draft_memory_points(doc: dict) -> tuple[int, dict, dict[tuple[float, str], dict]]:
    """(batch size, ondemand's record, (share, way) -> record) of a draft-memory ablation."""
    entry = next(e for e in doc["ablations"] if e["ablation"] == "draft-memory")
    ok = [r for r in entry["records"] if not r.get("skipped")]
    base = next((r for r in ok if r.get("policy") == "ondemand"), None)
    points = {(r["draft_memory_share"], r["draft_way"]): r for r in ok if "draft_way" in r}
    return entry["batch_size"], base, points


def draft_memory_columns(docs: list[dict]) -> list[tuple[int, dict[tuple[float, str], tuple[dict, dict | None]]]]:
    """The curves by batch size: (B, (share, way) -> (record, ondemand's record of the same
    run)), merging the documents of one batch size (the real-size curve is one run per
    draft memory, each beside its own ondemand)."""
    columns: dict[int, dict] = {}
    for doc in docs:
        batch, base, points = draft_memory_points(doc)
        columns.setdefault(batch, {}).update({key: (r, base) for key, r in points.items()})
    return sorted(columns.items())


def ways_at(points: dict[tuple[float, str], dict], share: float) -> dict[str, dict]:
    """way -> record at one draft memory of a curve."""
    return {way: r for (s, way), r in points.items() if s == share}


def singles_at(at: dict[str, dict]) -> dict[str, dict]:
    """The single formats among `at`'s ways: neither the allocator nor the paper's draft."""
    return {w: r for w, r in at.items() if w not in ("allocated", "paper")}


def best_single(at: dict[str, dict]) -> str | None:
    """The single format with the most tokens per step among `at`'s ways; None if there is none."""
    singles = singles_at(at)
    return max(singles, key=lambda w: singles[w]["tokens_per_step"], default=None)


def goal_points(docs: list[dict]):
    """Each point where the allocator ran: (B, draft memory, ondemand's record, the allocator's,
    the best single format, its record, the paper's draft's record, allocated ÷ best single
    and ÷ paper in tokens per step; None where that one did not run)."""
    for doc in docs:
        batch, base, points = draft_memory_points(doc)
        for share in sorted({s for s, _ in points}):
            at = ways_at(points, share)
            mine, best = at.get("allocated"), best_single(at)
            top, paper = at.get(best), at.get("paper")
            if mine is None:
                continue
            vs_best = mine["tokens_per_step"] / top["tokens_per_step"] if top else None
            vs_paper = mine["tokens_per_step"] / paper["tokens_per_step"] if paper else None
            yield batch, share, base, mine, best, top, paper, vs_best, vs_paper


def draft_memory_goals(docs: list[dict], samples: dict[int, dict] | None = None) -> str:
    """Per batch size and draft memory: the allocator's tokens per step against the best
    single format's and the paper's draft at the same bytes (goals: >= 1.0x and >= 2x),
    and each one's throughput as a multiple of ondemand in the same run. Where twice the
    paper's tokens per step is more than gamma + 1 (every draft accepted), the table says
    so: no draft can reach it. Where the allocator falls short of the best single format
    and the point ran again with more prompts (`samples`: those runs by batch size), the
    table says what they gave: a curve's few prompts cannot tell ways a few % apart."""
    rows = []
    for batch, share, base, mine, best, top, paper, vs_best, vs_paper in goal_points(docs):
        x_ondemand = f"{mine['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x" if base else "–"
        met = "yes" if vs_best is not None and vs_best >= 1.0 else _short_of_best((samples or {}).get(batch), share)
        rows.append([str(batch), f"{share:.0%}", _f(mine["tokens_per_step"], "{:.2f}"),
                     _f(mine.get("acceptance_rate"), "{:.2f}"), x_ondemand,
                     f"{best} {_f(top['tokens_per_step'], '{:.2f}')}" if top else "–",
                     _f(vs_best, "{:.3f}x"), met,
                     _f(paper["tokens_per_step"], "{:.2f}") if paper else "does not fit",
                     _f(vs_paper, "{:.2f}x"), _twice_paper(vs_paper, paper, mine)])
    return md_table(["B", "draft memory", "allocated tok/step", "acceptance", "× ondemand", "best single format",
                     "allocated ÷ best", "≥ 1.0", "paper's tok/step", "allocated ÷ paper", "≥ 2"], rows) + "\n"


def _short_of_best(sample: dict | None, share: float) -> str:
    """'no', and what the allocator gave against the best single format where the point
    ran again with more prompts."""
    if sample is None:
        return "no"
    batch, _, points = draft_memory_points(sample)
    ratio = _curve_ratio(points, share)
    return "no" if ratio == "–" else f"no; {ratio} on {sample['config']['prompt_batches'] * batch} prompts (below)"


def _twice_paper(ratio: float | None, paper: dict | None, mine: dict) -> str:
    if ratio is None:
        return "–"
    if ratio >= 2.0:
        return "yes"
    ceiling = mine["gamma"] + 1
    return f"no: 2x is {2 * paper['tokens_per_step']:.1f}, above gamma + 1 = {ceiling}" \
        if 2 * paper["tokens_per_step"] > ceiling else "no"


def draft_memory_means(docs: list[dict]) -> str:
    """Each way's tokens per step at each draft memory averaged over the batch sizes that
    measured it (two or more): whether the allocator's choice is the better one across
    batch sizes where the best single format changes from one batch size to the next."""
    curves = [(batch, {key: r for key, (r, _) in points.items()}) for batch, points in draft_memory_columns(docs)]
    rows = []
    for share in sorted({s for _, points in curves for s, _ in points}):
        at = [(b, points) for b, points in curves if (share, "allocated") in points]
        ways = set.intersection(*({w for s, w in points if s == share} for _, points in at)) - {"paper"}
        if len(at) < 2 or len(ways) < 2:
            continue
        mean = {w: sum(points[share, w]["tokens_per_step"] for _, points in at) / len(at) for w in ways}
        best = max((w for w in mean if w != "allocated"), key=lambda w: mean[w])
        rows.append([f"{share:.0%}", ", ".join(str(b) for b, _ in at), _f(mean["allocated"], "{:.2f}"),
                     f"{best} {mean[best]:.2f}", f"{mean['allocated'] / mean[best]:.3f}x"])
    if not rows:
        return ""
    return ("Each way averaged over the batch sizes:\n\n"
            + md_table(["draft memory", "B", "allocated tok/step", "best single format", "allocated ÷ best"], rows)
            + "\n")


def ratio_interval(a: list, b: list, draws: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """The 95 % interval of (tokens per step of a) / (that of b) over their requests
    (`sequence_decode`: [decode tokens, steps] a request), the requests resampled in pairs:
    both ran the same prompts. None without the per-request counts."""
    if not a or not b or len(a) != len(b):
        return None
    rng, n, ratios = random.Random(seed), len(a), []
    for _ in range(draws):
        pick = [rng.randrange(n) for _ in range(n)]
        steps_a, steps_b = sum(a[i][1] for i in pick), sum(b[i][1] for i in pick)
        if steps_a and steps_b:
            ratios.append(sum(a[i][0] for i in pick) / steps_a / (sum(b[i][0] for i in pick) / steps_b))
    ratios.sort()
    return (ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]) if ratios else None


def draft_memory_samples(samples: list[tuple[str, dict]], curves: dict[str, dict]) -> str:
    """The scarce points with more prompts: the allocator against each single format (with
    the 95 % interval of that ratio over the requests), beside the same comparison on the
    curve (`curves`: its documents by file name)."""
    rows = []
    for name, doc in samples:
        batch, _, points = draft_memory_points(doc)
        curve = curves.get(name.replace("-sample", ""))
        on_curve = draft_memory_points(curve)[2] if curve else {}
        for share in sorted({s for s, _ in points}):
            at = ways_at(points, share)
            best = best_single(at)
            if "allocated" not in at or best is None:
                continue
            mine, singles = at["allocated"], singles_at(at)
            ratio = mine["tokens_per_step"] / singles[best]["tokens_per_step"]
            interval = ratio_interval(mine.get("sequence_decode"), singles[best].get("sequence_decode"))
            met = "yes" if ratio >= 1.0 else "no" if interval is None or interval[1] < 1.0 else "no; 1.0 in the interval"
            rows.append([_sample_of(name, doc, batch), str(batch), f"{share:.0%}",
                         str(doc["config"]["prompt_batches"] * batch), _f(mine["tokens_per_step"], "{:.2f}"),
                         " · ".join(f"{w} {singles[w]['tokens_per_step']:.2f}" for w in singles),
                         f"{ratio:.3f}x", f"{interval[0]:.3f}-{interval[1]:.3f}" if interval else "–", met,
                         _curve_ratio(on_curve, share)])
    return md_table(["model", "B", "draft memory", "prompts", "allocated tok/step", "single formats",
                     "allocated ÷ best", "95 % interval", "≥ 1.0", "on the curve"], rows) + "\n"


def draft_memory_pooled(samples: list[tuple[str, dict]]) -> str:
    """The points sampled on more than one set of prompts, their requests pooled: each way's
    tokens per step over every set's requests, the allocator against the best single format
    so pooled, and the 95 % interval of that ratio (resampled in pairs over all the requests):
    one set's ratio moves from one set to the next by more than its own interval says."""
    groups: dict[tuple[str, int, float], list[tuple[dict, dict[str, dict]]]] = {}
    for name, doc in samples:
        batch, _, points = draft_memory_points(doc)
        for share in sorted({s for s, _ in points}):
            groups.setdefault((_model_of(name), batch, share), []).append((doc, ways_at(points, share)))
    rows = []
    for (model, batch, share), sets in sorted(groups.items()):
        ways = set.intersection(*(set(at) for _, at in sets)) - {"paper"}
        if len(sets) < 2 or "allocated" not in ways or len(ways) < 2 or not all(
                at[w].get("sequence_decode") for _, at in sets for w in ways):
            continue
        requests = {w: [req for _, at in sets for req in at[w]["sequence_decode"]] for w in ways}
        pooled = {w: sum(t for t, _ in reqs) / sum(n for _, n in reqs) for w, reqs in requests.items()}
        best = max(ways - {"allocated"}, key=lambda w: pooled[w])
        ratio = pooled["allocated"] / pooled[best]
        interval = ratio_interval(requests["allocated"], requests[best])
        rows.append([model, str(batch), f"{share:.0%}", ", ".join(_prompt_range(doc, batch) for doc, _ in sets),
                     str(len(requests["allocated"])), f"{pooled['allocated']:.2f}", f"{best} {pooled[best]:.2f}",
                     f"{ratio:.3f}x", f"{interval[0]:.3f}-{interval[1]:.3f}" if interval else "–",
                     "yes" if ratio >= 1.0 else "no"])
    if not rows:
        return ""
    return md_table(["model", "B", "draft memory", "prompts", "requests", "allocated tok/step",
                     "best single format", "allocated ÷ best", "95 % interval", "≥ 1.0"], rows) + "\n"


def _model_of(name: str) -> str:
    return "translation" if "translate" in name else "demo"


def _prompt_range(doc: dict, batch: int) -> str:
    skip = doc["config"].get("prompts_skip", 0)
    return f"{skip + 1}-{skip + doc['config']['prompt_batches'] * batch}"


def _sample_of(name: str, doc: dict, batch: int) -> str:
    """The model, and which of the file's prompts where the run skipped some."""
    model, skip = _model_of(name), doc["config"].get("prompts_skip", 0)
    return f"{model} (prompts {_prompt_range(doc, batch)})" if skip else model


def _curve_ratio(points: dict, share: float) -> str:
    """The allocator against the best single format at `share` on the curve."""
    at = ways_at(points, share)
    best = best_single(at)
    if "allocated" not in at or best is None:
        return "–"
    return f"{at['allocated']['tokens_per_step'] / at[best]['tokens_per_step']:.3f}x ({best})"


# benchmarks/pick_costs.py's documents: (file name, model) on training prompts (the
# translation model has held-out prompts only: a set the curve and the sample did not use)
PICK_COSTS = (("pick-costs.json", "demo"), ("pick-costs-translate.json", "translation"))
PICK_COSTS_RUNS = (("pick-costs.json", ""), ("pick-costs-translate.json", "--model specmoe-demo-translate "
                   "--prompts-file benchmarks/prompts/translate_heldout.jsonl --prompts-skip 200 --num-prompts 64 "))
COPY_WAYS = tuple(BITS)  # int8 .. int2


def pick_cost_table(costs: list[tuple[str, dict]]) -> str:
    """Each way's cost per pick measured from the draft's acceptance beside the engine's
    model of it (pick_cost of the relative output error), both as multiples of int3's."""
    rows = []
    for model, doc in costs:
        c, errors = doc["costs"], doc.get("errors", {})
        # the engine's model as it is now, not as it was when the document was written
        e = {way: pick_cost(error) for way, error in errors.items()}
        for way in (*COPY_WAYS, "substitute"):
            rows.append([model, way, _f(errors.get(way), "{:.3f}"), f"{c[way]:.5f}",
                         _f(c[way] / c["int3"] if c["int3"] else None, "{:.2f}"),
                         _f(e[way] / e["int3"] if e.get(way) is not None and e.get("int3") else None, "{:.2f}")])
    return md_table(["model", "way", "relative output error", "cost per pick (from acceptance)", "÷ int3's",
                     "error model ÷ int3's"], rows) + "\n"


def block_cost_table(costs: list[tuple[str, dict]]) -> str:
    """Per block: its share of the residual stream and the weight the allocator gives its
    picks, beside what a pick there costs measured from acceptance (int2 there, then its less
    picked half substituted; every other expert int8), each over its mean over the blocks."""
    rows = []
    for model, doc in costs:
        blocks = doc["blocks"]
        mean = {w: sum(b[w] for b in blocks) / len(blocks) for w in ("int2", "substitute")}
        for b in blocks:
            rows.append([model, str(b["layer"]), f"{b['residual_share']:.3f}", f"{b['weight']:.2f}",
                         f"{b['int2']:.5f}", _f(b["int2"] / mean["int2"] if mean["int2"] > 0 else None, "{:.2f}"),
                         f"{b['substitute']:.5f}",
                         _f(b["substitute"] / mean["substitute"] if mean["substitute"] > 0 else None, "{:.2f}")])
    return md_table(["model", "block", "share of the residual stream", "weight (allocator)", "int2: cost per pick",
                     "÷ blocks' mean", "substitute: cost per pick", "÷ blocks' mean"], rows) + "\n"


def _real_size_run(stem: str, ways: str, smoke_ways: str, batch: int, share: int, tokens: int,
                   prompt_batches: int) -> Run:
    name = f"{stem}-{batch}-{share}.json"
    return Run(name, f"{REAL_SIZE_MODEL} && specmoe bench --model {{out}}/real-size-k8-m16 --no-grid --ablation "
               f"draft-memory --ablation-draft-memory {share}% --ablation-draft-ways {ways} --ablation-batch-size "
               f"{batch} {ablation_run(tokens, prompt_batches)} --json {{out}}/{name}",
               f"{REAL_SIZE_SMOKE_MODEL} && specmoe bench --model {{out}}/real-size-k2-m2 --no-grid --ablation "
               f"draft-memory --ablation-draft-memory {share}% --ablation-draft-ways {smoke_ways} "
               f"--ablation-batch-size {min(batch, 2)} {BENCH_SMOKE} --anchors none --json {{out}}/{name}")


def draft_memory_section(docs: dict[str, dict]) -> str:
    """The goals per model and batch size, each way averaged over the batch sizes, and
    the curves' picture."""
    parts = []
    for title, stem, names in (
            ("The demo model", "draft-memory", [f"draft-memory-{b}.json" for b in (1, 16, 64)]),
            ("The translation model (its decoder blocks draft)", "draft-memory-translate",
             [f"draft-memory-translate-{b}.json" for b in (1, 16, 64)]),
            ("The real-size model (int8, int4 and the paper's draft beside the allocator)", "draft-memory-real-size",
             [f"draft-memory-real-size-{b}-{share}.json" for b, share, _, _ in REAL_SIZE_POINTS])):
        present = [docs[n] for n in names if n in docs]
        if not present:
            continue
        # the same model's scarce points again with more prompts: draft-memory-sample-1.json beside draft-memory-1.json
        sampled = [docs.get(n.replace("draft-memory", "draft-memory-sample", 1)) for n in names if n in docs]
        text = f"### {title}\n\n" + draft_memory_goals(
            present, {draft_memory_points(s)[0]: s for s in sampled if s is not None})
        if stem:  # a curve per batch size: their means, and the picture
            text += ("\n" + draft_memory_means(present) + "\n"
                     f"![{title}: tokens per step and throughput against draft memory](docs/{stem}.png)\n")
        parts.append(text)
    again = [(f"B = {b}, {share} %", docs[page], docs[rerun]) for b, share, _, _ in REAL_SIZE_POINTS
             if (page := f"draft-memory-real-size-{b}-{share}.json") in docs
             and (rerun := f"{REAL_SIZE_AGAIN}-{b}-{share}.json") in docs]
    if again:
        parts.append("The real-size points again, the allocator alone, once it priced a pick by the square of its "
                     "copy's error (the runs above ran with a cube): where it holds the same copies, the same "
                     "tokens follow and those runs stand.\n\n" + same_holdings(again))
    samples = [(n, docs[n]) for n in (f"{stem}-{b}.json" for stem, _, b, *_ in SAMPLE_POINTS) if n in docs]
    if samples:
        parts.append("### The scarce points with more prompts\n\n"
                     "Tokens per step where the draft is scarce, again with more prompts (host tier: "
                     "tokens per step do not depend on it), the allocator's ratio to the best single format with "
                     "its 95 % interval over the requests (resampled in pairs: both ran the same prompts), beside "
                     "the curve's own comparison at that point (\"on the curve\"):\n\n" + draft_memory_samples(samples, docs))
        pooled = draft_memory_pooled(samples)
        if pooled:
            parts.append("Where a point ran on more than one set of prompts, every set's requests pooled (one "
                         "set's ratio moves from one set to the next by more than its own interval says):\n\n"
                         + pooled)
    costs = [(model, docs[name]) for name, model in PICK_COSTS if name in docs]
    if costs:
        parts.append("### What a pick costs the draft, measured from its acceptance\n\n"
                     "A drafted token survives each of its P picks (top_k per drafting block) held one way with "
                     "chance exp(-c), so its acceptance is exp(-P sum_w s_w c_w) over the shares s_w of its picks "
                     "held each way: c, a way's cost per pick, from runs with every drafting expert held one way "
                     "(int8 .. int2 copies of all of them), then substitution beside int8 copies of half and "
                     "three quarters of the experts, placed as the allocator places them (in the blocks that "
                     "weigh most: the substituted picks fall in the others) (benchmarks/pick_costs.py; host "
                     "tier, B = 16, 96 tokens, the "
                     "demo model's training prompts (32), the translation model's held-out prompts 201-264, "
                     "neither the curve's nor the sample's). Beside each, the allocator's model of it from the "
                     "relative output error:\n\n" + pick_cost_table(costs)
                     + "\nBlock by block: one block held int2 (then its less picked half substituted), every "
                     "other expert an int8 copy. The output errors are alike in every block, but a pick costs "
                     "more where the block writes more of the residual stream: the allocator weighs each "
                     "block's picks by the square of that share (measured on the first prefill), over its "
                     "mean:\n\n" + block_cost_table(costs))
    return "\n".join(p.rstrip("\n") + "\n" for p in parts)


SECTION = Section("draft-memory", "The draft under a memory budget",
            "`--draft-memory`: the draft's bytes, as a share of all expert bytes, added to the run's budget (30 % of "
            "the expert bytes + non-expert + KV) so that verification keeps the same pool at every point; held-out "
            "prompts, real disk tier, one torch thread, each run beside ondemand in one rotation (B = 1: four "
            "prompts one after another; B = 64: 48 tokens and no 5 % point, for time). At each point: each "
            "expert's way chosen (allocated: full precision, int8 .. int2 copies or substitution), one format for "
            "the experts it can hold, most picked first, the rest substituted (int8 .. int2), and the paper's "
            "draft of full-precision experts (paper). The goals: the allocator's tokens per step at least the best "
            "single format's and twice the paper's (where twice the paper's is above gamma + 1, every draft "
            "accepted, the table says so). Below each model's table, each way averaged over the batch sizes: "
            "where the draft is scarce (5-10 %) the best single format on the curve changes from one batch size to "
            "the next, and with the sample (below). The real-size model at "
            "B = 1 (four prompts of 48 tokens one after another), 16 and 64 (32 tokens), at 20 and 40 %, one run per "
            "draft memory, int8, int4 and the paper's draft beside the allocator "
            "(int3 and int2 copies take the portable path there, about 1 tok/s; they held fewer tokens per step "
            "than int4 at 20 and 40 % on every smaller curve). The curves: docs/STEM.png (python "
            "benchmarks/plot_draft_memory.py docs/STEM.png bench-results/STEM-{1,16,64}.json, STEM draft-memory or "
            "draft-memory-translate; the real-size curve from bench-results/draft-memory-real-size-*.json, each "
            "point's throughput against the ondemand of its own run). The allocator weighs each block's picks "
            "by the square of the block's share of the residual stream, measured on the first prefill (the last "
            "table below): the demo model's first MoE block writes 0.98 of the stream and the others about a "
            "fifth, so where the draft is scarce it holds the better copies there. Before it weighed blocks it held "
            "int2 copies of 72 experts and one int3 there, tying int2 alone (0.958-1.001x on three sets of 128 "
            "prompts, B = 16) at 2.2-2.7 tokens per step. It prices a pick by the square of its copy's relative "
            "output error (saturating; a cube before, chosen again on training prompts once blocks were weighed: "
            "the square fell short of the best single format at one of nine training points, the cube at three). "
            "Where the draft is scarce the square holds more int3 copies and substitutes a few more experts (demo "
            "model, 5 %, B = 16: int4 copies of 16 experts, int3 of 8 and int2 of 36, 68 substituted, where the "
            "cube held 9, 8 and 48 and substituted 63; translation model, 5 %, B = 1: 19 int3, 9 int2 and 4 "
            "substituted, where the cube held 4 int3 and 28 int2); where every expert gets at least an int4 copy "
            "the two hold the same. The demo and translation curves, the samples below and the draft splits ran "
            "again with the square. The real-size curve's points hold int4 and int8 copies (20 %) or full "
            "experts and int8 copies (40 %): the allocator ran again alone at each with the square (the table below "
            "the real-size curve) and held the same copies, at the same tokens per step, so its runs stand. They "
            "ran with the block weights (half an hour a run here; B = 16 at 40 % and B = 64 "
            "beside other benchmarks on this machine's two cores: their throughput against ondemand is noisier, their "
            "tokens per step are not; at B = 1 and 40 % int8 alone held every expert, as before the weights, and "
            "drafted 14.46 tokens per step against 15.67 then). Where the draft is scarce the ways come within a few "
            "% of each other, closer than one run's sampling error, so those points ran again with more prompts (the "
            "demo model at B = 1: 32 one after another, B = 16: 128, both beside int3 and int2, eight times the "
            "curve's prompts, and B = 16 at 5 % on the next two sets of 128 too; B = 64: 128; the translation model "
            "at B = 1: 64, and at 5 % on its next two sets of 64 too; 96 tokens each, beside int4, int3 and int2), on "
            "the host tier: tokens per step do not depend on the tier. The interval over one run's requests is "
            "narrower than what changes from one set of prompts to the next.",
            tuple(Run(f"{stem}-{b}.json", f"specmoe bench {model}--no-grid --ablation draft-memory "
                      f"--ablation-draft-memory {shares} --ablation-batch-size {b} {run} --json {{out}}/{stem}-{b}.json",
                      f"specmoe bench {model}--no-grid --ablation draft-memory --ablation-draft-memory 20% "
                      f"--ablation-batch-size {smoke} {BENCH_SMOKE} --anchors none --json {{out}}/{stem}-{b}.json")
                  for stem, model in (("draft-memory", ""), ("draft-memory-translate", TRANSLATE))
                  for b, smoke, shares, run in ((1, 1, "5%,10%,20%,40%", DRAFT_MEMORY_RUN + " --prompt-batches 4"),
                                                (16, 2, "5%,10%,20%,40%", DRAFT_MEMORY_RUN + " --prompt-batches 1"),
                                                (64, 4, "10%,20%,40%", DRAFT_MEMORY_RUN_64)))
            + tuple(_real_size_run(stem, ways, smoke_ways, *point) for point in REAL_SIZE_POINTS
                    for stem, ways, smoke_ways in (("draft-memory-real-size", REAL_SIZE_WAYS, "allocated,int8"),
                                                   (REAL_SIZE_AGAIN, "allocated", "allocated")))
            + tuple(Run(f"{stem}-{b}.json", f"specmoe bench {model}--no-grid --ablation draft-memory "
                        f"--ablation-draft-memory {shares} --ablation-draft-ways {ways} --ablation-batch-size {b} "
                        f"{ablation_run(tokens, batches)} --offload host --json {{out}}/{stem}-{b}.json",
                        f"specmoe bench {model}--no-grid --ablation draft-memory --ablation-draft-memory 10% "
                        f"--ablation-draft-ways allocated,int3 --ablation-batch-size {min(b, 2)} {BENCH_SMOKE} "
                        f"--anchors none --offload host --json {{out}}/{stem}-{b}.json")
                    for stem, model, b, shares, tokens, batches, ways in SAMPLE_POINTS)
            + tuple(Run(name, f"python benchmarks/pick_costs.py {options}--json {{out}}/{name}",
                        f"python benchmarks/pick_costs.py {options}--num-prompts 4 --max-tokens 8 "
                        f"--json {{out}}/{name}")
                    for name, options in PICK_COSTS_RUNS),
            draft_memory_section)
