"""The layouts a draft copy's matrix is multiplied in (experts/quant.py's device_layout
chooses): each holds the QuantizedMatrix's codes and float16 scales, so the same weights.

- `Int4KernelMatrix`, `Int8KernelMatrix`: torch's fused CPU kernels' layouts, multiplied
  in bfloat16 where kernels.py let them run;
- `BlockMatrix`: ggml Q8_0 / Q4_0 rows, multiplied by specmoe's block kernels
  (kernels/blockdot.py) with 8-bit activations, as a GGUF file's weights are.

`from_quantized` takes any QuantizedMatrix (its data, scales, bits, group, in_features).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base.errors import SpecMoEError
from ..base.gguf_quants import row_bytes
from ..kernels import blockdot
from ..kernels.packed import PackedMatrix
from ..model.layers import as_dtype
from .kernels import aligned, aligned_stack, int4_mm, int4_pack, int8_mm, stack_bytes
from .packing import unpack

# torch's fused weight-only matmuls on the CPU (kernels.py chooses where they may run):
# int4, the kernel behind gpt-fast's int4, W = (q_u - 8) * s + z per group; int8, x times
# int8 codes with one bfloat16 scale per output row (the int8 format's grid). Both take
# bfloat16 activations, run without a dequantized copy, and are several times faster than
# dequantizing a small expert per call.


@dataclass(frozen=True)
class Int4KernelMatrix:
    """An int4 QuantizedMatrix in the layout of torch's CPU int4 matmul, each expert's
    tensors 64-byte aligned."""

    packed: torch.Tensor  # uint8 [..., out, in / 2], torch's CPU int4pack layout
    scales_zeros: torch.Tensor  # bfloat16 [..., in / group, out, 2]: (scale, 0)
    group: int
    in_features: int

    @classmethod
    def from_quantized(cls, q) -> Int4KernelMatrix:
        out = q.out_features
        lead = q.scales.shape[:-2]
        codes = unpack(q.data, 4, out * q.in_features).reshape(-1, out, q.in_features).to(torch.int32)
        packed = torch.stack([int4_pack(c) for c in codes])
        scales = q.scales.to(torch.bfloat16).transpose(-1, -2)  # [..., groups, out]
        scales_zeros = torch.stack([scales, torch.zeros_like(scales)], dim=-1)
        packed, scales_zeros = packed.reshape(*lead, *packed.shape[1:]), scales_zeros.contiguous()
        return cls(*(aligned_stack(t) if lead else aligned(t) for t in (packed, scales_zeros)), q.group, q.in_features)

    @property
    def nbytes(self) -> int:
        stacked = self.packed.dim() == 3
        return stack_bytes(self.packed, stacked) + stack_bytes(self.scales_zeros, stacked)

    def select(self, index) -> Int4KernelMatrix:
        return Int4KernelMatrix(self.packed[index], self.scales_zeros[index], self.group, self.in_features)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return as_dtype(int4_mm(as_dtype(x, torch.bfloat16), self.packed, self.group, self.scales_zeros), x.dtype)

    def scratch_bytes(self, dtype: torch.dtype) -> int:
        return 0


@dataclass(frozen=True)
class Int8KernelMatrix:
    """An int8 QuantizedMatrix in the layout of torch's CPU int8 matmul: the same codes,
    the row scales in bfloat16, each expert's codes and scales 64-byte aligned (`aligned_stack`)."""

    codes: torch.Tensor  # int8 [..., out, in]
    scales: torch.Tensor  # bfloat16 [..., out]
    in_features: int

    @classmethod
    def from_quantized(cls, q) -> Int8KernelMatrix:
        stacked = q.data.dim() == 3
        codes, scales = q.data, q.scales.to(torch.bfloat16)[..., 0]
        return cls(*(aligned_stack(t) if stacked else aligned(t) for t in (codes, scales)), q.in_features)

    @property
    def nbytes(self) -> int:
        stacked = self.codes.dim() == 3
        return stack_bytes(self.codes, stacked) + stack_bytes(self.scales, stacked)

    def select(self, index) -> Int8KernelMatrix:
        return Int8KernelMatrix(self.codes[index], self.scales[index], self.in_features)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return as_dtype(int8_mm(as_dtype(x, torch.bfloat16), self.codes, self.scales), x.dtype)

    def scratch_bytes(self, dtype: torch.dtype) -> int:
        return 0


