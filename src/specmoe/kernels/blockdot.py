"""Matrices multiplied in their GGUF block encoding, by blockdot.c: the weights stay as the
file stores them (Q4_K, Q6_K, Q8_0, ...), and each activation row is quantized to 8 bits
in blocks of 32 as llama.cpp does before its own products.

blockdot.c is compiled once per machine by the system's C compiler (`cc`, `-O3
-march=native`) into the cache dir, keyed by the source, the compiler and the CPU, and
loaded with ctypes: nothing to install beyond a C compiler, which pip's own builds need
anyway. Before a build is used, a child process (`python -m
specmoe.kernels.blockdot_check`) multiplies random blocks of every type through it, on
both of its paths (AVX-512 VNNI and portable C), and compares with the blocks dequantized
by base/gguf_quants.py and multiplied in float64: a build that crashes there, or misses,
is never loaded into the engine, and the matrices take the dequantizing path with a one-line warning
(`available()` says why). `SPECMOE_BLOCKDOT=off` turns it off; `=portable` keeps the
portable C path only.

It also packs a quantized checkpoint's int8 / int4 / fp4 codes into Q8_0 / Q4_0 / MXFP4
blocks as an expert enters its pool slot (`pack_blocks`: bytes moved, no arithmetic).

Batch invariance (blockdot.c's header): an output element depends only on its own
activation row and weight row, so a row's product is the same bits alone or among 1088.

Shapes: M rows of activations, K inputs, N outputs.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from ..base.errors import SpecMoEError, warn
from ..base.gguf_quants import TYPE_IDS, row_bytes
from ..base.paths import cache_dir
from .cpu import cpu_id

SOURCE = Path(__file__).with_name("blockdot.c")
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
ENV = "SPECMOE_BLOCKDOT"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-pthread")
CHECK_TIMEOUT_S = 120


@dataclass(frozen=True)
class Library:
    """The loaded build, or why there is none (`lib` None)."""

    lib: ctypes.CDLL | None
    why: str
    simd: bool = False

    def describe(self) -> str:
        return self.why


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_path(portable: bool = False) -> Path | None:
    cc = _compiler()
    if cc is None:
        return None
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(json.dumps([SOURCE.read_text(), version, FLAGS, cpu_id(), portable]).encode()).hexdigest()
    return cache_dir() / "kernels" / f"blockdot-{key[:16]}.so"


def build(portable: bool = False) -> Path:
    """The shared library for this machine, compiled now unless the cache dir has it."""
    out = build_path(portable)
    if out is None:
        raise SpecMoEError("no C compiler (cc or gcc) found to build specmoe's block kernels; install one "
                           "(apt-get install gcc) or set SPECMOE_BLOCKDOT=off")
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [_compiler(), *FLAGS, *(["-DSMK_PORTABLE"] if portable else []), str(SOURCE), "-o", str(tmp), "-lm"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        tmp.unlink(missing_ok=True)
        last = (run.stderr.strip().splitlines() or ["no message"])[-1]
        raise SpecMoEError(f"compiling specmoe's block kernels failed ({last[:200]}); set SPECMOE_BLOCKDOT=off")
    os.replace(tmp, out)
    return out


def load(path: Path) -> ctypes.CDLL:
    """The build at `path`, its entry points typed (no check: `library` loads checked builds)."""
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.smk_act_bytes.argtypes, lib.smk_act_bytes.restype = [i64], i64
    lib.smk_pack_blocks.argtypes, lib.smk_pack_blocks.restype = [ptr, ptr, ctypes.c_int, ctypes.c_int, i64, ptr], None
    lib.smk_quantize.argtypes, lib.smk_quantize.restype = [ptr, i64, i64, i64, ptr, ctypes.c_int], None
    lib.smk_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]
    lib.smk_matmul.restype = ctypes.c_int
    lib.smk_set_threads.argtypes, lib.smk_set_threads.restype = [ctypes.c_int], None
    lib.smk_experts_scratch.argtypes, lib.smk_experts_scratch.restype = [ctypes.c_int, i64, i64, i64], i64
    lib.smk_experts.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.smk_experts.restype = ctypes.c_int
    lib.smk_linear.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, ptr, i64, ptr, i64, ptr, ctypes.c_int]
    lib.smk_linear.restype = ctypes.c_int
    lib.smk_matmul_f32.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]
    lib.smk_matmul_f32.restype = None
    lib.smk_attend.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_int, ctypes.c_float, ptr,
                               i64, i64, i64, i64, ctypes.c_int]
    lib.smk_attend.restype = None
    lib.smk_rms_norm.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_float, ptr, i64]
    lib.smk_rms_norm.restype = None
    lib.smk_matmul_bf16.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]
    lib.smk_matmul_bf16.restype = None
    return lib


# --- the self-check: verdicts per build, kept beside it ---------------------------------------------


def _verdict_path(so: Path) -> Path:
    return so.with_suffix(".json")


def _checked(so: Path) -> tuple[bool, str]:
    """(passed, why) for a build: its kept verdict, else a child process runs the check now."""
    path = _verdict_path(so)
    try:
        kept = json.loads(path.read_text())
        if isinstance(kept, dict) and isinstance(kept.get("ok"), bool) and isinstance(kept.get("why"), str):
            return kept["ok"], kept["why"]
    except (OSError, ValueError):
        pass
    try:
        run = subprocess.run([sys.executable, "-m", "specmoe.kernels.blockdot_check", str(so)],
                             capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        if run.returncode == 0 and lines:
            result = json.loads(lines[-1])
            ok, why = bool(result["ok"]), str(result["why"])
        elif run.returncode < 0:
            ok, why = False, f"self-check crashed (signal {-run.returncode})"
        else:
            last = (run.stderr.strip().splitlines() or ["no message"])[-1]
            ok, why = False, f"self-check failed with exit status {run.returncode}: {last[:160]}"
    except subprocess.TimeoutExpired:
        ok, why = False, f"self-check timed out after {CHECK_TIMEOUT_S} s"
    path.write_text(json.dumps({"ok": ok, "why": why}))
    return ok, why


@lru_cache(maxsize=1)
def library() -> Library:
    """This process's build of blockdot.c, once checked on this machine, or why not."""
    mode = os.environ.get(ENV, "on")
    if mode not in ("on", "off", "portable"):
        raise SpecMoEError(f"{ENV}={mode!r} is not understood; set it to 'on' (the default), 'portable' "
                           "(the block kernels' plain C path only) or 'off' (dequantize every matrix per call)")
    if mode == "off":
        return Library(None, f"{ENV}=off")
    try:
        so = build(portable=mode == "portable")
    except SpecMoEError as exc:
        warn(str(exc) + "; GGUF matrices are dequantized per call instead (slower)")
        return Library(None, str(exc))
    ok, why = _checked(so)
    if not ok:
        warn(f"specmoe's block kernels failed their self-check on this machine ({why}); "
             "GGUF matrices are dequantized per call instead (same values, slower)")
        return Library(None, why)
    lib = load(so)
    simd = bool(lib.smk_simd())
    lib.smk_set_threads(torch.get_num_threads())
    path = "AVX-512 VNNI" if simd else "portable C"
    return Library(lib, f"blockdot ({path}), {why}", simd)


