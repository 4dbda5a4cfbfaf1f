"""Attention variants: grouped-query attention (q/k norms, attention sinks, windows, NoPE
temperature) and multi-head latent attention.

Shapes: T new tokens in the step, B sequences, n most new tokens of one sequence, H query
heads, G kv heads, r = H / G, d q/k head dim, dv value dim, L keys per sequence, and for
MLA c the latent (kv_lora_rank), dn / dr the non-rotary / rotary q-k dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..base.model_config import ModelConfig
from .kv_cache import KVCache, StepBatch
from ..kernels import blockdot
from .layers import linear, rms_norm

LATENT_NORM_EPS = 1e-6  # DeepSeek's q/kv latent RMSNorms use their default eps, not the config's


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, batch: StepBatch,
           scale: float, sinks: torch.Tensor | None = None, by_length: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence: q [T, H, d], keys [B, G, L, d], values
    [B, G, L, dv], mask [B, 1, n, L] (None: every query sees every key) -> [T, H, dv].

    Grouped-query attention: query head j reads kv head j // r. The r query heads of a kv
    head become n x r query rows of that head, token by token, so K and V are read where
    they are (copying them r times would cost more than the attention at large batches).
    When every sequence has the same number of new tokens the tokens already are the
    padded layout. `by_length` (keys indexed by position): sequences of very different
    lengths attend in runs, each over its own longest length and most new tokens, instead
    of all over the batch's (StepBatch.key_runs)."""
    T, H, d = q.shape
    B, G, n = len(batch.slots), keys.shape[1], batch.max_new
    r = H // G
    if not batch.uniform:
        q_pad = q.new_zeros(B * n, H, d)
        q_pad[batch.padded_index] = q
        q = q_pad
    if n == 1:  # decode and draft: the r query rows of a kv head are its r heads, already in place
        q_grouped = q.view(B, G, r, d)
    else:
        q_grouped = q.view(B, n, G, r, d).transpose(1, 2).reshape(B, G, n * r, d)
    if mask is not None and r > 1 and n > 1:  # one query row per (token, head); with n = 1 the mask broadcasts
        mask = mask.repeat_interleave(r, dim=2)  # [B, 1, n * r, L]
    sinks = None if sinks is None else sinks.view(G, r)
    runs = batch.key_runs(r) if by_length else [(0, B, keys.shape[2], n)]
    if len(runs) == 1 and runs[0][3] == n:
        length = runs[0][2]
        if length < keys.shape[2]:
            keys, values = keys[:, :, :length], values[:, :, :length]
            mask = None if mask is None else mask[..., :length]
        out = _attend_rows(q_grouped, keys, values, mask, scale, sinks, n, batch.invariant)
    else:  # rows past a run's tokens are padding, dropped below
        out = q.new_empty(B, G, n * r, values.shape[-1])
        for first, end, length, tokens in runs:
            rows = tokens * r
            out[first:end, :, :rows] = _attend_rows(
                q_grouped[first:end, :, :rows], keys[first:end, :, :length], values[first:end, :, :length],
                None if mask is None else mask[first:end, :, :rows, :length], scale, sinks, tokens, batch.invariant)
    dv = out.shape[-1]
    if n == 1:
        return out.reshape(B, H, dv)
    out = out.view(B, G, n, r, dv).transpose(1, 2).reshape(B * n, H, dv)
    return out if batch.uniform else out[batch.padded_index]


def _attend_rows(q, keys, values, mask, scale, sinks, n, invariant=False):
    """One attention call over sequences side by side: q [b, G, rows, d], keys [b, G, L, d].
    `invariant`: each query row summed in one order whatever shares the call (blockdot.attend)."""
    if invariant and sinks is None and q.dtype == torch.float32 and q.device.type == "cpu":
        return blockdot.attend(q, keys, values, mask, scale)
    if sinks is not None:
        b, rows, L = keys.shape[0], q.shape[2], keys.shape[2]
        if mask is None:
            mask = torch.ones(b, 1, 1, L, dtype=torch.bool, device=keys.device)
        keys, values, mask = _with_sink(keys, values, mask.expand(b, 1, rows, L), sinks, n)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def _with_sink(keys, values, mask, sinks, n):
    """One more key per head whose logit is the head's sink and whose value is zero: it
    takes its share of the softmax and adds nothing (GPT-OSS)."""
    B, G, L, _ = keys.shape
    zero = keys.new_zeros(B, G, 1, keys.shape[-1])
    keys = torch.cat([keys, zero], dim=2)
    values = torch.cat([values, values.new_zeros(B, G, 1, values.shape[-1])], dim=2)
    bias = torch.zeros(mask.shape, dtype=keys.dtype, device=keys.device).masked_fill(~mask, float("-inf"))
    rows = mask.shape[2]
    sink = sinks.to(keys.dtype)[:, None, :].expand(G, n, sinks.shape[1]).reshape(1, G, rows, 1).expand(B, G, rows, 1)
    return keys, values, torch.cat([bias.expand(B, G, rows, L), sink], dim=-1)


