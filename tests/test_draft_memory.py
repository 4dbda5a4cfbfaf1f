"""The draft under --draft-memory: the allocation (plain Python, against brute force), the
bytes the draft really holds, the resident model's tokens in every way, and the errors a
user gets for a draft memory that cannot work."""

import itertools
import json
from collections import Counter

import pytest
import torch
from factories import (
    BOOKKEEPING_ALLOWANCE,
    random_prompts,
    resident_reference,
    run_cli,
    watch_device_bytes,
)

from specmoe import LLM, SamplingParams, SpecMoEError
from specmoe.base.checkpoint import Checkpoint
from specmoe.policies.specmoe.allocation import (
    FULL,
    SUBSTITUTE,
    Options,
    allocate,
    choose_full,
    pick_cost,
    pick_shares,
)
from specmoe.policies.specmoe.draft_quality import (
    RESIDUAL_SHARE,
    SAMPLE_ROWS,
    block_weights,
    cached_errors,
    errors_path,
    measure_block,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# bytes per expert and error of each way, shaped like a real expert's (int8 a quarter of
# float32, int4 an eighth, int2 a sixteenth)
NBYTES = {FULL: 1600, "int8": 400, "int4": 200, "int2": 100}
ERRORS = {FULL: 0.0, "int8": 0.01, "int4": 0.12, "int2": 0.45, SUBSTITUTE: 1.2}


def cost_of(held: dict, shares: dict) -> float:
    """The expected cost of an allocation, computed from scratch."""
    return sum(shares[layer][e] * pick_cost(ERRORS[how]) for (layer, e), how in held.items())


def bytes_of(held: dict) -> int:
    return sum(NBYTES.get(how, 0) for how in held.values() if how not in (FULL, SUBSTITUTE))


def brute_force(shares: dict, ways: tuple, budget: int) -> float:
    """The least cost of any assignment of ways to experts within budget."""
    keys = [(layer, e) for layer, row in shares.items() for e in range(len(row))]
    best = float("inf")
    for choice in itertools.product((*ways, SUBSTITUTE), repeat=len(keys)):
        held = dict(zip(keys, choice))
        if bytes_of(held) <= budget:
            best = min(best, cost_of(held, shares))
    return best


# --- the allocation -------------------------------------------------------------------------


def test_pick_cost_grows_with_the_error_and_saturates():
    costs = [pick_cost(e) for e in (0.0, 0.01, 0.12, 0.45, 1.2, 3.0)]
    assert costs[0] == 0 and all(a < b for a, b in zip(costs, costs[1:]))
    assert costs[-1] < 1.0 and costs[-1] - costs[-2] < costs[-2] - costs[-3]  # saturating
    # a substituted pick costs several times an int2 one, more than their error ratio (2.7)
    assert pick_cost(1.2) / pick_cost(0.45) > 4


@pytest.mark.parametrize("budget", [0, 150, 300, 450, 700, 1000, 1600])
def test_allocation_stays_in_budget_and_is_near_the_brute_force_optimum(budget):
    shares = pick_shares({0: [9, 3, 1], 1: [5, 5, 0]})
    ways = ("int8", "int4", "int2")
    a = allocate(shares, Options(NBYTES, ERRORS, ways), budget)
    assert bytes_of(a.held) == a.nbytes <= budget
    assert a.cost == pytest.approx(cost_of(a.held, shares))
    optimum = brute_force(shares, ways, budget)
    # the greedy is within one upgrade of the optimum (the dearest single upgrade's saving)
    one_upgrade = max(s for row in shares.values() for s in row) * pick_cost(ERRORS[SUBSTITUTE])
    assert optimum - 1e-12 <= a.cost <= optimum + one_upgrade


def test_the_hotter_expert_gets_the_better_copy():
    shares = {0: [0.8, 0.2]}
    a = allocate(shares, Options(NBYTES, ERRORS, ("int8", "int2")), 500)
    assert a.held == {(0, 0): "int8", (0, 1): "int2"}


def test_coverage_comes_before_precision():
    """Four equally picked experts and the bytes for one int8 copy or four int2 ones:
    substitution costs more than int2's error, so every expert gets an int2 copy."""
    a = allocate({0: [0.25] * 4}, Options(NBYTES, ERRORS, ("int8", "int2")), 400)
    assert sorted(a.held.values()) == ["int2"] * 4


def test_at_least_one_expert_per_block_is_held_when_the_budget_allows():
    # block 1's experts are rarely picked: the greedy alone would spend everything on block 0
    shares = {0: [0.5, 0.5], 1: [0.01, 0.01]}
    plain = allocate(shares, Options(NBYTES, ERRORS, ("int2",)), 200)
    floor = allocate(shares, Options(NBYTES, ERRORS, ("int2",)), 200, at_least_one=True)
    assert [h for (layer, _), h in plain.held.items() if layer == 1] == [SUBSTITUTE] * 2
    assert floor.covered(0) and floor.covered(1) and floor.nbytes <= 200


def test_a_block_that_writes_more_of_the_stream_weighs_more():
    """Weights are the squared shares of the residual stream over their mean; a block not
    measured yet weighs 1."""
    w = block_weights({0: {RESIDUAL_SHARE: 0.9}, 1: {RESIDUAL_SHARE: 0.3}, 2: {RESIDUAL_SHARE: 0.3}})
    assert w[0] == pytest.approx(0.81 / 0.33) and w[1] == w[2] == pytest.approx(0.09 / 0.33)
    assert block_weights({0: {"int2": 0.4}, 1: {"int2": 0.5}}) == {0: 1.0, 1: 1.0}


def test_the_heavier_block_gets_the_better_copy():
    """Two blocks picked alike: the one whose picks count more gets int4, the other int2;
    unweighted, the tie goes to the first block either way."""
    shares = {0: [1.0], 1: [1.0]}
    heavy_second = allocate(shares, Options(NBYTES, ERRORS, ("int4", "int2"), block_weights={0: 0.5, 1: 1.5}), 300)
    assert heavy_second.held == {(0, 0): "int2", (1, 0): "int4"}
    heavy_first = allocate(shares, Options(NBYTES, ERRORS, ("int4", "int2"), block_weights={0: 1.5, 1: 0.5}), 300)
    assert heavy_first.held == {(0, 0): "int4", (1, 0): "int2"}
    assert heavy_first.cost == pytest.approx(1.5 * pick_cost(ERRORS["int4"]) + 0.5 * pick_cost(ERRORS["int2"]))


def test_full_precision_experts_come_out_of_the_same_budget():
    shares = {0: [0.7, 0.1, 0.1, 0.1]}
    opts = Options(NBYTES, ERRORS, (FULL, "int8"))
    a = choose_full(shares, opts, 1600 + 3 * 400, slot_bytes=1600, most=2)
    assert a.full_per_block == 1 and a.held == {(0, 0): FULL, (0, 1): "int8", (0, 2): "int8", (0, 3): "int8"}
    assert a.nbytes == 1600 + 3 * 400
    # the same bytes with no full precision allowed: int8 copies of all four, bytes to spare
    b = choose_full(shares, Options(NBYTES, ERRORS, ("int8",)), 1600 + 3 * 400, slot_bytes=1600, most=2)
    assert b.full_per_block == 0 and set(b.held.values()) == {"int8"} and b.nbytes == 1600


# --- on a model -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    path = tiny_ckpt("mixtral")
    prompts = random_prompts(6, 128, 3, 10, seed=5)
    sha, budgets, expert_bytes = resident_reference(path, prompts, GREEDY, 6, 48, (0.3,))
    return path, prompts, sha, budgets[0.3], expert_bytes


def memory_llm(reference, tmp_path, share: float, **kw):
    path, _, _, budget, expert_bytes = reference
    draft = int(share * expert_bytes)
    opts = dict(device="cpu", policy="specmoe", offload="disk", offload_dir=str(tmp_path),
                device_memory=budget + draft, max_batch_size=6, max_model_len=48, gamma=3, draft_memory=draft)
    opts.update(kw)
    return LLM(model=str(path), **opts), draft


def draft_tensor_bytes(policy) -> int:
    """The device bytes the draft holds, from its tensors: each distinct storage reachable
    from its copies once, and one pool slot per full-precision draft expert."""
    storages = {}
    copies = policy.quantized
    for key in copies.modes:
        q = copies.expert(*key)
        for t in _tensors(q):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    full = sum(len(experts) for experts in policy.draft.values())
    return sum(storages.values()) + full * policy.pool.slot_bytes


def _tensors(obj, seen=None):
    seen = seen if seen is not None else set()
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, seen)
    elif hasattr(obj, "__dict__"):
        for x in vars(obj).values():
            yield from _tensors(x, seen)