def available() -> bool:
    return library().lib is not None


def as_stored(dtype_option: str, device) -> bool:
    """Whether GGUF weights are multiplied in their own encoding: the default (`--dtype
    auto`) on the CPU where the block kernels built and passed their self-check here.
    `--dtype float32` is the reference: every weight dequantized, activations unrounded."""
    return dtype_option == "auto" and torch.device(device).type == "cpu" and available()


def computes_as_stored(dtype_option: str, config, device) -> bool:
    """Whether a model (its ModelConfig) has its weights multiplied in the encoding its file
    stores them in (a GGUF file's blocks, a bfloat16 checkpoint's bfloat16) by these kernels:
    the CPU's default where they built and passed their self-check. The engine then gives
    the cores to their threads (torch's on one), and a draft's int8 / int4 copies run on
    them too (experts/quant.py)."""
    gguf = getattr(config.expert_quant, "source", None) == "gguf"
    return as_stored(dtype_option, device) and (gguf or config.torch_dtype == "bfloat16")


def computes(type_name: str) -> bool:
    """Whether the kernels multiply weights stored as `type_name`: the block types (with
    8-bit activations, as llama.cpp rounds them), and BF16 (float32 activations: matmul_bf16)."""
    return type_name in TYPES or type_name == "BF16"


