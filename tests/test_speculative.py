"""SpecMoE: lossless greedy output for every draft choice, zero bytes moved while drafting,
and speculative sampling whose tokens follow resident's distribution (the acceptance rule
itself is checked exactly in test_acceptance.py)."""

import math
from collections import Counter

import pytest
import torch
from factories import (
    BOOKKEEPING_ALLOWANCE,
    expert_share_budget,
    random_prompts,
    watch_device_bytes,
    watch_draft_reads,
    watch_reads_while_drafting,
)

from specmoe import LLM, SamplingParams, SpecMoEError
from specmoe.engine import speculative
from specmoe.engine.sampling import target_probs

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
    held = watch_device_bytes(llm.engine)
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    assert stats["token_ids_sha256"] == sha
    assert 1.0 <= stats["tokens_per_step"] <= gamma + 1
    assert held.excess(budget) <= BOOKKEEPING_ALLOWANCE
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
    """The --draft-quant rule (what a budget the planner finds no split in gets; the
    planned default is tested in test_draft_split.py)."""
    path, prompts, sha, budget, _ = reference
    llm = spec_llm(path, budget, tmp_path, draft_quant="auto", draft_experts=0)
    held = watch_device_bytes(llm.engine)
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    assert stats["draft_quant"] in ("int8", "int4") and stats["draft_quantized_bytes"] > 0
    assert stats["token_ids_sha256"] == sha and held.excess(budget) <= BOOKKEEPING_ALLOWANCE
    llm.close()


def test_copies_alone_under_a_budget_too_small_for_them_name_the_budget(reference, tmp_path):
    """--draft-experts 0: no paper's draft to fall back on, so copies that do not fit are a
    one-line error that names a budget (it once surfaced as a bad draft_experts)."""
    path, _, _, budget, _ = reference
    with pytest.raises(SpecMoEError, match="raise --device-memory to at least") as err:
        spec_llm(path, budget // 2, tmp_path, draft_quant="auto", draft_experts=0)
    assert "\n" not in str(err.value)


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


def watch_draft_picks(policy) -> tuple[set, list]:
    """Every (block, expert) the draft's own router picked, seen from its backend's input;
    and every fetch a draft block started for an expert of the draft set it ran with."""
    picks, own, original = set(), [], policy.drafter.run_moe

    def run_moe(layer, x, routing):
        picks.update((layer, e) for e in routing.ids.unique().tolist())
        held, before = {(layer, e) for e in policy.draft.get(layer, ())}, set(policy.transfer.inflight)
        out = original(layer, x, routing)
        own.extend(held & (set(policy.transfer.inflight) - before))
        return out

    policy.drafter.run_moe = run_moe
    return picks, own


def test_verifications_reads_start_while_the_draft_runs_and_only_for_its_picks(reference, tmp_path):
    """Reads issued during draft passes are verification's: experts the draft's routing
    picked, never a draft expert (pinned, resident), never waited for by the draft; and
    the output stays resident's."""
    path, prompts, sha, budget, _ = reference
    llm = spec_llm(path, budget, tmp_path, gamma=4)
    issued, used = watch_reads_while_drafting(llm.engine), watch_draft_reads(llm.engine)
    picks, own = watch_draft_picks(llm.engine.policy)
    llm.generate(prompts, GREEDY)
    assert llm.last_stats["token_ids_sha256"] == sha
    assert issued and set(issued) <= picks and used == [] and own == []
    llm.close()


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_draft_watcher_sees_a_draft_that_fetches(reference, tmp_path, monkeypatch, tier):
    """The watcher of test_draft_steps_move_zero_expert_bytes can fail: a drafter made to
    fetch (one expert not in the pool per block) shows in it, expert by expert."""
    path, prompts, _, budget, _ = reference
    llm = spec_llm(path, budget, tmp_path, offload=tier, gamma=2)
    policy, fetched = llm.engine.policy, []
    original = policy.drafter.run_moe

    def fetching(layer, x, routing):
        absent = [(layer, e) for e in range(llm.config.num_experts) if not policy.transfer.has((layer, e))]
        if absent:
            policy.transfer.ensure(absent[0])
            fetched.append(absent[0])
        return original(layer, x, routing)

    monkeypatch.setattr(policy.drafter, "run_moe", fetching)
    draft_reads = watch_draft_reads(llm.engine)
    with pytest.raises(RuntimeError, match="a draft pass fetched experts"):  # the policy's own check agrees
        llm.generate(prompts[:2], GREEDY)
    assert fetched and draft_reads == fetched  # verification's reads during the draft are not among them
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


# --- sampling: the emitted tokens follow resident's distribution -----------------------------------

SAMPLES = 1500
# 4 tokens: the first comes from the prefill, the next speculative step drafts 2 (gamma=2);
# the test looks at the first 3, whose distribution that step decides
SAMPLED = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=i, ignore_eos=True) for i in range(SAMPLES)]


