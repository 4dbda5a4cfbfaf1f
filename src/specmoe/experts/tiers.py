"""Where a model's experts live when they are not on the device: the offload tier a run
asks for, opened over its checkpoint (store.py: host memory and the expert file;
gguf_store.py: a GGUF file read in place)."""

from __future__ import annotations

import torch

from ..base.checkpoint import Checkpoint
from ..base.errors import SpecMoEError
from .expert_file import Key
from .formats import ExpertFormat
from .gguf_store import GGUFFileStore, reads_in_place
from .store import DiskStore, ExpertStore, HostStore


def open_store(ckpt: Checkpoint, keys: list[Key], fmt: ExpertFormat, device: torch.device, tier: str,
               directory: str | None = None, bandwidth: float | None = None) -> ExpertStore:
    """The offload tier `tier` of these experts. A GGUF file kept in its encoding is the disk
    tier itself (gguf_store.py); every other checkpoint gets an expert file of aligned blobs."""
    cuda = device.type == "cuda"
    if tier == "host":
        return HostStore(ckpt, keys, fmt, pin=cuda, bandwidth=bandwidth)
    if tier == "disk" and reads_in_place(ckpt, fmt):
        return GGUFFileStore(ckpt, keys, fmt, bandwidth, cuda=cuda)
    if tier == "disk":
        return DiskStore(ckpt, keys, fmt, directory, bandwidth, cuda=cuda)
    raise SpecMoEError(f"unknown offload tier {tier!r}; choose one of: disk, host")
