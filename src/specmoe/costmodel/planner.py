"""``--policy auto``: pick the policy and its parameters for a batch from the cost model.

The engine calls :func:`plan` at start-up with its calibrated profile and the model's
shape, and again whenever its running acceptance estimate moves, e.g.::

    p = plan(shape, load_profile("local"), batch_size=16, acceptance=0.8,
             acceptance_draft_experts=4, policies=("ondemand", "caching", "specmoe"))
    p.policy, p.gamma, p.draft_experts, p.cache_fraction

Speculation is simply one candidate: where it does not pay (small batches, low
acceptance) another policy wins and speculation is off.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..base.config import MAX_GAMMA
from .cost_model import (
    DEFAULT_CACHE_FRACTION,
    DEFAULT_CONTEXT,
    DEFAULT_OUTPUT,
    DEFAULT_PREDICTION_ACCURACY,
    DEFAULT_SOURCE,
    Scenario,
    StepEstimate,
    estimate,
)
from .hardware import HardwareProfile
from .routing import DEFAULT_ACCEPTANCE, DEFAULT_DRAFT_EXPERTS, DEFAULT_QUANT_ACCEPTANCE, RoutingModel
from .shapes import ModelShape

# Policies the engine implements (oracle-overlap is a bound, not a policy one can run).
AUTO_POLICIES = ("resident", "ondemand", "overlap", "caching", "host", "specmoe")
GAMMAS = tuple(range(1, MAX_GAMMA + 1))
DRAFT_EXPERT_CHOICES = (2, 4, 8, 16)


@dataclass(frozen=True)
class Plan:
    policy: str
    gamma: int | None  # specmoe only
    draft_experts: int | None  # specmoe only
    cache_fraction: float | None  # caching only
    estimate: StepEstimate
    draft_quant: str | None = None  # specmoe only
    correction: float = 1.0  # measured / predicted for this policy on this machine (autotune/speeds.py)

    @property
    def decode_tokens_per_s(self) -> float:
        """The model's prediction, scaled by what this policy measured here before."""
        return self.estimate.decode_tokens_per_s * self.correction

    def describe(self) -> str:
        if self.policy == "specmoe":
            draft = f", {self.draft_quant} draft" if self.draft_quant not in (None, "none") else ""
            return f"specmoe (gamma={self.gamma}, N={self.draft_experts}{draft})"
        if self.policy == "caching":
            return f"caching ({self.cache_fraction:.0%})"
        return self.policy


DRAFT_QUANTS = ("int8", "int4", "none")  # the engine's choices, most precise first


def draft_expert_choices(num_experts: int, draft_quant: str = "none") -> list[int]:
    """{2, 4, 8, 16} (and 0 beside quantized copies), keeping N < E (N = E would be the
    resident policy)."""
    low = (0,) if draft_quant != "none" else ()
    return [n for n in low + DRAFT_EXPERT_CHOICES if n < num_experts] or [1]


def candidates(sc: Scenario, batch_size: int, acceptance: float, acceptance_draft_experts: int,
               cache_fraction: float = DEFAULT_CACHE_FRACTION, policies=AUTO_POLICIES,
               quant_acceptance: dict[str, float] | None = None, draft_quants=DRAFT_QUANTS,
               cache_lru_slots: int = 0) -> list[Plan]:
    """Every (policy, parameters) the planner considers, fitting in memory or not.

    SpecMoE is considered with each draft the engine has: quantized copies of every
    expert (acceptance from `quant_acceptance`, default DEFAULT_QUANT_ACCEPTANCE) and
    the paper's draft of N resident experts (`acceptance` at `acceptance_draft_experts`)."""
    quant_acceptance = {**DEFAULT_QUANT_ACCEPTANCE, **(quant_acceptance or {})}
    out = []
    for policy in policies:
        if policy == "specmoe":
            for quant in draft_quants:
                a = acceptance if quant == "none" else quant_acceptance[quant]
                for n in draft_expert_choices(sc.shape.num_experts, quant):
                    for g in GAMMAS:
                        e = estimate("specmoe", sc, batch_size, gamma=g, draft_experts=n, acceptance=a,
                                     acceptance_draft_experts=acceptance_draft_experts, draft_quant=quant)
                        out.append(Plan("specmoe", g, n, None, e, draft_quant=quant))
        elif policy == "caching":
            out.append(Plan("caching", None, None, cache_fraction,
                            estimate("caching", sc, batch_size, fraction=cache_fraction, lru_slots=cache_lru_slots)))
        else:
            out.append(Plan(policy, None, None, None, estimate(policy, sc, batch_size)))
    return out


def plan(shape: ModelShape, hardware: HardwareProfile, batch_size: int, acceptance: float | None = None, *,
         acceptance_draft_experts: int = DEFAULT_DRAFT_EXPERTS, routing: RoutingModel | None = None,
         context_len: int = DEFAULT_CONTEXT, cache_fraction: float = DEFAULT_CACHE_FRACTION,
         device_memory: int | None = None, prediction_accuracy: float = DEFAULT_PREDICTION_ACCURACY,
         policies=AUTO_POLICIES, quant_acceptance: dict[str, float] | None = None,
         draft_quants=DRAFT_QUANTS, cache_lru_slots: int = 0,
         corrections: dict[str, float] | None = None, source_len: int = DEFAULT_SOURCE,
         output_len: int = DEFAULT_OUTPUT) -> Plan:
    """The fastest fitting (policy, gamma, N) for this batch, by predicted decode tokens/s.

    acceptance: per-token acceptance of the paper's draft, measured (or assumed) with
    `acceptance_draft_experts` draft experts; None: DEFAULT_ACCEPTANCE. quant_acceptance:
    the same for quantized drafts, by mode. Searches gamma in 1..MAX_GAMMA, the draft (int8,
    int4, the paper's) and N in {2, 4, 8, 16} (and 0 beside quantized copies; N < E)."""
    unknown = [p for p in policies if p not in AUTO_POLICIES]
    if unknown:
        raise ValueError(f"auto cannot choose policy {unknown[0]!r}: use some of {', '.join(AUTO_POLICIES)}")
    sc = Scenario(shape, hardware, routing or RoutingModel(), context_len, device_memory, prediction_accuracy,
                  source_len, output_len)
    a = DEFAULT_ACCEPTANCE if acceptance is None else acceptance
    every = candidates(sc, batch_size, a, acceptance_draft_experts, cache_fraction, policies, quant_acceptance,
                       draft_quants, cache_lru_slots)
    corrections = corrections or {}
    fitting = [replace(c, correction=corrections.get(c.policy, 1.0)) for c in every if c.estimate.fits]
    if not fitting:
        need = min(c.estimate.device_bytes for c in every)
        raise ValueError(f"no policy fits {shape.name} at batch {batch_size} in {sc.memory / 2**30:.1f} GiB of "
                         f"device memory: raise the device memory to at least {need / 2**30:.1f} GiB "
                         f"or lower the batch size")
    # max() keeps the first of equals: AUTO_POLICIES order prefers the simpler policy.
    return max(fitting, key=lambda c: c.decode_tokens_per_s)
