"""The draft pass's experts: the model's own router, unchanged, over what the device holds.

Per block, a pick is computed with
- the full-precision draft expert, when the pick is one (pinned in the device pool);
- else, with quantized copies of every expert, the pick's quantized copy (the draft then
  routes exactly like the full model);
- else, with `draft_compute="host"`, the expert itself on the host, where it lives;
- else the substitute the policy's map names (nearest by affinity, or random).
Nothing here fetches: a draft pass moves no expert bytes.
"""

from __future__ import annotations

from collections import Counter

import torch

from ...model.layers import as_dtype
from ...model.moe import Routing, combine, group_by_expert


class Drafter:
    """The ExpertBackend of draft passes; reads the policy's draft sets and substitutes."""

    def __init__(self, policy):
        self.policy = policy
        c = policy.config
        self.spec, self.num_experts = c.expert, c.num_experts

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        p = self.policy
        # the draft's own picks predict what verification will need
        p.predicted.setdefault(layer, Counter()).update(routing.ids.reshape(-1).tolist())
        if p.runtime.options.draft_compute == "host":
            groups = group_by_expert(routing, self.num_experts)
            return p.blocks.run_block(layer, x, groups, on_host=set(groups.experts) - set(p.draft[layer]))
        if p.quantized is None:
            routing = routing.with_ids(p.substitute[layer][routing.ids])
        groups = group_by_expert(routing, self.num_experts)
        resident = set(p.draft[layer])
        dtype = p.quantized.compute_dtype if p.quantized is not None else None
        xq = x if dtype is None else as_dtype(x, dtype)  # the quantized copies' input, converted once per block
        outputs = [self._expert(layer, e, groups.inputs(x if e in resident else xq, j), e in resident)
                   for j, e in enumerate(groups.experts)]
        return combine(x, groups, outputs)

    def _expert(self, layer: int, e: int, xs: torch.Tensor, resident: bool) -> torch.Tensor:
        p = self.policy
        if resident:
            return p.blocks.format.forward(p.pool.slot_tensor((layer, e)), xs)
        return p.quantized.forward(layer, e, xs)

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        pass
