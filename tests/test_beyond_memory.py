"""The bigger-than-memory benchmark's bookkeeping (benchmarks/beyond_memory.py and its
section): ratios round by round, the goal's rule at its edge, a failed run never "met",
bytes read as the kernel counts them, and llama.cpp's process free of torch."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import beyond_memory as bench  # noqa: E402

from specmoe.bench import beyond_memory as section  # noqa: E402


def record(engine, tok_s, rnd, batch=16, share=0.4, oom=0, rc=0):
    r = {"engine": engine, "batch_size": batch, "cap_share": share, "cap_bytes": 1000, "cgroup_peak_bytes": 990,
         "oom_kills": oom, "returncode": rc, "round": rnd}
    if rc == 0:
        r.update(decode_tokens_per_s=tok_s, read_bytes_per_token=100.0, token_ids=[[1, 2]], tokens_per_step=1.5,
                 acceptance_rate=0.3, stats={"verify_disk_read_rate": 1.5e9})
    return r


def rows(ratios, **kw):
    out = []
    for i, ratio in enumerate(ratios):
        out += [record("specmoe", ratio * 10.0, i, **kw), record("llama.cpp", 10.0, i, **kw)]
    return bench.summarize(out)


@pytest.mark.parametrize(("ratios", "met"), [
    ((5.0, 5.5, 6.0), True),  # every round at or above 5x
    ((4.99, 5.5, 6.0), False),  # one round short: the median would say otherwise
    ((6.0, 6.0), False),  # two rounds: the rule needs three
])
def test_the_goal_is_met_only_where_every_round_clears_it(ratios, met):
    [row] = rows(ratios)
    assert row["rounds"] == len(ratios) and row["ratio_low"] == pytest.approx(min(ratios))
    assert section.met(row) is met
    assert ("met" if met else "not met") in section.speeds({"summary": [row], "rounds": len(ratios)})


def test_a_run_killed_at_the_cap_is_never_met_and_the_table_says_so():
    recs = []
    for i in range(3):
        recs += [record("specmoe", 80.0, i), record("llama.cpp", 10.0, i)]
    recs.append(record("specmoe", 0, 3, oom=1, rc=-9))
    [row] = bench.summarize(recs)
    assert row["specmoe_oom_kills"] == 1 and row["specmoe_failed_runs"] == 1 and row["ratio_low"] == 8.0
    assert not section.met(row)
    doc = {"summary": [row], "rounds": 3}
    assert "not met (a run failed)" in section.speeds(doc)
    assert "| no |" in section.memory(doc)  # not within the cap in every run


def test_the_ceiling_is_the_most_rows_per_second_any_batch_size_computed_in_memory():
    """Each goal beside resident's speed with nothing read: the largest of its runs bounds
    every batch size (a verify pass computes B (gamma + 1) rows), and a run whose tokens
    differ from SpecMoE's under the cap says so."""
    from specmoe.engine.stats import token_ids_sha256

    [row] = rows((1.2, 1.1, 1.3))  # llama.cpp at 10 tok/s: the 5x goal asks 50
    sha = token_ids_sha256([[1, 2]])
    doc = {"summary": [row], "ceiling": [{"batch_size": 16, "decode_tokens_per_s": 20.0, "sha256": sha},
                                         {"batch_size": 64, "decode_tokens_per_s": 40.0, "sha256": "other"}]}
    table = section.ceiling(doc)
    assert "| 16 | 5x | 50.00 | 20.00 | 40.00 (B = 64) | 1.25x | yes |" in table
    doc["ceiling"][0]["sha256"] = "other"
    assert table.replace("| yes |", "| no |") == section.ceiling(doc)
    assert section.ceiling({"summary": [row]}) == ""  # a document from before the ceiling runs


def test_a_cap_without_a_goal_is_reported_without_one():
    [row] = rows((1.2, 1.3, 1.4), share=0.7)
    assert "–" in section._verdict(row) and section._goal(row) is None


def test_direct_reads_count_as_bytes_read_from_storage(tmp_path):
    """/proc/self/io's read_bytes, how both engines' reads are counted, sees reads that bypass
    the page cache (the disk tier's) as well as those through it (mmap's page faults)."""
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(8 << 20))
    bench.evict([path])
    before = bench.read_bytes()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("this file system has no O_DIRECT")
    buf = mmap.mmap(-1, 1 << 20)
    try:
        for off in range(0, 8 << 20, 1 << 20):
            os.preadv(fd, [buf], off)
    finally:
        os.close(fd)
    assert bench.read_bytes() - before >= 8 << 20


def test_the_llama_cpp_process_imports_no_torch():
    code = "import sys, specmoe.bench.llama_batch, specmoe.bench.cgroup; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"
