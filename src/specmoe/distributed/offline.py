"""`ReplicatedLLM`: offline generation over engine replicas on a Ray cluster.

Prompts are cut into chunks of `max_batch_size`, each sent to a replica (a Ray actor
holding an `LLM`), which batches it with the configured policy. Results come back in
input order as soon as every earlier one is in. Fault handling is Ray's: a replica whose
process dies is restarted (`max_restarts`) and the calls it had not answered run again
on the new process (`max_task_retries`), so each chunk's result arrives exactly once;
only a replica Ray gives up on has its chunks sent to the others (`Schedule.lose`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from ..api import RequestOutput
from ..base.config import EngineConfig
from ..base.errors import SpecMoEError
from ..engine.sampling import SamplingParams
from .cluster import connect, cpu_threads, replica_errors, replica_resources, require_ray
from .options import ReplicaOptions
from .replica import Replica
from .runstats import TokenHash, merge_runs, replica_stats
from .schedule import Schedule, chunked, paired


class Result(NamedTuple):
    index: int  # the prompt's place in the input
    prompt: str | list[int]
    output: RequestOutput


class ReplicatedLLM:
    """Like `LLM`, over `replicas` engines on Ray (one per GPU, or a share of the CPUs).

    `model=None` uses the bundled demo model; a path must exist on every node. Engine
    options are `LLM`'s (`EngineConfig`); `replica_cpus`, `ray_address` and
    `max_restarts` are `ReplicaOptions`.
    """

    def __init__(self, model: str | Path | None = None, *, replicas: int = 2, replica_cpus: float | None = None,
                 ray_address: str | None = None, max_restarts: int = 3, **options):
        self.placement = ReplicaOptions(replicas, replica_cpus, ray_address, max_restarts)
        self.options = EngineConfig.from_kwargs(**options)  # checked here, before a replica starts
        if self.options.trace:
            raise SpecMoEError("--trace records one engine's steps: drop it, or run without --replicas")
        self.last_stats: dict | None = None
        self._started_ray = connect(ray_address)
        self.replicas: list = []
        try:
            self.workers = self._start(None if model is None else str(Path(model).resolve()), options)
        except BaseException:
            self.close()
            raise

    def _start(self, model: str | None, options: dict) -> list[str]:
        """Start the replicas and wait until each has loaded the model; their host:pid."""
        ray, placement = require_ray(), self.placement
        resources = replica_resources(placement, self.options.device, ray.cluster_resources())
        options = {**options, "threads": cpu_threads(resources, self.options.threads)}
        actor = ray.remote(Replica).options(max_restarts=placement.max_restarts,
                                            max_task_retries=placement.max_restarts, **resources)
        self.replicas = [actor.remote(model, options) for _ in range(placement.replicas)]
        with replica_errors():
            return ray.get([replica.ready.remote() for replica in self.replicas])

    def generate(self, prompts: Iterable, sampling_params: SamplingParams | Iterable[SamplingParams] | None = None,
                 progress: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Outputs in prompt order (prompts: strings or lists of token ids, any iterable)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return [result.output for result in self.stream(prompts, sampling_params, progress)]

    def stream(self, prompts: Iterable, sampling_params=None, progress=None) -> Iterator[Result]:
        """Results in input order as soon as they and every earlier one are done; prompts
        are read as replicas need them. `progress(n)` is called as n more prompts finish
        (in any order). `last_stats` is set when the iterator is exhausted."""
        ray = require_ray()
        pairs = paired(prompts, sampling_params or SamplingParams())
        schedule = Schedule(chunked(pairs, self.options.max_batch_size), len(self.replicas))
        pending: dict = {}  # ObjectRef -> (replica, chunk)
        runs: list[list] = [[] for _ in self.replicas]
        digest, start = TokenHash(), time.perf_counter()
        while True:
            for replica, chunk in schedule.assign():
                pending[self.replicas[replica].generate.remote(chunk.prompts, chunk.params)] = (replica, chunk)
            if not pending:
                break
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            replica, chunk = pending.pop(ref)
            try:
                with replica_errors():
                    run = ray.get(ref)
            except ray.exceptions.RayActorError:  # restarts used up: the others take its work
                schedule.lose(replica, chunk)
                continue
            runs[replica].append(run)
            if progress:
                progress(len(chunk.prompts))
            for done, run in schedule.finish(replica, chunk, run):
                for i, (prompt, output) in enumerate(zip(done.prompts, run.outputs)):
                    digest.add(output.token_ids)
                    yield Result(done.first + i, prompt, output)
        if schedule.read == 0:
            raise SpecMoEError("no prompts given")
        self.last_stats = self._stats(runs, time.perf_counter() - start, digest.hexdigest())

    def _stats(self, runs: list[list], wall_s: float, sha: str) -> dict:
        every = [run for replica in runs for run in replica]
        total = merge_runs(every, wall_s)
        per_replica = [replica_stats(i, self.workers[i], replica_runs) for i, replica_runs in enumerate(runs)]
        self.workers = [stats["workers"][-1] for stats in per_replica]  # where the next run starts
        total.update(replicas=per_replica, num_replicas=len(runs), token_ids_sha256=sha,
                     restarts=sum(r["restarts"] for r in per_replica))
        return total

    def close(self) -> None:
        ray = require_ray()
        for replica in getattr(self, "replicas", []):
            ray.kill(replica)
        self.replicas = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> ReplicatedLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
