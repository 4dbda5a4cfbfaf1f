"""Which of torch's private fused CPU kernels a matrix may go through, and the calls themselves.

torch's weight-only matmuls for the CPU (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`
with `_convert_weight_to_int4pack_for_cpu`) take CPU-specific code paths, and not all of
them do what the signature promises: on an AVX-512 EPYC with torch 2.13 the int8 kernel
returns garbage when K is not a multiple of 16 and segfaults on weights that start a few
bytes into their storage (and a tensor loaded from a safetensors file can start at any
8-byte offset). A crash cannot be caught in the process that has it. So a matrix goes
through a fused kernel only when

1. its shape meets the kernel's requirements (`requirement`): int8, K a multiple of 16;
   int4, N a multiple of 16 and a group of 32-256 that divides K; and every tensor handed
   to the kernel is contiguous and starts on a 64-byte boundary (`aligned`,
   `aligned_stack` copy what does not; `int8_mm` and `int4_mm` refuse what does not), and
2. the kernel passed a self-check on this machine, with this torch and thread count, for
   the matrix's shape class (kernel, N, K, group): a child process (kernel_check.py)
   multiplies random weights of that shape at several row counts and compares with the
   dequantizing path. Verdicts are kept in the cache dir (kernels.json, read as untrusted
   input), so a shape is checked once per machine.

Otherwise the matrix takes the portable path (dequantized per call, then F.linear: the
same codes and scales, so the same draft up to rounding), and `KernelChoice.why` says
why, for `specmoe info` and the run statistics. `SPECMOE_FUSED_KERNELS=off` turns every
fused kernel off.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..base.errors import SpecMoEError, warn
from ..base.memory import release_free_memory
from ..base.paths import read_json, write_json
from ..kernels.cpu import cpu_id

ALIGN = 64  # bytes: an AVX-512 register; the int8 kernel crashed at offsets 1-8, not at 16 or 32
TOLERANCE = 1e-2  # relative L2 error: bfloat16 activations give about 3e-3; garbage gives 0.3 and up
INT4_GROUPS = (32, 64, 128, 256)
STATE_FILE = "kernels.json"
CHECK_TIMEOUT_S = 300
ENV = "SPECMOE_FUSED_KERNELS"
_OPS = {"int8": ("_weight_int8pack_mm",), "int4": ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")}


@dataclass(frozen=True)
class Shape:
    """A shape class of one kernel: W [out, in] (N x K), int4 with its group size."""

    kernel: str  # "int8" | "int4"
    out: int
    inp: int
    group: int = 0

    @property
    def key(self) -> str:
        return f"{self.kernel} N={self.out} K={self.inp}" + (f" group={self.group}" if self.kernel == "int4" else "")

    def case(self) -> dict:
        return {"kernel": self.kernel, "out": self.out, "in": self.inp, "group": self.group}


@dataclass(frozen=True)
class KernelChoice:
    shape: Shape
    fused: bool
    why: str

    def describe(self) -> str:
        return ("fused: " if self.fused else "portable: ") + self.why


def requirement(shape: Shape) -> str | None:
    """Why this shape may not use its kernel whatever the machine does, or None."""
    missing = [op for op in _OPS[shape.kernel] if not hasattr(torch.ops.aten, op)]
    if missing:
        return f"this torch has no {missing[0]}"
    if shape.kernel == "int8" and shape.inp % 16:
        return f"K = {shape.inp} is not a multiple of 16 (torch's int8 kernel computes garbage there on AVX-512)"
    if shape.kernel == "int4":
        if shape.out % 16:
            return f"N = {shape.out} is not a multiple of 16"
        if shape.group not in INT4_GROUPS or shape.inp % shape.group:
            return f"group {shape.group} is not one of {', '.join(map(str, INT4_GROUPS))} dividing K = {shape.inp}"
    return None


def choose(shapes: Iterable[Shape], device) -> dict[Shape, KernelChoice]:
    """Per shape whether its matrices go through the fused kernel on `device`: the static
    requirements, then this machine's self-check verdict (checked now, in one child
    process, for the shapes without one)."""
    shapes = list(dict.fromkeys(shapes))
    static = {s: _static_reason(s, device) for s in shapes}
    choices = {s: KernelChoice(s, False, why) for s, why in static.items() if why}
    pending = [s for s in shapes if s not in choices]
    if pending:
        for shape, (ok, why) in verdicts(pending).items():
            choices[shape] = KernelChoice(shape, ok, why)
    return {s: choices[s] for s in shapes}


def _static_reason(shape: Shape, device) -> str | None:
    if torch.device(device).type != "cpu":
        return "the fused kernels are torch's CPU kernels"
    mode = os.environ.get(ENV, "check")
    if mode not in ("check", "off"):
        raise SpecMoEError(f"{ENV}={mode!r} is not understood; set it to 'off' (never use torch's fused CPU kernels) "
                           "or 'check' (the default: use each after it passed a self-check on this machine)")
    if mode == "off":
        return f"{ENV}=off"
    return requirement(shape)


# --- verdicts: the cache file and the child process ----------------------------------------


def machine() -> str:
    """What a verdict holds for: torch's build, the CPU (model and instruction-set flags), threads."""
    return f"torch {torch.__version__}, {platform.machine()}, {cpu_id()}, {torch.get_num_threads()} threads"


