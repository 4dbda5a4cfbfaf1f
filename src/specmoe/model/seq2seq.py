"""The encoder-decoder MoE transformer (NLLB-MoE), top to bottom.

Shapes: S source tokens of the sequences being admitted (all together), T new decoder
tokens in the step, B sequences, D hidden, H heads, d head dim, Ls source positions.

Layers 0 .. E-1 are the encoder and E .. N-1 the decoder: one numbering, so an expert is
(layer, e) in the tiers and the policies whichever stack holds it. Pre-LayerNorm blocks:

    encoder  h += self_attention(norm(h))   bidirectional over the source
             h += mlp(norm(h))
    decoder  h += self_attention(norm(h))   causal, through the KV cache (as decoder-only)
             h += cross_attention(norm(h))  over the source's K/V, cached at admission
             h += mlp(norm(h))

where mlp is a routed MoE block or a dense fc1 / ReLU / fc2. Tokens enter as
embedding * embed_scale + a sinusoidal position (fairseq's, offset past the pad id).
`encode` runs once per request when it is admitted and leaves every decoder layer's
cross-attention K/V in the cache beside the self-attention entries; decoding, drafting
and verifying then run `forward`, the decoder only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..base.model_config import ModelConfig
from .attention import attend, gqa
from .kv_cache import KVCache, LayerCacheSpec, StepBatch
from .layers import embedding, linear
from .moe import ExpertBackend
from .transformer import MoETransformer
from .weights import AttentionWeights, ModelWeights


def sinusoidal_table(rows: int, dim: int, pad: int) -> torch.Tensor:
    """fairseq's sinusoidal positions [rows, dim]: sin over the first half of the dims,
    cos over the second; the pad row is zero (a pad token gets no position)."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(rows, 1)], dim=1)
    table[pad] = 0
    return table


def padded(t: torch.Tensor, batch: StepBatch) -> torch.Tensor:
    """[T, H, d] rows of a batch laid out sequence by sequence -> [B, H, n, d] (zeros past a sequence's end)."""
    B, n = len(batch.slots), batch.max_new
    out = t.new_zeros(B * n, *t.shape[1:])
    out[batch.padded_index] = t
    return out.view(B, n, *t.shape[1:]).transpose(1, 2)


