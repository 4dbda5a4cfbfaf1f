"""How a checkpoint stores its routed experts when they are quantized, read from
config.json's `quantization_config`, and the layout of one quantized expert's blob.

Data only (no torch): the cost model, `specmoe info` and the budget count with it; the
experts layer (experts/formats.py) packs and computes with it.

Checkpoints read (each expert matrix W [out, in], `in` the input dimension):

- `fp8` (DeepSeek-V3, R1, Kimi-K2): float8_e4m3fn codes, one float32 `weight_scale_inv`
  per block of `weight_block_size` = (rows, columns);
- `mxfp4` (GPT-OSS): 4-bit e2m1 codes two to a byte, one power-of-two scale (e8m0) per
  32 columns;
- `compressed-tensors` (what llm-compressor writes and vLLM loads): int4 / int8 codes
  (`pack-quantized`, `int-quantized`) or float8 (`float-quantized`), symmetric, one scale
  per group of columns, per row (channel), per matrix (tensor) or per block.

One expert is one blob, each section 16-byte aligned (so that it can be viewed as its
dtype in place):

    [w_in codes | w_in scales | w_out codes | w_out scales | b_in | b_out]

w_in is [R, D] (gated: gate rows, then up rows), w_out [D, I], as in `ExpertSpec`. Codes:
int8 as signed bytes; int4 as q + 8 and fp4 as e2m1, two to a byte, the even column in
the low nibble; fp8 as float8_e4m3fn. Biases in float32.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from .errors import SpecMoEError
from .specs import ExpertSpec

CODE_BITS = {"int8": 8, "int4": 4, "fp8": 8, "fp4": 4}
SCALE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "e8m0": 1}
SECTION_ALIGN = 16
CT_FORMATS = {"pack-quantized", "int-quantized", "naive-quantized", "float-quantized"}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _align(n: int) -> int:
    return _ceil(n, SECTION_ALIGN) * SECTION_ALIGN


@dataclass(frozen=True)
class MatrixQuant:
    """One quantized matrix [rows, cols]: its codes and a grid of scales, each scale
    shared by a block of `block_rows` x `group` weights (the last block may be partial)."""

    rows: int
    cols: int
    codes: str  # int8 | int4 | fp8 | fp4
    block_rows: int
    group: int
    scale_dtype: str  # float32 | bfloat16 | float16 | e8m0 (a power of two, biased by 127)

    def __post_init__(self):
        if self.codes not in CODE_BITS or self.scale_dtype not in SCALE_BYTES:
            raise SpecMoEError(f"internal: bad matrix quantization {self.codes}/{self.scale_dtype}")
        if CODE_BITS[self.codes] == 4 and self.cols % 2:
            raise SpecMoEError(f"config.json: 4-bit expert matrices need an even input dimension, not {self.cols}")

    @property
    def bits(self) -> int:
        return CODE_BITS[self.codes]

    @property
    def scale_shape(self) -> tuple[int, int]:
        return _ceil(self.rows, self.block_rows), _ceil(self.cols, self.group)

    @property
    def code_bytes(self) -> int:
        return self.rows * self.cols * self.bits // 8

    @property
    def scale_bytes(self) -> int:
        r, c = self.scale_shape
        return r * c * SCALE_BYTES[self.scale_dtype]


@dataclass(frozen=True)
class ExpertQuant:
    """A routed expert's quantized form: both matrices, where its biases go, and the blob."""

    scheme: str  # what users call it: int4, int8, fp8, mxfp4
    source: str  # the checkpoint's format: fp8 | mxfp4 | compressed-tensors
    w_in: MatrixQuant
    w_out: MatrixQuant
    bias: bool = False  # b_in [R] and b_out [D] in float32 after the matrices
    part_block_rows: int = 1  # the checkpoint's rows per scale in gate and up (w_in may hold one scale row per row)

    def sections(self) -> dict[str, tuple[int, int]]:
        """name -> (offset, bytes) in the blob."""
        sizes = [("w_in.codes", self.w_in.code_bytes), ("w_in.scales", self.w_in.scale_bytes),
                 ("w_out.codes", self.w_out.code_bytes), ("w_out.scales", self.w_out.scale_bytes)]
        if self.bias:
            sizes += [("b_in", 4 * self.w_in.rows), ("b_out", 4 * self.w_out.rows)]
        out, offset = {}, 0
        for name, n in sizes:
            out[name] = (offset, n)
            offset = _align(offset + n)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of one expert's blob: what the tiers store, a pool slot holds and a fetch moves."""
        return _align(max(offset + n for offset, n in self.sections().values()))

    @property
    def weights(self) -> int:
        return self.w_in.rows * self.w_in.cols + self.w_out.rows * self.w_out.cols

    def describe(self) -> str:
        m = self.w_in
        grid = (f"{m.block_rows}x{m.group} blocks" if m.block_rows > 1 else
                "per row" if m.group >= m.cols else f"groups of {m.group}")
        return f"{self.scheme} ({self.source}; {grid}, {m.scale_dtype} scales; {8 * self.nbytes / self.weights:.2f} bits/weight)"

    def identity(self) -> dict:
        """What the disk tier's file header records, so that a file of other blobs is never read as these."""
        return {"scheme": self.scheme, "source": self.source, "bias": self.bias,
                **{f"{name}": [m.rows, m.cols, m.codes, m.block_rows, m.group, m.scale_dtype]
                   for name, m in (("w_in", self.w_in), ("w_out", self.w_out))}}

    def with_scale_dtype(self, dtype: str) -> ExpertQuant:
        return replace(self, w_in=replace(self.w_in, scale_dtype=dtype), w_out=replace(self.w_out, scale_dtype=dtype))


