"""`specmoe`: self-assisted speculative decoding (DESIGN.md §2).

Draft passes run the model's own router over the N draft experts per block that are
pinned in the device pool; a pick outside the draft set is replaced by the nearest draft
expert (affinity) or a random one, or, with `draft_compute="host"`, computed on the host
from the host tier. No expert bytes move while drafting. The verify pass is an ordinary
offloaded pass over B x (gamma + 1) positions whose fetches are prefetched in the order
the draft's own router picks predicted. After it, the N experts each block selected most
often become the next draft set (temporal hotness); they were just fetched, so the
refresh normally moves nothing.
"""

from __future__ import annotations

import random
from dataclasses import replace
from collections import Counter
from pathlib import Path

import torch

from ..errors import SpecMoEError
from ..experts.store import default_cache_dir
from ..model.moe import Routing, combine, group_by_expert, run_expert
from ..spec.affinity import load_affinity, substitution_map
from ..spec.hotness import HotnessCounter, random_draft_set
from ..spec.quant import QUANT_MODES, quantize_all
from .offload import OffloadPolicy

DRAFT_SETS = ("temporal-hot", "global-hot", "random")
SUBSTITUTIONS = ("affinity", "random")
DRAFT_COMPUTE = ("device", "host")
DRAFT_QUANT = QUANT_MODES  # none: the paper's draft; else quantized copies of every expert
WORKING_SLOTS = 2  # slots beyond the draft sets, for streaming verification's fetches


