"""What a GGUF file's metadata and tensor names mean, in the terms of a Hugging Face
checkpoint: the `config.json` its architecture would have (read by the same family table,
families.py) and, for every tensor the engine loads, the llama.cpp tensor it comes from.

llama.cpp's converter (convert_hf_to_gguf.py) names tensors `blk.{i}.{part}` and changes
two layouts, undone here:
- its `llama` architecture (Mixtral: llama with experts) permutes q and k rows from the
  rotate-half RoPE layout to interleaved pairs; the other MoE architectures keep them;
- DeepSeek's kv_b projection is split into k_b [H, c, dn] (transposed) and v_b [H, dv, c]
  in newer files (older ones keep attn_kv_b).
Routed experts are stacked per block: ffn_{gate,up,down}_exps [E, rows, cols].
"""

from __future__ import annotations

from .errors import SpecMoEError
from .gguf_arch_families import glm4moe, llama4, phimoe
from .gguf_file import GGUFFile

# general.architecture -> the Hugging Face architecture specmoe runs it as
ARCHITECTURES = {"llama": "MixtralForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "olmoe": "OlmoeForCausalLM", "deepseek2": "DeepseekV3ForCausalLM", "gpt-oss": "GptOssForCausalLM",
                 "glm4moe": "Glm4MoeForCausalLM", "llama4": "Llama4ForCausalLM", "phimoe": "PhimoeForCausalLM"}
# whether top-k weights are renormalised where the file does not say (llama.cpp's own defaults)
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False, "deepseek2": False, "gpt-oss": True,
              "glm4moe": False, "llama4": False, "phimoe": True}

# Per layer: the Hugging Face name (a candidate of checkpoint.LAYER_TENSORS) <- the GGUF part.
LAYER_PARTS = {
    "input_layernorm.weight": "attn_norm.weight", "input_layernorm.bias": "attn_norm.bias",
    "post_attention_layernorm.bias": "ffn_norm.bias",
    "post_attention_layernorm.weight": ("ffn_norm.weight", "post_attention_norm.weight"),
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_PARTS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "model.norm.bias": "output_norm.bias", "lm_head.bias": "output.bias",
                "lm_head.weight": "output.weight"}
EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def tensor_map(f: GGUFFile, num_layers: int) -> dict[str, str]:
    """Hugging Face name -> GGUF name, for every non-expert tensor the file has. A
    DeepSeek kv_b split in two maps to its k_b part (the checkpoint joins them)."""
    out = {hf: g for hf, g in GLOBAL_PARTS.items() if g in f.tensors}
    for i in range(num_layers):
        for hf, parts in LAYER_PARTS.items():
            for part in (parts,) if isinstance(parts, str) else parts:
                if f"blk.{i}.{part}" in f.tensors:
                    out[f"model.layers.{i}.{hf}"] = f"blk.{i}.{part}"
                    break
        if f"blk.{i}.attn_kv_b.weight" not in f.tensors and f"blk.{i}.attn_k_b.weight" in f.tensors:
            out[f"model.layers.{i}.self_attn.kv_b_proj.weight"] = f"blk.{i}.attn_k_b.weight"
    return out


def _need(f: GGUFFile, key: str):
    value = f.arch_value(key)
    if value is None:
        raise SpecMoEError(f"{f.path}: GGUF metadata {f.architecture}.{key} is missing; the file is incomplete")
    return value


def _scalar(value):
    """Some keys are per layer in newer files (head counts): the first layer's."""
    return value[0] if isinstance(value, list) else value


