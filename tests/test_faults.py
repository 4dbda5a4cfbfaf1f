"""The machine says no: a directory that cannot be written, a disk that fills up while the
expert file is written. `specmoe` answers with one line that names the path and what to
do, exit status 1, no traceback, and leaves nothing half-written behind.

The read-only and the full disk are real: a small tmpfs mounted in a private mount
namespace (`unshare`: through a user namespace, else sudo; where neither works a skip
that fails CI, tests/skip_policy.py). A file-size limit
(RLIMIT_FSIZE) fails the same writes on any Linux."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys

import pytest
from factories import assert_one_line_failure, in_small_tmpfs, run_cli

RUN = ["--policy", "ondemand", "--offload", "disk", "--device-memory", "30%", "--max-tokens", "2",
       "--max-model-len", "16", "--device", "cpu"]


@pytest.fixture
def ids_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    return path


def generate_command(model, ids_file, offload_dir) -> list[str]:
    return [sys.executable, "-m", "specmoe.cli", "generate", "--model", str(model), "--prompts-file", str(ids_file),
            "--offload-dir", str(offload_dir), *RUN]


def test_an_offload_dir_through_a_regular_file_is_one_line(tiny_ckpt, ids_file, tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    argv = generate_command(tiny_ckpt("mixtral"), ids_file, tmp_path / "file" / "experts")[3:]  # in-process
    status, _, err = run_cli(capsys, *argv)
    assert_one_line_failure(subprocess.CompletedProcess(argv, status, "", err),
                            "not a directory", "--offload-dir", str(tmp_path / "file"))


def test_a_read_only_offload_dir_is_one_line(tiny_ckpt, ids_file, tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    proc, listing = in_small_tmpfs(mount, generate_command(tiny_ckpt("mixtral"), ids_file, mount), read_only=True)
    assert_one_line_failure(proc, "read-only file system", str(mount), "--offload-dir")
    assert listing == []


def test_a_disk_without_room_for_the_expert_file_is_refused_before_a_byte_is_written(tiny_ckpt, ids_file, tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    proc, listing = in_small_tmpfs(mount, generate_command(tiny_ckpt("mixtral"), ids_file, mount), size="64k")
    assert_one_line_failure(proc, "it needs", "64.0 kib free", str(mount), "--offload-dir")
    assert [name for name in listing if not name.endswith(".lock")] == []  # no partial or temporary file


def limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


def test_a_write_that_fails_midway_is_one_line_and_leaves_nothing_behind(tiny_ckpt, ids_file, tmp_path):
    offload = tmp_path / "experts"
    proc = subprocess.run(generate_command(tiny_ckpt("mixtral"), ids_file, offload), capture_output=True, text=True,
                          timeout=180, preexec_fn=limit_file_size)
    assert_one_line_failure(proc, "file too large", str(offload), "--offload-dir")
    assert [p.name for p in offload.iterdir() if p.suffix != ".lock"] == []
