"""Quantized tensors as checkpoints store them, read into float (non-expert weights) or
into one expert's blob (routed experts stay quantized; layout: quantization.py).

- block-scaled FP8 (DeepSeek-V3, Kimi-K2): `weight` in float8_e4m3fn, `weight_scale_inv`;
- MXFP4 (GPT-OSS): `*_blocks` / `*_scales`;
- compressed-tensors: read with the `compressed-tensors` library, the format's own
  implementation (`weight_packed` / `weight_shape`, or `weight` in int8 / float8, and
  `weight_scale`).
"""

from __future__ import annotations

import re

import torch

from .errors import SpecMoEError
from .quantization import ExpertQuant, MatrixQuant

# The 16 values of a 4-bit float (e2m1): codes 0-7 positive, 8-15 their negatives.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "e8m0": torch.uint8}
CT_SUFFIXES = ("_packed", "_scale", "_shape", "_zero_point", "_g_idx", "_scale_inv")  # beside a `.weight`


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block-scaled FP8 -> float32 (DeepSeek-V3, Kimi-K2): each block x block tile of the
    weight [out, in] times its entry of scale_inv [ceil(out / b0), ceil(in / b1)]."""
    return weight.float() * expand_scales(scale_inv.float(), block, weight.shape)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> float32: blocks [..., G, 16] uint8 (two codes a byte, low nibble first),
    scales [..., G] uint8 (the block's power of two, biased by 127) -> [..., G * 32]."""
    lut = torch.tensor(FP4_VALUES)
    codes = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = torch.ldexp(codes.reshape(*blocks.shape[:-1], 32), scales.to(torch.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


def expand_scales(scales: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """A grid of scales [ceil(rows / b0), ceil(cols / b1)] -> one per weight [rows, cols]."""
    rows, cols = shape
    return scales.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """4-bit codes [rows, cols] (0..15) -> uint8 [rows, cols / 2], the even column in the low nibble."""
    v = values.to(torch.uint8)
    return (v[:, 0::2] | (v[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: uint8 [rows, cols / 2] -> codes uint8 [rows, cols]."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


# --- one expert's blob -----------------------------------------------------------------------


def stack_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], part_block_rows: int, m: MatrixQuant):
    """One matrix from row blocks (gate and up into w_in): codes stacked, and scales stacked
    when the blob keeps the checkpoint's blocks, else repeated to one scale row per row."""
    codes = torch.cat([c for c, _ in parts])
    if m.block_rows == part_block_rows or len(parts) == 1:
        return codes, torch.cat([s for _, s in parts])
    rows = [s.repeat_interleave(part_block_rows, 0)[: c.shape[0]] for c, s in parts]
    return codes, torch.cat(rows)


def pack_blob(quant: ExpertQuant, w_in, w_out, b_in=None, b_out=None) -> torch.Tensor:
    """The blob of one expert from w_in / w_out as (codes [rows, cols], scales): codes
    int8 / int4 as signed integers, fp4 as e2m1 codes 0..15, fp8 as float8_e4m3fn ->
    uint8 [quant.nbytes]."""
    blob = torch.zeros(quant.nbytes, dtype=torch.uint8)
    sections = quant.sections()
    for name, (codes, scales), m in (("w_in", w_in, quant.w_in), ("w_out", w_out, quant.w_out)):
        if tuple(codes.shape) != (m.rows, m.cols) or tuple(scales.shape) != m.scale_shape:
            raise SpecMoEError(f"expert {name}: codes {list(codes.shape)} / scales {list(scales.shape)} do not match "
                               f"{m.rows}x{m.cols} with {list(m.scale_shape)} scales; the checkpoint is not what its "
                               "config.json says")
        if m.codes == "int4":
            codes = codes.to(torch.int16) + 8  # stored unsigned
        packed = pack_nibbles(codes) if m.bits == 4 else codes.contiguous()
        _put(blob, sections[f"{name}.codes"], packed)
        _put(blob, sections[f"{name}.scales"], scales.to(SCALE_DTYPES[m.scale_dtype]).contiguous())
    if quant.bias:
        _put(blob, sections["b_in"], b_in.float().contiguous())
        _put(blob, sections["b_out"], b_out.float().contiguous())
    return blob


def _put(blob: torch.Tensor, section: tuple[int, int], t: torch.Tensor) -> None:
    offset, n = section
    blob[offset:offset + n].copy_(t.reshape(-1).view(torch.uint8))


# --- compressed-tensors ------------------------------------------------------------------------


class CompressedTensors:
    """A compressed-tensors checkpoint's quantization, with the library's own code."""

    def __init__(self, qc: dict, where: str):
        try:
            from compressed_tensors.compressors import BaseCompressor
            from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
            from compressed_tensors.quantization import QuantizationConfig
        except ImportError:
            raise SpecMoEError(f"{where} is a compressed-tensors checkpoint: install the library that reads it, "
                               "pip install compressed-tensors") from None
        self._registry, self._unpack = BaseCompressor, unpack_from_int32
        self.config = QuantizationConfig.model_validate(qc)

    def scheme(self, module: str):
        """The config group whose targets take `module` (a Linear), None when it is ignored."""
        if any(_matches(p, module) for p in self.config.ignore or ()):
            return None
        return next((g for g in self.config.config_groups.values() if any(_matches(t, module) for t in g.targets)),
                    None)

    def dequantize(self, module: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """A quantized Linear's weight in float32, from its serialized tensors (`weight_*`)."""
        scheme = self.scheme(module)
        if scheme is None:
            raise SpecMoEError(f"{module}: quantized in the checkpoint but no config group targets it")
        compressor = self._registry.get_value_from_registry(scheme.format or self.config.format)
        return compressor.decompress(tensors, scheme)["weight"].float()

    def codes(self, tensors: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
        """A matrix's integer codes (int8 [rows, cols]) or float8 values, as stored."""
        if "weight_packed" in tensors:
            shape = torch.Size(int(v) for v in tensors["weight_shape"].tolist())
            return self._unpack(tensors["weight_packed"], bits, shape)
        return tensors["weight"]


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in ("Linear", module) or module.endswith("." + target)
