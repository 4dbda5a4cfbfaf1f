"""Model shapes: the sizes the cost model needs, from presets or a HF ``config.json``.

Legend: L layers, M MoE layers, D hidden, E experts, k experts per token, I expert
intermediate size, V vocabulary. Attention is counted as q/k/v/o projections plus the
score/value products over the context; norms are ignored (a few D-sized vectors).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..base.config import ModelConfig

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float": 4, "half": 2, "bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    moe_layers: tuple[int, ...]  # indices of the layers whose FFN is an MoE block
    hidden: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    shared_expert_intermediate: int = 0  # per MoE layer, always active (0: none)
    dense_intermediate: int = 0  # FFN of the non-MoE layers
    bytes_per_param: float = 2.0
    expert_matrices: int = 3  # 3: gated (SwiGLU: gate, up, down); 2: plain (fc1, fc2)
    tied_embeddings: bool = False
    note: str = ""  # approximations made for this shape

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        for name in ("num_layers", "hidden", "num_experts", "top_k", "expert_intermediate", "num_heads",
                     "num_kv_heads", "head_dim", "vocab", "expert_matrices"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"model shape {self.name}: {name} must be a positive integer, got {v!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"model shape {self.name}: top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if not self.moe_layers:
            raise ValueError(f"model shape {self.name}: no MoE layers")
        if any(not 0 <= i < self.num_layers for i in self.moe_layers) or len(set(self.moe_layers)) != len(self.moe_layers):
            raise ValueError(f"model shape {self.name}: moe_layers must be distinct indices in 0..{self.num_layers - 1}")
        if self.num_layers > len(self.moe_layers) and self.dense_intermediate <= 0:
            raise ValueError(f"model shape {self.name}: dense layers present but dense_intermediate is 0")
        if self.bytes_per_param <= 0:
            raise ValueError(f"model shape {self.name}: bytes_per_param must be positive")

    # ---- parameter counts ----------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def expert_params(self) -> int:
        return self.expert_matrices * self.hidden * self.expert_intermediate

    @property
    def attention_params(self) -> int:
        """Per layer: q and o (D x H*hd each), k and v (D x Hkv*hd each)."""
        return 2 * self.hidden * self.num_heads * self.head_dim + 2 * self.hidden * self.num_kv_heads * self.head_dim

    @property
    def dense_ffn_params(self) -> int:
        return self.expert_matrices * self.hidden * self.dense_intermediate

    @property
    def shared_expert_params(self) -> int:
        return self.expert_matrices * self.hidden * self.shared_expert_intermediate

    @property
    def router_params(self) -> int:
        return self.hidden * self.num_experts

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def non_expert_params(self) -> int:
        return (self.num_layers * self.attention_params
                + self.num_dense_layers * self.dense_ffn_params
                + self.num_moe_layers * (self.shared_expert_params + self.router_params)
                + self.embedding_params)

    # ---- bytes -----------------------------------------------------------------------------
    @property
    def expert_bytes(self) -> int:
        """One routed expert."""
        return int(self.expert_params * self.bytes_per_param)

    @property
    def expert_bytes_total(self) -> int:
        return self.expert_bytes * self.num_experts * self.num_moe_layers

    @property
    def non_expert_bytes(self) -> int:
        return int(self.non_expert_params * self.bytes_per_param)

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes_total + self.non_expert_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one position, all layers."""
        return int(self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.bytes_per_param)

    # ---- FLOPs per token (2 per multiply-add) ------------------------------------------------
    def attention_flops_per_token(self, context: int) -> float:
        """Projections plus QK^T and PV over `context` cached positions, all layers."""
        per_layer = 2 * self.attention_params + 4 * self.num_heads * self.head_dim * context
        return float(self.num_layers * per_layer)

    def dense_flops_per_token(self) -> float:
        """Everything that is neither attention nor a routed expert: dense FFNs, shared
        experts, routers, LM head."""
        return float(2 * (self.num_dense_layers * self.dense_ffn_params
                          + self.num_moe_layers * (self.shared_expert_params + self.router_params)
                          + self.hidden * self.vocab))

    def expert_flops_per_token(self) -> float:
        """Routed experts: k experts in each MoE layer."""
        return float(2 * self.expert_params * self.top_k * self.num_moe_layers)

    def flops_per_token(self, context: int) -> float:
        return self.attention_flops_per_token(context) + self.dense_flops_per_token() + self.expert_flops_per_token()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelShape":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"model shape: unknown key {unknown[0]!r}")
        return cls(**d)


