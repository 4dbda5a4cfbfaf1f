"""A file the disk tier reads with the page cache bypassed, so that the bandwidth measured
is the disk's: O_DIRECT where the file system takes it, else buffered reads each dropped
from the page cache after it (posix_fadvise(DONTNEED)), with a one-line warning.

O_DIRECT wants the offset, the length and the buffer aligned to the logical block size
(ALIGN covers every common one); some file systems accept O_DIRECT at open and refuse the
read (EINVAL): the file then falls back to buffered reads, once, for every reader thread.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
from pathlib import Path

from ..base.errors import warn

ALIGN = 4096  # O_DIRECT needs offsets, sizes and buffers aligned to the logical block size


class DirectFile:
    """One file, read by several reader threads at once. `fix`: what the warning tells a
    user whose file system cannot bypass the page cache."""

    def __init__(self, path: Path, fix: str):
        self.path, self._fix = path, fix
        self.fd, self.direct, self.reason = open_direct(path)
        self._lock = threading.Lock()
        self._retired: list[int] = []  # replaced by a fallback: another reader may still be in a read on one
        if not self.direct:
            self._warn()

    def pread(self, buf, offset: int) -> int:
        """Read into `buf` (aligned: an mmap or a view of one from its start) at `offset`."""
        fd, direct = self.fd, self.direct
        try:
            got = os.preadv(fd, [buf], offset)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            self._fall_back(fd, f"O_DIRECT read refused: {exc.strerror}")
            got = os.preadv(self.fd, [buf], offset)
        if not self.direct:  # drop what the read put in the page cache: the next read hits the disk
            os.posix_fadvise(self.fd, offset, len(buf), os.POSIX_FADV_DONTNEED)
        return got

    def _fall_back(self, failed_fd: int, reason: str) -> None:
        with self._lock:
            if self.fd != failed_fd:  # another reader fell back already
                return
            # not closed yet: another reader may be inside a read on it (closed by close())
            self._retired.append(self.fd)
            self.fd, self.direct, self.reason = os.open(self.path, os.O_RDONLY), False, reason
        self._warn()

    def _warn(self) -> None:
        warn(f"{self.path.parent} does not bypass the page cache ({self.reason}); expert reads are buffered and "
             f"dropped with posix_fadvise(DONTNEED), so repeated reads may come from memory, not the disk: {self._fix}")

    def close(self) -> None:
        for fd in self._retired:
            os.close(fd)
        self._retired = []
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def open_direct(path: Path) -> tuple[int, bool, str]:
    """(fd, whether reads bypass the page cache, why or why not)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return os.open(path, os.O_RDONLY), False, f"O_DIRECT is not available on {sys.platform}"
    try:
        return os.open(path, os.O_RDONLY | flag), True, "O_DIRECT"
    except OSError as exc:  # e.g. a file system without direct I/O
        return os.open(path, os.O_RDONLY), False, f"O_DIRECT refused: {exc.strerror}"


def direct_io_support(directory: Path) -> tuple[bool, str]:
    """Whether files in `directory` can be read with the page cache bypassed, and why
    (for `specmoe info`): opens and reads a small file there the way the store does."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".direct-io-probe-{os.getpid()}"
    try:
        probe.write_bytes(bytes(ALIGN))
        return direct_read_support(probe)
    finally:
        probe.unlink(missing_ok=True)


def direct_read_support(path: Path) -> tuple[bool, str]:
    """Whether `path` itself can be read with the page cache bypassed, and why (for `specmoe
    info` on a GGUF file, which the disk tier reads in place): its first block read as the
    store reads it, nothing written."""
    fd, direct, reason = open_direct(path)
    try:
        if direct:
            os.preadv(fd, [mmap.mmap(-1, ALIGN)], 0)
    except OSError as exc:
        direct, reason = False, f"O_DIRECT read refused: {exc.strerror}"
    finally:
        os.close(fd)
    return direct, reason
