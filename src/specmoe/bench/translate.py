"""BENCHMARKS.md's translation section, made from one `benchmarks/translate_bench.py`
document: throughput against ondemand and caching per tier and batch size, tokens per
step, bytes moved per token, the draft-expert ablation, and the paper's NLLB-MoE figures
beside ours. Every figure of ours is read from the document."""

from __future__ import annotations

from .machine import threads_label
from .report import md_table

# The paper's NLLB-MoE measurements (H100, PCIe 5, B = 256, γ = 10, N = 4): data, for comparison.
PAPER = {"tokens_per_step": 7.265, "speedup_vs_ondemand": 4.30, "bytes_per_token_change": -0.7673,
         "ablation_tok_s": {2: 116.4, 4: 123.0, 8: 121.3, 16: 117.2}}


def _ratio(a: dict, b: dict) -> float:
    return a["decode_tokens_per_s"] / b["decode_tokens_per_s"]


def _cut(a: dict, b: dict) -> float:
    return a["transfer_bytes_per_token"] / b["transfer_bytes_per_token"] - 1


def tier_table(runs: dict[str, dict]) -> str:
    """One tier: per batch size each policy's tokens/s, SpecMoE's ratios and bytes per token."""
    rows = []
    for batch, at in sorted(runs.items(), key=lambda kv: int(kv[0])):
        on, ca, sp, q = at["ondemand"], at["caching"], at["specmoe"], at["specmoe-int8"]
        rows.append([batch, f"{on['decode_tokens_per_s']:.1f}", f"{ca['decode_tokens_per_s']:.1f}",
                     f"{sp['decode_tokens_per_s']:.1f}", f"{_ratio(sp, on):.2f}x", f"{_ratio(sp, ca):.2f}x",
                     f"{sp['tokens_per_step']:.2f}", f"{_cut(sp, on):+.1%}",
                     f"{q['decode_tokens_per_s']:.1f} ({_ratio(q, on):.2f}x, {q['tokens_per_step']:.2f})"])
    return md_table(["B", "ondemand tok/s", "caching tok/s", "specmoe tok/s", "× ondemand", "× caching",
                     "tokens/step", "bytes/token vs ondemand", "int8 draft tok/s (× ondemand, tokens/step)"],
                    rows) + "\n"


def ablation_table(ablation: dict) -> str:
    runs = ablation["runs"]
    on = runs["ondemand"]
    ns = sorted((int(k.split("=")[1]) for k in runs if k.startswith("N=")))
    best = max(runs[f"N={n}"]["decode_tokens_per_s"] for n in ns)
    rows = [[str(n), f"{runs[f'N={n}']['decode_tokens_per_s']:.1f}", f"{_ratio(runs[f'N={n}'], on):.2f}x",
             f"{runs[f'N={n}']['tokens_per_step']:.2f}", f"{runs[f'N={n}']['decode_tokens_per_s'] / best:.3f}",
             f"{PAPER['ablation_tok_s'][n] / max(PAPER['ablation_tok_s'].values()):.3f}"
             if n in PAPER["ablation_tok_s"] else "–"] for n in ns]
    return md_table(["N", "tok/s", "× ondemand", "tokens/step", "tok/s / best N", "paper: tok/s / best N"],
                    rows) + "\n"


def paper_table(doc: dict) -> str:
    """The paper's headline NLLB-MoE figures beside ours at our largest batch on the capped tier."""
    tier = doc["tiers"].get("capped") or next(iter(doc["tiers"].values()))
    batch = max(tier, key=int)
    sp, on = tier[batch]["specmoe"], tier[batch]["ondemand"]
    rows = [
        ["tokens per step, γ = 10, N = 4", f"{PAPER['tokens_per_step']:.3f}", f"{sp['tokens_per_step']:.3f}"],
        ["throughput × ondemand", f"{PAPER['speedup_vs_ondemand']:.2f}x (B = 256)", f"{_ratio(sp, on):.2f}x (B = {batch})"],
        ["bytes moved per token vs ondemand", f"{PAPER['bytes_per_token_change']:+.2%}", f"{_cut(sp, on):+.2%}"],
    ]
    return md_table(["", "paper (NLLB-MoE 54B, H100)", "specmoe-demo-translate (capped tier)"], rows) + "\n"


def translate(doc: dict) -> str:
    out = []
    # a document without "threads" ran before the script defaulted to the machine's cores: on one
    threads = threads_label(doc.get("threads", 1))
    for tier, runs in doc["tiers"].items():
        label = {"disk": "real disk tier", "capped": f"disk tier capped to a {doc['sweep_s']:g} s sweep"}.get(tier, tier)
        out += [f"{label.capitalize()} (γ = {doc['gamma']}, the paper's draft, N = 4; "
                f"{doc['max_tokens']} tokens; {threads}):", "", tier_table(runs)]
    ab = doc["ablation"]
    out += [f"Draft experts per decoder block (paper's draft, γ = {doc['gamma']}, capped tier, "
            f"B = {ab['batch_size']}):", "", ablation_table(ab), "The paper's figures beside ours:", "",
            paper_table(doc)]
    return "\n".join(out)
