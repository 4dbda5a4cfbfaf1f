"""The allowances of the device-memory tests are below what those tests claim to catch,
checked on any machine (test_cuda.py itself runs only where torch sees a GPU): the CUDA
peak tests' one pass of activations is less than one float32 expert and less than the
int4 model's dequantization scratch, and no pass computes more tokens than the allowance
is computed for."""

from contextlib import contextmanager

import torch
from factories import (
    CUDA_PEAK,
    cuda_activation_allowance,
    pass_tokens,
    random_prompts,
    require_compressed_tensors,
    to_compressed_tensors,
)

from specmoe import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _llm(path, tmp_path, **kw):
    s = CUDA_PEAK
    return LLM(model=str(path), device="cpu", max_batch_size=s["batch"], max_model_len=s["max_model_len"],
               offload="host", offload_dir=str(tmp_path), **kw)


def _prompts():
    s = CUDA_PEAK
    return random_prompts(s["prompts"], 128, s["min_len"], s["max_len"], seed=7)


def _widest_pass(llm) -> list:
    """Records the tokens of every MoE block a pass runs (the rows its activations have)."""
    seen, engine = [], llm.engine
    original = engine.pass_scope

    class Counting:
        def __init__(self, experts):
            self.experts = experts

        def run_moe(self, layer, x, routing):
            seen.append(x.shape[0])
            return self.experts.run_moe(layer, x, routing)

        def __getattr__(self, name):
            return getattr(self.experts, name)

    @contextmanager
    def scope(kind):
        with original(kind) as experts:
            yield Counting(experts)

    engine.pass_scope = scope
    return seen


def test_one_pass_of_activations_is_less_than_one_float32_expert(tiny_ckpt, tmp_path):
    s = CUDA_PEAK
    prompts = _prompts()
    llm = _llm(tiny_ckpt("mixtral", intermediate_size=s["intermediate_size"]), tmp_path, policy="specmoe",
               gamma=s["gamma"])
    c = llm.config
    tokens = _widest_pass(llm)
    llm.generate(prompts, GREEDY)
    assert llm.last_stats["tokens_per_step"] > 1.0  # verify passes of gamma + 1 tokens a sequence ran
    assert max(tokens) <= pass_tokens(prompts, s["batch"], s["gamma"])
    expert = llm.engine.policy.runtime.expert_bytes
    assert expert == 3 * c.hidden_size * s["intermediate_size"] * 4  # float32 slots
    for grouped in (False, True):  # resident's grouped experts hold every pick's activations at once
        assert cuda_activation_allowance(c, pass_tokens(prompts, s["batch"], s["gamma"]), s["max_model_len"],
                                         grouped) < expert
    llm.close()


def test_one_pass_of_activations_is_less_than_the_int4_models_scratch(tiny_ckpt, tmp_path):
    require_compressed_tensors()  # a listed skip on Python 3.10 only
    s = CUDA_PEAK
    prompts = _prompts()
    path = to_compressed_tensors(tiny_ckpt("mixtral", intermediate_size=s["intermediate_size"]), tmp_path / "q",
                                 "w4a16", group_size=8)
    llm = _llm(path, tmp_path, policy="ondemand")
    c, runtime = llm.config, llm.engine.policy.runtime
    tokens = _widest_pass(llm)
    llm.generate(prompts, GREEDY)
    assert max(tokens) <= pass_tokens(prompts, s["batch"], 0)
    scratch = 2 * s["intermediate_size"] * c.hidden_size * 4  # gate/up dequantized to float32
    assert runtime.dtype == torch.float32 and runtime.expert_format.scratch_bytes(runtime.dtype) == scratch
    assert cuda_activation_allowance(c, pass_tokens(prompts, s["batch"], 0), s["max_model_len"]) < scratch
    llm.close()
