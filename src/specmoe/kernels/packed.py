"""A dense weight kept as its GGUF file stores it, multiplied by the block kernels.

`PackedMatrix` is W [rows, cols] as one or more row ranges, each in its own block type (a
fused q/k/v matrix of a Q4_K_M file holds Q4_K q and k rows and Q6_K v rows; a bfloat16
checkpoint's matrices are BF16, one value a "block"): the model's
`layers.linear` multiplies it like a float matrix, quantizing the activations once for
all parts. It holds the file's bytes and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..base.gguf_quants import dequantize, row_bytes
from . import blockdot


@dataclass(frozen=True)
class Part:
    type_name: str
    rows: int
    raw: torch.Tensor  # uint8, rows * row_bytes(type_name, cols), contiguous


@dataclass(frozen=True)
class PackedMatrix:
    parts: tuple[Part, ...]
    cols: int

    @classmethod
    def of(cls, raw: torch.Tensor, type_name: str, rows: int, cols: int) -> PackedMatrix:
        if raw.numel() != rows * row_bytes(type_name, cols):
            raise ValueError(f"{raw.numel()} bytes are not a {rows}x{cols} {type_name} matrix")
        return cls((Part(type_name, rows, raw.contiguous().reshape(-1)),), cols)

    @classmethod
    def cat(cls, matrices: list[PackedMatrix]) -> PackedMatrix:
        """Rows of each matrix in turn (torch.cat of their rows); neighbouring parts of one
        type become one."""
        parts: list[Part] = []
        for m in matrices:
            for p in m.parts:
                if parts and parts[-1].type_name == p.type_name:
                    last = parts.pop()
                    p = Part(p.type_name, last.rows + p.rows, torch.cat([last.raw, p.raw]))
                parts.append(p)
        return cls(tuple(parts), matrices[0].cols)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return sum(p.raw.numel() for p in self.parts)

    @property
    def encoding(self) -> str:
        return "/".join(dict.fromkeys(p.type_name for p in self.parts))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, cols] -> x W^T [T, rows] in float32 (activations rounded to 8 bits per block, as
        each part's type is multiplied, a BF16 part's not at all: blockdot.py), in one call."""
        lead, flat = x.shape[:-1], x.reshape(-1, self.cols)
        return blockdot.linear_parts(flat, self.kernel_parts).reshape(*lead, self.rows)

    @cached_property
    def kernel_parts(self) -> blockdot.Parts:
        """The parts as the kernels take them, made once (on a frozen instance: its __dict__)."""
        return blockdot.Parts.of([(p.raw, p.type_name, p.rows) for p in self.parts], self.cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([dequantize(p.raw, p.type_name, p.rows, self.cols, dtype) for p in self.parts])

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized to float32 (an embedding lookup): [*ids.shape, cols]."""
        flat = ids.reshape(-1)
        out = torch.empty(flat.numel(), self.cols, dtype=torch.float32)
        start = 0
        for p in self.parts:
            inside = (flat >= start) & (flat < start + p.rows)
            if inside.any():
                where = inside.nonzero().reshape(-1)
                rb = row_bytes(p.type_name, self.cols)
                raw = p.raw.view(p.rows, rb)[flat[where] - start]
                out[where] = dequantize(raw, p.type_name, where.numel(), self.cols)
            start += p.rows
        return out.reshape(*ids.shape, self.cols)
