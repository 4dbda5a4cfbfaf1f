"""`specmoe calibrate`: measures, saves a profile, and the profile loads by name."""

import argparse
import json
import math
import threading

import pytest

from specmoe.autotune import calibrate, probe
from specmoe.costmodel.cost_model import Scenario, pass_work
from specmoe.costmodel.hardware import load_profile
from specmoe.experts.store import DISK_READ_DEPTH
from specmoe.tools import calibrate as calibrate_command


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="specmoe")
    calibrate_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calibrate", *argv])
    rc = args.func(args)
    return (rc, *capsys.readouterr())


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.slow  # a long scenario (a whole run of the command): .ci/run runs it after make test
def test_calibrate_saves_a_loadable_profile(tmp_path, capsys, monkeypatch):
    probed, real_probe = [], probe.run_probe

    def run_probe(*args, **kwargs):  # the real probe, its passes kept for the check below
        probed.append(real_probe(*args, **kwargs))
        return probed[-1]

    monkeypatch.setattr(probe, "run_probe", run_probe)
    rc, out, err = run(["--dir", str(tmp_path / "disk"), "--name", "testbox", "--size", "16MiB", "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    m = doc["measurements"]
    assert m["disk_read_bw"] > 0 and m["host_mem_bw"] > 0 and m["host_matmul_flops_fp32"] > 0
    assert m["disk_file_bytes"] == 16 << 20
    assert m["disk_sequential_bw"] == m["disk_read_bw"] and m["disk_random_bw"] > 0
    assert m["disk_random_read_bytes"] == 8 << 20 and m["disk_read_depth"] == DISK_READ_DEPTH
    p = load_profile("testbox")
    assert (p.disk_sequential_bw, p.disk_random_bw) == (m["disk_sequential_bw"], m["disk_random_bw"])
    assert p.slow_tier_read_bw > 0 and p.to_dict() == doc["profile"]
    # the engine probe ran on the demo model and its fit is the profile's compute side: the
    # saved profile's pass times against the probe's timed resident passes give the error
    # the fit reports (how small it is is a benchmark matter: BENCHMARKS.md validates it)
    (shape, samples), = probed
    resident = [s for s in samples if s.policy == "resident"]
    predicted = [pass_work(Scenario(shape, p, context_len=s.context), s.batch, s.per_sequence, s.experts).time_s
                 for s in resident]
    rel = [t / s.wall_s - 1 for t, s in zip(predicted, resident)]
    assert m["engine_fit_passes"] == len(resident) >= 10
    assert m["engine_fit_rms_rel_error"] == pytest.approx(math.sqrt(sum(r * r for r in rel) / len(rel)), rel=1e-9)
    assert p.kernel_launch_s == m["engine_kernel_launch_s"] and p.device_mem_bw == m["engine_device_mem_bw"]
    assert m["engine_fetch_s"] > 0 and p.transfer_latency_s > 0
    # the disk test file is removed; the probe's expert file is kept in --dir, and nowhere else
    assert {p.name.split("-")[0] for p in (tmp_path / "disk").iterdir()} == {"experts"}
    assert not list((tmp_path / "cache").rglob("experts-*"))


def test_calibrate_prints_the_disks_sequential_and_random_rates(tmp_path, capsys):
    rc, out, err = run(["--dir", str(tmp_path / "disk"), "--name", "plain", "--size", "16MiB", "--no-engine-probe"],
                       capsys)
    assert rc == 0, err
    line = out.splitlines()[0]
    assert " sequential (" in line and f"8 MiB reads at random offsets, {DISK_READ_DEPTH} in flight" in line
    assert load_profile("plain").disk_random_bw > 0


def test_the_random_rate_reads_at_the_disk_tiers_depth(tmp_path, monkeypatch):
    """Its reads really are in flight together: each waits at a barrier that opens only
    when DISK_READ_DEPTH of them are inside it."""
    from specmoe.autotune import measure

    barrier, real_preadv = threading.Barrier(DISK_READ_DEPTH, timeout=10), measure.os.preadv

    def preadv(fd, buffers, offset):
        barrier.wait()
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(measure.os, "preadv", preadv)
    monkeypatch.setattr(measure, "_read_direct", lambda *a: 1.0)  # only the random reads meet the barrier
    monkeypatch.setattr(measure, "_disk_latency", lambda *a: 1e-4)
    monkeypatch.setattr(measure, "_read_overlap", lambda *a: 1.0)
    monkeypatch.setattr(measure, "RANDOM_READ_BYTES", 1 << 20)
    m = measure.measure_disk(tmp_path / "d", 4 << 20)
    assert m["disk_random_bw"] > 0 and m["disk_read_depth"] == DISK_READ_DEPTH


def test_calibrate_refuses_a_builtin_name(capsys):
    with pytest.raises(calibrate_command.CalibrateError, match="built-in"):
        run(["--name", "h100-pcie5", "--size", "16MiB"], capsys)


def test_cuda_measurements_make_a_host_tier_gpu_profile_and_a_disk_variant():
    m = {"host_matmul_flops_bf16": 2e12, "host_matmul_flops_fp32": 1e12, "host_mem_bw": 300e9,
         "host_copy_bw": 150e9, "host_op_overhead_s": 2e-6, "host_threads": 32, "disk_read_bw": 6e9,
         "disk_latency_s": 1e-4, "cuda_device": "NVIDIA H200", "cuda_memory_bytes": 141 * 2**30,
         "h2d_pinned_bw": 50e9, "h2d_pageable_bw": 20e9, "h2d_latency_s": 8e-6,
         "gpu_matmul_flops_bf16": 700e12, "gpu_mem_bw": 4e12, "gpu_launch_s": 4e-6}
    p = calibrate.build_profile("gpubox", m, cuda=True)
    assert (p.slow_tier, p.fetch_bw, p.device_matmul_flops, p.h2d_pageable_bw) == ("host", 50e9, 700e12, 20e9)
    d = calibrate.second_tier(p, m)
    assert (d.name, d.slow_tier, d.fetch_bw) == ("gpubox-disk", "disk", 6e9)


def test_cpu_measurements_make_the_cpu_the_device_and_the_disk_the_slow_tier():
    m = {"host_matmul_flops_bf16": 5e11, "host_matmul_flops_fp32": 2e11, "host_mem_bw": 20e9,
         "host_copy_bw": 10e9, "host_op_overhead_s": 3e-6, "host_threads": 2, "disk_read_bw": 1.6e9,
         "disk_latency_s": 1e-4}
    p = calibrate.build_profile("cpubox", m, cuda=False)
    assert (p.slow_tier, p.fetch_bw, p.device_matmul_flops, p.device_mem_bw) == ("disk", 1.6e9, 5e11, 20e9)
    h = calibrate.second_tier(p, m)  # --offload host there: a fetch is a copy within DRAM
    assert (h.name, h.slow_tier, h.fetch_bw, h.transfer_latency_s) == ("cpubox-host", "host", 10e9, 3e-6)


def test_the_planner_calibrates_a_cpu_only_machine_once_for_either_tier(tmp_path, monkeypatch, capsys):
    """On a machine without a GPU, --offload host used to find no saved profile of its tier,
    calibrate at every engine start and plan with the disk's; measuring is stood in for."""
    from specmoe.autotune import choose

    m = {"host_matmul_flops_bf16": 5e11, "host_matmul_flops_fp32": 2e11, "host_mem_bw": 20e9,
         "host_copy_bw": 10e9, "host_op_overhead_s": 3e-6, "host_threads": 2, "disk_read_bw": 1.6e9,
         "disk_latency_s": 1e-4}
    calls = []

    def measure(name, directory, size, engine=True, offload_dir=None, device_bytes=None):
        calls.append(name)
        return calibrate.build_profile(name, m, cuda=False), m

    monkeypatch.setattr(choose, "calibrate", measure)
    host = choose.machine_profile("host", None)
    disk = choose.machine_profile("disk", None)
    err = capsys.readouterr().err  # one calibration: the line that starts it and the one that ends it
    assert calls == ["local"] and err.count("calibrating") == 2 and err.count("done in") == 1
    assert (host.name, host.slow_tier, host.fetch_bw) == ("local-host", "host", 10e9)
    assert (disk.name, disk.slow_tier, disk.fetch_bw) == ("local", "disk", 1.6e9)
    assert choose.machine_profile("host", None) == host and calls == ["local"]


def test_auto_calibrates_in_the_offload_dir(tmp_path, monkeypatch):
    """--policy auto's first-use calibration measures the disk, and keeps the probe's expert
    file, in --offload-dir (a second copy went to the cache dir); measuring is stood in for."""
    from dataclasses import replace

    from specmoe.autotune import choose

    seen = {}

    def measure(name, directory, size, engine=True, offload_dir=None, device_bytes=None):
        seen.update(directory=directory, offload_dir=offload_dir)
        return (replace(load_profile("h100-pcie5-ssd"), name=name, slow_tier="disk"),
                {"host_copy_bw": 10e9, "host_op_overhead_s": 3e-6})

    monkeypatch.setattr(choose, "calibrate", measure)
    profile = choose.machine_profile("disk", None, str(tmp_path / "experts"))
    assert seen == {"directory": tmp_path / "experts", "offload_dir": str(tmp_path / "experts")}
    assert profile.name == "local" and load_profile("local") == profile  # saved for next time


def test_a_gpu_calibrated_within_the_device_budget_is_used_for_the_run_and_not_saved(tmp_path, monkeypatch, capsys):
    """At an engine's start the calibration may take only the device bytes the budget has
    not reserved (test_cuda.py measures that on a GPU); a GPU measured in buffers smaller
    than its usual ones plans this run, is not saved as the machine's profile, and the
    user is told how to save a full one; measuring is stood in for."""
    from dataclasses import replace

    from specmoe.autotune import choose

    seen = {}

    def measure(name, directory, size, engine=True, offload_dir=None, device_bytes=None):
        seen["device_bytes"] = device_bytes
        return replace(load_profile("h100-pcie5-ssd"), name=name, slow_tier="host"), {"cuda_buffers_capped": True}

    monkeypatch.setattr(choose, "calibrate", measure)
    profile = choose.machine_profile("host", 1e9, None, device_room=12 << 20)
    assert seen == {"device_bytes": 12 << 20}
    assert profile.name == "local" and profile.slow_tier_read_bw == 1e9  # --offload-bandwidth still caps it
    with pytest.raises(ValueError):
        load_profile("local")
    assert "run `specmoe calibrate` once" in capsys.readouterr().err
