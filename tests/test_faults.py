"""The machine says no: a directory that cannot be written, a disk that fills up while the
expert file is written. `specmoe` answers with one line that names the path and what to
do, exit status 1, no traceback, and leaves nothing half-written behind.

The read-only and the full disk are real: a small tmpfs mounted in a private mount
namespace (`unshare`: through a user namespace, else sudo; where neither works a skip
that fails CI, tests/skip_policy.py). A file-size limit
(RLIMIT_FSIZE) fails the same writes on any Linux."""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys

import pytest
from factories import run_cli

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


def assert_one_line_failure(proc, *fragments):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment.lower() in lines[0].lower(), lines[0]


def namespace_commands(command: list[str]) -> list[list[str]]:
    """Ways to run a script as root in a private mount namespace, with `command` in it run
    as this user, in the order tried: a user namespace (most kernels); where those are
    blocked (AppArmor on Ubuntu 24.04, a container), sudo, as CI's runners have it, or
    plain unshare when this process is root."""
    ways = [(["unshare", "--user", "--map-root-user", "--mount"], command)]
    if os.geteuid() == 0:
        ways.append((["unshare", "--mount"], command))
    elif shutil.which("sudo"):
        env = [f"{k}={v}" for k, v in os.environ.items() if k.isidentifier()]  # sudo starts from a clean one
        as_me = ["setpriv", f"--reuid={os.getuid()}", f"--regid={os.getgid()}", "--clear-groups", "--"]
        ways.append((["sudo", "-n", "env", *env, "unshare", "--mount"], as_me + command))
    return ways


def in_small_tmpfs(mount, command: list[str], size: str = "64k", read_only: bool = False):
    """Run `command` with a fresh tmpfs of `size` on `mount` (visible to it alone); the
    mount's listing afterwards is printed on stdout after a marker line. Where no way to a
    mount namespace works, a skip that no allowlist entry covers: CI fails."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    options = f"size={size}" + (",ro" if read_only else "")
    refused = []
    for prefix, inner in namespace_commands(command):
        script = (f"mount -t tmpfs -o {options},mode=1777 tmpfs {shlex.quote(str(mount))} || exit 99; "
                  f"{shlex.join(inner)}; status=$?; echo LISTING; ls -A {shlex.quote(str(mount))}; exit $status")
        proc = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True, timeout=180)
        if proc.returncode != 99 and "unshare:" not in proc.stderr and "LISTING\n" in proc.stdout:
            return proc, proc.stdout.split("LISTING\n", 1)[1].split()
        refused.append(f"{' '.join(prefix[:2])}: {proc.stderr.strip()[:200]}")
    pytest.skip(f"no private mount namespace here: {'; '.join(refused)}")


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


def test_a_disk_that_fills_up_is_one_line_and_leaves_nothing_behind(tiny_ckpt, ids_file, tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    proc, listing = in_small_tmpfs(mount, generate_command(tiny_ckpt("mixtral"), ids_file, mount), size="64k")
    assert_one_line_failure(proc, "no space left on device", str(mount), "--offload-dir")
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
