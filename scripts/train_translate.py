#!/usr/bin/env python3
"""Train the bundled translation MoE ``specmoe-demo-translate`` (NLLB-MoE layout) on the CPU.

The parallel text is the machine's own: the gettext catalogs (``.mo`` files) that Debian
packages install under ``share/locale/fr/LC_MESSAGES``, English msgid -> French msgstr.
Resumable and wall-clock bounded; each stage is skipped when its output exists in
``--workdir``:

  a. corpus     read every French .mo file (charset from its header), owner package by
                ``dpkg -S``, deduplicated (package, English, French) triples
  b. split      held out by *package* (sha256(package) % 100 < 10), not by string; held-out
                pairs whose English string also occurs in training are dropped
  c. tokenizer  byte-level BPE, vocab 8000, specials <s> <pad> </s> <unk> and the language
                codes eng_Latn fra_Latn (NLLB's ids: pad 1, eos 2 = decoder start)
  -  prompts    benchmarks/prompts/translate_heldout.jsonl (held-out sources + references)
  d. train      NllbMoeForConditionalGeneration (16 experts, top-2, an MoE block every 2nd
                layer of encoder and decoder), AdamW, warm-up + cosine over a step count
                fixed from the first steps' measured speed and --minutes; checkpoint every
                --ckpt-minutes; SIGTERM/SIGINT checkpoint and stop; --resume continues
  e. score      greedy translations of the held-out test split; BLEU and chrF (sacrebleu)
                against copying the source; per-block expert load and temporal locality
  f. export     bf16 safetensors + tokenizer to ``--out``

    .venv/bin/python scripts/train_translate.py --minutes 70            # fresh run
    .venv/bin/python scripts/train_translate.py --resume --minutes 90   # continue to 90 min in all
    .venv/bin/python scripts/train_translate.py --score-only            # score + export the checkpoint
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import time
from glob import glob
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEED = 1234
VOCAB = 8000
SRC_LANG, TGT_LANG = "eng_Latn", "fra_Latn"
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", SRC_LANG, TGT_LANG]
MAX_TOKENS = 48          # per side; longer pairs are left out of training and scoring
HELDOUT_PERCENT = 10
TEST_PAIRS, DEV_PAIRS = 600, 200
BATCH_TOKENS = 2500      # source + target tokens per training batch


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- a. corpus
def read_mo(path: str) -> list[tuple[str, str]]:
    """(msgid, msgstr) pairs of a compiled gettext catalog, decoded with its own charset.

    Python's gettext module refuses catalogs whose header is not UTF-8, so the (simple)
    format is read here: magic, count, then two tables of (length, offset)."""
    data = Path(path).read_bytes()
    order = "<" if struct.unpack("<I", data[:4])[0] == 0x950412DE else ">"
    _, count, originals, translations = struct.unpack(order + "4I", data[4:20])

    def entry(table: int, i: int) -> bytes:
        length, offset = struct.unpack(order + "2I", data[table + 8 * i: table + 8 * i + 8])
        return data[offset: offset + length]

    raw = [(entry(originals, i), entry(translations, i)) for i in range(count)]
    charset = "utf-8"
    for msgid, msgstr in raw:
        match = re.search(rb"charset=([-\w]+)", msgstr) if msgid == b"" else None
        if match:
            charset = match.group(1).decode()
    pairs = []
    for msgid, msgstr in raw:
        # msgctxt\x04msgid; plural forms are NUL-separated: keep the singular
        msgid = msgid.split(b"\x04")[-1].split(b"\0")[0]
        msgstr = msgstr.split(b"\0")[0]
        try:
            pairs.append((msgid.decode(charset), msgstr.decode(charset)))
        except (UnicodeDecodeError, LookupError):
            continue
    return [(s, t) for s, t in pairs if s.strip() and t.strip()]


def owner_package(path: str) -> str:
    out = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True)
    return out.stdout.split(":")[0].strip() if out.returncode == 0 else Path(path).stem


def stage_corpus(work: Path) -> list[dict]:
    f = work / "corpus.jsonl"
    if f.exists():
        return [json.loads(l) for l in f.read_text().splitlines()]
    files = sorted(set(glob("/usr/share/locale/fr/LC_MESSAGES/*.mo")
                       + glob("/usr/share/**/lang/fr/LC_MESSAGES/*.mo", recursive=True)))
    seen, rows = set(), []
    for path in files:
        package = owner_package(path)
        for src, tgt in read_mo(path):
            if len(src) > 300 or len(tgt) > 400 or (package, src, tgt) in seen:
                continue
            seen.add((package, src, tgt))
            rows.append({"package": package, "domain": Path(path).stem, "en": src, "fr": tgt})
    f.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    log(f"corpus: {len(rows)} pairs from {len(files)} catalogs of "
        f"{len({r['package'] for r in rows})} packages")
    return rows


# --------------------------------------------------------------------------- b. split
def is_heldout_package(package: str) -> bool:
    return int(hashlib.sha256(package.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def stable_key(row: dict) -> str:
    return hashlib.sha256(f"{row['package']}\0{row['en']}\0{row['fr']}".encode()).hexdigest()


def stage_split(work: Path, rows: list[dict]) -> dict:
    f = work / "split.json"
    if f.exists():
        return json.loads(f.read_text())
    train = [r for r in rows if not is_heldout_package(r["package"])]
    train_sources = {r["en"] for r in train}
    held = [r for r in rows if is_heldout_package(r["package"]) and r["en"] not in train_sources]
    held.sort(key=stable_key)
    split = {
        "rule": f"sha256(package) % 100 < {HELDOUT_PERCENT} -> held out; held-out English strings "
                "that also occur in training are dropped",
        "heldout_packages": sorted({r["package"] for r in rows if is_heldout_package(r["package"])}),
        "train": train, "dev": held[:DEV_PAIRS], "test": held[DEV_PAIRS: DEV_PAIRS + TEST_PAIRS],
        "heldout_total": len(held),
    }
    f.write_text(json.dumps(split, ensure_ascii=False))
    log(f"split: {len(train)} train pairs; held out {len(held)} pairs of packages "
        f"{split['heldout_packages']}")
    return split


# --------------------------------------------------------------------------- c. tokenizer
def stage_tokenizer(work: Path, split: dict) -> Path:
    tokdir = work / "tokenizer"
    if (tokdir / "tokenizer.json").exists():
        return tokdir
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    texts = [r["en"] for r in split["train"]] + [r["fr"] for r in split["train"]]
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(s) for s in SPECIALS] == list(range(len(SPECIALS)))
    tmp = work / "tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_tokenizer_files(tok, tmp)
    os.replace(tmp, tokdir)
    log(f"tokenizer: {tok.get_vocab_size()} tokens")
    return tokdir


def write_tokenizer_files(tok, d: Path) -> None:
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "pad_token": "<pad>", "unk_token": "<unk>",
           "additional_special_tokens": [SRC_LANG, TGT_LANG], "model_max_length": 256,
           "src_lang": SRC_LANG, "tgt_lang": TGT_LANG,  # the direction it was trained on: specmoe's defaults
           "clean_up_tokenization_spaces": False}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_tok(tokdir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokdir / "tokenizer.json"))


def encode_pair(tok, row: dict) -> tuple[list[int], list[int]]:
    """NLLB's framing: source [src_lang] text </s>; target [tgt_lang] text </s> (the
    decoder input is the target shifted right after the start token </s>)."""
    src = [tok.token_to_id(SRC_LANG)] + tok.encode(row["en"]).ids + [2]
    tgt = [tok.token_to_id(TGT_LANG)] + tok.encode(row["fr"]).ids + [2]
    return src, tgt


def stage_prompts(split: dict, tokdir: Path, path: Path) -> None:
    tok = load_tok(tokdir)
    rows = [r for r in split["test"] if max(map(len, encode_pair(tok, r))) <= MAX_TOKENS]
    path.write_text("".join(json.dumps({"prompt": r["en"], "reference": r["fr"], "package": r["package"]},
                                       ensure_ascii=False) + "\n" for r in rows))
    log(f"wrote {len(rows)} held-out prompts to {path}")


# --------------------------------------------------------------------------- d. train
def make_config(tokdir: Path):
    from transformers import NllbMoeConfig

    return NllbMoeConfig(
        vocab_size=load_tok(tokdir).get_vocab_size(), d_model=192, max_position_embeddings=256,
        encoder_layers=4, decoder_layers=4, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=384, decoder_ffn_dim=384, num_experts=16, encoder_sparse_step=2,
        decoder_sparse_step=2, expert_capacity=64, moe_eval_capacity_token_fraction=1.0,
        second_expert_policy="all", normalize_router_prob_before_dropping=False,
        batch_prioritized_routing=False, router_bias=False, moe_token_dropout=0.1, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
        activation_function="relu", scale_embedding=True, router_aux_loss_coef=0.05,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        tie_word_embeddings=True)


def fairseq_experts_forward(self, hidden_states, router_mask, router_probs):
    """NLLB-MoE's expert mixture as fairseq and transformers 4.x compute it: every token
    through its top-1 and top-2 experts (router_probs > 0), weighted by their normalised
    probabilities, times 1 - moe_token_dropout at inference.

    transformers 5.x's NllbMoeExperts.forward one-hot encodes the top-1 mask's *values*
    and so runs expert_0 and expert_1 on every token whatever the router chose; this
    forward is put in its place for training and scoring."""
    import torch

    out = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        rows = (router_probs[:, e] > 0).nonzero().squeeze(-1)
        if len(rows):
            y = self[f"expert_{e}"](hidden_states[rows]) * router_probs[rows, e, None]
            if self.moe_token_dropout > 0:
                y = self.token_dropout(y) if self.training else y * (1 - self.moe_token_dropout)
            out.index_add_(0, rows, y.to(out.dtype))
    return out


def nllb_class():
    from transformers import NllbMoeForConditionalGeneration
    from transformers.models.nllb_moe import modeling_nllb_moe

    modeling_nllb_moe.NllbMoeExperts.forward = fairseq_experts_forward
    return NllbMoeForConditionalGeneration


def batches(pairs: list, epoch: int) -> list[list[int]]:
    """Index batches of similar length (little padding), in a seeded order per epoch."""
    rng = random.Random(SEED + epoch)
    order = sorted(range(len(pairs)), key=lambda i: (max(len(pairs[i][0]), len(pairs[i][1])), rng.random()))
    out, cur, longest = [], [], 0
    for i in order:
        longest = max(longest, len(pairs[i][0]), len(pairs[i][1]))
        if cur and 2 * longest * (len(cur) + 1) > BATCH_TOKENS:
            out.append(cur)
            cur, longest = [], max(len(pairs[i][0]), len(pairs[i][1]))
        cur.append(i)
    out.append(cur)
    rng.shuffle(out)
    return out


def collate(pairs: list, idx: list[int]):
    import torch

    src_len = max(len(pairs[i][0]) for i in idx)
    tgt_len = max(len(pairs[i][1]) for i in idx)
    src = torch.full((len(idx), src_len), 1, dtype=torch.long)
    labels = torch.full((len(idx), tgt_len), -100, dtype=torch.long)
    dec = torch.full((len(idx), tgt_len), 1, dtype=torch.long)
    for row, i in enumerate(idx):
        s, t = pairs[i]
        src[row, : len(s)] = torch.tensor(s)
        labels[row, : len(t)] = torch.tensor(t)
        dec[row, : len(t)] = torch.tensor([2] + t[:-1])
    return src, (src != 1).long(), dec, (dec != 1).long() * (labels != -100).long(), labels


def balance_loss(router_logits, mask, experts: int):
    """Switch-style load balancing, per MoE block (not over blocks pooled), on real tokens."""
    import torch

    keep = mask.reshape(-1).bool()
    total = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits[keep].float(), -1)
        picks = torch.nn.functional.one_hot(probs.topk(2, -1).indices, experts).float().sum(1)
        total = total + experts * (picks.mean(0) / 2 * probs.mean(0)).sum()
    return total / len(router_logits)


def uncapped(model) -> None:
    """Keep every token at training time too (inference keeps every token: eval fraction 1)."""
    for module in model.modules():
        if type(module).__name__ == "NllbMoeTop2Router":
            module.expert_capacity = 10 ** 9


def lr_at(step: int, total: int, peak: float, warmup: int = 300, floor: float = 0.05) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def dev_loss(model, pairs: list) -> float:
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(pairs), 50):
            src, src_mask, dec, dec_mask, labels = collate(pairs, list(range(i, min(i + 50, len(pairs)))))
            out = model(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec, labels=labels)
            n = int((labels != -100).sum())
            total, count = total + out.loss.item() * n, count + n
    model.train()
    return total / count


def save_ckpt(work: Path, state: dict) -> None:
    import torch

    tmp = work / "ckpt.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, work / "ckpt.pt")


def stage_train(args, work: Path, tokdir: Path, split: dict):
    import torch

    NllbMoeForConditionalGeneration = nllb_class()
    torch.set_num_threads(1)  # the machine is shared: leave the other core to others
    torch.manual_seed(SEED)
    tok = load_tok(tokdir)
    pairs = [p for p in (encode_pair(tok, r) for r in split["train"]) if max(map(len, p)) <= MAX_TOKENS]
    dev = [p for p in (encode_pair(tok, r) for r in split["dev"]) if max(map(len, p)) <= MAX_TOKENS]
    cfg = make_config(tokdir)
    model = NllbMoeForConditionalGeneration(cfg)
    params = sum(p.numel() for p in model.parameters())
    log(f"{len(pairs)} training pairs; parameters {params:,} (bf16 ~{params * 2 / 1e6:.1f} MB)")
    assert params * 2 <= 40e6, "bf16 export would exceed 40 MB"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    st = {"step": 0, "epoch": 0, "batch": 0, "elapsed": 0.0, "total_steps": args.steps}
    ckpt = work / "ckpt.pt"
    if ckpt.exists():
        if not args.resume:
            raise SystemExit(f"{ckpt} exists: pass --resume to continue it, or remove {work}")
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        torch.set_rng_state(saved["torch_rng"])
        st = saved["state"]
        log(f"resumed at step {st['step']} ({st['elapsed'] / 60:.1f} min trained)")
    budget, t0, last_ckpt = args.minutes * 60, time.time() - st["elapsed"], time.time()
    stop = {"signal": None}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: stop.update(signal=s))
    loss_log = (work / "loss_log.csv").open("a")
    model.train()
    order = batches(pairs, st["epoch"])
    acc = [0.0, 0.0, 0, 0, time.time()]
    while time.time() - t0 < budget and stop["signal"] is None and (
            not st["total_steps"] or st["step"] < st["total_steps"]):
        if st["batch"] >= len(order):
            st["epoch"], st["batch"] = st["epoch"] + 1, 0
            order = batches(pairs, st["epoch"])
        if not st["total_steps"] and st["step"] == st.get("probe_from", 0) + 40:
            per_step = (time.time() - t0 - st.get("probe_elapsed", 0.0)) / 40
            st["total_steps"] = int(st["step"] + (budget - (time.time() - t0)) / per_step)
            log(f"{per_step:.2f} s/step: schedule fixed at {st['total_steps']} steps")
        lr = lr_at(st["step"], st["total_steps"] or 10 ** 6, args.lr)
        for group in opt.param_groups:
            group["lr"] = lr
        src, src_mask, dec, dec_mask, labels = collate(pairs, order[st["batch"]])
        uncapped(model)
        out = model(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec,
                    decoder_attention_mask=dec_mask, output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), labels.reshape(-1),
                                               ignore_index=-100, label_smoothing=0.1)
        aux = (balance_loss(out.encoder_router_logits, src_mask, cfg.num_experts)
               + balance_loss(out.decoder_router_logits, dec_mask, cfg.num_experts)) / 2
        (ce + cfg.router_aux_loss_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        st["step"], st["batch"] = st["step"] + 1, st["batch"] + 1
        acc[0] += ce.item(); acc[1] += aux.item(); acc[2] += 1; acc[3] += int(src_mask.sum() + dec_mask.sum())
        if st["step"] % 50 == 0:
            elapsed = time.time() - t0
            loss_log.write(f"{st['step']},{st['epoch']},{acc[0] / acc[2]:.4f},{acc[1] / acc[2]:.4f},{lr:.3g},{elapsed:.0f}\n")
            loss_log.flush()
            log(f"step {st['step']}/{st['total_steps']} epoch {st['epoch']} loss {acc[0] / acc[2]:.3f} "
                f"aux {acc[1] / acc[2]:.3f} lr {lr:.2e} {acc[3] / (time.time() - acc[4]):,.0f} tok/s "
                f"{elapsed / 60:.1f} min")
            acc = [0.0, 0.0, 0, 0, time.time()]
        if st["step"] % 500 == 0:
            log(f"step {st['step']}: dev loss {dev_loss(model, dev):.3f}")
        if time.time() - last_ckpt > args.ckpt_minutes * 60:
            st["elapsed"] = time.time() - t0
            save_ckpt(work, {"model": model.state_dict(), "opt": opt.state_dict(),
                             "torch_rng": torch.get_rng_state(), "state": st})
            last_ckpt = time.time()
    st["elapsed"] = time.time() - t0
    save_ckpt(work, {"model": model.state_dict(), "opt": opt.state_dict(),
                     "torch_rng": torch.get_rng_state(), "state": st})
    log(f"stopped at step {st['step']} after {st['elapsed'] / 60:.1f} min; dev loss {dev_loss(model, dev):.3f}")
    if stop["signal"] is not None:
        raise SystemExit(0)


# --------------------------------------------------------------------------- e. score
def load_trained(work: Path, tokdir: Path):
    import torch

    model = nllb_class()(make_config(tokdir))
    saved = torch.load(work / "ckpt.pt", weights_only=False, map_location="cpu")
    model.load_state_dict(saved["model"])
    return model.eval(), saved["state"]


def translate(model, tok, sources: list[str], max_new: int = MAX_TOKENS) -> tuple[list[str], list]:
    import torch

    outs, routing = [], []
    for i in range(0, len(sources), 32):
        encoded = [[tok.token_to_id(SRC_LANG)] + tok.encode(s).ids[: MAX_TOKENS - 2] + [2]
                   for s in sources[i: i + 32]]
        width = max(map(len, encoded))
        ids = torch.tensor([e + [1] * (width - len(e)) for e in encoded])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=(ids != 1).long(), max_new_tokens=max_new,
                                 num_beams=1, do_sample=False, forced_bos_token_id=tok.token_to_id(TGT_LANG))
        outs += [tok.decode([t for t in row.tolist()[2:] if t > 3]) for row in gen]
        routing.append(gen)
    return outs, routing


def routing_statistics(model, tok, rows: list[dict]) -> dict:
    """Per MoE block: share of top-2 picks per expert, and temporal locality (the share of
    a decoder token's experts that the previous token of the same sequence also used)."""
    import torch

    loads, locality = {}, {}
    for row in rows:
        src, tgt = encode_pair(tok, row)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([[2] + tgt[:-1]]),
                        output_router_logits=True)
        for side, logits_list in (("encoder", out.encoder_router_logits), ("decoder", out.decoder_router_logits)):
            for b, logits in enumerate(logits_list):
                picks = logits.topk(2, -1).indices.tolist()
                key = f"{side}.{b}"
                counts = loads.setdefault(key, [0] * logits.shape[-1])
                for p in picks:
                    for e in p:
                        counts[e] += 1
                if side == "decoder":
                    same = [len(set(a) & set(c)) / 2 for a, c in zip(picks, picks[1:])]
                    locality.setdefault(key, []).extend(same)
    return {"load": {k: [round(c / sum(v), 4) for c in v] for k, v in loads.items()},
            "temporal_locality": {k: round(sum(v) / len(v), 3) for k, v in locality.items()}}


