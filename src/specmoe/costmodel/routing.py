"""Routing and acceptance models: how many experts a pass touches, how many tokens a
speculative step gains.

Synthetic routing model (used when no trace exists), per MoE layer:

- *Hotness.* Expert of rank i (0 = hottest) is picked with probability
  q_i ∝ ((i + 1/2) / E) ** -skew. Rank is normalised by E, so the same skew describes a
  16-expert demo model and a 128-expert model alike: that is how a demo-model trace
  scales to a big model ("scale by E"). skew = 0 is uniform routing.
- *Picks.* Each position picks k distinct experts (top-k draws without replacement).
  Closed form: it misses expert e with probability m_e = (1 - q_e)^k', k' >= k chosen so
  that the position touches exactly k experts in expectation (sum of 1 - m_e = k); for
  uniform routing that is the exact k/E. (k' = k would be k draws with replacement:
  at batch 1 of a top-2 model about 11 % too few experts.)
- *Temporal locality.* A pass covers B sequences with L consecutive positions each
  (decode: L = 1; verify: L = gamma + 1). Position j > 0 of a sequence repeats the picks
  of position j - 1 with probability `locality`, else draws afresh.

Closed form. Expert e is missed by a first position with probability m_e and by a later
position with probability λ + (1 - λ) m_e (a repeat misses e exactly when its
predecessor did, which is already accounted for), so

    P(e touched) = 1 - m_e^B * (λ + (1 - λ) m_e)^(B (L - 1))

and the expected number of distinct experts is the sum over e. With λ = 0 this is the
E-term sum  Σ_e 1 - m_e^P  for P = B L independent positions.

Acceptance: with per-token acceptance a and gamma drafts, accepted drafts are a truncated
geometric and tokens per step (accepted + the target's own token) are
(1 - a^(γ+1)) / (1 - a).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..base.trace import StepRecord

DEFAULT_SKEW = 1.0
DEFAULT_LOCALITY = 0.2
DEFAULT_ACCEPTANCE = 0.7  # per-token acceptance at DEFAULT_DRAFT_EXPERTS when nothing better is known
DEFAULT_DRAFT_EXPERTS = 4
# Per-token acceptance of quantized drafts (copies of every expert, exact routing) when
# nothing better is known: measured on the demo model (BENCHMARKS.md, quantized drafts:
# int8 0.998, int4 0.900; int3 agreement 0.93), rounded down.
DEFAULT_QUANT_ACCEPTANCE = {"int8": 0.99, "int4": 0.9, "int3": 0.8}
# How per-token rejection (1 - a) scales with the routing mass the draft set does not
# cover: miss ∝ uncovered ** COVERAGE_BETA. Derived once from the SpecMoE paper's draft-set
# ablation (NLLB-MoE, γ=10, N=4: temporal-hot 7.265 vs random 6.812 tokens/step, i.e.
# a = 0.913 vs 0.898, uncovered mass 0.51 vs 0.97 at skew 1): beta = 0.24. Affinity
# substitution makes acceptance weakly sensitive to which experts are resident.
COVERAGE_BETA = 0.25


@dataclass(frozen=True)
class RoutingModel:
    skew: float = DEFAULT_SKEW
    locality: float = DEFAULT_LOCALITY

    def __post_init__(self) -> None:
        if not 0.0 <= self.skew <= 4.0:
            raise ValueError(f"routing skew must be in [0, 4], got {self.skew}")
        if not 0.0 <= self.locality < 1.0:
            raise ValueError(f"routing locality must be in [0, 1), got {self.locality}")

    def hotness(self, num_experts: int) -> np.ndarray:
        """Pick probabilities, hottest first (sums to 1)."""
        r = (np.arange(num_experts) + 0.5) / num_experts
        w = r ** -self.skew
        return w / w.sum()

    def position_miss(self, num_experts: int, top_k: int) -> np.ndarray:
        """P(one position does not pick expert e): (1 - q_e)^k' with sum(1 - .) = k."""
        return _position_miss(self.skew, num_experts, top_k)

    def touched(self, num_experts: int, top_k: int, batch: int, per_sequence: int = 1) -> np.ndarray:
        """P(expert touched) in one layer for a pass over batch x per_sequence positions."""
        miss_first = self.position_miss(num_experts, top_k)
        miss_later = self.locality + (1.0 - self.locality) * miss_first
        with np.errstate(divide="ignore"):  # q = 1 (a single expert): log 0 = -inf, touched = 1
            log_miss = batch * np.log(miss_first)
            if per_sequence > 1:
                log_miss = log_miss + batch * (per_sequence - 1) * np.log(miss_later)
        return 1.0 - np.exp(log_miss)

    def expected_distinct(self, num_experts: int, top_k: int, batch: int, per_sequence: int = 1,
                          exclude_hottest: int = 0) -> float:
        """Expected distinct experts per layer, not counting the `exclude_hottest` hottest
        (those resident on the device: cache or draft set)."""
        return float(self.touched(num_experts, top_k, batch, per_sequence)[exclude_hottest:].sum())

    def coverage(self, num_experts: int, n: int) -> float:
        """Routing mass on the n hottest experts."""
        return float(self.hotness(num_experts)[: max(0, n)].sum())


