"""GLM-4.5, Llama 4 and Phi-3.5-MoE as GGUF: what llama.cpp fixes in code rather than in
the file. A checkpoint such a file cannot describe is refused by the converter (writing it
would give a different model); GLM-4.5's multi-token-prediction blocks (the last
nextn_predict_layers) are not part of the model read."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from factories import build_model, make_checkpoint, random_prompts  # noqa: E402
from gguf_factories import reference_logprobs, sizes  # noqa: E402

from specmoe import LLM  # noqa: E402
from specmoe.base.errors import SpecMoEError  # noqa: E402
from specmoe.tools import gguf_convert_families  # noqa: E402
from specmoe.tools.gguf_convert import convert  # noqa: E402


def _sizes_without_llama_cpp_fixes(family: str, **changes) -> dict:
    """sizes() with the factory's own values where llama.cpp fixes them (factories.py)."""
    out = sizes(family, 32)
    for key in ("attention_chunk_size", "no_rope_layer_interval", "floor_scale", "attn_scale", "n_group", "topk_group"):
        out.pop(key, None)
    return {**out, **changes}


def test_a_llama4_checkpoint_whose_chunks_and_nope_layers_llama_cpp_cannot_say_is_refused(tmp_path):
    hf = make_checkpoint("llama4", tmp_path / "hf", **_sizes_without_llama_cpp_fixes("llama4"))  # chunk 8, NoPE 2nd
    with pytest.raises(SpecMoEError, match=r"llama4 GGUF: llama\.cpp fixes the NoPE layers"):
        convert(hf, tmp_path / "l4.gguf", "Q8_0")
    hf = make_checkpoint("llama4", tmp_path / "hf2", **{**sizes("llama4", 32), "attention_chunk_size": 16})
    with pytest.raises(SpecMoEError, match="fixes the chunked attention"):
        convert(hf, tmp_path / "l4b.gguf", "Q8_0")


def test_a_glm4_moe_checkpoint_with_expert_groups_is_refused(tmp_path):
    hf = make_checkpoint("glm4_moe", tmp_path / "hf", **_sizes_without_llama_cpp_fixes("glm4_moe"))  # 3 groups
    with pytest.raises(SpecMoEError, match="glm4moe GGUF has no expert groups"):
        convert(hf, tmp_path / "g.gguf", "Q8_0")


def test_glm4_moe_nextn_blocks_are_not_part_of_the_model(tmp_path, monkeypatch):
    """A file of 4 blocks whose last is the MTP head (nextn_predict_layers = 1) is the
    3-layer model: its logits are transformers' of the first 3 layers."""
    import transformers

    hf = make_checkpoint("glm4_moe", tmp_path / "hf", **{**sizes("glm4_moe", 32), "num_hidden_layers": 4})
    metadata = gguf_convert_families.metadata

    def with_nextn(writer, c, arch):
        metadata(writer, c, arch)
        writer.add_nextn_predict_layers(1)

    monkeypatch.setattr(gguf_convert_families, "metadata", with_nextn)
    path = convert(hf, tmp_path / "g.gguf", "F32")
    full = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    ref = build_model("glm4_moe", **{**sizes("glm4_moe", 32), "num_hidden_layers": 3})
    ref.load_state_dict({k: v for k, v in full.state_dict().items() if ".layers.3." not in k})
    llm = LLM(model=str(path), device="cpu", dtype="float32")
    assert llm.engine.config.num_layers == 3
    prompts = random_prompts(2, min_len=3, max_len=12, seed=7)
    for got, want in zip(llm.score(prompts), reference_logprobs(ref.eval(), prompts)):
        assert (torch.as_tensor(got) - want).abs().max() <= 1e-4
