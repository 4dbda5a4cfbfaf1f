"""Dense building blocks: norms, SwiGLU and the experts' activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..base.specs import ExpertSpec
from ..kernels import blockdot
from ..kernels.packed import PackedMatrix


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`; t itself when it already is (a conversion call is an operator for nothing)."""
    return t if t.dtype == dtype else t.to(dtype)


def as_float32(t: torch.Tensor) -> torch.Tensor:
    return as_dtype(t, torch.float32)


def embedding(tokens: torch.Tensor, table: torch.Tensor | PackedMatrix) -> torch.Tensor:
    """Rows `tokens` of an embedding table (a packed one dequantizes only those rows)."""
    return table.take(tokens) if isinstance(table, PackedMatrix) else F.embedding(tokens, table)


def linear(x: torch.Tensor, w: torch.Tensor | PackedMatrix, b: torch.Tensor | None = None,
           draft: bool = False) -> torch.Tensor:
    """x w^T + b for a dense weight that may be kept in another dtype than x (bfloat16
    beside float32 activations, ModelWeights.load's draft_dtype): widened to x's dtype, an exact copy of a
    bfloat16 checkpoint's values, so the product is the one float32 weights give; in a
    draft pass (`draft`) multiplied in bfloat16 instead, several times faster on CPUs with
    bfloat16 matrix units, and only the draft's guesses round differently. A weight kept
    in its GGUF encoding (`PackedMatrix`) goes through the block kernels."""
    if isinstance(w, PackedMatrix):
        y = w.linear(x).to(x.dtype)
        return y if b is None else y + b
    if w.dtype == x.dtype:
        return F.linear(x, w, b)
    if draft:
        return F.linear(x.to(w.dtype), w, None if b is None else b.to(w.dtype)).to(x.dtype)
    return F.linear(x, w.t().to(x.dtype).t() if w.stride(0) == 1 else w.to(x.dtype), b)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, invariant: bool = False) -> torch.Tensor:
    # Normalise in float32 whatever the activation dtype, as the reference does. In float32
    # torch's own rms_norm computes exactly these products, in one call instead of six;
    # `invariant` (weights multiplied as stored, on the CPU) computes it as llama.cpp does, in
    # the block kernels' library: one order per row, and a tenth of torch's time at batch 1.
    floats = x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32)
    if invariant and floats and x.device.type == "cpu":
        return blockdot.rms_norm(x, weight, eps)
    if floats:
        return torch.rms_norm(x, x.shape[-1:], weight, eps)
    x32 = as_float32(x)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if x.dtype != torch.float32:
        x32 = x32.to(x.dtype)
    return x32 if weight is None else weight * x32


def norm(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
         invariant: bool = False) -> torch.Tensor:
    """The family's pre-norm: RMSNorm, or LayerNorm with a bias (Phi-3.5-MoE)."""
    if kind == "layer":
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return rms_norm(x, weight, eps, invariant)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x); gate_up [2I, D] holds the gate rows first."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)


def expert_activation(spec: ExpertSpec, h: torch.Tensor) -> torch.Tensor:
    """The expert's hidden activation from its first projection h [T, R] -> [T, I]."""
    if spec.activation == "relu":
        return F.relu(h)
    gate, up = h.chunk(2, dim=-1)
    if spec.activation == "clamped_swiglu":  # GPT-OSS: clamp both halves, gate * sigmoid(alpha gate), (up + 1)
        gate = gate.clamp(max=spec.limit)
        up = up.clamp(-spec.limit, spec.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * spec.alpha))
    return F.silu(gate) * up
