"""The self-check of torch's fused CPU kernels, run as a child process by kernels.py.

A kernel that segfaults takes its process with it, so the check runs here, apart from
the engine, and reports case by case on stdout (one JSON object a line):
  {"begin": i}               before case i runs (a crash leaves this as the last line)
  {"case": i, "error": e}    e: the largest relative L2 error over the row counts, or null
                             when the result was not finite
Each case multiplies random weights of the case's shape, in fresh (aligned) storage, at
several row counts, and compares with the same weights dequantized to float32 and
multiplied by F.linear.

usage: python kernel_check.py '{"threads": 2, "cases": [{"kernel": "int8", "out": 64, "in": 64}, ...]}'

Imports only torch, so that it starts quickly and checks the kernel, not specmoe.
"""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.nn.functional as F

# Row counts a draft hands one matrix: 1 (batch 1), small batches, and enough rows to take
# the kernels' blocked paths (the crashes reported began at 2 and 4 rows).
ROWS = (1, 2, 4, 7, 16, 64)


def int8_case(out: int, inp: int, gen: torch.Generator):
    """(the fused call, the float32 weights it stands for): int8 codes, a bfloat16 scale per row."""
    codes = torch.randint(-128, 128, (out, inp), dtype=torch.int8, generator=gen)
    scales = (torch.rand(out, generator=gen) * 0.02 + 0.01).to(torch.bfloat16)
    weights = codes.float() * scales.float()[:, None]
    return (lambda x: torch.ops.aten._weight_int8pack_mm(x, codes, scales)), weights


def int4_case(out: int, inp: int, group: int, gen: torch.Generator):
    """The int4 kernel computes (q - 8) * s + z per group; here z = 0, as the engine uses it."""
    codes = torch.randint(0, 16, (out, inp), dtype=torch.int32, generator=gen)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales = (torch.rand(inp // group, out, generator=gen) * 0.02 + 0.01).to(torch.bfloat16)
    scales_zeros = torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()
    weights = (codes.float() - 8) * scales.float().t().repeat_interleave(group, dim=1)
    return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)), weights


def relative_error(fused, weights: torch.Tensor, gen: torch.Generator, rows=ROWS) -> float:
    """The largest relative L2 error of `fused` (bfloat16 rows in) against F.linear in float32;
    inf where the kernel's output is not finite."""
    worst = 0.0
    for m in rows:
        x = torch.randn(m, weights.shape[1], generator=gen).to(torch.bfloat16)
        reference = F.linear(x.float(), weights)
        err = float((fused(x).float() - reference).norm() / reference.norm().clamp_min(1e-30))
        if not math.isfinite(err):
            return math.inf
        worst = max(worst, err)
    return worst


def check(case: dict) -> float:
    gen = torch.Generator().manual_seed(case["out"] * 7919 + case["in"])
    if case["kernel"] == "int8":
        fused, weights = int8_case(case["out"], case["in"], gen)
    else:
        fused, weights = int4_case(case["out"], case["in"], case["group"], gen)
    return relative_error(fused, weights, gen)


def main(argv: list[str]) -> None:
    request = json.loads(argv[1])
    torch.set_num_threads(int(request["threads"]))
    for i, case in enumerate(request["cases"]):
        print(json.dumps({"begin": i}), flush=True)
        err = check(case)
        print(json.dumps({"case": i, "error": err if math.isfinite(err) else None}), flush=True)


if __name__ == "__main__":
    main(sys.argv)
