"""`overlap`: while layer l computes, prefetch layer l+1's experts, predicted by applying
layer l+1's router to layer l's output hidden state; mispredictions are fetched on
demand. Like `ondemand`, nothing is kept across steps."""

from __future__ import annotations

import torch

from ..model.layers import norm
from ..model.moe import Routing
from ..model.transformer import route_block
from .offload import OffloadPolicy


class OverlapPolicy(OffloadPolicy):
    name = "overlap"
    keep_across_steps = False

    @classmethod
    def min_slots(cls, config, options) -> int:
        return 2

    def pool_slots_wanted(self) -> int:
        return 2 * self.config.num_experts  # the running block and the predicted next one

    def reset_stats(self) -> None:
        super().reset_stats()
        self.predicted = 0
        self.predicted_used = 0
        self.needed = 0  # distinct experts the predicted blocks needed
        self._prediction: dict[int, set[int]] = {}

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        nxt = self._next_moe_layer(layer)
        if nxt is None:
            return
        lw = self.runtime.weights.layers[nxt]
        c = self.config
        guess = route_block(c, lw, norm(c.family.norm, hidden, lw.mlp_norm, lw.mlp_norm_bias, c.rms_norm_eps))
        experts = torch.unique(guess.ids).tolist()
        self._prediction[nxt] = set(experts)
        self.predicted += len(experts)
        for e in experts:
            self.transfer.fetch((nxt, e))

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        predicted = self._prediction.pop(layer, None)
        if predicted is not None:
            needed = set(routing.ids.unique().tolist())
            self.predicted_used += len(predicted & needed)
            self.needed += len(needed)
        return super().run_moe(layer, x, routing)

    def _next_moe_layer(self, layer: int) -> int | None:
        c = self.config  # the next block of the same stack (an encoder's output is no decoder input)
        later = [i for i in c.moe_layer_ids if i > layer and c.stack_of(i) == c.stack_of(layer)]
        return later[0] if later else None

    def stats(self) -> dict:
        s = super().stats()
        s["prefetch_precision"] = self.predicted_used / self.predicted if self.predicted else None
        s["prefetch_recall"] = self.predicted_used / self.needed if self.needed else None
        return s
