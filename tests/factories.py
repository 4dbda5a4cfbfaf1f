"""Tiny random Hugging Face MoE checkpoints, built with transformers' own classes.

The checkpoints are the reference for specmoe's loader and model: transformers writes
them (``save_pretrained``) exactly as it writes real ones, and transformers' forward pass
and ``generate`` give the numbers specmoe must reproduce. Sizes are tiny (vocab 128,
hidden 32, 2-3 layers, 8 experts, top-2) so a checkpoint builds in well under a second.

Each family exercises what distinguishes it:

- mixtral    explicit ``head_dim`` (16) != hidden / heads (8); softmax -> top-k -> renormalise.
- qwen2_moe  q/k/v bias, shared expert with its sigmoid gate, a dense MLP layer
             (``mlp_only_layers=[1]``), top-k weights not renormalised.
- qwen3_moe  per-head q/k RMSNorm, explicit ``head_dim`` (16), ``norm_topk_prob=True``,
             a dense MLP layer (``mlp_only_layers=[2]``).
- olmoe      q/k RMSNorm over the whole projection, ``norm_topk_prob=False``.

Weights are drawn with a large std (0.15; embeddings 1; norm weights 1 +- 0.1) so that logits and
router scores are far from 0 and routing is not degenerate. Special ids: pad 0, bos 1,
eos 2; prompts from :func:`random_prompts` avoid them.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import random
import shlex
import shutil
import subprocess
import sys
import threading
import types
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch._library.fake_class_registry import FakeScriptObject

from specmoe.experts.kernels import STATE_FILE as KERNELS_STATE

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# The families people offload today (see _FAMILY_SPECS for what each exercises).
LARGE_FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "llama4", "phimoe")
ALL_FAMILIES = FAMILIES + LARGE_FAMILIES
LAYOUTS = ("per_expert", "fused")

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_IDS = (PAD_ID, BOS_ID, EOS_ID)
VOCAB = 128
INIT_STD = 0.15

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    tie_word_embeddings=False,
)

# Per family: transformers config / model class names and the config fields.
# Intermediate sizes differ per role (expert 16/24, shared 24, dense 40) so that a
# tensor's shape alone says which role it has.
_FAMILY_SPECS = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            num_hidden_layers=2,
            head_dim=16,  # != hidden_size / heads = 8
            intermediate_size=24,  # per expert
            num_local_experts=8,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_hidden_layers=3,
            intermediate_size=40,  # dense MLP layers
            moe_intermediate_size=16,  # per expert
            shared_expert_intermediate_size=24,
            num_experts=8,
            norm_topk_prob=False,
            qkv_bias=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=3,
            head_dim=16,  # != hidden_size / heads = 8, as in the real Qwen3-MoE
            intermediate_size=40,  # dense MLP layers
            moe_intermediate_size=16,  # per expert
            num_experts=8,
            norm_topk_prob=True,
            attention_bias=False,
            decoder_sparse_step=1,
            mlp_only_layers=[2],
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        ),
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(
            # OLMoE's q_norm spans hidden_size, so head_dim must be hidden / heads.
            num_hidden_layers=2,
            intermediate_size=24,  # per expert
            num_experts=8,
            norm_topk_prob=False,
            attention_bias=False,
            clip_qkv=None,
            rope_parameters={"rope_type": "default", "rope_theta": 30000.0},
        ),
    ),
}


_SMALL_ATTENTION = dict(num_key_value_heads=4)  # MLA: every head has its own K and V
_MLA = dict(kv_lora_rank=12, q_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10)

# The large families: odd expert counts, shared experts, dense first layers, each family's
# own router, attention and RoPE scaling, windows shorter than the test contexts.
_FAMILY_SPECS.update({
    # MLA with a q latent, YaRN (factor 4 over 64 positions, mscale_all_dim != mscale: the
    # softmax scale changes), sigmoid routing with correction bias in 3 groups (2 kept),
    # 9 experts top-3, a shared expert, one dense first layer, interleaved RoPE
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_hidden_layers=3, **_SMALL_ATTENTION, **_MLA, intermediate_size=40, moe_intermediate_size=16,
            n_routed_experts=9, n_shared_experts=1, num_experts_per_tok=3, n_group=3, topk_group=2,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 20000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.707,
                             "beta_fast": 32.0, "beta_slow": 1.0},
        ),
    ),
    # MLA without a q latent (V2-Lite), softmax routing limited to the best 2 of 3 groups,
    # two shared experts, scaled weights
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            num_hidden_layers=3, **_SMALL_ATTENTION, **{**_MLA, "q_lora_rank": None}, intermediate_size=40,
            moe_intermediate_size=16, n_routed_experts=9, n_shared_experts=2, num_experts_per_tok=3, n_group=3,
            topk_group=2, topk_method="group_limited_greedy", first_k_dense_replace=1, routed_scaling_factor=1.5,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        ),
    ),
    # GQA with per-head q/k norm, q/k/v bias, half the head rotated, sigmoid grouped routing
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            num_hidden_layers=3, head_dim=16, intermediate_size=40, moe_intermediate_size=16, n_routed_experts=9,
            n_shared_experts=1, num_experts_per_tok=3, n_group=3, topk_group=2, first_k_dense_replace=1,
            use_qk_norm=True, attention_bias=True, norm_topk_prob=True, routed_scaling_factor=1.5,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.5},
        ),
    ),
    # attention sinks, sliding (window 8) / full layers, router bias and softmax over the
    # top-k, expert biases, the clamped SwiGLU (limit 1: the clamp bites), YaRN
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            num_hidden_layers=3, head_dim=16, intermediate_size=16, num_local_experts=7, num_experts_per_tok=2,
            sliding_window=8, swiglu_limit=1.0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 30000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        ),
    ),
    # MoE every 2nd layer, top-1 sigmoid router scaling the expert input, a shared expert,
    # NoPE layers (1, 3) with attention temperature (floor_scale 4: it varies here),
    # chunked attention (8) with q/k L2 norm in the RoPE layers, llama3 RoPE scaling
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            num_hidden_layers=4, head_dim=16, intermediate_size=16, intermediate_size_mlp=40, num_local_experts=5,
            num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=8, no_rope_layer_interval=2,
            attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1, use_qk_norm=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        ),
    ),
    # sparsemixer top-2 (eps 0.3: several experts inside the threshold), LayerNorm, q/k/v/o
    # biases, LongRoPE with its own cos/sin scale (the tests stay inside its 128 pre-training
    # positions: past them transformers switches the scale for the whole batch, see docs/MODELS.md)
    "phimoe": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        dict(
            num_hidden_layers=2, intermediate_size=16, num_local_experts=7, num_experts_per_tok=2,
            attention_bias=True, router_jitter_noise=0.3,
            rope_parameters={"rope_type": "longrope", "rope_theta": 30000.0,
                             "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.0, 2.0, 3.0, 4.0],
                             "original_max_position_embeddings": 128, "short_mscale": 1.2, "long_mscale": 1.3},
        ),
    ),
})

# Llama 4 as the Hub ships it: the text model inside Llama4ForConditionalGeneration, with a
# (tiny) vision tower the engine does not load.
_LLAMA4_VISION = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, image_size=28,
                      patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)


def _transformers():
    import transformers

    return transformers


def build_config(family: str, *, multimodal: bool = False, **overrides):
    """The transformers config of the tiny model of ``family`` (``overrides`` win).
    ``multimodal`` (llama4 only): the text model inside a Llama4ForConditionalGeneration."""
    if family not in _FAMILY_SPECS:
        raise ValueError(f"unknown family {family!r}; choose one of {ALL_FAMILIES}")
    config_name, _, fields = _FAMILY_SPECS[family]
    kwargs = {**_COMMON, **fields, **overrides}
    tr = _transformers()
    if multimodal:
        return tr.Llama4Config(text_config=kwargs, vision_config=_LLAMA4_VISION,
                               tie_word_embeddings=kwargs["tie_word_embeddings"])
    return getattr(tr, config_name)(**kwargs)


@torch.no_grad()
def build_model(family: str, *, seed: int = 0, std: float = INIT_STD, multimodal: bool = False, **overrides):
    """A tiny random float32 model of ``family`` in eval mode, weights drawn from ``seed``."""
    _, model_name, _ = _FAMILY_SPECS[family]
    config = build_config(family, multimodal=multimodal, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    cls = "Llama4ForConditionalGeneration" if multimodal else model_name
    model = getattr(_transformers(), cls)(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    # correction biases are buffers; drawn too, or the sigmoid routers would not use them
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if "correction_bias" in n)]
    for name, param in sorted(tensors, key=lambda t: t[0]):
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if "norm" in name.rsplit(".", 2)[-2] and name.endswith("weight"):  # norm weights: around 1, not 0
            param.copy_(1.0 + 0.1 * noise)
        elif "embed_tokens" in name:  # token identity must dominate the residual stream,
            param.copy_(noise)  # else all positions route alike
        elif "sinks" in name:  # attention sinks: logits comparable with q.k
            param.copy_(noise)
        else:  # linear weights, biases, embeddings, routers, experts
            param.copy_(std * noise)
    text = getattr(config, "text_config", config)
    model.generation_config = _transformers().GenerationConfig(
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
    )
    return model


def make_checkpoint(
    family: str,
    out_dir,
    *,
    layout: str = "per_expert",
    shards: int = 1,
    seed: int = 0,
    **overrides,
) -> Path:
    """Write a tiny random checkpoint of ``family`` to ``out_dir`` and return the path.

    layout="per_expert": the original Hub tensor names (one tensor per expert and
    projection, e.g. ``block_sparse_moe.experts.3.w1.weight``, ``mlp.experts.3.gate_proj.weight``).
    layout="fused": transformers 5's in-memory names, ``mlp.experts.gate_up_proj``
    [E, 2I, H] (gate rows first, then up) and ``mlp.experts.down_proj`` [E, H, I].
    shards > 1: several ``model-0000N-of-0000M.safetensors`` plus ``model.safetensors.index.json``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(family, seed=seed, **overrides)
    save_kwargs = dict(safe_serialization=True, save_original_format=(layout == "per_expert"))
    if shards == 1:
        model.save_pretrained(out, **save_kwargs)
        files = sorted(out.glob("*.safetensors"))
        assert [f.name for f in files] == ["model.safetensors"], files
    else:
        # transformers packs tensors greedily up to max_shard_size, so total/shards may
        # give one file more than asked; grow the size until the count is exact.
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        for step in range(40):
            for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
                stale.unlink()
            size = int(total / shards * (1.0 + 0.025 * step))
            model.save_pretrained(out, max_shard_size=size, **save_kwargs)
            files = sorted(out.glob("model-*-of-*.safetensors"))
            if len(files) == shards:
                break
        assert len(files) == shards, f"could not write {shards} shards, got {[f.name for f in files]}"
        assert (out / "model.safetensors.index.json").is_file()
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    return out


