"""benchmarks/profile_passes.py's method: each operator's time goes to the code that called
it, and a profiled run on a real engine accounts for every unit of decode work."""

from __future__ import annotations

import contextlib
from collections import Counter
from types import SimpleNamespace

import pytest
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
def checkpoint(tmp_path_factory):
    return make_checkpoint("mixtral", tmp_path_factory.mktemp("m"))


OPTIONS = dict(policy="specmoe", offload="host", device_memory="60%", gamma=2, max_batch_size=2, max_model_len=64)
PARAMS = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def profiled(checkpoint):
    llm = LLM(model=checkpoint, **OPTIONS)
    inst = Instrumented(llm.engine)
    llm.generate([[5, 6, 7]], PARAMS)
    inst.clock.reset()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as p:
        llm.generate([[5, 6, 7]], PARAMS)  # one sequence: one drafted token per draft forward
    yield inst, p.events(), llm.engine.counters
    llm.close()


TICKS = {"draft": 1.0, "verify": 1e3, "other": 1e6}  # a forward pass's virtual seconds, by where it runs


def tick_in_forwards(engine, now: list, tally: Counter) -> None:
    """Make `engine`'s forward passes the only thing that advances the virtual clock `now`,
    by TICKS of where each runs (a draft pass, the rest of a speculative step, elsewhere),
    counted in `tally`. Wraps the engine's own methods, as Instrumented does after it."""
    forward, scope, step = engine.forward_logits, engine.pass_scope, engine.decoder.step
    where = {"draft": False, "step": False}

    @contextlib.contextmanager
    def pass_scope(kind):
        where["draft"] = kind == "draft"
        try:
            with scope(kind) as experts:
                yield experts
        finally:
            where["draft"] = False

    def forward_logits(*args, **kwargs):
        unit = "draft" if where["draft"] else "verify" if where["step"] else "other"
        now[0] += TICKS[unit]
        tally[unit] += 1
        return forward(*args, **kwargs)

    def decoder_step(seqs):
        where["step"] = True
        try:
            return step(seqs)
        finally:
            where["step"] = False

    engine.forward_logits, engine.pass_scope, engine.decoder.step = forward_logits, pass_scope, decoder_step


def virtual_clock(now: list) -> SimpleNamespace:
    """A stand-in for the time module where thread and wall time are both `now`."""
    return SimpleNamespace(thread_time=lambda: now[0], perf_counter=lambda: now[0])


def test_every_draft_forward_and_speculative_step_is_counted_and_timed(checkpoint, monkeypatch):
    """Draft time is exactly the draft forwards' and verify time the rest of each step's."""
    import specmoe.bench.profile as profile_module

    llm, now, tally = LLM(model=checkpoint, **OPTIONS), [0.0], Counter()
    tick_in_forwards(llm.engine, now, tally)
    monkeypatch.setattr(profile_module, "time", virtual_clock(now))
    inst = Instrumented(llm.engine)
    llm.generate([[5, 6, 7]], PARAMS)
    counters = llm.engine.counters
    llm.close()
    assert inst.clock.count["verify"] == counters.steps >= 2 and tally["verify"] >= counters.steps
    assert inst.clock.count["draft"] == counters.drafted == tally["draft"]  # one sequence: a token a forward
    for clock in (inst.clock.cpu, inst.clock.wall):
        assert clock["draft"] == tally["draft"] * TICKS["draft"]
        assert clock["verify"] == tally["verify"] * TICKS["verify"]


def test_operator_shares_cover_attention_router_and_experts_of_each_unit(profiled):
    inst, events, _ = profiled
    shares = operator_shares(events, inst.clock.count)
    for unit in ("draft", "verify"):
        cats = shares[unit]["categories"]
        assert {"attention", "router", "expert dispatch", "expert matmuls"} <= set(cats)
        assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
        assert shares[unit]["operators"] > 0
    assert 0.0 <= outside_share(events)["draft"] < 1.0


