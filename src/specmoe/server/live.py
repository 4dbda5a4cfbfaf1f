"""The live view's data: what the engine is doing, read between steps on the engine thread.

The engine loop (loop.py) calls `LiveView.tick` after every step. While no page
watches, `tick` returns at once and the engine counts nothing for the view. While one
does, the engine counts the router's picks per expert (`Engine.expert_load`), `tick`
notes which experts each step fetched, and at most once per `interval_s` `capture`
reads the policy's device pool, draft sets and the device-memory ledger into `latest`:
a JSON-ready dict replaced whole, so the event loop reads it without a lock. What a
page receives every `interval_s` (`LiveEvents.next`) adds the counters /metrics shows
and rates over the last few seconds.
"""

from __future__ import annotations

import time
from collections import deque

from ..engine.expert_load import ExpertLoad
from .loop import ServerStats

# an expert's state in the map: bits, ORed; 0 means it is only in the offload tier
DRAFT, DEVICE, FETCHED = 1, 2, 4
INTERVAL_S = 0.25  # page updates: four a second
RATE_WINDOW_S = 2.0  # tokens/s, MB/s, acceptance, ... over the last this many seconds


def expert_states(blocks: list[int], num_experts: int, draft: dict[int, list[int]], on_device: set,
                  fetched: set) -> list[list[int]]:
    """Per MoE block, per expert: DRAFT (a draft expert) | DEVICE (in the device pool) |
    FETCHED (brought in by the last step)."""
    rows = []
    for layer in blocks:
        drafts = set(draft.get(layer, ()))
        rows.append([(DRAFT if e in drafts else 0) | (DEVICE if (layer, e) in on_device else 0)
                     | (FETCHED if (layer, e) in fetched else 0) for e in range(num_experts)])
    return rows


def on_device_experts(policy, all_keys: list) -> set:
    """The experts in device memory now; a policy without a pool (resident) holds them all."""
    pool = getattr(policy, "pool", None)
    return set(all_keys) if pool is None else set(pool.table.slot_of)


def fetch_log(policy) -> list:
    """Every expert the policy has fetched, in order (the transfer engine's own record)."""
    transfer = getattr(policy, "transfer", None)
    return transfer.fetched if transfer is not None else []


def memory_ledger(budget, policy_stats: dict) -> dict:
    """The device budget: its limit (None: the whole device), what each item holds, and
    which part of the pool the draft experts pin."""
    return {"limit": budget.limit, "used": budget.used, "peak": budget.peak, "items": dict(budget.by_item),
            "draft_experts_bytes": int(policy_stats.get("draft_resident_bytes") or 0)}


