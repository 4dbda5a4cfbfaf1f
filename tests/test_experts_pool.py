"""Pool bookkeeping without tensors, and the slow tier's bandwidth cap."""

import time

import pytest
import torch

from specmoe.base.errors import SpecMoEError
from specmoe.experts.budget import DeviceBudget
from specmoe.experts.pool import SlotTable


def test_free_slots_are_used_before_anything_is_evicted():
    table = SlotTable(2)
    assert table.place((0, 1)) == (0, None)
    assert table.place((0, 2)) == (1, None)


def test_least_recently_used_unpinned_expert_is_evicted():
    table = SlotTable(2)
    table.place((0, 1))
    table.place((0, 2))
    table.touch((0, 1))
    slot, evicted = table.place((0, 3))
    assert evicted == (0, 2) and slot == 1


def test_a_pinned_expert_is_never_evicted():
    table = SlotTable(2)
    table.place((0, 1))
    table.place((0, 2))
    table.pin((0, 1))  # (0, 1) is now the least recently used, but pinned
    assert table.place((0, 3))[1] == (0, 2)
    table2 = SlotTable(1)
    table2.place((1, 0))
    table2.pin((1, 0))
    assert not table2.can_place()
    with pytest.raises(RuntimeError, match="pinned"):
        table2.place((1, 1))
    with pytest.raises(RuntimeError, match="pinned"):
        table2.drop((1, 0))


def test_budget_refuses_a_reservation_over_the_limit_and_names_the_need():
    budget = DeviceBudget(1000)
    budget.reserve("weights", 600)
    with pytest.raises(SpecMoEError, match="at least 1.08 KiB"):
        budget.reserve("pool", 500)
    assert budget.used == 600 and budget.peak == 600


def test_bandwidth_cap_slows_reads_to_the_given_rate(tiny_ckpt, tmp_path):
    from specmoe.base.checkpoint import Checkpoint
    from specmoe.experts.formats import FloatFormat
    from specmoe.experts.store import DiskStore

    ckpt = Checkpoint(tiny_ckpt("mixtral"))
    keys = [(0, e) for e in range(8)]
    fmt = FloatFormat(ckpt.config.expert, torch.float32)
    store = DiskStore(ckpt, keys, fmt, str(tmp_path), bandwidth=200_000)  # 200 kB/s
    dest = torch.empty(store.numel)
    start = time.perf_counter()
    for key in keys[:4]:
        store.read_into(key, dest)
    elapsed = time.perf_counter() - start
    assert elapsed >= 4 * store.nbytes / 200_000 * 0.95
    assert torch.equal(dest, ckpt.expert_buffer(0, 3, torch.float32))
    store.close()
