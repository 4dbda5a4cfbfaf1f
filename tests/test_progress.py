"""The first run's one-time work says on stderr what it is doing and how long it will take:
the machine's calibration for the planner at once, with an estimate; the disk tier's
expert file and the quantized draft copies once they have run a second, with their share
done and the time left, then the time they took. Work that ends sooner prints nothing."""

from __future__ import annotations

import re

import pytest

from specmoe.base import progress
from specmoe.base.checkpoint import Checkpoint
from specmoe.base.paths import DEMO_MODEL_DIR
from specmoe.base.progress import OneTime
from specmoe.experts.expert_file import ExpertLayout, open_or_build
from specmoe.experts.quant_cache import save_quantized


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_work_that_ends_within_a_second_says_nothing(capsys):
    clock = Clock()
    with OneTime("building x", clock=clock) as work:
        clock.now += 0.5
        work.update(1, 2)
        clock.now += 0.4
        work.update(2, 2)
    assert lines(capsys) == []


def test_longer_work_says_its_share_the_time_left_and_the_time_it_took(capsys):
    clock = Clock()
    with OneTime("building x", clock=clock) as work:
        clock.now += 2
        work.update(1, 4)  # a quarter in 2 s: 6 s left
        clock.now += 2
        work.update(2, 4)  # within EVERY_S of the last line: quiet
        clock.now += 150
        work.update(3, 4)
    assert lines(capsys) == ["specmoe: building x: 25% after 2 s, about 6 s left",
                             "specmoe: building x: 75% after 3 min, about 51 s left",
                             "specmoe: building x: done in 3 min"]


def test_work_that_fails_ends_with_its_error_not_with_done(capsys):
    clock = Clock()
    with pytest.raises(OSError), OneTime("building x", clock=clock) as work:
        clock.now += 2
        work.update(1, 4)
        raise OSError("disk full")
    assert lines(capsys) == ["specmoe: building x: 25% after 2 s, about 6 s left"]


def test_work_without_progress_announces_itself_with_an_estimate(capsys):
    clock = Clock()
    with OneTime("calibrating", "about 30 s", clock=clock):
        clock.now += 31
    assert lines(capsys) == ["specmoe: calibrating (about 30 s)...", "specmoe: calibrating: done in 31 s"]


@pytest.fixture
def every_step_is_slow(monkeypatch):
    monkeypatch.setattr(progress, "QUIET_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.0)


def test_the_first_build_of_the_disk_tiers_file_says_what_and_how_long(tmp_path, capsys, every_step_is_slow):
    layout = ExpertLayout("fingerprint", "float32", ((0, 0), (0, 1), (1, 0), (1, 1)), 1000)
    path = tmp_path / "experts.bin"
    capsys.readouterr()
    _, built = open_or_build(path, layout, lambda key: bytes([key[1]]) * 1000)
    out = lines(capsys)
    assert built and len(out) == 5, out
    assert out[0].startswith("specmoe: writing this checkpoint's experts into the disk tier's file, once (")
    assert f"in {tmp_path})" in out[0] and ": 25% after 0 s, about 0 s left" in out[0]
    assert out[3].endswith(": 100% after 0 s, about 0 s left") and out[4].endswith(": done in 0 s")
    _, built = open_or_build(path, layout, lambda key: bytes(1000))  # built: opened, nothing to say
    assert not built and lines(capsys) == []


def test_the_first_build_of_the_draft_copies_says_what_and_how_long(tmp_path, capsys, every_step_is_slow):
    ckpt = Checkpoint(DEMO_MODEL_DIR)
    blocks = len(list(ckpt.config.moe_layer_ids))
    capsys.readouterr()
    save_quantized(ckpt, "int8", tmp_path)
    out = lines(capsys)
    assert len(out) == blocks + 1, out
    assert out[0].startswith(f"specmoe: making int8 draft copies of this checkpoint's experts, once (kept in {tmp_path}): ")
    assert re.search(r"\): done in \d+ s$", out[-1])


def test_the_planners_calibration_says_what_it_measures_and_how_long_it_takes(monkeypatch, tmp_path, capsys):
    from specmoe.autotune import calibrate, choose

    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path / "cache"))
    m = {"host_matmul_flops_bf16": 5e11, "host_matmul_flops_fp32": 2e11, "host_mem_bw": 20e9,
         "host_copy_bw": 10e9, "host_op_overhead_s": 3e-6, "host_threads": 2, "disk_read_bw": 1.6e9,
         "disk_latency_s": 1e-4}
    monkeypatch.setattr(choose, "calibrate", lambda name, *a, **k: (calibrate.build_profile(name, m, cuda=False), m))
    capsys.readouterr()
    choose.machine_profile("disk", None)
    out = lines(capsys)
    assert out[0] == (f"specmoe: calibrating this machine once for the planner: its disk, memory and matmul rates, "
                      f"then the engine on the demo model ({choose.CALIBRATION_ESTIMATE})...")
    assert out[1].startswith("specmoe: calibrating this machine once") and out[1].endswith(": done in 0 s")
    choose.machine_profile("disk", None)  # saved: not again
    assert lines(capsys) == []
