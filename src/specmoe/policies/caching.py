"""`caching`: keep the most frequently used experts of each block resident (default 10 %
of each block, `cache_fraction`), chosen from a profiling pass over the prompts (the
routing of the first prefill pass); the remaining slots are an LRU cache; misses are fetched
on demand."""

from __future__ import annotations

import math

import torch

from ..model.moe import Routing
from .offload import OffloadPolicy


class CachingPolicy(OffloadPolicy):
    name = "caching"

    @classmethod
    def hot_per_block(cls, config, fraction: float) -> int:
        return max(1, math.ceil(fraction * config.num_experts)) if fraction > 0 else 0

    @classmethod
    def min_slots(cls, config, options) -> int:
        return cls.hot_per_block(config, options.cache_fraction) * len(config.moe_layer_ids) + 1

    def reset_stats(self) -> None:
        super().reset_stats()
        if not hasattr(self, "profile"):
            self.profile = torch.zeros(self.config.num_layers, self.config.num_experts, dtype=torch.long)
            self.hot: list[tuple[int, int]] | None = None

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        self.count_picks(layer, routing)
        return super().run_moe(layer, x, routing)

    def count_picks(self, layer: int, routing: Routing) -> None:
        """While profiling (before the hot set is chosen), count the router's picks."""
        if self.hot is None:
            self.profile[layer] += torch.bincount(routing.ids.reshape(-1).cpu(), minlength=self.config.num_experts)

    def begin_pass(self, kind: str):
        if self.hot is None and self.profile.sum() > 0:
            # the first prefill's prompts have been seen: profiling is over (also when the
            # next pass is another prefill, as in scoring runs that never decode)
            self.choose_hot_set()
        return super().begin_pass(kind)

    def choose_hot_set(self) -> None:
        k = self.hot_per_block(self.config, self.runtime.options.cache_fraction)
        self.hot = [
            (layer, int(e)) for layer in self.config.moe_layer_ids
            for e in torch.argsort(self.profile[layer], descending=True, stable=True)[:k].tolist()
        ]
        self.load_resident(self.hot)

    def stats(self) -> dict:
        s = super().stats()
        s["hot_experts"] = len(self.hot or [])
        return s
