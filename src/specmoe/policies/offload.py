"""What every offloading policy shares: a store (the offload tier), a device pool, a
transfer engine and a block executor that runs a MoE block with experts that may not
be on the device yet (experts/executor.py)."""

from __future__ import annotations

import torch

from ..experts.executor import BlockExecutor
from ..experts.pool import DevicePool, Key, slots_for_budget
from ..experts.tiers import open_store
from ..experts.transfer import TransferEngine
from ..model.moe import Routing, group_by_expert
from .base import Policy, Runtime, reserve_scratch


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
        fmt = runtime.expert_format
        self.store = open_store(
            runtime.checkpoint, runtime.expert_keys, fmt, runtime.device, opts.offload,
            opts.offload_dir, opts.offload_bandwidth,
        )
        reserve_scratch(runtime)
        slots = slots_for_budget(runtime.budget, fmt.slot_bytes, len(runtime.expert_keys), self.pool_slots_wanted())
        self.pool = DevicePool(slots, fmt, runtime.device, runtime.budget, self.name, self.min_slots(c, opts))
        self.transfer = TransferEngine(self.store, self.pool, runtime.device)
        self.blocks = BlockExecutor(self.store, self.pool, self.transfer, fmt)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.store.reset_counters()
        self.transfer.reset_counters()
        self.blocks.reset()

    def moved_bytes(self) -> int:
        return self.transfer.transfer_bytes

    def stats(self) -> dict:
        counters = self.blocks.counters
        reads = self.store.meter.totals()
        return {
            "transfer_bytes": self.transfer.transfer_bytes,
            "experts_fetched": self.transfer.fetches,
            "transfer_wait_s": self.transfer.wait_s,
            "cache_hit_rate": counters.hits / counters.uses if counters.uses else 1.0,
            "pool_slots": self.pool.num_slots,
            "offload": self.store.tier,
            # whether disk reads bypass the page cache (None: the host tier has no disk)
            "offload_direct": getattr(self.store, "direct", None),
            "offload_direct_reason": getattr(self.store, "direct_reason", None),
            # wall time during which at least one read was in flight (reads overlap)
            "offload_read_s": reads.busy_s,
            **self._disk_read_stats(reads),
            "host_expert_tokens": counters.host_tokens,
            "activation_bytes": counters.activation_bytes,
            "fused_kernels": self.fused_kernels(),
            **self._stack_bytes(),
        }

    def _disk_read_stats(self, reads) -> dict:
        """The rate the disk tier achieved: bytes over the time a read was in flight, over the
        run and within verify passes (SpecMoE's; None elsewhere, and on other tiers)."""
        disk = self.store.tier == "disk"
        verified = disk and reads.window_busy_s > 0
        return {
            "disk_read_depth": self.store.read_depth if disk else None,
            "disk_read_bytes": reads.bytes if disk else None,
            "disk_read_busy_s": reads.busy_s if disk else None,
            "disk_read_rate": reads.rate if disk else None,
            "verify_disk_read_bytes": reads.window_bytes if verified else None,
            "verify_disk_read_busy_s": reads.window_busy_s if verified else None,
            "verify_disk_read_rate": reads.window_rate if verified else None,
            "host_scratch_bytes": self.store.host_scratch_bytes(),
        }

    def _stack_bytes(self) -> dict:
        """An encoder-decoder model's transfers split by stack: the encoder's (once per
        admitted batch) and the decoder's (every step)."""
        c = self.config
        if c.seq2seq is None:
            return {}
        encoder = sum(n for layer, n in self.transfer.layer_bytes.items() if layer < c.encoder_layers)
        return {"encoder_transfer_bytes": encoder, "decoder_transfer_bytes": self.transfer.transfer_bytes - encoder}

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        groups = group_by_expert(routing, self.config.num_experts)
        out = self.blocks.run_block(layer, x, groups)
        self.blocks.finish_block(layer, keep=self.keep_across_steps)
        return out

    def load_resident(self, keys: list[Key]) -> None:
        self.blocks.load_resident(keys)

    def close(self) -> None:
        self.transfer.close()
        self.store.close()
