"""The weights that stay on the compute device: everything but the routed experts
(embeddings, norms, attention, routers, shared experts, dense MLPs, the LM head), read
from a checkpoint by role and checked against the shapes config.json implies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base.checkpoint import Checkpoint
from ..base.gguf_checkpoint import GGUFCheckpoint
from ..kernels import blockdot
from ..kernels.packed import PackedMatrix

Tensor = torch.Tensor | None


@dataclass
class AttentionWeights:
    """A plain multi-head attention's projections and the LayerNorm before it."""

    norm: torch.Tensor
    norm_bias: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: Tensor = None
    k_bias: Tensor = None
    v_bias: Tensor = None
    o_bias: Tensor = None


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    o: torch.Tensor
    attn_norm_bias: Tensor = None  # LayerNorm families
    mlp_norm_bias: Tensor = None
    qkv: Tensor = None  # GQA: q, k and v rows in one matrix [(H + 2G) d, D], one matmul per layer
    qkv_bias: Tensor = None
    q: Tensor = None  # MLA without a q latent
    o_bias: Tensor = None
    q_norm: Tensor = None
    k_norm: Tensor = None
    sinks: Tensor = None  # [H]
    q_a: Tensor = None  # MLA: [q_lora, D]
    q_a_bias: Tensor = None
    q_a_norm: Tensor = None
    q_b: Tensor = None  # [H * (dn + dr), q_lora]
    kv_a: Tensor = None  # [c + dr, D]
    kv_a_bias: Tensor = None
    kv_a_norm: Tensor = None
    kv_b: Tensor = None  # [H * (dn + dv), c]
    router: Tensor = None  # [E, D]; None in a dense layer
    router_bias: Tensor = None  # [E], added to the logits (GPT-OSS)
    correction_bias: Tensor = None  # [E], shifts the choice only (DeepSeek-V3, GLM-4.5)
    shared_gate_up: Tensor = None  # [2S, D]
    shared_down: Tensor = None  # [D, S]
    shared_expert_gate: Tensor = None  # [1, D] (Qwen2-MoE's sigmoid gate)
    dense_gate_up: Tensor = None  # [2F, D]; a plain (ReLU) MLP: its fc1 [F, D]
    dense_down: Tensor = None  # [D, F]
    dense_in_bias: Tensor = None  # [F] (fc1 / fc2 biases, NLLB)
    dense_out_bias: Tensor = None  # [D]
    cross: AttentionWeights | None = None  # an encoder-decoder model's decoder layers: attention to the source


@dataclass
class ModelWeights:
    """Everything but the routed experts: what stays on the compute device."""

    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights]
    final_norm_bias: Tensor = None
    lm_head_bias: Tensor = None
    encoder_norm: Tensor = None  # an encoder-decoder model's encoder output LayerNorm
    encoder_norm_bias: Tensor = None
    encoder_embed: Tensor = None  # the encoder's token embedding (NLLB: the same `shared` matrix)

    def tensors(self):
        """Every tensor held (a packed matrix's bytes, part by part)."""
        held = [self.embed, self.final_norm, self.final_norm_bias, self.lm_head_bias, self.encoder_norm,
                self.encoder_norm_bias]
        if self.lm_head is not self.embed:
            held.append(self.lm_head)
        if self.encoder_embed is not None and self.encoder_embed is not self.embed:
            held.append(self.encoder_embed)
        for layer in self.layers:
            held += list(vars(layer).values())
            if layer.cross is not None:
                held += list(vars(layer.cross).values())
        for t in held:
            if isinstance(t, torch.Tensor):
                yield t
            elif isinstance(t, PackedMatrix):
                yield from (p.raw for p in t.parts)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @classmethod
    def load(cls, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype,
             draft_dtype: torch.dtype | None = None, as_stored: bool = False) -> ModelWeights:
        """`draft_dtype` (bfloat16): the attention projections and the LM head stay in it where
        the checkpoint stores them so (the draft multiplies them in it; exact passes widen them
        to `dtype`, the very values loading in `dtype` gives: layers.linear). `as_stored`: a
        GGUF file's matrices (embedding, attention, LM head, shared experts, dense MLPs) stay
        in their blocks, and a safetensors checkpoint's bfloat16 ones in bfloat16, where the
        block kernels compute them (kernels/packed.py)."""
        c = ckpt.config
        D, V = c.hidden_size, c.vocab_size
        loader = _Loader(ckpt, device, dtype, draft_dtype, as_stored)
        layers = [loader.layer(i) for i in range(c.num_layers)]
        embed = loader.matrix("embed", (V, D))
        head = None if c.tie_word_embeddings else loader.dense("lm_head", (V, D), required=False)
        lm_head = embed if head is None else column_major(head)  # none in the file: the embedding is the head
        encoder = c.seq2seq is not None
        encoder_embed = loader.get("encoder_embed", (V, D)) if encoder else None
        if encoder and ckpt.find(("model.shared.weight",)) and ckpt.find(("model.encoder.embed_tokens.weight",)) is None \
                and ckpt.find(("model.decoder.embed_tokens.weight",)) is None:
            encoder_embed = embed  # one shared matrix in the file: one on the device
        return cls(embed=embed, final_norm=loader.get("final_norm", (D,)), lm_head=lm_head, layers=layers,
                   final_norm_bias=loader.get("final_norm_bias", (D,), required=False),
                   lm_head_bias=loader.get("lm_head_bias", (V,), required=False),
                   encoder_norm=loader.get("encoder_norm", (D,)) if encoder else None,
                   encoder_norm_bias=loader.get("encoder_norm_bias", (D,)) if encoder else None,
                   encoder_embed=encoder_embed)


