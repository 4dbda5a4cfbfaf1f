"""Configuration as small frozen dataclasses.

`ModelConfig` is what to compute, read from a Hugging Face `config.json`; the family
table says how each supported architecture differs. `EngineConfig` is how to run it, with
every option checked in one place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import SpecMoEError
from .units import parse_rate, parse_size


@dataclass(frozen=True)
class Family:
    """How one Hugging Face architecture differs from the common MoE transformer."""

    name: str
    experts_keys: tuple[str, ...]  # config keys that may hold the number of routed experts
    expert_intermediate_key: str  # config key with the routed experts' intermediate size
    always_renormalize: bool  # Mixtral renormalises top-k weights whatever the config says
    qk_norm: str  # "none" | "head" (RMSNorm over head_dim) | "full" (over all heads' dims)
    has_sparse_step: bool  # decoder_sparse_step / mlp_only_layers decide which layers are MoE


FAMILIES: dict[str, Family] = {
    "MixtralForCausalLM": Family("mixtral", ("num_local_experts",), "intermediate_size", True, "none", False),
    "Qwen2MoeForCausalLM": Family("qwen2_moe", ("num_experts", "num_local_experts"), "moe_intermediate_size", False, "none", True),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", ("num_experts", "num_local_experts"), "moe_intermediate_size", False, "head", True),
    "OlmoeForCausalLM": Family("olmoe", ("num_experts", "num_local_experts"), "intermediate_size", False, "full", False),
}


@dataclass(frozen=True)
class ModelConfig:
    """The shape and semantics of one MoE language model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    dense_intermediate_size: int  # layers that are not MoE use a dense SwiGLU MLP of this size
    shared_expert_intermediate_size: int  # 0: no shared expert
    moe_layers: tuple[bool, ...]
    renormalize_topk: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None = None
    clip_qkv: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise SpecMoEError(
                f"config.json: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}: fix the config"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise SpecMoEError(
                f"config.json: num_experts_per_tok={self.top_k} must be between 1 and the "
                f"number of experts ({self.num_experts})"
            )
        if len(self.moe_layers) != self.num_layers:
            raise SpecMoEError("internal: moe_layers must name every layer")

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, is_moe in enumerate(self.moe_layers) if is_moe)

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def kv_elements_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict, generation: dict | None = None, where: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in FAMILIES), None)
        if arch is None:
            named = ", ".join(archs) or f"model_type={cfg.get('model_type')!r}"
            raise SpecMoEError(
                f"{where}: architecture {named} is not supported; supported: {', '.join(FAMILIES)}"
            )
        family = FAMILIES[arch]

        def need(key):
            if cfg.get(key) is None:
                raise SpecMoEError(f"{where}: missing required key {key!r} for {arch}")
            return cfg[key]

        num_layers = int(need("num_hidden_layers"))
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = cfg.get("head_dim") or hidden // num_heads
        # transformers 5 writes some families' expert count under another name
        experts_key = next((k for k in family.experts_keys if cfg.get(k) is not None), family.experts_keys[0])
        num_experts = int(need(experts_key))
        if family.has_sparse_step:
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            dense_only = set(cfg.get("mlp_only_layers") or [])
            moe_layers = tuple(
                i not in dense_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
            )
        else:
            moe_layers = (True,) * num_layers
        generation = generation or {}
        eos = generation.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = cfg.get("sliding_window")
        if family.name != "mixtral" and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen configs carry a window size that is off unless use_sliding_window
        elif family.name != "mixtral":
            raise SpecMoEError(f"{where}: use_sliding_window=true is not supported for {arch}")
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            num_experts=num_experts,
            top_k=int(need("num_experts_per_tok")),
            expert_intermediate_size=int(need(family.expert_intermediate_key)),
            dense_intermediate_size=int(cfg.get("intermediate_size") or 0),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            moe_layers=moe_layers,
            renormalize_topk=family.always_renormalize or bool(cfg.get("norm_topk_prob", False)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg, where),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=int(sliding) if sliding else None,
            clip_qkv=cfg.get("clip_qkv"),
            bos_token_id=generation.get("bos_token_id", cfg.get("bos_token_id")),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise SpecMoEError(f"{model_dir}: no config.json; --model must be a Hugging Face model directory")
        cfg = _read_json(path)
        gen_path = Path(model_dir) / "generation_config.json"
        generation = _read_json(gen_path) if gen_path.is_file() else None
        return cls.from_dict(cfg, generation, where=str(path))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecMoEError(f"{path}: not valid JSON ({exc}); restore the file from the checkpoint") from None


