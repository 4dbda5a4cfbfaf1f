"""The live view's data (server/live.py) on a real engine, stepped here as the server's
engine loop steps it: what the expert map and the rates say is checked against what
`--trace` records and against counts made independently, and nothing is computed for
the view while no page watches."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")

from factories import random_prompts  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.base.trace import read_trace  # noqa: E402
from specmoe.server.live import DEVICE, DRAFT, FETCHED, LiveEvents, LiveView, RateWindow, expert_states  # noqa: E402
from specmoe.server.loop import ServerStats  # noqa: E402

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))
SPECMOE = dict(policy="specmoe", offload="host", device_memory="50%", draft_quant="none", draft_experts=2, gamma=3)


def build(tiny_ckpt, tmp_path, device="cpu", **options) -> LLM:
    return LLM(model=str(tiny_ckpt("mixtral")), device=device, max_batch_size=4, max_model_len=64,
               trace=str(tmp_path / "trace.jsonl"), **options)


def serve(engine, view: LiveView, steps: list | None = None) -> None:
    """Run three greedy requests to the end, ticking the view after every step like the engine loop;
    `steps` gets (trace records so far, the view's capture, pool slots in use) after each step."""
    for prompt in random_prompts(3, min_len=4, max_len=10):
        engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=0.0))
    while engine.scheduler.has_work:
        engine.step()
        view.tick(engine)
        if steps is not None:
            pool = getattr(engine.policy, "pool", None)
            in_use = pool.num_slots - len(pool.table.free) if pool else None
            steps.append((engine.tracer.step, view.latest, in_use))


def watched_run(llm: LLM, tmp_path) -> tuple[list, list]:
    """A page watches from the start (a capture after every step) while `serve` runs; the
    steps' (trace records so far, capture, pool slots in use) and the trace's records."""
    view = LiveView(interval_s=0)
    view.watch()
    view.capture(llm.engine)
    steps: list = []
    serve(llm.engine, view, steps)
    llm.close()
    return steps, read_trace(tmp_path / "trace.jsonl")[1]


def cells(state: list[list[int]], blocks: list[int], bit: int) -> set:
    return {(layer, e) for layer, row in zip(blocks, state) for e, s in enumerate(row) if s & bit}


def test_nothing_is_computed_while_no_page_watches(tiny_ckpt, tmp_path):
    llm = build(tiny_ckpt, tmp_path, **SPECMOE)
    view = LiveView(interval_s=0)
    serve(llm.engine, view)
    assert (llm.engine.expert_load, view.latest, view.captures) == (None, None, 0)
    llm.close()


def test_the_engine_stops_counting_when_the_last_page_leaves(tiny_ckpt, tmp_path):
    llm = build(tiny_ckpt, tmp_path, **SPECMOE)
    view = LiveView(interval_s=0)
    view.watch()
    view.capture(llm.engine)
    assert llm.engine.expert_load is not None
    view.unwatch()
    assert view.stop_if_unwatched(llm.engine) and llm.engine.expert_load is None
    llm.close()


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_load_is_what_the_full_model_routed_as_the_trace_records_it(tiny_ckpt, tmp_path, device):
    llm = build(tiny_ckpt, tmp_path, device, **SPECMOE)
    view = LiveView(interval_s=0)  # a capture after every step: their loads add up to the whole run
    view.watch()
    view.capture(llm.engine)
    seen: Counter = Counter()
    for prompt in random_prompts(3, min_len=4, max_len=10):
        llm.engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=0.0))
    while llm.engine.scheduler.has_work:
        llm.engine.step()
        view.tick(llm.engine)
        latest = view.latest
        for layer, row in zip(latest["blocks"], latest["load"]):
            seen.update({(layer, e): n for e, n in enumerate(row) if n})
    llm.close()
    _, records = read_trace(tmp_path / "trace.jsonl")
    routed: Counter = Counter()
    for record in records:
        if record.kind != "draft":  # a draft's picks are guesses verification replaces
            for lr in record.layers:
                routed.update({(lr.layer, e): n for e, n in lr.expert_tokens.items()})
    assert {r.kind for r in records} >= {"prefill", "draft", "verify"}
    assert seen == routed and sum(seen.values()) > 0