def residents_distribution(llm, prompt) -> dict[tuple, float]:
    """Exact probability of every 3-token continuation under the target (resident's
    logits, after the same temperature and top-k): p(t1) p(t2 | t1) p(t3 | t1 t2)."""
    def after(prefixes):
        return [target_probs(rows[-1], SAMPLED[0]) for rows in llm.score([prompt + list(p) for p in prefixes])]

    dist = {(): 1.0}
    for _ in range(3):
        prefixes = list(dist)
        dist = {p + (t,): dist[p] * float(probs[t])
                for p, probs in zip(prefixes, after(prefixes)) for t in torch.nonzero(probs).flatten().tolist()}
    return dist


def goodness_of_fit(outputs, exact: dict) -> float:
    """Chi-square p-value of the histogram of the continuations' first 3 tokens against
    `exact` (0 when a continuation the target cannot produce appears)."""
    from scipy.stats import chisquare

    counts = Counter(tuple(o.token_ids[:3]) for o in outputs)
    if not set(counts) <= set(exact):
        return 0.0
    keys = sorted(exact)
    total = sum(exact.values())  # 1 up to float32 rounding, which chisquare would refuse
    return chisquare([counts[k] for k in keys], [exact[k] / total * len(outputs) for k in keys]).pvalue


@pytest.fixture(scope="module")
def sampled_run(reference, tmp_path_factory):
    """1500 samples of one prompt (seeds 0..1499) through the paper's draft with one draft
    expert per block (acceptance about 0.55: drafts are often wrong), and the exact
    target distribution to compare with."""
    path, prompts, _, _, _ = reference
    prompt = prompts[0]
    resident = LLM(model=str(path), device="cpu", max_batch_size=32, max_model_len=16)
    exact = residents_distribution(resident, prompt)
    budget = expert_share_budget(resident, 0.5, SAMPLES, 20)
    resident.close()
    llm = spec_llm(path, budget, tmp_path_factory.mktemp("sampled"), offload="host", max_batch_size=SAMPLES,
                   max_model_len=20, gamma=2, draft_experts=1)
    yield llm, prompt, exact
    llm.close()


def test_sampled_speculative_decoding_keeps_residents_distribution(sampled_run):
    llm, prompt, exact = sampled_run
    outputs = llm.generate([prompt] * SAMPLES, SAMPLED)
    assert 0.2 < llm.last_stats["acceptance_rate"] < 0.9  # drafts were both accepted and rejected
    assert goodness_of_fit(outputs, exact) > 0.01


def correction_from_the_target(drafts, q, p, coins):
    """A plausible mistake: at a rejection, draw from p instead of norm(max(0, p - q))."""
    for k, token in enumerate(drafts):
        if not (q[k, token] > 0 and coins.accept(min(1.0, float(p[k, token] / q[k, token])))):
            return k, coins.draw(p[k])
    return len(drafts), coins.draw(p[len(drafts)])


def test_the_same_check_fails_an_engine_with_a_wrong_rule(sampled_run, monkeypatch):
    llm, prompt, exact = sampled_run
    monkeypatch.setattr(speculative, "accept_sampled", correction_from_the_target)
    assert goodness_of_fit(llm.generate([prompt] * SAMPLES, SAMPLED), exact) < 1e-4


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


def test_the_affinity_table_is_the_l2_distance_between_whole_experts(tiny_ckpt):
    """Accumulated a tensor at a time, it is still each pair's distance between the flattened
    experts (compared with cdist over whole buffers, the table's old one-shot computation)."""
    from specmoe.base.checkpoint import Checkpoint
    from specmoe.policies.specmoe.affinity import compute_affinity

    ckpt = Checkpoint(tiny_ckpt("mixtral"))
    c = ckpt.config
    for layer, table in compute_affinity(ckpt).items():
        whole = torch.stack([ckpt.expert_buffer(layer, e, torch.float32) for e in range(c.num_experts)])
        want = torch.cdist(whole[None].double(), whole[None].double())[0].float()
        assert torch.allclose(table, want, rtol=1e-5, atol=1e-6) and table.diagonal().abs().max() < 1e-3


