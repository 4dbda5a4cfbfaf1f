"""Bit-packing of the quantized draft copies' codes (quant.py): codes are unsigned, < 2**bits.

Planar layouts, so that unpacking writes long contiguous runs (an interleaving stack
of two nibbles is ~10x slower on the CPU than the shifts themselves):
  int4: n codes -> n/2 bytes, byte i = code i | code (i + n/2) << 4   (two per byte)
  int3: n codes -> 3 planes of n/8 bytes; word i = plane0[i] | plane1[i] << 8 | plane2[i] << 16
        holds codes i, i + n/8, ..., i + 7n/8, three bits each
n is padded to a multiple of 8 (codes 0) before packing.
"""

from __future__ import annotations

import torch


def packed_size(n: int, bits: int) -> int:
    """Bytes of n codes: int8 one each; packed modes 8 codes in `bits` bytes."""
    return n if bits == 8 else -(-n // 8) * bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., n] -> packed uint8 [..., packed_size(n, bits)]."""
    pad = -codes.shape[-1] % 8
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    if bits == 4:
        lo, hi = codes.chunk(2, dim=-1)
        return (lo | (hi << 4)).contiguous()
    planes = codes.reshape(*codes.shape[:-1], 8, -1).to(torch.int32)  # [..., 8, n/8]
    word = torch.zeros_like(planes[..., 0, :])
    for j in range(8):
        word |= planes[..., j, :] << (bits * j)
    out = torch.stack([(word >> (8 * k)) & 0xFF for k in range(bits)], dim=-2)  # [..., bits, n/8]
    return out.to(torch.uint8).reshape(*codes.shape[:-1], -1).contiguous()


def unpack(packed: torch.Tensor, bits: int, n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Inverse of `pack`: the first n codes [..., n], converted to `dtype` on the way out."""
    lead = packed.shape[:-1]
    m = packed.shape[-1] * 8 // bits  # padded count
    out = torch.empty(*lead, m, dtype=dtype, device=packed.device)
    if bits == 4:
        half = m // 2
        out[..., :half].copy_(packed & 0x0F)
        out[..., half:].copy_(packed >> 4)
    else:
        planes = packed.reshape(*lead, bits, m // 8).to(torch.int32)
        word = planes[..., 0, :]
        for k in range(1, bits):
            word = word | (planes[..., k, :] << (8 * k))
        mask = (1 << bits) - 1
        view = out.view(*lead, 8, m // 8)
        for j in range(8):
            view[..., j, :].copy_((word >> (bits * j)) & mask)
    return out[..., :n]
