"""The policy interface.

A policy decides where routed experts are when a MoE block runs and how they get there.
It is the model's `ExpertBackend` (run_moe / after_layer) and keeps its own counters.
Decoding strategy (plain or speculative) is the engine's, chosen by `speculative`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checkpoint import Checkpoint
from ..config import ModelConfig
from ..experts.budget import DeviceBudget
from ..model.moe import Routing


@dataclass
class Runtime:
    """What every policy may use: the model's shape and checkpoint, the device and its budget."""

    config: ModelConfig
    checkpoint: Checkpoint
    device: torch.device
    dtype: torch.dtype
    budget: DeviceBudget
    options: object  # the EngineConfig (policy-specific knobs live there)
    weights: object = None  # the ModelWeights (routers and norms, for policies that predict routing)
    max_model_len: int = 2048  # KV positions reserved per sequence

    @property
    def expert_bytes(self) -> int:
        return self.config.expert_params * torch.tensor([], dtype=self.dtype).element_size()

    @property
    def expert_keys(self) -> list[tuple[int, int]]:
        return [(layer, e) for layer in self.config.moe_layer_ids for e in range(self.config.num_experts)]


class Policy:
    name = "base"
    speculative = False

    @classmethod
    def min_slots(cls, config, options) -> int:
        """Device pool slots (experts) the policy needs to run at all."""
        return len(config.moe_layer_ids) * config.num_experts

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.config = runtime.config

    # --- ExpertBackend -----------------------------------------------------------------
    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        raise NotImplementedError

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        pass

    # --- lifecycle ---------------------------------------------------------------------
    kind = "prefill"

    def begin_pass(self, kind: str) -> None:
        """kind: 'prefill' | 'decode' | 'draft' | 'verify'."""
        self.kind = kind

    def reset_stats(self) -> None:
        pass

    auto_plan: str | None = None  # set when `auto` chose this policy

    def stats(self) -> dict:
        """Policy counters merged into the run statistics."""
        return {"transfer_bytes": 0, "cache_hit_rate": 1.0}

    def run_stats(self) -> dict:
        stats = self.stats()
        if self.auto_plan:
            stats.update(auto_choice=self.name, auto_plan=self.auto_plan)
        return stats

    def close(self) -> None:
        pass
