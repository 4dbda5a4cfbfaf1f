"""Every policy, both tiers: greedy output identical to `resident`, bytes counted exactly,
the device budget respected (measured by walking what the engine holds, not read from its
ledger), and clear errors for budgets and names that cannot work."""

import re

import pytest
import torch
from factories import (
    BOOKKEEPING_ALLOWANCE,
    _cached_model,
    assert_policy_run_is_exact,
    expert_share_budget,
    install_fixed_profile,
    random_prompts,
    watch_device_bytes,
)

from specmoe import LLM, SamplingParams, SpecMoEError
from specmoe.base.units import parse_size

POLICIES = ["ondemand", "overlap", "caching", "host"]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TOP_K = 2  # the tiny qwen2_moe: 8 experts per block, 2 per position (factories)


@pytest.fixture(scope="module")
def setup(tiny_ckpt):
    path = tiny_ckpt("qwen2_moe")
    prompts = random_prompts(8, 128, 3, 10, seed=3)
    ref = LLM(model=str(path), device="cpu", max_batch_size=8, max_model_len=64)
    ref.generate(prompts, PARAMS)
    return path, prompts, ref.last_stats, expert_share_budget(ref, 0.5, 8, 64)


@pytest.mark.parametrize(("policy", "tier"), [(p, t) for p in POLICIES for t in ("host", "disk")
                                              if (p, t) != ("host", "disk")])  # host on disk: an error, below
def test_policy_matches_resident_tokens(setup, tmp_path, policy, tier):
    path, prompts, ref_stats, budget = setup
    llm = LLM(model=str(path), device="cpu", policy=policy, offload=tier, offload_dir=str(tmp_path),
              device_memory=budget, max_batch_size=8, max_model_len=64)
    held = watch_device_bytes(llm.engine)
    llm.generate(prompts, PARAMS)
    assert_policy_run_is_exact(llm.last_stats, ref_stats["token_ids_sha256"], policy)
    assert held.excess(budget) <= BOOKKEEPING_ALLOWANCE
    llm.close()


def test_resident_holds_no_more_than_the_budget_it_asks_for(setup):
    path, prompts, ref_stats, _ = setup
    need = LLM(model=str(path), device="cpu", max_batch_size=8, max_model_len=64).engine.budget.used
    llm = LLM(model=str(path), device="cpu", device_memory=need, max_batch_size=8, max_model_len=64)
    held = watch_device_bytes(llm.engine)
    llm.generate(prompts, PARAMS)
    assert llm.last_stats["token_ids_sha256"] == ref_stats["token_ids_sha256"]
    assert need - BOOKKEEPING_ALLOWANCE < max(held) <= need + BOOKKEEPING_ALLOWANCE  # it sees the model too
    llm.close()


def test_the_measurement_sees_a_copy_the_ledger_was_not_told_about(setup, tmp_path):
    """What a policy keeping an uncharged expert copy would look like: the held bytes
    exceed the budget while the ledger still says everything fits."""
    path, prompts, _, budget = setup
    llm = LLM(model=str(path), device="cpu", policy="caching", offload="host", device_memory=budget,
              max_batch_size=8, max_model_len=64)
    held = watch_device_bytes(llm.engine)
    llm.engine.policy.leaked = [llm.engine.policy.pool.buffers[0].clone()]  # one expert, uncharged
    llm.generate(prompts, PARAMS)
    assert llm.last_stats["device_peak_bytes"] <= budget < max(held) - BOOKKEEPING_ALLOWANCE
    llm.close()


def test_transfer_bytes_equal_the_experts_fetched(setup, tmp_path):
    path, prompts, _, budget = setup
    llm = LLM(model=str(path), device="cpu", policy="ondemand", offload="disk", offload_dir=str(tmp_path),
              device_memory=budget, max_batch_size=8, max_model_len=64)
    policy = llm.engine.policy
    fetched = []
    original = policy.transfer._load
    policy.transfer._load = lambda key, dest, after=None: (fetched.append(key), original(key, dest, after))[1]
    llm.generate(prompts, PARAMS)
    c = llm.config
    expert_bytes = 3 * c.hidden_size * c.expert_intermediate_size * 4
    assert llm.last_stats["transfer_bytes"] == len(fetched) * expert_bytes
    assert policy.store.read_bytes == len(fetched) * expert_bytes
    llm.close()


@torch.no_grad()
def routed_experts(path, token_ids: list[int]) -> list[list[set[int]]]:
    """Per MoE block, per position: the experts transformers' own model routes it to."""
    model = _cached_model(path)
    routers = model(input_ids=torch.tensor([token_ids]), output_router_logits=True).router_logits
    return [[set(row.topk(TOP_K).indices.tolist()) for row in logits] for logits in routers]


def test_ondemand_fetches_each_blocks_routed_experts_once_every_pass(setup, tmp_path):
    path, prompts, _, budget = setup
    llm = LLM(model=str(path), device="cpu", policy="ondemand", offload="host", device_memory=budget,
              max_batch_size=1, max_model_len=64)
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    # the prefill pass fetches, per block, the union of the prompt's experts; each of the 3
    # decode passes (the last token is never fed) its one position's; nothing is kept
    n = len(prompts[0])
    routed = routed_experts(path, prompts[0] + out.token_ids[:-1])
    assert len(routed) == 2 and len(routed[0]) == n + 3
    decode = sum(sum(len(experts) for experts in block[n:]) for block in routed)
    want = sum(len(set().union(*block[:n])) for block in routed) + decode
    stats = llm.last_stats
    assert stats["experts_fetched"] == want
    # the decode steps' own bytes per token, apart from the prefill's: 3 decode tokens
    expert_bytes = llm.engine.policy.pool.expert_bytes
    assert stats["decode_transfer_bytes_per_token"] * 3 == pytest.approx(decode * expert_bytes)
    llm.close()


