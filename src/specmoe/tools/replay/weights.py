"""The experts a replay runs on: the replayed shape (scaled, SwiGLU, at the replay dtype),
a check that they fit before anything is allocated, random weights standing in for a
checkpoint, and the store that serves every trace layer from the K replayed layers."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from ...base.specs import ExpertSpec
from ...base.units import format_bytes
from ...costmodel.shapes import ModelShape
from ...experts.formats import FloatFormat
from ...experts.pool import Key
from ...experts.store import ExpertStore
from ...experts.tiers import open_store
from .errors import ReplayError
from .schedule import LayerMap


def _round8(x: float) -> int:
    return max(8, round(x / 8) * 8)


def replay_shape(shape: ModelShape, scale: float, dtype_bytes: int) -> tuple[ModelShape, list[str]]:
    """The shape as replayed: scaled, SwiGLU, at the replay dtype."""
    notes = []
    hidden, inter, name = shape.hidden, shape.expert_intermediate, shape.name
    if shape.expert_matrices != 3:
        inter = _round8(inter * shape.expert_matrices / 3)
        notes.append(f"{shape.name} has {shape.expert_matrices}-matrix experts; replayed as SwiGLU with intermediate "
                     f"size {inter} = {shape.expert_matrices}/3 x {shape.expert_intermediate} (the same bytes and "
                     "FLOPs per token)")
    if scale != 1.0:
        hidden, inter, name = _round8(hidden * scale), _round8(inter * scale), f"{shape.name}x{scale:g}"
        notes.append(f"hidden and expert intermediate sizes scaled by {scale:g} (--scale): {shape.hidden}->{hidden}, "
                     f"{shape.expert_intermediate}->{inter}; times are for that smaller shape")
    out = replace(shape, name=name, hidden=hidden, expert_intermediate=inter, expert_matrices=3,
                  bytes_per_param=float(dtype_bytes))
    return out, notes


def _available_host_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(shape: ModelShape, k: int, pool_slots: int, device: torch.device, offload: str,
                 hint_scale: bool) -> None:
    """Refuse what cannot fit before allocating anything, saying what to change."""
    e_bytes = shape.expert_bytes
    # host tier on CUDA: the store is allocated, then pinned (a second copy for a moment)
    store = k * shape.num_experts * e_bytes * (2 if device.type == "cuda" else 1) if offload == "host" \
        else 2 * e_bytes
    pool = pool_slots * e_bytes
    fix = "lower --layers" + (" or pass --scale (e.g. 0.125)" if hint_scale else "")
    avail = _available_host_bytes()
    host_need = store + (pool if device.type == "cpu" else 0)
    if avail is not None and host_need > 0.8 * avail:
        raise ReplayError(f"{k} layer(s) of {shape.name} experts ({shape.num_experts} x {format_bytes(e_bytes)}) "
                          f"and a pool of {pool_slots} experts need {format_bytes(host_need)} of host memory; "
                          f"{format_bytes(avail)} is available: {fix}")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if pool > 0.9 * free:
            raise ReplayError(f"a device pool of {pool_slots} experts of {format_bytes(e_bytes)} needs "
                              f"{format_bytes(pool)}; {format_bytes(free)} of GPU memory is free: pass --scale "
                              "or a trace with fewer MoE layers")


class RandomExperts:
    """Stands in for a Checkpoint where the offload stores need one: random expert
    buffers [gate | up | down] of the replayed shape, K layers."""

    def __init__(self, shape: ModelShape, k: int, seed: int):
        self.config = SimpleNamespace(expert_params=shape.expert_params)
        self.shape, self.k, self.seed = shape, k, seed
        self._tile = None

    def expert_buffer(self, layer: int, expert: int, dtype: torch.dtype) -> torch.Tensor:
        if self._tile is None:  # one random tile, repeated: filling GBs with randn would take minutes
            g = torch.Generator().manual_seed(self.seed)
            self._tile = (torch.randn(1 << 20, generator=g) * 0.02).to(dtype)
        n = self.config.expert_params
        tile = self._tile.to(dtype)
        reps = -(-n // tile.numel()) + 1
        start = (layer * 1009 + expert * 9973) % tile.numel()
        return tile.repeat(reps)[start:start + n]  # contiguous: the stores copy it

    def fingerprint(self) -> str:
        s = self.shape
        key = f"replay:{s.hidden}:{s.expert_intermediate}:{s.num_experts}:{self.k}:{self.seed}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]


class SharedLayerStore(ExpertStore):
    """The store seen by the pools: pool keys (layer id, expert) served from the inner
    store's K replayed layers (`LayerMap.physical`)."""

    def __init__(self, inner: ExpertStore, lmap: LayerMap):
        super().__init__(inner.keys, inner.numel, inner.dtype, None)
        self.inner, self.lmap = inner, lmap
        self.tier = inner.tier

    def _key(self, key: Key) -> Key:
        return (self.lmap.physical(key[0]), key[1])

    def _read(self, key: Key, dest: torch.Tensor) -> None:
        self.inner.read_into(self._key(key), dest)

    def host_tensor(self, key: Key) -> torch.Tensor | None:
        return self.inner.host_tensor(self._key(key))

    @property
    def pinned(self) -> bool:
        return getattr(self.inner, "pinned", False)

    def close(self) -> None:
        self.inner.close()


def open_experts(shape: ModelShape, lmap: LayerMap, dtype: torch.dtype, device: torch.device, offload: str,
                 offload_dir: str | None, seed: int) -> SharedLayerStore:
    """K replayed layers of random experts in the offload tier, shared by every trace layer."""
    fake = RandomExperts(shape, lmap.physical_layers, seed)
    keys = [(p, e) for p in range(lmap.physical_layers) for e in range(shape.num_experts)]
    fmt = FloatFormat(ExpertSpec(shape.hidden, shape.expert_intermediate), dtype)
    return SharedLayerStore(open_store(fake, keys, fmt, device, offload, offload_dir), lmap)
