"""``specmoe calibrate``: measure this machine and save a hardware profile.

Measures the slow tier (disk read bandwidth with the page cache bypassed), host memory
bandwidth, CPU matmul throughput (fp32 and bf16) and, when CUDA is present, host-to-device
bandwidth (pinned and pageable) and GPU matmul throughput. The profile is saved as
``<cache dir>/profiles/NAME.json`` and used with ``--hardware NAME``.

Without a GPU the compute device is the CPU: device rates are the CPU's, "host to device"
is a memory copy, and the disk is the slow tier (DESIGN §3).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from ..errors import SpecMoEError
from .hardware import HardwareProfile, builtin_profile_names, cache_dir, save_profile
from .units import format_bytes, parse_size

CHUNK_SIZES = (4 << 20, 16 << 20, 64 << 20)  # O_DIRECT read sizes tried; the best is kept
MIN_TIME_S = 0.2  # repeat each measurement at least this long


class CalibrateError(SpecMoEError):
    """Bad input to `specmoe calibrate`: one line, exit code 2."""


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("calibrate", help="measure this machine and save a hardware profile",
                              description="Measure disk, memory, matmul (and, with CUDA, PCIe and GPU) rates and "
                                          "save them as a hardware profile for --hardware NAME.")
    p.add_argument("--dir", metavar="PATH", help="directory for the disk test file (default: a temporary dir "
                                                 "under the specmoe cache dir; put it on the disk experts live on)")
    p.add_argument("--name", default="local", help="profile name (default: local)")
    p.add_argument("--size", default="256MiB", help="disk test file size (default: 256MiB)")
    p.add_argument("--json", action="store_true", help="print the profile and measurements as JSON")
    p.add_argument("--no-engine-probe", action="store_true",
                   help="skip timing the engine on the bundled demo model (CPU-only machines; the profile then "
                        "holds raw matmul and memory rates, which overstate what a small model attains)")
    p.set_defaults(func=run_calibrate)
    return p


def _timed(fn, min_time: float = MIN_TIME_S, max_reps: int = 50) -> float:
    """Best wall time of fn() over repetitions lasting at least min_time."""
    fn()  # warm-up
    best, spent, reps = float("inf"), 0.0, 0
    while (spent < min_time or reps < 2) and reps < max_reps:
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


# ---- disk ---------------------------------------------------------------------------------

def _write_test_file(path: Path, size: int) -> None:
    block = os.urandom(1 << 20)  # incompressible; repeated so writing stays fast
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def _read_direct(path: Path, size: int, chunk: int) -> float:
    """Seconds to read the file with O_DIRECT in `chunk`-byte aligned reads."""
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT requires
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        t = time.perf_counter()
        off = 0
        while off < size:
            n = os.preadv(fd, [buf], off)
            if n <= 0:
                break
            off += n
        return time.perf_counter() - t
    finally:
        os.close(fd)
        buf.close()


def _read_dropped(path: Path, size: int, chunk: int) -> float:
    """Fallback: drop the file's cached pages, then read it with readahead."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf = bytearray(chunk)
        t = time.perf_counter()
        with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        return time.perf_counter() - t
    finally:
        os.close(fd)


def measure_disk(directory: Path, size: int) -> dict:
    """Read bandwidth of the disk holding `directory`, page cache bypassed."""
    size = max(CHUNK_SIZES[0], size // CHUNK_SIZES[0] * CHUNK_SIZES[0])  # whole aligned chunks
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix="specmoe-calibrate-") as tmp:
        path = Path(tmp) / "blob"
        _write_test_file(path, size)
        chunks = [c for c in CHUNK_SIZES if c <= size]
        results, method = {}, "O_DIRECT"
        try:
            for c in chunks:
                results[c] = size / _read_direct(path, size, c)
        except OSError:  # e.g. tmpfs: no O_DIRECT
            method, results = "posix_fadvise(DONTNEED) + read", {}
            for c in chunks:
                results[c] = size / _read_dropped(path, size, c)
        latency = _disk_latency(path, size, method == "O_DIRECT")
        overlap = _read_overlap(path, size, method == "O_DIRECT")
    best = max(results, key=results.get)
    return {"disk_read_bw": results[best], "disk_method": method, "disk_best_chunk": best,
            "disk_read_bw_by_chunk": {str(c): bw for c, bw in results.items()}, "disk_latency_s": latency,
            "disk_read_overlap": overlap, "disk_file_bytes": size, "disk_dir": str(directory)}


