"""SpecMoE on the demo model, host tier, 30 % budget: greedy tokens equal to resident at
B = 1, 4, 16 for several gamma / draft choices (disk tier: see the bench grid and ablations)."""
import json
from specmoe import LLM, SamplingParams
prompts = [json.loads(l)["prompt"] for l in open("benchmarks/prompts/heldout.jsonl")][:16]
P = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
for B in (1, 4, 16):
    ref = LLM(max_batch_size=B, max_model_len=320); ref.generate(prompts[:B*2], P); sha = ref.last_stats["token_ids_sha256"]
    for kw in (dict(gamma=1), dict(gamma=10), dict(gamma=5, draft_quant="none"), dict(gamma=3, draft_quant="none", draft_set="random", substitution="random"), dict(gamma=5, draft_quant="none", draft_compute="host")):
        llm = LLM(policy="specmoe", offload="host", device_memory="30%", max_batch_size=B, max_model_len=320, **kw)
        llm.generate(prompts[:B*2], P); s = llm.last_stats
        print(B, kw, s["token_ids_sha256"] == sha, round(s["tokens_per_step"], 2), flush=True)
        llm.close()
