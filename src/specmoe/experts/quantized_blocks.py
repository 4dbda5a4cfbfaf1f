"""A quantized safetensors checkpoint's int8 / int4 experts (compressed-tensors w8a16 /
w4a16, as llm-compressor and `specmoe quantize` write them) and fp4 ones (GPT-OSS's
MXFP4) multiplied as ggml blocks by the block kernels, where the engine computes as
stored (the CPU's default: kernels/blockdot.py, activations rounded to 8 bits per block
of 32 as for a GGUF file).

The re-encoding is exact, or not done:
- an int8 matrix is Q8_0 rows: each block of 32 columns the same 32 codes, its scale its
  group's (or row's) in float16;
- an int4 matrix is Q4_0 blocks: the blob holds q + 8 two to a byte, the even column in
  the low nibble (base/quantization.py); Q4_0 holds value j of a block in byte j's low
  nibble and value j + 16 in its high one, as d * (nibble - 8);
- an fp4 matrix is MXFP4 blocks: its e8m0 exponent byte, then the block's e2m1 codes in
  Q4_0's nibble order (ggml's e2m1 table is doubled and its exponent halved: the same
  values); an exponent of 255 (not a number, by the OCP MX format) keeps the blob;
- only where every group holds whole blocks (`in` and the group size multiples of 32),
  and every int scale of the expert is a float16 number: checked as the expert enters its
  slot. A bfloat16 scale below 2^-17 or above 65504 is rounded by float16 (float32 scales
  almost always are: they are refused without looking, `refusal`); an expert with such a
  scale keeps its blob in the slot and is dequantized per call, as before.

The tiers store and a fetch moves the blob, unchanged; only a slot holds another layout:
the blocks of w_in (gate rows, then up rows) and w_out, the biases, and one byte saying
whether the slot holds those blocks or the expert's blob. `QuantizedBlocksFormat` has
`formats.ExpertFormat`'s interface (formats.expert_format builds it). Shapes: T tokens,
D hidden, I expert intermediate.
"""

from __future__ import annotations

import torch

from ..base.gguf_quants import row_bytes
from ..base.quantization import ExpertQuant, MatrixQuant
from ..base.quantized_tensors import SCALE_DTYPES, expand_scales
from ..base.specs import ExpertSpec
from ..kernels import blockdot
from ..kernels.packed import PackedMatrix
from ..model.layers import as_dtype
from ..model.moe import expert_forward
from .copy_layouts import BLOCK
from .kernels import ALIGN, aligned_sections

BLOCK_TYPES = {"int8": "Q8_0", "int4": "Q4_0", "fp4": "MXFP4"}
NAN_E8M0 = 255  # an e8m0 byte that is no power of two
HOLDS_BLOB, HOLDS_BLOCKS = 0, 1  # the slot's last section: what it holds


def refusal(quant: ExpertQuant) -> str | None:
    """Why these experts cannot be ggml blocks holding the same numbers, or None where they can
    (each expert's scales are still checked as it enters its slot)."""
    for name, m in (("w_in", quant.w_in), ("w_out", quant.w_out)):
        if m.codes == "fp8":
            return "fp8 codes: no ggml block holds e4m3 values exactly"
        if m.codes not in BLOCK_TYPES:
            return f"{m.codes} codes: not re-encoded as ggml blocks (only int8, int4 and fp4 are)"
        if m.cols % BLOCK or min(m.group, m.cols) % BLOCK:
            return f"{name}'s groups of {min(m.group, m.cols)} of {m.cols} columns are not whole blocks of {BLOCK}"
        if m.codes == "fp4":
            if m.scale_dtype != "e8m0" or m.group != BLOCK:
                return f"fp4 codes with {m.scale_dtype} scales per {m.group} columns: MXFP4 blocks hold an e8m0 " \
                       f"exponent per {BLOCK}"
        elif m.scale_dtype not in ("bfloat16", "float16"):
            return f"{m.scale_dtype} scales: a block's float16 scale would round them"
    return None


