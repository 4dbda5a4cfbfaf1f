"""The MoE decoder-only transformer, top to bottom.

Shapes: T new tokens in the step (all sequences together), D hidden, V vocabulary.

Pre-norm blocks: h += attention(norm(h)); h += mlp(norm(h)), where mlp is a routed MoE
block (plus an optional shared expert) or, in layers that are not MoE, a dense SwiGLU.
What differs between families is data in `ModelConfig` and small named pieces: the norm
(layers.py), the attention variant and its cache layout (attention.py), RoPE (rope.py),
the router (routers.py) and the expert activation. Routed experts are not held here: an
`ExpertBackend` (a policy) runs them.
"""

from __future__ import annotations

import torch

from ..base.model_config import ModelConfig
from .attention import ATTENTION
from .kv_cache import KVCache, LayerCacheSpec, StepBatch
from .layers import as_float32, embedding, linear, norm, swiglu
from .moe import ExpertBackend, Routing, expert_forward
from .rope import RotaryTable
from .routers import route
from .weights import LayerWeights, ModelWeights


class MoETransformer:
    """forward(tokens, batch, cache, experts) -> final hidden states [T, D]."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, device: torch.device, dtype: torch.dtype,
                 invariant: bool = False):
        self.config, self.weights = config, weights
        self.device, self.dtype = device, dtype
        self.invariant = invariant  # every pass's attention batch-invariant (StepBatch.invariant)
        self.rotary = RotaryTable(config.rope, device)
        self.attention = ATTENTION[config.attention.kind]

    def new_cache(self, num_slots: int, max_len: int | None = None, rollback: int = 16) -> KVCache:
        """A KV cache of `num_slots` sequences of up to `max_len` positions (default: the
        model's context); `rollback`: the most positions a step may write and then truncate."""
        a = self.config.attention
        if a.kind == "mla":  # the latent and the rotary key, one "head" shared by all query heads
            shape = dict(heads=1, k_dim=a.kv_lora_rank + a.qk_rope_dim, v_dim=0)
        else:
            shape = dict(heads=a.num_kv_heads, k_dim=a.head_dim, v_dim=a.v_head_dim)
        layers = [LayerCacheSpec(**shape, window=w) for w in self.config.windows]
        return KVCache(layers, num_slots, max_len or self.config.max_position_embeddings, self.dtype, self.device,
                       rollback)

    def step_batch(self, slots, starts, counts, draft: bool = False) -> StepBatch:
        return StepBatch.build(slots, starts, counts, self.device, draft, self.invariant)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, batch: StepBatch, cache: KVCache, experts: ExpertBackend) -> torch.Tensor:
        c = self.config
        cache.reserve(batch.kv_len)
        rope = self.rotary.rotation(batch.positions, self.dtype)
        h = embedding(tokens, self.weights.embed).to(self.dtype)  # [T, D]
        for i, lw in enumerate(self.weights.layers):
            x = self.norm(h, lw.attn_norm, lw.attn_norm_bias)
            h = h + self.attention(c, i, lw, x, batch, cache, rope if c.rope_layers[i] else None)
            h = h + self.mlp(i, lw, self.norm(h, lw.mlp_norm, lw.mlp_norm_bias), experts)
            experts.after_layer(i, h)
        cache.commit(batch)
        return self.norm(h, self.weights.final_norm, self.weights.final_norm_bias)

    def norm(self, x, weight, bias=None) -> torch.Tensor:
        return norm(self.config.family.norm, x, weight, bias, self.config.rms_norm_eps, self.invariant)

    def logits(self, hidden: torch.Tensor, draft: bool = False) -> torch.Tensor:
        """[n, D] final hidden states -> [n, V] float32 logits (`draft`: a draft pass's, see layers.linear)."""
        return as_float32(linear(hidden, self.weights.lm_head, self.weights.lm_head_bias, draft))

    def mlp(self, i, lw: LayerWeights, x, experts: ExpertBackend) -> torch.Tensor:
        if lw.router is None:
            return dense_mlp(self.config, lw, x)
        out = experts.run_moe(i, x, route_block(self.config, lw, x, self.invariant))
        if lw.shared_gate_up is not None:  # always on the device: never routed, never fetched
            shared = swiglu(x, lw.shared_gate_up, lw.shared_down)
            if lw.shared_expert_gate is not None:  # Qwen2-MoE gates it per token
                shared = torch.sigmoid(linear(x, lw.shared_expert_gate)) * shared
            out = out + shared
        return out


def dense_mlp(config: ModelConfig, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    """A layer that is not MoE: SwiGLU, or for families with plain experts (NLLB) fc1 /
    the experts' activation / fc2 with biases."""
    if config.expert.gated:
        return swiglu(x, lw.dense_gate_up, lw.dense_down)
    return expert_forward(config.expert, x, lambda t: linear(t, lw.dense_gate_up),
                          lambda t: linear(t, lw.dense_down), lw.dense_in_bias, lw.dense_out_bias)


def route_block(config: ModelConfig, lw: LayerWeights, x: torch.Tensor, invariant: bool = False) -> Routing:
    """The family's router on a MoE block's (normed) input x [T, D]."""
    return route(config.router, x, lw.router, lw.router_bias, lw.correction_bias, invariant)
