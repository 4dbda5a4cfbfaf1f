"""GLM-4.5 (`glm4moe`), Llama 4 (`llama4`) and Phi-3.5-MoE (`phimoe`) GGUF files as the
config.json of their Hugging Face architecture (gguf_arch.py registers them).

What llama.cpp does not write as metadata, it fixes in code (llama-model.cpp), and so is
read here the same way:
- llama4: chunked attention of 8192 in every layer but each 4th, which is NoPE (no RoPE,
  full attention, q scaled by position: floor 8192, scale 0.1); q/k L2 norm unless the
  model has 128 experts (Maverick); a MoE block every `interleave_moe_layer_step` layers;
  Llama 3's RoPE scaling as per-frequency divisors (the `rope_freqs` tensor);
- glm4moe: sigmoid routing (no expert groups), the last `nextn_predict_layers` blocks
  are the multi-token-prediction head, not part of the model;
- phimoe: LongRoPE's short and long factors as tensors (rope_factors_short / _long), one
  cos/sin scale (rope.scaling.attn_factor); the router's sparsemixer threshold is not in
  the file: Phi-3.5-MoE's 0.01 (router_jitter_noise). llama.cpp itself computes phimoe with
  RMSNorm and a softmax top-k router; specmoe computes the model the file holds as
  transformers does (LayerNorm with bias, sparsemixer).
"""

from __future__ import annotations

from .errors import SpecMoEError
from .gguf_file import GGUFFile

LLAMA4_CHUNK, LLAMA4_NOPE_STEP, LLAMA4_TEMPERATURE = 8192, 4, (8192, 0.1)
PHIMOE_ROUTER_EPS = 0.01  # Phi-3.5-MoE's router_jitter_noise


def _key(f: GGUFFile, key: str):
    value = f.arch_value(key)
    if value is None:
        raise SpecMoEError(f"{f.path}: GGUF metadata {f.architecture}.{key} is missing; the file is incomplete")
    return value


def _factors(f: GGUFFile, name: str) -> list[float] | None:
    return f.dequantized(name).reshape(-1).tolist() if name in f.tensors else None


def _has(f: GGUFFile, layer: int, part: str) -> bool:
    return f"blk.{layer}.{part}" in f.tensors


def glm4moe(f, cfg, experts, expert_ff, dense_ff) -> dict:
    gating = int(f.arch_value("expert_gating_func", 2) or 2)
    if gating != 2:
        raise SpecMoEError(f"{f.path}: a glm4moe file with expert_gating_func {gating}; GLM-4.5 routes by sigmoid (2)")
    layers = cfg["num_hidden_layers"] - int(f.arch_value("nextn_predict_layers", 0) or 0)
    groups = int(f.arch_value("expert_group_count", 1) or 1)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope_dim = int(f.arch_value("rope.dimension_count", head_dim // 2))
    dense = int(f.arch_value("leading_dense_block_count", 0) or 0)
    return {"num_hidden_layers": layers, "n_routed_experts": experts, "moe_intermediate_size": expert_ff,
            "intermediate_size": dense_ff, "first_k_dense_replace": dense,
            "n_shared_experts": int(f.arch_value("expert_shared_count", 0) or 0),
            "routed_scaling_factor": float(f.arch_value("expert_weights_scale", 1.0) or 1.0),
            "n_group": groups, "topk_group": int(f.arch_value("expert_group_used_count", groups) or groups),
            "use_qk_norm": _has(f, 0, "attn_q_norm.weight"), "attention_bias": _has(f, 0, "attn_q.bias"),
            "partial_rotary_factor": rope_dim / head_dim}


def llama4(f, cfg, experts, expert_ff, dense_ff) -> dict:
    layers = cfg["num_hidden_layers"]
    window = f.arch_value("attention.sliding_window")
    chunked = window is None or int(window) != 0  # 0: no chunks, RoPE everywhere (llama.cpp's MobileLLM case)
    out = {"architecture": "Llama4ForCausalLM", "num_local_experts": experts, "intermediate_size": expert_ff,
           "intermediate_size_mlp": dense_ff, "interleave_moe_layer_step": int(_key(f, "interleave_moe_layer_step")),
           "attention_chunk_size": LLAMA4_CHUNK if chunked else None,
           "no_rope_layers": [int(not chunked or (i + 1) % LLAMA4_NOPE_STEP != 0) for i in range(layers)],
           "attn_temperature_tuning": chunked, "floor_scale": LLAMA4_TEMPERATURE[0],
           "attn_scale": LLAMA4_TEMPERATURE[1], "use_qk_norm": experts != 128}
    freqs = _factors(f, "rope_freqs.weight")
    if freqs:  # llama3 scaling as llama.cpp keeps it: each frequency divided by its factor
        out["rope_parameters"] = {"rope_type": "longrope", "rope_theta": cfg["rope_theta"], "short_factor": freqs,
                                  "long_factor": freqs, "short_mscale": 1.0, "long_mscale": 1.0,
                                  "original_max_position_embeddings": cfg["max_position_embeddings"]}
    return out


def phimoe(f, cfg, experts, expert_ff, dense_ff) -> dict:
    window = int(f.arch_value("attention.sliding_window", 0) or 0)
    out = {"num_local_experts": experts, "intermediate_size": expert_ff, "sliding_window": window or None,
           "router_jitter_noise": PHIMOE_ROUTER_EPS, "attention_bias": _has(f, 0, "attn_q.bias"),
           "lm_head_bias": "output.bias" in f.tensors}
    short, long = _factors(f, "rope_factors_short.weight"), _factors(f, "rope_factors_long.weight")
    if short and long:
        scale = float(f.arch_value("rope.scaling.attn_factor", 1.0) or 1.0)
        original = int(f.arch_value("rope.scaling.original_context_length", cfg["max_position_embeddings"]))
        out["rope_parameters"] = {"rope_type": "longrope", "rope_theta": cfg["rope_theta"], "short_factor": short,
                                  "long_factor": long, "short_mscale": scale, "long_mscale": scale,
                                  "original_max_position_embeddings": original}
    eps = f.arch_value("attention.layer_norm_epsilon")
    if eps is not None:
        out["rms_norm_eps"] = float(eps)
    return out
