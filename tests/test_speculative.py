"""SpecMoE: lossless greedy output for every draft choice, zero bytes moved while drafting,
and speculative sampling that keeps the target's distribution exactly."""

import pytest
import torch
from factories import expert_share_budget, random_prompts, watch_draft_reads

from specmoe import LLM, SamplingParams, SpecMoEError
from specmoe.engine.acceptance import accept_greedy, accept_sampled

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    path = tiny_ckpt("mixtral")
    prompts = random_prompts(8, 128, 3, 10, seed=11)
    ref = LLM(model=str(path), device="cpu", max_batch_size=8, max_model_len=64)
    outs = ref.generate(prompts, GREEDY)
    return path, prompts, ref.last_stats["token_ids_sha256"], expert_share_budget(ref, 0.5, 8, 64), outs


def spec_llm(path, budget, tmp_path, **kw):
    opts = dict(device="cpu", policy="specmoe", offload="disk", offload_dir=str(tmp_path), device_memory=budget,
                max_batch_size=8, max_model_len=64, draft_quant="none")  # the paper's draft unless a test says
    opts.update(kw)
    return LLM(model=str(path), **opts)


@pytest.mark.parametrize(
    "gamma, draft_set, substitution",
    [(1, "temporal-hot", "affinity"), (3, "temporal-hot", "affinity"), (5, "temporal-hot", "affinity"),
     (10, "temporal-hot", "affinity"), (3, "global-hot", "affinity"), (3, "random", "affinity"),
     (3, "temporal-hot", "random"), (5, "random", "random")],
)
def test_greedy_output_is_exactly_residents(reference, tmp_path, gamma, draft_set, substitution):
    path, prompts, sha, budget, _ = reference
    llm = spec_llm(path, budget, tmp_path, gamma=gamma, draft_set=draft_set, substitution=substitution)
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    assert stats["token_ids_sha256"] == sha
    assert 1.0 <= stats["tokens_per_step"] <= gamma + 1
    assert stats["device_peak_bytes"] <= budget
    llm.close()


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_greedy_identity_holds_at_other_batch_sizes_and_tiers(reference, tmp_path, batch, tier):
    path, prompts, _, budget, outs = reference
    llm = spec_llm(path, budget, tmp_path, offload=tier, max_batch_size=batch)
    got = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in outs]
    llm.close()


def test_default_draft_takes_quantized_copies_that_fit_and_keeps_the_output(reference, tmp_path):
    path, prompts, sha, budget, _ = reference
    llm = spec_llm(path, budget, tmp_path, draft_quant="auto")
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    assert stats["draft_quant"] in ("int8", "int4") and stats["draft_quantized_bytes"] > 0
    assert stats["token_ids_sha256"] == sha and stats["device_peak_bytes"] <= budget
    llm.close()


def test_drafting_on_the_host_keeps_the_exact_router_and_output(reference, tmp_path):
    path, prompts, sha, budget, _ = reference
    llm = spec_llm(path, budget, tmp_path, offload="host", draft_compute="host")
    llm.generate(prompts, GREEDY)
    assert llm.last_stats["token_ids_sha256"] == sha
    assert llm.last_stats["host_expert_tokens"] > 0
    llm.close()


def test_draft_steps_move_zero_expert_bytes(reference, tmp_path):
    path, prompts, _, budget, _ = reference
    llm = spec_llm(path, budget, tmp_path, gamma=4)
    draft_reads = watch_draft_reads(llm.engine)
    llm.generate(prompts, GREEDY)
    assert llm.last_stats["acceptance_rate"] is not None
    assert draft_reads == []
    llm.close()


def test_default_draft_experts_fit_the_budget_and_at_most_a_quarter(reference, tmp_path):
    path, _, _, budget, _ = reference
    llm = spec_llm(path, budget, tmp_path)
    policy = llm.engine.policy
    assert 1 <= policy.draft_experts <= llm.config.num_experts // 4
    assert policy.draft_experts * len(llm.config.moe_layer_ids) < policy.pool.num_slots
    llm.close()


def test_too_many_draft_experts_for_the_budget_is_a_clear_error(reference, tmp_path):
    path, _, _, budget, _ = reference
    with pytest.raises(SpecMoEError, match="raise --device-memory to at least"):
        spec_llm(path, budget, tmp_path, draft_experts=6)


