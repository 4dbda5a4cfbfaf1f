"""The disk tier's expert file: every routed expert as one aligned blob, behind a header
that says what the file was built from. It is a cache derived from the checkpoint, shared
by every process that runs the model from the same directory, and never trusted blindly.

Layout::

    MAGIC (8 bytes) | header length (8 bytes, little endian) | header (JSON) | zeros to ALIGN
    blob 0 | blob 1 | ...      each ALIGN bytes aligned: the expert's bytes, then zeros

The header holds the format version, the checkpoint's fingerprint, the expert format
(the compute dtype, or for quantized experts the scheme and every matrix's codes and
scale grid: `ExpertQuant.identity`), the keys in blob order, the expert size, the blob
size, and a CRC32 per blob (fixed-width hex, so
the header's length, and so the file's size, follow from the layout alone).

- Building: under the file's lock (base/files.locked), so concurrent processes build it
  once and the others wait and use it; written under a unique temporary name and renamed
  into place (base/files.publish), so no one ever opens half a file; leftovers of builds
  that died are removed first.
- Opening: the magic, the header and the file's size are checked; a file that fails is
  rebuilt from the checkpoint with a one-line warning.
- Reading (store.DiskStore): each blob's CRC is checked on its first read; one that fails
  is served from the checkpoint and rewritten in place (`repair_blob`), with a warning.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..base.errors import EnvironmentFailure, os_failure, warn
from ..base.files import locked, publish, remove_leftovers
from ..base.progress import OneTime
from ..base.units import format_bytes
from .direct_file import ALIGN

MAGIC = b"SPMOEXP\x00"
VERSION = 3  # 1: blobs only, with a separate JSON manifest; 2: float experts only
_PREFIX = struct.Struct("<8sQ")  # magic, header length
MAX_HEADER_BYTES = 64 << 20
Key = tuple[int, int]  # (layer, expert)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ExpertLayout:
    """What an expert file must hold: which experts of which checkpoint, in what form."""

    checkpoint: str  # Checkpoint.fingerprint()
    dtype: str  # the expert format's name: "float32", "bfloat16", ... or a quantized one ("int4-1x128-bfloat16")
    keys: tuple[Key, ...]
    expert_bytes: int
    quantization: dict | None = None  # ExpertQuant.identity() of quantized experts

    @property
    def blob_size(self) -> int:
        return _align(self.expert_bytes)

    def identity(self) -> dict:
        return {"format": "specmoe-experts", "version": VERSION, "checkpoint": self.checkpoint, "dtype": self.dtype,
                "quantization": self.quantization, "expert_bytes": self.expert_bytes, "blob_size": self.blob_size,
                "keys": [list(k) for k in self.keys]}

    def header(self, checksums: list[int]) -> bytes:
        body = json.dumps({**self.identity(), "crc32": [f"{c:08x}" for c in checksums]}).encode()
        return _PREFIX.pack(MAGIC, len(body)) + body

    @property
    def data_offset(self) -> int:
        return _align(len(self.header([0] * len(self.keys))))

    @property
    def file_size(self) -> int:
        return self.data_offset + len(self.keys) * self.blob_size

    def offset(self, index: int) -> int:
        return self.data_offset + index * self.blob_size


@dataclass(frozen=True)
class Found:
    """What `inspect` found at a path: the checksums of a good file, else why it is not one."""

    checksums: list[int] | None
    problem: str | None = None  # None with no checksums: there is no file


def inspect(path: Path, layout: ExpertLayout) -> Found:
    """Check the file's magic, header and size against `layout`, reading only the header."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            magic, length = _PREFIX.unpack(f.read(_PREFIX.size).ljust(_PREFIX.size, b"\0"))
            if magic != MAGIC:
                return Found(None, "not an expert file of this specmoe version")
            if length > MAX_HEADER_BYTES:
                return Found(None, "its header is damaged")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        return Found(None)
    except (OSError, ValueError) as exc:  # ValueError: JSON and UTF-8 errors
        return Found(None, f"its header cannot be read ({exc})")
    if not isinstance(header, dict) or {k: header.get(k) for k in layout.identity()} != layout.identity():
        return Found(None, "its header does not match this checkpoint, dtype and layout")
    if size != layout.file_size:
        return Found(None, f"it holds {size} bytes where its header implies {layout.file_size} (truncated?)")
    try:
        checksums = [int(c, 16) for c in header["crc32"]]
    except (KeyError, TypeError, ValueError):
        return Found(None, "its checksums are damaged")
    if len(checksums) != len(layout.keys):
        return Found(None, "its checksums are damaged")
    return Found(checksums)


def open_or_build(path: Path, layout: ExpertLayout, expert: Callable[[Key], bytes]) -> tuple[list[int], bool]:
    """(per-blob checksums, whether this call built the file). `expert(key)` gives an
    expert's bytes from the checkpoint. Raises EnvironmentFailure when the file can be
    neither read nor written."""
    found = inspect(path, layout)
    if found.checksums is not None:
        return found.checksums, False
    fix = (f"pass --offload-dir DIR on a writable disk with {format_bytes(layout.file_size)} free "
           "(the expert file is rebuilt there)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path):
            found = inspect(path, layout)  # another process may have built it while this one waited
            if found.checksums is not None:
                return found.checksums, False
            if found.problem:
                warn(f"the expert file {path} is not usable ({found.problem}); rebuilding it from the checkpoint")
            remove_leftovers(path)
            path.with_suffix(".json").unlink(missing_ok=True)  # version 1's manifest
            _require_room(path, layout.file_size, fix)
            checksums: list[int] = []
            work = OneTime(f"writing this checkpoint's experts into the disk tier's file, once "
                           f"({format_bytes(layout.file_size)} in {path.parent})").begin()
            publish(path, lambda tmp: checksums.extend(_write(tmp, layout, expert, work.update)))
            work.end()
    except OSError as exc:
        raise os_failure(exc, f"cannot write the expert file {path}", fix) from None
    return checksums, True


def _require_room(path: Path, size: int, fix: str) -> None:
    """Refuse before the first byte a file the disk cannot hold: a write of many GB that
    fails near its end costs the user minutes and says less."""
    free = shutil.disk_usage(path.parent).free
    if free < size:
        raise EnvironmentFailure(f"cannot write the expert file {path}: it needs {format_bytes(size)} and the disk "
                                 f"has {format_bytes(free)} free; {fix}")


def _write(tmp: Path, layout: ExpertLayout, expert: Callable[[Key], bytes],
           progress: Callable[[int, int], None] = lambda done, total: None) -> list[int]:
    checksums = []
    blob = bytearray(layout.blob_size)
    with open(tmp, "wb") as f:
        f.seek(layout.data_offset)
        for key in layout.keys:
            data = expert(key)
            blob[: len(data)] = data
            checksums.append(zlib.crc32(data))
            f.write(blob)
            progress(len(checksums), len(layout.keys))
        f.seek(0)
        f.write(layout.header(checksums))
    return checksums


def repair_blob(path: Path, layout: ExpertLayout, index: int, data: bytes) -> str | None:
    """Rewrite blob `index` in place with the checkpoint's bytes; None, or why it could not be."""
    blob = bytes(data) + bytes(layout.blob_size - len(data))
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, blob, layout.offset(index))
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
