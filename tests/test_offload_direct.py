"""The disk tier bypasses the page cache (O_DIRECT) and says so; where the file system
refuses, the fallback is announced on stderr and in the run statistics."""

import errno
import json
import os
import time

import pytest
from factories import random_prompts, run_cli

from specmoe import LLM, SamplingParams
from specmoe.experts import direct_file

O_DIRECT = getattr(os, "O_DIRECT", 0)
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def kernel_says_direct(fd: int) -> bool:
    """The open file's flags as the kernel reports them (/proc/self/fdinfo), not as specmoe
    remembers them."""
    for line in open(f"/proc/self/fdinfo/{fd}"):
        if line.startswith("flags:"):
            return bool(int(line.split()[1], 8) & O_DIRECT)
    raise AssertionError("no flags line in fdinfo")


@pytest.fixture
def direct_dir(direct_io_dir):
    """A directory whose file system takes O_DIRECT (conftest.py: checked with os.open, not
    by specmoe; tmp_path, else one in the checkout or the home directory)."""
    return direct_io_dir


def ondemand(path, directory):
    return LLM(model=str(path), device="cpu", policy="ondemand", offload="disk", offload_dir=str(directory),
               max_batch_size=2, max_model_len=32)


def test_disk_reads_bypass_the_page_cache_and_the_stats_say_so(tiny_ckpt, direct_dir):
    llm = ondemand(tiny_ckpt("mixtral"), direct_dir)
    llm.generate(random_prompts(2, max_len=8), PARAMS)
    stats = llm.last_stats
    assert (stats["offload_direct"], stats["offload_direct_reason"]) == (True, "O_DIRECT")
    assert stats["transfer_bytes"] > 0 and kernel_says_direct(llm.engine.policy.store.fd)
    llm.close()


def refuse_direct_opens(monkeypatch):
    """A file system that refuses O_DIRECT at open, as some do (EINVAL)."""
    real_open = os.open

    def open_(path, flags, *args, **kw):
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kw)
    monkeypatch.setattr(direct_file.os, "open", open_)


def refuse_direct_reads(monkeypatch):
    """A file system that takes O_DIRECT at open and refuses the read (EINVAL)."""
    real_preadv = os.preadv

    def preadv(fd, buffers, offset):
        if kernel_says_direct(fd):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_preadv(fd, buffers, offset)
    monkeypatch.setattr(direct_file.os, "preadv", preadv)


@pytest.mark.parametrize("refuse, reason", [(refuse_direct_opens, "O_DIRECT refused"),
                                            (refuse_direct_reads, "O_DIRECT read refused")])
def test_a_refused_o_direct_is_announced_and_the_output_is_unchanged(tiny_ckpt, direct_dir, capsys, monkeypatch,
                                                                     refuse, reason):
    path = tiny_ckpt("mixtral")
    prompts = random_prompts(2, max_len=8)
    want = ondemand(path, direct_dir)
    want.generate(prompts, PARAMS)
    want.close()
    refuse(monkeypatch)
    capsys.readouterr()
    llm = ondemand(path, direct_dir)
    llm.generate(prompts, PARAMS)
    stats = llm.last_stats
    warnings = [line for line in capsys.readouterr().err.splitlines() if "page cache" in line]
    assert len(warnings) == 1 and reason in warnings[0] and "--offload-dir" in warnings[0]
    assert stats["offload_direct"] is False and stats["offload_direct_reason"].startswith(reason)
    assert not kernel_says_direct(llm.engine.policy.store.fd)
    assert stats["token_ids_sha256"] == want.last_stats["token_ids_sha256"]
    llm.close()


def test_info_says_whether_the_offload_dir_bypasses_the_page_cache(direct_dir, capsys, monkeypatch):
    code, out, err = run_cli(capsys, "info", "--offload-dir", direct_dir, "--json")
    assert code == 0, err
    assert json.loads(out)["offload_direct"] is True
    refuse_direct_opens(monkeypatch)
    code, out, err = run_cli(capsys, "info", "--offload-dir", direct_dir, "--json")
    info = json.loads(out)
    assert info["offload_direct"] is False and "refused" in info["offload_direct_reason"]


def test_info_on_a_gguf_file_says_whether_reads_of_the_file_itself_bypass_the_page_cache(direct_dir, capsys,
                                                                                         monkeypatch):
    """The disk tier reads a GGUF file in place: info probes the file, not --offload-dir."""
    pytest.importorskip("gguf")
    from gguf_factories import make_gguf

    _, path = make_gguf(direct_dir / "gguf", "mixtral", "Q8_0")
    code, out, _ = run_cli(capsys, "info", "--model", str(path), "--offload-dir", str(direct_dir), "--json")
    info = json.loads(out)
    assert code == 0 and info["offload_reads"] == str(path) and info["offload_direct"] is True
    refuse_direct_opens(monkeypatch)
    code, out, _ = run_cli(capsys, "info", "--model", str(path), "--offload-dir", str(direct_dir), "--json")
    info = json.loads(out)
    assert info["offload_direct"] is False and "refused" in info["offload_direct_reason"]


def test_each_runs_read_time_counts_that_runs_reads_only(tiny_ckpt, direct_dir):
    # throttled reads take most of a run; read time carried over from earlier runs would
    # outgrow the later runs' own wall time, timed here around each call
    llm = LLM(model=str(tiny_ckpt("mixtral")), device="cpu", policy="ondemand", offload="disk",
              offload_dir=str(direct_dir), offload_bandwidth="20MB/s", max_batch_size=2, max_model_len=32)
    prompts = random_prompts(2, max_len=8)
    for _ in range(3):
        start = time.perf_counter()
        llm.generate(prompts, PARAMS)
        wall = time.perf_counter() - start
        read_s, moved = llm.last_stats["offload_read_s"], llm.last_stats["transfer_bytes"]
        # at least what this run's bytes take at the throttled rate (its compute's share of
        # the wall time varies with the machine's load), at most the run itself
        assert 0.8 * moved / 20e6 < read_s <= wall, (read_s, moved, wall)
    llm.close()