def stage_score(work: Path, tokdir: Path, split: dict) -> dict:
    import sacrebleu
    import torch

    torch.set_num_threads(1)
    tok = load_tok(tokdir)
    model, st = load_trained(work, tokdir)
    rows = [r for r in split["test"] if max(map(len, encode_pair(tok, r))) <= MAX_TOKENS]
    hyps, _ = translate(model, tok, [r["en"] for r in rows])
    refs = [[r["fr"] for r in rows]]
    copy = [r["en"] for r in rows]
    scores = {
        "test_pairs": len(rows), "heldout_packages": split["heldout_packages"],
        "train_pairs": len(split["train"]), "steps": st["step"], "epochs": st["epoch"],
        "train_minutes": round(st["elapsed"] / 60, 1),
        "model": {"bleu": round(sacrebleu.corpus_bleu(hyps, refs).score, 2),
                  "chrf": round(sacrebleu.corpus_chrf(hyps, refs).score, 2)},
        "copy_source": {"bleu": round(sacrebleu.corpus_bleu(copy, refs).score, 2),
                        "chrf": round(sacrebleu.corpus_chrf(copy, refs).score, 2)},
        "routing": routing_statistics(model, tok, rows[:200]),
        "examples": [{"en": r["en"], "reference": r["fr"], "model": h} for r, h in list(zip(rows, hyps))[:12]],
    }
    (work / "scores.json").write_text(json.dumps(scores, indent=1, ensure_ascii=False) + "\n")
    log(f"scores: model {scores['model']} copy-the-source {scores['copy_source']}")
    return scores