def column_major(w: torch.Tensor | PackedMatrix) -> torch.Tensor | PackedMatrix:
    """w [out, in] as a view of [in, out] memory, for F.linear: the CPU's matmul then walks
    the outputs contiguously. Measured on this project's shapes (float32, one thread): a
    4096 x 256 LM head 2x faster at one row, attention's 512 x 256 projection 1.3x at 1
    to 16 rows and 1.1x at 176, never slower; the products differ from row-major ones
    only in rounding. A packed matrix stays as it is (its kernel walks rows)."""
    return w if isinstance(w, PackedMatrix) else w.t().contiguous().t()


def rows_of(parts: list, dtype: torch.dtype) -> torch.Tensor | PackedMatrix:
    """The parts' rows in one matrix: packed where every part is, else a tensor (in the
    compute dtype where the parts' dtypes differ)."""
    if all(isinstance(p, PackedMatrix) for p in parts):
        return PackedMatrix.cat(parts)
    parts = [p.dequantize(dtype) if isinstance(p, PackedMatrix) else p for p in parts]
    if len({p.dtype for p in parts}) > 1:  # one of them not stored in the draft dtype: all in the compute dtype
        parts = [p.to(dtype) for p in parts]
    return torch.cat(parts)


class _Loader:
    """Reads one layer's tensors by role (base/checkpoint.py names them), on the device."""

    def __init__(self, ckpt: Checkpoint, device, dtype, draft_dtype=None, as_stored=False):
        self.ckpt, self.device, self.dtype, self.draft_dtype = ckpt, device, dtype, draft_dtype
        self.as_stored = as_stored
        self.c = ckpt.config

    def matrix(self, role, shape, layer=None, required=True, keep=None):
        """A matrix the model multiplies (or looks rows up in): where `as_stored`, packed in
        the checkpoint's encoding when the block kernels compute it (a GGUF file's blocks, a
        bfloat16 tensor), else `get`."""
        if not self.as_stored:
            return self.get(role, shape, layer, required, keep)
        if isinstance(self.ckpt, GGUFCheckpoint):
            stored = self.ckpt.stored_matrix(role, shape, layer)
            if stored is not None and blockdot.computes(stored[1]):
                return PackedMatrix.of(stored[0], stored[1], *shape)
            return self.get(role, shape, layer, required, keep)
        t = self.ckpt.get(role, shape, layer, required)  # read once, kept as stored or placed
        if t is not None and t.dtype == torch.bfloat16:
            return PackedMatrix.of(t.contiguous().view(torch.uint8), "BF16", *shape)
        return self._placed(t, keep)

    def get(self, role, shape, layer=None, required=True, keep=None):
        """The tensor on the device in the compute dtype; in `keep` instead where the
        checkpoint stores it in that dtype."""
        return self._placed(self.ckpt.get(role, shape, layer, required), keep)

    def _placed(self, t, keep=None):
        if t is None:
            return None
        return t.to(device=self.device, dtype=keep if keep is not None and t.dtype == keep else self.dtype)

    def dense(self, role, shape, layer=None, required=True):
        """A dense matrix the draft multiplies: kept in `draft_dtype` where the checkpoint
        stores it so (widening it back is then exact)."""
        return self.matrix(role, shape, layer, required, keep=self.draft_dtype)

    def pair(self, gate_role, up_role, down_role, inter, i):
        """A SwiGLU MLP as gate_up [2F, D] (gate rows first) and down [D, F]."""
        D = self.c.hidden_size
        gate_up = rows_of([self.matrix(gate_role, (inter, D), i), self.matrix(up_role, (inter, D), i)], self.dtype)
        return gate_up, self.matrix(down_role, (D, inter), i)

    def layer(self, i: int) -> LayerWeights:
        c, D = self.c, self.c.hidden_size
        lw = LayerWeights(
            attn_norm=self.get("attn_norm", (D,), i), mlp_norm=self.get("mlp_norm", (D,), i),
            o=column_major((self.matrix if c.attention.kind == "mla" else self.dense)(
                "o", (D, c.num_heads * c.attention.v_head_dim), i)),
            o_bias=self.get("o_bias", (D,), i, required=False),
        )
        if c.family.norm == "layer":
            lw.attn_norm_bias, lw.mlp_norm_bias = self.get("attn_norm_bias", (D,), i), self.get("mlp_norm_bias", (D,), i)
        if c.attention.kind == "mla":
            self.mla(lw, i)
        else:
            self.gqa(lw, i)
        if c.moe_layers[i]:
            self.moe(lw, i)
        elif c.expert.gated:
            lw.dense_gate_up, lw.dense_down = self.pair("dense_gate_proj", "dense_up_proj", "dense_down_proj",
                                                        c.dense_intermediate_size, i)
        else:
            F_ = c.dense_intermediate_size
            lw.dense_gate_up, lw.dense_down = self.get("dense_fc1", (F_, D), i), self.get("dense_fc2", (D, F_), i)
            lw.dense_in_bias, lw.dense_out_bias = self.get("dense_fc1_bias", (F_,), i), self.get("dense_fc2_bias", (D,), i)
        if c.seq2seq and i >= c.encoder_layers:
            lw.cross = self.cross_attention(i)
        return lw

    def cross_attention(self, i: int) -> AttentionWeights:
        D = self.c.hidden_size
        return AttentionWeights(
            norm=self.get("cross_norm", (D,), i), norm_bias=self.get("cross_norm_bias", (D,), i),
            **{p: self.get(f"cross_{p}", (D, D), i) for p in "qkvo"},
            **{f"{p}_bias": self.get(f"cross_{p}_bias", (D,), i, required=False) for p in "qkvo"},
        )

    def gqa(self, lw: LayerWeights, i: int) -> None:
        a, D = self.c.attention, self.c.hidden_size
        q_out, kv_out = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        parts = [self.dense(role, (n, D), i) for role, n in (("q", q_out), ("k", kv_out), ("v", kv_out))]
        lw.qkv = column_major(rows_of(parts, self.dtype))
        biases = [self.get(role + "_bias", (n,), i, required=False)
                  for role, n in (("q", q_out), ("k", kv_out), ("v", kv_out))]
        if any(b is not None for b in biases):  # a missing one adds zeros: x.w + 0 is x.w exactly
            zeros = dict(dtype=self.dtype, device=self.device)
            lw.qkv_bias = torch.cat([b if b is not None else torch.zeros(n, **zeros)
                                     for b, n in zip(biases, (q_out, kv_out, kv_out))])
        norm_q, norm_k = {"head": (a.head_dim, a.head_dim), "full": (q_out, kv_out)}.get(a.qk_norm, (None, None))
        if norm_q:
            lw.q_norm, lw.k_norm = self.get("q_norm", (norm_q,), i), self.get("k_norm", (norm_k,), i)
        if a.sinks:
            lw.sinks = self.get("sinks", (a.num_heads,), i)

    def mla(self, lw: LayerWeights, i: int) -> None:
        a, D = self.c.attention, self.c.hidden_size
        q_out = a.num_heads * (a.qk_nope_dim + a.qk_rope_dim)
        if a.q_lora_rank:
            lw.q_a, lw.q_a_norm = self.matrix("q_a", (a.q_lora_rank, D), i), self.get("q_a_norm", (a.q_lora_rank,), i)
            lw.q_a_bias = self.get("q_a_bias", (a.q_lora_rank,), i, required=False)
            lw.q_b = self.matrix("q_b", (q_out, a.q_lora_rank), i)
        else:
            lw.q = self.matrix("q", (q_out, D), i)
        lw.kv_a = self.matrix("kv_a", (a.kv_lora_rank + a.qk_rope_dim, D), i)
        lw.kv_a_bias = self.get("kv_a_bias", (a.kv_lora_rank + a.qk_rope_dim,), i, required=False)
        lw.kv_a_norm = self.get("kv_a_norm", (a.kv_lora_rank,), i)
        lw.kv_b = self.get("kv_b", (a.num_heads * (a.qk_nope_dim + a.v_head_dim), a.kv_lora_rank), i)

    def moe(self, lw: LayerWeights, i: int) -> None:
        c, D = self.c, self.c.hidden_size
        E = c.num_experts
        # routers in float32 whatever the compute dtype (as DeepSeek's reference keeps them): they are
        # small, and a pick decided by a rounding of the router would change which expert moves
        lw.router = self.ckpt.get("router", (E, D), i).to(self.device, torch.float32)
        if c.router.logit_bias:
            lw.router_bias = self.ckpt.get("router_bias", (E,), i).to(self.device, torch.float32)
        if c.router.correction_bias:
            lw.correction_bias = self.ckpt.get("correction_bias", (E,), i).to(self.device, torch.float32)
        if c.shared_expert_intermediate_size:
            lw.shared_gate_up, lw.shared_down = self.pair("shared_gate_proj", "shared_up_proj", "shared_down_proj",
                                                          c.shared_expert_intermediate_size, i)
            if c.family.shared == "gated":
                lw.shared_expert_gate = self.get("shared_expert_gate", (1, D), i)
