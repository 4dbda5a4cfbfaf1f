"""Routers: each family's choice of experts as a pure function of a block's router logits.

Shapes: T tokens, E experts, K experts per token, G expert groups. Logits are float32
[T, E] (router projection plus its bias, if any); every function returns a `Routing`: the
K chosen expert ids and their float32 mixing weights, as the reference computes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..base.specs import RouterSpec
from ..kernels import blockdot
from .layers import as_float32
from .moe import Routing


def softmax_topk(spec: RouterSpec, logits: torch.Tensor, bias=None) -> Routing:
    """softmax over all E, top-K, optionally renormalised (Mixtral, Qwen, OLMoE, DeepSeek-V2 greedy)."""
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(ids, weights * spec.scaling if spec.scaling != 1.0 else weights)


def _best_groups(scores: torch.Tensor, spec: RouterSpec, group_score) -> torch.Tensor:
    """[T, E] bool: experts in the `topk_groups` groups whose `group_score` is highest."""
    T, E, G = scores.shape[0], spec.num_experts, spec.num_groups
    per_group = group_score(scores.view(T, G, E // G))  # [T, G]
    chosen = torch.topk(per_group, spec.topk_groups, dim=-1, sorted=False).indices
    mask = torch.zeros_like(per_group, dtype=torch.bool).scatter_(1, chosen, True)
    return mask[:, :, None].expand(T, G, E // G).reshape(T, E)


def group_limited_softmax(spec: RouterSpec, logits: torch.Tensor, bias=None) -> Routing:
    """DeepSeek-V2 group_limited_greedy: softmax; groups ranked by their best expert; top-K
    within the chosen groups; weights scaled by routed_scaling_factor."""
    scores = torch.softmax(logits, dim=-1)
    keep = _best_groups(scores, spec, lambda g: g.max(dim=-1).values)
    weights, ids = torch.topk(scores.masked_fill(~keep, 0.0), spec.top_k, dim=-1)
    return Routing(ids, weights * spec.scaling)


def sigmoid_group_topk(spec: RouterSpec, logits: torch.Tensor, bias: torch.Tensor | None = None) -> Routing:
    """DeepSeek-V3 / GLM-4.5: sigmoid scores; the correction bias shifts the choice only;
    groups ranked by the sum of their two best biased scores; top-K in the chosen groups;
    weights = unbiased scores, renormalised if norm_topk_prob, times routed_scaling_factor."""
    scores = torch.sigmoid(logits)
    choice = scores if bias is None else scores + bias
    keep = _best_groups(choice, spec, lambda g: g.topk(min(2, g.shape[-1]), dim=-1).values.sum(dim=-1))
    ids = torch.topk(choice.masked_fill(~keep, float("-inf")), spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(ids, weights * spec.scaling)


def topk_softmax(spec: RouterSpec, logits: torch.Tensor, bias=None) -> Routing:
    """GPT-OSS: top-K of the logits, softmax over those K only."""
    top, ids = torch.topk(logits, spec.top_k, dim=-1)
    return Routing(ids, torch.softmax(top, dim=-1))


def topk_sigmoid(spec: RouterSpec, logits: torch.Tensor, bias=None) -> Routing:
    """Llama 4: top-K of the logits, each weighted by its sigmoid; the weight scales the
    expert's input (`scales_input`), not its output."""
    top, ids = torch.topk(logits, spec.top_k, dim=-1)
    return Routing(ids, torch.sigmoid(top), scales_input=True)


def sparsemixer(spec: RouterSpec, logits: torch.Tensor, bias=None) -> Routing:
    """Phi-3.5-MoE at inference: the best expert, weighted by its softmax among the experts
    within a relative distance 2*eps of it; then the same among the rest for the second."""
    ids, weights = [], []
    remaining = logits
    for _ in range(2):
        best, index = remaining.max(dim=-1, keepdim=True)
        factor = logits.abs().clamp(min=best)
        far = (best - logits) / factor > 2 * spec.jitter_eps
        gates = torch.softmax(remaining.masked_fill(far, float("-inf")), dim=-1)
        ids.append(index)
        weights.append(gates.gather(-1, index))
        remaining = torch.scatter(logits, -1, torch.cat(ids, dim=-1), float("-inf"))
    return Routing(torch.cat(ids, dim=-1), torch.cat(weights, dim=-1))


def top2_all(spec: RouterSpec, logits: torch.Tensor, bias=None) -> Routing:
    """NLLB-MoE at inference (second-expert policy "all", the evaluation capacity keeping
    every token, so a token's experts never depend on its batch): the most probable
    expert, then the best other by logit; both probabilities renormalised over the two,
    times 1 - moe_token_dropout (`scaling`)."""
    probs = torch.softmax(logits, dim=-1)
    first = probs.argmax(dim=-1, keepdim=True)
    second = logits.scatter(-1, first, float("-inf")).argmax(dim=-1, keepdim=True)
    ids = torch.cat([first, second], dim=-1)
    picked = probs.gather(-1, ids)
    weights = picked / picked.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(picked.dtype).eps)
    return Routing(ids, weights * spec.scaling)


ROUTERS = {
    "softmax_topk": softmax_topk,
    "group_limited_softmax": group_limited_softmax,
    "sigmoid_group_topk": sigmoid_group_topk,
    "topk_softmax": topk_softmax,
    "topk_sigmoid": topk_sigmoid,
    "sparsemixer": sparsemixer,
    "top2_all": top2_all,
}


def route(spec: RouterSpec, x: torch.Tensor, weight: torch.Tensor, logit_bias: torch.Tensor | None = None,
          correction_bias: torch.Tensor | None = None, invariant: bool = False) -> Routing:
    """The block's choice for x [T, D]: logits in float32, then the family's router."""
    if invariant:  # one order of additions per row: the same choice in every pass (blockdot.matmul_f32)
        logits = blockdot.matmul_f32(x, weight)
        logits = logits if logit_bias is None else logits + as_float32(logit_bias)
    else:
        logits = F.linear(as_float32(x), as_float32(weight), None if logit_bias is None else as_float32(logit_bias))
    return ROUTERS[spec.kind](spec, logits, correction_bias)
