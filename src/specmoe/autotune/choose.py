"""`--policy auto`: the cost model picks the policy and its parameters (gamma, the kind of
draft) for this model, this machine and this batch; speculation is simply one candidate,
off where it does not pay (the paper notes that plain caching is slightly faster at
batch 1).

`choose(runtime)` is what the API hands the engine to resolve `auto` before any policy
is built. The machine's profile comes from `specmoe calibrate` (name `local`, measured
once and saved on first use when missing); the tier's read rate is capped by
`offload_bandwidth` when that emulation is on. Earlier runs' measured acceptance
(history.py) and tokens/s (speeds.py) correct the model. While decoding, the engine's
GammaTuner adapts gamma to measured tokens/s.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from ..base.errors import SpecMoEError, warn
from ..base.paths import cache_dir, offload_dir
from ..base.progress import OneTime
from ..base.units import format_bytes
from ..costmodel.cost_model import Scenario
from ..costmodel.hardware import load_profile, profiles_dir, save_profile
from ..costmodel.planner import candidates, plan
from ..costmodel.routing import DEFAULT_ACCEPTANCE
from ..costmodel.shapes import as_run, shape_of
from ..experts.quant import auto_modes, draft_copy_bytes, draft_modes, saves_bytes
from ..policies.caching import CachingPolicy
from ..policies.specmoe import WORKING_SLOTS
from ..policies.specmoe.policy import draft_table_bytes
from . import history, speeds
from .calibrate import calibrate, second_tier
from .draft_split import LEAST_VERIFY_SLOTS, choose_split

LOCAL_PROFILE = "local"
# `specmoe calibrate --size 64MiB`, what the planner runs, took 19 s on a busy 2-core AMD EPYC; saved, it runs once
CALIBRATION_ESTIMATE = "about 20 s on 2 CPU cores; saved as profile 'local'"


def machine_profile(tier: str, bandwidth: float | None, offload_dir: str | None = None,
                    device_room: int | None = None):
    """This machine's calibrated profile for experts on `tier` (calibrated once if missing;
    the disk is measured, and the probe's expert file kept, in `offload_dir` when given).
    `device_room`: the device bytes the calibration may take (what the budget has not yet
    reserved); a GPU's measured in less than its usual buffers is used for this run only."""
    profile = _saved_profile(tier)
    if profile is None:
        work = OneTime("calibrating this machine once for the planner: its disk, memory and matmul rates, then the "
                       "engine on the demo model", CALIBRATION_ESTIMATE).begin()
        measured, m = calibrate(LOCAL_PROFILE, Path(offload_dir) if offload_dir else cache_dir() / "calibrate",
                                64 << 20, offload_dir=offload_dir, device_bytes=device_room)
        work.end()
        if m.get("cuda_buffers_capped"):
            warn(f"the calibration measured the GPU within --device-memory ({format_bytes(device_room)} free), "
                 "in smaller buffers than it needs to be exact: used for this run, not saved; "
                 "run `specmoe calibrate` once to save this machine's profile")
            return _bandwidth_limited(measured, bandwidth)
        try:
            save_profile(measured, m)
            save_profile(second_tier(measured, m), m)  # the other tier: a GPU machine's disk, a CPU's host memory
        except OSError as exc:  # a read-only cache dir: plan with it, measure again next time
            warn(f"cannot save the calibrated profile in {profiles_dir()} ({exc.strerror or exc})")
        profile = _saved_profile(tier) or measured
    return _bandwidth_limited(profile, bandwidth)


def _bandwidth_limited(profile, bandwidth: float | None):
    """The profile with its slow tier's read bandwidth capped at --offload-bandwidth."""
    if bandwidth:
        profile = replace(profile, slow_tier_read_bw=min(profile.slow_tier_read_bw, bandwidth))
    return profile


