"""Model shapes: the sizes the cost model needs, from presets or a HF ``config.json``.

Legend: L layers, M MoE layers, D hidden, E experts, k experts per token, I expert
intermediate size, V vocabulary. Attention is counted as q/k/v/o projections plus the
score/value products over the context; norms are ignored (a few D-sized vectors).
Multi-head latent attention (DeepSeek, Kimi) has its own projection count and caches
one latent per token and layer (`kv_elements_per_layer`); windowed layers (GPT-OSS's
sliding, Llama 4's chunked) cache at most their window.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
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
    expert_bytes_per_param: float = 0.0  # routed experts' own, when quantized (scales included); 0: bytes_per_param
    stored_bytes_per_param: float = 0.0  # float experts in the tiers, where narrower than a slot's (bf16 computed in float32)
    expert_matrices: int = 3  # 3: gated (SwiGLU: gate, up, down); 2: plain (fc1, fc2)
    tied_embeddings: bool = False
    attention_params_per_layer: int = 0  # 0: GQA projections from the head counts; MLA: its own count
    kv_elements_per_layer: int = 0  # cached per token and layer; 0: K and V of the kv heads
    windowed_layers: int = 0  # layers whose attention sees at most `window` positions
    window: int = 0
    encoder_layers: int = 0  # an encoder-decoder model: the first layers are the encoder (run once per request)
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
        if self.bytes_per_param <= 0 or self.expert_bytes_per_param < 0 or self.stored_bytes_per_param < 0:
            raise ValueError(f"model shape {self.name}: bytes_per_param must be positive")
        if not 0 <= self.encoder_layers < self.num_layers:
            raise ValueError(f"model shape {self.name}: encoder_layers must be in 0..{self.num_layers - 1}")

    # ---- parameter counts ----------------------------------------------------------------
    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    # ---- what a decode step runs: every layer, or an encoder-decoder model's decoder ----------
    @property
    def step_layers(self) -> int:
        return self.num_layers - self.encoder_layers

    @property
    def step_moe_layers(self) -> int:
        return sum(1 for i in self.moe_layers if i >= self.encoder_layers)

    @property
    def step_dense_layers(self) -> int:
        return self.step_layers - self.step_moe_layers

    @property
    def encoder_moe_layers(self) -> int:
        return self.num_moe_layers - self.step_moe_layers

    @property
    def expert_params(self) -> int:
        return self.expert_matrices * self.hidden * self.expert_intermediate

    @property
    def attention_params(self) -> int:
        """Per layer: q and o (D x H*hd each), k and v (D x Hkv*hd each), unless given (MLA)."""
        if self.attention_params_per_layer:
            return self.attention_params_per_layer
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
        # an encoder-decoder model's decoder layers also hold a cross-attention (plain MHA)
        cross = self.step_layers * 4 * self.hidden * self.num_heads * self.head_dim if self.encoder_layers else 0
        return (self.num_layers * self.attention_params + cross
                + self.num_dense_layers * self.dense_ffn_params
                + self.num_moe_layers * (self.shared_expert_params + self.router_params)
                + self.embedding_params)

    # ---- bytes -----------------------------------------------------------------------------
    @property
    def expert_bytes(self) -> int:
        """One routed expert, as the tiers hold and move it."""
        return int(self.expert_params * (self.expert_bytes_per_param or self.stored_bytes_per_param or self.bytes_per_param))

    @property
    def expert_slot_bytes(self) -> int:
        """One routed expert, as a device slot holds it (and its compute reads it)."""
        return int(self.expert_params * (self.expert_bytes_per_param or self.bytes_per_param))

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
        """What one position costs in the KV cache, all the layers a decode step runs (MLA:
        the latent); an encoder-decoder model's cross-attention K/V of a source token costs the same."""
        per_layer = self.kv_elements_per_layer or 2 * self.num_kv_heads * self.head_dim
        return int(self.step_layers * per_layer * self.bytes_per_param)

    def kv_bytes_per_sequence(self, context: int, source: int = 0) -> int:
        """KV cache of one sequence of `context` positions, windowed layers holding their
        window only (plus an encoder-decoder model's `source` positions of cross K/V)."""
        per_layer = self.kv_bytes_per_token / self.step_layers
        windowed = self.windowed_layers * min(context, self.window or context)
        own = per_layer * ((self.step_layers - self.windowed_layers) * context + windowed)
        return int(own + (self.kv_bytes_per_token * source if self.encoder_layers else 0))

    # ---- FLOPs per token (2 per multiply-add) ------------------------------------------------
    def attention_flops_per_token(self, context: int) -> float:
        """Projections plus QK^T and PV over `context` cached positions, the layers a decode step runs."""
        per_layer = 2 * self.attention_params + 4 * self.num_heads * self.head_dim * context
        return float(self.step_layers * per_layer)

    def dense_flops_per_token(self) -> float:
        """Everything that is neither attention nor a routed expert: dense FFNs, shared
        experts, routers, LM head."""
        return float(2 * (self.step_dense_layers * self.dense_ffn_params
                          + self.step_moe_layers * (self.shared_expert_params + self.router_params)
                          + self.hidden * self.vocab))

    def expert_flops_per_token(self) -> float:
        """Routed experts: k experts in each MoE layer a decode step runs."""
        return float(2 * self.expert_params * self.top_k * self.step_moe_layers)

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


