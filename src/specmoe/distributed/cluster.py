"""Joining a Ray cluster and sizing a replica's share of it.

Ray is an optional dependency: it is imported inside the functions that need it, so that
`specmoe --help` and every command without `--replicas` run without it.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

from ..base.errors import SpecMoEError
from .options import ReplicaOptions


def require_ray():
    """The ray module, or a one-line error that says how to install it."""
    try:
        import ray
    except ModuleNotFoundError:
        raise SpecMoEError("--replicas runs engine replicas on Ray: pip install 'specmoe[ray]'") from None
    return ray


def connect(address: str | None) -> bool:
    """Join the cluster at `address` ($RAY_ADDRESS when None), or start a local one when
    there is neither. True when this call started Ray (the caller shuts it down)."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    joining = address is not None or bool(os.environ.get("RAY_ADDRESS"))
    try:
        # a cluster started for one run needs no dashboard (and starts seconds sooner without it)
        ray.init(address=address, logging_level=logging.WARNING, **({} if joining else {"include_dashboard": False}))
    except ConnectionError as exc:
        raise SpecMoEError(f"cannot join the Ray cluster at {address or os.environ.get('RAY_ADDRESS')} ({exc}): "
                           "start one with `ray start --head`, or drop --ray-address to run on this machine") from None
    return True


def replica_resources(options: ReplicaOptions, device: str, cluster: dict) -> dict:
    """Ray resources of one replica: one GPU each where the engine runs on CUDA, else a
    share of the cluster's CPUs. Refuses what the cluster cannot place (Ray would wait)."""
    n, gpus, cpus = options.replicas, cluster.get("GPU", 0), cluster.get("CPU", 0)
    if device == "cuda" or (device == "auto" and gpus >= 1):
        if gpus < n:
            raise SpecMoEError(f"{n} replicas need one GPU each and the Ray cluster has {gpus:g}: "
                               "lower --replicas, add GPU nodes, or run on CPUs with --device cpu")
        return {"num_gpus": 1, "num_cpus": options.replica_cpus or 1}
    per_replica = options.replica_cpus or cpus / n
    if per_replica * n > cpus + 1e-9:
        raise SpecMoEError(f"{n} replicas x {per_replica:g} CPUs exceed the Ray cluster's {cpus:g} CPUs: "
                           "lower --replica-cpus or --replicas")
    return {"num_cpus": per_replica}


def cpu_threads(resources: dict, threads: int | None) -> int | None:
    """Compute threads of a CPU replica: half its CPUs, as one engine takes half the
    machine's (the rest move experts), so that replicas on one node do not fight over
    cores. An explicit --threads wins; GPU replicas keep the engine's default."""
    if threads is not None or "num_gpus" in resources:
        return threads
    return max(1, int(resources["num_cpus"]) // 2)


@contextmanager
def replica_errors():
    """A SpecMoEError raised on a replica reaches the caller as itself (one line, the fix
    in it), not wrapped in Ray's task error with the replica's traceback."""
    ray = require_ray()
    try:
        yield
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, SpecMoEError):
            raise SpecMoEError(str(exc.cause)) from None
        raise
