"""Model shapes: presets match the published sizes; config.json parsing per family."""

import json

import pytest

from specmoe.costmodel.shapes import PRESETS, load_shape, shape_from_config

GB = 1e9


def test_mixtral_8x7b_expert_is_352_mb_in_bf16():
    s = PRESETS["mixtral-8x7b"]
    assert s.expert_bytes == 3 * 4096 * 14336 * 2
    assert s.expert_bytes / 1e6 == pytest.approx(352.3, abs=0.1)


def test_mixtral_8x7b_splits_into_90_gb_experts_and_3_gb_rest():
    s = PRESETS["mixtral-8x7b"]
    assert s.expert_bytes_total / GB == pytest.approx(90.2, abs=0.3)
    assert s.non_expert_bytes / GB == pytest.approx(3.2, abs=0.1)
    assert (s.expert_bytes_total + s.non_expert_bytes) / 2 / GB == pytest.approx(46.7, abs=0.2)  # params


def test_nllb_encoder_and_decoder_have_six_moe_layers_each_of_128_two_matrix_experts():
    s = PRESETS["nllb-moe-54b"]
    assert s.encoder_layers == 24 and s.step_layers == 24
    assert s.moe_layers == (3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47)
    assert s.step_moe_layers == s.encoder_moe_layers == 6
    assert s.expert_bytes == 2 * 2048 * 8192 * 2
    assert (s.expert_bytes_total + s.non_expert_bytes) / 2 / 1e9 == pytest.approx(54.5, abs=0.5)  # 54.5 B params


@pytest.mark.parametrize("name,params_b", [("llama-4-scout", 109), ("qwen3-30b-a3b", 30.5),
                                           ("mixtral-8x22b", 141), ("deepseek-v2-lite", 15.7),
                                           ("deepseek-v3", 671), ("kimi-k2", 1040), ("glm-4.5-air", 106),
                                           ("gpt-oss-120b", 117), ("gpt-oss-20b", 21), ("qwen3-235b-a22b", 235)])
def test_preset_total_parameters_match_the_model_card(name, params_b):
    s = PRESETS[name]
    assert s.total_bytes / s.bytes_per_param / 1e9 == pytest.approx(params_b, rel=0.06)


def test_flops_per_token_grow_with_context():
    s = PRESETS["mixtral-8x7b"]
    assert s.flops_per_token(4096) > s.flops_per_token(0)
    # about 2 x active parameters (12.9 B) at zero context
    assert s.flops_per_token(0) / 2e9 == pytest.approx(12.9, rel=0.05)


def _write(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_mixtral_config_reads_like_the_preset(tmp_path):
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_local_experts": 8,
           "num_experts_per_tok": 2, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 32000, "torch_dtype": "bfloat16", "head_dim": None}
    s = shape_from_config(_write(tmp_path, cfg))
    p = PRESETS["mixtral-8x7b"]
    assert (s.expert_bytes, s.non_expert_bytes, s.moe_layers, s.head_dim) == \
        (p.expert_bytes, p.non_expert_bytes, p.moe_layers, 128)


def test_qwen2_moe_config_honours_sparse_step_mlp_only_layers_and_shared_expert(tmp_path):
    cfg = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 6, "num_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 128,
           "shared_expert_intermediate_size": 96, "decoder_sparse_step": 2, "mlp_only_layers": [3],
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "dtype": "float32"}
    s = shape_from_config(_write(tmp_path, cfg) / "config.json")
    assert s.moe_layers == (1, 5)
    assert s.shared_expert_intermediate == 96 and s.dense_intermediate == 128
    assert s.bytes_per_param == 4 and s.head_dim == 16


def test_qwen3_moe_and_olmoe_configs_parse(tmp_path):
    q = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_experts": 128,
         "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16"}
    s = shape_from_config(_write(tmp_path, q))
    assert s.expert_bytes == PRESETS["qwen3-30b-a3b"].expert_bytes and s.num_moe_layers == 48
    o = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 2048, "num_hidden_layers": 16, "num_experts": 64,
         "num_experts_per_tok": 8, "intermediate_size": 1024, "num_attention_heads": 16, "vocab_size": 50304}
    assert shape_from_config(_write(tmp_path, o)).expert_intermediate == 1024


def test_unsupported_family_names_the_supported_ones(tmp_path):
    with pytest.raises(ValueError, match="MixtralForCausalLM, Qwen2MoeForCausalLM"):
        shape_from_config(_write(tmp_path, {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))


def test_unknown_shape_name_lists_presets():
    with pytest.raises(ValueError, match="nllb-moe-54b"):
        load_shape("gpt-5")


def test_mla_presets_cache_the_latent_not_full_keys_and_values():
    s = PRESETS["deepseek-v3"]
    assert s.kv_bytes_per_token == 61 * (512 + 64) * 2  # 70 kB: the latent and the rotary key, bf16
    assert s.kv_bytes_per_token * 60 < 61 * 128 * (192 + 128) * 2  # K (192) and V (128) of 128 heads: 68x more


def test_windowed_layers_cache_at_most_their_window():
    s = PRESETS["gpt-oss-120b"]
    per_layer = s.kv_bytes_per_token // s.num_layers
    assert s.kv_bytes_per_sequence(100) == 36 * 100 * per_layer
    assert s.kv_bytes_per_sequence(4096) == (18 * 4096 + 18 * 128) * per_layer


def test_a_deepseek_config_reads_to_its_mla_shape(tmp_path):
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "num_hidden_layers": 61,
           "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "intermediate_size": 18432,
           "n_shared_experts": 1, "first_k_dense_replace": 3, "num_attention_heads": 128, "num_key_value_heads": 128,
           "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
           "v_head_dim": 128, "n_group": 8, "topk_group": 4, "vocab_size": 129280, "torch_dtype": "bfloat16",
           "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}
    s, p = shape_from_config(_write(tmp_path, cfg)), PRESETS["deepseek-v3"]
    assert (s.moe_layers, s.kv_bytes_per_token, s.attention_params, s.expert_bytes, s.non_expert_bytes) == \
        (p.moe_layers, p.kv_bytes_per_token, p.attention_params, p.expert_bytes, p.non_expert_bytes)
