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


def compute_affinity(ckpt: Checkpoint) -> dict[int, torch.Tensor]:
    """layer -> [E, E] float32 distances between flattened expert weights."""
    c = ckpt.config
    table = {}
    for layer in c.moe_layer_ids:
        weights = torch.stack([ckpt.expert_buffer(layer, e, torch.float32) for e in range(c.num_experts)])
        table[layer] = torch.cdist(weights[None], weights[None])[0]
    return table


def load_affinity(ckpt: Checkpoint, cache_dir: Path) -> dict[int, torch.Tensor]:
    path = Path(cache_dir) / f"affinity-{ckpt.fingerprint()}.safetensors"
    if path.is_file():
        return {int(name): t for name, t in load_file(str(path)).items()}
    table = compute_affinity(ckpt)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({str(layer): t.contiguous() for layer, t in table.items()}, str(tmp))
    tmp.replace(path)
    return table


def substitution_map(distances: torch.Tensor, draft: list[int]) -> torch.Tensor:
    """[E] long: each expert -> the nearest draft expert (a draft expert maps to itself)."""
    held = torch.tensor(draft, dtype=torch.long)
    nearest = torch.argmin(distances[:, held], dim=1)
    return held[nearest]
