"""The disk tier with several reads in flight: the readers really overlap, a failed read
on one of them still raises where its expert is waited for and frees its slot, the
emulated link's cap holds for all readers together, the union-of-intervals rate
arithmetic, the host bytes the tier holds, and tokens identical to resident's."""

import threading
import time

import pytest
import torch
from factories import random_prompts

from specmoe import LLM, SamplingParams
from specmoe.base.checkpoint import Checkpoint
from specmoe.base.errors import SpecMoEError
from specmoe.experts import store as store_module
from specmoe.experts.budget import DeviceBudget
from specmoe.experts.formats import FloatFormat
from specmoe.experts.pool import DevicePool
from specmoe.experts.read_meter import ReadMeter
from specmoe.experts.store import DiskStore
from specmoe.experts.transfer import TransferEngine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


# --- the rate arithmetic, without threads ----------------------------------------------------

def test_the_busy_time_is_the_union_of_overlapping_reads_and_a_window_takes_its_share():
    meter = ReadMeter()
    meter.reset(t=0.0)
    a = meter.begin(t=0.0)
    b = meter.begin(t=1.0)  # overlaps a: [0, 2] and [1, 3] are busy for 3 s, not 4
    meter.window(True, t=1.5)
    meter.end(a, 100, t=2.0)
    meter.end(b, 100, t=3.0)
    c = meter.begin(t=5.0)  # after an idle gap
    meter.window(False, t=5.5)
    meter.end(c, 100, t=6.0)
    got = meter.totals(t=7.0)
    assert got.bytes == 300 and got.read_s == pytest.approx(5.0)
    assert got.busy_s == pytest.approx(4.0) and got.rate == pytest.approx(75.0)
    # the window [1.5, 5.5]: busy 1.5 s of [1, 3] and 0.5 s of [5, 6]; bytes pro rata:
    # a 0.5 of its 2 s, b 1.5 of 2 s, c 0.5 of 1 s
    assert got.window_busy_s == pytest.approx(2.0)
    assert got.window_bytes == pytest.approx(25 + 75 + 50) and got.window_rate == pytest.approx(75.0)


def test_a_read_in_flight_counts_its_time_so_far_and_its_bytes_once_done():
    meter = ReadMeter()
    meter.reset(t=0.0)
    meter.window(True, t=0.0)
    token = meter.begin(t=1.0)
    now = meter.totals(t=3.0)
    assert (now.bytes, now.busy_s, now.window_busy_s) == (0, pytest.approx(2.0), pytest.approx(2.0))
    meter.end(token, 0, t=4.0)  # a failed read: time, no bytes
    assert meter.totals(t=9.0).busy_s == pytest.approx(3.0) and meter.totals().rate == 0.0


# --- several readers ---------------------------------------------------------------------------

@pytest.fixture
def ckpt(tiny_ckpt):
    return Checkpoint(tiny_ckpt("mixtral"))


def engine_over(store, slots=8):
    fmt = FloatFormat(store._format.spec, torch.float32)
    pool = DevicePool(slots, fmt, torch.device("cpu"), DeviceBudget(None), "test", 1)
    return TransferEngine(store, pool, torch.device("cpu"))


class BarrierStore(DiskStore):
    """Each read waits at a barrier that opens only when `parties` reads are inside it at
    once, and notes when it was inside: fewer readers in flight break the barrier."""

    def __init__(self, *args, parties, **kw):
        super().__init__(*args, **kw)
        self.barrier = threading.Barrier(parties, timeout=10)
        self.intervals = []

    def _read_blob(self, i):
        start = time.perf_counter()
        self.barrier.wait()
        view = super()._read_blob(i)
        self.intervals.append((start, time.perf_counter()))
        return view


def most_overlapping(intervals) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    depth = most = 0
    for _, step in events:
        depth += step
        most = max(most, depth)
    return most


def test_several_reads_really_are_in_flight_at_once(ckpt, tmp_path):
    keys = [(0, e) for e in range(8)]
    fmt = FloatFormat(ckpt.config.expert, torch.float32)
    store = BarrierStore(ckpt, keys, fmt, str(tmp_path), read_depth=4, parties=4)
    transfer = engine_over(store)
    for key in keys:
        assert transfer.fetch(key)
    transfer.drain()  # a barrier broken by too few readers in flight raises here
    assert most_overlapping(store.intervals) == 4  # timestamps, independently of the store's meter
    for key in keys:
        assert torch.equal(transfer.pool.get(key), ckpt.expert_buffer(*key, torch.float32))
    assert store.meter.totals().busy_s < store.meter.read_s  # the union, not the sum
    transfer.close()
    store.close()


