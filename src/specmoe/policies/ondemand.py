"""`ondemand` (MoE-OnDemand, HF-accelerate style): fetch each block's experts when the
block runs, every step; keep nothing across steps."""

from __future__ import annotations

from .offload import OffloadPolicy


class OnDemandPolicy(OffloadPolicy):
    name = "ondemand"
    keep_across_steps = False

    def pool_slots_wanted(self) -> int:
        return self.config.num_experts  # one block's worth is all it ever holds
