"""Accepting drafts (engine/acceptance.py), as pure functions.

Speculative sampling is checked exactly, not by Monte Carlo: every random choice of
`accept_sampled` goes through a coins object, so the test replays the whole speculative
process (draft tokens drawn from q, accept / reject, the correction or bonus token) along
every possible path and sums each path's probability. The distribution of the emitted
tokens must equal the target's own, to float64 rounding. Target and draft are random
first-order "models" over a vocabulary of 4 whose rows all differ (and hold some zeros),
so a rule that reads the wrong row, or ignores the draft, gives a different answer.
"""

from collections import defaultdict

import pytest
import torch

from specmoe.engine.acceptance import accept_greedy, accept_sampled

V, GAMMA, N_TOKENS = 4, 2, 3


def test_greedy_accepts_the_matching_prefix_then_the_targets_token():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == (2, 9)
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == (3, 1)
    assert accept_greedy([5], [4, 3]) == (0, 4)
    assert accept_greedy([], [8]) == (0, 8)


def random_rows(seed: int, zeros: list[tuple[int, int]]) -> torch.Tensor:
    """[V, V] float64: row r is the distribution of the token after token r."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(1.5 * torch.randn(V, V, generator=gen, dtype=torch.float64), dim=-1)
    for row, col in zeros:  # tokens one side can never produce (as after top-k / top-p)
        probs[row, col] = 0.0
    return probs / probs.sum(-1, keepdim=True)


TARGET = random_rows(1, zeros=[(2, 0), (3, 1)])
DRAFT = random_rows(2, zeros=[(0, 3), (1, 2), (2, 1)])


class Branch(Exception):
    def __init__(self, options):
        self.options = options


class ScriptedCoins:
    """Coins that follow a script of choices and multiply up its probability; past the
    end of the script they raise Branch with the possible next choices."""

    def __init__(self, script):
        self.script, self.used, self.weight = script, 0, 1.0

    def _next(self, options):
        if self.used == len(self.script):
            raise Branch(options)
        self.used += 1
        return self.script[self.used - 1]

    def accept(self, probability: float) -> bool:
        yes = self._next([o for o, w in ((True, probability), (False, 1.0 - probability)) if w > 0])
        self.weight *= probability if yes else 1.0 - probability
        return yes

    def draw(self, probs: torch.Tensor) -> int:
        token = self._next([t for t in range(len(probs)) if probs[t] > 0])
        self.weight *= float(probs[token])
        return token


def exact_distribution(process) -> dict:
    """{outcome: probability} of `process(coins)` over every path of its choices."""
    dist, scripts = defaultdict(float), [[]]
    while scripts:
        script = scripts.pop()
        coins = ScriptedCoins(script)
        try:
            outcome = process(coins)
        except Branch as branch:
            scripts += [script + [choice] for choice in branch.options]
            continue
        dist[outcome] += coins.weight
    return dist


def speculative_tokens(rule, coins) -> tuple:
    """N_TOKENS tokens after token 0, by speculative steps of up to GAMMA drafts (fewer
    near the end, as the engine drafts)."""
    out, prev = [], 0
    while len(out) < N_TOKENS:
        drafts, qs, context = [], [], prev
        for _ in range(min(GAMMA, N_TOKENS - len(out) - 1)):
            token = coins.draw(DRAFT[context])
            drafts.append(token)
            qs.append(DRAFT[context])
            context = token
        ps = torch.stack([TARGET[t] for t in [prev] + drafts])  # row k: after the first k drafts
        accepted, nxt = rule(drafts, torch.stack(qs) if qs else ps[:0], ps, coins)
        out += drafts[:accepted] + [nxt]
        prev = out[-1]
    return tuple(out)


def target_distribution() -> dict:
    """What the target alone gives: p(t1 | 0) p(t2 | t1) p(t3 | t2)."""
    dist = {}
    for t1 in range(V):
        for t2 in range(V):
            for t3 in range(V):
                dist[(t1, t2, t3)] = float(TARGET[0, t1] * TARGET[t1, t2] * TARGET[t2, t3])
    return dist


def distance(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def test_speculative_sampling_emits_exactly_the_targets_distribution():
    got = exact_distribution(lambda coins: speculative_tokens(accept_sampled, coins))
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-12)
    assert distance(got, target_distribution()) < 1e-12


# --- rules with one mistake each: the same check must tell them apart ---------------------------


def accept_every_draft(drafts, q, p, coins):
    return len(drafts), coins.draw(p[len(drafts)])


def ratio_from_the_first_draft_row(drafts, q, p, coins):
    """Reads q's row 0 at every position (the old test's draft rows were all alike, so
    this mistake passed it)."""
    return accept_sampled(drafts, q[:1].expand_as(q) if len(q) else q, p, coins)


def correction_from_the_target(drafts, q, p, coins):
    """At a rejection, draws from p instead of norm(max(0, p - q))."""
    for k, token in enumerate(drafts):
        if not (q[k, token] > 0 and coins.accept(min(1.0, float(p[k, token] / q[k, token])))):
            return k, coins.draw(p[k])
    return len(drafts), coins.draw(p[len(drafts)])


@pytest.mark.parametrize("wrong_rule", [accept_every_draft, ratio_from_the_first_draft_row,
                                        correction_from_the_target])
def test_a_rule_with_a_mistake_emits_another_distribution(wrong_rule):
    got = exact_distribution(lambda coins: speculative_tokens(wrong_rule, coins))
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-12)
    assert distance(got, target_distribution()) > 1e-3
