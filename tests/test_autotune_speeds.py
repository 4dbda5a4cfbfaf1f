"""Measured / predicted speed per policy (perf/feedback.py) and how auto's planner uses it."""

from dataclasses import replace

import pytest

from specmoe.autotune import speeds as feedback
from specmoe.base.paths import DEMO_MODEL_DIR
from specmoe.costmodel.hardware import load_profile
from specmoe.costmodel.planner import plan
from specmoe.costmodel.shapes import load_shape


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    """A fresh cache dir per test: no profile, no history, whatever ran before."""
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path / "cache"))

def test_measured_speed_is_the_median_at_the_nearest_batch_size():
    assert feedback.measured("m", "disk", "caching", 16) is None  # nothing recorded
    for tokens_per_s in (50, 60, 70):
        feedback.record("m", "disk", "caching", 1, tokens_per_s)
    feedback.record("m", "disk", "caching", 64, 200)
    assert feedback.measured("m", "disk", "caching", 2) == (1, pytest.approx(60))
    assert feedback.measured("m", "disk", "caching", 32) == (64, pytest.approx(200))
    assert feedback.measured("m", "host", "caching", 1) is None  # another tier
    assert feedback.measured("other", "disk", "caching", 1) is None  # another model


def test_only_the_most_recent_runs_count():
    for tokens_per_s in [500.0] * 3 + [100.0] * feedback.RECENT:
        feedback.record("m", "disk", "ondemand", 4, tokens_per_s)
    assert feedback.measured("m", "disk", "ondemand", 4) == (4, 100.0)


def test_measurements_that_contradict_the_model_change_the_plan():
    shape = replace(load_shape(str(DEMO_MODEL_DIR)), bytes_per_param=4)
    hw = load_profile("h100-pcie5")
    kw = dict(policies=("ondemand", "overlap", "caching"), context_len=64)
    first = plan(shape, hw, 16, **kw)
    slower = {first.policy: 0.1}
    second = plan(shape, hw, 16, corrections=slower, **kw)
    assert second.policy != first.policy
    assert second.decode_tokens_per_s == pytest.approx(second.estimate.decode_tokens_per_s)


def test_an_offloading_run_records_its_speed_and_auto_plans_with_it(tiny_ckpt, tmp_path):
    from factories import random_prompts

    from specmoe import LLM, SamplingParams
    from specmoe.costmodel.hardware import save_profile

    path = tiny_ckpt("mixtral")
    prompts = random_prompts(4, min_len=3, max_len=10, seed=2)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    opts = dict(model=str(path), device="cpu", offload="disk", offload_dir=str(tmp_path), max_batch_size=4,
                max_model_len=32)
    llm = LLM(policy="ondemand", **opts)
    fingerprint = llm.engine.checkpoint.fingerprint()
    llm.generate(prompts, params)
    llm.close()
    batch, speed = feedback.measured(fingerprint, "disk", "ondemand", 4)
    assert batch == 4 and speed == pytest.approx(llm.last_stats["decode_tokens_per_s"])

    # a profile that makes ondemand look best; measurements that say it is 1000x slower
    save_profile(replace(load_profile("h100-pcie5-ssd"), name="local", slow_tier="disk"))

    def chosen():
        llm = LLM(policy="auto", **opts)
        name = llm.engine.policy.name
        llm.close()
        return name

    first = chosen()
    for _ in range(3):
        feedback.record(fingerprint, "disk", first, 4, 1e-3)
    assert chosen() != first


def test_speeds_are_kept_per_setup_capped_tier_and_draft():
    """A capped tier, and SpecMoE's drafts and γ, are setups of their own: a slow γ = 1
    experiment or a capped run must not teach auto how fast the default runs."""
    capped = feedback.tier_key("disk", 50e6)
    assert capped == "disk@50000000Bps" and feedback.tier_key("disk") == "disk"
    feedback.record("m", capped, "ondemand", 16, 10.0)
    feedback.record("m", "disk", feedback.policy_key("specmoe", "int8", 1), 16, 20.0)
    feedback.record("m", "disk", feedback.policy_key("specmoe", "none@4", 5), 16, 30.0)
    assert feedback.measured("m", "disk", "ondemand", 16) is None  # only the capped tier ran it
    assert feedback.draft_variants("m", "disk") == [("int8", 1), ("none@4", 5)]
    assert feedback.draft_variants("m", capped) == []
    assert feedback.measured("m", "disk", "specmoe:int8:5", 16) is None


def test_a_run_in_the_reference_encoding_is_a_setup_of_its_own():
    """--dtype float32 dequantizes a GGUF file's every matrix: several times slower than the
    default, so its speeds must not correct the default's plans."""
    from specmoe.base.config import EngineConfig

    reference = feedback.tier_of(EngineConfig(dtype="float32", offload="disk"))
    assert reference == "disk in float32" and feedback.tier_of(EngineConfig(offload="disk")) == "disk"
    feedback.record("m2", reference, "ondemand", 16, 4.0)
    assert feedback.measured("m2", "disk", "ondemand", 16) is None
    assert feedback.measured("m2", reference, "ondemand", 16) == (16, 4.0)


def test_a_speculative_run_records_its_draft_and_gamma(tiny_ckpt, tmp_path):
    from factories import random_prompts

    from specmoe import LLM, SamplingParams

    llm = LLM(model=str(tiny_ckpt("mixtral")), device="cpu", policy="specmoe", gamma=3, draft_quant="int8",
              offload="disk", offload_dir=str(tmp_path), offload_bandwidth="1GB/s", max_batch_size=4, max_model_len=64)
    llm.generate(random_prompts(4, min_len=3, max_len=10, seed=3), SamplingParams(max_tokens=32, ignore_eos=True))
    llm.close()
    tier = feedback.tier_key("disk", 1e9)
    assert feedback.draft_variants(llm.engine.checkpoint.fingerprint(), tier) == [("int8", 3)]
    batch, speed = feedback.measured(llm.engine.checkpoint.fingerprint(), tier, "specmoe:int8:3", 4)
    assert speed == pytest.approx(llm.last_stats["decode_tokens_per_s"])


def test_a_run_whose_gamma_was_tuned_records_its_speed_under_its_own_gamma_key(tiny_ckpt, tmp_path):
    from factories import random_prompts

    from specmoe import LLM, SamplingParams

    llm = LLM(model=str(tiny_ckpt("mixtral")), device="cpu", policy="specmoe", draft_quant="int8", offload="disk",
              offload_dir=str(tmp_path), max_batch_size=4, max_model_len=160)  # no gamma: tuned step by step
    # long enough for the steps a speed is kept from (the first drafts 16 tokens)
    llm.generate(random_prompts(4, min_len=3, max_len=10, seed=3), SamplingParams(max_tokens=120, ignore_eos=True))
    llm.close()
    fingerprint = llm.engine.checkpoint.fingerprint()
    assert feedback.draft_variants(fingerprint, "disk") == [("int8", feedback.ADAPTED)]
    _, speed = feedback.measured(fingerprint, "disk", "specmoe:int8:auto", 4)
    assert speed == pytest.approx(llm.last_stats["decode_tokens_per_s"])
