"""`ModelConfig`: what to compute, read from a Hugging Face `config.json` through the
family table (families.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import families as fam
from .errors import SpecMoEError
from .families import FAMILIES, Family
from .quantization import ExpertQuant, expert_quant
from .specs import AttentionSpec, AttentionWindow, ExpertSpec, RopeSpec, RouterSpec, Seq2SeqSpec, cache_positions


@dataclass(frozen=True)
class ModelConfig:
    """The shape and semantics of one MoE language model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_experts: int
    expert_intermediate_size: int
    dense_intermediate_size: int  # layers that are not MoE use a dense SwiGLU MLP of this size
    shared_expert_intermediate_size: int  # 0: no shared expert
    moe_layers: tuple[bool, ...]
    attention: AttentionSpec
    rope: RopeSpec
    router: RouterSpec
    expert: ExpertSpec
    windows: tuple[AttentionWindow | None, ...]  # per layer; None: full causal attention
    rope_layers: tuple[bool, ...]  # per layer: whether q and k are rotated
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    weight_block_size: tuple[int, int] = (128, 128)  # FP8 checkpoints: the tile each weight scale covers
    expert_quant: ExpertQuant | None = None  # how the routed experts are stored when quantized (None: float)
    seq2seq: Seq2SeqSpec | None = None  # an encoder-decoder model: which layers are the encoder

    def __post_init__(self):
        for name in ("moe_layers", "windows", "rope_layers"):
            if len(getattr(self, name)) != self.num_layers:
                raise SpecMoEError(f"config.json: {name} must name each of the {self.num_layers} layers")

    # --- shorthands the rest of the package reads -------------------------------------------
    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    @property
    def num_heads(self) -> int:
        return self.attention.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.attention.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim

    @property
    def top_k(self) -> int:
        return self.router.top_k

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, is_moe in enumerate(self.moe_layers) if is_moe)

    @property
    def encoder_layers(self) -> int:
        """Leading layers that form the encoder (0: decoder-only)."""
        return self.seq2seq.encoder_layers if self.seq2seq else 0

    @property
    def decoder_layer_ids(self) -> tuple[int, ...]:
        return tuple(range(self.encoder_layers, self.num_layers))

    @property
    def encoder_moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in self.moe_layer_ids if i < self.encoder_layers)

    @property
    def draft_layer_ids(self) -> tuple[int, ...]:
        """The MoE blocks token-by-token decoding runs (a draft's blocks): the decoder's."""
        return tuple(i for i in self.moe_layer_ids if i >= self.encoder_layers)

    def stack_of(self, layer: int) -> str:
        return "encoder" if layer < self.encoder_layers else "decoder"

    @property
    def expert_params(self) -> int:
        """Elements of one routed expert's buffer (its matrices, and biases where it has them)."""
        return self.expert.numel

    def expert_bytes(self, elem_bytes: int) -> int:
        """Bytes of one routed expert as the tiers hold and move it: its quantized blob, or
        its elements in the compute dtype (`elem_bytes` each)."""
        return self.expert_quant.nbytes if self.expert_quant else self.expert.numel * elem_bytes

    @property
    def kv_elements_per_token(self) -> int:
        """What the KV cache stores per token, all layers (MLA: the compressed latent); an
        encoder-decoder model caches its decoder layers only."""
        return len(self.decoder_layer_ids) * self.attention.kv_elements_per_token

    def kv_elements_per_sequence(self, max_len: int, rollback: int) -> int:
        """KV cache elements one sequence of `max_len` positions needs, windowed layers
        holding only their window (plus `rollback` draft positions)."""
        per_layer = self.attention.kv_elements_per_token
        own = sum(per_layer * cache_positions(self.windows[i], max_len, rollback) for i in self.decoder_layer_ids)
        # an encoder-decoder model also keeps each decoder layer's cross-attention K/V of a
        # source of up to max_len tokens, computed once at admission
        return own + (len(self.decoder_layer_ids) * per_layer * max_len if self.seq2seq else 0)

    # --- reading config.json ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict, generation: dict | None = None, where: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in FAMILIES), None)
        if arch is None:
            named = ", ".join(archs) or f"model_type={cfg.get('model_type')!r}"
            raise SpecMoEError(f"{where}: architecture {named} is not supported; supported: {', '.join(FAMILIES)}")
        family = FAMILIES[arch]
        outer, cfg = cfg, (cfg.get(family.nested_config) or {}) if family.nested_config else cfg
        if family.nested_config and not cfg:
            raise SpecMoEError(f"{where}: {arch} needs its text model's config under {family.nested_config!r}")
        if family.encoder_decoder:
            cfg = fam.encoder_decoder_keys(cfg, where, arch)

        def need(key):
            return fam.need(cfg, key, where, arch)

        num_layers, hidden = int(need("num_hidden_layers")), int(need("hidden_size"))
        # transformers 5 writes some families' expert count under another name
        experts_key = next((k for k in family.experts_keys if cfg.get(k) is not None), family.experts_keys[0])
        num_experts, top_k = int(need(experts_key)), int(need("num_experts_per_tok"))
        inter = int(need(family.expert_intermediate_key))
        attention, rope = fam.attention_spec(family, cfg, where, arch)
        generation = generation or {}
        expert = fam.expert_spec(family, cfg, hidden, inter)
        torch_dtype = str(outer.get("torch_dtype") or outer.get("dtype") or cfg.get("torch_dtype")
                          or cfg.get("dtype") or "float32")
        eos = generation.get("eos_token_id", cfg.get("eos_token_id", outer.get("eos_token_id")))
        return cls(
            architecture=arch, vocab_size=int(need("vocab_size")), hidden_size=hidden, num_layers=num_layers,
            num_experts=num_experts, expert_intermediate_size=inter,
            dense_intermediate_size=int(cfg.get(family.dense_intermediate_key) or 0),
            shared_expert_intermediate_size=fam.shared_intermediate(family, cfg, inter),
            moe_layers=fam.moe_layers(family, cfg, num_layers, num_experts),
            attention=attention, rope=rope,
            router=fam.router_spec(family, cfg, top_k, num_experts, where),
            expert=expert,
            windows=fam.layer_windows(family, cfg, num_layers, where),
            rope_layers=fam.rope_layers(family, cfg, num_layers),
            rms_norm_eps=float(cfg.get("rms_norm_eps", family.norm_eps)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", outer.get("tie_word_embeddings", False))),
            bos_token_id=generation.get("bos_token_id", cfg.get("bos_token_id", outer.get("bos_token_id"))),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            torch_dtype=torch_dtype,
            weight_block_size=tuple((outer.get("quantization_config") or {}).get("weight_block_size") or (128, 128)),
            expert_quant=expert_quant(outer, expert, torch_dtype, where),
            seq2seq=fam.seq2seq_spec(cfg) if family.encoder_decoder else None,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise SpecMoEError(f"{model_dir}: no config.json; --model must be a Hugging Face model directory")
        cfg = read_json(path)
        gen_path = Path(model_dir) / "generation_config.json"
        generation = read_json(gen_path) if gen_path.is_file() else None
        return cls.from_dict(cfg, generation, where=str(path))


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecMoEError(f"{path}: not valid JSON ({exc}); restore the file from the checkpoint") from None
