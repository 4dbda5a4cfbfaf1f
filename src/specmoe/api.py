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
from .base.paths import default_model_dir
from .engine.engine import Engine
from .engine.sampling import SamplingParams
from .engine.stats import RunCounters, summarize


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


class LLM:
    """An MoE model with an expert-placement policy, for batch generation.

    `model=None` uses the bundled demo model. Engine options (policy, offload,
    device_memory, gamma, draft_experts, ...) are those of `EngineConfig`.
    """

    def __init__(self, model: str | Path | None = None, **options):
        self.model_dir = Path(model) if model is not None else default_model_dir()
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
        progress=None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids); outputs in prompt order."""
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
        start = time.perf_counter()
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        for seq in seqs:
            seq.arrival_s = start
        try:
            engine.run_until_done(on_step=progress)
        except BaseException:
            engine.abandon(seqs)  # a failed run (a read error, an interrupt) leaves the engine usable
            raise
        opts = self.options
        policy_stats = engine.policy.stats()
        if engine.auto_plan:
            policy_stats.update(auto_choice=engine.policy.name, auto_plan=engine.auto_plan)
        self.last_stats = summarize(
            policy=opts.policy, batch_size=min(opts.max_batch_size, len(seqs)), gamma=engine.gamma,
            draft_experts=getattr(engine.policy, "draft_experts", None),
            seqs=seqs, counters=engine.counters, wall_s=time.perf_counter() - start,
            policy_stats=policy_stats, device_peak_bytes=engine.budget.peak,
            device_memory=engine.budget.limit,
        )
        learn_from_run(engine, self.last_stats)
        return [RequestOutput(s.prompt_ids, s.output_ids, s.text, s.finish_reason) for s in seqs]

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        if self.tokenizer is None:
            raise SpecMoEError(f"{self.model_dir} has no tokenizer; chat needs one")
        return self.generate([self.tokenizer.apply_chat_template(messages)], sampling_params)[0]

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Logits [len_i, V] at every position of each prompt, in one batched forward."""
        engine = self.engine
        ids = [engine.encode(p) for p in prompts]
        slots = [engine.cache.allocate() for _ in ids]
        try:
            with engine.pass_scope("prefill") as experts:
                logits = engine.forward_logits(experts, slots, ids, rows="all")
        finally:
            for slot in slots:
                engine.cache.free(slot)
        return list(torch.split(logits, [len(i) for i in ids]))

    def close(self) -> None:
        self.engine.close()
