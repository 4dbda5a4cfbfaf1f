"""The disk tier's expert file as a shared cache: built once by concurrent processes,
never left half-written, checked when opened, repaired when damaged; read errors on the
reader thread reach the caller."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from factories import random_prompts

from specmoe import LLM, SamplingParams
from specmoe.base.checkpoint import Checkpoint
from specmoe.base.errors import EnvironmentFailure
from specmoe.experts.expert_file import ExpertLayout, inspect
from specmoe.experts.formats import FloatFormat
from specmoe.experts.store import DiskStore

# A process that builds (or opens) the expert file, slowed down per expert so that
# concurrent builds overlap, once the file GO exists; it prints what it saw.
BUILDER = """
import json, sys, time
from pathlib import Path
import torch
from specmoe.base.checkpoint import Checkpoint
from specmoe.experts.formats import FloatFormat
from specmoe.experts.store import DiskStore

ckpt_dir, out_dir, go, delay = sys.argv[1:5]
read_expert = Checkpoint.expert_buffer
def slow_expert(self, *args):
    time.sleep(float(delay))
    return read_expert(self, *args)
Checkpoint.expert_buffer = slow_expert
ckpt = Checkpoint(ckpt_dir)
keys = [(l, e) for l in ckpt.config.moe_layer_ids for e in range(ckpt.config.num_experts)]
while not Path(go).exists():
    time.sleep(0.005)
store = DiskStore(ckpt, keys, FloatFormat(ckpt.config.expert, torch.float32), out_dir)
dest = torch.empty(store.numel)
same = True
for key in keys:
    store.read_into(key, dest)
    same = same and torch.equal(dest, read_expert(ckpt, *key, torch.float32))
