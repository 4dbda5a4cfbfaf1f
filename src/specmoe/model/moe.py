"""The router's choice and expert dispatch.

Shapes: T tokens, D hidden, E experts, K experts per token, I expert intermediate size,
R rows of an expert's first projection (2I gated, I plain).

The router is its own step (routers.py, one pure function per family): it returns which
experts each token picked and with what weight. Whoever runs the MoE block (an `ExpertBackend`: a policy) receives that
choice, may change it (a draft substitutes experts it does not hold), makes sure the
experts it computes with are where the compute is, and runs `dispatch`, which groups
tokens by expert so that each expert runs once per pass over all its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from ..base.specs import ExpertSpec
from .layers import as_dtype, expert_activation


@dataclass(frozen=True)
class Routing:
    """The router's choice for T tokens."""

    ids: torch.Tensor  # [T, K] long: chosen experts
    weights: torch.Tensor  # [T, K] float32: their mixing weights
    scales_input: bool = False  # weights multiply each expert's input, not its output (Llama 4)

    def with_ids(self, ids: torch.Tensor) -> Routing:
        return Routing(ids, self.weights, self.scales_input)


@dataclass(frozen=True)
class ExpertGroups:
    """Tokens grouped by expert: the block's picks sorted by expert (stably: an expert's
    tokens stay in order); expert `experts[j]` serves the `counts[j]` picks from
    `starts[j]` on: token rows `rows[a:b]` with mixing weights `weights[a:b]`."""

    experts: list[int]
    counts: list[int]
    rows: torch.Tensor  # [P] long: each pick's token row, P = T * K
    weights: torch.Tensor  # [P] float32
    starts: list[int]
    scales_input: bool = False

    def count_of(self) -> dict[int, int]:
        return dict(zip(self.experts, self.counts))

    def inputs(self, x: torch.Tensor, j: int) -> torch.Tensor:
        """What expert `experts[j]` computes on: its tokens' rows of x (scaled by their
        weights where the family weights inputs)."""
        a, b = self.starts[j], self.starts[j] + self.counts[j]
        xs = x[self.rows[a:b]]
        return (xs * self.weights[a:b, None]).to(x.dtype) if self.scales_input else xs

    def split_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`inputs(x, j)` of every j at once: one gather for the block, then views."""
        xs = x[self.rows]
        if self.scales_input:
            xs = (xs * self.weights[:, None]).to(x.dtype)
        return xs.split(self.counts)


def group_by_expert(routing: Routing, num_experts: int) -> ExpertGroups:
    k = routing.ids.shape[1]
    flat = routing.ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts_all = torch.bincount(flat, minlength=num_experts).tolist()  # one host sync per block
    experts = [e for e, n in enumerate(counts_all) if n]
    counts = [counts_all[e] for e in experts]
    starts = list(accumulate(counts[:-1], initial=0))
    return ExpertGroups(experts, counts, torch.div(order, k, rounding_mode="floor"), routing.weights.reshape(-1)[order],
                        starts, routing.scales_input)


def dispatch(x: torch.Tensor, groups: ExpertGroups, compute: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over each token's experts of weight * expert(x); `compute(e, x_e)` runs expert e."""
    return combine(x, groups, [compute(e, xs) for e, xs in zip(groups.experts, groups.split_inputs(x))])


def combine(x: torch.Tensor, groups: ExpertGroups, outputs: list[torch.Tensor]) -> torch.Tensor:
    """Weighted sum of the experts' outputs per token (`outputs[j]` is expert
    `experts[j]`'s, whatever order they were computed in). One weighting and one indexed
    add for the block: each token's outputs are added in expert order, as the reference
    adds them."""
    if not outputs:
        return torch.zeros_like(x)
    y = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    if not groups.scales_input:
        y = y * groups.weights[:, None]
    return torch.zeros_like(x).index_add_(0, groups.rows, as_dtype(y, x.dtype))


