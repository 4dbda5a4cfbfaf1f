"""The offload tier: where every routed expert lives when it is not on the device.

`host`: all experts in CPU memory, one contiguous buffer each (pinned when the compute
device is CUDA, so copies can be asynchronous).
`disk`: all experts written once as aligned blobs into one file, reused while the
checkpoint is unchanged, read with the page cache bypassed (O_DIRECT, else
posix_fadvise(DONTNEED)) so that the bandwidth measured is the disk's. A CRC32 per blob is
verified on its first read. `bandwidth` caps the read rate: an *emulation* of a slower
link (PCIe 3, a network store), not a measurement.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import threading
import time
import zlib
from pathlib import Path

import torch

from ..base.checkpoint import Checkpoint
from ..base.errors import SpecMoEError
from ..base.paths import offload_dir

ALIGN = 4096  # O_DIRECT needs offsets, sizes and buffers aligned to the logical block size
Key = tuple[int, int]  # (layer, expert)


class ExpertStore:
    """All routed experts of a model in the slow tier, each one contiguous buffer."""

    tier = "none"

    def __init__(self, keys: list[Key], numel: int, dtype: torch.dtype, bandwidth: float | None):
        self.keys = keys
        self.numel, self.dtype = numel, dtype
        self.nbytes = numel * torch.tensor([], dtype=dtype).element_size()
        self.bandwidth = bandwidth
        self.read_bytes = 0
        self.read_s = 0.0

    def read_into(self, key: Key, dest: torch.Tensor) -> None:
        """Copy expert `key` into `dest` (1-D, `numel` elements, host memory)."""
        start = time.perf_counter()
        self._read(key, dest)
        self._throttle(start)
        self.read_bytes += self.nbytes
        self.read_s += time.perf_counter() - start

    def _read(self, key: Key, dest: torch.Tensor) -> None:
        raise NotImplementedError

    def _throttle(self, start: float) -> None:
        # Emulated link: a read of n bytes takes at least n / bandwidth seconds.
        if self.bandwidth:
            remaining = self.nbytes / self.bandwidth - (time.perf_counter() - start)
            if remaining > 0:
                time.sleep(remaining)

    def host_tensor(self, key: Key) -> torch.Tensor | None:
        """The expert's buffer in host memory when the tier is host memory, else None."""
        return None

    def close(self) -> None:
        pass


class HostStore(ExpertStore):
    tier = "host"

    def __init__(self, ckpt: Checkpoint, keys: list[Key], dtype: torch.dtype, pin: bool, bandwidth=None):
        numel = ckpt.config.expert_params
        super().__init__(keys, numel, dtype, bandwidth)
        self.index = {key: i for i, key in enumerate(keys)}
        self.buffers = torch.empty(len(keys), numel, dtype=dtype)
        self.pinned = False
        if pin:
            try:
                self.buffers = self.buffers.pin_memory()
                self.pinned = True
            except RuntimeError as exc:  # e.g. locked-memory limits
                print(f"specmoe: warning: could not pin host memory for experts ({exc}); copies will be synchronous", file=sys.stderr)
        for key, i in self.index.items():
            self.buffers[i].copy_(ckpt.expert_buffer(*key, dtype))

    def _read(self, key: Key, dest: torch.Tensor) -> None:
        dest.copy_(self.buffers[self.index[key]])

    def host_tensor(self, key: Key) -> torch.Tensor:
        return self.buffers[self.index[key]]


