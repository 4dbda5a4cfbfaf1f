"""The draft within `--draft-memory`: what it may hold, reserved when the engine starts,
and which experts it holds how, chosen from routing as it is seen.

At start (nothing routed yet): the budget is reserved, and the count N of full-precision
draft experts per block is chosen with every expert equally likely (`start_plan`); they
are pool slots, so N is fixed for the run. After every prefill: the errors are measured
on that prefill's block inputs the first time (draft_quality.py; then cached per model),
the N most picked experts of each block so far become the full-precision ones, and the
copies for the rest are chosen again from every pick counted so far (`allocate`) and
loaded where they changed: a copy kept in its precision is not read again. Bytes read
for that are counted (`reload_bytes`). With no copies (the paper's draft in this memory)
the verify refresh still moves the N experts to the last pass's hottest.

Why after prefills and not after every verify pass, as the paper refreshes its draft set:
choosing the copies again after every verify pass gave no more tokens per step on the demo
model's training prompts at 5 and 10 % (from every pick so far: 3.04 against 3.17 at B = 1,
5 %; from picks decayed by 0.9 a pass: 3.11 against 3.39 at B = 16, 5 %), and re-read up to
13 and 61 MiB of copies a run, where a prefill-time choice re-reads 3-6 MiB.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from ...base.config import budget_share
from ...base.errors import SpecMoEError
from ...base.units import format_bytes, parse_size
from ...experts.draft_copies import ExpertCopies, load_copies
from ...experts.quant import auto_modes, draft_copy_bytes
from .allocation import FULL, Allocation, Options, allocate, choose_full, pick_shares
from .draft_quality import (
    RESIDUAL_SHARE,
    block_weights,
    cached_errors,
    default_errors,
    mean_errors,
    measure_block,
    save_errors,
)

def draft_ways(draft_quant: str, expert_quant) -> tuple[str, ...]:
    """How experts may be held: auto, every way it weighs (quant.auto_modes); none, the
    paper's full-precision draft experts; a mode, that mode alone."""
    if draft_quant == "auto":
        return (FULL, *auto_modes(expert_quant))
    if draft_quant == "none":
        return (FULL,)
    return (draft_quant,)


def draft_memory_bytes(value, budget_limit: int | None) -> int:
    """--draft-memory in bytes: as given, or its share of the device budget."""
    share = budget_share(value, "draft_memory")
    if share is None:
        return parse_size(value, "--draft-memory") if isinstance(value, str) else int(value)
    if budget_limit is None:
        raise SpecMoEError(f"--draft-memory {value} is a share of the device budget, and there is none: give "
                           "--device-memory too, or --draft-memory as a size (e.g. 400MiB)")
    return int(share * budget_limit)


