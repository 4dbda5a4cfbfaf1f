"""Which sequences run in the next step: plain bookkeeping, no tensors.

Requests wait in arrival order and join the running batch when a KV slot is free and
the batch is below its size limit; finished or cancelled sequences leave between steps.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


class Scheduler:
    def __init__(self, max_batch_size: int):
        self.max_batch_size = max_batch_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self, free_slots: int) -> list[Sequence]:
        """Move waiting sequences into the running batch while there is room."""
        room = min(free_slots, self.max_batch_size - len(self.running))
        admitted = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        self.running.extend(admitted)
        return admitted

    def retire(self) -> list[Sequence]:
        """Remove and return the finished sequences."""
        done = [s for s in self.running if s.finished]
        self.running = [s for s in self.running if not s.finished]
        return done

    def cancel(self, request_id: int) -> Sequence | None:
        """Drop a request wherever it is (a client went away); the caller frees its slot."""
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                seq.finish_reason = "abort"
                return seq
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
