"""A child process's exact peak memory, measured from outside it (Linux).

Where this process may make a memory cgroup (cgroup v1's memory hierarchy, or v2 with the
memory controller enabled below this process's cgroup; root usually may on v1), the child
runs in a cgroup of its own. The kernel charges every page to it as it is allocated, and
`memory.max_usage_in_bytes` (v2: `memory.peak`) is the exact maximum, however short. The
count also holds kernel memory (a few MiB) and the page cache the child brings in: the files
it will read, and the interpreter's libraries, are read here first (`warm`), so their pages
are charged to this process, not to the child; the pages a child writes are its own, and a
limit (`limit`) makes the kernel reclaim them before the child may pass it, and kill the
child (OOM) if its own memory would.

Elsewhere the peak is the child's VmHWM (the kernel's exact high-water mark of its resident
set) less its file-backed and shared part (RssFile + RssShmem: the libraries it maps, about
0.1 GiB), both read from /proc/self/status as the child exits (SPECMOE_NO_CGROUP=1
measures so everywhere).
"""

from __future__ import annotations

import functools
import itertools
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from specmoe.bench.cgroup import Cgroup

# Runs `python -m MODULE ARGS...` and writes the process's /proc/self/status to PATH as it exits.
EXIT_STATUS = """
import atexit, runpy, sys
path, module = sys.argv[1], sys.argv[2]
def record():
    with open("/proc/self/status") as src, open(path, "w") as dst:
        dst.write(src.read())
atexit.register(record)
sys.argv = [module, *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""

_names = itertools.count()


@dataclass
class Measured:
    returncode: int
    stdout: str
    stderr: str
    peak: int | None  # the exact peak of the child's own memory (bytes); None if it did not exit normally
    method: str  # how `peak` was measured
    hwm: int | None  # VmHWM at exit: the whole resident set's high-water mark
    file_part: int | None  # RssFile + RssShmem at exit
    cgroup_peak: int | None  # the cgroup's peak, where the child had a cgroup of its own
    cgroup_page_cache: int | None  # the page cache still charged to that cgroup after the child exited
    killed_at_limit: bool  # the kernel killed the child when it would have passed `limit`

    @property
    def hwm_anon(self) -> int | None:
        """VmHWM less the file-backed part: the high-water mark of the child's own memory."""
        return None if self.hwm is None or self.file_part is None else self.hwm - self.file_part


def _status(path: Path) -> dict[str, int]:
    fields = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


@functools.cache
def interpreter_libraries() -> tuple[Path, ...]:
    """The shared objects a child of this interpreter may map: every one under its
    site-packages and its standard library's extension modules, and the files this process maps."""
    roots = {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    roots.add(Path(os.__file__).parent / "lib-dynload")
    found = {path for root in roots if root.is_dir() for path in root.rglob("*.so*") if path.is_file()}
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and Path(fields[5]).is_file():
            found.add(Path(fields[5]))
    return tuple(sorted(found))


@functools.cache
def fresh_interpreter_memory(measure: str) -> int:
    """What a fresh interpreter holds with specmoe's engine imported, by
    `specmoe.base.memory.<measure>` (anon_rss_bytes: its own memory; resident_bytes: with
    the libraries it maps, which --memory-limit counts), its libraries read here first as
    before every measured child."""
    warm([])
    probe = (f"import specmoe.api, specmoe.engine.engine; from specmoe.base.memory import {measure}; "
             f"print({measure}())")
    return int(subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout)


def warm(paths) -> None:
    """Read every file under `paths`, and the interpreter's libraries, here: their pages in
    the page cache are then this process's. A library page a child brought in would be
    charged to it, and once its limit reclaimed the page, to the next child that maps it:
    with the libraries evicted first, a run's cgroup peak was 20 MiB over its own memory's."""
    buf = memoryview(bytearray(16 << 20))
    files = [p for root in paths for p in (sorted(Path(root).rglob("*")) if Path(root).is_dir() else [Path(root)])]
    for path in [*files, *interpreter_libraries()]:
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def run_module(module: str, args: list[str], *, env: dict, status_dir: Path, limit: int | None = None,
               warm_paths=()) -> Measured:
    """Run `python -m module args`, in a memory cgroup of its own where possible, and measure its peak."""
    warm(warm_paths)
    status = Path(status_dir) / f"status-{os.getpid()}-{next(_names)}"
    cmd = [sys.executable, "-c", EXIT_STATUS, str(status), module, *args]
    group = Cgroup.make(limit)
    if group is not None:
        cmd = group.join_command(cmd)
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
        cgroup_peak = group.peak() if group is not None else None
        page_cache = group.page_cache() if group is not None else None
        killed = group is not None and group.oom_kills() > 0
    finally:
        if group is not None:
            group.remove()
    fields = _status(status) if status.is_file() else {}
    hwm = fields.get("VmHWM")
    file_part = fields["RssFile"] + fields.get("RssShmem", 0) if "RssFile" in fields else None
    if proc.returncode != 0:
        peak, method = None, "none: the run failed"
    elif cgroup_peak is not None:
        peak, method = cgroup_peak, f"its memory cgroup's {group._peak_file} (cgroup v{2 if group.v2 else 1})"
    else:
        peak = None if hwm is None or file_part is None else hwm - file_part
        method = "VmHWM - RssFile - RssShmem at exit"
    return Measured(proc.returncode, proc.stdout, proc.stderr, peak, method, hwm, file_part, cgroup_peak, page_cache,
                    killed)
