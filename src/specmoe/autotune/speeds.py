"""How fast each policy really ran on this machine: `--policy auto` corrects the cost
model with it.

A cost model fitted on seconds of probing is off by tens of percent for some policy and
batch size on a shared machine (BENCHMARKS.md, validation); ranking policies whose
predictions are that close needs measurements. Every run of an offloading policy records
its decode tokens/s per (model, tier, policy, batch size) in ``<cache dir>/speeds.json``
(the last RECENT runs). When planning, each policy's prediction is scaled by
measured / predicted at the recorded batch size nearest to the one planned, both taken
now: speeds are kept, not ratios, so a new calibration does not leave stale corrections
behind. Nothing recorded: the model alone (a fresh machine).

A speed belongs to the setup that produced it: the tier with its bandwidth cap (a capped
tier is a slower machine), and for SpecMoE the draft and the γ the run started with (a
γ = 1 run, or the paper's draft at low acceptance, says nothing about an int8 draft at
γ = 5), or `auto` where the tuner chose γ step by step (the default run). Kept together,
they taught `auto` that SpecMoE was slow from experiments that ran it slowly on purpose.
"""

from __future__ import annotations

import math
import statistics

from ..base.paths import read_json, write_json

FILE = "speeds.json"
RECENT = 8


def tier_key(offload: str, bandwidth: float | None = None, dtype: str = "auto") -> str:
    """The tier as speeds are kept: `disk`, or `disk@50000000Bps` when capped, and `disk in
    float32` for a run in another encoding than the default (the reference encoding computes
    a GGUF file several times slower: its speeds are no correction for a default run)."""
    tier = offload if bandwidth is None else f"{offload}@{bandwidth:.0f}Bps"  # no "/": it separates tier and policy
    return tier if dtype == "auto" else f"{tier} in {dtype}"


def tier_of(opts) -> str:
    """tier_key of a run's EngineConfig."""
    return tier_key(opts.offload, opts.offload_bandwidth, opts.dtype)


ADAPTED = "auto"  # the γ of a run whose γ the tuner chose step by step (the default)


def policy_key(policy: str, draft: str | None = None, gamma: int | str | None = None) -> str:
    """The policy as speeds are kept: its name, and for SpecMoE `specmoe:<draft>:<γ>`, γ a
    fixed one or ADAPTED."""
    return f"{policy}:{draft}:{gamma}" if draft is not None else policy


def draft_variants(fingerprint: str, tier: str, policy: str = "specmoe") -> list[tuple[str, int | str]]:
    """The (draft, γ) setups of a speculative policy with speeds recorded on this tier (γ an
    int, or ADAPTED)."""
    out = []
    for key in read_json(FILE, well_formed).get(fingerprint, {}):
        recorded_tier, _, rest = key.partition("/")
        name, _, setup = rest.partition(":")
        draft, _, gamma = setup.rpartition(":")
        if recorded_tier == tier and name == policy and draft and (gamma.isdecimal() or gamma == ADAPTED):
            out.append((draft, int(gamma) if gamma.isdecimal() else gamma))
    return sorted(out, key=str)


def well_formed(data: dict) -> bool:
    """{fingerprint: {"tier/policy": {"batch size": [tokens/s, ...]}}}"""
    return all(isinstance(by_policy, dict) and all(_runs_ok(runs) for runs in by_policy.values())
               for by_policy in data.values())


def _runs_ok(by_batch) -> bool:
    return isinstance(by_batch, dict) and all(
        b.isdecimal() and int(b) > 0 and isinstance(runs, list)
        and all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0 for r in runs)
        for b, runs in by_batch.items())


def record(fingerprint: str, tier: str, policy: str, batch: int, tokens_per_s: float) -> None:
    """Keep a run's decode tokens/s."""
    if not tokens_per_s > 0:
        return
    data = read_json(FILE, well_formed)
    runs = data.setdefault(fingerprint, {}).setdefault(f"{tier}/{policy}", {}).setdefault(str(batch), [])
    runs.append(float(tokens_per_s))
    del runs[:-RECENT]
    write_json(FILE, data)  # a read-only cache dir: plans use the model alone


def measured(fingerprint: str, tier: str, policy: str, batch: int) -> tuple[int, float] | None:
    """(recorded batch size nearest to `batch` in log scale, median tokens/s there), or None."""
    found = measured_runs(fingerprint, tier, policy, batch)
    return None if found is None else (found[0], float(statistics.median(found[1])))


def measured_runs(fingerprint: str, tier: str, policy: str, batch: int) -> tuple[int, list[float]] | None:
    """(recorded batch size nearest to `batch` in log scale, the tokens/s of its recent runs), or None."""
    by_batch = read_json(FILE, well_formed).get(fingerprint, {}).get(f"{tier}/{policy}", {})
    runs = {int(b): r for b, r in by_batch.items() if isinstance(r, list) and r}
    if not runs:
        return None
    nearest = min(runs, key=lambda b: abs(math.log(b) - math.log(batch)))
    return nearest, [float(r) for r in runs[nearest]]
