#!/usr/bin/env python3
"""Measure the bundled demo model and write its MODEL_CARD.md.

Computes, with transformers, on held-out text (documents never trained on):

* held-out perplexity of the model, and of a unigram model of the same tokens
  (unigram estimated on the training tokens, add-one smoothing);
* parameter counts (total, per expert, active per token);
* routing statistics per MoE block (top-2 router picks): expert load max/min share,
  hotness skew (share of the top 25 % experts, Gini), and temporal locality
  (probability that a token's experts include one of the previous token's experts,
  vs the value expected if consecutive tokens picked independently).

Usage (from the repository root, after scripts/train_demo.py has finished):

    .venv/bin/python scripts/model_card.py
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
SEQ = 256


def load_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def gini(x: np.ndarray) -> float:
    x = np.sort(np.asarray(x, dtype=np.float64))
    n = len(x)
    if x.sum() == 0:
        return 0.0
    i = np.arange(1, n + 1)
    return float(2 * (i * x).sum() / (n * x.sum()) - (n + 1) / n)


def routing_stats(picks: np.ndarray, num_experts: int) -> dict:
    """picks: [windows, seq, k] expert ids of one block."""
    W, T, k = picks.shape
    flat = picks.reshape(-1)
    share = np.bincount(flat, minlength=num_experts) / len(flat)
    top = np.sort(share)[::-1][: max(1, num_experts // 4)].sum()
    # temporal locality: overlap between the expert sets of consecutive tokens
    prev, cur = picks[:, :-1, :], picks[:, 1:, :]
    overlap = (prev[..., :, None] == cur[..., None, :]).any(-1).any(-1)
    p_obs = float(overlap.mean())
    # expected under independence: draw both sets from the empirical set distribution
    sets = [tuple(sorted(s)) for s in picks.reshape(-1, k).tolist()]
    combos = {c: i for i, c in enumerate(itertools.combinations(range(num_experts), k))}
    q = np.bincount([combos[s] for s in sets], minlength=len(combos)) / len(sets)
    keys = list(combos)
    m = np.array([[bool(set(a) & set(b)) for b in keys] for a in keys], dtype=np.float64)
    p_ind = float(q @ m @ q)
    return {
        "max_share": float(share.max()),
        "min_share": float(share.min()),
        "dead": int((share == 0).sum()),
        "top25_share": float(top),
        "gini": gini(share),
        "p_overlap": p_obs,
        "p_overlap_indep": p_ind,
        "shares": share.tolist(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="src/specmoe/data/demo")
    ap.add_argument("--workdir", default=".cache/demo-train")
    ap.add_argument("--windows", type=int, default=0, help="limit held-out windows (0 = all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    ap.add_argument("--train-args", default="--steps 1600 --minutes 85",
                    help="the train_demo.py arguments to show in the reproduce section")
    ap.add_argument("--note", default="", help="extra sentence(s) for the training section")
    args = ap.parse_args()
    os.chdir(REPO)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, work = Path(args.model), Path(args.workdir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    E, k, L = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers

    # ---- parameters
    total = sum(p.numel() for p in model.parameters())
    per_expert = 3 * cfg.hidden_size * cfg.intermediate_size
    active = total - L * (E - k) * per_expert
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)

    # ---- held-out text
    train = np.load(work / "train.u16.npy")
    held = np.load(work / "heldout.u16.npy")
    nwin = len(held) // SEQ
    if args.windows:
        nwin = min(nwin, args.windows)
    wins = torch.from_numpy(held[: nwin * SEQ].astype(np.int64).reshape(nwin, SEQ))

    counts = np.bincount(train, minlength=cfg.vocab_size).astype(np.float64)
    uni_logp = np.log((counts + 1) / (counts.sum() + cfg.vocab_size))
    targets = wins[:, 1:].numpy()
    uni_nll = float(-uni_logp[targets].mean())

    nll_sum, n_tok = 0.0, 0
    picks = [[] for _ in range(L)]
    t0 = time.time()
    with torch.no_grad():
        for i in range(0, nwin, 8):
            x = wins[i : i + 8]
            o = model(input_ids=x, output_router_logits=True)
            lp = torch.log_softmax(o.logits[:, :-1].float(), -1)
            nll = -lp.gather(-1, x[:, 1:, None]).squeeze(-1)
            nll_sum += float(nll.sum())
            n_tok += nll.numel()
            for li, lg in enumerate(o.router_logits):
                picks[li].append(torch.topk(lg.float(), k, -1).indices.reshape(x.shape[0], SEQ, k).numpy())
    nll = nll_sum / n_tok
    ppl, uni_ppl = math.exp(nll), math.exp(uni_nll)
    stats = [routing_stats(np.concatenate(p), E) for p in picks]
    print(f"held-out: {n_tok:,} predicted tokens in {nwin} windows of {SEQ} ({time.time() - t0:.0f} s)")
    print(f"model loss {nll:.4f} ppl {ppl:.2f}; unigram loss {uni_nll:.4f} ppl {uni_ppl:.2f}; "
          f"ratio {uni_ppl / ppl:.1f}x")

    # ---- training record
    loss_rows = load_csv(work / "loss_log.csv")
    eval_rows = load_csv(work / "eval_log.csv")
    last = loss_rows[-1] if loss_rows else {}
    done = json.loads((work / "DONE").read_text()) if (work / "DONE").exists() else {}
    steps = int(last.get("step", 0))
    tokens_seen = int(last.get("tokens_seen", 0))
    train_min = float(done.get("elapsed_s", last.get("elapsed_s", 0))) / 60
    train_tokens = len(train)

    # ---- greedy sample
    prompt = "The built-in function len returns"
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        g = model.generate(ids, max_new_tokens=48, do_sample=False)
    sample = tok.decode(g[0])

    safet = model_dir / "model.safetensors"
    size_mb = safet.stat().st_size / 1e6 if safet.exists() else float("nan")
    rows = "\n".join(
        f"| {i} | {s['max_share']:.3f} | {s['min_share']:.3f} | {s['dead']} | {s['top25_share']:.3f} | "
        f"{s['gini']:.3f} | {s['p_overlap']:.3f} | {s['p_overlap_indep']:.3f} | "
        f"{s['p_overlap'] / s['p_overlap_indep']:.2f} |"
        for i, s in enumerate(stats)
    )
    mean = lambda key: sum(s[key] for s in stats) / len(stats)
    evals = "\n".join(
        f"| {r['step']} | {int(r['tokens_seen']) / 1e6:.2f} M | {float(r['heldout_loss']):.3f} | "
        f"{float(r['heldout_ppl']):.1f} | {float(r['elapsed_s']) / 60:.1f} |"
        for r in eval_rows
    )
    card = f"""# specmoe demo model

