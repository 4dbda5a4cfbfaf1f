"""Running one MoE block with experts that may not be on the device yet.

`BlockExecutor.run_block` computes the experts already present first while the missing
ones stream in (as many in flight as there are free or evictable slots), so a block
waits only for what it really lacks. Experts the block needs are pinned until computed:
never evicted while the layer that needs them runs. Experts named in `on_host` are
computed on the host from the store instead (activations move, not weights).

After the block's own fetches, the executor starts prefetches from `prefetch_queue`:
experts of later blocks a policy predicted (overlap's next-layer guess, SpecMoE's
draft-ordered verify fetches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.moe import ExpertGroups, combine
from .formats import ExpertFormat
from .pool import DevicePool, Key
from .store import ExpertStore
from .transfer import TransferEngine


@dataclass
class BlockCounters:
    hits: int = 0  # expert uses served by an expert already resident (or on its way)
    uses: int = 0
    host_tokens: int = 0  # tokens whose expert ran on the host
    activation_bytes: int = 0  # activations shipped to and from the host


class BlockExecutor:
    def __init__(self, store: ExpertStore, pool: DevicePool, transfer: TransferEngine, fmt: ExpertFormat):
        self.store, self.pool, self.transfer = store, pool, transfer
        self.format = fmt
        self.reset()

    def reset(self) -> None:
        self.counters = BlockCounters()
        self.prefetch_queue: list[Key] = []

    def run_block(self, layer: int, x: torch.Tensor, groups: ExpertGroups,
                  on_host: set[int] = frozenset()) -> torch.Tensor:
        """The block's routed-expert output [T, D]; experts in `on_host` run on the host."""
        keys = [(layer, e) for e in groups.experts]
        table = self.pool.table
        # this block fetches what it lacks itself; a queued prefetch for it would land
        # after its expert ran and be evicted unused (or evict a later block's prefetch)
        self.drop_prefetches_up_to(layer)
        present = [j for j, k in enumerate(keys) if self.transfer.has(k)]
        self.counters.uses += len(keys)
        self.counters.hits += len(present)
        resident = set(present)
        host = [j for j, k in enumerate(keys) if k[1] in on_host and j not in resident]
        missing = [j for j, k in enumerate(keys) if j not in resident and k[1] not in on_host]
        for j in present:
            table.pin(keys[j])
        queue = list(missing)
        self.issue(keys, queue)
        inputs = groups.split_inputs(x)
        outputs: list[torch.Tensor | None] = [None] * len(keys)
        for j in present:
            self.transfer.wait(keys[j])  # a prefetch may still be on its way
            outputs[j] = self.compute(keys[j], inputs[j])
            self.issue(keys, queue)
        for j in host:
            outputs[j] = self.run_on_host(keys[j], inputs[j])
        for j in missing:
            self.transfer.ensure(keys[j])  # issued above when a slot was free, else now
            table.pin(keys[j])
            outputs[j] = self.compute(keys[j], inputs[j])
            self.issue(keys, queue)
        return combine(x, groups, outputs)

    def finish_block(self, layer: int, keep: bool) -> None:
        """Release what the block no longer needs: prefetches for it that missed land and
        unpin; queued prefetches for it are dropped; unless `keep`, the block's experts
        leave the pool (ondemand-style policies)."""
        for key in [k for k in self.transfer.inflight if k[0] == layer]:
            self.transfer.wait(key)
        self.drop_prefetches_up_to(layer)
        if not keep:
            self.evict_layer(layer)

    def compute(self, key: Key, xs: torch.Tensor) -> torch.Tensor:
        """Run a pinned resident expert, then unpin it: the block is done with it."""
        y = self.format.forward(self.pool.get(key), xs)
        self.pool.table.unpin(key)
        return y

    def issue(self, keys: list[Key], queue: list[int]) -> None:
        """Start fetches for the block's queued experts while a slot is free or evictable,
        then for predicted experts of later blocks (`prefetch_queue`)."""
        table = self.pool.table
        while queue and table.can_place():
            self.transfer.fetch(keys[queue.pop(0)])
        # Prefetches stay pinned until their block runs, so always leave one slot that
        # could be evicted: the running block must be able to fetch what it lacks.
        while self.prefetch_queue and self.spare_slots() >= 2:
            self.transfer.fetch(self.prefetch_queue.pop(0))

    def prefetch(self, keys: list[Key]) -> None:
        """Queue predicted experts of later blocks and start what fits now."""
        self.prefetch_queue = list(keys)
        self.issue([], [])

    def drop_prefetches_up_to(self, layer: int) -> None:
        self.prefetch_queue = [k for k in self.prefetch_queue if k[0] > layer]

    def spare_slots(self) -> int:
        table = self.pool.table
        return len(table.free) + sum(1 for k in table.lru if k not in table.pins)

    def run_on_host(self, key: Key, xs: torch.Tensor) -> torch.Tensor:
        weights = self.store.host_tensor(key)
        self.counters.host_tokens += xs.shape[0]
        if xs.device.type == "cpu":
            return self.format.forward_stored(weights, xs)
        self.counters.activation_bytes += 2 * xs.numel() * xs.element_size()
        return self.format.forward_stored(weights, xs.cpu()).to(xs.device)

    def evict_layer(self, layer: int) -> None:
        table = self.pool.table
        for key in [k for k in table.slot_of if k[0] == layer and k not in table.pins]:
            table.drop(key)

    def load_resident(self, keys: list[Key]) -> None:
        """Bring `keys` in and pin them for good (a static set: hot experts, draft experts)."""
        for key in keys:
            self.transfer.ensure(key)
            self.pool.table.pin(key)
