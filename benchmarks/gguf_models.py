"""The bundled demo model as GGUF files, Q8_0 and Q4_K, against its bf16 safetensors: each
model's held-out perplexity, and ondemand, caching and specmoe on the real disk tier at
B = 1 and 16 (decode tokens/s, expert bytes moved per token, tokens/s as a multiple of
ondemand on the bf16 model at the same B). The GGUF experts stay in the file's encoding in
the tier, in every transfer and in the pool, and are multiplied as stored (--dtype auto,
the default, on a CPU with the block kernels).

    nice -n 10 python benchmarks/gguf_models.py --json gguf.json
    python benchmarks/gguf_models.py --batch-sizes 1 --max-tokens 4 --repeats 1 --ppl-prompts 8 --json g.json

The files are written by specmoe.tools.gguf_convert, laid out as llama.cpp's converter
lays them out. The demo's experts are 128 wide, not whole Q4_K blocks (256) along their
down projection, so the Q4_K file keeps those in Q5_0, as llama.cpp falls back. Same
device memory for every model, measured as benchmarks/quantized_models.py measures (its
perplexity and speed functions): non-expert + KV + 30 % of the bf16 expert bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from quantized_models import measure_and_write, perplexity, speed_arguments

ROOT = Path(__file__).resolve().parent
TYPES = ("Q8_0", "Q4_K")
POLICIES = ("ondemand", "caching", "specmoe")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default=",".join(TYPES), help="GGUF types of the demo model to measure")
    speed_arguments(p, POLICIES)
    p.add_argument("--workdir", help="where the GGUF files and the expert files go (default: a temporary dir)")
    p.add_argument("--json", metavar="FILE", help="write the document BENCHMARKS.md's section is rendered from")
    args = p.parse_args(argv)
    args.types, args.policies = args.types.split(","), args.policies.split(",")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    from specmoe.base.gguf_checkpoint import open_checkpoint
    from specmoe.base.paths import default_model_dir
    from specmoe.tools.gguf_convert import convert

    work = Path(args.workdir or tempfile.mkdtemp(prefix="specmoe-gguf-"))
    work.mkdir(parents=True, exist_ok=True)
    texts = [json.loads(line)["prompt"] for line in (ROOT / "prompts" / "heldout.jsonl").read_text().splitlines()
             if line.strip()]
    models = {"bf16": default_model_dir()}
    for type_name in args.types:
        path = work / f"demo-{type_name}.gguf"
        if not path.is_file():
            convert(models["bf16"], path, type_name)
        models[type_name] = path
    summary = {}
    for name, path in models.items():
        ppl, tokens = perplexity(path, texts[: args.ppl_prompts or None])
        c = open_checkpoint(path).config
        quant = c.expert_quant
        summary[name] = {"path": str(path), "perplexity": ppl, "perplexity_tokens": tokens,
                         "expert_format": quant.describe() if quant else "bf16",
                         "expert_bytes": quant.nbytes if quant else c.expert_params * 2, "quantize": None,
                         "file_bytes": path.stat().st_size if path.is_file() else None}
        print(f"# {name}: held-out perplexity {ppl:.3f} over {tokens} tokens; {summary[name]['expert_format']}",
              flush=True)
    return measure_and_write("gguf_models.py", "gguf-models", models, summary, args, argv, texts, work)


if __name__ == "__main__":
    sys.exit(main())
