"""Tiny GGUF models and their references.

A tiny random checkpoint written by transformers (factories.py), at sizes whose rows are
whole blocks of the GGUF type, converted with specmoe.tools.gguf_convert. The reference
is built without specmoe's reader: the gguf package reads the file and dequantizes every
tensor (llama.cpp's numpy code), llama.cpp's own name map (gguf.get_tensor_name_map) says
which Hugging Face parameter each tensor is, transformers' GGUF loader undoes the `llama`
architecture's q/k permutation, and the values are put into transformers' model of the
family, whose forward pass gives the logits and greedy tokens specmoe must reproduce.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path

import numpy as np
import torch

from factories import build_model, make_checkpoint

GGUF_ARCH = {"mixtral": "LLAMA", "qwen2_moe": "QWEN2MOE", "qwen3_moe": "QWEN3MOE", "olmoe": "OLMOE",
             "deepseek_v2": "DEEPSEEK2", "deepseek_v3": "DEEPSEEK2", "gpt_oss": "GPT_OSS", "glm4_moe": "GLM4_MOE",
             "llama4": "LLAMA4", "phimoe": "PHIMOE"}


def sizes(family: str, block: int) -> dict:
    """Config overrides that make every expert and most other rows whole blocks of `block` values."""
    d = 64 if block <= 64 else block
    inter = 32 if block <= 64 else block
    out = {"hidden_size": d}
    if family in ("mixtral", "olmoe", "gpt_oss", "phimoe"):
        out["intermediate_size"] = inter
    elif family == "llama4":
        out.update(intermediate_size=inter, intermediate_size_mlp=d)
    else:
        out.update(moe_intermediate_size=inter, intermediate_size=d)
    if family in ("qwen2_moe", "qwen3_moe"):
        out["mlp_only_layers"] = []  # llama.cpp's qwen MoE architectures are MoE in every layer
    if family == "qwen2_moe":
        out["shared_expert_intermediate_size"] = inter
    if family == "deepseek_v3":  # GGUF keeps one YaRN mscale (llama.cpp assumes mscale = mscale_all_dim)
        out["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 20000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 0.707,
                                  "beta_fast": 32.0, "beta_slow": 1.0}
    out.update(_LLAMA_CPP_FIXES.get(family, {}))
    if family == "phimoe":  # one factor per rotated pair; llama.cpp's cos/sin scale from the context lengths
        half, scale = d // 4 // 2, math.sqrt(1 + math.log(256 / 128) / math.log(128))
        out["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 30000.0,
                                  "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                  "long_factor": [1.0 + 0.5 * i for i in range(half)],
                                  "original_max_position_embeddings": 128, "short_mscale": scale, "long_mscale": scale}
    return out


# What llama.cpp fixes in code for these architectures (the file cannot say otherwise):
# GLM-4.5 routes over all experts; Llama 4 chunks attention by 8192 with every 4th layer
# NoPE and its temperature (8192, 0.1); Phi-3.5-MoE's sparsemixer threshold is its 0.01.
_LLAMA_CPP_FIXES = {
    "glm4_moe": dict(n_group=1, topk_group=1),
    "llama4": dict(attention_chunk_size=8192, no_rope_layer_interval=4, floor_scale=8192, attn_scale=0.1),
    "phimoe": dict(router_jitter_noise=0.01, lm_head_bias=True),  # llama.cpp requires output.bias (as released)
}


def make_gguf(out_dir, family: str, type_name: str, block: int = 32, **kw) -> tuple[Path, Path]:
    """(the Hugging Face directory, its GGUF file in `type_name`)."""
    from specmoe.tools.gguf_convert import convert

    out = Path(out_dir)
    hf = make_checkpoint(family, out / f"{family}-hf-{block}", **sizes(family, block))
    return hf, convert(hf, out / f"{family}-{type_name}.gguf", type_name, **kw)


def _dequantized(path: Path) -> dict[str, torch.Tensor]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        out[t.name] = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(tuple(reversed(t.shape.tolist())))
    return out


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    return torch.from_numpy(LlamaTensorProcessor()._reverse_permute_weights(w.numpy(), heads, heads))


def _reference_value(family: str, name: str, param: torch.Tensor, g: dict, name_map, config) -> torch.Tensor:
    layer = re.search(r"layers\.(\d+)\.", name)
    blk = f"blk.{layer[1]}." if layer else ""
    if name.endswith("experts.gate_up_proj"):
        gate, up = g[blk + "ffn_gate_exps.weight"], g[blk + "ffn_up_exps.weight"]
        if family == "llama4":  # [E, D, 2I]: gate columns, then up
            return torch.cat([gate, up], dim=1).transpose(1, 2)
        if family == "gpt_oss":  # [E, D, 2I], gate and up columns alternating
            return torch.stack([gate, up], dim=2).reshape(gate.shape[0], -1, gate.shape[2]).transpose(1, 2)
        return torch.cat([gate, up], dim=1)
    if name.endswith("experts.gate_up_proj_bias"):
        gate, up = g[blk + "ffn_gate_exps.bias"], g[blk + "ffn_up_exps.bias"]
        return torch.stack([gate, up], dim=2).reshape(gate.shape[0], -1)
    if name.endswith("experts.down_proj"):
        down = g[blk + "ffn_down_exps.weight"]
        return down.transpose(1, 2) if family in ("gpt_oss", "llama4") else down
    if name.endswith("experts.down_proj_bias"):
        return g[blk + "ffn_down_exps.bias"]
    if name.endswith("e_score_correction_bias"):
        return g[blk + "exp_probs_b.bias"]
    if name.endswith("self_attn.sinks"):
        return g[blk + "attn_sinks.weight"]
    base, _, suffix = name.rpartition(".")
    gguf_name = f"{name_map.get_name(base)}.{suffix}"
    if gguf_name.endswith("attn_kv_b.weight") and gguf_name not in g:
        # newer llama.cpp splits kv_b [H (dn + dv), c] into k_b [H, c, dn] (transposed) and v_b [H, dv, c]
        k_b, v_b = g[blk + "attn_k_b.weight"], g[blk + "attn_v_b.weight"]
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(param.shape)
    value = g[gguf_name]
    if family == "mixtral" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
        heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
        value = _unpermute(value, heads)
    return value.reshape(param.shape)


@functools.lru_cache(maxsize=8)
def reference_model(family: str, hf_dir: str, gguf_file: str):
    """transformers' model of `family` holding the GGUF file's values, as the gguf package reads them."""
    import gguf

    model = build_model(family, **sizes(family, _block_of(hf_dir)))
    g = _dequantized(Path(gguf_file))
    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, GGUF_ARCH[family]), model.config.num_hidden_layers)
    state = model.state_dict()
    with torch.no_grad():
        for name, param in state.items():
            if "rotary_emb" in name:
                continue
            param.copy_(_reference_value(family, name, param, g, name_map, model.config))
    return model.eval()


def _block_of(hf_dir: str) -> int:
    return int(Path(hf_dir).name.rsplit("-", 1)[1])


@torch.no_grad()
def reference_logprobs(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    return [torch.log_softmax(model(input_ids=torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, each from a full forward pass (no KV cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]