def model_card(scores: dict, loss_log: str) -> str:
    """MODEL_CARD.md from scores.json (data, training, scores, routing) and the loss log."""
    last = [l.split(",") for l in loss_log.splitlines() if l.strip()][-1]
    load = scores["routing"]["load"]
    rows = "\n".join(f"| {block} | {min(v):.3f} | {max(v):.3f} | {sum(1 for x in v if x == 0)} | "
                     f"{scores['routing']['temporal_locality'].get(block, '–')} |" for block, v in load.items())
    cell = lambda text: repr(text).replace("|", "\\|")  # noqa: E731
    examples = "\n".join(f"| {cell(e['en'])} | {cell(e['reference'])} | {cell(e['model'])} |"
                         for e in scores["examples"][:8])
    m, c = scores["model"], scores["copy_source"]
    return f"""# specmoe-demo-translate

A small English->French translation Mixture-of-Experts in NLLB-MoE's layout
(`NllbMoeForConditionalGeneration`), bundled with specmoe so that the encoder-decoder
engine, its offloading policies and SpecMoE can be run and measured without a download.
It is a demonstration model, not a usable translator.

## Architecture

d_model 192, 4 attention heads; a 4-layer encoder and a 4-layer decoder, pre-LayerNorm;
an MoE block every 2nd layer of each (encoder blocks 1, 3; decoder blocks 5, 7 in specmoe's
numbering), 16 experts, top-2 (second expert policy "all", evaluation capacity keeping every
token), ReLU fc1/fc2 experts of 384; dense FFN 384; sinusoidal positions; embeddings
scaled by sqrt(d_model) and tied with the output head; moe_token_dropout 0.1 (expert
outputs scaled by 0.9 at inference). 13.4 M parameters, bf16 safetensors. Vocabulary:
byte-level BPE of 8000 tokens with `<s>` 0, `<pad>` 1, `</s>` 2 (the decoder start),
`<unk>` 3 and the language codes `eng_Latn`, `fra_Latn` as special tokens (the
tokenizer's defaults: `src_lang` eng_Latn, `tgt_lang` fra_Latn, the trained direction).

## Data

The gettext message catalogs that Debian packages install on this machine
(`/usr/share/locale/fr/LC_MESSAGES/*.mo`, and vim's), English msgid -> French msgstr,
read with each catalog's own charset; the owning package by `dpkg -S`; deduplicated per
package. {scores['train_pairs']} training pairs; held out by package (sha256(package)
% 100 < 10): {', '.join(scores['heldout_packages'])}; held-out strings whose English also
occurs in training dropped. Scored on {scores['test_pairs']} held-out pairs (sources and
targets of at most 48 tokens); `benchmarks/prompts/translate_heldout.jsonl` holds them.

## Training

`scripts/train_translate.py` (resumable; `--resume`, checkpoints every 4 minutes): AdamW
(betas 0.9 / 0.98, weight decay 0.01), peak lr 2e-3 with 300 warm-up steps and cosine
decay over a step count fixed from the first steps' speed and the time budget, batches of
about 2500 source + target tokens of similar length, label smoothing 0.1, a per-block
Switch load-balancing loss (coefficient 0.05), one CPU thread on a shared 2-core machine.
transformers 5's NllbMoeExperts.forward runs experts 0 and 1 on every token whatever the
router chose; training used fairseq's mixture (each token's top-1 and top-2 experts), the
semantics specmoe computes. {scores['steps']} steps ({scores['epochs'] + 1} epoch(s) begun),
{scores['train_minutes']} minutes; last logged training loss {float(last[2]):.2f}
(label-smoothed cross-entropy).

## Scores (held-out packages, sacrebleu)

| system | BLEU | chrF |
|---|---|---|
| this model, greedy | {m['bleu']:.2f} | {m['chrf']:.2f} |
| copy the source | {c['bleu']:.2f} | {c['chrf']:.2f} |

Examples:

| English | reference | model |
|---|---|---|
{examples}

## Routing statistics (the first 200 held-out pairs, teacher-forced)

Load: each block's share of top-2 picks per expert (min and max over its 16 experts, and
experts never picked). Temporal locality (decoder blocks): the share of a token's two
experts that the previous token of the same sequence also used, what SpecMoE's temporal
draft set relies on.

| block | min share | max share | unused experts | temporal locality |
|---|---|---|---|---|
{rows}

Per-expert shares: `scores.json` beside this card.
"""


