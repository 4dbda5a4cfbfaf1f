"""The offload tier: where every routed expert lives when it is not on the device.

`host`: all experts in CPU memory, one contiguous buffer each (pinned when the compute
device is CUDA, so copies can be asynchronous).
`disk`: all experts as aligned blobs in one file (expert_file.py: built once per
checkpoint under a lock, checked when opened, a blob that fails its CRC32 on its first
read rewritten from the checkpoint), read with the page cache bypassed (O_DIRECT, else
posix_fadvise(DONTNEED), with a warning) so that the bandwidth measured is the disk's.
`bandwidth` caps the read rate: an *emulation* of a slower link (PCIe 3, a network
store), not a measurement; with several readers it caps their sum.

Reads run on the transfer engine's reader threads, `read_depth` of them (several reads in
flight for the disk, DISK_READ_DEPTH; one for host memory). Each reader thread owns its
scratch: the disk's aligned bounce buffer and, where the pool's slots need a conversion
or a CUDA copy needs pinned staging, one expert-sized host tensor (`reader_tensor`).
`host_scratch_bytes()` is what all of that can take at most, outside the device pool.
"""

from __future__ import annotations

import mmap
import threading
import time
import zlib
from pathlib import Path

import torch

from ..base.checkpoint import Checkpoint
from ..base.errors import SpecMoEError, os_failure, warn
from ..base.paths import offload_dir
from .direct_file import DirectFile
from .expert_file import ExpertLayout, Key, open_or_build, repair_blob
from .formats import ExpertFormat
from .read_meter import ReadMeter

# Reads the disk tier keeps in flight. Measured on this project's 2-core machine (a virtio
# disk; 2, 8 and 24 MiB O_DIRECT reads at random offsets, each depth on a region no earlier
# run read): depth 2 read 1.2-2x faster than depth 1, depth 4 no faster than 2, depth 8
# slower (docs/MEMORY.md has the table). Each reader also copies its expert into the pool
# on a CPU that computes, so more threads than that only contend.
DISK_READ_DEPTH = 2


class ExpertStore:
    """All routed experts of a model in the slow tier, each one contiguous buffer of
    `numel` elements of `dtype` (the expert format's: compute dtype, or a quantized blob)."""

    tier = "none"

    read_depth = 1  # reader threads, each with one read in flight

    def __init__(self, keys: list[Key], numel: int, dtype: torch.dtype, bandwidth: float | None,
                 reader_tensor: bool = False, pin: bool = False):
        self.keys = keys
        self.numel, self.dtype = numel, dtype
        self.nbytes = numel * torch.tensor([], dtype=dtype).element_size()
        self.bandwidth = bandwidth
        self._link_free_at = 0.0  # the emulated link's: when its last reservation ends
        self._link_lock = threading.Lock()
        self._reader_tensor, self._pin = reader_tensor, pin
        self._local = threading.local()  # each reader thread's own scratch
        self.meter = ReadMeter()

    def reset_counters(self) -> None:
        """Start counting one run's reads (a run's statistics are that run's alone)."""
        self.meter.reset()

    @property
    def read_bytes(self) -> int:
        return self.meter.bytes

    def host_scratch_bytes(self) -> int:
        """Host bytes the tier holds outside the pool at most: per reader thread, its
        bounce buffer and its expert-sized conversion or staging tensor."""
        return self.read_depth * (self._bounce_bytes() + self.nbytes * self._reader_tensor)

    def _bounce_bytes(self) -> int:
        return 0

    def _bounce(self) -> mmap.mmap:
        """This thread's aligned bounce buffer of `_bounce_bytes()` (one per reader thread)."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = mmap.mmap(-1, self._bounce_bytes())  # page-aligned, as O_DIRECT requires
        return buf

    def reader_tensor(self) -> torch.Tensor:
        """This thread's expert-sized host tensor (a read converted from, or staged for a
        CUDA copy from; pinned on CUDA), made on first use: readers never share one."""
        if not self._reader_tensor:
            raise RuntimeError("internal: this store was opened without reader tensors")
        tensor = getattr(self._local, "tensor", None)
        if tensor is None:
            tensor = torch.empty(self.numel, dtype=self.dtype)
            self._local.tensor = tensor.pin_memory() if self._pin else tensor
        return self._local.tensor

    def read_into(self, key: Key, dest: torch.Tensor) -> None:
        """Copy expert `key` into `dest` (1-D, `numel` elements, host memory)."""
        token = self.meter.begin()
        done = 0
        try:
            start = time.perf_counter()
            self._read(key, dest)
            self._throttle(start)
            done = self.nbytes
        finally:
            self.meter.end(token, done)

    def _read(self, key: Key, dest: torch.Tensor) -> None:
        raise NotImplementedError

    def _throttle(self, start: float) -> None:
        # Emulated link: n bytes take n / bandwidth seconds of the link, which readers
        # reserve one after another, so several of them share the rate, not multiply it.
        if not self.bandwidth:
            return
        with self._link_lock:
            begin = max(start, self._link_free_at)
            self._link_free_at = begin + self.nbytes / self.bandwidth
            until = self._link_free_at
        remaining = until - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def host_tensor(self, key: Key) -> torch.Tensor | None:
        """The expert's buffer in host memory when the tier is host memory, else None."""
        return None

    def close(self) -> None:
        pass