def to_mxfp4(path) -> Path:
    """Rewrite a (single-file, fused) GPT-OSS checkpoint's expert matrices as the released
    checkpoints hold them: MXFP4 `*_blocks` / `*_scales`, [out, in] per expert, 32-value
    blocks along `in` with a power-of-two scale each; config.json says quant_method mxfp4.
    The in dimensions must be multiples of 32."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    file = _single_file(path)
    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).transpose(1, 2)  # stored [E, in, out] for x @ W: back to [E, out, in]
        tensors[name + "_blocks"], tensors[name + "_scales"] = _mxfp4(w)
    save_file(tensors, str(file), metadata=metadata)
    cfg = read_config(path)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                  "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (Path(path) / "config.json").write_text(json.dumps(cfg))
    return Path(path)


def to_fp8(src, out_dir, block: int = 4) -> tuple[Path, Path]:
    """Two copies of a (single-file, per-expert) checkpoint: one as DeepSeek-V3 and Kimi-K2
    are released (every linear weight but the embedding, head and routers in float8_e4m3fn
    with a float32 `weight_scale_inv` per block x block tile, partial at the edges: max |w| / 448), and a float32
    reference holding exactly those FP8 values times their tile's scale, computed tile by
    tile here (transformers reads it without any quantization support)."""
    import shutil

    fp8, reference = Path(out_dir) / "fp8", Path(out_dir) / "fp8-reference"
    shutil.copytree(src, fp8)
    shutil.copytree(src, reference)
    quantized, dequantized = {}, {}

    def quantize(tensors):
        for name in [k for k, t in tensors.items() if t.dim() == 2 and k.endswith(".weight")]:
            if any(part in name for part in ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")):
                continue
            w = tensors[name].float()
            scale = torch.empty(-(-w.shape[0] // block), -(-w.shape[1] // block))  # edge tiles may be partial
            w8 = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
            back = torch.empty(w.shape)
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
                    scale[i, j] = tile.abs().max().clamp_min(1e-12) / 448.0
                    w8[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale[i, j]).to(w8.dtype)
                    back[i * block:(i + 1) * block, j * block:(j + 1) * block] = \
                        w8[i * block:(i + 1) * block, j * block:(j + 1) * block].float() * scale[i, j]
            quantized[name], quantized[name + "_scale_inv"], dequantized[name] = w8, scale, back
        tensors.update(quantized)

    _rewrite(fp8, quantize)
    _rewrite(reference, lambda tensors: tensors.update(dequantized))
    cfg = read_config(fp8)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    return fp8, reference


def to_bfloat16(src, out_dir) -> Path:
    """A copy of a (single-file) checkpoint with every float tensor in bfloat16, as most are released."""
    import shutil

    out = Path(out_dir)
    shutil.copytree(src, out)
    _rewrite(out, lambda tensors: tensors.update({k: t.to(torch.bfloat16) for k, t in tensors.items()
                                                  if t.is_floating_point()}))
    (out / "config.json").write_text(json.dumps({**read_config(out), "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    return out


def to_compressed_tensors(src, out_dir, scheme: str, group_size: int = 8) -> Path:
    """`specmoe quantize`'s checkpoint of `src`: w4a16 / w8a16 (int, one scale per
    `group_size` input columns) or fp8 (one scale per row)."""
    from specmoe.tools.quantize import quantize_checkpoint

    quantize_checkpoint(src, out_dir, scheme, group_size=group_size)
    return Path(out_dir)


# Routed expert projections in the Hub's per-expert names.
EXPERT_PROJECTION = r".*\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)$"


def to_compressed_tensors_with(src, out_dir, fmt: str, **weights) -> Path:
    """A compressed-tensors checkpoint of (single-file, per-expert) `src` written with the
    library's own compressor, independently of specmoe's writer: every routed expert
    projection quantized round-to-nearest with QuantizationArgs(**weights) (strategy
    group, channel, tensor or block), in format `fmt` (pack-quantized, int-quantized,
    float-quantized)."""
    import re
    import shutil

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    out = Path(out_dir)
    shutil.copytree(src, out)
    scheme = QuantizationScheme(targets=["re:" + EXPERT_PROJECTION], weights=QuantizationArgs(**weights), format=fmt)
    compressor = BaseCompressor.get_value_from_registry(fmt)

    def quantize(tensors):
        for name in [k for k in tensors if re.match(EXPERT_PROJECTION, k.removesuffix(".weight"))]:
            w = tensors.pop(name)
            blocks = _ct_blocks(w.float(), scheme.weights)
            scale, zero = calculate_qparams(blocks.amin((1, 3)), blocks.amax((1, 3)), scheme.weights)
            if scheme.weights.strategy in ("group", "channel"):
                scale, zero = scale.reshape(w.shape[0], -1), zero.reshape(w.shape[0], -1)
            elif scheme.weights.strategy == "tensor":
                scale, zero = scale.reshape(1), zero.reshape(1)
            packed = compressor.compress({"weight": w.float(), "weight_scale": scale.to(w.dtype),
                                          "weight_zero_point": zero}, scheme)
            tensors.update({name.removesuffix("weight") + k: v for k, v in packed.items()})

    _rewrite(out, quantize)
    cfg = read_config(out)
    cfg["quantization_config"] = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt,
                                                    quantization_status="compressed").model_dump(mode="json")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _ct_blocks(w: torch.Tensor, args) -> torch.Tensor:
    """w [rows, cols] viewed as [row blocks, rows per block, column blocks, columns per block]."""
    rows, cols = w.shape
    r, c = {"group": (1, args.group_size), "channel": (1, cols), "tensor": (rows, cols)}.get(
        args.strategy, tuple(args.block_structure or (rows, cols)))
    return w.reshape(rows // r, r, cols // c, c)


def _mxfp4(w: torch.Tensor):
    """w [..., in] -> (blocks [..., in/32, 16] uint8, scales [..., in/32] uint8): each value
    the nearest of the 16 e2m1 values times the block's 2^e, e the smallest with max|w| <= 6 * 2^e."""
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp_min(1e-30) / 6.0))
    scaled = blocks / torch.exp2(exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - values).abs().argmin(-1)
    codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def _cached_model(path):
    """The loaded model of ``path``, reused while the directory's files are unchanged."""
    path = Path(path).resolve()
    stamp = tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir()))
    return _load_cached(str(path), stamp)


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, stamp: tuple):
    return _load(path)


