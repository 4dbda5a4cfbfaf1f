"""The large MoE families (DeepSeek-V2/V3, GLM-4.5, GPT-OSS, Llama 4, Phi-3.5-MoE) beyond
plain parity: what speculation relies on (multi-token steps, cache truncation, windows
shorter than the context) checked against transformers' logits; on-demand offloading and
SpecMoE (the paper's draft, int8 copies) on the disk tier giving the resident model's
tokens; and the KV cache holding what each attention variant needs (MLA: the latent only;
windowed layers: their window only), measured on the allocated tensors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from factories import (  # noqa: E402
    LARGE_FAMILIES,
    VOCAB,
    assert_policy_run_is_exact,
    expert_share_budget,
    hf_logits,
    random_prompts,
    read_config,
    run_cli,
    under_one_expert,
    watch_device_bytes,
)

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.base.checkpoint import Checkpoint  # noqa: E402
from specmoe.tools.info import model_info  # noqa: E402

ATOL = 1e-4
TOP8 = dict(n_routed_experts=11, num_experts_per_tok=8, n_group=1, topk_group=1, n_shared_experts=0)
# (family, overrides): each large family, plus top-8 routing and Mixtral's sliding window
VARIANTS = [*((f, {}) for f in LARGE_FAMILIES), ("deepseek_v3", TOP8), ("mixtral", {"sliding_window": 8})]
IDS = [*LARGE_FAMILIES, "deepseek_v3-top8", "mixtral-sliding8"]


def _feed(llm, slots, token_lists):
    with llm.engine.pass_scope("prefill") as experts:
        rows = llm.engine.forward_logits(experts, slots, token_lists, rows="all")
    return torch.split(rows, [len(t) for t in token_lists])


@pytest.mark.parametrize(("family", "overrides"), VARIANTS, ids=IDS)
def test_multi_token_steps_and_truncation_match_transformers(tiny_ckpt, family, overrides):
    """Two sequences fed together in uneven multi-token steps, past their windows (8), with
    rejected tokens written and cut off in between: every logit as transformers' full forward."""
    path = tiny_ckpt(family, "fused", **overrides)
    a, b = (p[:31] for p in random_prompts(2, VOCAB, 31, 32, seed=21))
    want = hf_logits(path, [a, b])
    llm = LLM(model=str(path), device="cpu", dtype="float32", max_batch_size=2, max_model_len=64)
    cache = llm.engine.cache
    slots = [cache.allocate(), cache.allocate()]
    # (tokens of a, tokens of b) per step; None: 5 rejected drafts, then the cache cut back
    steps = [(a[:13], b[:4]), (a[13:19], b[4:5]), None, (a[19:20], b[5:17]), (a[20:30], b[17:23]), None,
             (a[30:], b[23:31])]
    got = [[], []]
    for step in steps:
        if step is None:
            lengths = [cache.lengths[s] for s in slots]
            _feed(llm, slots, [[7, 8, 9, 10, 11]] * 2)
            for s, n in zip(slots, lengths):
                cache.truncate(s, n)
            continue
        for out, rows in zip(got, _feed(llm, slots, list(step))):
            out.append(rows)
    for g, w, name in zip(got, want, "ab"):
        diff = (torch.cat(g) - w).abs().max()
        assert diff <= ATOL, f"sequence {name}: max |logit diff| {diff:.2e} > {ATOL:.0e}"
    llm.close()


PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# What differs by family is the model's compute (attention, routing, shared and dense
# layers), which each of these runs through the disk tier's fetches and the draft's
# substitution; the policies' own logic does not. Caching and SpecMoE at gamma 1 are
# checked the same way (tokens, device bytes walked) on one family: test_policies.py
# test_policy_matches_resident_tokens[caching-disk] and test_speculative.py
# test_greedy_output_is_exactly_residents[1-temporal-hot-affinity].
OFFLOADED = [
    dict(policy="ondemand"),
    dict(policy="specmoe", gamma=5, draft_quant="none"),  # the paper's draft: resident experts + substitution
    dict(policy="specmoe", gamma=5, draft_quant="int8"),  # quantized copies of every expert
]


