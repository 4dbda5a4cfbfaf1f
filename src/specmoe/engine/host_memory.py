"""`--memory-limit`: the device budget of a CPU run, derived from the whole process's memory.

The process holds, besides the engine's ledger (weights, KV cache, draft copies, pool):
what it held before any weight was loaded (measured: the interpreter, torch, the tokenizer),
the activations of its largest pass (estimated from shapes here, times a measured margin),
the offload tier's host buffers, and the allocator's slack (base/memory.py: LimitPlan).
The engine and `specmoe info` plan with the same function, so they agree byte for byte
given the same measured fixed cost.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..base.config import MAX_GAMMA, EngineConfig, memory_limit_bytes
from ..base.errors import SpecMoEError, warn
from ..base.memory import SCRATCH_MARGIN, LimitPlan, release_free_memory, resident_bytes
from ..base.model_config import ModelConfig
from ..base.units import format_bytes, format_size_at_least
from ..experts.expert_file import ALIGN
from ..experts.quant import draft_modes, saves_bytes
from ..experts.store import DISK_READ_DEPTH

SPECULATIVE = ("specmoe", "auto")
# The most of a limit one pass's activations may take. Past a few hundred rows a pass gains
# little (verification at B x (gamma + 1) rows is compute-bound by then, and a prefill in
# chunks costs only the chunks' expert reads), while every 0.13 GiB of activations is four
# experts the pool does not hold. Within it: the rows of `max_pass_rows`.
ACTIVATION_SHARE = 0.10


def measure_fixed(device) -> int:
    """What this process holds now, before any weight is loaded (the interpreter, torch, the
    tokenizer, the libraries they map): its resident set, once freed memory is handed back."""
    if device.type != "cpu":
        raise SpecMoEError("--memory-limit bounds a CPU-only run's whole process; on cuda give the GPU's "
                           "budget with --device-memory")
    release_free_memory()  # what opening the checkpoint freed is not a fixed cost
    fixed = resident_bytes()
    if fixed is None:
        raise SpecMoEError("--memory-limit needs /proc/self/status (Linux) to measure this process; "
                           "use --device-memory instead")
    return fixed


def max_pass_rows(limit: int, config: ModelConfig, options: EngineConfig, max_model_len: int, elem: int) -> int:
    """The most rows (tokens) one pass computes under `limit`: its activations within
    ACTIVATION_SHARE of the limit, but never fewer than a whole context (a prompt is
    prefilled in one pass) nor a plain decode step of every sequence."""
    per_row = row_bytes(config, elem) * SCRATCH_MARGIN + config.vocab_size * 4 * 2
    return max(max_model_len, options.max_batch_size, int(ACTIVATION_SHARE * limit / per_row))


def gamma_cap(max_rows: int | None, batch: int) -> int:
    """The largest gamma whose verification (batch x (gamma + 1) rows) fits `max_rows`."""
    return MAX_GAMMA if max_rows is None else max(0, min(MAX_GAMMA, max_rows // batch - 1))


def step_rows(options: EngineConfig, max_model_len: int, prefill_tokens: int,
              max_rows: int | None = None) -> tuple[int, int]:
    """(rows of the largest pass, rows of it that produce logits). Verification runs
    B x (gamma + 1) rows, all with logits; the gamma tuner may go up to MAX_GAMMA, or what
    `max_rows` allows. A prefill runs up to `prefill_tokens` rows (its chunk, at most
    `max_rows`; a longer prompt alone), with logits for each sequence's last only (prompt
    log-probabilities, which take every prompt row's, are not counted)."""
    batch = options.max_batch_size
    gamma = 0
    if options.policy in SPECULATIVE:
        gamma = max(options.gamma, MAX_GAMMA) if options.adapt_gamma or options.policy == "auto" else options.gamma
        gamma = min(gamma, gamma_cap(max_rows, batch))
    verify = batch * (gamma + 1)
    chunk = prefill_tokens if max_rows is None else min(prefill_tokens, max_rows)
    prefill = min(batch * max_model_len, max(chunk, max_model_len))
    return max(verify, prefill), max(verify, batch)