def _load(path):
    """transformers' float32 model of a checkpoint directory, eval mode, eager attention."""
    tr = _transformers()
    cfg = read_config(path)
    multimodal = "Llama4ForConditionalGeneration" in cfg.get("architectures", [])
    cls = tr.Llama4ForConditionalGeneration if multimodal else tr.AutoModelForCausalLM
    extra = {}
    qc = cfg.get("quantization_config", {})
    method = qc.get("quant_method")
    if method == "mxfp4":  # transformers' own dequantization
        extra["quantization_config"] = tr.Mxfp4Config(dequantize=True)
    elif method == "fp8":
        extra["quantization_config"] = tr.FineGrainedFP8Config(dequantize=True,
                                                               weight_block_size=tuple(qc["weight_block_size"]))
    elif method == "compressed-tensors":  # through the compressed-tensors library
        extra["quantization_config"] = tr.CompressedTensorsConfig(dequantize=True)

    model = cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager", **extra)
    # the multimodal Llama 4's own forward needs images; its text model is a Llama4ForCausalLM
    return (model.language_model if multimodal else model).eval()


@torch.no_grad()
def hf_logits(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 logits [len_i, vocab] of each prompt, each run on its own."""
    model = _cached_model(path)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long)
        out.append(model(input_ids=ids).logits[0].float())
    return out


@torch.no_grad()
def hf_greedy(path, prompt: list[int], n: int) -> list[int]:
    """Exactly ``n`` greedy new tokens of transformers' ``generate``; eos does not stop it.

    Semantic: token t+1 = argmax of the logits after prompt + tokens[:t], for t < n, eos
    included as an ordinary token (what ``SamplingParams(ignore_eos=True)`` means).
    ``min_new_tokens`` is deliberately NOT used: it masks eos out of the logits, which
    would change the argmax. Instead the model's eos is unset so nothing stops early.
    """
    model = _cached_model(path)
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt], dtype=torch.long)
    seq = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        pad_token_id=PAD_ID,
    )
    new = seq[0, len(prompt) :].tolist()
    assert len(new) == n, f"generate returned {len(new)} tokens, expected {n}"
    return new


@torch.no_grad()
def hf_greedy_reference(path, prompt: list[int], n: int) -> list[int]:
    """The same as :func:`hf_greedy` by recomputing the full forward each step (no KV cache)."""
    model = _cached_model(path)
    seq = list(prompt)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([seq], dtype=torch.long)).logits[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


def require_compressed_tensors():
    """The compressed-tensors library, or a skip where the quant extra cannot install it
    (Python < 3.11: on tests/skip_allowlist.txt). Missing anywhere else, it is an error."""
    if sys.version_info < (3, 11):
        pytest.skip("compressed-tensors needs Python >= 3.11 (the quant extra installs it only there)",
                    allow_module_level=True)
    import compressed_tensors

    return compressed_tensors


def random_prompts(n: int, vocab: int = VOCAB, min_len: int = 3, max_len: int = 24, seed: int = 0):
    """``n`` prompts of pairwise different lengths in [min_len, max_len], no special ids."""
    if max_len - min_len + 1 < n:
        raise ValueError(f"need {n} distinct lengths, range [{min_len}, {max_len}] is too small")
    rng = random.Random(seed)
    lengths = rng.sample(range(min_len, max_len + 1), n)
    low = max(SPECIAL_IDS) + 1
    return [[rng.randrange(low, vocab) for _ in range(length)] for length in lengths]


# --- bad inputs ---------------------------------------------------------------------

def _single_file(path) -> Path:
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            raise ValueError(f"{path} holds {len(files)} safetensors files, expected a single-file checkpoint")
        return files[0]
    return path


def _rewrite(path, change) -> str:
    from safetensors import safe_open
    from safetensors.torch import save_file

    file = _single_file(path)
    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    changed = change(tensors)
    save_file(tensors, str(file), metadata=metadata)
    return changed


def _find(tensors: dict, name_substring: str) -> str:
    matches = sorted(k for k in tensors if name_substring in k)
    if not matches:
        raise KeyError(f"no tensor name contains {name_substring!r}")
    return matches[0]


def corrupt_truncate(path, keep_fraction: float = 0.5) -> Path:
    """Cut the (single) safetensors file of ``path`` to ``keep_fraction`` of its bytes."""
    file = _single_file(path)
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(int(size * keep_fraction))
    return file


def drop_tensor(path, name_substring: str) -> str:
    """Remove the first tensor (sorted by name) whose name contains ``name_substring``; return its name."""

    def change(tensors):
        name = _find(tensors, name_substring)
        del tensors[name]
        return name

    return _rewrite(path, change)


def reshape_tensor(path, name_substring: str) -> str:
    """Give the first matching tensor a wrong shape (one row more on dim 0); return its name."""

    def change(tensors):
        name = _find(tensors, name_substring)
        t = tensors[name]
        tensors[name] = torch.cat([t, t[:1]], dim=0).contiguous()
        return name

    return _rewrite(path, change)


def tensor_shapes(path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a checkpoint directory (all shards)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():
                shapes[k] = tuple(f.get_slice(k).get_shape())
    return shapes


def read_config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


# --- helpers for tests of the engine ---------------------------------------------------------


FIXED_PROFILE = Path(__file__).resolve().parent / "data" / "profile-2core-disk.json"


SESSION_CACHE: Path | None = None  # the test session's private cache dir (conftest.py)


def install_fixed_profile(cache_dir) -> None:
    """Make a profile measured once on a 2-core VM this cache dir's `local` profile, so
    that `--policy auto` plans from fixed numbers instead of calibrating the machine the
    tests run on (seconds per session, and choices that depend on that machine)."""
    import shutil

    from specmoe.autotune.calibrate import second_tier
    from specmoe.costmodel.hardware import load_profile, save_profile

    profiles = Path(cache_dir) / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXED_PROFILE, profiles / "local.json")
    # its host-memory tier as calibrate saves it beside the disk's: without it a run with
    # --offload host calibrated this machine (10-20 s of a test)
    measurements = json.loads(FIXED_PROFILE.read_text())["measurements"]
    save_profile(second_tier(load_profile(FIXED_PROFILE), measurements), measurements, profiles)
    # the fused kernels' verdicts this session measured on this machine (3-4 s a child
    # process each): a fresh cache dir for planning need not check them again
    verdicts = SESSION_CACHE / KERNELS_STATE if SESSION_CACHE is not None else None
    if verdicts is not None and verdicts.is_file() and Path(cache_dir) != SESSION_CACHE:
        shutil.copy(verdicts, Path(cache_dir) / KERNELS_STATE)
    # and the block kernels' build with its self-check's verdict (a compile and a child process,
    # 2-3 s, in each process that starts from a fresh cache dir)
    built = SESSION_CACHE / "kernels" if SESSION_CACHE is not None else None
    if built is not None and built.is_dir() and Path(cache_dir) != SESSION_CACHE:
        shutil.copytree(built, Path(cache_dir) / "kernels", dirs_exist_ok=True)


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """`specmoe ARGS` in-process: (exit status, stdout, stderr). argparse's own errors end
    in SystemExit, as they end the real process."""
    from specmoe.cli import main

    capsys.readouterr()  # drop what earlier steps of the test printed
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err



def resident_reference(path, prompts, params, batch: int, max_len: int, shares) -> tuple[str, dict, int]:
    """The resident model's run of `prompts` on the CPU: (its token_ids_sha256, {share:
    expert_share_budget} for each of `shares`, all expert bytes)."""
    from specmoe import LLM

    ref = LLM(model=str(path), device="cpu", max_batch_size=batch, max_model_len=max_len)
    ref.generate(prompts, params)
    runtime = ref.engine.policy.runtime
    budgets = {share: expert_share_budget(ref, share, batch, max_len) for share in shares}
    ref.close()
    return ref.last_stats["token_ids_sha256"], budgets, runtime.expert_bytes * len(runtime.expert_keys)


def expert_share_budget(llm, fraction: float, batch: int, max_len: int) -> int:
    """Device budget: non-expert bytes + KV for `batch` x `max_len` + `fraction` of all expert bytes."""
    e = llm.engine
    experts = e.policy.runtime.expert_bytes * len(e.policy.runtime.expert_keys)
    return int(e.model.weights.nbytes + e.cache.bytes_per_token() * batch * max_len + fraction * experts)


# --- the device budget, measured without the ledger -------------------------------------------

# What the engine may hold on the device beyond its ledger: bookkeeping the ledger does not
# charge (the caching policy's pick counts, rotary frequencies; SpecMoE's affinity table,
# substitution maps and hotness counts are charged, as "draft routing tables"): 32-300 B
# for the tiny Mixtral. Less than one
# of its experts in the smallest format, int4 (4 bits a weight, 3 x 32 x 24 weights: over
# 1152 B; test_quantized_drafts checks it), so an uncharged copy of one int4 expert shows.
BOOKKEEPING_ALLOWANCE = 1024


def under_one_expert(config, bits: int) -> int:
    """An allowance just under one routed expert stored at `bits` a weight: its three
    matrices' codes alone (scales, biases and padding only add to an expert), less a byte.
    For tests whose models have more experts than the tiny Mixtral (bookkeeping grows
    with E x E) and whose smallest format is int8."""
    return 3 * config.hidden_size * config.expert_intermediate_size * bits // 8 - 1


def device_bytes_held(engine) -> int:
    """Bytes of every distinct tensor storage on the engine's device reachable from the
    engine or from specmoe's module-level state: weights, KV cache, expert pool, quantized
    copies, draft sets, anything a policy keeps, in attributes, containers (deques too),
    closures, partials and lru_caches (formats.py's caches tensors). Found by walking
    objects, not by asking its budget ledger. The offload tier (the store: host memory or a
    file, by definition not the device) and the checkpoint reader are not walked; on a
    CPU-only machine they share the device's memory, but they are the slow tier."""
    return sum(_device_storages(engine).values())


def _device_storages(engine) -> dict[int, int]:
    """{data_ptr: nbytes} of the storages device_bytes_held counts. The walk visits every
    object once (leaves: never); what it does with one depends on its type alone (see
    _kind), so each type's checks run once per process, not once per object: the walk runs
    at every block boundary of the tests that watch the device, thousands of times a test."""
    device_type = engine.device.type
    skip = {id(engine.checkpoint), id(getattr(engine.policy, "store", None)), id(engine.tokenizer)}
    seen, storages, stack = set(skip), {}, [engine, *_module_state()]
    pop, push, mark, kinds = stack.pop, stack.extend, seen.add, _KINDS
    while stack:
        obj = pop()
        kind = kinds.get(type(obj))
        if kind is None:
            kind = _kind(obj)
        if kind is _LEAF or id(obj) in seen:
            continue
        mark(id(obj))
        if kind is _TENSOR:
            if obj.device.type == device_type:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        elif kind is _DICT:
            push(obj.keys())
            push(obj.values())
        elif kind is _ITEMS:
            push(obj)
        elif kind is _ATTRS:  # an instance with a __dict__ and no __slots__
            push(obj.__dict__.values())
        else:
            push(_parts(obj))
    return storages


# What the walk does with an object, by _kind
_LEAF, _TENSOR, _DICT, _ITEMS, _ATTRS, _OTHER = "leaf", "tensor", "dict", "items", "attrs", "other"
_KINDS: dict[type, str] = {}  # a type's kind, where its instances cannot differ (_kind)


def _kind(obj) -> str:
    """What the walk does with `obj`: the checks of the walk and of _parts, in their order
    ("other": _parts itself, per object; slotted objects go there, since which slots are
    filled is the instance's). Recorded for type(obj) where every instance of that type
    gets the same answers: Python's own types, and classes none of whose own classes
    redefines __class__, __dict__ or attribute lookup (isinstance and hasattr read those),
    FakeScriptObject aside (torch.Generator's isinstance looks inside those)."""
    if isinstance(obj, _LEAVES):
        kind = _LEAF
    elif isinstance(obj, torch.Tensor):
        kind = _TENSOR
    elif isinstance(obj, dict):
        kind = _DICT
    elif isinstance(obj, (list, tuple, set, frozenset, deque)):
        kind = _ITEMS
    elif isinstance(obj, (types.MethodType, types.FunctionType, functools.partial, _LRU_CACHE)):
        kind = _OTHER
    elif not hasattr(obj, "__dict__") and not getattr(type(obj), "__slots__", ()):
        kind = _OTHER  # a C container: gc.get_referents
    elif getattr(type(obj), "__slots__", ()):
        kind = _OTHER
    else:
        kind = _ATTRS
    t = type(obj)
    if t in _SAFE_TYPES or (_plain_lookup(t) and not isinstance(obj, FakeScriptObject)):
        _KINDS[t] = kind
    return kind


def _plain_lookup(t: type) -> bool:
    """Whether every instance of `t` reads __class__ and __dict__ as object does: none of
    its classes but object defines attribute lookup, __class__, or a __dict__ other than
    the instance's own."""
    for c in t.__mro__[:-1]:
        own = vars(c)
        if "__getattribute__" in own or "__getattr__" in own or "__class__" in own:
            return False
        if "__dict__" in own and type(own["__dict__"]) is not types.GetSetDescriptorType:
            return False
    return True


# Python's own types whose instances' __class__ is their type: each defines __getattribute__
# (as every C type does), but one that finds __class__ on the type first, as object's does.
# `type`: a class's __class__ is its metaclass's (object's) data descriptor.
_SAFE_TYPES = frozenset({type, str, bytes, int, float, bool, type(None), dict, list, tuple, set, frozenset, deque,
                         types.MethodType, types.CellType, functools.partial, types.BuiltinFunctionType,
                         types.WrapperDescriptorType, types.MethodDescriptorType, types.MethodWrapperType})


def _parts(obj) -> list:
    """What `obj` holds that could keep a tensor alive."""
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset, deque)):
        return list(obj)
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, types.FunctionType):  # its closure and defaults, not its module's globals
        cells = [x for cell in obj.__closure__ or () for x in gc.get_referents(cell)]  # [] if empty
        return [*cells, *(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, _LRU_CACHE):  # its cached results are not in its __dict__
        return gc.get_referents(obj)
    if not hasattr(obj, "__dict__") and not getattr(type(obj), "__slots__", ()):
        return gc.get_referents(obj)  # a C container: a cell, an iterator
    slots = [getattr(obj, name) for name in getattr(type(obj), "__slots__", ()) if hasattr(obj, name)]
    return [*getattr(obj, "__dict__", {}).values(), *slots]


def _module_state() -> list:
    """specmoe's module-level state, where caches hold what no engine points to: each
    module's globals that can hold something, read afresh (a cache assigned later shows)."""
    return [namespace[name] for namespace, name in _state_names(len(sys.modules)) if name in namespace]


@functools.lru_cache(maxsize=1)
def _state_names(count: int) -> list:  # count: sys.modules' size, which an import changes
    """(globals, name) of every specmoe module's names but its definitions and imports
    (modules, classes, builtins, functions without closure or defaults), which are never
    rebound; listed once, since going through every global at every sample costs more
    than the rest of the walk."""
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("specmoe") and m is not None]
    return [(vars(m), name) for m in modules for name, value in list(vars(m).items())
            if not name.startswith("__") and _can_hold_state(value)]


