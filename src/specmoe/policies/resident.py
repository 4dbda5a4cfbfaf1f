"""`resident`: every expert on the compute device ("standard MoE inference")."""

from __future__ import annotations

import torch

from ..model.moe import Routing, dispatch, group_by_expert, run_expert
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
        self.experts: dict[int, list[torch.Tensor]] = {
            layer: [
                runtime.checkpoint.expert_buffer(layer, e, runtime.dtype).to(runtime.device)
                for e in range(c.num_experts)
            ]
            for layer in c.moe_layer_ids
        }

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        c = self.config
        buffers = self.experts[layer]
        groups = group_by_expert(routing, c.num_experts)
        return dispatch(x, groups, lambda e, xs: run_expert(buffers[e], xs, c.expert))
