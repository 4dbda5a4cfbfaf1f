#!/usr/bin/env python3
"""Train the small bundled demo Mixtral-family model on the Python 3 docs (CPU).

Reproducible (seeded), resumable and wall-clock bounded.  Stages, each skipped when
its output already exists in ``--workdir``:

  a. corpus      apt-get download python3.11-doc; dpkg-deb -x; collect *.rst.txt sources
  b. split       hold out 2 % of documents by a stable hash of their relative path
  c. tokenizer   byte-level BPE (vocab 4096, <s> </s> <pad>) trained on training docs
  -  prompts     benchmarks/prompts/{heldout,train}.jsonl (deterministic; regenerated)
  d. tokenize    bos + tokens + eos per doc, packed into uint16 streams
  e. train       MixtralForCausalLM, AdamW, warm-up + cosine, checkpoints every ~5 min
  f. export      bf16 safetensors (per-expert HF layout) + tokenizer to ``--out``

Typical use (from the repository root):

    .venv/bin/python scripts/train_demo.py --steps 4000 --minutes 85
    .venv/bin/python scripts/train_demo.py --export-only   # export latest checkpoint
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SEED = 1234
VOCAB = 4096
SEQ = 256
HELDOUT_PER_10K = 200  # 2 %
SPECIALS = ["<s>", "</s>", "<pad>"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- a. corpus
def stage_corpus(work: Path, corpus_arg: str | None) -> Path:
    """Return the directory that holds the *.rst.txt doc sources."""
    if corpus_arg:
        root = Path(corpus_arg)
    else:
        root = work / "corpus"
        if not root.exists():
            debs = sorted(work.glob("python3.11-doc_*.deb"))
            if not debs:
                log("downloading python3.11-doc with apt-get download")
                r = subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=work)
                if r.returncode != 0:
                    subprocess.run(["apt-get", "update"], check=True)
                    subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=work, check=True)
                debs = sorted(work.glob("python3.11-doc_*.deb"))
            tmp = work / "corpus.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(tmp)], check=True)
            os.replace(tmp, root)
    hits = sorted(glob.glob(str(root / "**" / "_sources"), recursive=True))
    if not hits:
        raise SystemExit(f"no _sources directory under {root}")
    return Path(hits[0])


def list_docs(src: Path) -> list[str]:
    return sorted(str(p.relative_to(src)) for p in src.rglob("*.txt") if p.is_file())


# --------------------------------------------------------------------------- b. split
def is_heldout(rel: str) -> bool:
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return h % 10000 < HELDOUT_PER_10K


def stage_split(work: Path, src: Path) -> dict:
    f = work / "split.json"
    if f.exists():
        return json.loads(f.read_text())
    docs = list_docs(src)
    split = {
        "rule": "sha256(relpath)[:8] big-endian % 10000 < 200 -> heldout",
        "train": [d for d in docs if not is_heldout(d)],
        "heldout": [d for d in docs if is_heldout(d)],
    }
    f.write_text(json.dumps(split, indent=1))
    log(f"split: {len(split['train'])} train docs, {len(split['heldout'])} held-out docs")
    return split


def read_doc(src: Path, rel: str) -> str:
    return (src / rel).read_text(encoding="utf-8", errors="replace")


# --------------------------------------------------------------------------- c. tokenizer
def stage_tokenizer(work: Path, src: Path, split: dict) -> Path:
    tokdir = work / "tokenizer"
    if (tokdir / "tokenizer.json").exists():
        return tokdir
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    log("training byte-level BPE tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator((read_doc(src, d) for d in split["train"]), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    tmp = work / "tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_tokenizer_files(tok, tmp)
    os.replace(tmp, tokdir)
    return tokdir


def write_tokenizer_files(tok, d: Path) -> None:
    tok.save(str(d / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": 1024,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_tok(tokdir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokdir / "tokenizer.json"))


# --------------------------------------------------------------------------- prompts
def _is_markup(par: str) -> bool:
    """True for paragraphs that are not prose: directives, titles, tables, code."""
    s = par.strip()
    first = s.splitlines()[0].strip()
    if first.startswith(("..", ":", "+-", "|", ">>>", "$ ", "#", "=")):
        return True
    if set(first) <= set("=-~^*#+`'\"._:| "):
        return True
    if ">>>" in s or "\n   " in s.replace("\t", "    ") and "{" in s:
        return True
    if sum(s.count(c) for c in "(){}[]=;<>\\") > 0.06 * len(s):
        return True
    letters = sum(c.isalpha() for c in s)
    return letters < 0.7 * len(s) or len(s.split()) < 8


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, dedented; literal blocks (after ``::``) dropped."""
    out, cur, raw = [], [], []
    for line in text.splitlines() + [""]:
        if line.strip():
            cur.append(line.rstrip())
            continue
        if cur:
            raw.append(cur)
            cur = []
    literal_indent = None
    for lines in raw:
        indent = min(len(l) - len(l.lstrip()) for l in lines)
        if literal_indent is not None and indent > literal_indent:
            continue  # inside a literal (code) block
        literal_indent = None
        text_ = "\n".join(l[indent:] for l in lines)
        if text_.rstrip().endswith("::"):
            literal_indent = indent
            if text_.rstrip() == "::" or text_.lstrip().startswith(".."):
                continue
            text_ = text_.rstrip()[:-1]  # "Example::" reads as "Example:"
        out.append(text_)
    return out


