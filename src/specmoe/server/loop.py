"""The engine loop: the one thread that owns the engine.

HTTP handlers run on the asyncio event loop; the engine runs here. Handlers hand over a
`RequestHandle` (tokenized prompt + SamplingParams) through a thread-safe queue and read
`Delta`s from the handle's asyncio queue. Between two engine steps this thread takes
every new request and every cancellation, so requests join and leave the running batch
between steps, and every running sequence takes part in the same step (continuous
batching). After each step each sequence's new tokens and text go to its handle via
`call_soon_threadsafe`, the only way another thread may touch an event loop's objects.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..base.errors import SpecMoEError
from .answer_stats import answer_stats, moved_bytes
from .detok import IncrementalText
from .protocol import APIError

log = logging.getLogger("specmoe.server")

RATE_WINDOW_S = 10  # tokens/s is measured over the last this many seconds


@dataclass
class Delta:
    """What one step added to one request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" once finished
    error: APIError | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprobs of token_ids, if the request asked
    prompt_logprobs: list | None = None  # in the first delta, if the request scores its prompt
    stats: dict | None = None  # in the last delta: the request's own engine statistics (answer_stats)


class RequestHandle:
    """One request as both sides see it. The engine thread writes `seq` and `text`;
    the event loop only reads `queue`."""

    def __init__(self, prompt_ids: list[int], params, aloop: asyncio.AbstractEventLoop, source_ids=None,
                 want_stats: bool = False):
        self.prompt_ids = prompt_ids
        self.source_ids = source_ids  # an encoder-decoder model's framed source
        self.params = params
        self.want_stats = want_stats  # the last delta carries the request's engine statistics
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.aloop = aloop
        self.seq = None
        self.text: IncrementalText | None = None
        self.tokens_sent = 0
        self.moved_bytes = 0.0  # its share of the expert bytes moved by the steps it took part in

    def push(self, delta: Delta) -> None:
        deliver({self.aloop: [(self, delta)]})


def deliver(batches: dict) -> None:
    """Hand deltas to their handles' queues: one wake-up of each event loop per step."""
    for aloop, items in batches.items():
        try:
            aloop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


def _put_all(items) -> None:
    for handle, delta in items:
        handle.queue.put_nowait(delta)


@dataclass(frozen=True)
class Snapshot:
    """Engine state for /metrics, written whole by the engine thread (no locks needed)."""

    running: int = 0
    waiting: int = 0
    steps: int = 0
    seq_steps: int = 0
    decode_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    transfer_bytes: int = 0
    tokens_by_second: tuple[tuple[int, int], ...] = ()  # (unix second, tokens generated in it)


class ServerStats:
    """Counters of the loop; ints written by the engine thread, read by /metrics."""

    def __init__(self):
        self.requests = 0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.snapshot = Snapshot()
        self._buckets: dict[int, int] = {}

    def count_tokens(self, n: int) -> None:
        self.generated_tokens += n
        second = int(time.time())
        self._buckets[second] = self._buckets.get(second, 0) + n

    def tokens_per_s(self, now: float | None = None) -> float:
        """Tokens generated in the last RATE_WINDOW_S full seconds, per second."""
        now = int(now if now is not None else time.time())
        recent = sum(n for s, n in self.snapshot.tokens_by_second if now - RATE_WINDOW_S <= s < now)
        return recent / RATE_WINDOW_S

    def refresh(self, engine) -> None:
        horizon = int(time.time()) - RATE_WINDOW_S - 1
        self._buckets = {s: n for s, n in self._buckets.items() if s >= horizon}
        counters = engine.counters
        policy = engine.policy.stats()
        self.snapshot = Snapshot(
            running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting),
            steps=counters.steps, seq_steps=counters.seq_steps, decode_tokens=counters.decode_tokens,
            drafted=counters.drafted,
            accepted=counters.accepted, transfer_bytes=int(policy.get("transfer_bytes", 0)),
            tokens_by_second=tuple(sorted(self._buckets.items())),
        )


