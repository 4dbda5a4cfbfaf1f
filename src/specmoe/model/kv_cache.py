"""A slot-based KV cache that takes any number of new tokens per sequence per step.

Each running sequence owns a slot. A step appends n_i >= 1 tokens to each of its
sequences at positions length_i .. length_i + n_i - 1 (prefill: the prompt; decode: 1;
verification: 1 + gamma). Rolling back rejected drafts is `truncate`: the entries beyond
the new length are simply overwritten later. Lengths are plain Python bookkeeping.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from ..base.errors import SpecMoEError


@dataclass(frozen=True)
class StepBatch:
    """Where the T new tokens of one forward pass go. Built once per step, passed explicitly.

    B sequences; sequence b has `counts[b]` new tokens starting at position `starts[b]`
    in KV slot `slots[b]`. Tokens are laid out sequence after sequence.
    """

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    positions: torch.Tensor  # [T] position of each new token
    token_slots: torch.Tensor  # [T] KV slot of each new token
    padded_index: torch.Tensor  # [T] row in the padded [B * max_new] layout attention uses
    mask: torch.Tensor  # [B, 1, max_new, kv_len] True where a query may attend a key
    slot_index: torch.Tensor  # [B] slots as a tensor
    kv_len: int
    max_new: int

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def last_token_rows(self) -> list[int]:
        """Row of each sequence's last new token (whose logits predict the next token)."""
        rows, total = [], 0
        for n in self.counts:
            total += n
            rows.append(total - 1)
        return rows

    @classmethod
    def build(cls, slots, starts, counts, device, sliding_window: int | None = None) -> StepBatch:
        slots, starts, counts = tuple(slots), tuple(starts), tuple(counts)
        if not counts or min(counts) < 1:
            raise ValueError("every sequence in a step needs at least one new token")
        max_new = max(counts)
        kv_len = max(s + n for s, n in zip(starts, counts))
        positions, token_slots, padded = [], [], []
        for b, (slot, start, n) in enumerate(zip(slots, starts, counts)):
            positions.extend(range(start, start + n))
            token_slots.extend([slot] * n)
            padded.extend(range(b * max_new, b * max_new + n))
        starts_t = torch.tensor(starts, device=device)
        query_pos = starts_t[:, None] + torch.arange(max_new, device=device)[None, :]  # [B, max_new]
        key_pos = torch.arange(kv_len, device=device)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # causal; also hides stale entries
        if sliding_window is not None:
            mask &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
        as_long = dict(dtype=torch.long, device=device)
        return cls(
            slots, starts, counts,
            positions=torch.tensor(positions, **as_long),
            token_slots=torch.tensor(token_slots, **as_long),
            padded_index=torch.tensor(padded, **as_long),
            mask=mask[:, None, :, :],
            slot_index=torch.tensor(slots, **as_long),
            kv_len=kv_len,
            max_new=max_new,
        )


class KVCache:
    """K and V of every layer: [slots, kv_heads, max_len, head_dim], allocated once at its
    full size. The engine charges the device budget for exactly that (every slot at
    max_len positions), so the cache never holds more than the budget says, not even
    while growing."""

    def __init__(self, num_layers, num_slots, num_kv_heads, head_dim, max_len, dtype, device):
        self.num_layers, self.num_slots = num_layers, num_slots
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.max_len, self.dtype, self.device = max_len, dtype, device
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        # zeros, not empty: padded rows of a batch read positions no token wrote, and
        # garbage there could be NaN, which a zero attention weight does not cancel
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots))  # a min-heap: the lowest free slot first

    # --- slots: plain bookkeeping -------------------------------------------------------

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV slot: the scheduler admitted more sequences than slots")
        slot = heapq.heappop(self._free)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        heapq.heappush(self._free, slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def truncate(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length

    def commit(self, batch: StepBatch) -> None:
        """Record that the step's tokens are now cached."""
        for slot, start, n in zip(batch.slots, batch.starts, batch.counts):
            self.lengths[slot] = start + n

    # --- tensors ----------------------------------------------------------------------

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.bytes_per_token() * self.num_slots * self.max_len

    def reserve(self, length: int) -> None:
        if length > self.max_len:
            raise SpecMoEError(
                f"a sequence needs {length} positions but the context holds {self.max_len}: "
                "shorten the prompt, lower --max-tokens or raise --max-model-len"
            )

    def write_and_read(self, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor):
        """Store the new tokens' k, v [T, kv_heads, d]; return the batch's keys and values
        [B, kv_heads, kv_len, d], new tokens included."""
        self.k[layer][batch.token_slots, :, batch.positions] = k
        self.v[layer][batch.token_slots, :, batch.positions] = v
        slots = batch.slots
        if slots == tuple(range(slots[0], slots[0] + len(slots))):  # contiguous: a view, no copy
            sl = slice(slots[0], slots[0] + len(slots))
            return self.k[layer][sl, :, : batch.kv_len], self.v[layer][sl, :, : batch.kv_len]
        return (
            self.k[layer][batch.slot_index, :, : batch.kv_len],
            self.v[layer][batch.slot_index, :, : batch.kv_len],
        )
