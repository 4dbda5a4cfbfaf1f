"""The hardware profile a replay predicts with, and the cost model's predictions for the
replayed steps: per step (the replayed routing and the replay's own fetch counts) and
end to end (`specmoe simulate`'s estimate, routing model fitted to the trace)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import replace

import torch

from ...autotune.measure import matmul_flops, timed
from ...costmodel.cost_model import (
    LAUNCHES_PER_EXPERT,
    PassWork,
    Scenario,
    estimate,
    pass_work,
)
from ...costmodel.hardware import HardwareProfile, load_profile
from ...costmodel.routing import RoutingModel, acceptance_from_trace, fit_routing
from ...costmodel.shapes import ModelShape
from ...experts.store import ExpertStore
from .errors import ReplayError
from .run import PreparedPass, StepMeasure
from .schedule import Schedule, StepPlan
from .sources import TraceSource


def quick_profile(store: ExpertStore, device: torch.device, dtype: torch.dtype, offload: str) -> HardwareProfile:
    """This device's rates, measured in a few seconds: the fetch bandwidth by copying
    experts from the replay's own store to the device, matmul throughput at the replay
    dtype, device memory bandwidth and per-operation overhead."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    dest = torch.empty(store.numel, dtype=store.dtype, device=device)
    keys = store.keys[: min(4, len(store.keys))]
    staging = None if store.host_tensor(keys[0]) is not None else torch.empty(store.numel, dtype=store.dtype)
    if staging is not None and device.type == "cuda":
        staging = staging.pin_memory()

    def fetch():
        for key in keys:
            src = store.host_tensor(key)
            if src is None:
                store.read_into(key, staging)
                src = staging
            dest.copy_(src, non_blocking=True)
        sync()
    fetch_bw = len(keys) * store.nbytes / timed(fetch, min_time=0.2, max_reps=10)
    small = torch.ones(1, device=device)

    def ops():
        for _ in range(200):
            small.add_(1)
        sync()
    launch = timed(ops, min_time=0.05, max_reps=5) / 200
    big = torch.empty(32 << 20, dtype=torch.uint8, device=device)
    big2 = torch.empty_like(big)

    def dcopy():
        big2.copy_(big)
        sync()
    mem_bw = 2 * big.numel() / timed(dcopy, min_time=0.05, max_reps=10)
    flops = matmul_flops(dtype, device, 8192 if device.type == "cuda" else 2048, sync)
    host_flops = flops if device.type == "cpu" else matmul_flops(torch.float32, None, 512)
    h2d = fetch_bw
    what = "host->device copies" if device.type == "cuda" else "host memory copies"
    return HardwareProfile(
        name="replay-measured",
        description=f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'} as the compute "
                    f"device, experts in {'host memory' if offload == 'host' else 'a disk file'} (quick measurement)",
        source=f"measured by specmoe replay: fetch = {what} of {len(keys)} replayed experts"
               + (" read from disk" if offload == "disk" else "") + f", {dtype} matmul, 32 MiB device copy",
        device_matmul_flops=flops, device_mem_bw=mem_bw,
        device_memory_bytes=int(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda"
        else int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        h2d_bw=h2d, slow_tier=offload, slow_tier_read_bw=fetch_bw, host_mem_bw=mem_bw if device.type == "cpu"
        else fetch_bw, host_matmul_flops=host_flops, transfer_latency_s=max(launch, 1e-7),
        kernel_launch_s=max(launch, 1e-8))


def profile_for(name: str, offload: str) -> HardwareProfile:
    """A given profile, with its slow tier matched to --offload."""
    try:
        hw = load_profile(name)
    except ValueError as e:
        raise ReplayError(str(e)) from None
    if offload == "host" and hw.slow_tier != "host":
        hw = replace(hw, slow_tier="host", slow_tier_read_bw=hw.h2d_bw)
    elif offload == "disk" and hw.slow_tier != "disk":
        raise ReplayError(f"hardware profile {hw.name} keeps experts in host memory; for --offload disk pass its "
                          f"disk variant (specmoe calibrate saves {hw.name}-disk)")
    return hw


def predict_step(policy: str, sc: Scenario, prep: list[PreparedPass], m: StepMeasure) -> float:
    """The cost model's step time for the replayed routing and fetch counts: per expert
    max(FLOPs / matmul rate, bytes / memory bandwidth) + launches, per fetched expert
    bytes / fetch bandwidth + latency, combined by the policy's overlap rule (as in
    :mod:`specmoe.costmodel.cost_model`)."""
    shape, hw = sc.shape, sc.hardware

    def compute(ps: PreparedPass, rank: int) -> float:
        w = PassWork()
        for rk, _, routing in ps.layers:
            if rk != rank:
                continue
            for n in Counter(routing.ids.reshape(-1).tolist()).values():
                w.add(hw, 2 * n * shape.expert_params, shape.expert_bytes, LAUNCHES_PER_EXPERT)
        return w.time_s

    total = 0.0
    for ps in prep:
        for rank, _, _ in ps.layers:
            c = compute(ps, rank)
            if ps.kind == "draft":
                total += c
                continue
            f = sc.fetch_s(m.fetched.get(rank, 0))
            total += max(c, f) if policy == "overlap" else c + f  # fetched: refreshes included
    return total


def nonexpert_s(sc: Scenario, step: StepPlan) -> float:
    """The cost model's time for everything but the routed experts in this step's passes."""
    return sum(pass_work(sc, p.batch, max(1, p.positions // p.batch), 0, routed=False).time_s for p in step.passes)


def simulated(s: Schedule, shape: ModelShape, sc: Scenario, cache_fraction: float, rec: dict) -> dict:
    """The cost model's end-to-end estimate for this policy and batch (routing model fitted
    to the trace, as `specmoe simulate --trace`), next to the replay's record `rec`."""
    if "error" in rec:
        return {}
    try:
        routing = fitted_routing(s.trace)
        sc2 = replace(sc, routing=routing) if routing else sc
        if s.policy == "specmoe":
            acc = acceptance_from_trace([r for r in s.trace.records if r.batch_size == s.batch]) \
                or acceptance_from_trace(s.trace.records)
            n = max(1, min(shape.num_experts - 1, round(s.draft_experts or 1)))
            est = estimate("specmoe", sc2, s.batch, gamma=s.gamma or acc.gamma, draft_experts=n,
                           acceptance=acc.acceptance)
        elif s.policy == "caching":
            est = estimate("caching", sc2, s.batch, fraction=cache_fraction)
        elif s.policy == "overlap":
            est = estimate("oracle-overlap", sc2, s.batch)
        else:
            est = estimate(s.policy, sc2, s.batch)
    except (ValueError, AttributeError) as e:
        return {"simulate_error_note": str(e)}
    return {"simulate_decode_tokens_per_s": est.decode_tokens_per_s,
            "simulate_transfer_bytes_per_token": est.transfer_bytes_per_token,
            "simulate_error": est.decode_tokens_per_s / rec["decode_tokens_per_s"] - 1.0}


_FITTED: dict[str, RoutingModel | None] = {}


def fitted_routing(src: TraceSource) -> RoutingModel | None:
    """The routing model fitted to a trace (once per trace file)."""
    key = str(src.path)
    if key not in _FITTED:
        _FITTED[key] = fit_routing(src.header, src.records)
    return _FITTED[key]
