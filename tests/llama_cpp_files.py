"""The small GGUF files llama.cpp is compared on (tests/test_gguf_llama_cpp.py runs llama.cpp
on them; tests/llama_cpp_fixtures.py keeps its log-probabilities for CI): tiny random
checkpoints of each family with a tokenizer llama.cpp loads, converted by
specmoe.tools.gguf_convert, and the prompts. Needs no llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path

# llama.cpp's gpt-oss graph clamps the SwiGLU at 7.0 whatever the file says (the released
# models' limit), and its YaRN rounds the correction range to whole dimensions (transformers'
# truncate=True; GPT-OSS has truncate=False, which the reader keeps): the model for it has both.
GPT_OSS = {"swiglu_limit": 7.0, "rope_parameters": {"rope_type": "default", "rope_theta": 30000.0}}
# llama.cpp's OLMoE has no GQA (its k norm spans n_embd); its DeepSeek-V2 without a q LoRA is
# only the 27-layer Lite, and it scores expert groups by their top two (DeepSeek-V3's rule)
# where V2's group_limited_greedy takes their best one: V2 here has a q LoRA and one group.
DEEPSEEK_V2 = {"q_lora_rank": 32, "n_group": 1, "topk_group": 1, "topk_method": "greedy"}
OVERRIDES = {"gpt_oss": GPT_OSS, "olmoe": {"num_key_value_heads": 4}, "deepseek_v2": DEEPSEEK_V2}


def _tokenizer(hf_dir: Path) -> None:
    """A byte-level BPE tokenizer.json with exactly the tiny vocabulary (128 tokens and one
    merge), which the converter writes as the file's tokenizer.ggml.* vocabulary: llama.cpp
    loads no model without one."""
    from specmoe.base.paths import default_model_dir

    spec = json.loads((default_model_dir() / "tokenizer.json").read_text())
    vocab = {t: i for t, i in spec["model"]["vocab"].items() if i < 126}
    vocab.update({"\u0120": 126, "\u0120a": 127})
    spec["model"].update(vocab=vocab, merges=["\u0120 a"])
    (hf_dir / "tokenizer.json").write_text(json.dumps(spec))


def gguf_file(tmp: Path, family: str, type_name: str, **convert_kw) -> tuple[Path, Path]:
    from factories import INIT_STD, make_checkpoint
    from gguf_factories import sizes

    from specmoe.tools.gguf_convert import convert

    block = 256 if type_name.endswith("_K") else 32
    shape = {**sizes(family, block), **OVERRIDES.get(family, {})}
    std = INIT_STD * (64 / shape["hidden_size"]) ** 0.5  # 256 wide: activations of the 64-wide models' size
    hf = make_checkpoint(family, tmp / f"{family}-hf-{block}", std=std, **shape)
    _tokenizer(hf)
    return hf, convert(hf, tmp / f"{family}-{type_name}.gguf", type_name, **convert_kw)


def prompts() -> list[list[int]]:
    from factories import random_prompts

    return random_prompts(6, min_len=3, max_len=20, seed=3)