@pytest.mark.parametrize("way,share", [("auto", 0.08), ("auto", 0.2), ("auto", 0.5), ("int2", 0.08),
                                       ("int8", 0.2), ("none", 0.5)])
def test_the_draft_holds_no_more_than_its_memory_and_gives_residents_tokens(reference, tmp_path, way, share):
    _, prompts, sha, budget, _ = reference
    llm, draft = memory_llm(reference, tmp_path, share, draft_quant=way)
    held = watch_device_bytes(llm.engine)
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    assert stats["token_ids_sha256"] == sha
    assert 0 < draft_tensor_bytes(llm.engine.policy) <= draft
    assert held.excess(budget + draft) <= BOOKKEEPING_ALLOWANCE
    if way == "none":
        assert set(stats["draft_held"]) == {FULL, SUBSTITUTE}
    elif way != "auto":
        assert set(stats["draft_held"]) <= {way, SUBSTITUTE} and stats["draft_held"][way] > 0
    llm.close()


def test_the_drafts_picks_are_counted_by_how_they_were_held(reference, tmp_path):
    """draft_picks_by_way against the draft passes' routing, recorded beside the drafter:
    each pick's expert looked up in the allocation of that moment."""
    _, prompts, _, _, _ = reference
    llm, _ = memory_llm(reference, tmp_path, 0.08, draft_quant="auto")
    policy = llm.engine.policy
    seen = Counter()
    run_moe = policy.drafter.run_moe

    def recording(layer, x, routing):
        held = policy.memory.allocation.held
        seen.update(held[(layer, int(e))] for e in routing.ids.flatten())
        return run_moe(layer, x, routing)

    policy.drafter.run_moe = recording
    llm.generate(prompts, GREEDY)
    shares = llm.last_stats["draft_picks_by_way"]
    total = sum(seen.values())
    assert SUBSTITUTE in seen and len(seen) >= 2  # a scarce draft: picks held and substituted
    assert shares == pytest.approx({way: n / total for way, n in seen.items()})
    llm.close()


