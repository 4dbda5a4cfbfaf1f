"""`specmoe quantize MODEL_DIR OUT_DIR --scheme w8a16|w4a16|fp8`: a compressed-tensors
checkpoint whose routed experts are quantized (the bytes an offloading run moves) and
whose other weights are copied as they are.

Round to nearest by default, with the `compressed-tensors` library's own scale and
packing code (the format vLLM and transformers load): w4a16 / w8a16 are symmetric int4 /
int8 with one scale per `--group-size` input columns; fp8 is float8_e4m3fn with one
scale per row. The rewrite streams: one tensor read (with pread), quantized in row
chunks and written at a time, into a directory that is renamed into place when whole.
`--method gptq` hands the model to llm-compressor's GPTQ instead (when it is installed;
it loads the whole model and needs calibration prompts).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from ..base.checkpoint import Checkpoint
from ..base.errors import SpecMoEError
from ..base.model_config import read_json
from ..base.quantization import ExpertQuant, expert_quant
from ..base.safetensors_stream import SafetensorsReader, SafetensorsWriter, TensorEntry
from ..base.units import format_bytes
from . import gptq

SCHEMES = ("w8a16", "w4a16", "fp8")
# The routed experts' projections in the Hub's per-expert names; the target the config names them by.
EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
EXPERT_TARGET = r"re:.*\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)$"
CHUNK_ELEMENTS = 1 << 20  # rows quantized at a time: bounds the float32 temporaries
INDEX = "model.safetensors.index.json"


def register(subparsers) -> None:
    q = subparsers.add_parser("quantize", help="write a compressed-tensors checkpoint with quantized experts")
    q.add_argument("model_dir", help="a Hugging Face model directory (float weights, experts one tensor each)")
    q.add_argument("out_dir", help="where the quantized checkpoint goes (must not exist, or be empty)")
    q.add_argument("--scheme", required=True, choices=SCHEMES,
                   help="w8a16 / w4a16: int8 / int4 experts, one scale per group; fp8: float8 experts, one scale per row")
    q.add_argument("--group-size", type=int, default=128, help="input columns per scale for w8a16 / w4a16 (default 128)")
    q.add_argument("--method", choices=("rtn", "gptq"), default="rtn",
                   help="rtn: round to nearest, streamed (default); gptq: llm-compressor's GPTQ (needs llmcompressor)")
    q.add_argument("--calibration-file", help="--method gptq: prompts (text lines or .jsonl) to calibrate on")
    q.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    q.set_defaults(func=run_quantize)


def run_quantize(args) -> int:
    summary = quantize_checkpoint(args.model_dir, args.out_dir, args.scheme, group_size=args.group_size,
                                  method=args.method, calibration_file=args.calibration_file,
                                  progress=not args.json and sys.stderr.isatty())
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"specmoe: wrote {summary['out_dir']}: {summary['experts_quantized']} expert matrices as "
              f"{summary['expert_format']}; experts {format_bytes(summary['expert_bytes_before'])} -> "
              f"{format_bytes(summary['expert_bytes_after'])} each; peak memory "
              f"{format_bytes(summary['peak_rss_growth_bytes'])} over the start for a largest tensor of "
              f"{format_bytes(summary['largest_tensor_bytes'])}")
    return 0


# --- the scheme, with the library's own types ----------------------------------------------------------


def _library():
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise SpecMoEError("specmoe quantize writes compressed-tensors checkpoints with the format's own library: "
                           "pip install compressed-tensors") from None
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    return BaseCompressor, QuantizationArgs, QuantizationConfig, QuantizationScheme, calculate_qparams


def build_scheme(scheme: str, group_size: int):
    """(QuantizationScheme of the experts, the config.json `quantization_config`)."""
    _, args_cls, config_cls, scheme_cls, _ = _library()
    if scheme == "fp8":
        weights = args_cls(num_bits=8, type="float", symmetric=True, strategy="channel", dynamic=False)
        fmt = "float-quantized"
    else:
        weights = args_cls(num_bits=4 if scheme == "w4a16" else 8, type="int", symmetric=True, strategy="group",
                           group_size=group_size, dynamic=False)
        fmt = "pack-quantized"
    experts = scheme_cls(targets=[EXPERT_TARGET], weights=weights, format=fmt)
    config = config_cls(config_groups={"group_0": experts}, format=fmt, quantization_status="compressed", ignore=[])
    return experts, config.model_dump(mode="json")


class MatrixQuantizer:
    """Round to nearest with the library's scales (max |w| over the group / half the code
    range, rounded to the checkpoint's dtype) and its compressor (packing, float8 cast)."""

    def __init__(self, scheme):
        registry, _, _, _, self.qparams = _library()
        self.scheme = scheme
        self.compressor = registry.get_value_from_registry(scheme.format)

    def outputs(self, entry: TensorEntry) -> list[TensorEntry]:
        """What the compressor writes for one [out, in] weight, planned before any data is
        read (the writer refuses a tensor that differs from its plan)."""
        rows, cols = entry.shape
        w = self.scheme.weights
        out = [TensorEntry(f"{entry.name}_scale", entry.dtype,
                           (rows, 1 if w.strategy == "channel" else cols // w.group_size))]
        if self.scheme.format == "pack-quantized":  # num_bits codes per value, densely in int32 words
            out += [TensorEntry(f"{entry.name}_packed", torch.int32, (rows, math.ceil(cols * w.num_bits / 32))),
                    TensorEntry(f"{entry.name}_shape", torch.int64, (2,))]
        else:
            out.append(TensorEntry(entry.name, torch.float8_e4m3fn, entry.shape))
        return sorted(out, key=lambda e: e.name)

    def quantize(self, entry: TensorEntry, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> tensor of `outputs(entry)`, quantized in row chunks into preallocated outputs."""
        planned = {e.name.removeprefix(entry.name.removesuffix("weight")): e for e in self.outputs(entry)}
        out = {k: torch.empty(e.shape, dtype=e.dtype) for k, e in planned.items()}
        rows, cols = w.shape
        step = max(1, CHUNK_ELEMENTS // cols)
        for start in range(0, rows, step):
            part = self._chunk(w[start:start + step], entry.dtype)
            for key, t in part.items():
                if key != "weight_shape":
                    out[key][start:start + step].copy_(t)
        if "weight_shape" in out:
            out["weight_shape"].copy_(torch.tensor([rows, cols]))
        return {entry.name.removesuffix("weight") + k: t for k, t in out.items()}

    def _chunk(self, w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        x = w.float()
        args = self.scheme.weights
        groups = x.view(x.shape[0], -1, args.group_size if args.strategy == "group" else x.shape[1])
        scale, zero = self.qparams(groups.amin(-1), groups.amax(-1), args)
        return self.compressor.compress({"weight": x, "weight_scale": scale.to(dtype), "weight_zero_point": zero},
                                        self.scheme)


# --- the rewrite ------------------------------------------------------------------------------------------


def quantize_checkpoint(model_dir, out_dir, scheme: str, group_size: int = 128, method: str = "rtn",
                        calibration_file: str | None = None, progress: bool = False) -> dict:
    """Write the quantized checkpoint; returns a summary (sizes, peak memory, time)."""
    ckpt = Checkpoint(model_dir)
    out = Path(out_dir)
    _check(ckpt, out, scheme, group_size, method)
    experts, qconfig = build_scheme(scheme, group_size)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    start = time.perf_counter()
    try:
        if method == "gptq":
            gptq.run(ckpt.dir, partial, experts, calibration_file)
            stats = {"largest_tensor_bytes": 0, "peak_rss_growth_bytes": 0, "tensors": 0, "experts_quantized": 0}
        else:
            stats = _stream(ckpt, partial, MatrixQuantizer(experts), progress)
            _write_config(ckpt, partial, qconfig)
        _copy_other_files(ckpt.dir, partial)
        quant = _written_quant(partial)
        _write_note(partial, ckpt, scheme, group_size, method, quant)
        if out.exists():
            out.rmdir()  # checked empty above
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    elem = torch.tensor([], dtype=ckpt.torch_dtype()).element_size()
    return {"out_dir": str(out), "scheme": scheme, "method": method, "group_size": group_size,
            "expert_format": quant.describe(), "expert_bytes_before": ckpt.config.expert_params * elem,
            "expert_bytes_after": quant.nbytes, "wall_s": time.perf_counter() - start, **stats}


def _check(ckpt: Checkpoint, out: Path, scheme: str, group_size: int, method: str) -> None:
    c = ckpt.config
    if scheme not in SCHEMES:
        raise SpecMoEError(f"unknown scheme {scheme!r}; choose one of: {', '.join(SCHEMES)}")
    if "quantization_config" in read_json(ckpt.dir / "config.json"):
        raise SpecMoEError(f"{ckpt.dir} is already quantized (config.json has a quantization_config); "
                           "quantize the float checkpoint it was made from")
    if ckpt.fused_layout:
        raise SpecMoEError(f"{ckpt.dir} stores its experts fused (one tensor per layer); specmoe quantize reads "
                           "checkpoints with one tensor per expert, as the Hub ships them")
    if scheme != "fp8" and (group_size < 1 or c.hidden_size % group_size or c.expert_intermediate_size % group_size):
        raise SpecMoEError(f"--group-size {group_size} must divide the experts' input dimensions ({c.hidden_size} and "
                           f"{c.expert_intermediate_size}): pass a divisor of both, e.g. "
                           f"{_largest_common_group(c.hidden_size, c.expert_intermediate_size)}")
    if out.resolve() == ckpt.dir.resolve() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise SpecMoEError(f"{out} already exists and is not an empty directory: pass a new OUT_DIR")


def _largest_common_group(a: int, b: int) -> int:
    g = math.gcd(a, b)
    return next(p for p in (128, 64, 32, 16, 8, 4, 2, 1) if g % p == 0)


def _shards(ckpt: Checkpoint) -> list[str]:
    index = ckpt.dir / INDEX
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]


def _stream(ckpt: Checkpoint, out: Path, quantizer: MatrixQuantizer, progress: bool) -> dict:
    """Every shard rewritten tensor by tensor; the peak resident memory above the start measured."""
    readers = [SafetensorsReader(ckpt.dir / name) for name in _shards(ckpt)]
    c = ckpt.config
    shapes = {(c.expert_intermediate_size, c.hidden_size), (c.hidden_size, c.expert_intermediate_size)}
    for reader in readers:
        for name, dtype in reader.unknown.items():  # the rewrite copies every tensor: it must know each dtype
            raise SpecMoEError(f"{reader.path}: tensor {name!r} has dtype {dtype}, which specmoe cannot copy")
        for name, entry in reader.entries.items():
            if EXPERT_WEIGHT.search(name) and entry.shape not in shapes:
                raise SpecMoEError(f"{reader.path}: expert tensor {name!r} has shape {list(entry.shape)}; config.json "
                                   f"implies {' or '.join(str(list(s)) for s in sorted(shapes))}")
    plans = [[*_planned(r, quantizer)] for r in readers]
    total = sum(len(r.entries) for r in readers)
    largest = max(e.nbytes for r in readers for e in r.entries.values())
    weight_map, quantized = {}, 0
    _warm_up(readers, quantizer)  # torch's and the library's one-time setup is not what the stream holds
    before = _reset_peak_rss()
    with _bar(progress, total) as advance:
        for reader, plan in zip(readers, plans):
            writer = SafetensorsWriter(out / reader.path.name, plan, {"format": "pt"})
            for name, entry in reader.entries.items():
                tensor = reader.read(name)
                written = quantizer.quantize(entry, tensor) if EXPERT_WEIGHT.search(name) else {name: tensor}
                quantized += len(written) > 1
                for key in sorted(written):
                    writer.write(key, written[key])
                    weight_map[key] = reader.path.name
                del tensor, written
                advance()
            writer.close()
    peak = _peak_rss()
    if (ckpt.dir / INDEX).is_file():
        size = sum(e.nbytes for plan in plans for e in plan)
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2))
    return {"tensors": total, "experts_quantized": quantized, "largest_tensor_bytes": largest,
            "peak_rss_growth_bytes": max(0, peak - before) if peak and before else None}


def _warm_up(readers: list[SafetensorsReader], quantizer: MatrixQuantizer) -> None:
    """The stream's code once over the smallest tensor of each dtype and the smallest expert weight."""
    smallest = {}
    for reader in readers:
        for entry in reader.entries.values():
            for key in (entry.dtype, EXPERT_WEIGHT.search(entry.name) is not None):
                if key is not False and (key not in smallest or entry.nbytes < smallest[key][1].nbytes):
                    smallest[key] = (reader, entry)
    for reader, entry in smallest.values():
        tensor = reader.read(entry.name)
        if EXPERT_WEIGHT.search(entry.name):
            quantizer.quantize(entry, tensor)


def _planned(reader: SafetensorsReader, quantizer: MatrixQuantizer):
    """The output entries of one shard, in the order the stream writes them."""
    for name, entry in reader.entries.items():
        yield from quantizer.outputs(entry) if EXPERT_WEIGHT.search(name) else [entry]


def _write_config(ckpt: Checkpoint, out: Path, qconfig: dict) -> None:
    cfg = json.loads((ckpt.dir / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _copy_other_files(src: Path, out: Path) -> None:
    """The tokenizer, generation config, model card...: every file but the weights and the config."""
    for f in src.iterdir():
        if f.is_file() and not (out / f.name).exists() and not f.name.endswith(".safetensors") \
                and f.name not in ("config.json", INDEX):
            shutil.copy2(f, out / f.name)


def _written_quant(out: Path) -> ExpertQuant:
    """The experts' form as specmoe will read the new checkpoint (the written tensors decide)."""
    quant = Checkpoint(out).config.expert_quant
    if quant is None:
        raise SpecMoEError(f"internal: {out} came out without quantized experts")
    return quant


def _write_note(out: Path, ckpt: Checkpoint, scheme: str, group_size: int, method: str, quant: ExpertQuant) -> None:
    grid = "one scale per row" if scheme == "fp8" else f"one scale per {group_size} input columns"
    (out / "QUANTIZATION.md").write_text(
        f"# Quantized with specmoe\n\n"
        f"- source: {ckpt.dir.name} (checkpoint fingerprint {ckpt.fingerprint()})\n"
        f"- scheme: {scheme}: routed experts {quant.scheme}, symmetric, {grid}, "
        f"{'GPTQ (llm-compressor)' if method == 'gptq' else 'round to nearest'}; every other tensor as in the source\n"
        f"- format: compressed-tensors ({'float-quantized' if scheme == 'fp8' else 'pack-quantized'}), "
        f"as vLLM and transformers read it\n"
        f"- one expert: {format_bytes(quant.nbytes)} as specmoe stores and moves it ({quant.describe()})\n\n"
        f"Written by `specmoe quantize {ckpt.dir.name} {out.name.split('.partial-')[0].lstrip('.')} --scheme {scheme}"
        f"{'' if scheme == 'fp8' else f' --group-size {group_size}'}{' --method gptq' if method == 'gptq' else ''}`.\n")


# --- measuring memory and showing progress -------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int | None:
    """Resident bytes now, with the kernel's high-water mark reset to them where Linux allows."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_kib("VmRSS")


def _peak_rss() -> int | None:
    return _status_kib("VmHWM")


class _bar:
    """A rich progress bar over tensors on stderr (only on a terminal); yields `advance`."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.progress = enabled, total, None

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        from rich.progress import Progress

        self.progress = Progress(transient=True)
        self.progress.start()
        task = self.progress.add_task("quantizing", total=self.total)
        return lambda: self.progress.advance(task)

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()
