"""A Hugging Face MoE checkpoint as a quantized GGUF file, laid out as llama.cpp's own
converter (convert_hf_to_gguf.py) lays it out, written with the `gguf` package
(pip install gguf): what the tests and the benchmark give `--model FILE.gguf`.

    python -m specmoe.tools.gguf_convert MODEL_DIR OUT.gguf --type Q4_K [--down-type Q6_K]

Families: Mixtral (llama.cpp's `llama` with experts: q/k rows permuted to interleaved
pairs), Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3 (kv_b split into k_b / v_b as newer
llama.cpp writes it, or kept), GPT-OSS, GLM-4.5, Llama 4 and Phi-3.5-MoE (their metadata,
RoPE factor tensors and refusals in gguf_convert_families.py). Experts stacked per block [E, rows, cols].
Quantization: 2-D weights in the chosen type where their rows are whole blocks of it,
else its fallback (as llama.cpp falls back); norms, biases and routers in F32. Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, MXFP4 and BF16 are the gguf package's own quantizers; Q4_K and Q6_K are
written by the simple encoders below (any valid encoding reads back exactly as llama.cpp
dequantizes it, which is what the readers are checked against).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from ..base.checkpoint import LAYER_TENSORS, Checkpoint
from ..base.errors import SpecMoEError
from ..base.gguf_quants import BLOCKS
from ..model.moe import expert_views
from . import gguf_convert_families as families
from .gguf_export import _write_tokenizer, rope_to_interleaved

GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe",
             "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss", "glm4_moe": "glm4moe",
             "llama4": "llama4", "phimoe": "phimoe"}
ROLE_PARTS = {
    "attn_norm": "attn_norm.weight", "attn_norm_bias": "attn_norm.bias", "mlp_norm_bias": "ffn_norm.bias",
    "mlp_norm": "ffn_norm.weight", "q": "attn_q.weight", "k": "attn_k.weight",
    "v": "attn_v.weight", "o": "attn_output.weight", "q_bias": "attn_q.bias", "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias", "o_bias": "attn_output.bias", "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight", "sinks": "attn_sinks.weight", "q_a": "attn_q_a.weight",
    "q_a_norm": "attn_q_a_norm.weight", "q_b": "attn_q_b.weight", "kv_a": "attn_kv_a_mqa.weight",
    "kv_a_norm": "attn_kv_a_norm.weight", "kv_b": "attn_kv_b.weight", "router": "ffn_gate_inp.weight",
    "router_bias": "ffn_gate_inp.bias", "correction_bias": "exp_probs_b.bias",
    "shared_gate_proj": "ffn_gate_shexp.weight", "shared_up_proj": "ffn_up_shexp.weight",
    "shared_down_proj": "ffn_down_shexp.weight", "shared_expert_gate": "ffn_gate_inp_shexp.weight",
    "dense_gate_proj": "ffn_gate.weight", "dense_up_proj": "ffn_up.weight", "dense_down_proj": "ffn_down.weight",
}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q3_K": "Q4_0", "Q2_K": "Q4_0", "MXFP4": "Q8_0"}
KEEP_F32 = ("norm.weight", ".bias", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "attn_sinks.weight")


# --- encoders the gguf package lacks ---------------------------------------------------------


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Blocks of 256 -> Q4_K: 8 sub-blocks of 32 with 6-bit scale and min (min <= 0)."""
    b = x.reshape(-1, 8, 32).astype(np.float32)
    lo, hi = np.minimum(b.min(-1), 0), np.maximum(b.max(-1), 0)
    scale, minus = (hi - lo) / 15, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (minus.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(np.divide(scale, d[:, None], out=np.zeros_like(scale), where=d[:, None] > 0)), 0, 63)
    mn = np.clip(np.round(np.divide(minus, dmin[:, None], out=np.zeros_like(minus), where=dmin[:, None] > 0)), 0, 63)
    eff_s, eff_m = d[:, None].astype(np.float32) * sc, dmin[:, None].astype(np.float32) * mn
    q = np.divide(b + eff_m[..., None], eff_s[..., None], out=np.zeros_like(b), where=eff_s[..., None] > 0)
    q = np.clip(np.round(q), 0, 15).astype(np.uint8)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Blocks of 256 -> Q6_K: 16 sub-blocks of 16 with an int8 scale each, 6-bit codes."""
    b = x.reshape(-1, 16, 16).astype(np.float32)
    s = np.abs(b).max(-1) / 31
    d = (s.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.round(np.divide(s, d[:, None], out=np.zeros_like(s), where=d[:, None] > 0)), -128, 127)
    eff = d[:, None].astype(np.float32) * sc
    q = np.divide(b, eff[..., None], out=np.zeros_like(b), where=eff[..., None] > 0)
    q = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # per half of 128 values
    ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)  # [n, 2, 64]
    high = (q >> 4).reshape(-1, 2, 4, 32)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)  # [n, 2, 32]
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                           _f16_bytes(d)], axis=1)


_OWN = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def encode(w: torch.Tensor, type_name: str) -> tuple[np.ndarray, str]:
    """A float tensor in `type_name` (or its fallback where rows are not whole blocks):
    (array for GGUFWriter.add_tensor, the type written)."""
    import gguf

    a = np.ascontiguousarray(w.float().numpy())
    if type_name == "F32" or a.ndim == 1:
        return a, "F32"
    if a.shape[-1] % BLOCKS[type_name][0]:
        return encode(w, FALLBACK.get(type_name, "F32")) if type_name in FALLBACK else encode(w, "F32")
    if type_name == "F16":
        return a.astype(np.float16), "F16"
    if type_name in _OWN:
        rows = _OWN[type_name](a.reshape(-1, 256))
        return rows.reshape(*a.shape[:-1], -1), type_name
    return gguf.quants.quantize(a, gguf.GGMLQuantizationType[type_name]), type_name


# --- the file ---------------------------------------------------------------------------------


def convert(model_dir, out, type_name: str = "Q8_0", expert_type: str | None = None,
            down_types: dict[int, str] | None = None, split_kv_b: bool = True, split_max_tensors: int = 0) -> Path:
    """Write `model_dir` as GGUF to `out`; `expert_type` (default `type_name`) for the routed
    experts, `down_types` per layer for their down projections (Q4_K_M keeps some in Q6_K)."""
    import gguf

    ckpt = Checkpoint(model_dir)
    c = ckpt.config
    arch = GGUF_ARCH.get(c.family.name)
    if arch is None:
        raise SpecMoEError(f"converting {c.architecture} to GGUF is not supported ({', '.join(GGUF_ARCH)})")
    out = Path(out)
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    families.check(c, arch)
    _metadata(writer, ckpt, arch, split_kv_b)
    families.metadata(writer, c, arch)
    if (ckpt.dir / "tokenizer.json").is_file():
        _write_tokenizer(writer, ckpt)
        cfg_path = ckpt.dir / "tokenizer_config.json"
        template = json.loads(cfg_path.read_text()).get("chat_template") if cfg_path.is_file() else None
        if template:
            writer.add_chat_template(template)
    for name, tensor, kind in _tensors(ckpt, arch, split_kv_b, type_name, expert_type or type_name, down_types or {}):
        data, written = encode(tensor, "F32" if name.endswith(KEEP_F32) else kind)
        raw = None if written in ("F32", "F16") else gguf.GGMLQuantizationType[written]
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _metadata(writer, ckpt: Checkpoint, arch: str, split_kv_b: bool) -> None:
    c, a = ckpt.config, ckpt.config.attention
    writer.add_name(f"specmoe conversion of {ckpt.dir.name}")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_layers)
    writer.add_feed_forward_length(c.dense_intermediate_size or c.expert.inter)
    writer.add_expert_feed_forward_length(c.expert.inter)
    writer.add_head_count(a.num_heads)
    # llama.cpp's MLA (k_b / v_b) runs attention as MQA over the latent: one kv head
    writer.add_head_count_kv(1 if a.kind == "mla" and split_kv_b else a.num_kv_heads)
    writer.add_rope_freq_base(c.rope.theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_expert_count(c.num_experts)
    writer.add_expert_used_count(c.router.top_k)
    writer.add_vocab_size(c.vocab_size)
    writer.add_expert_weights_norm(c.router.renormalize)
    if c.bos_token_id is not None:
        writer.add_bos_token_id(c.bos_token_id)
    if c.eos_token_ids:
        writer.add_eos_token_id(c.eos_token_ids[0])
    if c.shared_expert_intermediate_size and arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if a.kind == "mla":
        _mla_metadata(writer, c, split_kv_b)
    else:
        writer.add_key_length(a.head_dim)
        writer.add_value_length(a.v_head_dim)
        writer.add_rope_dimension_count(c.rope.dim)
    if arch == "gpt-oss":
        writer.add_uint32(f"{arch}.attention.sliding_window", next(w.size for w in c.windows if w is not None))
        writer.add_float32(f"{arch}.swiglu_clamp_exp", c.expert.limit)
    if c.rope.kind in ("yarn", "linear"):
        writer.add_rope_scaling_type(gguf_rope(c.rope.kind))
        writer.add_rope_scaling_factor(c.rope.factor)
        writer.add_rope_scaling_orig_ctx_len(c.rope.original_max_positions)
        if c.rope.mscale_all_dim:
            writer.add_rope_scaling_yarn_log_mul(0.1 * c.rope.mscale_all_dim)


def gguf_rope(kind: str):
    import gguf

    return gguf.RopeScalingType.YARN if kind == "yarn" else gguf.RopeScalingType.LINEAR


def _mla_metadata(writer, c, split_kv_b: bool) -> None:
    import gguf

    a, r = c.attention, c.router
    nope_rope = a.qk_nope_dim + a.qk_rope_dim
    if split_kv_b:  # newer llama.cpp: attention described in its MQA form, per-head sizes under *_mla
        writer.add_key_length(a.kv_lora_rank + a.qk_rope_dim)
        writer.add_value_length(a.kv_lora_rank)
        writer.add_key_length_mla(nope_rope)
        writer.add_value_length_mla(a.v_head_dim)
    else:
        writer.add_key_length(nope_rope)
        writer.add_value_length(a.v_head_dim)
    writer.add_rope_dimension_count(a.qk_rope_dim)
    writer.add_kv_lora_rank(a.kv_lora_rank)
    if a.q_lora_rank:
        writer.add_q_lora_rank(a.q_lora_rank)
    writer.add_leading_dense_block_count(c.moe_layer_ids[0])
    writer.add_expert_shared_count(c.shared_expert_intermediate_size // c.expert.inter)
    writer.add_expert_weights_scale(r.scaling)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if r.kind == "sigmoid_group_topk"
                                  else gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_expert_group_count(r.num_groups)
    writer.add_expert_group_used_count(r.topk_groups)


def _tensors(ckpt: Checkpoint, arch: str, split_kv_b: bool, kind: str, expert_kind: str, down_types: dict):
    """(GGUF name, float tensor, type) for every weight."""
    c = ckpt.config
    yield "token_embd.weight", ckpt.tensor(ckpt.find(("model.embed_tokens.weight",))), kind
    yield "output_norm.weight", ckpt.tensor(ckpt.find(("model.norm.weight",))), "F32"
    for name, tensor in families.extra_tensors(c, arch):
        yield name, tensor, "F32"
    for hf, part in (("model.norm.bias", "output_norm.bias"), ("lm_head.bias", "output.bias")):  # Phi-3.5-MoE
        if ckpt.find((hf,)) is not None:
            yield part, ckpt.tensor(ckpt.find((hf,))), "F32"
    head = None if c.tie_word_embeddings else ckpt.find(("lm_head.weight",))
    if head is not None:
        yield "output.weight", ckpt.tensor(head), kind
    for i in range(c.num_layers):
        yield from _layer(ckpt, i, arch, split_kv_b, kind)
        if c.moe_layers[i]:
            yield from _experts(ckpt, i, expert_kind, down_types.get(i, expert_kind))


def _layer(ckpt: Checkpoint, i: int, arch: str, split_kv_b: bool, kind: str):
    c, a = ckpt.config, ckpt.config.attention
    for role, part in ROLE_PARTS.items():
        name = ckpt.find(tuple(ckpt.layer_prefix(i) + t for t in LAYER_TENSORS[role]))
        if name is None:
            continue
        t = ckpt.tensor(name).float()
        if arch in ("gpt-oss", "glm4moe") and role == "mlp_norm":
            part = "post_attention_norm.weight"
        if arch == "llama" and role in ("q", "k"):
            t = rope_to_interleaved(t, a.num_heads if role == "q" else a.num_kv_heads)
        if role == "shared_expert_gate":
            t = t.reshape(-1)
        if role == "kv_b" and split_kv_b:  # [H (dn + dv), c] -> k_b [H, c, dn], v_b [H, dv, c]
            kv = t.reshape(a.num_heads, a.qk_nope_dim + a.v_head_dim, -1)
            yield f"blk.{i}.attn_k_b.weight", kv[:, :a.qk_nope_dim].transpose(1, 2).contiguous(), kind
            yield f"blk.{i}.attn_v_b.weight", kv[:, a.qk_nope_dim:].contiguous(), kind
            continue
        yield f"blk.{i}.{part}", t, kind


def _experts(ckpt: Checkpoint, i: int, kind: str, down_kind: str):
    c = ckpt.config
    I = c.expert.inter
    views = [expert_views(ckpt.expert_buffer(i, e, torch.float32), c.expert) for e in range(c.num_experts)]
    yield f"blk.{i}.ffn_gate_exps.weight", torch.stack([v.w_in[:I] for v in views]), kind
    yield f"blk.{i}.ffn_up_exps.weight", torch.stack([v.w_in[I:] for v in views]), kind
    yield f"blk.{i}.ffn_down_exps.weight", torch.stack([v.w_out for v in views]), down_kind
    if c.expert.bias:
        yield f"blk.{i}.ffn_gate_exps.bias", torch.stack([v.b_in[:I] for v in views]), "F32"
        yield f"blk.{i}.ffn_up_exps.bias", torch.stack([v.b_in[I:] for v in views]), "F32"
        yield f"blk.{i}.ffn_down_exps.bias", torch.stack([v.b_out for v in views]), "F32"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("out")
    p.add_argument("--type", default="Q8_0", help="Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K, MXFP4, BF16, F16, F32")
    p.add_argument("--expert-type", help="the routed experts' type (default: --type)")
    p.add_argument("--down-type", help="the experts' down projections' type (default: --expert-type)")
    args = p.parse_args(argv)
    layers = Checkpoint(args.model_dir).config.moe_layer_ids
    down = {i: args.down_type for i in layers} if args.down_type else None
    print(convert(args.model_dir, args.out, args.type, args.expert_type, down))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
