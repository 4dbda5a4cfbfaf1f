"""The small frozen pieces a `ModelConfig` is made of, each read from a Hugging Face
`config.json`: RoPE, attention, the router, one routed expert, a layer's attention window.

Data only (no torch): model/ computes with them, the cost model and `specmoe info` count
with them. Each family's config keys map onto them in families.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SpecMoEError

ROPE_KINDS = ("default", "linear", "yarn", "llama3", "longrope")
ROPE_STYLES = ("half", "interleaved")  # half: dims i and i + d/2 rotate together (NeoX); interleaved: 2i and 2i+1
QK_NORMS = ("none", "head", "full", "l2")
ROUTER_KINDS = ("softmax_topk", "group_limited_softmax", "sigmoid_group_topk", "topk_softmax", "topk_sigmoid",
                "sparsemixer", "top2_all")
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu", "relu")
WINDOW_KINDS = ("sliding", "chunked")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding: which frequencies, over which dims, laid out how."""

    kind: str = "default"
    theta: float = 10000.0
    dim: int = 0  # rotated dims per head; the rest of the head passes unrotated (partial RoPE)
    style: str = "half"
    factor: float = 1.0
    original_max_positions: int = 0  # the pre-training context that scaling extends
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # scales cos/sin (yarn, longrope); None: derived from the factor
    mscale: float | None = None
    mscale_all_dim: float | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0
    short_factor: tuple[float, ...] = ()  # longrope, per frequency
    long_factor: tuple[float, ...] = ()
    short_mscale: float | None = None  # Phi-3.5-MoE's own cos/sin scales per regime
    long_mscale: float | None = None

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise SpecMoEError(f"config.json: rope type {self.kind!r} is not supported; supported: {', '.join(ROPE_KINDS)}")
        if self.style not in ROPE_STYLES or self.dim % 2:
            raise SpecMoEError(f"internal: bad RoPE style {self.style!r} or odd rotary dim {self.dim}")
        if self.kind == "longrope" and len(self.short_factor) != self.dim // 2:
            raise SpecMoEError(f"config.json: longrope short_factor has {len(self.short_factor)} values, "
                               f"the rotary dims need {self.dim // 2}")

    @classmethod
    def from_config(cls, cfg: dict, dim: int, style: str, default_theta: float, default_partial: float = 1.0) -> RopeSpec:
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        kind = params.get("rope_type", params.get("type")) or "default"
        partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default_partial))
        # as transformers: a top-level original_max_position_embeddings (Phi) wins, else the
        # scaling's own, else the context itself
        original = (cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                    or cfg.get("max_position_embeddings") or 0)
        factor = params.get("factor")
        if factor is None and original:
            factor = cfg.get("max_position_embeddings", original) / original
        pick = {k: params[k] for k in ("beta_fast", "beta_slow", "truncate", "attention_factor", "mscale",
                                        "mscale_all_dim", "low_freq_factor", "high_freq_factor",
                                        "short_mscale", "long_mscale") if params.get(k) is not None}
        return cls(
            kind=kind, theta=float(params.get("rope_theta", cfg.get("rope_theta", default_theta))),
            dim=int(dim * partial) // 2 * 2, style=style, factor=float(factor or 1.0),
            original_max_positions=int(original or 0),
            short_factor=tuple(params.get("short_factor") or ()), long_factor=tuple(params.get("long_factor") or ()),
            **pick,
        )


@dataclass(frozen=True)
class AttentionSpec:
    """Self-attention: grouped-query (`gqa`) or multi-head latent attention (`mla`, DeepSeek).

    MLA projects each token's K and V through one low-rank latent (kv_lora_rank) plus a
    shared rotary key (qk_rope_dim); the KV cache stores only those."""

    kind: str  # gqa | mla
    num_heads: int
    num_kv_heads: int
    head_dim: int  # q/k dims per head (MLA: nope + rope)
    v_head_dim: int
    scale: float  # softmax scale of q.k
    qk_norm: str = "none"  # head: RMSNorm per head; full: over all heads; l2: weightless, RoPE layers only
    sinks: bool = False  # a learned per-head logit that takes softmax mass and adds nothing (GPT-OSS)
    clip_qkv: float | None = None
    q_lora_rank: int = 0  # MLA; 0: q is one projection
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    temperature: tuple[float, float] | None = None  # (floor_scale, attn_scale): q scaled by position in NoPE layers

    def __post_init__(self):
        if self.qk_norm not in QK_NORMS:
            raise SpecMoEError(f"internal: unknown q/k norm {self.qk_norm!r}")
        if self.num_heads % self.num_kv_heads:
            raise SpecMoEError(f"config.json: num_attention_heads={self.num_heads} is not a multiple of "
                               f"num_key_value_heads={self.num_kv_heads}: fix the config")

    @property
    def kv_elements_per_token(self) -> int:
        """What one layer caches per token: the latent and the rotary key (MLA), else K and V."""
        if self.kind == "mla":
            return self.kv_lora_rank + self.qk_rope_dim
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)


