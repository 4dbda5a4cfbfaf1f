"""The traces given with ``--trace [POLICY=]FILE``: read, checked, and described (which
policy recorded them, at which batch size, with how many experts and MoE layers)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...base.trace import StepRecord, read_trace
from .errors import ReplayError

TRACE_POLICIES = ("resident", "ondemand", "overlap", "caching", "host", "specmoe")


def parse_trace_args(values: list[str]) -> list[tuple[str | None, Path]]:
    """'FILE' or 'POLICY=FILE' -> (policy or None, path)."""
    out = []
    for v in values:
        policy, sep, path = v.partition("=")
        if not sep or "/" in policy or policy.endswith(".jsonl"):
            policy, path = None, v
        elif policy not in TRACE_POLICIES:
            raise ReplayError(f"bad --trace {v!r}: {policy!r} is not a policy; use POLICY=FILE with POLICY one of "
                              f"{', '.join(TRACE_POLICIES)}, or just FILE")
        if not Path(path).is_file():
            raise ReplayError(f"--trace {path}: no such file (record one with specmoe generate --trace FILE)")
        out.append((policy, Path(path)))
    return out


@dataclass
class TraceSource:
    path: Path
    policy: str  # the policy that recorded it
    header: dict
    records: list[StepRecord]
    batch: int  # the batch size it was recorded at (full-batch steps)
    num_experts: int
    top_k: int
    layers: list[int]  # model indices of its MoE layers, in order

    @property
    def name(self) -> str:
        return self.path.name


def load_trace(path: Path, policy: str | None) -> TraceSource:
    try:
        header, records = read_trace(path)
    except ValueError as e:
        raise ReplayError(str(e)) from None
    routed = [r for r in records if r.layers and r.kind != "prefill"]
    if not routed:
        raise ReplayError(f"trace {path}: no decode, draft or verify step with routing: nothing to replay")
    recorded = (header.get("config") or {}).get("policy")
    if policy and recorded and policy != recorded:
        raise ReplayError(f"--trace {policy}={path}: the trace header says it was recorded with policy {recorded!r}")
    policy = policy or recorded
    if policy not in TRACE_POLICIES:
        raise ReplayError(f"trace {path}: its header names no policy; pass --trace POLICY={path}")
    model = header.get("model") or {}
    experts = int(model.get("num_experts") or 1 + max(e for r in records for lr in r.layers for e in lr.expert_tokens))
    top_k = int(model.get("top_k") or 0)
    if not top_k:  # picks per position, from the passes themselves
        top_k = max(1, round(sum(sum(lr.expert_tokens.values()) for lr in routed[0].layers)
                             / (len(routed[0].layers) * routed[0].positions)))
    layers = sorted({lr.layer for r in records for lr in r.layers})
    batch = int((header.get("config") or {}).get("max_batch_size") or 0) or max(r.batch_size for r in routed)
    batch = min(batch, max(r.batch_size for r in routed))  # fewer prompts than the engine's limit
    return TraceSource(path, policy, header, records, batch, experts, top_k, layers)