@pytest.mark.parametrize("kind", ["safetensors", "Q4_K"])
def test_the_affinity_table_is_accumulated_in_bounded_pieces(tiny_ckpt, tmp_path, monkeypatch, kind):
    """Pieces of a few rows (across the gate/up boundary of a GGUF expert's first tensor)
    add up to the distance between whole experts, and every piece is what the expert holds
    there: a block's experts are never all in float32 at once."""
    from gguf_factories import make_gguf

    from specmoe.base.gguf_checkpoint import open_checkpoint
    from specmoe.policies.specmoe import affinity

    path = tiny_ckpt("mixtral") if kind == "safetensors" else make_gguf(tmp_path, "mixtral", kind, block=256)[1]
    ckpt = open_checkpoint(path)
    c, layer = ckpt.config, ckpt.config.moe_layer_ids[0]
    shapes = affinity.part_shapes(ckpt, layer)
    assert shapes == [tuple(t.shape) for t in ckpt.expert_parts(layer, 1)]
    for part, shape in enumerate(shapes):
        whole = ckpt.expert_parts(layer, 1)[part].float().reshape(shape[0], -1)
        cut = (shape[0] // 2 + 3) if shape[0] > 6 else 1  # a GGUF part 0 crosses from gate rows to up rows here
        pieces = torch.cat([affinity.part_rows(ckpt, layer, 1, part, a, b) for a, b in ((0, cut), (cut, shape[0]))])
        assert torch.equal(pieces, whole)
    held = []
    real_stack = torch.stack
    monkeypatch.setattr(affinity.torch, "stack", lambda xs, *a, **k: held.append(sum(x.numel() for x in xs))
                        or real_stack(xs, *a, **k))
    monkeypatch.setattr(affinity, "PIECE_BYTES", 4 * c.num_experts * max(math.prod(s[1:]) for s in shapes) * 5)
    table = affinity.compute_affinity(ckpt)[layer]
    whole = real_stack([ckpt.expert_buffer(layer, e, torch.float32) for e in range(c.num_experts)])
    want = torch.cdist(whole[None].double(), whole[None].double())[0].float()
    assert torch.allclose(table, want, rtol=1e-5, atol=1e-6)
    assert len(held) > len(shapes) and max(held) * 4 <= affinity.PIECE_BYTES  # in pieces, each within the bound


def test_gamma_zero_is_plain_decoding_with_residents_tokens(reference, tmp_path):
    """Where the tuner falls back (gamma 0, engine/gamma.py): no draft pass, one token a
    sequence per step, verified by the full model: resident's tokens."""
    path, prompts, sha, budget, _ = reference
    llm = spec_llm(path, budget, tmp_path, adapt_gamma=False)  # gamma stays where the test puts it
    llm.engine.decoder.gamma = 0
    passes = []
    real = llm.engine.pass_scope
    llm.engine.pass_scope = lambda kind: passes.append(kind) or real(kind)
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    assert stats["token_ids_sha256"] == sha and stats["acceptance_rate"] is None  # nothing drafted
    assert "draft" not in passes and stats["steps"] == GREEDY.max_tokens - 1
    llm.close()


def test_by_default_gamma_adapts_and_the_statistics_say_how_many_steps_decoded_plainly(reference, tmp_path):
    """Without a gamma asked for, the second step measures plain decoding (engine/gamma.py)
    and each later step's gamma is chosen: resident's tokens all the same."""
    path, prompts, sha, budget, _ = reference
    llm = spec_llm(path, budget, tmp_path)
    assert llm.options.adapt_gamma
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    assert stats["token_ids_sha256"] == sha
    assert stats["plain_decoding_steps"] >= 1 and stats["steps"] >= 3
    # a second call counts its own steps: never more plain steps than steps
    tuner = llm.engine.decoder.tuner
    before = tuner.plain_steps
    llm.generate(prompts, GREEDY)
    again = llm.last_stats
    assert again["plain_decoding_steps"] == tuner.plain_steps - before <= again["steps"]
    fixed = spec_llm(path, budget, tmp_path / "fixed", gamma=4)
    assert not fixed.options.adapt_gamma and fixed.engine.decoder.tuner is None  # a gamma asked for is kept
    fixed.close()
    llm.close()


@pytest.mark.parametrize("batch", [1, 8])
def test_the_draft_set_follows_verification_without_reading_an_expert(reference, tmp_path, batch):
    """After the first draft set, every expert read is one a block ran or a prefetch
    predicted: the next draft set is taken from the experts a verify pass has just used,
    block by block, while they are still in the pool (a refresh after the whole pass read
    the first blocks' experts again, evicted by the later blocks')."""
    path, prompts, sha, budget, _ = reference
    llm = spec_llm(path, budget, tmp_path, gamma=3, max_batch_size=batch)
    runtime = llm.engine.policy.runtime
    tight = budget - int(0.2 * runtime.expert_bytes * len(runtime.expert_keys))  # 30 %: blocks evict each other's
    llm.close()
    llm = spec_llm(path, tight, tmp_path, gamma=3, max_batch_size=batch)
    policy = llm.engine.policy
    reads, inside = {"block": 0, "other": 0}, []

    def counted(original, why):
        def call(*args, **kwargs):
            inside.append(why)
            try:
                return original(*args, **kwargs)
            finally:
                inside.pop()
        return call

    fetch = policy.transfer.fetch

    def watched_fetch(key):
        started = fetch(key)
        if started:  # a refresh is a block's only where a prefill chooses the first draft set
            legit = inside and (inside[-1] != "refresh" or policy.pass_kind == "prefill")
            reads["block" if legit else "other"] += 1
        return started

    policy.transfer.fetch = watched_fetch
    policy.blocks.run_block = counted(policy.blocks.run_block, "block")
    policy.blocks.prefetch = counted(policy.blocks.prefetch, "prefetch")
    policy.prefetch_for_verify = counted(policy.prefetch_for_verify, "predicted")
    policy.refresh = counted(policy.refresh, "refresh")
    llm.generate(prompts, GREEDY)
    assert reads["block"] > 0 and reads["other"] == 0, reads
    assert llm.last_stats["token_ids_sha256"] == sha
    llm.close()
