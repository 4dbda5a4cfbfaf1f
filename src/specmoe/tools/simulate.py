"""``specmoe simulate``: predicted throughput and transfer volume per policy and batch size
for a model shape on a hardware profile, from a trace or from the routing model.

    specmoe simulate --model-shape mixtral-8x7b --hardware h100-pcie5 --batch-sizes 1,16,256 --json
"""

from __future__ import annotations

import argparse
import json
import sys

from ..base.errors import SpecMoEError
from ..base.trace import read_trace
from ..base.units import format_bytes, parse_batch_sizes, parse_size
from ..costmodel import cost_model
from ..costmodel.cost_model import (
    DEFAULT_CACHE_FRACTION,
    DEFAULT_CONTEXT,
    DEFAULT_OUTPUT,
    DEFAULT_PREDICTION_ACCURACY,
    DEFAULT_SOURCE,
    Scenario,
    StepEstimate,
)
from ..costmodel.hardware import load_profile
from ..costmodel.planner import plan
from ..costmodel.routing import (
    DEFAULT_ACCEPTANCE,
    DEFAULT_DRAFT_EXPERTS,
    DEFAULT_LOCALITY,
    DEFAULT_SKEW,
    RoutingModel,
    acceptance_for_tokens_per_step,
    acceptance_from_trace,
    fit_routing,
)
from ..costmodel.shapes import load_shape

DEFAULT_BATCH_SIZES = "1,4,16,64,128,256"
DEFAULT_GAMMA = 5
# Rows of the table, in order; "auto" is added after them.
POLICY_ROWS = ("ondemand", "overlap", "oracle-overlap", "caching", "host", "resident", "specmoe")
BASELINES = ("ondemand", "overlap", "caching")


class SimulateError(SpecMoEError):
    """Bad input to `specmoe simulate`: reported in one line, exit code 2."""


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate", help="predict throughput per policy and batch size on a hardware profile",
        description="Predict decode throughput and transfer volume of each policy for a model shape on a "
                    "hardware profile, from an engine trace (--trace) or from a synthetic routing model.")
    p.add_argument("--trace", metavar="FILE", help="engine trace (generate/bench --trace): routing locality and "
                                                    "acceptance are fitted from it")
    p.add_argument("--model-shape", required=True, metavar="NAME|config.json",
                   help="preset (mixtral-8x7b, nllb-moe-54b, ...) or a HF config.json / model dir")
    p.add_argument("--hardware", required=True, metavar="NAME|path", help="hardware profile name or JSON path")
    p.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, metavar="B1,B2,...")
    p.add_argument("--gamma", type=int, default=DEFAULT_GAMMA, help="draft tokens per step for specmoe")
    p.add_argument("--draft-experts", type=int, default=None, metavar="N",
                   help=f"draft experts per MoE block for specmoe (default: the trace's, else "
                        f"{DEFAULT_DRAFT_EXPERTS} but at most a quarter of the block)")
    p.add_argument("--acceptance", type=float, default=None, metavar="A",
                   help=f"per-token draft acceptance at --draft-experts (default: the trace's, else "
                        f"{DEFAULT_ACCEPTANCE})")
    p.add_argument("--draft-quant", default="none", choices=("none", "int8", "int4", "int3"),
                   help="specmoe's draft: none = the paper's (N resident experts, default), or quantized copies "
                        "of every expert (the engine's default); --acceptance then applies to that draft")
    p.add_argument("--tokens-per-step", type=float, default=None, metavar="T",
                   help="alternative to --acceptance: measured tokens per step at --gamma")
    p.add_argument("--cache-fraction", type=float, default=None, metavar="F",
                   help=f"caching: fraction of each block's experts kept resident (default: "
                        f"{DEFAULT_CACHE_FRACTION:.0%}% or the draft set's share N/E, whichever is larger, so that "
                        f"caching and specmoe keep the same expert bytes resident)")
    p.add_argument("--skew", type=float, default=None, help=f"routing hotness skew (default {DEFAULT_SKEW})")
    p.add_argument("--locality", type=float, default=None,
                   help=f"routing temporal locality (default {DEFAULT_LOCALITY})")
    p.add_argument("--context-len", type=int, default=DEFAULT_CONTEXT, help="mean cached positions per sequence")
    p.add_argument("--source-len", type=int, default=DEFAULT_SOURCE,
                   help="an encoder-decoder model (nllb-moe-54b): source tokens per request, the encoder's work")
    p.add_argument("--output-len", type=int, default=DEFAULT_OUTPUT,
                   help="an encoder-decoder model: tokens decoded per request, over which its encoder pass is spread")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="device memory budget, e.g. 24GiB or 24G (GiB; GB is decimal) (default: the profile's device memory)")
    p.add_argument("--prediction-accuracy", type=float, default=DEFAULT_PREDICTION_ACCURACY,
                   help="overlap: fraction of next-layer picks predicted right")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also plot tokens/s and bytes/token against batch size")
    p.set_defaults(func=run_simulate)
    return p