def hf_config(f: GGUFFile) -> dict:
    """The config.json this file's model would have."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise SpecMoEError(f"{f.path}: GGUF architecture {arch!r} is not supported; specmoe runs "
                           f"{', '.join(sorted(ARCHITECTURES))} (Mixtral as llama with experts)")
    experts = int(f.arch_value("expert_count", 0) or 0)
    if experts <= 1:
        raise SpecMoEError(f"{f.path}: a dense {arch} model (no experts); specmoe runs Mixture-of-Experts models")
    layers = int(_need(f, "block_count"))
    heads = int(_scalar(_need(f, "attention.head_count")))
    cfg = {
        "num_hidden_layers": layers, "hidden_size": int(_need(f, "embedding_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(f.arch_value("attention.head_count_kv", heads))),
        "num_experts_per_tok": int(_need(f, "expert_used_count")),
        "max_position_embeddings": int(f.arch_value("context_length", 4096)),
        "rms_norm_eps": float(f.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(f.arch_value("rope.freq_base", 10000.0)),
        "vocab_size": int(f.arch_value("vocab_size", 0) or f.info("token_embd.weight").shape[0]),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "norm_topk_prob": bool(f.arch_value("expert_weights_norm", _NORM_TOPK[arch])),
        "torch_dtype": "float32" if f.info("token_embd.weight").type_name == "F32" else "bfloat16",
        "bos_token_id": f.value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f.value("tokenizer.ggml.eos_token_id"),
    }
    key_length = f.arch_value("attention.key_length")
    if key_length is not None and arch != "deepseek2":
        cfg["head_dim"] = int(key_length)
    expert_ff = int(f.arch_value("expert_feed_forward_length", 0) or f.arch_value("feed_forward_length", 0))
    dense_ff = int(_scalar(f.arch_value("feed_forward_length", 0)) or 0)
    cfg.update(_FAMILY_KEYS[arch](f, cfg, experts, expert_ff, dense_ff))
    cfg["architectures"] = [cfg.pop("architecture", ARCHITECTURES[arch])]
    return cfg


def _dense_layers(f: GGUFFile, layers: int) -> list[int]:
    return [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors]


def _mixtral(f, cfg, experts, expert_ff, dense_ff) -> dict:
    return {"num_local_experts": experts, "intermediate_size": expert_ff}


def _qwen(f, cfg, experts, expert_ff, dense_ff) -> dict:
    out = {"num_experts": experts, "moe_intermediate_size": expert_ff, "intermediate_size": dense_ff,
           "decoder_sparse_step": 1, "mlp_only_layers": _dense_layers(f, cfg["num_hidden_layers"])}
    shared = f.arch_value("expert_shared_feed_forward_length")
    if shared:
        out["shared_expert_intermediate_size"] = int(shared)
    return out


def _olmoe(f, cfg, experts, expert_ff, dense_ff) -> dict:
    return {"num_experts": experts, "intermediate_size": expert_ff}


def _deepseek(f, cfg, experts, expert_ff, dense_ff) -> dict:
    """MLA and the grouped router. Newer files describe attention in its MQA form
    (key_length = latent + rope) and keep the per-head sizes under *_mla."""
    rope_dim = int(_need(f, "rope.dimension_count"))
    qk = int(f.arch_value("attention.key_length_mla") or _need(f, "attention.key_length"))
    v = int(f.arch_value("attention.value_length_mla") or _need(f, "attention.value_length"))
    groups = int(f.arch_value("expert_group_count", 1) or 1)
    sigmoid = int(f.arch_value("expert_gating_func", 1) or 1) == 2
    out = {"n_routed_experts": experts, "moe_intermediate_size": expert_ff, "intermediate_size": dense_ff,
           "first_k_dense_replace": int(f.arch_value("leading_dense_block_count", 0) or 0),
           "n_shared_experts": int(f.arch_value("expert_shared_count", 0) or 0),
           "routed_scaling_factor": float(f.arch_value("expert_weights_scale", 1.0) or 1.0),
           "n_group": groups, "topk_group": int(f.arch_value("expert_group_used_count", groups) or groups),
           "q_lora_rank": int(f.arch_value("attention.q_lora_rank", 0) or 0) or None,
           "kv_lora_rank": int(_need(f, "attention.kv_lora_rank")),
           "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": qk - rope_dim, "v_head_dim": v,
           "num_key_value_heads": cfg["num_attention_heads"], "rope_interleave": True}
    if sigmoid:
        out["architecture"] = "DeepseekV3ForCausalLM"
    else:  # DeepSeek-V2: softmax routing, limited to groups where there are several
        out["architecture"] = "DeepseekV2ForCausalLM"
        out["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    scaling = _rope_scaling(f)
    if scaling:
        log_mul = f.arch_value("rope.scaling.yarn_log_multiplier")
        if log_mul:  # llama.cpp keeps 0.1 * mscale_all_dim (and assumes mscale equals it)
            scaling["mscale_all_dim"] = scaling["mscale"] = float(log_mul) / 0.1
        out["rope_scaling"] = scaling
    return out


def _gpt_oss(f, cfg, experts, expert_ff, dense_ff) -> dict:
    window = int(_need(f, "attention.sliding_window"))
    limit = f.arch_value("swiglu_clamp_exp")
    out = {"num_local_experts": experts, "intermediate_size": expert_ff, "sliding_window": window,
           "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                           for i in range(cfg["num_hidden_layers"])]}
    if limit:
        out["swiglu_limit"] = float(_scalar(limit))
    scaling = _rope_scaling(f)
    if scaling:
        out["rope_scaling"] = {**scaling, "truncate": False}
    return out


def _rope_scaling(f: GGUFFile) -> dict | None:
    kind = f.arch_value("rope.scaling.type")
    if not kind or kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise SpecMoEError(f"{f.path}: RoPE scaling {kind!r} in a GGUF file is not supported (linear, yarn)")
    out = {"rope_type": "default" if kind == "linear" else kind, "factor": float(_need(f, "rope.scaling.factor"))}
    if kind == "linear":
        out["rope_type"] = "linear"
    original = f.arch_value("rope.scaling.original_context_length")
    if original:
        out["original_max_position_embeddings"] = int(original)
    if kind == "yarn":
        out["beta_fast"] = float(f.arch_value("rope.scaling.yarn_beta_fast", 32.0))
        out["beta_slow"] = float(f.arch_value("rope.scaling.yarn_beta_slow", 1.0))
    return out


_FAMILY_KEYS = {"llama": _mixtral, "qwen2moe": _qwen, "qwen3moe": _qwen, "olmoe": _olmoe, "deepseek2": _deepseek,
                "gpt-oss": _gpt_oss, "glm4moe": glm4moe, "llama4": llama4, "phimoe": phimoe}
