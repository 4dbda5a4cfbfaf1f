"""Safetensors, one tensor at a time: for rewriting a checkpoint without holding it.

Reading uses `pread` on the byte range the header names, into a tensor of torch's own
(aligned) allocation (no memory map: a mapped file's pages stay in the process's
resident memory once touched, so a stream over a whole checkpoint would look as if it
held it; and a mapped tensor starts wherever the file puts it). Writing lays the header
out first, from names, dtypes and shapes known in advance, then appends each tensor's
bytes in that order.

The format: an 8-byte little-endian header length, the JSON header (`{name: {dtype,
shape, data_offsets: [begin, end]}, "__metadata__": {...}}`, padded with spaces to a
multiple of 8), then the tensors' bytes, offsets relative to the end of the header.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SpecMoEError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
CODES = {dtype: code for code, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.tensor([], dtype=self.dtype).element_size()


class SafetensorsReader:
    """One safetensors file's header, and its tensors read on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error) as exc:
            raise SpecMoEError(f"{self.path}: not a readable safetensors file ({exc}); download or save it again") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + length
        self.entries, self._offsets = {}, {}
        self.unknown = {}  # name -> a dtype this reader has no torch dtype for (an error when it is read)
        for name, info in header.items():
            if info["dtype"] not in DTYPES:
                self.unknown[name] = info["dtype"]
                continue
            self.entries[name] = TensorEntry(name, DTYPES[info["dtype"]], tuple(info["shape"]))
            self._offsets[name] = tuple(info["data_offsets"])

    def read(self, name: str, row: int | None = None) -> torch.Tensor:
        """The tensor, or only its `row`-th slice along the first dimension."""
        if name in self.unknown:
            raise SpecMoEError(f"{self.path}: tensor {name!r} has dtype {self.unknown[name]}, "
                               "which specmoe cannot read")
        begin, end = self._offsets[name]
        entry = self.entries[name]
        if row is not None:
            size = (end - begin) // entry.shape[0]
            begin, end = begin + row * size, begin + (row + 1) * size
            entry = TensorEntry(name, entry.dtype, entry.shape[1:])
        # read straight into a tensor of torch's own (64-byte aligned) allocation
        raw = torch.empty(end - begin, dtype=torch.uint8)
        if not raw.numel():
            return torch.empty(entry.shape, dtype=entry.dtype)
        with open(self.path, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [raw.numpy()], self.data_start + begin)
        if got != raw.numel():
            raise SpecMoEError(f"{self.path}: tensor {name!r} is cut short (truncated file); download it again")
        return raw.view(entry.dtype).reshape(entry.shape)


class SafetensorsWriter:
    """Writes `entries`, in their order, to `path`; `write` takes each tensor in turn."""

    def __init__(self, path: Path, entries: list[TensorEntry], metadata: dict[str, str] | None = None):
        header, offset = {}, 0
        for e in entries:
            header[e.name] = {"dtype": CODES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        if metadata:
            header["__metadata__"] = metadata
        body = json.dumps(header, separators=(",", ":")).encode()
        body += b" " * (-len(body) % 8)
        self.entries, self.next = list(entries), 0
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(body)) + body)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want = self.entries[self.next]
        if name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
            raise RuntimeError(f"internal: writing {name} {tensor.dtype} {list(tensor.shape)} where the header "
                               f"planned {want.name} {want.dtype} {list(want.shape)}")
        if tensor.numel():
            self.file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        self.next += 1

    def close(self) -> None:
        self.file.close()
        if self.next != len(self.entries):
            raise RuntimeError(f"internal: {len(self.entries) - self.next} tensors planned but not written")
