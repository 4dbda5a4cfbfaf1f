"""How one routed expert is held where it lives and how it is computed: the unit the
offload tiers store and a fetch moves, and the layout a device-pool slot holds it in.

- `FloatFormat`: the expert's weights as one buffer in the layout of `ExpertSpec` (float
  checkpoints), in the compute dtype, or in the checkpoint's narrower one where widening
  it is exact (bfloat16 weights computed in float32 on the CPU: `stored_dtype`); a slot
  holds the buffer in the compute dtype, or, multiplied as stored (the CPU's default), in
  bfloat16 (kernels/blockdot.py widens each weight in registers).
- `QuantizedFormat`: the checkpoint's own quantized bytes, one uint8 blob (layout:
  base/quantization.py: codes and scales of w_in and w_out, biases). A slot holds the
  blob, and computing an expert dequantizes each matrix in turn to the compute dtype (one
  matrix of scratch at a time) and multiplies. On the CPU in bfloat16, int4 matrices with
  bfloat16 scales are instead converted once, when the expert enters its slot (on the
  transfer thread), to the layout of torch's fused int4 matmul, the kernel the quantized
  draft copies use: the expert then multiplies without dequantizing, every time it runs.
  Such a slot is the blob's size plus its scales once more (bfloat16 pairs of scale and
  zero); what moves is still the blob. Only where kernels.py lets both matrices' shapes
  through on this machine (requirements, self-check); else the blob, dequantized.
- `QuantizedBlocksFormat` (quantized_blocks.py): where the engine computes as stored (the
  CPU's default), int8 / int4 experts whose Q8_0 / Q4_0 re-encoding holds the same
  numbers: a slot holds those blocks, the block kernels multiply them; what moves is
  still the blob. Where the re-encoding would not be exact, `QuantizedFormat`'s `kernels`
  says why.

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
from ..kernels import blockdot
from ..model.layers import as_dtype
from ..model.moe import expert_forward, expert_views, run_expert
from .gguf_format import GGUFFormat
from .kernels import ALIGN, KernelChoice, Shape, aligned_sections, choose, int4_mm, int4_pack
from .quantized_blocks import QuantizedBlocksFormat, refusal


class ExpertFormat:
    """One routed expert as stored and moved (`numel` of `storage_dtype`, `nbytes`) and as
    a pool slot holds it (`slot_numel` of `slot_dtype`, `slot_bytes`)."""

    name: str  # names the expert file and goes into its header
    storage_dtype: torch.dtype
    numel: int
    quant: ExpertQuant | None = None
    converts = False  # whether a slot holds another layout than the stored buffer
    kernels: dict[str, str] = {}  # fused-kernel shape class -> fused or portable, and why

    @property
    def nbytes(self) -> int:
        return self.numel * torch.tensor([], dtype=self.storage_dtype).element_size()

    @property
    def slot_numel(self) -> int:
        return self.numel

    @property
    def slot_dtype(self) -> torch.dtype:
        return self.storage_dtype

    @property
    def slot_bytes(self) -> int:
        return self.slot_numel * torch.tensor([], dtype=self.slot_dtype).element_size()

    def read(self, ckpt: Checkpoint, layer: int, expert: int) -> torch.Tensor:
        """The expert's stored buffer (1-D, `numel` of `storage_dtype`) from the checkpoint."""
        raise NotImplementedError

    def prepare(self, stored: torch.Tensor, slot: torch.Tensor) -> None:
        """Fill a slot (on any device) from the stored buffer."""
        slot.copy_(stored)

    def forward(self, slot: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The expert on x [T, D] from its slot, on the slot's device, in x's dtype."""
        return self.forward_stored(slot, x)

    def forward_stored(self, stored: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The expert on x [T, D] from its stored buffer (the host tier computing it)."""
        raise NotImplementedError

    def forward_token(self, slots: list[torch.Tensor], weights: list[float], x: torch.Tensor) -> torch.Tensor | None:
        """Batch 1: sum over k of weights[k] * the expert in slots[k] on x [1, D], added in the
        order given (as moe.one_token adds them), in one kernel call; None where this format
        computes experts one at a time."""
        return None

    def scratch_bytes(self, dtype: torch.dtype) -> int:
        """Device bytes a forward allocates beside its activations (a dequantized matrix)."""
        return 0


class FloatFormat(ExpertFormat):
    def __init__(self, spec: ExpertSpec, dtype: torch.dtype, stored: torch.dtype | None = None, as_stored: bool = False):
        self.spec, self.numel, self.compute_dtype = spec, spec.numel, dtype
        self.storage_dtype = stored or dtype
        # bfloat16 experts multiplied as stored (kernels/blockdot.py: widened in registers, the
        # float32 reference's products): a slot holds them at half the bytes of float32
        self.as_stored = as_stored and self.storage_dtype == torch.bfloat16 and dtype == torch.float32
        self.converts = self.storage_dtype != self.slot_dtype
        self.name = str(self.storage_dtype).removeprefix("torch.")
        if self.as_stored:
            self.kernels = {"bfloat16 experts": f"as stored: {blockdot.library().describe()}"}

    @property
    def slot_dtype(self) -> torch.dtype:
        return self.storage_dtype if self.as_stored else self.compute_dtype

    def read(self, ckpt: Checkpoint, layer: int, expert: int) -> torch.Tensor:
        return ckpt.expert_buffer(layer, expert, self.storage_dtype)

    def forward_stored(self, stored: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self._in_one_call(stored, x):
            return blockdot.swiglu(x, *self._matrices(stored), self.spec.inter)
        if self._as_stored(stored, x):
            v = expert_views(stored, self.spec)
            return expert_forward(self.spec, x, lambda t: blockdot.matmul_bf16(t, v.w_in, v.w_in.shape[0]),
                                  lambda t: blockdot.matmul_bf16(t, v.w_out, v.w_out.shape[0]),
                                  as_dtype(v.b_in, x.dtype) if v.b_in is not None else None,
                                  as_dtype(v.b_out, x.dtype) if v.b_out is not None else None)
        return run_expert(as_dtype(stored, x.dtype), x, self.spec)

    def forward_token(self, slots: list[torch.Tensor], weights: list[float], x: torch.Tensor) -> torch.Tensor | None:
        """sum over k of weights[k] * expert k on x [1, D], added in the order given (as
        moe.one_token adds them), in one kernel call (blockdot.experts); None where these
        experts are computed one at a time."""
        if not all(self._in_one_call(slot, x) for slot in slots):
            return None
        return blockdot.experts(x, [self._matrices(slot) for slot in slots], weights, self.spec.inter)

    def _as_stored(self, stored: torch.Tensor, x: torch.Tensor) -> bool:
        return self.as_stored and stored.dtype == torch.bfloat16 and x.dtype == torch.float32 and x.device.type == "cpu"

    def _in_one_call(self, stored: torch.Tensor, x: torch.Tensor) -> bool:
        """A gated SiLU expert without biases, multiplied as stored: gate, up, activation
        and down in one kernel call."""
        s = self.spec
        return self._as_stored(stored, x) and s.gated and s.activation == "silu" and not s.bias

    def _matrices(self, stored: torch.Tensor) -> tuple[tuple[torch.Tensor, str], ...]:
        v, inter = expert_views(stored, self.spec), self.spec.inter
        return (v.w_in[:inter], "BF16"), (v.w_in[inter:], "BF16"), (v.w_out, "BF16")


class QuantizedFormat(ExpertFormat):
    storage_dtype = torch.uint8

    def __init__(self, spec: ExpertSpec, quant: ExpertQuant, device=None, dtype: torch.dtype | None = None,
                 not_as_stored: str | None = None):
        """`not_as_stored`: why the block kernels, which would multiply these experts as
        stored here, do not (quantized_blocks.refusal)."""
        self.spec, self.quant, self.numel = spec, quant, quant.nbytes
        self.sections = quant.sections()
        m = quant.w_in
        self.name = f"{quant.scheme}-{m.block_rows}x{m.group}-{m.scale_dtype}"
        choices = int4_kernel_choices(quant, torch.device(device), dtype) if device is not None else {}
        self.kernels = {s.key: c.describe() for s, c in choices.items()}  # for the run statistics
        if not_as_stored:
            self.kernels[f"{quant.scheme} experts"] = f"dequantized per call, not as stored: {not_as_stored}"
        self.converts = bool(choices) and all(c.fused for c in choices.values())
        self.slot_sections = _kernel_sections(quant) if self.converts else self.sections

    @property
    def slot_numel(self) -> int:
        if not self.converts:
            return self.numel
        offset, n = max(self.slot_sections.values())
        return -(-(offset + n) // ALIGN) * ALIGN

    def read(self, ckpt: Checkpoint, layer: int, expert: int) -> torch.Tensor:
        return ckpt.expert_blob(layer, expert)

    def section(self, buffer: torch.Tensor, name: str, sections=None) -> torch.Tensor:
        offset, n = (sections or self.sections)[name]
        return buffer[offset:offset + n]

    def prepare(self, stored: torch.Tensor, slot: torch.Tensor) -> None:
        if not self.converts:
            slot.copy_(stored)
            return
        for name, m in (("w_in", self.quant.w_in), ("w_out", self.quant.w_out)):
            codes, scales = self.section(stored, f"{name}.codes"), self.section(stored, f"{name}.scales")
            packed, scales_zeros = int4_kernel_layout(codes, scales, m)
            self.section(slot, f"{name}.packed", self.slot_sections).copy_(packed.view(-1))
            self.section(slot, f"{name}.scales_zeros", self.slot_sections).copy_(scales_zeros.view(-1).view(torch.uint8))
        if self.quant.bias:
            for name in ("b_in", "b_out"):
                self.section(slot, name, self.slot_sections).copy_(self.section(stored, name))

    def forward(self, slot: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if not self.converts:
            return self.forward_stored(slot, x)
        q, sec = self.quant, self.slot_sections

        def linear(name: str, m: MatrixQuant):
            packed = self.section(slot, f"{name}.packed", sec).view(m.rows, m.cols // 2)
            scales_zeros = self.section(slot, f"{name}.scales_zeros", sec).view(torch.bfloat16).view(-1, m.rows, 2)
            return lambda t: int4_mm(t, packed, m.group, scales_zeros)

        return expert_forward(self.spec, x, linear("w_in", q.w_in), linear("w_out", q.w_out), *self._biases(slot, x, sec))

    def forward_stored(self, stored: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q = self.quant
        return expert_forward(self.spec, x, self._dequantizing(stored, "w_in", q.w_in),
                              self._dequantizing(stored, "w_out", q.w_out), *self._biases(stored, x, self.sections))

    def _biases(self, buffer: torch.Tensor, x: torch.Tensor, sections) -> tuple:
        if not self.quant.bias:
            return None, None
        return tuple(self.section(buffer, n, sections).view(torch.float32).to(x.dtype) for n in ("b_in", "b_out"))

    def _dequantizing(self, stored: torch.Tensor, name: str, m: MatrixQuant):
        codes, scales = self.section(stored, f"{name}.codes"), self.section(stored, f"{name}.scales")
        return lambda x: F.linear(x, dequantize(codes, scales, m, x.dtype))

    def scratch_bytes(self, dtype: torch.dtype) -> int:
        if self.converts:
            return 0
        elem = torch.tensor([], dtype=dtype).element_size()
        return max(m.rows * m.cols for m in (self.quant.w_in, self.quant.w_out)) * elem


def expert_format(config: ModelConfig, dtype: torch.dtype, device=None,
                  checkpoint_dtype: torch.dtype | None = None, as_stored: bool = False) -> ExpertFormat:
    """How this model's experts are held: the checkpoint's quantized blobs, else float
    buffers (`stored_dtype`); `device` (where the pool is) decides a slot's layout;
    `as_stored`: a GGUF expert is multiplied in its blocks, a bfloat16 one in bfloat16, a
    quantized checkpoint's int8 / int4 one as Q8_0 / Q4_0 blocks where those hold its
    numbers (experts/quantized_blocks.py; kernels/blockdot.py)."""
    if config.expert_quant is not None and config.expert_quant.source == "gguf":  # a GGUF file's own encoding
        return GGUFFormat(config.expert, config.expert_quant, as_stored)
    if config.expert_quant is not None:
        spec, quant = config.expert, config.expert_quant
        refused = refusal(quant) if as_stored else None
        if as_stored and refused is None:  # int8 / int4 experts as Q8_0 / Q4_0 blocks in their slots
            return QuantizedBlocksFormat(spec, quant, QuantizedFormat(spec, quant))
        return QuantizedFormat(spec, quant, device, dtype, refused)
    return FloatFormat(config.expert, dtype, stored_dtype(checkpoint_dtype, dtype), as_stored)


def checkpoint_format(ckpt: Checkpoint, dtype: torch.dtype, device=None) -> ExpertFormat:
    """`expert_format` of this checkpoint, its experts' own dtype read from the first of them."""
    return expert_format(ckpt.config, dtype, device, checkpoint_expert_dtype(ckpt))


def checkpoint_expert_dtype(ckpt: Checkpoint) -> torch.dtype | None:
    """The dtype the checkpoint's routed experts come in (its first expert's tensors), or
    None where those tensors differ in dtype."""
    dtypes = {t.dtype for t in ckpt.expert_parts(ckpt.config.moe_layer_ids[0], 0)}
    return dtypes.pop() if len(dtypes) == 1 else None


def stored_dtype(checkpoint_dtype: torch.dtype | None, compute: torch.dtype) -> torch.dtype:
    """What the offload tiers hold float experts in: the checkpoint's bfloat16 or float16
    when the compute dtype is float32 (widening is exact: the same numbers, half the bytes
    to store, read and move; a slot widens the expert when it arrives), else the compute
    dtype."""
    if compute == torch.float32 and checkpoint_dtype in (torch.bfloat16, torch.float16):
        return checkpoint_dtype
    return compute


# --- dequantization -------------------------------------------------------------------------------


def dequantize(codes: torch.Tensor, scales: torch.Tensor, m: MatrixQuant, dtype: torch.dtype) -> torch.Tensor:
    """One matrix [rows, cols] in `dtype` from its blob sections (uint8 views): codes times
    their block's scale, scaled in place."""
    w, factor = _values(codes, m, dtype)
    s = _scales(scales, m, dtype)
    if factor != 1.0:
        s = s * factor
        if not torch.isfinite(s).all():  # a scale too large to carry the factor: convert the codes plainly
            w, s = _plain_values(codes, m, dtype), _scales(scales, m, dtype)
    rows_per, group = m.block_rows, m.group
    if m.rows % rows_per == 0 and m.cols % group == 0:
        w.view(s.shape[0], rows_per, s.shape[1], group).mul_(s[:, None, :, None])
    else:  # partial blocks at the edges
        w.mul_(expand_scales(s, (rows_per, group), (m.rows, m.cols)))
    return w


# Float codes are converted by moving their bits into bfloat16's (exact: bfloat16 has more
# exponent and mantissa bits), which leaves each value times a power of two that the scales
# take back: e4m3 (s eeee mmm) -> bfloat16 s 0000eeee mmm0000 = value * 2^-120; e2m1
# (s ee m) -> s 000000ee m000000 = value * 2^-126. Faster on the CPU than torch's own
# float8 conversion or a table lookup, and the same on any device.
FP8_FACTOR, FP4_FACTOR = 2.0 ** 120, 2.0 ** 126


def _values(codes: torch.Tensor, m: MatrixQuant, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """The codes as numbers [rows, cols] in `dtype`, and the factor the scales must take on."""
    if m.codes == "int8":
        return codes.view(torch.int8).view(m.rows, m.cols).to(dtype), 1.0
    if m.codes == "fp8":
        v = codes.view(torch.int8).view(m.rows, m.cols).to(torch.int16)
        return (((v & 0x80) << 8) | ((v & 0x7F) << 4)).view(torch.bfloat16).to(dtype), FP8_FACTOR
    packed = codes.view(m.rows, m.cols // 2)
    if m.codes == "int4":  # stored as q + 8
        out = torch.empty(m.rows, m.cols // 2, 2, dtype=dtype, device=codes.device)
        out[..., 0].copy_(packed & 0x0F)
        out[..., 1].copy_(packed >> 4)
        return out.sub_(8).view(m.rows, m.cols), 1.0
    v = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(m.rows, m.cols).to(torch.int16)  # fp4 (e2m1)
    return (((v & 0x8) << 12) | ((v & 0x7) << 6)).view(torch.bfloat16).to(dtype), FP4_FACTOR


def _plain_values(codes: torch.Tensor, m: MatrixQuant, dtype: torch.dtype) -> torch.Tensor:
    if m.codes == "fp8":
        return codes.view(torch.float8_e4m3fn).view(m.rows, m.cols).to(dtype)
    v = torch.stack([codes & 0x0F, codes >> 4], dim=-1).view(m.rows, m.cols)  # fp4
    return _fp4_table(codes.device, dtype)[v.long()]


def _scales(scales: torch.Tensor, m: MatrixQuant, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = m.scale_shape
    if m.scale_dtype == "e8m0":  # 2 ** (e - 127), exact in float32
        return torch.exp2(scales.view(rows, cols).float() - 127).to(dtype)
    return scales.view(SCALE_DTYPES[m.scale_dtype]).view(rows, cols).to(dtype)


@lru_cache(maxsize=8)
def _fp4_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(FP4_VALUES, dtype=dtype, device=device)


# --- torch's fused int4 matmul (CPU, bfloat16) ------------------------------------------------


def int4_kernel_choices(quant: ExpertQuant, device: torch.device, dtype: torch.dtype | None) -> dict[Shape, KernelChoice]:
    """Where the fused kernel's arithmetic is the format's (computing in bfloat16 on the CPU,
    int4 codes with one bfloat16 scale per group of a row), whether kernels.py lets each
    matrix's shape through on this machine; {} where the kernel does not apply at all."""
    if not (device.type == "cpu" and dtype == torch.bfloat16 and all(
            m.codes == "int4" and m.block_rows == 1 and m.scale_dtype == "bfloat16" for m in (quant.w_in, quant.w_out))):
        return {}
    return choose([Shape("int4", m.rows, m.cols, m.group) for m in (quant.w_in, quant.w_out)], device)


def int4_kernel_layout(codes: torch.Tensor, scales: torch.Tensor, m: MatrixQuant):
    """(packed uint8 [rows, cols / 2] in the kernel's layout, bfloat16 [groups, rows, 2] of
    (scale, 0)) from a matrix's blob sections. The kernel computes (q_u - 8) * s + z."""
    packed = codes.view(m.rows, m.cols // 2)
    unsigned = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(m.rows, m.cols).to(torch.int32)
    s = scales.view(torch.bfloat16).view(m.rows, m.cols // m.group).t()
    return int4_pack(unsigned), torch.stack([s, torch.zeros_like(s)], dim=-1).contiguous()


def _kernel_sections(quant: ExpertQuant) -> dict[str, tuple[int, int]]:
    """A converted slot: per matrix the kernel's packed codes and (scale, zero) pairs, then
    the biases, each at a multiple of ALIGN bytes (the slot's size is one too, so in the
    pool's aligned buffer every section the kernel reads is aligned)."""
    sizes = []
    for name, m in (("w_in", quant.w_in), ("w_out", quant.w_out)):
        sizes += [(f"{name}.packed", m.rows * m.cols // 2), (f"{name}.scales_zeros", m.rows * (m.cols // m.group) * 4)]
    if quant.bias:
        sizes += [("b_in", 4 * quant.w_in.rows), ("b_out", 4 * quant.w_out.rows)]
    return aligned_sections(sizes)
