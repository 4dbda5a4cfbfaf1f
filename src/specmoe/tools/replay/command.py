"""The ``specmoe replay`` subcommand: its arguments, the run over every (policy, batch
size) the traces support, and the JSON document or table it prints. What a replay does
and assumes is described in the package docstring (:mod:`specmoe.tools.replay`)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ...base.units import format_bytes, parse_batch_sizes
from ...costmodel.cost_model import Scenario
from ...costmodel.shapes import ModelShape, load_shape
from ...engine.engine import resolve_device
from .errors import ReplayError
from .predict import profile_for, quick_profile
from .results import format_table, mean, replay_schedule, speedups
from .run import pool_slots
from .schedule import LayerMap, Schedule, build_schedules
from .sources import TraceSource, load_trace, parse_trace_args
from .weights import SharedLayerStore, check_memory, open_experts, replay_shape

REPLAY_POLICIES = ("ondemand", "overlap", "caching", "specmoe")
DEFAULT_MAX_STEPS = 8
DEFAULT_CACHE_FRACTION = 0.1
DTYPES = ("bfloat16", "float16", "float32")


# ---- command line -------------------------------------------------------------------------------

def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "replay", help="time a recorded trace's expert fetches and computations at a model shape, per policy",
        description="Execute the expert fetches and expert computations recorded in engine traces "
                    "(generate/bench --trace) on K layers of a model shape with random weights, for each "
                    "policy, measure real step times, project them to the full model and compare them with "
                    "the performance model.")
    p.add_argument("--trace", action="append", required=True, metavar="[POLICY=]FILE",
                   help="engine trace; repeat for several batch sizes or policies. POLICY= says which policy "
                        "recorded it (default: the trace header's)")
    p.add_argument("--model-shape", required=True, metavar="NAME|config.json",
                   help="preset (mixtral-8x7b, ...) or a HF config.json / model dir")
    p.add_argument("--layers", type=int, default=1, metavar="K",
                   help="MoE layers whose experts are built (host memory: K x experts per layer x expert "
                        "bytes; default 1)")
    p.add_argument("--policies", default=",".join(REPLAY_POLICIES), help="comma-separated, from: "
                   + ", ".join(REPLAY_POLICIES))
    p.add_argument("--batch-sizes", default=None, metavar="B1,B2,...",
                   help="replay only the traces recorded at these batch sizes (default: every one given)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    p.add_argument("--offload", default="host", help="where the experts live: host | disk (default host)")
    p.add_argument("--offload-dir", help="directory for the disk tier's expert file (default: the cache dir)")
    p.add_argument("--dtype", default="bfloat16", help="expert dtype: " + " | ".join(DTYPES) + " (default bfloat16)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply hidden and expert intermediate sizes by this factor (0 < f <= 1), e.g. 0.125 "
                        "to replay a smaller copy of the shape on a CPU")
    p.add_argument("--hardware", metavar="NAME|path",
                   help="hardware profile for the predictions (e.g. one saved by specmoe calibrate); default: "
                        "measure this device's fetch bandwidth and matmul rate quickly")
    p.add_argument("--cache-fraction", type=float, default=None, metavar="F",
                   help=f"caching: share of each block kept resident (default: {DEFAULT_CACHE_FRACTION:.0%}% or "
                        "specmoe's draft-set share N/E, whichever is larger: the same resident bytes)")
    p.add_argument("--max-steps", type=int, default=DEFAULT_MAX_STEPS, metavar="N",
                   help=f"timed steps per policy and batch size after one warm-up step (default {DEFAULT_MAX_STEPS})")
    p.add_argument("--context-len", type=int, default=None,
                   help="cached positions per sequence for the modelled non-expert compute (default: the cost "
                        "model's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--output", metavar="FILE", help="also write the JSON object to FILE")
    p.set_defaults(func=run_replay)
    return p


def run_replay(args) -> int:
    doc = replay(args)
    if args.output:
        try:
            Path(args.output).write_text(json.dumps(doc, indent=2) + "\n")
        except OSError as e:
            raise ReplayError(f"cannot write --output {args.output}: {e}") from None
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(format_table(doc))
    return 1 if any("error" in r for r in doc["records"]) else 0


def _csv(text: str, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ReplayError(f"bad --{what} {text!r}: expected a comma-separated list")
    return items


def check_args(args) -> list[str]:
    """Refuse bad numbers and names before reading anything; returns the policies."""
    policies = _csv(args.policies, "policies")
    bad = [p for p in policies if p not in REPLAY_POLICIES]
    if bad:
        raise ReplayError(f"bad --policies: {bad[0]!r} cannot be replayed; use some of {', '.join(REPLAY_POLICIES)}")
    if args.layers < 1:
        raise ReplayError(f"bad --layers {args.layers}: must be >= 1")
    if not 0 < args.scale <= 1:
        raise ReplayError(f"bad --scale {args.scale}: must be in (0, 1]")
    if args.max_steps < 1:
        raise ReplayError(f"bad --max-steps {args.max_steps}: must be >= 1")
    if args.dtype not in DTYPES:
        raise ReplayError(f"bad --dtype {args.dtype!r}: use one of {', '.join(DTYPES)}")
    if args.offload not in ("host", "disk"):
        raise ReplayError(f"bad --offload {args.offload!r}: use host or disk")
    if args.cache_fraction is not None and not 0 < args.cache_fraction <= 1:
        raise ReplayError(f"bad --cache-fraction {args.cache_fraction}: must be in (0, 1]")
    return policies


# ---- inputs -------------------------------------------------------------------------------------

@dataclass
class Inputs:
    """Everything a replay runs from, checked: traces, shapes, device, the layer map."""

    policies: list[str]
    sources: list[TraceSource]
    batches: list[int]
    base_shape: ModelShape  # as given
    shape: ModelShape  # as replayed
    device: torch.device
    dtype: torch.dtype
    lmap: LayerMap
    notes: list[str]  # how the traces were mapped onto the shape


def load_inputs(args) -> Inputs:
    policies = check_args(args)
    try:
        base_shape = load_shape(args.model_shape)
    except ValueError as e:
        raise ReplayError(str(e)) from None
    sources = [load_trace(path, policy) for policy, path in parse_trace_args(args.trace)]
    batches = select_batches(args.batch_sizes, sources)
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    shape, notes = replay_shape(base_shape, args.scale, torch.tensor([], dtype=dtype).element_size())
    trace_layers = sorted({l for s in sources for l in s.layers})
    lmap = LayerMap(tuple(trace_layers), min(args.layers, len(trace_layers)), shape.num_experts)
    notes += mapping_notes(args.layers, sources, lmap, shape, base_shape)
    return Inputs(policies, sources, batches, base_shape, shape, device, dtype, lmap, notes)


def select_batches(batch_sizes: str | None, sources: list[TraceSource]) -> list[int]:
    """The batch sizes to replay: --batch-sizes (each must have a trace), else every one traced."""
    traced = sorted({s.batch for s in sources})
    if not batch_sizes:
        return traced
    try:
        batches = parse_batch_sizes(batch_sizes)
    except ValueError as e:
        raise ReplayError(str(e)) from None
    missing = [b for b in batches if b not in traced]
    if missing:
        raise ReplayError(f"no trace recorded at batch size {missing[0]}; the traces given are at "
                          f"{', '.join(map(str, traced))}: record one with specmoe generate --batch-size "
                          f"{missing[0]} --trace FILE")
    return batches


def mapping_notes(layers: int, sources: list[TraceSource], lmap: LayerMap, shape: ModelShape,
                  base_shape: ModelShape) -> list[str]:
    """How trace layers, expert ids and top-k map onto the replayed shape."""
    L = lmap.num_trace_layers
    notes = [f"layers: the trace's MoE layer of rank r runs on replayed layer r mod {lmap.physical_layers} "
             + f"({L} trace layers per pass); per-layer time = step time / {L}, full model = per-layer time x "
             + f"{shape.num_moe_layers} MoE layers of {base_shape.name}"]
    if layers > L:
        notes.append(f"--layers {layers} > the traces' {L} MoE layers: {L} built")
    src_e = sorted({s.num_experts for s in sources})
    if src_e != [shape.num_experts]:
        how = (f"folded onto {shape.num_experts} (id mod {shape.num_experts}; merged ids' token counts added)"
               if max(src_e) > shape.num_experts else
               f"kept (ids < {max(src_e)} of {shape.num_experts}: the other experts are never used)")
        notes.append(f"experts: the traces' {'/'.join(map(str, src_e))} experts per layer {how}")
    src_k = sorted({s.top_k for s in sources})
    if src_k != [shape.top_k]:
        notes.append(f"top-k: the traces route {'/'.join(map(str, src_k))} experts per token, {base_shape.name} "
                     f"{shape.top_k}: the recorded picks are replayed as they are")
    return notes


def cache_fraction_for(given: float | None, schedules: list[Schedule], num_experts: int) -> float:
    """--cache-fraction, else 10 % or specmoe's draft-set share, whichever is larger."""
    if given is not None:
        return given
    spec_n = [s.draft_experts for s in schedules if s.policy == "specmoe" and s.draft_experts]
    return max(DEFAULT_CACHE_FRACTION, (mean(spec_n) / num_experts) if spec_n else 0.0)


