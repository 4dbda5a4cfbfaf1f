"""SpecMoE's expert side: the policy (policy.py), the draft pass's experts (draft.py),
choosing the draft set (draft_set.py: temporal hotness, global, random) and the
affinity table for substitution (affinity.py)."""

from .policy import WORKING_SLOTS, SpecMoEPolicy

__all__ = ["SpecMoEPolicy", "WORKING_SLOTS"]
