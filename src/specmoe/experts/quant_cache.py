"""Quantized draft copies on disk: computed once per checkpoint and mode (quant.py's
format), cached next to the affinity table, keyed by the checkpoint's fingerprint, the
mode and the format version."""

from __future__ import annotations

from pathlib import Path

import torch

from ..base.checkpoint import Checkpoint
from ..base.errors import SpecMoEError, warn
from ..base.files import keep
from ..base.progress import OneTime
from ..base.safetensors_stream import SafetensorsReader, SafetensorsWriter, TensorEntry
from ..model.moe import expert_views
from .quant import BITS, FORMAT_VERSION, QuantizedExpert, QuantizedExperts, QuantizedMatrix, check_mode, quantize_matrix


def compute_quantized(ckpt: Checkpoint, mode: str, layers=None) -> QuantizedExperts:
    """Quantize every expert of the given MoE blocks (default all), one expert in float32 at a
    time: each copy is written into its block's stacks as it is made, so building them holds
    the copies and one expert, not a block of float32 experts and its temporaries (about
    4x a block's float32 bytes at real size: 3 GiB for 16 experts of 2048 x 2048)."""
    c = ckpt.config
    bits, spec = BITS[mode], c.expert
    out = {}
    for layer in layers if layers is not None else c.moe_layer_ids:
        stacks = None
        for e in range(c.num_experts):
            v = expert_views(ckpt.expert_buffer(layer, e, torch.float32), spec)
            one = QuantizedExpert(quantize_matrix(v.w_in, bits), quantize_matrix(v.w_out, bits),
                                  *((None, None) if not spec.bias else (v.b_in.clone(), v.b_out.clone())))
            if stacks is None:
                stacks = _empty_stacks(one, c.num_experts)
            _put(stacks, e, one)
        out[layer] = stacks
    return QuantizedExperts(mode, out, spec)


def _empty_stacks(one: QuantizedExpert, n: int) -> QuantizedExpert:
    """Stacks [n, ...] shaped like one expert's copy."""
    def like(t):
        return None if t is None else torch.empty((n, *t.shape), dtype=t.dtype)

    def matrix(m: QuantizedMatrix) -> QuantizedMatrix:
        return QuantizedMatrix(like(m.data), like(m.scales), m.bits, m.in_features)

    return QuantizedExpert(matrix(one.gate_up), matrix(one.down), like(one.b_in), like(one.b_out))


def _put(stacks: QuantizedExpert, e: int, one: QuantizedExpert) -> None:
    for stack, m in ((stacks.gate_up, one.gate_up), (stacks.down, one.down)):
        stack.data[e].copy_(m.data)
        stack.scales[e].copy_(m.scales)
    for stack, b in ((stacks.b_in, one.b_in), (stacks.b_out, one.b_out)):
        if b is not None:
            stack[e].copy_(b)


def cache_path(ckpt: Checkpoint, mode: str, cache_dir: Path) -> Path:
    return Path(cache_dir) / f"quant-v{FORMAT_VERSION}-{mode}-{ckpt.fingerprint()}.safetensors"


def load_quantized(ckpt: Checkpoint, mode: str, cache_dir: Path | None) -> QuantizedExperts:
    """All experts quantized (on the CPU), from the cache when there, else computed and cached."""
    check_mode(mode)
    if mode == "none":
        raise SpecMoEError("draft_quant none has no quantized copies")
    if cache_dir is None:
        return compute_quantized(ckpt, mode)
    path = cache_path(ckpt, mode, cache_dir)
    if path.is_file():
        q = _read_cached(ckpt, mode, path)
        if q is not None:
            return q
        warn(f"ignoring {path}: it is not this model's {mode} copies (damaged?); it will be rebuilt")
    save_quantized(ckpt, mode, cache_dir)
    q = _read_cached(ckpt, mode, path) if path.is_file() else None
    return q if q is not None else compute_quantized(ckpt, mode)  # none kept (a read-only cache dir)


def _read_cached(ckpt: Checkpoint, mode: str, path: Path) -> QuantizedExperts | None:
    """The copies in `path`, or None where it is not this model's."""
    c = ckpt.config
    try:
        reader = SafetensorsReader(path)  # read, not mapped: aligned, and no second copy in the resident set
        q = QuantizedExperts.from_state_dict(mode, {n: reader.read(n) for n in reader.entries}, c.expert)
        return q if set(q.layers) == set(c.moe_layer_ids) else None
    except Exception:  # noqa: BLE001 - a damaged or foreign cache file: recompute it
        return None


def save_quantized(ckpt: Checkpoint, mode: str, cache_dir: Path) -> None:
    """Build the mode's cache file a block at a time: each block's copies are written as
    they are made, so building holds one block's copies, not every expert's (which a run
    that builds it while it holds its pool and draft would hold beyond its budget: int4
    copies of the 4x widened demo model's 128 experts are 96 MiB, a quarter of its budget).
    Where the file cannot be written it says so and leaves none."""
    c = ckpt.config
    layers = list(c.moe_layer_ids)
    work = OneTime(f"making {mode} draft copies of this checkpoint's experts, once (kept in {cache_dir})").begin()
    made = {layers[0]: compute_quantized(ckpt, mode, layers[:1]).state_dict()}  # its shapes are every block's
    entries = [TensorEntry(f"{layer}.{name.split('.', 1)[1]}", t.dtype, tuple(t.shape))
               for layer in layers for name, t in made[layers[0]].items()]

    def write(tmp: Path) -> None:
        writer = SafetensorsWriter(tmp, entries, {"mode": mode, "format": str(FORMAT_VERSION)})
        for i, layer in enumerate(layers):
            block = made.pop(layer, None) or compute_quantized(ckpt, mode, [layer]).state_dict()
            for name, t in block.items():
                writer.write(name, t)
            work.update(i + 1, len(layers))
        writer.close()

    keep(cache_path(ckpt, mode, cache_dir), write, f"the {mode} copies of the experts")
    work.end()


def quantize_all(ckpt: Checkpoint, keys, mode: str, cache_dir: Path | None,
                 device: torch.device | str = "cpu", blocks: bool = False) -> QuantizedExperts:
    """Quantized copies of the experts `keys` [(layer, e)] (whole blocks are kept stacked:
    the keys' blocks, all their experts), on `device` in the layouts quant.device_layout
    gives them (`blocks` as there). The stored format does not depend on the compute dtype:
    a copy computes in its input's (quantized_expert_forward)."""
    q = load_quantized(ckpt, mode, cache_dir)
    wanted = {layer for layer, _ in keys}
    q = QuantizedExperts(q.mode, {l: m for l, m in q.layers.items() if l in wanted}, q.spec)
    return q.to(device, blocks, release=True)
