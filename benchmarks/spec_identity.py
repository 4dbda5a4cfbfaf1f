"""SpecMoE's greedy output equals resident's on the demo model's held-out prompts.

Both tiers, B = 1, 4 and 16 (2 x B prompts each), 30 % budget: gamma 1, 3, 5, 10 with
the default draft, and every draft set x substitution with the paper's draft
(--draft-quant none, gamma 5). Prints one line per run and a count; exit 1 on a mismatch.
"""

import itertools
import json
import sys
from pathlib import Path

from specmoe import LLM, SamplingParams

PROMPTS = Path(__file__).parent / "prompts" / "heldout.jsonl"
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
CHOICES = [dict(gamma=g) for g in (1, 3, 5, 10)] + [
    dict(gamma=5, draft_quant="none", draft_set=d, substitution=s)
    for d, s in itertools.product(("temporal-hot", "global-hot", "random"), ("affinity", "random"))
]


def main() -> int:
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.open()]
    equal = total = 0
    for batch in (1, 4, 16):
        batch_prompts = prompts[: 2 * batch]
        ref = LLM(max_batch_size=batch, max_model_len=320)
        ref.generate(batch_prompts, PARAMS)
        want = ref.last_stats["token_ids_sha256"]
        for tier, choice in itertools.product(("disk", "host"), CHOICES):
            llm = LLM(policy="specmoe", offload=tier, device_memory="30%", max_batch_size=batch, max_model_len=320, **choice)
            llm.generate(batch_prompts, PARAMS)
            stats = llm.last_stats
            same = stats["token_ids_sha256"] == want
            equal, total = equal + same, total + 1
            print(f"B={batch} {tier} {choice} equal={same} tokens/step={stats['tokens_per_step']:.2f}", flush=True)
            llm.close()
    print(f"{equal}/{total} runs equal to resident")
    return 0 if equal == total else 1


if __name__ == "__main__":
    sys.exit(main())