def test_sampled_speculative_decoding_runs_and_is_reproducible(reference, tmp_path):
    path, prompts, _, budget, _ = reference
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = spec_llm(path, budget, tmp_path)
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        llm.close()
    assert runs[0] == runs[1] and all(len(t) == 12 for t in runs[0])


# --- the acceptance rules, as pure functions ------------------------------------------------


def test_greedy_accepts_the_matching_prefix_then_the_targets_token():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == (2, 9)
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == (3, 1)
    assert accept_greedy([5], [4, 3]) == (0, 4)
    assert accept_greedy([], [8]) == (0, 8)


V = 5
TARGET = torch.softmax(torch.tensor([[1.5, 0.2, -1.0, 0.7, 0.0], [0.0, 1.0, 0.5, -0.5, 2.0],
                                     [-1.0, 0.3, 1.2, 0.8, 0.1], [0.4, 0.4, 0.4, -2.0, 1.0],
                                     [2.0, -1.0, 0.0, 0.5, 0.3]]), dim=-1)  # p(next | previous)
DRAFT = torch.softmax(torch.tensor([[0.0, 1.0, 0.0, 0.5, -1.0]]).repeat(V, 1) + 0.3 * torch.arange(V)[:, None], dim=-1)


def wrong_rule(draft_tokens, draft_probs, target_probs, generator):
    """Accept every draft: outputs follow the draft's distribution, not the target's."""
    g = len(draft_tokens)
    return g, int(torch.multinomial(target_probs[g], 1, generator=generator))


def sample_pairs(rule, n, gamma=2, seed=0):
    """Generate 2 tokens after token 0 with speculative steps; return counts of (t1, t2)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(n):
        out, prev = [], 0
        while len(out) < 2:
            drafts, qs, context = [], [], prev
            for _ in range(gamma):
                q = DRAFT[context]
                token = int(torch.multinomial(q, 1, generator=gen))
                drafts.append(token)
                qs.append(q)
                context = token
            ps = torch.stack([TARGET[t] for t in [prev] + drafts])  # target rows given the draft prefix
            accepted, nxt = rule(drafts, torch.stack(qs), ps, gen)
            out += drafts[:accepted] + [nxt]
            prev = out[-1]
        counts[out[0], out[1]] += 1
    return counts


def chi_square_p(counts):
    from scipy.stats import chisquare

    expected = (TARGET[0][:, None] * TARGET).reshape(-1) * counts.sum()
    return chisquare(counts.reshape(-1).numpy(), expected.numpy()).pvalue


def test_rejection_sampling_keeps_the_target_distribution():
    assert chi_square_p(sample_pairs(accept_sampled, 20_000)) > 0.01


def test_a_wrong_acceptance_rule_fails_the_same_test():
    assert chi_square_p(sample_pairs(wrong_rule, 20_000)) < 0.01


def test_as_many_draft_experts_as_the_block_has_is_refused(reference, tmp_path):
    path, _, _, budget, _ = reference
    with pytest.raises(SpecMoEError, match="must be below the 8 experts per block"):
        spec_llm(path, budget, tmp_path, draft_experts=8)


@pytest.mark.parametrize("draft_quant", ["none", "int8"])
def test_a_verify_pass_fetches_each_expert_at_most_once(reference, tmp_path, draft_quant):
    """Prefetches queued for a block that is already running would land after its experts
    ran and be fetched again: every fetch of a verify pass (before the draft-set refresh)
    must be a different expert."""
    path, prompts, sha, budget, _ = reference
    llm = spec_llm(path, budget, tmp_path, gamma=4, draft_quant=draft_quant)
    policy = llm.engine.policy
    per_pass, original_fetch, original_begin, original_end = [], policy.transfer.fetch, policy.begin_pass, policy.end_pass

    def begin(kind):
        per_pass.append((kind, []))
        return original_begin(kind)

    def fetch(key):
        started = original_fetch(key)
        if started and per_pass:
            per_pass[-1][1].append(key)
        return started

    def end(kind):
        per_pass.append(("after " + kind, []))  # the draft-set refresh after a verify pass
        return original_end(kind)

    policy.begin_pass, policy.transfer.fetch, policy.end_pass = begin, fetch, end
    llm.generate(prompts, GREEDY)
    verify = [keys for kind, keys in per_pass if kind == "verify"]
    assert verify and all(keys for keys in verify)
    assert all(len(keys) == len(set(keys)) for keys in verify)
    assert llm.last_stats["token_ids_sha256"] == sha
    llm.close()
