"""/metrics in the Prometheus text exposition format (version 0.0.4).

A server that is one replica of several (`specmoe serve --replicas N`) renders the
`combine`d counters of all of them, with each replica's requests beside.
"""

from __future__ import annotations

import dataclasses

from .loop import RATE_WINDOW_S, ServerStats, Snapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NOW_FIELDS = ("running", "waiting", "tokens_by_second")  # the state now: only live replicas count


def render(stats: ServerStats, http_errors: dict[int, int], model: str, replicas: dict[str, int] | None = None) -> str:
    """The text; `replicas` (replica -> requests it admitted) adds each replica's line."""
    snap = stats.snapshot
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in {"model": model, **labels}.items())
            lines.append(f"{name}{{{label_text}}} {_number(value)}")

    metric("specmoe_requests_total", "counter", "Requests admitted to the engine.", [({}, stats.requests)])
    metric("specmoe_requests_finished_total", "counter", "Requests that left the engine, by finish reason "
           "(abort: the client went away).", [({"finish_reason": r}, n) for r, n in sorted(stats.finished.items())])
    metric("specmoe_http_errors_total", "counter", "Error responses, by HTTP status.",
           [({"status": str(s)}, n) for s, n in sorted(http_errors.items())])
    metric("specmoe_prompt_tokens_total", "counter", "Prompt tokens admitted.", [({}, stats.prompt_tokens)])
    metric("specmoe_generation_tokens_total", "counter", "Tokens generated.", [({}, stats.generated_tokens)])
    metric("specmoe_generation_tokens_per_second", "gauge",
           f"Tokens generated per second over the last {RATE_WINDOW_S} s.", [({}, stats.tokens_per_s())])
    metric("specmoe_running_requests", "gauge", "Sequences in the running batch after the last step.",
           [({}, snap.running)])
    metric("specmoe_waiting_requests", "gauge", "Requests waiting for a batch slot.", [({}, snap.waiting)])
    metric("specmoe_decode_steps_total", "counter", "Decode steps (a speculative step is draft + verify).",
           [({}, snap.steps)])
    metric("specmoe_decode_sequence_steps_total", "counter", "Sum over decode steps of the sequences in them "
           "(divided by specmoe_decode_steps_total: the mean batch size).", [({}, snap.seq_steps)])
    metric("specmoe_transfer_bytes_total", "counter", "Expert bytes moved into the device pool.",
           [({}, snap.transfer_bytes)])
    metric("specmoe_draft_tokens_total", "counter", "Draft tokens proposed.", [({}, snap.drafted)])
    metric("specmoe_accepted_draft_tokens_total", "counter", "Draft tokens accepted by verification.",
           [({}, snap.accepted)])
    metric("specmoe_acceptance_rate", "gauge", "Accepted / proposed draft tokens since start (NaN: none drafted).",
           [({}, snap.accepted / snap.drafted if snap.drafted else float("nan"))])
    if replicas is not None:
        metric("specmoe_replica_requests_total", "counter", "Requests admitted by each engine replica (the "
               "counters above add up every replica).", [({"replica": r}, n) for r, n in sorted(replicas.items())])
    return "\n".join(lines) + "\n"


def combine(parts: list[ServerStats], live: list[bool]) -> ServerStats:
    """Several servers' stats as one: counters added up over all of them (a replica that
    was replaced keeps counting, so no counter goes down), the state now over the live ones."""
    total = ServerStats()
    for name in list(vars(total)):
        if name != "snapshot" and not name.startswith("_"):
            setattr(total, name, _add([getattr(p, name) for p in parts]))
    snapshots = {f.name: [getattr(p.snapshot, f.name) for p in parts] for f in dataclasses.fields(Snapshot)}
    for name in NOW_FIELDS:
        snapshots[name] = [v for v, up in zip(snapshots[name], live) if up]
    per_second = _add([dict(seconds) for seconds in snapshots.pop("tokens_by_second")])
    total.snapshot = Snapshot(**{name: sum(values) for name, values in snapshots.items()},
                              tokens_by_second=tuple(sorted(per_second.items())))
    return total


def combine_counts(parts: list[dict]) -> dict:
    """Counts by key (HTTP errors by status) added up, every key kept (zeros too)."""
    return {key: sum(p.get(key, 0) for p in parts) for key in dict.fromkeys(k for p in parts for k in p)}


def _add(values: list):
    return combine_counts(values) if values and isinstance(values[0], dict) else sum(values)


def _number(value) -> str:
    if isinstance(value, float):
        if value != value:
            return "NaN"
        return repr(value)
    return str(value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
