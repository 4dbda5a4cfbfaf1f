"""Run statistics: counters kept during a run, one dict at its end."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, fields

from ..base.memory import peak_rss_bytes


def per_token_acceptance(accepted: int, rejected: int) -> float | None:
    """Maximum-likelihood per-token acceptance from speculative steps: each accepted
    draft is a success, each step that stopped before its last draft one failure."""
    return accepted / (accepted + rejected) if accepted + rejected else None


def token_ids_sha256(outputs: list[list[int]]) -> str:
    """SHA-256 of the generated token ids, request by request, in order."""
    return hashlib.sha256(json.dumps(outputs, separators=(",", ":")).encode()).hexdigest()


@dataclass
class RunCounters:
    prefill_s: float = 0.0
    prefill_transfer_bytes: int = 0  # expert bytes moved during prefills (a draft set's first load included)
    decode_s: float = 0.0
    steps: int = 0  # decode steps (a speculative step = draft + verify)
    seq_steps: int = 0  # sum over decode steps of the sequences in them
    decode_tokens: int = 0  # tokens produced by decode steps
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    rejected: int = 0  # sequence-steps that rejected a draft token (stopped before the last)
    agreed: int = 0  # draft tokens equal to the target's argmax at their position (greedy)
    draft_s: float = 0.0
    verify_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def add_step(self, seconds: float, num_seqs: int, new_tokens: int) -> None:
        self.decode_s += seconds
        self.steps += 1
        self.seq_steps += num_seqs
        self.decode_tokens += new_tokens

    @classmethod
    def total(cls, runs: list[RunCounters]) -> RunCounters:
        """The counters of several runs added up (`extra` is per run and left out)."""
        names = [f.name for f in fields(cls) if f.name != "extra"]
        return cls(**{name: sum(getattr(run, name) for run in runs) for name in names})


def rates(counters: RunCounters, *, requests: int, generated: int, wall_s: float, transfer: int) -> dict:
    """The ratios of a run, from its counts: one engine's run, or several added up."""
    c = counters
    return {
        "decode_tokens_per_s": c.decode_tokens / c.decode_s if c.decode_s else 0.0,
        "tokens_per_step": c.decode_tokens / c.seq_steps if c.seq_steps else 0.0,
        "acceptance_rate": c.accepted / c.drafted if c.drafted else None,
        "acceptance_per_token": per_token_acceptance(c.accepted, c.rejected) if c.drafted else None,
        "draft_target_agreement": c.agreed / c.drafted if c.drafted else None,
        "transfer_bytes_per_token": transfer / generated if generated else 0.0,
        # decode steps' own: what bounds decoding speed on a tier read at a given rate
        "decode_transfer_bytes_per_token": (transfer - c.prefill_transfer_bytes) / c.decode_tokens
        if c.decode_tokens else 0.0,
        # evaluation runs score prompts (max_tokens=0): requests are their unit of work
        "requests_per_s": requests / wall_s if wall_s else 0.0,
        "transfer_bytes_per_request": transfer / requests if requests else 0.0,
    }


def summarize(
    *, policy: str, batch_size: int, gamma: int | None, draft_experts: int | None, seqs, counters: RunCounters,
    wall_s: float, policy_stats: dict, device_peak_bytes: int, device_memory: int | None = None,
) -> dict:
    prompt_tokens = sum(len(s.prompt_ids) for s in seqs)
    generated = sum(len(s.output_ids) for s in seqs)
    ttfts = [s.first_token_s - s.arrival_s for s in seqs if s.first_token_s is not None]
    tbts = [
        (s.last_token_s - s.first_token_s) / (len(s.output_ids) - 1)
        for s in seqs
        if len(s.output_ids) > 1 and s.last_token_s is not None
    ]
    transfer = int(policy_stats.get("transfer_bytes", 0))
    stats = {
        "policy": policy,
        "batch_size": batch_size,
        "gamma": gamma,
        "draft_experts": draft_experts,
        "num_requests": len(seqs),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "wall_s": wall_s,
        "prefill_s": counters.prefill_s,
        "decode_s": counters.decode_s,
        "ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "tbt_s": sum(tbts) / len(tbts) if tbts else None,
        "steps": counters.steps,
        "draft_s": counters.draft_s,
        "verify_s": counters.verify_s,
        "transfer_bytes": transfer,
        **rates(counters, requests=len(seqs), generated=generated, wall_s=wall_s, transfer=transfer),
        "device_memory": device_memory,  # the budget in bytes (None: no limit)
        "device_peak_bytes": device_peak_bytes,
        # the whole process's peak resident memory, as the kernel measured it (not the ledger)
        "host_peak_bytes": peak_rss_bytes(),
        "token_ids_sha256": token_ids_sha256([s.output_ids for s in seqs]),
        # each request's decode tokens (its first comes from the prefill) and decode steps, in
        # request order: tokens per step with a confidence interval over the requests
        "sequence_decode": [[max(len(s.output_ids) - 1, 0), s.steps] for s in seqs],
    }
    stats["compute_s"] = counters.prefill_s + counters.decode_s - float(policy_stats.get("transfer_wait_s", 0.0))
    for key, value in policy_stats.items():
        stats.setdefault(key, value)
    stats.update(counters.extra)
    return stats
