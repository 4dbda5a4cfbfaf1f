"""GammaTuner, the rule that picks each speculative step's gamma, against simulated steps:
drafts accepted at a known rate, passes that cost known seconds (with noise). No model."""

import random

import pytest

from specmoe.engine.gamma import GammaTuner, StepMeasure, expected_tokens


def simulate(acceptance, draft_pass_s, verify_s, steps=60, start=16, batch=16, seed=0, tuner=None):
    """Run `steps` steps of a batch; return (tokens per second, the gammas run, the tuner).
    `acceptance` may be a function of the step index (text that changes)."""
    rng = random.Random(seed)
    tuner = tuner or GammaTuner(gamma=start)
    tokens = seconds = 0.0
    gammas = []
    for i in range(steps):
        g = tuner.gamma
        gammas.append(g)
        a = acceptance(i) if callable(acceptance) else acceptance
        accepted = rejections = 0
        for _ in range(batch):
            k = 0
            while k < g and rng.random() < a:
                k += 1
            accepted += k
            rejections += k < g
        noise = lambda: rng.uniform(0.9, 1.1)  # noqa: E731 - a shared machine's timings
        draft, verify = g * draft_pass_s * noise(), verify_s(g) * noise()
        tokens += accepted + batch
        seconds += draft + verify
        tuner.update(StepMeasure(g, accepted, rejections, draft, verify))
    return tokens / seconds, gammas, tuner


def fixed_rate(acceptance, draft_pass_s, verify_s, g, batch=16):
    return batch * expected_tokens(acceptance, g) / (g * draft_pass_s + verify_s(g))


def best_fixed(acceptance, draft_pass_s, verify_s):
    return max(fixed_rate(acceptance, draft_pass_s, verify_s, g) for g in range(33))


def test_expected_tokens_is_the_geometric_run_plus_one():
    assert expected_tokens(0.0, 16) == 1
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_acceptance_counts_rejections_not_short_drafts():
    tuner = GammaTuner(gamma=4)
    tuner.update(StepMeasure(4, accepted=30, rejections=10, draft_s=1.0, verify_s=1.0))
    assert tuner.acceptance == pytest.approx(31 / 42)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_where_drafts_are_rejected_it_decodes_plainly_within_two_steps(seed):
    # the disk-tier Q4_K_M case: 12 % acceptance, verification that grows with every position
    verify = lambda g: 1.0 + 0.3 * g  # noqa: E731
    rate, gammas, tuner = simulate(0.12, 0.4, verify, seed=seed)
    plain = fixed_rate(0.12, 0.4, verify, 0)
    assert gammas[:3] == [16, 0, 0]
    assert tuner.plain_steps >= 50
    # the first step at 16 costs as much as 12 plain ones here: over 60 steps that is the gap
    assert rate >= 0.8 * plain, (rate, plain)
    assert rate > 2 * fixed_rate(0.12, 0.4, verify, 16)  # what the fixed default would have run at


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_where_verification_is_transfer_bound_it_drafts_long(seed):
    verify = lambda g: 1.0 + 0.01 * g  # noqa: E731 - each expert read serves every position
    rate, gammas, _ = simulate(0.85, 0.02, verify, seed=seed)
    assert sum(g >= 8 for g in gammas[10:]) >= 0.9 * len(gammas[10:])  # all but plain decoding's re-measures
    assert rate >= 0.85 * best_fixed(0.85, 0.02, verify)
    assert rate > 3 * fixed_rate(0.85, 0.02, verify, 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("verify", [
    lambda g: 0.3 + 0.05 * g,  # compute-bound: every verified position costs the same
    lambda g: 0.3 + 0.6 * (1 - 0.8 ** g),  # transfer-bound, saturating as the positions share experts
])
def test_an_optimum_inside_is_found(seed, verify):
    rate, gammas, _ = simulate(0.8, 0.03, verify, seed=seed)
    best = max(range(33), key=lambda g: fixed_rate(0.8, 0.03, verify, g))
    assert 2 <= best <= 12, best
    assert rate >= 0.85 * best_fixed(0.8, 0.03, verify)
    assert rate > 1.2 * fixed_rate(0.8, 0.03, verify, 0)
    assert rate > fixed_rate(0.8, 0.03, verify, 16)  # the fixed default


def test_it_measures_plain_decoding_again_and_drafts_again_when_the_text_turns():
    verify = lambda g: 1.0 + 0.05 * g  # noqa: E731
    acceptance = lambda i: 0.05 if i < 60 else 0.9  # noqa: E731
    _, gammas, tuner = simulate(acceptance, 0.02, verify, steps=140, seed=3, tuner=GammaTuner(gamma=16, reprobe=16))
    assert sum(gammas[20:60]) <= 20  # rejected drafts: plain decoding, now and then a draft of 1 to re-measure
    assert sorted(gammas[110:])[3] >= 8  # after the turn it tried drafts again and climbed
    # plain decoding is measured again every 16 speculative steps
    runs = [i for i in range(100, 140) if gammas[i] == 0]
    assert 1 <= len(runs) <= 4
