"""The offload tiers' expert dtype: the demo model's bf16 experts kept bf16 on disk (what
specmoe does when it computes in float32) against the same experts widened to float32
before they are stored (what it did before), on the real disk tier (page cache bypassed)
or the host tier (`--offload host`, where the `host` policy computes experts in place).

Both engines of a policy live in one process and run the same batches in alternating
rounds, so the ratio holds while the machine's speed drifts. Tokens must be identical:
widening bf16 to float32 is exact, so only where it happens changes.

    python benchmarks/stored_dtype.py --policies ondemand,specmoe --batch-size 16 --json stored.json
    python benchmarks/stored_dtype.py --offload host --policies host,specmoe --batch-size 16 --json stored-host.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specmoe import LLM, SamplingParams
from specmoe.bench.machine import threads_label
from specmoe.experts import formats
from specmoe.kernels.cpu import usable_cores

PROMPTS = Path(__file__).resolve().parent / "prompts" / "heldout.jsonl"


def engine(policy: str, batch: int, widened: bool, budget: str, offload: str, threads: int) -> LLM:
    """An engine whose tier stores bf16 experts (the default) or float32 copies of them."""
    keep = formats.stored_dtype
    if widened:
        formats.stored_dtype = lambda checkpoint_dtype, compute: compute
    try:
        return LLM(policy=policy, offload=offload, device_memory=budget, max_batch_size=batch, max_model_len=512,
                   threads=threads)
    finally:
        formats.stored_dtype = keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="ondemand,specmoe")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds after one warm-up")
    ap.add_argument("--device-memory", default="30%")
    ap.add_argument("--offload", default="disk", choices=("disk", "host"))
    ap.add_argument("--threads", type=int, default=usable_cores(), help="compute threads (default: the usable cores)")
    ap.add_argument("--json", metavar="FILE", required=True)
    args = ap.parse_args()
    B = args.batch_size
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()][: 2 * B]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engines = {(p, stored): engine(p, B, stored == "float32", args.device_memory, args.offload, args.threads)
               for p in args.policies.split(",") for stored in ("bfloat16", "float32")}
    speeds = {key: [] for key in engines}
    moved = {}
    tokens_equal = True
    for r in range(args.rounds + 1):
        batch = prompts[:B] if r % 2 == 0 else prompts[B:]
        seen = {}
        for (policy, stored), llm in engines.items():
            llm.engine.use_threads()  # the engine built last set torch's pool for every one
            out = [o.token_ids for o in llm.generate(batch, params)]
            tokens_equal &= seen.setdefault(policy, out) == out
            stats = llm.last_stats
            if r:  # round 0 warms up
                speeds[policy, stored].append(stats["decode_tokens_per_s"])
                moved[policy, stored] = stats["transfer_bytes"] / (B * args.max_tokens) / 1e6
            print(f"round {r}: {policy} stored {stored}, {threads_label(args.threads)}: "
                  f"{stats['decode_tokens_per_s']:.1f} tok/s", flush=True)
    rows = []
    for policy in args.policies.split(","):
        narrow, wide = speeds[policy, "bfloat16"], speeds[policy, "float32"]
        rows.append({"policy": policy, "tok_s_bf16": statistics.median(narrow), "tok_s_f32": statistics.median(wide),
                     "ratio_median": statistics.median(a / b for a, b in zip(narrow, wide)),
                     "mb_per_token_bf16": moved[policy, "bfloat16"], "mb_per_token_f32": moved[policy, "float32"]})
        print(f"{policy}: bf16 stored {rows[-1]['tok_s_bf16']:.1f} tok/s, float32 stored {rows[-1]['tok_s_f32']:.1f}; "
              f"per-round ratio median {rows[-1]['ratio_median']:.2f}x; MB/token {rows[-1]['mb_per_token_bf16']:.2f} "
              f"vs {rows[-1]['mb_per_token_f32']:.2f}")
    print("tokens identical in every round:", tokens_equal)
    for llm in engines.values():
        llm.close()
    Path(args.json).write_text(json.dumps({"kind": "stored-dtype", "offload": args.offload, "batch_size": B,
                                           "threads": args.threads,
                                           "rounds": args.rounds,
                                           "tokens_equal": tokens_equal, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