def _every(step: int, n: int) -> tuple[int, ...]:
    """Layers (i+1) % step == 0: the HF `sparse_step` convention (NLLB, Qwen2-MoE)."""
    return tuple(i for i in range(n) if (i + 1) % step == 0)


PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in [
        ModelShape("mixtral-8x7b", num_layers=32, moe_layers=tuple(range(32)), hidden=4096, num_experts=8, top_k=2,
                   expert_intermediate=14336, num_heads=32, num_kv_heads=8, head_dim=128, vocab=32000),
        ModelShape("mixtral-8x22b", num_layers=56, moe_layers=tuple(range(56)), hidden=6144, num_experts=8, top_k=2,
                   expert_intermediate=16384, num_heads=48, num_kv_heads=8, head_dim=128, vocab=32768),
        ModelShape("nllb-moe-54b", num_layers=24, moe_layers=_every(4, 24), hidden=2048, num_experts=128, top_k=2,
                   expert_intermediate=8192, dense_intermediate=8192, num_heads=16, num_kv_heads=16, head_dim=128,
                   vocab=256206, expert_matrices=2, tied_embeddings=True,
                   note="decoder-only approximation: the 24 decoder layers (MoE every 4th: 6 MoE layers, "
                        "51.5 GB of experts in bf16); decode steps run only the decoder, so the encoder "
                        "(run once per sequence) and cross-attention over the encoder states are omitted"),
        ModelShape("llama-4-scout", num_layers=48, moe_layers=tuple(range(48)), hidden=5120, num_experts=16, top_k=1,
                   expert_intermediate=8192, shared_expert_intermediate=8192, num_heads=40, num_kv_heads=8,
                   head_dim=128, vocab=202048,
                   note="text decoder only (vision encoder omitted); chunked/no-RoPE attention counted as full attention"),
        ModelShape("qwen3-30b-a3b", num_layers=48, moe_layers=tuple(range(48)), hidden=2048, num_experts=128, top_k=8,
                   expert_intermediate=768, num_heads=32, num_kv_heads=4, head_dim=128, vocab=151936),
        ModelShape("deepseek-v2-lite", num_layers=27, moe_layers=tuple(range(1, 27)), hidden=2048, num_experts=64,
                   top_k=6, expert_intermediate=1408, shared_expert_intermediate=2 * 1408, dense_intermediate=10944,
                   num_heads=16, num_kv_heads=16, head_dim=128, vocab=102400,
                   note="MLA attention approximated as 16-head MHA with head_dim 128 (similar parameter count; "
                        "the real compressed KV cache is smaller)"),
    ]
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def shape_of(config: ModelConfig, name: str) -> ModelShape:
    """The cost model's view of a model the engine loads: derived from the same
    `ModelConfig` the engine reads, so both agree on what a checkpoint is."""
    dtype = config.torch_dtype.removeprefix("torch.")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"{name}: unsupported dtype {dtype!r}")
    dense_layers = config.num_layers > len(config.moe_layer_ids)
    return ModelShape(
        name=name, num_layers=config.num_layers, moe_layers=config.moe_layer_ids, hidden=config.hidden_size,
        num_experts=config.num_experts, top_k=config.top_k, expert_intermediate=config.expert_intermediate_size,
        shared_expert_intermediate=config.shared_expert_intermediate_size,
        dense_intermediate=config.dense_intermediate_size if dense_layers else 0,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        vocab=config.vocab_size, bytes_per_param=float(_DTYPE_BYTES[dtype]),
        tied_embeddings=config.tie_word_embeddings,
    )


def shape_from_config(path: str | os.PathLike, name: str | None = None) -> ModelShape:
    """A ModelShape from a HF ``config.json`` (or a directory holding one): every family
    the engine loads."""
    p = Path(path)
    directory = p if p.is_dir() else p.parent
    if not p.is_dir() and p.name != "config.json":
        raise ValueError(f"{p}: expected a model directory or its config.json")
    config = ModelConfig.from_dir(directory)
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    return shape_of(config, name or raw.get("_name_or_path") or directory.name or config.family.name)


def load_shape(name_or_path: str | os.PathLike) -> ModelShape:
    """A preset by name, or a shape from a config.json / model directory."""
    s = str(name_or_path)
    if s in PRESETS:
        return PRESETS[s]
    p = Path(s).expanduser()
    if p.exists():
        return shape_from_config(p)
    raise ValueError(f"unknown model shape {s!r}: use one of {', '.join(preset_names())} or a path to a config.json")
