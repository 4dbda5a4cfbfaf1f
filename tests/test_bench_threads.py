"""The bench's thread counts: every engine and anchor computes on the threads the run was
given (by default the machine's usable cores, as users run them), also where runners built
one after another set torch's per-process pool differently, and a one-thread run says so
where its figures are reported."""

import pytest
import torch

from specmoe.bench.anchors import TransformersRunner
from specmoe.bench.machine import describe
from specmoe.bench.runners import PolicyRunner
from specmoe.engine.sampling import SamplingParams

MACHINE = {"cpu": "Some CPU", "cores": 2, "torch": "2.13.0", "python": "3.11", "platform": "Linux", "date": "today",
           "torch_threads": 1}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def threads_while_generating(obj, attr: str) -> list[int]:
    """Wraps obj.attr so that each call records torch's thread count at that moment."""
    seen, call = [], getattr(obj, attr)

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return call(*args, **kwargs)

    setattr(obj, attr, recording)
    return seen


@pytest.mark.parametrize("machine, threads, says", [
    ({**MACHINE, "compute_threads": 1}, None, "(2 cores, one thread (--threads 1))"),
    ({**MACHINE, "compute_threads": 2}, None, "(2 cores, 2 threads)"),
    (MACHINE, 1, "(2 cores, one thread (--threads 1))"),  # an older document: its --threads
    (MACHINE, None, "(2 cores, torch threads: 1)"),  # neither recorded: what torch had
    (MACHINE, "threads as in each row", "(2 cores, threads as in each row)"),
])
def test_the_machine_line_says_how_many_threads_the_run_computed_on(machine, threads, says):
    assert says in describe(machine, threads)


def test_interleaved_engines_each_compute_on_their_own_threads(tiny_ckpt, torch_threads):
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    options = dict(device="cpu", policy="resident", max_batch_size=2)
    two = PolicyRunner("two", str(tiny_ckpt("mixtral")), {**options, "threads": 2}, PROMPTS, params)
    one = PolicyRunner("one", str(tiny_ckpt("mixtral")), {**options, "threads": 1}, PROMPTS, params)
    try:
        assert not two.llm.engine.as_stored  # float32: torch's pool computes, on the engine's threads
        seen = threads_while_generating(two.llm, "generate")
        stats, _ = two.run()  # `one`, built last, left torch on 1 thread
        assert seen == [2] and stats["threads"] == 2
        seen = threads_while_generating(one.llm, "generate")
        stats, _ = one.run()
        assert seen == [1] and stats["threads"] == 1
    finally:
        two.close()
        one.close()


def test_the_transformers_anchor_computes_on_the_runs_threads(tiny_ckpt, torch_threads):
    runner = TransformersRunner(tiny_ckpt("mixtral"), PROMPTS, 2, 2, torch.device("cpu"), torch.float32, 2)
    try:
        torch.set_num_threads(1)  # as an engine multiplying as stored leaves it
        seen = threads_while_generating(runner.model, "generate")
        record, _ = runner.run()
        assert seen == [2] and record["threads"] == 2
    finally:
        runner.close()
