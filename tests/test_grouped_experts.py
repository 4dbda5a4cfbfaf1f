"""One grouped computation per MoE block gives what the loop over experts gives: the same
products, added per token in the same (expert) order. Float32 outputs agree to the last
bit or so (a matmul's last bit may depend on where in memory its rows start)."""

from __future__ import annotations

import pytest
import torch

from specmoe.base.specs import ExpertSpec
from specmoe.model.moe import (
    Routing,
    dispatch,
    expert_views,
    group_by_expert,
    grouped_experts,
    grouped_linear,
    one_token_experts,
    run_expert,
    sort_picks,
    stacked_views,
)

E, K, D, I = 6, 2, 16, 8
SPECS = {
    "swiglu": ExpertSpec(D, I),
    "clamped-swiglu-with-biases": ExpertSpec(D, I, activation="clamped_swiglu", bias=True),
    "relu": ExpertSpec(D, I, activation="relu"),
}


def _block(spec: ExpertSpec, tokens: int, scales_input: bool, seed: int = 0, experts: int = E):
    gen = torch.Generator().manual_seed(seed)
    buffers = torch.randn(experts, spec.numel, generator=gen)
    x = torch.randn(tokens, D, generator=gen)
    scores = torch.randn(tokens, experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(scores, -1), K, dim=-1)
    return buffers, x, Routing(ids, weights, scales_input)


def _loop(spec, buffers, x, routing):
    return dispatch(x, group_by_expert(routing, len(buffers)), lambda e, xs: run_expert(buffers[e], xs, spec))


@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("scales_input", [False, True], ids=["weights-outputs", "weights-inputs"])
def test_grouped_block_equals_the_loop_over_experts(name, tokens, scales_input):
    spec = SPECS[name]
    buffers, x, routing = _block(spec, tokens, scales_input)
    picks = sort_picks(routing, E)
    got = grouped_experts(spec, x, picks, stacked_views(buffers, spec), picks.offsets)
    torch.testing.assert_close(got, _loop(spec, buffers, x, routing), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("name", list(SPECS))
def test_a_block_with_few_picks_runs_only_the_picked_experts_and_gives_the_same_block(name, tokens):
    # 16 experts, at most 4 picks: the grouped block loops over the picked experts' groups
    spec = SPECS[name]
    buffers, x, routing = _block(spec, tokens, False, seed=3, experts=16)
    picks = sort_picks(routing, 16)
    got = grouped_experts(spec, x, picks, stacked_views(buffers, spec), picks.offsets)
    torch.testing.assert_close(got, _loop(spec, buffers, x, routing), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("scales_input", [False, True], ids=["weights-outputs", "weights-inputs"])
def test_one_token_runs_its_experts_in_turn_and_gives_the_loops_block(name, scales_input):
    # batch-1 decoding: no sorting or grouping, the outputs added in expert order
    spec = SPECS[name]
    for seed in range(4):
        buffers, x, routing = _block(spec, 1, scales_input, seed=seed, experts=16)
        got = one_token_experts(spec, x, routing, [expert_views(b, spec) for b in buffers])
        assert torch.equal(got, _loop(spec, buffers, x, routing))


def test_present_groups_over_the_picked_experts_only_give_the_same_block():
    spec = SPECS["clamped-swiglu-with-biases"]
    buffers, x, routing = _block(spec, 3, False, seed=1)
    picks = sort_picks(routing, E)
    used, offsets = picks.present()
    assert used.tolist() == sorted(set(routing.ids.flatten().tolist()))
    full = stacked_views(buffers, spec)
    compact = stacked_views(buffers[used], spec)
    compact = type(compact)(compact.w_in, compact.w_out, full.b_in, full.b_out)  # biases are indexed by expert
    assert torch.equal(grouped_experts(spec, x, picks, compact, offsets),
                       grouped_experts(spec, x, picks, full, picks.offsets))


def test_grouped_linear_equals_its_loop_with_empty_groups():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, D, generator=gen), torch.randn(4, 5, D, generator=gen)
    offsets = torch.tensor([0, 3, 3, 7], dtype=torch.int32)  # groups 0 and 2 are empty
    want = torch.cat([x[:3] @ w[1].T, x[3:] @ w[3].T])
    torch.testing.assert_close(grouped_linear(x, w, offsets), want)
    torch.testing.assert_close(grouped_linear(x, w, offsets, offsets.tolist()), want)


def test_sorted_picks_keep_each_experts_tokens_in_order():
    routing = Routing(torch.tensor([[2, 0], [0, 1], [2, 1]]), torch.rand(3, 2))
    picks = sort_picks(routing, 4)
    assert picks.experts.tolist() == [0, 0, 1, 1, 2, 2]
    assert picks.rows.tolist() == [0, 1, 1, 2, 0, 2]
    assert picks.offsets.tolist() == [2, 4, 6, 6]
