"""``specmoe replay``: execute a recorded engine trace at another model's expert size and
time it, per policy.

    specmoe replay --trace specmoe=run-b16.jsonl --trace ondemand=od-b16.jsonl \\
        --model-shape mixtral-8x7b --layers 2 --device cuda --offload host --hardware local

What runs. K MoE layers of the shape are built with random weights (the time of a copy
or a matmul does not depend on the values), every routed expert one contiguous buffer
[gate | up | down] in the engine's own offload store (:mod:`specmoe.experts.store`:
host memory, pinned on CUDA, or the disk tier) and a device pool
(:mod:`specmoe.experts.pool`) filled by the engine's transfer engine (one reader thread,
on CUDA a side stream and events). Each step of the trace is then executed pass by pass
and layer by layer: the experts a layer's routing names are fetched as the policy would
fetch them and each is computed on as many tokens (random activations) as the trace
says, through the engine's own block code (``OffloadPolicy.run_block``: experts already
on the device are computed while the missing ones stream in). Step times are real:
``perf_counter`` around each step, after ``torch.cuda.synchronize`` on CUDA.

Mapping a trace onto the shape (stated in every output):

- layers: the trace's MoE layer of rank r (0 = first MoE layer) runs on replayed layer
  r mod K. Every trace layer keeps its own pool entries (draft set, hot set), only the
  host copies of the weights are shared, so K only bounds host memory. Per-layer time
  = step time / trace layers; the full model = per-layer time x the shape's MoE layers.
- experts: id e -> e mod E (E = the shape's experts per layer), token counts of merged
  ids added. The demo model's 16 experts thus fold pairwise onto Mixtral's 8.
- SwiGLU only: a shape with 2-matrix experts (fc1, fc2; NLLB) is run as SwiGLU with
  2/3 of its intermediate size: the same bytes and FLOPs per token.

Policies (each with its own pool: the fetch decisions are the replay's, not copied from
the trace's ``fetched`` field, which depends on the recording's --device-memory):

- ``ondemand``: a block's experts are fetched when it runs, every step, and dropped after
  it (pool: one block, E slots).
- ``overlap``: as ondemand, plus the next block's experts are prefetched while this one
  computes. Predictor: the *recorded* routing of the next block, i.e. perfect prediction
  (the paper's oracle Overlap; the engine's overlap predicts with the next router
  applied to the previous hidden state and is at best this fast). Pool: 2E slots.
- ``caching``: the hottest ``--cache-fraction`` of each block's experts (by the trace's
  prefill routing, as the engine profiles the prompts) stay resident; misses are fetched
  on demand into E more slots (LRU).
- ``specmoe``: per cycle, the recorded draft set (ids mapped) is made resident (refresh;
  normally moves nothing), the gamma draft passes compute with the draft set only (picks
  outside it go round-robin to draft experts: affinity needs real weights; never a
  fetch), then the verify pass fetches the union of what it needs minus the draft set,
  prefetching in the order the drafts' own picks predict (as the engine does). Pool:
  N x trace layers + E slots.

Which routing. A trace holds one policy's run. Greedy non-speculative policies produce
the same tokens and so the same routing: a trace recorded with any of them at batch B
is exact decode routing for ondemand, overlap and caching at B. Without one, their
decode passes are derived from a specmoe trace: each verify pass over B x (gamma + 1)
positions becomes gamma + 1 decode passes of B positions, its recorded expert picks
dealt to them at random per layer (a trace keeps per-expert token counts, not which
position chose what): per-expert totals are exact, per-step distinct counts are an
approximation. specmoe itself needs a specmoe trace at B.

Predictions. For the same steps (the replayed routing and the replay's own fetch
counts) the cost model's rules give a predicted step time (:mod:`specmoe.perf.cost_model`:
per-expert roofline + launches, per-expert transfer time, each policy's overlap rule);
``prediction_error`` = predicted / measured - 1. The projection to a full model adds the
cost model's non-expert compute (attention over ``--context-len`` cached positions,
routers, LM head); the cost model's own end-to-end estimate (routing model fitted to
the trace, as ``specmoe simulate``) is reported next to it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

from ..errors import SpecMoEError
from .shapes import ModelShape, load_shape
from .trace import StepRecord, read_trace
from .units import format_bytes, parse_batch_sizes

REPLAY_POLICIES = ("ondemand", "overlap", "caching", "specmoe")
TRACE_POLICIES = ("resident", "ondemand", "overlap", "caching", "host", "specmoe")
DEFAULT_MAX_STEPS = 8
DEFAULT_CACHE_FRACTION = 0.1
DTYPES = ("bfloat16", "float16", "float32")


class ReplayError(SpecMoEError):
    """Bad input to `specmoe replay`: one line, exit code 2."""


# ---- command line -------------------------------------------------------------------------------

def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "replay", help="time a recorded trace's expert fetches and computations at a model shape, per policy",
        description="Execute the expert fetches and expert computations recorded in engine traces "
                    "(generate/bench --trace) on K layers of a model shape with random weights, for each "
                    "policy, measure real step times, project them to the full model and compare them with "
                    "the performance model.")
    p.add_argument("--trace", action="append", required=True, metavar="[POLICY=]FILE",
                   help="engine trace; repeat for several batch sizes or policies. POLICY= says which policy "
                        "recorded it (default: the trace header's)")
    p.add_argument("--model-shape", required=True, metavar="NAME|config.json",
                   help="preset (mixtral-8x7b, ...) or a HF config.json / model dir")
    p.add_argument("--layers", type=int, default=1, metavar="K",
                   help="MoE layers whose experts are built (host memory: K x experts per layer x expert "
                        "bytes; default 1)")
    p.add_argument("--policies", default=",".join(REPLAY_POLICIES), help="comma-separated, from: "
                   + ", ".join(REPLAY_POLICIES))
    p.add_argument("--batch-sizes", default=None, metavar="B1,B2,...",
                   help="replay only the traces recorded at these batch sizes (default: every one given)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    p.add_argument("--offload", default="host", help="where the experts live: host | disk (default host)")
    p.add_argument("--offload-dir", help="directory for the disk tier's expert file (default: the cache dir)")
    p.add_argument("--dtype", default="bfloat16", help="expert dtype: " + " | ".join(DTYPES) + " (default bfloat16)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply hidden and expert intermediate sizes by this factor (0 < f <= 1), e.g. 0.125 "
                        "to replay a smaller copy of the shape on a CPU")
    p.add_argument("--hardware", metavar="NAME|path",
                   help="hardware profile for the predictions (e.g. one saved by specmoe calibrate); default: "
                        "measure this device's fetch bandwidth and matmul rate quickly")
    p.add_argument("--cache-fraction", type=float, default=None, metavar="F",
                   help=f"caching: share of each block kept resident (default: {DEFAULT_CACHE_FRACTION:.0%}% or "
                        "specmoe's draft-set share N/E, whichever is larger: the same resident bytes)")
    p.add_argument("--max-steps", type=int, default=DEFAULT_MAX_STEPS, metavar="N",
                   help=f"timed steps per policy and batch size after one warm-up step (default {DEFAULT_MAX_STEPS})")
    p.add_argument("--context-len", type=int, default=None,
                   help="cached positions per sequence for the modelled non-expert compute (default: the cost "
                        "model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--output", metavar="FILE", help="also write the JSON object to FILE")
    p.set_defaults(func=run_replay)
    return p


def _csv(text: str, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ReplayError(f"bad --{what} {text!r}: expected a comma-separated list")
    return items


def parse_trace_args(values: list[str]) -> list[tuple[str | None, Path]]:
    """'FILE' or 'POLICY=FILE' -> (policy or None, path)."""
    out = []
    for v in values:
        policy, sep, path = v.partition("=")
        if not sep or "/" in policy or policy.endswith(".jsonl"):
            policy, path = None, v
        elif policy not in TRACE_POLICIES:
            raise ReplayError(f"bad --trace {v!r}: {policy!r} is not a policy; use POLICY=FILE with POLICY one of "
                              f"{', '.join(TRACE_POLICIES)}, or just FILE")
        if not Path(path).is_file():
            raise ReplayError(f"--trace {path}: no such file (record one with specmoe generate --trace FILE)")
        out.append((policy, Path(path)))
    return out


# ---- traces -------------------------------------------------------------------------------------

@dataclass
class TraceSource:
    path: Path
    policy: str  # the policy that recorded it
    header: dict
    records: list[StepRecord]
    batch: int  # the batch size it was recorded at (full-batch steps)
    num_experts: int
    top_k: int
    layers: list[int]  # model indices of its MoE layers, in order

    @property
    def name(self) -> str:
        return self.path.name


def load_trace(path: Path, policy: str | None) -> TraceSource:
    try:
        header, records = read_trace(path)
    except ValueError as e:
        raise ReplayError(str(e)) from None
    routed = [r for r in records if r.layers and r.kind != "prefill"]
    if not routed:
        raise ReplayError(f"trace {path}: no decode, draft or verify step with routing: nothing to replay")
    recorded = (header.get("config") or {}).get("policy")
    if policy and recorded and policy != recorded:
        raise ReplayError(f"--trace {policy}={path}: the trace header says it was recorded with policy {recorded!r}")
    policy = policy or recorded
    if policy not in TRACE_POLICIES:
        raise ReplayError(f"trace {path}: its header names no policy; pass --trace POLICY={path}")
    model = header.get("model") or {}
    experts = int(model.get("num_experts") or 1 + max(e for r in records for lr in r.layers for e in lr.expert_tokens))
    top_k = int(model.get("top_k") or 0)
    if not top_k:  # picks per position, from the passes themselves
        top_k = max(1, round(sum(sum(lr.expert_tokens.values()) for lr in routed[0].layers)
                             / (len(routed[0].layers) * routed[0].positions)))
    layers = sorted({lr.layer for r in records for lr in r.layers})
    batch = int((header.get("config") or {}).get("max_batch_size") or 0) or max(r.batch_size for r in routed)
    batch = min(batch, max(r.batch_size for r in routed))  # fewer prompts than the engine's limit
    return TraceSource(path, policy, header, records, batch, experts, top_k, layers)


# ---- mapping a trace onto the shape -------------------------------------------------------------

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
    hot: dict[int, list[int]] = field(default_factory=dict)  # caching: rank -> resident experts

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
    for st, nxt in zip(steps, steps[1:]):
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
    from .trace import LayerRouting

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


# ---- shapes and memory ---------------------------------------------------------------------------

def _round8(x: float) -> int:
    return max(8, int(round(x / 8)) * 8)


def replay_shape(shape: ModelShape, scale: float, dtype_bytes: int) -> tuple[ModelShape, list[str]]:
    """The shape as replayed: scaled, SwiGLU, at the replay dtype."""
    notes = []
    hidden, inter, name = shape.hidden, shape.expert_intermediate, shape.name
    if shape.expert_matrices != 3:
        inter = _round8(inter * shape.expert_matrices / 3)
        notes.append(f"{shape.name} has {shape.expert_matrices}-matrix experts; replayed as SwiGLU with intermediate "
                     f"size {inter} = {shape.expert_matrices}/3 x {shape.expert_intermediate} (the same bytes and "
                     "FLOPs per token)")
    if scale != 1.0:
        hidden, inter, name = _round8(hidden * scale), _round8(inter * scale), f"{shape.name}x{scale:g}"
        notes.append(f"hidden and expert intermediate sizes scaled by {scale:g} (--scale): {shape.hidden}->{hidden}, "
                     f"{shape.expert_intermediate}->{inter}; times are for that smaller shape")
    out = replace(shape, name=name, hidden=hidden, expert_intermediate=inter, expert_matrices=3,
                  bytes_per_param=float(dtype_bytes))
    return out, notes


def _available_host_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(shape: ModelShape, k: int, pool_slots: int, device, offload: str, hint_scale: bool) -> None:
    """Refuse what cannot fit before allocating anything, saying what to change."""
    e_bytes = shape.expert_bytes
    # host tier on CUDA: the store is allocated, then pinned (a second copy for a moment)
    store = k * shape.num_experts * e_bytes * (2 if device.type == "cuda" else 1) if offload == "host" \
        else 2 * e_bytes
    pool = pool_slots * e_bytes
    fix = "lower --layers" + (" or pass --scale (e.g. 0.125)" if hint_scale else "")
    avail = _available_host_bytes()
    host_need = store + (pool if device.type == "cpu" else 0)
    if avail is not None and host_need > 0.8 * avail:
        raise ReplayError(f"{k} layer(s) of {shape.name} experts ({shape.num_experts} x {format_bytes(e_bytes)}) "
                          f"and a pool of {pool_slots} experts need {format_bytes(host_need)} of host memory; "
                          f"{format_bytes(avail)} is available: {fix}")
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        if pool > 0.9 * free:
            raise ReplayError(f"a device pool of {pool_slots} experts of {format_bytes(e_bytes)} needs "
                              f"{format_bytes(pool)}; {format_bytes(free)} of GPU memory is free: pass --scale "
                              "or a trace with fewer MoE layers")


# ---- execution -----------------------------------------------------------------------------------

class _RandomExperts:
    """Stands in for a Checkpoint where the offload stores need one: random expert
    buffers [gate | up | down] of the replayed shape, K layers."""

    def __init__(self, shape: ModelShape, k: int, seed: int):
        self.config = SimpleNamespace(expert_params=shape.expert_params)
        self.shape, self.k, self.seed = shape, k, seed
        self._tile = None

    def expert_buffer(self, layer: int, expert: int, dtype):
        import torch

        if self._tile is None:  # one random tile, repeated: filling GBs with randn would take minutes
            g = torch.Generator().manual_seed(self.seed)
            self._tile = (torch.randn(1 << 20, generator=g) * 0.02).to(dtype)
        n = self.config.expert_params
        tile = self._tile.to(dtype)
        reps = -(-n // tile.numel()) + 1
        start = (layer * 1009 + expert * 9973) % tile.numel()
        return tile.repeat(reps)[start:start + n]  # contiguous: the stores copy it

    def fingerprint(self) -> str:
        s = self.shape
        key = f"replay:{s.hidden}:{s.expert_intermediate}:{s.num_experts}:{self.k}:{self.seed}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]


def _shared_layer_store(inner, lmap: LayerMap):
    """The store seen by the pool: pool keys (layer id, expert) served from the inner
    store's K replayed layers."""
    from ..experts.store import ExpertStore

    class SharedLayerStore(ExpertStore):
        tier = inner.tier

        def __init__(self):
            super().__init__(inner.keys, inner.numel, inner.dtype, None)

        def _key(self, key):
            return (lmap.physical(key[0]), key[1])

        def _read(self, key, dest):
            inner.read_into(self._key(key), dest)

        def host_tensor(self, key):
            return inner.host_tensor(self._key(key))

        @property
        def pinned(self):
            return getattr(inner, "pinned", False)

        def close(self):
            inner.close()

    return SharedLayerStore()


