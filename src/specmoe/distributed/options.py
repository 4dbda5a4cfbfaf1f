"""Where engine replicas run: how many, on which Ray cluster, with what resources."""

from __future__ import annotations

from dataclasses import dataclass

from ..base.errors import SpecMoEError


@dataclass(frozen=True)
class ReplicaOptions:
    replicas: int = 2
    # CPUs each replica reserves: on a CPU cluster its compute threads; None: the cluster's
    # CPUs shared out evenly (one each beside a GPU). Fractions let replicas share a core.
    replica_cpus: float | None = None
    # the Ray cluster to join ("auto", "HOST:6379", "ray://HOST:10001"); None: $RAY_ADDRESS,
    # else a local cluster started for this run and stopped after it
    ray_address: str | None = None
    # a replica that dies is restarted this many times, and Ray runs its unfinished work again
    max_restarts: int = 3

    def __post_init__(self):
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 1:
            raise SpecMoEError(f"--replicas must be a positive integer, got {self.replicas!r}")
        cpus = self.replica_cpus
        if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not cpus > 0):
            raise SpecMoEError(f"--replica-cpus must be a number above 0 (fractions share a core), got {cpus!r}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise SpecMoEError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
