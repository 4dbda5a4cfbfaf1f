"""Ablation: SpecMoE's draft with the paper's resident subset (draft_quant none) vs
quantized copies of every expert (int8, int4, int3), at equal device memory, in one run.

Setting (issue 10): budget = non-expert bytes + KV (batch x max_model_len) + 30 % of the
expert bytes; disk tier capped so that one sweep over all expert bytes takes about 1 s;
batch 16, 32 new tokens, greedy, ignore_eos. Modes are interleaved round by round so that
machine noise hits them alike. Every mode's output is checked against `resident`.

    nice -n 10 python benchmarks/quant_ablation.py                  # the bundled demo model
    nice -n 10 python benchmarks/quant_ablation.py --model DIR --modes none,int8,int4,int3 --json quant.json

Prints one line per mode and the ratios against `none`; --json FILE also writes the
summary document that BENCHMARKS.md's section is rendered from (`specmoe bench --report`).
Agreement is the engine's own count (draft_target_agreement): the share of drafted tokens
equal to the target's argmax at their position.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def load_prompts(path: Path, n: int) -> list[str]:
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    if len(prompts) < n:
        raise SystemExit(f"{path} holds {len(prompts)} prompts, {n} asked")
    return prompts[:n]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the bundled demo model)")
    p.add_argument("--prompts", default=str(ROOT / "prompts" / "heldout.jsonl"))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--expert-fraction", type=float, default=0.3, help="share of the expert bytes in the budget")
    p.add_argument("--sweep-s", type=float, default=1.0, help="seconds for one sweep over all expert bytes")
    p.add_argument("--offload", default="disk")
    p.add_argument("--offload-dir", help="where the disk tier and caches live (default: a temporary dir)")
    p.add_argument("--modes", default="none,int8,int4,int3")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", metavar="FILE", help="also write the summary and every run's statistics as JSON")
    args = p.parse_args(argv)

    import torch

    from specmoe import LLM, SamplingParams
    from specmoe.base.units import format_bytes

    torch.manual_seed(0)
    modes = args.modes.split(",")
    prompts = load_prompts(Path(args.prompts), args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    common = dict(device="cpu", max_batch_size=args.batch_size, max_model_len=args.max_model_len)
    workdir = Path(args.offload_dir or tempfile.mkdtemp(prefix="specmoe-quant-"))

    ref = LLM(model=args.model, **common)
    ref.generate(prompts, params)
    ref_sha = ref.last_stats["token_ids_sha256"]
    e = ref.engine
    rt = e.policy.runtime
    expert_total = rt.expert_bytes * len(rt.expert_keys)  # as the tier stores them: what a sweep moves
    budget = int(e.model.weights.nbytes + e.cache.bytes_per_token() * args.batch_size * args.max_model_len
                 + args.expert_fraction * rt.slot_bytes * len(rt.expert_keys))  # as device slots hold them
    rate = expert_total / args.sweep_s
    model_dir = ref.model_dir
    ref.close()
    print(f"# {model_dir}: experts {format_bytes(expert_total)}, budget {format_bytes(budget)} "
          f"(+{args.expert_fraction:.0%} of experts), {args.offload} tier at {format_bytes(rate)}/s, "
          f"batch {args.batch_size}, {len(prompts)} prompts x {args.max_tokens} tokens, gamma {args.gamma}, "
          f"{args.rounds} interleaved rounds", flush=True)

    llms = {}
    for mode in modes:
        llm = LLM(model=str(model_dir), policy="specmoe", offload=args.offload, offload_dir=str(workdir),
                  device_memory=budget, offload_bandwidth=rate, gamma=args.gamma, draft_quant=mode, **common)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        llms[mode] = llm

    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            llms[mode].generate(prompts, params)
            stats = dict(llms[mode].last_stats)
            stats["round"] = r
            runs[mode].append(stats)

    def total(mode, key):
        return sum(s[key] for s in runs[mode])

    summary = {}
    for mode in modes:
        s0 = runs[mode][0]
        decode_tokens = sum(s["decode_tokens_per_s"] * s["decode_s"] for s in runs[mode])
        seq_steps = sum(s["decode_tokens_per_s"] * s["decode_s"] / s["tokens_per_step"] for s in runs[mode])
        summary[mode] = {
            "tokens_per_step": decode_tokens / seq_steps,
            "decode_tokens_per_s": decode_tokens / total(mode, "decode_s"),
            "acceptance_rate": sum(s["acceptance_rate"] for s in runs[mode]) / len(runs[mode]),
            "draft_target_agreement": sum(s["draft_target_agreement"] for s in runs[mode]) / len(runs[mode]),
            "draft_s": total(mode, "draft_s"),
            "verify_s": total(mode, "verify_s"),
            "transfer_bytes_per_token": total(mode, "transfer_bytes") / total(mode, "generated_tokens"),
            "draft_experts": s0["draft_experts"],
            "draft_resident_bytes": s0["draft_resident_bytes"],
            "draft_quantized_bytes": s0["draft_quantized_bytes"],
            "device_peak_bytes": max(s["device_peak_bytes"] for s in runs[mode]),
            "exact": all(s["token_ids_sha256"] == ref_sha for s in runs[mode]),
        }
        m = summary[mode]
        print(f"{mode:5s} tokens/step {m['tokens_per_step']:.3f}  decode {m['decode_tokens_per_s']:.1f} tok/s  "
              f"accept {m['acceptance_rate']:.3f}  agree {m['draft_target_agreement']:.3f}  "
              f"draft {m['draft_s']:.2f} s  verify {m['verify_s']:.2f} s  "
              f"{format_bytes(m['transfer_bytes_per_token'])}/token  N={m['draft_experts']}  "
              f"resident {format_bytes(m['draft_resident_bytes'])} + quantized {format_bytes(m['draft_quantized_bytes'])}  "
              f"peak {format_bytes(m['device_peak_bytes'])} <= {format_bytes(budget)}: {m['device_peak_bytes'] <= budget}  "
              f"exact: {m['exact']}", flush=True)
    if "none" in summary:
        base = summary["none"]
        for mode in modes:
            if mode != "none":
                m = summary[mode]
                print(f"{mode} / none: tokens per step {m['tokens_per_step'] / base['tokens_per_step']:.2f}x, "
                      f"decode tokens/s {m['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x")
    for llm in llms.values():
        llm.close()
    if args.json:
        doc = {"kind": "quant-ablation", "command": "python benchmarks/quant_ablation.py " + " ".join(argv or sys.argv[1:]),
               "config": {**vars(args), "model": str(model_dir), "budget": budget, "rate": rate,
                          "expert_bytes_total": expert_total, "num_prompts": len(prompts)},
               "modes": summary, "runs": runs}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    ok = all(m["exact"] for m in summary.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