def _blocks(name: str, store, slots: int, device, dtype, shape: ModelShape, keep: bool):
    """The engine's block execution (OffloadPolicy.run_block: compute what is present while
    the rest streams in; pins; the prefetch queue) over the replay's store and a pool of
    `slots` experts, without a checkpoint or model."""
    from ..experts.budget import DeviceBudget
    from ..experts.pool import DevicePool
    from ..experts.transfer import TransferEngine
    from ..policies.offload import OffloadPolicy

    class ReplayBlocks(OffloadPolicy):
        keep_across_steps = keep

        def __init__(self):  # deliberately not OffloadPolicy.__init__: no checkpoint, no runtime
            self.name = name
            self.config = SimpleNamespace(num_experts=shape.num_experts)
            self.hidden, self.inter = shape.hidden, shape.expert_intermediate
            self.store = store
            self.pool = DevicePool(slots, store.numel, dtype, device, DeviceBudget(None), name, 1)
            self.transfer = TransferEngine(store, self.pool, device)
            self.reset_stats()

        def close(self):  # the store is shared by every policy's run
            self.transfer.close()

    return ReplayBlocks()


def _routing(counts: dict[int, int], positions: int, device):
    """A router choice with these per-expert token counts over `positions` positions."""
    import torch

    from ..model.moe import Routing

    flat = [e for e, n in counts.items() for _ in range(n)]
    if not flat:
        return None
    k = len(flat) // positions if positions and len(flat) % positions == 0 else 1
    ids = torch.tensor(flat, dtype=torch.long, device=device).view(-1, k)
    weights = torch.full(ids.shape, 1.0 / k, dtype=torch.float32, device=device)
    return Routing(ids, weights)


