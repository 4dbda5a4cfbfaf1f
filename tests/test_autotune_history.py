"""Measured draft acceptance is kept per model and draft, and auto plans with it."""

import json

import pytest
import torch

from specmoe.autotune import history
from specmoe.engine.stats import per_token_acceptance


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    """A fresh cache dir per test: no profile, no history, whatever ran before."""
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path / "cache"))

def test_record_merges_runs_weighted_by_drafted_tokens():
    history.record("model-a", "int8", 1.0, 100)
    history.record("model-a", "int8", 0.5, 300)
    history.record("model-a", "none@4", 0.2, 50)
    history.record("model-b", "int4", 0.9, 10)
    assert history.measured("model-a") == pytest.approx({"int8": 0.625, "none@4": 0.2})
    assert history.measured("model-b") == {"int4": 0.9}
    assert history.measured("unseen") == {}


def test_a_damaged_history_file_is_ignored_and_rewritten():
    history.history_path().parent.mkdir(parents=True, exist_ok=True)
    history.history_path().write_text("{not json")
    assert history.measured("m") == {}
    history.record("m", "int8", 0.99, 10)
    assert json.loads(history.history_path().read_text())["m"]["int8"]["drafted"] == 10


def test_per_token_acceptance_counts_a_rejection_once_per_step():
    # steps of 5 drafts: accepted 5 (no rejection), 2 (rejected at the 3rd), 0
    assert per_token_acceptance(5 + 2 + 0, 2) == pytest.approx(7 / 9)
    assert per_token_acceptance(0, 0) is None


def test_draft_keys():
    assert history.draft_key("int8", 0) == "int8"
    assert history.draft_key("none", 4) == "none@4"


def test_a_speculative_run_records_its_acceptance(tiny_ckpt, tmp_path):
    from factories import random_prompts

    from specmoe import LLM, SamplingParams

    path = tiny_ckpt("mixtral")
    llm = LLM(model=str(path), device="cpu", policy="specmoe", offload="disk", offload_dir=str(tmp_path),
              max_batch_size=4, max_model_len=64, draft_quant="int8", gamma=3)
    llm.generate(random_prompts(4, min_len=3, max_len=10, seed=5), SamplingParams(max_tokens=8, temperature=0.0,
                                                                                   ignore_eos=True))
    seen = history.measured(llm.engine.checkpoint.fingerprint())
    assert seen["int8"] == pytest.approx(llm.last_stats["acceptance_per_token"])
    llm.close()


def test_auto_plans_the_papers_draft_only_once_measured(tiny_ckpt):
    from types import SimpleNamespace

    from specmoe.autotune.choose import _draft_knowledge
    from specmoe.base.checkpoint import Checkpoint

    ckpt = Checkpoint(tiny_ckpt("mixtral"))
    c = ckpt.config
    runtime = SimpleNamespace(checkpoint=ckpt, config=c, budget=SimpleNamespace(limit=None),
                              expert_keys=[(0, e) for e in range(c.num_experts)], expert_bytes=4 * c.expert_params,
                              device=torch.device("cpu"), dtype=torch.float32, computes_as_stored=False)
    assert _draft_knowledge(runtime)["draft_quants"] == ("int8",)
    history.record(ckpt.fingerprint(), "none@2", 0.6, 100)
    known = _draft_knowledge(runtime)
    assert known["draft_quants"] == ("int8", "none") and (known["acceptance"], known["acceptance_draft_experts"]) == (0.6, 2)
