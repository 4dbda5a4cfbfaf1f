"""The MoE decoder-only transformer, top to bottom.

Shapes: T new tokens in the step (all sequences together), B sequences, D hidden,
H query heads, G kv heads, d head dim, L keys per sequence, V vocabulary.

Pre-norm blocks: h += attention(norm(h)); h += mlp(norm(h)), where mlp is a routed MoE
block (plus an optional gated shared expert) or, in layers that are not MoE, a dense
SwiGLU. Routed experts are not held here: an `ExpertBackend` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..base.checkpoint import Checkpoint
from ..base.config import ModelConfig
from .kv_cache import KVCache, StepBatch
from .layers import RotaryTable, apply_rotary, rms_norm, swiglu
from .moe import ExpertBackend, route


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    mlp_norm: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    router: torch.Tensor | None = None  # [E, D]; None in a dense layer
    shared_gate_up: torch.Tensor | None = None  # [2S, D]
    shared_down: torch.Tensor | None = None  # [D, S]
    shared_expert_gate: torch.Tensor | None = None  # [1, D]
    dense_gate_up: torch.Tensor | None = None  # [2F, D]
    dense_down: torch.Tensor | None = None  # [D, F]


@dataclass
class ModelWeights:
    """Everything but the routed experts: what stays on the compute device."""

    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights]

    def tensors(self):
        yield from (self.embed, self.final_norm)
        if self.lm_head is not self.embed:
            yield self.lm_head
        for layer in self.layers:
            yield from (t for t in vars(layer).values() if t is not None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @classmethod
    def load(cls, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> ModelWeights:
        c = ckpt.config
        D, V = c.hidden_size, c.vocab_size
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

        def get(role, shape, layer=None, required=True):
            t = ckpt.get(role, shape, layer, required)
            return None if t is None else t.to(device=device, dtype=dtype)

        def pair(gate_role, up_role, down_role, inter, i):
            gate_up = torch.cat([get(gate_role, (inter, D), i), get(up_role, (inter, D), i)])
            return gate_up, get(down_role, (D, inter), i)

        layers = []
        for i in range(c.num_layers):
            norm_q, norm_k = {"none": (None, None), "head": (c.head_dim, c.head_dim), "full": (q_out, kv_out)}[
                c.family.qk_norm
            ]
            lw = LayerWeights(
                attn_norm=get("attn_norm", (D,), i),
                q=get("q", (q_out, D), i), k=get("k", (kv_out, D), i), v=get("v", (kv_out, D), i),
                o=get("o", (D, q_out), i),
                mlp_norm=get("mlp_norm", (D,), i),
                q_bias=get("q_bias", (q_out,), i, required=False),
                k_bias=get("k_bias", (kv_out,), i, required=False),
                v_bias=get("v_bias", (kv_out,), i, required=False),
                o_bias=get("o_bias", (D,), i, required=False),
                q_norm=get("q_norm", (norm_q,), i) if norm_q else None,
                k_norm=get("k_norm", (norm_k,), i) if norm_k else None,
            )
            if c.moe_layers[i]:
                lw.router = get("router", (c.num_experts, D), i)
                if c.shared_expert_intermediate_size:
                    S = c.shared_expert_intermediate_size
                    lw.shared_gate_up, lw.shared_down = pair("shared_gate_proj", "shared_up_proj", "shared_down_proj", S, i)
                    lw.shared_expert_gate = get("shared_expert_gate", (1, D), i)
            else:
                F_ = c.dense_intermediate_size
                lw.dense_gate_up, lw.dense_down = pair("dense_gate_proj", "dense_up_proj", "dense_down_proj", F_, i)
            layers.append(lw)
        embed = get("embed", (V, D))
        if c.tie_word_embeddings or not ckpt.has("lm_head.weight"):
            lm_head = embed
        else:
            lm_head = get("lm_head", (V, D))
        return cls(embed=embed, final_norm=get("final_norm", (D,)), lm_head=lm_head, layers=layers)


class MoETransformer:
    """forward(tokens, batch, cache, experts) -> final hidden states [T, D]."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, device: torch.device, dtype: torch.dtype):
        self.config, self.weights = config, weights
        self.device, self.dtype = device, dtype
        self.rotary = RotaryTable(config.head_dim, config.rope_theta, device)

    def new_cache(self, num_slots: int, max_len: int | None = None) -> KVCache:
        """A KV cache of `num_slots` sequences of up to `max_len` positions (default: the model's)."""
        c = self.config
        return KVCache(
            c.num_layers, num_slots, c.num_kv_heads, c.head_dim, max_len or c.max_position_embeddings,
            self.dtype, self.device,
        )

    def step_batch(self, slots, starts, counts) -> StepBatch:
        return StepBatch.build(slots, starts, counts, self.device, self.config.sliding_window)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, batch: StepBatch, cache: KVCache, experts: ExpertBackend) -> torch.Tensor:
        cache.reserve(batch.kv_len)
        cos, sin = self.rotary.lookup(batch.positions, self.dtype)
        h = F.embedding(tokens, self.weights.embed)  # [T, D]
        for i, lw in enumerate(self.weights.layers):
            h = h + self.attention(i, lw, rms_norm(h, lw.attn_norm, self.config.rms_norm_eps), batch, cache, cos, sin)
            h = h + self.mlp(i, lw, rms_norm(h, lw.mlp_norm, self.config.rms_norm_eps), experts)
            experts.after_layer(i, h)
        cache.commit(batch)
        return rms_norm(h, self.weights.final_norm, self.config.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, D] final hidden states -> [n, V] float32 logits."""
        return F.linear(hidden, self.weights.lm_head).float()

    def attention(self, i, lw: LayerWeights, x, batch: StepBatch, cache: KVCache, cos, sin) -> torch.Tensor:
        c = self.config
        T, H, G, d = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        q, k, v = F.linear(x, lw.q, lw.q_bias), F.linear(x, lw.k, lw.k_bias), F.linear(x, lw.v, lw.v_bias)
        if c.family.qk_norm == "full":  # OLMoE: over the whole projection
            q, k = rms_norm(q, lw.q_norm, c.rms_norm_eps), rms_norm(k, lw.k_norm, c.rms_norm_eps)
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q, k, v = q.view(T, H, d), k.view(T, G, d), v.view(T, G, d)
        if c.family.qk_norm == "head":  # Qwen3-MoE: per head
            q, k = rms_norm(q, lw.q_norm, c.rms_norm_eps), rms_norm(k, lw.k_norm, c.rms_norm_eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        keys, values = cache.write_and_read(i, batch, k, v)  # [B, G, L, d]
        B, n, r = len(batch.slots), batch.max_new, H // G
        q_pad = q.new_zeros(B * n, H, d)
        q_pad[batch.padded_index] = q
        # Grouped-query attention: query head j reads kv head j // r. The r query heads of
        # a kv head become r x n query rows of that head, so K and V are read where they
        # are (copying them r times would cost more than the attention at large batches).
        q_grouped = q_pad.view(B, n, G, r, d).permute(0, 2, 3, 1, 4).reshape(B, G, r * n, d)
        mask = batch.mask if r == 1 else batch.mask.repeat(1, 1, r, 1)  # [B, 1, r * n, L]
        out = F.scaled_dot_product_attention(q_grouped, keys, values, attn_mask=mask)  # [B, G, r * n, d]
        out = out.view(B, G, r, n, d).permute(0, 3, 1, 2, 4).reshape(B * n, H * d)[batch.padded_index]
        return F.linear(out, lw.o, lw.o_bias)

    def mlp(self, i, lw: LayerWeights, x, experts: ExpertBackend) -> torch.Tensor:
        c = self.config
        if lw.router is None:
            return swiglu(x, lw.dense_gate_up, lw.dense_down)
        routing = route(x, lw.router, c.top_k, c.renormalize_topk)
        out = experts.run_moe(i, x, routing)
        if lw.shared_gate_up is not None:
            gate = torch.sigmoid(F.linear(x, lw.shared_expert_gate))
            out = out + gate * swiglu(x, lw.shared_gate_up, lw.shared_down)
        return out
