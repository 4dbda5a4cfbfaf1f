"""The block kernels' self-check, run in a child process before a build is loaded into the
engine (blockdot.library): `python -m specmoe.kernels.blockdot_check LIB` multiplies random
blocks of every type through both paths of the build at LIB (AVX-512 VNNI and portable C),
and bfloat16 and float32 weights too, against float64 products, and prints its verdict as
one JSON line. A build that crashes here never reaches the engine."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch

from ..base.gguf_quants import BLOCKS, dequantize
from .blockdot import (TYPES, Library, Parts, act_width, experts, linear_parts, load, matmul, matmul_bf16,
                       matmul_f32)

CHECK_ROWS = (1, 3, 16)
TOLERANCE = 1e-4  # relative L2 error against the same 8-bit activations in float64: float32 rounding only


def activations_reference(x: torch.Tensor, type_name: str) -> torch.Tensor:
    """What blockdot.c multiplies `type_name` weights with for x [M, K] float32, as float64:
    each block of a row (`act_width`) rounded (half to even) to multiples of a scale: for
    blocks of 32, max|x| / 127 kept in float16 (where float16 holds it as a normal number);
    for blocks of 256, 1 / (127 / max|x|)."""
    M, K = x.shape
    width = act_width(type_name)
    blocks = torch.nn.functional.pad(x.float(), (0, -K % width)).view(M, -1, width)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv)
    if width == 256:
        scale = torch.where(amax > 0, 1.0 / inv, torch.zeros_like(inv))
    else:
        scale = amax / 127.0
        normal = (scale >= 2.0 ** -14) & (scale <= 65504.0)  # in float16 as llama.cpp keeps it, where it can be
        scale = torch.where(normal, scale.half().float(), scale)
    return (codes.double() * scale.double()).view(M, -1)[:, :K]


def random_blocks(type_name: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Random bytes laid out as `rows` x `cols` of the type, with sane float16 scales (random
    bytes there could be infinities) and, for MXFP4, exponents near 1."""
    values, nbytes = BLOCKS[type_name]
    raw = torch.randint(0, 256, (rows * cols // values, nbytes), dtype=torch.uint8, generator=gen)
    scales = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(type_name, ())
    for at in scales:
        half = (torch.rand(raw.shape[0], generator=gen) * 0.02 + 0.001).to(torch.float16)
        raw[:, at:at + 2] = half.view(torch.uint8).view(-1, 2)
    if type_name == "MXFP4":
        raw[:, 0] = torch.randint(120, 128, (raw.shape[0],), dtype=torch.uint8, generator=gen)
    return raw.reshape(-1)


def self_check(lib_path: str) -> dict:
    """Every type through both paths of the build at LIB, against float64 products of the
    blocks dequantized by base/gguf_quants.py and the activations as the build rounds
    them; the two paths must also agree bitwise, and a row among others must give the
    bits it gives alone."""
    lib = load(Path(lib_path))
    lib.smk_set_threads(2)
    simd = bool(lib.smk_simd())
    build = Library(lib, "under test", simd)
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for t in TYPES:
        for N, K in ((48, 512), (17, 768 if act_width(t) == 256 else 288)):
            raw = random_blocks(t, N, K, gen)
            w = dequantize(raw, t, N, K).double()
            for M in CHECK_ROWS:
                x = torch.randn(M, K, generator=gen)
                want = activations_reference(x, t) @ w.T
                paths = [matmul(x, raw, t, N, simd=s, build=build) for s in ((False, True) if simd else (False,))]
                for y in paths:
                    if not torch.isfinite(y).all():
                        return {"ok": False, "why": f"self-check: {t} gave a result that is not finite"}
                    err = float((y.double() - want).norm() / want.norm())
                    worst = max(worst, err)
                    if err > TOLERANCE:
                        return {"ok": False, "why": f"self-check: {t} N={N} K={K} M={M} relative error {err:.2g}"}
                if simd and not torch.equal(paths[0], paths[1]):
                    return {"ok": False, "why": f"self-check: {t} AVX-512 and portable paths differ"}
                if M > 1 and not torch.equal(paths[-1][-1], matmul(x[-1:], raw, t, N, build=build)[0]):
                    return {"ok": False, "why": f"self-check: {t} gives a row other bits among {M} rows than alone"}
    why = _check_float(build, simd, gen) or _check_composed(build, simd, gen)
    if why:
        return {"ok": False, "why": f"self-check: {why}"}
    return {"ok": True, "why": f"self-check passed (relative error at most {worst:.1e})"}


def _check_float(build: Library, simd: bool, gen: torch.Generator) -> str | None:
    """What is wrong with the build's products of bfloat16 and float32 weights (float64
    products of the same values, both paths, a row alone), or None."""
    products = {"BF16": lambda x, w, s: matmul_bf16(x, w, w.shape[0], simd=s, build=build),
                "F32": lambda x, w, s: matmul_f32(x, w, simd=s, build=build)}
    for (kind, product), (N, K) in itertools.product(products.items(), ((48, 512), (17, 40))):
        w = torch.randn(N, K, generator=gen).to(torch.bfloat16 if kind == "BF16" else torch.float32)
        for M in (*CHECK_ROWS, 6):
            x = torch.randn(M, K, generator=gen)
            want = x.double() @ w.double().T
            paths = [product(x, w, s) for s in ((False, True) if simd else (False,))]
            if any(float((y.double() - want).norm() / want.norm()) > TOLERANCE for y in paths):
                return f"{kind} N={N} K={K} M={M}: not the float64 product"
            if simd and not torch.equal(paths[0], paths[1]):
                return f"{kind}: the AVX-512 and portable paths differ"
            if M > 1 and not torch.equal(paths[-1][-1], product(x[-1:], w, None)[0]):
                return f"{kind} gives a row other bits among {M} rows than alone"
    return None


def _check_composed(build: Library, simd: bool, gen: torch.Generator) -> str | None:
    """What is wrong with the calls that run several products as one job (a matrix of parts
    in several encodings; gated SiLU experts, weighted and added), or None: each must give
    the bits of its products called one by one, on both paths, and an expert its products
    with silu between them."""
    D, I = 256, 512

    def matrix(t, rows, cols):
        return torch.randn(rows, cols, generator=gen).bfloat16() if t == "BF16" else random_blocks(t, rows, cols, gen)

    def product(x, w, t, rows, s):
        return matmul_bf16(x, w, rows, simd=s, build=build) if t == "BF16" else matmul(x, w, t, rows, simd=s, build=build)

    kinds = (("Q4_K", "Q4_K", "Q6_K"), ("BF16", "Q8_0", "BF16"))
    mats = [tuple((matrix(t, r, c), t) for t, (r, c) in zip(kind, ((I, D), (I, D), (D, I)))) for kind in kinds]
    for M, s in itertools.product((1, 3), (False, True) if simd else (False,)):
        x = torch.randn(M, D, generator=gen)
        parts = [(w, t, I) for w, t in mats[0][:2] + mats[1][:2]]
        whole = linear_parts(x, Parts.of(parts, D), simd=s, build=build)
        if not torch.equal(whole, torch.cat([product(x, w, t, I, s) for w, t, _ in parts], 1)):
            return f"a matrix of parts (M={M}) is not its parts' products"
        singles = []
        for (gate, gt), (up, ut), (down, dt) in mats:
            h = torch.nn.functional.silu(product(x, gate, gt, I, s)) * product(x, up, ut, I, s)
            got = experts(x, [((gate, gt), (up, ut), (down, dt))], [1.0], I, simd=s, build=build)
            want = product(h, down, dt, D, s).double()
            if float((got.double() - want).norm() / want.norm()) > 1e-3:  # silu in C and in torch round apart
                return f"a {gt}/{ut}/{dt} expert (M={M}) is not its products with silu between"
            singles.append(got)
        weights = torch.rand(2, generator=gen)
        both = experts(x, mats, weights.tolist(), I, simd=s, build=build)
        if not torch.equal(both, singles[0] * weights[0] + singles[1] * weights[1]):
            return f"two experts in one call (M={M}) are not each expert weighted and added in order"
    return None


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m specmoe.kernels.blockdot_check LIB")
    print(json.dumps(self_check(sys.argv[1])), flush=True)
