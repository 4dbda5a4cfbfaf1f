"""The draft pass's experts: the model's own router, unchanged, over what the device holds.

Per block, a pick is computed with
- the full-precision draft expert, when the pick is one (pinned in the device pool);
- else its quantized copy, when the draft holds one (copies of every expert: the draft
  then routes exactly like the full model; under --draft-memory, of those chosen);
- else, with `draft_compute="host"`, the expert itself on the host, where it lives;
- else the substitute the policy's map names (nearest held by affinity, or random).
Nothing here fetches for the draft: it moves no expert bytes for itself. What its routing
picks starts reading for the verify pass to come (the policy's `prefetch_for_verify`).
"""

from __future__ import annotations

from collections import Counter

import torch

from ...model.layers import as_dtype
from ...model.moe import Routing, combine, dispatch, group_by_expert


class Drafter:
    """The ExpertBackend of draft passes; reads the policy's draft sets and substitutes."""

    def __init__(self, policy):
        self.policy = policy
        c = policy.config
        self.spec, self.num_experts = c.expert, c.num_experts

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        p = self.policy
        picked = group_by_expert(routing, self.num_experts)
        # the draft's own picks predict what verification will need
        counts = picked.count_of()
        p.predicted.setdefault(layer, Counter()).update(counts)
        if p.memory is not None:
            p.memory.count_drafted(layer, counts)
        if p.runtime.options.draft_compute == "host":
            # not here: run_block would wait for such a read and compute from the pool
            return p.blocks.run_block(layer, x, picked, on_host=set(picked.experts) - set(p.draft[layer]))
        p.prefetch_for_verify(layer, counts)  # their reads start now, while the draft runs on
        resident = set(p.draft[layer])
        if layer in p.substitute:  # what the draft does not hold becomes the nearest it does
            picked = group_by_expert(routing.with_ids(p.substitute[layer][routing.ids]), self.num_experts)
        if p.quantized is None:
            return dispatch(x, picked, lambda e, xs: self._resident(layer, e, xs))
        # the quantized copies' input converted once per block; they run together, the
        # full-precision draft experts one by one
        outputs = p.quantized.block_outputs(layer, as_dtype(x, p.quantized.compute_dtype or x.dtype), picked,
                                            skip=resident)
        for j, e in enumerate(picked.experts):
            if e in resident:
                outputs[j] = self._resident(layer, e, picked.inputs(x, j))
        return combine(x, picked, outputs)

    def _resident(self, layer: int, e: int, xs: torch.Tensor) -> torch.Tensor:
        p = self.policy
        return p.blocks.format.forward(p.pool.slot_tensor((layer, e)), xs)

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        pass
