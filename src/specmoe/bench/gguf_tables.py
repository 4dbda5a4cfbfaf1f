"""BENCHMARKS.md's GGUF section from benchmarks/gguf_models.py's document: what one expert
is in each file, the file's size and held-out perplexity; then each policy's speed and
expert bytes per token on the disk tier, against ondemand on the bf16 safetensors model."""

from __future__ import annotations

from .report import md_table


def gguf_models(doc: dict) -> str:
    c, models = doc["config"], doc["models"]
    rows = [[name, m["expert_format"], f"{m['expert_bytes'] / 2**10:.1f} KiB",
             "–" if not m.get("file_bytes") else f"{m['file_bytes'] / 2**20:.1f} MiB", f"{m['perplexity']:.3f}"]
            for name, m in models.items()]
    tokens = next(iter(models.values()))["perplexity_tokens"]
    out = [md_table(["model", "experts", "one expert (as moved)", "file", f"held-out perplexity ({tokens} tokens)"],
                    rows), ""]
    batches = sorted({r["batch_size"] for r in doc["records"]})
    rows = []
    for name in models:
        for policy in c["policies"]:
            cells = []
            for b in batches:
                r = next((r for r in doc["records"] if (r["model"], r["policy"], r["batch_size"]) == (name, policy, b)),
                         None)
                ratio = r.get("vs_ondemand_bf16") if r else None
                cells.append("–" if not r or r.get("skipped") else
                             f"{r['decode_tokens_per_s']:.1f} (×{'–' if ratio is None else f'{ratio:.2f}'}), "
                             f"{r['transfer_bytes_per_token'] / 1e6:.3f} MB")
            rows.append([name, policy, *cells])
    out += [f"Disk tier, {c['dtype']}, γ = {c['gamma']}, {c['max_tokens']} tokens per sequence, {c['batches']} x B "
            f"held-out prompts, median of {c['repeats']} interleaved rounds; every model in the same device memory "
            f"(non-expert + KV + {c['expert_fraction']:.0%} of the bf16 expert bytes). Each cell: decode tokens/s "
            "(× ondemand on the bf16 model at that B), expert bytes moved per generated token.", "",
            md_table(["model", "policy", *[f"B = {b}" for b in batches]], rows)]
    return "\n".join(out) + "\n"
