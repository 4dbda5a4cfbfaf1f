"""Which replica takes which chunk of prompts, and when results leave in input order.

Plain bookkeeping, no Ray: `ReplicatedLLM` sends what `assign` returns and reports back
with `finish` or `lose`. Prompts are read lazily, a chunk at a time, so a large prompt
file streams through: each replica holds at most `depth` chunks (one running, the next
queued so that it never waits for the driver), and no chunk is read more than
`lookahead` chunks ahead of the oldest unfinished one, which bounds the results held back
waiting for it (backpressure).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..base.errors import SpecMoEError
from ..engine.sampling import SamplingParams


@dataclass(frozen=True)
class Chunk:
    index: int  # the chunk's place in the input
    first: int  # the input index of its first prompt
    prompts: list
    params: list  # one SamplingParams per prompt


def paired(prompts: Iterable, params) -> Iterator[tuple]:
    """(prompt, SamplingParams) pairs: one SamplingParams for every prompt, or one each."""
    if isinstance(params, SamplingParams):
        yield from ((prompt, params) for prompt in prompts)
        return
    for prompt, own in itertools.zip_longest(prompts, params):
        if prompt is None or own is None:
            raise SpecMoEError("give one SamplingParams per prompt, or a single one for all")
        yield prompt, own


def chunked(pairs: Iterable[tuple], size: int) -> Iterator[Chunk]:
    """Chunks of `size` (prompt, params) pairs, read as they are needed."""
    pairs = iter(pairs)
    for index in itertools.count():
        part = list(itertools.islice(pairs, size))
        if not part:
            return
        yield Chunk(index, index * size, [prompt for prompt, _ in part], [params for _, params in part])


class Schedule:
    def __init__(self, chunks: Iterator[Chunk], replicas: int, depth: int = 2, lookahead: int | None = None):
        self._chunks = chunks
        self.depth = depth
        self.lookahead = lookahead or 2 * depth * replicas
        self.held = {r: 0 for r in range(replicas)}  # live replica -> chunks sent to it, unfinished
        self._retry: list[Chunk] = []  # chunks whose replica is gone for good, oldest first
        self._finished: dict[int, tuple[Chunk, object]] = {}  # waiting for an older chunk
        self.read = 0  # chunks taken from the input
        self.emitted = 0  # chunks handed out in input order
        self.exhausted = False

    @property
    def done(self) -> bool:
        return self.exhausted and self.emitted == self.read

    def assign(self) -> list[tuple[int, Chunk]]:
        """(replica, chunk) pairs to send now, each to the replica holding the fewest."""
        sent = []
        while True:
            free = [r for r, n in self.held.items() if n < self.depth]
            chunk = self._next() if free else None
            if chunk is None:
                return sent
            replica = min(free, key=lambda r: (self.held[r], r))
            self.held[replica] += 1
            sent.append((replica, chunk))

    def _next(self) -> Chunk | None:
        if self._retry:
            return self._retry.pop(0)
        if self.exhausted or self.read - self.emitted >= self.lookahead:
            return None
        chunk = next(self._chunks, None)
        if chunk is None:
            self.exhausted = True
            return None
        self.read += 1
        return chunk

    def finish(self, replica: int, chunk: Chunk, result) -> list[tuple[Chunk, object]]:
        """Record a chunk's result; return the results now due, in input order."""
        self.held[replica] -= 1
        self._finished[chunk.index] = (chunk, result)
        due = []
        while self.emitted in self._finished:
            due.append(self._finished.pop(self.emitted))
            self.emitted += 1
        return due

    def lose(self, replica: int, chunk: Chunk) -> None:
        """`replica` is gone for good (Ray gave up restarting it): its chunk goes to another."""
        self.held.pop(replica, None)
        self._retry = sorted(self._retry + [chunk], key=lambda c: c.index)
        if not self.held:
            raise SpecMoEError("every replica died and Ray gave up restarting them; "
                               "see the replicas' logs (ray logs, or /tmp/ray/session_latest/logs)")