def _well_formed(data: dict) -> bool:
    return all(isinstance(shapes, dict) and all(
        isinstance(v, dict) and isinstance(v.get("fused"), bool) and isinstance(v.get("why"), str)
        for v in shapes.values()) for shapes in data.values())


def verdicts(shapes: list[Shape], child: list[str] | None = None) -> dict[Shape, tuple[bool, str]]:
    """(fused, why) per shape: kept verdicts of this machine, the rest checked now by
    `child` (default: kernel_check.py under this Python) and kept."""
    state = read_json(STATE_FILE, _well_formed)
    here = dict(state.get(machine(), {}))
    pending = [s for s in shapes if s.key not in here]
    if pending:
        for shape, (ok, why) in self_check(pending, child).items():
            here[shape.key] = {"fused": ok, "why": why}
            if not ok:
                warn(f"torch's {shape.kernel} CPU kernel failed its self-check on this machine for {shape.key} "
                     f"({why}); those matrices take the portable path (same codes, slower)")
        write_json(STATE_FILE, {**state, machine(): here})
    return {s: (here[s.key]["fused"], here[s.key]["why"]) for s in shapes}


def self_check(shapes: list[Shape], child: list[str] | None = None) -> dict[Shape, tuple[bool, str]]:
    """Run the cases in child processes, one after another; a case that takes its process
    down is marked crashed and the rest go to a fresh one."""
    argv = child or [sys.executable, str(Path(__file__).with_name("kernel_check.py"))]
    out: dict[Shape, tuple[bool, str]] = {}
    rest = list(shapes)
    while rest:
        request = json.dumps({"threads": torch.get_num_threads(), "cases": [s.case() for s in rest]})
        try:
            run = subprocess.run([*argv, request], capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
            lines, code, stderr = run.stdout.splitlines(), run.returncode, run.stderr
        except subprocess.TimeoutExpired as exc:  # what it printed comes back as bytes
            printed = exc.stdout or b""
            lines = (printed.decode(errors="replace") if isinstance(printed, bytes) else printed).splitlines()
            code, stderr = None, ""
        started, errors = _parse(lines, len(rest))
        out.update({rest[i]: _verdict(err) for i, err in errors.items()})
        broken = next((i for i in sorted(started) if i not in errors), None)
        if broken is not None:
            out[rest[broken]] = (False, f"self-check {_exit_reason(code, stderr)}")
        elif not errors:  # the child died before it began a case
            why = _exit_reason(code, stderr)
            out.update({s: (False, f"self-check could not run ({why})") for s in rest})
        rest = [s for s in rest if s not in out]
    return out


def _verdict(err: float | None) -> tuple[bool, str]:
    if err is None:
        return False, "self-check: the result is not finite"
    if err >= TOLERANCE:
        return False, f"self-check: relative error {err:.2g} against the dequantizing path"
    return True, f"self-check passed (relative error {err:.1e})"


def _parse(lines: list[str], cases: int) -> tuple[set[int], dict[int, float | None]]:
    """(cases begun, error per case finished) from the child's lines; anything else is ignored."""
    started, errors = set(), {}
    for line in lines:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if not isinstance(msg, dict):
            continue
        if msg.get("begin") in range(cases):
            started.add(msg["begin"])
        elif msg.get("case") in range(cases):
            err = msg.get("error")
            errors[msg["case"]] = float(err) if isinstance(err, (int, float)) else None
    return started, errors


def _exit_reason(code: int | None, stderr: str) -> str:
    if code is None:
        return f"timed out after {CHECK_TIMEOUT_S} s"
    if code < 0:
        return f"crashed (signal {-code})"
    last = (stderr.strip().splitlines() or ["no message"])[-1]
    return f"failed with exit status {code}: {last[:160]}"


# --- memory the kernels are handed -------------------------------------------------------------


def is_aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % ALIGN == 0


def _empty_aligned(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A 1-D tensor whose data starts on an ALIGN boundary (torch's CPU allocator gives
    64 bytes already; a larger allocation covers any other)."""
    flat = torch.empty(numel, dtype=dtype, device=device)
    if flat.data_ptr() % ALIGN == 0:
        return flat
    elem = flat.element_size()
    spare = torch.empty(numel + ALIGN // elem, dtype=dtype, device=device)
    skip = (-spare.data_ptr() % ALIGN) // elem
    return spare[skip:skip + numel]


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t itself when it is contiguous and 64-byte aligned, else a copy that is."""
    if is_aligned(t):
        return t
    return _empty_aligned(t.numel(), t.dtype, t.device).view(t.shape).copy_(t)


def aligned_sections(sizes: list[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    """name -> (offset, bytes) of sections laid out in turn, each at a multiple of ALIGN bytes."""
    out, offset = {}, 0
    for name, n in sizes:
        out[name] = (offset, n)
        offset = -(-(offset + n) // ALIGN) * ALIGN
    return out


def padded(numel: int, elem: int) -> int:
    """Elements one matrix of a stack takes with each matrix starting on an ALIGN boundary."""
    return -(-numel * elem // ALIGN) * ALIGN // elem


def aligned_stack(t: torch.Tensor) -> torch.Tensor:
    """t [E, ...] with each t[e] contiguous and 64-byte aligned: t itself where it already
    is, else a copy whose experts are `padded` apart."""
    per = t[0].numel()
    stride = padded(per, t.element_size())
    if is_aligned(t) and stride == per:
        return t
    flat = _empty_aligned(t.shape[0] * stride, t.dtype, t.device)
    inner = torch.empty(t.shape[1:], device="meta").stride()
    out = flat.as_strided(t.shape, (stride, *inner))
    out.copy_(t)
    return out


def stack_bytes(t: torch.Tensor, stacked: bool) -> int:
    """Bytes a matrix (or a stack laid out by `aligned_stack`) holds, its padding included."""
    n = t.shape[0] * t.stride(0) if stacked else t.numel()
    return n * t.element_size()


# --- the calls -------------------------------------------------------------------------------


def _refuse(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if not is_aligned(t):
            raise RuntimeError(f"internal: {name} handed a tensor that is not contiguous and {ALIGN}-byte aligned "
                               f"(offset {t.data_ptr() % ALIGN}); it would crash on some CPUs")


def int8_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [T, K] bfloat16 times int8 codes [N, K] with a bfloat16 scale per row [N]."""
    _refuse("_weight_int8pack_mm", codes, scales)
    return torch.ops.aten._weight_int8pack_mm(x, codes, scales)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x [T, K] bfloat16 times int4 weights in torch's CPU int4pack layout."""
    _refuse("_weight_int4pack_mm_for_cpu", packed, scales_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)


def int4_pack(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned int4 codes [N, K] (int32) in torch's CPU int4pack layout, in aligned storage.

    Each conversion leaves freed heap behind that glibc does not reuse for the next ones
    (torch's allocations are 64-byte aligned, and a freed block of one size seldom takes
    the same size again with its alignment), so converting copies one after another grows
    the process: 64 calls on 1024 x 1024 codes, their 32 MiB of outputs kept, left 228 MiB
    free in it; loading int4 copies of the 4x widened demo model's 128 experts (107 MiB)
    grew a run by 260 to 480 MiB, past its device budget's allowance. So what each call
    freed goes back to the system at once (about 0.4 ms of CPU a call here, a fifth of the
    conversion)."""
    packed = aligned(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1))
    release_free_memory()
    return packed