def make_prompts(tok, src: Path, docs: list[str], limit: int) -> list[dict]:
    cands = []
    for rel in docs:
        for i, par in enumerate(paragraphs(read_doc(src, rel))):
            if _is_markup(par):
                continue
            ids = tok.encode(par).ids
            if len(ids) < 32:
                continue
            if len(ids) > 256:
                text = tok.decode(ids[:256])
                cut = text.rfind(" ")
                text = text[:cut] if cut > len(text) // 2 else text
                if len(tok.encode(text).ids) < 32:
                    continue
            else:
                text = par
            key = hashlib.sha256(f"{rel}#{i}".encode()).hexdigest()
            cands.append((key, {"prompt": text, "doc": rel, "paragraph": i}))
    cands.sort(key=lambda kv: kv[0])
    chosen = [c for _, c in cands[:limit]]
    chosen.sort(key=lambda c: (c["doc"], c["paragraph"]))
    return chosen


def stage_prompts(src: Path, split: dict, tokdir: Path, pdir: Path) -> None:
    tok = load_tok(tokdir)
    pdir.mkdir(parents=True, exist_ok=True)
    for name, docs in (("heldout", split["heldout"]), ("train", split["train"])):
        ps = make_prompts(tok, src, docs, 512)
        if len(ps) < 256:
            log(f"WARNING: only {len(ps)} {name} prompts")
        with open(pdir / f"{name}.jsonl", "w") as f:
            for p in ps:
                f.write(json.dumps(p, ensure_ascii=False) + "\n")
        log(f"wrote {len(ps)} prompts to {pdir / (name + '.jsonl')}")


# --------------------------------------------------------------------------- d. tokenize
def stage_tokenize(work: Path, src: Path, split: dict, tokdir: Path) -> tuple[np.ndarray, np.ndarray]:
    tok = load_tok(tokdir)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    out = {}
    for name in ("train", "heldout"):
        f = work / f"{name}.u16.npy"
        if not f.exists():
            parts = []
            for rel in split[name]:
                parts.append(np.array([bos] + tok.encode(read_doc(src, rel)).ids + [eos], dtype=np.uint16))
            arr = np.concatenate(parts)
            tmp = work / f"{name}.tmp.npy"
            np.save(tmp, arr)
            os.replace(tmp, f)
            log(f"{name}: {len(arr):,} tokens")
        out[name] = np.load(f)
    return out["train"], out["heldout"]


# --------------------------------------------------------------------------- e. model
def make_config(tokdir: Path):
    from transformers import MixtralConfig

    tok = load_tok(tokdir)
    return MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        num_local_experts=16,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.05,
        output_router_logits=True,
        router_jitter_noise=0.0,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
    )


