"""One request's own engine statistics, which the page shows under each answer.

Requests that run together share each step, so each gets an equal share of the expert
bytes its steps moved (one fetch serves the whole batch); its speed, tokens per decode
step and draft acceptance are its own (engine/sequence.py counts them). A client asks
for them with the extension field `specmoe_stats: true`.
"""

from __future__ import annotations


def moved_bytes(policy) -> int:
    """Expert bytes the policy has moved into device memory so far (resident: none)."""
    transfer = getattr(policy, "transfer", None)
    return transfer.transfer_bytes if transfer is not None else 0


def answer_stats(seq, moved: float, policy: str) -> dict:
    """One request's own statistics, shown under its answer: its decode speed, its tokens
    per decode step and draft acceptance, and its share of the expert bytes moved."""
    n = len(seq.output_ids)
    decode_s = seq.last_token_s - seq.first_token_s if n > 1 else 0.0
    decoded = max(0, n - 1)  # the first token comes from the prefill
    return {
        "policy": policy, "completion_tokens": n, "steps": seq.steps,
        "ttft_s": seq.first_token_s - seq.arrival_s if seq.first_token_s is not None else None,
        "decode_tokens_per_s": decoded / decode_s if decode_s > 0 else None,
        "tokens_per_step": decoded / seq.steps if seq.steps else None,
        "drafted": seq.drafted, "accepted": seq.accepted,
        "acceptance_rate": seq.accepted / seq.drafted if seq.drafted else None,
        "transfer_bytes": round(moved), "transfer_bytes_per_token": moved / n if n else None,
    }
