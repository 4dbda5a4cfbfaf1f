"""The disk tier of a GGUF file: each expert read where the file keeps it, no copy written.

A GGUF file stacks a block's experts in three tensors (gate, up, down: `blk.N.ffn_*_exps`),
so one expert is three slices of the file, each whole rows of blocks (and, for GPT-OSS,
three slices of float32 biases). A read fetches each slice with the page cache bypassed,
from the 4 KiB boundaries around it (O_DIRECT's alignment: at most 8 KiB more a slice),
and lays it into the expert's blob (base/gguf_layout.py) as the pool's slots hold it.

Against the expert file that the other checkpoints get (expert_file.py): no second copy of
the experts on disk (a Q4_K_M file of 40 GB needed 40 GB more) and no first run spent
writing it; a read is three requests instead of one, and there is no checksum of ours to
check (the file is the checkpoint, as it is for llama.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..base.errors import SpecMoEError, os_failure
from ..base.gguf_arch import EXPERT_PARTS
from ..base.gguf_checkpoint import GGUFCheckpoint
from ..base.gguf_layout import HEADER
from .direct_file import ALIGN, DirectFile
from .expert_file import Key
from .store import DISK_READ_DEPTH, ExpertStore, checked_read_depth


@dataclass(frozen=True)
class Slice:
    """`nbytes` at `offset` of `path` that go to `at` in the expert's blob."""

    path: Path
    offset: int
    nbytes: int
    at: int

    @property
    def span(self) -> tuple[int, int]:
        """The aligned range of the file that holds it."""
        start = self.offset - self.offset % ALIGN
        return start, -(-(self.offset + self.nbytes) // ALIGN) * ALIGN


def reads_in_place(ckpt, fmt) -> bool:
    """Whether the disk tier can read this model's experts from its own file: a GGUF file
    kept in its encoding, its biases (if any) float32 as the blob holds them."""
    q = getattr(fmt, "quant", None)
    if not isinstance(ckpt, GGUFCheckpoint) or getattr(q, "source", None) != "gguf":
        return False
    return not q.bias or all(t.type_name == "F32" for name, t in ckpt.file.tensors.items()
                             if name.endswith("_exps.bias"))


def expert_slices(ckpt, layer: int, expert: int) -> list[Slice]:
    """Where expert `expert` of `layer` lies in the file, section by section of its blob."""
    q = ckpt.config.expert_quant
    sections = q.sections(q.types_of(layer))
    out = []

    def add(tensor: str, at: int) -> int:
        t = ckpt.file.info(tensor)
        per = t.nbytes // t.shape[0]
        out.append(Slice(t.path, t.offset + expert * per, per, at))
        return per

    for part in EXPERT_PARTS:  # gate, up, down
        add(f"blk.{layer}.{part}.weight", sections[part.removeprefix("ffn_").removesuffix("_exps")][0])
    if q.bias:
        gate_bias = add(f"blk.{layer}.ffn_gate_exps.bias", sections["b_in"][0])
        add(f"blk.{layer}.ffn_up_exps.bias", sections["b_in"][0] + gate_bias)
        add(f"blk.{layer}.ffn_down_exps.bias", sections["b_out"][0])
    return out


def gaps(slices: list[Slice], size: int) -> list[tuple[int, int]]:
    """The ranges of a `size`-byte blob that neither the header nor a slice fills."""
    out, end = [], HEADER
    for piece in sorted(slices, key=lambda p: p.at):
        if piece.at > end:
            out.append((end, piece.at))
        end = max(end, piece.at + piece.nbytes)
    return out + ([(end, size)] if end < size else [])


class GGUFFileStore(ExpertStore):
    """The experts of a GGUF checkpoint, read from the GGUF file (and its shards)."""

    tier = "disk"

    def __init__(self, ckpt, keys: list[Key], fmt, bandwidth=None, cuda: bool = False, read_depth: int | None = None):
        super().__init__(keys, fmt.numel, fmt.storage_dtype, bandwidth, reader_tensor=cuda, pin=cuda)
        self.read_depth = checked_read_depth(DISK_READ_DEPTH if read_depth is None else read_depth)
        q = ckpt.config.expert_quant
        self.slices = {key: expert_slices(ckpt, *key) for key in keys}
        self._headers = {layer: torch.tensor(q.header(types), dtype=torch.uint8) for layer, types in q.layer_types}
        self._span_bytes = max(s.span[1] - s.span[0] for slices in self.slices.values() for s in slices)
        self._gaps = {layer: gaps(slices, self.numel) for (layer, _), slices in self.slices.items()}
        self.files = {path: DirectFile(path, "move the GGUF file to a file system with direct I/O")
                      for path in dict.fromkeys(s.path for slices in self.slices.values() for s in slices)}

    @property
    def direct(self) -> bool:
        return all(f.direct for f in self.files.values())

    @property
    def direct_reason(self) -> str:
        return next((f.reason for f in self.files.values() if not f.direct), "O_DIRECT")

    def _bounce_bytes(self) -> int:
        return self._span_bytes

    def _read(self, key: Key, dest: torch.Tensor) -> None:
        blob = dest.view(torch.uint8)
        for start, stop in self._gaps[key[0]]:  # the padding between sections, and past a smaller blob
            blob[start:stop] = 0
        blob[:HEADER] = self._headers[key[0]]
        for piece in self.slices[key]:
            blob[piece.at:piece.at + piece.nbytes] = torch.frombuffer(self._read_slice(key, piece), dtype=torch.uint8)

    def _read_slice(self, key: Key, piece: Slice) -> memoryview:
        start, stop = piece.span
        buf = self._bounce()
        file = self.files[piece.path]
        try:
            got = file.pread(memoryview(buf)[: stop - start], start)
        except OSError as exc:
            raise os_failure(exc, f"cannot read expert {key} from {piece.path}", "check the disk (dmesg)") from None
        skip = piece.offset - start
        if got < skip + piece.nbytes:
            raise SpecMoEError(f"{piece.path}: expert {key} could not be read whole (the file shrank?); "
                               "download the file again")
        return memoryview(buf)[skip:skip + piece.nbytes]

    def close(self) -> None:
        for file in self.files.values():
            file.close()
