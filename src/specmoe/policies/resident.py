"""`resident`: every expert on the compute device ("standard MoE inference")."""

from __future__ import annotations

import torch

from ..experts.formats import FloatFormat
from ..model.moe import Routing, dispatch, group_by_expert, grouped_experts, sort_picks, stacked_views
from .base import Policy, Runtime, reserve_scratch


class ResidentPolicy(Policy):
    name = "resident"

    def __init__(self, runtime: Runtime):
        super().__init__(runtime)
        c = runtime.config
        self.format = fmt = runtime.expert_format
        reserve_scratch(runtime)
        runtime.budget.reserve(
            "experts", runtime.slot_bytes * len(runtime.expert_keys),
            hint=" (policy resident keeps every expert on the device; an offloading policy needs less)",
        )
        slots = {layer: [self._slot(fmt.read(runtime.checkpoint, layer, e)) for e in range(c.num_experts)]
                 for layer in c.moe_layer_ids}
        # float experts: each block's experts stacked in one buffer, run as one grouped
        # computation; quantized experts: one kernel call per expert on its own slot
        self.grouped = isinstance(fmt, FloatFormat)
        if self.grouped:
            self.views = {layer: stacked_views(torch.stack(s), c.expert) for layer, s in slots.items()}
        else:
            self.experts: dict[int, list[torch.Tensor]] = slots

    def _slot(self, stored: torch.Tensor) -> torch.Tensor:
        slot = torch.empty(self.format.slot_numel, dtype=self.format.slot_dtype, device=self.runtime.device)
        self.format.prepare(stored, slot)
        return slot

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        c = self.config
        if self.grouped:
            picks = sort_picks(routing, c.num_experts)
            return grouped_experts(c.expert, x, picks, self.views[layer], picks.offsets)
        buffers = self.experts[layer]
        groups = group_by_expert(routing, c.num_experts)
        return dispatch(x, groups, lambda e, xs: self.format.forward(buffers[e], xs))