def _can_hold_state(value) -> bool:
    if isinstance(value, types.FunctionType):  # specmoe's own: another library's state is not the engine's
        own = (value.__module__ or "").startswith("specmoe")
        return own and bool(value.__closure__ or value.__defaults__ or value.__kwdefaults__)
    # a module's logger is the logging library's: walking it walks every library's loggers and
    # pytest's handlers (it made each walk in the suite 3-4x slower than alone)
    return not isinstance(value, (type, types.ModuleType, types.BuiltinFunctionType, logging.Logger))


_LRU_CACHE = type(functools.lru_cache(maxsize=1)(len))
_LEAVES = (str, bytes, int, float, bool, type(None), type, types.BuiltinFunctionType, types.ModuleType,
           types.CodeType, torch.dtype, torch.device, torch.Generator, threading.Thread)


class DeviceSamples(list):
    """device_bytes_held at each sample (the list) and, at the same moments, held minus
    what the engine's ledger says it holds (`over_ledger`): its reservations less the
    dequantization scratch, which lives only inside a matmul. A copy the ledger was not
    told about shows there even where the budget has room to spare."""

    def __init__(self):
        super().__init__()
        self.over_ledger: list[int] = []

    def sample(self, engine) -> None:
        held = device_bytes_held(engine)
        budget = engine.budget
        scratch = sum(n for item, n in budget.by_item.items() if item.endswith("scratch"))
        self.append(held)
        self.over_ledger.append(held - (budget.used - scratch))

    def excess(self, budget: int) -> int:
        """The most the engine held beyond `budget` or beyond its own ledger, at any sample."""
        return max(max(self) - budget, max(self.over_ledger))


