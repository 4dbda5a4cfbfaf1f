"""--model FILE.gguf computes the model the file holds: log-probabilities within float
rounding of, and greedy tokens equal to, transformers' model holding the values the gguf
package dequantizes from the same file (gguf_factories.py), for each family and type;
Qwen3-MoE also against transformers loading the GGUF file itself."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from factories import random_prompts  # noqa: E402
from gguf_factories import make_gguf, reference_greedy, reference_logprobs, reference_model  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402

ATOL = 1e-4  # float32 rounding: both sides compute with the same dequantized values
TOKENS = 12
CASES = [
    *(pytest.param(f, t, 32, id=f"{f}-{t}") for f in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "glm4_moe",
                                                       "llama4", "phimoe") for t in ("Q8_0", "Q4_0")),
    pytest.param("gpt_oss", "MXFP4", 32, id="gpt_oss-MXFP4"),
    *(pytest.param(f, "Q4_K", 256, id=f"{f}-Q4_K") for f in ("mixtral", "qwen3_moe")),
    *(pytest.param(f, "Q5_1", 32, id=f"{f}-Q5_1") for f in ("qwen2_moe", "olmoe", "deepseek_v2")),
]


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    cache = {}

    def get(family, type_name, block):
        key = (family, type_name, block)
        if key not in cache:
            hf, path = make_gguf(tmp_path_factory.mktemp(f"{family}-{type_name}"), family, type_name, block)
            cache[key] = (path, reference_model(family, str(hf), str(path)))
        return cache[key]

    return get


def _prompts(seed: int) -> list[list[int]]:
    return random_prompts(3, min_len=3, max_len=20, seed=seed)


@pytest.mark.parametrize(("family", "type_name", "block"), CASES)
def test_log_probabilities_and_greedy_tokens_are_the_dequantized_files(gguf_model, family, type_name, block):
    path, ref = gguf_model(family, type_name, block)
    llm = LLM(model=str(path), device="cpu", dtype="float32")
    assert llm.engine.config.expert_quant.scheme.startswith(type_name)
    prompts = _prompts(seed=3)
    for i, (got, want) in enumerate(zip(llm.score(prompts), reference_logprobs(ref, prompts))):
        diff = (torch.as_tensor(got) - want).abs().max()
        assert diff <= ATOL, f"prompt {i}: max |log-prob diff| {diff:.2e}"
    outs = llm.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == reference_greedy(ref, prompt, TOKENS)


def test_qwen3_moe_matches_transformers_loading_the_gguf_file(gguf_model, tmp_path):
    import transformers

    path, _ = gguf_model("qwen3_moe", "Q8_0", 32)
    # transformers' GGUF config mapping for qwen3moe reads no expert size (its default is Qwen3-30B-A3B's 768)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                           moe_intermediate_size=32).eval()
    prompts = _prompts(seed=4)
    llm = LLM(model=str(path), device="cpu", dtype="float32")
    for got, want in zip(llm.score(prompts), reference_logprobs(hf, prompts)):
        assert (torch.as_tensor(got) - want).abs().max() <= ATOL


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3",
                                    "gpt_oss", "glm4_moe", "llama4", "phimoe"])
def test_an_f32_file_holds_the_checkpoints_own_weights(tmp_path, family):
    """The converter's layout is llama.cpp's: read back through the gguf package, llama.cpp's
    name map and transformers' own inverse of the q/k permutation, an F32 file gives every
    parameter of the checkpoint it was written from; and specmoe on it computes transformers'
    logits of that checkpoint."""
    from factories import build_model, hf_logits
    from gguf_factories import sizes

    hf, path = make_gguf(tmp_path, family, "F32")
    want = build_model(family, **sizes(family, 32)).state_dict()
    got = reference_model(family, str(hf), str(path)).state_dict()
    for name, value in want.items():
        if "rotary_emb" not in name:
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    prompts = _prompts(seed=5)
    for g, w in zip(LLM(model=str(path), device="cpu", dtype="float32").score(prompts), hf_logits(hf, prompts)):
        assert (torch.as_tensor(g) - torch.log_softmax(w, dim=-1)).abs().max() <= ATOL