class LiveView:
    """The engine's side of the live view; `watch`/`unwatch` come from the event loop."""

    def __init__(self, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self.watchers = 0  # pages connected; written by the event loop only
        self.latest: dict | None = None  # the last capture, replaced whole
        self.captures = 0
        self._captured_at: float | None = None
        self._counting = False  # whether the engine counts router picks for the view (Engine.expert_load)
        self._fetch_mark = 0  # how much of the fetch log earlier steps had written
        self._fetched: set = set()  # what the last step fetched

    def watch(self) -> None:
        self.watchers += 1

    def unwatch(self) -> None:
        self.watchers = max(0, self.watchers - 1)

    # --- the engine thread -------------------------------------------------------------

    def tick(self, engine) -> None:
        """After a step: note what it fetched and, if an interval has passed, capture."""
        if self.stop_if_unwatched(engine):
            return
        if not self._start(engine):
            log = fetch_log(engine.policy)
            if len(log) < self._fetch_mark:  # the counters were reset
                self._fetch_mark = 0
            self._fetched = set(log[self._fetch_mark:])
            self._fetch_mark = len(log)
        if self._captured_at is None or time.monotonic() - self._captured_at >= self.interval_s:
            self.capture(engine)

    def stop_if_unwatched(self, engine) -> bool:
        """With no page left, the engine stops counting for the view; True if none is left."""
        if self.watchers > 0:
            return False
        if self._counting:
            engine.expert_load = None
            self._counting, self._captured_at = False, None
        return True

    def _start(self, engine) -> bool:
        """Switch counting on if it is off; True if it was off (this step's fetches are unknown)."""
        if self._counting:
            return False
        c = engine.config
        engine.expert_load = ExpertLoad(c.num_layers, c.num_experts, engine.device)
        self._counting = True
        self._fetch_mark, self._fetched = len(fetch_log(engine.policy)), set()
        return True

    def capture(self, engine) -> None:
        """Read the engine's state into `latest` (between steps: nothing is moving)."""
        if self.watchers <= 0:
            return
        self._start(engine)
        now = time.monotonic()
        c, policy = engine.config, engine.policy
        blocks = list(c.moe_layer_ids)
        load = engine.expert_load.take()
        stats = policy.stats()
        keys = [(layer, e) for layer in blocks for e in range(c.num_experts)]
        self.latest = {
            "capture": self.captures + 1,
            "policy": policy.name, "gamma": engine.gamma, "draft_experts": getattr(policy, "draft_experts", None),
            "draft_quant": stats.get("draft_quant"), "offload": stats.get("offload"),
            "pool_slots": stats.get("pool_slots"),
            "blocks": blocks, "experts": c.num_experts,
            "state": expert_states(blocks, c.num_experts, policy.draft_sets(), on_device_experts(policy, keys),
                                   self._fetched),
            # tokens the full model routed to each expert since the previous capture
            "load": [load[layer] for layer in blocks],
            "load_window_s": now - self._captured_at if self._captured_at is not None else None,
            "memory": memory_ledger(engine.budget, stats),
        }
        self.captures += 1
        self._captured_at = now


def counters_of(stats: ServerStats) -> dict[str, int]:
    """The loop's cumulative counters (the ones /metrics reports)."""
    snap = stats.snapshot
    return {"requests": stats.requests, "generated_tokens": stats.generated_tokens,
            "decode_tokens": snap.decode_tokens, "steps": snap.steps, "seq_steps": snap.seq_steps,
            "drafted": snap.drafted, "accepted": snap.accepted, "transfer_bytes": snap.transfer_bytes}


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


class RateWindow:
    """Rates from cumulative counters sampled over time: the change over the last `span_s`."""

    def __init__(self, span_s: float = RATE_WINDOW_S):
        self.span_s = span_s
        self.samples: deque[tuple[float, dict]] = deque()

    def add(self, t: float, counters: dict) -> tuple[dict, float]:
        """The change of each counter since the oldest sample within the span, and its seconds."""
        self.samples.append((t, counters))
        while len(self.samples) > 2 and t - self.samples[1][0] >= self.span_s:
            self.samples.popleft()
        t0, first = self.samples[0]
        return {k: counters[k] - first[k] for k in counters}, t - t0


class LiveEvents:
    """One page's event stream: counters and rates each time, the engine's capture when it is new."""

    def __init__(self, stats: ServerStats, view: LiveView, span_s: float = RATE_WINDOW_S):
        self.stats, self.view = stats, view
        self.window = RateWindow(span_s)
        self.sent_capture = None

    def next(self, now: float | None = None) -> dict:
        now = time.monotonic() if now is None else now
        counters = counters_of(self.stats)
        change, seconds = self.window.add(now, counters)
        snap = self.stats.snapshot
        event = {
            "time": time.time(), "running": snap.running, "waiting": snap.waiting, **counters,
            "tokens_per_s": ratio(change["generated_tokens"], seconds) or 0.0,
            "transfer_bytes_per_s": ratio(change["transfer_bytes"], seconds) or 0.0,
            "transfer_bytes_per_token": ratio(change["transfer_bytes"], change["generated_tokens"]),
            "tokens_per_step": ratio(change["decode_tokens"], change["seq_steps"]),
            "acceptance_rate": ratio(change["accepted"], change["drafted"]),
        }
        latest = self.view.latest
        if latest is not None and latest["capture"] != self.sent_capture:
            event["engine"] = latest
            self.sent_capture = latest["capture"]
        return event