@pytest.mark.parametrize(("family", "overrides"), VARIANTS[:-1], ids=IDS[:-1])
def test_offloading_and_drafts_on_the_disk_tier_give_residents_tokens(tiny_ckpt, tmp_path, family, overrides):
    path = str(tiny_ckpt(family, **overrides))
    prompts = random_prompts(4, VOCAB, 3, 12, seed=5)
    shape = dict(device="cpu", max_batch_size=4, max_model_len=64)
    ref = LLM(model=path, **shape)
    ref.generate(prompts, PARAMS)
    sha, budget = ref.last_stats["token_ids_sha256"], expert_share_budget(ref, 0.5, 4, 64)
    for options in OFFLOADED:
        llm = LLM(model=path, offload="disk", offload_dir=str(tmp_path), device_memory=budget, **shape, **options)
        held = watch_device_bytes(llm.engine)  # every device tensor the engine holds, not its ledger
        llm.generate(prompts, PARAMS)
        stats = llm.last_stats
        assert_policy_run_is_exact(stats, sha, options["policy"])
        assert held.excess(budget) <= under_one_expert(llm.config, 8), options  # int8: the smallest format here
        if options["policy"] == "specmoe":
            assert stats["tokens_per_step"] > 1.0, options  # drafts were accepted: speculation ran
        llm.close()


def _measured_bytes_per_token(cache, layers) -> float:
    """Bytes the allocated cache tensors of `layers` hold per slot and position."""
    total = 0.0
    for i in layers:
        for t in (cache.k[i], cache.v[i]):
            if t is not None:
                total += t.numel() * t.element_size() / (t.shape[0] * t.shape[2])
    return total


def test_mla_cache_holds_only_the_latent(tiny_ckpt):
    path = tiny_ckpt("deepseek_v3")
    llm = LLM(model=str(path), device="cpu", dtype="float32", max_batch_size=2, max_model_len=64)
    c, cache = llm.config, llm.engine.cache
    a = c.attention
    latent = c.num_layers * (a.kv_lora_rank + a.qk_rope_dim) * 4  # float32
    full_kv = c.num_layers * a.num_heads * (a.head_dim + a.v_head_dim) * 4  # K and V of every head
    assert _measured_bytes_per_token(cache, range(c.num_layers)) == latent
    assert model_info(str(path), dtype="float32")["kv_bytes_per_token"] == latent
    assert latent * 3 < full_kv  # (tiny here: 240 B against 1344 B; DeepSeek-V3: 70 kB against 4.8 MB)
    llm.close()


@pytest.mark.parametrize("family", ["gpt_oss", "llama4"])
def test_windowed_layers_keep_their_window_not_the_context(tiny_ckpt, family):
    path = tiny_ckpt(family)
    llm = LLM(model=str(path), device="cpu", dtype="float32", max_batch_size=2, max_model_len=256)
    c, cache = llm.config, llm.engine.cache
    llm.score(random_prompts(2, VOCAB, 200, 201, seed=3))  # grows the full layers to the context
    windowed = [i for i, w in enumerate(c.windows) if w is not None]
    full = [i for i, w in enumerate(c.windows) if w is None]
    assert windowed and full
    for i in windowed:  # the window plus the drafts a step may roll back, however long the context
        assert cache.k[i].shape[2] == c.windows[i].size + cache.rollback < 200
    for i in full:
        assert cache.k[i].shape[2] >= 201
    llm.close()


def test_shared_experts_stay_on_the_device_and_are_never_fetched(tiny_ckpt, tmp_path):
    path = str(tiny_ckpt("deepseek_v3"))
    ref = LLM(model=path, device="cpu", max_batch_size=4, max_model_len=64)
    budget = expert_share_budget(ref, 0.5, 4, 64)
    llm = LLM(model=path, device="cpu", policy="ondemand", offload="disk", offload_dir=str(tmp_path),
              device_memory=budget, max_batch_size=4, max_model_len=64)
    policy = llm.engine.policy
    fetched = []
    original = policy.transfer._load
    policy.transfer._load = lambda key, dest, after=None: (fetched.append(key), original(key, dest, after))[1]
    llm.generate(random_prompts(4, VOCAB, 3, 12, seed=5), PARAMS)
    c = llm.config
    assert all(lw.shared_gate_up is not None for i, lw in enumerate(llm.engine.model.weights.layers) if c.moe_layers[i])
    assert {e for _, e in fetched} <= set(range(c.num_experts))  # routed experts only
    assert llm.last_stats["transfer_bytes"] == len(fetched) * c.expert_params * 4
    llm.close()


