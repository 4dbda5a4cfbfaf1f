"""Evaluation throughput: the requests of an lm-evaluation-harness run, through the engine.

Two workloads from benchmarks/eval_tasks.py (the held-out Python docs):
- loglikelihood: every (question, choice) of `pydoc_mc` scored as one prefill-only
  request (max_tokens=0, prompt_logprobs=1: what `echo` + `logprobs` with max_tokens 0
  asks the server), under resident, ondemand and caching;
- generation: every prompt of `pydoc_gen` continued greedily up to a newline, under
  resident, ondemand and specmoe.

Each policy runs with the same device budget (default 30 %: non-expert weights, the KV
cache and 30 % of the expert bytes) at each batch size, after a short warm-up. One line
per run: requests/s, its ratio to resident's in the same run, expert bytes moved per
request, and whether the results equal resident's (the same tokens; log-likelihoods within
1e-4). --markdown prints the table for BENCHMARKS.md.

    python benchmarks/eval_throughput.py                              # 200 questions, 50 generations, B=1,16
    python benchmarks/eval_throughput.py --questions 16 --generations 4 --batch-sizes 4   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from eval_tasks import generation, multiple_choice, paragraphs  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402

WORKLOADS = {"loglikelihood": ("resident", "ondemand", "caching"), "generation": ("resident", "ondemand", "specmoe")}
SCORE = SamplingParams(max_tokens=0, prompt_logprobs=1)
GENERATE = SamplingParams(max_tokens=16, temperature=0.0, stop="\n")
ATOL = 1e-4


def requests(tokenizer, questions: int, generations: int) -> dict:
    """Token ids per workload, as lm-eval sends them (no special tokens; the context's length
    for each scored request, so its continuation's log-likelihood can be summed)."""
    import random

    paras = paragraphs()
    scored = []
    for doc in multiple_choice(paras, questions, random.Random(0)):
        context = len(tokenizer.encode(doc["context"], add_special_tokens=False))
        for choice in doc["choices"]:
            scored.append((tokenizer.encode(doc["context"] + " " + choice, add_special_tokens=False), context))
    prompts = [tokenizer.encode(d["context"], add_special_tokens=False) for d in generation(paras, generations)]
    return {"loglikelihood": scored, "generation": prompts}


def run(llm: LLM, workload: str, work: list) -> tuple[dict, list]:
    """Stats of one timed run and what it computed (log-likelihoods or token ids)."""
    if workload == "loglikelihood":
        outs = llm.generate([ids for ids, _ in work], SCORE)
        results = [sum(p.logprob for p in out.prompt_logprobs[ctx:]) for out, (_, ctx) in zip(outs, work)]
    else:
        outs = llm.generate(work, GENERATE)
        results = [out.token_ids for out in outs]
    return llm.last_stats, results


def same(a: list, b: list) -> bool:
    if a and isinstance(a[0], float):
        return max(abs(x - y) for x, y in zip(a, b)) <= ATOL
    return a == b


def measure(args) -> list[dict]:
    rows = []
    probe = LLM(device=args.device, max_batch_size=1)
    work = requests(probe.tokenizer, args.questions, args.generations)
    probe.close()
    for workload, policies in WORKLOADS.items():
        for batch in args.batch_sizes:
            baseline = None
            for policy in policies:
                options = {} if policy == "resident" else {"offload": args.offload, "device_memory": args.device_memory}
                llm = LLM(device=args.device, policy=policy, max_batch_size=batch, max_model_len=args.max_model_len,
                          **options)
                run(llm, workload, work[workload][:batch])  # warm-up: first fetches, file and cache set-up
                stats, results = run(llm, workload, work[workload])
                llm.close()
                baseline = baseline or (stats, results)
                rows.append(row(workload, policy, batch, stats, baseline, same(results, baseline[1])))
                print(line(rows[-1]), flush=True)
    return rows


def row(workload, policy, batch, stats, baseline, exact) -> dict:
    return {
        "workload": workload, "policy": policy, "batch_size": batch, "requests": stats["num_requests"],
        "wall_s": stats["wall_s"], "requests_per_s": stats["requests_per_s"],
        "vs_resident": stats["requests_per_s"] / baseline[0]["requests_per_s"],
        "transfer_bytes_per_request": stats["transfer_bytes_per_request"],
        "generated_tokens": stats["generated_tokens"], "tokens_per_step": stats["tokens_per_step"],
        "same_as_resident": exact,
    }


def line(r: dict) -> str:
    return (f"{r['workload']:13s} {r['policy']:9s} B={r['batch_size']:<3d} {r['requests']} requests "
            f"{r['requests_per_s']:8.2f} req/s ({r['vs_resident']:.2f}x resident) "
            f"{r['transfer_bytes_per_request'] / 2**20:8.2f} MiB moved/request "
            f"{'same results' if r['same_as_resident'] else 'RESULTS DIFFER'}")


def markdown(rows: list[dict]) -> str:
    out = ["| workload | policy | batch | requests/s | vs resident | MiB moved per request | same results |",
           "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r['workload']} | {r['policy']} | {r['batch_size']} | {r['requests_per_s']:.2f} | "
                   f"{r['vs_resident']:.2f}x | {r['transfer_bytes_per_request'] / 2**20:.2f} | "
                   f"{'yes' if r['same_as_resident'] else 'NO'} |")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=200, help="multiple-choice questions (4 scored requests each)")
    p.add_argument("--generations", type=int, default=50, help="generation requests")
    p.add_argument("--batch-sizes", default="1,16", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--device-memory", default="30%", help="the budget of every offloading policy (default 30%%)")
    p.add_argument("--offload", default="disk", choices=["host", "disk"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--markdown", action="store_true", help="print a table for BENCHMARKS.md")
    args = p.parse_args(argv)
    rows = measure(args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
