"""The affinity table: pairwise L2 distances between the experts of each MoE block.

When the draft picks an expert it does not hold, it uses the held expert nearest in
weight space instead. Distances are computed once per model, streamed one tensor of a
block's experts at a time, and cached on disk keyed by the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...base.checkpoint import Checkpoint
from ...base.errors import warn
from ...base.files import keep


def compute_affinity(ckpt: Checkpoint) -> dict[int, torch.Tensor]:
    """layer -> [E, E] float32 distances between flattened expert weights.

    The squared distance is a sum over the expert's tensors (gate, up, down, biases), so it
    is accumulated one tensor at a time: a block's experts are in memory one part at a time
    (a third of the block for a gated expert), never the whole block in float32."""
    c = ckpt.config
    table = {}
    for layer in c.moe_layer_ids:
        parts = len(ckpt.expert_parts(layer, 0))
        squared = torch.zeros(c.num_experts, c.num_experts, dtype=torch.float64)
        for p in range(parts):
            x = torch.stack([ckpt.expert_parts(layer, e)[p].reshape(-1).float() for e in range(c.num_experts)])
            squared += torch.cdist(x[None], x[None])[0].double() ** 2
            del x
        table[layer] = squared.sqrt().float()
    return table


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
