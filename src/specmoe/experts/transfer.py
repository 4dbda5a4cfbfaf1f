"""Moving experts from the offload tier into the device pool, asynchronously.

Background readers fill pool slots while the main thread computes: `store.read_depth`
of them, so that a disk has several reads in flight (its queue is never left empty
between reads); one for host memory. Fetches start in the order they are issued. Each
reader converts or stages in its own tensor (`store.reader_tensor`). On CUDA the
host-to-device copy runs on a side stream and an event orders it before the compute
that uses the expert. A key is pinned from the moment its fetch is issued until `wait`
hands it over, so its slot cannot be reused mid-copy. A read that fails on a reader
thread raises in `wait`, on the main thread, and frees its slot. All bookkeeping (the
slot table, pins, counters) stays on the main thread; the readers only fill slots.
Every byte that enters the pool is counted here.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .pool import DevicePool, Key
from .store import ExpertStore


class TransferEngine:
    def __init__(self, store: ExpertStore, pool: DevicePool, device: torch.device):
        self.store, self.pool, self.device = store, pool, device
        self.cuda = device.type == "cuda"
        self.executor = ThreadPoolExecutor(max_workers=store.read_depth, thread_name_prefix="specmoe-transfer")
        self.inflight: dict[Key, Future] = {}
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # a slot in another layout than the stored one (int4 for the CPU kernel): read, then convert
        self.converts = pool.format.converts
        self.reset_counters()

    def reset_counters(self) -> None:
        self.transfer_bytes = 0
        self.fetches = 0
        self.layer_bytes: dict[int, int] = {}  # bytes fetched per block (encoder / decoder split)
        self.wait_s = 0.0
        self.fetched: list[Key] = []  # in issue order, for traces and refresh accounting

    def has(self, key: Key) -> bool:
        """Resident or on its way."""
        return key in self.pool.table or key in self.inflight

    def fetch(self, key: Key) -> bool:
        """Start bringing `key` into the pool; False when already there or no slot is free."""
        table = self.pool.table
        if self.has(key):
            return False
        if not table.can_place():
            return False
        slot, _ = table.place(key)
        table.pin(key)
        self.transfer_bytes += self.pool.expert_bytes
        self.layer_bytes[key[0]] = self.layer_bytes.get(key[0], 0) + self.pool.expert_bytes
        self.fetches += 1
        self.fetched.append(key)
        # On CUDA the slot may have just been freed by an expert whose kernels are still
        # queued on the compute stream: the copy must wait for them.
        after = None
        if self.cuda:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        self.inflight[key] = self.executor.submit(self._load, key, self.pool.buffers[slot], after)
        return True

    def _load(self, key: Key, dest: torch.Tensor, after=None):
        """On a reader thread: fill `dest`, the key's slot."""
        if not self.cuda:
            if not self.converts:
                self.store.read_into(key, dest)
            else:  # on this reader thread, off the compute thread
                converting = self.store.reader_tensor()
                self.store.read_into(key, converting)
                self.pool.format.prepare(converting, dest)
            return None
        source, staged = self.host_source(key)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(after)
            dest.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        if staged:
            event.synchronize()  # this reader's staging tensor is reused by its next read
        return event

    def host_source(self, key: Key) -> tuple[torch.Tensor, bool]:
        """The host tensor a CUDA copy of `key` comes from, and whether it is this reader's
        staging tensor (read from disk into it) rather than the host tier's own buffer."""
        source = self.store.host_tensor(key)
        if source is not None:
            return source, False
        staging = self.store.reader_tensor()
        self.store.read_into(key, staging)
        return staging, True

    def wait(self, key: Key) -> None:
        """Block until `key` is usable by compute; release the fetch's pin."""
        future = self.inflight.pop(key, None)
        if future is None:
            return
        start = time.perf_counter()
        try:
            self._land(key, future)
        except BaseException:
            self._settle()  # leave nothing in flight whose outcome no one will ask for
            raise
        self.wait_s += time.perf_counter() - start

    def _land(self, key: Key, future: Future) -> None:
        try:
            event = future.result()  # a read that failed on the reader thread raises here
        except BaseException:
            # the slot holds nothing usable: free it, so that a later fetch reads the expert again
            table = self.pool.table
            table.unpin(key)
            if key in table and key not in table.pins:
                table.drop(key)
            raise
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self.pool.table.unpin(key)

    def _settle(self) -> None:
        """Land every fetch still in flight, keeping those that arrived (a failure was raised already)."""
        for key in list(self.inflight):
            with contextlib.suppress(Exception):
                self._land(key, self.inflight.pop(key))

    def ensure(self, key: Key) -> None:
        if key not in self.pool.table and key not in self.inflight:
            if not self.fetch(key):
                raise RuntimeError(f"no pool slot for expert {key}: every slot is pinned")
        self.wait(key)

    def drain(self) -> None:
        for key in list(self.inflight):
            self.wait(key)

    def close(self) -> None:
        self._settle()  # no copy may still write into the pool once it is freed
        self.executor.shutdown(wait=True)