class _SampledBackend:
    """An ExpertBackend that samples the device bytes at every block boundary: before and
    after each MoE block (inside the pass, where a block's scratch and staging live), and
    after each layer."""

    def __init__(self, experts, sample):
        self._experts, self._sample = experts, sample

    def run_moe(self, layer, x, routing):
        self._sample()
        out = self._experts.run_moe(layer, x, routing)
        self._sample()
        return out

    def after_layer(self, layer, hidden):
        self._experts.after_layer(layer, hidden)
        self._sample()

    def __getattr__(self, name):
        return getattr(self._experts, name)


def watch_device_bytes(engine) -> DeviceSamples:
    """device_bytes_held after construction, when each pass opens, before and after each
    MoE block inside it, before each expert an offloading policy's block computes, after
    each layer, after each pass and after every step of the engine: the list grows while
    it runs; its max is the measured peak."""
    samples = DeviceSamples()
    samples.sample(engine)
    original_scope, original_step = engine.pass_scope, engine.step

    def sample():
        samples.sample(engine)

    @contextmanager
    def scope(kind):
        with original_scope(kind) as experts:
            sample()
            yield _SampledBackend(experts, sample)
        sample()

    def step():
        done = original_step()
        sample()
        return done

    blocks = getattr(engine.policy, "blocks", None)  # an offloading policy's BlockExecutor
    if blocks is not None:
        original_compute = blocks.compute

        def compute(key, xs):  # inside a block: its experts fetched, the others on their way
            sample()
            return original_compute(key, xs)

        blocks.compute = compute
    engine.pass_scope, engine.step = scope, step
    return samples


