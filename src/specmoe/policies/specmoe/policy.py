"""`specmoe`: self-assisted speculative decoding, the expert side (the engine runs the
draft / verify / accept loop: engine/speculative.py).

Draft passes run the model's own router over the draft experts of each block (`Drafter`,
draft.py): N full-precision experts pinned in the device pool, with picks outside them
substituted (affinity or random), computed on the host (`draft_compute="host"`), or taken
from quantized copies of every expert. No expert bytes move while drafting. The verify
pass is an ordinary offloaded pass over B x (gamma + 1) positions whose fetches are
prefetched in the order the draft's own router picks predicted: the reads start while the
draft still runs, as soon as its routing at a block is known (`prefetch_for_verify`),
into slots no pinned expert holds (the draft experts are pinned), and what did not fit
is queued when verification begins. As soon as a block of the verify pass has run, the N
experts it selected most often among those still in the pool become its next draft set
(temporal hotness): the pass has just used them, so the refresh reads nothing.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from ...base.paths import offload_dir
from ...experts.formats import expert_format
from ...experts.quant import draft_copy_bytes, draft_modes
from ...experts.quant_cache import quantize_all
from ...kernels.blockdot import computes_as_stored
from ...model.moe import Routing
from ..offload import OffloadPolicy
from .affinity import load_affinity, substitution_map
from .draft import Drafter
from .draft_memory import DraftMemory
from .draft_set import HotnessCounter, random_draft_set

WORKING_SLOTS = 2  # slots beyond the draft sets, for streaming verification's fetches


def uses_affinity(options, copies_of_every_expert: bool) -> bool:
    """Whether the draft substitutes picks by the affinity table (it needs the table)."""
    return options.substitution == "affinity" and options.draft_compute == "device" and not copies_of_every_expert


def draft_table_bytes(config, options, device, copies_of_every_expert: bool, whole_run: bool) -> int:
    """The draft's routing tables, reserved before the pool is sized: a substitution map
    [E] per drafting block on the device (copies of every expert substitute nothing); the
    hotness counts and the affinity table ([E, E] per MoE block: 15 MiB at 256 experts and
    58 blocks) are host tensors, which on a CPU-only machine share the budget's memory.
    `whole_run`: the hotness counts keep a second table (--draft-memory's allocation)."""
    E = config.num_experts
    held = (not copies_of_every_expert) * len(config.draft_layer_ids) * E * 8
    if device.type == "cpu":
        held += config.num_layers * E * 8 * (1 + whole_run)  # HotnessCounter, its totals
        held += uses_affinity(options, copies_of_every_expert) * len(config.moe_layer_ids) * E * E * 4
    return held


class SpecMoEPolicy(OffloadPolicy):
    name = "specmoe"
    speculative = True

    @classmethod
    def min_slots(cls, config, options) -> int:
        # with quantized copies of every expert the draft needs no full-precision one
        n = options.draft_experts or (0 if options.draft_quant != "none" else 1)
        return n * len(config.draft_layer_ids) + WORKING_SLOTS

    @classmethod
    def min_device_bytes(cls, config, options, expert_bytes: int, device, dtype) -> int:
        """The cheapest draft this configuration may take: quantized copies of every expert
        (with their scratch) beside the working slots, or the paper's resident draft."""
        if options.draft_compute == "host":
            modes = ("none",)
        else:
            paper = ("none",) if options.draft_experts != 0 else ()  # the paper's draft needs a draft expert
            modes = (*draft_modes(config.expert_quant), *paper) if options.draft_quant == "auto" else (options.draft_quant,)
        experts = len(config.draft_layer_ids) * config.num_experts
        need = []
        blocks = computes_as_stored(options.dtype, config, device)  # as Runtime.computes_as_stored
        for mode in modes:
            copy, scratch = draft_copy_bytes(config.expert, mode, device, dtype, blocks)
            slots = cls.min_slots(config, replace(options, draft_quant=mode))
            every = mode != "none" and options.draft_memory is None  # copies of every expert substitute nothing
            tables = draft_table_bytes(config, options, device, every, whole_run=options.draft_memory is not None)
            need.append(slots * expert_bytes + experts * copy + scratch + tables)
        return min(need) + expert_format(config, dtype, device).scratch_bytes(dtype)

    @classmethod
    def default_draft_experts(cls, config, slots: int) -> int:
        """The most experts per block that fit beside the working slots, at most a quarter of a block."""
        return max(1, min(config.num_experts // 4, (slots - WORKING_SLOTS) // len(config.draft_layer_ids)))

    def __init__(self, runtime):
        opts, c = runtime.options, runtime.config
        cache = Path(opts.offload_dir) if opts.offload_dir else offload_dir()
        self.quantized, self.quantized_bytes = None, 0
        self.memory = None  # with --draft-memory: what the draft holds, chosen expert by expert
        if opts.draft_memory is not None:
            self.memory = DraftMemory(runtime, cache, opts.draft_experts)
            self.draft_quant = opts.draft_quant if opts.draft_quant != "auto" else "mixed"
            n = self.memory.full_per_block
            self._reserve_tables(runtime)
            super().__init__(replace(runtime, options=replace(opts, draft_experts=n or None)))
        else:
            self.draft_quant = self._reserve_quantized(runtime, cache)
            self._reserve_tables(runtime)
            super().__init__(replace(runtime, options=replace(opts, draft_quant=self.draft_quant)))  # auto, resolved
        if self.memory is not None:
            default = self.memory.full_per_block
        elif self.quantized is not None:
            # full-precision draft experts where the budget allows: possibly none
            fits = (self.pool.num_slots - WORKING_SLOTS) // len(c.draft_layer_ids)
            default = max(0, min(c.num_experts // 4, fits))
        else:
            default = self.default_draft_experts(c, self.pool.num_slots)
        self.draft_experts = default if self.memory is not None else (opts.draft_experts or default)
        self.rng = random.Random(0)
        self.draft: dict[int, list[int]] = {}  # block -> its draft experts (pinned in the pool)
        self.substitute: dict[int, torch.Tensor] = {}  # block -> [E] expert each pick becomes
        self.affinity = None
        if uses_affinity(opts, self.quantized is not None):
            self.affinity = load_affinity(runtime.checkpoint, cache)  # (every draft that substitutes)
        self.hotness = HotnessCounter(c.num_layers, c.num_experts, whole_run=self.memory is not None)
        self.drafter = Drafter(self)

    def _reserve_tables(self, runtime) -> None:
        held = draft_table_bytes(runtime.config, runtime.options, runtime.device, self.quantized is not None,
                                 whole_run=self.memory is not None)
        runtime.budget.reserve("draft routing tables", held)

    def _reserve_quantized(self, runtime, cache) -> str:
        """Quantized copies of every expert for the draft, reserved before the pool is sized.

        `auto` (the default) takes the most precise copies that leave room for the working
        slots: int8, else int4, else none (the paper's draft of resident experts only)."""
        opts = runtime.options
        auto = opts.draft_quant == "auto" and opts.draft_compute == "device"
        modes = draft_modes(runtime.config.expert_quant) if auto else (opts.draft_quant,)
        copy_modes = list(itertools.takewhile(lambda m: m not in ("none", "auto"), modes))
        for mode in copy_modes:
            quantized = quantize_all(runtime.checkpoint, runtime.draft_keys, mode, cache, runtime.device,
                                     runtime.computes_as_stored)
            need = quantized.nbytes + quantized.scratch_bytes(runtime.dtype)
            # --draft-experts 0: copies alone draft, so the last format is reserved (or refused, naming the budget)
            last_chance = opts.draft_experts == 0 and mode == copy_modes[-1]
            if (opts.draft_quant == "auto" and not last_chance
                    and runtime.budget.available() < need + WORKING_SLOTS * runtime.slot_bytes):
                continue  # does not fit beside the working slots: try fewer bits
            runtime.budget.reserve(
                "quantized draft experts", quantized.nbytes,
                hint=f" ({mode} copies of all {len(runtime.draft_keys)} experts; a lower-bit --draft-quant needs less)",
            )
            if quantized.scratch_bytes(runtime.dtype):
                runtime.budget.reserve("quantized draft scratch", quantized.scratch_bytes(runtime.dtype))
            self.quantized, self.quantized_bytes = quantized, quantized.nbytes
            return mode
        return "none"

    # --- counters ------------------------------------------------------------------------

    def reset_stats(self) -> None:
        super().reset_stats()
        self.refresh_fetches = 0
        self.predicted: dict[int, Counter] = {}  # block -> the draft's own picks in this cycle
        self.prefetch_hits = self.prefetch_predicted = self.prefetch_needed = 0
        if self.memory is not None:
            self.memory.drafted.clear()

    def stats(self) -> dict:
        s = super().stats()
        opts = self.runtime.options
        s.update(
            draft_set=opts.draft_set, substitution=opts.substitution, draft_compute=opts.draft_compute,
            draft_quant=self.draft_quant,
            draft_resident_bytes=self.draft_experts * len(self.config.draft_layer_ids) * self.pool.slot_bytes,
            draft_quantized_bytes=self.quantized_bytes,
            refresh_bytes=self.refresh_fetches * self.pool.expert_bytes,
            prefetch_precision=self.prefetch_hits / self.prefetch_predicted if self.prefetch_predicted else None,
            prefetch_recall=self.prefetch_hits / self.prefetch_needed if self.prefetch_needed else None,
        )
        if self.memory is not None:
            held = self.memory.stats()
            s.update(held, draft_quantized_bytes=held["draft_copies_bytes"])
        if self.quantized is not None:
            s["fused_kernels"] = {**s["fused_kernels"], **{f"draft {k}": v for k, v in self.quantized.kernels.items()}}
        return s

    # --- passes --------------------------------------------------------------------------

    def begin_pass(self, kind: str):
        self.pass_kind = kind
        self.store.meter.window(kind == "verify")  # the disk's rate during verify passes
        if kind == "draft":
            self.predicted = {}
            self._fetches_before_draft = self.transfer.fetches
            self._draft_prefetches = 0
            return self.drafter
        if kind == "verify":
            self._prefetch_predicted()
            if self.runtime.options.draft_set == "temporal-hot":
                self.hotness.reset()  # the next draft set comes from this pass alone
        return self

    def end_pass(self, kind: str) -> None:
        self.store.meter.window(False)  # the refresh below is not verification's
        if kind == "prefill" and self.memory is not None:
            self.refresh(reallocate=True)  # new requests' routing: the copies chosen again
        elif kind == "prefill" and not self.draft:
            self.refresh()  # the first draft set, from the prefill's routing
        if kind == "draft" and self.transfer.fetches - self._fetches_before_draft != self._draft_prefetches:
            raise RuntimeError("internal: a draft pass fetched experts for itself; drafting must move no expert "
                               "bytes (only verification's prefetches may start during it)")
        if kind == "verify":
            self.predicted = {}

    def prefetch_for_verify(self, layer: int, counts: dict[int, int]) -> None:
        """During a draft pass, once its routing at `layer` is known: start reading the
        experts it picked that verification will need, the most picked first. Only into
        slots no pinned expert holds (the draft's own are pinned), leaving one a block can
        evict, as any prefetch; predicted experts already resident become the most
        recently used, so these reads evict them last."""
        table, spare = self.pool.table, None
        for e in sorted(counts, key=counts.get, reverse=True):
            key = (layer, e)
            if key in table:
                table.touch(key)
                continue
            if self.transfer.has(key):
                continue
            if spare is None:  # counted once, when the first read is wanted (O(slots))
                spare = self.blocks.spare_slots()
            if spare < 2 or not self.transfer.fetch(key):
                return
            spare -= 1
            self._draft_prefetches += 1

    def _prefetch_predicted(self) -> None:
        """Prefetch what the draft's own (unsubstituted) picks predict, block by block, the
        most demanded first; the rest is fetched on demand."""
        queue = []
        for layer in sorted(self.predicted):
            queue += [(layer, e) for e, _ in self.predicted[layer].most_common() if not self.transfer.has((layer, e))]
        self.blocks.prefetch(queue)

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """A full-model block (prefill or verify): count what it picks, fetch what it lacks."""
        if layer in self.predicted:  # a verify pass after drafting: how good was the prediction
            needed = set(torch.unique(routing.ids).tolist())
            predicted = set(self.predicted[layer])
            self.prefetch_hits += len(needed & predicted)
            self.prefetch_predicted += len(predicted)
            self.prefetch_needed += len(needed)
        self.hotness.add(layer, routing.ids)
        measuring = self.memory is not None and self.pass_kind == "prefill"
        if measuring:
            self.memory.record(layer, x, self.hotness.totals[layer].tolist(),
                               self.affinity[layer] if self.affinity is not None else None)
        out = super().run_moe(layer, x, routing)
        if measuring:
            self.memory.record_output(layer, out)
        if self.pass_kind == "verify" and layer in self.draft and self._follows_passes():
            self._follow_block(layer)
        return out

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        super().after_layer(layer, hidden)
        if self.memory is not None and self.pass_kind == "prefill":
            self.memory.record_residual(layer, hidden)

    # --- the draft set ---------------------------------------------------------------------

    def draft_sets(self) -> dict[int, list[int]]:
        return self.draft

    def _holds_copies(self) -> bool:
        """Under --draft-memory with copies, the full-precision draft experts stay those the
        copies were chosen around (refreshed after each prefill): an expert the verify
        refresh moved out of the full set would have no copy, and be substituted."""
        return self.memory is not None and self.quantized is not None and bool(self.quantized.modes)

    def _follows_passes(self) -> bool:
        """Whether each verify pass chooses the next draft set (temporal hotness)."""
        return self.runtime.options.draft_set == "temporal-hot" and not self._holds_copies()

    def _follow_block(self, layer: int) -> None:
        """Right after a verify pass's block: its next draft set is the N experts it selected
        most that are still in the pool (ties: the current set, pinned there), so the
        refresh reads nothing. Chosen once the whole pass had run, the first blocks' hottest
        had been evicted by the later blocks' experts and were read again: on the 4 GB
        Q4_K_M file under a 40 % memory cap, at B = 1, a third of all the bytes read."""
        table, old = self.pool.table, self.draft[layer]
        held = [e for e in range(self.config.num_experts) if (layer, e) in table]
        new = self.hotness.hottest(layer, len(old), tie_break=old, among=held)
        if new != old:
            self._hold(layer, new)
            self._substitute_around(layer, new)

    def _hold(self, layer: int, experts: list[int]) -> None:
        """Make `experts` the block's draft set: pinned in the pool (read where missing)."""
        table = self.pool.table
        for e in self.draft.get(layer, ()):
            table.unpin((layer, e))
        for e in experts:
            if not self.transfer.has((layer, e)):
                self.refresh_fetches += 1
            self.transfer.ensure((layer, e))
            table.pin((layer, e))
        self.draft[layer] = experts

    def _substitute_around(self, layer: int, experts: list[int]) -> None:
        """The block's substitution map for a new draft set: a pick held neither in full nor
        as a copy becomes the nearest that is (copies of every expert substitute nothing)."""
        if self.memory is not None:
            self.substitute[layer] = self._substitution(layer, sorted(set(experts) | set(self._copied(layer))))
        elif self.quantized is None:
            self.substitute[layer] = self._substitution(layer, experts)

    def refresh(self, reallocate: bool = False) -> None:
        """Make the N hottest experts of each block (or the configured choice) the draft set;
        under --draft-memory, with `reallocate` also choose the quantized copies again."""
        opts, c, n = self.runtime.options, self.config, self.draft_experts
        new = {}
        for layer in c.draft_layer_ids:  # an encoder's blocks run once per request: no draft set
            if opts.draft_set == "random" or (self.draft and opts.draft_set == "global-hot"):
                new[layer] = self.draft.get(layer) or random_draft_set(c.num_experts, n, self.rng)
            else:
                new[layer] = self.hotness.hottest(layer, n, tie_break=self.draft.get(layer), whole_run=reallocate)
        for layer, experts in self.draft.items():  # every block's old set first: the new ones need the slots
            for e in experts:
                self.pool.table.unpin((layer, e))
        self.draft = {}
        for layer, experts in new.items():
            self._hold(layer, experts)
        if self.memory is not None and (reallocate or self.quantized is None):
            self.quantized = self.memory.reallocate(self.hotness.totals, new)
        for layer, experts in new.items():
            self._substitute_around(layer, experts)

    def _copied(self, layer: int) -> list[int]:
        return [e for (l, e) in self.quantized.modes if l == layer]

    def _substitution(self, layer: int, experts: list[int]) -> torch.Tensor:
        if self.affinity is not None:
            return substitution_map(self.affinity[layer], experts).to(self.runtime.device)
        E = self.config.num_experts
        mapping = [e if e in experts else self.rng.choice(experts) for e in range(E)]
        return torch.tensor(mapping, dtype=torch.long, device=self.runtime.device)