class DraftMemory:
    """The draft's bytes and what they hold; the policy asks it after prefills."""

    def __init__(self, runtime, cache: Path, draft_experts: int | None):
        opts, c = runtime.options, runtime.config
        self.runtime, self.cache = runtime, cache
        self.layers = list(c.draft_layer_ids)
        start = Start(runtime.checkpoint, opts.draft_memory, runtime.budget.limit, runtime.slot_bytes,
                      runtime.device, runtime.dtype, opts.draft_quant, cache, draft_experts, runtime.computes_as_stored)
        self.limit, self.scratch, self.options, plan = start.limit, start.scratch, start.options, start.plan
        self.measured = start.errors is not None
        self.full_per_block = plan.full_per_block
        self.copy_budget = self.limit - self.scratch - start.full_bytes
        runtime.budget.reserve("draft copies", self.copy_budget,
                               hint=f" (--draft-memory {format_bytes(self.limit)} less its full-precision experts)")
        if self.scratch:
            runtime.budget.reserve("quantized draft scratch", self.scratch)
        self.allocation: Allocation | None = None
        self.copies: ExpertCopies | None = None
        self.reload_bytes = 0
        self.rows: dict[int, dict[str, float]] = {}  # measured errors, block by block
        self.output_norm: dict[int, float] = {}  # a prefill block's output, until the stream after it is seen
        self.drafted = Counter()  # the draft's picks by how it held the picked expert

    def count_drafted(self, layer: int, picks: dict[int, int]) -> None:
        """A draft pass's picks in `layer` (expert -> count), before substitution."""
        held = self.allocation.held
        for e, n in picks.items():
            self.drafted[held[(layer, e)]] += n

    # --- what the engine routes ---------------------------------------------------------

    def record(self, layer: int, x: torch.Tensor, counts: list[int], distances: torch.Tensor | None) -> None:
        """Until the errors are measured: measure a prefill block's row on its inputs, there
        and then (nothing is kept: on the CPU, kept inputs would be device bytes)."""
        if not self.measured and layer in self.layers and layer not in self.rows:
            modes = [w for w in self.options.ways() if w != FULL]
            self.rows[layer] = measure_block(self.runtime.checkpoint, layer, x, counts, distances, modes)

    def record_output(self, layer: int, out: torch.Tensor) -> None:
        """A prefill block's output, while its row lacks its share of the residual stream."""
        if layer in self.rows and RESIDUAL_SHARE not in self.rows[layer]:
            self.output_norm[layer] = float(out.float().norm(dim=-1).mean())

    def record_residual(self, layer: int, hidden: torch.Tensor) -> None:
        """The residual stream after the block whose output was just recorded: its share."""
        if layer in self.output_norm:
            stream = float(hidden.float().norm(dim=-1).mean())
            self.rows[layer][RESIDUAL_SHARE] = self.output_norm.pop(layer) / stream if stream > 0 else 1.0

    def reallocate(self, picks: torch.Tensor, full: dict[int, list[int]]) -> ExpertCopies:
        """Copies for the experts not held in full, from every pick so far (`picks` [layers,
        E]); loads what changed."""
        ckpt = self.runtime.checkpoint
        counts = {layer: picks[layer].tolist() for layer in self.layers}
        if not self.measured and set(self.rows) == set(self.layers) and all(
                RESIDUAL_SHARE in row for row in self.rows.values()):
            save_errors(ckpt, self.cache, self.rows)
            self.options = Options(self.options.nbytes, mean_errors(self.rows), self.options.allowed,
                                   block_weights=block_weights(self.rows))
            self.measured, self.rows = True, {}
        allocation = allocate(pick_shares(counts), self.options, self.copy_budget, full, at_least_one=True)
        self.copies, read = load_copies(ckpt, allocation.copies(), self.cache, self.runtime.device, self.copies,
                                        self.runtime.computes_as_stored)
        self.allocation, self.reload_bytes = allocation, self.reload_bytes + read
        if self.copies.nbytes > self.copy_budget:
            raise RuntimeError(f"internal: draft copies of {self.copies.nbytes} bytes exceed their "
                               f"{self.copy_budget} reserved")
        return self.copies

    def stats(self) -> dict:
        held = self.allocation.count() if self.allocation else {}
        return {"draft_memory": self.limit, "draft_held": held, "draft_copies_bytes": self.copies.nbytes if self.copies else 0,
                "draft_reload_bytes": self.reload_bytes, "draft_picks_by_way": self.picks_by_way(),
                "draft_expected_cost": self.allocation.cost if self.allocation else None,
                "draft_errors_measured": self.measured}

    def picks_by_way(self) -> dict[str, float]:
        """Each way's share of the draft's picks: what the acceptance is the cost of."""
        total = sum(self.drafted.values())
        return {w: n / total for w, n in sorted(self.drafted.items())} if total else {}


