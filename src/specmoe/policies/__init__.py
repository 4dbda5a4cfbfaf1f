"""Which experts go where and when: one small module per policy, one interface (base.py).

`make_policy(runtime)` builds the policy `runtime.options.policy` names; `POLICIES` maps
the names users may pass (besides `auto`, which the API resolves to one of these before
the engine is built: autotune/choose.py).
"""

from __future__ import annotations

from ..base.errors import SpecMoEError
from .base import PASS_KINDS, Policy, Runtime
from .caching import CachingPolicy
from .host import HostPolicy
from .ondemand import OnDemandPolicy
from .overlap import OverlapPolicy
from .resident import ResidentPolicy
from .specmoe import SpecMoEPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (ResidentPolicy, OnDemandPolicy, OverlapPolicy, CachingPolicy, HostPolicy, SpecMoEPolicy)
}


def min_device_bytes(config, options, expert_bytes: int, device, dtype) -> int:
    """Device bytes the policy `options.policy` needs beside weights and KV cache to run
    at all; for `auto`, the least any offloading policy it may choose needs."""
    if options.policy in POLICIES:
        return POLICIES[options.policy].min_device_bytes(config, options, expert_bytes, device, dtype)
    return min(cls.min_device_bytes(config, options, expert_bytes, device, dtype)
               for name, cls in POLICIES.items() if name not in ("resident", "host"))


def make_policy(runtime: Runtime) -> Policy:
    name = runtime.options.policy
    if name not in POLICIES:
        raise SpecMoEError(f"policy {name!r} must be resolved before the engine is built; choose one of: {', '.join(POLICIES)}")
    return POLICIES[name](runtime)


__all__ = ["PASS_KINDS", "POLICIES", "Policy", "Runtime", "make_policy", "min_device_bytes"]