# ---- the run ------------------------------------------------------------------------------------

def replay(args) -> dict:
    """Replay every (policy, batch size) the traces support; the JSON document."""
    inp = load_inputs(args)
    shape, lmap = inp.shape, inp.lmap
    schedules, skipped = build_schedules(inp.sources, inp.policies, inp.batches, lmap, args.seed)
    if not schedules:
        raise ReplayError("nothing to replay: " + "; ".join(skipped))
    cache_fraction = cache_fraction_for(args.cache_fraction, schedules, shape.num_experts)
    largest_pool = max([2 * shape.num_experts] + [pool_slots(s, lmap, shape.num_experts, cache_fraction)
                                                  for s in schedules])
    check_memory(shape, lmap.physical_layers, largest_pool, inp.device, args.offload, hint_scale=args.scale == 1.0)
    hw = profile_for(args.hardware, args.offload) if args.hardware else None

    t0 = time.perf_counter()
    store = open_experts(shape, lmap, inp.dtype, inp.device, args.offload, args.offload_dir, args.seed)
    setup_s = time.perf_counter() - t0
    try:
        if hw is not None:
            hw_note = f"hardware profile {hw.name} ({hw.source})"
        else:
            hw = quick_profile(store, inp.device, inp.dtype, args.offload)
            hw_note = ("hardware measured quickly by replay (pass --hardware NAME from specmoe calibrate for a "
                       "fuller one)")
        sc = Scenario(shape, hw, **({"context_len": args.context_len} if args.context_len is not None else {}))
        records = [replay_schedule(s, store, lmap, shape, inp.device, inp.dtype, cache_fraction, args.max_steps, sc)
                   for s in schedules]
    finally:
        store.close()

    notes = inp.notes + run_notes(args.cache_fraction is None, cache_fraction, shape, sc, hw_note, records)
    return {
        "config": config_doc(args, inp, store, cache_fraction, setup_s),
        "hardware": hw.to_dict(),
        "assumptions": notes,
        "skipped": skipped,
        "records": records,
        "speedups": speedups(records, inp.batches),
    }


