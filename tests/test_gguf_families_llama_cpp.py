"""llama.cpp's own logits on the converter's Phi-3.5-MoE GGUF file (where llama-cpp-python
is installed; run as test_gguf_llama_cpp.py runs llama.cpp, which also covers GLM-4.5 and
Llama 4 files). llama.cpp's phimoe graph is not the model (RMSNorm plus bias
where Phi has LayerNorm, softmax top-2 renormalised where it has sparsemixer, and LongRoPE's
long factors for the whole context once the context, padded to 256, exceeds the original
one); the file is still laid out as llama.cpp reads it: transformers' model holding the
file's values, with exactly those three changes, gives llama.cpp's logits within 1e-4.
specmoe computes the model itself (transformers' Phi-3.5-MoE), far from llama.cpp's.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytest.importorskip("llama_cpp")

from gguf_factories import reference_logprobs, reference_model  # noqa: E402
from test_gguf_llama_cpp import (  # noqa: E402
    F32_ATOL, _compare, _prompts, _specmoe_logprobs, gguf_file, llama_cpp_logprobs,
)


def _as_llama_cpp_computes_phimoe(model):
    """transformers' Phi-3.5-MoE changed where llama.cpp's phimoe graph differs."""
    def rms_norm_plus_bias(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias

    def softmax_top_k(self, h):
        logits = torch.nn.functional.linear(h, self.weight)
        weights, experts = logits.softmax(-1).topk(self.top_k, dim=-1)
        return logits, weights / weights.sum(-1, keepdim=True), experts

    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.forward = types.MethodType(rms_norm_plus_bias, m)
        elif type(m).__name__ == "PhimoeTopKRouter":
            m.forward = types.MethodType(softmax_top_k, m)
    rope = model.config.rope_parameters
    rope["short_factor"], rope["short_mscale"] = rope["long_factor"], rope["long_mscale"]
    return model


def test_llama_cpp_reads_a_phimoe_file_as_laid_out_and_computes_its_own_approximation(tmp_path):
    hf, path = gguf_file(tmp_path, "phimoe", "F32")
    prompts = _prompts()
    theirs = llama_cpp_logprobs(path, prompts, tmp_path)
    ref = reference_model("phimoe", str(hf), str(path))
    try:
        as_llama_cpp = _as_llama_cpp_computes_phimoe(ref)
        diffs, agree, _ = _compare(theirs, [p.double() for p in reference_logprobs(as_llama_cpp, prompts)])
        assert diffs.max() <= F32_ATOL and agree == 1.0, f"per position {np.round(diffs, 3)}"
    finally:
        reference_model.cache_clear()  # the patched model must not serve other tests
    diffs, _, _ = _compare(theirs, _specmoe_logprobs(path, prompts))
    assert np.median(diffs) > 0.1  # specmoe computes Phi-3.5-MoE itself, not llama.cpp's approximation