@dataclass(frozen=True)
class AttentionWindow:
    """Keys a query may see besides causality: the last `size` positions (sliding) or its
    own block of `size` positions (chunked, Llama 4)."""

    kind: str
    size: int

    def __post_init__(self):
        if self.kind not in WINDOW_KINDS or self.size < 1:
            raise SpecMoEError(f"config.json: bad attention window {self.kind} of {self.size} positions")


def cache_positions(window: AttentionWindow | None, max_len: int, rollback: int) -> int:
    """Positions a layer's KV cache holds per sequence: the whole context, or for a windowed
    layer a ring of the window plus the drafts a step may roll back (their writes must not
    overwrite keys the window still needs)."""
    if window is None:
        return max_len
    return min(max_len, window.size + rollback)


@dataclass(frozen=True)
class RouterSpec:
    """How a block's router logits choose experts (model/routers.py has one function per kind)."""

    kind: str
    top_k: int
    num_experts: int
    renormalize: bool = False  # the k weights divided by their sum
    scaling: float = 1.0  # routed_scaling_factor
    num_groups: int = 1  # group-limited routing: experts in groups, only the best topk_groups groups
    topk_groups: int = 1
    logit_bias: bool = False  # the router projection has a bias (GPT-OSS)
    correction_bias: bool = False  # e_score_correction_bias shifts the choice, not the weights
    jitter_eps: float = 0.0  # sparsemixer's relative threshold
    scales_input: bool = False  # the weight multiplies the expert's input, not its output (Llama 4)

    def __post_init__(self):
        if self.kind not in ROUTER_KINDS:
            raise SpecMoEError(f"internal: unknown router kind {self.kind!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise SpecMoEError(f"config.json: num_experts_per_tok={self.top_k} must be between 1 and the "
                               f"number of experts ({self.num_experts})")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise SpecMoEError(f"config.json: n_group={self.num_groups} must divide the {self.num_experts} experts")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise SpecMoEError(f"config.json: topk_group={self.topk_groups} must be between 1 and n_group={self.num_groups}")
        if self.kind in ("sparsemixer", "top2_all") and self.top_k != 2:
            raise SpecMoEError(f"config.json: the {self.kind} router routes to exactly 2 experts, not {self.top_k}")


@dataclass(frozen=True)
class ExpertSpec:
    """One routed expert, and the layout of its contiguous buffer (the unit that moves):

        [w_in (R x D) | w_out (D x I) | b_in (R) | b_out (D)]     R = 2I gated, I plain

    Gated experts hold the gate rows first, then the up rows (a checkpoint that interleaves
    them is de-interleaved on load); biases only where the family has them."""

    hidden: int
    inter: int
    activation: str = "silu"  # silu: SwiGLU; clamped_swiglu: GPT-OSS; relu: fc1/fc2, not gated
    bias: bool = False
    alpha: float = 1.702  # clamped_swiglu: gate * sigmoid(alpha * gate), both clamped at `limit`
    limit: float = 7.0

    def __post_init__(self):
        if self.activation not in EXPERT_ACTIVATIONS:
            raise SpecMoEError(f"internal: unknown expert activation {self.activation!r}")

    @property
    def gated(self) -> bool:
        return self.activation != "relu"

    @property
    def in_rows(self) -> int:
        return 2 * self.inter if self.gated else self.inter

    @property
    def numel(self) -> int:
        weights = self.in_rows * self.hidden + self.hidden * self.inter
        return weights + (self.in_rows + self.hidden if self.bias else 0)


@dataclass(frozen=True)
class Seq2SeqSpec:
    """An encoder-decoder model (NLLB-MoE): the first `encoder_layers` layers of the
    model's layer list are the encoder, the rest the decoder (one numbering, so that an
    expert is (layer, e) in the tiers and policies whichever stack it belongs to).

    The decoder starts from `decoder_start_token_id` followed by the target language's
    token; positions are sinusoidal, offset past `pad_token_id` (fairseq's convention);
    embeddings are scaled by `embed_scale`."""

    encoder_layers: int
    decoder_start_token_id: int
    pad_token_id: int
    embed_scale: float = 1.0

    def __post_init__(self):
        if self.encoder_layers < 1:
            raise SpecMoEError(f"config.json: an encoder-decoder model needs encoder layers, not {self.encoder_layers}")