class HostStore(ExpertStore):
    tier = "host"

    def __init__(self, ckpt: Checkpoint, keys: list[Key], fmt: ExpertFormat, pin: bool, bandwidth=None):
        # one reader: a copy within memory has no device queue to keep busy
        super().__init__(keys, fmt.numel, fmt.storage_dtype, bandwidth, reader_tensor=fmt.converts)
        self.index = {key: i for i, key in enumerate(keys)}
        self.buffers = torch.empty(len(keys), fmt.numel, dtype=fmt.storage_dtype)
        self.pinned = False
        if pin:
            try:
                self.buffers = self.buffers.pin_memory()
                self.pinned = True
            except RuntimeError as exc:  # e.g. locked-memory limits
                warn(f"could not pin host memory for experts ({exc}); copies will be synchronous")
        for key, i in self.index.items():
            self.buffers[i].copy_(fmt.read(ckpt, *key))

    def _read(self, key: Key, dest: torch.Tensor) -> None:
        dest.copy_(self.buffers[self.index[key]])

    def host_tensor(self, key: Key) -> torch.Tensor:
        return self.buffers[self.index[key]]


class DiskStore(ExpertStore):
    """The experts in one file on disk (expert_file.py: format, build, checks, repair)."""

    tier = "disk"

    def __init__(self, ckpt: Checkpoint, keys: list[Key], fmt: ExpertFormat, directory: str | None, bandwidth=None,
                 cuda: bool = False, read_depth: int | None = None):
        read_depth = checked_read_depth(DISK_READ_DEPTH if read_depth is None else read_depth)
        # a slot in another layout (int4 for the CPU kernel) is converted from a host tensor;
        # a CUDA copy comes from pinned staging
        super().__init__(keys, fmt.numel, fmt.storage_dtype, bandwidth, reader_tensor=fmt.converts or cuda, pin=cuda)
        self.read_depth = read_depth
        fingerprint = ckpt.fingerprint()
        quantization = fmt.quant.identity() if fmt.quant else None
        self.layout = ExpertLayout(fingerprint, fmt.name, tuple(keys), self.nbytes, quantization)
        self.blob_size = self.layout.blob_size
        base = Path(directory) if directory else offload_dir()
        self.path = base / f"experts-{fingerprint}-{fmt.name}.bin"
        self.index = {key: i for i, key in enumerate(keys)}
        self._ckpt, self._format = ckpt, fmt
        self._ckpt_lock = threading.Lock()  # the checkpoint's reader is not thread-safe; repairs run on reader threads
        self._repair_lock = threading.Lock()  # one repair (a write to the file, a counter) at a time
        self.checksums, self.built = open_or_build(self.path, self.layout, self._checkpoint_bytes)
        self.verified = [False] * len(keys)
        self.repaired = 0  # blobs that failed their checksum and were served from the checkpoint
        self.file = DirectFile(self.path, "put --offload-dir on a file system with direct I/O")

    @property
    def fd(self) -> int:
        return self.file.fd

    @property
    def direct(self) -> bool:
        return self.file.direct

    @property
    def direct_reason(self) -> str:
        return self.file.reason

    def _checkpoint_bytes(self, key: Key) -> bytes:
        with self._ckpt_lock:
            return self._format.read(self._ckpt, *key).contiguous().view(torch.uint8).numpy().tobytes()

    def _bounce_bytes(self) -> int:
        return self.blob_size

    def _read_blob(self, i: int) -> memoryview:
        """Blob `i`'s expert bytes as they are on disk (a view of this thread's buffer)."""
        buf = self._bounce()
        try:
            got = self._pread(buf, self.layout.offset(i))
        except OSError as exc:
            raise os_failure(exc, f"cannot read expert {self.keys[i]} from the expert file {self.path}",
                             "check the disk (dmesg), or pass --offload-dir DIR on another disk") from None
        return memoryview(buf)[: min(got, self.nbytes)]

    def _pread(self, buf: mmap.mmap, offset: int) -> int:
        return self.file.pread(buf, offset)

    def _read(self, key: Key, dest: torch.Tensor) -> None:
        i = self.index[key]
        view = self._read_blob(i)
        if not self.verified[i]:
            if len(view) == self.nbytes and zlib.crc32(view) == self.checksums[i]:
                self.verified[i] = True
            else:
                view = self._repair(i, key)
        dest.view(torch.uint8).copy_(torch.frombuffer(view, dtype=torch.uint8))

    def _repair(self, i: int, key: Key):
        """A blob that fails its checksum is never used: serve the checkpoint's bytes and
        rewrite the blob; it counts as verified once a read of it checks out."""
        with self._repair_lock:
            return self._repair_locked(i, key)

    def _repair_locked(self, i: int, key: Key):
        data = self._checkpoint_bytes(key)
        why = repair_blob(self.path, self.layout, i, data)
        self.repaired += 1
        if why is None and zlib.crc32(self._read_blob(i)) == self.checksums[i]:
            self.verified[i] = True
            warn(f"expert {key} in {self.path} failed its checksum; rewrote it from the checkpoint")
        else:
            warn(f"expert {key} in {self.path} failed its checksum and could not be rewritten "
                 f"({why or 'it still reads back wrong'}); reading it from the checkpoint")
        return memoryview(bytearray(data))

    def close(self) -> None:
        self.file.close()


def checked_read_depth(read_depth) -> int:
    if not isinstance(read_depth, int) or isinstance(read_depth, bool) or read_depth < 1:
        raise SpecMoEError(f"disk read depth must be a whole number >= 1, got {read_depth!r}")
    return read_depth
