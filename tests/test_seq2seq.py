"""NLLB-MoE (encoder-decoder) against transformers, on tiny random checkpoints it writes.

The reference is transformers' NllbMoeForConditionalGeneration with fairseq's expert
mixture (seq2seq_factories.py says why): encoder outputs and decoder logits to 1e-4 in
float32, and greedy translations equal to its `generate` with `forced_bos_token_id`, at
batch 1 and at batch 8 with sources of different lengths (transformers pads them).
"""

from __future__ import annotations

import functools
import json
import random

import pytest
import torch

pytest.importorskip("transformers")

from factories import make_checkpoint, run_cli  # noqa: E402
from seq2seq_factories import (  # noqa: E402
    EOS_ID, LANGS, VOCAB, hf_decoder_logits, hf_encoder_outputs, hf_translate, make_nllb_checkpoint,
)

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.base.errors import SpecMoEError  # noqa: E402

ATOL = 1e-4
SRC, TGT = LANGS


def sources(n: int, seed: int = 0) -> list[list[int]]:
    """n framed sources [src_lang] text </s> of pairwise different lengths."""
    rng = random.Random(seed)
    lengths = rng.sample(range(2, 20), n)
    return [[SRC] + [rng.randrange(5, VOCAB) for _ in range(k)] + [EOS_ID] for k in lengths]


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    return make_nllb_checkpoint(tmp_path_factory.mktemp("nllb"))


@functools.lru_cache(maxsize=None)
def _llm(path: str) -> LLM:
    return LLM(path, policy="resident", device="cpu", max_batch_size=8)


def test_encoder_outputs_match_transformers(nllb):
    srcs = sources(8)
    engine = _llm(str(nllb)).engine
    slots = [engine.cache.allocate() for _ in srcs]
    try:
        with engine.pass_scope("prefill") as experts:
            out = engine.model.encode(slots, srcs, engine.cache, experts)
    finally:
        for slot in slots:
            engine.cache.free(slot)
    for got, want in zip(torch.split(out, [len(s) for s in srcs]), hf_encoder_outputs(nllb, srcs)):
        assert (got - want).abs().max().item() <= ATOL


def test_decoder_logits_match_transformers(nllb):
    srcs, rng = sources(8, seed=1), random.Random(1)
    targets = [[EOS_ID, TGT] + [rng.randrange(5, VOCAB) for _ in range(rng.randrange(1, 12))] for _ in srcs]
    engine = _llm(str(nllb)).engine
    slots = [engine.cache.allocate() for _ in srcs]
    try:
        with engine.pass_scope("prefill") as experts:
            engine.model.encode(slots, srcs, engine.cache, experts)
            logits = engine.forward_logits(experts, slots, targets, rows="all")
    finally:
        for slot in slots:
            engine.cache.free(slot)
    for got, want in zip(torch.split(logits, [len(t) for t in targets]), hf_decoder_logits(nllb, srcs, targets)):
        assert (got.log_softmax(-1) - want.log_softmax(-1)).abs().max().item() <= ATOL


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_translation_equals_transformers_generate(nllb, batch):
    srcs = sources(batch, seed=2)
    outs = _llm(str(nllb)).generate(srcs, SamplingParams(max_tokens=24, temperature=0), tgt_lang=TGT)
    assert [o.token_ids for o in outs] == hf_translate(nllb, srcs, TGT, 24)


def test_router_choice_does_not_depend_on_the_batch():
    """transformers' NLLB router at inference (capacity fraction 1) routes each token the
    same alone and among 64; specmoe's router gives those picks and weights."""
    from transformers import NllbMoeConfig
    from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeTop2Router

    from specmoe.base.specs import RouterSpec
    from specmoe.model.routers import route

    torch.manual_seed(0)
    router = NllbMoeTop2Router(NllbMoeConfig(d_model=16, num_experts=8, moe_token_dropout=0.0)).eval()
    x = torch.randn(64, 16)
    _, together, _ = router(x)
    alone = torch.cat([router(row[None])[1] for row in x])
    assert torch.equal(together > 0, alone > 0) and torch.allclose(together, alone)
    ours = route(RouterSpec("top2_all", 2, 8), x, router.classifier.weight)
    dense = torch.zeros(64, 8).scatter(1, ours.ids, ours.weights)
    assert torch.allclose(dense, together, atol=1e-6)


