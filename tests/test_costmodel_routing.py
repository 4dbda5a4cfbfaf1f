"""Routing model: closed form vs Monte Carlo; acceptance algebra; fitting from a trace."""

import numpy as np
import pytest

from specmoe.base.trace import LayerRouting, StepRecord
from specmoe.costmodel.routing import (
    RoutingModel,
    acceptance_at,
    acceptance_for_tokens_per_step,
    acceptance_from_trace,
    empirical_distinct,
    fit_routing,
    monte_carlo_distinct,
    tokens_per_step,
)


@pytest.mark.parametrize("E,k,B,L,skew,loc", [
    (8, 2, 1, 1, 0.0, 0.0),
    (16, 2, 4, 1, 1.0, 0.0),
    (128, 2, 16, 1, 1.0, 0.0),
    (16, 2, 4, 6, 1.0, 0.5),
    (64, 6, 2, 11, 0.5, 0.2),
])
def test_closed_form_distinct_matches_monte_carlo(E, k, B, L, skew, loc):
    m = RoutingModel(skew, loc)
    closed = m.expected_distinct(E, k, B, L)
    mc = monte_carlo_distinct(m, E, k, B, L, trials=400, seed=1)
    assert closed == pytest.approx(mc, rel=0.03, abs=0.1)


def test_uniform_routing_is_exact_for_top_k_without_replacement():
    # each position picks k distinct experts: expert e is missed with probability 1 - k/E
    E, k, P = 128, 2, 256
    assert RoutingModel(0.0, 0.0).expected_distinct(E, k, P) == pytest.approx(E * (1 - (1 - k / E) ** P))


@pytest.mark.parametrize("skew", [0.0, 1.0, 2.0])
def test_one_position_touches_exactly_k_experts(skew):
    assert RoutingModel(skew, 0.3).expected_distinct(16, 2, 1) == pytest.approx(2.0)


def test_distinct_grows_with_positions_and_saturates_at_E():
    m = RoutingModel()
    d = [m.expected_distinct(128, 2, b) for b in (1, 4, 16, 64, 256, 4096)]
    assert all(a < b for a, b in zip(d, d[1:]))
    assert d[-1] <= 128 and d[-1] > 127


def test_locality_and_skew_each_reduce_distinct_experts():
    base = RoutingModel(0.5, 0.0).expected_distinct(64, 2, 4, 8)
    assert RoutingModel(0.5, 0.6).expected_distinct(64, 2, 4, 8) < base
    assert RoutingModel(1.5, 0.0).expected_distinct(64, 2, 4, 8) < base


def test_excluding_hottest_removes_at_most_that_many():
    m = RoutingModel()
    full, rest = m.expected_distinct(128, 2, 64), m.expected_distinct(128, 2, 64, exclude_hottest=4)
    assert 0 < full - rest <= 4


@pytest.mark.parametrize("a,g,expected", [(0.0, 5, 1.0), (1.0, 5, 6.0), (0.5, 1, 1.5), (0.5, 2, 1.75)])
def test_tokens_per_step_is_truncated_geometric(a, g, expected):
    assert tokens_per_step(a, g) == pytest.approx(expected)


def test_paper_tokens_per_step_inverts_to_acceptance():
    a = acceptance_for_tokens_per_step(7.265, 10)
    assert tokens_per_step(a, 10) == pytest.approx(7.265, abs=1e-6)
    assert 0.90 < a < 0.92


def test_acceptance_rises_with_more_draft_experts():
    m = RoutingModel()
    a = [acceptance_at(0.8, 4, n, 128, m) for n in (2, 4, 8, 16)]
    assert a[1] == 0.8 and all(x < y for x, y in zip(a, a[1:]))


def _synthetic_trace(model, E=16, k=2, B=8, gamma=3, steps=30, acceptance=0.75, seed=0):
    """Records sampled from `model`: decode passes and verify passes with locality."""
    rng = np.random.default_rng(seed)
    q = model.hotness(E)
    perm = rng.permutation(E)  # expert ids need not be ordered by hotness
    records = []
    for step in range(steps):
        for kind, L in (("decode", 1), ("verify", gamma + 1)):
            layers = []
            for layer in range(4):
                counts = {}
                for _ in range(B):
                    picks = rng.choice(E, size=k, p=q)
                    for j in range(L):
                        if j and rng.random() >= model.locality:
                            picks = rng.choice(E, size=k, p=q)
                        for e in picks:
                            counts[int(perm[e])] = counts.get(int(perm[e]), 0) + 1
                layers.append(LayerRouting(layer, counts))
            acc = [int(min(gamma, rng.geometric(1 - acceptance) - 1)) for _ in range(B)] if kind == "verify" else []
            records.append(StepRecord(step, kind, B, B * L, layers, accepted_lengths=acc,
                                      draft_set={l: [0, 1, 2, 3] for l in range(4)} if kind == "verify" else {}))
    return {"model": {"num_experts": E, "top_k": k}}, records


def test_fit_routing_recovers_skew_and_locality_from_a_trace():
    truth = RoutingModel(1.0, 0.5)
    header, records = _synthetic_trace(truth)
    fitted = fit_routing(header, records)
    # what matters: the fitted model predicts the trace's distinct counts
    for p in empirical_distinct(records):
        assert fitted.expected_distinct(16, 2, p.batch, p.per_sequence) == pytest.approx(p.distinct, rel=0.08)
    assert fitted.skew == pytest.approx(1.0, abs=0.35)


def test_acceptance_from_trace_recovers_the_per_token_rate():
    header, records = _synthetic_trace(RoutingModel(), acceptance=0.75, steps=60)
    est = acceptance_from_trace(records)
    assert est.gamma == 3 and est.draft_experts == 4
    assert est.acceptance == pytest.approx(0.75, abs=0.06)


def test_no_verify_steps_means_no_acceptance_estimate():
    assert acceptance_from_trace([StepRecord(0, "decode", 1, 1)]) is None
