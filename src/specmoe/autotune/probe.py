"""Time the engine's own passes and fit the profile's engine terms (part of `calibrate`).

A matmul benchmark says what the hardware can do; a small MoE model on an eager engine
spends most of a pass elsewhere: the dispatcher and Python around each operator, and
host work per sequence (sampling, scheduling). So calibration runs the
bundled demo model through the engine, traces every pass, and fits the cost model's
terms to what it measured:

- the cost per operator (``kernel_launch_s``), timed on a decode-like mix of tiny
  operators;
- with every expert resident (decode at several batch sizes, and their prefills):
  effective matmul rate and memory bandwidth and the cost per sequence
  (``sequence_overhead_s``), by least squares on relative error;
- with ``ondemand`` on the disk tier, reading the engine's own expert file: what one
  expert fetch adds to a pass (``transfer_latency_s`` then holds what it costs beyond
  the bytes at the disk's rate).

The fit uses the cost model's own :func:`~specmoe.costmodel.cost_model.pass_work`, so the
same terms project a calibrated machine to other models.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..base.gguf_checkpoint import open_checkpoint
from ..base.config import EngineConfig
from ..base.paths import default_model_dir
from ..base.trace import read_trace
from ..costmodel.cost_model import Scenario, pass_work
from ..costmodel.hardware import HardwareProfile
from ..costmodel.shapes import ModelShape, as_run, shape_of
from ..experts.formats import checkpoint_format
from ..kernels.cpu import usable_cores
from ..engine.engine import Engine, resolve_dtype
from ..engine.sampling import SamplingParams
from ..engine.stats import RunCounters

# (policy, batch size, prompt length): resident runs at several batch sizes and two
# context lengths (so that memory traffic and per-operator costs can be told apart),
# ondemand runs on the disk tier for the cost of a fetch
PROBE_RUNS = (("resident", 1, 32), ("resident", 4, 32), ("resident", 16, 32), ("resident", 48, 32),
              ("resident", 16, 192), ("resident", 64, 128), ("ondemand", 1, 32), ("ondemand", 16, 32))
PROBE_TOKENS = 12


@dataclass(frozen=True)
class PassSample:
    """One traced pass: its shape, what it touched and how long it took."""

    policy: str
    kind: str
    batch: int
    per_sequence: float  # positions per sequence
    context: int  # cached positions per sequence before the pass
    experts: float  # distinct experts per MoE layer
    fetched: int  # experts fetched during the pass
    wall_s: float  # the pass, plus (decode) the engine's work around it in the step


def _prompts(batch: int, length: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 1000 + 3 for j in range(length)] for i in range(batch)]


def _generate(model_dir: Path, options: EngineConfig, prompts: list[list[int]]) -> RunCounters:
    """Run the engine on `prompts` (greedy, PROBE_TOKENS each); its counters."""
    engine = Engine(model_dir, options)
    try:
        params = SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0, ignore_eos=True)
        for prompt in prompts:
            engine.add_request(prompt, params)
        engine.run_until_done()
        return engine.counters
    finally:
        engine.close()


def _run(model_dir: Path, threads: int | None, workdir: Path, policy: str, batch: int, length: int, warm_up: bool,
         offload_dir: str | None = None):
    """(trace records, engine seconds per decode step outside the traced passes)."""
    trace = workdir / f"{policy}-{batch}-{length}.jsonl"
    # the disk tier's expert file where the engine keeps it (`offload_dir`, else the cache
    # dir), not a fresh one: a file just written may still sit in a cache below the guest
    opts = dict(policy=policy, device="cpu", threads=threads, max_batch_size=batch, offload="disk", adapt_gamma=False,
                offload_dir=offload_dir, max_model_len=length + PROBE_TOKENS + 1)
    if warm_up:  # first-touch allocations, page faults, the disk tier's file: not measured
        _generate(model_dir, EngineConfig(**opts), _prompts(batch, length))
    counters = _generate(model_dir, EngineConfig(trace=str(trace), **opts), _prompts(batch, length))
    _, records = read_trace(trace)
    decode = [r.timings["wall_s"] for r in records if r.kind == "decode" and "wall_s" in r.timings]
    outside = counters.decode_s / counters.steps - statistics.mean(decode) if decode and counters.steps else 0.0
    return records, max(0.0, outside)


def run_probe(model_dir: Path, threads: int | None, workdir: Path,
              offload_dir: str | None = None) -> tuple[ModelShape, list[PassSample]]:
    """Trace the PROBE_RUNS on `model_dir`: per run, each prefill pass and one decode
    sample, the median decode pass (a shared machine's hiccups are not the engine's
    cost) with its experts and fetches averaged."""
    checkpoint = open_checkpoint(model_dir)
    dtype = resolve_dtype("auto", checkpoint, torch.device("cpu"))
    stored = checkpoint_format(checkpoint, dtype).storage_dtype
    shape = as_run(shape_of(checkpoint.config, model_dir.name), dtype.itemsize, stored.itemsize)
    samples: list[PassSample] = []
    seen = set()
    for policy, batch, length in PROBE_RUNS:
        records, outside = _run(model_dir, threads, workdir, policy, batch, length, warm_up=policy not in seen,
                                offload_dir=offload_dir)
        seen.add(policy)
        passes = [r for r in records if r.layers and "wall_s" in r.timings]
        for r in passes:
            if r.kind == "prefill":
                samples.append(_sample(policy, r, r.positions / r.batch_size, 0, r.timings["wall_s"]))
        decode = [r for r in passes if r.kind == "decode"]
        if decode:
            wall = statistics.median(r.timings["wall_s"] for r in decode) + outside
            samples.append(PassSample(
                policy=policy, kind="decode", batch=decode[0].batch_size, per_sequence=1.0,
                context=length + len(decode) // 2,
                experts=statistics.mean(sum(lr.distinct for lr in r.layers) / len(r.layers) for r in decode),
                fetched=round(statistics.mean(sum(len(lr.fetched) for lr in r.layers) for r in decode)),
                wall_s=wall))
    return shape, samples


def _sample(policy: str, r, per_sequence: float, context: int, wall_s: float) -> PassSample:
    return PassSample(policy=policy, kind=r.kind, batch=r.batch_size, per_sequence=per_sequence, context=context,
                      experts=sum(lr.distinct for lr in r.layers) / len(r.layers),
                      fetched=sum(len(lr.fetched) for lr in r.layers), wall_s=wall_s)


def _features(shape: ModelShape, hw: HardwareProfile, s: PassSample) -> tuple[float, float]:
    """(roofline seconds, operator count) of a sample's pass under `hw`'s rates."""
    sc = Scenario(shape, hw, context_len=s.context)
    w = pass_work(sc, s.batch, s.per_sequence, s.experts)
    return w.time_s - w.launches * hw.kernel_launch_s - w.host_s, w.launches


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (drop negative ones and refit: 3 unknowns)."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[active] = sol
            return x
        active = [i for i, v in zip(active, sol) if v > 0]
    return x


def measure_op_cost(threads: int | None = None, reps: int = 400) -> float:
    """Seconds per operator of a decode-like mix on tiny tensors (gather, matmul, SiLU,
    product, scatter-add, norm): the dispatcher and Python around each operator, with
    next to no arithmetic. Measured directly, because a fit cannot tell it from memory
    traffic: both grow with the experts a pass runs."""
    torch.set_num_threads(threads or usable_cores())  # as the engine runs
    x, w = torch.randn(4, 256), torch.randn(256, 256)
    rows = torch.tensor([0, 2, 3])
    out = torch.zeros(4, 256)

    def mix():
        h = x[rows]
        y = torch.nn.functional.linear(h, w)
        y = torch.nn.functional.silu(y) * y
        out.index_add_(0, rows, y)
        torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
        return 8  # operators above: the norm is three (pow, mean, rsqrt)

    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        ops = sum(mix() for _ in range(reps))
        best = min(best, (time.perf_counter() - t) / ops)
    return best


def fit_compute(shape: ModelShape, base: HardwareProfile, samples: list[PassSample],
                op_cost: float | None = None) -> dict:
    """Rates and overheads that make the cost model's pass times match resident passes.

    The cost per operator is `op_cost` when given (measured: :func:`measure_op_cost`),
    else fitted. A grid over the matmul rate and the memory bandwidth (up to the
    measured ones x 1.5); for each, the remaining per-operator and per-sequence costs
    solve a non-negative least-squares problem on relative error (a per-pass constant
    would trade off against the operators: every pass runs about as many). The
    long-context run is what separates memory traffic (K/V reads) from the rest."""
    resident = [s for s in samples if s.policy == "resident"]
    if len(resident) < 3:
        raise ValueError("engine probe: too few resident passes traced to fit the compute model")
    t = np.array([s.wall_s for s in resident])
    batch = np.array([s.batch for s in resident], dtype=float)
    best = None
    for flops in np.geomspace(base.device_matmul_flops / 30, base.device_matmul_flops * 1.5, 30):
        for bw in np.geomspace(base.device_mem_bw / 30, base.device_mem_bw * 1.5, 24):
            hw = replace(base, device_matmul_flops=float(flops), device_mem_bw=float(bw), kernel_launch_s=1e-6,
                         sequence_overhead_s=0.0)
            feats = np.array([_features(shape, hw, s) for s in resident])
            roof, ops = feats[:, 0], feats[:, 1]
            if op_cost is None:
                a = np.stack([ops, batch], axis=1) / t[:, None]
                coef = _nonnegative_lstsq(a, 1.0 - roof / t)
            else:
                fixed = roof + ops * op_cost
                a = batch[:, None] / t[:, None]
                coef = np.concatenate([[op_cost], _nonnegative_lstsq(a, 1.0 - fixed / t)])
            pred = roof + ops * coef[0] + batch * coef[1]
            rel = pred / t - 1.0
            err = float(np.sqrt(np.mean(rel ** 2)))
            if best is None or err < best[0]:
                best = (err, float(flops), float(bw), coef, rel)
    err, flops, bw, coef, rel = best
    return {"device_matmul_flops": flops, "device_mem_bw": bw, "kernel_launch_s": max(float(coef[0]), 1e-8),
            "sequence_overhead_s": float(coef[1]),
            "fit_rms_rel_error": err, "fit_max_rel_error": float(np.abs(rel).max()), "fit_passes": len(resident)}


def fit_fetch(shape: ModelShape, hw: HardwareProfile, samples: list[PassSample]) -> float | None:
    """Seconds one expert fetch adds to an ondemand decode pass (extra time over all
    such passes / all their fetches), or None."""
    extra = fetched = 0.0
    for s in samples:
        if s.policy != "ondemand" or s.kind != "decode" or s.fetched == 0:
            continue
        compute = pass_work(Scenario(shape, hw, context_len=s.context), s.batch, s.per_sequence, s.experts).time_s
        extra, fetched = extra + s.wall_s - compute, fetched + s.fetched
    return max(extra, 0.0) / fetched if fetched else None


def calibrate_engine(base: HardwareProfile, threads: int | None = None, model_dir: Path | None = None,
                     offload_dir: str | None = None) -> dict:
    """Run the probe on the demo model (or `model_dir`) and fit around `base`'s measured
    per-operator cost (:func:`measure_op_cost`); measurements for the profile. The
    disk tier's expert file is kept in `offload_dir` (default: the cache dir's)."""
    with tempfile.TemporaryDirectory(prefix="specmoe-probe-") as tmp:
        shape, samples = run_probe(Path(model_dir) if model_dir else default_model_dir(), threads, Path(tmp),
                                   offload_dir)
    fit = fit_compute(shape, base, samples, base.kernel_launch_s)
    fitted = replace(base, **{k: fit[k] for k in ("device_matmul_flops", "device_mem_bw", "kernel_launch_s",
                                                   "sequence_overhead_s")})
    fetch = fit_fetch(shape, fitted, samples)
    out = {f"engine_{k}": v for k, v in fit.items()}
    out["engine_model"] = shape.name
    if fetch is not None:
        out["engine_fetch_s"] = fetch
        out["engine_fetch_expert_bytes"] = shape.expert_bytes
    return out
