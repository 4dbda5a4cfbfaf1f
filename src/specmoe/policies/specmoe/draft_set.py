"""Choosing the draft experts: temporal hotness (the paper's default), global hotness,
or random. Plain counting; the policy decides when to refresh."""

from __future__ import annotations

import random

import torch


class HotnessCounter:
    """Selections per expert per block, accumulated over a window (a verify pass), and
    and, when asked, over the whole run (`totals`: what --draft-memory's allocation weighs
    experts by)."""

    def __init__(self, num_layers: int, num_experts: int, whole_run: bool = False):
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.long)
        # only --draft-memory weighs the whole run: elsewhere no second table is held
        self.totals = torch.zeros_like(self.counts) if whole_run else None

    def add(self, layer: int, ids: torch.Tensor) -> None:
        picks = torch.bincount(ids.reshape(-1).cpu(), minlength=self.counts.shape[1])
        self.counts[layer] += picks
        if self.totals is not None:
            self.totals[layer] += picks

    def hottest(self, layer: int, n: int, tie_break: list[int] | None = None, whole_run: bool = False,
                among: list[int] | None = None) -> list[int]:
        """The n most selected experts of `layer` in the window (or the whole run), of
        `among` where given; ties go to `tie_break`'s order (the current draft set first,
        so that a refresh moves as little as possible)."""
        counts = (self.totals if whole_run else self.counts)[layer].tolist()
        preferred = {e: i for i, e in enumerate(tie_break or [])}
        candidates = range(len(counts)) if among is None else among
        order = sorted(candidates, key=lambda e: (-counts[e], preferred.get(e, len(counts)), e))
        return sorted(order[:n])

    def reset(self) -> None:
        self.counts.zero_()


def random_draft_set(num_experts: int, n: int, rng: random.Random) -> list[int]:
    return sorted(rng.sample(range(num_experts), n))
