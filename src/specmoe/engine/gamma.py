"""Choosing gamma (draft tokens per speculative step) by measuring."""

from __future__ import annotations

from ..base.config import MAX_GAMMA


class GammaTuner:
    """Picks gamma by measuring: tokens per second of speculative steps at each gamma
    tried (exponential moving averages), moving to the better neighbour (gamma +- 1) and
    trying an untried neighbour once. How verification time grows with gamma depends on
    the machine (transfer-bound: barely; compute-bound on a CPU: with every position),
    so no formula for it is assumed.
    """

    def __init__(self, gamma: int, max_gamma: int = MAX_GAMMA, smoothing: float = 0.5):
        self.gamma, self.max_gamma, self.smoothing = gamma, max_gamma, smoothing
        self.rate: dict[int, float] = {}  # gamma -> tokens per second of a step

    def update(self, tokens: int, seconds: float) -> int:
        """Record a step at the current gamma that produced `tokens` in `seconds`; return
        the gamma for the next step."""
        g = self.gamma
        r = tokens / max(seconds, 1e-9)
        self.rate[g] = r if g not in self.rate else (1 - self.smoothing) * self.rate[g] + self.smoothing * r
        near = [n for n in (g - 1, g + 1) if 1 <= n <= self.max_gamma]
        untried = [n for n in near if n not in self.rate]
        if untried and max(self.rate.values()) == self.rate[g]:
            self.gamma = untried[-1]  # explore upwards first: longer drafts are the point
        else:
            self.gamma = max([g] + [n for n in near if n in self.rate], key=self.rate.get)
        return self.gamma