def mla_params(hidden: int, heads: int, q_lora: int, kv_lora: int, nope: int, rope: int, v: int) -> int:
    """Projections of one multi-head latent attention layer: q (through its latent when
    q_lora > 0), the kv latent and rotary key, their up-projection, the output."""
    q = hidden * q_lora + q_lora * heads * (nope + rope) if q_lora else hidden * heads * (nope + rope)
    return q + hidden * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * hidden


def _mla(hidden: int, heads: int, q_lora: int, kv_lora: int = 512, nope: int = 128, rope: int = 64, v: int = 128):
    """The ModelShape fields of a DeepSeek-style MLA layer."""
    return dict(num_heads=heads, num_kv_heads=heads, head_dim=nope + rope, kv_elements_per_layer=kv_lora + rope,
                attention_params_per_layer=mla_params(hidden, heads, q_lora, kv_lora, nope, rope, v))


_MLA_NOTE = "MLA: the KV cache holds the 576-element latent per token and layer; attention FLOPs counted as MHA"
_GPT_OSS = dict(hidden=2880, top_k=4, expert_intermediate=2880, num_heads=64, num_kv_heads=8, head_dim=64,
                vocab=201088, window=128,
                note="bf16 experts (the released checkpoint stores them in MXFP4, about 4.25 bits per weight; "
                     "expert biases ignored); every other layer a 128-position sliding window")

PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in [
        ModelShape("mixtral-8x7b", num_layers=32, moe_layers=tuple(range(32)), hidden=4096, num_experts=8, top_k=2,
                   expert_intermediate=14336, num_heads=32, num_kv_heads=8, head_dim=128, vocab=32000),
        ModelShape("mixtral-8x22b", num_layers=56, moe_layers=tuple(range(56)), hidden=6144, num_experts=8, top_k=2,
                   expert_intermediate=16384, num_heads=48, num_kv_heads=8, head_dim=128, vocab=32768),
        ModelShape("nllb-moe-54b", num_layers=48, encoder_layers=24, moe_layers=_every(4, 24) + tuple(
                   24 + i for i in _every(4, 24)), hidden=2048, num_experts=128, top_k=2,
                   expert_intermediate=8192, dense_intermediate=8192, num_heads=16, num_kv_heads=16, head_dim=128,
                   vocab=256206, expert_matrices=2, tied_embeddings=True,
                   note="encoder-decoder: 24 encoder + 24 decoder layers, MoE every 4th in each (12 blocks, "
                        "103 GB of experts in bf16); the encoder runs once per request over its source and is "
                        "amortized over the request's decode steps; decode steps run the decoder, with "
                        "cross-attention over the source"),
        ModelShape("llama-4-scout", num_layers=48, moe_layers=tuple(range(48)), hidden=5120, num_experts=16, top_k=1,
                   expert_intermediate=8192, shared_expert_intermediate=8192, num_heads=40, num_kv_heads=8,
                   head_dim=128, vocab=202048, windowed_layers=36, window=8192,
                   note="text decoder only (vision encoder omitted); the 36 RoPE layers attend in 8192-position "
                        "chunks, the 12 NoPE layers the whole context"),
        ModelShape("qwen3-30b-a3b", num_layers=48, moe_layers=tuple(range(48)), hidden=2048, num_experts=128, top_k=8,
                   expert_intermediate=768, num_heads=32, num_kv_heads=4, head_dim=128, vocab=151936),
        ModelShape("qwen3-235b-a22b", num_layers=94, moe_layers=tuple(range(94)), hidden=4096, num_experts=128,
                   top_k=8, expert_intermediate=1536, num_heads=64, num_kv_heads=4, head_dim=128, vocab=151936),
        ModelShape("deepseek-v2-lite", num_layers=27, moe_layers=tuple(range(1, 27)), hidden=2048, num_experts=64,
                   top_k=6, expert_intermediate=1408, shared_expert_intermediate=2 * 1408, dense_intermediate=10944,
                   vocab=102400, **_mla(2048, 16, q_lora=0), note=_MLA_NOTE),
        ModelShape("deepseek-v3", num_layers=61, moe_layers=tuple(range(3, 61)), hidden=7168, num_experts=256,
                   top_k=8, expert_intermediate=2048, shared_expert_intermediate=2048, dense_intermediate=18432,
                   vocab=129280, **_mla(7168, 128, q_lora=1536),
                   note=_MLA_NOTE + "; the same shape as DeepSeek-R1; the multi-token-prediction layer is not counted"),
        ModelShape("kimi-k2", num_layers=61, moe_layers=tuple(range(1, 61)), hidden=7168, num_experts=384, top_k=8,
                   expert_intermediate=2048, shared_expert_intermediate=2048, dense_intermediate=18432,
                   vocab=163840, **_mla(7168, 64, q_lora=1536), note=_MLA_NOTE + "; DeepSeek-V3 architecture"),
        ModelShape("glm-4.5-air", num_layers=46, moe_layers=tuple(range(1, 46)), hidden=4096, num_experts=128,
                   top_k=8, expert_intermediate=1408, shared_expert_intermediate=1408, dense_intermediate=10944,
                   num_heads=96, num_kv_heads=8, head_dim=128, vocab=151552,
                   note="the multi-token-prediction layer is not counted"),
        ModelShape("gpt-oss-120b", num_layers=36, moe_layers=tuple(range(36)), num_experts=128, windowed_layers=18,
                   **_GPT_OSS),
        ModelShape("gpt-oss-20b", num_layers=24, moe_layers=tuple(range(24)), num_experts=32, windowed_layers=12,
                   **_GPT_OSS),
    ]
}


def as_run(shape: ModelShape, compute_bytes: float, stored_bytes: float) -> ModelShape:
    """The shape as the engine runs it: weights in a compute dtype of `compute_bytes` per
    parameter, float experts kept in the tiers at `stored_bytes` (the engine's expert format)."""
    return replace(shape, bytes_per_param=float(compute_bytes),
                   stored_bytes_per_param=float(stored_bytes) if stored_bytes < compute_bytes else 0.0)


def preset_names() -> list[str]:
    return sorted(PRESETS)


def shape_of(config: ModelConfig, name: str) -> ModelShape:
    """The cost model's view of a model the engine loads: derived from the same
    `ModelConfig` the engine reads, so both agree on what a checkpoint is."""
    dtype = config.torch_dtype.removeprefix("torch.")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"{name}: unsupported dtype {dtype!r}")
    dense_layers = config.num_layers > len(config.moe_layer_ids)
    a = config.attention
    mla = {}
    if a.kind == "mla":
        mla = dict(kv_elements_per_layer=a.kv_elements_per_token, attention_params_per_layer=mla_params(
            config.hidden_size, a.num_heads, a.q_lora_rank, a.kv_lora_rank, a.qk_nope_dim, a.qk_rope_dim, a.v_head_dim))
    windows = [w.size for w in config.windows if w is not None]
    quant = config.expert_quant  # its blob: what moves per expert
    return ModelShape(
        name=name, num_layers=config.num_layers, moe_layers=config.moe_layer_ids, hidden=config.hidden_size,
        num_experts=config.num_experts, top_k=config.top_k, expert_intermediate=config.expert_intermediate_size,
        shared_expert_intermediate=config.shared_expert_intermediate_size,
        dense_intermediate=config.dense_intermediate_size if dense_layers else 0,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        vocab=config.vocab_size, bytes_per_param=float(_DTYPE_BYTES[dtype]),
        expert_bytes_per_param=quant.nbytes / config.expert_params if quant else 0.0,
        tied_embeddings=config.tie_word_embeddings, expert_matrices=3 if config.expert.gated else 2,
        windowed_layers=len(windows), window=max(windows, default=0), encoder_layers=config.encoder_layers, **mla,
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