def _expert(scheme: str, source: str, spec: ExpertSpec, codes: str, grid, scale_dtype: str) -> ExpertQuant:
    """Both matrices of an expert from `grid(rows, cols, part_rows) -> (block_rows, group)`
    applied to the checkpoint's parts: gate and up [I, D] stacked into w_in, down [D, I]."""
    R, D, I = spec.in_rows, spec.hidden, spec.inter
    part_rows, group = grid(I, D)
    # a block straddling gate and up would mix two matrices' scales: one scale row per row instead
    block_rows = 1 if R != I and I % part_rows else part_rows
    w_in = MatrixQuant(R, D, codes, block_rows, group, scale_dtype)
    w_out = MatrixQuant(D, I, codes, *grid(D, I), scale_dtype)
    return ExpertQuant(scheme, source, w_in, w_out, spec.bias, part_rows)


def expert_quant(cfg: dict, spec: ExpertSpec, dtype: str, where: str = "config.json") -> ExpertQuant | None:
    """The experts' quantized form from `quantization_config`, or None for float experts.
    `dtype` is the checkpoint's dtype name: the usual dtype of compressed-tensors scales
    (the checkpoint's tensors have the last word: Checkpoint checks them)."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise SpecMoEError(f"{where}: FP8 format {fmt!r} is not supported; specmoe reads e4m3 (DeepSeek-V3 style)")
        rows, cols = (int(v) for v in qc.get("weight_block_size") or (128, 128))
        return _expert("fp8", "fp8", spec, "fp8", lambda r, c: (rows, cols), "float32")
    if method == "mxfp4":
        return _expert("mxfp4", "mxfp4", spec, "fp4", lambda r, c: (1, 32), "e8m0")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, spec, dtype, where)
    raise SpecMoEError(f"{where}: quant_method {method!r} is not supported; specmoe reads fp8 (block-wise), "
                       "mxfp4 and compressed-tensors checkpoints")


def experts_group(qc: dict) -> dict:
    """The config group that quantizes the routed experts, chosen as transformers does: the
    one whose `re:` targets name experts, else the first with a class-name target ("Linear")."""
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        return {}
    for group in groups:
        if any(t.startswith("re:") and "experts" in t for t in group.get("targets") or ()):
            return group
    return next((g for g in groups if any(not t.startswith("re:") for t in g.get("targets") or ())), groups[0])


def _compressed_tensors(qc: dict, spec: ExpertSpec, dtype: str, where: str) -> ExpertQuant | None:
    group = experts_group(qc)
    weights = group.get("weights")
    if not weights or _ignored(qc.get("ignore") or ()):
        return None
    fmt = group.get("format") or qc.get("format") or "pack-quantized"
    kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 8))
    codes = {("int", 4): "int4", ("int", 8): "int8", ("float", 8): "fp8"}.get((kind, bits))
    problem = None
    if fmt not in CT_FORMATS:
        problem = f"format {fmt!r}"
    elif codes is None:
        problem = f"{bits}-bit {kind} weights"
    elif not weights.get("symmetric", True):
        problem = "asymmetric weights (zero points)"
    elif weights.get("actorder") == "group":
        problem = "activation-ordered groups (actorder=group, weight_g_idx)"
    elif weights.get("dynamic"):
        problem = "dynamically quantized weights"
    elif (group.get("input_activations") or {}).get("dynamic") is False:
        problem = "statically quantized activations"
    if problem:
        raise SpecMoEError(f"{where}: the experts' compressed-tensors scheme has {problem}, which specmoe does not "
                           "read; it reads symmetric int4 / int8 / fp8 weights (the W4A16, W8A16 and FP8 presets): "
                           "requantize the float model with `specmoe quantize`")
    strategy, size = weights.get("strategy", "tensor"), weights.get("group_size")
    block = weights.get("block_structure")
    grids = {"group": lambda r, c: (1, int(size or c)), "channel": lambda r, c: (1, c),
             "tensor": lambda r, c: (r, c), "block": lambda r, c: tuple(int(v) for v in block or (r, c))}
    if strategy not in grids:
        raise SpecMoEError(f"{where}: compressed-tensors strategy {strategy!r} is not supported for expert weights; "
                           f"use one of {', '.join(grids)}")
    scale = dtype if dtype in SCALE_BYTES and dtype != "e8m0" else "bfloat16"
    return _expert({"int4": "int4", "int8": "int8", "fp8": "fp8"}[codes], "compressed-tensors", spec, codes,
                   grids[strategy], scale)


# Module names of routed experts as the Hub writes them, to test `ignore` patterns against.
_SAMPLE_EXPERTS = ("model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.block_sparse_moe.experts.0.w1")


def _ignored(patterns) -> bool:
    """Whether the ignore list leaves the routed experts unquantized."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if any(re.match(pattern[3:], name) for name in _SAMPLE_EXPERTS):
                return True
        elif pattern in _SAMPLE_EXPERTS:
            return True
    return False
