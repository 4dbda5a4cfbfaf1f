"""The candidate CPU kernels for a GGUF matrix, per shape class: time, memory held, and
whether a row's result is the same bits alone and among others (what lossless speculation
needs). Weights 2048 x 2048 (the real-size model's experts and attention), eight distinct
matrices in rotation so that no product finds its weights in cache; rows M = 1 (a decode
step at B = 1), 16 (B = 16), 272 (a verify pass of B = 16 at gamma = 16).

    python benchmarks/kernel_shapes.py --json kernels.json     # docs/KERNELS.md's table

Candidates: specmoe's block kernels on the blocks as stored (blockdot); the blocks
dequantized to float32 at every call and multiplied by torch (what specmoe did before);
torch's float32 and bfloat16 matmuls on weights dequantized once and kept (4x and 2x the
memory of Q8_0, 7x and 3.5x of Q4_K). The block kernels are timed as the engine runs them,
on their own threads with torch's on one; the rest on torch's threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from specmoe.base.gguf_quants import dequantize
from specmoe.kernels import blockdot, blockdot_check
from specmoe.kernels.cpu import usable_cores

N = K = 2048
ROWS = (1, 16, 272)
TYPES = ("Q4_K", "Q6_K", "Q8_0")


def timed(fn, reps: int) -> float:
    warm = time.perf_counter()
    while time.perf_counter() - warm < 0.3:  # past the other thread pool's busy wait, caches and allocator warm
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def invariant(product, x: torch.Tensor) -> bool:
    """Whether rows 0 and M-1 of a product of all rows are the bits of each row alone."""
    full = product(x)
    return bool(torch.equal(full[0], product(x[:1])[0]) and torch.equal(full[-1], product(x[-1:])[0]))


def candidates(raws: list[torch.Tensor], type_name: str) -> dict:
    floats = [dequantize(r, type_name, N, K) for r in raws]
    bf16 = [w.to(torch.bfloat16) for w in floats]
    turn = [0]

    def pick(items):
        turn[0] = (turn[0] + 1) % len(items)
        return items[turn[0]]

    return {
        "blockdot (as stored)": (lambda x: blockdot.matmul(x, pick(raws), type_name, N), raws[0].numel()),
        "dequantize per call + torch float32": (
            lambda x: F.linear(x, dequantize(pick(raws), type_name, N, K)), raws[0].numel()),
        "torch float32 (kept dequantized)": (lambda x: F.linear(x, pick(floats)), N * K * 4),
        "torch bfloat16 (kept dequantized)": (lambda x: F.linear(x.bfloat16(), pick(bf16)).float(), N * K * 2),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=usable_cores())
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", help="write the records here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    blockdot.set_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    records = []
    for type_name in TYPES:
        raws = [blockdot_check.random_blocks(type_name, N, K, gen) for _ in range(8)]
        for name, (product, held) in candidates(raws, type_name).items():
            # as the engine runs them: the block kernels' own threads with torch's on one (its
            # OpenMP threads spin after each operator and would take the cores from them)
            torch.set_num_threads(1 if name.startswith("blockdot") else args.threads)
            for M in ROWS:
                x = torch.randn(M, K, generator=gen)
                rec = {"type": type_name, "kernel": name, "rows": M, "ms": timed(lambda: product(x), args.reps),
                       "bytes_held": held, "threads": args.threads}
                if M > 1:
                    rec["batch_invariant"] = invariant(lambda t: _same_weights(name, t, raws[0], type_name), x)
                records.append(rec)
                print(json.dumps(rec), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "records": records}, f, indent=1)
    return 0


def _same_weights(name: str, x: torch.Tensor, raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """The candidate's product with one fixed matrix (the invariance check compares calls)."""
    if name.startswith("blockdot"):
        return blockdot.matmul(x, raw, type_name, N)
    w = dequantize(raw, type_name, N, K)
    if "bfloat16" in name:
        return F.linear(x.bfloat16(), w.bfloat16()).float()
    return F.linear(x, w)


if __name__ == "__main__":
    sys.exit(main())
