"""benchmarks/profile_passes.py's method: each operator's time goes to the code that called
it, and a profiled run on a real engine accounts for every unit of decode work."""

from __future__ import annotations

import pytest
import torch
from factories import make_checkpoint
from torch.profiler import ProfilerActivity, profile

from specmoe import LLM, SamplingParams
from specmoe.bench.profile import Instrumented, category_of, frames_of, operator_shares, outside_share

CASES = [  # (operator, frames from the innermost, category)
    ("aten::mm", [("model/moe", "grouped_linear"), ("policies/resident", "run_moe"), ("model/transformer", "mlp")],
     "expert matmuls"),
    ("aten::index", [("model/moe", "grouped_experts"), ("policies/resident", "run_moe")], "expert dispatch"),
    ("aten::mul", [("model/layers", "rms_norm"), ("model/attention", "gqa")], "attention"),  # q/k norm
    ("aten::mul", [("model/layers", "rms_norm"), ("model/layers", "norm"), ("model/transformer", "forward")], "norms"),
    ("aten::topk", [("model/routers", "softmax_topk"), ("model/transformer", "route_block")], "router"),
    ("aten::linear", [("model/transformer", "logits"), ("engine/engine", "forward_logits")], "LM head"),
    ("aten::argmax", [("engine/speculative", "step")], "sampling & acceptance"),
    ("aten::lift_fresh", [("model/kv_cache", "build"), ("engine/engine", "forward_logits")], "step setup"),
]


@pytest.mark.parametrize(("op", "frames", "category"), CASES, ids=[c[2] + "-" + c[0] for c in CASES])
def test_an_operator_goes_to_the_code_that_called_it(op, frames, category):
    assert category_of(op, frames) == category


def test_frames_are_read_from_profiler_event_names():
    names = ["aten::linear", "/x/src/specmoe/model/attention.py(61): gqa", "torch/nn/functional.py(12): f"]
    assert frames_of(names) == [("model/attention", "gqa")]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    path = make_checkpoint("mixtral", tmp_path_factory.mktemp("m"))
    llm = LLM(model=path, policy="specmoe", offload="host", device_memory="60%", gamma=2, max_batch_size=2,
              max_model_len=64)
    inst = Instrumented(llm.engine)
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    llm.generate([[5, 6, 7]], params)
    inst.clock.reset()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as p:
        llm.generate([[5, 6, 7]], params)  # one sequence: one drafted token per draft forward
    yield inst, p.events(), llm.engine.counters
    llm.close()


def test_every_draft_forward_and_speculative_step_is_counted_and_timed(profiled):
    inst, _, counters = profiled
    assert inst.clock.count["verify"] == counters.steps >= 2
    assert inst.clock.count["draft"] == counters.drafted
    assert inst.clock.cpu["draft"] > 0 and inst.clock.cpu["verify"] > 0


def test_operator_shares_cover_attention_router_and_experts_of_each_unit(profiled):
    inst, events, _ = profiled
    shares = operator_shares(events, inst.clock.count)
    for unit in ("draft", "verify"):
        cats = shares[unit]["categories"]
        assert {"attention", "router", "expert dispatch", "expert matmuls"} <= set(cats)
        assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
        assert shares[unit]["operators"] > 0
    assert 0.0 <= outside_share(events)["draft"] < 1.0


def test_pair_mode_times_another_revision_beside_this_tree_in_turns(tmp_path):
    import importlib.util
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    spec = importlib.util.spec_from_file_location("profile_passes_script", root / "benchmarks" / "profile_passes.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    old = script.package_at("HEAD", str(tmp_path))
    assert old.__name__ == "specmoe_HEAD" and Path(old.__file__).is_relative_to(tmp_path)
    assert old.LLM is not LLM  # a second copy of the package, not this one again

    path = make_checkpoint("mixtral", tmp_path / "m")
    options = dict(model=path, policy="specmoe", offload="host", device_memory="60%", gamma=2, max_batch_size=2,
                   max_model_len=64)
    llms = {"before": old.LLM(**options), "after": LLM(**options)}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    rounds = script.measure_pair(script.load_profile_module(), llms, [[5, 6, 7], [8, 9]], params, repeats=3)
    for llm in llms.values():
        llm.close()

    assert set(rounds) == {"before", "after"}
    for name in rounds:
        assert len(rounds[name]) == 3
        assert all(r["draft"] > 0 and r["verify"] > 0 for r in rounds[name])
