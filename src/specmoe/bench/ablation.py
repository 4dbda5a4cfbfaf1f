"""The paper's ablations (draft set, substitution, N, gamma, ...), each a set of specmoe variants at one batch size.

Every ablation also runs `ondemand` in the same rotation: throughput is reported as a
ratio to it, and every variant's tokens must equal its tokens (ondemand's equal
resident's: the main grid and the policy tests check that).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..base.config import MAX_GAMMA
from ..base.errors import SpecMoEError

ABLATIONS = ("draft-set", "substitution", "draft-experts", "gamma", "draft-compute", "draft-quant", "draft-dense",
             "draft-memory", "draft-split")
# the draft-memory curve: draft bytes as shares of all expert bytes, and what holds them
DRAFT_MEMORY_SHARES = (0.02, 0.05, 0.1, 0.2, 0.4)
DRAFT_MEMORY_WAYS = (("allocated", "auto"), ("int8", "int8"), ("int4", "int4"), ("int3", "int3"), ("int2", "int2"),
                     ("paper", "none"))
# the draft-split curve: one budget, the draft's share of what it leaves for experts, and
# what holds it (the allocator's mix, or one fused copy format); plus --draft-memory auto
DRAFT_SPLIT_SHARES = (0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
DRAFT_SPLIT_WAYS = (("allocated", "auto"), ("int8", "int8"), ("int4", "int4"))
CURVE_WAYS = tuple(label for label, _ in DRAFT_MEMORY_WAYS)  # --ablation-draft-ways picks among them

# The paper's ablations are of its draft: N full-precision experts per block plus substitutes.
# They run with draft_quant="none" whatever the run's --draft-quant (quantized copies of
# every expert leave nothing to choose or substitute).
PAPER_DRAFT = {"draft_quant": "none"}

WHAT = {
    "draft-set": "which experts draft: temporal-hot (refreshed from the last verify pass, the paper's), "
                 "global-hot (most used in profiling), random",
    "substitution": "a pick outside the draft set is replaced by the nearest draft expert by weight distance "
                    "(affinity) or by a random draft expert",
    "draft-experts": "N draft experts per MoE block, N = 2, 4, 8, 16 below the block's expert count (the budget is "
                     "raised where N does not fit it; see device_memory in the JSON)",
    "gamma": "draft tokens per speculative step (with the run's --draft-quant)",
    "draft-compute": "draft on the device with substitutes (device) vs computing non-resident experts on the host "
                     "with the exact router (host)",
    "draft-quant": "what drafts: the paper's N resident experts plus substitutes (none) vs quantized copies of every "
                   "expert on the device (int8, int4); verification stays full precision",
    "draft-dense": "the draft's attention projections and LM head multiplied in the compute dtype (none) or kept "
                   "in bfloat16 where the checkpoint is (bfloat16); exact passes widen them back, so tokens never change",
    "draft-memory": "what the draft holds in --draft-memory bytes (a share of all expert bytes, added to the run's "
                    "budget so that verification keeps the same pool): each expert's precision chosen (allocated), "
                    "one precision for the experts it can hold (int8 .. int2, the rest substituted), or the "
                    "paper's full-precision draft experts (paper)",
    "draft-split": "one device budget split between the draft and verification's pool: --draft-memory as a share of "
                   "the bytes the budget leaves for experts, held as the allocator chooses (allocated) or in one "
                   "copy format (int8, int4), and the split --draft-memory auto predicts fastest (planner)",
}


@dataclass
class Variant:
    label: str
    options: dict  # engine options over the run's
    fields: dict = field(default_factory=dict)  # recorded with each record


def parse_ablations(text: str | None) -> list[str]:
    if not text:
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(ABLATIONS)
    for n in names:
        if n not in ABLATIONS:
            raise SpecMoEError(f"unknown --ablation {n!r}; choose from: {', '.join(ABLATIONS)} (comma-separated) or all")
    return list(dict.fromkeys(names))


def variants(name: str, num_experts: int, gamma: int, quick: bool, gammas: list[int] | None = None,
             expert_bytes: int = 0, shares: list[float] | None = None,
             ways: tuple[str, ...] | None = None) -> list[Variant]:
    """The ablation's specmoe variants; `expert_bytes`: the draft-memory curve's unit (all expert bytes;
    draft-split: what the budget leaves for experts), `shares`: the curve's points (None: its default list),
    `ways`: the curves' ways to run (None: every one)."""
    if name == "draft-set":
        return [Variant(s, {"draft_set": s, **PAPER_DRAFT}, {"draft_set": s}) for s in ("temporal-hot", "global-hot", "random")]
    if name == "substitution":
        return [Variant(s, {"substitution": s, **PAPER_DRAFT}, {"substitution": s}) for s in ("affinity", "random")]
    if name == "draft-experts":
        # N = E would make the draft the full model (nothing to substitute): below E only.
        ns = [n for n in (2, 4, 8, 16) if n < num_experts] or [max(1, num_experts - 1)]
        return [Variant(f"N={n}", {"draft_experts": n, **PAPER_DRAFT}, {"draft_experts": n}) for n in ns]
    if name == "gamma":
        # 1 to 10 one by one, then the long drafts that pay where verification is transfer-bound
        gs = gammas or ((1, 3, 5, 10) if quick else (*range(1, 11), 16, 24, MAX_GAMMA))
        return [Variant(f"gamma={g}", {"gamma": g, "adapt_gamma": False}, {"gamma": g}) for g in gs]
    if name == "draft-compute":
        return [Variant(f"draft on {c}", {"draft_compute": c, **PAPER_DRAFT}, {"draft_compute": c}) for c in ("device", "host")]
    if name == "draft-quant":
        return [Variant(f"draft {q}", {"draft_quant": q}, {}) for q in ("none", "int8", "int4")]
    if name == "draft-memory":
        shares = shares or ((0.05, 0.2) if quick else DRAFT_MEMORY_SHARES)
        return [Variant(f"{label} {share:.0%}", {"draft_quant": quant, "draft_memory": int(share * expert_bytes)},
                        {"draft_memory_share": share, "draft_way": label})
                for share in shares for label, quant in DRAFT_MEMORY_WAYS if label in (ways or (label,))]
    if name == "draft-split":  # expert_bytes: the bytes the run's budget leaves for experts
        shares = shares or ((0.2, 0.7) if quick else DRAFT_SPLIT_SHARES)
        return [Variant("planner", {"draft_memory": "auto"}, {"draft_way": "planner"})] + [
            Variant(f"{label} {share:.0%}", {"draft_quant": quant, "draft_memory": int(share * expert_bytes)},
                    {"draft_split_share": share, "draft_way": label})
            for share in shares for label, quant in DRAFT_SPLIT_WAYS if label in (ways or (label,))]
    if name == "draft-dense":
        return [Variant(f"dense {d}", {"draft_dense": d}, {"draft_dense": d}) for d in ("none", "bfloat16")]
    raise ValueError(name)