def _rope_theta(cfg: dict, where: str) -> float:
    """RoPE base from `rope_theta` (transformers < 5) or `rope_parameters` (>= 5)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise SpecMoEError(f"{where}: rope type {rope_type!r} is not supported; only the default RoPE is")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    return float(theta) if theta is not None else 10000.0


# --- the engine ----------------------------------------------------------------------------

DEVICES = ("auto", "cpu", "cuda")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")
OFFLOAD_TIERS = ("disk", "host")
POLICY_NAMES = ("resident", "ondemand", "overlap", "caching", "host", "specmoe", "auto")
DRAFT_SETS = ("temporal-hot", "global-hot", "random")
SUBSTITUTIONS = ("affinity", "random")
DRAFT_COMPUTE = ("device", "host")
DRAFT_QUANT = ("auto", "none", "int8", "int4", "int3")


@dataclass(frozen=True)
class EngineConfig:
    """How to run a model: device, memory budget, policy and its knobs. Every option is
    checked here, once; `check_model` adds the checks that need the model's shape."""

    device: str = "auto"
    dtype: str = "auto"
    policy: str = "resident"
    offload: str = "disk"
    # bytes for weights, KV cache and expert pool; "30%": those weights and KV cache plus
    # 30 % of all expert bytes; None: no limit
    device_memory: int | str | None = None
    offload_bandwidth: float | None = None  # bytes/s cap on the slow tier (an emulation)
    offload_dir: str | None = None  # where the disk tier keeps its expert file
    max_batch_size: int = 32
    max_model_len: int | None = None  # KV positions per sequence; None: the model's, capped at 2048
    gamma: int = 5
    draft_experts: int | None = None  # None: chosen from the budget
    draft_set: str = "temporal-hot"
    substitution: str = "affinity"
    draft_compute: str = "device"
    draft_quant: str = "auto"  # auto: int8, else int4 copies of every expert where they fit; none: the paper's draft
    cache_fraction: float = 0.1
    trace: str | None = None
    threads: int | None = None  # CPU compute threads; None: half the cores (the rest move experts)

    def __post_init__(self):
        for name, allowed in (("device", DEVICES), ("dtype", COMPUTE_DTYPES), ("offload", OFFLOAD_TIERS),
                              ("policy", POLICY_NAMES), ("draft_set", DRAFT_SETS), ("substitution", SUBSTITUTIONS),
                              ("draft_compute", DRAFT_COMPUTE), ("draft_quant", DRAFT_QUANT)):
            _choice(name, getattr(self, name), allowed)
        if self.device_memory is not None and expert_share(self.device_memory) is None:
            object.__setattr__(self, "device_memory", parse_size(self.device_memory, "device_memory"))
        if self.offload_bandwidth is not None:
            object.__setattr__(self, "offload_bandwidth", parse_rate(self.offload_bandwidth))
        for name in ("max_batch_size", "gamma"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecMoEError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise SpecMoEError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise SpecMoEError(f"threads must be a positive integer, got {self.threads!r}")
        smallest = 0 if self.draft_quant != "none" else 1  # quantized copies can draft alone
        if self.draft_experts is not None and (not isinstance(self.draft_experts, int) or self.draft_experts < smallest):
            raise SpecMoEError(f"draft_experts must be an integer >= {smallest}, got {self.draft_experts!r}")
        if not isinstance(self.cache_fraction, (int, float)) or not 0 <= self.cache_fraction <= 1:
            raise SpecMoEError(f"cache_fraction must be between 0 and 1, got {self.cache_fraction!r}")
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.policy == "host" and self.offload != "host":
            raise SpecMoEError("policy host computes experts where they live and needs --offload host (not disk)")
        if self.draft_compute == "host" and self.offload != "host":
            raise SpecMoEError("--draft-compute host computes draft experts where they live and needs --offload host")
        if self.draft_quant not in ("none", "auto") and self.draft_compute == "host":
            raise SpecMoEError(f"--draft-quant {self.draft_quant} already gives the draft every expert on the device; "
                               "drop --draft-compute host or use --draft-quant none")

    def check_model(self, config: ModelConfig) -> None:
        """The checks that need the model."""
        if self.draft_experts and self.draft_experts >= config.num_experts:
            raise SpecMoEError(f"--draft-experts {self.draft_experts} must be below the {config.num_experts} experts "
                               "per block (drafting with all of them is policy resident)")

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = set(cls.__dataclass_fields__)
        for key in kwargs:
            if key not in known:
                raise SpecMoEError(f"unknown engine option {key!r}; known options: {', '.join(sorted(known))}")
        return cls(**kwargs)


def expert_share(device_memory) -> float | None:
    """'30%' -> 0.3 (a budget relative to the model's expert bytes); None for absolute sizes."""
    if isinstance(device_memory, str) and device_memory.strip().endswith("%"):
        try:
            share = float(device_memory.strip()[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 <= share <= 1:
            raise SpecMoEError(f"device_memory {device_memory!r}: a share of the expert bytes must be 0%..100%")
        return share
    return None


def _choice(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SpecMoEError(f"unknown {name} {value!r}; choose one of: {', '.join(allowed)}")
