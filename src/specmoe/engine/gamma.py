"""Choosing gamma (draft tokens per speculative step) from what the steps measure.

A step at gamma g costs g draft passes and one verification pass, and gives each sequence
its accepted drafts plus one token. The tuner measures how deep drafts are accepted (the
share of sequences whose draft was accepted to position j, for every j drafted), the time
of a draft pass, and the verification's time at gamma 0 (plain decoding) and at the gammas
it runs, and moves to the gamma with the most tokens per second. Acceptance is not taken
as one rate per token: on real text some sequences accept whole drafts (repetitions,
code) while others reject the first token, and long drafts pay for the first kind; the
depth curve keeps both. Gamma 0 is plain decoding: where drafts are rejected or cost more
than they save the measurements say so after a step or two, and the run is not slower
than not speculating.

Plain Python: `GammaTuner` sees only counts and seconds (`StepMeasure`), so the rule is
tested without a model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..base.config import MAX_GAMMA


@dataclass(frozen=True)
class StepMeasure:
    """One speculative step of the running batch."""

    gamma: int  # the longest draft of the step
    drafts: tuple[tuple[int, int], ...]  # per sequence: (tokens drafted, of them accepted)
    draft_s: float
    verify_s: float


class AcceptanceDepth:
    """How deep drafts are accepted: for each position j, the share of the sequences that
    drafted j or more tokens whose first j were accepted (counts decayed by `memory` per
    step, so that the curve follows the text). A sequence's expected tokens from a step of
    gamma g is 1 plus that share summed over j = 1..g; past the deepest position measured
    (`measured_to`) the curve goes on falling as it fell over its last measured position."""

    def __init__(self, memory: float):
        self.memory = memory
        self.drafted = [0.0] * (MAX_GAMMA + 1)  # index j: sequences that drafted j or more
        self.reached = [0.0] * (MAX_GAMMA + 1)  # ... and had their first j accepted
        self._tokens: list[float] | None = None  # expected tokens at each gamma, made once per record

    def record(self, drafts) -> None:
        self.drafted = [self.memory * n for n in self.drafted]
        self.reached = [self.memory * n for n in self.reached]
        for drafted, accepted in drafts:
            for j in range(1, min(drafted, MAX_GAMMA) + 1):
                self.drafted[j] += 1
                self.reached[j] += accepted >= j
        self._tokens = None

    @property
    def measured_to(self) -> int:
        """The deepest position still measured: drafted by at least one sequence's worth of
        decayed counts (a position not drafted for a while is forgotten, and extrapolated)."""
        return max((j for j in range(1, MAX_GAMMA + 1) if self.drafted[j] >= 1.0), default=0)

    def share(self, j: int) -> float:
        """The share of sequences whose first j drafts (1 <= j <= MAX_GAMMA) are accepted."""
        return self.expected_tokens(j) - self.expected_tokens(j - 1)

    def expected_tokens(self, gamma: int) -> float:
        if self._tokens is None:  # the tuner asks at every gamma every step: the curve is summed once
            self._tokens = list(itertools.accumulate(self._shares(), initial=1.0))
        return self._tokens[gamma]

    def _shares(self) -> list[float]:
        """share(j) for j = 1..MAX_GAMMA."""
        deepest = self.measured_to
        if deepest == 0:
            return [0.5 ** j for j in range(1, MAX_GAMMA + 1)]  # nothing drafted yet: a coin per token
        measured = [(self.reached[j] + 1e-3) / (self.drafted[j] + 2e-3) for j in range(1, deepest + 1)]
        last = measured[-1]
        step = min(last / measured[-2] if deepest > 1 else last, 1.0)
        return measured + [last * step ** (j - deepest) for j in range(deepest + 1, MAX_GAMMA + 1)]


class GammaTuner:
    """Picks each step's gamma from measured acceptance depth and pass times.

    - acceptance: `AcceptanceDepth`;
    - a draft pass's seconds, and verification's seconds at each gamma run (moving averages);
    - verification time at a gamma not run is the straight line through the measured ones
      (through plain decoding's and the nearest measured gamma's beyond the last).

    The first step runs at the given gamma, the second plain (to measure gamma 0); from then
    on each step runs at the gamma predicted fastest, at most twice the largest one measured
    plus one (the line is not trusted far out). Plain decoding is measured again every
    `reprobe` steps, and from gamma 0 a draft is tried again after `reprobe` plain steps.
    """

    def __init__(self, gamma: int, max_gamma: int = MAX_GAMMA, reprobe: int = 32, memory: float = 0.9,
                 smoothing: float = 0.5):
        self.gamma, self.max_gamma, self.reprobe = gamma, max_gamma, reprobe
        self.smoothing = smoothing
        self.depth = AcceptanceDepth(memory)
        self.draft_pass_s: float | None = None
        self.verify_s: dict[int, float] = {}  # gamma -> seconds of its verification pass
        self.plain_steps = 0  # steps at gamma 0
        self._since_plain = 0  # steps since gamma 0 was measured
        self._plain_run = 0  # consecutive steps at gamma 0

    def update(self, step: StepMeasure) -> int:
        """Record a step; return the gamma for the next one."""
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
            self.depth.record(step.drafts)
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
        return self.depth.expected_tokens(g) / max(seconds, 1e-9)

    def best(self, positive: bool = False) -> int:
        """The gamma predicted fastest, within reach of what was measured."""
        if self.draft_pass_s is None:  # no draft measured yet: nothing to compare
            return self.gamma
        reach = min(self.max_gamma, 2 * max(self.verify_s) + 1)
        return max(range(1 if positive else 0, reach + 1), key=self.rate)