class FailingStore(DiskStore):
    """Expert (0, 2)'s read fails as a disk's would (EIO), after the other readers started."""

    def _pread(self, buf, offset):
        if offset == self.layout.offset(self.index[(0, 2)]):
            time.sleep(0.05)
            raise OSError(5, "Input/output error")
        return super()._pread(buf, offset)


def test_a_failed_read_on_one_reader_raises_in_wait_and_frees_its_slot(ckpt, tmp_path):
    keys = [(0, e) for e in range(6)]
    fmt = FloatFormat(ckpt.config.expert, torch.float32)
    store = FailingStore(ckpt, keys, fmt, str(tmp_path), read_depth=3)
    transfer = engine_over(store, slots=6)
    for key in keys:
        transfer.fetch(key)
    with pytest.raises(SpecMoEError, match="cannot read expert \\(0, 2\\)"):
        transfer.wait((0, 2))
    table = transfer.pool.table
    assert (0, 2) not in table and len(table.free) == 1 and not table.pins and not transfer.inflight
    for key in keys:  # the others landed (settled) and hold their experts
        if key != (0, 2):
            assert torch.equal(transfer.pool.get(key), ckpt.expert_buffer(*key, torch.float32))
    transfer.close()
    store.close()


def test_the_emulated_link_caps_all_readers_together(ckpt, tmp_path):
    keys = [(0, e) for e in range(4)]
    fmt = FloatFormat(ckpt.config.expert, torch.float32)
    store = DiskStore(ckpt, keys, fmt, str(tmp_path), bandwidth=200_000, read_depth=4)
    transfer = engine_over(store)
    start = time.perf_counter()
    for key in keys:
        transfer.fetch(key)
    transfer.drain()
    assert time.perf_counter() - start >= 4 * store.nbytes / 200_000 * 0.95
    transfer.close()
    store.close()


def test_host_scratch_bytes_is_a_bounce_buffer_per_reader_and_bad_depths_are_one_line(ckpt, tmp_path):
    keys = [(0, e) for e in range(2)]
    fmt = FloatFormat(ckpt.config.expert, torch.float32)
    store = DiskStore(ckpt, keys, fmt, str(tmp_path), read_depth=3)
    assert store.host_scratch_bytes() == 3 * store.blob_size
    staged = DiskStore(ckpt, keys, fmt, str(tmp_path), read_depth=2, cuda=True)  # pinned staging per reader
    assert staged.host_scratch_bytes() == 2 * (staged.blob_size + staged.nbytes)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(SpecMoEError, match="read depth must be a whole number") as err:
            DiskStore(ckpt, keys, fmt, str(tmp_path), read_depth=bad)
        assert "\n" not in str(err.value)
    store.close()
    staged.close()


# --- whole runs ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def resident(tiny_ckpt):
    path = tiny_ckpt("mixtral")
    prompts = random_prompts(6, 128, 3, 10, seed=5)
    llm = LLM(model=str(path), device="cpu", max_batch_size=6, max_model_len=64)
    llm.generate(prompts, GREEDY)
    sha = llm.last_stats["token_ids_sha256"]
    llm.close()
    return path, prompts, sha


@pytest.mark.parametrize("policy", ["ondemand", "specmoe"])
def test_tokens_stay_residents_with_four_readers_and_the_stats_give_the_rate(resident, tmp_path, monkeypatch, policy):
    path, prompts, sha = resident
    monkeypatch.setattr(store_module, "DISK_READ_DEPTH", 4)
    llm = LLM(model=str(path), device="cpu", policy=policy, offload="disk", offload_dir=str(tmp_path),
              device_memory="40%", max_batch_size=6, max_model_len=64, draft_quant="none")
    llm.generate(prompts, GREEDY)
    s = llm.last_stats
    assert s["token_ids_sha256"] == sha and s["disk_read_depth"] == 4
    assert s["disk_read_bytes"] == s["transfer_bytes"] > 0
    assert 0 < s["disk_read_busy_s"] <= s["wall_s"] and s["disk_read_rate"] == pytest.approx(
        s["disk_read_bytes"] / s["disk_read_busy_s"])
    assert s["host_scratch_bytes"] == llm.engine.policy.store.host_scratch_bytes() > 0
    if policy == "specmoe":
        assert 0 < s["verify_disk_read_bytes"] <= s["disk_read_bytes"] and s["verify_disk_read_rate"] > 0
    else:
        assert s["verify_disk_read_rate"] is None
    llm.close()