def lr_at(step: int, total: int, peak: float, warmup: int = 200, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def expert_shares(router_logits, top_k: int = 2):
    """Per layer: share of top-k picks per expert (tensor [layers, experts])."""
    import torch

    rows = []
    for lg in router_logits:
        idx = torch.topk(lg, top_k, dim=-1).indices.reshape(-1)
        c = torch.bincount(idx, minlength=lg.shape[-1]).float()
        rows.append(c / c.sum())
    return torch.stack(rows)


def per_layer_aux(router_logits, num_experts: int, top_k: int):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return sum(load_balancing_loss_func((lg,), num_experts, top_k) for lg in router_logits) / len(router_logits)


def eval_windows(held: np.ndarray, n: int = 48) -> np.ndarray:
    step = (len(held) - SEQ - 1) // n
    return np.stack([held[i * step : i * step + SEQ].astype(np.int64) for i in range(n)])


def evaluate(model, wins: np.ndarray):
    import torch

    model.eval()
    tot, cnt, shares = 0.0, 0, []
    with torch.no_grad():
        for i in range(0, len(wins), 16):
            x = torch.from_numpy(wins[i : i + 16])
            o = model(input_ids=x, labels=x, output_router_logits=True)
            lm = (o.loss - model.config.router_aux_loss_coef * o.aux_loss).item()
            tot += lm * x.shape[0]
            cnt += x.shape[0]
            shares.append(expert_shares(o.router_logits))
    model.train()
    return tot / cnt, torch.stack(shares).mean(0)


def save_ckpt(work: Path, model, opt, gen, step: int, elapsed: float) -> None:
    import torch

    tmp = work / "ckpt.pt.tmp"
    torch.save(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "gen": gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "step": step,
            "elapsed": elapsed,
        },
        tmp,
    )
    os.replace(tmp, work / "ckpt.pt")


def trim_csv(path: Path, max_step: int) -> None:
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    keep = [lines[0]] + [l for l in lines[1:] if int(l.split(",")[0]) <= max_step]
    path.write_text("\n".join(keep) + "\n")


