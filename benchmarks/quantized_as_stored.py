"""A quantized safetensors checkpoint's int8 / int4 experts multiplied as Q8_0 / Q4_0 blocks
by the block kernels (the default on the CPU) against what ran before: the same experts
through torch's fused int4 kernel where its guard let it run, else dequantized at every
call. The real-size model (benchmarks/real_size_model.py) written by `specmoe quantize` as
w4a16 (groups of 128) and w8a16 (one scale per row: a group as wide as the row), resident,
every weight in memory, greedy, held-out prompts, the machine's cores.

Both engines of a checkpoint live in one process (the "before" one built with the block
re-encoding refused, as the code before it did) and run the same batches in alternating
rounds after a warm-up, so the ratio holds while the machine's speed drifts; the ratio is
taken round by round. Tokens may differ: the blocks round activations to 8 bits as a GGUF
file's do, where before they were bfloat16 (int4) or float32.

    python benchmarks/quantized_as_stored.py --model-dir /work/rs --workdir /work/rsq --json quantized-as-stored.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specmoe import LLM, SamplingParams
from specmoe.bench import paired
from specmoe.experts import formats
from specmoe.kernels.cpu import usable_cores
from specmoe.tools.quantize import quantize_checkpoint

PROMPTS = Path(__file__).resolve().parent / "prompts" / "heldout.jsonl"
SCHEMES = {"w4a16": 128, "w8a16": 2048}  # scheme -> group size (2048: the real-size model's rows, one scale each)


def checkpoint(model_dir: Path, workdir: Path, scheme: str) -> Path:
    out = workdir / f"{scheme}-g{SCHEMES[scheme]}"
    if not (out / "config.json").is_file():
        quantize_checkpoint(model_dir, out, scheme, group_size=SCHEMES[scheme])
    return out


def engine(path: Path, batch: int, threads: int, before: bool) -> LLM:
    """A resident engine on `path`; `before`: its experts kept off the block kernels."""
    keep = formats.refusal
    if before:
        formats.refusal = lambda quant: "the code before the block re-encoding"
    try:
        return LLM(model=str(path), policy="resident", max_batch_size=batch, max_model_len=256, threads=threads)
    finally:
        formats.refusal = keep


def measure(path: Path, batch: int, threads: int, rounds: int, max_tokens: int) -> dict:
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()][:batch]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engines = {"blocks": engine(path, batch, threads, False), "before": engine(path, batch, threads, True)}
    runs: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    try:
        for rnd in range(rounds + 1):  # round 0 warms both up
            for name in (list(engines) if rnd % 2 == 0 else list(engines)[::-1]):
                llm = engines[name]
                llm.engine.use_threads()
                out = llm.generate(texts, params)
                if rnd:
                    runs[name].append(llm.last_stats["decode_tokens_per_s"])
                    tokens[name] = [o.token_ids for o in out]
        # the format each resident policy holds and computes with (the run statistics' fused_kernels
        # ask the runtime again, which builds the format afresh: the block path for both)
        kernels = {name: dict(llm.engine.policy.format.kernels) for name, llm in engines.items()}
    finally:
        for llm in engines.values():
            llm.close()
    return {"batch_size": batch, "threads": threads, "blocks_tok_s": runs["blocks"], "before_tok_s": runs["before"],
            **paired.compare(runs["blocks"], runs["before"], tokens["blocks"], tokens["before"]),
            "kernels": kernels, "rounds": rounds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, type=Path, help="the real-size model (benchmarks/real_size_model.py)")
    p.add_argument("--workdir", required=True, type=Path, help="where the quantized checkpoints are written (and kept)")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--threads", type=int, default=usable_cores())
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, help="write the records here")
    args = p.parse_args(argv)
    records = []
    for scheme in args.schemes.split(","):
        path = checkpoint(args.model_dir, args.workdir, scheme)
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            started = time.time()
            rec = {"scheme": scheme, "group": SCHEMES[scheme], "checkpoint_bytes": sum(
                f.stat().st_size for f in path.iterdir()), **measure(path, batch, args.threads, args.rounds,
                                                                      args.max_tokens)}
            line = f"{scheme} B={batch}: " + paired.summary(rec, "blocks_tok_s", "before_tok_s", "blocks", "before")
            paired.keep(records, rec, started, args.json, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
