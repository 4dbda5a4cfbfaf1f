"""The supported architectures, as data: one `Family` row each, and the small readers that
turn a family's config.json keys into the pieces of a `ModelConfig` (specs.py).

A row names what differs: where the expert count and sizes are, how the router chooses,
which layers are MoE, the attention variant and its RoPE, the shared expert, the expert
activation and how fused expert tensors are laid out in the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import SpecMoEError
from .specs import AttentionSpec, AttentionWindow, ExpertSpec, RopeSpec, RouterSpec, Seq2SeqSpec


@dataclass(frozen=True)
class Family:
    """How one Hugging Face architecture differs from the common MoE transformer."""

    name: str
    experts_keys: tuple[str, ...]  # config keys that may hold the number of routed experts
    expert_intermediate_key: str  # config key with the routed experts' intermediate size
    router: str  # a router kind (specs.ROUTER_KINDS) or "deepseek_v2" (chosen by topk_method)
    moe_pattern: str  # all | sparse_step (Qwen) | first_k_dense (DeepSeek, GLM) | moe_layers (Llama 4)
    shared: str = "none"  # none | gated (Qwen2-MoE) | n_shared (DeepSeek, GLM) | expert_size (Llama 4)
    attention: str = "gqa"  # gqa | mla
    qk_norm: str = "none"  # none | head | full | l2 | use_qk_norm (per head when the config says so)
    rope_style: str = "half"  # half | interleaved | rope_interleave (the config key decides)
    windows: str = "none"  # none | sliding (every layer) | layer_types (GPT-OSS) | chunked (Llama 4)
    norm: str = "rms"  # rms | layer (LayerNorm with bias)
    activation: str = "silu"
    expert_bias: bool = False
    always_renormalize: bool = False  # Mixtral renormalises top-k weights whatever the config says
    sinks: bool = False
    dense_intermediate_key: str = "intermediate_size"
    fused_transposed: bool = False  # fused experts stored [E, D, 2I] and [E, I, D] (x @ W), not [E, 2I, D]
    gate_up_interleaved: bool = False  # fused gate/up rows alternate gate, up, gate, ... (GPT-OSS)
    default_theta: float = 10000.0
    default_partial_rotary: float = 1.0  # GLM-4.5 rotates half of each head unless the config says otherwise
    nested_config: str | None = None  # the text model's config sits under this key (multimodal checkpoints)
    positions: str = "rope"  # rope | sinusoidal (added to the embeddings, NLLB)
    norm_eps: float = 1e-6  # when config.json names none
    encoder_decoder: bool = False  # encoder layers first, then decoder layers with cross-attention


_QWEN = dict(experts_keys=("num_experts", "num_local_experts"), expert_intermediate_key="moe_intermediate_size",
             router="softmax_topk", moe_pattern="sparse_step")
_DEEPSEEK = dict(experts_keys=("n_routed_experts", "num_local_experts"), expert_intermediate_key="moe_intermediate_size",
                 moe_pattern="first_k_dense", shared="n_shared")
_LLAMA4 = dict(experts_keys=("num_local_experts",), expert_intermediate_key="intermediate_size", router="topk_sigmoid",
               moe_pattern="moe_layers", shared="expert_size", qk_norm="l2", rope_style="interleaved",
               windows="chunked", dense_intermediate_key="intermediate_size_mlp", fused_transposed=True,
               default_theta=500000.0)

FAMILIES: dict[str, Family] = {
    "MixtralForCausalLM": Family("mixtral", ("num_local_experts",), "intermediate_size", "softmax_topk", "all",
                                 windows="sliding", always_renormalize=True),
    "Qwen2MoeForCausalLM": Family("qwen2_moe", **_QWEN, shared="gated"),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", **_QWEN, qk_norm="head"),
    "OlmoeForCausalLM": Family("olmoe", ("num_experts", "num_local_experts"), "intermediate_size", "softmax_topk",
                               "all", qk_norm="full"),
    "DeepseekV2ForCausalLM": Family("deepseek_v2", **_DEEPSEEK, router="deepseek_v2", attention="mla",
                                    rope_style="interleaved"),
    "DeepseekV3ForCausalLM": Family("deepseek_v3", **_DEEPSEEK, router="sigmoid_group_topk", attention="mla",
                                    rope_style="rope_interleave"),
    "Glm4MoeForCausalLM": Family("glm4_moe", **_DEEPSEEK, router="sigmoid_group_topk", qk_norm="use_qk_norm",
                                 default_partial_rotary=0.5),
    "GptOssForCausalLM": Family("gpt_oss", ("num_local_experts", "num_experts"), "intermediate_size", "topk_softmax",
                                "all", windows="layer_types", activation="clamped_swiglu", expert_bias=True,
                                sinks=True, fused_transposed=True, gate_up_interleaved=True, default_theta=150000.0),
    "Llama4ForCausalLM": Family("llama4", **_LLAMA4),
    "Llama4ForConditionalGeneration": Family("llama4", **_LLAMA4, nested_config="text_config"),
    "PhimoeForCausalLM": Family("phimoe", ("num_local_experts",), "intermediate_size", "sparsemixer", "all",
                                norm="layer", windows="sliding", default_theta=1000000.0),
    "NllbMoeForConditionalGeneration": Family("nllb_moe", ("num_experts",), "encoder_ffn_dim", "top2_all",
                                              "encoder_decoder", norm="layer", activation="relu", expert_bias=True,
                                              dense_intermediate_key="encoder_ffn_dim", positions="sinusoidal",
                                              norm_eps=1e-5, encoder_decoder=True),
}


def need(cfg: dict, key: str, where: str, arch: str):
    if cfg.get(key) is None:
        raise SpecMoEError(f"{where}: missing required key {key!r} for {arch}")
    return cfg[key]


# --- which layers are MoE ------------------------------------------------------------------


def moe_layers(family: Family, cfg: dict, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    if num_experts <= 0:
        return (False,) * num_layers
    if family.moe_pattern == "sparse_step":
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense_only = set(cfg.get("mlp_only_layers") or [])
        return tuple(i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))
    if family.moe_pattern == "first_k_dense":
        # DeepSeek's own code also honours moe_layer_freq (1 in every released config)
        first, freq = int(cfg.get("first_k_dense_replace") or 0), int(cfg.get("moe_layer_freq") or 1)
        return tuple(i >= first and i % freq == 0 for i in range(num_layers))
    if family.moe_pattern == "encoder_decoder":  # every `sparse_step`-th layer of each stack
        enc = int(cfg["encoder_layers"])
        steps = (int(cfg.get("encoder_sparse_step") or 0), int(cfg.get("decoder_sparse_step") or 0))
        index = [(i, steps[0]) for i in range(enc)] + [(i, steps[1]) for i in range(num_layers - enc)]
        return tuple(step > 0 and (i + 1) % step == 0 for i, step in index)
    if family.moe_pattern == "moe_layers":
        listed = cfg.get("moe_layers")
        if listed is None:
            step = int(cfg.get("interleave_moe_layer_step", 1) or 1)
            listed = range(step - 1, num_layers, step)
        return tuple(i in set(listed) for i in range(num_layers))
    return (True,) * num_layers


# --- the router ----------------------------------------------------------------------------------


def router_spec(family: Family, cfg: dict, top_k: int, num_experts: int, where: str) -> RouterSpec:
    kind = family.router
    if kind == "deepseek_v2":  # transformers' DeepSeek-V2 never renormalises, whatever norm_topk_prob says
        method = cfg.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise SpecMoEError(f"{where}: topk_method {method!r} is not supported; use greedy or group_limited_greedy")
        kind = "softmax_topk" if method == "greedy" else "group_limited_softmax"
    grouped = kind in ("group_limited_softmax", "sigmoid_group_topk")
    # NLLB-MoE scales expert outputs by 1 - moe_token_dropout at inference (expert output masking)
    scaling = 1.0 - float(cfg.get("moe_token_dropout") or 0.0) if kind == "top2_all" else \
        float(cfg.get("routed_scaling_factor") or 1.0)
    return RouterSpec(
        kind=kind, top_k=top_k, num_experts=num_experts,
        renormalize=family.always_renormalize or (family.router != "deepseek_v2" and bool(cfg.get("norm_topk_prob"))),
        scaling=scaling,
        num_groups=int(cfg.get("n_group") or 1) if grouped else 1,
        topk_groups=int(cfg.get("topk_group") or 1) if grouped else 1,
        logit_bias=kind == "topk_softmax" or (kind == "top2_all" and bool(cfg.get("router_bias"))),
        correction_bias=kind == "sigmoid_group_topk",
        jitter_eps=float(cfg.get("router_jitter_noise") or 0.0),
        scales_input=kind == "topk_sigmoid",
    )


def expert_spec(family: Family, cfg: dict, hidden: int, inter: int) -> ExpertSpec:
    clamp = {}
    if family.activation == "clamped_swiglu":
        clamp = dict(alpha=float(cfg.get("swiglu_alpha", 1.702)), limit=float(cfg.get("swiglu_limit", 7.0)))
    return ExpertSpec(hidden, inter, family.activation, family.expert_bias, **clamp)


def shared_intermediate(family: Family, cfg: dict, expert_inter: int) -> int:
    if family.shared == "gated":
        return int(cfg.get("shared_expert_intermediate_size") or 0)
    if family.shared == "n_shared":
        return expert_inter * int(cfg.get("n_shared_experts") or 0)
    if family.shared == "expert_size":
        return expert_inter
    return 0


# --- attention ----------------------------------------------------------------------------------


def attention_spec(family: Family, cfg: dict, where: str, arch: str) -> tuple[AttentionSpec, RopeSpec]:
    heads = int(need(cfg, "num_attention_heads", where, arch))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    style = family.rope_style
    if style == "rope_interleave":
        style = "interleaved" if cfg.get("rope_interleave", True) else "half"
    if family.attention == "mla":
        nope, rope_dim = int(need(cfg, "qk_nope_head_dim", where, arch)), int(need(cfg, "qk_rope_head_dim", where, arch))
        rope = RopeSpec.from_config(cfg, rope_dim, style, family.default_theta, family.default_partial_rotary)
        spec = AttentionSpec(
            "mla", heads, heads, nope + rope_dim, int(need(cfg, "v_head_dim", where, arch)),
            scale=(nope + rope_dim) ** -0.5 * _yarn_mscale_squared(rope),
            q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=int(need(cfg, "kv_lora_rank", where, arch)),
            qk_nope_dim=nope, qk_rope_dim=rope_dim,
        )
        return spec, rope
    head_dim = int(cfg.get("head_dim") or int(need(cfg, "hidden_size", where, arch)) // heads)
    qk_norm = family.qk_norm
    if qk_norm == "use_qk_norm":
        qk_norm = "head" if cfg.get("use_qk_norm") else "none"
    if qk_norm == "l2" and not cfg.get("use_qk_norm", True):
        qk_norm = "none"
    temperature = None
    if family.name == "llama4" and cfg.get("attn_temperature_tuning"):
        temperature = (float(cfg.get("floor_scale", 8192)), float(cfg.get("attn_scale", 0.1)))
    spec = AttentionSpec(
        "gqa", heads, kv_heads, head_dim, head_dim, scale=head_dim ** -0.5, qk_norm=qk_norm, sinks=family.sinks,
        clip_qkv=cfg.get("clip_qkv"), temperature=temperature,
    )
    return spec, RopeSpec.from_config(cfg, head_dim, style, family.default_theta, family.default_partial_rotary)


def _yarn_mscale_squared(rope: RopeSpec) -> float:
    """DeepSeek scales MLA's softmax by mscale(factor, mscale_all_dim)^2 under YaRN."""
    if rope.kind == "default" or not rope.mscale_all_dim or rope.factor <= 1:
        return 1.0
    m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
    return m * m


