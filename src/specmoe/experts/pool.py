"""The device expert pool: a fixed number of expert slots on the compute device.

Bookkeeping is plain Python (`SlotTable`); the tensor is one [slots, numel] buffer
reserved in the device budget once, a slot the size of one expert in its format (a
quantized expert's blob: the same budget holds as many more experts as it is smaller). Pinned experts (in use by the running layer, or the
draft set, or a static hot set) are never evicted; the rest are evicted least recently
used first.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

import torch

from ..base.errors import SpecMoEError
from ..base.units import format_bytes
from .budget import DeviceBudget
from .formats import ExpertFormat

Key = tuple[int, int]


class SlotTable:
    """Which expert is in which slot; LRU order; pin counts. No tensors."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.slot_of: dict[Key, int] = {}
        self.lru: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self.pins: Counter[Key] = Counter()
        self.free: list[int] = list(range(num_slots - 1, -1, -1))

    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of

    def touch(self, key: Key) -> None:
        self.lru.move_to_end(key)

    def pin(self, key: Key) -> None:
        self.pins[key] += 1

    def unpin(self, key: Key) -> None:
        self.pins[key] -= 1
        if self.pins[key] <= 0:
            del self.pins[key]

    def evictable(self) -> Key | None:
        return next((k for k in self.lru if k not in self.pins), None)

    def can_place(self) -> bool:
        return bool(self.free) or self.evictable() is not None

    def place(self, key: Key) -> tuple[int, Key | None]:
        """A slot for `key`: a free one, else the least recently used unpinned one.
        Returns (slot, evicted key or None)."""
        if key in self.slot_of:
            raise ValueError(f"expert {key} is already in the pool")
        evicted = None
        if self.free:
            slot = self.free.pop()
        else:
            evicted = self.evictable()
            if evicted is None:
                raise RuntimeError("every pool slot holds a pinned expert")
            slot = self.remove(evicted)
        self.slot_of[key] = slot
        self.lru[key] = None
        return slot, evicted

    def remove(self, key: Key) -> int:
        if key in self.pins:
            raise RuntimeError(f"expert {key} is pinned (in use) and cannot be evicted")
        slot = self.slot_of.pop(key)
        del self.lru[key]
        return slot

    def drop(self, key: Key) -> None:
        self.free.append(self.remove(key))


class DevicePool:
    """Expert slots on the compute device, inside the device budget."""

    def __init__(self, num_slots: int, fmt: ExpertFormat, device: torch.device, budget: DeviceBudget,
                 policy_name: str, min_slots: int):
        expert_bytes = fmt.slot_bytes
        if num_slots < min_slots:
            raise SpecMoEError(
                f"device memory {format_bytes(budget.limit or 0)} leaves room for {num_slots} experts; policy "
                f"{policy_name} needs {min_slots}: raise --device-memory to at least "
                f"{budget.smallest_that_works(budget.used + min_slots * expert_bytes)}"
            )
        budget.reserve("expert pool", num_slots * expert_bytes)
        self.table = SlotTable(num_slots)
        self.buffers = torch.empty(num_slots, fmt.slot_numel, dtype=fmt.slot_dtype, device=device)
        self.format = fmt
        self.slot_bytes = expert_bytes
        self.expert_bytes = fmt.nbytes  # what a fetch into a slot moves

    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    def get(self, key: Key) -> torch.Tensor | None:
        slot = self.table.slot_of.get(key)
        if slot is None:
            return None
        self.table.touch(key)
        return self.buffers[slot]

    def slot_tensor(self, key: Key) -> torch.Tensor:
        return self.buffers[self.table.slot_of[key]]


def slots_for_budget(budget: DeviceBudget, expert_bytes: int, total_experts: int, cap: int | None = None) -> int:
    """How many expert slots the rest of the budget holds (all experts at most)."""
    most = total_experts if cap is None else min(cap, total_experts)
    if budget.limit is None:
        return most
    return max(0, min(most, int(budget.available() // expert_bytes)))
