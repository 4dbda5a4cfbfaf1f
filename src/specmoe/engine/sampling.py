"""Sampling parameters and the logits -> token step.

`target_probs` is shared with speculative verification: temperature, top-k and top-p
are applied to the draft's and the target's distributions the same way, so that
rejection sampling keeps the target's (processed) distribution exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..base.errors import SpecMoEError
from .logprobs import check_k


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # log-probabilities under the full model (engine/logprobs.py): None = off; k = the
    # token's own and the k most likely (0..20); -1 = the whole vocabulary
    logprobs: int | None = None  # of each generated token
    prompt_logprobs: int | None = None  # of each prompt token but the first

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise SpecMoEError(f"max_tokens must be an integer >= 1 (0 only to score a prompt), got {self.max_tokens!r}")
        check_k("logprobs", self.logprobs)
        check_k("prompt_logprobs", self.prompt_logprobs)
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise SpecMoEError("max_tokens=0 generates nothing: it is only for scoring a prompt; "
                               "set prompt_logprobs (e.g. 0), or ask for at least 1 token")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or math.isnan(t) or t < 0 or math.isinf(t):
            raise SpecMoEError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or math.isnan(p) or not 0 < p <= 1:
            raise SpecMoEError(f"top_p must be in (0, 1], got {p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SpecMoEError(f"top_k must be an integer >= 0 (0 = no limit), got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SpecMoEError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> probabilities after temperature, top-k and top-p (float32)."""
    logits = logits.float()
    # largest logit to 0 first (softmax does not change) and a temperature float32 can
    # hold: a tiny one then sends the others to -inf, probability 0, rather than to nan
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop = before >= params.top_p
        drop[..., 0] = False  # the first token always stays, even where top_p rounds to 0 in float32
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_tokens(logits: torch.Tensor, seqs) -> list[int]:
    """One token per row of [B, V] logits for each of `seqs` (their params and generators):
    the greedy rows' argmax in one call, the others drawn one by one."""
    greedy = [s.params.greedy for s in seqs]
    tokens = logits.argmax(-1).tolist() if any(greedy) else [None] * len(seqs)
    for i, seq in enumerate(seqs):
        if not greedy[i]:
            tokens[i] = sample_token(logits[i], seq.params, seq.generator)
    return tokens


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from [V] logits: argmax when greedy, else a draw from `target_probs`."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = target_probs(logits, params)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
