"""SpecMoE's greedy output equals resident's on the demo model's held-out prompts.

Both tiers, B = 1, 4 and 16 (2 x B prompts each), 30 % budget: gamma 1, 3, 5, 10 with
the default draft, and every draft set x substitution with the paper's draft
(--draft-quant none, gamma 5). Prints one line per run and a count; --json FILE also
writes every run's result; exit 1 on a mismatch.
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

from specmoe import LLM, SamplingParams
from specmoe.base.units import parse_batch_sizes

PROMPTS = Path(__file__).parent / "prompts" / "heldout.jsonl"
CHOICES = [dict(gamma=g) for g in (1, 3, 5, 10)] + [
    dict(gamma=5, draft_quant="none", draft_set=d, substitution=s)
    for d, s in itertools.product(("temporal-hot", "global-hot", "random"), ("affinity", "random"))
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", metavar="FILE", help="also write every run's result as one JSON document")
    args = ap.parse_args(argv)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.open()]
    runs = []
    for batch in parse_batch_sizes(args.batch_sizes):
        batch_prompts = prompts[: 2 * batch]
        ref = LLM(max_batch_size=batch, max_model_len=320)
        ref.generate(batch_prompts, params)
        want = ref.last_stats["token_ids_sha256"]
        for tier, choice in itertools.product(("disk", "host"), CHOICES):
            llm = LLM(policy="specmoe", offload=tier, device_memory="30%", max_batch_size=batch, max_model_len=320, **choice)
            llm.generate(batch_prompts, params)
            stats = llm.last_stats
            runs.append({"batch_size": batch, "tier": tier, **choice, "equal": stats["token_ids_sha256"] == want,
                         "tokens_per_step": stats["tokens_per_step"], "draft_quant": stats.get("draft_quant")})
            print(f"B={batch} {tier} {choice} equal={runs[-1]['equal']} tokens/step={stats['tokens_per_step']:.2f}",
                  flush=True)
            llm.close()
    equal = sum(r["equal"] for r in runs)
    print(f"{equal}/{len(runs)} runs equal to resident")
    if args.json:
        command = "python benchmarks/spec_identity.py " + " ".join(argv if argv is not None else sys.argv[1:])
        doc = {"kind": "spec-identity", "command": command.strip(), "max_tokens": args.max_tokens, "runs": runs}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if equal == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
