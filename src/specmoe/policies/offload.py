"""What every offloading policy shares: a store, a device pool, a transfer engine, and
one way to run a MoE block with experts that may not be on the device yet.

`run_block` computes the experts already present first while the missing ones stream
in (as many in flight as there are free or evictable slots), so a block waits only for
what it really lacks. Experts the block needs are pinned until computed: never evicted
while the layer that needs them runs.
"""

from __future__ import annotations

import torch

from ..experts.pool import DevicePool, Key, slots_for_budget
from ..experts.store import open_store
from ..experts.transfer import TransferEngine
from ..model.moe import ExpertGroups, Routing, combine, group_by_expert, run_expert
from .base import Policy, Runtime


class OffloadPolicy(Policy):
    """Base of ondemand, overlap, caching, host and specmoe."""

    keep_across_steps = True  # False: the pool is emptied after every block (ondemand)

    @classmethod
    def min_slots(cls, config, options) -> int:
        """Pool slots this policy needs to run at all."""
        return 1

    def pool_slots_wanted(self) -> int | None:
        """How many slots to take from the budget (None: as many as fit)."""
        return None

    def __init__(self, runtime: Runtime):
        super().__init__(runtime)
        opts = runtime.options
        c = runtime.config
        self.hidden, self.inter = c.hidden_size, c.expert_intermediate_size
        self.store = open_store(
            runtime.checkpoint, runtime.expert_keys, runtime.dtype, runtime.device, opts.offload,
            opts.offload_dir, opts.offload_bandwidth,
        )
        slots = slots_for_budget(runtime.budget, runtime.expert_bytes, len(runtime.expert_keys), self.pool_slots_wanted())
        self.pool = DevicePool(slots, c.expert_params, runtime.dtype, runtime.device, runtime.budget, self.name, self.min_slots(c, opts))
        self.transfer = TransferEngine(self.store, self.pool, runtime.device)
        self.reset_stats()

    # --- counters --------------------------------------------------------------------------

    def reset_stats(self) -> None:
        self.transfer.reset_counters()
        self.hits = 0  # expert uses served by an expert already resident (or on its way)
        self.uses = 0
        self.host_tokens = 0  # tokens whose expert ran on the host (host policy, host drafts)
        self.activation_bytes = 0
        self.prefetch_queue: list[Key] = []

    def stats(self) -> dict:
        return {
            "transfer_bytes": self.transfer.transfer_bytes,
            "experts_fetched": self.transfer.fetches,
            "transfer_wait_s": self.transfer.wait_s,
            "cache_hit_rate": self.hits / self.uses if self.uses else 1.0,
            "pool_slots": self.pool.num_slots,
            "offload": self.store.tier,
            "offload_read_s": self.store.read_s,
            "host_expert_tokens": self.host_tokens,
            "activation_bytes": self.activation_bytes,
        }

    # --- running a block ----------------------------------------------------------------------

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        groups = group_by_expert(routing, self.config.num_experts)
        out = self.run_block(layer, x, groups)
        self.finish_block(layer)
        return out

    def finish_block(self, layer: int) -> None:
        """Release what the block no longer needs: prefetches that missed land and unpin;
        queued prefetches for it are dropped; ondemand-style policies empty the block."""
        for key in [k for k in self.transfer.inflight if k[0] == layer]:
            self.transfer.wait(key)
        self.prefetch_queue = [k for k in self.prefetch_queue if k[0] > layer]
        if not self.keep_across_steps:
            self.evict_layer(layer)

    def run_block(self, layer: int, x: torch.Tensor, groups: ExpertGroups, on_host: set[int] = frozenset()) -> torch.Tensor:
        """Compute the block's experts; experts in `on_host` run on the host from the store."""
        keys = [(layer, e) for e in groups.experts]
        table = self.pool.table
        # this block fetches what it lacks itself; a queued prefetch for it would land
        # after its expert ran and be evicted unused (or evict a later block's prefetch)
        self.prefetch_queue = [k for k in self.prefetch_queue if k[0] > layer]
        self.uses += len(keys)
        present = [j for j, k in enumerate(keys) if self.transfer.has(k)]
        self.hits += len(present)
        resident = set(present)
        host = [j for j, k in enumerate(keys) if k[1] in on_host and j not in resident]
        missing = [j for j, k in enumerate(keys) if j not in resident and k[1] not in on_host]
        for j in present:
            table.pin(keys[j])
        queue = list(missing)
        self._issue(keys, queue)
        outputs: list[torch.Tensor | None] = [None] * len(keys)
        for j in present:
            self.transfer.wait(keys[j])  # a prefetch may still be on its way
            outputs[j] = self._compute(keys[j], x[groups.tokens[j]])
            self._issue(keys, queue)
        for j in host:
            outputs[j] = self._run_on_host(keys[j], x[groups.tokens[j]])
        for j in missing:
            self.transfer.ensure(keys[j])  # issued above when a slot was free, else now
            table.pin(keys[j])
            outputs[j] = self._compute(keys[j], x[groups.tokens[j]])
            self._issue(keys, queue)
        return combine(x, groups, outputs)

    def _compute(self, key: Key, xs: torch.Tensor) -> torch.Tensor:
        """Run a pinned resident expert, then unpin it: the block is done with it."""
        y = run_expert(self.pool.get(key), xs, self.hidden, self.inter)
        self.pool.table.unpin(key)
        return y

    def _issue(self, keys: list[Key], queue: list[int]) -> None:
        """Start fetches for the block's queued experts while a slot is free or evictable,
        then for predicted experts of later blocks (`prefetch_queue`)."""
        table = self.pool.table
        while queue and table.can_place():
            self.transfer.fetch(keys[queue.pop(0)])
        # Prefetches stay pinned until their block runs, so always leave one slot that
        # could be evicted: the running block must be able to fetch what it lacks.
        while self.prefetch_queue and self._spare_slots() >= 2:
            self.transfer.fetch(self.prefetch_queue.pop(0))

    def _spare_slots(self) -> int:
        table = self.pool.table
        return len(table.free) + sum(1 for k in table.lru if k not in table.pins)

    def _run_on_host(self, key: Key, xs: torch.Tensor) -> torch.Tensor:
        weights = self.store.host_tensor(key)
        self.host_tokens += xs.shape[0]
        if xs.device.type == "cpu":
            return run_expert(weights, xs, self.hidden, self.inter)
        self.activation_bytes += 2 * xs.numel() * xs.element_size()
        return run_expert(weights, xs.cpu(), self.hidden, self.inter).to(xs.device)

    def evict_layer(self, layer: int) -> None:
        table = self.pool.table
        for key in [k for k in table.slot_of if k[0] == layer and k not in table.pins]:
            table.drop(key)

    def load_resident(self, keys: list[Key]) -> None:
        """Bring `keys` in and pin them for good (a static set: hot experts, draft experts)."""
        for key in keys:
            self.transfer.ensure(key)
            self.pool.table.pin(key)

    def close(self) -> None:
        self.transfer.close()
        self.store.close()