A tiny Mixtral-family mixture-of-experts language model, bundled so that the engine,
its tests and benchmarks run with no download. It writes plausible-looking Python
documentation in reStructuredText; it is a test article, not a useful assistant.

## Data and license

- Corpus: the reStructuredText sources of the Python 3.11 documentation
  (`usr/share/doc/python3.11/html/_sources/**/*.rst.txt`) from Debian's
  `python3.11-doc` package (bookworm), {len(json.loads((work / 'split.json').read_text())['train'])} training documents, {train_tokens:,} training tokens.
- License of the corpus (and so of this derived model): the Python Software Foundation
  License (PSF License Version 2), under which the Python documentation is distributed;
  see `/usr/share/doc/python3.11-doc/copyright` in the Debian package.
- Held out: 2 % of the documents, chosen by a stable hash of their path
  (`sha256(relpath)[:8] % 10000 < 200`), never trained on — {len(held):,} tokens.
  `benchmarks/prompts/heldout.jsonl` holds paragraph starts from these documents;
  `benchmarks/prompts/train.jsonl` holds paragraph starts from training documents.
- Tokenizer: byte-level BPE (`tokenizers`), vocabulary {cfg.vocab_size}, trained on the
  training documents only; `<s>` = {cfg.bos_token_id}, `</s>` = {cfg.eos_token_id}, `<pad>` = {cfg.pad_token_id}.

## Shape

| | |
|---|---|
| architecture | `MixtralForCausalLM` (transformers), bf16 safetensors, per-expert layout |
| layers / hidden / heads (kv) / head dim | {L} / {cfg.hidden_size} / {cfg.num_attention_heads} ({cfg.num_key_value_heads}) / {cfg.head_dim} |
| experts per block / active per token | {E} / {k} (SwiGLU, intermediate size {cfg.intermediate_size}) |
| vocabulary / max positions | {cfg.vocab_size} / {cfg.max_position_embeddings} |
| parameters, total | {total:,} |
| parameters, one expert | {per_expert:,} ({L * E} experts: {L * E * per_expert:,}) |
| parameters, active per token | {active:,} (of which embeddings + LM head {embed:,}) |
| `model.safetensors` | {size_mb:.1f} MB |