def layer_windows(family: Family, cfg: dict, num_layers: int, where: str) -> tuple[AttentionWindow | None, ...]:
    if family.windows == "layer_types":
        size = int(need(cfg, "sliding_window", where, family.name))
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                           for i in range(num_layers)]
        return tuple(AttentionWindow("sliding", size) if t == "sliding_attention" else None for t in types)
    if family.windows == "chunked":
        size = cfg.get("attention_chunk_size")
        return tuple(AttentionWindow("chunked", int(size)) if size and rope else None
                     for rope in rope_layers(family, cfg, num_layers))
    size = cfg.get("sliding_window")
    if family.windows == "sliding" and size:
        return (AttentionWindow("sliding", int(size)),) * num_layers
    if size and cfg.get("use_sliding_window", False):
        raise SpecMoEError(f"{where}: use_sliding_window=true is not supported for {family.name}")
    return (None,) * num_layers


def rope_layers(family: Family, cfg: dict, num_layers: int) -> tuple[bool, ...]:
    """Which layers rotate q and k. Llama 4's `no_rope_layers[i]` is 1 where RoPE is used."""
    if family.positions == "sinusoidal":
        return (False,) * num_layers
    if family.name != "llama4":
        return (True,) * num_layers
    flags = cfg.get("no_rope_layers")
    if not flags:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    return tuple(bool(f) for f in flags)


