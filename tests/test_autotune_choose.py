"""`--policy auto` on a fixed machine profile: its plan is good by the performance model it
plans with, and the plan is what the engine then runs.

The profile (tests/data/profile-2core-disk.json) was measured once by `specmoe calibrate`
on a 2-core VM without a GPU; with it and a fresh cache dir (no measured speeds or
acceptance) the plan is a pure function of the model, the budget and the batch size.
Quality: the cost model's predicted decode tokens/s of the plan is within AUTO_FACTOR of
the best fixed policy a user could pick instead (`--policy ondemand`, `overlap`,
`caching` at its default fraction, `specmoe` at its default gamma with the draft
`--draft-quant auto` takes), each predicted here from cost_model.estimate on the inputs
the planner was given, not from the planner's own search.
"""

import pytest
from factories import install_fixed_profile

from specmoe import LLM
from specmoe.autotune import choose as choose_module
from specmoe.base.config import EngineConfig
from specmoe.costmodel.cost_model import Scenario, estimate
from specmoe.costmodel.routing import DEFAULT_ACCEPTANCE, DEFAULT_QUANT_ACCEPTANCE

# auto searches a superset of the fixed choices with the same model, so it is predicted at
# least as fast as each of them (1e-9: rounding only)
AUTO_FACTOR = 1.0 - 1e-9


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A cache dir with only the fixed profile: nothing learnt from earlier runs."""
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path / "cache"))
    install_fixed_profile(tmp_path / "cache")
    return tmp_path


def _acceptance(kwargs, quant):
    if quant in (None, "none"):
        return kwargs.get("acceptance", DEFAULT_ACCEPTANCE)
    return {**DEFAULT_QUANT_ACCEPTANCE, **kwargs["quant_acceptance"]}[quant]


def _fixed_policies(kwargs) -> dict[str, tuple[str, dict]]:
    """What `--policy X` with its defaults runs, as cost-model parameters."""
    quant = kwargs["draft_quants"][0] if kwargs["draft_quants"] else "none"
    specmoe = dict(gamma=EngineConfig.gamma, draft_experts=0 if quant != "none" else 4,
                   acceptance=_acceptance(kwargs, quant), acceptance_draft_experts=kwargs.get("acceptance_draft_experts"),
                   draft_quant=quant)
    return {"ondemand": ("ondemand", {}), "overlap": ("overlap", {}),
            "caching": ("caching", dict(fraction=kwargs["cache_fraction"], lru_slots=kwargs["cache_lru_slots"])),
            "specmoe": ("specmoe", specmoe)}


def _plan_params(chosen, kwargs) -> dict:
    if chosen.policy == "specmoe":
        return dict(gamma=chosen.gamma, draft_experts=chosen.draft_experts,
                    acceptance=_acceptance(kwargs, chosen.draft_quant),
                    acceptance_draft_experts=kwargs.get("acceptance_draft_experts"), draft_quant=chosen.draft_quant)
    if chosen.policy == "caching":
        return dict(fraction=chosen.cache_fraction, lru_slots=kwargs["cache_lru_slots"])
    return {}


@pytest.mark.parametrize("batch", [1, 4, 16, 64])
def test_auto_plan_is_as_fast_as_the_best_fixed_policy_by_its_model(fresh_cache, monkeypatch, batch):
    seen = []
    planner = choose_module.plan

    def recording(shape, hardware, batch_size, **kwargs):
        chosen = planner(shape, hardware, batch_size, **kwargs)
        seen.append((shape, hardware, batch_size, kwargs, chosen))
        return chosen

    monkeypatch.setattr(choose_module, "plan", recording)
    llm = LLM(device="cpu", policy="auto", offload="disk", offload_dir=str(fresh_cache), device_memory="30%",
              max_batch_size=batch, max_model_len=64)
    engine = llm.engine
    [(shape, hardware, batch_size, kwargs, chosen)] = seen
    assert batch_size == batch and not kwargs["corrections"]  # a fresh cache: the model alone decides
    sc = Scenario(shape, hardware, context_len=kwargs["context_len"], device_memory=kwargs["device_memory"])

    auto = estimate(chosen.policy, sc, batch, **_plan_params(chosen, kwargs))
    assert auto.fits
    fixed = {name: estimate(policy, sc, batch, **params) for name, (policy, params) in _fixed_policies(kwargs).items()}
    fitting = {name: e.decode_tokens_per_s for name, e in fixed.items() if e.fits}
    assert fitting  # else the comparison says nothing
    best = max(fitting, key=fitting.get)
    assert auto.decode_tokens_per_s >= AUTO_FACTOR * fitting[best], (chosen.describe(), best, fitting)

    # the engine runs the plan; under a budget SpecMoE's draft memory is planned after it
    assert engine.policy.name == chosen.policy
    assert engine.gamma == (chosen.gamma if chosen.policy == "specmoe" else None)
    if chosen.policy == "specmoe":
        plan, split = engine.auto_plan.split("; ")
        assert plan == chosen.describe() and split.startswith("draft memory ")
        assert engine.options.draft_memory == engine.policy.memory.limit > 0
    else:
        assert engine.auto_plan == chosen.describe() and engine.options.draft_memory is None
    llm.close()
