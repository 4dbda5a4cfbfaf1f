"""Configuration as small frozen dataclasses.

`ModelConfig` is what to compute, read from a Hugging Face `config.json` (model_config.py;
the family table that says how each supported architecture differs is families.py).
`EngineConfig` is how to run it, with every option checked in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SpecMoEError
from .families import FAMILIES, Family
from .memory import total_ram_bytes
from .model_config import ModelConfig
from .units import parse_rate, parse_size

__all__ = ["FAMILIES", "Family", "ModelConfig", "EngineConfig", "expert_share"]


# --- the engine ----------------------------------------------------------------------------

DEVICES = ("auto", "cpu", "cuda")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")
OFFLOAD_TIERS = ("disk", "host")
POLICY_NAMES = ("resident", "ondemand", "overlap", "caching", "host", "specmoe", "auto")
DRAFT_SETS = ("temporal-hot", "global-hot", "random")
SUBSTITUTIONS = ("affinity", "random")
DRAFT_COMPUTE = ("device", "host")
DRAFT_QUANT = ("auto", "none", "int8", "int4", "int3", "int2")
DRAFT_DENSE = ("auto", "bfloat16", "none")
# The longest draft the gamma tuner and the planner's search try, and the provisional KV
# positions every sequence reserves for a step's rollback. Long drafts pay when verification
# is transfer-bound (it then costs about the same at any gamma) and the draft agrees with
# the model: on the real-size model at B = 16 (training prompts) 32 drafted tokens beat 10, 16
# and 24; at B = 64 16 beat 32; `benchmarks/run_all.py --only gamma-real-size` measures it.
MAX_GAMMA = 32


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
    # the whole process's memory on a CPU-only machine (--memory-limit): the device budget is what
    # is left after what the process measurably holds before loading weights, a step's
    # activations, the tier's buffers and the allocator's slack (engine/host_memory.py); "50%":
    # that share of this machine's memory. Instead of device_memory, not beside it.
    memory_limit: int | str | None = None
    offload_bandwidth: float | None = None  # bytes/s cap on the slow tier (an emulation)
    offload_dir: str | None = None  # where the disk tier keeps its expert file
    max_batch_size: int = 32
    max_model_len: int | None = None  # KV positions per sequence; None: the model's, capped at 2048
    # chosen on the real-size model's training prompts (BENCHMARKS.md, "Choosing gamma and the draft's
    # dense precision at real size"): at B = 64, the batches SpecMoE is for, 16 was 1.10x 32's tokens/s;
    # at B = 1 and 16, 32 was 1.24x and 1.27x 16's (--gamma 32, or --policy auto, which tunes it)
    gamma: int = 16
    # gamma above is the first step's; each next one is chosen from the acceptance and pass times
    # measured so far (engine/gamma.py), down to 0, plain decoding, where drafts do not pay.
    # False: every step drafts gamma tokens (what asking for a gamma means: `--gamma N`,
    # LLM(gamma=N); from_kwargs sets it)
    adapt_gamma: bool = True
    draft_experts: int | None = None  # None: chosen from the budget
    draft_set: str = "temporal-hot"
    substitution: str = "affinity"
    draft_compute: str = "device"
    # auto: each expert's way chosen under a draft memory (planned by default under a budget:
    # plans_draft_split), else int8, else int4 copies of every expert where they fit; none: the paper's draft
    draft_quant: str = "auto"
    # the draft's attention projections and LM head in bfloat16 (kept so, where the checkpoint has them so);
    # none: in the compute dtype; auto: where a probe finds this CPU multiplies bfloat16 faster
    # (engine.draft_dense_dtype). none is the default: on the real-size model (training prompts,
    # B = 16) the probe's bfloat16 made the whole draft slower and lowered its acceptance:
    # BENCHMARKS.md, "Choosing gamma and the draft's dense precision at real size"
    draft_dense: str = "none"
    # device bytes the draft may hold (its quantized copies and full-precision draft experts),
    # chosen expert by expert (policies/specmoe/allocation.py); "20%": a share of the device
    # budget; auto: the split with verification's pool predicted fastest (autotune/draft_split.py);
    # None: auto under a device budget when nothing else fixes the draft (plans_draft_split),
    # else the --draft-quant rule above (copies of every expert, or the paper's draft)
    draft_memory: int | str | None = None
    cache_fraction: float = 0.1
    trace: str | None = None
    threads: int | None = None  # CPU compute threads; None: the cores this process may use (kernels/cpu.py)

    def __post_init__(self):
        for name, allowed in (("device", DEVICES), ("dtype", COMPUTE_DTYPES), ("offload", OFFLOAD_TIERS),
                              ("policy", POLICY_NAMES), ("draft_set", DRAFT_SETS), ("substitution", SUBSTITUTIONS),
                              ("draft_compute", DRAFT_COMPUTE), ("draft_quant", DRAFT_QUANT),
                              ("draft_dense", DRAFT_DENSE)):
            _choice(name, getattr(self, name), allowed)
        if self.device_memory is not None and expert_share(self.device_memory) is None:
            object.__setattr__(self, "device_memory", parse_size(self.device_memory, "device_memory"))
        if self.memory_limit is not None and ram_share(self.memory_limit) is None:
            object.__setattr__(self, "memory_limit", parse_size(self.memory_limit, "memory_limit"))
        if self.draft_memory not in (None, "auto") and budget_share(self.draft_memory, "draft_memory") is None:
            object.__setattr__(self, "draft_memory", parse_size(self.draft_memory, "draft_memory"))
        if self.offload_bandwidth is not None:
            object.__setattr__(self, "offload_bandwidth", parse_rate(self.offload_bandwidth))
        if not isinstance(self.adapt_gamma, bool):
            raise SpecMoEError(f"adapt_gamma must be True or False, got {self.adapt_gamma!r}")
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

    def plans_draft_split(self, budgeted: bool) -> bool:
        """Whether the draft's share of the device budget is planned when the engine starts
        (autotune/draft_split.py): asked for (`--draft-memory auto`), or SpecMoE under a
        budget (`budgeted`: one the --draft-quant rule runs in, so that a budget too small
        for both is refused naming the rule's minimum) with nothing that fixes its draft (no
        --draft-memory, --draft-quant or --draft-experts): the planner is the default, as it
        is for `--policy auto`."""
        if self.draft_memory == "auto":
            return True
        return (budgeted and self.policy == "specmoe" and self.draft_memory is None and self.draft_quant == "auto"
                and self.draft_experts is None and self.draft_compute == "device")

    def _check_combinations(self) -> None:
        if self.memory_limit is not None and self.device_memory is not None:
            raise SpecMoEError("--memory-limit (the whole process) and --device-memory (the engine's ledger) "
                               "both set: keep one, --memory-limit where you know the machine's memory")
        if self.memory_limit is not None and self.device == "cuda":
            raise SpecMoEError("--memory-limit bounds a CPU-only run's whole process; on cuda give the GPU's "
                               "budget with --device-memory")
        if self.policy == "host" and self.offload != "host":
            raise SpecMoEError("policy host computes experts where they live and needs --offload host (not disk)")
        if self.draft_compute == "host" and self.offload != "host":
            raise SpecMoEError("--draft-compute host computes draft experts where they live and needs --offload host")
        if self.draft_memory is not None and self.policy not in ("specmoe", "auto"):
            raise SpecMoEError(f"--draft-memory sizes SpecMoE's draft; policy {self.policy} has none: drop it "
                               "or use --policy specmoe")
        if self.draft_memory is not None and self.draft_compute == "host":
            raise SpecMoEError("--draft-memory sizes what the draft holds on the device; --draft-compute host "
                               "holds nothing there: drop one of them")
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
        if "gamma" in kwargs and "adapt_gamma" not in kwargs:
            kwargs["adapt_gamma"] = False  # a gamma asked for is every step's, as `--gamma N` on the command line
        return cls(**kwargs)


def expert_share(device_memory) -> float | None:
    """'30%' -> 0.3 (a budget relative to the model's expert bytes); None for absolute sizes."""
    return _share(device_memory, f"device_memory {device_memory!r}: a share of the expert bytes must be 0%..100%")


def ram_share(memory_limit) -> float | None:
    """'50%' -> 0.5 (a share of this machine's memory); None for absolute sizes."""
    return _share(memory_limit, f"memory_limit {memory_limit!r}: a share of this machine's memory must be "
                  "above 0% and at most 100%", zero=False)


def memory_limit_bytes(memory_limit) -> int:
    """--memory-limit in bytes: a size, or a share of this machine's memory (MemTotal)."""
    share = ram_share(memory_limit)
    if share is None:
        return parse_size(memory_limit, "--memory-limit")
    total = total_ram_bytes()
    if total is None:
        raise SpecMoEError(f"--memory-limit {memory_limit}: this system does not say how much memory it has "
                           "(no /proc/meminfo); give a size, e.g. 16GiB")
    return int(share * total)


def budget_share(value, name: str) -> float | None:
    """'20%' -> 0.2 (a share of the device budget); None for absolute sizes."""
    return _share(value, f"{name} {value!r}: a share of the device budget must be above 0% and at most 100%",
                  zero=False)


def _share(value, error: str, zero: bool = True) -> float | None:
    """A 'N%' string as a fraction (an error outside 0..1, or at 0 unless `zero`); None for anything else."""
    if not (isinstance(value, str) and value.strip().endswith("%")):
        return None
    try:
        share = float(value.strip()[:-1]) / 100
    except ValueError:
        share = -1.0
    if not (0 <= share <= 1 and (zero or share > 0)):
        raise SpecMoEError(error)
    return share


def _choice(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SpecMoEError(f"unknown {name} {value!r}; choose one of: {', '.join(allowed)}")