@dataclass(frozen=True)
class ExpertViews:
    """One expert's tensors, viewed in its contiguous buffer (layout: `ExpertSpec`)."""

    w_in: torch.Tensor  # [R, D]: gate rows, then up rows
    w_out: torch.Tensor  # [D, I]
    b_in: torch.Tensor | None = None  # [R]
    b_out: torch.Tensor | None = None  # [D]


def expert_views(buffer: torch.Tensor, spec: ExpertSpec) -> ExpertViews:
    R, D, I = spec.in_rows, spec.hidden, spec.inter
    a, b = R * D, R * D + D * I
    w_in, w_out = buffer[:a].view(R, D), buffer[a:b].view(D, I)
    if not spec.bias:
        return ExpertViews(w_in, w_out)
    return ExpertViews(w_in, w_out, buffer[b : b + R], buffer[b + R : b + R + D])


def expert_forward(spec: ExpertSpec, x: torch.Tensor, linear_in, linear_out, b_in=None, b_out=None) -> torch.Tensor:
    """out(act(in(x) + b_in)) + b_out, the projections given as functions (plain matrices
    or quantized copies)."""
    h = linear_in(x)
    if b_in is not None:
        h = h + b_in
    y = linear_out(expert_activation(spec, h))
    return y if b_out is None else y + b_out


def run_expert(buffer: torch.Tensor, x: torch.Tensor, spec: ExpertSpec) -> torch.Tensor:
    """One routed expert on x [T, D] from its contiguous buffer."""
    v = expert_views(buffer, spec)
    return expert_forward(spec, x, lambda t: F.linear(t, v.w_in), lambda t: F.linear(t, v.w_out), v.b_in, v.b_out)


# --- one grouped computation per block --------------------------------------------------------------
# Instead of a Python loop over experts (a dozen operators each), a block's picks are
# sorted by expert once and every expert runs in one grouped matmul per projection
# (torch._grouped_mm where it exists: per group the same product F.linear computes).


@dataclass(frozen=True)
class SortedPicks:
    """A block's T x K picks sorted by expert, stably (an expert's tokens stay in order).
    Pick j is token `rows[j]` for expert `experts[j]` with mixing weight `weights[j]`;
    `offsets[e]` (int32) ends expert e's picks, over all E experts (empty groups allowed)."""

    rows: torch.Tensor  # [P] long, P = T * K
    weights: torch.Tensor  # [P, 1] float32
    experts: torch.Tensor  # [P] long, ascending
    counts: torch.Tensor  # [E] long
    offsets: torch.Tensor  # [E] int32
    scales_input: bool = False

    def present(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the experts with picks [n], ascending; their offsets [n]): the groups of a
        computation over those experts' weights only."""
        used = self.counts > 0
        return torch.nonzero(used).flatten(), self.offsets[used]


def sort_picks(routing: Routing, num_experts: int) -> SortedPicks:
    k = routing.ids.shape[1]
    flat = routing.ids.reshape(-1)
    experts, order = torch.sort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return SortedPicks(torch.div(order, k, rounding_mode="floor"), routing.weights.reshape(-1, 1)[order], experts,
                       counts, counts.cumsum(0, dtype=torch.int32), routing.scales_input)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                   ends: list[int] | None = None) -> torch.Tensor:
    """x [P, in] in groups ending at `offsets` [G] -> [P, out]: group g times weight[g]^T
    ([G, out, in]). One grouped matmul on the CPU (torch >= 2.8). A loop over the groups
    that have rows instead when the caller passes the offsets on the host (`ends`, as
    offsets.tolist(): it chose the loop), or off the CPU, where the fused kernel wants
    other dtypes and alignments."""
    if ends is None and x.device.type == "cpu" and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    ends = offsets.tolist() if ends is None else ends  # one host sync
    starts = [0] + ends[:-1]
    outs = [F.linear(x[a:b], weight[g]) for g, (a, b) in enumerate(zip(starts, ends)) if b > a]
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def stacked_views(buffers: torch.Tensor, spec: ExpertSpec) -> ExpertViews:
    """Views of G experts' tensors [G, ...] in a [G, numel] stack of their buffers."""
    R, D, I = spec.in_rows, spec.hidden, spec.inter
    a, b = R * D, R * D + D * I
    w_in, w_out = buffers[:, :a].view(-1, R, D), buffers[:, a:b].view(-1, D, I)
    if not spec.bias:
        return ExpertViews(w_in, w_out)
    return ExpertViews(w_in, w_out, buffers[:, b : b + R], buffers[:, b + R : b + R + D])