def stage_train(args, work: Path, tokdir: Path, train: np.ndarray, held: np.ndarray):
    import torch
    from transformers import MixtralForCausalLM

    threads = args.threads if args.threads > 0 else 1
    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    cfg = make_config(tokdir)
    model = MixtralForCausalLM(cfg)
    impl = getattr(model.config, "_experts_implementation", None)
    log(f"experts implementation: {impl}; attention: {model.config._attn_implementation}")
    if impl != "grouped_mm":
        log("WARNING: expected grouped_mm experts implementation")
    nparam = sum(p.numel() for p in model.parameters())
    log(f"parameters: {nparam:,} (bf16 ~{nparam * 2 / 1e6:.1f} MB)")
    assert nparam * 2 <= 40e6, "bf16 export would exceed 40 MB"

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=False,
    )
    gen = torch.Generator().manual_seed(SEED)
    step, elapsed0 = 0, 0.0
    ck = work / "ckpt.pt"
    loss_csv, load_csv, eval_csv = work / "loss_log.csv", work / "expert_load.csv", work / "eval_log.csv"
    if ck.exists():
        st = torch.load(ck, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        torch.set_rng_state(st["torch_rng"])
        step, elapsed0 = st["step"], st["elapsed"]
        for f in (loss_csv, load_csv, eval_csv):
            trim_csv(f, step)
        log(f"resumed from step {step} ({elapsed0 / 60:.1f} min elapsed)")
    for f, hdr in (
        (loss_csv, "step,tokens_seen,train_loss,aux_loss,lr,elapsed_s"),
        (load_csv, "step,layer,min_share,max_share,dead_experts"),
        (eval_csv, "step,tokens_seen,heldout_loss,heldout_ppl,elapsed_s"),
    ):
        if not f.exists():
            f.write_text(hdr + "\n")

    wins = eval_windows(held)
    train_t = torch.from_numpy(train.astype(np.int64))
    B = args.batch
    budget = args.minutes * 60
    t0 = time.time() - elapsed0
    last_ck = time.time()
    model.train()

    progress = None
    if sys.stdout.isatty():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        progress.start()
        task = progress.add_task("train", total=args.steps, completed=step, info="")

    acc_loss, acc_aux, acc_n, acc_tok, acc_t = 0.0, 0.0, 0, 0, time.time()
    stop = {"sig": None}

    def on_signal(signum, frame):  # checkpoint and leave at the end of the current step
        stop["sig"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # --threads 0: pick 1 or 2 threads by measurement, re-probed every 100 steps, because
    # two threads are 3-8x slower than one when other jobs share the two cores.
    times: dict[int, list[float]] = {1: [], 2: []}
    probe_left = 0
    while step < args.steps and time.time() - t0 < budget and stop["sig"] is None:
        if args.threads == 0:
            if probe_left == 0 and step % 100 == 0 and step > 0:
                threads, probe_left = 3 - threads, 4
                torch.set_num_threads(threads)
            elif probe_left == 1:
                other = 3 - threads
                med = lambda v: sorted(v)[len(v) // 2] if v else float("inf")
                new, old = med(times[threads][-4:]), med(times[other][-10:])
                if new >= old:
                    threads = other
                    torch.set_num_threads(threads)
                log(f"threads probe: {3 - other}: {new:.2f} s/step vs {other}: {old:.2f} -> using {threads}")
            probe_left = max(0, probe_left - 1)
        ts = time.time()
        lr = lr_at(step, args.steps, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train_t) - SEQ, (B,), generator=gen)
        x = torch.stack([train_t[s : s + SEQ] for s in starts.tolist()])
        o = model(input_ids=x, labels=x, output_router_logits=True)
        # transformers' aux loss concatenates all layers' router logits, so it balances
        # experts only in aggregate over layers (experts died per layer with it); use
        # the mean of the per-layer Switch/Mixtral load-balancing losses instead.
        aux_t = per_layer_aux(o.router_logits, cfg.num_local_experts, cfg.num_experts_per_tok)
        lm_t = o.loss - cfg.router_aux_loss_coef * o.aux_loss
        (lm_t + cfg.router_aux_loss_coef * aux_t).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        times[threads].append(time.time() - ts)
        aux = aux_t.item()
        acc_loss += lm_t.item()
        acc_aux += aux
        acc_n += 1
        acc_tok += B * SEQ
        elapsed = time.time() - t0
        if step % args.log_every == 0 or step == args.steps:
            tps = acc_tok / (time.time() - acc_t)
            tl = acc_loss / acc_n
            with open(loss_csv, "a") as f:
                f.write(f"{step},{step * B * SEQ},{tl:.4f},{acc_aux / acc_n:.4f},{lr:.6g},{elapsed:.1f}\n")
            info = f"loss {tl:.3f} aux {acc_aux / acc_n:.3f} lr {lr:.2e} {tps:,.0f} tok/s"
            if progress:
                progress.update(task, completed=step, info=info)
            else:
                log(f"step {step}/{args.steps} {info} elapsed {elapsed / 60:.1f} min")
            acc_loss, acc_aux, acc_n, acc_tok, acc_t = 0.0, 0.0, 0, 0, time.time()
        if step % (args.log_every * 5) == 0:
            with torch.no_grad():
                sh = expert_shares([lg.detach() for lg in o.router_logits])
            with open(load_csv, "a") as f:
                for li, row in enumerate(sh):
                    f.write(f"{step},{li},{row.min():.4f},{row.max():.4f},{int((row == 0).sum())}\n")
            log("expert share min/max per layer: "
                + " ".join(f"{r.min():.3f}/{r.max():.3f}" for r in sh))
        if step % args.eval_every == 0:
            hl, sh = evaluate(model, wins)
            with open(eval_csv, "a") as f:
                f.write(f"{step},{step * B * SEQ},{hl:.4f},{math.exp(hl):.2f},{elapsed:.1f}\n")
            log(f"step {step}: held-out loss {hl:.4f} (ppl {math.exp(hl):.1f}); "
                f"held-out expert share min {sh.min():.3f} max {sh.max():.3f}")
        if time.time() - last_ck > args.ckpt_minutes * 60:
            save_ckpt(work, model, opt, gen, step, time.time() - t0)
            last_ck = time.time()
    if progress:
        progress.stop()
    elapsed = time.time() - t0
    if stop["sig"] is not None:
        save_ckpt(work, model, opt, gen, step, elapsed)
        log(f"signal {stop['sig']}: checkpointed step {step} and stopped")
        raise SystemExit(0)
    hl, sh = evaluate(model, wins)
    with open(eval_csv, "a") as f:
        f.write(f"{step},{step * B * SEQ},{hl:.4f},{math.exp(hl):.2f},{elapsed:.1f}\n")
    log(f"final step {step}: held-out loss {hl:.4f} (ppl {math.exp(hl):.1f}); {elapsed / 60:.1f} min")
    save_ckpt(work, model, opt, gen, step, elapsed)
    (work / "DONE").write_text(json.dumps({"step": step, "elapsed_s": elapsed, "heldout_loss": hl}) + "\n")


# --------------------------------------------------------------------------- f. export
def export(work: Path, tokdir: Path, out: Path, threads: int) -> None:
    import torch
    from safetensors import safe_open
    from transformers import GenerationConfig, MixtralForCausalLM

    torch.set_num_threads(threads)
    st = torch.load(work / "ckpt.pt", weights_only=False, map_location="cpu")
    cfg = make_config(tokdir)
    model = MixtralForCausalLM(cfg)
    model.load_state_dict(st["model"])
    model = model.to(torch.bfloat16).eval()
    model.config.output_router_logits = False
    model.config.dtype = torch.bfloat16
    model.config.architectures = ["MixtralForCausalLM"]
    tmp = out.parent / (out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                     pad_token_id=cfg.pad_token_id).save_pretrained(tmp)
    write_tokenizer_files(load_tok(tokdir), tmp)
    files = sorted(p.name for p in tmp.iterdir())
    assert "model.safetensors" in files and not any("index" in f for f in files), files
    with safe_open(str(tmp / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert any("block_sparse_moe.experts.0.w1.weight" in k for k in keys), keys[:20]
    assert dtypes == {"BF16"}, dtypes
    size = (tmp / "model.safetensors").stat().st_size
    assert size <= 40e6, size
    conf = json.loads((tmp / "config.json").read_text())
    # transformers 5 writes rope_parameters only; keep the classic key for other readers
    conf.setdefault("rope_theta", cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None)
                    else cfg.rope_theta)
    (tmp / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    (tmp / "model.safetensors").chmod(0o644)
    assert conf["architectures"] == ["MixtralForCausalLM"]
    assert conf.get("output_router_logits") is False
    # keep a model card written earlier
    if (out / "MODEL_CARD.md").exists():
        shutil.copy(out / "MODEL_CARD.md", tmp / "MODEL_CARD.md")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    log(f"exported step {st['step']} to {out}: {files}, model.safetensors {size / 1e6:.1f} MB, "
        f"{len(keys)} tensors, dtype(config)={conf.get('dtype', conf.get('torch_dtype'))}")
    verify(out)


def verify(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    prompt = "The built-in function len returns"
    ids = tok(prompt, return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == prompt
    with torch.no_grad():
        g = model.generate(ids, max_new_tokens=40, do_sample=False)
    log(f"verify: dtype {model.dtype}; greedy: {tok.decode(g[0])!r}")


# --------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=".cache/demo-train")
    ap.add_argument("--out", default="src/specmoe/data/demo")
    ap.add_argument("--prompts-dir", default="benchmarks/prompts")
    ap.add_argument("--corpus", default=None, help="existing extracted python3.11-doc tree")
    ap.add_argument("--minutes", type=float, default=85.0, help="wall-clock training budget (total)")
    ap.add_argument("--steps", type=int, default=4000, help="total steps (LR schedule)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads; 0 = choose 1 or 2 by measurement (2 threads degrade 3-8x "
                         "when the 2 cores are shared with other jobs)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--export-only", action="store_true", help="export the latest checkpoint and exit")
    ap.add_argument("--prompts-only", action="store_true", help="(re)write the benchmark prompts and exit")
    ap.add_argument("--no-export", action="store_true")
    args = ap.parse_args()

    os.chdir(REPO)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    src = stage_corpus(work, args.corpus)
    split = stage_split(work, src)
    tokdir = stage_tokenizer(work, src, split)
    if args.export_only:
        export(work, tokdir, out, max(1, args.threads))
        return
    stage_prompts(src, split, tokdir, Path(args.prompts_dir))
    if args.prompts_only:
        return
    train, held = stage_tokenize(work, src, split, tokdir)
    log(f"train stream {len(train):,} tokens, held-out stream {len(held):,} tokens")
    stage_train(args, work, tokdir, train, held)
    if not args.no_export:
        export(work, tokdir, out, max(1, args.threads))


if __name__ == "__main__":
    main()
