"""Quantized experts end to end on the bundled demo model: `specmoe quantize` to w8a16 and
w4a16 (its peak memory measured), each model's held-out perplexity, and ondemand, caching
and specmoe on the real disk tier at B = 1 and 16: decode tokens/s, expert bytes moved per
token, and tokens/s as a multiple of ondemand on the bf16 model at the same B.

    nice -n 10 python benchmarks/quantized_models.py --json quantized.json
    python benchmarks/quantized_models.py --batch-sizes 1 --max-tokens 4 --repeats 1 --ppl-prompts 8 --json q.json

Every model runs with the same device memory: non-expert bytes + the KV cache reserved for
the run + 30 % of the bf16 model's expert bytes, so a quantized model's pool holds as many
more experts as its experts are smaller. Runs compute as the default does (--dtype auto):
on a CPU with the block kernels, the bf16 model's experts in bfloat16 as stored and the
quantized ones as Q8_0 / Q4_0 blocks in their slots; every expert moves as stored (the
bf16 one as bf16, the quantized ones as their blobs). Perplexity is computed
in float32 with every expert resident. Runs of one batch size are interleaved round by
round after a warm-up (bench/grid.py); a record is the median timed round.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SCHEMES = ("w8a16", "w4a16")
POLICIES = ("ondemand", "caching", "specmoe")


def quantize(model_dir: Path, out: Path, scheme: str) -> dict:
    """`specmoe quantize` in its own process, so that its peak memory is its own."""
    if (out / "config.json").is_file():
        return json.loads((out / "quantize.json").read_text())
    done = subprocess.run([sys.executable, "-m", "specmoe.cli", "quantize", str(model_dir), str(out), "--scheme", scheme,
                           "--json"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"specmoe quantize failed: {done.stderr.strip()}")
    summary = json.loads(done.stdout)
    (out / "quantize.json").write_text(json.dumps(summary))
    return summary


def perplexity(model_dir, texts: list[str]) -> tuple[float, int]:
    """exp(mean negative log-likelihood) of every held-out token after the first of its
    paragraph, every expert resident, float32."""
    from specmoe import LLM, SamplingParams

    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", max_batch_size=32, max_model_len=512)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    nll, count = 0.0, 0
    for out in llm.generate(texts, params):
        for position in out.prompt_logprobs[1:]:
            nll -= position.logprob
            count += 1
    llm.close()
    return math.exp(nll / count), count


def speed_records(models: dict[str, Path], args, texts: list[str], offload_dir: Path) -> list[dict]:
    from specmoe.base.checkpoint import Checkpoint
    from specmoe.bench.grid import Builder, encode_prompts, max_model_len_for, measure, prompts_for_batch, summarize
    from specmoe.bench.runners import PolicyRunner
    from specmoe.engine.sampling import SamplingParams
    from specmoe.tools.info import model_info

    base = models["bf16"]
    config = Checkpoint(base).config
    encoded = encode_prompts(texts, base, config.vocab_size)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    records = []
    for batch in args.batch_sizes:
        prompts = prompts_for_batch(encoded, batch, args.batches)
        max_len = max_model_len_for(prompts, args.max_tokens, args.gamma, config.max_position_embeddings)
        info = model_info(str(base), dtype=args.dtype, device="cpu")
        budget = int(info["non_expert_bytes"] + info["kv_bytes_per_token"] * batch * max_len
                     + args.expert_fraction * info["expert_bytes_total"])
        options = dict(device="cpu", dtype=args.dtype, offload="disk", offload_dir=str(offload_dir),
                       device_memory=budget, max_batch_size=batch, max_model_len=max_len, gamma=args.gamma)
        builders = [Builder(f"{name}/{policy}", "policy",
                            lambda path=path, policy=policy, name=name: PolicyRunner(
                                f"{name}/{policy}", str(path), {**options, "policy": policy}, prompts, params,
                                {"model": name, "batch_size": batch, "budget": budget}),
                            {"model": name, "policy": policy, "batch_size": batch})
                    for name, path in models.items() for policy in args.policies]
        measured = measure(builders, args.repeats, on_run=lambda m, rnd, s: print(
            f"B={batch} {m.label:16s} round {rnd}: {s['decode_tokens_per_s']:.1f} tok/s, "
            f"{s['transfer_bytes_per_token'] / 1e6:.3f} MB/token", flush=True))
        records += [summarize(m) for m in measured]
    for r in records:
        base_run = next((b for b in records if b["model"] == "bf16" and b["policy"] == "ondemand"
                         and b["batch_size"] == r["batch_size"] and not b.get("skipped")), None)
        if base_run and not r.get("skipped"):
            r["vs_ondemand_bf16"] = r["decode_tokens_per_s"] / base_run["decode_tokens_per_s"]
    return records


def speed_arguments(p: argparse.ArgumentParser, policies) -> None:
    """The flags this script and gguf_models.py share: what is run and how often."""
    p.add_argument("--policies", default=",".join(policies))
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--batches", type=int, default=2, help="prompts per run: this many batches of B")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--expert-fraction", type=float, default=0.3, help="share of the bf16 expert bytes in the budget")
    p.add_argument("--ppl-prompts", type=int, default=0, help="held-out paragraphs for perplexity (default: all)")


def measure_and_write(script, kind, models, summary, args, argv, texts, work) -> int:
    """Every model's speed records (printed as they come), then the section's document:
    the end of this script and of gguf_models.py."""
    records = speed_records(models, args, texts, work / "offload")
    for r in records:
        if not r.get("skipped"):
            print(f"B={r['batch_size']} {r['model']:6s} {r['policy']:9s} {r['decode_tokens_per_s']:7.1f} tok/s  "
                  f"{r['transfer_bytes_per_token'] / 1e6:.3f} MB/token  x{r.get('vs_ondemand_bf16', 0):.2f} "
                  f"ondemand-bf16")
    if args.json:
        command = "python benchmarks/" + script + " " + " ".join(argv if argv is not None else sys.argv[1:])
        config = {k: v for k, v in vars(args).items() if k != "json"}
        doc = {"kind": kind, "command": command.strip(), "config": config, "models": summary,
               "records": records}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", default=",".join(SCHEMES), help="quantized variants of the demo model to measure")
    speed_arguments(p, POLICIES)
    p.add_argument("--workdir", help="where the quantized models and the expert files go (default: a temporary dir)")
    p.add_argument("--json", metavar="FILE", help="write the document BENCHMARKS.md's section is rendered from")
    args = p.parse_args(argv)
    args.schemes, args.policies = args.schemes.split(","), args.policies.split(",")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    from specmoe.base.checkpoint import Checkpoint
    from specmoe.base.paths import default_model_dir

    work = Path(args.workdir or tempfile.mkdtemp(prefix="specmoe-quantized-"))
    texts = [json.loads(line)["prompt"] for line in (ROOT / "prompts" / "heldout.jsonl").read_text().splitlines()
             if line.strip()]
    models, quantized = {"bf16": default_model_dir()}, {}
    for scheme in args.schemes:
        quantized[scheme] = quantize(models["bf16"], work / scheme, scheme)
        models[scheme] = work / scheme
        print(f"# quantize {scheme}: {quantized[scheme]['peak_rss_growth_bytes'] / 2**20:.2f} MiB peak over the start, "
              f"largest tensor {quantized[scheme]['largest_tensor_bytes'] / 2**20:.2f} MiB", flush=True)
    summary = {}
    for name, path in models.items():
        ppl, tokens = perplexity(path, texts[: args.ppl_prompts or None])
        quant = Checkpoint(path).config.expert_quant
        summary[name] = {"path": str(path), "perplexity": ppl, "perplexity_tokens": tokens,
                         "expert_format": quant.describe() if quant else "bf16",
                         "expert_bytes": quant.nbytes if quant else Checkpoint(path).config.expert_params * 2,
                         "quantize": quantized.get(name)}
        print(f"# {name}: held-out perplexity {ppl:.3f} over {tokens} tokens; {summary[name]['expert_format']}",
              flush=True)
    return measure_and_write("quantized_models.py", "quantized-models", models, summary, args, argv, texts, work)


if __name__ == "__main__":
    sys.exit(main())