def grouped_experts(spec: ExpertSpec, x: torch.Tensor, picks: SortedPicks, w: ExpertViews,
                    offsets: torch.Tensor) -> torch.Tensor:
    """The block's routed output [T, D]: the picks in the groups `offsets` ends (over all
    E experts: picks.offsets; over some, as `present` gives them) with the matching
    stacked weights `w` (biases, if any, stacked over all E: indexed by expert).
    Outputs are added per token in expert order, as `combine` adds them."""
    xs = x[picks.rows]
    if picks.scales_input:
        xs = (xs * picks.weights).to(x.dtype)
    # A quarter as many picks as groups or fewer (batch 1 or 2): most groups would be empty,
    # and the CPU's grouped matmul still visits each; a loop over the groups with rows is
    # cheaper there (a decode step 6 % faster at batch 1; at batch 4 the loop was 2 %
    # slower, so larger batches keep the grouped matmul).
    ends = offsets.tolist() if 4 * xs.shape[0] <= offsets.shape[0] else None
    h = grouped_linear(xs, w.w_in, offsets, ends)
    if w.b_in is not None:
        h = h + w.b_in[picks.experts].to(h.dtype)
    y = grouped_linear(expert_activation(spec, h), w.w_out, offsets, ends)
    if w.b_out is not None:
        y = y + w.b_out[picks.experts].to(y.dtype)
    if not picks.scales_input:
        y = y * picks.weights
    return torch.zeros_like(x).index_add_(0, picks.rows, as_dtype(y, x.dtype))


def one_token(x: torch.Tensor, routing: Routing, compute: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`dispatch` for a single token x [1, D] (batch-1 decoding): its K experts one after
    another (`compute(e, x_e)` runs expert e), with no sorting or grouping. Added in expert
    order from the first output on, as `combine` adds them into zeros (0 + a + b == a + b)."""
    ids = routing.ids[0].tolist()  # one host sync
    weights = routing.weights.unbind(1)  # K tensors [1]
    out = None
    for k in sorted(range(len(ids)), key=ids.__getitem__):
        xs = (x * weights[k]).to(x.dtype) if routing.scales_input else x
        y = compute(ids[k], xs)
        y = as_dtype(y if routing.scales_input else y * weights[k], x.dtype)
        out = y if out is None else out + y
    return out


def picks_in_order(routing: Routing) -> tuple[list[int], list[float]]:
    """A single token's experts in ascending order (the order `one_token` adds them in)
    with their mixing weights (one host sync)."""
    ids, weights = routing.ids[0].tolist(), routing.weights[0].tolist()
    order = sorted(range(len(ids)), key=ids.__getitem__)
    return [ids[k] for k in order], [weights[k] for k in order]


def one_token_experts(spec: ExpertSpec, x: torch.Tensor, routing: Routing, experts: list[ExpertViews]) -> torch.Tensor:
    """`one_token` over float experts (`experts[e]`: expert e's views), as `grouped_experts` computes them."""
    def compute(e: int, xs: torch.Tensor) -> torch.Tensor:
        w = experts[e]
        return expert_forward(spec, xs, lambda t: F.linear(t, w.w_in), lambda t: F.linear(t, w.w_out), w.b_in, w.b_out)
    return one_token(x, routing, compute)


class ExpertBackend(Protocol):
    """Runs the routed experts of MoE blocks: where they live and when they move."""

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Routed-expert output [T, D] for x [T, D] under the router's choice."""

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        """Called with each decoder layer's output (a policy may prefetch for the next)."""
