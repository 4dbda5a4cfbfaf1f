"""How a benchmark is run and summarised: prompts, the budget rule, interleaved timing,
the median over repeats, and the check that every policy produced the same tokens.

Timing protocol. For one group (a batch size of the main grid, or one ablation) every
runner is built first (never timed). Then rounds: round 0 is a warm-up, rounds 1..R are
timed; in each round every runner runs once, so that drift of a shared machine (another
job, thermal state, page cache) hits all alike. Each round runs them in another order
(`round_order`): what a runner leaves behind (a page cache emptied by ondemand's reads, a
disk queue still draining) then falls on a different successor each round instead of
always on the same one. A record reports the median timed run (the lower median for an
even R) and min/median/max of the main statistics over the R runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..base.errors import SpecMoEError
from ..base.gguf_checkpoint import load_tokenizer, open_checkpoint

EXPERT_FRACTION = 0.3  # share of all expert bytes the default budget gives the expert pool

BUDGET_RULE = (
    "device memory = non-expert bytes + KV cache reserved for the run (batch x max_model_len positions, "
    "max_model_len = longest prompt + max_tokens + gamma + 1) + {pct} % of all expert bytes. The KV cache "
    "counts against the budget, so it is added: experts get {pct} % at every batch size. resident runs "
    "without a limit (it is the upper bound: every expert on the device)."
)

# Statistics summarised over repeats as {"min", "median", "max"}.
SUMMARY_KEYS = (
    "decode_tokens_per_s", "wall_s", "ttft_s", "tbt_s", "tokens_per_step", "acceptance_rate",
    "transfer_bytes_per_token", "transfer_wait_s", "compute_s", "device_peak_bytes",
)


# --- prompts and budget ---------------------------------------------------------------------------


def encode_prompts(prompts: list, model_dir: Path, vocab_size: int) -> list[list[int]]:
    """Token ids of each prompt, with the checkpoint's tokenizer: every system benchmarked
    (each policy, each anchor) then gets exactly the same ids, and tokenizing is not timed."""

    tokenizer = None
    out = []
    for n, p in enumerate(prompts, 1):
        if isinstance(p, str):
            if tokenizer is None:
                tokenizer = load_tokenizer(open_checkpoint(Path(model_dir)))
                if tokenizer is None:
                    raise SpecMoEError(
                        f"{model_dir} has no tokenizer.json, so text prompts cannot be encoded: "
                        "use a prompts file with {\"prompt_token_ids\": [...]} lines"
                    )
            ids = tokenizer.encode(p)
        else:
            ids = list(p)
        if not ids:
            raise SpecMoEError(f"prompt {n} is empty")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            raise SpecMoEError(f"prompt {n}: token id {bad[0]!r} is outside the vocabulary (0..{vocab_size - 1})")
        out.append(ids)
    return out


def prompts_for_batch(prompts: list[list[int]], batch_size: int, batches: int = 2) -> list[list[int]]:
    """The first `batches` x B prompts (all of them if the file has fewer)."""
    return prompts[: batch_size * batches]


def max_model_len_for(prompts: list[list[int]], max_tokens: int, gamma: int, max_positions: int) -> int:
    """KV positions a sequence can need: its prompt, its tokens, and gamma + 1 provisional
    draft positions of the last speculative step."""
    return min(max(len(p) for p in prompts) + max_tokens + gamma + 1, max_positions)


def default_budget(info: dict, batch_size: int, max_model_len: int, fraction: float = EXPERT_FRACTION) -> int:
    """Non-expert bytes + the KV cache (an encoder-decoder's cross-attention K/V of its source
    too, as the engine reserves it) + `fraction` of the expert bytes."""
    per_position = info["kv_bytes_per_token"] + info.get("kv_cross_bytes_per_source_token", 0)
    return int(info["non_expert_bytes"] + per_position * batch_size * max_model_len
               + fraction * info["expert_bytes_total"])


# --- timing -----------------------------------------------------------------------------------------


@dataclass
class Measurement:
    label: str
    kind: str
    fields: dict
    rounds: list[dict] = field(default_factory=list)  # round 0 is the warm-up
    token_ids: list | None = None  # of the last round
    error: str | None = None  # the runner could not be built: skipped

    @property
    def timed(self) -> list[dict]:
        return self.rounds[1:]


@dataclass
class Builder:
    label: str
    kind: str
    build: Callable  # () -> Runner
    fields: dict = field(default_factory=dict)


def _build(b: Builder, on_skip: Callable | None) -> tuple[Measurement, object]:
    m = Measurement(b.label, b.kind, dict(b.fields))
    try:
        return m, b.build()
    except (SpecMoEError, ImportError, RuntimeError, MemoryError) as exc:
        # A policy that does not fit (resident on a large model) or an anchor that
        # cannot load is reported as skipped; the rest of the group still runs.
        m.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if on_skip:
            on_skip(m)
        return m, None


def _run(m: Measurement, runner, rnd: int, on_run: Callable | None) -> None:
    stats, ids = runner.run()
    stats.update(m.fields)
    m.rounds.append(stats)
    m.token_ids = ids
    if on_run:
        on_run(m, rnd, stats)


def round_order(n: int, rnd: int) -> list[int]:
    """The order in which `n` runners run in round `rnd`: a Williams design (0, 1, n-1, 2,
    n-2, ...) shifted by the round. Over n rounds (2n for odd n, whose odd rounds run
    reversed) every runner holds every place once and follows every other runner once: on
    the real-size model a fixed order had the runner after ondemand wait four times as long
    for its transfers in every round, and lose a goal it met in another order."""
    if n <= 1:
        return list(range(n))
    base, low, high = [0], 1, n - 1
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    order = [(i + rnd) % n for i in base]
    return order[::-1] if n % 2 and rnd % 2 else order


def measure(builders: list[Builder], repeats: int, on_run: Callable | None = None,
            on_skip: Callable | None = None, together: bool = True) -> list[Measurement]:
    """Build every runner, then run warm-up + `repeats` interleaved rounds, each in its own
    order (`round_order`). Not
    `together` (runners that would not fit in memory side by side): each runner is built,
    run warm-up + `repeats` times and closed before the next is built."""
    if not together:
        measurements = []
        for b in builders:
            m, runner = _build(b, on_skip)
            measurements.append(m)
            try:
                for rnd in range(repeats + 1 if runner is not None else 0):
                    _run(m, runner, rnd, on_run)
            finally:
                if runner is not None:
                    runner.close()
        return measurements
    measurements, runners = [], []
    try:
        for b in builders:
            m, runner = _build(b, on_skip)
            measurements.append(m)
            runners.append(runner)
        for rnd in range(repeats + 1):
            for i in round_order(len(runners), rnd):
                if runners[i] is not None:
                    _run(measurements[i], runners[i], rnd, on_run)
    finally:
        for runner in runners:
            if runner is not None:
                runner.close()
    return measurements


WHOLE_MODEL_RUNNERS = ("resident", "transformers", "llama.cpp")  # every weight in the process's memory


def runner_needs(labels: list[str], whole: int, budget: int) -> dict[str, int]:
    """Host memory each runner holds: the whole model for those that keep every weight
    (llama.cpp too: counted as page cache it could give back, a real-size group judged to
    fit in 22 GiB was killed by the kernel at 24 GiB anonymous), the budget for the rest."""
    return {label: whole if label in WHOLE_MODEL_RUNNERS else budget for label in labels}


def fit_together(needs: dict[str, int], available: int, share: float = 0.85) -> bool:
    """Whether runners needing `needs` bytes of host memory each (label -> bytes) fit side
    by side in `share` of the `available` bytes."""
    return sum(needs.values()) <= share * available


def summarize(m: Measurement) -> dict:
    """The record of one runner: its median timed run plus min/median/max over repeats."""
    if m.error is not None:
        return {"label": m.label, "kind": m.kind, **m.fields, "skipped": m.error}
    runs = m.timed
    order = sorted(range(len(runs)), key=lambda i: runs[i].get("decode_tokens_per_s") or 0.0)
    record = {"label": m.label, "kind": m.kind, **dict(runs[order[(len(runs) - 1) // 2]])}
    record["repeats"] = len(runs)
    over = {}
    for key in SUMMARY_KEYS:
        values = [r.get(key) for r in runs]
        if any(v is None for v in values):
            continue
        over[key] = {"min": min(values), "median": statistics.median_low(values), "max": max(values)}
    record["over_repeats"] = over
    direct = [r.get("offload_direct") for r in m.rounds]  # every round, warm-up included
    if any(d is not None for d in direct):
        record["offload_direct"] = all(direct)
        record["offload_direct_reason"] = next((r.get("offload_direct_reason") for r in m.rounds
                                                if not r.get("offload_direct")), "O_DIRECT")
    return record


def tokps(record: dict | None) -> float | None:
    if not record or record.get("skipped"):
        return None
    return record["decode_tokens_per_s"]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# --- output identity -------------------------------------------------------------------------------


def held_exact(measurements: list[Measurement], exact_anchors: tuple[str, ...]) -> list[Measurement]:
    """The runs whose tokens must be the reference's: every policy, and the anchors in
    `exact_anchors` (the others' share of equal tokens is reported instead)."""
    return [m for m in measurements if m.kind != "anchor" or m.label in exact_anchors]


def check_outputs(measurements: list[Measurement], reference: str, where: str) -> tuple[int, list[str]]:
    """Compare every runner's token_ids_sha256 with the reference's, round by round
    (warm-up included). Returns (comparisons made, mismatch descriptions)."""
    by_label = {m.label: m for m in measurements if m.error is None}
    ref = by_label.get(reference)
    if ref is None:
        return 0, []
    checked, bad = 0, []
    ref_shas = [r["token_ids_sha256"] for r in ref.rounds]
    if len(set(ref_shas)) > 1:
        bad.append(f"{where}: {reference} itself produced different tokens in different rounds")
    for m in by_label.values():
        if m is ref:
            continue
        for rnd, (run, ref_sha) in enumerate(zip(m.rounds, ref_shas)):
            checked += 1
            if run["token_ids_sha256"] != ref_sha:
                name = "warm-up" if rnd == 0 else f"repeat {rnd}"
                bad.append(f"{where}, {name}: {m.label} sha {run['token_ids_sha256'][:12]} != "
                           f"{reference} {ref_sha[:12]}")
    return checked, bad


def matches_reference(m: Measurement, ref: Measurement | None) -> bool | None:
    if ref is None or m.error is not None or ref.error is not None:
        return None
    return all(a["token_ids_sha256"] == b["token_ids_sha256"] for a, b in zip(m.rounds, ref.rounds))


def token_agreement(ids: list[list[int]] | None, ref: list[list[int]] | None) -> float | None:
    """Share of positions where two runs generated the same token (for anchors, whose
    padded batches may round differently)."""
    if not ids or not ref:
        return None
    same = total = 0
    for a, b in zip(ids, ref):
        total += max(len(a), len(b))
        same += sum(x == y for x, y in zip(a, b))
    return same / total if total else None
