"""The paper's measurements on the bundled translation MoE (`specmoe-demo-translate`, NLLB-MoE
layout): held-out English UI strings translated into French, greedy, on a tier where
experts really have to move.

For each tier (`disk`: the real disk tier, page cache bypassed; `capped`: its read rate
capped so that one sweep over all expert bytes takes --sweep-s seconds) and each batch
size: ondemand, caching and SpecMoE (γ = --gamma, the paper's draft of N resident
experts per decoder block, `--draft-quant none`, and the default quantized draft)
interleaved round by round after a warm-up, the median of the rounds reported; every
run's tokens are checked against `resident`. Then the draft-expert ablation (N = 2, 4, 8,
paper's draft) at one batch size on the capped tier. Budget: non-expert bytes + KV + 30 %
of the expert bytes, as in the main grid.

    nice -n 10 python benchmarks/translate_bench.py --json translate.json
    python benchmarks/translate_bench.py --batch-sizes 1,4 --rounds 1 --max-tokens 8 --json t.json   # smoke

Prints one line per run; --json FILE writes the document BENCHMARKS.md's section is
rendered from (`specmoe.bench.tables.translate`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
MODEL = "specmoe-demo-translate"
KEEP = ("decode_tokens_per_s", "tokens_per_step", "transfer_bytes_per_token", "transfer_bytes",
        "encoder_transfer_bytes", "decoder_transfer_bytes", "acceptance_rate", "generated_tokens", "wall_s",
        "token_ids_sha256", "draft_experts", "gamma", "draft_quant")


def load_sources(path: Path, n: int) -> list[str]:
    rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    if len(rows) < n:
        raise SystemExit(f"{path} holds {len(rows)} sources, {n} asked")
    return rows[:n]


def configurations(gamma: int) -> dict[str, dict]:
    return {
        "ondemand": dict(policy="ondemand"),
        "caching": dict(policy="caching"),
        "specmoe": dict(policy="specmoe", gamma=gamma, draft_quant="none", draft_experts=4),
        "specmoe-int8": dict(policy="specmoe", gamma=gamma, draft_quant="int8"),
    }


def run_rounds(llms: dict, sources: list[str], params, rounds: int, reference: str) -> dict[str, dict]:
    """Warm-up, then `rounds` interleaved rounds; the median round per configuration."""
    runs = {name: [] for name in llms}
    for r in range(rounds + 1):
        for name, llm in llms.items():
            llm.generate(sources, params)
            stats = {k: llm.last_stats.get(k) for k in KEEP}
            if stats["token_ids_sha256"] != reference:
                raise SystemExit(f"{name}: output differs from resident's")
            if r:  # round 0 warms the caches and the page cache is bypassed anyway
                runs[name].append(stats)
            print(f"  {name:13s} B={len(sources):3d} {stats['decode_tokens_per_s']:8.1f} tok/s "
                  f"{stats['tokens_per_step']:.2f} tok/step {stats['transfer_bytes_per_token'] / 1e6:.3f} MB/tok",
                  file=sys.stderr)
    return {name: median_run(rs) for name, rs in runs.items()}


def median_run(runs: list[dict]) -> dict:
    ordered = sorted(runs, key=lambda s: s["decode_tokens_per_s"])
    out = dict(ordered[len(ordered) // 2])
    out["decode_tokens_per_s_runs"] = [s["decode_tokens_per_s"] for s in runs]
    return out


def main(argv=None) -> int:
    from specmoe.kernels.cpu import usable_cores

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--sources", default=str(ROOT / "prompts" / "translate_heldout.jsonl"))
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--gamma", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sweep-s", type=float, default=1.0, help="capped tier: seconds for one sweep over all experts")
    p.add_argument("--ablation-batch-size", type=int, default=16)
    p.add_argument("--ablation-n", default="2,4,8")
    p.add_argument("--tiers", default="disk,capped")
    p.add_argument("--threads", type=int, default=usable_cores(), help="compute threads (default: the usable cores)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)

    from specmoe import LLM, SamplingParams

    batches = [int(b) for b in args.batch_sizes.split(",")]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    common = dict(device="cpu", device_memory="30%", threads=args.threads, max_model_len=128)
    doc = {"model": args.model, "max_tokens": args.max_tokens, "gamma": args.gamma, "sweep_s": args.sweep_s,
           "threads": args.threads, "tiers": {}, "ablation": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for tier in args.tiers.split(","):
            doc["tiers"][tier] = {}
            for batch in batches:
                sources = load_sources(Path(args.sources), batch)
                resident = LLM(args.model, policy="resident", max_batch_size=batch, device="cpu", threads=args.threads,
                               max_model_len=128)
                resident.generate(sources, params)
                reference = resident.last_stats["token_ids_sha256"]
                total = resident.config.expert_params * 4 * resident.config.num_experts * len(resident.config.moe_layer_ids)
                resident.close()
                cap = {"offload_bandwidth": f"{total / args.sweep_s / 1e6:.3f}MB/s"} if tier == "capped" else {}
                doc["expert_bytes_total"] = total
                llms = {name: LLM(args.model, offload="disk", offload_dir=tmp, max_batch_size=batch, **common,
                                  **cap, **opts) for name, opts in configurations(args.gamma).items()}
                print(f"{tier} tier, B = {batch}:", file=sys.stderr)
                doc["tiers"][tier][str(batch)] = run_rounds(llms, sources, params, args.rounds, reference)
                for llm in llms.values():
                    llm.close()
        batch = args.ablation_batch_size
        sources = load_sources(Path(args.sources), batch)
        resident = LLM(args.model, policy="resident", max_batch_size=batch, device="cpu", threads=args.threads,
                       max_model_len=128)
        resident.generate(sources, params)
        reference = resident.last_stats["token_ids_sha256"]
        resident.close()
        cap = {"offload_bandwidth": f"{doc['expert_bytes_total'] / args.sweep_s / 1e6:.3f}MB/s"}
        llms = {"ondemand": LLM(args.model, offload="disk", offload_dir=tmp, max_batch_size=batch, policy="ondemand",
                                **common, **cap)}
        for n in args.ablation_n.split(","):
            llms[f"N={n}"] = LLM(args.model, offload="disk", offload_dir=tmp, max_batch_size=batch, policy="specmoe",
                                 gamma=args.gamma, draft_quant="none", draft_experts=int(n), **common, **cap)
        print(f"draft-expert ablation, capped tier, B = {batch}:", file=sys.stderr)
        doc["ablation"] = {"batch_size": batch, "runs": run_rounds(llms, sources, params, args.rounds, reference)}
        for llm in llms.values():
            llm.close()
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
