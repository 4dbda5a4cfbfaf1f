"""A trace mapped onto the replayed shape, as the steps each policy replays.

`LayerMap` folds trace layers onto the K replayed layers and expert ids onto the shape's
E experts. A `Schedule` is one (policy, batch size): its steps, each a list of passes
with per-layer (mapped) expert token counts, taken from the trace exactly (specmoe's
draft and verify passes, a decode trace's decode passes) or derived from a specmoe
trace's verify passes (`split_verify`)."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass, field

from ...base.trace import LayerRouting, StepRecord
from .sources import TraceSource


@dataclass(frozen=True)
class LayerMap:
    """Trace layers -> ranks (0..L-1) -> replayed layers (rank mod K); expert ids mod E."""

    trace_layers: tuple[int, ...]
    physical_layers: int  # K
    num_experts: int  # E of the replayed shape

    @property
    def num_trace_layers(self) -> int:
        return len(self.trace_layers)

    def rank(self, layer: int) -> int:
        return self.trace_layers.index(layer)

    def physical(self, layer_id: int) -> int:
        """Replayed layer of a pool layer id (a rank, or a running id = pass x L + rank)."""
        return (layer_id % self.num_trace_layers) % self.physical_layers

    def expert(self, e: int) -> int:
        return e % self.num_experts

    def counts(self, expert_tokens: dict[int, int]) -> dict[int, int]:
        out: dict[int, int] = {}
        for e, n in expert_tokens.items():
            if n > 0:
                m = self.expert(e)
                out[m] = out.get(m, 0) + int(n)
        return dict(sorted(out.items()))

    def experts(self, ids) -> list[int]:
        return sorted({self.expert(e) for e in ids})


@dataclass
class PassPlan:
    kind: str  # decode | draft | verify
    batch: int
    positions: int
    layers: list[tuple[int, dict[int, int]]]  # (rank, mapped expert -> tokens), in layer order


@dataclass
class StepPlan:
    passes: list[PassPlan]
    batch: int
    generated: int  # tokens this step adds over all its sequences
    draft_set: dict[int, list[int]] = field(default_factory=dict)  # rank -> mapped draft experts (specmoe)
    predicted: dict[int, Counter] = field(default_factory=dict)  # rank -> drafts' own mapped picks (specmoe)
    next_draft_set: dict[int, list[int]] = field(default_factory=dict)  # the next cycle's (specmoe refresh)


@dataclass
class Schedule:
    policy: str
    batch: int
    source: str  # "exact" | "derived"
    trace: TraceSource
    steps: list[StepPlan]
    note: str
    gamma: int | None = None

    @property
    def draft_experts(self) -> float | None:
        sizes = [len(v) for s in self.steps for v in s.draft_set.values()]
        return sum(sizes) / len(sizes) if sizes else None


def _pass(r: StepRecord, kind: str, lmap: LayerMap) -> PassPlan:
    layers = [(lmap.rank(lr.layer), lmap.counts(lr.expert_tokens)) for lr in sorted(r.layers, key=lambda x: x.layer)]
    return PassPlan(kind, r.batch_size, r.positions, layers)


def _full_batch(records: list[StepRecord], batch: int) -> list[StepRecord]:
    full = [r for r in records if r.batch_size == batch]
    return full or records


def specmoe_steps(src: TraceSource, lmap: LayerMap) -> list[StepPlan]:
    """One step per speculative cycle: its draft passes and the verify pass after them."""
    steps, drafts = [], []
    for r in src.records:
        if r.kind == "draft":
            drafts.append(r)
        elif r.kind == "verify":
            if r.batch_size == src.batch and r.layers:
                first = drafts[0] if drafts else r
                predicted: dict[int, Counter] = {}
                for d in drafts:
                    for lr in d.layers:
                        predicted.setdefault(lmap.rank(lr.layer), Counter()).update(lmap.counts(lr.expert_tokens))
                draft_set = {lmap.rank(l): lmap.experts(es) for l, es in (first.draft_set or r.draft_set).items()
                             if l in lmap.trace_layers}
                generated = sum(a + 1 for a in r.accepted_lengths) if r.accepted_lengths else r.batch_size
                passes = [_pass(d, "draft", lmap) for d in drafts if d.layers] + [_pass(r, "verify", lmap)]
                steps.append(StepPlan(passes, r.batch_size, generated, draft_set, predicted))
            drafts = []
        else:
            drafts = []
    for st, nxt in itertools.pairwise(steps):
        st.next_draft_set = nxt.draft_set
    return steps


def decode_steps(src: TraceSource, lmap: LayerMap) -> list[StepPlan]:
    """Recorded decode passes (exact routing)."""
    recs = _full_batch([r for r in src.records if r.kind == "decode" and r.layers], src.batch)
    return [StepPlan([_pass(r, "decode", lmap)], r.batch_size, r.batch_size) for r in recs]


def split_verify(r: StepRecord, rng: random.Random) -> list[StepRecord]:
    """A verify pass over B x (gamma + 1) positions as gamma + 1 decode passes of B positions.

    Per layer, the pass's recorded picks (expert e repeated expert_tokens[e] times) are
    shuffled and dealt in gamma + 1 hands of B x k picks: per-expert totals are kept,
    which position chose what is not in a trace."""

    n = r.positions_per_sequence
    out = [StepRecord(step=r.step, kind="decode", batch_size=r.batch_size, positions=r.batch_size) for _ in range(n)]
    for lr in r.layers:
        picks = [e for e, c in sorted(lr.expert_tokens.items()) for _ in range(c)]
        rng.shuffle(picks)
        hand = max(1, len(picks) // n)
        for i, rec in enumerate(out):
            chunk = picks[i * hand:(i + 1) * hand] if i < n - 1 else picks[i * hand:]
            rec.layers.append(LayerRouting(lr.layer, dict(Counter(chunk))))
    return out


def derived_decode_steps(src: TraceSource, lmap: LayerMap, seed: int) -> list[StepPlan]:
    rng = random.Random(seed)
    steps = []
    for r in src.records:
        if r.kind == "verify" and r.layers and r.batch_size == src.batch:
            for d in split_verify(r, rng):
                steps.append(StepPlan([_pass(d, "decode", lmap)], d.batch_size, d.batch_size))
    return steps


def hot_sets(src: TraceSource, lmap: LayerMap, per_block: int) -> tuple[dict[int, list[int]], str]:
    """Caching's resident set per rank: the most picked (mapped) experts of the prefill
    routing, as the engine profiles the prompts; else of the whole trace."""
    prefill = []
    for r in src.records:
        if r.kind != "prefill":
            break
        prefill.append(r)
    recs, what = (prefill, "the trace's prefill routing") if any(r.layers for r in prefill) else \
        (src.records, "the whole trace's routing (it has no prefill routing)")
    counts = {rank: Counter() for rank in range(lmap.num_trace_layers)}
    for r in recs:
        for lr in r.layers:
            counts[lmap.rank(lr.layer)].update(lmap.counts(lr.expert_tokens))
    hot = {}
    for rank, c in counts.items():
        order = sorted(range(lmap.num_experts), key=lambda e: (-c.get(e, 0), e))  # stable on ties, as the engine
        hot[rank] = sorted(order[:per_block])
    return hot, what


def build_schedules(sources: list[TraceSource], policies: list[str], batches: list[int], lmap: LayerMap,
                    seed: int) -> tuple[list[Schedule], list[str]]:
    """One schedule per (policy, batch) that some trace supports; notes for the ones skipped."""
    schedules, skipped = [], []
    for b in batches:
        at_b = [s for s in sources if s.batch == b]
        spec = [s for s in at_b if any(r.kind == "verify" for r in s.records)]
        spec.sort(key=lambda s: s.policy != "specmoe")
        for policy in policies:
            if policy == "specmoe":
                if not spec:
                    skipped.append(f"specmoe at batch {b}: no trace with verify passes at batch {b} "
                                   "(record one with --policy specmoe)")
                    continue
                src = spec[0]
                steps = specmoe_steps(src, lmap)
                gammas = Counter(len(s.passes) - 1 for s in steps)
                schedules.append(Schedule(policy, b, "exact", src, steps,
                                          f"draft and verify passes of {src.name}", gamma=gammas.most_common(1)[0][0]
                                          if gammas else None))
                continue
            dec = [s for s in at_b if any(r.kind == "decode" and r.layers for r in s.records)]
            dec.sort(key=lambda s: s.policy != policy)
            if dec:
                src = dec[0]
                why = "" if src.policy == policy else (f" (recorded with {src.policy}: greedy non-speculative "
                                                       "policies decode the same tokens, so they route alike)")
                schedules.append(Schedule(policy, b, "exact", src, decode_steps(src, lmap),
                                          f"decode passes of {src.name}{why}"))
            elif spec:
                src = spec[0]
                schedules.append(Schedule(policy, b, "derived", src, derived_decode_steps(src, lmap, seed),
                                          f"decode passes derived from the verify passes of {src.name}: each pass over "
                                          "B x (gamma+1) positions dealt at random into gamma+1 passes of B positions "
                                          "(per-expert totals exact, per-step distinct experts approximate)"))
            else:
                skipped.append(f"{policy} at batch {b}: no trace at batch {b} with decode or verify passes")
    return [s for s in schedules if s.steps], skipped + [
        f"{s.policy} at batch {s.batch}: {s.trace.name} has no full-batch steps" for s in schedules if not s.steps]