def _substituted(counts: dict[int, int], draft: list[int]) -> dict[int, int]:
    """Draft routing: a pick outside the draft set goes to draft[e mod N] (round-robin;
    the engine's affinity substitution needs real weights)."""
    out: dict[int, int] = {}
    for e, n in counts.items():
        d = e if e in draft else draft[e % len(draft)]
        out[d] = out.get(d, 0) + n
    return out


@dataclass
class _Prepared:
    """A pass with its routings built on the device ahead of timing."""

    kind: str
    batch: int
    positions: int
    layers: list[tuple[int, int, object]]  # (rank, tokens, Routing)


def _prepare(step: StepPlan, device, num_experts: int) -> list[_Prepared]:
    out = []
    for p in step.passes:
        layers = []
        for rank, counts in p.layers:
            if p.kind == "draft":
                draft = step.draft_set.get(rank)
                if not draft:
                    continue
                counts = _substituted(counts, draft)
            r = _routing(counts, p.positions, device)
            if r is not None:
                layers.append((rank, r.ids.shape[0], r))
        out.append(_Prepared(p.kind, p.batch, p.positions, layers))
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


@dataclass
class StepMeasure:
    seconds: float
    transfer_bytes: int
    fetched: dict[int, int]  # rank -> experts fetched in this step
    refresh_fetches: int
    draft_fetches: int
    hits: int  # experts a block needed that were on the device or on their way when it ran
    uses: int


