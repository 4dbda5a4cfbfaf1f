"""The real-size benchmark model: the bundled demo model widened without changing its function.

The demo model (hidden 256, 8 heads of 32, 16 experts 128 wide, 8 layers) is 31 MiB: at
that size per-operator overhead hides what moving experts costs. Widened Net2Net-style it
keeps a trained model's routing and draft acceptance with the shapes of a real one:

- every hidden coordinate repeated k times (embedding columns, norm weights, the rows of
  every matrix that writes the residual stream), so RMSNorm's statistic is unchanged;
- every attention and kv head repeated k times (head_dim unchanged, so RoPE and the
  softmax scale are too; query head j still reads kv head j // group);
- every expert neuron repeated m times;
- each matrix's input dimension that grew divided by its factor, so a product sums k (or
  m) equal copies of each original term: the same value. With power-of-two factors the
  division is exact in bfloat16.

Greedy tokens under transformers equal the demo model's (tests/test_real_size_model.py,
at small factors); k = 8, m = 16 give hidden 2048, experts 2048 wide (24 MiB each in
bfloat16), 128 experts, 3.2 GiB in all. Written as one safetensors shard per layer.

usage: python benchmarks/real_size_model.py OUT_DIR [--hidden-factor 8] [--expert-factor 16] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

DEMO = Path(__file__).resolve().parents[1] / "src" / "specmoe" / "data" / "demo"
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def widen(name: str, t: torch.Tensor, k: int, m: int) -> torch.Tensor:
    """One demo tensor widened: rows repeated, columns repeated and divided by their factor
    (the embedding's columns are the stream itself: repeated only)."""
    if t.dim() == 1:  # norm weights, over the hidden dimension
        return t.repeat(k)
    if name.endswith("embed_tokens.weight"):  # [V, D]
        return t.repeat(1, k)
    if any(p in name for p in ("q_proj", "k_proj", "v_proj", "o_proj")):  # [heads * hd, D], [D, heads * hd]
        rows, cols = k, k
    elif name.endswith(("w1.weight", "w3.weight")):  # [I, D]
        rows, cols = m, k
    elif name.endswith("w2.weight"):  # [D, I]
        rows, cols = k, m
    elif name.endswith(("gate.weight", "lm_head.weight")):  # [E or V, D]
        rows, cols = 1, k
    else:
        raise SystemExit(f"real_size_model: no widening rule for {name} {tuple(t.shape)}")
    return t.repeat(rows, cols) / cols


def widened_config(config: dict, k: int, m: int) -> dict:
    out = dict(config)
    out["hidden_size"] = config["hidden_size"] * k
    out["num_attention_heads"] = config["num_attention_heads"] * k
    out["num_key_value_heads"] = config["num_key_value_heads"] * k
    out["intermediate_size"] = config["intermediate_size"] * m
    out["head_dim"] = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return out


def layer_of(name: str) -> str:
    parts = name.split(".")
    return f"layer{int(parts[2]):02d}" if parts[:2] == ["model", "layers"] else "outer"


def write(src: Path, out: Path, k: int, m: int) -> Path:
    for factor in (k, m):
        if factor < 1 or factor & (factor - 1):
            raise SystemExit(f"real_size_model: factors must be powers of two (exact in bfloat16), got {factor}")
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
        shards = sorted({layer_of(n) for n in names})
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            tensors = {n: widen(n, f.get_tensor(n), k, m).contiguous() for n in names if layer_of(n) == shard}
            save_file(tensors, str(out / file), metadata={"format": "pt"})
            weight_map.update({n: file for n in tensors})
            print(f"{file}: {sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20:.0f} MiB",
                  file=sys.stderr, flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(widened_config(config, k, m), indent=2) + "\n")
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def built(src: Path, out: Path, k: int, m: int) -> bool:
    """Whether `out` holds a finished widening of `src` by (k, m): its config, written last,
    is the widened one."""
    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return config == json.loads(json.dumps(widened_config(json.loads((src / "config.json").read_text()), k, m)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="directory of the widened checkpoint")
    p.add_argument("--source", type=Path, default=DEMO, help="a Mixtral-family checkpoint (default: the demo model)")
    p.add_argument("--hidden-factor", type=int, default=8, help="k: hidden size and heads times k")
    p.add_argument("--expert-factor", type=int, default=16, help="m: expert width times m")
    p.add_argument("--keep", action="store_true", help="leave OUT as it is when it already holds this widening")
    args = p.parse_args(argv)
    if args.keep and built(args.source, args.out, args.hidden_factor, args.expert_factor):
        print(f"real_size_model: {args.out} already holds this widening (kept)", file=sys.stderr)
        return 0
    write(args.source, args.out, args.hidden_factor, args.expert_factor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