class EngineLoop:
    def __init__(self, engine, max_pending: int = 4096):
        self.engine = engine
        self.max_pending = max_pending
        self.stats = ServerStats()
        self.error: BaseException | None = None  # why the thread died, if it did
        # set (one assignment: safe from a signal handler) when shutdown begins: no new
        # request is admitted, and those still running at this time are answered with an error
        self.drain_deadline: float | None = None
        self._commands: queue.Queue = queue.Queue()
        self._active: dict[int, RequestHandle] = {}  # engine request id -> handle
        self.after_step: list = []  # fn(engine), run on this thread after each step (the live view)
        self._thread = threading.Thread(target=self._run, name="specmoe-engine", daemon=True)

    # --- called from the event loop ----------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._commands.put(("stop", None))
        self._thread.join(timeout)

    def drain(self, grace_s: float) -> None:
        """Stop admitting; requests in flight get `grace_s` seconds to finish."""
        self.drain_deadline = time.monotonic() + grace_s

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    @property
    def alive(self) -> bool:
        # a loop that has failed is dead even while its thread is still failing the
        # requests it held: /health must say 503 and no new request may be queued
        return self._thread.is_alive() and self.error is None

    def submit(self, handle: RequestHandle) -> None:
        if not self.alive:
            raise APIError(503, "the engine is not running; see the server log", code="engine_dead")
        if self.draining:
            raise shutting_down()
        pending = self._commands.qsize() + self.stats.snapshot.waiting
        if pending >= self.max_pending:
            raise APIError(503, f"the server has {pending} requests waiting; retry later", code="overloaded")
        self._commands.put(("add", handle))

    def cancel(self, handle: RequestHandle) -> None:
        """The client went away: drop its sequence at the next step boundary."""
        self._commands.put(("abort", handle))

    def call(self, fn) -> None:
        """Run `fn(engine)` on the engine thread between steps (where engine state may be read)."""
        self._commands.put(("call", fn))

    # --- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            # inference mode is per thread: the engine's forward passes run in this one
            with torch.inference_mode():
                while self._take_commands(block=not self.engine.scheduler.has_work):
                    if self.engine.scheduler.has_work:
                        self._step()
                    if self.draining and time.monotonic() >= self.drain_deadline:
                        self._fail_all(shutting_down)
        except BaseException as exc:  # keep the reason for /health and the log
            self.error = exc
            log.exception("the engine loop stopped")
            message = "the engine loop stopped: " + str(exc)
            self._fail_all(lambda: engine_error(message))

    def _take_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one first when idle. False: stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            kind, handle = command
            if kind == "stop":
                self._fail_all(shutting_down)
                self._refuse_queued()
                return False
            if kind == "add":
                self._add(handle)
            elif kind == "call":
                self._call(handle)
            elif kind == "abort" and handle.seq is not None and handle.seq.request_id in self._active:
                self.engine.abort(handle.seq.request_id)
                del self._active[handle.seq.request_id]
                self.stats.finished["abort"] += 1
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, handle: RequestHandle) -> None:
        try:
            seq = self.engine.add_request(handle.prompt_ids, handle.params, source_ids=handle.source_ids)
        except SpecMoEError as exc:  # checked by the handler already; a safety net
            handle.push(Delta(error=APIError(400, str(exc))))
            return
        handle.seq = seq
        handle.text = IncrementalText(self.engine.tokenizer, handle.params.stop)
        self._active[seq.request_id] = handle
        self.stats.requests += 1
        self.stats.prompt_tokens += len(seq.prompt_ids)

    def _step(self) -> None:
        moved = moved_bytes(self.engine.policy)
        try:
            self.engine.step()
        except Exception as exc:
            # The state of the sequences in this step is unknown: fail them, keep serving.
            log.exception("an engine step failed; failing the %d requests in it", len(self._active))
            message = f"the engine failed while generating: {exc}"
            self._fail_all(lambda: engine_error(message))
        stepped = [(rid, h) for rid, h in self._active.items()
                   if len(h.seq.output_ids) > h.tokens_sent or h.seq.finished]
        share = (moved_bytes(self.engine.policy) - moved) / max(1, len(stepped))  # a fetch serves the whole batch
        batches: dict = {}
        for rid, handle in stepped:
            seq = handle.seq
            sent = handle.tokens_sent
            new_ids = seq.output_ids[sent:]
            handle.tokens_sent = len(seq.output_ids)
            handle.moved_bytes += share
            final = seq.text if seq.finished else None
            text = handle.text.update(seq.output_ids, final_text=final)
            delta = Delta(text, new_ids, seq.finish_reason if seq.finished else None,
                          logprobs=seq.logprobs[sent:], prompt_logprobs=seq.prompt_logprobs if sent == 0 else None,
                          stats=self._answer_stats(handle) if seq.finished else None)
            batches.setdefault(handle.aloop, []).append((handle, delta))
            self.stats.count_tokens(len(new_ids))
            if seq.finished:
                self.stats.finished[seq.finish_reason] = self.stats.finished.get(seq.finish_reason, 0) + 1
                del self._active[rid]
        deliver(batches)
        self.stats.refresh(self.engine)
        for fn in self.after_step:
            self._call(fn)

    def _answer_stats(self, handle: RequestHandle) -> dict | None:
        return answer_stats(handle.seq, handle.moved_bytes, self.engine.policy.name) if handle.want_stats else None

    def _call(self, fn) -> None:
        """Run an observer on the engine; its failure is logged, never the end of serving."""
        try:
            fn(self.engine)
        except Exception:  # noqa: BLE001 - the live view must not take the server down
            log.exception("%s failed on the engine thread", getattr(fn, "__qualname__", fn))

    def _fail_all(self, error: Callable[[], APIError]) -> None:
        """Answer every request the engine holds with an `error()` and drop it."""
        for rid, handle in list(self._active.items()):
            handle.push(Delta(error=error()))
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - already failing; the requests are answered
                pass
            self.stats.finished["error"] += 1
        self._active.clear()

    def _refuse_queued(self) -> None:
        while True:
            try:
                kind, handle = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                handle.push(Delta(error=shutting_down()))


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry later or on another replica", code="shutting_down")


def engine_error(message: str) -> APIError:
    return APIError(500, message, code="engine_error")
