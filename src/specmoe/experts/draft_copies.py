"""Quantized draft copies of some experts, each in its own precision (`--draft-memory`).

Where `QuantizedExperts` holds one mode's copies of every expert stacked per block,
`ExpertCopies` holds the copies an allocation chose (policies/specmoe/allocation.py):
expert (layer, e) in int8, another in int2, most in none. Each copy is read on its own
from its mode's cache file (quant_cache.py: a row of the block's stacks), so loading
holds the chosen copies, never a whole mode's; a mode's file is built once, a block at
a time (so neither does building it), the first time a copy of that mode is wanted.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..base.checkpoint import Checkpoint
from ..base.safetensors_stream import SafetensorsReader
from .quant import (
    BITS,
    Int4KernelMatrix,
    Int8KernelMatrix,
    QuantizedExpert,
    QuantizedExperts,
    QuantizedMatrix,
    draft_kernel_choices,
    expert_matrices,
    kernel_notes,
    quantize_expert,
)
from .quant_cache import cache_path, save_quantized

Key = tuple[int, int]


class ExpertCopies(QuantizedExperts):
    """Copies of the experts an allocation names, each in its mode, on the device."""

    def __init__(self, copies: dict[Key, QuantizedExpert], modes: dict[Key, str], spec):
        super().__init__("mixed", {}, spec)
        self._experts = dict(copies)
        self.modes = dict(modes)
        # bfloat16 once per block only when every copy goes through a fused kernel
        self.compute_dtype = torch.bfloat16 if copies and all(
            isinstance(m, (Int4KernelMatrix, Int8KernelMatrix)) for q in copies.values()
            for m in (q.gate_up, q.down)) else None

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self._experts.values())

    def scratch_bytes(self, dtype: torch.dtype) -> int:
        return max((q.scratch_bytes(dtype) for q in self._experts.values()), default=0)

    def expert(self, layer: int, e: int) -> QuantizedExpert:
        return self._experts[layer, e]

    def has(self, layer: int, e: int) -> bool:
        return (layer, e) in self._experts

    def retain(self, keys) -> None:
        """Drop every copy but `keys`' (their tensors freed once nothing else holds them)."""
        keys = set(keys)
        self._experts = {k: q for k, q in self._experts.items() if k in keys}
        self.modes = {k: m for k, m in self.modes.items() if k in keys}


def load_copies(ckpt: Checkpoint, wanted: dict[Key, str], cache_dir: Path | None, device,
                have: ExpertCopies | None = None, blocks: bool = False) -> tuple[ExpertCopies, int]:
    """The copies `wanted` names ((layer, e) -> mode), on `device` in the layouts
    quant.device_layout gives them (`blocks` as there); those `have` already holds in the
    same mode are kept, not read again. Returns them and the bytes read."""
    spec = ckpt.config.expert
    copies, read = {}, 0
    by_mode: dict[str, list[Key]] = {}
    for key, mode in sorted(wanted.items()):
        if have is not None and have.modes.get(key) == mode:
            copies[key] = have.expert(*key)
        else:
            by_mode.setdefault(mode, []).append(key)
    kernels = dict(have.kernels) if have is not None else {}
    if have is not None:  # stale copies go before new ones are read: the two are never held together
        have.retain(copies)
    for mode, keys in by_mode.items():
        choices = draft_kernel_choices(spec, mode, device, blocks)
        kernels.update(kernel_notes([(BITS[mode], *m) for m in expert_matrices(spec)], choices, device, blocks))
        for key, host in _read_rows(ckpt, mode, keys, cache_dir):
            read += host.nbytes
            copies[key] = host.to(device, choices, blocks)
    out = ExpertCopies(copies, dict(wanted), spec)
    out.kernels = kernels
    return out, read


def _read_rows(ckpt: Checkpoint, mode: str, keys: list[Key], cache_dir: Path | None):
    """(key, that expert's copy in the stored format) for each key, from the mode's cache
    file (built first when missing, a block at a time), one expert's rows at a time; with
    no file (no cache, or none could be written) each quantized from the checkpoint alone."""
    spec, bits = ckpt.config.expert, BITS[mode]
    path = cache_path(ckpt, mode, cache_dir) if cache_dir is not None else None
    if path is not None and not path.is_file():
        save_quantized(ckpt, mode, cache_dir)
    if path is None or not path.is_file():
        for layer, e in keys:
            yield (layer, e), quantize_expert(ckpt.expert_buffer(layer, e, torch.float32), spec, bits)
        return
    reader = SafetensorsReader(path)
    for layer, e in keys:
        def matrix(part: str, in_features: int) -> QuantizedMatrix:
            return QuantizedMatrix(reader.read(f"{layer}.{part}.data", e), reader.read(f"{layer}.{part}.scales", e),
                                   bits, in_features)
        biases = [reader.read(f"{layer}.{b}", e) if f"{layer}.{b}" in reader.entries else None
                  for b in ("b_in", "b_out")]
        yield (layer, e), QuantizedExpert(matrix("gate_up", spec.hidden), matrix("down", spec.inter), *biases)
