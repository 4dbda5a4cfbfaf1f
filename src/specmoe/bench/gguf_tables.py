"""BENCHMARKS.md's GGUF section from benchmarks/gguf_models.py's document: what one expert
is in each file, the file's size and held-out perplexity; then each policy's speed and
expert bytes per token on the disk tier, against ondemand on the bf16 safetensors model."""

from __future__ import annotations

from .report import md_table
from .tables import models_speeds


def gguf_models(doc: dict) -> str:
    models = doc["models"]
    rows = [[name, m["expert_format"], f"{m['expert_bytes'] / 2**10:.1f} KiB",
             "–" if not m.get("file_bytes") else f"{m['file_bytes'] / 2**20:.1f} MiB", f"{m['perplexity']:.3f}"]
            for name, m in models.items()]
    tokens = next(iter(models.values()))["perplexity_tokens"]
    out = [md_table(["model", "experts", "one expert (as moved)", "file", f"held-out perplexity ({tokens} tokens)"],
                    rows), ""]
    return "\n".join(out + [models_speeds(doc)])
