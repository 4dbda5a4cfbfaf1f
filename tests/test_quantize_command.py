"""`specmoe quantize`: the checkpoint it writes, checked with the compressed-tensors library
(not with specmoe's reader), and its errors. That transformers and specmoe read what it
writes to the same logits is in test_quantized_checkpoints.py."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from factories import require_compressed_tensors  # noqa: E402

require_compressed_tensors()  # a skip only where the quant extra cannot install it

from factories import read_config, reshape_tensor, run_cli, to_compressed_tensors  # noqa: E402
from safetensors import safe_open  # noqa: E402

from specmoe.base.paths import default_model_dir  # noqa: E402
from specmoe.tools.quantize import EXPERT_WEIGHT  # noqa: E402

STEPS = {"w4a16": 7.5, "w8a16": 127.5}  # symmetric int: max |w| of a group maps to half the code range


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _decompressed(path: Path, module: str, tensors: dict) -> torch.Tensor:
    """The library's own decompression of one quantized Linear of the written checkpoint."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(read_config(path)["quantization_config"])
    scheme = config.config_groups["group_0"]
    parts = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".weight")}
    return BaseCompressor.get_value_from_registry(scheme.format).decompress(parts, scheme)["weight"].float()


@pytest.mark.parametrize("scheme", ["w4a16", "w8a16", "fp8"])
def test_experts_are_rounded_to_nearest_and_the_rest_is_copied(tiny_ckpt, tmp_path, scheme):
    src = tiny_ckpt("mixtral")
    out = to_compressed_tensors(src, tmp_path / "q", scheme, group_size=8)
    before, after = _tensors(src), _tensors(out)
    experts = [k for k in before if EXPERT_WEIGHT.search(k)]
    assert len(experts) == 2 * 8 * 3
    for name, w in before.items():
        if name not in experts:
            assert torch.equal(after[name], w), name
            continue
        deq = _decompressed(out, name.removesuffix(".weight"), after)
        if scheme == "fp8":  # one scale per row, max |w| -> 448; e4m3 keeps 3 mantissa bits
            scale = w.abs().amax(1, keepdim=True) / 448
            assert torch.allclose(after[name + "_scale"].float(), scale, rtol=1e-6)
            assert ((deq - w).abs() <= (w.abs() * 2 ** -4 + scale * 2 ** -9)).all(), name
        else:  # one scale per 8 columns; every weight within half a step
            scale = w.reshape(w.shape[0], -1, 8).abs().amax(-1) / STEPS[scheme]
            assert torch.allclose(after[name + "_scale"].float(), scale, rtol=1e-6)
            half_step = scale.repeat_interleave(8, 1) / 2
            assert ((deq - w).abs() <= half_step * (1 + 1e-4)).all(), name  # the positive max: exactly half


def test_the_checkpoint_carries_its_tokenizer_config_and_a_note(tmp_path, capsys):
    """The bundled demo model (with its tokenizer), quantized by the command as users run it."""
    code, out, err = run_cli(capsys, "quantize", default_model_dir(), tmp_path / "w4", "--scheme", "w4a16", "--json")
    assert code == 0, err
    summary = json.loads(out)
    written = tmp_path / "w4"
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "QUANTIZATION.md"} <= {
        f.name for f in written.iterdir()}
    qc = read_config(written)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 128
    assert "w4a16" in (written / "QUANTIZATION.md").read_text()
    assert summary["experts_quantized"] == 8 * 16 * 3
    assert summary["expert_bytes_after"] * 3.8 < summary["expert_bytes_before"]  # bf16 -> int4 + scales
    assert not list(tmp_path.glob(".w4.partial-*"))


def test_a_sharded_checkpoint_keeps_its_shards_and_index(tiny_ckpt, tmp_path):
    out = to_compressed_tensors(tiny_ckpt("mixtral", shards=2), tmp_path / "q", "w8a16")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = {f.name: f for f in out.glob("*.safetensors")}
    assert set(index["weight_map"].values()) == set(files) and len(files) == 2
    for name, file in index["weight_map"].items():
        with safe_open(str(files[file]), framework="pt") as f:
            assert name in f.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _tensors(out).values())


def _already_quantized(tiny_ckpt, tmp_path):
    return to_compressed_tensors(tiny_ckpt("mixtral"), tmp_path / "q", "w8a16")


@pytest.mark.parametrize(("make", "args", "message"), [
    (lambda t, p: t("mixtral"), ["--scheme", "w4a16"], "--group-size 128 must divide the experts' input dimensions "
                                                       "(32 and 24): pass a divisor of both, e.g. 8"),
    (lambda t, p: t("mixtral", "fused"), ["--scheme", "fp8"], "stores its experts fused"),
    (_already_quantized, ["--scheme", "fp8"], "is already quantized"),
    (lambda t, p: p / "missing", ["--scheme", "fp8"], "does not exist"),
    (lambda t, p: t("mixtral"), ["--scheme", "fp8", "--method", "gptq"], "--method gptq calibrates on prompts"),
], ids=["group-size", "fused", "already-quantized", "missing", "gptq-without-prompts"])
def test_bad_input_is_one_line_and_exit_status_2(tiny_ckpt, tmp_path, capsys, make, args, message):
    code, out, err = run_cli(capsys, "quantize", make(tiny_ckpt, tmp_path), tmp_path / "out", *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "out").exists()


def test_an_output_directory_in_use_is_refused(tiny_ckpt, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "quantize", tiny_ckpt("mixtral"), tmp_path / "out", "--scheme", "fp8")
    assert code == 2 and "already exists and is not an empty directory" in err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


@pytest.mark.skipif(importlib.util.find_spec("llmcompressor") is not None, reason="llm-compressor is installed")
def test_gptq_without_llm_compressor_says_what_to_install(tiny_ckpt, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the first prompt\nthe second\n")
    code, _, err = run_cli(capsys, "quantize", tiny_ckpt("mixtral"), tmp_path / "out", "--scheme", "w8a16",
                           "--group-size", "8", "--method", "gptq", "--calibration-file", prompts)
    assert code == 2 and "pip install llmcompressor" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_a_failed_rewrite_leaves_nothing_behind(tiny_ckpt, tmp_path, capsys):
    """An expert tensor that is not the shape config.json implies stops the rewrite (found
    while planning the output, after the partial directory exists): one line, no output."""
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt("mixtral"), src)
    name = reshape_tensor(src, "experts.3.w2.weight")
    code, _, err = run_cli(capsys, "quantize", src, tmp_path / "out", "--scheme", "fp8")
    assert code == 2 and f"expert tensor {name!r} has shape [33, 24]" in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))
