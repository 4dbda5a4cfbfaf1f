"""`--policy auto` on a fixed machine profile: the exact plan at chosen batch sizes, and
the plan is what the engine then runs.

The profile (tests/data/profile-2core-disk.json) was measured once by `specmoe calibrate`
on a 2-core VM without a GPU; with it and a fresh cache dir (no measured speeds or
acceptance) the plan is a pure function of the model, the budget and the batch size.
The expected plans are the paper's picture on the bundled demo model: at batch 1 plain
caching wins (a draft costs gamma passes that one sequence cannot amortize); from batch 4
on speculation with quantized draft copies does, with long drafts while the batch is
small and shorter ones once verification itself gets expensive.
"""

import pytest
from factories import install_fixed_profile

from specmoe import LLM


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A cache dir with only the fixed profile: nothing learnt from earlier runs."""
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path / "cache"))
    install_fixed_profile(tmp_path / "cache")
    return tmp_path


@pytest.mark.parametrize("batch, policy, plan, gamma", [
    (1, "caching", "caching (10%)", None),
    (4, "specmoe", "specmoe (gamma=10, N=0, int8 draft)", 10),
    (16, "specmoe", "specmoe (gamma=10, N=0, int8 draft)", 10),
    # (the disk tier keeps the demo's experts in bf16: a fetch costs half what it did in float32,
    # so at batch 64 verification's compute outweighs the fetches a longer draft would share)
    (64, "specmoe", "specmoe (gamma=1, N=4, int8 draft)", 1),
])
def test_auto_plans_exactly_on_the_fixed_profile(fresh_cache, batch, policy, plan, gamma):
    llm = LLM(device="cpu", policy="auto", offload="disk", offload_dir=str(fresh_cache), device_memory="30%",
              max_batch_size=batch, max_model_len=64)
    engine = llm.engine
    assert (engine.policy.name, engine.auto_plan, engine.gamma) == (policy, plan, gamma)
    if policy == "specmoe":
        assert engine.policy.draft_quant == "int8"
    llm.close()
