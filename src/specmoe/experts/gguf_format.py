"""A GGUF file's routed expert, kept in the file's encoding (Q8_0, Q4_K, MXFP4, ...): the
blob of base/gguf_layout.py is what the tiers store, a fetch moves and a pool slot holds.
Computing the expert multiplies each matrix in its blocks where `as_stored` (the default
encoding on the CPU: kernels/blockdot.py, activations rounded to 8 bits as llama.cpp
rounds them; a gated SiLU expert in one call); otherwise (`--dtype float32`, the reference, or a type the kernels do
not compute) it dequantizes one matrix at a time (gate, up, then down) to the compute
dtype where it runs (base/gguf_quants.py, vectorized per block type) and multiplies: the
scratch is one matrix, as for the other quantized formats (formats.QuantizedFormat).

The class has `formats.ExpertFormat`'s interface (formats.expert_format builds it).
Shapes: T tokens, D hidden, I expert intermediate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..base.checkpoint import Checkpoint
from ..base.errors import SpecMoEError
from ..base.gguf_layout import GGUFExpertQuant
from ..base.gguf_quants import TYPE_NAMES, dequantize, native
from ..base.specs import ExpertSpec
from ..kernels import blockdot
from ..kernels.packed import PackedMatrix, Part
from ..model.moe import expert_forward


class GGUFFormat:
    storage_dtype = torch.uint8
    slot_dtype = torch.uint8
    converts = False  # a slot holds the blob as stored
    kernels: dict[str, str] = {}

    def __init__(self, spec: ExpertSpec, quant: GGUFExpertQuant, as_stored: bool = False):
        self.spec, self.quant, self.numel = spec, quant, quant.nbytes
        self.name = f"gguf-{quant.scheme.replace('/', '-')}"
        self.uniform = quant.uniform  # None: each blob's header says how it is encoded
        self._sections = {t: quant.sections(t) for t in quant.combos}
        self.as_stored = as_stored
        self._fused = spec.gated and spec.activation == "silu" and not quant.bias  # one call per expert: blockdot.swiglu
        kernels = {}
        for combo in quant.combos:
            for t in combo:
                if as_stored and blockdot.computes(t):
                    kernels[f"gguf {t}"] = f"as stored: {blockdot.library().describe()}"
                elif not native(t):  # dequantized through the gguf package, on the CPU (slow, but exact)
                    kernels[f"gguf {t}"] = "dequantized by the gguf package on the CPU"
                else:
                    kernels[f"gguf {t}"] = "dequantized per call" + ("" if as_stored else " (--dtype float32: the reference)")
        self.kernels = kernels

    @property
    def nbytes(self) -> int:
        return self.numel

    @property
    def slot_numel(self) -> int:
        return self.numel

    @property
    def slot_bytes(self) -> int:
        return self.numel

    def read(self, ckpt: Checkpoint, layer: int, expert: int) -> torch.Tensor:
        return ckpt.expert_blob(layer, expert)

    def prepare(self, stored: torch.Tensor, slot: torch.Tensor) -> None:
        slot.copy_(stored)

    def forward(self, slot: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.forward_stored(slot, x)

    def _types(self, blob: torch.Tensor) -> tuple[str, str, str]:
        if self.uniform is not None:
            return self.uniform
        ids = blob[:3].tolist()  # a mixed file: the blob's header (a device sync on CUDA)
        types = tuple(TYPE_NAMES.get(i, "?") for i in ids)
        if types not in self._sections:
            raise SpecMoEError(f"internal: a GGUF expert blob names encodings {types}, not one of this model's")
        return types

    def forward_stored(self, stored: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The expert on x [T, D] from its blob, in x's dtype."""
        D, I = self.spec.hidden, self.spec.inter
        one_call = self._one_call(stored, x)
        if one_call is not None:
            return blockdot.swiglu(x, *one_call, I)
        types = self._types(stored)
        sec = self._sections[types]

        def raw(name: str) -> torch.Tensor:
            offset, n = sec[name]
            return stored[offset:offset + n]

        def matrix(name: str, type_name: str, rows: int, cols: int) -> torch.Tensor:
            return dequantize(raw(name), type_name, rows, cols, x.dtype)

        def linear_in(t: torch.Tensor) -> torch.Tensor:  # [T, 2I]: gate's outputs, then up's
            if self._blocks(types[0], t) and self._blocks(types[1], t):  # as a packed matrix of two parts
                return PackedMatrix((Part(types[0], I, raw("gate")), Part(types[1], I, raw("up"))), D).linear(t)
            gate = F.linear(t, matrix("gate", types[0], I, D))
            return torch.cat([gate, F.linear(t, matrix("up", types[1], I, D))], dim=-1)

        def linear_out(t: torch.Tensor) -> torch.Tensor:
            if self._blocks(types[2], t):
                return PackedMatrix.of(raw("down"), types[2], D, I).linear(t)
            return F.linear(t, matrix("down", types[2], D, I))

        b_in = b_out = None
        if self.quant.bias:
            (o_in, n_in), (o_out, n_out) = sec["b_in"], sec["b_out"]
            b_in = stored[o_in:o_in + n_in].view(torch.float32).to(x.dtype)
            b_out = stored[o_out:o_out + n_out].view(torch.float32).to(x.dtype)
        return expert_forward(self.spec, x, linear_in, linear_out, b_in, b_out)

    def forward_token(self, blobs: list[torch.Tensor], weights: list[float], x: torch.Tensor) -> torch.Tensor | None:
        """sum over k of weights[k] * expert k on x [1, D], added in the order given (as
        moe.one_token adds them), in one kernel call (blockdot.experts); None where
        these experts are computed one at a time (not gated SiLU, a type or dtype the
        kernels do not take)."""
        experts = [self._one_call(blob, x) for blob in blobs]
        if any(m is None for m in experts):
            return None
        return blockdot.experts(x, experts, weights, self.spec.inter)

    def _one_call(self, blob: torch.Tensor, x: torch.Tensor) -> tuple[tuple[torch.Tensor, str], ...] | None:
        """The expert's gate, up and down as (bytes, type) where the kernels compute it in one
        call (a gated SiLU expert, every matrix multiplied in its blocks), else None."""
        if not self._fused:
            return None
        types = self._types(blob)
        if not all(self._blocks(t, x) for t in types):
            return None
        sec = self._sections[types]
        return tuple((blob[sec[name][0]:sec[name][0] + sec[name][1]], t)
                     for name, t in zip(("gate", "up", "down"), types))

    def _blocks(self, type_name: str, x: torch.Tensor) -> bool:
        """Whether this matrix is multiplied in its blocks: asked for, a type the kernels
        compute, float32 activations on the CPU."""
        return self.as_stored and x.dtype == torch.float32 and x.device.type == "cpu" and blockdot.computes(type_name)

    def scratch_bytes(self, dtype: torch.dtype) -> int:
        """One matrix dequantized: its float32 values (scaled in place) and, computing in
        another dtype, their conversion."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return self.spec.hidden * self.spec.inter * (4 + (elem if dtype != torch.float32 else 0))

