"""The router and expert dispatch.

Shapes: T tokens, D hidden, E experts, K experts per token, I expert intermediate size.

The router is its own step: `route` returns which experts each token picked and with
what weight. Whoever runs the MoE block (an `ExpertBackend`: a policy) receives that
choice, may change it (a draft substitutes experts it does not hold), makes sure the
experts it computes with are where the compute is, and runs `dispatch`, which groups
tokens by expert so that each expert runs once per pass over all its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .layers import swiglu


@dataclass(frozen=True)
class Routing:
    """The router's choice for T tokens."""

    ids: torch.Tensor  # [T, K] long: chosen experts
    weights: torch.Tensor  # [T, K] float32: their mixing weights

    def with_ids(self, ids: torch.Tensor) -> Routing:
        return Routing(ids, self.weights)


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """softmax over all E experts, then top-k; optionally renormalise the k weights."""
    probs = torch.softmax(torch.nn.functional.linear(x, router_weight).float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(ids, weights)


@dataclass(frozen=True)
class ExpertGroups:
    """Tokens grouped by expert: expert `experts[j]` serves `tokens[j]` with `weights[j]`."""

    experts: list[int]
    counts: list[int]
    tokens: list[torch.Tensor]  # each [n_j] long: token rows
    weights: list[torch.Tensor]  # each [n_j] float32

    def count_of(self) -> dict[int, int]:
        return dict(zip(self.experts, self.counts))


def group_by_expert(routing: Routing, num_experts: int) -> ExpertGroups:
    k = routing.ids.shape[1]
    flat = routing.ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_rows = order // k
    sorted_weights = routing.weights.reshape(-1)[order]
    counts_all = torch.bincount(flat, minlength=num_experts).tolist()  # one host sync per block
    experts, counts, tokens, weights = [], [], [], []
    start = 0
    for expert, n in enumerate(counts_all):
        if n:
            experts.append(expert)
            counts.append(n)
            tokens.append(token_rows[start : start + n])
            weights.append(sorted_weights[start : start + n])
            start += n
    return ExpertGroups(experts, counts, tokens, weights)


def dispatch(x: torch.Tensor, groups: ExpertGroups, compute: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over each token's experts of weight * expert(x); `compute(e, x_e)` runs expert e."""
    return combine(x, groups, [compute(e, x[t]) for e, t in zip(groups.experts, groups.tokens)])


def combine(x: torch.Tensor, groups: ExpertGroups, outputs: list[torch.Tensor]) -> torch.Tensor:
    """Weighted sum of the experts' outputs per token. Added in expert order, whatever
    order the experts were computed in, as the reference adds them."""
    out = torch.zeros_like(x)
    for tokens, weights, y in zip(groups.tokens, groups.weights, outputs):
        out.index_add_(0, tokens, (y * weights[:, None]).to(out.dtype))
    return out


def expert_views(buffer: torch.Tensor, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one expert's contiguous buffer: gate_up [2I, D] and down [D, I]."""
    split = 2 * inter * hidden
    return buffer[:split].view(2 * inter, hidden), buffer[split:].view(hidden, inter)


def run_expert(buffer: torch.Tensor, x: torch.Tensor, hidden: int, inter: int) -> torch.Tensor:
    gate_up, down = expert_views(buffer, hidden, inter)
    return swiglu(x, gate_up, down)


class ExpertBackend(Protocol):
    """Runs the routed experts of MoE blocks: where they live and when they move."""

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Routed-expert output [T, D] for x [T, D] under the router's choice."""

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        """Called with each decoder layer's output (a policy may prefetch for the next)."""
