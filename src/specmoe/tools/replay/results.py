"""What a replay reports: one record per policy and batch size (measured times projected
to the full model, transfer volume, the cost model's predictions next to them), the
speedups of specmoe over the baselines, and the table printed without --json."""

from __future__ import annotations

import torch

from ...base.units import format_bytes
from ...costmodel.cost_model import Scenario
from ...costmodel.shapes import ModelShape
from ...experts.store import ExpertStore
from .predict import nonexpert_s, predict_step, simulated
from .run import PolicyReplay, StepMeasure, timed_steps
from .schedule import LayerMap, Schedule

BASELINES = ("ondemand", "overlap", "caching")


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def replay_schedule(s: Schedule, store: ExpertStore, lmap: LayerMap, shape: ModelShape, device: torch.device,
                    dtype: torch.dtype, cache_fraction: float, max_steps: int, sc: Scenario) -> dict:
    """Run one schedule and report it; an error (e.g. CUDA out of memory) is reported in
    the record and the other schedules still run."""
    rec = {"policy": s.policy, "batch_size": s.batch, "source": s.source, "trace": str(s.trace.path),
           "routing": s.note}
    try:
        pr = PolicyReplay(s, store, lmap, shape, device, dtype, cache_fraction)
        measures = pr.run(max_steps)
    except (RuntimeError, MemoryError) as e:
        rec["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        return rec
    rec.update(measured(s, pr, measures, lmap, shape, cache_fraction, max_steps, sc))
    rec.update(simulated(s, shape, sc, cache_fraction, rec))
    return rec


def measured(s: Schedule, pr: PolicyReplay, measures: list[StepMeasure], lmap: LayerMap, shape: ModelShape,
             cache_fraction: float, max_steps: int, sc: Scenario) -> dict:
    """The record's measured and predicted fields: per-layer times, the full-model
    projection, transfer volume, the per-step prediction."""
    timed = timed_steps(s.steps, max_steps)
    L, M = lmap.num_trace_layers, shape.num_moe_layers
    prepared = pr.prepared[1:1 + len(measures)]  # [0] was the warm-up
    predicted = [predict_step(s.policy, sc, p, m) for p, m in zip(prepared, measures)]
    layer_s = [m.seconds / L for m in measures]
    generated = sum(st.generated for st in timed)
    seqs = sum(st.batch for st in timed)
    expert_s = sum(layer_s) * M
    other_s = sum(nonexpert_s(sc, st) for st in timed)
    moved = sum(m.transfer_bytes for m in measures) / L * M
    distinct = mean(len(c) for st in timed for p in st.passes if p.kind != "draft" for _, c in p.layers)
    rec = {
        "steps_timed": len(measures),
        "pool_slots": pr.slots,
        "layer_s": mean(layer_s),
        "layer_s_min": min(layer_s),
        "layer_s_max": max(layer_s),
        "model_step_s": (expert_s + other_s) / len(measures),
        "expert_step_s": expert_s / len(measures),
        "nonexpert_step_s": other_s / len(measures),
        "tokens_per_step": generated / seqs,
        "decode_tokens_per_s": generated / (expert_s + other_s),
        "decode_tokens_per_s_experts_only": generated / expert_s,
        "transfer_bytes_per_token": moved / generated,
        "transfer_bytes_per_step": moved / len(measures),
        "fetched_per_layer": mean(sum(m.fetched.values()) / L for m in measures),
        "present_rate": sum(m.hits for m in measures) / max(1, sum(m.uses for m in measures)),
        "distinct_per_layer": distinct,
        "refresh_bytes": sum(m.refresh_fetches for m in measures) * shape.expert_bytes,
        "draft_transfer_bytes": sum(m.draft_transfer_bytes for m in measures),
        "predicted_layer_s": mean(p / L for p in predicted),
        "prediction_error": sum(predicted) / sum(m.seconds for m in measures) - 1.0,
        "gamma": s.gamma,
        "draft_experts": s.draft_experts,
        "cache_fraction": cache_fraction if s.policy == "caching" else None,
    }
    if s.policy == "caching":
        rec["hot_set_from"] = pr.hot_source
    return rec


def speedups(records: list[dict], batches: list[int]) -> list[dict]:
    """specmoe's projected tokens/s over each baseline replayed at the same batch size."""
    out = []
    for b in batches:
        at = {r["policy"]: r for r in records if r["batch_size"] == b and "error" not in r}
        if "specmoe" not in at:
            continue
        for base in BASELINES:
            if base in at:
                out.append({
                    "batch_size": b, "over": base,
                    "speedup": at["specmoe"]["decode_tokens_per_s"] / at[base]["decode_tokens_per_s"],
                    "speedup_experts_only": at["specmoe"]["decode_tokens_per_s_experts_only"]
                    / at[base]["decode_tokens_per_s_experts_only"]})
    return out


def format_table(doc: dict) -> str:
    """The replay's document as the table printed without --json."""
    c = doc["config"]
    hw = doc["hardware"]
    header = (f"specmoe replay: {c['model_shape']} experts ({format_bytes(c['expert_bytes'])} each, "
              f"{c['dtype']}), {c['layers']} layer(s) built, {c['trace_layers']} trace layers per pass, on "
              f"{c['device_name']}, experts in {c['offload']}{' (pinned)' if c['pinned'] else ''}; profile "
              f"{hw['name']}: fetch {format_bytes(min(hw['h2d_bw'], hw['slow_tier_read_bw']))}/s, matmul "
              f"{hw['device_matmul_flops'] / 1e12:.3g} TFLOP/s")
    columns = (f"{'B':>4} {'policy':9} {'routing':8} {'ms/layer':>9} {'model ms':>9} {'tok/step':>8} {'tok/s':>9} "
               f"{'MB/token':>9} {'fetch/L':>7} {'pred ms/L':>9} {'pred err':>8}")
    lines = [header, columns]
    for r in doc["records"]:
        if "error" in r:
            lines.append(f"{r['batch_size']:>4} {r['policy']:9} {r['source']:8} error: {r['error']}")
            continue
        lines.append(f"{r['batch_size']:>4} {r['policy']:9} {r['source']:8} {r['layer_s'] * 1e3:9.3f} "
                     f"{r['model_step_s'] * 1e3:9.2f} {r['tokens_per_step']:8.2f} {r['decode_tokens_per_s']:9.1f} "
                     f"{r['transfer_bytes_per_token'] / 1e6:9.2f} {r['fetched_per_layer']:7.2f} "
                     f"{r['predicted_layer_s'] * 1e3:9.3f} {r['prediction_error']:+8.0%}")
    if doc["speedups"]:
        by_b: dict[int, list[str]] = {}
        for sp in doc["speedups"]:
            by_b.setdefault(sp["batch_size"], []).append(f"{sp['speedup']:.2f}x over {sp['over']}")
        lines.append("specmoe speedup (projected tok/s): "
                     + "; ".join(f"B={b}: " + ", ".join(v) for b, v in by_b.items()))
    for n in doc["skipped"]:
        lines.append(f"skipped: {n}")
    lines += [f"note: {n}" for n in doc["assumptions"]]
    return "\n".join(lines)
