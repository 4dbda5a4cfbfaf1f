"""The process's own memory as the kernel counts it, and what a run may hold beyond its budget.

On a machine without a GPU the device budget (`--device-memory`) is the memory a run may
take: the engine keeps its weights, KV cache, draft copies and expert pool within it, and
builds what it builds at start one expert at a time. The rest of the process, Python,
torch, the tokenizer, activations and the allocator's slack, is the allowance below.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
import sys

HOST_ALLOWANCE_BYTES = 256 << 20  # the interpreter, torch and the tokenizer (~150 MiB here), activations
HOST_ALLOWANCE_SHARE = 0.15  # the allocator's slack and per-step scratch grow with what the budget holds


def host_bound(budget: int) -> int:
    """The most a CPU run's process should hold at its peak, for a device budget of `budget` bytes."""
    return int(budget * (1 + HOST_ALLOWANCE_SHARE)) + HOST_ALLOWANCE_BYTES


def _status(field: str, pid: int | str = "self") -> int | None:
    """A `/proc/PID/status` field in bytes (Linux), or None (elsewhere, or a process that has ended)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """The process's peak resident set so far, as the kernel measured it (VmHWM; elsewhere
    getrusage's maximum): every page it ever held at once, shared libraries included."""
    hwm = _status("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


def anon_rss_bytes(pid: int | str = "self") -> int | None:
    """A process's anonymous resident memory now (its own data, not mapped files), or None."""
    return _status("RssAnon", pid)


def release_free_memory() -> None:
    """Hand freed heap memory back to the system (glibc's malloc_trim): building the engine
    frees large temporaries that glibc would otherwise keep in the process (about 0.2 GiB
    at real size). A no-op where the C library has no malloc_trim."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None; looked up once (finding the C library runs ldconfig,
    a few ms: more than a trim, and some callers trim per expert)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def available_bytes() -> int | None:
    """The kernel's estimate of memory available to new work without swapping
    (MemAvailable: free memory plus the page cache it could reclaim); None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
