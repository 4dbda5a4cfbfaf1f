"""Measuring this machine: disk reads with the page cache bypassed, host memory and
matmul rates, the engine's cost per operator, and, with CUDA, host-to-device copies and
the GPU's rates. Raw numbers in a dict; `calibrate` turns them into a profile."""

from __future__ import annotations

import mmap
import os
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..experts.store import DISK_READ_DEPTH
from .probe import measure_op_cost

CHUNK_SIZES = (4 << 20, 16 << 20, 64 << 20)  # O_DIRECT read sizes tried; the best is kept
# The random rate's read: an expert's size (a real-size expert, 2048 x 2048 gated, is 7 MB
# in Q4_K and 25 MB in bf16), at the disk tier's queue depth.
RANDOM_READ_BYTES = 8 << 20
MIN_TIME_S = 0.2  # repeat each measurement at least this long


def timed(fn, min_time: float = MIN_TIME_S, max_reps: int = 50) -> float:
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


def _read_random(path: Path, size: int, chunk: int, depth: int, direct: bool) -> float:
    """Seconds to read every `chunk`-sized aligned piece of the file once, in a shuffled
    order, `depth` reads in flight (each reader thread with its own aligned buffer)."""
    offsets = [i * chunk for i in range(size // chunk)]
    random.Random(0).shuffle(offsets)
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    local = threading.local()

    def read(offset: int) -> None:
        if not hasattr(local, "buf"):
            local.buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT requires
        if not direct:
            os.posix_fadvise(fd, offset, chunk, os.POSIX_FADV_DONTNEED)
        os.preadv(fd, [local.buf], offset)

    try:
        with ThreadPoolExecutor(depth) as pool:
            t = time.perf_counter()
            list(pool.map(read, offsets))
            return time.perf_counter() - t
    finally:
        os.close(fd)


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
        random_bytes = min(RANDOM_READ_BYTES, size)
        random_bw = size // random_bytes * random_bytes / _read_random(path, size, random_bytes, DISK_READ_DEPTH,
                                                                      method == "O_DIRECT")
    best = max(results, key=results.get)
    # sequential: large reads in file order, the best chunk size; random: expert-sized reads
    # at shuffled aligned offsets, DISK_READ_DEPTH in flight, as the disk tier reads
    return {"disk_read_bw": results[best], "disk_sequential_bw": results[best], "disk_random_bw": random_bw,
            "disk_random_read_bytes": random_bytes, "disk_read_depth": DISK_READ_DEPTH,
            "disk_method": method, "disk_best_chunk": best,
            "disk_read_bw_by_chunk": {str(c): bw for c, bw in results.items()}, "disk_latency_s": latency,
            "disk_read_overlap": overlap, "disk_file_bytes": size, "disk_dir": str(directory)}


def _read_overlap(path: Path, size: int, direct: bool, chunk: int = 512 << 10, reads: int = 48) -> float:
    """Rate of expert-sized reads while this CPU computes (small matmuls in a loop, like
    a decode pass) over their rate alone: the share of the disk the engine keeps while
    it computes, at most 1."""
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

def matmul_flops(dtype, device=None, max_size: int = 2048, sync=lambda: None) -> float:
    """Best square-matmul FLOP/s, growing the size until one product takes > 20 ms (so a
    slow dtype on a loaded machine does not take minutes)."""
    best, size = 0.0, 256
    while size <= max_size:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)

        def mm():
            a @ b
            sync()
        t = timed(mm, min_time=0.1)
        best = max(best, 2 * size**3 / t)
        if t > 0.02:
            break
        size *= 2
    return best


def measure_host(copy_bytes: int = 256 << 20) -> dict:
    n = copy_bytes
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src))
    out = {"host_copy_bw": n / t, "host_mem_bw": 2 * n / t}  # STREAM convention: read + write
    out["host_matmul_flops_fp32"] = matmul_flops(torch.float32)
    out["host_matmul_flops_bf16"] = matmul_flops(torch.bfloat16)
    out["host_threads"] = torch.get_num_threads()
    out["host_op_overhead_s"] = measure_op_cost()
    return out


# what measure_cuda allocates on the GPU at most, unbounded: its copies and matmuls' buffers
CUDA_MEASURE_BYTES = 2 << 30


def measure_cuda(max_bytes: int | None = None) -> dict:
    """Host-to-device and device bandwidths, bf16 matmul FLOP/s and launch cost. `max_bytes`:
    the most device bytes its buffers may take at once (an engine's start under a device
    budget); smaller buffers than the defaults measure less exactly, and `cuda_buffers_capped`
    says so."""
    dev = torch.device("cuda")
    cap = CUDA_MEASURE_BYTES if max_bytes is None else max(1 << 20, min(max_bytes, CUDA_MEASURE_BYTES))
    n = min(256 << 20, cap)
    out = {"cuda_device": torch.cuda.get_device_name(dev),
           "cuda_memory_bytes": torch.cuda.get_device_properties(dev).total_memory,
           "cuda_buffers_capped": cap < CUDA_MEASURE_BYTES}
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    for kind, src in (("pinned", torch.ones(n, dtype=torch.uint8).pin_memory()),
                      ("pageable", torch.ones(n, dtype=torch.uint8))):
        def copy(src=src):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
        out[f"h2d_{kind}_bw"] = n / timed(copy)
    del dst
    tiny = torch.ones(1024, dtype=torch.float32).pin_memory()
    tiny_dev = torch.empty_like(tiny, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        tiny_dev.copy_(tiny, non_blocking=True)
    torch.cuda.synchronize()
    out["h2d_latency_s"] = (time.perf_counter() - t0) / 200  # per small copy: the fixed cost of a transfer
    # a square bf16 product holds its float32 draw, two factors and the product: 10 bytes an element
    size = 8192
    while size > 256 and 10 * size * size > cap:
        size //= 2
    out["gpu_matmul_flops_bf16"] = matmul_flops(torch.bfloat16, dev, size, torch.cuda.synchronize)
    big = torch.empty(min(1 << 30, cap // 2), dtype=torch.uint8, device=dev)
    big2 = torch.empty_like(big)

    def dcopy():
        big2.copy_(big)
        torch.cuda.synchronize()
    out["gpu_mem_bw"] = 2 * big.numel() / timed(dcopy)
    del big, big2
    small = torch.ones(1, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(1000):
        small.add_(1)
    torch.cuda.synchronize()
    out["gpu_launch_s"] = (time.perf_counter() - t0) / 1000
    torch.cuda.empty_cache()
    return out


