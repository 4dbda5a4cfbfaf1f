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
from safetensors import SafetensorError, safe_open
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
    config = json.loads((src / "config.json").read_text())
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
        shards = sorted({layer_of(n) for n in names})
        files = {shard: f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i, shard in enumerate(shards, 1)}
        require_room(out, widened_bytes(f, names, k, m), files.values())
        out.mkdir(parents=True, exist_ok=True)
        weight_map = {}
        for shard, file in files.items():
            tensors = {n: widen(n, f.get_tensor(n), k, m).contiguous() for n in names if layer_of(n) == shard}
            save_shard(tensors, out / file)
            weight_map.update({n: file for n in tensors})
            print(f"{file}: {sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20:.0f} MiB",
                  file=sys.stderr, flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(widened_config(config, k, m), indent=2) + "\n")
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


def widened_bytes(f, names: list[str], k: int, m: int) -> int:
    """What the widened tensors take, from their shapes alone (widened on the meta device)."""
    grown = (widen(n, f.get_tensor(n).to("meta"), k, m) for n in names)
    return sum(t.numel() * t.element_size() for t in grown)


def require_room(out: Path, needed: int, files) -> None:
    """Refuse, before writing anything, a widening that the disk under `out` cannot hold
    (shards already there from an earlier run are rewritten in place and count as room)."""
    there = out if out.exists() else next(p for p in out.parents if p.exists())
    if there.is_file():
        raise SystemExit(f"real_size_model: {there} is a file; give a directory as OUT_DIR")
    rewritten = sum((out / name).stat().st_size for name in files if (out / name).is_file())
    free = shutil.disk_usage(there).free + rewritten
    if needed > free:
        raise SystemExit(f"real_size_model: this widening needs {needed / 2**20:.0f} MiB and the disk under {out} "
                         f"has {free / 2**20:.0f} MiB free: free some space there or give another OUT_DIR")


def save_shard(tensors: dict, path: Path) -> None:
    """One shard written whole, or none: a write that fails (a disk filling up under another
    process, a file-size limit) leaves no partial file and says so in one line."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except (OSError, SafetensorError) as e:  # safetensors reports an I/O error as its own
        path.unlink(missing_ok=True)
        reason = getattr(e, "strerror", None) or str(e).rsplit("I/O error: ", 1)[-1]
        raise SystemExit(f"real_size_model: writing {path} failed ({reason}) and was undone: "
                         "make room there or give another OUT_DIR") from None


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