def build(args) -> tuple[dict, list[str], list[dict]]:
    """(config, assumptions, records) for the parsed arguments."""
    shape = load_shape(args.model_shape)
    hw = load_profile(args.hardware)
    sizes = parse_batch_sizes(args.batch_sizes)
    if args.gamma < 1:
        raise SimulateError(f"bad --gamma {args.gamma}: must be >= 1")
    if args.acceptance is not None and args.tokens_per_step is not None:
        raise SimulateError("give --acceptance or --tokens-per-step, not both")
    device_memory = parse_size(args.device_memory, "--device-memory") if args.device_memory else None
    assumptions = [f"{shape.name}: {shape.note}"] if shape.note else []
    fitted, est = _read_trace(args, shape, assumptions)
    routing = _routing(args, fitted, assumptions)
    draft = _draft(args, shape, est, assumptions)
    assumptions.append(f"context {args.context_len} cached positions per sequence; overlap predicts "
                       f"{args.prediction_accuracy:.0%} of picks; caching keeps {draft['cache_fraction']:.0%} of "
                       "each block")
    if shape.encoder_layers:
        assumptions.append(f"encoder-decoder: {args.source_len} source tokens and {args.output_len} output tokens "
                           "per request (one encoder pass per admitted batch)")
    sc = Scenario(shape, hw, routing, args.context_len, device_memory, args.prediction_accuracy, args.source_len,
                  args.output_len)
    config = {
        "model_shape": shape.name, "hardware": hw.name, "batch_sizes": sizes, "gamma": args.gamma,
        "draft_experts": draft["n"], "draft_quant": args.draft_quant, "acceptance": draft["acceptance"],
        "acceptance_draft_experts": draft["n_ref"], "acceptance_source": draft["source"],
        "skew": routing.skew, "locality": routing.locality, "context_len": args.context_len,
        "source_len": args.source_len, "output_len": args.output_len,
        "cache_fraction": draft["cache_fraction"], "prediction_accuracy": args.prediction_accuracy,
        "device_memory": sc.memory, "trace": args.trace, "expert_bytes": shape.expert_bytes,
        "expert_bytes_total": shape.expert_bytes_total, "non_expert_bytes": shape.non_expert_bytes,
        "fetch_bw": hw.fetch_bw, "slow_tier": hw.slow_tier,
    }
    out = [r for b in sizes for r in _records_at(sc, b, args, draft, device_memory, assumptions)]
    return config, assumptions, out


