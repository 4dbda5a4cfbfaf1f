"""Expert placement and movement policies, one small module each, one interface.

`make_policy(name, runtime)` builds one; `POLICIES` lists the names users may pass.
"""

from __future__ import annotations

from ..errors import SpecMoEError
from .base import Policy, Runtime
from .caching import CachingPolicy
from .host import HostPolicy
from .ondemand import OnDemandPolicy
from .overlap import OverlapPolicy
from .resident import ResidentPolicy
from .specmoe import SpecMoEPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (ResidentPolicy, OnDemandPolicy, OverlapPolicy, CachingPolicy, HostPolicy, SpecMoEPolicy)
}


def make_policy(name: str, runtime: Runtime) -> Policy:
    if name == "auto":
        from dataclasses import replace

        from .auto import choose

        chosen, options, plan = choose(runtime)
        policy = POLICIES[chosen](replace(runtime, options=options))
        policy.auto_plan = plan.describe()
        return policy
    if name not in POLICIES:
        raise SpecMoEError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}, auto")
    return POLICIES[name](runtime)


__all__ = ["POLICIES", "Policy", "Runtime", "make_policy"]
