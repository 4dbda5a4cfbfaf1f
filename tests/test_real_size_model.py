"""benchmarks/real_size_model.py: the demo model widened without changing its function.
transformers, not specmoe, is the judge: its greedy tokens on the widened copy are the
demo model's, and its logits move only by float rounding."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from factories import assert_one_line_failure, hf_greedy, hf_logits, in_small_tmpfs

from specmoe.base.paths import DEMO_MODEL_DIR

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "real_size_model.py"
PROMPTS = [[0, 17, 230, 99, 4001, 12], [0, 5, 5, 5, 812, 77, 1203, 3000, 41, 9]]


@pytest.fixture(scope="module")
def widened(tmp_path_factory):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("widened") / "k2m4"
    subprocess.run([sys.executable, str(SCRIPT), str(out), "--hidden-factor", "2", "--expert-factor", "4"],
                   check=True, capture_output=True)
    return out


def test_the_widened_config_has_the_grown_shapes(widened):
    small, big = (json.loads((d / "config.json").read_text()) for d in (DEMO_MODEL_DIR, widened))
    assert big["hidden_size"] == 2 * small["hidden_size"]
    assert big["num_attention_heads"] == 2 * small["num_attention_heads"]
    assert big["num_key_value_heads"] == 2 * small["num_key_value_heads"]
    assert big["intermediate_size"] == 4 * small["intermediate_size"]
    assert big["head_dim"] == small["head_dim"]
    index = json.loads((widened / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == small["num_hidden_layers"] + 1  # a shard per layer + the rest


def test_transformers_gives_the_demo_models_greedy_tokens_on_the_widened_copy(widened):
    for prompt in PROMPTS:
        assert hf_greedy(widened, prompt, 12) == hf_greedy(DEMO_MODEL_DIR, prompt, 12)


def test_the_widened_logits_differ_from_the_demo_models_only_by_rounding(widened):
    for small, big in zip(hf_logits(DEMO_MODEL_DIR, PROMPTS), hf_logits(widened, PROMPTS)):
        assert float((big - small).abs().max()) < 1e-3


def test_factors_that_are_not_powers_of_two_are_refused(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "x"), "--hidden-factor", "3"],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "powers of two" in run.stderr and not (tmp_path / "x" / "config.json").exists()


def test_keep_leaves_a_finished_widening_and_rebuilds_another(widened, tmp_path):
    """--keep: the same factors leave the directory untouched (no shard rewritten); other
    factors, or a widening that stopped before its config, are written."""
    shard = next(widened.glob("model-*.safetensors"))
    before = shard.stat().st_mtime_ns
    args = [sys.executable, str(SCRIPT), str(widened), "--hidden-factor", "2", "--expert-factor", "4", "--keep"]
    subprocess.run(args, check=True, capture_output=True)
    assert shard.stat().st_mtime_ns == before
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{")  # a run killed mid-write
    args[2], args[6] = str(partial), "2"
    subprocess.run(args, check=True, capture_output=True)
    config = json.loads((partial / "config.json").read_text())
    assert config["intermediate_size"] == 2 * json.loads((DEMO_MODEL_DIR / "config.json").read_text())[
        "intermediate_size"]


def test_a_disk_without_room_for_the_widening_is_refused_before_anything_is_written(tmp_path):
    """Found before the first shard: the need, what is free and the path, in one line."""
    mount = tmp_path / "small"
    mount.mkdir()
    proc, listing = in_small_tmpfs(mount, [sys.executable, str(SCRIPT), str(mount / "k4m4"),
                                          "--hidden-factor", "4", "--expert-factor", "4"], size="8m")
    assert_one_line_failure(proc, "needs 448 MiB", "8 MiB free", str(mount / "k4m4"), "OUT_DIR")
    assert listing == []


def limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_a_shard_that_fails_midway_is_one_line_and_removed(tmp_path):
    out = tmp_path / "k1m1"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "--hidden-factor", "1", "--expert-factor", "1"],
                          capture_output=True, text=True, timeout=120, preexec_fn=limit_file_size)
    assert_one_line_failure(proc, "file too large", str(out / "model-00001-of-00009.safetensors"), "OUT_DIR")
    assert list(out.iterdir()) == []
