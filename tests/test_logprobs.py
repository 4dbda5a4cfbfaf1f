"""Log-probabilities through the Python API: the full model's, equal to transformers'
log-softmax (float32, 1e-4) for prompt and generated tokens under every kind of policy;
scoring requests (max_tokens=0) batched like generation; clear errors for bad values."""

import pytest
import torch
from factories import expert_share_budget, hf_logits, random_prompts

from specmoe import LLM, SamplingParams, SpecMoEError
from specmoe.engine.logprobs import MAX_LOGPROBS

ATOL = 1e-4
K = 5
MAX_LEN = 64
POLICIES = {  # policy -> options beyond the shared ones (budget: half of the experts fit)
    "resident": {},
    "ondemand": {"offload": "host"},
    "specmoe": {"offload": "host", "gamma": 3, "draft_quant": "none"},  # the paper's draft: it often disagrees
}


@pytest.fixture(scope="module")
def setup(tiny_ckpt):
    path = tiny_ckpt("mixtral")
    ref = LLM(model=str(path), device="cpu", max_batch_size=8, max_model_len=MAX_LEN)
    return path, random_prompts(6, 128, 3, 12, seed=21), expert_share_budget(ref, 0.5, 8, MAX_LEN)


def make_llm(setup, policy):
    path, _, budget = setup
    extra = {"device_memory": budget, **POLICIES[policy]} if policy != "resident" else {}
    return LLM(model=str(path), device="cpu", policy=policy, max_batch_size=8, max_model_len=MAX_LEN, **extra)


def reference_log_softmax(path, prompt, output):
    """transformers' log-softmax at every position of prompt + output, teacher-forced."""
    return torch.log_softmax(hf_logits(path, [list(prompt) + list(output)])[0], dim=-1)


def assert_position_matches(got, want_row, token, k, where):
    assert got.token_id == token, where
    assert abs(got.logprob - float(want_row[token])) <= ATOL, f"{where}: {got.logprob} vs {float(want_row[token])}"
    assert abs(float(want_row.sort(descending=True).values[got.rank - 1]) - got.logprob) <= ATOL, f"{where}: rank"
    top_values = want_row.topk(k).values
    assert len(got.top) == k, where
    assert torch.allclose(torch.tensor([v for _, v in got.top]), top_values, atol=ATOL), where
    assert all(abs(float(want_row[i]) - v) <= ATOL for i, v in got.top), f"{where}: top ids do not carry their values"


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_logprobs_equal_transformers_log_softmax(setup, policy, temperature):
    path, prompts, _ = setup
    llm = make_llm(setup, policy)
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=5, ignore_eos=True,
                            logprobs=K, prompt_logprobs=K)
    outs = llm.generate(prompts, params)
    llm.close()
    for i, out in enumerate(outs):
        want = reference_log_softmax(path, out.prompt_token_ids, out.token_ids)
        n = len(out.prompt_token_ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
        for j in range(1, n):
            assert_position_matches(out.prompt_logprobs[j], want[j - 1], out.prompt_token_ids[j], K,
                                    f"prompt {i} position {j}")
        assert len(out.logprobs) == len(out.token_ids) == 10
        for j, token in enumerate(out.token_ids):
            assert_position_matches(out.logprobs[j], want[n - 1 + j], token, K, f"prompt {i} generated token {j}")


def test_logprobs_do_not_depend_on_the_policy_or_on_speculation(setup):
    _, prompts, _ = setup
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    runs = {}
    for policy in POLICIES:
        llm = make_llm(setup, policy)
        runs[policy] = [p.logprob for out in llm.generate(prompts, params) for p in out.logprobs]
        llm.close()
    assert runs["specmoe"] == pytest.approx(runs["resident"], abs=ATOL)
    assert runs["ondemand"] == pytest.approx(runs["resident"], abs=ATOL)


def test_greedy_tokens_have_rank_one(setup):
    _, prompts, _ = setup
    llm = make_llm(setup, "resident")
    out = llm.generate(prompts[:2], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0))
    for o in out:
        assert [p.rank for p in o.logprobs] == [1] * 6 and all(p.top == () for p in o.logprobs)
        assert [p.token_id for p in o.logprobs] == o.token_ids