def named_budget(error: SpecMoEError) -> tuple[int, int]:
    """The budget an error names, in bytes, and the next value below it at the precision it
    was printed with ('183 KiB' -> 182 KiB)."""
    number, unit = re.search(r"raise --device-memory to at least ([0-9.]+) (\S+)$", str(error)).groups()
    decimals = len(number.partition(".")[2])
    return parse_size(f"{number} {unit}"), parse_size(f"{float(number) - 10 ** -decimals:.{decimals}f} {unit}")


@pytest.mark.parametrize("options", [
    dict(policy="resident"),
    dict(policy="ondemand"),  # the first refusal is the KV cache's; the pool needs a slot more
    dict(policy="caching", cache_fraction=0.5),
    dict(policy="specmoe", draft_quant="none", draft_experts=3),
    dict(policy="specmoe", draft_quant="int8"),  # copies, their scratch and two working slots
    dict(policy="specmoe"),  # auto: whichever draft fits in the least
], ids=lambda o: "-".join(map(str, o.values())))
def test_the_budget_an_error_names_is_the_smallest_that_works(setup, tmp_path, options):
    path, prompts, ref_stats, _ = setup
    kw = dict(model=str(path), device="cpu", offload="disk", offload_dir=str(tmp_path), max_batch_size=8,
              max_model_len=64, **options)
    with pytest.raises(SpecMoEError) as refused:
        LLM(device_memory=1000, **kw)
    named, below = named_budget(refused.value)
    llm = LLM(device_memory=named, **kw)
    llm.generate(prompts, PARAMS)
    assert llm.last_stats["token_ids_sha256"] == ref_stats["token_ids_sha256"]
    llm.close()
    with pytest.raises(SpecMoEError, match="raise --device-memory to at least"):
        LLM(device_memory=below, **kw)


def test_unknown_policy_lists_valid_ones(setup):
    with pytest.raises(SpecMoEError, match="ondemand.*overlap.*caching"):
        LLM(model=str(setup[0]), device="cpu", policy="magic")


def test_host_policy_needs_the_host_tier(setup, tmp_path):
    with pytest.raises(SpecMoEError, match="--offload host"):
        LLM(model=str(setup[0]), device="cpu", policy="host", offload="disk", offload_dir=str(tmp_path))


def test_disk_tier_repairs_a_corrupted_blob_and_keeps_the_output(setup, tmp_path, capsys):
    path, prompts, ref_stats, budget = setup
    kw = dict(model=str(path), device="cpu", policy="ondemand", offload="disk", offload_dir=str(tmp_path),
              device_memory=budget, max_batch_size=8, max_model_len=64)
    LLM(**kw).close()  # writes the expert file
    llm = LLM(**kw)
    store = llm.engine.policy.store
    with open(store.path, "r+b") as f:  # damage every blob
        for i in range(len(store.keys)):
            f.seek(store.layout.offset(i) + 100)
            f.write(b"\xde\xad")
    llm.generate(prompts, PARAMS)
    assert llm.last_stats["token_ids_sha256"] == ref_stats["token_ids_sha256"]
    assert store.repaired > 0 and "failed its checksum" in capsys.readouterr().err
    llm.close()


def test_disk_file_is_reused_while_the_checkpoint_is_unchanged(setup, tmp_path):
    path, _, _, budget = setup
    kw = dict(model=str(path), device="cpu", policy="ondemand", offload="disk", offload_dir=str(tmp_path),
              device_memory=budget, max_batch_size=8, max_model_len=64)
    LLM(**kw).close()
    blob = next(tmp_path.glob("experts-*.bin"))
    before = blob.stat().st_mtime_ns
    LLM(**kw).close()
    assert blob.stat().st_mtime_ns == before


def test_auto_runs_its_plan_and_keeps_the_output(setup, tmp_path, monkeypatch):
    """On the fixed profile with nothing learnt yet (a fresh cache dir), auto runs the plan
    its planner returned (recorded here, not a plan copied from an earlier run: whether a
    plan is good is tests/test_autotune_choose.py's question, against the fixed policies
    by the same model), and its output is resident's."""
    from specmoe.autotune import choose as choose_module

    path, prompts, ref_stats, budget = setup
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path / "cache"))
    install_fixed_profile(tmp_path / "cache")
    plans, planner = [], choose_module.plan
    monkeypatch.setattr(choose_module, "plan", lambda *a, **kw: plans.append(planner(*a, **kw)) or plans[-1])
    llm = LLM(model=str(path), device="cpu", policy="auto", offload="disk", offload_dir=str(tmp_path),
              device_memory=budget, max_batch_size=8, max_model_len=64)
    llm.generate(prompts, PARAMS)
    stats = llm.last_stats
    [chosen] = plans
    assert (stats["policy"], stats["auto_choice"]) == ("auto", chosen.policy)
    assert stats["auto_plan"].split("; ")[0] == chosen.describe()  # then SpecMoE's draft memory, planned after it
    assert llm.engine.policy.name == chosen.policy
    assert stats["token_ids_sha256"] == ref_stats["token_ids_sha256"]
    llm.close()