def test_ondemand_map_marks_every_routed_expert_fetched_and_keeps_none(tiny_ckpt, tmp_path):
    # ondemand empties each block after it runs: a step fetches exactly what it routes
    steps, records = watched_run(build(tiny_ckpt, tmp_path, policy="ondemand", offload="host", device_memory="50%"),
                                 tmp_path)
    start = 0
    for end, latest, _ in steps:
        routed = {(lr.layer, e) for r in records[start:end] for lr in r.layers
                  for e, n in lr.expert_tokens.items() if n}
        blocks = latest["blocks"]
        assert cells(latest["state"], blocks, FETCHED) == routed
        assert cells(latest["state"], blocks, DEVICE | DRAFT) == set()
        start = end


def test_specmoe_map_shows_the_draft_sets_pinned_in_the_pool(tiny_ckpt, tmp_path):
    steps, records = watched_run(build(tiny_ckpt, tmp_path, **SPECMOE), tmp_path)
    start = 0
    for end, latest, in_use in steps:
        blocks, state = latest["blocks"], latest["state"]
        draft, device = cells(state, blocks, DRAFT), cells(state, blocks, DEVICE)
        assert len(draft) == 2 * len(blocks) and draft <= device
        assert len(device) == in_use <= latest["pool_slots"]
        # what the trace saw each pass fetch (a refresh after verification may fetch more)
        traced = {(lr.layer, e) for r in records[start:end] for lr in r.layers for e in lr.fetched}
        assert traced <= cells(state, blocks, FETCHED)
        start = end
    assert any(cells(latest["state"], latest["blocks"], FETCHED) for _, latest, _ in steps)


def test_memory_ledger_is_the_device_budget(tiny_ckpt, tmp_path):
    llm = build(tiny_ckpt, tmp_path, **SPECMOE)
    view = LiveView()
    view.watch()
    view.capture(llm.engine)
    memory, budget = view.latest["memory"], llm.engine.budget
    assert (memory["limit"], memory["used"]) == (budget.limit, budget.used)
    assert sum(memory["items"].values()) == budget.used and {"KV cache", "expert pool"} <= set(memory["items"])
    assert memory["draft_experts_bytes"] == 2 * len(view.latest["blocks"]) * llm.engine.policy.pool.expert_bytes
    llm.close()


def test_captures_come_at_most_once_per_interval(tiny_ckpt, tmp_path):
    llm = build(tiny_ckpt, tmp_path, **SPECMOE)
    view = LiveView(interval_s=0.2)
    view.watch()
    start = time.monotonic()
    steps = 0
    for _ in range(4):
        steps_before = steps
        for prompt in random_prompts(2, min_len=4, max_len=10):
            llm.engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0.0))
        while llm.engine.scheduler.has_work:
            llm.engine.step()
            view.tick(llm.engine)
            steps += 1
        assert steps > steps_before
    elapsed = time.monotonic() - start
    llm.close()
    assert 1 <= view.captures <= elapsed / 0.2 + 1 < steps


def test_expert_states_combine_the_three_bits():
    state = expert_states([3, 5], 4, {3: [0, 1]}, on_device={(3, 0), (3, 1), (3, 2), (5, 3)},
                          fetched={(3, 2), (5, 0)})
    assert state == [[DRAFT | DEVICE, DRAFT | DEVICE, DEVICE | FETCHED, 0], [FETCHED, 0, 0, DEVICE]]


def test_rate_window_measures_the_change_over_its_span():
    window = RateWindow(span_s=2.0)
    for t in range(5):
        change, seconds = window.add(float(t), {"tokens": 10 * t * t})
    # at t=4 the oldest sample kept is t=2: (160 - 40) tokens over 2 s
    assert (change, seconds) == ({"tokens": 120}, 2.0)


def test_events_carry_each_engine_capture_once():
    stats, view = ServerStats(), LiveView()
    events = LiveEvents(stats, view)
    view.latest = {"capture": 1}
    first, second = events.next(now=0.0), events.next(now=0.25)
    view.latest = {"capture": 2}
    third = events.next(now=0.5)
    assert (first["engine"], "engine" in second, third["engine"]) == ({"capture": 1}, False, {"capture": 2})
    assert first["acceptance_rate"] is None and first["tokens_per_s"] == 0.0
