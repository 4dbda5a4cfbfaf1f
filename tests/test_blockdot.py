"""The block kernels (kernels/blockdot.c): every GGUF block type multiplied as stored, exact
up to float32 rounding given the 8-bit activations, the same bits for a row however many
rows share the call, on either code path and thread count; and a build that computes
something else is refused by the self-check before the engine loads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specmoe.base.errors import SpecMoEError
from specmoe.base.gguf_quants import dequantize
from specmoe.kernels import blockdot, blockdot_check
from specmoe.kernels.cpu import usable_cores
from specmoe.kernels.packed import PackedMatrix

pytestmark = pytest.mark.skipif(not blockdot.available(), reason=f"block kernels unavailable: {blockdot.library().why}")

TYPES = blockdot.TYPES
PATHS = [False, True] if blockdot.library().simd else [False]


def weights(type_name, rows, cols, seed=0):
    return blockdot_check.random_blocks(type_name, rows, cols, torch.Generator().manual_seed(seed))


def width(type_name):
    return 768 if type_name.endswith("_K") else 288  # three K-quant super-blocks; nine 32-blocks (a partial chunk)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("simd", PATHS, ids=lambda s: "avx512" if s else "portable")
def test_each_type_is_the_dequantized_product_of_the_rounded_activations(type_name, simd):
    N, K = 40, width(type_name)
    raw = weights(type_name, N, K)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1)) * 3
    want = blockdot_check.activations_reference(x, type_name) @ dequantize(raw, type_name, N, K).double().T
    got = blockdot.matmul(x, raw, type_name, N, simd=simd)
    assert float((got.double() - want).norm() / want.norm()) < 1e-6
    # and within 8-bit rounding of the float32 product (what --dtype float32 computes)
    exact = x.double() @ dequantize(raw, type_name, N, K).double().T
    assert float((got.double() - exact).norm() / exact.norm()) < 2e-2


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("simd", PATHS, ids=lambda s: "avx512" if s else "portable")
def test_a_row_gives_the_same_bits_alone_and_among_up_to_1088_rows(type_name, simd):
    N, K = 24, width(type_name)
    raw = weights(type_name, N, K, seed=2)
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(1088, K, generator=gen)
    alone = torch.cat([blockdot.matmul(rows[i:i + 1], raw, type_name, N, simd=simd) for i in (0, 1, 700, 1087)])
    for m in (2, 3, 16, 17, 64, 272, 1088):
        batch = torch.cat([rows[:m - 1], rows[1087:]]) if m < 1088 else rows
        got = blockdot.matmul(batch, raw, type_name, N, simd=simd)
        assert torch.equal(got[0], alone[0]) and torch.equal(got[-1], alone[3])
        if m > 2:  # row 1 is in the batch
            assert torch.equal(got[1], alone[1])
    assert torch.equal(blockdot.matmul(rows, raw, type_name, N, simd=simd)[700], alone[2])


@pytest.mark.skipif(not blockdot.library().simd, reason="this CPU has no AVX-512 VNNI: only the portable path runs")
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [19, 3])  # 3 rows of whole chunks: the fused product (dotted in registers)
def test_the_avx512_and_portable_paths_give_the_same_bits(type_name, rows):
    N, K = 33, width(type_name) if rows > 4 else 512
    raw = weights(type_name, N, K, seed=4)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(5))
    assert torch.equal(blockdot.matmul(x, raw, type_name, N, simd=True), blockdot.matmul(x, raw, type_name, N, simd=False))


def test_the_thread_count_does_not_change_a_bit():
    N, K = 512, 2048  # large enough to be split between threads
    raw = weights("Q4_K", N, K, seed=6)
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(7))
    try:
        blockdot.set_threads(1)
        one = blockdot.matmul(x, raw, "Q4_K", N)
        blockdot.set_threads(3)
        three = blockdot.matmul(x, raw, "Q4_K", N)
    finally:
        blockdot.set_threads(torch.get_num_threads())
    assert torch.equal(one, three)


def test_a_packed_matrix_multiplies_and_looks_up_rows_as_its_parts_do():
    K = 256
    q, v = weights("Q4_K", 16, K, seed=8), weights("Q6_K", 8, K, seed=9)
    m = PackedMatrix.cat([PackedMatrix.of(q, "Q4_K", 16, K), PackedMatrix.of(v, "Q6_K", 8, K)])
    assert m.shape == (24, K) and m.encoding == "Q4_K/Q6_K" and m.nbytes == q.numel() + v.numel()
    x = torch.randn(3, K)
    assert torch.equal(m.linear(x), torch.cat([blockdot.matmul(x, q, "Q4_K", 16), blockdot.matmul(x, v, "Q6_K", 8)], 1))
    ids = torch.tensor([[3, 20], [0, 23]])
    assert torch.equal(m.take(ids), m.dequantize()[ids])
    same = PackedMatrix.cat([PackedMatrix.of(q, "Q4_K", 16, K), PackedMatrix.of(q, "Q4_K", 16, K)])
    assert len(same.parts) == 1 and same.rows == 32


def _build_from(source: str, tmp_path: Path) -> Path:
    src, out = tmp_path / "blockdot.c", tmp_path / "blockdot.so"
    src.write_text(source)
    cmd = [blockdot._compiler(), *blockdot.FLAGS, str(src), "-o", str(out), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True)
    return out


@pytest.mark.parametrize("mutation", [
    ("put32(ws, wm, g32, d, -128.0f * d);", "put32(ws, wm, g32, d, -127.0f * d);"),  # Q8_0's offset off by one code
    ("*m = q[j + 4] & 63;", "*m = q[j + 4] & 31;"),  # a Q4_K min loses its top bit
    ("if (n1 > n0) j->range(j, n0, n1);",  # both paths: one row's last bit depends on the batch
     "if (n1 > n0) { j->range(j, n0, n1); if (j->M > 8) j->y[(j->M - 1) * j->ldy + n0] *= 1.0000001f; }"),
    ("acc[c] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + c * K + k), acc[c]);",  # a router's product unfused
     "acc[c] = _mm512_add_ps(_mm512_mul_ps(xv, _mm512_loadu_ps(w + c * K + k)), acc[c]);"),
    ("for (int k = 1; k < n; k++) acc = acc + ys[k * M * D + i] * weights[k];",  # experts added with one rounding
     "for (int k = 1; k < n; k++) acc = fmaf(ys[k * M * D + i], weights[k], acc);"),
    ("s->start[s->n + 1] = s->start[s->n] + N;",  # a job of several products that skips a segment's last row
     "s->start[s->n + 1] = s->start[s->n] + N - (s->n > 0);"),
    ("u[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x88);",  # Q4_K's AVX-512 codes in value order, not slot order
     "u[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);"),
    ("s[lane_group(2 * h, l)], f[h][l]);",  # the portable path's block pairs scaled by another group's scale
     "s[lane_group(h, l)], f[h][l]);"),
], ids=["q8_0-offset", "q4_k-min", "batch-dependent", "f32-unfused", "experts-fused-sum", "segment-short",
        "q4_k-value-order", "portable-pair-scale"])
def test_the_self_check_refuses_a_build_that_computes_something_else(mutation, tmp_path):
    source = blockdot.SOURCE.read_text()
    assert mutation[0] in source
    lib = _build_from(source.replace(mutation[0], mutation[1]), tmp_path)
    run = subprocess.run([sys.executable, "-m", "specmoe.kernels.blockdot_check", str(lib)],
                         capture_output=True, text=True, timeout=120)
    verdict = run.stdout.strip().splitlines()[-1]
    assert '"ok": false' in verdict, verdict


def test_the_self_check_passes_the_shipped_source(tmp_path):
    lib = _build_from(blockdot.SOURCE.read_text(), tmp_path)
    result = blockdot_check.self_check(str(lib))
    assert result["ok"], result["why"]


def test_rms_norm_is_llama_cpps_and_gives_a_row_the_same_bits_alone_and_among_others():
    gen = torch.Generator().manual_seed(15)
    x, w = torch.randn(17, 2048, generator=gen) * 3, torch.randn(2048, generator=gen)
    full = blockdot.rms_norm(x, w, 1e-5)
    x64 = x.double()
    want = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert ((full.double() - want).abs().max() / want.abs().max()) < 1e-6
    assert torch.equal(full[9], blockdot.rms_norm(x[9:10], w, 1e-5)[0])
    assert torch.equal(blockdot.rms_norm(x, None, 1e-5) * w, full)  # x * scale, then times w, each rounded


def test_an_unknown_setting_is_a_one_line_error_naming_the_values():
    env = {**os.environ, "SPECMOE_BLOCKDOT": "fast"}
    run = subprocess.run([sys.executable, "-c", "from specmoe.kernels import blockdot; blockdot.library()"],
                         capture_output=True, text=True, env=env)
    assert run.returncode != 0 and "SPECMOE_BLOCKDOT='fast' is not understood" in run.stderr
    assert "'on'" in run.stderr and "'off'" in run.stderr


def test_off_computes_gguf_weights_dequantized():
    env = {**os.environ, "SPECMOE_BLOCKDOT": "off"}
    code = "from specmoe.kernels import blockdot; print(blockdot.as_stored('auto', 'cpu'), blockdot.library().why)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split()[0] == "False" and "SPECMOE_BLOCKDOT=off" in out


def test_the_reference_encoding_is_asked_for_by_float32():
    assert blockdot.as_stored("auto", "cpu") and not blockdot.as_stored("float32", "cpu")
    assert not blockdot.as_stored("auto", "meta")


def test_usable_cores_follows_the_affinity_mask():
    code = "import os; from specmoe.kernels.cpu import usable_cores; os.sched_setaffinity(0, {0}); print(usable_cores())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("Q4_0", "Q4_0", "Q5_1")])
def test_a_fused_expert_is_its_three_products_and_the_same_bits_alone_or_in_a_batch(types):
    D, I = 512, 768 if types[2].endswith("_K") else 288
    gen = torch.Generator().manual_seed(10)
    gate, up = (blockdot_check.random_blocks(t, I, D, gen) for t in types[:2])
    down = blockdot_check.random_blocks(types[2], D, I, gen)
    x = torch.randn(9, D, generator=gen)
    y = blockdot.swiglu(x, (gate, types[0]), (up, types[1]), (down, types[2]), I)
    g, u = blockdot.matmul(x, gate, types[0], I), blockdot.matmul(x, up, types[1], I)
    want = blockdot.matmul(torch.nn.functional.silu(g) * u, down, types[2], D)
    assert float((y - want).norm() / want.norm()) < 1e-3  # silu in C and in torch round apart, then 8 bits
    alone = blockdot.swiglu(x[4:5], (gate, types[0]), (up, types[1]), (down, types[2]), I)
    assert torch.equal(alone[0], y[4])


@pytest.mark.parametrize("simd", PATHS, ids=lambda s: "avx512" if s else "portable")
def test_a_tokens_experts_in_one_call_are_its_experts_one_by_one_weighted_and_added_in_order(simd):
    """What batch-1 decoding computes in one call (the experts' rows as one job for the
    threads) has the bits of one swiglu call per expert, each times its weight, added in
    the order given (as moe.one_token adds them), at M = 1 and M = 3, for mixed encodings
    (K-quants with 256-wide activation blocks, Q8_0 with 32-wide ones, bfloat16 unrounded)."""
    D, I = 512, 768
    gen = torch.Generator().manual_seed(12)
    kinds = [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q4_K", "Q8_0"), ("BF16", "BF16", "BF16"), ("Q6_K", "BF16", "Q4_K")]

    def matrix(type_name, rows, cols):
        if type_name == "BF16":
            return torch.randn(rows, cols, generator=gen).bfloat16(), type_name
        return blockdot_check.random_blocks(type_name, rows, cols, gen), type_name

    experts = [(matrix(g, I, D), matrix(u, I, D), matrix(d, D, I)) for g, u, d in kinds]
    weights = torch.rand(len(kinds), generator=gen).tolist()
    for m in (1, 3):
        x = torch.randn(m, D, generator=gen)
        want = None
        for expert, w in zip(experts, torch.tensor(weights).unbind()):
            y = blockdot.swiglu(x, *expert, I, simd=simd) * w
            want = y if want is None else want + y
        got = blockdot.experts(x, experts, weights, I, simd=simd)
        assert torch.equal(got, want)
    # a bad type is refused, not computed
    with pytest.raises(SpecMoEError, match="do not compute"):
        blockdot.experts(x, [experts[0]], [1.0], I + 8)  # down's 776 inputs: not whole Q6_K blocks


@pytest.mark.parametrize("simd", PATHS, ids=lambda s: "avx512" if s else "portable")
def test_a_bfloat16_expert_in_one_call_is_its_bfloat16_products(simd):
    D, I = 256, 512
    gen = torch.Generator().manual_seed(13)
    gate, up, down = (torch.randn(r, c, generator=gen).bfloat16() for r, c in ((I, D), (I, D), (D, I)))
    x = torch.randn(5, D, generator=gen)
    y = blockdot.swiglu(x, (gate, "BF16"), (up, "BF16"), (down, "BF16"), I, simd=simd)
    h = torch.nn.functional.silu(blockdot.matmul_bf16(x, gate, I)) * blockdot.matmul_bf16(x, up, I)
    want = blockdot.matmul_bf16(h, down, D)
    assert float((y - want).norm() / want.norm()) < 1e-5  # silu in C and in torch round apart
    assert torch.equal(blockdot.swiglu(x[3:4], (gate, "BF16"), (up, "BF16"), (down, "BF16"), I, simd=simd)[0], y[3])
    # the activation's rows are 2I apart in the down product's input: every row, not only the first
    matrices = ((gate, "BF16"), (up, "BF16"), (down, "BF16"))
    assert all(torch.equal(blockdot.swiglu(x[m:m + 1], *matrices, I, simd=simd)[0], y[m]) for m in range(5))


@pytest.mark.parametrize("simd", PATHS, ids=lambda s: "avx512" if s else "portable")
def test_a_row_of_a_matrix_of_parts_and_of_an_expert_gives_the_same_bits_alone_and_among_up_to_1088(simd):
    """The calls that run several products as one job (a packed matrix's parts, an expert's
    gate, up, silu and down) are batch-invariant like the products they are made of."""
    D, I = 256, 512
    gen = torch.Generator().manual_seed(14)
    q, v = blockdot_check.random_blocks("Q4_K", 40, D, gen), blockdot_check.random_blocks("Q8_0", 24, D, gen)
    bf = torch.randn(8, D, generator=gen).bfloat16()
    parts = blockdot.Parts.of([(q, "Q4_K", 40), (v, "Q8_0", 24), (bf, "BF16", 8)], D)
    expert = ((blockdot_check.random_blocks("Q4_K", I, D, gen), "Q4_K"), (torch.randn(I, D, generator=gen).bfloat16(),
              "BF16"), (blockdot_check.random_blocks("Q6_K", D, I, gen), "Q6_K"))
    rows = torch.randn(1088, D, generator=gen)
    for f in (lambda x: blockdot.linear_parts(x, parts, simd=simd), lambda x: blockdot.swiglu(x, *expert, I, simd=simd)):
        alone = torch.cat([f(rows[i:i + 1]) for i in (0, 700, 1087)])
        for m in (2, 17, 272, 1088):
            got = f(torch.cat([rows[:m - 1], rows[1087:]]) if m < 1088 else rows)
            assert torch.equal(got[0], alone[0]) and torch.equal(got[-1], alone[2])
        assert torch.equal(f(rows)[700], alone[1])


@pytest.mark.parametrize("d", [32, 20])  # 20: the eight running sums' tail
def test_attention_gives_a_query_row_the_same_bits_alone_and_among_others(d):
    gen = torch.Generator().manual_seed(11)
    B, G, R, L = 3, 4, 6, 40
    q, k, v = (torch.randn(B, G, n, d, generator=gen) for n in (R, L, L))
    mask = torch.ones(B, 1, R, L, dtype=torch.bool).tril(L - R)  # row i sees keys up to L - R + i
    out = blockdot.attend(q, k, v, mask, 0.2)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2)
    assert (out - want).abs().max() < 1e-5
    # the keys read in place from a view (as from the KV cache) and from a copy
    alone = blockdot.attend(q[1:2, :, 2:3], k[1:2, :, :L - R + 3], v[1:2, :, :L - R + 3], None, 0.2)
    copied = blockdot.attend(q[1:2, :, 2:3], k[1:2, :, :L - R + 3].clone(), v[1:2, :, :L - R + 3].clone(), None, 0.2)
    assert torch.equal(alone[0, :, 0], out[1, :, 2]) and torch.equal(alone, copied)


@pytest.mark.skipif(not blockdot.library().simd, reason="this CPU has no AVX-512 VNNI: only the portable path runs")
@pytest.mark.parametrize("d", [32, 20])
def test_attention_on_the_avx512_and_portable_paths_gives_the_same_bits(d):
    gen = torch.Generator().manual_seed(13)
    B, G, R, L = 2, 3, 5, 70  # 70 keys: four vectors of 16 exponentials and a tail
    q, k, v = (torch.randn(B, G, n, d, generator=gen) * 4 for n in (R, L, L))
    mask = torch.ones(B, 1, R, L, dtype=torch.bool).tril(L - R)
    mask[1, :, :, 3:40] = False  # keys hidden in the middle of a run of 16
    k[1, :, 5], v[1, :, 5] = float("nan"), float("nan")  # a hidden key's row may hold anything
    paths = [blockdot.attend(q, k, v, mask, 0.3, simd=s) for s in (True, False)]
    assert torch.equal(paths[0], paths[1]) and not paths[0].isnan().any()
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.nan_to_num().double(), v.nan_to_num().double(),
                                                            attn_mask=mask, scale=0.3)
    assert (paths[0].double() - want).abs().max() < 2e-5  # float32 rounding (torch's own float32 attention: 3e-5)


@pytest.mark.parametrize("K", [2048, 40])  # 40: not whole vectors (the portable lanes on every path)
def test_bfloat16_weights_give_the_float32_product_and_a_row_the_same_bits_alone_and_among_others(K):
    gen = torch.Generator().manual_seed(14)
    w, x = torch.randn(48, K, generator=gen).bfloat16(), torch.randn(1088, K, generator=gen)
    full = blockdot.matmul_bf16(x[:19], w, 48)
    want = x[:19].double() @ w.double().T
    assert ((full - want).norm() / want.norm()) < 1e-6  # float32 rounding of the exact products only
    for m in (0, 5, 18):  # rows in blocks of four, and the tail
        assert torch.equal(full[m], blockdot.matmul_bf16(x[m:m + 1], w, 48)[0])
    assert torch.equal(full, blockdot.matmul_bf16(x[:19], w, 48, simd=False))
    alone = blockdot.matmul_bf16(x[:1], w, 48)[0]
    for rows in (2, 3, 16, 17, 64, 272, 1088):  # one row's bits inside calls of 2 to 1088 rows
        assert torch.equal(blockdot.matmul_bf16(x[:rows], w, 48)[0], alone), rows


@pytest.mark.parametrize("N, K", [(16, 2048), (18, 2048), (16, 40)])  # whole vectors and blocks of 4 rows, or not
def test_the_routers_float_product_gives_a_row_the_same_bits_alone_and_among_others_on_both_paths(N, K):
    gen = torch.Generator().manual_seed(12)
    w, x = torch.randn(N, K, generator=gen), torch.randn(272, K, generator=gen)
    full = blockdot.matmul_f32(x, w)
    assert (full - x @ w.T).abs().max() < 1e-3
    assert torch.equal(full[100], blockdot.matmul_f32(x[100:101], w)[0])
    assert torch.equal(full, blockdot.matmul_f32(x, w, simd=False))
