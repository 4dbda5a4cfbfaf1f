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
import math
import resource
import sys
from dataclasses import dataclass

HOST_ALLOWANCE_BYTES = 256 << 20  # the interpreter, torch and the tokenizer (~150 MiB here), activations
HOST_ALLOWANCE_SHARE = 0.15  # the allocator's slack and per-step scratch grow with what the budget holds


# Beyond the process's own memory before any weight: activations and the tokenizer's work.
ALLOWANCE_BEYOND_FIXED = 100 << 20


def host_allowance(fixed: int | None = None) -> int:
    """The allowance of a process whose own memory before loading any weight was `fixed`
    bytes (None: not measured): HOST_ALLOWANCE_BYTES, or that measure and ALLOWANCE_BEYOND_FIXED
    where it is larger. torch's CUDA build holds 277 MiB of its own once imported (Python 3.10
    here), its CPU build 151 MiB: one fixed allowance fitted one of them."""
    return HOST_ALLOWANCE_BYTES if fixed is None else max(HOST_ALLOWANCE_BYTES, fixed + ALLOWANCE_BEYOND_FIXED)


def host_bound(budget: int, fixed: int | None = None) -> int:
    """The most a CPU run's process should hold at its peak, for a device budget of `budget`
    bytes; `fixed`: its own memory before it loaded any weight (`host_fixed_bytes` in its
    statistics), where measured."""
    return int(budget * (1 + HOST_ALLOWANCE_SHARE)) + host_allowance(fixed)


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
    return _meminfo("MemAvailable")


def _meminfo(field: str) -> int | None:
    """A /proc/meminfo field in bytes, or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# --- --memory-limit: the whole process's memory, from which the device budget is derived -------

# The allocator's slack on top of what the ledger holds (glibc arenas, torch's caching of freed
# blocks, fragmentation between experts loaded and freed), as a share of the budget. Measured on
# the widened demo model with the disk tier (docs/MEMORY.md, "A limit for the whole process").
LIMIT_SLACK_SHARE = 0.05
# Per-step activations estimated from shapes (engine/host_memory.py) are multiplied by this: the
# temporaries torch keeps alive at once within a layer were measured at up to 1.6x the estimate.
SCRATCH_MARGIN = 1.5


def resident_bytes() -> int | None:
    """The process's resident set now (VmRSS: its own memory, the files it maps, shared memory),
    or None off Linux: what the process holds before the engine loads anything is a fixed cost."""
    return _status("VmRSS")


def total_ram_bytes() -> int | None:
    """This machine's memory (MemTotal), or None off Linux."""
    return _meminfo("MemTotal")


@dataclass(frozen=True)
class LimitPlan:
    """How `--memory-limit` (the whole process) splits: what the process held before loading
    any weight (`fixed`, measured), the per-step activations (`scratch`), the offload tier's
    host buffers (`tier`), the allocator's slack on the budget, and the device budget: the
    engine's ledger for weights, KV cache, draft copies and expert pool."""

    limit: int
    fixed: int
    scratch: int
    tier: int
    slack_share: float = LIMIT_SLACK_SHARE
    max_rows: int | None = None  # the most rows one pass computes (prefill chunks, B x (gamma + 1))

    @property
    def overhead(self) -> int:
        return self.fixed + self.scratch + self.tier

    @property
    def budget(self) -> int:
        """The device budget (may be <= 0: the limit is too small for the fixed costs alone)."""
        return int((self.limit - self.overhead) / (1 + self.slack_share))

    def limit_for(self, budget: int) -> int:
        """The smallest limit whose budget is at least `budget` bytes."""
        need = self.overhead + math.ceil(budget * (1 + self.slack_share))
        while LimitPlan(need, self.fixed, self.scratch, self.tier, self.slack_share, self.max_rows).budget < budget:
            need += 1  # int() of the division may round one byte short
        return need

    def as_dict(self) -> dict:
        return {"memory_limit": self.limit, "fixed_bytes": self.fixed, "step_scratch_bytes": self.scratch,
                "tier_host_bytes": self.tier, "slack_share": self.slack_share, "device_budget": self.budget,
                "max_pass_rows": self.max_rows}