def _read_overlap(path: Path, size: int, direct: bool, chunk: int = 512 << 10, reads: int = 48) -> float:
    """Rate of expert-sized reads while this CPU computes (small matmuls in a loop, like
    a decode pass) over their rate alone: the share of the disk the engine keeps while
    it computes, at most 1."""
    import threading

    import torch

    def read_all() -> float:
        buf = mmap.mmap(-1, chunk)
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            step = max(chunk, size // reads // chunk * chunk)
            t = time.perf_counter()
            for i in range(reads):
                if not direct:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.preadv(fd, [buf], (i * step) % (size - chunk + 1) // 4096 * 4096)
            return time.perf_counter() - t
        finally:
            os.close(fd)
            buf.close()

    alone = min(read_all() for _ in range(2))
    stop = threading.Event()
    x, w = torch.randn(4, 256), torch.randn(256, 256)

    def compute():
        while not stop.is_set():
            torch.nn.functional.linear(x, w).mul_(0.5)

    worker = threading.Thread(target=compute, daemon=True)
    worker.start()
    try:
        busy = min(read_all() for _ in range(2))
    finally:
        stop.set()
        worker.join()
    return max(0.05, min(1.0, alone / busy))


def _disk_latency(path: Path, size: int, direct: bool, reads: int = 16) -> float:
    """Mean time of a 4 KiB read at scattered aligned offsets."""
    page = 4096
    buf = mmap.mmap(-1, page)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    try:
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        step = max(page, size // reads // page * page)
        t = time.perf_counter()
        for i in range(reads):
            os.preadv(fd, [buf], (i * step) % size)
        return (time.perf_counter() - t) / reads
    finally:
        os.close(fd)
        buf.close()


# ---- memory and compute -----------------------------------------------------------------------

def _matmul_flops(torch, dtype, device=None, max_size: int = 2048, sync=lambda: None) -> float:
    """Best square-matmul FLOP/s, growing the size until one product takes > 20 ms (so a
    slow dtype on a loaded machine does not take minutes)."""
    best, size = 0.0, 256
    while size <= max_size:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)

        def mm():
            a @ b
            sync()
        t = _timed(mm, min_time=0.1)
        best = max(best, 2 * size**3 / t)
        if t > 0.02:
            break
        size *= 2
    return best


def measure_host(torch, copy_bytes: int = 256 << 20) -> dict:
    n = copy_bytes
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src))
    out = {"host_copy_bw": n / t, "host_mem_bw": 2 * n / t}  # STREAM convention: read + write
    out["host_matmul_flops_fp32"] = _matmul_flops(torch, torch.float32)
    out["host_matmul_flops_bf16"] = _matmul_flops(torch, torch.bfloat16)
    out["host_threads"] = torch.get_num_threads()
    from .probe import measure_op_cost  # (sets torch's threads to the engine's)

    out["host_op_overhead_s"] = measure_op_cost()
    return out