def _saved_profile(tier: str):
    """'local-TIER' where the machine's main profile has the other tier ('local-disk' on a
    GPU machine, 'local-host' on a CPU-only one), else 'local'."""
    for name in (f"{LOCAL_PROFILE}-{tier}", LOCAL_PROFILE):
        try:
            profile = load_profile(name)
        except ValueError as exc:
            path = profiles_dir() / f"{name}.json"
            if path.is_file():  # there, but damaged: measure again
                warn(f"ignoring {path} ({exc}); it will be rebuilt")
            continue
        if profile.slow_tier == tier:
            return profile
    return None


CANDIDATES = ("ondemand", "overlap", "caching", "specmoe")


def _model_inputs(runtime):
    """(shape, plan keyword arguments) for this runtime, as the planner sees it."""
    opts = runtime.options
    # weights in the compute dtype, experts as the tiers keep them; quantized experts keep their blobs' size (shape_of)
    shape = as_run(shape_of(runtime.config, runtime.checkpoint.dir.name), runtime.dtype.itemsize,
                   runtime.expert_format.storage_dtype.itemsize)
    slot = runtime.expert_format.slot_dtype.itemsize
    if not shape.expert_bytes_per_param and slot < runtime.dtype.itemsize:  # a bf16 checkpoint's experts as stored
        shape = replace(shape, expert_bytes_per_param=float(slot))
    memory = runtime.budget.available() if runtime.budget.limit is not None else None
    # mean cached positions: half the length reserved per sequence (sequences grow into
    # it); the KV the model then counts stays inside what the engine reserved
    kwargs = dict(device_memory=_plan_memory(runtime, memory, shape), context_len=max(1, runtime.max_model_len // 2),
                  cache_fraction=opts.cache_fraction, cache_lru_slots=_lru_slots(runtime, memory),
                  **_draft_knowledge(runtime))
    return shape, kwargs


def choose(runtime) -> tuple:
    """(EngineConfig with what was `auto` chosen, a one-line description of the plan) for
    this runtime's model and budget: the policy and its knobs (`--policy auto`), then the
    draft's share of the budget (`--draft-memory auto`; SpecMoE under a budget when no flag
    fixes its draft; `--policy auto` under a budget when it chose SpecMoE: draft_split.py)."""
    opts, described = runtime.options, []
    budgeted = runtime.budget.limit is not None
    plan_split = opts.plans_draft_split(runtime.budget.limits_above_minimum())
    if opts.policy == "auto":
        opts, plan = choose_policy(runtime)
        described.append(plan)
        # under a budget the draft's share of it is planned too, unless it was given
        plan_split = plan_split or (opts.draft_memory is None and budgeted)
    if plan_split:
        if opts.policy == "specmoe":
            opts, split = _split_or_rule(replace(runtime, options=opts), asked=opts.draft_memory == "auto")
            described.append(split)
        else:  # the plan chose a policy without a draft
            opts = replace(opts, draft_memory=None)
    return opts, "; ".join(described)


def _split_or_rule(runtime, asked: bool) -> tuple:
    """choose_draft_memory; where the split was not asked for (the default) and no split
    holds a draft beside verification, the --draft-quant rule instead (the paper's draft
    where no copies fit) rather than an error."""
    try:
        return choose_draft_memory(runtime)
    except SpecMoEError:
        if asked:
            raise
        return replace(runtime.options, draft_memory=None), \
            f"no draft fits beside {LEAST_VERIFY_SLOTS} verification slots: --draft-quant's rule"


def choose_draft_memory(runtime) -> tuple:
    """(EngineConfig with --draft-memory and --draft-quant chosen, its description)."""
    opts = runtime.options
    if runtime.budget.limit is None:  # before a calibration that would be for nothing
        raise SpecMoEError("--draft-memory auto splits a device budget between the draft and verification: "
                           "give --device-memory too, or --draft-memory as a size")
    # what the budget leaves for experts: less the scratch quantized experts dequantize into and
    # the draft's routing tables (both reserved before the pool)
    tables = draft_table_bytes(runtime.config, opts, runtime.device, False, whole_run=True)
    room = runtime.budget.available() - runtime.expert_format.scratch_bytes(runtime.dtype) - tables
    hardware = machine_profile(opts.offload, opts.offload_bandwidth, opts.offload_dir, runtime.budget.available())
    shape, kwargs = _model_inputs(runtime)
    sc = Scenario(shape, hardware, context_len=kwargs["context_len"], device_memory=kwargs["device_memory"])
    fused = _fused_modes(runtime)
    cache = Path(opts.offload_dir) if opts.offload_dir else offload_dir()
    best, _ = choose_split(runtime.checkpoint, runtime.expert_format, sc, runtime.budget.limit, room,
                           runtime.slot_bytes, runtime.device, runtime.dtype, cache, opts.max_batch_size, opts.gamma,
                           history.measured(runtime.checkpoint.fingerprint()), fused, _split_speeds(runtime),
                           runtime.computes_as_stored, opts.adapt_gamma)
    return replace(opts, draft_memory=best.draft_memory, draft_quant=best.draft_quant), best.describe(room)


def _split_speeds(runtime) -> dict[str, list[float]]:
    """Decode tokens/s that runs of each split (draft memory and ways) measured on this tier
    at this batch size and gamma (fixed, or tuned step by step as this run's will be): key
    (draft_split.history_key) -> the recent runs' tokens/s."""
    opts, fingerprint = runtime.options, runtime.checkpoint.fingerprint()
    tier = speeds.tier_of(opts)
    gamma_here = speeds.ADAPTED if opts.adapt_gamma else opts.gamma
    out = {}
    for draft, gamma in speeds.draft_variants(fingerprint, tier):
        if not draft.startswith("memory@") or gamma != gamma_here:
            continue
        seen = speeds.measured_runs(fingerprint, tier, speeds.policy_key("specmoe", draft, gamma), opts.max_batch_size)
        if seen is not None and seen[0] == opts.max_batch_size:  # another batch size's step is another step
            out[draft] = seen[1]
    return out


def _fused_modes(runtime) -> tuple[str, ...]:
    """The copy formats this device multiplies with a fused kernel (no dequantized scratch)
    whose copies hold fewer bytes than the experts: a draft of copies as big as the
    experts (int4 copies of a Q4_K file's) is no split of its own, only a worse use of the
    room that pinning the experts themselves would make (those spare verification its
    fetches too). On the real-size Q4_K_M file, disk tier, B = 16, the planner's int4-only
    splits ran 0.89x and 0.99x ondemand at 30 % and 1.27x at 50 %, where its mixes of full
    experts and copies (`auto`) ran 1.30x and 1.64x."""
    c = runtime.config
    return tuple(mode for mode in auto_modes(c.expert_quant) if saves_bytes(c.expert_quant, mode)
                 and not draft_copy_bytes(c.expert, mode, runtime.device, runtime.dtype, runtime.computes_as_stored)[1])


def choose_policy(runtime) -> tuple:
    """(EngineConfig with the chosen policy and its knobs, a one-line description of the
    plan) for this runtime's model and budget."""
    opts = runtime.options
    hardware = machine_profile(opts.offload, opts.offload_bandwidth, opts.offload_dir, runtime.budget.available())
    policies = CANDIDATES + (("host",) if opts.offload == "host" else ())
    shape, kwargs = _model_inputs(runtime)
    corrections = _corrections(runtime, shape, hardware, kwargs, policies)
    try:
        chosen = plan(shape, hardware, opts.max_batch_size, policies=policies, corrections=corrections, **kwargs)
    except ValueError as exc:
        raise SpecMoEError(f"policy auto: {exc}") from None
    overrides = {"policy": chosen.policy}
    if chosen.policy == "specmoe":
        # gamma (then tuned online) and the kind of draft from the plan; how many
        # full-precision draft experts fit beside it is specmoe's own choice from the budget
        overrides.update(gamma=chosen.gamma, draft_quant=chosen.draft_quant or "auto")
    return replace(opts, **overrides), chosen.describe()


def _corrections(runtime, shape, hardware, kwargs, policies) -> dict[str, float]:
    """Per policy: tokens/s measured here (speeds.py) at the recorded batch size
    nearest to the planned one, over what the model predicts there now for the same
    setup (SpecMoE: each recorded draft and γ against its own estimate, the median)."""
    opts = runtime.options
    sc = Scenario(shape, hardware, context_len=kwargs["context_len"], device_memory=kwargs["device_memory"])
    acceptance = kwargs.get("acceptance") or DEFAULT_ACCEPTANCE
    fingerprint, tier = runtime.checkpoint.fingerprint(), speeds.tier_of(opts)

    def ratio(policy: str, key: str, same_setup) -> float | None:
        seen = speeds.measured(fingerprint, tier, key, opts.max_batch_size)
        if seen is None:
            return None
        batch, speed = seen
        plans = candidates(sc, batch, acceptance, kwargs.get("acceptance_draft_experts", 4), kwargs["cache_fraction"],
                           (policy,), kwargs["quant_acceptance"], kwargs["draft_quants"], kwargs["cache_lru_slots"])
        predicted = max((c.estimate.decode_tokens_per_s for c in plans if same_setup(c)), default=0.0)
        return speed / predicted if predicted > 0 else None

    out = {}
    for policy in policies:
        if policy == "specmoe":  # each recorded (draft, γ) against the model's estimate of that setup
            ratios = [ratio(policy, speeds.policy_key(policy, draft, gamma), lambda c, d=draft, g=gamma:
                            c.gamma == g and history.draft_key(c.draft_quant or "none", c.draft_experts) == d)
                      for draft, gamma in speeds.draft_variants(fingerprint, tier, policy)]
            ratios = [r for r in ratios if r is not None]
            found = statistics.median(ratios) if ratios else None
        else:
            found = ratio(policy, policy, lambda c: True)
        if found is not None:
            out[policy] = found
    return out


def _draft_knowledge(runtime) -> dict:
    """What the planner may assume about each draft: quantized drafts with their
    measured acceptance (else the priors); the paper's draft only once a run has
    measured it on this model (its acceptance ranges from 10 % to 90 % across models)."""
    seen = history.measured(runtime.checkpoint.fingerprint())
    quant = {k: v for k, v in seen.items() if not k.startswith("none@")}
    paper = sorted((int(k.split("@")[1]), v) for k, v in seen.items() if k.startswith("none@"))
    mode = _quantized_draft(runtime)
    quantized = (mode,) if mode else ()
    if not paper:
        return {"quant_acceptance": quant, "draft_quants": quantized}
    n, a = paper[-1]
    return {"quant_acceptance": quant, "draft_quants": quantized + ("none",), "acceptance": a,
            "acceptance_draft_experts": n}


def _quantized_draft(runtime) -> str | None:
    """The quantized draft specmoe's `--draft-quant auto` would take in this budget (the
    most precise that fits beside two working slots), or None. The planner plans that
    one rather than choosing between bit widths itself: which dequantizes faster is a
    kernel detail the cost model does not know."""
    c, budget = runtime.config, runtime.budget
    free = budget.available() if budget.limit is not None else None
    for mode in draft_modes(c.expert_quant):
        copy, scratch = draft_copy_bytes(c.expert, mode, runtime.device, runtime.dtype, runtime.computes_as_stored)
        need = copy * len(c.draft_layer_ids) * c.num_experts + scratch  # the decoder's experts
        if free is None or free >= need + WORKING_SLOTS * runtime.slot_bytes:
            return mode
    return None


def _plan_memory(runtime, available, shape):
    """The planner budgets whole-model bytes: give it what the engine's ledger would allow,
    the non-expert weights counted as the planner counts them (in the compute dtype; the
    engine may hold a bfloat16 checkpoint's as stored, in half that), so that the room it
    leaves the experts is the engine's."""
    if available is None:
        return None
    held = runtime.budget.by_item.get("non-expert weights", 0)
    return int(available + runtime.budget.used - held + shape.non_expert_bytes)


def _lru_slots(runtime, available) -> int:
    """Pool slots the caching policy would run as an LRU beside its pinned hot set."""
    total = len(runtime.expert_keys)
    slots = total if available is None else min(total, available // runtime.slot_bytes)
    hot = CachingPolicy.hot_per_block(runtime.config, runtime.options.cache_fraction) * len(runtime.config.moe_layer_ids)
    return max(0, slots - hot)
