"""A GGUF model file (llama.cpp's format), or the shards of a split one, read lazily.

The header (metadata and the tensor index) is parsed with the `gguf` package, llama.cpp's
own reader; tensor bytes are read with `pread` into tensors of torch's allocation, never
taken from a memory map (a touched mapped page stays resident: a pass over every expert
would hold the whole file). A tensor's shape is given here in torch's order, outermost
first ([E, rows, cols] for stacked experts), where GGUF lists ggml's innermost-first.

`--model` may name the file, a directory holding one GGUF model, or the first shard of a
split model (`NAME-00001-of-00003.gguf`); the other shards must lie beside it.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import SpecMoEError
from .gguf_quants import BLOCKS, TYPE_NAMES, dequantize

SHARD = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class GGUFTensor:
    """Where one tensor's bytes are and how they are encoded."""

    name: str
    type_name: str  # a ggml type (gguf_quants.TYPE_NAMES)
    shape: tuple[int, ...]  # torch's order: the last dimension is a row
    path: Path
    offset: int  # absolute, in `path`
    nbytes: int

    @property
    def rows(self) -> int:
        n = 1
        for d in self.shape[:-1]:
            n *= d
        return n


def is_gguf(path: Path) -> bool:
    """Whether --model names a GGUF model: a .gguf file, a file that starts as GGUF files do
    (Ollama keeps its models as blobs named by their hash), or a directory with one and no config.json."""
    path = Path(path)
    if path.suffix == ".gguf":
        return True
    if path.is_file():
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    return path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*.gguf"))


def model_file(path: Path) -> Path:
    """The GGUF file --model names: the file itself, or the one model file (or first shard) in a directory."""
    path = Path(path)
    if not path.exists():
        raise SpecMoEError(f"GGUF file {path} does not exist; pass --model FILE.gguf (or a directory holding one)")
    if path.is_file():
        return path
    files = sorted(p for p in path.glob("*.gguf") if not _is_later_shard(p) and not p.name.startswith("mmproj"))
    if len(files) != 1:
        names = ", ".join(p.name for p in files) or "none"
        raise SpecMoEError(f"{path}: expected one GGUF model file, found {names}; pass --model FILE.gguf")
    return files[0]


def _is_later_shard(p: Path) -> bool:
    m = SHARD.match(p.name)
    return bool(m) and int(m["no"]) != 1


def shard_paths(first: Path) -> list[Path]:
    """All files of the model whose first (or only) file is `first`, in order; a missing one is an error."""
    m = SHARD.match(first.name)
    if not m:
        return [first]
    if int(m["no"]) != 1:
        raise SpecMoEError(f"{first} is shard {int(m['no'])} of a split GGUF model; pass the first shard "
                           f"({m['stem']}-00001-of-{m['count']}.gguf)")
    count = int(m["count"])
    paths = [first.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)]
    for p in paths:
        if not p.is_file():
            raise SpecMoEError(f"{p}: shard {paths.index(p) + 1} of {count} of the split GGUF model is missing; "
                               "download it beside the first shard")
    return paths


class GGUFFile:
    """Metadata and tensors of one GGUF model (all its shards)."""

    def __init__(self, path: str | Path):
        self.path = model_file(Path(path))
        self.paths = shard_paths(self.path)
        self.fields: dict = {}
        self.tensors: dict[str, GGUFTensor] = {}
        for p in self.paths:
            self._read_header(p)
        self._fd: dict[Path, int] = {}

    def _read_header(self, path: Path) -> None:
        try:
            from gguf import GGUFReader
        except ImportError:
            raise SpecMoEError(f"{path} is a GGUF file: install the package that reads it, pip install gguf") from None
        size = path.stat().st_size
        try:
            reader = GGUFReader(str(path))
        except Exception as exc:  # the reader raises ValueError, IndexError, struct errors ...
            raise SpecMoEError(f"{path}: not a readable GGUF file, truncated or corrupt ({type(exc).__name__}: "
                               f"{exc}); download it again") from None
        for key, field in reader.fields.items():
            self.fields.setdefault(key, field)
        for t in reader.tensors:
            type_id = int(t.tensor_type)
            type_name = TYPE_NAMES.get(type_id, f"type {type_id}")
            if type_name not in BLOCKS:
                raise SpecMoEError(f"{path}: tensor {t.name} has ggml {type_name}, which specmoe cannot read; use a "
                                   "file quantized as Q8_0, Q6_K, Q5_K, Q4_K, Q4_0 or MXFP4")
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise SpecMoEError(f"{path}: truncated ({size:,} bytes, tensor {t.name} ends at {end:,}); "
                                   "download the file again")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = GGUFTensor(t.name, type_name, shape, path, int(t.data_offset), int(t.n_bytes))
        del reader  # its memory map: only the header's pages were touched

    # --- metadata ---------------------------------------------------------------------------

    def value(self, key: str, default=None):
        """A metadata value (a number, a string or a list), `default` when absent."""
        field = self.fields.get(key)
        if field is None:
            return default
        return field.contents()

    @property
    def architecture(self) -> str:
        arch = self.value("general.architecture")
        if not arch:
            raise SpecMoEError(f"{self.path}: no general.architecture in the GGUF metadata; the file is not a model")
        return arch

    def arch_value(self, key: str, default=None):
        """`{architecture}.{key}`, as llama.cpp names its hyperparameters."""
        return self.value(f"{self.architecture}.{key}", default)

    # --- tensors ------------------------------------------------------------------------------

    def info(self, name: str) -> GGUFTensor:
        t = self.tensors.get(name)
        if t is None:
            raise SpecMoEError(f"{self.path}: tensor {name!r} is missing from the GGUF file")
        return t

    def read(self, name: str, start: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """Bytes [start, start + nbytes) of a tensor's data, as uint8."""
        t = self.info(name)
        nbytes = t.nbytes - start if nbytes is None else nbytes
        out = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy())
        fd = self._fd.get(t.path)
        if fd is None:
            fd = self._fd[t.path] = os.open(t.path, os.O_RDONLY)
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], t.offset + start + done)
            if n <= 0:
                raise SpecMoEError(f"{t.path}: tensor {name} could not be read whole (the file shrank?)")
            done += n
        return out

    def slice_bytes(self, name: str, index: int) -> torch.Tensor:
        """The bytes of `tensor[index]` along its first dimension (one expert of a stacked tensor)."""
        t = self.info(name)
        per = t.nbytes // t.shape[0]
        return self.read(name, index * per, per)

    def dequantized(self, name: str) -> torch.Tensor:
        """A tensor in float32, in its shape."""
        t = self.info(name)
        return dequantize(self.read(name), t.type_name, t.rows, t.shape[-1]).reshape(t.shape)

    def fingerprint(self) -> str:
        parts = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in self.paths]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def close(self) -> None:
        for fd in self._fd.values():
            os.close(fd)
        self._fd.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