# The CUDA peak tests (test_cuda.py), fixed here so that test_allowances.py can check on any
# machine that their allowance is below what they claim to catch: one extra float32 expert
# held (intermediate 4096: 1.5 MiB), and an unreserved dequantization scratch of the int4
# model (its gate/up matrix in float32: 1 MiB). Few tokens a pass keep one pass's
# activations under both: the running expert's intermediate grows with the tokens, the
# expert and the scratch with the hidden size.
CUDA_PEAK = dict(intermediate_size=4096, prompts=2, min_len=3, max_len=6, batch=2, gamma=4, max_model_len=32)


def pass_tokens(prompts, batch: int, gamma: int) -> int:
    """The most tokens one forward pass computes: every prompt prefilled in one pass, or a
    speculative verify pass of batch x (gamma + 1)."""
    return max(sum(map(len, prompts)), batch * (gamma + 1))


def cuda_activation_allowance(config, tokens: int, kv_len: int, grouped: bool = False) -> int:
    """What one forward pass of `tokens` tokens may allocate on CUDA beyond the budget: its
    activations, float32. Per token: hidden states, norms and residuals (8 D), q/k/v/o
    (4 H d), attention scores and probabilities over kv_len keys (2 H kv_len), router
    logits (E), the running expert's gate/up output (2 I; experts run one at a time),
    logits (V); that sum counts every phase as alive at once, which none is, doubled for
    the temporaries an operator holds beside its output. `grouped`: a block's experts run
    as one grouped computation (resident's float experts), which holds every pick's
    gate/up output, activation and product (4 I a pick, top_k picks a token) at once: 16
    picks of I = 4096 held 1.05 MB on an H200. Nothing for the caching allocator's
    rounding to 512 B: the tests compare the allocator's requested bytes."""
    c = config
    per_token = (8 * c.hidden_size + 4 * c.num_heads * c.head_dim + 2 * c.num_heads * kv_len + c.num_experts
                 + c.vocab_size)
    experts = c.top_k * 4 * c.expert_intermediate_size if grouped else 2 * 2 * c.expert_intermediate_size
    return 4 * (2 * per_token + experts) * tokens