def test_more_draft_memory_covers_more_and_accepts_more(reference, tmp_path):
    _, prompts, _, _, _ = reference
    seen = []
    for share in (0.08, 0.5):
        llm, _ = memory_llm(reference, tmp_path, share, draft_quant="auto", gamma=4)
        llm.generate(prompts, GREEDY)
        stats = llm.last_stats
        seen.append((stats["draft_held"].get(SUBSTITUTE, 0), stats["acceptance_rate"]))
        llm.close()
    (sub_small, acc_small), (sub_large, acc_large) = seen
    assert sub_large < sub_small and acc_large > acc_small


def test_measured_errors_order_the_precisions(reference):
    """On a block's real inputs, fewer bits give a larger output error, and substitution
    the largest: what the allocation trades."""
    ckpt = Checkpoint(reference[0])
    c = ckpt.config
    x = torch.randn(SAMPLE_ROWS, c.hidden_size, generator=torch.Generator().manual_seed(0))
    for layer in c.moe_layer_ids:
        row = measure_block(ckpt, layer, x, [1] * c.num_experts, None, ["int8", "int4", "int3", "int2"])
        assert 0 < row["int8"] < row["int4"] < row["int3"] < row["int2"] < row[SUBSTITUTE]
        assert row["int8"] < 0.02 and 0.3 < row[SUBSTITUTE] < 3


def test_the_first_prefill_measures_each_blocks_share_of_the_residual_stream(reference, tmp_path):
    """The shares cached after the first prefill, against the same prefill's MoE outputs and
    residual stream seen from the model's side (its layers' outputs, hooked)."""
    from specmoe.model import transformer

    path, prompts, _, _, _ = reference
    outputs, streams = {}, {}
    mlp, forward = transformer.MoETransformer.mlp, transformer.MoETransformer.forward

    def hooked_mlp(self, i, lw, x, experts):
        out = mlp(self, i, lw, x, experts)
        outputs.setdefault(i, out.float().norm(dim=-1).mean().item())  # the first pass: the prefill
        return out

    def hooked_forward(self, tokens, batch, cache, experts):
        after = experts.after_layer

        def seen(i, h):
            streams.setdefault(i, h.float().norm(dim=-1).mean().item())
            after(i, h)

        experts.after_layer = seen
        try:
            return forward(self, tokens, batch, cache, experts)
        finally:
            del experts.after_layer

    transformer.MoETransformer.mlp, transformer.MoETransformer.forward = hooked_mlp, hooked_forward
    try:
        llm, _ = memory_llm(reference, tmp_path, 0.08, draft_quant="auto")
        llm.generate(prompts, GREEDY)
    finally:
        transformer.MoETransformer.mlp, transformer.MoETransformer.forward = mlp, forward
    table = cached_errors(Checkpoint(path), tmp_path, ("int8", "int4", "int3", "int2"))
    assert table is not None and set(table) <= set(outputs)
    for layer, row in table.items():
        assert row[RESIDUAL_SHARE] == pytest.approx(outputs[layer] / streams[layer], rel=1e-5)
    llm.close()