def _read_trace(args, shape, assumptions: list[str]):
    """(routing model fitted to --trace, acceptance measured in it), each None without one."""
    if not args.trace:
        return None, None
    header, records = read_trace(args.trace)
    fitted, est = fit_routing(header, records), acceptance_from_trace(records)
    src = (header.get("model") or {}).get("name") or args.trace
    e_src = (header.get("model") or {}).get("num_experts", "?")
    if fitted:
        assumptions.append(f"routing skew {fitted.skew} and locality {fitted.locality} fitted to trace {args.trace} "
                           f"({src}, E={e_src}) and applied to E={shape.num_experts} (hotness by rank/E)")
    if est:
        assumptions.append(f"acceptance {est.acceptance:.3f} per token from trace {args.trace} ({src}: "
                           f"{est.tokens_per_step:.2f} tokens/step at gamma={est.gamma}, "
                           f"N={est.draft_experts}, {est.sequences} sequence-steps)")
    return fitted, est


def _routing(args, fitted, assumptions: list[str]) -> RoutingModel:
    skew = args.skew if args.skew is not None else (fitted.skew if fitted else DEFAULT_SKEW)
    locality = args.locality if args.locality is not None else (fitted.locality if fitted else DEFAULT_LOCALITY)
    try:
        routing = RoutingModel(skew, locality)
    except ValueError as e:
        raise SimulateError(str(e)) from None
    if not fitted:
        why = "given" if args.skew is not None and args.locality is not None else "assumed (no trace)"
        assumptions.append(f"routing: Zipf-like hotness skew {skew}, temporal locality {locality}: {why}")
    return routing


