"""GammaTuner, the rule that picks each speculative step's gamma, against simulated steps:
drafts accepted at known rates, passes that cost known seconds (with noise). No model."""

import random

import pytest

from specmoe.engine.gamma import AcceptanceDepth, GammaTuner, StepMeasure


def geometric(a: float, g: int) -> float:
    """A sequence's tokens per step at gamma g when each draft token is accepted with probability a."""
    return sum(a ** k for k in range(g + 1))


def simulate(rates, draft_pass_s, verify_s, steps=60, start=16, seed=0, tuner=None):
    """Run `steps` steps of a batch whose sequence i accepts each draft token with
    probability rates[i] (or rates(step)[i]: text that changes); return (tokens per second,
    the gammas run, the tuner)."""
    rng = random.Random(seed)
    tuner = tuner or GammaTuner(gamma=start)
    tokens = seconds = 0.0
    gammas = []
    for i in range(steps):
        g = tuner.gamma
        gammas.append(g)
        drafts = []
        for a in (rates(i) if callable(rates) else rates):
            k = 0
            while k < g and rng.random() < a:
                k += 1
            drafts.append((g, k))
        noise = lambda: rng.uniform(0.9, 1.1)  # noqa: E731 - a shared machine's timings
        draft, verify = g * draft_pass_s * noise(), verify_s(g) * noise()
        tokens += sum(k + 1 for _, k in drafts)
        seconds += draft + verify
        tuner.update(StepMeasure(g, tuple(drafts), draft, verify))
    return tokens / seconds, gammas, tuner


def fixed_rate(rates, draft_pass_s, verify_s, g):
    return sum(geometric(a, g) for a in rates) / (g * draft_pass_s + verify_s(g))


def best_fixed(rates, draft_pass_s, verify_s):
    return max(fixed_rate(rates, draft_pass_s, verify_s, g) for g in range(33))


def test_the_depth_curve_is_the_share_accepted_at_each_position_and_falls_on_past_it():
    depth = AcceptanceDepth(memory=1.0)
    depth.record([(4, 4), (4, 0), (4, 2), (2, 2)])  # (drafted, accepted)
    assert depth.share(1) == pytest.approx(3 / 4, abs=1e-3)
    assert depth.share(3) == pytest.approx(1 / 3, abs=1e-3)  # of the three that drafted 3
    assert depth.share(5) == pytest.approx(depth.share(4) * depth.share(4) / depth.share(3), abs=1e-3)
    assert depth.expected_tokens(2) == pytest.approx(1 + 3 / 4 + 3 / 4, abs=1e-3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_where_drafts_are_rejected_it_decodes_plainly_from_the_second_step(seed):
    # 12 % acceptance, verification that grows with every position
    verify = lambda g: 1.0 + 0.3 * g  # noqa: E731
    rates = [0.12] * 16
    rate, gammas, tuner = simulate(rates, 0.4, verify, seed=seed)
    plain = fixed_rate(rates, 0.4, verify, 0)
    assert gammas[:3] == [16, 0, 0]
    assert tuner.plain_steps >= 50
    # the first step at 16 costs as much as 12 plain ones here: over 60 steps that is the gap
    assert rate >= 0.8 * plain, (rate, plain)
    assert rate > 2 * fixed_rate(rates, 0.4, verify, 16)  # what a fixed 16 would have run at


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_where_verification_is_transfer_bound_it_drafts_long(seed):
    verify = lambda g: 1.0 + 0.01 * g  # noqa: E731 - each expert read serves every position
    rates = [0.85] * 16
    rate, gammas, _ = simulate(rates, 0.02, verify, seed=seed)
    assert sum(g >= 8 for g in gammas[10:]) >= 0.9 * len(gammas[10:])  # all but plain decoding's re-measures
    assert rate >= 0.85 * best_fixed(rates, 0.02, verify)
    assert rate > 3 * fixed_rate(rates, 0.02, verify, 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_where_some_sequences_accept_everything_and_others_nothing_it_drafts_long(seed):
    """The gguf-disk case: repetitive sequences accept whole drafts, the rest reject the
    first token. One rate per token (0.5 here) would say gamma 2; the depth curve says
    long drafts pay for the first half while verification costs the same at any gamma."""
    verify = lambda g: 0.7 + 0.005 * g  # noqa: E731
    rates = [0.98] * 8 + [0.03] * 8
    rate, gammas, _ = simulate(rates, 0.06, verify, seed=seed)
    best = max(range(33), key=lambda g: fixed_rate(rates, 0.06, verify, g))
    assert best >= 8
    assert rate >= 0.85 * best_fixed(rates, 0.06, verify)
    assert rate > 1.2 * fixed_rate(rates, 0.06, verify, 2)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("verify", [
    lambda g: 0.3 + 0.05 * g,  # compute-bound: every verified position costs the same
    lambda g: 0.3 + 0.6 * (1 - 0.8 ** g),  # transfer-bound, saturating as the positions share experts
])
def test_an_optimum_inside_is_found(seed, verify):
    rates = [0.8] * 16
    rate, gammas, _ = simulate(rates, 0.03, verify, seed=seed)
    best = max(range(33), key=lambda g: fixed_rate(rates, 0.03, verify, g))
    assert 2 <= best <= 12, best
    assert rate >= 0.85 * best_fixed(rates, 0.03, verify)
    assert rate > 1.2 * fixed_rate(rates, 0.03, verify, 0)
    assert rate > fixed_rate(rates, 0.03, verify, 16)  # the fixed default


def test_it_measures_plain_decoding_again_and_drafts_again_when_the_text_turns():
    verify = lambda g: 1.0 + 0.05 * g  # noqa: E731
    rates = lambda i: [0.05 if i < 60 else 0.9] * 16  # noqa: E731
    _, gammas, tuner = simulate(rates, 0.02, verify, steps=140, seed=3, tuner=GammaTuner(gamma=16, reprobe=16))
    assert sum(gammas[20:60]) <= 20  # rejected drafts: plain decoding, now and then a short draft to re-measure
    assert sorted(gammas[110:])[3] >= 8  # after the turn it tried drafts again and climbed
    # plain decoding is measured again every 16 speculative steps
    runs = [i for i in range(100, 140) if gammas[i] == 0]
    assert 1 <= len(runs) <= 4
