"""The CLI on a tiny checkpoint (in-process): JSON output, prompt files, info."""

import json
from pathlib import Path

import pytest
from factories import run_cli
from safetensors import safe_open


@pytest.fixture
def run(capsys):
    def specmoe(*args):
        code, out, err = run_cli(capsys, *args)
        assert code == 0, err
        return out
    return specmoe


def test_generate_json_prints_one_object_with_stats_and_outputs(tiny_ckpt, tmp_path, run):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in ([5, 6, 7], [9, 10], [11, 12, 13, 14])))
    out = json.loads(run("generate", "--model", tiny_ckpt("olmoe"), "--prompts-file", path, "--max-tokens", 6,
                         "--ignore-eos", "--batch-size", 2, "--json"))
    assert [len(o["token_ids"]) for o in out["outputs"]] == [6, 6, 6]
    assert all(o["finish_reason"] == "length" for o in out["outputs"])
    stats = out["stats"]
    for key in ("policy", "batch_size", "gamma", "draft_experts", "prompt_tokens", "generated_tokens", "wall_s",
                "decode_tokens_per_s", "ttft_s", "tbt_s", "steps", "tokens_per_step", "acceptance_rate",
                "transfer_bytes", "transfer_bytes_per_token", "device_peak_bytes", "cache_hit_rate", "token_ids_sha256"):
        assert key in stats, key
    assert stats["generated_tokens"] == 18 and stats["prompt_tokens"] == 9 and stats["batch_size"] == 2


def test_info_json_reports_bytes_and_fit(tiny_ckpt, run):
    path = tiny_ckpt("qwen2_moe")
    expert = 3 * 32 * 16 * 4  # gate, up, down of hidden 32 x 16, float32
    # counted independently: the checkpoint's tensors that are not routed experts, and the
    # K/V of 2 sequences x 32 positions (3 layers, K and V, 2 KV heads of 32 / 4 = 8, float32)
    with safe_open(next(Path(path).glob("*.safetensors")), "pt") as f:
        non_expert = sum(f.get_tensor(k).nbytes for k in f.keys() if ".mlp.experts." not in k)
    kv = 2 * 32 * (3 * 2 * 2 * 8 * 4)
    budget = non_expert + kv + 5 * expert + expert // 2  # room for five experts and a half
    info = json.loads(run("info", "--model", path, "--device-memory", budget, "--batch-size", 2, "--max-model-len", 32,
                          "--json"))
    assert info["family"] == "qwen2_moe" and info["experts_per_block"] == 8 and info["moe_layers"] == 2
    assert info["expert_bytes"] == expert and info["expert_bytes_total"] == 16 * expert
    assert (info["non_expert_bytes"], info["kv_reserved_bytes"]) == (non_expert, kv)
    assert (info["experts_fit"], info["experts_fit_per_block"]) == (5, 2) and "policies_fit" in info
    # on the CPU the budget is the process's memory: its stated bound, 1.15 x the budget + 256 MiB, or the
    # process's own memory before any weight + 100 MiB where more (torch's CUDA build: Python 3.10 here)
    allowance = max(256 << 20, info["host_fixed_bytes"] + (100 << 20))
    assert info["host_peak_bound_bytes"] == int(budget * 1.15) + allowance


def test_info_says_which_fused_kernel_each_draft_matrix_would_take(tiny_ckpt, run):
    info = json.loads(run("info", "--model", tiny_ckpt("mixtral"), "--json"))
    kernels = info["fused_kernels"]  # the tiny Mixtral: hidden 32, experts 24 wide
    assert kernels["draft int8 N=32 K=24"].startswith("portable: K = 24 is not a multiple of 16")
    assert set(kernels) == {"draft int8 N=48 K=32", "draft int8 N=32 K=24", "draft int4 N=48 K=32 group=32",
                            "draft int4 N=32 K=24 group=24"}


def test_info_reports_draft_quantization_error_per_block(tiny_ckpt, run):
    info = json.loads(run("info", "--model", tiny_ckpt("mixtral"), "--draft-quant", "int8", "--json"))
    errors = info["draft_quant_error"]
    assert len(errors) == 2 and all(0 <= e["mean_rel_l2"] < 0.05 for e in errors.values())
