"""The cost model's operator counts are the engine's: count what a decode pass dispatches.

Each operator costs the profile's `kernel_launch_s` in the model; on a CPU (and for a
small model on a GPU) those fixed costs are most of a pass, so counts that drift from
the code make every prediction drift with them.
"""

from dataclasses import replace

import pytest
from factories import random_prompts
from torch.utils._python_dispatch import TorchDispatchMode

from specmoe import LLM, SamplingParams
from specmoe.base.trace import read_trace
from specmoe.costmodel.cost_model import Scenario, pass_work
from specmoe.costmodel.hardware import load_profile
from specmoe.costmodel.shapes import shape_from_config


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("batch", [1, 6])
def test_a_decode_pass_dispatches_the_operators_the_model_counts(tiny_ckpt, tmp_path, batch):
    path = tiny_ckpt("mixtral")
    trace = tmp_path / "trace.jsonl"
    llm = LLM(model=str(path), device="cpu", max_batch_size=batch, max_model_len=64, trace=str(trace))
    counts, forward = [], llm.engine.model.forward

    def counted(*args, **kwargs):
        with CountOps() as ops:
            out = forward(*args, **kwargs)
        counts.append(ops.count)
        return out

    llm.engine.model.forward = counted
    llm.generate(random_prompts(batch, min_len=4, max_len=12, seed=3),
                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    llm.close()
    _, records = read_trace(trace)
    assert len(records) == len(counts)
    shape = replace(shape_from_config(path), bytes_per_param=4)
    sc = Scenario(shape, load_profile("h100-pcie5"), context_len=16)
    decode = [(n, r) for n, r in zip(counts, records) if r.kind == "decode"]
    assert decode
    for n, r in decode:
        experts = sum(lr.distinct for lr in r.layers) / len(r.layers)
        modelled = pass_work(sc, r.batch_size, 1, experts, grouped=True).launches  # resident: one grouped block
        assert modelled == pytest.approx(n, rel=0.25), (n, modelled)
