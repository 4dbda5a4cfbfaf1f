"""Memory cgroups for measuring a child process from outside it (Linux; root on cgroup v1,
or v2 with the memory controller enabled below this process's cgroup).

The kernel charges every page a process in the cgroup allocates, and every page of the page
cache it brings in, to the cgroup: `memory.max_usage_in_bytes` (v2: `memory.peak`) is the
exact peak, however short. With a limit, the kernel reclaims page cache before letting the
cgroup pass it and kills a process (OOM) when its own memory would: a limit so enforced is a
machine with that much memory. The tests measure memory bounds with it, and the bench runs
engines under one cap with it (SPECMOE_NO_CGROUP=1 turns it off, as on a machine without).
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

NO_CGROUP = "SPECMOE_NO_CGROUP"
_names = itertools.count()


class Cgroup:
    """A memory cgroup below this process's own, or None from `make` where the machine does not allow one."""

    prefix = "specmoe"

    def __init__(self, path: Path, v2: bool):
        self.path, self.v2 = path, v2

    @classmethod
    def parent(cls) -> tuple[Path, bool] | None:
        """This process's memory cgroup directory, and whether it is v2, if children can be made there."""
        try:
            mounts = Path("/proc/self/mountinfo").read_text().splitlines()
            own = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in mounts:
            fields, _, fs = line.partition(" - ")
            fields, fs = fields.split(), fs.split()
            root, point, fstype, options = fields[3], fields[4], fs[0], fs[-1].split(",")
            if fstype == "cgroup" and "memory" in options:
                mine = [ln.split(":", 2)[2] for ln in own if "memory" in ln.split(":")[1].split(",")]
                v2 = False
            elif fstype == "cgroup2":
                mine = [ln.split(":", 2)[2] for ln in own if ln.startswith("0::")]
                v2 = True
            else:
                continue
            if not mine or not (mine[0] + "/").startswith(root.rstrip("/") + "/"):
                continue
            path = Path(point) / os.path.relpath(mine[0], root)
            if v2:  # children get the memory controller only where it is enabled below this cgroup
                try:
                    if "memory" not in (path / "cgroup.subtree_control").read_text().split():
                        continue
                except OSError:
                    continue
            if os.access(path, os.W_OK):
                return path, v2
        return None

    @classmethod
    def make(cls, limit: int | None) -> Cgroup | None:
        found = None if os.environ.get(NO_CGROUP) == "1" else cls.parent()
        if found is None:
            return None
        parent, v2 = found
        path = parent / f"{cls.prefix}-{os.getpid()}-{next(_names)}"
        try:
            path.mkdir()
        except OSError:
            return None
        group = cls(path, v2)
        if not (path / group._peak_file).is_file():  # v2 before Linux 5.19 has no memory.peak
            group.remove()
            return None
        if limit is not None:
            group._write("memory.max" if v2 else "memory.limit_in_bytes", limit)
            # without swap for its own memory: past the limit it is killed, not swapped out
            group._write("memory.swap.max" if v2 else "memory.swappiness", 0)
            if not v2 and (path / "memory.memsw.limit_in_bytes").is_file():
                group._write("memory.memsw.limit_in_bytes", limit)
        return group

    @property
    def _peak_file(self) -> str:
        return "memory.peak" if self.v2 else "memory.max_usage_in_bytes"

    def _write(self, name: str, value: int) -> None:
        try:
            (self.path / name).write_text(str(value))
        except OSError:
            if name in ("memory.max", "memory.limit_in_bytes"):
                raise

    def peak(self) -> int:
        return int((self.path / self._peak_file).read_text())

    def page_cache(self) -> int:
        """Bytes of page cache charged to the cgroup now (files its processes brought into
        memory first: read, mapped or written), from memory.stat ("file"; v1: "cache")."""
        stat = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines()
                    if len(line.split()) == 2)
        return int(stat.get("file" if self.v2 else "cache", 0))

    def join_command(self, cmd: list[str]) -> list[str]:
        """`cmd` run so that it starts inside this cgroup: a shell joins it, then becomes `cmd`
        (every page the command ever holds is counted)."""
        return ["sh", "-c", f'echo $$ > "{self.path}/cgroup.procs" && exec "$@"', "sh", *cmd]

    def oom_kills(self) -> int:
        text = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0))

    def remove(self) -> None:
        for _ in range(50):  # the child's exit may take a moment to leave the cgroup
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.02)