def gqa(c: ModelConfig, i: int, lw, x: torch.Tensor, batch: StepBatch, cache: KVCache, rope) -> torch.Tensor:
    """Grouped-query attention of layer i on x [T, D]; `rope` is the pass's Rotation, or None in a NoPE layer."""
    a, eps = c.attention, c.rms_norm_eps
    T, d = x.shape[0], a.head_dim
    H, G = a.num_heads, a.num_kv_heads
    qkv = linear(x, lw.qkv, lw.qkv_bias, batch.draft)
    plain = a.qk_norm in ("none", "l2") and a.clip_qkv is None  # l2 comes after the rotation
    if plain and rope is not None:  # q and k side by side: rotated in one go
        # (split_with_sizes: Tensor.split is a Python wrapper around it, twice as slow at batch 1)
        qk, v = qkv.view(T, H + 2 * G, d).split_with_sizes([H + G, G], dim=1)
        q, k = rope.apply(qk).split_with_sizes([H, G], dim=1)
    else:
        q, k, v = qkv.split([H * d, G * d, G * d], dim=-1)
        if a.qk_norm == "full":  # OLMoE: over the whole projection
            q, k = rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        q, k, v = q.reshape(T, H, d), k.reshape(T, G, d), v.reshape(T, G, d)
        if a.qk_norm == "head":  # Qwen3-MoE, GLM-4.5: per head
            q, k = rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)
        if rope is not None:
            q, k = rope.apply(q), rope.apply(k)
    if rope is not None and a.qk_norm == "l2":  # Llama 4: weightless, after the rotation, RoPE layers only
        q, k = rms_norm(q, None, eps), rms_norm(k, None, eps)
    elif rope is None and a.temperature is not None:  # Llama 4's NoPE layers: sharper attention far into the context
        floor_scale, attn_scale = a.temperature
        scales = torch.log1p(torch.floor((batch.positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        q = (q * scales[:, None, None]).to(q.dtype)
    keys, values, mask = cache.write_and_read(i, batch, k, v)
    out = attend(q, keys, values, mask, batch, a.scale, lw.sinks, by_length=not cache.is_windowed(i))
    return linear(out.reshape(T, -1), lw.o, lw.o_bias, batch.draft)


def mla(c: ModelConfig, i: int, lw, x: torch.Tensor, batch: StepBatch, cache: KVCache, rope) -> torch.Tensor:
    """Multi-head latent attention (DeepSeek-V2/V3) of layer i on x [T, D].

    K and V of all heads are up-projections of one latent per token: k_nope = W_uk c,
    v = W_uv c. The cache keeps [c | k_rot] ((kv_lora_rank + qk_rope_dim) per token and
    layer, what MLA exists for) and the up-projections are absorbed: q_nope . (W_uk c) =
    (W_uk^T q_nope) . c, and sum_j p_j W_uv c_j = W_uv (sum_j p_j c_j), so attention runs
    over the latents with one shared kv head and nothing is expanded per position."""
    a = c.attention
    T, H, dn, dr, lat = x.shape[0], a.num_heads, a.qk_nope_dim, a.qk_rope_dim, a.kv_lora_rank
    if lw.q_a is not None:
        q = linear(rms_norm(linear(x, lw.q_a, lw.q_a_bias), lw.q_a_norm, LATENT_NORM_EPS), lw.q_b)
    else:
        q = linear(x, lw.q)
    q_nope, q_rot = q.view(T, H, dn + dr).split([dn, dr], dim=-1)
    latent, k_rot = linear(x, lw.kv_a, lw.kv_a_bias).split([lat, dr], dim=-1)
    latent = rms_norm(latent, lw.kv_a_norm, LATENT_NORM_EPS)
    q_rot, k_rot = rope.apply(q_rot), rope.apply(k_rot[:, None, :])
    w_kv = lw.kv_b.view(H, dn + a.v_head_dim, lat)
    query = torch.cat([torch.einsum("thd,hdc->thc", q_nope, w_kv[:, :dn]), q_rot], dim=-1)  # [T, H, c + dr]
    keys, _, mask = cache.write_and_read(i, batch, torch.cat([latent[:, None, :], k_rot], dim=-1), None)
    out = attend(query, keys, keys[..., :lat], mask, batch, a.scale, by_length=not cache.is_windowed(i))  # [T, H, c]
    out = torch.einsum("thc,hvc->thv", out, w_kv[:, dn:])  # [T, H, dv]
    return linear(out.reshape(T, -1), lw.o, lw.o_bias)


ATTENTION = {"gqa": gqa, "mla": mla}
