"""specmoe against llama.cpp on the same GGUF file, every weight in memory, as users compare
them: the real-size model written as a float32 GGUF (tools/gguf_export.py) and quantized by
llama.cpp's own quantizer (llama_model_quantize) to Q4_K_M, Q8_0 and BF16, and the bfloat16
checkpoint itself (specmoe on the directory, llama.cpp on its BF16 file; with the peak
resident set of a specmoe-only child process); greedy, held-out prompts, the same token ids
and thread count for both, llama.cpp as it loads by default (weights repacked for its CPU
kernels where it does so).

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
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# llama.cpp's file types (llama.h's llama_ftype) its quantizer takes
FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q8_0": 7, "BF16": 32, "Q4_0": 2}


def quantized_file(model_dir: Path, workdir: Path, type_name: str, source: str = "f32", keep_source: bool = True) -> Path:
    """The model as `type_name`, written by llama.cpp's quantizer from its GGUF copy in
    `source` encoding (f32, or bf16: half the disk for a bfloat16 checkpoint, the same
    weights), both cached unless `keep_source` is False (a model of tens of GB)."""
    import llama_cpp

    from specmoe.base.checkpoint import Checkpoint
    from specmoe.tools.gguf_export import cached_gguf

    out = workdir / f"{model_dir.name}-{type_name}.gguf"
    if out.is_file():
        return out
    whole = cached_gguf(Checkpoint(model_dir), workdir, source)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[type_name]
    params.nthread = os.cpu_count() or 1
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(whole).encode(), str(tmp).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {whole} to {type_name}")
    tmp.rename(out)
    if not keep_source:
        whole.unlink()
    return out


# Not a llama.cpp file type: the model directory itself (bfloat16 safetensors, what a Hugging
# Face user has) for specmoe, against llama.cpp on its BF16 GGUF of the same weights.
CHECKPOINT = "BF16-checkpoint"


def files_for(type_name: str, model_dir: Path, workdir: Path) -> tuple[Path, Path]:
    """(what specmoe loads, what llama.cpp loads)."""
    if type_name == CHECKPOINT:
        return model_dir, quantized_file(model_dir, workdir, "BF16")
    path = quantized_file(model_dir, workdir, type_name)
    return path, path


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if path.is_dir() else path.stat().st_size


def peak_rss(path: Path, batch: int, threads: int, max_tokens: int, prompts_file: Path) -> int:
    """The peak resident set (VmHWM) of a child process that loads `path` with specmoe's
    resident policy and generates as the rounds do: specmoe's memory alone."""
    code = (
        "import json, sys\n"
        "from specmoe import LLM, SamplingParams\n"
        "from specmoe.base.memory import peak_rss_bytes\n"
        f"texts = [json.loads(l)['prompt'] for l in open({str(prompts_file)!r}) if l.strip()][:{batch}]\n"
        f"llm = LLM(model={str(path)!r}, device='cpu', threads={threads}, max_batch_size={batch}, max_model_len=256)\n"
        f"llm.generate(texts, SamplingParams(max_tokens={max_tokens}, temperature=0.0, ignore_eos=True))\n"
        "print(peak_rss_bytes())\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return int(out.split()[-1])


def prompts_ids(file: Path, tokenizer, n: int) -> list[list[int]]:
    texts = [json.loads(line)["prompt"] for line in file.read_text().splitlines() if line.strip()][:n]
    return [tokenizer.encode(t) for t in texts]


def measure(path: Path, theirs_path: Path, batch: int, threads: int, rounds: int, max_tokens: int,
            prompts_file: Path) -> dict:
    import gc

    import torch

    from specmoe.bench import paired
    from specmoe.bench.anchors import LlamaCppRunner
    from specmoe.bench.runners import PolicyRunner
    from specmoe.engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    options = dict(device="cpu", policy="resident", threads=threads, max_batch_size=batch, max_model_len=256)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ours = PolicyRunner("specmoe resident", str(path), options, [], params)
    prompts = prompts_ids(prompts_file, ours.llm.tokenizer, 2 * batch)
    ours.prompts = prompts
    theirs = LlamaCppRunner(str(theirs_path), prompts, batch, max_tokens, threads, theirs_path.parent)
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
    speeds = {name: [r["decode_tokens_per_s"] for r in rs] for name, rs in runs.items()}
    return {"file": path.name, "llama_cpp_file": theirs_path.name, "bytes": size_of(path), "batch_size": batch,
            "threads": threads, "specmoe_tok_s": speeds["specmoe"], "llama_cpp_tok_s": speeds["llama.cpp"],
            **paired.compare(speeds["specmoe"], speeds["llama.cpp"], runs["specmoe"][-1]["token_ids"],
                             runs["llama.cpp"][-1]["token_ids"]),
            "rounds": rounds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, type=Path, help="the real-size model (benchmarks/real_size_model.py)")
    p.add_argument("--workdir", required=True, type=Path, help="where the GGUF files are written (and kept)")
    p.add_argument("--types", default=f"Q4_K_M,Q8_0,BF16,{CHECKPOINT}",
                   help=f"llama.cpp file types; {CHECKPOINT}: the model directory against llama.cpp's BF16 file")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--threads", default=f"{os.cpu_count() or 1},1", help="thread counts (default: the cores, then 1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts-file", type=Path, default=ROOT / "benchmarks" / "prompts" / "heldout.jsonl")
    p.add_argument("--json", type=Path, help="write the records here")
    args = p.parse_args(argv)
    from specmoe.bench import paired

    args.workdir.mkdir(parents=True, exist_ok=True)
    records = []
    for type_name in args.types.split(","):
        path, theirs = files_for(type_name, args.model_dir, args.workdir)
        for threads in (int(t) for t in args.threads.split(",")):
            for batch in (int(b) for b in args.batch_sizes.split(",")):
                started = time.time()
                rec = {"type": type_name, **measure(path, theirs, batch, threads, args.rounds, args.max_tokens,
                                                    args.prompts_file)}
                if type_name == CHECKPOINT:  # the memory bound: 1.1x the checkpoint + 400 MiB
                    rec["specmoe_peak_rss_bytes"] = peak_rss(path, batch, threads, args.max_tokens, args.prompts_file)
                line = f"{type_name} B={batch} threads={threads}: " + paired.summary(
                    rec, "specmoe_tok_s", "llama_cpp_tok_s", "specmoe", "llama.cpp")
                paired.keep(records, rec, started, args.json, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
