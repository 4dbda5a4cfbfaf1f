"""What the cache dir holds is untrusted input: a learned-state file, a saved profile, an
affinity table or quantized copies that do not parse into the expected shape are ignored
with one warning naming the file, and rebuilt."""

from __future__ import annotations

import pytest
import torch

from specmoe.autotune import history, speeds
from specmoe.autotune.choose import _saved_profile
from specmoe.base.checkpoint import Checkpoint
from specmoe.base.paths import cache_dir
from specmoe.costmodel.hardware import profiles_dir
from specmoe.experts.quant_cache import cache_path, compute_quantized, load_quantized
from specmoe.policies.specmoe.affinity import compute_affinity, load_affinity

FP = "0123456789abcdef"
NOT_JSON = [b"{not json", b"\xff\xfe\x00garbage", b"[" * 100_000]
WRONG_SHAPE = [b"[]", b"5", b'{"%s": []}' % FP.encode(), b'{"%s": {"k": "x"}}' % FP.encode(),
               b'{"%s": {"int8": {"acceptance": 7, "drafted": 1}}}' % FP.encode(),
               b'{"%s": {"disk/ondemand": {"x": [1.0]}}}' % FP.encode(),
               b'{"%s": {"disk/ondemand": {"4": ["fast"]}}}' % FP.encode(),
               b'{"%s": {"disk/ondemand": {"4": [-1.0]}}}' % FP.encode()]


@pytest.fixture(autouse=True)
def _fresh_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()


def read_back(store) -> dict:
    """What the module reads for FP (acceptance by draft, or one policy's measured speed)."""
    if store is history:
        return history.measured(FP)
    return {"ondemand": speeds.measured(FP, "disk", "ondemand", 4)}


def record(store) -> None:
    if store is history:
        history.record(FP, "int8", 0.9, 100)
    else:
        speeds.record(FP, "disk", "ondemand", 4, 12.5)


@pytest.mark.parametrize("content", NOT_JSON + WRONG_SHAPE)
@pytest.mark.parametrize("store", [history, speeds], ids=["acceptance", "speeds"])
def test_a_damaged_state_file_is_ignored_with_one_warning_and_rebuilt(capsys, store, content):
    path = cache_dir() / store.FILE
    path.write_bytes(content)
    capsys.readouterr()
    assert read_back(store) in ({}, {"ondemand": None})
    read_back(store)  # read again: still one warning
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and str(path) in err and "rebuilt" in err
    record(store)
    assert read_back(store) in ({"int8": 0.9}, {"ondemand": (4, 12.5)})
    assert capsys.readouterr().err == ""


PROFILE_DAMAGE = [b"[1]", b'{"profiles": 5}', b'{"profiles": {"a": 5}}', b"\xff\xfe",
                  b'{"name": "local", "device_matmul_flops": "fast"}', b'{"device_memory_bytes": 1e400}']


@pytest.mark.parametrize("content", PROFILE_DAMAGE)
def test_a_damaged_saved_profile_is_ignored_with_a_warning(capsys, content):
    profiles_dir().mkdir(parents=True)
    (profiles_dir() / "local.json").write_bytes(content)
    assert _saved_profile("disk") is None  # so --policy auto measures this machine again
    err = capsys.readouterr().err
    assert "local.json" in err and "rebuilt" in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def ckpt(tiny_ckpt):
    return Checkpoint(tiny_ckpt("mixtral"))


def test_a_damaged_affinity_table_is_recomputed_with_a_warning(ckpt, tmp_path, capsys):
    load_affinity(ckpt, tmp_path)
    cached = next(tmp_path.glob("affinity-*.safetensors"))
    cached.write_bytes(cached.read_bytes()[: cached.stat().st_size // 2])
    table = load_affinity(ckpt, tmp_path)
    want = compute_affinity(ckpt)
    assert all(torch.equal(table[layer], want[layer]) for layer in want)
    assert str(cached) in capsys.readouterr().err
    assert load_affinity(ckpt, tmp_path).keys() == want.keys() and capsys.readouterr().err == ""  # rebuilt


def test_damaged_quantized_copies_are_recomputed_with_a_warning(ckpt, tmp_path, capsys):
    cache_path(ckpt, "int8", tmp_path).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    q = load_quantized(ckpt, "int8", tmp_path)
    want = compute_quantized(ckpt, "int8")
    assert all(torch.equal(q.layers[layer].gate_up.data, want.layers[layer].gate_up.data) for layer in want.layers)
    assert "int8 copies" in capsys.readouterr().err