class PolicyReplay:
    """Runs one schedule's steps with one policy's pool and rules."""

    def __init__(self, schedule: Schedule, store, lmap: LayerMap, shape: ModelShape, device, dtype,
                 cache_fraction: float):
        self.s, self.store, self.lmap, self.shape, self.device, self.dtype = schedule, store, lmap, shape, device, dtype
        L, E = lmap.num_trace_layers, shape.num_experts
        policy = schedule.policy
        self.persistent = policy in ("caching", "specmoe")
        if policy == "ondemand":
            slots = E
        elif policy == "overlap":
            slots = 2 * E
        elif policy == "caching":
            from ..policies.caching import CachingPolicy

            per_block = CachingPolicy.hot_per_block(SimpleNamespace(num_experts=E), cache_fraction)
            schedule.hot, self.hot_source = hot_sets(schedule.trace, lmap, per_block)
            slots = per_block * L + E
        else:
            n = max((len(v) for st in schedule.steps for v in st.draft_set.values()), default=0)
            slots = n * L + E
        self.slots = slots
        self.pass_counter = 0

    def run(self, max_steps: int) -> list[StepMeasure]:
        import torch

        steps = self.s.steps
        timed = steps[1:1 + max_steps] if len(steps) > 1 else steps[:1]
        plan = [steps[0]] + timed  # the first is a warm-up (allocator, kernels, cuBLAS)
        prepared = [_prepare(st, self.device, self.shape.num_experts) for st in plan]
        most = max((t for p in prepared for ps in p for _, t, _ in ps.layers), default=1)
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.x = torch.randn(most, self.shape.hidden, generator=gen, device=self.device).to(self.dtype)
        blocks = _blocks(self.s.policy, self.store, self.slots, self.device, self.dtype, self.shape,
                         keep=self.persistent)
        self.blocks = blocks
        self.draft: dict[int, list[int]] = {}
        try:
            if self.s.policy == "caching":
                blocks.load_resident([(rank, e) for rank, es in self.s.hot.items() for e in es])
            # overlap prefetches the next block, across step boundaries too: a flat list of
            # (pass index, pass, rank) gives each block its successor; the step after the
            # last timed one is prepared (not run) so that the last step prefetches as well
            tail = steps[1 + len(timed):2 + len(timed)] if self.s.policy == "overlap" else []
            self.prepared = prepared + [_prepare(st, self.device, self.shape.num_experts) for st in tail]
            self.flat = [(i, j, rank) for i, p in enumerate(self.prepared) for j, ps in enumerate(p)
                         for rank, _, _ in ps.layers]
            out = []
            for i, (st, prep) in enumerate(zip(plan, prepared)):
                _sync(self.device)
                blocks.reset_stats()
                before = len(blocks.transfer.fetched)
                t0 = time.perf_counter()
                refresh, draft_f = self._step(i, st, prep)
                _sync(self.device)
                dt = time.perf_counter() - t0
                fetched = Counter(k[0] % self.lmap.num_trace_layers for k in blocks.transfer.fetched[before:])
                if i > 0:
                    out.append(StepMeasure(dt, blocks.transfer.transfer_bytes, dict(fetched), refresh, draft_f,
                                           blocks.hits, blocks.uses))
            blocks.transfer.drain()
            return out
        finally:
            blocks.close()
            del self.blocks, self.x
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    # -- one step --------------------------------------------------------------------------------
    def _step(self, i: int, st: StepPlan, prep: list[_Prepared]) -> tuple[int, int]:
        b = self.blocks
        refresh = draft_fetches = 0
        if self.s.policy == "specmoe":
            refresh = self._refresh(st.draft_set)
        for j, ps in enumerate(prep):
            if ps.kind == "draft":
                before = b.transfer.fetches
                for rank, t, routing in ps.layers:
                    self._draft_block(rank, self.x[:t], routing)
                draft_fetches += b.transfer.fetches - before
                if b.transfer.fetches != before:
                    raise RuntimeError("internal: a replayed draft pass fetched experts")
                continue
            if ps.kind == "verify":
                self._verify_prefetch(st)
            for rank, t, routing in ps.layers:
                layer_id = rank if self.persistent else self.pass_counter * self.lmap.num_trace_layers + rank
                if self.s.policy == "overlap":
                    b.prefetch_queue = self._next_block(i, j, rank, layer_id)
                b.run_moe(layer_id, self.x[:t], routing)
                if ps.kind == "verify" and rank in st.next_draft_set:
                    # the block's next draft set is its hottest experts of this pass: pinned now,
                    # while they are still in the pool (the refresh the paper calls free)
                    refresh += self._refresh_block(rank, st.next_draft_set[rank])
            self.pass_counter += 1
        return refresh, draft_fetches

    def _next_block(self, i: int, j: int, rank: int, layer_id: int) -> list:
        """Oracle prediction: the recorded routing of the block that runs next."""
        pos = self.flat.index((i, j, rank))
        if pos + 1 >= len(self.flat):
            return []
        ni, nj, nrank = self.flat[pos + 1]
        ps = self.prepared[ni][nj]
        routing = next(r for rk, _, r in ps.layers if rk == nrank)
        experts = Counter(routing.ids.reshape(-1).tolist()).most_common()
        next_id = (self.pass_counter + ((ni, nj) != (i, j))) * self.lmap.num_trace_layers + nrank
        return [(next_id, e) for e, _ in experts]

    def _refresh(self, draft_set: dict[int, list[int]]) -> int:
        """Make the cycle's recorded draft set resident and pinned (as SpecMoEPolicy.refresh);
        normally done block by block during the previous verify pass already."""
        return sum(self._refresh_block(rank, experts) for rank, experts in draft_set.items())

    def _refresh_block(self, rank: int, experts: list[int]) -> int:
        """Draft set of one block: unpin the old one, fetch (if needed) and pin the new one.
        Returns the experts that had to be fetched."""
        b, table = self.blocks, self.blocks.pool.table
        if self.draft.get(rank) == experts:
            return 0
        for e in self.draft.get(rank, ()):
            table.unpin((rank, e))
        moved = 0
        for e in experts:
            if not b.transfer.has((rank, e)):
                moved += 1
            b.transfer.ensure((rank, e))
            table.pin((rank, e))
        self.draft[rank] = list(experts)
        return moved

    def _draft_block(self, rank: int, x, routing) -> None:
        """As SpecMoEPolicy._draft_block: draft experts straight from their pool slots."""
        from ..model.moe import combine, group_by_expert, run_expert

        b = self.blocks
        groups = group_by_expert(routing, self.shape.num_experts)
        outputs = [run_expert(b.pool.slot_tensor((rank, e)), x[t], b.hidden, b.inter)
                   for e, t in zip(groups.experts, groups.tokens)]
        combine(x, groups, outputs)

    def _verify_prefetch(self, st: StepPlan) -> None:
        """As SpecMoEPolicy.begin_pass('verify'): prefetch what the drafts' own picks
        predict, block by block, most demanded first."""
        b = self.blocks
        queue = []
        for rank in sorted(st.predicted):
            queue += [(rank, e) for e, _ in st.predicted[rank].most_common() if not b.transfer.has((rank, e))]
        b.prefetch_queue = queue
        b._issue([], [])