class EncoderDecoderCache(KVCache):
    """The decoder layers' self-attention KV cache (entry j: decoder layer j) and, beside
    it, their cross-attention K/V of each slot's source, [slots, H, Ls, d] per layer,
    written once by the encoder pass. Truncation (a rejected draft) touches only the
    self-attention entries: the source does not change while a request decodes."""

    def __init__(self, layers: list[LayerCacheSpec], num_slots: int, max_len: int, dtype, device,
                 rollback: int, max_source_len: int):
        super().__init__(layers, num_slots, max_len, dtype, device, rollback)
        self.max_source_len = max_source_len
        shape = [(num_slots, s.heads, max_source_len, s.k_dim) for s in layers]
        self.cross_k = [torch.zeros(sh, dtype=dtype, device=device) for sh in shape]
        self.cross_v = [torch.zeros(sh, dtype=dtype, device=device) for sh in shape]
        self.source_lengths = [0] * num_slots

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.numel() for t in self.cross_k + self.cross_v) * self._elem()

    def free(self, slot: int) -> None:
        self.source_lengths[slot] = 0
        super().free(slot)

    def write_source(self, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """The source K/V [S, H, d] of decoder layer `layer` for the batch's slots."""
        self.cross_k[layer][batch.token_slots, :, batch.positions] = k
        self.cross_v[layer][batch.token_slots, :, batch.positions] = v
        for slot, n in zip(batch.slots, batch.counts):
            self.source_lengths[slot] = n

    def read_source(self, layer: int, batch: StepBatch):
        """Keys and values [B, H, Ls, d] of the step's sequences' sources and the mask
        [B, 1, n, Ls] that hides positions past each source's end."""
        lengths = torch.tensor([self.source_lengths[s] for s in batch.slots], device=self.device)
        width = int(lengths.max())
        mask = torch.arange(width, device=self.device)[None, :] < lengths[:, None]
        mask = mask[:, None, None, :].expand(len(batch.slots), 1, batch.max_new, width)
        index = batch.slot_index
        return self.cross_k[layer][index, :, :width], self.cross_v[layer][index, :, :width], mask


class EncoderDecoderTransformer(MoETransformer):
    """encode(slots, sources, cache, experts) once per request; then forward(tokens, batch,
    cache, experts) -> the decoder's final hidden states [T, D], as `MoETransformer`."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, device: torch.device, dtype: torch.dtype,
                 invariant: bool = False):
        super().__init__(config, weights, device, dtype, invariant)
        s = config.seq2seq
        self.encoder_ids = range(config.encoder_layers)
        rows = config.max_position_embeddings + s.pad_token_id + 2
        self.positions = sinusoidal_table(rows, config.hidden_size, s.pad_token_id).to(device, dtype)

    def new_cache(self, num_slots: int, max_len: int | None = None, rollback: int = 16) -> EncoderDecoderCache:
        a, max_len = self.config.attention, max_len or self.config.max_position_embeddings
        layers = [LayerCacheSpec(a.num_kv_heads, a.head_dim, a.v_head_dim) for _ in self.config.decoder_layer_ids]
        return EncoderDecoderCache(layers, num_slots, max_len, self.dtype, self.device, rollback, max_len)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """embedding * scale + position; positions count from pad + 1, a pad token gets none."""
        s = self.config.seq2seq
        rows = torch.where(tokens == s.pad_token_id, s.pad_token_id, positions + s.pad_token_id + 1)
        return embedding(tokens, table) * s.embed_scale + self.positions[rows]

    @torch.inference_mode()
    def encode(self, slots: list[int], sources: list[list[int]], cache: EncoderDecoderCache,
               experts: ExpertBackend) -> torch.Tensor:
        """The encoder over the sources of the sequences being admitted, in one pass (each
        MoE block runs once for all their tokens); every decoder layer's cross K/V of them
        is left in `cache`. Returns the encoder output [S, D]."""
        batch = StepBatch.build(slots, [0] * len(slots), [len(s) for s in sources], self.device)
        tokens = torch.tensor([t for s in sources for t in s], dtype=torch.long, device=self.device)
        counts = torch.tensor(batch.counts, device=self.device)
        mask = torch.arange(batch.max_new, device=self.device)[None, :] < counts[:, None]
        mask = mask[:, None, None, :].expand(len(slots), 1, batch.max_new, batch.max_new)  # bidirectional
        h = self.embed(tokens, batch.positions, self.weights.encoder_embed)
        for i in self.encoder_ids:
            lw = self.weights.layers[i]
            x = self.norm(h, lw.attn_norm, lw.attn_norm_bias)
            h = h + self.source_attention(x, lw, batch, mask)
            h = h + self.mlp(i, lw, self.norm(h, lw.mlp_norm, lw.mlp_norm_bias), experts)
            if i + 1 < self.config.encoder_layers:  # no prediction across the stacks
                experts.after_layer(i, h)
        source = self.norm(h, self.weights.encoder_norm, self.weights.encoder_norm_bias)
        for j, i in enumerate(self.config.decoder_layer_ids):
            cross = self.weights.layers[i].cross
            cache.write_source(j, batch, *(self.heads(F.linear(source, w, b)) for w, b in
                                           ((cross.k, cross.k_bias), (cross.v, cross.v_bias))))
        return source

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], -1, self.config.attention.head_dim)

    def source_attention(self, x: torch.Tensor, lw, batch: StepBatch, mask: torch.Tensor) -> torch.Tensor:
        """The encoder's self-attention: every source token sees its whole source."""
        q, k, v = (self.heads(t) for t in linear(x, lw.qkv, lw.qkv_bias).chunk(3, dim=-1))  # q, k, v rows in one matrix
        out = attend(q, padded(k, batch), padded(v, batch), mask, batch, self.config.attention.scale)
        return linear(out.reshape(x.shape[0], -1), lw.o, lw.o_bias)

    def cross_attention(self, j: int, w: AttentionWeights, x: torch.Tensor, batch: StepBatch,
                        cache: EncoderDecoderCache) -> torch.Tensor:
        """Decoder layer j's attention to the source: queries from the decoder, keys and
        values as the encoder pass cached them."""
        keys, values, mask = cache.read_source(j, batch)
        out = attend(self.heads(F.linear(x, w.q, w.q_bias)), keys, values, mask, batch, self.config.attention.scale)
        return F.linear(out.reshape(x.shape[0], -1), w.o, w.o_bias)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, batch: StepBatch, cache: EncoderDecoderCache,
                experts: ExpertBackend) -> torch.Tensor:
        c = self.config
        cache.reserve(batch.kv_len)
        h = self.embed(tokens, batch.positions, self.weights.embed)  # [T, D]
        for j, i in enumerate(c.decoder_layer_ids):
            lw = self.weights.layers[i]
            h = h + gqa(c, j, lw, self.norm(h, lw.attn_norm, lw.attn_norm_bias), batch, cache, None)
            h = h + self.cross_attention(j, lw.cross, self.norm(h, lw.cross.norm, lw.cross.norm_bias), batch, cache)
            h = h + self.mlp(i, lw, self.norm(h, lw.mlp_norm, lw.mlp_norm_bias), experts)
            experts.after_layer(i, h)
        cache.commit(batch)
        return self.norm(h, self.weights.final_norm, self.weights.final_norm_bias)
