"""The offline Python API: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence as Seq

import torch

from .config import EngineConfig
from .engine.engine import Engine
from .engine.sampling import SamplingParams
from .engine.stats import RunCounters, summarize
from .errors import SpecMoEError
from .spec import history

DEMO_MODEL_DIR = Path(__file__).parent / "data" / "demo"


def default_model_dir() -> Path:
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        raise SpecMoEError("the bundled demo model is not installed in this build; pass --model DIR (a Hugging Face MoE checkpoint)")
    return DEMO_MODEL_DIR


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
        self.engine = Engine(self.model_dir, self.options)
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
        engine.run_until_done(on_step=progress)
        opts = self.options
        self.last_stats = summarize(
            policy=opts.policy, batch_size=min(opts.max_batch_size, len(seqs)),
            gamma=engine.policy.gamma if engine.policy.speculative else None,
            draft_experts=getattr(engine.policy, "draft_experts", None),
            seqs=seqs, counters=engine.counters, wall_s=time.perf_counter() - start,
            policy_stats=engine.policy.run_stats(), device_peak_bytes=engine.budget.peak,
        )
        self._remember_acceptance()
        self._remember_speed()
        return [RequestOutput(s.prompt_ids, s.output_ids, s.text, s.finish_reason) for s in seqs]

    def _remember_acceptance(self) -> None:
        """Keep the draft's measured acceptance for `--policy auto`'s next plan (spec/history.py)."""
        policy, counters = self.engine.policy, self.engine.counters
        acceptance = self.last_stats.get("acceptance_per_token")
        if policy.speculative and acceptance is not None:
            key = history.draft_key(policy.draft_quant, policy.draft_experts)
            history.record(self.engine.checkpoint.fingerprint(), key, acceptance, counters.drafted)

    def _remember_speed(self) -> None:
        """Keep this offloading policy's measured tokens/s for `--policy auto` (perf/feedback.py)."""
        from .perf import feedback
        from .policies.auto import CANDIDATES

        stats, policy = self.last_stats, self.engine.policy
        if policy.name not in CANDIDATES + ("host",) or not stats["decode_tokens_per_s"] or stats["steps"] < 4:
            return  # not a policy auto chooses, or too short to say anything
        feedback.record(self.engine.checkpoint.fingerprint(), self.options.offload, policy.name,
                        stats["batch_size"], stats["decode_tokens_per_s"])

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
            logits = engine.forward_logits(slots, ids, rows="all")
        finally:
            for slot in slots:
                engine.cache.free(slot)
        return list(torch.split(logits, [len(i) for i in ids]))

    def close(self) -> None:
        self.engine.close()
