"""After a run: keep what it measured for the next `--policy auto` plan."""

from __future__ import annotations

from . import history, speeds
from .choose import CANDIDATES
from .draft_split import history_key


def learn_from_run(engine, stats: dict) -> None:
    """Record the draft's per-token acceptance (speculative runs) and the policy's decode
    tokens/s (offloading policies `auto` chooses between), keyed by checkpoint."""
    policy, fingerprint = engine.policy, engine.checkpoint.fingerprint()
    draft = _draft_key(engine) if policy.speculative else None
    acceptance = stats.get("acceptance_per_token")
    if draft is not None and acceptance is not None:
        history.record(fingerprint, draft, acceptance, engine.counters.drafted)
    opts = engine.options
    if policy.name in CANDIDATES + ("host",) and stats["decode_tokens_per_s"] and stats["steps"] >= 4:
        # shorter runs say nothing about speed; a run whose gamma the tuner moved is kept
        # under its own γ key, not its first gamma's
        gamma = (speeds.ADAPTED if opts.adapt_gamma else opts.gamma) if draft else None
        speeds.record(fingerprint, speeds.tier_of(opts), speeds.policy_key(policy.name, draft, gamma),
                      stats["batch_size"], stats["decode_tokens_per_s"])


def _draft_key(engine) -> str:
    """The draft as history and speeds keep it. Under --draft-memory, keyed by its bytes and
    ways: one format for the experts a small memory holds, the rest substituted, is not that
    format's draft of every expert (recorded under its name, such runs once taught --policy
    auto that int8 copies accept 54 % on the demo model, where they accept 99 %)."""
    policy = engine.policy
    if getattr(policy, "memory", None) is not None:
        return history_key(engine.options.draft_quant, policy.memory.limit, engine.config, policy.pool.slot_bytes)
    return history.draft_key(policy.draft_quant, policy.draft_experts)
