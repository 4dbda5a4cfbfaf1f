"""Choosing gamma (draft tokens per speculative step) by measuring."""

from __future__ import annotations

from ..base.config import MAX_GAMMA


class GammaTuner:
    """Picks gamma by measuring: tokens per second of speculative steps at each gamma
    tried (exponential moving averages), moving to the better neighbour (gamma +- 1) and
    trying an untried neighbour once. How verification time grows with gamma depends on
    the machine (transfer-bound: barely; compute-bound on a CPU: with every position),
    so no formula for it is assumed.

    Gamma 0 is plain decoding (no draft; the verify pass checks one token a sequence):
    where drafts are rejected or cost more than they save, the tuner walks down to it and
    the run is never slower than not speculating. From there it forgets what drafts
    measured every `reprobe` steps and tries gamma 1 again (acceptance changes with the
    text), climbing on from there if drafts pay.
    """

    def __init__(self, gamma: int, max_gamma: int = MAX_GAMMA, smoothing: float = 0.5, reprobe: int = 32):
        self.gamma, self.max_gamma, self.smoothing, self.reprobe = gamma, max_gamma, smoothing, reprobe
        self.rate: dict[int, float] = {}  # gamma -> tokens per second of a step
        self.plain_steps = 0  # steps at gamma 0
        self._since_probe = 0

    def update(self, tokens: int, seconds: float) -> int:
        """Record a step at the current gamma that produced `tokens` in `seconds`; return
        the gamma for the next step."""
        g = self.gamma
        r = tokens / max(seconds, 1e-9)
        self.rate[g] = r if g not in self.rate else (1 - self.smoothing) * self.rate[g] + self.smoothing * r
        if g == 0:
            self.plain_steps += 1
            self._since_probe += 1
            if self._since_probe >= self.reprobe:  # speculation may pay again: forget what drafts measured
                self._since_probe = 0
                self.rate = {0: self.rate[0]}
        near = [n for n in (g - 1, g + 1) if 0 <= n <= self.max_gamma]
        untried = [n for n in near if n not in self.rate]
        if untried and max(self.rate.values()) == self.rate[g]:
            self.gamma = untried[-1]  # explore upwards first: longer drafts are the point
        else:
            self.gamma = max([g] + [n for n in near if n in self.rate], key=self.rate.get)
        return self.gamma
