"""Tiny random NLLB-MoE checkpoints written by transformers, and transformers' answers.

The model: vocab 128, d_model 32, 4 heads, FFN 24, 8 experts top-2; encoder of 2 layers
(layer 1 MoE), decoder of 3 layers (layer 1 MoE), moe_token_dropout 0.2 (inference scales
expert outputs by 0.8), scaled embeddings, sinusoidal positions past pad id 1. Special
ids: bos 0, pad 1, eos 2 (also the decoder start); ids 3 and 4 play the language codes.

transformers 5.x's `NllbMoeExperts.forward` one-hot encodes the top-1 mask's values and so
runs expert_0 and expert_1 on every token, whatever the router chose (transformers 4.x and
fairseq run each token's top-1 and top-2 experts). The reference here is transformers
with fairseq's expert mixture put back (`fairseq_experts`), the semantics NLLB-MoE was
trained with; everything else is transformers' own code.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

PAD_ID, EOS_ID = 1, 2
LANGS = (3, 4)  # "source" and "target" language tokens
VOCAB = 128
CONFIG = dict(
    vocab_size=VOCAB, d_model=32, max_position_embeddings=128, encoder_layers=2, decoder_layers=3,
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24,
    num_experts=8, encoder_sparse_step=2, decoder_sparse_step=2, moe_token_dropout=0.2, dropout=0.0,
    attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
    pad_token_id=PAD_ID, bos_token_id=0, eos_token_id=EOS_ID, decoder_start_token_id=EOS_ID,
    second_expert_policy="all", moe_eval_capacity_token_fraction=1.0, router_bias=False,
    tie_word_embeddings=False,  # a tied head echoes the input token of a random model
)


def fairseq_experts(self, hidden_states, router_mask, router_probs):
    """Each token through its top-1 and top-2 experts (router_probs > 0), weighted by
    their normalised probabilities, times 1 - moe_token_dropout (eval)."""
    out = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        rows = (router_probs[:, e] > 0).nonzero().squeeze(-1)
        if len(rows):
            y = self[f"expert_{e}"](hidden_states[rows]) * router_probs[rows, e, None]
            out.index_add_(0, rows, (y * (1 - self.moe_token_dropout)).to(out.dtype))
    return out


@contextlib.contextmanager
def fairseq_semantics():
    from transformers.models.nllb_moe import modeling_nllb_moe as m

    original = m.NllbMoeExperts.forward
    m.NllbMoeExperts.forward = fairseq_experts
    try:
        yield
    finally:
        m.NllbMoeExperts.forward = original


@torch.no_grad()
def make_nllb_checkpoint(out_dir, seed: int = 0, **overrides) -> Path:
    """A tiny random NLLB-MoE written by `save_pretrained` (float32)."""
    import transformers

    out = Path(out_dir)
    config = transformers.NllbMoeConfig(**{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = transformers.NllbMoeForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda t: t[0]):
        noise = torch.randn(param.shape, generator=gen)
        if "layer_norm" in name and name.endswith("weight"):
            param.copy_(1.0 + 0.1 * noise)
        elif name.endswith("shared.weight"):  # token identity dominates the residual stream
            param.copy_(noise)
        else:
            param.copy_(0.15 * noise)
    model.config.architectures = ["NllbMoeForConditionalGeneration"]
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=0, eos_token_id=EOS_ID, pad_token_id=PAD_ID, decoder_start_token_id=EOS_ID)
    model.save_pretrained(out, safe_serialization=True)
    return out


@functools.lru_cache(maxsize=4)
def _model(path: str):
    import transformers

    return transformers.NllbMoeForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def padded_batch(sources: list[list[int]]):
    width = max(map(len, sources))
    ids = torch.tensor([s + [PAD_ID] * (width - len(s)) for s in sources])
    return ids, (ids != PAD_ID).long()


@torch.no_grad()
def hf_encoder_outputs(path, sources: list[list[int]]) -> list[torch.Tensor]:
    """The encoder's last hidden state [len_i, D] of each source, run as one padded batch."""
    ids, mask = padded_batch(sources)
    with fairseq_semantics():
        out = _model(str(path)).get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    return [row[: len(s)] for row, s in zip(out, sources)]


@torch.no_grad()
def hf_decoder_logits(path, sources: list[list[int]], targets: list[list[int]]) -> list[torch.Tensor]:
    """Logits [len_i, V] of each decoder input (teacher forcing), one pass per pair."""
    model, out = _model(str(path)), []
    with fairseq_semantics():
        for src, tgt in zip(sources, targets):
            out.append(model(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([tgt])).logits[0])
    return out


@torch.no_grad()
def hf_translate(path, sources: list[list[int]], forced: int, n: int) -> list[list[int]]:
    """transformers' greedy `generate` of the padded batch, the first token forced to
    `forced` (NLLB's target language); the tokens after [start, forced], up to n, eos included."""
    ids, mask = padded_batch(sources)
    with fairseq_semantics():
        gen = _model(str(path)).generate(input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1,
                                         max_new_tokens=n + 1, forced_bos_token_id=forced)
    outs = []
    for row in gen.tolist():
        assert row[:2] == [EOS_ID, forced], row[:2]
        tokens = row[2:]
        outs.append(tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens)
    return outs
