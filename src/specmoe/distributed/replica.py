"""One engine replica: an `LLM` in a Ray actor, batching each chunk of prompts it is given.

The class is plain Python; `ReplicatedLLM` makes it an actor with `ray.remote` (restarted
by Ray when its process dies, with the work it had not finished sent to it again).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ..api import LLM, RequestOutput
from ..base.errors import SpecMoEError
from ..engine.stats import RunCounters


@dataclass
class ChunkRun:
    """What one replica reports for one chunk: its outputs and the engine's run statistics."""

    outputs: list[RequestOutput]
    stats: dict  # LLM.last_stats of the chunk
    counters: RunCounters  # the counts behind its ratios (added up across chunks and replicas)
    worker: str  # host:pid of the process that ran it (a restarted replica has a new pid)


class Replica:
    def __init__(self, model: str | None, options: dict):
        # A bad option or budget is the user's to fix: keep it for ready() to raise as a
        # task error (an error in an actor's constructor reaches the caller only as a
        # death notice, without the message).
        try:
            self.llm, self.error = LLM(model=model, **options), None
        except SpecMoEError as exc:
            self.llm, self.error = None, exc

    def ready(self) -> str:
        if self.error is not None:
            raise self.error
        return self.worker()

    def worker(self) -> str:
        return f"{socket.gethostname()}:{os.getpid()}"

    def generate(self, prompts: list, params: list) -> ChunkRun:
        outputs = self.llm.generate(prompts, params)
        return ChunkRun(outputs, self.llm.last_stats, self.llm.engine.counters, self.worker())
