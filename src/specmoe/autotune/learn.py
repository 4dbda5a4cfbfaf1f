"""After a run: keep what it measured for the next `--policy auto` plan."""

from __future__ import annotations

from . import history, speeds
from .choose import CANDIDATES
from .draft_split import history_key


def learn_from_run(engine, stats: dict) -> None:
    """Record the draft's per-token acceptance (speculative runs) and the policy's decode
    tokens/s (offloading policies `auto` chooses between), keyed by checkpoint."""
    policy, fingerprint = engine.policy, engine.checkpoint.fingerprint()
    acceptance = stats.get("acceptance_per_token")
    if policy.speculative and acceptance is not None:
        key = history.draft_key(policy.draft_quant, policy.draft_experts)
        if getattr(policy, "memory", None) is not None:  # --draft-memory: keyed by its bytes and ways
            key = history_key(engine.options.draft_quant, policy.memory.limit, engine.config, policy.pool.slot_bytes)
        history.record(fingerprint, key, acceptance, engine.counters.drafted)
    if policy.name in CANDIDATES + ("host",) and stats["decode_tokens_per_s"] and stats["steps"] >= 4:
        # shorter runs say nothing about speed
        opts = engine.options
        draft = history.draft_key(policy.draft_quant, policy.draft_experts) if policy.speculative else None
        speeds.record(fingerprint, speeds.tier_key(opts.offload, opts.offload_bandwidth),
                      speeds.policy_key(policy.name, draft, opts.gamma if draft else None),
                      stats["batch_size"], stats["decode_tokens_per_s"])
