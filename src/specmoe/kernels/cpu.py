"""This CPU: its identity (what a kernel's verdict or build holds for) and the cores this
process may compute on, as llama.cpp counts them."""

from __future__ import annotations

import hashlib
import os
import platform
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def cpu_id() -> str:
    """The CPU's model name and a digest of its flags (read once: /proc/cpuinfo is long on big machines)."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            info.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    model = info.get("model name") or platform.processor() or "unknown CPU"
    flags = " ".join(sorted((info.get("flags") or info.get("Features") or "").split()))
    return f"{model}, flags {hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def usable_cores() -> int:
    """Cores this process may compute on: the CPUs of its affinity mask, one per physical
    core where SMT siblings show (as llama.cpp's default thread count), capped by its
    cgroup's CPU quota (a container given 2 CPUs of a 64-core host computes on 2)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    cores = {_core_of(c) for c in cpus}
    n = len(cores) if None not in cores else len(cpus)
    quota = _cgroup_quota()
    return max(1, min(n, quota) if quota else n)


def _core_of(cpu: int) -> str | None:
    """A key shared by SMT siblings (package and core id), or None where sysfs does not say."""
    topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return f"{(topo / 'physical_package_id').read_text().strip()}:{(topo / 'core_id').read_text().strip()}"
    except OSError:
        return None


def _cgroup_quota() -> int | None:
    """Whole CPUs the cgroup's quota allows (v2 cpu.max, v1 cfs_quota_us / cfs_period_us), rounded up; None: no quota."""
    for path, parse in ((Path("/sys/fs/cgroup/cpu.max"), lambda t: t.split()),
                        (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), None)):
        try:
            if parse is not None:
                quota, period = parse(path.read_text())
            else:
                quota = path.read_text().strip()
                period = (path.parent / "cpu.cfs_period_us").read_text().strip()
        except (OSError, ValueError):
            continue
        if quota in ("max", "-1"):
            return None
        try:
            q, p = int(quota), int(period)
        except ValueError:
            return None
        return max(1, -(-q // p)) if q > 0 and p > 0 else None
    return None