class SpecMoEPolicy(OffloadPolicy):
    name = "specmoe"
    speculative = True

    @classmethod
    def min_slots(cls, config, options) -> int:
        # with quantized copies of every expert the draft needs no full-precision one
        n = options.draft_experts or (0 if options.draft_quant != "none" else 1)
        return n * len(config.moe_layer_ids) + WORKING_SLOTS

    @classmethod
    def default_draft_experts(cls, config, slots: int) -> int:
        """The most experts per block that fit beside the working slots, at most a quarter of a block."""
        return max(1, min(config.num_experts // 4, (slots - WORKING_SLOTS) // len(config.moe_layer_ids)))

    def __init__(self, runtime):
        opts = runtime.options
        for name, value, allowed in (("draft_set", opts.draft_set, DRAFT_SETS), ("substitution", opts.substitution, SUBSTITUTIONS),
                                     ("draft_compute", opts.draft_compute, DRAFT_COMPUTE)):
            if value not in allowed:
                raise SpecMoEError(f"unknown {name} {value!r}; choose one of: {', '.join(allowed)}")
        if opts.draft_quant not in DRAFT_QUANT + ("auto",):
            raise SpecMoEError(f"unknown draft_quant {opts.draft_quant!r}; choose one of: auto, {', '.join(DRAFT_QUANT)}")
        if opts.draft_compute == "host" and opts.offload != "host":
            raise SpecMoEError("draft_compute host computes draft experts where they live and needs --offload host")
        if opts.draft_quant not in ("none", "auto") and opts.draft_compute == "host":
            raise SpecMoEError(f"--draft-quant {opts.draft_quant} already gives the draft every expert on the device; "
                               "drop --draft-compute host or use --draft-quant none")
        c = runtime.config
        if opts.draft_experts and opts.draft_experts >= c.num_experts:
            raise SpecMoEError(f"--draft-experts {opts.draft_experts} must be below the {c.num_experts} experts per block "
                               "(drafting with all of them is policy resident)")
        cache = Path(opts.offload_dir) if opts.offload_dir else default_cache_dir()
        self.quantized = None
        self.quantized_bytes = 0
        self.draft_quant = self._reserve_quantized(runtime, cache)
        runtime = replace(runtime, options=replace(opts, draft_quant=self.draft_quant))  # auto, resolved
        opts = runtime.options
        super().__init__(runtime)
        quant = self.quantized is not None
        if quant:
            # full-precision draft experts where the budget allows: possibly none
            fits = (self.pool.num_slots - WORKING_SLOTS) // len(c.moe_layer_ids)
            default = max(0, min(c.num_experts // 4, fits))
        else:
            default = self.default_draft_experts(c, self.pool.num_slots)
        self.draft_experts = opts.draft_experts or default
        self.gamma = opts.gamma
        self.rng = random.Random(0)
        self.draft: dict[int, list[int]] = {}
        self.substitute: dict[int, torch.Tensor] = {}
        self.affinity = None
        if opts.substitution == "affinity" and opts.draft_compute == "device" and not quant:
            self.affinity = load_affinity(runtime.checkpoint, cache)
        self.hotness = HotnessCounter(c.num_layers, c.num_experts)

    def reset_stats(self) -> None:
        super().reset_stats()
        self.refresh_fetches = 0
        self.draft_fetches_seen = 0
        self.predicted: dict[int, Counter] = {}
        self.prefetch_hits = self.prefetch_predicted = self.prefetch_needed = 0

    def stats(self) -> dict:
        s = super().stats()
        s.update(
            draft_set=self.runtime.options.draft_set,
            substitution=self.runtime.options.substitution,
            draft_compute=self.runtime.options.draft_compute,
            draft_quant=self.draft_quant,
            draft_resident_bytes=self.draft_experts * len(self.config.moe_layer_ids) * self.pool.expert_bytes,
            draft_quantized_bytes=self.quantized_bytes,
            refresh_bytes=self.refresh_fetches * self.pool.expert_bytes,
            draft_transfer_bytes=self.draft_fetches_seen * self.pool.expert_bytes,
            prefetch_precision=self.prefetch_hits / self.prefetch_predicted if self.prefetch_predicted else None,
            prefetch_recall=self.prefetch_hits / self.prefetch_needed if self.prefetch_needed else None,
        )
        return s

    def _reserve_quantized(self, runtime, cache) -> str:
        """Quantized copies of every expert for the draft, reserved before the pool is sized.

        `auto` (the default) takes the most precise copies that leave room for the working
        slots: int8, else int4, else none (the paper's draft of resident experts only)."""
        opts = runtime.options
        modes = ("int8", "int4") if opts.draft_quant == "auto" and opts.draft_compute == "device" else (opts.draft_quant,)
        for mode in modes:
            if mode in ("none", "auto"):
                break
            quantized = quantize_all(runtime.checkpoint, runtime.expert_keys, mode, runtime.dtype, cache, runtime.device)
            need = quantized.nbytes + quantized.scratch_bytes(runtime.dtype)
            if opts.draft_quant == "auto" and runtime.budget.available() < need + WORKING_SLOTS * runtime.expert_bytes:
                continue  # does not fit beside the working slots: try fewer bits
            runtime.budget.reserve(
                "quantized draft experts", quantized.nbytes,
                hint=f" ({mode} copies of all {len(runtime.expert_keys)} experts; a lower-bit --draft-quant needs less)",
            )
            if quantized.scratch_bytes(runtime.dtype):
                runtime.budget.reserve("quantized draft scratch", quantized.scratch_bytes(runtime.dtype))
            self.quantized, self.quantized_bytes = quantized, quantized.nbytes
            return mode
        return "none"

    # --- passes --------------------------------------------------------------------------

    def begin_pass(self, kind: str) -> None:
        if kind == "draft" and not self.draft:
            self.refresh()  # the first draft set, from the prefill's routing: before drafting starts
        super().begin_pass(kind)
        if kind == "draft":
            self.predicted = {}
            self._fetches_before_draft = self.transfer.fetches
        elif kind == "verify":
            # prefetch what the draft's own (unsubstituted) picks predict, block by block,
            # the most demanded first; the rest is fetched on demand
            queue = []
            for layer in sorted(self.predicted):
                queue += [(layer, e) for e, _ in self.predicted[layer].most_common() if not self.transfer.has((layer, e))]
            self.prefetch_queue = queue
            self._issue([], [])
            if self.runtime.options.draft_set == "temporal-hot":
                self.hotness.reset()  # the next draft set comes from this pass alone

    def end_draft(self) -> None:
        """Drafting must not have moved any expert bytes."""
        moved = self.transfer.fetches - self._fetches_before_draft
        self.draft_fetches_seen += moved
        if moved:
            raise RuntimeError(f"internal: the draft fetched {moved} experts")

    def end_verify(self) -> None:
        if self.runtime.options.draft_set == "temporal-hot":
            self.refresh()

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        if self.kind == "draft":
            return self._draft_block(layer, x, routing)
        if self.kind == "verify":
            needed = set(torch.unique(routing.ids).tolist())
            predicted = set(self.predicted.get(layer, ()))
            self.prefetch_hits += len(needed & predicted)
            self.prefetch_predicted += len(predicted)
            self.prefetch_needed += len(needed)
        if self.kind in ("prefill", "verify"):
            self.hotness.add(layer, routing.ids)
        return super().run_moe(layer, x, routing)

    def _draft_block(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        self.predicted.setdefault(layer, Counter()).update(routing.ids.reshape(-1).tolist())
        if self.runtime.options.draft_compute == "host":
            groups = group_by_expert(routing, self.config.num_experts)
            on_host = set(groups.experts) - set(self.draft[layer])
            return self.run_block(layer, x, groups, on_host=on_host)
        if self.quantized is not None:
            # every expert has a copy on the device: the draft routes exactly, through the
            # full-precision draft expert where one is resident, else the quantized copy
            groups = group_by_expert(routing, self.config.num_experts)
            resident = set(self.draft[layer])
            outputs = [
                run_expert(self.pool.slot_tensor((layer, e)), x[t], self.hidden, self.inter) if e in resident
                else self.quantized.forward(layer, e, x[t])
                for e, t in zip(groups.experts, groups.tokens)
            ]
            return combine(x, groups, outputs)
        groups = group_by_expert(routing.with_ids(self.substitute[layer][routing.ids]), self.config.num_experts)
        outputs = [
            run_expert(self.pool.slot_tensor((layer, e)), x[t], self.hidden, self.inter)
            for e, t in zip(groups.experts, groups.tokens)
        ]
        return combine(x, groups, outputs)

    # --- the draft set ---------------------------------------------------------------------

    def refresh(self) -> None:
        """Make the N hottest experts of each block (or the configured choice) the draft set."""
        opts, c, n = self.runtime.options, self.config, self.draft_experts
        table = self.pool.table
        new = {}
        for layer in c.moe_layer_ids:
            if opts.draft_set == "random" or (self.draft and opts.draft_set == "global-hot"):
                new[layer] = self.draft.get(layer) or random_draft_set(c.num_experts, n, self.rng)
            else:
                new[layer] = self.hotness.hottest(layer, n, tie_break=self.draft.get(layer))
        for layer, experts in self.draft.items():
            for e in experts:
                table.unpin((layer, e))
        for layer, experts in new.items():
            for e in experts:
                if (layer, e) not in table and (layer, e) not in self.transfer.inflight:
                    self.refresh_fetches += 1
                self.transfer.ensure((layer, e))
                table.pin((layer, e))
            if self.quantized is None:  # with quantized copies nothing is substituted (and N may be 0)
                self.substitute[layer] = self._substitution(layer, experts)
        self.draft = new

    def _substitution(self, layer: int, experts: list[int]) -> torch.Tensor:
        if self.affinity is not None:
            return substitution_map(self.affinity[layer], experts).to(self.runtime.device)
        E = self.config.num_experts
        mapping = [e if e in experts else self.rng.choice(experts) for e in range(E)]
        return torch.tensor(mapping, dtype=torch.long, device=self.runtime.device)
