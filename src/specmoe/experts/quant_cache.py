"""Quantized draft copies on disk: computed once per checkpoint and mode (quant.py's
format), cached next to the affinity table, keyed by the checkpoint's fingerprint, the
mode and the format version."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..base.checkpoint import Checkpoint
from ..base.errors import SpecMoEError, warn
from ..base.files import keep
from ..model.moe import expert_views
from .quant import BITS, FORMAT_VERSION, QuantizedExpert, QuantizedExperts, check_mode, quantize_matrix


def compute_quantized(ckpt: Checkpoint, mode: str, layers=None) -> QuantizedExperts:
    """Quantize every expert of the given MoE blocks (default all), one block in memory at a time."""
    c = ckpt.config
    bits, spec = BITS[mode], c.expert
    out = {}
    for layer in layers if layers is not None else c.moe_layer_ids:
        views = [expert_views(ckpt.expert_buffer(layer, e, torch.float32), spec) for e in range(c.num_experts)]
        w_in, w_out = torch.stack([v.w_in for v in views]), torch.stack([v.w_out for v in views])
        biases = (None, None) if not spec.bias else (torch.stack([v.b_in for v in views]),
                                                     torch.stack([v.b_out for v in views]))
        out[layer] = QuantizedExpert(quantize_matrix(w_in, bits), quantize_matrix(w_out, bits), *biases)
    return QuantizedExperts(mode, out, spec)


def cache_path(ckpt: Checkpoint, mode: str, cache_dir: Path) -> Path:
    return Path(cache_dir) / f"quant-v{FORMAT_VERSION}-{mode}-{ckpt.fingerprint()}.safetensors"


def load_quantized(ckpt: Checkpoint, mode: str, cache_dir: Path | None) -> QuantizedExperts:
    """All experts quantized (on the CPU), from the cache when there, else computed and cached."""
    check_mode(mode)
    if mode == "none":
        raise SpecMoEError("draft_quant none has no quantized copies")
    c = ckpt.config
    if cache_dir is None:
        return compute_quantized(ckpt, mode)
    path = cache_path(ckpt, mode, cache_dir)
    if path.is_file():
        try:
            q = QuantizedExperts.from_state_dict(mode, load_file(str(path)), c.expert)
            if set(q.layers) == set(c.moe_layer_ids):
                return q
        except Exception:  # noqa: BLE001 - a damaged or foreign cache file: recompute it
            pass
        warn(f"ignoring {path}: it is not this model's {mode} copies (damaged?); it will be rebuilt")
    q = compute_quantized(ckpt, mode)
    keep(path, lambda tmp: save_file(q.state_dict(), str(tmp), metadata={"mode": mode, "format": str(FORMAT_VERSION)}),
         f"the {mode} copies of the experts")
    return q


def quantize_all(ckpt: Checkpoint, keys, mode: str, cache_dir: Path | None,
                 device: torch.device | str = "cpu") -> QuantizedExperts:
    """Quantized copies of the experts `keys` [(layer, e)] (whole blocks are kept stacked:
    the keys' blocks, all their experts), on `device`. The stored format does not depend
    on the compute dtype: a copy computes in its input's (quantized_expert_forward)."""
    q = load_quantized(ckpt, mode, cache_dir)
    wanted = {layer for layer, _ in keys}
    q = QuantizedExperts(q.mode, {l: m for l, m in q.layers.items() if l in wanted}, q.spec)
    return q.to(device)