class DiskStore(ExpertStore):
    tier = "disk"

    def __init__(self, ckpt: Checkpoint, keys: list[Key], dtype: torch.dtype, directory: str | None, bandwidth=None):
        numel = ckpt.config.expert_params
        super().__init__(keys, numel, dtype, bandwidth)
        self.blob_size = -(-self.nbytes // ALIGN) * ALIGN
        dtype_name = str(dtype).removeprefix("torch.")
        base = Path(directory) if directory else offload_dir()
        base.mkdir(parents=True, exist_ok=True)
        stem = f"experts-{ckpt.fingerprint()}-{dtype_name}"
        self.path = base / f"{stem}.bin"
        self.manifest_path = base / f"{stem}.json"
        self.index = {key: i for i, key in enumerate(keys)}
        self.checksums = self._load_or_write(ckpt)
        self.verified = [False] * len(keys)
        self.fd, self.direct, self.direct_reason = _open_direct(self.path)
        if not self.direct:
            _warn_buffered(self.path, self.direct_reason)
        self._buffers = threading.local()  # one aligned bounce buffer per reading thread

    def _load_or_write(self, ckpt: Checkpoint) -> list[int]:
        if self.manifest_path.is_file() and self.path.is_file():
            try:
                manifest = json.loads(self.manifest_path.read_text())
                if manifest["keys"] == [list(k) for k in self.keys] and manifest["blob_size"] == self.blob_size:
                    return manifest["crc32"]
            except (ValueError, KeyError):
                pass  # rewrite a manifest we cannot trust
        # one temporary file per process: replicas on one machine may write the same blob file at once
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        checksums = []
        blob = bytearray(self.blob_size)
        with open(tmp, "wb") as f:
            for key in self.keys:
                data = ckpt.expert_buffer(*key, self.dtype).contiguous().view(torch.uint8).numpy().tobytes()
                blob[: len(data)] = data
                checksums.append(zlib.crc32(data))
                f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        manifest = {"keys": [list(k) for k in self.keys], "blob_size": self.blob_size, "nbytes": self.nbytes, "crc32": checksums}
        tmp = self.manifest_path.with_suffix(f".json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, self.manifest_path)  # a replica reading it meanwhile sees the old one or the new one
        return checksums

    def _bounce(self) -> mmap.mmap:
        buf = getattr(self._buffers, "buf", None)
        if buf is None:
            buf = mmap.mmap(-1, self.blob_size)  # page-aligned, as O_DIRECT requires
            self._buffers.buf = buf
        return buf

    def _read(self, key: Key, dest: torch.Tensor) -> None:
        i = self.index[key]
        buf = self._bounce()
        offset = i * self.blob_size
        try:
            got = os.preadv(self.fd, [buf], offset)
        except OSError as exc:  # some file systems accept O_DIRECT at open and refuse the read
            if not self.direct:
                raise
            self._fall_back_to_buffered(f"O_DIRECT read refused: {exc.strerror}")
            got = os.preadv(self.fd, [buf], offset)
        if got < self.nbytes:
            raise SpecMoEError(f"{self.path}: short read of expert {key} ({got} of {self.nbytes} bytes); delete the file to rebuild it")
        if not self.direct:  # drop what the read put in the page cache: the next read hits the disk
            os.posix_fadvise(self.fd, offset, self.blob_size, os.POSIX_FADV_DONTNEED)
        view = memoryview(buf)[: self.nbytes]
        if not self.verified[i]:
            if zlib.crc32(view) != self.checksums[i]:
                raise SpecMoEError(f"{self.path}: checksum mismatch for expert {key}; delete the file to rebuild it")
            self.verified[i] = True
        dest.view(torch.uint8).copy_(torch.frombuffer(view, dtype=torch.uint8))

    def _fall_back_to_buffered(self, reason: str) -> None:
        os.close(self.fd)
        self.fd, self.direct, self.direct_reason = os.open(self.path, os.O_RDONLY), False, reason
        _warn_buffered(self.path, reason)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _open_direct(path: Path) -> tuple[int, bool, str]:
    """(fd, whether reads bypass the page cache, why or why not)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return os.open(path, os.O_RDONLY), False, f"O_DIRECT is not available on {sys.platform}"
    try:
        return os.open(path, os.O_RDONLY | flag), True, "O_DIRECT"
    except OSError as exc:  # e.g. a file system without direct I/O
        return os.open(path, os.O_RDONLY), False, f"O_DIRECT refused: {exc.strerror}"


def _warn_buffered(path: Path, reason: str) -> None:
    print(f"specmoe: warning: {path.parent} does not bypass the page cache ({reason}); expert reads are "
          "buffered and dropped with posix_fadvise(DONTNEED), so repeated reads may come from memory, "
          "not the disk: put --offload-dir on a file system with direct I/O", file=sys.stderr)


def direct_io_support(directory: Path) -> tuple[bool, str]:
    """Whether files in `directory` can be read with the page cache bypassed, and why
    (for `specmoe info`): opens and reads a small file there the way the store does."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".direct-io-probe-{os.getpid()}"
    try:
        probe.write_bytes(bytes(ALIGN))
        fd, direct, reason = _open_direct(probe)
        try:
            if direct:
                os.preadv(fd, [mmap.mmap(-1, ALIGN)], 0)
        except OSError as exc:
            direct, reason = False, f"O_DIRECT read refused: {exc.strerror}"
        finally:
            os.close(fd)
        return direct, reason
    finally:
        probe.unlink(missing_ok=True)


def open_store(ckpt: Checkpoint, keys: list[Key], dtype: torch.dtype, device: torch.device, tier: str,
               directory: str | None = None, bandwidth: float | None = None) -> ExpertStore:
    if tier == "host":
        return HostStore(ckpt, keys, dtype, pin=device.type == "cuda", bandwidth=bandwidth)
    if tier == "disk":
        return DiskStore(ckpt, keys, dtype, directory, bandwidth)
    raise SpecMoEError(f"unknown offload tier {tier!r}; choose one of: disk, host")