class Start:
    """What a draft of `value` (--draft-memory) holds when the engine starts, before routing
    is seen: its bytes, scratch, ways with their (cached or prior) errors, and `plan`."""

    def __init__(self, ckpt, value, budget_limit: int | None, slot_bytes: int, device, dtype, draft_quant: str,
                 cache: Path | None, draft_experts: int | None = None, blocks: bool = False):
        c = ckpt.config
        self.limit = draft_memory_bytes(value, budget_limit)
        ways = draft_ways(draft_quant, c.expert_quant)
        self.errors = cached_errors(ckpt, cache, ways)  # None: not measured yet
        nbytes, self.scratch = way_bytes(c, ways, slot_bytes, device, dtype, blocks)
        table = self.errors or default_errors(c.draft_layer_ids)
        self.options = Options(nbytes, mean_errors(table), ways, block_weights=block_weights(table))
        self.plan = start_plan(c, self.options, self.limit, self.scratch, slot_bytes, draft_quant, draft_experts)
        self.full_bytes = self.plan.full_per_block * len(c.draft_layer_ids) * slot_bytes


def describe(ckpt, value, budget_limit: int | None, slot_bytes: int, device, dtype, draft_quant: str,
             cache: Path | None, blocks: bool = False) -> dict:
    """`specmoe info --draft-memory`: what the draft would hold when the engine starts."""
    start = Start(ckpt, value, budget_limit, slot_bytes, device, dtype, draft_quant, cache, blocks=blocks)
    plan = start.plan
    return {"draft_memory": start.limit, "draft_holds": plan.count(), "draft_full_per_block": plan.full_per_block,
            "draft_full_bytes": start.full_bytes, "draft_copies_bytes": plan.nbytes - start.full_bytes,
            "draft_scratch_bytes": start.scratch,
            "draft_errors": "measured" if start.errors else "prior (measured on the first prefill, then cached)",
            "draft_block_weights": {layer: round(w, 2) for layer, w in start.options.block_weights.items()}
            if start.errors else "1 each until the first prefill measures them",
            "draft_note": "before routing is seen: the copies are chosen again from the picks after each prefill"}


def way_bytes(config, ways, slot_bytes: int, device, dtype, blocks: bool = False) -> tuple[dict[str, int], int]:
    """Device bytes per expert of each way, and the scratch the portable copies dequantize into."""
    nbytes, scratch = {FULL: slot_bytes}, 0
    for mode in ways:
        if mode != FULL:
            nbytes[mode], s = draft_copy_bytes(config.expert, mode, device, dtype, blocks)
            scratch = max(scratch, s)
    return nbytes, scratch


def start_plan(config, options: Options, limit: int, scratch: int, slot_bytes: int, draft_quant: str,
               draft_experts: int | None = None) -> Allocation:
    """What the draft holds before any routing is seen (every expert equally likely): the
    count N of full-precision experts per block (fixed for the run) and copies for the
    rest. A draft memory that cannot hold something in every block is a SpecMoEError."""
    layers = list(config.draft_layer_ids)
    uniform = pick_shares({layer: [0] * config.num_experts for layer in layers})
    most = config.num_experts - 1 if draft_quant == "none" else config.num_experts // 4
    fewest = 1 if draft_quant == "none" else 0
    fewest, most = (draft_experts, draft_experts) if draft_experts is not None else (fewest, most)
    plan = choose_full(uniform, options, limit - scratch, slot_bytes, most, fewest)
    if plan is None or not all(plan.covered(layer) for layer in layers):
        cheapest = min(options.nbytes[w] for w in options.ways())
        need = max(fewest * slot_bytes, cheapest) * len(layers) + scratch
        what = "one full-precision expert" if draft_quant == "none" else "one copy of an expert"
        raise SpecMoEError(
            f"--draft-memory {format_bytes(limit)} holds less than {what} per block ({len(layers)} blocks); raise it "
            f"to at least {format_bytes(need)}" +
            ("" if draft_quant in ("auto", "int2") else " or allow lower-bit copies (--draft-quant auto)"))
    return plan
