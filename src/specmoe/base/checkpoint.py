"""Reading Hugging Face safetensors checkpoints, lazily, without pickle.

The index (or the single file's header) is read once; a tensor is read when asked for.
Tensor names differ between families and between transformers versions; the tables
below map each internal role to the names it may have. One routed expert is handed out
as one contiguous buffer `[gate (I*H) | up (I*H) | down (H*I)]`: it is the unit that
moves between tiers.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .errors import SpecMoEError

# Per-layer tensors, as templates under "model.layers.{i}.". The first name present wins.
# Mixtral writes its MoE block as `block_sparse_moe`; Qwen2/3-MoE and OLMoE as `mlp`.
LAYER_TENSORS: dict[str, tuple[str, ...]] = {
    "attn_norm": ("input_layernorm.weight",),
    "mlp_norm": ("post_attention_layernorm.weight",),
    "q": ("self_attn.q_proj.weight",),
    "k": ("self_attn.k_proj.weight",),
    "v": ("self_attn.v_proj.weight",),
    "o": ("self_attn.o_proj.weight",),
    "q_bias": ("self_attn.q_proj.bias",),
    "k_bias": ("self_attn.k_proj.bias",),
    "v_bias": ("self_attn.v_proj.bias",),
    "o_bias": ("self_attn.o_proj.bias",),
    "q_norm": ("self_attn.q_norm.weight",),
    "k_norm": ("self_attn.k_norm.weight",),
    "router": ("block_sparse_moe.gate.weight", "mlp.gate.weight"),
    "shared_gate_proj": ("mlp.shared_expert.gate_proj.weight",),
    "shared_up_proj": ("mlp.shared_expert.up_proj.weight",),
    "shared_down_proj": ("mlp.shared_expert.down_proj.weight",),
    "shared_expert_gate": ("mlp.shared_expert_gate.weight",),
    "dense_gate_proj": ("mlp.gate_proj.weight",),
    "dense_up_proj": ("mlp.up_proj.weight",),
    "dense_down_proj": ("mlp.down_proj.weight",),
}

# One routed expert in the per-expert layout ({e}: expert index).
EXPERT_TENSORS: dict[str, tuple[str, ...]] = {
    "gate": ("block_sparse_moe.experts.{e}.w1.weight", "mlp.experts.{e}.gate_proj.weight"),
    "up": ("block_sparse_moe.experts.{e}.w3.weight", "mlp.experts.{e}.up_proj.weight"),
    "down": ("block_sparse_moe.experts.{e}.w2.weight", "mlp.experts.{e}.down_proj.weight"),
}

# All routed experts of a layer in the fused layout (transformers >= 5,
# save_original_format=False): gate_up [E, 2I, H] with gate rows first, down [E, H, I].
FUSED_EXPERT_TENSORS: dict[str, tuple[str, ...]] = {
    "gate_up": ("block_sparse_moe.experts.gate_up_proj", "mlp.experts.gate_up_proj"),
    "down": ("block_sparse_moe.experts.down_proj", "mlp.experts.down_proj"),
}

GLOBAL_TENSORS: dict[str, tuple[str, ...]] = {
    "embed": ("model.embed_tokens.weight",),
    "final_norm": ("model.norm.weight",),
    "lm_head": ("lm_head.weight",),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Checkpoint:
    """A Hugging Face model directory: its config and its tensors, read lazily."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.exists():
            raise SpecMoEError(f"model directory {self.dir} does not exist; pass --model DIR of a Hugging Face checkpoint")
        if not self.dir.is_dir():
            raise SpecMoEError(f"{self.dir} is not a directory; pass --model DIR of a Hugging Face checkpoint")
        self.config = ModelConfig.from_dir(self.dir)
        self._handles: dict[str, object] = {}
        self._fused_cache: dict[tuple[int, str], torch.Tensor] = {}
        self._file_of = self._read_index()

    # --- the index ------------------------------------------------------------------

    def _read_index(self) -> dict[str, str]:
        """tensor name -> file name, from model.safetensors.index.json or the single file."""
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise SpecMoEError(f"{index}: unreadable index ({exc}); restore it from the checkpoint") from None
            for fname in set(weight_map.values()):
                if not (self.dir / fname).is_file():
                    raise SpecMoEError(f"{self.dir / fname}: shard named in the index is missing; download it again")
            return dict(weight_map)
        single = self.dir / "model.safetensors"
        if not single.is_file():
            if any(self.dir.glob("*.bin")) or any(self.dir.glob("*.pt")):
                raise SpecMoEError(
                    f"{self.dir}: only pickle weights (*.bin/*.pt) found; specmoe reads safetensors only: "
                    "convert with save_pretrained(safe_serialization=True)"
                )
            raise SpecMoEError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        return {name: single.name for name in self._open(single.name).keys()}

    def _open(self, fname: str):
        handle = self._handles.get(fname)
        if handle is None:
            path = self.dir / fname
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types
                raise SpecMoEError(
                    f"{path}: truncated or corrupt safetensors file ({exc}); download or save it again"
                ) from None
            self._handles[fname] = handle
        return handle

    @property
    def names(self) -> set[str]:
        return set(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from the file header, without reading its bytes."""
        return tuple(self._open(self._file_of[name]).get_slice(name).get_shape())

    def is_routed_expert(self, name: str) -> bool:
        return ".experts." in name

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise SpecMoEError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        fname = self._file_of[name]
        try:
            return self._open(fname).get_tensor(name)
        except SpecMoEError:
            raise
        except Exception as exc:
            raise SpecMoEError(f"{self.dir / fname}: cannot read tensor {name!r} ({exc}); the file is corrupt") from None

    # --- tensors by role --------------------------------------------------------------

    def find(self, candidates: tuple[str, ...], **fmt) -> str | None:
        for template in candidates:
            name = template.format(**fmt)
            if name in self._file_of:
                return name
        return None

    def get(self, role: str, shape: tuple[int, ...], layer: int | None = None, required: bool = True):
        """The tensor playing `role` (in `layer`), checked against `shape`; None if optional and absent."""
        if layer is None:
            candidates = GLOBAL_TENSORS[role]
        else:
            candidates = tuple(f"model.layers.{layer}.{t}" for t in LAYER_TENSORS[role])
        name = self.find(candidates)
        if name is None:
            if required:
                raise SpecMoEError(f"{self.dir}: tensor {candidates[0]!r} is missing from the checkpoint")
            return None
        return self._checked(name, shape)

    def _checked(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.tensor(name)
        if tuple(t.shape) != tuple(shape):
            raise SpecMoEError(
                f"{self.dir}: tensor {name!r} has shape {list(t.shape)}, config.json implies {list(shape)}"
            )
        return t

    @cached_property
    def fused_layout(self) -> bool:
        layer = self.config.moe_layer_ids[0] if self.config.moe_layer_ids else 0
        pre = f"model.layers.{layer}."
        return self.find(tuple(pre + t for t in FUSED_EXPERT_TENSORS["gate_up"])) is not None

    def expert_buffer(self, layer: int, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Routed expert `expert` of `layer` as one contiguous 1-D buffer [gate | up | down]."""
        c = self.config
        inter, hidden = c.expert_intermediate_size, c.hidden_size
        pre = f"model.layers.{layer}."
        if self.fused_layout:
            gate_up = self._fused(layer, "gate_up", (c.num_experts, 2 * inter, hidden))[expert]
            down = self._fused(layer, "down", (c.num_experts, hidden, inter))[expert]
            parts = [gate_up, down]
        else:
            parts = []
            for part, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
                candidates = tuple(pre + t for t in EXPERT_TENSORS[part])
                name = self.find(candidates, e=expert)
                if name is None:
                    raise SpecMoEError(
                        f"{self.dir}: tensor {candidates[0].format(e=expert)!r} is missing from the checkpoint"
                    )
                parts.append(self._checked(name, shape))
        return torch.cat([p.reshape(-1).to(dtype) for p in parts])

    def _fused(self, layer: int, part: str, shape: tuple[int, ...]) -> torch.Tensor:
        # One fused tensor serves every expert of the layer: keep the last one read.
        key = (layer, part)
        cache = self._fused_cache
        if key not in cache:
            if len(cache) >= 2:
                cache.clear()
            pre = f"model.layers.{layer}."
            name = self.find(tuple(pre + t for t in FUSED_EXPERT_TENSORS[part]))
            if name is None:
                raise SpecMoEError(
                    f"{self.dir}: tensor {pre + FUSED_EXPERT_TENSORS[part][0]!r} is missing from the checkpoint"
                )
            cache[key] = self._checked(name, shape)
        return cache[key]

    def torch_dtype(self) -> torch.dtype:
        return DTYPES.get(self.config.torch_dtype, torch.float32)

    def fingerprint(self) -> str:
        """Identifies the checkpoint's bytes cheaply: file names, sizes and modification times."""
        parts = []
        for fname in sorted(set(self._file_of.values())) + ["config.json"]:
            st = (self.dir / fname).stat()
            parts.append(f"{fname}:{st.st_size}:{st.st_mtime_ns}")
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
