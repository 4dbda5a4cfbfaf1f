"""In the default encoding a GGUF model's whole forward pass is batch-invariant: a prompt's
log-probabilities are the same bits scored alone and among other prompts. The 8-bit
rounding of activations makes this necessary: a batch-dependent bit upstream of a rounding
moves a code by one step, not by one float ulp. At these tiny sizes torch's own attention
and router products happened to keep a row's bits too, so this does not single out the
kernels that made the real-size model invariant: test_blockdot.py checks those
(`blockdot.attend`, `blockdot.matmul_f32`), and the real-size bench compares every
policy's tokens."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from factories import random_prompts  # noqa: E402
from gguf_factories import make_gguf  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.kernels import blockdot  # noqa: E402

pytestmark = pytest.mark.skipif(not blockdot.available(), reason=f"block kernels unavailable: {blockdot.library().why}")


@pytest.mark.parametrize(("family", "type_name"), [("mixtral", "Q4_K"), ("qwen3_moe", "Q8_0")])
def test_a_prompts_logprobs_are_the_same_bits_alone_and_among_others(tmp_path, family, type_name):
    _, path = make_gguf(tmp_path, family, type_name, block=256 if type_name.endswith("_K") else 32)
    prompts = random_prompts(5, min_len=4, max_len=24, seed=9)
    llm = LLM(model=str(path), device="cpu", max_batch_size=8, max_model_len=64)
    together = llm.score(prompts)
    for i in (0, 3):
        alone = llm.score([prompts[i]])[0]
        assert torch.equal(torch.as_tensor(alone), torch.as_tensor(together[i])), f"prompt {i}"
    llm.close()


@pytest.fixture(scope="module")
def q4k_reference(tmp_path_factory):
    """A Q4_K file, 64 prompts, and resident's tokens for them at B = 64."""
    _, path = make_gguf(tmp_path_factory.mktemp("q4k"), "mixtral", "Q4_K", block=256)
    prompts = random_prompts(64, min_len=3, max_len=66, seed=11)
    llm = LLM(model=str(path), device="cpu", max_batch_size=64, max_model_len=96)
    llm.generate(prompts, SHORT)
    sha = llm.last_stats["token_ids_sha256"]
    llm.close()
    return path, prompts, sha


SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize(("policy", "extra"), [
    ("ondemand", {}), ("caching", {}),
    ("specmoe", {}),  # the default: the paper's draft under a budget, gamma adapted step by step
    ("specmoe", {"draft_quant": "int4", "gamma": 3, "device_memory": "6MiB"}),  # copies of every expert, 3 a step
], ids=["ondemand", "caching", "specmoe", "specmoe-int4-gamma3"])
def test_every_policy_gives_residents_tokens_at_batch_1_16_and_64(q4k_reference, tmp_path, batch, policy, extra):
    """The default encoding's promise for speculation: B sequences decoded together, or B x
    (gamma + 1) rows verified together, give the tokens resident gives them 64 at a time."""
    path, prompts, sha = q4k_reference
    llm = LLM(model=str(path), device="cpu", max_batch_size=batch, max_model_len=96, policy=policy,
              offload="disk", offload_dir=str(tmp_path), **{"device_memory": "50%", **extra})
    llm.generate(prompts, SHORT)
    assert llm.last_stats["token_ids_sha256"] == sha
    llm.close()