print(json.dumps({"built": store.built, "same": same, "repaired": store.repaired}))
"""


@pytest.fixture
def ckpt(tiny_ckpt):
    return Checkpoint(tiny_ckpt("mixtral"))


def all_keys(ckpt):
    return [(layer, e) for layer in ckpt.config.moe_layer_ids for e in range(ckpt.config.num_experts)]


def open_store(ckpt, directory):
    return DiskStore(ckpt, all_keys(ckpt), FloatFormat(ckpt.config.expert, torch.float32), str(directory))


def builder(ckpt, out_dir, go, delay):
    return subprocess.Popen([sys.executable, "-c", BUILDER, str(ckpt.dir), str(out_dir), str(go), str(delay)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def reads_match_the_checkpoint(store, ckpt) -> bool:
    dest = torch.empty(store.numel)
    for key in store.keys:
        store.read_into(key, dest)
        if not torch.equal(dest, ckpt.expert_buffer(*key, torch.float32)):
            return False
    return True


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_a_new_file_carries_its_layout_and_checksums(ckpt, tmp_path):
    store = open_store(ckpt, tmp_path)
    found = inspect(store.path, store.layout)
    assert found.checksums == store.checksums and store.built
    assert store.path.stat().st_size == store.layout.file_size
    assert reads_match_the_checkpoint(store, ckpt)
    store.close()


def test_concurrent_processes_build_the_file_once_and_all_use_it(ckpt, tmp_path):
    go = tmp_path / "go"
    procs = [builder(ckpt, tmp_path / "experts", go, 0.1) for _ in range(2)]  # builds overlap by ~1.6 s
    time.sleep(0.5)
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    assert sorted(r["built"] for r in results) == [False, True]
    assert all(r["same"] and r["repaired"] == 0 for r in results)
    assert leftovers(tmp_path / "experts") == []


def test_an_interrupted_build_leaves_no_file_and_the_next_run_cleans_up_and_builds(ckpt, tmp_path):
    go = tmp_path / "go"
    go.touch()
    out_dir = tmp_path / "experts"
    proc = builder(ckpt, out_dir, go, 0.1)  # 16 experts: about 1.6 s to build
    deadline = time.monotonic() + 60
    while not (out_dir.is_dir() and leftovers(out_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, "the build never started writing"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not list(out_dir.glob("*.bin"))  # only the temporary file: nothing a run could trust
    store = open_store(ckpt, out_dir)
    assert store.built and leftovers(out_dir) == []
    assert reads_match_the_checkpoint(store, ckpt)
    store.close()


def truncate(path, layout):
    os.truncate(path, layout.file_size - layout.blob_size // 2)


def garble_header(path, layout):
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"\xff" * 16)


def old_format(path, layout):
    path.write_bytes(bytes(layout.blob_size * len(layout.keys)))  # version 1: blobs only, no header


def foreign_header(path, layout):
    other = ExpertLayout(layout.checkpoint, "bfloat16", layout.keys, layout.expert_bytes)
    with open(path, "r+b") as f:
        f.write(other.header([0] * len(layout.keys)))


@pytest.mark.parametrize("damage, reason", [(truncate, "truncated"), (garble_header, "header cannot be read"),
                                            (old_format, "not an expert file of this specmoe version"),
                                            (foreign_header, "does not match")])
def test_a_damaged_file_is_rebuilt_with_a_warning(ckpt, tmp_path, capsys, damage, reason):
    store = open_store(ckpt, tmp_path)
    store.close()
    damage(store.path, store.layout)
    capsys.readouterr()
    store = open_store(ckpt, tmp_path)
    err = capsys.readouterr().err
    assert store.built and reason in err and str(store.path) in err and len(err.splitlines()) == 1
    assert reads_match_the_checkpoint(store, ckpt)
    store.close()


def flip_byte(store, index, at=100):
    with open(store.path, "r+b") as f:
        f.seek(store.layout.offset(index) + at)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_blob_failing_its_checksum_is_served_from_the_checkpoint_and_rewritten(ckpt, tmp_path, capsys):
    open_store(ckpt, tmp_path).close()
    store = open_store(ckpt, tmp_path)
    flip_byte(store, 3)
    assert reads_match_the_checkpoint(store, ckpt)
    assert store.repaired == 1 and "rewrote it from the checkpoint" in capsys.readouterr().err
    store.close()
    again = open_store(ckpt, tmp_path)
    assert not again.built and reads_match_the_checkpoint(again, ckpt) and again.repaired == 0
    again.close()


def test_a_blob_that_cannot_be_rewritten_is_still_never_trusted(ckpt, tmp_path, capsys):
    open_store(ckpt, tmp_path).close()
    store = open_store(ckpt, tmp_path)
    flip_byte(store, 5)
    store.path.rename(tmp_path / "moved.bin")  # the open file stays readable; its path is now a directory
    store.path.mkdir()
    assert reads_match_the_checkpoint(store, ckpt)
    assert "could not be rewritten" in capsys.readouterr().err
    store.close()


# --- a read that fails on the reader thread ---------------------------------------------------

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def disk_llm(tiny_ckpt, tmp_path):
    llm = LLM(model=str(tiny_ckpt("mixtral")), device="cpu", policy="ondemand", offload="disk",
              offload_dir=str(tmp_path / "experts"), device_memory="30%", max_batch_size=4, max_model_len=32)
    yield llm
    llm.close()


def break_reads(store, directory):
    """Point the store's file descriptor at a directory: every read fails with EISDIR. Returns an undo."""
    saved = os.dup(store.fd)
    bad = os.open(directory, os.O_RDONLY)
    os.dup2(bad, store.fd)
    os.close(bad)

    def undo():
        os.dup2(saved, store.fd)
        os.close(saved)

    return undo


def generate_in_thread(llm, prompts, timeout=60):
    result = {}

    def run():
        try:
            result["outputs"] = llm.generate(prompts, PARAMS)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), "generate hung after a failed read"
    return result


def test_a_read_error_on_the_reader_thread_raises_in_the_caller_naming_the_file(disk_llm, tmp_path):
    store = disk_llm.engine.policy.store
    break_reads(store, tmp_path)
    result = generate_in_thread(disk_llm, random_prompts(2, 128, 3, 6, seed=1))
    error = result.get("error")
    assert isinstance(error, EnvironmentFailure), result
    assert str(store.path) in str(error) and "is a directory" in str(error) and "\n" not in str(error)


def test_after_a_failed_read_the_engine_runs_again_with_the_same_output(disk_llm, tmp_path):
    prompts = random_prompts(2, 128, 3, 6, seed=1)
    want = [o.token_ids for o in disk_llm.generate(prompts, PARAMS)]
    undo = break_reads(disk_llm.engine.policy.store, tmp_path)
    assert "error" in generate_in_thread(disk_llm, prompts)
    undo()
    assert [o.token_ids for o in disk_llm.generate(prompts, PARAMS)] == want