def cuda_requested_bytes(stat: str = "current") -> int:
    """The CUDA caching allocator's bytes as requested (before its rounding to 512 B blocks):
    'current' now, 'peak' since torch.cuda.reset_peak_memory_stats()."""
    return torch.cuda.memory_stats()[f"requested_bytes.all.{stat}"]


def assert_policy_run_is_exact(stats: dict, sha: str, policy: str) -> None:
    """Resident's tokens and (offloading) experts really moved."""
    assert stats["token_ids_sha256"] == sha
    if policy != "host":
        assert stats["transfer_bytes"] > 0


def watch_draft_reads(engine) -> list:
    """Every expert the draft used that was read while it ran (there must be none): a load
    into a pool slot issued while the engine has a draft pass open, which the draft then
    waited for (transfer.wait, as any use of a fetched expert must) before the pass closed.
    SpecMoE starts verification's reads during the draft (`watch_reads_while_drafting`
    sees them); the draft never waits for them: it moves no expert bytes for itself."""
    issued = watch_reads_while_drafting(engine)
    used, transfer = [], engine.policy.transfer
    original_wait = transfer.wait

    def wait(key):
        if key in transfer.inflight and key in issued.this_draft and "draft" in issued.open_kinds:
            used.append(key)
        return original_wait(key)

    transfer.wait = wait
    return used


