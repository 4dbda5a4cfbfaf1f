"""Calibration: measurements of this machine (measure.py, probe.py) turned into a hardware
profile for the cost model (`specmoe calibrate`, and `--policy auto` on first use).

Measures the slow tier (disk read bandwidth with the page cache bypassed), host memory
bandwidth, CPU matmul throughput (fp32 and bf16) and, when CUDA is present, host-to-device
bandwidth (pinned and pageable) and GPU matmul throughput. The profile is saved as
``<cache dir>/profiles/NAME.json`` and used with ``--hardware NAME``.

Without a GPU the compute device is the CPU: device rates are the CPU's, "host to device"
is a memory copy, and the disk is the slow tier.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..costmodel.hardware import HardwareProfile
from .measure import measure_cuda, measure_disk, measure_host
from .probe import calibrate_engine


def _total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def build_profile(name: str, m: dict, cuda: bool) -> HardwareProfile:
    """Turn measurements into a profile. CPU-only: the CPU is the compute device, the disk
    the slow tier. CUDA: the GPU is the device and host DRAM the slow tier (the disk
    bandwidth stays in the measurements; a disk-tier profile can be derived from it)."""
    host_flops = max(m["host_matmul_flops_bf16"], m["host_matmul_flops_fp32"])
    common = dict(name=name, host_mem_bw=m["host_mem_bw"], host_matmul_flops=host_flops,
                  disk_sequential_bw=m.get("disk_sequential_bw"), disk_random_bw=m.get("disk_random_bw"),
                  source=f"measured by specmoe calibrate on {platform.node()} ({time.strftime('%Y-%m-%d')})")
    if cuda:
        return HardwareProfile(
            description=f"{m['cuda_device']}, experts in host DRAM (measured)",
            device_matmul_flops=m["gpu_matmul_flops_bf16"], device_mem_bw=m["gpu_mem_bw"],
            device_memory_bytes=int(m["cuda_memory_bytes"]), h2d_bw=m["h2d_pinned_bw"], slow_tier="host",
            slow_tier_read_bw=m["h2d_pinned_bw"], transfer_latency_s=max(m["h2d_latency_s"], 1e-7),
            kernel_launch_s=max(m["gpu_launch_s"], 1e-7), h2d_pageable_bw=m["h2d_pageable_bw"], **common)
    return HardwareProfile(
        description=f"{platform.processor() or platform.machine()} CPU as the compute device, experts on disk "
                    f"(measured, {m['host_threads']} threads)",
        device_matmul_flops=host_flops, device_mem_bw=m["host_mem_bw"], device_memory_bytes=_total_ram(),
        h2d_bw=m["host_copy_bw"], slow_tier="disk", slow_tier_read_bw=m["disk_read_bw"],
        transfer_latency_s=max(m["disk_latency_s"], 1e-7), kernel_launch_s=max(m["host_op_overhead_s"], 1e-8),
        transfer_overlap=m.get("disk_read_overlap", 1.0), **common)


def disk_variant(profile: HardwareProfile, m: dict) -> HardwareProfile:
    """The same machine with experts on the measured disk (``--offload disk``)."""
    return replace(profile, name=f"{profile.name}-disk", slow_tier="disk", slow_tier_read_bw=m["disk_read_bw"],
                   transfer_latency_s=max(m["disk_latency_s"], 1e-7),
                   description=profile.description.replace("experts in host DRAM", "experts on disk"))


def host_variant(profile: HardwareProfile, m: dict) -> HardwareProfile:
    """A CPU-only machine with experts in a host-memory store (``--offload host``): a fetch
    is a copy within DRAM, at the measured copy rate, with an operator's overhead."""
    return replace(profile, name=f"{profile.name}-host", slow_tier="host", slow_tier_read_bw=m["host_copy_bw"],
                   transfer_latency_s=max(m["host_op_overhead_s"], 1e-8), transfer_overlap=1.0,
                   description=profile.description.replace("experts on disk", "experts in host memory"))


def second_tier(profile: HardwareProfile, m: dict) -> HardwareProfile:
    """The machine's profile for its other tier: disk beside a GPU's host DRAM, host memory
    beside a CPU-only machine's disk."""
    return disk_variant(profile, m) if profile.slow_tier == "host" else host_variant(profile, m)


def with_engine_terms(profile: HardwareProfile, m: dict) -> HardwareProfile:
    """The CPU profile with the engine probe's fitted rates and overheads (probe.py):
    what the engine attains, not what a large matmul does; a fetch costs what the engine
    measured, of which the read at the disk's rate is the bandwidth part."""
    if "engine_kernel_launch_s" not in m:
        return profile
    fitted = {k: m[f"engine_{k}"] for k in ("device_matmul_flops", "device_mem_bw", "kernel_launch_s",
                                             "sequence_overhead_s")}
    if "engine_fetch_s" in m:
        read = m["engine_fetch_expert_bytes"] / profile.fetch_bw
        fitted["transfer_latency_s"] = max(m["engine_fetch_s"] - read, profile.transfer_latency_s)
    return replace(profile, **fitted)


def calibrate(name: str, directory: Path, size: int, engine: bool = True,
              offload_dir: str | None = None, device_bytes: int | None = None) -> tuple[HardwareProfile, dict]:
    """Measure and build the profile. CPU-only machines also run the engine probe on the
    bundled demo model (a few seconds) unless `engine` is False; its expert file goes to
    `offload_dir` (default: the cache dir's, where runs keep theirs). `device_bytes`: the
    most GPU memory the measurements may take (an engine's start under --device-memory)."""
    m = measure_disk(directory, size)
    # a copy smaller than 64 MiB would measure caches, not DRAM
    m.update(measure_host(copy_bytes=min(256 << 20, max(64 << 20, size))))
    cuda = torch.cuda.is_available()
    if cuda:
        m.update(measure_cuda(device_bytes))
    profile = build_profile(name, m, cuda)
    if engine and not cuda:
        m.update(calibrate_engine(profile, offload_dir=offload_dir))
        profile = with_engine_terms(profile, m)
    return profile, m


