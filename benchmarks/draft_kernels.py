"""The layouts a draft's int8 / int4 expert copy can be multiplied in on the CPU, timed on
the real-size model's expert matrices (gate and up 4096 x 2048, down 2048 x 2048), at the
rows a draft pass gives one expert (1, 4, 16, 64). Eight distinct copies in rotation so that
no product finds its weights in cache; rounds interleaved, each layout's after 0.3 s of its
own calls (torch's thread pool spins after its calls and would take the cores from the
block kernels' threads), the median reported with the lowest and highest round.

    python benchmarks/draft_kernels.py --json draft-kernels.json     # docs/KERNELS.md's draft table

Layouts (experts/quant.py; the same codes and float16 scales in each, so the same weights):
- ggml blocks (int8 as Q8_0, int4 as Q4_0) through specmoe's block kernels, on their own
  threads with torch's on one, as the engine runs them;
- torch's fused weight-only kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`,
  bfloat16 activations) where their self-check passes on this machine;
- dequantized per call, then torch's float32 matmul (the portable format).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from specmoe.experts import kernels
from specmoe.experts.quant import BlockMatrix, Int4KernelMatrix, Int8KernelMatrix, kernel_shape, quantize_matrix
from specmoe.kernels import blockdot
from specmoe.kernels.cpu import usable_cores

SHAPES = ((4096, 2048), (2048, 2048))  # (out, in): an expert's gate and up rows, its down matrix
ROWS = (1, 4, 16, 64)
COPIES = 8


def layouts(bits: int, out: int, inp: int, gen) -> dict:
    copies = [quantize_matrix(torch.randn(out, inp, generator=gen) * 0.02, bits) for _ in range(COPIES)]
    found = {"blockdot blocks": [BlockMatrix.from_quantized(q) for q in copies],
             "dequantized per call + torch float32": copies}
    shape = kernel_shape(bits, out, inp)
    if kernels.choose([shape], "cpu")[shape].fused:
        fused = Int8KernelMatrix if bits == 8 else Int4KernelMatrix
        found["torch fused"] = [fused.from_quantized(q) for q in copies]
    return found


def one_round(matrices, x) -> float:
    warm = time.perf_counter()
    while time.perf_counter() - warm < 0.3:  # past the other thread pool's busy wait (it would take the cores)
        matrices[0].linear(x)
    start = time.perf_counter()
    for m in matrices:
        m.linear(x)
    return (time.perf_counter() - start) / len(matrices) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=usable_cores())
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", help="write the records here")
    args = p.parse_args(argv)
    blockdot.set_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    records = []
    for bits in (8, 4):
        for out, inp in SHAPES:
            found = layouts(bits, out, inp, gen)
            for M in ROWS:
                x = torch.randn(M, inp, generator=gen)
                times = {name: [] for name in found}
                for _ in range(args.rounds + 1):  # the first round warms caches and thread pools: dropped
                    for name, matrices in found.items():
                        torch.set_num_threads(1 if name.startswith("blockdot") else args.threads)
                        times[name].append(one_round(matrices, x))
                for name, t in times.items():
                    t = t[1:]
                    rec = {"copy": f"int{bits}", "out": out, "in": inp, "rows": M, "layout": name,
                           "ms": statistics.median(t), "ms_low": min(t), "ms_high": max(t),
                           "bytes": found[name][0].nbytes, "threads": args.threads}
                    records.append(rec)
                    print(json.dumps(rec), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