def run_notes(default_fraction: bool, cache_fraction: float, shape: ModelShape, sc: Scenario, hw_note: str,
              records: list[dict]) -> list[str]:
    """What the run assumed (predictor, substitution, resident bytes, projection, profile)
    and what it saw (specmoe's draft-set re-fetches)."""
    notes = [
        "overlap uses a perfect predictor (the recorded routing of the next block): the paper's oracle Overlap",
        "specmoe drafts substitute round-robin into the draft set (the engine's affinity table needs real weights)",
        f"caching keeps {cache_fraction:.0%} of each block resident"
        + (" (= specmoe's mean draft-set share, so both keep the same expert bytes resident)"
           if default_fraction and cache_fraction > DEFAULT_CACHE_FRACTION else ""),
        (f"projected tokens/s = batch x tokens per step / (measured expert time x {shape.num_moe_layers} "
         f"layers / trace layers + the cost model's non-expert compute at context {sc.context_len}); "
         "'experts only' leaves the latter out"),
        hw_note,
    ]
    for r in records:
        if r.get("refresh_bytes"):
            notes.append(f"specmoe at batch {r['batch_size']}: {format_bytes(r['refresh_bytes'] / r['steps_timed'])} "
                         "per step re-fetched for the next draft set (the verify's prefetches had evicted some of it "
                         f"from the {r['pool_slots']}-slot pool before it was pinned)")
    return notes


def config_doc(args, inp: Inputs, store: SharedLayerStore, cache_fraction: float, setup_s: float) -> dict:
    """The document's "config": what was replayed, where, and how it was timed."""
    shape, device = inp.shape, inp.device
    cuda = device.type == "cuda"
    return {
        "model_shape": inp.base_shape.name, "replayed_shape": shape.to_dict(), "layers": inp.lmap.physical_layers,
        "trace_layers": inp.lmap.num_trace_layers, "moe_layers": shape.num_moe_layers, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "offload": args.offload, "pinned": bool(store.pinned), "dtype": args.dtype,
        "scale": args.scale, "expert_bytes": shape.expert_bytes, "max_steps": args.max_steps,
        "cache_fraction": cache_fraction,
        "timing": "torch.cuda.synchronize + perf_counter around each step" if cuda else "perf_counter around each step",
        "setup_s": setup_s,
        "traces": [{"path": str(s.path), "policy": s.policy, "batch_size": s.batch, "num_experts": s.num_experts,
                    "top_k": s.top_k} for s in inp.sources],
    }
