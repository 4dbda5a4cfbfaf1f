"""The tiny-checkpoint factories themselves, checked against transformers only (no specmoe)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from factories import (  # noqa: E402
    FAMILIES,
    LAYOUTS,
    SPECIAL_IDS,
    VOCAB,
    build_model,
    corrupt_truncate,
    drop_tensor,
    hf_greedy,
    hf_greedy_reference,
    hf_logits,
    random_prompts,
    read_config,
    reshape_tensor,
    tensor_shapes,
)

PROMPTS = random_prompts(3, VOCAB, min_len=4, max_len=20, seed=1)


@torch.no_grad()
def _memory_logits(family, prompts, **overrides):
    model = build_model(family, seed=0, **overrides)
    return [model(input_ids=torch.tensor([p])).logits[0] for p in prompts]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_reloads_to_identical_logits(tiny_ckpt, family, layout):
    path = tiny_ckpt(family, layout)
    expected = _memory_logits(family, PROMPTS)
    for got, want in zip(hf_logits(path, PROMPTS), expected):
        assert got.shape == (len(want), VOCAB)
        # Bit-identical except for float rounding of differently laid out expert tensors.
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_sharded_checkpoint_reloads_to_identical_logits(tiny_ckpt, family, layout):
    path = tiny_ckpt(family, layout, shards=2)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensor_shapes(path))
    assert set(index["weight_map"].values()) == set(files)
    for got, want in zip(hf_logits(path, PROMPTS), _memory_logits(family, PROMPTS)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


VARIANTS = [
    ("qwen2_moe", {"decoder_sparse_step": 2, "mlp_only_layers": []}),
    ("olmoe", {"clip_qkv": 1.0}),
    ("qwen3_moe", {"tie_word_embeddings": True}),
]


@pytest.mark.parametrize(("family", "overrides"), VARIANTS, ids=[f for f, _ in VARIANTS])
def test_variant_checkpoints_reload_to_identical_logits(tiny_ckpt, family, overrides):
    path = tiny_ckpt(family, **overrides)
    for got, want in zip(hf_logits(path, PROMPTS), _memory_logits(family, PROMPTS, **overrides)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_sparse_step_variant_makes_only_layer_1_moe(tiny_ckpt):
    shapes = tensor_shapes(tiny_ckpt("qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[]))
    assert [any(k.startswith(f"model.layers.{i}.mlp.experts.") for k in shapes) for i in range(3)] == [
        False,
        True,
        False,
    ]


def test_tied_variant_has_no_lm_head_tensor(tiny_ckpt):
    path = tiny_ckpt("qwen3_moe", tie_word_embeddings=True)
    assert "lm_head.weight" not in tensor_shapes(path)
    assert read_config(path)["tie_word_embeddings"] is True


@pytest.mark.parametrize("family", FAMILIES)
def test_per_expert_and_fused_layouts_hold_the_same_expert_weights(tiny_ckpt, family):
    from safetensors import safe_open

    def tensors(path):
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    per, fused = tensors(tiny_ckpt(family, "per_expert")), tensors(tiny_ckpt(family, "fused"))
    prefix_per = "block_sparse_moe" if family == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    gate_up = fused["model.layers.0.mlp.experts.gate_up_proj"]
    down = fused["model.layers.0.mlp.experts.down_proj"]
    n_experts, two_i, _ = gate_up.shape
    for e in range(n_experts):
        base = f"model.layers.0.{prefix_per}.experts.{e}."
        g, u, d = (per[f"{base}{n}.weight"] for n in names)
        assert torch.equal(gate_up[e, : two_i // 2], g)  # gate rows first
        assert torch.equal(gate_up[e, two_i // 2 :], u)
        assert torch.equal(down[e], d)


def test_qwen2_moe_has_shared_expert_qkv_bias_and_a_dense_layer(tiny_ckpt):
    shapes = tensor_shapes(tiny_ckpt("qwen2_moe"))
    assert shapes["model.layers.0.mlp.shared_expert_gate.weight"] == (1, 32)
    assert shapes["model.layers.0.mlp.shared_expert.gate_proj.weight"] == (24, 32)
    assert shapes["model.layers.0.self_attn.q_proj.bias"] == (32,)
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (40, 32)  # dense MLP layer
    assert not any(k.startswith("model.layers.1.mlp.experts.") for k in shapes)
    assert "model.layers.2.mlp.gate.weight" in shapes


def test_qwen3_moe_has_per_head_qk_norm_explicit_head_dim_and_a_dense_layer(tiny_ckpt):
    path = tiny_ckpt("qwen3_moe")
    shapes, cfg = tensor_shapes(path), read_config(path)
    assert cfg["head_dim"] == 16 != cfg["hidden_size"] // cfg["num_attention_heads"]
    assert cfg["norm_topk_prob"] is True and cfg["mlp_only_layers"] == [2]
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (16,)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (64, 32)
    assert shapes["model.layers.2.mlp.down_proj.weight"] == (32, 40)


def test_olmoe_has_full_width_qk_norm(tiny_ckpt):
    path = tiny_ckpt("olmoe")
    shapes, cfg = tensor_shapes(path), read_config(path)
    assert cfg["norm_topk_prob"] is False
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (32,)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (16,)


def test_mixtral_has_explicit_head_dim(tiny_ckpt):
    cfg = read_config(tiny_ckpt("mixtral"))
    assert cfg["head_dim"] == 16 and cfg["hidden_size"] // cfg["num_attention_heads"] == 8


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_theta_is_not_the_default(tiny_ckpt, family):
    cfg = read_config(tiny_ckpt(family))
    theta = cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta"))
    assert theta not in (None, 10000.0, 1000000.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_random_weights_give_spread_logits_and_varied_routing(family):
    model = build_model(family, seed=0)
    prompt = random_prompts(1, VOCAB, 24, 24, seed=3)[0]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), output_router_logits=True)
    assert out.logits.std() > 0.3
    for router_logits in out.router_logits:
        picks = router_logits.topk(2, dim=-1).indices
        assert len(picks.unique()) >= 5  # most of the 8 experts used over 24 tokens
        assert len({tuple(sorted(p)) for p in picks.tolist()}) >= 4


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_greedy_is_plain_argmax_decoding(tiny_ckpt, family):
    path = tiny_ckpt(family)
    prompt = PROMPTS[0]
    assert hf_greedy(path, prompt, 12) == hf_greedy_reference(path, prompt, 12)


def test_hf_greedy_does_not_stop_or_mask_at_eos(tiny_ckpt):
    prompt = PROMPTS[1]
    first = hf_greedy_reference(tiny_ckpt("mixtral"), prompt, 1)[0]
    # A checkpoint whose eos is exactly the first greedy token: generation must carry on.
    path = tiny_ckpt("mixtral", eos_token_id=first)
    assert read_config(path)["eos_token_id"] == first
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == first
    got = hf_greedy(path, prompt, 8)
    assert got[0] == first and len(got) == 8
    assert got == hf_greedy_reference(path, prompt, 8)


def test_random_prompts_have_distinct_lengths_and_no_special_ids():
    prompts = random_prompts(4, VOCAB, 3, 30, seed=7)
    assert len({len(p) for p in prompts}) == 4
    assert all(3 <= len(p) <= 30 for p in prompts)
    assert not {t for p in prompts for t in p} & set(SPECIAL_IDS)
    assert all(0 <= t < VOCAB for p in prompts for t in p)
    assert prompts == random_prompts(4, VOCAB, 3, 30, seed=7)


def test_drop_tensor_removes_exactly_one_tensor(damaged_ckpt):
    path = damaged_ckpt("mixtral")
    before = tensor_shapes(path)
    name = drop_tensor(path, "layers.1.self_attn.k_proj")
    assert name == "model.layers.1.self_attn.k_proj.weight"
    assert set(before) - set(tensor_shapes(path)) == {name}


def test_reshape_tensor_changes_one_shape(damaged_ckpt):
    path = damaged_ckpt("qwen2_moe")
    name = reshape_tensor(path, "layers.0.mlp.gate.weight")
    assert tensor_shapes(path)[name] == (9, 32)


def test_corrupt_truncate_makes_the_file_unreadable(damaged_ckpt):
    from safetensors import safe_open

    path = damaged_ckpt("olmoe")
    file = corrupt_truncate(path)
    with pytest.raises(Exception):
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():
                f.get_tensor(k)


def test_damaged_checkpoint_is_rejected_by_transformers(damaged_ckpt):
    from factories import _load

    path = damaged_ckpt("mixtral", layout="fused")
    reshape_tensor(path, "layers.0.mlp.experts.down_proj")
    with pytest.raises(Exception):
        _load(path)
