"""The affinity table: pairwise L2 distances between the experts of each MoE block.

When the draft picks an expert it does not hold, it uses the held expert nearest in
weight space instead. Distances are computed once per model, streamed one tensor of a
block's experts at a time, and cached on disk keyed by the checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...base.checkpoint import Checkpoint
from ...base.errors import warn
from ...base.files import keep


PIECE_BYTES = 64 << 20  # the most float32 bytes of a block's experts held at once


def compute_affinity(ckpt: Checkpoint) -> dict[int, torch.Tensor]:
    """layer -> [E, E] float32 distances between flattened expert weights.

    The squared distance is a sum over the experts' coordinates, so it is accumulated over
    pieces: the same rows of one tensor of every expert of the block, at most PIECE_BYTES in
    float32 at once. Holding whole tensors (a third of a block) took 2.1 GiB at experts 8192
    wide, and killed a first run under a memory limit."""
    c = ckpt.config
    table = {}
    for layer in c.moe_layer_ids:
        squared = torch.zeros(c.num_experts, c.num_experts, dtype=torch.float64)
        for p, shape in enumerate(part_shapes(ckpt, layer)):
            rows, width = shape[0], math.prod(shape[1:])
            step = max(1, PIECE_BYTES // (4 * width * c.num_experts))
            for start in range(0, rows, step):
                stop = min(rows, start + step)
                x = torch.stack([part_rows(ckpt, layer, e, p, start, stop).reshape(-1)
                                 for e in range(c.num_experts)])
                squared += torch.cdist(x[None], x[None])[0].double() ** 2
                del x
        table[layer] = squared.sqrt().float()
    return table


def part_shapes(ckpt: Checkpoint, layer: int) -> list[tuple[int, ...]]:
    """The shapes of a routed expert's tensors in `layer` (`expert_parts`' order)."""
    if hasattr(ckpt, "expert_part_shapes"):  # a GGUF file knows them without dequantizing
        return ckpt.expert_part_shapes(layer)
    return [tuple(t.shape) for t in ckpt.expert_parts(layer, 0)]


def part_rows(ckpt: Checkpoint, layer: int, expert: int, part: int, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop of the expert's `part`-th tensor in float32, 2-D (a bias is a column).
    A GGUF file reads and dequantizes those rows' blocks only; a safetensors checkpoint hands
    its tensor as stored, of which only the rows are widened."""
    if hasattr(ckpt, "expert_part_rows"):
        return ckpt.expert_part_rows(layer, expert, part, start, stop)
    t = ckpt.expert_parts(layer, expert)[part]
    return t.reshape(t.shape[0], -1)[start:stop].float()


def load_affinity(ckpt: Checkpoint, cache_dir: Path) -> dict[int, torch.Tensor]:
    """The table from the cache when it is there and whole (else computed and cached)."""
    path = Path(cache_dir) / f"affinity-{ckpt.fingerprint()}.safetensors"
    if path.is_file():
        table = _cached(path, ckpt.config)
        if table is not None:
            return table
        warn(f"ignoring {path}: it is not this model's affinity table (damaged?); it will be rebuilt")
    table = compute_affinity(ckpt)
    keep(path, lambda tmp: save_file({str(layer): t.contiguous() for layer, t in table.items()}, str(tmp)),
         "the affinity table")
    return table


def _cached(path: Path, config) -> dict[int, torch.Tensor] | None:
    """The cached table, or None unless it holds an [E, E] float32 table for every MoE block."""
    try:
        table = {int(name): t for name, t in load_file(str(path)).items()}
    except Exception:  # noqa: BLE001 - safetensors' own errors for a damaged file
        return None
    shape = (config.num_experts, config.num_experts)
    whole = set(table) == set(config.moe_layer_ids) and all(
        tuple(t.shape) == shape and t.dtype == torch.float32 for t in table.values())
    return table if whole else None


def substitution_map(distances: torch.Tensor, draft: list[int]) -> torch.Tensor:
    """[E] long: each expert -> the nearest draft expert (a draft expert maps to itself)."""
    held = torch.tensor(draft, dtype=torch.long)
    nearest = torch.argmin(distances[:, held], dim=1)
    return held[nearest]
