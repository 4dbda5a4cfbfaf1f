"""`resident`: every expert on the compute device ("standard MoE inference")."""

from __future__ import annotations

import torch

from ..base.memory import release_free_memory
from ..experts.formats import FloatFormat
from ..model.moe import (Routing, dispatch, expert_views, group_by_expert, grouped_experts, one_token,
                         one_token_experts, picks_in_order, sort_picks, stacked_views)
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
        # each block's slots in one buffer, filled in place (no second copy on the device):
        # float experts run as one grouped computation over it, quantized experts (and
        # bfloat16 ones multiplied as stored) as one kernel call per expert on its row
        self.grouped = isinstance(fmt, FloatFormat) and not fmt.as_stored
        self.experts: dict[int, torch.Tensor] = {layer: self._block(layer) for layer in c.moe_layer_ids}
        if self.grouped:
            self.views = {layer: stacked_views(stack, c.expert) for layer, stack in self.experts.items()}
            self.expert_views = {layer: [expert_views(buffer, c.expert) for buffer in stack]
                                 for layer, stack in self.experts.items()}  # batch 1: one expert at a time

    def _block(self, layer: int) -> torch.Tensor:
        fmt, rt = self.format, self.runtime
        stack = torch.empty((self.config.num_experts, fmt.slot_numel), dtype=fmt.slot_dtype, device=rt.device)
        for e in range(self.config.num_experts):
            fmt.prepare(fmt.read(rt.checkpoint, layer, e), stack[e])
            # the expert was read into a temporary, which the allocator keeps once freed: given
            # back at once, building the model peaks near what it holds (the real-size
            # bfloat16 model: 4.08 GiB before, 3.75 after)
            release_free_memory()
        return stack

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        c = self.config
        if self.grouped and x.shape[0] == 1:
            return one_token_experts(c.expert, x, routing, self.expert_views[layer])
        if self.grouped:
            picks = sort_picks(routing, c.num_experts)
            return grouped_experts(c.expert, x, picks, self.views[layer], picks.offsets)
        buffers = self.experts[layer]
        compute = lambda e, xs: self.format.forward(buffers[e], xs)  # noqa: E731
        if x.shape[0] == 1:
            return self._one_token(x, routing, buffers, compute)
        return dispatch(x, group_by_expert(routing, c.num_experts), compute)

    def _one_token(self, x: torch.Tensor, routing: Routing, buffers: torch.Tensor, compute) -> torch.Tensor:
        """Batch 1: the token's experts in one kernel call where the format has one (the same
        bits as one call per expert, fewer waits for the threads), else one by one."""
        if not routing.scales_input:
            ids, weights = picks_in_order(routing)
            y = self.format.forward_token([buffers[e] for e in ids], weights, x)
            if y is not None:
                return y
        return one_token(x, routing, compute)
