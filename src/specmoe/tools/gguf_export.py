"""A GGUF copy of a checkpoint, for llama.cpp (the bench's llama.cpp anchor), written with
the `gguf` package (pip install 'specmoe[anchors]').

Mixtral family only: llama.cpp runs it as its `llama` architecture with experts
(softmax router, top-k weights renormalised, SwiGLU experts), which is what Mixtral
computes. Every tensor is written in float32, the dtype specmoe computes in on the CPU,
so the anchor is compared at the same precision. Two layout differences from the
checkpoint, as llama.cpp's own converter makes them:
- q and k rows are permuted per head from the rotate-half RoPE layout to the
  interleaved pairs llama.cpp rotates (q.k, and so the model, is unchanged);
- experts are stacked per block: ffn_gate_exps / ffn_up_exps [E, I, D], ffn_down_exps [E, D, I].
The tokenizer (byte-level BPE from tokenizer.json) is written as llama.cpp's `gpt2` model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..base.checkpoint import Checkpoint
from ..base.errors import SpecMoEError
from ..base.files import publish
from ..model.moe import expert_views

SUPPORTED = ("MixtralForCausalLM",)
FORMAT_VERSION = 1  # part of the cached file's name: bump when what is written changes


def check_supported(ckpt: Checkpoint) -> None:
    c = ckpt.config
    if c.architecture not in SUPPORTED:
        raise SpecMoEError(f"converting {c.architecture} to GGUF is not supported (families: {', '.join(SUPPORTED)})")
    if any(w is not None for w in c.windows):
        raise SpecMoEError("converting to GGUF: a sliding attention window is not supported (llama.cpp's llama "
                           "architecture attends to the whole context)")
    if not (ckpt.dir / "tokenizer.json").is_file():
        raise SpecMoEError(f"converting to GGUF needs the tokenizer: {ckpt.dir} has no tokenizer.json")


def rope_to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection [heads * d, D]: within each head, the rotate-half order
    (dim i pairs with i + d/2) becomes pairs (2i, 2i + 1), as llama.cpp's converter does."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_path(ckpt: Checkpoint, cache_dir: Path) -> Path:
    return Path(cache_dir) / f"gguf-v{FORMAT_VERSION}-f32-{ckpt.fingerprint()}.gguf"


def cached_gguf(ckpt: Checkpoint, cache_dir: Path) -> Path:
    """The checkpoint's GGUF copy in `cache_dir`, written once."""
    path = gguf_path(ckpt, cache_dir)
    if not path.is_file():
        check_supported(ckpt)
        path.parent.mkdir(parents=True, exist_ok=True)
        publish(path, lambda tmp: write_gguf(ckpt, Path(tmp)))
    return path


def write_gguf(ckpt: Checkpoint, path: Path) -> None:
    import gguf

    check_supported(ckpt)
    c = ckpt.config
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_header(writer, c)
    _write_tokenizer(writer, ckpt)
    for name, tensor in _tensors(ckpt):
        writer.add_tensor(name, np.ascontiguousarray(tensor.numpy(), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_header(writer, c) -> None:
    import gguf

    a = c.attention
    writer.add_name("specmoe export")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_layers)
    writer.add_feed_forward_length(c.expert.inter)
    writer.add_head_count(a.num_heads)
    writer.add_head_count_kv(a.num_kv_heads)
    writer.add_key_length(a.head_dim)
    writer.add_value_length(a.v_head_dim)
    writer.add_rope_dimension_count(c.rope.dim)
    writer.add_rope_freq_base(c.rope.theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_expert_count(c.num_experts)
    writer.add_expert_used_count(c.router.top_k)
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def _write_tokenizer(writer, ckpt: Checkpoint) -> None:
    spec = json.loads((ckpt.dir / "tokenizer.json").read_text())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise SpecMoEError(f"converting to GGUF: tokenizer type {model.get('type')!r} is not supported (byte-level BPE only)")
    vocab = {**model["vocab"], **{t["content"]: t["id"] for t in spec.get("added_tokens", [])}}
    size = ckpt.config.vocab_size
    tokens = [f"[PAD{i}]" for i in range(size)]  # ids the tokenizer does not name (a padded vocabulary)
    types = [5] * size  # unused
    for text, i in vocab.items():
        if i < size:
            tokens[i], types[i] = text, 1  # normal
    for t in spec.get("added_tokens", []):
        if t["id"] < size:
            types[t["id"]] = 3 if t.get("special") else 4  # control / user-defined
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    cfg = ckpt.config
    if cfg.bos_token_id is not None:
        writer.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_ids:
        writer.add_eos_token_id(cfg.eos_token_ids[0])
    writer.add_add_bos_token(False)  # prompts are given as token ids, exactly as specmoe gets them


def _tensors(ckpt: Checkpoint):
    """(GGUF name, float32 tensor) for every weight, by role (either expert layout)."""
    c = ckpt.config
    a, D, V, E, I = c.attention, c.hidden_size, c.vocab_size, c.num_experts, c.expert.inter
    f32 = torch.float32

    def get(role, shape, layer=None):
        return ckpt.get(role, shape, layer).to(f32)

    yield "token_embd.weight", get("embed", (V, D))
    yield "output_norm.weight", get("final_norm", (D,))
    head = None if c.tie_word_embeddings else ckpt.get("lm_head", (V, D), required=False)
    yield "output.weight", (get("embed", (V, D)) if head is None else head.to(f32))
    q_out, kv_out = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    for i in range(c.num_layers):
        blk = f"blk.{i}."
        yield blk + "attn_norm.weight", get("attn_norm", (D,), i)
        yield blk + "attn_q.weight", rope_to_interleaved(get("q", (q_out, D), i), a.num_heads)
        yield blk + "attn_k.weight", rope_to_interleaved(get("k", (kv_out, D), i), a.num_kv_heads)
        yield blk + "attn_v.weight", get("v", (kv_out, D), i)
        yield blk + "attn_output.weight", get("o", (D, q_out), i)
        yield blk + "ffn_norm.weight", get("mlp_norm", (D,), i)
        yield blk + "ffn_gate_inp.weight", get("router", (E, D), i)
        views = [expert_views(ckpt.expert_buffer(i, e, f32), c.expert) for e in range(E)]
        yield blk + "ffn_gate_exps.weight", torch.stack([v.w_in[:I] for v in views])
        yield blk + "ffn_up_exps.weight", torch.stack([v.w_in[I:] for v in views])
        yield blk + "ffn_down_exps.weight", torch.stack([v.w_out for v in views])
