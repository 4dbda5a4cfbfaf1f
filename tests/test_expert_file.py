"""The disk tier's expert file as a shared cache: built once by concurrent processes,
never left half-written, checked when opened, repaired when damaged; read errors on the
reader thread reach the caller. Processes are synchronised by events (files), never by sleeps."""

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

# A process that builds (or opens) the expert file and prints what it saw. Events are files
# in EVENTS: a build that reads its first expert says "<name>-building" and goes on only
# once "go" exists; a process that finds the file's lock held says "<name>-waiting" first.
BUILDER = """
import fcntl, json, sys, time
from pathlib import Path
import torch
from specmoe.base.checkpoint import Checkpoint
from specmoe.experts.formats import FloatFormat
from specmoe.experts.store import DiskStore

ckpt_dir, out_dir, events, name = sys.argv[1:5]
events = Path(events)
read_expert, flock = Checkpoint.expert_buffer, fcntl.flock
seen = {"building": False, "waiting": False}

def event(what):
    seen[what] = True
    (events / f"{name}-{what}").touch()

def first_expert_waits_for_go(self, *args):
    if not seen["building"]:
        event("building")
        while not (events / "go").exists():
            time.sleep(0.005)
    return read_expert(self, *args)

def flock_saying_so(fd, operation):
    try:
        flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        event("waiting")
        flock(fd, operation)

Checkpoint.expert_buffer, fcntl.flock = first_expert_waits_for_go, flock_saying_so
ckpt = Checkpoint(ckpt_dir)
keys = [(l, e) for l in ckpt.config.moe_layer_ids for e in range(ckpt.config.num_experts)]
store = DiskStore(ckpt, keys, FloatFormat(ckpt.config.expert, torch.float32), out_dir)
dest = torch.empty(store.numel)
same = True
for key in keys:
    store.read_into(key, dest)
    same = same and torch.equal(dest, read_expert(ckpt, *key, torch.float32))
print(json.dumps({"built": store.built, "same": same, "repaired": store.repaired, **seen}))
"""


@pytest.fixture
def ckpt(tiny_ckpt):
    return Checkpoint(tiny_ckpt("mixtral"))


def all_keys(ckpt):
    return [(layer, e) for layer in ckpt.config.moe_layer_ids for e in range(ckpt.config.num_experts)]


def open_store(ckpt, directory):
    return DiskStore(ckpt, all_keys(ckpt), FloatFormat(ckpt.config.expert, torch.float32), str(directory))


@pytest.fixture
def builder(ckpt):
    """builder(out_dir, events, name): a BUILDER process; any still running at the end is killed."""
    procs = []

    def start(out_dir, events, name):
        procs.append(subprocess.Popen([sys.executable, "-c", BUILDER, str(ckpt.dir), str(out_dir), str(events), name],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return procs[-1]
    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def wait_for_event(events, name: str, proc, instead: str | None = None, timeout: float = 120) -> None:
    """Until the file events/name exists; fails if `proc` ends or says `instead` first."""
    deadline = time.monotonic() + timeout
    while not (events / name).exists():
        assert proc.poll() is None, f"the builder ended before {name}: {proc.communicate()}"
        assert not (instead and (events / instead).exists()), f"{instead} before {name}"
        assert time.monotonic() < deadline, f"no {name} within {timeout} s"
        time.sleep(0.01)


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


def test_concurrent_processes_build_the_file_once_and_all_use_it(ckpt, builder, tmp_path):
    """The second process starts while the first is mid-build (its first expert read),
    finds the lock held and waits; then the first finishes and the second uses its file."""
    out_dir = tmp_path / "experts"
    first = builder(out_dir, tmp_path, "first")
    wait_for_event(tmp_path, "first-building", first)
    second = builder(out_dir, tmp_path, "second")
    wait_for_event(tmp_path, "second-waiting", second, instead="second-building")
    (tmp_path / "go").touch()
    results = []
    for proc in (first, second):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    assert [(r["built"], r["building"], r["waiting"]) for r in results] == [(True, True, False), (False, False, True)]
    assert all(r["same"] and r["repaired"] == 0 for r in results)
    assert leftovers(out_dir) == []


def test_an_interrupted_build_leaves_no_file_and_the_next_run_cleans_up_and_builds(ckpt, builder, tmp_path):
    out_dir = tmp_path / "experts"
    proc = builder(out_dir, tmp_path, "killed")
    wait_for_event(tmp_path, "killed-building", proc)  # its temporary file is open, nothing in it yet
    assert leftovers(out_dir)
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
