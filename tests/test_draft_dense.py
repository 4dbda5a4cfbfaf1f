"""The draft's attention projections and LM head in bfloat16 (`draft_dense`, with
`--dtype float32`: by default the CPU multiplies a bfloat16 checkpoint as stored in every
pass, test_bfloat16_as_stored.py): kept so where a bfloat16 checkpoint stores them so,
multiplied in bfloat16 by draft passes only, widened back to float32 by every exact pass
(prefill, verify), which then computes exactly what float32 weights give: the same logits
bit for bit, the resident model's tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from factories import build_model, random_prompts

from specmoe import LLM, SamplingParams
from specmoe.base.config import EngineConfig
from specmoe.base.errors import SpecMoEError
from specmoe.engine.engine import bfloat16_pays, draft_dense_dtype

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts(3, min_len=4, max_len=10, seed=7)


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    """A bfloat16 Mixtral checkpoint written by transformers, and a float32 one of the same values."""
    out = tmp_path_factory.mktemp("draft-dense")
    model = build_model("mixtral", seed=3).to(torch.bfloat16)
    model.save_pretrained(out / "bf16", safe_serialization=True)
    model.to(torch.float32).save_pretrained(out / "f32", safe_serialization=True)
    return out / "bf16", out / "f32"


def llm(path, tmp_path, **options):
    return LLM(model=str(path), device="cpu", offload_dir=str(tmp_path), max_batch_size=3, max_model_len=48,
               threads=1, **{"dtype": "float32", **options})


def test_bfloat16_projections_widened_give_the_float32_weights_logits_bit_for_bit(bf16_ckpt, tmp_path):
    kept = llm(bf16_ckpt[0], tmp_path, policy="specmoe", device_memory="40%", draft_dense="bfloat16")
    plain = llm(bf16_ckpt[0], tmp_path, policy="specmoe", device_memory="40%", draft_dense="none")
    weights = kept.engine.model.weights
    assert weights.layers[0].qkv.dtype == weights.layers[0].o.dtype == weights.lm_head.dtype == torch.bfloat16
    assert plain.engine.model.weights.layers[0].qkv.dtype == torch.float32
    for a, b in zip(kept.score(PROMPTS), plain.score(PROMPTS)):  # prefill: an exact pass
        assert torch.equal(a, b)


def test_specmoe_with_a_bfloat16_draft_gives_the_resident_models_tokens(bf16_ckpt, tmp_path):
    resident = llm(bf16_ckpt[0], tmp_path, policy="resident")
    resident.generate(PROMPTS, PARAMS)
    for quant in ("auto", "none"):  # quantized copies, and the paper's draft of resident experts
        spec = llm(bf16_ckpt[0], tmp_path, policy="specmoe", device_memory="40%", draft_dense="bfloat16",
                   draft_quant=quant, gamma=4)
        spec.generate(PROMPTS, PARAMS)
        stats = spec.last_stats
        assert stats["draft_dense"] == "bfloat16" and stats["steps"] < PARAMS.max_tokens
        assert stats["token_ids_sha256"] == resident.last_stats["token_ids_sha256"]


def test_the_draft_really_multiplies_in_bfloat16(bf16_ckpt, tmp_path, monkeypatch):
    spec = llm(bf16_ckpt[0], tmp_path, policy="specmoe", device_memory="40%", draft_dense="bfloat16", gamma=4)
    seen = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: seen.append(w.dtype) or real(x, w, b))
    spec.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    # bfloat16 products happened (the draft's), and float32 ones (prefill and verify widen)
    assert torch.bfloat16 in seen and torch.float32 in seen


def test_the_kept_weights_hold_half_their_float32_bytes(bf16_ckpt, tmp_path):
    kept = llm(bf16_ckpt[0], tmp_path, policy="specmoe", device_memory="40%", draft_dense="bfloat16")
    plain = llm(bf16_ckpt[0], tmp_path, policy="specmoe", device_memory="40%", draft_dense="none")
    c = kept.engine.config
    a, D = c.attention, c.hidden_size
    per_layer = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim * D + D * a.num_heads * a.head_dim  # qkv and o
    kept_params = c.num_layers * per_layer + c.vocab_size * D  # and the (untied) LM head
    held = [sum(t.numel() * t.element_size() for t in e.engine.model.weights.tensors()) for e in (kept, plain)]
    assert held[1] - held[0] == kept_params * 2  # 4 bytes a value in float32, 2 kept in bfloat16


def test_a_float32_checkpoint_keeps_float32_weights_widening_would_not_be_exact(bf16_ckpt, tmp_path):
    spec = llm(bf16_ckpt[1], tmp_path, policy="specmoe", device_memory="40%", draft_dense="bfloat16")
    weights = spec.engine.model.weights
    assert weights.layers[0].qkv.dtype == weights.lm_head.dtype == torch.float32


def config(**overrides):
    base = dict(attention=SimpleNamespace(kind="gqa"), seq2seq=None, hidden_size=64)
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize("options, cfg, dtype, want", [
    (dict(policy="specmoe", draft_dense="bfloat16"), config(), torch.float32, torch.bfloat16),
    (dict(policy="specmoe", draft_dense="none"), config(), torch.float32, None),
    (dict(policy="ondemand"), config(), torch.float32, None),  # only SpecMoE drafts
    (dict(policy="specmoe", draft_dense="bfloat16"), config(), torch.bfloat16, None),  # nothing to gain
    (dict(policy="specmoe", draft_dense="bfloat16"), config(attention=SimpleNamespace(kind="mla")), torch.float32,
     None),
    (dict(policy="specmoe", draft_dense="bfloat16"), config(seq2seq=object()), torch.float32, None),
])
def test_which_engines_keep_the_drafts_weights_in_bfloat16(options, cfg, dtype, want):
    assert draft_dense_dtype(EngineConfig(**options), cfg, torch.device("cpu"), dtype) == want


def test_auto_asks_this_cpu_and_follows_the_measurement(monkeypatch):
    from specmoe.engine import engine
    for pays, want in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(engine, "bfloat16_pays", lambda width, rows, pays=pays: pays)
        options = EngineConfig(policy="specmoe", draft_dense="auto")
        assert draft_dense_dtype(options, config(), torch.device("cpu"), torch.float32) == want


def test_bfloat16_pays_compares_the_two_products_times():
    assert bfloat16_pays(64, 4, ratio=0.0) is True  # any time >= 0 x the other
    assert bfloat16_pays(64, 4, ratio=1e9) is False


def test_an_unknown_draft_dense_is_a_one_line_error():
    with pytest.raises(SpecMoEError, match="draft_dense"):
        EngineConfig(draft_dense="float8")


def test_a_bfloat16_checkpoint_multiplied_as_stored_needs_no_draft_copy(bf16_ckpt, tmp_path):
    stored = llm(bf16_ckpt[0], tmp_path, policy="specmoe", device_memory="40%", draft_dense="bfloat16", dtype="auto")
    assert stored.engine.as_stored and stored.engine.draft_dense is None
    stored.close()