# --------------------------------------------------------------------------- f. export
def export(work: Path, tokdir: Path, out: Path) -> None:
    import torch
    from transformers import GenerationConfig

    model, st = load_trained(work, tokdir)
    model = model.to(torch.bfloat16)
    model.config.architectures = ["NllbMoeForConditionalGeneration"]
    tmp = out.parent / (out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=1, decoder_start_token_id=2,
                     max_length=MAX_TOKENS + 2).save_pretrained(tmp)
    write_tokenizer_files(load_tok(tokdir), tmp)
    size = (tmp / "model.safetensors").stat().st_size
    assert size <= 40e6, size
    (tmp / "model.safetensors").chmod(0o644)
    for keep in ("MODEL_CARD.md", "scores.json"):
        if (out / keep).exists():
            shutil.copy(out / keep, tmp / keep)
    if (work / "scores.json").exists():
        shutil.copy(work / "scores.json", tmp / "scores.json")
        scores = json.loads((work / "scores.json").read_text())
        (tmp / "MODEL_CARD.md").write_text(model_card(scores, (work / "loss_log.csv").read_text()))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    log(f"exported step {st['step']} to {out}: model.safetensors {size / 1e6:.1f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=".cache/translate-train")
    ap.add_argument("--out", default="src/specmoe/data/translate")
    ap.add_argument("--prompts", default="benchmarks/prompts/translate_heldout.jsonl")
    ap.add_argument("--minutes", type=float, default=70.0, help="wall-clock training budget, in all")
    ap.add_argument("--steps", type=int, default=0, help="schedule length (0: from the measured speed)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ckpt-minutes", type=float, default=4.0)
    ap.add_argument("--resume", action="store_true", help="continue the checkpoint in --workdir")
    ap.add_argument("--score-only", action="store_true", help="score and export the checkpoint")
    args = ap.parse_args()
    os.chdir(REPO)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    split = stage_split(work, stage_corpus(work))
    tokdir = stage_tokenizer(work, split)
    stage_prompts(split, tokdir, Path(args.prompts))
    if not args.score_only:
        stage_train(args, work, tokdir, split)
    stage_score(work, tokdir, split)
    export(work, tokdir, Path(args.out))


if __name__ == "__main__":
    main()