def set_threads(n: int) -> None:
    lib = library().lib
    if lib is not None:
        lib.smk_set_threads(int(n))


# --- the calls ----------------------------------------------------------------------------------


def pack_blocks(codes: torch.Tensor, heads: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Blocks of 32 into `out` (uint8, contiguous): each block's scale bytes from `heads`
    (uint8 [blocks, head]), then its codes from `codes` (contiguous uint8: 8-bit codes as
    they are; 4-bit ones two a byte, the even column low, put in Q4_0's nibble order)."""
    blocks, head = heads.shape
    body = 32 if bits == 8 else 16
    if not (codes.is_contiguous() and heads.is_contiguous() and out.is_contiguous()) or head not in (1, 2) \
            or codes.numel() != blocks * body or out.numel() != blocks * (head + body):
        raise SpecMoEError(f"internal: {blocks} blocks of {bits}-bit codes do not fit their buffers")
    library().lib.smk_pack_blocks(codes.data_ptr(), heads.data_ptr(), head, bits, blocks, out.data_ptr())


def act_bytes(cols: int) -> int:
    """Bytes of one quantized activation row of `cols` values (blockdot.c's layout)."""
    cpad = -(-cols // 256) * 256
    return cpad + 2 * (cpad // 16) * 4


def act_width(type_name: str) -> int:
    """The activation blocks llama.cpp rounds to 8 bits before multiplying this weight type:
    256 values for K-quants (its Q8_K), 32 for the others (its Q8_0)."""
    return 256 if type_name.endswith("_K") else 32


def quantize(x: torch.Tensor, type_name: str, build: Library | None = None) -> tuple[torch.Tensor, int, int]:
    """x [M, K] float32 -> (M rows of 8-bit activations as blockdot.c lays them out, K,
    their block width) for products with `type_name` weights."""
    lib = (build or library()).lib
    x = x.contiguous()
    M, K = x.shape
    xq = torch.empty(M * act_bytes(K), dtype=torch.uint8)
    width = act_width(type_name)
    lib.smk_quantize(x.data_ptr(), M, K, K, xq.data_ptr(), width)
    return xq, K, width


def matmul_q(xq: tuple[torch.Tensor, int, int], raw: torch.Tensor, type_name: str, rows: int,
             out: torch.Tensor | None = None, simd: bool | None = None, build: Library | None = None) -> torch.Tensor:
    """Quantized activations (`quantize`) times W [rows, K] as `raw` GGUF bytes: [M, rows] float32.
    `simd` False takes the portable path of a build that has both."""
    build = build or library()
    codes, K, width = xq
    M = codes.numel() // act_bytes(K)
    rb = row_bytes(type_name, K)
    if raw.numel() != rows * rb or not raw.is_contiguous() or raw.dtype != torch.uint8:
        raise SpecMoEError(f"internal: {raw.numel()} bytes are not a contiguous {rows}x{K} {type_name} matrix")
    if width != act_width(type_name):
        raise SpecMoEError(f"internal: activations in blocks of {width} handed to {type_name} weights")
    y = out if out is not None else torch.empty(M, rows, dtype=torch.float32)
    use_simd = build.simd if simd is None else simd
    if build.lib.smk_matmul(TYPE_IDS[type_name], raw.data_ptr(), rows, K, rb, codes.data_ptr(), M, y.data_ptr(),
                            y.stride(0), int(use_simd)):
        raise SpecMoEError(f"internal: the block kernels do not compute {type_name} with {K} inputs")
    return y


def swiglu(x: torch.Tensor, gate: tuple[torch.Tensor, str], up: tuple[torch.Tensor, str], down: tuple[torch.Tensor, str],
           inter: int, simd: bool | None = None, build: Library | None = None) -> torch.Tensor:
    """A gated SiLU expert in one call: down(silu(gate x) * up x) for x [M, D] float32, each
    matrix as (its bytes, type): gate, up [inter, D], down [D, inter]. The products are
    `matmul`'s (a block type) or `matmul_bf16`'s (BF16); silu is computed in C (g / (1 +
    exp(-g)), row by row)."""
    return experts(x, [(gate, up, down)], [1.0], inter, simd, build)


def experts(x: torch.Tensor, matrices: list[tuple[tuple[torch.Tensor, str], ...]], weights: list[float], inter: int,
            simd: bool | None = None, build: Library | None = None) -> torch.Tensor:
    """sum over k of weights[k] * swiglu(x, *matrices[k]) for x [M, D] float32 in one call,
    added in the order given as `y * w` then `out + y` round in float32 (batch-1 decoding: a
    token's experts, as moe.one_token adds them). Each expert's output has the same bits
    alone; the threads run all the experts' gate and up rows as one job, then their down rows."""
    build = build or library()
    lib = build.lib
    x = x.float().contiguous()
    M, D = x.shape
    n = len(matrices)
    mats = [m for expert in matrices for m in expert]
    types = (ctypes.c_int * (3 * n))(*(TYPE_IDS[t] for _, t in mats))
    pointers = (ctypes.c_void_p * (3 * n))(*(raw.data_ptr() for raw, _ in mats))
    scratch = torch.empty(lib.smk_experts_scratch(n, M, D, inter), dtype=torch.uint8)
    y = torch.empty(M, D, dtype=torch.float32)
    if lib.smk_experts(n, types, pointers, (ctypes.c_float * n)(*weights), D, inter, x.data_ptr(), M, y.data_ptr(),
                       scratch.data_ptr(), int(build.simd if simd is None else simd)):
        raise SpecMoEError(f"internal: the block kernels do not compute {n} {D}x{inter} experts in "
                           f"{'/'.join(t for _, t in mats)}")
    return y


@dataclass(frozen=True)
class Parts:
    """W [rows, cols] as row ranges of their own types (GGUF block types or BF16), in the
    arrays `linear_parts` hands the kernels; `keep` holds the tensors they point into."""

    types: ctypes.Array
    pointers: ctypes.Array
    counts: ctypes.Array
    rows: int
    cols: int
    quantized: bool
    keep: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, parts: list[tuple[torch.Tensor, str, int]], cols: int) -> Parts:
        """From (contiguous bytes or bfloat16 values, type, rows) per range, top to bottom."""
        for raw, type_name, rows in parts:
            if raw.numel() * raw.element_size() != rows * row_bytes(type_name, cols) or not raw.is_contiguous():
                raise SpecMoEError(f"internal: {raw.numel() * raw.element_size()} bytes are not a contiguous "
                                   f"{rows}x{cols} {type_name} matrix")
        n = len(parts)
        return cls((ctypes.c_int * n)(*(TYPE_IDS[t] for _, t, _ in parts)),
                   (ctypes.c_void_p * n)(*(raw.data_ptr() for raw, _, _ in parts)),
                   (ctypes.c_int64 * n)(*(rows for _, _, rows in parts)), sum(r for _, _, r in parts), cols,
                   any(t != "BF16" for _, t, _ in parts), tuple(raw for raw, _, _ in parts))


def linear_parts(x: torch.Tensor, w: Parts, simd: bool | None = None, build: Library | None = None) -> torch.Tensor:
    """x [M, cols] float32 times W^T for W in `Parts`: [M, rows] float32, in one call. Each
    range's rows are computed as `matmul` (its activation blocks) or `matmul_bf16` computes
    them; the threads take all ranges as one job."""
    build = build or library()
    x = x.float().contiguous()
    M = x.shape[0]
    scratch = torch.empty(2 * M * act_bytes(w.cols) if w.quantized else 0, dtype=torch.uint8)
    y = torch.empty(M, w.rows, dtype=torch.float32)
    if build.lib.smk_linear(len(w.types), w.types, w.pointers, w.counts, w.cols, x.data_ptr(), M, y.data_ptr(),
                            w.rows, scratch.data_ptr(), int(build.simd if simd is None else simd)):
        raise SpecMoEError(f"internal: the block kernels do not compute a matrix of {w.cols} inputs in these types")
    return y


def matmul_f32(x: torch.Tensor, weight: torch.Tensor, simd: bool | None = None,
               build: Library | None = None) -> torch.Tensor:
    """x [M, K] times float32 weight [N, K]^T, each output in one order of additions (no
    rounding of x): the routers of a model whose other weights are multiplied as stored.
    `simd` False takes the portable path of a build that has both."""
    build = build or library()
    x, w = x.float().contiguous(), weight.float().contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    build.lib.smk_matmul_f32(w.data_ptr(), w.shape[0], w.shape[1], x.data_ptr(), x.shape[0], y.data_ptr(),
                             y.stride(0), int(build.simd if simd is None else simd))
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of float32 x as llama.cpp computes it (blockdot.c's
    smk_rms_norm: the squares summed in double), one order per row; weight float32 or None."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(flat)
    w = None if weight is None else weight.contiguous()
    library().lib.smk_rms_norm(flat.data_ptr(), flat.shape[0], flat.shape[1], flat.shape[1],
                               None if w is None else w.data_ptr(), eps, y.data_ptr(), y.shape[1])
    return y.view(x.shape)


def matmul_bf16(x: torch.Tensor, raw: torch.Tensor, rows: int, out: torch.Tensor | None = None,
                simd: bool | None = None, build: Library | None = None) -> torch.Tensor:
    """x [M, K] float32 times W^T for bfloat16 W [rows, K] (`raw`: its bytes, or the bfloat16
    tensor): [M, rows] float32, each weight widened exactly and the activations unrounded,
    one order of additions per output (blockdot.c's smk_matmul_bf16)."""
    build = build or library()
    x = x.float().contiguous()
    M, K = x.shape
    if raw.numel() * raw.element_size() != rows * K * 2 or not raw.is_contiguous():
        raise SpecMoEError(f"internal: {raw.numel() * raw.element_size()} bytes are not a contiguous {rows}x{K} "
                           "bfloat16 matrix")
    y = out if out is not None else torch.empty(M, rows, dtype=torch.float32)
    build.lib.smk_matmul_bf16(raw.data_ptr(), rows, K, x.data_ptr(), M, y.data_ptr(), y.stride(0),
                              int(build.simd if simd is None else simd))
    return y


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           scale: float | None, simd: bool | None = None, build: Library | None = None) -> torch.Tensor:
    """softmax(q k^T scale) v over the keys `mask` shows each row, one order of additions per
    row: q [B, G, R, d], keys [B, G, L, d], values [B, G, L, dv], mask bool [B, 1, R or 1, L]
    or None (every key) -> [B, G, R, dv] float32. Keys and values are read where they are
    (a view of the KV cache: rows side by side, any stride between heads and sequences).
    `simd` False takes the portable path of a build that has both."""
    build = build or library()
    q = q.float().contiguous()
    keys, values = _rows_in_place(keys), _rows_in_place(values)
    B, G, R, d = q.shape
    L, dv = keys.shape[2], values.shape[3]
    if mask is None:
        visible, rows = torch.ones(B, 1, L, dtype=torch.uint8), 1
    else:
        rows = mask.shape[2]
        visible = mask.expand(B, 1, rows, L).to(torch.uint8).contiguous()
    out = torch.empty(B, G, R, dv, dtype=torch.float32)
    build.lib.smk_attend(q.data_ptr(), keys.data_ptr(), values.data_ptr(), visible.data_ptr(), B, G, R, L, d, dv,
                         rows, d ** -0.5 if scale is None else scale, out.data_ptr(),
                         keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
                         int(build.simd if simd is None else simd))
    return out


def _rows_in_place(t: torch.Tensor) -> torch.Tensor:
    """t [B, G, L, n] float32 whose rows lie side by side (strides n, 1): itself, else a copy."""
    t = t.float()
    return t if t.stride(3) == 1 and t.stride(2) == t.shape[3] else t.contiguous()


def matmul(x: torch.Tensor, raw: torch.Tensor, type_name: str, rows: int, simd: bool | None = None,
           build: Library | None = None) -> torch.Tensor:
    """x [M, K] float32 times W^T for W [rows, K] stored as GGUF `type_name` bytes: [M, rows] float32."""
    return matmul_q(quantize(x.float(), type_name, build), raw, type_name, rows, simd=simd, build=build)
