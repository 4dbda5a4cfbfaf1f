"""`host` (Fiddler / kTransformers style): experts not on the device are computed on the
host CPU, where they live, and activations move instead of weights. The device keeps a
hot set like `caching` does. Needs the host tier."""

from __future__ import annotations

import torch

from ..model.moe import Routing, group_by_expert
from .caching import CachingPolicy


class HostPolicy(CachingPolicy):
    name = "host"

    def pool_slots_wanted(self) -> int:
        return self.min_slots(self.config, self.runtime.options)  # the hot set; the rest runs on the host

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        self.count_picks(layer, routing)
        groups = group_by_expert(routing, self.config.num_experts)
        resident = {e for e in groups.experts if (layer, e) in self.pool.table}
        out = self.blocks.run_block(layer, x, groups, on_host=set(groups.experts) - resident)
        self.blocks.finish_block(layer, keep=True)
        return out
