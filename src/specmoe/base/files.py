"""Files that several processes share: written whole or not at all, built by one at a time.

`publish` writes under a name no other process uses and renames the result over the
final name, so a reader sees the old file or the new one, never half of one, and a
build that dies leaves only its temporary file behind. `locked` serialises builders of
the same file (an exclusive `fcntl.flock` on `<name>.lock`, released by the kernel when
the holder exits, however it exits); under it, `remove_leftovers` deletes what builds
that died left. `keep` publishes a file that only saves work, and goes on without it
where the disk refuses.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import warn


def temporary_name(path: Path) -> Path:
    """A sibling of `path` that no other build uses: `<name>.<pid>.<random>.tmp`."""
    return path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def publish(path: Path, write: Callable[[Path], None]) -> None:
    """Have `write` fill a temporary sibling, flush it to disk, rename it to `path`.

    On any failure (a full disk, an interrupt) the temporary file is removed and the
    error propagates; `path` is untouched."""
    tmp = temporary_name(path)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _sync_directory(path.parent)


def keep(path: Path, write: Callable[[Path], None], what: str) -> None:
    """`publish` a file that only saves recomputing something: where it cannot be written
    (a read-only or full disk), say so and go on."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        publish(path, write)
    except OSError as exc:
        warn(f"cannot keep {what} in {path} ({(exc.strerror or str(exc)).lower()}); it is computed again next time")


def _sync_directory(directory: Path) -> None:
    # the rename itself must reach the disk, or a crash may bring back the old name
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the exclusive lock of `path` (`<name>.lock` beside it), waiting for it if needed."""
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def remove_leftovers(path: Path) -> list[Path]:
    """Delete the temporary files of earlier builds of `path`; call it under `locked(path)`
    (a build in progress holds the lock, so what is left is from builds that died)."""
    removed = []
    for stale in path.parent.glob(f"{path.name}.*.tmp"):
        with contextlib.suppress(OSError):
            stale.unlink()
            removed.append(stale)
    return removed