def _draft(args, shape, est, assumptions: list[str]) -> dict:
    """SpecMoE's draft (N, the acceptance and the N it was measured at) and caching's share."""
    n = args.draft_experts or (est.draft_experts if est and est.draft_experts
                               else min(DEFAULT_DRAFT_EXPERTS, max(1, shape.num_experts // 4)))
    if not 1 <= n < shape.num_experts:
        raise SimulateError(f"bad --draft-experts {n}: {shape.name} has {shape.num_experts} experts per block; "
                            f"use 1..{shape.num_experts - 1}")
    cache_fraction = args.cache_fraction if args.cache_fraction is not None \
        else max(DEFAULT_CACHE_FRACTION, n / shape.num_experts)
    if not 0.0 <= cache_fraction <= 1.0:
        raise SimulateError(f"bad --cache-fraction {cache_fraction}: must be in [0, 1]")
    n_ref = n
    if args.acceptance is not None:
        if not 0.0 <= args.acceptance <= 1.0:
            raise SimulateError(f"bad --acceptance {args.acceptance}: must be in [0, 1]")
        acceptance, source = args.acceptance, "given"
    elif args.tokens_per_step is not None:
        try:
            acceptance = acceptance_for_tokens_per_step(args.tokens_per_step, args.gamma)
        except ValueError as e:
            raise SimulateError(f"bad --tokens-per-step: {e}") from None
        source = f"from --tokens-per-step {args.tokens_per_step} at gamma={args.gamma}"
    elif est:
        acceptance, source, n_ref = est.acceptance, f"trace {args.trace}", est.draft_experts or n
    else:
        acceptance, source = DEFAULT_ACCEPTANCE, "assumed (no trace)"
    kind = "the paper's draft" if args.draft_quant == "none" else f"{args.draft_quant} copies of every expert"
    assumptions.append(f"specmoe: gamma={args.gamma}, N={n}, {kind}, acceptance {acceptance:.3f} per token at "
                       f"N={n_ref} ({source})")
    return {"n": n, "n_ref": n_ref, "acceptance": acceptance, "source": source, "cache_fraction": cache_fraction}


def _records_at(sc: Scenario, batch: int, args, draft: dict, device_memory, assumptions: list[str]) -> list[dict]:
    """One record per policy (and auto's plan) at one batch size, with speedups."""
    rows: dict[str, StepEstimate] = {}
    for policy in POLICY_ROWS:
        if policy == "specmoe":
            rows[policy] = cost_model.specmoe(sc, batch, args.gamma, draft["n"], draft["acceptance"],
                                              acceptance_draft_experts=draft["n_ref"], draft_quant=args.draft_quant)
        elif policy == "caching":
            rows[policy] = cost_model.caching(sc, batch, draft["cache_fraction"])
        else:
            rows[policy] = cost_model.estimate(policy, sc, batch)
    recs = {p: e.to_dict() for p, e in rows.items()}
    try:
        chosen = plan(sc.shape, sc.hardware, batch, draft["acceptance"], acceptance_draft_experts=draft["n_ref"],
                      routing=sc.routing, context_len=args.context_len, cache_fraction=draft["cache_fraction"],
                      device_memory=device_memory, prediction_accuracy=args.prediction_accuracy,
                      source_len=args.source_len, output_len=args.output_len)
        auto = chosen.estimate.to_dict()
        auto.update(policy="auto", chosen_policy=chosen.policy, note=f"-> {chosen.describe()}")
        recs["auto"] = auto
    except ValueError as e:
        assumptions.append(f"auto at batch {batch}: {e}")
    for r in recs.values():
        for base in BASELINES:
            r[f"speedup_vs_{base}"] = r["decode_tokens_per_s"] / rows[base].decode_tokens_per_s
    return list(recs.values())


def _print_table(config: dict, assumptions: list[str], records: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{config['model_shape']} on {config['hardware']} "
                    f"(experts {format_bytes(config['expert_bytes_total'])}, {config['slow_tier']} tier at "
                    f"{format_bytes(config['fetch_bw'])}/s)")
    for col in ("batch", "policy", "tok/s", "x ondemand", "tok/step", "step", "transfer/token", "note"):
        t.add_column(col, justify="left" if col in ("policy", "note") else "right")
    last = None
    for r in records:
        if last is not None and r["batch_size"] != last:
            t.add_section()
        last = r["batch_size"]
        fits = r["fits"]
        t.add_row(str(r["batch_size"]), r["policy"],
                  f"{r['decode_tokens_per_s']:.1f}" if fits else "-",
                  f"{r['speedup_vs_ondemand']:.2f}x" if fits else "-",
                  f"{r['tokens_per_step']:.2f}", f"{r['step_s'] * 1e3:.1f} ms",
                  format_bytes(r["transfer_bytes_per_token"]),
                  r["note"] if fits else f"does not fit ({format_bytes(r['device_bytes'])} needed)")
    console = Console()
    if not console.is_terminal:
        console = Console(width=150)  # pipes and logs: do not fold the table to 80 columns
    console.print(t)
    for a in assumptions:
        console.print(f"assumed: {a}", highlight=False)


def _plot(path: str, config: dict, records: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in dict.fromkeys(r["policy"] for r in records):
        rs = [r for r in records if r["policy"] == policy and r["fits"]]
        if not rs:
            continue
        xs = [r["batch_size"] for r in rs]
        style = dict(marker="o", linestyle="--" if policy in ("oracle-overlap", "auto") else "-")
        ax1.plot(xs, [r["decode_tokens_per_s"] for r in rs], label=policy, **style)
        ax2.plot(xs, [r["transfer_bytes_per_token"] / 1e9 for r in rs], label=policy, **style)
    for ax, ylabel in ((ax1, "decode tokens/s"), (ax2, "transfer GB per token")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"{config['model_shape']} on {config['hardware']} (simulated; gamma={config['gamma']}, "
                 f"N={config['draft_experts']}, acceptance {config['acceptance']:.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_simulate(args) -> int:
    try:
        config, assumptions, records = build(args)
    except ValueError as e:  # SimulateError and the loaders' ValueErrors: one line, exit 2
        print(f"specmoe simulate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"config": config, "assumptions": assumptions, "records": records}, indent=2))
    else:
        _print_table(config, assumptions, records)
    if args.plot:
        try:
            _plot(args.plot, config, records)
        except OSError as e:
            print(f"specmoe simulate: error: cannot write plot {args.plot}: {e}", file=sys.stderr)
            return 2
    return 0
