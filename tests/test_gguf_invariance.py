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

from specmoe import LLM  # noqa: E402
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
