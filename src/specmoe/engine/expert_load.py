"""Router picks per MoE block and expert, counted only while someone asks for them.

The server's live view switches counting on (`Engine.expert_load`) while a page watches
and off when the last one leaves; switched off, passes run exactly as before. Only the
full model's passes count (prefill, decode, verify): a draft's picks are guesses that
verification replaces, and they move no bytes.
"""

from __future__ import annotations

import torch

from ..model.moe import Routing


class ExpertLoad:
    """Tokens routed to each expert of each block since the last `take` ([layers, E] counts)."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device):
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.long, device=device)

    def add(self, layer: int, ids: torch.Tensor) -> None:
        flat = ids.reshape(-1).to(self.counts.device)
        # index_add_ rather than bincount: bincount sizes its output on the host (a CUDA sync per block)
        self.counts[layer].index_add_(0, flat, torch.ones_like(flat))

    def take(self) -> list[list[int]]:
        """The counts so far (one copy to the host), then start again from zero."""
        counts = self.counts.tolist()
        self.counts.zero_()
        return counts

    def wrap(self, experts) -> CountingBackend:
        return CountingBackend(experts, self)


class CountingBackend:
    """A pass's ExpertBackend that counts each block's picks, then lets the policy run them."""

    def __init__(self, experts, load: ExpertLoad):
        self.experts, self.load = experts, load

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        self.load.add(layer, routing.ids)
        return self.experts.run_moe(layer, x, routing)

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        self.experts.after_layer(layer, hidden)
