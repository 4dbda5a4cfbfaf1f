"""Accepting drafted tokens: pure functions, one sequence at a time, batch-agnostic.

Greedy: with draft tokens d_1..d_g and the target's argmax a_0..a_g at the g+1 verified
positions (a_k predicts the token after d_k; a_0 after the last committed token), accept
the longest prefix with d_k == a_{k-1}; then emit a_j at the first mismatch j (or the
bonus a_g when all match). The output equals greedy decoding of the target exactly.

Sampling (speculative rejection sampling, Leviathan et al. / Chen et al.): accept d_k with
probability min(1, p_k(d_k) / q_k(d_k)), p the target's and q the draft's distribution at
that position, both after the same temperature/top-k/top-p; at the first rejection draw
from norm(max(0, p_k - q_k)); if all are accepted draw the bonus from p_g. The emitted
tokens are distributed exactly as the target's own samples.
"""

from __future__ import annotations

import torch


def accept_greedy(draft_tokens: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """(number of drafts accepted, the target's token that follows them)."""
    assert len(target_argmax) == len(draft_tokens) + 1
    accepted = 0
    for drafted, target in zip(draft_tokens, target_argmax):
        if drafted != target:
            break
        accepted += 1
    return accepted, target_argmax[accepted]


class TorchCoins:
    """The random choices of speculative sampling, drawn from a torch generator.

    `accept_sampled` makes every random choice through this small interface (a biased
    coin, a draw from a distribution), so that a test can enumerate all outcomes with
    their exact probabilities instead of sampling them."""

    def __init__(self, generator: torch.Generator | None):
        self.generator = generator

    def accept(self, probability: float) -> bool:
        return float(torch.rand((), generator=self.generator)) < probability

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))


def accept_sampled(
    draft_tokens: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor, coins: TorchCoins
) -> tuple[int, int]:
    """draft_probs [g, V] (q), target_probs [g + 1, V] (p), on the CPU; row k of both is
    the distribution of the token after the committed tokens and the first k drafts.
    Returns (number of drafts accepted, the next token)."""
    for k, token in enumerate(draft_tokens):
        p, q = float(target_probs[k, token]), float(draft_probs[k, token])
        if q > 0 and coins.accept(min(1.0, p / q)):
            continue
        residual = torch.clamp(target_probs[k] - draft_probs[k], min=0.0)
        total = float(residual.sum())
        if total <= 0:  # p == q: nothing to correct (only reachable through rounding)
            residual, total = target_probs[k], 1.0
        return k, coins.draw(residual / total)
    g = len(draft_tokens)
    return g, coins.draw(target_probs[g])
