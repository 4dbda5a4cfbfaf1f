"""A GGUF copy of a checkpoint, for llama.cpp (the bench's llama.cpp anchor), written with
the `gguf` package (pip install 'specmoe[anchors]').

Mixtral family only: llama.cpp runs it as its `llama` architecture with experts
(softmax router, top-k weights renormalised, SwiGLU experts), which is what Mixtral
computes. Every tensor is written in float32, the dtype specmoe computes in on the CPU,
so the anchor is compared at the same precision (or, with `encoding="bf16"`, every matrix
in bfloat16: half the bytes, exactly a bfloat16 checkpoint's weights, what llama.cpp's
quantizer reads as well as float32). Tensors are made and written one at a time, so a
checkpoint bigger than memory exports in bounded memory. Two layout differences from the
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


ENCODINGS = ("f32", "bf16")


def gguf_path(ckpt: Checkpoint, cache_dir: Path, encoding: str = "f32") -> Path:
    return Path(cache_dir) / f"gguf-v{FORMAT_VERSION}-{encoding}-{ckpt.fingerprint()}.gguf"


def cached_gguf(ckpt: Checkpoint, cache_dir: Path, encoding: str = "f32") -> Path:
    """The checkpoint's GGUF copy in `cache_dir`, written once."""
    path = gguf_path(ckpt, cache_dir, encoding)
    if not path.is_file():
        check_supported(ckpt)
        path.parent.mkdir(parents=True, exist_ok=True)
        publish(path, lambda tmp: write_gguf(ckpt, Path(tmp), encoding))
    return path


def write_gguf(ckpt: Checkpoint, path: Path, encoding: str = "f32") -> None:
    import gguf

    if encoding not in ENCODINGS:
        raise SpecMoEError(f"GGUF export encoding {encoding!r} is not one of: {', '.join(ENCODINGS)}")
    check_supported(ckpt)
    c = ckpt.config
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_header(writer, c, encoding)
    _write_tokenizer(writer, ckpt)
    for name, shape, make in _tensors(ckpt):
        bf16 = encoding == "bf16" and len(shape) >= 2  # norms stay float32, as llama.cpp's converter keeps them
        raw = gguf.GGMLQuantizationType.BF16 if bf16 else None
        # the writer takes anything with shape, dtype, nbytes and tofile: each tensor is made as it is written
        writer.add_tensor(name, _Deferred(shape, make, bf16), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class _Deferred:
    """A tensor the GGUF writer sees by its shape and size and gets only when it writes it:
    float32 values, or bfloat16 ones as bytes (the writer's way for raw types)."""

    def __init__(self, shape: tuple[int, ...], make, bf16: bool):
        self.make, self.bf16 = make, bf16
        self.dtype = np.dtype(np.uint8 if bf16 else np.float32)
        self.shape = (*shape[:-1], shape[-1] * 2) if bf16 else tuple(shape)
        self.nbytes = int(np.prod(shape)) * (2 if bf16 else 4)

    def tofile(self, fout) -> None:
        t = self.make()
        data = t.to(torch.bfloat16).contiguous().view(torch.uint8) if self.bf16 else t.to(torch.float32).contiguous()
        data = data.numpy()
        assert data.nbytes == self.nbytes, (data.shape, self.shape)
        data.tofile(fout)


def _write_header(writer, c, encoding: str) -> None:
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
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if encoding == "bf16" else gguf.LlamaFileType.ALL_F32)


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
    """(GGUF name, shape, a function that makes the float32 tensor) for every weight, by role
    (either expert layout): the shapes come first, each tensor only when it is written."""
    c = ckpt.config
    a, D, V, E, I = c.attention, c.hidden_size, c.vocab_size, c.num_experts, c.expert.inter
    f32 = torch.float32

    def get(role, shape, layer=None):
        return lambda: ckpt.get(role, shape, layer).to(f32)

    def entry(name, shape, make):
        return name, tuple(shape), make

    yield entry("token_embd.weight", (V, D), get("embed", (V, D)))
    yield entry("output_norm.weight", (D,), get("final_norm", (D,)))
    tied = c.tie_word_embeddings or ckpt.get("lm_head", (V, D), required=False) is None
    yield entry("output.weight", (V, D), get("embed" if tied else "lm_head", (V, D)))
    q_out, kv_out = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    for i in range(c.num_layers):
        blk = f"blk.{i}."
        q, k = get("q", (q_out, D), i), get("k", (kv_out, D), i)
        yield entry(blk + "attn_norm.weight", (D,), get("attn_norm", (D,), i))
        yield entry(blk + "attn_q.weight", (q_out, D), lambda q=q: rope_to_interleaved(q(), a.num_heads))
        yield entry(blk + "attn_k.weight", (kv_out, D), lambda k=k: rope_to_interleaved(k(), a.num_kv_heads))
        yield entry(blk + "attn_v.weight", (kv_out, D), get("v", (kv_out, D), i))
        yield entry(blk + "attn_output.weight", (D, q_out), get("o", (D, q_out), i))
        yield entry(blk + "ffn_norm.weight", (D,), get("mlp_norm", (D,), i))
        yield entry(blk + "ffn_gate_inp.weight", (E, D), get("router", (E, D), i))
        yield entry(blk + "ffn_gate_exps.weight", (E, I, D), lambda i=i: _experts(ckpt, i, lambda v: v.w_in[:I]))
        yield entry(blk + "ffn_up_exps.weight", (E, I, D), lambda i=i: _experts(ckpt, i, lambda v: v.w_in[I:]))
        yield entry(blk + "ffn_down_exps.weight", (E, D, I), lambda i=i: _experts(ckpt, i, lambda v: v.w_out))


def _experts(ckpt: Checkpoint, layer: int, part) -> torch.Tensor:
    """One block's experts' `part` matrices stacked [E, rows, cols], in float32."""
    c = ckpt.config
    return torch.stack([part(expert_views(ckpt.expert_buffer(layer, e, torch.float32), c.expert))
                        for e in range(c.num_experts)])
