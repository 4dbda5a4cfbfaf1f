"""Choosing gamma (draft tokens per speculative step) from what the steps measure.

A step at gamma g costs g draft passes and one verification pass, and gives each sequence
its accepted drafts plus one token. With each draft token accepted with probability a (the
paper's model), a sequence gets E(g) = 1 + a + ... + a^g tokens a step. The tuner measures
a, the time of a draft pass and the verification's time at gamma 0 (plain decoding) and at
the gamma it runs, and moves to the gamma with the most tokens per second under that model.
Gamma 0 is plain decoding: where drafts are rejected or cost more than they save the model
says so after a step or two, and the run is not slower than not speculating.

Plain Python: `GammaTuner` sees only counts and seconds (`StepMeasure`), so the rule is
tested without a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base.config import MAX_GAMMA


@dataclass(frozen=True)
class StepMeasure:
    """One full speculative step of the running batch (every sequence drafted `gamma`)."""

    gamma: int
    accepted: int  # draft tokens accepted, over the batch
    rejections: int  # sequences whose draft a rejection cut short
    draft_s: float
    verify_s: float


def expected_tokens(acceptance: float, gamma: int) -> float:
    """A sequence's tokens per step: the accepted drafts (a geometric run) plus one."""
    return sum(acceptance ** k for k in range(gamma + 1))


class GammaTuner:
    """Picks each step's gamma from measured acceptance and pass times.

    - acceptance: accepted / (accepted + rejections), each count decayed by `memory` per
      step so that it follows the text;
    - a draft pass's seconds, and verification's seconds at each gamma run (moving averages);
    - verification time at a gamma not run is the straight line through the measured ones
      (through plain decoding's and the nearest measured gamma's beyond the last).

    The first step runs at the given gamma, the second plain (to measure gamma 0); from then
    on each step runs at the model's best gamma, at most twice the largest one measured plus
    one (the line is not trusted far out). Plain decoding is measured again every `reprobe`
    steps, and from gamma 0 a draft is tried again after `reprobe` plain steps (acceptance
    changes with the text).
    """

    def __init__(self, gamma: int, max_gamma: int = MAX_GAMMA, reprobe: int = 32, memory: float = 0.8,
                 smoothing: float = 0.5):
        self.gamma, self.max_gamma, self.reprobe = gamma, max_gamma, reprobe
        self.memory, self.smoothing = memory, smoothing
        self.accepted = 0.0
        self.rejections = 0.0
        self.draft_pass_s: float | None = None
        self.verify_s: dict[int, float] = {}  # gamma -> seconds of its verification pass
        self.plain_steps = 0  # steps at gamma 0
        self._since_plain = 0  # steps since gamma 0 was measured
        self._plain_run = 0  # consecutive steps at gamma 0

    @property
    def acceptance(self) -> float:
        """Per-token acceptance, with one pseudo-count each way (never exactly 0 or 1)."""
        return (self.accepted + 1) / (self.accepted + self.rejections + 2)

    def update(self, step: StepMeasure) -> int:
        """Record a full step; return the gamma for the next one."""
        g = step.gamma
        self._average(g, step)
        if g == 0:
            self.plain_steps += 1
            self._since_plain, self._plain_run = 0, self._plain_run + 1
        else:
            self._since_plain, self._plain_run = self._since_plain + 1, 0
        if 0 not in self.verify_s or self._since_plain >= self.reprobe:
            self.gamma = 0  # measure plain decoding (again)
        elif g == 0 and self._plain_run >= self.reprobe:
            self.gamma = max(1, self.best(positive=True))  # drafts may pay again: measure them
        else:
            self.gamma = self.best()
        return self.gamma

    def _average(self, g: int, step: StepMeasure) -> None:
        def blend(old, new):
            return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

        self.verify_s[g] = blend(self.verify_s.get(g), step.verify_s)
        if g > 0:
            self.accepted = self.memory * self.accepted + step.accepted
            self.rejections = self.memory * self.rejections + step.rejections
            self.draft_pass_s = blend(self.draft_pass_s, step.draft_s / g)

    def predicted_verify_s(self, g: int) -> float:
        """Verification seconds at `g`: the line through the two measured gammas around it."""
        if g in self.verify_s:
            return self.verify_s[g]
        known = sorted(self.verify_s)
        below = max((k for k in known if k < g), default=known[0])
        above = min((k for k in known if k > g), default=None)
        if above is None:  # beyond the last measured: the slope between it and the one below
            above, below = below, max((k for k in known if k < below), default=below)
        if above == below:
            return self.verify_s[below]
        slope = (self.verify_s[above] - self.verify_s[below]) / (above - below)
        return max(0.0, self.verify_s[below] + slope * (g - below))

    def rate(self, g: int) -> float:
        """Predicted tokens per second of a sequence at gamma `g`."""
        seconds = self.predicted_verify_s(g) + g * (self.draft_pass_s or 0.0)
        return expected_tokens(self.acceptance, g) / max(seconds, 1e-9)

    def best(self, positive: bool = False) -> int:
        """The gamma the model predicts fastest, within reach of what was measured."""
        reach = min(self.max_gamma, 2 * max(self.verify_s) + 1)
        candidates = range(1 if positive else 0, reach + 1)
        if self.draft_pass_s is None:  # no draft measured yet: nothing to compare
            return self.gamma
        return max(candidates, key=self.rate)
