"""How one routed expert is held where it lives and how it is computed: the unit the
offload tiers store, a device-pool slot holds and a fetch moves.

- `FloatFormat`: the expert's weights in the compute dtype, one buffer in the layout of
  `ExpertSpec` (float checkpoints).
- `QuantizedFormat`: the checkpoint's own quantized bytes, one uint8 blob (layout:
  base/quantization.py: codes and scales of w_in and w_out, biases). Computing an expert
  dequantizes each matrix in turn to the compute dtype (one matrix of scratch at a time)
  and multiplies; on the CPU in bfloat16, int4 matrices with bfloat16 scales go through
  torch's fused int4 matmul instead (the kernel the quantized draft copies use), which
  multiplies without a dequantized copy.

Every policy computes an expert through its format, so all of them compute the same
numbers from the same bytes: their outputs are the resident (quantized) model's.

Shapes: T tokens, D hidden, I expert intermediate, R rows of w_in (2I gated, I plain).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from ..base.checkpoint import Checkpoint
from ..base.config import ModelConfig
from ..base.quantization import ExpertQuant, MatrixQuant
from ..base.quantized_tensors import FP4_VALUES, SCALE_DTYPES, expand_scales
from ..base.specs import ExpertSpec
from ..model.moe import expert_forward, run_expert
from .quant import int4_kernel_fits


class ExpertFormat:
    """One routed expert as stored and moved: `numel` elements of `storage_dtype`."""

    name: str  # names the expert file and goes into its header
    storage_dtype: torch.dtype
    numel: int
    quant: ExpertQuant | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * torch.tensor([], dtype=self.storage_dtype).element_size()

    def read(self, ckpt: Checkpoint, layer: int, expert: int) -> torch.Tensor:
        """The expert's buffer (1-D, `numel` of `storage_dtype`) from the checkpoint."""
        raise NotImplementedError

    def forward(self, buffer: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The expert on x [T, D] from its buffer, on the buffer's device, in x's dtype."""
        raise NotImplementedError

    def scratch_bytes(self, dtype: torch.dtype) -> int:
        """Device bytes a forward allocates beside its activations (a dequantized matrix)."""
        return 0


class FloatFormat(ExpertFormat):
    storage_dtype = torch.float32

    def __init__(self, spec: ExpertSpec, dtype: torch.dtype):
        self.spec, self.storage_dtype, self.numel = spec, dtype, spec.numel
        self.name = str(dtype).removeprefix("torch.")

    def read(self, ckpt: Checkpoint, layer: int, expert: int) -> torch.Tensor:
        return ckpt.expert_buffer(layer, expert, self.storage_dtype)

    def forward(self, buffer: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return run_expert(buffer, x, self.spec)


class QuantizedFormat(ExpertFormat):
    storage_dtype = torch.uint8

    def __init__(self, spec: ExpertSpec, quant: ExpertQuant):
        self.spec, self.quant, self.numel = spec, quant, quant.nbytes
        self.sections = quant.sections()
        m = quant.w_in
        self.name = f"{quant.scheme}-{m.block_rows}x{m.group}-{m.scale_dtype}"

    def read(self, ckpt: Checkpoint, layer: int, expert: int) -> torch.Tensor:
        return ckpt.expert_blob(layer, expert)

    def section(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        offset, n = self.sections[name]
        return buffer[offset:offset + n]

    def forward(self, buffer: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q = self.quant
        b_in = b_out = None
        if q.bias:
            b_in, b_out = (self.section(buffer, n).view(torch.float32).to(x.dtype) for n in ("b_in", "b_out"))
        return expert_forward(self.spec, x, self._linear(buffer, "w_in", q.w_in), self._linear(buffer, "w_out", q.w_out),
                              b_in, b_out)

    def _linear(self, buffer: torch.Tensor, name: str, m: MatrixQuant):
        codes, scales = self.section(buffer, f"{name}.codes"), self.section(buffer, f"{name}.scales")

        def linear(x: torch.Tensor) -> torch.Tensor:
            if int4_kernel_applies(m, x):
                return int4_kernel_linear(x, codes, scales, m)
            return F.linear(x, dequantize(codes, scales, m, x.dtype))

        return linear

    def scratch_bytes(self, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return max(m.rows * m.cols for m in (self.quant.w_in, self.quant.w_out)) * elem


def expert_format(config: ModelConfig, dtype: torch.dtype) -> ExpertFormat:
    """How this model's experts are held: the checkpoint's quantized blobs, else the compute dtype."""
    if config.expert_quant is not None:
        return QuantizedFormat(config.expert, config.expert_quant)
    return FloatFormat(config.expert, dtype)


# --- dequantization -------------------------------------------------------------------------------


def dequantize(codes: torch.Tensor, scales: torch.Tensor, m: MatrixQuant, dtype: torch.dtype) -> torch.Tensor:
    """One matrix [rows, cols] in `dtype` from its blob sections (uint8 views): codes times
    their block's scale, scaled in place."""
    w = _values(codes, m, dtype)
    s = _scales(scales, m, dtype)
    rows_per, group = m.block_rows, m.group
    if m.rows % rows_per == 0 and m.cols % group == 0:
        w.view(s.shape[0], rows_per, s.shape[1], group).mul_(s[:, None, :, None])
    else:  # partial blocks at the edges
        w.mul_(expand_scales(s, (rows_per, group), (m.rows, m.cols)))
    return w


def _values(codes: torch.Tensor, m: MatrixQuant, dtype: torch.dtype) -> torch.Tensor:
    if m.codes == "int8":
        return codes.view(torch.int8).view(m.rows, m.cols).to(dtype)
    if m.codes == "fp8":
        return codes.view(torch.float8_e4m3fn).view(m.rows, m.cols).to(dtype)
    packed = codes.view(m.rows, m.cols // 2)
    out = torch.empty(m.rows, m.cols // 2, 2, dtype=dtype, device=codes.device)
    lo, hi = packed & 0x0F, packed >> 4
    if m.codes == "int4":  # stored as q + 8
        out[..., 0].copy_(lo)
        out[..., 1].copy_(hi)
        out.sub_(8)
    else:  # fp4 (e2m1)
        lut = _fp4_table(codes.device, dtype)
        out[..., 0] = lut[lo.long()]
        out[..., 1] = lut[hi.long()]
    return out.view(m.rows, m.cols)


def _scales(scales: torch.Tensor, m: MatrixQuant, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = m.scale_shape
    if m.scale_dtype == "e8m0":  # 2 ** (e - 127), exact in float32
        return torch.exp2(scales.view(rows, cols).float() - 127).to(dtype)
    return scales.view(SCALE_DTYPES[m.scale_dtype]).view(rows, cols).to(dtype)


@lru_cache(maxsize=8)
def _fp4_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(FP4_VALUES, dtype=dtype, device=device)


# --- torch's fused int4 matmul (CPU, bfloat16) ------------------------------------------------


def int4_kernel_applies(m: MatrixQuant, x: torch.Tensor) -> bool:
    """The fused kernel computes exactly this matrix: int4 codes, one bfloat16 scale per
    group of a row, bfloat16 activations (its own arithmetic)."""
    return (m.codes == "int4" and m.block_rows == 1 and m.scale_dtype == "bfloat16" and x.dtype == torch.bfloat16
            and m.cols % m.group == 0 and int4_kernel_fits(x.device, 4, m.rows, m.group))


def int4_kernel_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, m: MatrixQuant) -> torch.Tensor:
    unsigned = torch.stack([codes & 0x0F, codes >> 4], dim=-1).view(m.rows, m.cols).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1)
    s = scales.view(torch.bfloat16).view(m.rows, m.cols // m.group).t()  # [groups, rows]
    scales_zeros = torch.stack([s, torch.zeros_like(s)], dim=-1).contiguous()
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, m.group, scales_zeros)