def measure_cuda(torch) -> dict:
    dev = torch.device("cuda")
    n = 256 << 20
    out = {"cuda_device": torch.cuda.get_device_name(dev),
           "cuda_memory_bytes": torch.cuda.get_device_properties(dev).total_memory}
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    for kind, src in (("pinned", torch.ones(n, dtype=torch.uint8).pin_memory()),
                      ("pageable", torch.ones(n, dtype=torch.uint8))):
        def copy(src=src):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
        out[f"h2d_{kind}_bw"] = n / _timed(copy)
    tiny = torch.ones(1024, dtype=torch.float32).pin_memory()
    tiny_dev = torch.empty_like(tiny, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        tiny_dev.copy_(tiny, non_blocking=True)
    torch.cuda.synchronize()
    out["h2d_latency_s"] = (time.perf_counter() - t0) / 200  # per small copy: the fixed cost of a transfer
    out["gpu_matmul_flops_bf16"] = _matmul_flops(torch, torch.bfloat16, dev, 8192, torch.cuda.synchronize)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    big2 = torch.empty_like(big)

    def dcopy():
        big2.copy_(big)
        torch.cuda.synchronize()
    out["gpu_mem_bw"] = 2 * big.numel() / _timed(dcopy)
    small = torch.ones(1, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(1000):
        small.add_(1)
    torch.cuda.synchronize()
    out["gpu_launch_s"] = (time.perf_counter() - t0) / 1000
    del big, big2, dst
    torch.cuda.empty_cache()
    return out


def _total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def build_profile(name: str, m: dict, cuda: bool) -> HardwareProfile:
    """Turn measurements into a profile. CPU-only: the CPU is the compute device, the disk
    the slow tier. CUDA: the GPU is the device and host DRAM the slow tier (the disk
    bandwidth stays in the measurements; a disk-tier profile can be derived from it)."""
    host_flops = max(m["host_matmul_flops_bf16"], m["host_matmul_flops_fp32"])
    common = dict(name=name, host_mem_bw=m["host_mem_bw"], host_matmul_flops=host_flops,
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


def with_engine_terms(profile: HardwareProfile, m: dict) -> HardwareProfile:
    """The CPU profile with the engine probe's fitted rates and overheads (perf/probe.py):
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


def calibrate(name: str, directory: Path, size: int, engine: bool = True) -> tuple[HardwareProfile, dict]:
    """Measure and build the profile. CPU-only machines also run the engine probe on the
    bundled demo model (a few seconds) unless `engine` is False."""
    import torch

    m = measure_disk(directory, size)
    # a copy smaller than 64 MiB would measure caches, not DRAM
    m.update(measure_host(torch, copy_bytes=min(256 << 20, max(64 << 20, size))))
    cuda = torch.cuda.is_available()
    if cuda:
        m.update(measure_cuda(torch))
    profile = build_profile(name, m, cuda)
    if engine and not cuda:
        from .probe import calibrate_engine

        m.update(calibrate_engine(profile))
        profile = with_engine_terms(profile, m)
    return profile, m


def run_calibrate(args) -> int:
    try:
        size = parse_size(args.size)
        if args.name in builtin_profile_names() or not args.name or "/" in args.name:
            raise CalibrateError(f"bad --name {args.name!r}: choose a name that is not a built-in profile "
                                 f"({', '.join(builtin_profile_names())}) and has no '/'")
        directory = Path(args.dir) if args.dir else cache_dir() / "calibrate"
        profile, m = calibrate(args.name, directory, size, engine=not args.no_engine_probe)
        path = save_profile(profile, m)
        extra = save_profile(disk_variant(profile, m), m) if profile.slow_tier == "host" else None
    except (ValueError, OSError) as e:
        print(f"specmoe calibrate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"profile": profile.to_dict(), "measurements": m, "path": str(path)}, indent=2))
    else:
        print(f"disk read {format_bytes(m['disk_read_bw'])}/s ({m['disk_method']}, "
              f"{m['disk_best_chunk'] >> 20} MiB reads), host memory {format_bytes(m['host_mem_bw'])}/s, "
              f"CPU matmul fp32 {m['host_matmul_flops_fp32'] / 1e9:.0f} GFLOP/s, "
              f"bf16 {m['host_matmul_flops_bf16'] / 1e9:.0f} GFLOP/s")
        if "h2d_pinned_bw" in m:
            print(f"{m['cuda_device']}: host->device pinned {format_bytes(m['h2d_pinned_bw'])}/s, pageable "
                  f"{format_bytes(m['h2d_pageable_bw'])}/s, matmul bf16 {m['gpu_matmul_flops_bf16'] / 1e12:.0f} "
                  f"TFLOP/s, memory {format_bytes(m['gpu_mem_bw'])}/s")
        if "engine_kernel_launch_s" in m:
            print(f"engine on the demo model: {m['engine_kernel_launch_s'] * 1e6:.1f} us per operator, "
                  f"{m['engine_sequence_overhead_s'] * 1e6:.0f} us per sequence, matmul "
                  f"{m['engine_device_matmul_flops'] / 1e9:.0f} GFLOP/s attained; fit error "
                  f"{m['engine_fit_rms_rel_error']:.0%} rms over {m['engine_fit_passes']} passes"
                  + (f"; an expert fetch costs {m['engine_fetch_s'] * 1e3:.2f} ms" if "engine_fetch_s" in m else ""))
        print(f"saved profile {profile.name!r} to {path}; use --hardware {profile.name}")
        if extra:
            print(f"saved profile {profile.name}-disk (experts on this disk) to {extra}")
    return 0
