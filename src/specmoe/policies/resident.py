"""`resident`: every expert on the compute device ("standard MoE inference")."""

from __future__ import annotations

import torch

from ..model.moe import Routing, grouped_experts, sort_picks, stacked_views
from .base import Policy, Runtime


class ResidentPolicy(Policy):
    name = "resident"

    def __init__(self, runtime: Runtime):
        super().__init__(runtime)
        c = runtime.config
        runtime.budget.reserve(
            "experts", runtime.expert_bytes * len(runtime.expert_keys),
            hint=" (policy resident keeps every expert on the device; an offloading policy needs less)",
        )
        # each block's experts stacked in one buffer: the block runs as one grouped computation
        self.stacks = {
            layer: torch.stack([runtime.checkpoint.expert_buffer(layer, e, runtime.dtype)
                                for e in range(c.num_experts)]).to(runtime.device)
            for layer in c.moe_layer_ids
        }
        self.views = {layer: stacked_views(stack, c.expert) for layer, stack in self.stacks.items()}

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        picks = sort_picks(routing, self.config.num_experts)
        return grouped_experts(self.config.expert, x, picks, self.views[layer], picks.offsets)
