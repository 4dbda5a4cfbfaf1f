"""The offline Python API: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence as Seq

import torch

from .autotune.choose import choose
from .autotune.learn import learn_from_run
from .base.config import EngineConfig
from .base.errors import SpecMoEError
from .base.paths import resolve_model_dir
from .engine.engine import Engine
from .engine.logprobs import TokenLogprobs
from .engine.sampling import SamplingParams
from .engine.stats import RunCounters, summarize


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    # with SamplingParams(logprobs=k): one per generated token
    logprobs: list[TokenLogprobs] | None = None
    # with SamplingParams(prompt_logprobs=k): one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    def summary(self) -> dict:
        """What `specmoe generate --json` and `--output` write for one prompt."""
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason}

    @classmethod
    def of(cls, seq) -> RequestOutput:
        logprobs = seq.logprobs if seq.params.logprobs is not None else None
        return cls(seq.prompt_ids, seq.output_ids, seq.text, seq.finish_reason, logprobs, seq.prompt_logprobs)


class LLM:
    """An MoE model with an expert-placement policy, for batch generation.

    `model=None` uses the bundled demo model; "specmoe-demo-translate" the bundled
    translation model (an NLLB-MoE: `generate(..., src_lang=, tgt_lang=)`). Engine options (policy, offload,
    device_memory, gamma, draft_experts, ...) are those of `EngineConfig`.
    """

    def __init__(self, model: str | Path | None = None, **options):
        self.model_dir = resolve_model_dir(model)
        self.options = EngineConfig.from_kwargs(**options)
        self.engine = Engine(self.model_dir, self.options, choose=choose)
        self.last_stats: dict | None = None

    @property
    def config(self):
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        progress=None, src_lang: str | None = None, tgt_lang: str | int | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids); outputs in prompt order.

        An encoder-decoder model (NLLB-MoE) translates each prompt from `src_lang` into
        `tgt_lang` (NLLB codes such as eng_Latn, fra_Latn; defaults from its tokenizer)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise SpecMoEError("no prompts given")
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise SpecMoEError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        engine.counters = RunCounters()
        engine.policy.reset_stats()
        engine.budget.reset_peak()
        tuner = engine.decoder.tuner if engine.decoder else None
        plain_before = tuner.plain_steps if tuner is not None else 0  # the tuner lives as long as the engine
        start = time.perf_counter()
        seqs = [engine.add_request(p, sp, src_lang, tgt_lang) for p, sp in zip(prompts, params_list)]
        for seq in seqs:
            seq.arrival_s = start
        try:
            engine.run_until_done(on_step=progress)
        except BaseException:
            engine.abandon(seqs)  # a failed run (a read error, an interrupt) leaves the engine usable
            raise
        opts = self.options
        policy_stats = engine.policy.stats()
        if engine.policy.speculative:  # the dtype of the draft's attention projections and LM head
            policy_stats["draft_dense"] = str(engine.draft_dense or engine.dtype).removeprefix("torch.")
        if engine.auto_plan:
            policy_stats.update(auto_choice=engine.policy.name, auto_plan=engine.auto_plan)
        if tuner is not None:  # steps of this call the tuned gamma spent at 0, plain decoding
            policy_stats["plain_decoding_steps"] = tuner.plain_steps - plain_before
        self.last_stats = summarize(
            policy=opts.policy, batch_size=min(opts.max_batch_size, len(seqs)), gamma=engine.gamma,
            draft_experts=getattr(engine.policy, "draft_experts", None),
            seqs=seqs, counters=engine.counters, wall_s=time.perf_counter() - start,
            policy_stats=policy_stats, device_peak_bytes=engine.budget.peak,
            device_memory=engine.budget.limit,
        )
        self.last_stats["host_fixed_bytes"] = engine.host_fixed_bytes
        if engine.memory_plan is not None:  # --memory-limit: how the limit was split, the measured fixed cost first
            self.last_stats["memory_limit_plan"] = engine.memory_plan.as_dict()
        learn_from_run(engine, self.last_stats)
        return [RequestOutput.of(s) for s in seqs]

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        if self.tokenizer is None:
            raise SpecMoEError(f"{self.model_dir} has no tokenizer; chat needs one")
        return self.generate([self.tokenizer.apply_chat_template(messages)], sampling_params)[0]

    def score(self, prompts) -> list[torch.Tensor]:
        """Log-probabilities [len_i, V] over the whole vocabulary at every position of each
        prompt (row j predicts the token after position j), from the engine's batched
        prefill like any request. For large vocabularies ask `generate` for what you need
        (`prompt_logprobs=k`, `max_tokens=0`) instead."""
        params = SamplingParams(max_tokens=1, prompt_logprobs=-1, logprobs=-1, ignore_eos=True)
        return [_dense(out.prompt_logprobs[1:] + out.logprobs[:1], self.config.vocab_size)
                for out in self.generate(prompts, params)]

    def close(self) -> None:
        self.engine.close()


def _dense(positions: list[TokenLogprobs], vocab_size: int) -> torch.Tensor:
    """[len, V] from positions that each list the whole vocabulary."""
    out = torch.empty(len(positions), vocab_size)
    for row, position in zip(out, positions):
        ids, values = zip(*position.top)
        row[list(ids)] = torch.tensor(values)
    return out
