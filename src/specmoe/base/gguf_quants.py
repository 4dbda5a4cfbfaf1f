"""GGUF's tensor encodings (llama.cpp's ggml types), dequantized in torch.

A ggml tensor is rows of blocks; each block holds `BLOCKS[type] = (values, bytes)`. One
function per type turns a whole matrix's blocks into float32 at once (no Python loop over
blocks), on whatever device the bytes are. Layouts, per block of the type:

- Q8_0: f16 d, 32 int8 q; x = d q.
- Q4_0 / Q4_1: f16 d (and f16 m), 16 bytes of nibbles: value j in the low nibble of byte j,
  value j + 16 in its high nibble; x = d (q - 8), or d q + m.
- Q5_0 / Q5_1: as Q4_*, and a 32-bit mask holding each value's fifth bit (bit j: value j).
- K-quants (256 values; sub-blocks of 16 or 32 with their own 4- to 8-bit scales):
  Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (layouts in each function).
- MXFP4: one e8m0 exponent, 16 bytes of e2m1 nibbles ordered as Q4_0's.
- F32, F16, BF16: plain values.

Any other type (IQ*, TQ*) goes through the `gguf` package's own numpy dequantization, on
the CPU (`dequantize` says so with `native`). Verified tensor by tensor against it:
tests/test_gguf_quants.py.
"""

from __future__ import annotations

import torch

from .errors import SpecMoEError

# ggml type id -> name, as GGUF files number them (ggml.h)
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
              11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
              19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
              27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
TYPE_IDS = {name: i for i, name in TYPE_NAMES.items()}
# name -> (values per block, bytes per block)
BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
          "Q5_1": (32, 24), "Q8_0": (32, 34), "Q8_1": (32, 40), "Q2_K": (256, 84), "Q3_K": (256, 110),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q8_K": (256, 292), "IQ2_XXS": (256, 66),
          "IQ2_XS": (256, 74), "IQ3_XXS": (256, 98), "IQ1_S": (256, 50), "IQ4_NL": (32, 18), "IQ3_S": (256, 110),
          "IQ2_S": (256, 82), "IQ4_XS": (256, 136), "IQ1_M": (256, 56), "TQ1_0": (256, 54), "TQ2_0": (256, 66),
          "MXFP4": (32, 17)}


def row_bytes(type_name: str, cols: int) -> int:
    """Bytes of one row of `cols` values."""
    values, nbytes = BLOCKS[type_name]
    if cols % values:
        raise SpecMoEError(f"GGUF: a {type_name} row of {cols} values is not whole blocks of {values}")
    return cols // values * nbytes


def bits_per_weight(type_name: str) -> float:
    values, nbytes = BLOCKS[type_name]
    return 8 * nbytes / values


def native(type_name: str) -> bool:
    """Whether this module dequantizes the type itself (else the gguf package does, on the CPU)."""
    return type_name in _DEQUANT or type_name in ("F32", "F16", "BF16")


def dequantize(raw: torch.Tensor, type_name: str, rows: int, cols: int, dtype=torch.float32) -> torch.Tensor:
    """A [rows, cols] matrix in `dtype` from its GGUF bytes (uint8, rows * row_bytes)."""
    raw = raw.reshape(-1)
    if raw.numel() != rows * row_bytes(type_name, cols):
        raise SpecMoEError(f"GGUF: {raw.numel()} bytes do not hold a {rows}x{cols} {type_name} matrix")
    if type_name in ("F32", "F16", "BF16"):
        plain = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
        return raw.view(plain).view(rows, cols).to(dtype)
    fn = _DEQUANT.get(type_name)
    if fn is None:
        return _with_gguf(raw, type_name, rows, cols).to(raw.device, dtype)
    values, nbytes = BLOCKS[type_name]
    blocks = raw.view(-1, nbytes)
    return fn(blocks).view(rows, cols).to(dtype)


def _with_gguf(raw: torch.Tensor, type_name: str, rows: int, cols: int) -> torch.Tensor:
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as np_dequantize
    except ImportError:
        raise SpecMoEError(f"GGUF tensors of type {type_name} need the gguf package: pip install gguf") from None
    try:
        out = np_dequantize(raw.cpu().numpy().reshape(rows, -1), GGMLQuantizationType[type_name])
    except (NotImplementedError, KeyError):
        raise SpecMoEError(f"GGUF tensor type {type_name} is not supported (the gguf package cannot dequantize it); "
                           "use a file quantized as Q8_0, Q6_K, Q5_K, Q4_K, Q4_0 or MXFP4") from None
    return torch.from_numpy(out.astype("float32", copy=False)).reshape(rows, cols)