def test_pair_mode_times_another_revision_beside_this_tree_in_turns(tmp_path, checkpoint):
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

    llms = {"before": old.LLM(model=checkpoint, **OPTIONS), "after": LLM(model=checkpoint, **OPTIONS)}
    now, tally, turns = [0.0], {name: Counter() for name in llms}, []
    # per call: its verify forwards and speculative steps (a round's draft, and so its steps,
    # can differ from another's: the pool's contents carry over and prefetches race the draft)
    calls = {name: [] for name in llms}

    def taking_turns(name, generate):
        def generate_noting_the_turn(*args):
            turns.append(name)
            before = tally[name]["verify"]
            out = generate(*args)
            calls[name].append((tally[name]["verify"] - before, llms[name].engine.counters.steps))
            return out
        return generate_noting_the_turn

    for name, llm in llms.items():
        tick_in_forwards(llm.engine, now, tally[name])
        llm.generate = taking_turns(name, llm.generate)
    prof = script.load_profile_module()
    prof.time = virtual_clock(now)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    rounds = script.measure_pair(prof, llms, [[5, 6, 7], [8, 9]], params, repeats=3)
    for llm in llms.values():
        llm.close()

    assert turns == ["before", "after"] + ["before", "after", "after", "before", "before", "after"]  # warm-up first
    for name in llms:  # after the warm-up, each round: per unit, its virtual ms over the units it ran
        assert len(calls[name]) == 4
        assert rounds[name] == [{"draft": 1e3 * TICKS["draft"],  # a draft unit is one forward
                                 "verify": 1e3 * TICKS["verify"] * forwards / steps}
                                for forwards, steps in calls[name][1:]]


def test_the_script_profiles_the_policies_and_model_it_is_given_and_refuses_an_unknown_policy(capsys):
    import argparse
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("profile_passes_script", root / "benchmarks" / "profile_passes.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    args = argparse.Namespace(batch_sizes="1,16", policies=script.policy_list("specmoe"), model="some/model",
                              threads=1, gamma=10, dtype="float32")
    runs = [(batch, policy, options["model"], options["policy"], options["dtype"])
            for batch, policy, options in script.setups(args)]
    assert runs == [(1, "specmoe", "some/model", "specmoe", "float32"), (16, "specmoe", "some/model", "specmoe", "float32")]
    with pytest.raises(SystemExit):
        script.main(["--policies", "resident,ondemand", "--json", "unused.json"])
    assert "'ondemand' is not a policy this script profiles; choose from resident, specmoe" in capsys.readouterr().err


def test_the_block_kernels_time_is_filed_with_the_code_that_called_them(tmp_path):
    """A GGUF file's products run in ctypes calls, which torch's profiler cannot see into:
    the profiling code labels them, so their time counts as operators, filed by their caller."""
    pytest.importorskip("gguf")
    from gguf_factories import make_gguf

    from specmoe.kernels import blockdot

    if not blockdot.available():
        pytest.skip("the block kernels are not built on this machine")
    _, path = make_gguf(tmp_path, "mixtral", "Q8_0")
    llm = LLM(model=str(path), policy="resident", max_batch_size=2, max_model_len=64)
    inst = Instrumented(llm.engine)
    llm.generate([[5, 6, 7]], PARAMS)
    inst.clock.reset()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as p:
        llm.generate([[5, 6, 7]], PARAMS)
    llm.close()
    events = p.events()
    names = {e.name for e in events}
    assert {"blockdot::experts", "blockdot::linear", "blockdot::attend", "blockdot::rms_norm"} <= names, names
    cats = operator_shares(events, inst.clock.count)["decode"]["categories"]
    assert {"attention", "expert matmuls", "norms"} <= set(cats)
    assert cats["expert matmuls"]["share"] > 0.02  # a tiny model: attention and norms weigh as much
