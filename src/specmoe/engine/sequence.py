"""One request's state, in plain Python."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .logprobs import TokenLogprobs
from .sampling import SamplingParams


@dataclass
class Sequence:
    """A prompt and what has been generated for it.

    KV-cache invariant while running: the cache holds the prompt and every generated
    token except the last one (`pending`), which the next step feeds.
    """

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival_s: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None
    text: str = ""
    first_token_s: float | None = None
    last_token_s: float | None = None
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, if asked for
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # [None, one per later prompt token], if asked for
    steps: int = 0  # decode steps it took part in (a speculative step counts once)
    drafted: int = 0  # draft tokens proposed for it
    accepted: int = 0  # of those, accepted by verification
    # an encoder-decoder model: the source the encoder reads (prompt_ids are then the
    # decoder's start: the start token and the target language's)
    source_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def pending(self) -> int:
        return self.output_ids[-1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)