# --- the same codes as ggml blocks, for specmoe's own block kernels ------------------------------

BLOCK = 32  # values per Q8_0 / Q4_0 block, each with one float16 scale
BLOCK_TYPES = {8: "Q8_0", 4: "Q4_0"}


def block_type(bits: int, in_features: int, group: int, device) -> str | None:
    """The ggml block type a copy of this format (groups of `group` along `in_features`)
    can be re-encoded in exactly on `device`, or None: on the CPU where the block kernels
    run, for int8 and int4 whose groups hold whole blocks."""
    if bits not in BLOCK_TYPES or in_features % BLOCK or group % BLOCK:
        return None
    if torch.device(device).type != "cpu" or not blockdot.available():
        return None
    return BLOCK_TYPES[bits]


@dataclass(frozen=True)
class BlockMatrix:
    """An int8 or int4 QuantizedMatrix as ggml Q8_0 / Q4_0 rows: the same codes and float16
    scales (a block's scale is its row's or group's), so the same weights, multiplied by
    blockdot.c with the activations rounded to 8 bits per block as llama.cpp does (a draft
    only proposes tokens: verification decides them)."""

    raw: torch.Tensor  # uint8 [..., out * row_bytes]
    type_name: str
    out_features: int
    in_features: int

    @classmethod
    def from_quantized(cls, q) -> BlockMatrix:
        out, n = q.out_features, q.in_features
        lead = q.scales.shape[:-2]
        scales = q.scales.repeat_interleave(q.group // BLOCK, dim=-1)  # [..., out, n / 32]
        if q.bits == 8:
            codes = q.data.view(torch.uint8).reshape(*lead, out, n // BLOCK, BLOCK)
        else:
            codes = unpack(q.data, 4, out * n).reshape(*lead, out, n // BLOCK, BLOCK)
        return cls(block_rows(scales, codes, q.bits), BLOCK_TYPES[q.bits], out, n)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def select(self, index) -> BlockMatrix:
        return BlockMatrix(self.raw[index].contiguous(), self.type_name, self.out_features, self.in_features)

    def _rows(self) -> PackedMatrix:
        """One matrix's rows as the model's own GGUF matrices hold them."""
        return PackedMatrix.of(self.raw, self.type_name, self.out_features, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._rows().dequantize(dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return as_dtype(self._rows().linear(x), x.dtype)

    def scratch_bytes(self, dtype: torch.dtype) -> int:
        return 0


def block_rows(scales: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Q8_0 / Q4_0 rows, uint8 [..., out * row_bytes], from each block's float16 scale
    [..., out, in / 32] and its 32 codes as bytes [..., out, in / 32, 32]: int8 codes as
    they are, int4 codes unsigned (q + 8, as Q4_0 holds them: d * (nibble - 8))."""
    if scales.dtype != torch.float16:  # a block's scale is float16: any other dtype would be rounded here
        raise SpecMoEError(f"internal: ggml block scales must be float16, not {scales.dtype}")
    head = scales.contiguous().view(torch.uint8).reshape(*codes.shape[:-1], 2)
    # Q4_0: value j of a block in byte j's low nibble, value j + 16 in its high one
    body = codes if bits == 8 else codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([head, body], dim=-1).reshape(*codes.shape[:-3], -1).contiguous()


def block_bytes(bits: int, out_features: int, in_features: int) -> int:
    return out_features * row_bytes(BLOCK_TYPES[bits], in_features)