class _Reads(list):
    open_kinds: list  # the passes open now
    this_draft: set  # keys issued while the last draft pass was open (recorded on the main thread)


def watch_reads_while_drafting(engine) -> list:
    """Every expert copied into a device pool slot for a fetch issued while the engine has
    a draft pass open. Watched from outside the policy: the pass scope the engine opens
    and the transfer engine's load of a key into a slot (what copies into the pool on
    either tier and either device: host tensor or disk read, CPU or CUDA), not the
    policy's own counters. A load issued on the main thread and run on a reader thread is
    judged by the passes open when it was issued."""
    reads, open_kinds = _Reads(), []
    reads.open_kinds, reads.this_draft = open_kinds, set()
    transfer = engine.policy.transfer
    slots = transfer.pool.buffers.untyped_storage().data_ptr()
    original_scope, original_load, original_submit = engine.pass_scope, transfer._load, transfer.executor.submit

    @contextmanager
    def scope(kind):
        open_kinds.append(kind)
        if kind == "draft":
            reads.this_draft = set()
        try:
            with original_scope(kind) as experts:
                yield experts
        finally:
            open_kinds.pop()

    def load(key, dest, *rest, issued_while_drafting=None):
        drafting = "draft" in open_kinds if issued_while_drafting is None else issued_while_drafting
        if drafting and dest.untyped_storage().data_ptr() == slots:
            reads.append(key)
        return original_load(key, dest, *rest)

    def submit(fn, *args, **kwargs):
        if fn is load:
            kwargs["issued_while_drafting"] = "draft" in open_kinds
            if "draft" in open_kinds:
                reads.this_draft.add(args[0])
        return original_submit(fn, *args, **kwargs)

    engine.pass_scope, transfer._load, transfer.executor.submit = scope, load, submit
    return reads


def widened_demo(out: Path, hidden: int = 4, expert: int = 4) -> Path:
    """The demo model widened by benchmarks/real_size_model.py into `out` (4x: experts 3 MiB
    as stored, 384 MiB in all): real-size shapes at a size the memory tests can run."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "real_size_model.py"
    run = subprocess.run([sys.executable, str(script), str(out), "--hidden-factor", str(hidden),
                          "--expert-factor", str(expert)], capture_output=True, text=True)
    assert run.returncode == 0, f"real_size_model.py exited {run.returncode}: {run.stderr[-2000:]}"
    return out


def assert_one_line_failure(proc, *fragments):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment.lower() in lines[0].lower(), lines[0]


def namespace_commands(command: list[str]) -> list[list[str]]:
    """Ways to run a script as root in a private mount namespace, with `command` in it run
    as this user, in the order tried: a user namespace (most kernels); where those are
    blocked (AppArmor on Ubuntu 24.04, a container), sudo, as CI's runners have it, or
    plain unshare when this process is root."""
    ways = [(["unshare", "--user", "--map-root-user", "--mount"], command)]
    if os.geteuid() == 0:
        ways.append((["unshare", "--mount"], command))
    elif shutil.which("sudo"):
        env = [f"{k}={v}" for k, v in os.environ.items() if k.isidentifier()]  # sudo starts from a clean one
        as_me = ["setpriv", f"--reuid={os.getuid()}", f"--regid={os.getgid()}", "--clear-groups", "--"]
        ways.append((["sudo", "-n", "env", *env, "unshare", "--mount"], as_me + command))
    return ways


def in_small_tmpfs(mount, command: list[str], size: str = "64k", read_only: bool = False):
    """Run `command` with a fresh tmpfs of `size` on `mount` (visible to it alone); the
    mount's listing afterwards is printed on stdout after a marker line. Where no way to a
    mount namespace works, a skip that no allowlist entry covers: CI fails."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    options = f"size={size}" + (",ro" if read_only else "")
    refused = []
    for prefix, inner in namespace_commands(command):
        script = (f"mount -t tmpfs -o {options},mode=1777 tmpfs {shlex.quote(str(mount))} || exit 99; "
                  f"{shlex.join(inner)}; status=$?; echo LISTING; ls -A {shlex.quote(str(mount))}; exit $status")
        proc = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True, timeout=180)
        if proc.returncode != 99 and "unshare:" not in proc.stderr and "LISTING\n" in proc.stdout:
            return proc, proc.stdout.split("LISTING\n", 1)[1].split()
        refused.append(f"{' '.join(prefix[:2])}: {proc.stderr.strip()[:200]}")
    pytest.skip(f"no private mount namespace here: {'; '.join(refused)}")