def test_info_shows_the_block_weights_once_a_run_has_measured_them(reference, tmp_path, capsys):
    path, prompts, _, _, expert_bytes = reference
    args = ("info", "--model", str(path), "--device", "cpu", "--draft-memory", str(int(0.2 * expert_bytes)),
            "--offload-dir", str(tmp_path), "--json")
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    assert json.loads(out)["draft_block_weights"].startswith("1 each until")
    llm, _ = memory_llm(reference, tmp_path, 0.2, draft_quant="auto")
    llm.generate(prompts, GREEDY)
    llm.close()
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    table = cached_errors(Checkpoint(path), tmp_path, ("int8", "int4", "int3", "int2"))
    want = {str(layer): round(w, 2) for layer, w in block_weights(table).items()}
    assert json.loads(out)["draft_block_weights"] == want


def test_a_cached_table_without_the_residual_shares_is_measured_again(reference, tmp_path):
    ckpt = Checkpoint(reference[0])
    rows = {layer: {FULL: 0.0, "int2": 0.4, SUBSTITUTE: 1.2, RESIDUAL_SHARE: 0.2} for layer in ckpt.config.draft_layer_ids}
    errors_path(ckpt, tmp_path).write_text(json.dumps({str(k): v for k, v in rows.items()}))
    assert cached_errors(ckpt, tmp_path, ("int2",)) is not None
    for row in rows.values():
        del row[RESIDUAL_SHARE]  # written before the shares were measured
    errors_path(ckpt, tmp_path).write_text(json.dumps({str(k): v for k, v in rows.items()}))
    assert cached_errors(ckpt, tmp_path, ("int2",)) is None


# --- what a user is told -----------------------------------------------------------------------


def test_a_draft_memory_too_small_for_one_copy_a_block_says_how_much_is_needed(reference, tmp_path):
    with pytest.raises(SpecMoEError, match=r"--draft-memory .* holds less than one copy of an expert per block.*raise it to at least"):
        memory_llm(reference, tmp_path, 0.0, draft_memory=64)


def test_the_papers_draft_in_too_little_memory_says_so(reference, tmp_path):
    with pytest.raises(SpecMoEError, match=r"holds less than one full-precision expert per block.*--draft-quant auto"):
        memory_llm(reference, tmp_path, 0.02, draft_quant="none")


def test_a_share_of_no_budget_is_an_error(reference, tmp_path):
    path = reference[0]
    with pytest.raises(SpecMoEError, match=r"share of the device budget, and there is none: give --device-memory"):
        LLM(model=str(path), device="cpu", policy="specmoe", offload="disk", offload_dir=str(tmp_path),
            draft_memory="20%")


@pytest.mark.parametrize("kw,what", [(dict(policy="ondemand"), "policy ondemand has none: drop it or use --policy specmoe"),
                                     (dict(draft_compute="host", offload="host"), "--draft-compute host holds nothing there")])
def test_draft_memory_with_a_policy_or_draft_that_cannot_use_it_is_an_error(reference, tmp_path, kw, what):
    with pytest.raises(SpecMoEError, match=what):
        memory_llm(reference, tmp_path, 0.2, **kw)


# --- specmoe info --------------------------------------------------------------------------


@pytest.mark.parametrize("way,share", [("auto", 0.2), ("none", 0.5)])
def test_info_says_what_the_draft_would_hold_as_the_engine_then_holds_it(reference, tmp_path, capsys, way, share):
    path, _, _, _, expert_bytes = reference
    draft = int(share * expert_bytes)
    code, out, err = run_cli(capsys, "info", "--model", str(path), "--device", "cpu", "--draft-memory", str(draft),
                           "--draft-quant", way, "--offload-dir", str(tmp_path), "--json")
    assert code == 0, err
    info = json.loads(out)
    c = Checkpoint(path).config
    assert sum(info["draft_holds"].values()) == len(c.moe_layer_ids) * c.num_experts
    assert info["draft_full_bytes"] + info["draft_copies_bytes"] + info["draft_scratch_bytes"] <= draft == info["draft_memory"]
    llm, _ = memory_llm(reference, tmp_path, share, draft_quant=way)
    policy = llm.engine.policy
    assert info["draft_full_per_block"] == policy.draft_experts
    assert info["draft_full_bytes"] == policy.draft_experts * len(c.moe_layer_ids) * policy.pool.slot_bytes
    llm.close()