def test_without_logprobs_outputs_carry_none(setup):
    _, prompts, _ = setup
    out = make_llm(setup, "resident").generate(prompts[:1], SamplingParams(max_tokens=2))[0]
    assert out.logprobs is None and out.prompt_logprobs is None


def test_max_tokens_zero_scores_the_prompt_without_generating(setup):
    path, prompts, _ = setup
    llm = make_llm(setup, "resident")
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert llm.last_stats["generated_tokens"] == 0 and llm.last_stats["steps"] == 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == [] and out.finish_reason == "length"
        want = reference_log_softmax(path, prompt, [])
        got = [p.logprob for p in out.prompt_logprobs[1:]]
        assert got == pytest.approx([float(want[j - 1, prompt[j]]) for j in range(1, len(prompt))], abs=ATOL)


def test_scoring_a_batch_fetches_experts_once_for_all_its_prompts(setup):
    """Scored prompts go through the engine's batched prefill: under ondemand, eight prompts
    scored together move far fewer expert bytes than the same eight scored one by one."""
    prompts = random_prompts(8, 128, 6, 13, seed=22)
    llm = make_llm(setup, "ondemand")
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    together = [o.prompt_logprobs for o in llm.generate(prompts, params)]
    batched_bytes = llm.last_stats["transfer_bytes"]
    alone, alone_bytes = [], 0
    for prompt in prompts:
        alone.append(llm.generate([prompt], params)[0].prompt_logprobs)
        alone_bytes += llm.last_stats["transfer_bytes"]
    llm.close()
    assert [p.logprob for o in together for p in o[1:]] == pytest.approx(
        [p.logprob for o in alone for p in o[1:]], abs=ATOL)
    assert batched_bytes > 0 and batched_bytes * 3 < alone_bytes


def test_whole_vocabulary_logprobs_sum_to_one(setup):
    _, prompts, _ = setup
    out = make_llm(setup, "resident").generate(prompts[:1], SamplingParams(max_tokens=1, logprobs=-1))[0]
    top = out.logprobs[0].top
    assert len(top) == 128 and sorted(i for i, _ in top) == list(range(128))
    assert sum(torch.tensor([v for _, v in top]).exp()).item() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(("field", "value"), [
    ("logprobs", MAX_LOGPROBS + 1), ("logprobs", -2), ("logprobs", 1.5), ("logprobs", True),
    ("prompt_logprobs", MAX_LOGPROBS + 1), ("prompt_logprobs", -3), ("prompt_logprobs", "5"),
])
def test_bad_logprobs_values_name_the_field(field, value):
    with pytest.raises(SpecMoEError, match=f"{field} must be an integer from 0 to {MAX_LOGPROBS}"):
        SamplingParams(**{field: value})


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(SpecMoEError, match="max_tokens=0 .* set prompt_logprobs"):
        SamplingParams(max_tokens=0)
    with pytest.raises(SpecMoEError, match="max_tokens must be"):
        SamplingParams(max_tokens=-1, prompt_logprobs=0)


def test_caching_keeps_its_hot_experts_across_scoring_batches(setup):
    """A scoring run never decodes: caching must still choose its hot set after the first
    prefill pass and move fewer bytes than ondemand over several batches of prompts."""
    path, _, budget = setup
    prompts = random_prompts(8, 128, 6, 13, seed=23)
    moved = {}
    for policy in ("ondemand", "caching"):
        llm = LLM(model=str(path), device="cpu", policy=policy, offload="host", device_memory=budget,
                  max_batch_size=2, max_model_len=MAX_LEN, cache_fraction=0.25)
        llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0))
        moved[policy] = llm.last_stats["transfer_bytes"]
        hot = llm.last_stats.get("hot_experts")
        llm.close()
    assert hot == 2 * 2  # a quarter of 8 experts in each of the 2 MoE blocks
    assert 0 < moved["caching"] < moved["ondemand"]