# ---- hardware profile and predictions -------------------------------------------------------------

def quick_profile(store, device, dtype, offload: str):
    """This device's rates, measured in a few seconds: the fetch bandwidth by copying
    experts from the replay's own store to the device, matmul throughput at the replay
    dtype, device memory bandwidth and per-operation overhead."""
    import torch

    from .calibrate import _matmul_flops, _timed
    from .hardware import HardwareProfile

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    dest = torch.empty(store.numel, dtype=store.dtype, device=device)
    keys = store.keys[: min(4, len(store.keys))]
    staging = None if store.host_tensor(keys[0]) is not None else torch.empty(store.numel, dtype=store.dtype)
    if staging is not None and device.type == "cuda":
        staging = staging.pin_memory()

    def fetch():
        for key in keys:
            src = store.host_tensor(key)
            if src is None:
                store.read_into(key, staging)
                src = staging
            dest.copy_(src, non_blocking=True)
        sync()
    fetch_bw = len(keys) * store.nbytes / _timed(fetch, min_time=0.2, max_reps=10)
    small = torch.ones(1, device=device)

    def ops():
        for _ in range(200):
            small.add_(1)
        sync()
    launch = _timed(ops, min_time=0.05, max_reps=5) / 200
    big = torch.empty(32 << 20, dtype=torch.uint8, device=device)
    big2 = torch.empty_like(big)

    def dcopy():
        big2.copy_(big)
        sync()
    mem_bw = 2 * big.numel() / _timed(dcopy, min_time=0.05, max_reps=10)
    flops = _matmul_flops(torch, dtype, device, 8192 if device.type == "cuda" else 2048, sync)
    host_flops = flops if device.type == "cpu" else _matmul_flops(torch, torch.float32, None, 512)
    h2d = fetch_bw
    what = "host->device copies" if device.type == "cuda" else "host memory copies"
    return HardwareProfile(
        name="replay-measured",
        description=f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'} as the compute "
                    f"device, experts in {'host memory' if offload == 'host' else 'a disk file'} (quick measurement)",
        source=f"measured by specmoe replay: fetch = {what} of {len(keys)} replayed experts"
               + (" read from disk" if offload == "disk" else "") + f", {dtype} matmul, 32 MiB device copy",
        device_matmul_flops=flops, device_mem_bw=mem_bw,
        device_memory_bytes=int(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda"
        else int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        h2d_bw=h2d, slow_tier=offload, slow_tier_read_bw=fetch_bw, host_mem_bw=mem_bw if device.type == "cpu"
        else fetch_bw, host_matmul_flops=host_flops, transfer_latency_s=max(launch, 1e-7),
        kernel_launch_s=max(launch, 1e-8))


def profile_for(name: str, offload: str):
    """A given profile, with its slow tier matched to --offload."""
    from .hardware import load_profile

    try:
        hw = load_profile(name)
    except ValueError as e:
        raise ReplayError(str(e)) from None
    if offload == "host" and hw.slow_tier != "host":
        hw = replace(hw, slow_tier="host", slow_tier_read_bw=hw.h2d_bw)
    elif offload == "disk" and hw.slow_tier != "disk":
        raise ReplayError(f"hardware profile {hw.name} keeps experts in host memory; for --offload disk pass its "
                          f"disk variant (specmoe calibrate saves {hw.name}-disk)")
    return hw


def predict_step(policy: str, sc, prep: list[_Prepared], m: StepMeasure) -> float:
    """The cost model's step time for the replayed routing and fetch counts: per expert
    max(FLOPs / matmul rate, bytes / memory bandwidth) + launches, per fetched expert
    bytes / fetch bandwidth + latency, combined by the policy's overlap rule (as in
    :mod:`specmoe.perf.cost_model`)."""
    from .cost_model import LAUNCHES_PER_EXPERT, _Work

    shape, hw = sc.shape, sc.hardware

    def compute(ps: _Prepared, rank: int) -> float:
        w = _Work()
        for rk, _, routing in ps.layers:
            if rk != rank:
                continue
            for n in Counter(routing.ids.reshape(-1).tolist()).values():
                w.add(hw, 2 * n * shape.expert_params, shape.expert_bytes, LAUNCHES_PER_EXPERT)
        return w.time_s

    total = 0.0
    for ps in prep:
        for rank, _, _ in ps.layers:
            c = compute(ps, rank)
            if ps.kind == "draft":
                total += c
                continue
            f = sc.fetch_s(m.fetched.get(rank, 0))
            total += max(c, f) if policy == "overlap" else c + f  # fetched: refreshes included
    return total


def nonexpert_s(sc, step: StepPlan) -> float:
    """The cost model's time for everything but the routed experts in this step's passes."""
    from .cost_model import pass_work

    return sum(pass_work(sc, p.batch, max(1, p.positions // p.batch), 0, routed=False).time_s for p in step.passes)


# ---- the run ----------------------------------------------------------------------------------------

def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def replay(args) -> dict:
    import torch

    from ..engine.engine import resolve_device
    from ..experts.store import open_store
    from .cost_model import Scenario

    # -- inputs ---------------------------------------------------------------------------------
    policies = _csv(args.policies, "policies")
    bad = [p for p in policies if p not in REPLAY_POLICIES]
    if bad:
        raise ReplayError(f"bad --policies: {bad[0]!r} cannot be replayed; use some of {', '.join(REPLAY_POLICIES)}")
    if args.layers < 1:
        raise ReplayError(f"bad --layers {args.layers}: must be >= 1")
    if not 0 < args.scale <= 1:
        raise ReplayError(f"bad --scale {args.scale}: must be in (0, 1]")
    if args.max_steps < 1:
        raise ReplayError(f"bad --max-steps {args.max_steps}: must be >= 1")
    if args.dtype not in DTYPES:
        raise ReplayError(f"bad --dtype {args.dtype!r}: use one of {', '.join(DTYPES)}")
    if args.offload not in ("host", "disk"):
        raise ReplayError(f"bad --offload {args.offload!r}: use host or disk")
    if args.cache_fraction is not None and not 0 < args.cache_fraction <= 1:
        raise ReplayError(f"bad --cache-fraction {args.cache_fraction}: must be in (0, 1]")
    try:
        base_shape = load_shape(args.model_shape)
    except ValueError as e:
        raise ReplayError(str(e)) from None
    sources = [load_trace(path, policy) for policy, path in parse_trace_args(args.trace)]
    traced = sorted({s.batch for s in sources})
    if args.batch_sizes:
        try:
            batches = parse_batch_sizes(args.batch_sizes)
        except ValueError as e:
            raise ReplayError(str(e)) from None
        missing = [b for b in batches if b not in traced]
        if missing:
            raise ReplayError(f"no trace recorded at batch size {missing[0]}; the traces given are at "
                              f"{', '.join(map(str, traced))}: record one with specmoe generate --batch-size "
                              f"{missing[0]} --trace FILE")
    else:
        batches = traced
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    shape, notes = replay_shape(base_shape, args.scale, dtype_bytes)

    trace_layers = sorted({l for s in sources for l in s.layers})
    lmap = LayerMap(tuple(trace_layers), min(args.layers, len(trace_layers)), shape.num_experts)
    notes.append(f"layers: the trace's MoE layer of rank r runs on replayed layer r mod {lmap.physical_layers} "
                 f"({len(trace_layers)} trace layers per pass); per-layer time = step time / {len(trace_layers)}, "
                 f"full model = per-layer time x {shape.num_moe_layers} MoE layers of {base_shape.name}")
    if args.layers > len(trace_layers):
        notes.append(f"--layers {args.layers} > the traces' {len(trace_layers)} MoE layers: {len(trace_layers)} built")
    src_e = sorted({s.num_experts for s in sources})
    if src_e != [shape.num_experts]:
        how = (f"folded onto {shape.num_experts} (id mod {shape.num_experts}; merged ids' token counts added)"
               if max(src_e) > shape.num_experts else
               f"kept (ids < {max(src_e)} of {shape.num_experts}: the other experts are never used)")
        notes.append(f"experts: the traces' {'/'.join(map(str, src_e))} experts per layer {how}")
    src_k = sorted({s.top_k for s in sources})
    if src_k != [shape.top_k]:
        notes.append(f"top-k: the traces route {'/'.join(map(str, src_k))} experts per token, {base_shape.name} "
                     f"{shape.top_k}: the recorded picks are replayed as they are")

    schedules, skipped = build_schedules(sources, policies, batches, lmap, args.seed)
    if not schedules:
        raise ReplayError("nothing to replay: " + "; ".join(skipped))
    spec_n = [s.draft_experts for s in schedules if s.policy == "specmoe" and s.draft_experts]
    cache_fraction = args.cache_fraction if args.cache_fraction is not None else \
        max(DEFAULT_CACHE_FRACTION, (_mean(spec_n) / shape.num_experts) if spec_n else 0.0)
    pool_max = 2 * shape.num_experts
    for s in schedules:
        if s.policy == "specmoe":
            pool_max = max(pool_max, max((len(v) for st in s.steps for v in st.draft_set.values()), default=0)
                           * lmap.num_trace_layers + shape.num_experts)
        if s.policy == "caching":
            pool_max = max(pool_max, math.ceil(cache_fraction * shape.num_experts) * lmap.num_trace_layers
                           + shape.num_experts)
    check_memory(shape, lmap.physical_layers, pool_max, device, args.offload, hint_scale=args.scale == 1.0)
    hw = profile_for(args.hardware, args.offload) if args.hardware else None

    # -- experts -----------------------------------------------------------------------------------
    t0 = time.perf_counter()
    fake = _RandomExperts(shape, lmap.physical_layers, args.seed)
    keys = [(p, e) for p in range(lmap.physical_layers) for e in range(shape.num_experts)]
    inner = open_store(fake, keys, dtype, device, args.offload, args.offload_dir)
    store = _shared_layer_store(inner, lmap)
    setup_s = time.perf_counter() - t0

    try:
        if hw is not None:
            hw_note = f"hardware profile {hw.name} ({hw.source})"
        else:
            hw = quick_profile(store, device, dtype, args.offload)
            hw_note = ("hardware measured quickly by replay (pass --hardware NAME from specmoe calibrate for a "
                       "fuller one)")
        sc_kwargs = {"context_len": args.context_len} if args.context_len is not None else {}
        sc = Scenario(shape, hw, **sc_kwargs)

        records = []
        for s in schedules:
            rec = _run_one(s, store, lmap, shape, device, dtype, cache_fraction, args.max_steps, sc)
            rec.update(_simulated(s, shape, sc, cache_fraction, rec))
            records.append(rec)
    finally:
        store.close()

    speedups = []
    for b in batches:
        at = {r["policy"]: r for r in records if r["batch_size"] == b and "error" not in r}
        if "specmoe" in at:
            for base in ("ondemand", "overlap", "caching"):
                if base in at:
                    speedups.append({
                        "batch_size": b, "over": base,
                        "speedup": at["specmoe"]["decode_tokens_per_s"] / at[base]["decode_tokens_per_s"],
                        "speedup_experts_only": at["specmoe"]["decode_tokens_per_s_experts_only"]
                        / at[base]["decode_tokens_per_s_experts_only"]})
    notes += [
        "overlap uses a perfect predictor (the recorded routing of the next block): the paper's oracle Overlap",
        "specmoe drafts substitute round-robin into the draft set (the engine's affinity table needs real weights)",
        f"caching keeps {cache_fraction:.0%} of each block resident"
        + (" (= specmoe's mean draft-set share, so both keep the same expert bytes resident)"
           if args.cache_fraction is None and cache_fraction > DEFAULT_CACHE_FRACTION else ""),
        f"projected tokens/s = batch x tokens per step / (measured expert time x {shape.num_moe_layers} layers / "
        f"trace layers + the cost model's non-expert compute at context {sc.context_len}); "
        "'experts only' leaves the latter out",
        hw_note,
    ]
    refreshed = [r for r in records if r.get("refresh_bytes")]
    for r in refreshed:
        notes.append(f"specmoe at batch {r['batch_size']}: {format_bytes(r['refresh_bytes'] / r['steps_timed'])} "
                     "per step re-fetched for the next draft set (the verify's prefetches had evicted some of it "
                     f"from the {r['pool_slots']}-slot pool before it was pinned)")
    if device.type == "cuda":
        timing = "torch.cuda.synchronize + perf_counter around each step"
    else:
        timing = "perf_counter around each step"
    return {
        "config": {
            "model_shape": base_shape.name, "replayed_shape": shape.to_dict(), "layers": lmap.physical_layers,
            "trace_layers": len(trace_layers), "moe_layers": shape.num_moe_layers, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "offload": args.offload, "pinned": bool(getattr(store, "pinned", False)), "dtype": args.dtype,
            "scale": args.scale, "expert_bytes": shape.expert_bytes, "max_steps": args.max_steps,
            "cache_fraction": cache_fraction, "timing": timing, "setup_s": setup_s,
            "traces": [{"path": str(s.path), "policy": s.policy, "batch_size": s.batch, "num_experts": s.num_experts,
                        "top_k": s.top_k} for s in sources],
        },
        "hardware": hw.to_dict(),
        "assumptions": notes,
        "skipped": skipped,
        "records": records,
        "speedups": speedups,
    }


def _run_one(s: Schedule, store, lmap: LayerMap, shape: ModelShape, device, dtype, cache_fraction: float,
             max_steps: int, sc) -> dict:
    rec = {"policy": s.policy, "batch_size": s.batch, "source": s.source, "trace": str(s.trace.path),
           "routing": s.note}
    try:
        pr = PolicyReplay(s, store, lmap, shape, device, dtype, cache_fraction)
        measures = pr.run(max_steps)
    except (RuntimeError, MemoryError) as e:  # e.g. CUDA out of memory: report it, replay the rest
        rec["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        return rec
    timed = s.steps[1:1 + max_steps] if len(s.steps) > 1 else s.steps[:1]
    L, M = lmap.num_trace_layers, shape.num_moe_layers
    prepared = pr.prepared[1:1 + len(measures)]  # [0] was the warm-up
    predicted = [predict_step(s.policy, sc, p, m) for p, m in zip(prepared, measures)]
    layer_s = [m.seconds / L for m in measures]
    generated = sum(st.generated for st in timed)
    seqs = sum(st.batch for st in timed)
    expert_s = sum(layer_s) * M
    other_s = sum(nonexpert_s(sc, st) for st in timed)
    moved = sum(m.transfer_bytes for m in measures) / L * M
    distinct = _mean(len(c) for st in timed for p in st.passes if p.kind != "draft" for _, c in p.layers)
    rec.update({
        "steps_timed": len(measures),
        "pool_slots": pr.slots,
        "layer_s": _mean(layer_s),
        "layer_s_min": min(layer_s),
        "layer_s_max": max(layer_s),
        "model_step_s": (expert_s + other_s) / len(measures),
        "expert_step_s": expert_s / len(measures),
        "nonexpert_step_s": other_s / len(measures),
        "tokens_per_step": generated / seqs,
        "decode_tokens_per_s": generated / (expert_s + other_s),
        "decode_tokens_per_s_experts_only": generated / expert_s,
        "transfer_bytes_per_token": moved / generated,
        "transfer_bytes_per_step": moved / len(measures),
        "fetched_per_layer": _mean(sum(m.fetched.values()) / L for m in measures),
        "present_rate": sum(m.hits for m in measures) / max(1, sum(m.uses for m in measures)),
        "distinct_per_layer": distinct,
        "refresh_bytes": sum(m.refresh_fetches for m in measures) * shape.expert_bytes,
        "draft_transfer_bytes": sum(m.draft_fetches for m in measures) * shape.expert_bytes,
        "predicted_layer_s": _mean(p / L for p in predicted),
        "prediction_error": sum(predicted) / sum(m.seconds for m in measures) - 1.0,
        "gamma": s.gamma,
        "draft_experts": s.draft_experts,
        "cache_fraction": cache_fraction if s.policy == "caching" else None,
    })
    if s.policy == "caching":
        rec["hot_set_from"] = pr.hot_source
    return rec


def _simulated(s: Schedule, shape, sc, cache_fraction, rec) -> dict:
    """The cost model's end-to-end estimate for this policy and batch (routing model fitted
    to the trace, as `specmoe simulate --trace`)."""
    from .cost_model import estimate
    from .routing import acceptance_from_trace

    if "error" in rec:
        return {}
    try:
        routing = _fitted(s.trace)
        sc2 = replace(sc, routing=routing) if routing else sc
        if s.policy == "specmoe":
            acc = acceptance_from_trace([r for r in s.trace.records if r.batch_size == s.batch]) \
                or acceptance_from_trace(s.trace.records)
            n = max(1, min(shape.num_experts - 1, round(s.draft_experts or 1)))
            est = estimate("specmoe", sc2, s.batch, gamma=s.gamma or acc.gamma, draft_experts=n,
                           acceptance=acc.acceptance)
        elif s.policy == "caching":
            est = estimate("caching", sc2, s.batch, fraction=cache_fraction)
        elif s.policy == "overlap":
            est = estimate("oracle-overlap", sc2, s.batch)
        else:
            est = estimate(s.policy, sc2, s.batch)
    except (ValueError, AttributeError) as e:
        return {"simulate_error_note": str(e)}
    return {"simulate_decode_tokens_per_s": est.decode_tokens_per_s,
            "simulate_transfer_bytes_per_token": est.transfer_bytes_per_token,
            "simulate_error": est.decode_tokens_per_s / rec["decode_tokens_per_s"] - 1.0}


_FITTED: dict[str, object] = {}


def _fitted(src: TraceSource):
    from .routing import fit_routing

    key = str(src.path)
    if key not in _FITTED:
        _FITTED[key] = fit_routing(src.header, src.records)
    return _FITTED[key]


# ---- output -------------------------------------------------------------------------------------

def format_table(doc: dict) -> str:
    c = doc["config"]
    hw = doc["hardware"]
    lines = [f"specmoe replay: {c['model_shape']} experts ({format_bytes(c['expert_bytes'])} each, {c['dtype']}), "
             f"{c['layers']} layer(s) built, {c['trace_layers']} trace layers per pass, on {c['device_name']}, "
             f"experts in {c['offload']}{' (pinned)' if c['pinned'] else ''}; profile {hw['name']}: fetch "
             f"{format_bytes(min(hw['h2d_bw'], hw['slow_tier_read_bw']))}/s, matmul "
             f"{hw['device_matmul_flops'] / 1e12:.3g} TFLOP/s",
             f"{'B':>4} {'policy':9} {'routing':8} {'ms/layer':>9} {'model ms':>9} {'tok/step':>8} {'tok/s':>9} "
             f"{'MB/token':>9} {'fetch/L':>7} {'pred ms/L':>9} {'pred err':>8}"]
    for r in doc["records"]:
        if "error" in r:
            lines.append(f"{r['batch_size']:>4} {r['policy']:9} {r['source']:8} error: {r['error']}")
            continue
        lines.append(f"{r['batch_size']:>4} {r['policy']:9} {r['source']:8} {r['layer_s'] * 1e3:9.3f} "
                     f"{r['model_step_s'] * 1e3:9.2f} {r['tokens_per_step']:8.2f} {r['decode_tokens_per_s']:9.1f} "
                     f"{r['transfer_bytes_per_token'] / 1e6:9.2f} {r['fetched_per_layer']:7.2f} "
                     f"{r['predicted_layer_s'] * 1e3:9.3f} {r['prediction_error']:+8.0%}")
    if doc["speedups"]:
        by_b: dict[int, list[str]] = {}
        for sp in doc["speedups"]:
            by_b.setdefault(sp["batch_size"], []).append(f"{sp['speedup']:.2f}x over {sp['over']}")
        lines.append("specmoe speedup (projected tok/s): "
                     + "; ".join(f"B={b}: " + ", ".join(v) for b, v in by_b.items()))
    for n in doc["skipped"]:
        lines.append(f"skipped: {n}")
    lines += [f"note: {n}" for n in doc["assumptions"]]
    return "\n".join(lines)


def run_replay(args) -> int:
    doc = replay(args)
    if args.output:
        try:
            Path(args.output).write_text(json.dumps(doc, indent=2) + "\n")
        except OSError as e:
            raise ReplayError(f"cannot write --output {args.output}: {e}") from None
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(format_table(doc))
    return 1 if any("error" in r for r in doc["records"]) else 0