def test_info_with_a_draft_memory_share_and_no_budget_is_a_one_line_error(reference, capsys):
    code, _, err = run_cli(capsys, "info", "--model", str(reference[0]), "--draft-memory", "20%")
    assert code != 0 and len(err.strip().splitlines()) == 1
    assert "give --device-memory too" in err


@pytest.mark.parametrize("args,says", [
    (["--ablation-draft-memory", "10%"], "add --ablation draft-memory"),
    (["--ablation", "draft-memory", "--ablation-draft-memory", "10%,150%"], "'150%' is not a share of the expert bytes"),
    (["--ablation-draft-ways", "int4"], "add --ablation draft-memory"),
    (["--ablation", "draft-memory", "--ablation-draft-ways", "int4,int5"], "int5 is not a way; use some of allocated,"),
])
def test_bench_draft_memory_points_are_checked(capsys, args, says):
    code, _, err = run_cli(capsys, "bench", "--no-grid", *args)
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1


# --- the bench's curve --------------------------------------------------------------------------


def _curve_doc(batch: int, points: dict) -> dict:
    records = [{"label": "ondemand", "policy": "ondemand", "decode_tokens_per_s": 10.0, "tokens_per_step": 1.0}]
    for (share, way), (tps, tok_s) in points.items():
        records.append({"label": f"{way} {share:.0%}", "policy": "specmoe", "draft_memory_share": share,
                        "draft_way": way, "tokens_per_step": tps, "decode_tokens_per_s": tok_s,
                        "acceptance_rate": 0.5, "gamma": 16})
    records.append({"label": "paper 5%", "draft_memory_share": 0.05, "draft_way": "paper", "skipped": "too small"})
    return {"ablations": [{"ablation": "draft-memory", "batch_size": batch, "what": "", "records": records}],
            "config": {"model": {"path": "demo"}, "offload": "disk"}}


def test_the_curves_ways_can_be_narrowed():
    from specmoe.bench.ablation import variants

    every = variants("draft-memory", 16, 16, False, expert_bytes=1000, shares=[0.2])
    some = variants("draft-memory", 16, 16, False, expert_bytes=1000, shares=[0.2], ways=("allocated", "paper"))
    assert len(every) == 6 and [v.fields["draft_way"] for v in some] == ["allocated", "paper"]
    split = variants("draft-split", 16, 16, False, expert_bytes=1000, shares=[0.5], ways=("int4",))
    assert [v.fields["draft_way"] for v in split] == ["planner", "int4"]