# --- encoder-decoder models ---------------------------------------------------------------------


def encoder_decoder_keys(cfg: dict, where: str, arch: str) -> dict:
    """NLLB-MoE's config keys in the common names: one layer list (encoder, then decoder),
    one head count and one FFN size for both stacks, top-2 routing. What would make the
    output depend on the batch (capacity dropping, a sampled second expert) is refused."""
    enc, dec = int(need(cfg, "encoder_layers", where, arch)), int(need(cfg, "decoder_layers", where, arch))
    for a, b in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if need(cfg, a, where, arch) != need(cfg, b, where, arch):
            raise SpecMoEError(f"{where}: {a}={cfg[a]} differs from {b}={cfg[b]}; specmoe needs one size for both stacks")
    policy = cfg.get("second_expert_policy", "all")
    if policy != "all":
        raise SpecMoEError(f"{where}: second_expert_policy {policy!r} routes at random; set it to \"all\" for inference")
    fraction = float(cfg.get("moe_eval_capacity_token_fraction", 1.0))
    if fraction < 1.0:
        raise SpecMoEError(f"{where}: moe_eval_capacity_token_fraction={fraction} drops tokens depending on the batch; "
                           "set it to 1.0 (every token keeps its experts)")
    return {**cfg, "num_hidden_layers": enc + dec, "hidden_size": need(cfg, "d_model", where, arch),
            "num_attention_heads": cfg["encoder_attention_heads"], "num_experts_per_tok": 2,
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}


def seq2seq_spec(cfg: dict) -> Seq2SeqSpec:
    pad = int(cfg.get("pad_token_id", 1) if cfg.get("pad_token_id") is not None else 1)
    start = cfg.get("decoder_start_token_id")
    return Seq2SeqSpec(
        encoder_layers=int(cfg["encoder_layers"]),
        decoder_start_token_id=int(start if start is not None else cfg.get("eos_token_id", 2)),
        pad_token_id=pad,
        embed_scale=math.sqrt(cfg["hidden_size"]) if cfg.get("scale_embedding", True) else 1.0,
    )