def float16_scales(scales: torch.Tensor) -> torch.Tensor | None:
    """The scales in float16 where float16 holds every one of them exactly (no rounding,
    overflow or loss in its subnormals), else None."""
    half = scales.to(torch.float16)
    return half if torch.equal(half.to(scales.dtype), scales) else None


def block_scales(scales: torch.Tensor, m: MatrixQuant) -> torch.Tensor | None:
    """A matrix's scales as its blocks hold them, or None where they cannot hold them all:
    e8m0 exponents as they are (but the byte that is not a number), else float16 scales."""
    if m.codes == "fp4":
        return None if bool((scales == NAN_E8M0).any()) else scales
    return float16_scales(scales)


def matrix_blocks(codes: torch.Tensor, scales: torch.Tensor, m: MatrixQuant, out: torch.Tensor) -> None:
    """One matrix's blob codes (uint8 section) and its block scales [scale rows, column
    groups] (`block_scales`) as Q8_0 / Q4_0 / MXFP4 rows, written into `out` (uint8
    [rows * row_bytes]): each block its scale's bytes (float16, or the e8m0 byte), then its
    codes: int8 as they are; int4 (stored as q + 8, which Q4_0 keeps) and fp4 (e2m1 codes,
    which MXFP4 keeps) in Q4_0's nibble order. Shuffled by blockdot.c's packer: in torch,
    a code a byte, a real-size int4 expert took 20 ms (0.3 GB/s) on the transfer thread,
    four times as long as the disk took to read it."""
    blocks = m.rows * m.cols // BLOCK
    heads = expand_scales(scales, (m.block_rows, m.group // BLOCK), (m.rows, m.cols // BLOCK)).contiguous()
    blockdot.pack_blocks(codes.contiguous(), heads.view(torch.uint8).view(blocks, -1), m.bits, out)


class QuantizedBlocksFormat:
    """`dequantizing`: the formats.QuantizedFormat of the same experts: it reads their blobs,
    and computes an expert whose scales its blocks cannot hold (its slot keeps the blob)."""

    storage_dtype = slot_dtype = torch.uint8
    converts = True

    def __init__(self, spec: ExpertSpec, quant: ExpertQuant, dequantizing):
        self.spec, self.quant, self.dequantizing, self.numel = spec, quant, dequantizing, dequantizing.numel
        self.name = dequantizing.name  # the expert file holds the same blobs
        self.types = {"w_in": BLOCK_TYPES[quant.w_in.codes], "w_out": BLOCK_TYPES[quant.w_out.codes]}
        self.slot_sections = _slot_sections(quant, self.types, self.numel)
        offset, n = self.slot_sections["holds"]
        self.slot_numel = -(-(offset + n) // ALIGN) * ALIGN
        self.one_call = spec.gated and spec.activation == "silu" and not quant.bias  # blockdot.swiglu
        encoding = "/".join(dict.fromkeys(self.types.values()))
        kept = "with an exponent that is not a number" if quant.w_in.codes == "fp4" else \
            "whose scales float16 does not hold"
        self.kernels = {f"{quant.scheme} experts": f"as stored, re-encoded exactly as {encoding} blocks in their slots "
                                                   f"(an expert {kept}: dequantized per call): "
                                                   f"{blockdot.library().describe()}"}

    @property
    def nbytes(self) -> int:
        return self.numel

    @property
    def slot_bytes(self) -> int:
        return self.slot_numel

    def read(self, ckpt, layer: int, expert: int) -> torch.Tensor:
        return self.dequantizing.read(ckpt, layer, expert)

    def section(self, slot: torch.Tensor, name: str) -> torch.Tensor:
        offset, n = self.slot_sections[name]
        return slot[offset:offset + n]

    def prepare(self, stored: torch.Tensor, slot: torch.Tensor) -> None:
        """The expert's blocks into `slot` where they hold its scales, else its blob."""
        q, blob = self.quant, self.dequantizing
        matrices = (("w_in", q.w_in), ("w_out", q.w_out))
        scales = {name: block_scales(blob.section(stored, f"{name}.scales").view(SCALE_DTYPES[m.scale_dtype])
                                     .view(m.scale_shape), m) for name, m in matrices}
        if any(s is None for s in scales.values()):
            slot[:self.numel].copy_(stored)
            self.section(slot, "holds").fill_(HOLDS_BLOB)
            return
        for name, m in matrices:
            matrix_blocks(blob.section(stored, f"{name}.codes"), scales[name], m, self.section(slot, name))
        if q.bias:
            for name in ("b_in", "b_out"):
                self.section(slot, name).copy_(blob.section(stored, name))
        self.section(slot, "holds").fill_(HOLDS_BLOCKS)

    def holds_blocks(self, slot: torch.Tensor) -> bool:
        return int(slot[self.slot_sections["holds"][0]]) == HOLDS_BLOCKS

    def forward(self, slot: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The expert on x [T, D] from its slot, in x's dtype: its blocks multiplied by the
        block kernels (a gated SiLU expert in one call), or its blob dequantized."""
        if not self.holds_blocks(slot):
            return self.dequantizing.forward_stored(slot[:self.numel], x)
        if self.one_call:
            return as_dtype(blockdot.swiglu(x, *self._gate_up_down(slot), self.spec.inter), x.dtype)
        q = self.quant
        w_in, w_out = (PackedMatrix.of(self.section(slot, name), self.types[name], m.rows, m.cols)
                       for name, m in (("w_in", q.w_in), ("w_out", q.w_out)))
        b_in = b_out = None
        if q.bias:
            b_in, b_out = (self.section(slot, name).view(torch.float32) for name in ("b_in", "b_out"))
        return as_dtype(expert_forward(self.spec, x.float(), w_in.linear, w_out.linear, b_in, b_out), x.dtype)

    def forward_stored(self, stored: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """From the blob (the host tier computing it): re-encoded for the call, so that the
        expert computes the numbers its slot would."""
        slot = torch.empty(self.slot_numel, dtype=torch.uint8)
        self.prepare(stored, slot)
        return self.forward(slot, x)

    def forward_token(self, slots: list[torch.Tensor], weights: list[float], x: torch.Tensor) -> torch.Tensor | None:
        """Batch 1: sum over k of weights[k] * expert k on x [1, D], added in the order given
        (as moe.one_token adds them), in one kernel call (blockdot.experts); None where
        these experts are computed one at a time."""
        if not self.one_call or not all(self.holds_blocks(slot) for slot in slots):
            return None
        y = blockdot.experts(x, [self._gate_up_down(slot) for slot in slots], weights, self.spec.inter)
        return as_dtype(y, x.dtype)

    def _gate_up_down(self, slot: torch.Tensor) -> tuple[tuple[torch.Tensor, str], ...]:
        w_in, half = self.section(slot, "w_in"), self.spec.inter * row_bytes(self.types["w_in"], self.spec.hidden)
        return (w_in[:half], self.types["w_in"]), (w_in[half:], self.types["w_in"]), \
            (self.section(slot, "w_out"), self.types["w_out"])

    def scratch_bytes(self, dtype: torch.dtype) -> int:
        """An expert kept as its blob dequantizes one matrix at a time."""
        return self.dequantizing.scratch_bytes(dtype)


def _slot_sections(quant: ExpertQuant, types: dict[str, str], blob_bytes: int) -> dict[str, tuple[int, int]]:
    """name -> (offset, bytes) in a slot: the blocks of w_in and w_out and the biases, each at
    a multiple of ALIGN bytes, then the byte saying what the slot holds, after the blocks and
    after the blob (which a slot may hold instead, from offset 0)."""
    matrices = (("w_in", quant.w_in), ("w_out", quant.w_out))
    sizes = [(name, m.rows * row_bytes(types[name], m.cols)) for name, m in matrices]
    if quant.bias:
        sizes += [("b_in", 4 * quant.w_in.rows), ("b_out", 4 * quant.w_out.rows)]
    out = aligned_sections(sizes)
    end = max(offset + n for offset, n in out.values())
    out["holds"] = (max(-(-end // ALIGN) * ALIGN, -(-blob_bytes // ALIGN) * ALIGN), 1)
    return out