def test_the_curves_goal_table_compares_the_allocator_with_the_best_format_and_the_papers_draft(tmp_path):
    from specmoe.bench.plot import write_draft_memory_plot
    from specmoe.bench.draft_memory import draft_memory_goals

    doc = _curve_doc(16, {(0.05, "allocated"): (3.0, 20.0), (0.05, "int2"): (2.0, 15.0), (0.05, "int8"): (1.5, 30.0),
                          (0.2, "allocated"): (9.0, 40.0), (0.2, "int4"): (10.0, 45.0), (0.2, "paper"): (2.0, 9.0)})
    rows = [line.strip("| ").split(" | ") for line in draft_memory_goals([doc]).splitlines()[2:]]
    small, large = rows
    assert small[5:11] == ["int2 2.00", "1.500x", "yes", "does not fit", "–", "–"]
    assert small[4] == "2.00x"  # 20 tok/s against ondemand's 10
    assert large[5:11] == ["int4 10.00", "0.900x", "no", "2.00", "4.50x", "yes"]
    write_draft_memory_plot([doc, _curve_doc(1, {(0.2, "allocated"): (4.0, 5.0)})], str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_a_point_short_on_the_curve_says_what_its_run_with_more_prompts_gave():
    from specmoe.bench.draft_memory import draft_memory_goals

    curve = _curve_doc(1, {(0.05, "allocated"): (3.9, 5.0), (0.05, "int3"): (4.4, 5.0),
                           (0.1, "allocated"): (9.0, 5.0), (0.1, "int3"): (9.5, 5.0)})
    sample = _curve_doc(1, {(0.05, "allocated"): (4.6, 5.0), (0.05, "int3"): (4.0, 5.0)})
    sample["config"]["prompt_batches"] = 32
    five, ten = [line.strip("| ").split(" | ") for line in draft_memory_goals([curve], {1: sample}).splitlines()[2:]]
    assert five[7] == "no; 1.150x (int3) on 32 prompts (below)"
    assert ten[7] == "no"  # the sample did not run at 10 %
    other = [line.strip("| ").split(" | ") for line in draft_memory_goals([curve], {16: sample}).splitlines()[2:]]
    assert other[0][7] == "no"  # another batch size's sample says nothing of this one


def test_twice_the_papers_draft_above_gamma_plus_one_is_said_to_be_out_of_reach():
    from specmoe.bench.draft_memory import draft_memory_goals

    doc = _curve_doc(16, {(0.4, "allocated"): (15.7, 20.0), (0.4, "int8"): (15.7, 20.0), (0.4, "paper"): (10.9, 9.0),
                          (0.2, "allocated"): (8.0, 20.0), (0.2, "int8"): (7.0, 20.0), (0.2, "paper"): (5.0, 9.0)})
    (mid, high) = [line.strip("| ").split(" | ") for line in draft_memory_goals([doc]).splitlines()[2:]]
    assert mid[10] == "no"  # 1.6x, and 2x (10 tokens per step) is within gamma + 1 = 17
    assert high[10] == "no: 2x is 21.8, above gamma + 1 = 17"


def test_each_way_averaged_over_batch_sizes_sets_the_allocator_against_the_best_mean():
    from specmoe.bench.draft_memory import draft_memory_means

    one = _curve_doc(1, {(0.05, "allocated"): (2.97, 6.0), (0.05, "int3"): (3.17, 6.0), (0.05, "int2"): (2.92, 6.0)})
    many = _curve_doc(16, {(0.05, "allocated"): (2.85, 6.0), (0.05, "int3"): (1.77, 6.0), (0.05, "int2"): (2.86, 6.0),
                           (0.1, "allocated"): (9.0, 9.0)})  # measured at one batch size only: no row
    table = draft_memory_means([one, many])
    (row,) = [line.strip("| ").split(" | ") for line in table.splitlines()[4:]]
    assert row == ["5%", "1, 16", "2.91", "int2 2.89", "1.007x"]
    assert draft_memory_means([one]) == ""


def test_one_run_per_draft_memory_makes_one_curve_each_point_against_its_own_ondemand(tmp_path):
    """The real-size curve is one run per draft memory: a batch size's documents are one
    column, and each point's throughput is divided by the ondemand of its own run."""
    from specmoe.bench.draft_memory import draft_memory_columns, draft_memory_means
    from specmoe.bench.plot import write_draft_memory_plot

    low = _curve_doc(16, {(0.2, "allocated"): (8.0, 20.0), (0.2, "int4"): (6.0, 15.0)})
    high = _curve_doc(16, {(0.4, "allocated"): (12.0, 30.0), (0.4, "int4"): (11.0, 25.0)})
    high["ablations"][0]["records"][0]["decode_tokens_per_s"] = 5.0  # a slower machine for that run
    one = _curve_doc(1, {(0.2, "allocated"): (5.0, 4.0), (0.2, "int4"): (4.0, 3.0)})
    columns = dict(draft_memory_columns([low, one, high]))
    assert sorted(columns) == [1, 16] and sorted(columns[16]) == [(0.2, "allocated"), (0.2, "int4"),
                                                                 (0.4, "allocated"), (0.4, "int4")]
    record, base = columns[16][0.4, "allocated"]
    assert record["decode_tokens_per_s"] / base["decode_tokens_per_s"] == 6.0
    assert columns[16][0.2, "allocated"][1]["decode_tokens_per_s"] == 10.0
    (row,) = [line.strip("| ").split(" | ") for line in draft_memory_means([low, one, high]).splitlines()[4:]]
    assert row == ["20%", "1, 16", "6.50", "int4 5.00", "1.300x"]
    write_draft_memory_plot([low, one, high], str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").stat().st_size > 10_000


def test_the_scarce_points_with_more_prompts_are_set_beside_the_curves_comparison():
    """Each sampled point: the allocator against the best single format there, its prompt
    count, and the same comparison on the curve's run of that model and batch size."""
    from specmoe.bench.draft_memory import draft_memory_samples

    curve = _curve_doc(1, {(0.05, "allocated"): (2.97, 6.0), (0.05, "int3"): (3.17, 6.0), (0.05, "paper"): (9.0, 9.0),
                           (0.1, "allocated"): (9.5, 9.0), (0.1, "int3"): (10.0, 9.0)})
    sample = _curve_doc(1, {(0.05, "allocated"): (3.01, 6.0), (0.05, "int3"): (2.87, 6.0), (0.05, "int2"): (3.09, 6.0),
                            (0.1, "allocated"): (9.68, 9.0), (0.1, "int3"): (9.50, 9.0)})
    sample["config"]["prompt_batches"] = 16
    per_request = {"allocated 5%": [[30, 10], [30, 10]], "int2 5%": [[31, 10], [31, 10]],
                   "allocated 10%": [[90, 9], [10, 1]], "int3 10%": [[90, 10], [10, 1]]}
    for r in sample["ablations"][0]["records"]:
        if r["label"] in per_request:
            r["sequence_decode"] = per_request[r["label"]]
    table = draft_memory_samples([("draft-memory-sample-1.json", sample)], {"draft-memory-1.json": curve})
    low, high = [line.strip("| ").split(" | ") for line in table.splitlines()[2:]]
    # every request 3.0 against 3.1 tokens a step: no resampling reaches 1.0
    assert low == ["demo", "1", "5%", "16", "3.01", "int3 2.87 · int2 3.09", "0.974x", "0.968-0.968", "no",
                   "0.937x (int3)"]
    # one request gains 10 %, one does not: resampled, from 1.0 (the second twice) to 1.11 (the first twice)
    assert high[6:] == ["1.019x", "1.000-1.111", "yes", "0.950x (int3)"]
    close = _curve_doc(16, {(0.05, "allocated"): (1.4, 6.0), (0.05, "int2"): (1.45, 6.0)})
    close["config"]["prompt_batches"] = 1
    for r, counts in zip(close["ablations"][0]["records"][1:3], ([[8, 10], [20, 10]], [[10, 10], [19, 10]])):
        r["sequence_decode"] = counts  # below overall, above on the second request alone
    (row,) = [line.strip("| ").split(" | ") for line in
              draft_memory_samples([("draft-memory-sample-16.json", close)], {}).splitlines()[2:]]
    assert row[6:] == ["0.966x", "0.800-1.053", "no; 1.0 in the interval", "–"]
    translated = draft_memory_samples([("draft-memory-sample-translate-1.json", sample)], {})
    assert translated.splitlines()[2].startswith("| translation | 1 | 5% |") and translated.splitlines()[2].endswith("| – |")
    close["config"]["prompts_skip"] = 128  # a later set of the file's prompts: which ones, and no curve beside it
    later = draft_memory_samples([("draft-memory-sample-skip128-16.json", close)], {"draft-memory-16.json": curve})
    assert later.splitlines()[2].startswith("| demo (prompts 129-144) | 16 | 5% | 16 |") and later.endswith("| – |\n")


def test_a_point_sampled_on_several_sets_of_prompts_is_pooled_over_their_requests():
    """Pooled: each way's tokens over its steps across every set's requests (not the mean of
    the sets' ratios), the best single format chosen on the pooled figures; a point sampled
    on one set, or without per-request counts, gets no pooled row."""
    from specmoe.bench.draft_memory import draft_memory_pooled

    def sample(skip: int, allocated: list, int3: list, int2: list) -> dict:
        doc = _curve_doc(1, {(0.05, "allocated"): (0.0, 1.0), (0.05, "int3"): (0.0, 1.0), (0.05, "int2"): (0.0, 1.0),
                             (0.1, "allocated"): (5.0, 1.0), (0.1, "int3"): (4.0, 1.0)})
        doc["config"].update(prompt_batches=2, prompts_skip=skip)
        for r in doc["ablations"][0]["records"]:
            r["sequence_decode"] = {"allocated 5%": allocated, "int3 5%": int3, "int2 5%": int2}.get(r["label"])
        return doc

    first = sample(0, [[30, 10], [30, 10]], [[40, 10], [40, 10]], [[20, 10], [20, 10]])  # int3 best: 0.75x
    second = sample(2, [[90, 10], [90, 10]], [[50, 10], [50, 10]], [[60, 10], [60, 10]])  # int2 best: 1.5x
    table = draft_memory_pooled([("draft-memory-sample-translate-1.json", first),
                                 ("draft-memory-sample-translate-skip2-1.json", second)])
    (row,) = [line.strip("| ").split(" | ") for line in table.splitlines()[2:]]
    # allocated 240 tokens / 40 steps = 6.0; int3 180 / 40 = 4.5 (int2 4.0): 1.333x, not the sets' mean 1.125x
    assert row[:8] == ["translation", "1", "5%", "1-2, 3-4", "4", "6.00", "int3 4.50", "1.333x"]
    assert row[9] == "yes" and float(row[8].split("-")[0]) < 1.333 < float(row[8].split("-")[1])
    assert draft_memory_pooled([("draft-memory-sample-translate-1.json", first)]) == ""
    assert draft_memory_pooled([("draft-memory-sample-1.json", first),
                                ("draft-memory-sample-translate-skip2-1.json", second)]) == ""  # two models


def test_copies_chosen_again_free_the_stale_ones_before_the_new_ones_are_read(reference, tmp_path, monkeypatch):
    """Reallocating after a prefill must not hold the old copies and the new together (up
    to twice the draft's memory): every tensor of a copy no longer wanted is gone before
    the first new copy is read."""
    import gc
    import weakref

    from specmoe.experts import draft_copies

    ckpt = Checkpoint(reference[0])
    have, _ = draft_copies.load_copies(ckpt, {(0, 0): "int2", (0, 1): "int2", (1, 1): "int2"}, tmp_path, "cpu")
    stale = [weakref.ref(t) for key in ((0, 1), (1, 1)) for t in _tensors(have.expert(*key))]
    assert stale
    alive_at_reads = []
    read_rows = draft_copies._read_rows

    def watched(*args):
        for row in read_rows(*args):
            gc.collect()
            alive_at_reads.append(sum(r() is not None for r in stale))
            yield row

    monkeypatch.setattr(draft_copies, "_read_rows", watched)
    new, read = draft_copies.load_copies(ckpt, {(0, 0): "int2", (0, 2): "int2", (1, 2): "int2"}, tmp_path, "cpu", have)
    assert alive_at_reads == [0, 0] and read > 0
    assert sorted(new.modes) == [(0, 0), (0, 2), (1, 2)]


def test_copies_read_from_a_mode_file_built_block_by_block_are_those_made_without_one(reference, tmp_path):
    """The cache file (built a block at a time) and no file at all (each copy quantized from
    the checkpoint, as where the cache dir is read-only) give every copy the same bytes."""
    from specmoe.experts import draft_copies

    ckpt = Checkpoint(reference[0])
    wanted = {(0, 0): "int4", (1, 2): "int4", (0, 1): "int2", (1, 3): "int8"}
    cached, _ = draft_copies.load_copies(ckpt, wanted, tmp_path, "cpu")
    alone, _ = draft_copies.load_copies(ckpt, wanted, None, "cpu")
    for key in wanted:
        ours, theirs = list(_tensors(cached.expert(*key))), list(_tensors(alone.expert(*key)))
        assert ours and len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_each_requests_decode_tokens_and_steps_add_up_to_the_runs_tokens_per_step(reference, tmp_path):
    """The per-request counts the scarce points' intervals resample are the run's own."""
    _, prompts, _, _, _ = reference
    llm, _ = memory_llm(reference, tmp_path, 0.2)
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    per_request = stats["sequence_decode"]
    assert len(per_request) == len(prompts) and all(steps > 0 for _, steps in per_request)
    assert sum(t for t, _ in per_request) == stats["generated_tokens"] - len(prompts)
    assert sum(t for t, _ in per_request) / sum(s for _, s in per_request) == pytest.approx(stats["tokens_per_step"])
    llm.close()


def test_runs_made_again_say_whether_the_draft_held_the_same_copies():
    from specmoe.bench.rerun import same_holdings

    def doc(*records):
        return {"ablations": [{"ablation": "draft-memory", "records": [{"label": "ondemand", "tokens_per_step": 1.0},
                                                                        *records]}]}

    page = doc({"label": "allocated 20%", "draft_held": {"int8": 67, "int4": 61}, "tokens_per_step": 13.05},
               {"label": "int8 20%", "draft_held": {"int8": 102, "substitute": 26}, "tokens_per_step": 9.9})
    same = doc({"label": "allocated 20%", "draft_held": {"int4": 61, "int8": 67}, "tokens_per_step": 13.05})
    moved = doc({"label": "allocated 20%", "draft_held": {"int4": 62, "int8": 66}, "tokens_per_step": 12.9},
                {"label": "planner", "draft_held": {"int8": 128}, "tokens_per_step": 14.6})  # not on the page
    rows = [line.strip("| ").split(" | ") for line in
            same_holdings([("B = 1", page, same), ("B = 16", page, moved)]).splitlines()[2:]]
    assert rows == [["B = 1", "allocated 20%", "int4 61, int8 67", "int4 61, int8 67", "yes", "13.050", "13.050"],
                    ["B = 16", "allocated 20%", "int4 61, int8 67", "int4 62, int8 66", "no", "13.050", "12.900"]]
