"""Bad input: one line on stderr naming the problem and the fix, exit status 2, no traceback.

The CLI runs in-process (`specmoe.cli.main`, what the `specmoe` script calls): a
subprocess per case would spend most of the suite's time importing torch. One test runs
the real executable to check that the process itself exits with status 2."""

import json
import shutil
import subprocess
import sys

import pytest
from factories import corrupt_truncate, drop_tensor, reshape_tensor, run_cli


@pytest.fixture
def specmoe(capsys):
    return lambda *args: run_cli(capsys, *args)


def assert_one_line_error(result, *fragments):
    code, out, err = result
    assert code == 2, (code, out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment.lower() in lines[0].lower(), lines[0]


@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt("mixtral"), dst)
    return dst


IDS = ["--prompts-file"]


@pytest.fixture
def ids_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    return path


def test_missing_directory(tmp_path, ids_file, specmoe):
    assert_one_line_error(specmoe("generate", "--model", tmp_path / "nope", "--prompts-file", ids_file), "does not exist", "--model")


def test_missing_config(tmp_path, ids_file, specmoe):
    (tmp_path / "m").mkdir()
    assert_one_line_error(specmoe("generate", "--model", tmp_path / "m", "--prompts-file", ids_file), "config.json")


def test_unsupported_architecture(ckpt_copy, ids_file, specmoe):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(
        specmoe("generate", "--model", ckpt_copy, "--prompts-file", ids_file),
        "LlamaForCausalLM", "not supported", "MixtralForCausalLM", "OlmoeForCausalLM",
    )


def test_truncated_safetensors(ckpt_copy, ids_file, specmoe):
    corrupt_truncate(ckpt_copy)
    assert_one_line_error(specmoe("generate", "--model", ckpt_copy, "--prompts-file", ids_file), "corrupt")


def test_missing_tensor_is_named(ckpt_copy, ids_file, specmoe):
    drop_tensor(ckpt_copy, "layers.1.self_attn.k_proj.weight")
    assert_one_line_error(
        specmoe("generate", "--model", ckpt_copy, "--prompts-file", ids_file), "model.layers.1.self_attn.k_proj.weight", "missing"
    )


def test_wrong_shape_is_named(ckpt_copy, ids_file, specmoe):
    reshape_tensor(ckpt_copy, "layers.0.self_attn.q_proj.weight")
    assert_one_line_error(
        specmoe("generate", "--model", ckpt_copy, "--prompts-file", ids_file), "model.layers.0.self_attn.q_proj.weight", "shape"
    )


def test_empty_prompt(tiny_ckpt, tmp_path, specmoe):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": []}) + "\n")
    assert_one_line_error(specmoe("generate", "--model", tiny_ckpt("mixtral"), "--prompts-file", path), "empty prompt")


@pytest.mark.parametrize(
    "flag, value, fragment",
    [
        ("--max-tokens", "0", "max_tokens"),
        ("--max-tokens", "-3", "max_tokens"),
        ("--temperature", "-1", "temperature"),
        ("--temperature", "nan", "temperature"),
        ("--top-p", "0", "top_p"),
        ("--top-p", "1.5", "top_p"),
        ("--policy", "fastest", "resident"),
        ("--offload", "tape", "disk"),
        ("--device", "tpu", "cpu"),
        ("--max-tokens", "many", "invalid int"),
    ],
)
def test_bad_option_values(tiny_ckpt, ids_file, flag, value, fragment, specmoe):
    assert_one_line_error(specmoe("generate", "--model", tiny_ckpt("mixtral"), "--prompts-file", ids_file, flag, value), fragment)


def test_prompt_longer_than_context(tiny_ckpt, tmp_path, specmoe):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [5] * 300}) + "\n")  # context is 256
    assert_one_line_error(specmoe("generate", "--model", tiny_ckpt("mixtral"), "--prompts-file", path), "300 tokens", "context")


def test_token_id_outside_vocabulary(tiny_ckpt, tmp_path, specmoe):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [5, 999]}) + "\n")
    assert_one_line_error(specmoe("generate", "--model", tiny_ckpt("mixtral"), "--prompts-file", path), "999", "vocabulary")


def test_bad_device_memory_size(tiny_ckpt, ids_file, specmoe):
    assert_one_line_error(
        specmoe("generate", "--model", tiny_ckpt("mixtral"), "--prompts-file", ids_file, "--device-memory", "lots"), "512MiB"
    )


def test_unknown_subcommand(specmoe):
    assert_one_line_error(specmoe("frobnicate"), "invalid choice")


def test_the_installed_command_exits_with_status_2_and_one_line():
    proc = subprocess.run([sys.executable, "-m", "specmoe.cli", "generate", "--max-tokens", "0", "x"],
                          capture_output=True, text=True, timeout=120)
    assert_one_line_error((proc.returncode, proc.stdout, proc.stderr), "max_tokens")


def test_budget_too_small_for_the_policy_names_the_smallest_that_works(tiny_ckpt, ids_file, specmoe):
    assert_one_line_error(
        specmoe("generate", "--model", tiny_ckpt("mixtral"), "--prompts-file", ids_file, "--policy", "caching",
                "--offload", "host", "--device-memory", "60KiB", "--max-model-len", "32", "--batch-size", "1"),
        "raise --device-memory to at least",
    )


def test_a_prompts_file_that_is_not_utf8_names_the_line_and_the_fix(tiny_ckpt, tmp_path, specmoe):
    path = tmp_path / "p.txt"
    path.write_bytes(b"fine\nlatin-1: caf\xe9\n")
    assert_one_line_error(specmoe("generate", "--model", tiny_ckpt("mixtral"), "--prompts-file", path),
                          f"{path}:2", "not UTF-8", "save the file as UTF-8")
