"""The affinity table: pairwise L2 distances between the experts of each MoE block.

When the draft picks an expert it does not hold, it uses the held expert nearest in
weight space instead. Distances are computed once per model, streamed block by block
(one block's experts in memory at a time), and cached on disk keyed by the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...base.checkpoint import Checkpoint
from ...base.errors import warn
from ...base.files import keep


def compute_affinity(ckpt: Checkpoint) -> dict[int, torch.Tensor]:
    """layer -> [E, E] float32 distances between flattened expert weights."""
    c = ckpt.config
    table = {}
    for layer in c.moe_layer_ids:
        weights = torch.stack([ckpt.expert_buffer(layer, e, torch.float32) for e in range(c.num_experts)])
        table[layer] = torch.cdist(weights[None], weights[None])[0]
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