# --- the pieces of a block ---------------------------------------------------------------------------


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block, as float32 [n, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """Bytes [..., k] -> [..., 2k]: the low nibbles, then the high ones (ggml's order)."""
    return torch.cat([q & 0x0F, q >> 4], dim=-1)


def _bits(mask: torch.Tensor, count: int, width: int = 1) -> torch.Tensor:
    """Bytes [n, m] -> [n, count, m]: field i of width `width` bits of every byte (i * width up)."""
    shifts = torch.arange(0, count * width, width, device=mask.device, dtype=torch.uint8)
    return (mask[:, None, :] >> shifts[None, :, None]) & ((1 << width) - 1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float().mul_(_f16(b, 0))


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 2:]).float().sub_(8).mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:]).float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _fifth_bits(b: torch.Tensor, at: int) -> torch.Tensor:
    """Q5_*: the 32-bit mask at byte `at` as [n, 32] bits, value j's in bit j."""
    mask = b[:, at:at + 4].contiguous().view(torch.int32)  # [n, 1], little-endian
    return ((mask >> torch.arange(32, device=b.device, dtype=torch.int32)) & 1).to(torch.uint8)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:]) | (_fifth_bits(b, 2) << 4)
    return q.float().sub_(16).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]) | (_fifth_bits(b, 4) << 4)
    return q.float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins. Bytes 0-3 hold scales
    0-3 (low 6 bits) and the top bits of scales 4-7; bytes 4-7 the same for the mins;
    bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    Unpacked four bytes at a time, as int32 words (little-endian): a few operations per
    block row instead of a dozen small ones per byte group."""
    d, m, md = s.contiguous().view(torch.int32).unbind(1)
    words = torch.stack([d & 0x3F3F3F3F, (md & 0x0F0F0F0F) | ((d >> 2) & 0x30303030),
                         m & 0x3F3F3F3F, ((md >> 4) & 0x0F0F0F0F) | ((m >> 2) & 0x30303030)], dim=1)
    values = words.view(torch.uint8).float()  # [n, 16]: the 8 scales, then the 8 mins
    return values[:, :8], values[:, 8:]


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """f16 d, f16 dmin, 12 bytes of scales and mins, 128 bytes: four runs of 32 bytes, each
    two sub-blocks of 32 (low nibbles, then high); x = d sc q - dmin m per sub-block."""
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return q.mul_((_f16(b, 0) * sc)[:, :, None]).sub_((_f16(b, 2) * mn)[:, :, None]).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K's layout with 32 bytes of fifth bits after the scales: bit i of byte j belongs
    to value j of sub-block i."""
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    low = _nibbles(b[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    q = (low | (_bits(b[:, 16:48], 8) << 4)).float()
    return q.mul_((_f16(b, 0) * sc)[:, :, None]).sub_((_f16(b, 2) * mn)[:, :, None]).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """128 bytes of low nibbles (per half of 128 values: 64 bytes, low then high nibbles),
    64 bytes of 2-bit high parts (per half: 32 bytes, four fields of 32 values), 16 int8
    scales (one per 16 values), f16 d; x = d sc (q - 32)."""
    n = b.shape[0]
    low = _nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 256)
    high = _bits(b[:, 128:192].reshape(n * 2, 32), 4, 2).reshape(n, 256)
    q = (low | (high << 4)).float().sub_(32).view(n, 16, 16)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    return q.mul_((_f16(b, 208) * scales)[:, :, None]).reshape(n, 256)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """16 bytes of (4-bit scale | 4-bit min << 4) per 16 values, 64 bytes of 2-bit codes (per
    half of 128 values: 32 bytes, four fields of 32 values), f16 d, f16 dmin."""
    n = b.shape[0]
    s = b[:, :16]
    q = _bits(b[:, 16:80].reshape(n * 2, 32), 4, 2).reshape(n, 16, 16).float()
    d, dmin = _f16(b, 80), _f16(b, 82)
    return q.mul_((d * (s & 0x0F).float())[:, :, None]).sub_((dmin * (s >> 4).float())[:, :, None]).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """32 bytes of high bits (bit i of byte j: value j of the i-th run of 32; set means no
    offset), 64 bytes of 2-bit codes (as Q2_K's), 12 bytes of 16 six-bit signed scales (low
    nibbles of bytes 0-7, then their high nibbles; top 2 bits in bytes 8-11), f16 d;
    x = d (sc - 32) (q - 4 (1 - h))."""
    n = b.shape[0]
    low = _bits(b[:, 32:96].reshape(n * 2, 32), 4, 2).reshape(n, 256)
    high = _bits(b[:, :32], 8).reshape(n, 256)
    q = (low.float() - 4 * (1 - high.float())).view(n, 16, 16)
    s = b[:, 96:108]
    top = _bits(s[:, 8:12], 4, 2).reshape(n, 16)
    scales = (_nibbles(s[:, :8]) | (top << 4)).float() - 32
    return q.mul_((_f16(b, 108) * scales)[:, :, None]).reshape(n, 256)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    """One e8m0 exponent e, 16 bytes of e2m1 nibbles; x = doubled value * 2^(e - 128) =
    e2m1 value * 2^(e - 127). A code's bits moved into bfloat16's (s ee m -> s 000000ee
    m000000) are its e2m1 value * 2^-126, exactly: no table lookup."""
    c = _nibbles(b[:, 1:]).to(torch.int16)
    values = (((c & 0x8) << 12) | ((c & 0x7) << 6)).view(torch.bfloat16).float()
    return values.mul_(2.0 ** 126).mul_(torch.exp2(b[:, :1].float() - 127))


_DEQUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k,
            "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4}