@pytest.mark.parametrize("family", LARGE_FAMILIES)
def test_info_reports_the_bytes_the_engine_allocates(tiny_ckpt, family):
    path = tiny_ckpt(family)
    info = model_info(str(path), dtype="float32", device_memory="50%", batch_size=2, max_model_len=64)
    llm = LLM(model=str(path), device="cpu", dtype="float32", max_batch_size=2, max_model_len=64)
    e = llm.engine
    assert info["kv_bytes_per_token"] == _measured_bytes_per_token(e.cache, range(e.config.num_layers))
    e.cache.reserve(64)  # every slot at the full context: what the budget must hold
    assert info["kv_reserved_bytes"] == e.cache.nbytes
    assert info["non_expert_bytes"] == e.model.weights.nbytes
    buffer = Checkpoint(path).expert_buffer(e.config.moe_layer_ids[0], 0, torch.float32)
    assert info["expert_bytes"] == buffer.numel() * 4
    assert info["experts_fit"] > 0 and info["policies_fit"]["specmoe"] == "fits"
    llm.close()


BAD_CONFIGS = [  # (family, config.json changes, what the one-line error says)
    ("deepseek_v3", {"n_group": 4}, "n_group=4 must divide the 9 experts"),
    ("deepseek_v3", {"topk_group": 5}, "topk_group=5 must be between 1 and n_group=3"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
    ("deepseek_v3", {"kv_lora_rank": None}, "missing required key 'kv_lora_rank'"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope type 'dynamic' is not supported"),
    ("phimoe", {"num_experts_per_tok": 3}, "routes to exactly 2 experts"),
    ("llama4", {"num_experts_per_tok": 6}, "num_experts_per_tok=6 must be between 1 and the number of experts (5)"),
]


@pytest.mark.parametrize(("family", "changes", "message"), BAD_CONFIGS, ids=[f"{f}-{'-'.join(c)}" for f, c, _ in BAD_CONFIGS])
def test_a_bad_family_config_is_a_clear_error(tiny_ckpt, family, changes, message):
    from specmoe import SpecMoEError
    from specmoe.base.model_config import ModelConfig

    cfg = {**read_config(tiny_ckpt(family)), **changes}
    with pytest.raises(SpecMoEError, match=re.escape(message)):
        ModelConfig.from_dict(cfg)


def test_the_cli_prints_a_bad_family_config_as_one_line(tiny_ckpt, tmp_path, capsys):
    """In-process, as test_errors' cases (`specmoe.cli.main`, what the script calls; that
    the executable itself exits with main's status is test_errors' subprocess test)."""
    model = tmp_path / "bad"
    shutil.copytree(tiny_ckpt("deepseek_v3"), model)
    (model / "config.json").write_text(json.dumps({**read_config(model), "n_group": 4}))
    code, _, err = run_cli(capsys, "info", "--model", model)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "n_group=4 must divide the 9 experts" in lines[0], err


def test_gpt_oss_released_mxfp4_experts_load_as_transformers_dequantizes_them(tiny_ckpt, tmp_path):
    """The released GPT-OSS checkpoints hold experts in MXFP4; they load (dequantized) to
    transformers' logits."""
    import transformers
    from factories import to_mxfp4

    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 21):
        # its integration dequantizes MXFP4 experts to bfloat16 whatever the model's dtype (5.21
        # on: to the model's), 1e-2 from the float32 values we load; 5.20 is the last for Python 3.10
        pytest.skip(f"transformers {transformers.__version__} < 5.21 dequantizes MXFP4 experts to bfloat16")
    path = tmp_path / "mxfp4"
    shutil.copytree(tiny_ckpt("gpt_oss", "fused", intermediate_size=32), path)
    to_mxfp4(path)
    prompts = random_prompts(3, VOCAB, 3, 30, seed=8)
    want = [torch.log_softmax(w, dim=-1) for w in hf_logits(path, prompts)]
    got = LLM(model=str(path), device="cpu", dtype="float32").score(prompts)  # log-probabilities
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= ATOL
    assert Checkpoint(path).mxfp4


def test_deepseek_released_fp8_weights_load_to_their_dequantized_values(tiny_ckpt, tmp_path):
    """DeepSeek-V3 and Kimi-K2 are released in block-scaled FP8: they load to the logits
    transformers gives for the same values in float32, and the experts move in the compute dtype."""
    from factories import to_fp8

    path, reference = to_fp8(tiny_ckpt("deepseek_v3"), tmp_path, block=4)
    prompts = random_prompts(3, VOCAB, 3, 30, seed=8)
    want = [torch.log_softmax(w, dim=-1) for w in hf_logits(reference, prompts)]
    got = LLM(model=str(path), device="cpu", dtype="float32").score(prompts)  # log-probabilities
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= ATOL
    assert Checkpoint(path).expert_buffer(1, 0, torch.float32).dtype == torch.float32
