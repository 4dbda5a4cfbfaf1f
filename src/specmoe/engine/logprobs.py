"""Log-probabilities of tokens under the full model (`logprobs`, `prompt_logprobs`).

They are always the full model's raw distribution: the log-softmax of the logits of the
pass that decided the token (prefill, decode, or SpecMoE's verification, never the
draft's), before temperature, top-k or top-p, as OpenAI and vLLM report them. So they do
not depend on the policy, on the batch, or on the sampling settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..base.errors import SpecMoEError

MAX_LOGPROBS = 20  # as OpenAI; -1 asks for the whole vocabulary (Python API only)


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token there, its log-probability and rank, and the k most likely tokens."""

    token_id: int
    logprob: float
    rank: int  # 1: the most likely token at this position
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first

    def top_dict(self) -> dict[int, float]:
        """The k most likely tokens and this position's own token, as vLLM's dict of id -> log-probability."""
        return {**dict(self.top), self.token_id: self.logprob}


def check_k(name: str, k) -> None:
    """None (off), 0..MAX_LOGPROBS, or -1 (the whole vocabulary); anything else is an error."""
    if k is None:
        return
    if not isinstance(k, int) or isinstance(k, bool) or not -1 <= k <= MAX_LOGPROBS:
        raise SpecMoEError(
            f"{name} must be an integer from 0 to {MAX_LOGPROBS} (the most likely tokens to return per "
            f"position), -1 for the whole vocabulary, or None, got {k!r}"
        )


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprobs]:
    """`logits` [N, V]: row i is what the model predicted for `tokens[i]`; `k` most likely
    tokens per row (-1: all of them). One copy to the host for all rows."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=logp.device)
    chosen = logp.gather(-1, ids[:, None])[:, 0]
    ranks = (logp > chosen[:, None]).sum(-1) + 1
    k = logp.shape[-1] if k < 0 else min(k, logp.shape[-1])
    top = torch.topk(logp, k, dim=-1)
    chosen, ranks, top_lp, top_ids = (t.tolist() for t in (chosen, ranks, top.values, top.indices))
    return [
        TokenLogprobs(token, lp, rank, tuple(zip(ids_row, lp_row)))
        for token, lp, rank, ids_row, lp_row in zip(tokens, chosen, ranks, top_ids, top_lp)
    ]
