"""The engine probe's fit (perf/probe.py): it recovers the terms that generated the times."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
from torch.overrides import TorchFunctionMode

from specmoe.autotune import probe
from specmoe.autotune.probe import PassSample, fit_compute, fit_fetch
from specmoe.base.paths import DEMO_MODEL_DIR
from specmoe.costmodel.cost_model import Scenario, pass_work
from specmoe.costmodel.hardware import load_profile
from specmoe.costmodel.shapes import load_shape

TRUE = dict(device_matmul_flops=50e9, device_mem_bw=8e9, kernel_launch_s=6e-6, sequence_overhead_s=1.5e-4)


def _samples(shape, hw):
    out = []
    for batch, length in ((1, 32), (4, 32), (16, 32), (48, 32), (32, 160)):
        for kind, per_seq, context, experts in (("prefill", length, 0, 15.9), ("decode", 1, length, min(16, 2 * batch))):
            t = pass_work(Scenario(shape, hw, context_len=context), batch, per_seq, experts).time_s
            out.append(PassSample("resident", kind, batch, per_seq, context, experts, 0, t))
    return out


def test_fit_recovers_the_per_operator_and_per_sequence_costs():
    shape = replace(load_shape(str(DEMO_MODEL_DIR)), bytes_per_param=4)
    base = replace(load_profile("h100-pcie5"), device_matmul_flops=80e9, device_mem_bw=30e9)
    truth = replace(base, **TRUE)
    fit = fit_compute(shape, base, _samples(shape, truth))
    assert fit["fit_rms_rel_error"] < 0.03
    assert fit["kernel_launch_s"] == pytest.approx(TRUE["kernel_launch_s"], rel=0.15)
    assert fit["sequence_overhead_s"] == pytest.approx(TRUE["sequence_overhead_s"], rel=0.3)


def test_a_measured_operator_cost_is_kept_and_the_rest_fitted_around_it():
    shape = replace(load_shape(str(DEMO_MODEL_DIR)), bytes_per_param=4)
    base = replace(load_profile("h100-pcie5"), device_matmul_flops=80e9, device_mem_bw=30e9)
    fit = fit_compute(shape, base, _samples(shape, replace(base, **TRUE)), op_cost=TRUE["kernel_launch_s"])
    assert fit["kernel_launch_s"] == TRUE["kernel_launch_s"]
    assert fit["fit_rms_rel_error"] < 0.03
    # per-sequence work trades off a little against K/V traffic, which also grows with B
    assert fit["sequence_overhead_s"] == pytest.approx(TRUE["sequence_overhead_s"], rel=0.4)


class CountTorchCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_operator_cost_is_the_fastest_rounds_time_over_the_operators_it_ran(monkeypatch):
    """The operators per mix counted as torch dispatches them (the difference between 2 and
    1 repetitions, over 3 rounds); then, on a clock that gives rounds of 3, 2 and 5 s, the
    cost is the fastest round over the operators it ran."""
    counts = []
    for reps in (1, 2):
        with CountTorchCalls() as mode:
            probe.measure_op_cost(reps=reps)
        counts.append(mode.calls)
    per_mix = (counts[1] - counts[0]) / 3
    clock = iter([0.0, 3.0, 10.0, 12.0, 20.0, 25.0])
    monkeypatch.setattr(probe, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    assert probe.measure_op_cost(reps=50) == pytest.approx(2.0 / (50 * per_mix), rel=1e-12)


def test_fetch_cost_is_what_ondemand_passes_add_per_expert():
    shape = replace(load_shape(str(DEMO_MODEL_DIR)), bytes_per_param=4)
    hw = replace(load_profile("h100-pcie5"), **TRUE)
    compute = pass_work(Scenario(shape, hw, context_len=32), 8, 1, 10).time_s
    samples = [PassSample("ondemand", "decode", 8, 1, 32, 10, 80, compute + 80 * 6e-4)]
    assert fit_fetch(shape, hw, samples) == pytest.approx(6e-4)


def test_too_few_passes_is_a_clear_error():
    shape = load_shape(str(DEMO_MODEL_DIR))
    with pytest.raises(ValueError, match="too few resident passes"):
        fit_compute(shape, load_profile("h100-pcie5"), [])