## Training

CPU only (2 shared cores, fp32, AdamW lr 1e-3, betas 0.9/0.95, weight decay 0.1,
200 warm-up steps then cosine to 10 %, gradient clip 1.0, batches of 16 × {SEQ}
tokens drawn at random from the packed training stream; load-balancing loss 0.05 ×
the mean over blocks of the per-block Switch/Mixtral balance loss).

- steps: {steps:,}; tokens seen: {tokens_seen:,} ({tokens_seen / max(1, train_tokens):.2f} epochs)
- training wall time: {train_min:.1f} minutes

{args.note}

| step | tokens seen | held-out loss | held-out ppl | minutes |
|---|---|---|---|---|
{evals}

## Held-out quality

Measured by `scripts/model_card.py` on {'all ' if nwin == len(held) // SEQ else ''}{nwin} non-overlapping {SEQ}-token windows of
the held-out stream ({n_tok:,} predicted tokens), fp32:

| model | loss (nats/token) | perplexity |
|---|---|---|
| this model | {nll:.3f} | {ppl:.1f} |
| unigram (training-token counts, add-one) | {uni_nll:.3f} | {uni_ppl:.1f} |

Unigram perplexity / model perplexity = {uni_ppl / ppl:.1f}.

Greedy continuation of `{prompt!r}`:

```
{sample}
```

## Routing on held-out text (top-{k} picks)

Shares are of all top-{k} picks in the block (uniform = {1 / E:.4f}). "Top 25 %" is the
share of the {max(1, E // 4)} busiest experts (uniform = 0.25). "Overlap" is the probability
that a token's {k} experts include one of the previous token's; "indep." is the same
probability if consecutive tokens drew their expert pairs independently from the
block's observed pair distribution.

| block | max share | min share | dead | top 25 % | Gini | overlap | indep. | ratio |
|---|---|---|---|---|---|---|---|---|
{rows}

Mean over blocks: max share {mean('max_share'):.3f}, min share {mean('min_share'):.3f},
top 25 % {mean('top25_share'):.3f}, Gini {mean('gini'):.3f}, overlap {mean('p_overlap'):.3f}
vs {mean('p_overlap_indep'):.3f} independent.

## Reproduce

From the repository root, with the project's virtual environment (torch CPU, transformers 5):

```
.venv/bin/python scripts/train_demo.py {args.train_args}   # downloads python3.11-doc with apt-get
.venv/bin/python scripts/model_card.py
```

`train_demo.py` works in `.cache/demo-train` (corpus, split, tokenizer, token streams,
checkpoints, `loss_log.csv`, `eval_log.csv`, `expert_load.csv`), resumes from its last
checkpoint when restarted, stops after `--steps` or `--minutes` of training (counted
across restarts), and exports to `src/specmoe/data/demo`. It also (re)writes
`benchmarks/prompts/{{heldout,train}}.jsonl`. Training is seeded, but a wall-clock limit,
the choice of 1 or 2 threads by measurement and CPU floating-point order make a rerun
close to, not bit-identical with, this model.
"""
    (model_dir / "MODEL_CARD.md").write_text(card)
    print(f"wrote {model_dir / 'MODEL_CARD.md'}")
    for i, s in enumerate(stats):
        print(f"block {i}: max {s['max_share']:.3f} min {s['min_share']:.3f} dead {s['dead']} "
              f"top25 {s['top25_share']:.3f} gini {s['gini']:.3f} overlap {s['p_overlap']:.3f} "
              f"indep {s['p_overlap_indep']:.3f}")
    print("sample:", repr(sample))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "heldout_loss": nll, "heldout_ppl": ppl, "unigram_loss": uni_nll, "unigram_ppl": uni_ppl,
            "params_total": total, "params_per_expert": per_expert, "params_active": active,
            "routing": stats, "steps": steps, "tokens_seen": tokens_seen, "train_minutes": train_min,
        }, indent=1))


if __name__ == "__main__":
    main()
