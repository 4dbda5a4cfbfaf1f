"""Quantized copies of routed experts, for drafting.

Every expert of every MoE block gets a low-bit copy on the device so that the draft can
follow the model's own routing with no substitution; verification still runs the
full-precision experts, so the output stays exactly the full model's.

Format (per matrix W [out, in], `in` the input dimension):
  per-group symmetric quantization along `in`: s = max|W_group| / qmax (stored float16),
  q = clamp(round(W / s), -qmax - 1, qmax), W ~= q * s.
  int8: one group per row (as torchao's int8 weight-only: one fused kernel call per
  matrix, and at 8 bits a finer grid gains little), q as int8.
  int4 / int3: groups of 128 or 64 (whichever divides `in`, else the whole row),
  q + 2^(bits-1) as unsigned codes, packed 8 codes into
  `bits` bytes (int4: two per byte) in a planar layout (see `pack`).
  int2: groups of 32 (else 64, 128, the row), codes packed as int3's; with four levels
  the scale max|W_group| / qmax rounds most weights to 0, so each group's scale is
  the one of a few clipped candidates (amax x 1.0 .. 0.4) with the least squared error
  (`CLIP_RATIOS`; the report in `specmoe info --draft-quant int2` measures the gain).
An expert is two matrices, as in the full-precision buffer (`ExpertSpec`): w_in [R, D]
(gated: gate rows, then up rows) and w_out [D, I]; the biases of families that have them
stay in float32 (a few hundred values).

That format is what is cached and what `quant_report.quant_error_report` measures. On the device the
draft holds each matrix in the first of these layouts that takes it, all the same weights
(codes times scales):
- on the CPU, the layout of torch's fused int4 matmul (`Int4KernelMatrix`) or int8 matmul
  (`Int8KernelMatrix`), multiplied in bfloat16, where kernels.py allows it (the shape meets
  the kernel's requirements and passed its self-check on this machine);
- on the CPU where specmoe's block kernels run (kernels/blockdot.py), ggml blocks
  (`BlockMatrix`): int8 as Q8_0 (each block of 32 with its row's float16 scale), int4 as
  Q4_0 (each with its group's scale, the codes unchanged), multiplied as a GGUF file's
  weights are, without a dequantized copy; these come first where the engine itself runs
  on the block kernels (`blocks`: Runtime.computes_as_stored), as it does on a GGUF file or
  a bfloat16 checkpoint: torch then has one thread and the block kernels the cores;
- as stored, dequantized to the compute dtype once per call, then F.linear.

Shapes: D hidden, I expert intermediate, E experts per block, n experts used.

Computed once per model and cached next to the affinity table (quant_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..base.errors import SpecMoEError
from ..base.memory import release_free_memory
from ..base.specs import ExpertSpec
from ..model.layers import as_dtype, expert_activation
from ..model.moe import ExpertGroups, expert_forward, expert_views
from .copy_layouts import (
    BlockMatrix,
    Int4KernelMatrix,
    Int8KernelMatrix,
    block_bytes,
    block_type,
)
from .kernels import KernelChoice, Shape, choose, padded
from .packing import pack, packed_size, unpack

QUANT_MODES = ("none", "int8", "int4", "int3", "int2")
BITS = {"int8": 8, "int4": 4, "int3": 3, "int2": 2}
GROUP_SIZES = (128, 64)  # preferred group sizes of the packed modes along the input dimension, first that divides
GROUP_SIZES_2BIT = (32, 64, 128)  # 2-bit codes need small groups: one outlier sets the scale of fewer weights
CLIP_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)  # 2-bit scale candidates, as fractions of max|W_group| / qmax
SCALE_DTYPE = torch.float16
FORMAT_VERSION = 2  # part of the cache file name: bump when the layout changes (2: int8 per row)


def draft_modes(expert_quant, modes=("int8", "int4")) -> tuple[str, ...]:
    """The copies of `modes` a draft may take (default: what `--draft-quant auto` tries),
    most precise first: those with fewer bits than the experts themselves (an int8 copy
    of int8 experts would save nothing). An int4 copy of Q4_K experts (4.5 bits a weight)
    holds as many bytes, and still drafts better than the same room in full experts: on the
    real-size Q4_K_M file, disk tier at 50 %, SpecMoE ran 1.88x ondemand with such copies
    and 1.05x without."""
    return tuple(mode for mode in modes if BITS[mode] < expert_bits(expert_quant))


# What a copy's scales add to its bits per weight: a 16-bit scale per group of 32, as the
# block layouts hold them (an int4 copy is a Q4_0 block, 4.5 bits a weight).
SCALE_BITS = 0.5


def saves_bytes(expert_quant, mode: str) -> bool:
    """Whether a `mode` copy holds fewer bytes than the expert itself, scales counted."""
    return BITS[mode] + SCALE_BITS < expert_bits(expert_quant)


def expert_bits(expert_quant) -> int:
    """Bits per weight of the experts as stored (16: not quantized)."""
    return expert_quant.w_in.bits if expert_quant is not None else 16


def auto_modes(expert_quant) -> tuple[str, ...]:
    """The copies `--draft-quant auto` weighs, most precise first: on full-precision experts
    every mode narrower than them; on quantized ones (GGUF, w8a16) int8 and int4 only. The
    int3 and int2 copies of the 4 GB Q4_K_M file's experts erred 23 % and 41 % (relative,
    per block), and building them took minutes and 4 GB of disk on a first run, whose
    float32 temporaries a run under --memory-limit had no room for."""
    return draft_modes(expert_quant, tuple(BITS) if expert_quant is None else ("int8", "int4"))


def check_mode(mode: str) -> None:
    if mode not in QUANT_MODES:
        raise SpecMoEError(f"unknown draft_quant {mode!r}; choose one of: {', '.join(QUANT_MODES)}")


def group_size(in_features: int, bits: int) -> int:
    if bits == 8:
        return in_features
    sizes = GROUP_SIZES_2BIT if bits <= 2 else GROUP_SIZES
    return next((g for g in sizes if in_features % g == 0), in_features)


# --- one matrix -----------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedMatrix:
    """W [..., out, in] quantized per group along `in`; leading dims (experts) allowed."""

    data: torch.Tensor  # int8 [..., out, in] (int8), or uint8 [..., packed_size(out * in)] (int4, int3)
    scales: torch.Tensor  # float16 [..., out, in / group]
    bits: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.scales.shape[-2]

    @property
    def group(self) -> int:
        return self.in_features // self.scales.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    def select(self, index) -> QuantizedMatrix:
        """The matrices of the experts `index` (an int, or a long tensor over the leading dim)."""
        return QuantizedMatrix(self.data[index], self.scales[index], self.bits, self.in_features)

    def to(self, device) -> QuantizedMatrix:
        return QuantizedMatrix(self.data.to(device), self.scales.to(device), self.bits, self.in_features)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W ~= q * s in `dtype`, one buffer, scaled in place."""
        out, groups = self.scales.shape[-2:]
        if self.bits == 8:
            w = self.data.to(dtype)
        else:
            w = unpack(self.data, self.bits, out * self.in_features, dtype)
            w = w.reshape(*w.shape[:-1], out, self.in_features)  # a copy only if padding was cut off
            w.sub_(1 << (self.bits - 1))
        w.view(*w.shape[:-1], groups, self.in_features // groups).mul_(self.scales.to(dtype)[..., None])
        return w

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> x W^T, W dequantized to x's dtype once for the call."""
        return F.linear(x, self.dequantize(x.dtype))

    def scratch_bytes(self, dtype: torch.dtype) -> int:
        """Device bytes of one dequantized matrix (alive during `linear`)."""
        return self.out_features * self.in_features * torch.tensor([], dtype=dtype).element_size()


def kernel_shape(bits: int, out_features: int, in_features: int) -> Shape | None:
    """The fused kernel's shape class for a matrix of this format, or None (no kernel takes int3)."""
    if bits == 8:
        return Shape("int8", out_features, in_features)
    if bits == 4:
        return Shape("int4", out_features, in_features, group_size(in_features, 4))
    return None


def _block_type(bits: int, in_features: int, device) -> str | None:
    """copy_layouts.block_type for a matrix of this format (its groups: group_size)."""
    return block_type(bits, in_features, group_size(in_features, bits), device)


def device_layout(q: QuantizedMatrix, device, choices: dict[Shape, KernelChoice] | None = None,
                  blocks: bool = False) -> QuantizedMatrix | BlockMatrix | Int4KernelMatrix | Int8KernelMatrix:
    """The matrix as the draft will hold it on `device`: ggml blocks first where the engine
    runs on the block kernels (`blocks`) and they take it, else a fused kernel's layout where
    `choices` (default: `kernels.choose` for this matrix) let it, else ggml blocks where the
    block kernels take it (`block_type`), else the portable format (dequantized per call)."""
    if blocks and block_type(q.bits, q.in_features, q.group, device) is not None:
        return BlockMatrix.from_quantized(q)
    shape = kernel_shape(q.bits, q.out_features, q.in_features)
    if shape is not None and choices is None:
        choices = choose([shape], device)
    if shape is not None and choices[shape].fused:
        return Int4KernelMatrix.from_quantized(q) if q.bits == 4 else Int8KernelMatrix.from_quantized(q)
    if block_type(q.bits, q.in_features, q.group, device) is not None:
        return BlockMatrix.from_quantized(q)
    return q.to(device)


def quantize_matrix(w: torch.Tensor, bits: int) -> QuantizedMatrix:
    """Symmetric per-group quantization of w [..., out, in] (any float dtype)."""
    in_features = w.shape[-1]
    g = group_size(in_features, bits)
    qmax = (1 << (bits - 1)) - 1
    w32 = w.float().reshape(*w.shape[:-1], in_features // g, g)
    amax = w32.abs().amax(-1)
    ratios = CLIP_RATIOS if bits <= 2 else (1.0,)
    best, best_error = None, None
    for ratio in ratios:
        scales = _stored_scales(amax * ratio / qmax, amax)
        # Round against the stored (float16) scale so that dequantization reproduces q * s.
        q = torch.round(w32 / scales.float()[..., None]).clamp(-qmax - 1, qmax)
        if len(ratios) == 1:
            best = (scales, q)
            break
        error = (q * scales.float()[..., None] - w32).square().sum(-1)
        if best is None:
            best, best_error = (scales, q), error
            continue
        better = error < best_error
        best = (torch.where(better, scales, best[0]), torch.where(better[..., None], q, best[1]))
        best_error = torch.minimum(error, best_error)
    scales, q = best
    q = q.reshape(w.shape)
    if bits == 8:
        data = q.to(torch.int8)
    else:
        codes = (q + (1 << (bits - 1))).to(torch.uint8)
        data = pack(codes.reshape(*w.shape[:-2], -1), bits)
    return QuantizedMatrix(data.contiguous(), scales.contiguous(), bits, in_features)


def _stored_scales(scales: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Scales as stored (float16, within its range); an all-zero group gets scale 1."""
    finfo = torch.finfo(SCALE_DTYPE)
    return torch.where(amax > 0, scales, torch.ones_like(scales)).clamp(finfo.tiny, finfo.max).to(SCALE_DTYPE)


# --- experts ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedExpert:
    """One expert's (or, with a leading dim, several experts') quantized matrices."""

    gate_up: QuantizedMatrix | Int4KernelMatrix | Int8KernelMatrix  # [(n,) R, D]
    down: QuantizedMatrix | Int4KernelMatrix | Int8KernelMatrix  # [(n,) D, I]
    b_in: torch.Tensor | None = None  # [(n,) R] float32, families with expert biases
    b_out: torch.Tensor | None = None  # [(n,) D]

    @property
    def nbytes(self) -> int:
        biases = sum(b.numel() * b.element_size() for b in (self.b_in, self.b_out) if b is not None)
        return self.gate_up.nbytes + self.down.nbytes + biases

    def select(self, index) -> QuantizedExpert:
        b_in, b_out = (None if b is None else b[index] for b in (self.b_in, self.b_out))
        return QuantizedExpert(self.gate_up.select(index), self.down.select(index), b_in, b_out)

    def to(self, device, choices: dict[Shape, KernelChoice] | None = None, blocks: bool = False) -> QuantizedExpert:
        """For the draft on `device`, each matrix in the layout device_layout gives it."""
        b_in, b_out = (None if b is None else b.to(device) for b in (self.b_in, self.b_out))
        return QuantizedExpert(device_layout(self.gate_up, device, choices, blocks),
                               device_layout(self.down, device, choices, blocks), b_in, b_out)

    def dequantize(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Portable format only."""
        return self.gate_up.dequantize(dtype), self.down.dequantize(dtype)

    def scratch_bytes(self, dtype: torch.dtype) -> int:
        return max(self.gate_up.scratch_bytes(dtype), self.down.scratch_bytes(dtype))


def quantize_expert(buffer: torch.Tensor, spec: ExpertSpec, bits: int) -> QuantizedExpert:
    """Quantize a full-precision expert buffer (layout: `ExpertSpec`)."""
    v = expert_views(buffer, spec)
    biases = (None, None) if v.b_in is None else (v.b_in.float(), v.b_out.float())
    return QuantizedExpert(quantize_matrix(v.w_in, bits), quantize_matrix(v.w_out, bits), *biases)


def quantized_expert_forward(x: torch.Tensor, qexpert: QuantizedExpert, spec: ExpertSpec) -> torch.Tensor:
    """The expert on x [T, D] with its activation, each matrix dequantized to x's dtype once
    per call (or multiplied by a fused int4 / int8 kernel), result in x's dtype."""
    b_in, b_out = (None if b is None else as_dtype(b, x.dtype) for b in (qexpert.b_in, qexpert.b_out))
    return expert_forward(spec, x, qexpert.gate_up.linear, qexpert.down.linear, b_in, b_out)


def expert_matrices(spec: ExpertSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    """(out, in) of an expert's two matrices: w_in [R, D] and w_out [D, I]."""
    return (spec.in_rows, spec.hidden), (spec.hidden, spec.inter)


def draft_kernel_choices(spec: ExpertSpec, mode: str, device, blocks: bool = False) -> dict[Shape, KernelChoice]:
    """Whether each matrix of a `mode` copy goes through a fused kernel on `device`, and why
    (no verdict for the matrices the block kernels take first: `blocks`, device_layout)."""
    bits = BITS[mode]
    shapes = [kernel_shape(bits, out, in_features) for out, in_features in expert_matrices(spec)
              if not (blocks and _block_type(bits, in_features, device))]
    return choose([s for s in shapes if s is not None], device)


def kernel_notes(matrices, choices: dict[Shape, KernelChoice], device, blocks: bool = False) -> dict[str, str]:
    """`specmoe info`'s line for each (bits, out, in) matrix of a copy: the layout
    device_layout gives it, and why."""
    notes = {}
    for bits, out, in_features in matrices:
        shape = kernel_shape(bits, out, in_features)
        kind = _block_type(bits, in_features, device)
        choice = choices.get(shape)
        key = shape.key if shape is not None else f"int{bits} N={out} K={in_features}"
        if kind is not None and blocks:
            notes[key] = f"blockdot: the codes and scales as ggml {kind} blocks, unchanged (the engine's kernels)"
        elif kind is not None and not (choice is not None and choice.fused):
            why = f" ({choice.why})" if choice is not None else ""
            notes[key] = f"blockdot: the codes and scales as ggml {kind} blocks, unchanged; not fused{why}"
        elif choice is not None:
            notes[key] = choice.describe()
    return notes


def draft_copy_bytes(spec: ExpertSpec, mode: str, device=None, dtype=torch.float32, blocks: bool = False,
                     ) -> tuple[int, int]:
    """(bytes of one expert's quantized copy, scratch bytes a call dequantizes at most),
    without building it: in the layout `device_layout` gives it on `device` (None: the
    portable layout, as stored; `blocks` as there), computing in `dtype`; float32 biases
    where the family has them."""
    if mode == "none":
        return 0, 0
    bits, elem = BITS[mode], torch.tensor([], dtype=dtype).element_size()
    copy = 4 * (spec.in_rows + spec.hidden) if spec.bias else 0
    scratch = 0
    choices = draft_kernel_choices(spec, mode, device, blocks) if device is not None else {}
    for out, in_features in expert_matrices(spec):
        shape, groups = kernel_shape(bits, out, in_features), in_features // group_size(in_features, bits)
        fused = shape in choices and choices[shape].fused
        block = device is not None and _block_type(bits, in_features, device)
        if blocks and block:
            copy += block_bytes(bits, out, in_features)
        elif fused and bits == 4:
            copy += out * in_features // 2 + groups * out * 2 * 2  # int4 pairs + bfloat16 (scale, zero)
        elif fused:  # int8 kernel: the same codes and bfloat16 row scales, each 64-byte aligned
            copy += padded(out * in_features, 1) + 2 * padded(out, 2)
        elif block:
            copy += block_bytes(bits, out, in_features)
        else:
            copy += packed_size(out * in_features, bits) + out * groups * torch.tensor([], dtype=SCALE_DTYPE).element_size()
            scratch = max(scratch, out * in_features * elem)
    return copy, scratch


class QuantizedExperts:
    """Quantized copies of experts, stacked per MoE block: layer -> QuantizedExpert [E, ...]."""

    def __init__(self, mode: str, layers: dict[int, QuantizedExpert], spec: ExpertSpec):
        self.mode = mode
        self.layers = layers
        self.spec = spec
        self._experts: dict[tuple[int, int], QuantizedExpert] = {}  # views, made once: a draft asks every pass
        self.kernels: dict[str, str] = {}  # shape class -> fused or portable, and why (set by `to`)
        # the dtype the copies compute in whatever the input's (the fused kernels' bfloat16),
        # or None (the input's): the draft converts a block's input once, not per expert
        kernels = all(isinstance(m, (Int4KernelMatrix, Int8KernelMatrix)) for q in layers.values()
                      for m in (q.gate_up, q.down))
        self.compute_dtype = torch.bfloat16 if kernels and layers else None

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.layers.values())

    def scratch_bytes(self, dtype: torch.dtype) -> int:
        """Device bytes of the largest matrix one quantized expert call dequantizes (0 with the fused kernel)."""
        return max((q.select(0).scratch_bytes(dtype) for q in self.layers.values()), default=0)

    def expert(self, layer: int, e: int) -> QuantizedExpert:
        if (layer, e) not in self._experts:
            self._experts[layer, e] = self.layers[layer].select(e)
        return self._experts[layer, e]

    def to(self, device, blocks: bool = False, release: bool = False) -> QuantizedExperts:
        """On `device`, in the layouts device_layout gives them (one self-check for all the
        shapes a fused kernel may take). `release`: this object gives up each block as its
        moved copy is made, for a caller that keeps only the result; converting every block
        first held both layouts of all copies at once (int8 copies in the block kernels'
        layout: twice their 214 MB on the 4x widened demo model, 0.2 GB past the run's bound)."""
        matrices = {(m.bits, m.out_features, m.in_features) for q in self.layers.values() for m in (q.gate_up, q.down)}
        shapes = {kernel_shape(*m) for m in matrices
                  if not (blocks and _block_type(m[0], m[2], device))} - {None}
        choices = choose(sorted(shapes, key=lambda s: s.key), device)
        layers = {}
        for layer in list(self.layers):
            source = self.layers.pop(layer) if release else self.layers[layer]
            layers[layer] = source.to(device, choices, blocks)
            del source
            if release:
                release_free_memory()
        moved = QuantizedExperts(self.mode, layers, self.spec)
        moved.kernels = kernel_notes(sorted(matrices), choices, device, blocks)
        return moved

    def block_outputs(self, layer: int, x: torch.Tensor, groups: ExpertGroups,
                      skip: set[int] = frozenset()) -> list[torch.Tensor | None]:
        """Per group of `groups` its expert's output from the quantized copy (None for
        experts in `skip`), in x's dtype. The block's rows are gathered once and the
        activation runs once over every expert's first projection: per expert only its
        two matrix products (a draft pass runs this in every block)."""
        outputs: list[torch.Tensor | None] = [None] * len(groups.experts)
        run = [j for j, e in enumerate(groups.experts) if e not in skip]
        if not run:
            return outputs
        xs = groups.split_inputs(x)
        experts = [self.expert(layer, groups.experts[j]) for j in run]
        h = [q.gate_up.linear(xs[j]) if q.b_in is None else q.gate_up.linear(xs[j]) + as_dtype(q.b_in, x.dtype)
             for j, q in zip(run, experts)]
        hidden = expert_activation(self.spec, torch.cat(h) if len(h) > 1 else h[0])
        hidden = hidden.split([groups.counts[j] for j in run])
        for j, q, a in zip(run, experts, hidden):
            y = q.down.linear(a)
            outputs[j] = y if q.b_out is None else y + as_dtype(q.b_out, y.dtype)
        return outputs

    # safetensors: "{layer}.{gate_up|down}.{data|scales}", "{layer}.{b_in|b_out}"
    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for layer, q in self.layers.items():
            for part, m in (("gate_up", q.gate_up), ("down", q.down)):
                out[f"{layer}.{part}.data"] = m.data.contiguous()
                out[f"{layer}.{part}.scales"] = m.scales.contiguous()
            for part, b in (("b_in", q.b_in), ("b_out", q.b_out)):
                if b is not None:
                    out[f"{layer}.{part}"] = b.contiguous()
        return out

    @classmethod
    def from_state_dict(cls, mode: str, tensors: dict[str, torch.Tensor], spec: ExpertSpec) -> QuantizedExperts:
        bits = BITS[mode]
        layers = {}
        for layer in sorted({int(k.split(".")[0]) for k in tensors}):
            gu = QuantizedMatrix(tensors[f"{layer}.gate_up.data"], tensors[f"{layer}.gate_up.scales"], bits, spec.hidden)
            dn = QuantizedMatrix(tensors[f"{layer}.down.data"], tensors[f"{layer}.down.scales"], bits, spec.inter)
            layers[layer] = QuantizedExpert(gu, dn, tensors.get(f"{layer}.b_in"), tensors.get(f"{layer}.b_out"))
        return cls(mode, layers, spec)
