"""specmoe against llama.cpp on the same GGUF file, every weight in memory, as users compare
them: the real-size model written as a float32 GGUF (tools/gguf_export.py) and quantized by
llama.cpp's own quantizer (llama_model_quantize) to Q4_K_M, Q8_0 and BF16; greedy, held-out
prompts, the same token ids and thread count for both, llama.cpp as it loads by default
(weights repacked for its CPU kernels where it does so).

For every file, batch size and thread count: both engines built once, then a warm-up and
--rounds rounds interleaved (specmoe first in even rounds, llama.cpp first in odd ones).
The ratio is taken round by round (specmoe's decode tokens/s over llama.cpp's in the same
round), and a goal is met only when the lowest round's ratio clears it.

    python benchmarks/same_file.py --model-dir /work/rs --workdir /work/rsg --json same-file.json
    python benchmarks/same_file.py ... --types Q4_K_M --batch-sizes 1 --threads 2 --rounds 1   # a quick look

Needs llama-cpp-python (make anchors) and gguf. The model directory is made by
benchmarks/real_size_model.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# llama.cpp's file types (llama.h's llama_ftype) its quantizer takes
FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q8_0": 7, "BF16": 32, "Q4_0": 2}


def quantized_file(model_dir: Path, workdir: Path, type_name: str) -> Path:
    """The model as `type_name`, written by llama.cpp's quantizer from its float32 GGUF (both cached)."""
    import llama_cpp

    from specmoe.base.checkpoint import Checkpoint
    from specmoe.tools.gguf_export import cached_gguf

    out = workdir / f"{model_dir.name}-{type_name}.gguf"
    if out.is_file():
        return out
    f32 = cached_gguf(Checkpoint(model_dir), workdir)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[type_name]
    params.nthread = os.cpu_count() or 1
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {f32} to {type_name}")
    tmp.rename(out)
    return out


def prompts_ids(file: Path, tokenizer, n: int) -> list[list[int]]:
    texts = [json.loads(line)["prompt"] for line in file.read_text().splitlines() if line.strip()][:n]
    return [tokenizer.encode(t) for t in texts]


def measure(path: Path, batch: int, threads: int, rounds: int, max_tokens: int, prompts_file: Path) -> dict:
    import gc

    import torch

    from specmoe.bench.anchors import LlamaCppRunner
    from specmoe.bench.runners import PolicyRunner
    from specmoe.engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    options = dict(device="cpu", policy="resident", threads=threads, max_batch_size=batch, max_model_len=256)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ours = PolicyRunner("specmoe resident", str(path), options, [], params)
    prompts = prompts_ids(prompts_file, ours.llm.tokenizer, 2 * batch)
    ours.prompts = prompts
    theirs = LlamaCppRunner(str(path), prompts, batch, max_tokens, threads, path.parent)
    runs: dict[str, list[dict]] = {"specmoe": [], "llama.cpp": []}
    try:
        for rnd in range(rounds + 1):  # round 0 warms both up
            order = [("specmoe", ours), ("llama.cpp", theirs)]
            for name, runner in (order if rnd % 2 == 0 else order[::-1]):
                stats, ids = runner.run()
                if rnd:
                    runs[name].append({"decode_tokens_per_s": stats["decode_tokens_per_s"], "token_ids": ids})
    finally:
        ours.close()
        theirs.close()
        gc.collect()
    ratios = [a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in zip(runs["specmoe"], runs["llama.cpp"])]
    same = sum(x == y for a, b in zip(runs["specmoe"][-1]["token_ids"], runs["llama.cpp"][-1]["token_ids"])
               for x, y in zip(a, b))
    total = sum(len(a) for a in runs["specmoe"][-1]["token_ids"])
    return {"file": path.name, "bytes": path.stat().st_size, "batch_size": batch, "threads": threads,
            "specmoe_tok_s": [r["decode_tokens_per_s"] for r in runs["specmoe"]],
            "llama_cpp_tok_s": [r["decode_tokens_per_s"] for r in runs["llama.cpp"]],
            "ratio_median": statistics.median(ratios), "ratio_low": min(ratios), "ratio_high": max(ratios),
            "tokens_equal": same / total if total else None, "rounds": rounds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, type=Path, help="the real-size model (benchmarks/real_size_model.py)")
    p.add_argument("--workdir", required=True, type=Path, help="where the GGUF files are written (and kept)")
    p.add_argument("--types", default="Q4_K_M,Q8_0,BF16")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--threads", default=f"{os.cpu_count() or 1},1", help="thread counts (default: the cores, then 1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts-file", type=Path, default=ROOT / "benchmarks" / "prompts" / "heldout.jsonl")
    p.add_argument("--json", type=Path, help="write the records here")
    args = p.parse_args(argv)
    from specmoe.bench.machine import machine_info

    args.workdir.mkdir(parents=True, exist_ok=True)
    records = []
    for type_name in args.types.split(","):
        path = quantized_file(args.model_dir, args.workdir, type_name)
        for threads in (int(t) for t in args.threads.split(",")):
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                started = time.time()
                rec = {"type": type_name, **measure(path, batch, threads, args.rounds, args.max_tokens,
                                                    args.prompts_file)}
                rec["seconds"] = round(time.time() - started, 1)
                records.append(rec)
                print(f"{type_name} B={batch} threads={threads}: specmoe {statistics.median(rec['specmoe_tok_s']):.1f} "
                      f"tok/s, llama.cpp {statistics.median(rec['llama_cpp_tok_s']):.1f}: {rec['ratio_median']:.2f}x "
                      f"({rec['ratio_low']:.2f}-{rec['ratio_high']:.2f}), tokens equal {rec['tokens_equal']:.0%}",
                      flush=True)
                if args.json:
                    doc = {"command": " ".join(sys.argv), "machine": machine_info("cpu"), "records": records}
                    args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