@lru_cache(maxsize=256)
def _position_miss(skew: float, num_experts: int, top_k: int) -> np.ndarray:
    """Solved once per (skew, E, k): the planner asks for it hundreds of times a plan."""
    q = RoutingModel(skew, 0.0).hotness(num_experts)
    k = min(top_k, num_experts)
    if k >= num_experts:
        return np.zeros_like(q)
    lo, hi = float(k), float(k)
    while (1.0 - (1.0 - q) ** hi).sum() < k:
        hi *= 2.0
    for _ in range(50):  # bisection on k'
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (1.0 - (1.0 - q) ** mid).sum() < k else (lo, mid)
    miss = (1.0 - q) ** hi
    miss.flags.writeable = False  # shared by every caller
    return miss


def monte_carlo_distinct(model: RoutingModel, num_experts: int, top_k: int, batch: int, per_sequence: int = 1,
                         trials: int = 200, seed: int = 0) -> float:
    """Sample the routing model directly (a check on the closed form)."""
    rng = np.random.default_rng(seed)
    q = model.hotness(num_experts)
    total = 0
    for _ in range(trials):
        # Fresh draw groups per sequence: the first position, plus each later position
        # that does not repeat its predecessor. Repeats add no new experts.
        fresh = batch + rng.binomial(batch * (per_sequence - 1), 1.0 - model.locality) if per_sequence > 1 else batch
        picks = [rng.choice(num_experts, size=top_k, replace=False, p=q) for _ in range(fresh)]
        total += np.unique(np.concatenate(picks)).size
    return total / trials


# ---- acceptance -------------------------------------------------------------------------------