def test_encoder_fetches_each_expert_once_for_the_admitted_batch(nllb, tmp_path):
    """ondemand: the encoder's bytes are exactly one fetch of each distinct expert that
    transformers' router picks in the encoder for any token of the batch."""
    from transformers import NllbMoeForConditionalGeneration

    srcs = sources(8, seed=3)
    hf = NllbMoeForConditionalGeneration.from_pretrained(str(nllb)).eval()
    width = max(map(len, srcs))
    ids = torch.tensor([s + [1] * (width - len(s)) for s in srcs])
    with torch.no_grad():
        routed = hf.get_encoder()(input_ids=ids, attention_mask=(ids != 1).long(), output_router_logits=True)
    real = (ids != 1).reshape(-1)
    distinct = sum(len(set(logits[real].topk(2, -1).indices.reshape(-1).tolist()))
                   for logits in routed.router_logits)
    llm = LLM(str(nllb), policy="ondemand", device="cpu", offload="host", device_memory="30%", max_batch_size=8)
    llm.generate(srcs, SamplingParams(max_tokens=4, temperature=0), tgt_lang=TGT)
    stats = llm.last_stats
    assert stats["encoder_transfer_bytes"] == distinct * stats["transfer_bytes"] // stats["experts_fetched"]
    assert stats["decoder_transfer_bytes"] == stats["transfer_bytes"] - stats["encoder_transfer_bytes"] > 0


# every policy at batch 1 and 16 on the bundled translation model: tests/test_translate_demo.py;
# here the prediction that must not cross from the encoder into the decoder (overlap) and
# the paper's draft over a random model's decoder
@pytest.mark.parametrize("policy, options", [("overlap", {}), ("specmoe", {"gamma": 10, "draft_quant": "none"})])
def test_policy_translates_as_the_resident_model(nllb, policy, options):
    srcs = sources(8, seed=4)
    params = SamplingParams(max_tokens=16, temperature=0)
    want = _llm(str(nllb)).generate(srcs, params, tgt_lang=TGT)
    llm = LLM(str(nllb), policy=policy, device="cpu", device_memory="30%", max_batch_size=8,
              **{"offload": "disk", **options})
    got = llm.generate(srcs, params, tgt_lang=TGT)
    llm.close()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_draft_sets_cover_only_decoder_blocks(nllb):
    llm = LLM(str(nllb), policy="specmoe", device="cpu", device_memory="30%", max_batch_size=8, draft_quant="none")
    llm.generate(sources(2), SamplingParams(max_tokens=6, temperature=0), tgt_lang=TGT)
    assert set(llm.engine.policy.draft_sets()) == set(llm.config.draft_layer_ids) == {3}
    llm.close()


def test_info_shows_encoder_and_decoder_blocks(nllb, capsys):
    code, out, _ = run_cli(capsys, "info", "--model", str(nllb), "--json")
    info = json.loads(out)
    assert code == 0 and info["encoder_moe_blocks"] == [1] and info["decoder_moe_blocks"] == [3]


def test_languages_on_a_decoder_only_model_are_an_error(tmp_path):
    llm = LLM(str(make_checkpoint("mixtral", tmp_path)), policy="resident", device="cpu")
    with pytest.raises(SpecMoEError, match="decoder-only"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), tgt_lang="fra_Latn")


def test_language_code_without_tokenizer_is_an_error(nllb):
    with pytest.raises(SpecMoEError, match="no tokenizer.json"):
        _llm(str(nllb)).generate([[SRC, 9, EOS_ID]], SamplingParams(max_tokens=2), tgt_lang="fra_Latn")


@pytest.mark.parametrize("key, value, message", [
    ("second_expert_policy", "random", "routes at random"),
    ("moe_eval_capacity_token_fraction", 0.5, "drops tokens"),
    ("decoder_ffn_dim", 48, "one size for both stacks"),
])
def test_batch_dependent_or_uneven_configs_are_refused(nllb, tmp_path, key, value, message):
    from specmoe.base.model_config import ModelConfig

    config = json.loads((nllb / "config.json").read_text())
    with pytest.raises(SpecMoEError, match=message):
        ModelConfig.from_dict({**config, key: value})
