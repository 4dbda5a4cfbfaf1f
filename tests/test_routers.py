"""Each family's router as a pure function of router logits (and biases), checked on its
own: against transformers' router module of the same config on the same random inputs,
and on hand-made logits for what distinguishes it."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("transformers")

from factories import build_config  # noqa: E402

from specmoe.base.model_config import ModelConfig  # noqa: E402
from specmoe.base.specs import RouterSpec  # noqa: E402
from specmoe.model.routers import route, sigmoid_group_topk, sparsemixer  # noqa: E402

# family -> (transformers module, router class, architecture)
ROUTERS = {
    "mixtral": ("mixtral", "MixtralTopKRouter", "MixtralForCausalLM"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeTopKRouter", "Qwen2MoeForCausalLM"),
    "olmoe": ("olmoe", "OlmoeTopKRouter", "OlmoeForCausalLM"),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2TopkRouter", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3TopkRouter", "DeepseekV3ForCausalLM"),
    "glm4_moe": ("glm4_moe", "Glm4MoeTopkRouter", "Glm4MoeForCausalLM"),
    "gpt_oss": ("gpt_oss", "GptOssTopKRouter", "GptOssForCausalLM"),
    "llama4": ("llama4", "Llama4Router", "Llama4ForCausalLM"),
    "phimoe": ("phimoe", "PhimoeTopKRouter", "PhimoeForCausalLM"),
}
CASES = [
    *((f, {}) for f in ROUTERS),
    ("deepseek_v2", {"topk_method": "greedy"}),
    ("deepseek_v3", dict(n_routed_experts=11, num_experts_per_tok=8, n_group=1, topk_group=1)),
    ("glm4_moe", dict(num_experts_per_tok=1, norm_topk_prob=False)),
    ("llama4", dict(num_experts_per_tok=3)),
    ("phimoe", dict(router_jitter_noise=0.01)),
]


def _reference_and_spec(family, overrides):
    module, cls, arch = ROUTERS[family]
    config = build_config(family, **overrides)
    reference = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)(config)
    spec = ModelConfig.from_dict({**config.to_dict(), "architectures": [arch]}).router
    return reference.eval(), spec


def _dense(ids, weights, num_experts):
    return torch.zeros(ids.shape[0], num_experts).scatter_add_(1, ids, weights.float())


@pytest.mark.parametrize(("family", "overrides"), CASES, ids=[f"{f}-{'-'.join(o) or 'default'}" for f, o in CASES])
@torch.no_grad()
def test_router_picks_and_weights_match_transformers(family, overrides):
    reference, spec = _reference_and_spec(family, overrides)
    gen = torch.Generator().manual_seed(0)
    params = dict(reference.named_parameters()) | dict(reference.named_buffers())
    for name, p in params.items():  # correction biases large enough to change picks
        p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if name == "weight" else 0.3))
    x = torch.randn(64, params["weight"].shape[1], generator=gen)

    ours = route(spec, x, params["weight"], params.get("bias"), params.get("e_score_correction_bias"))

    out = reference(x)
    if family == "llama4":  # (scores [T, E] with zeros off the top-k, logits)
        want = out[0].float()
    else:  # (logits, weights [T, K], ids [T, K])
        want = _dense(out[2], out[1], spec.num_experts)
    got = _dense(ours.ids, ours.weights, spec.num_experts)
    assert ((got != 0) == (want != 0)).all(), "different experts picked"
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert ours.ids.shape == (64, spec.top_k) and ours.scales_input == (family == "llama4")


def test_correction_bias_shifts_the_choice_but_not_the_weight():
    spec = RouterSpec("sigmoid_group_topk", top_k=2, num_experts=4, correction_bias=True)
    logits = torch.tensor([[3.0, 2.0, 1.0, -1.0]])
    plain = sigmoid_group_topk(spec, logits)
    biased = sigmoid_group_topk(spec, logits, torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert sorted(plain.ids[0].tolist()) == [0, 1]
    assert sorted(biased.ids[0].tolist()) == [0, 3]
    weight_of_3 = biased.weights[0][biased.ids[0] == 3]
    torch.testing.assert_close(weight_of_3, torch.sigmoid(torch.tensor([-1.0])))  # the unbiased score


def test_group_limited_routing_never_leaves_the_best_groups():
    spec = RouterSpec("sigmoid_group_topk", top_k=2, num_experts=6, num_groups=3, topk_groups=1)
    # group 1 (experts 2, 3) has the best pair; expert 4 alone beats both but its group loses
    logits = torch.tensor([[0.0, -3.0, 2.0, 2.0, 4.0, -5.0]])
    got = sigmoid_group_topk(spec, logits)
    assert sorted(got.ids[0].tolist()) == [2, 3]


def test_sparsemixer_weights_the_best_expert_among_its_near_rivals():
    spec = RouterSpec("sparsemixer", top_k=2, num_experts=4, jitter_eps=0.1)
    logits = torch.tensor([[4.0, 3.9, 1.0, 3.0]])
    got = sparsemixer(spec, logits)
    assert got.ids[0].tolist() == [0, 1]
    # first: softmax over {0, 1} (within 20 % of the best); second: expert 1 among {1} (3.0 is 23 % below 3.9)
    torch.testing.assert_close(got.weights[0], torch.tensor([torch.sigmoid(torch.tensor(0.1)).item(), 1.0]))