def tokens_per_step(acceptance: float, gamma: int) -> float:
    """Expected tokens per sequence per speculative step: (1 - a^(γ+1)) / (1 - a)."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if acceptance >= 1.0:
        return float(gamma + 1)
    return (1.0 - acceptance ** (gamma + 1)) / (1.0 - acceptance)


def acceptance_for_tokens_per_step(tokens: float, gamma: int) -> float:
    """Inverse of :func:`tokens_per_step` (bisection)."""
    if not 1.0 <= tokens <= gamma + 1:
        raise ValueError(f"tokens per step must be in [1, gamma+1={gamma + 1}], got {tokens}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if tokens_per_step(mid, gamma) < tokens:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def acceptance_at(acceptance_ref: float, n_ref: int, n: int, num_experts: int, routing: RoutingModel,
                  beta: float = COVERAGE_BETA) -> float:
    """Per-token acceptance with n draft experts, given acceptance_ref measured with n_ref.

    miss(n) = miss(n_ref) * (uncovered(n) / uncovered(n_ref)) ** beta, where uncovered(n)
    is the routing mass outside the n hottest experts (the temporal-hot draft set)."""
    if n == n_ref:
        return acceptance_ref
    u_ref = 1.0 - routing.coverage(num_experts, n_ref)
    u = 1.0 - routing.coverage(num_experts, n)
    if u_ref <= 1e-12:
        return acceptance_ref
    miss = (1.0 - acceptance_ref) * (max(u, 0.0) / u_ref) ** beta
    return float(min(1.0, max(0.0, 1.0 - miss)))


# ---- from a trace ------------------------------------------------------------------------------

@dataclass(frozen=True)
class DistinctPoint:
    batch: int
    per_sequence: int
    distinct: float  # mean distinct experts per layer per pass
    samples: int  # layer-passes averaged


def empirical_distinct(records: list[StepRecord], kinds: tuple[str, ...] = ("decode", "draft", "verify")
                       ) -> list[DistinctPoint]:
    """Mean distinct experts per layer per pass, grouped by (batch, positions per sequence)."""
    acc: dict[tuple[int, int], list[int]] = {}
    for r in records:
        if r.kind not in kinds:
            continue
        key = (r.batch_size, r.positions_per_sequence)
        acc.setdefault(key, []).extend(lr.distinct for lr in r.layers)
    return [DistinctPoint(b, l, float(np.mean(v)), len(v)) for (b, l), v in sorted(acc.items()) if v]


def _experts_and_k(header: dict, records: list[StepRecord]) -> tuple[int, int]:
    model = header.get("model") or {}
    e = model.get("num_experts")
    k = model.get("top_k")
    if not e:
        e = 1 + max((x for r in records for lr in r.layers for x in lr.expert_tokens), default=0)
    if not k:
        dec = [r for r in records if r.layers and r.kind in ("decode", "verify")]
        k = round(np.mean([sum(lr.expert_tokens.values()) / r.positions for r in dec for lr in r.layers])) if dec else 1
    return int(e), max(1, int(k))


def fit_routing(header: dict, records: list[StepRecord]) -> RoutingModel | None:
    """Skew and locality that best reproduce the trace's distinct-experts curve, as
    fractions of E (grid search). None when the trace has no routing."""
    pts = empirical_distinct(records)
    if not pts:
        return None
    e, k = _experts_and_k(header, records)
    best, best_err = None, float("inf")
    for skew in np.arange(0.0, 2.0001, 0.05):
        for loc in np.arange(0.0, 0.9501, 0.05):
            m = RoutingModel(float(round(skew, 2)), float(round(loc, 2)))
            err = sum(p.samples * (m.expected_distinct(e, k, p.batch, p.per_sequence) - p.distinct) ** 2 / e ** 2
                      for p in pts)
            if err < best_err - 1e-15:
                best, best_err = m, err
    return best


@dataclass(frozen=True)
class AcceptanceEstimate:
    acceptance: float  # per-token acceptance (truncated-geometric MLE)
    gamma: int
    draft_experts: int | None
    tokens_per_step: float  # measured mean accepted + 1
    sequences: int  # sequence-steps observed


def acceptance_from_trace(records: list[StepRecord]) -> AcceptanceEstimate | None:
    """Per-token acceptance from verify steps: each sequence-step with m accepted of γ is m
    successes plus, when m < γ, one failure; a = successes / (successes + failures)."""
    succ = fail = seqs = 0
    gammas, drafts, tokens = [], [], 0
    for r in records:
        if r.kind != "verify" or not r.accepted_lengths:
            continue
        g = r.positions_per_sequence - 1
        if g:  # a step with nothing left to draft (a sequence's last token) says nothing of gamma
            gammas.append(g)
        if r.draft_set:
            drafts.append(round(np.mean([len(v) for v in r.draft_set.values()])))
        for m in r.accepted_lengths:
            m = min(int(m), g)
            succ += m
            fail += m < g
            seqs += 1
            tokens += m + 1
    if not seqs:
        return None
    a = succ / (succ + fail) if succ + fail else 0.0
    a = min(a, 0.999)  # all-accepted traces: keep the estimate finite
    gamma = int(np.bincount(gammas).argmax()) if gammas else 0
    n = int(np.bincount(drafts).argmax()) if drafts else None
    return AcceptanceEstimate(a, gamma, n, tokens / seqs, seqs)