def row_bytes(config: ModelConfig, elem: int) -> int:
    """Activation bytes one row (token) of a pass holds at once at its widest: the residual
    stream and its norms, q/k/v, a MoE block's top-k gathered inputs and their gate, up and
    product, the shared expert's and a dense MLP's."""
    a, d = config.attention, config.hidden_size
    attention = a.num_heads * (a.head_dim + a.v_head_dim) + a.num_kv_heads * (a.head_dim + a.v_head_dim)
    moe = config.top_k * (d + 3 * config.expert_intermediate_size)
    mlps = 3 * (config.shared_expert_intermediate_size + config.dense_intermediate_size)
    return elem * (8 * d + attention + moe + mlps)


def step_scratch_bytes(config: ModelConfig, options: EngineConfig, max_model_len: int, elem: int,
                       prefill_tokens: int, max_rows: int | None = None) -> int:
    """The largest pass's activations, with the measured margin (base/memory.py): its rows'
    widths, and float32 logits over the vocabulary for its rows with logits, twice (the
    sampler's probabilities)."""
    rows, logit_rows = step_rows(options, max_model_len, prefill_tokens, max_rows)
    need = rows * row_bytes(config, elem) + logit_rows * config.vocab_size * 4 * 2
    return math.ceil(need * SCRATCH_MARGIN)


def tier_host_bytes(options: EngineConfig, stored_bytes: int, converts: bool, num_experts: int) -> int:
    """Host memory the offload tier keeps outside the ledger, planned before the store
    exists (check_tier compares the store's own count): disk, per reader thread, an aligned
    bounce buffer and, where a slot holds another layout, a buffer in the stored one (the
    transfer converts through it). Host: on the CPU every expert lives in this process."""
    if options.offload == "host":
        return stored_bytes * num_experts
    return DISK_READ_DEPTH * (-(-stored_bytes // ALIGN) * ALIGN + (stored_bytes if converts else 0))


def check_tier(plan: LimitPlan, store) -> None:
    """Warn where the store holds more host scratch than the plan set aside for it."""
    held = store.host_scratch_bytes() if store.tier == "disk" else 0
    if held > plan.tier:
        warn(f"--memory-limit: the disk tier holds {format_bytes(held)} of read buffers, "
             f"{format_bytes(plan.tier)} were planned; the run may pass its limit by the difference")


def plan_limit(options: EngineConfig, config: ModelConfig, *, fixed: int, elem: int, max_model_len: int,
               prefill_tokens: int, stored_bytes: int, converts: bool) -> LimitPlan:
    """The device budget `options.memory_limit` leaves, `fixed` being what the process held
    before loading any weight."""
    experts = len(config.moe_layer_ids) * config.num_experts
    limit = memory_limit_bytes(options.memory_limit)
    rows = max_pass_rows(limit, config, options, max_model_len, elem)
    return LimitPlan(
        limit=limit, fixed=fixed,
        scratch=step_scratch_bytes(config, options, max_model_len, elem, prefill_tokens, rows),
        tier=tier_host_bytes(options, stored_bytes, converts, experts), max_rows=rows,
    )


def limited_draft(options: EngineConfig, config: ModelConfig) -> EngineConfig:
    """Under --memory-limit, `--draft-quant auto` drafts with full experts (the paper's
    draft) where no copy would hold fewer bytes than the experts (Q4_K, Q4_0, MXFP4, w4a16):
    copies are built in float32 a block at a time on a first run, beyond what the limit
    bounds (on the 4 GB Q4_K_M file, 1.6 GB limit: OOM-killed), and would save no room."""
    if options.memory_limit is None or options.draft_quant != "auto":
        return options
    if any(saves_bytes(config.expert_quant, mode) for mode in draft_modes(config.expert_quant)):
        return options
    return replace(options, draft_quant="none")


def check_limit(plan: LimitPlan, minimum: int) -> None:
    """A limit whose budget is below what the configuration needs is refused, naming the
    smallest limit that works."""
    if plan.budget < minimum:
        raise SpecMoEError(
            f"--memory-limit {format_bytes(plan.limit)} is too small: this process already holds "
            f"{format_bytes(plan.fixed)}, a step's activations and the tier's buffers need "
            f"{format_bytes(plan.scratch + plan.tier)}, and weights, KV cache and the fewest experts "
            f"{format_bytes(minimum)}; raise it to at least {format_size_at_least(plan.limit_for(minimum))}"
        )
