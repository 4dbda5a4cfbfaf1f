"""What the offload tier's reads achieved: bytes, and the wall time during which at least
one read was in flight.

With several readers the reads overlap, so the sum of per-read times overstates the time
the device was busy; the rate a tier achieved is bytes over the *union* of the reads'
intervals. The meter keeps that union as the reads begin and end (one busy span open
while any read is), so it holds no per-read history. A *window* (SpecMoE's verify passes)
is counted apart: the busy time inside it, and each read's bytes in proportion to the
part of its interval inside it.

Every method takes the time explicitly (`t`; default: now) so the arithmetic is testable
without threads or sleeps. Methods may be called from any thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass


@dataclass
class _Read:
    start: float
    window_from: float | None  # when this read's time inside the open window began counting
    window_s: float = 0.0  # its time inside windows so far


@dataclass(frozen=True)
class ReadTotals:
    bytes: int  # completed reads
    busy_s: float  # union of the reads' intervals
    read_s: float  # sum of the reads' own times (overlapping reads count twice)
    window_bytes: float  # bytes read inside windows (a read cut by a window's edge: pro rata)
    window_busy_s: float  # union of the reads' intervals inside windows

    @property
    def rate(self) -> float | None:
        return self.bytes / self.busy_s if self.busy_s > 0 else None

    @property
    def window_rate(self) -> float | None:
        return self.window_bytes / self.window_busy_s if self.window_busy_s > 0 else None


class ReadMeter:
    def __init__(self):
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._open: dict[int, _Read] = {}
        self._window_open = False
        self.reset()

    def reset(self, t: float | None = None) -> None:
        """Count from `t` on; reads in flight count from `t` too."""
        t = time.perf_counter() if t is None else t
        with self._lock:
            self.bytes, self.busy_s, self.read_s = 0, 0.0, 0.0
            self.window_bytes, self.window_busy_s = 0.0, 0.0
            for read in self._open.values():
                read.start, read.window_s = t, 0.0
                read.window_from = t if self._window_open else None
            self._busy_from = t if self._open else None
            self._window_busy_from = t if self._open and self._window_open else None

    def begin(self, t: float | None = None) -> int:
        """A read starts; returns its token for `end`."""
        t = time.perf_counter() if t is None else t
        with self._lock:
            if not self._open:
                self._busy_from = t
                if self._window_open:
                    self._window_busy_from = t
            token = next(self._ids)
            self._open[token] = _Read(t, t if self._window_open else None)
            return token

    def end(self, token: int, nbytes: int, t: float | None = None) -> None:
        """The read `token` finished, having read `nbytes` (0: it failed)."""
        t = time.perf_counter() if t is None else t
        with self._lock:
            read = self._open.pop(token, None)
            if read is None:
                return
            if read.window_from is not None:
                read.window_s += t - read.window_from
            if not self._open:
                self.busy_s += t - self._busy_from
                self._busy_from = None
                if self._window_busy_from is not None:
                    self.window_busy_s += t - self._window_busy_from
                    self._window_busy_from = None
            duration = t - read.start
            self.bytes += nbytes
            self.read_s += duration
            share = read.window_s / duration if duration > 0 else float(self._window_open)
            self.window_bytes += nbytes * share

    def window(self, is_open: bool, t: float | None = None) -> None:
        """Open or close the window (no-op when already so)."""
        t = time.perf_counter() if t is None else t
        with self._lock:
            if is_open == self._window_open:
                return
            self._window_open = is_open
            for read in self._open.values():
                if is_open:
                    read.window_from = t
                else:
                    read.window_s += t - read.window_from
                    read.window_from = None
            if is_open and self._open:
                self._window_busy_from = t
            elif not is_open and self._window_busy_from is not None:
                self.window_busy_s += t - self._window_busy_from
                self._window_busy_from = None

    def totals(self, t: float | None = None) -> ReadTotals:
        """The counts so far; busy spans still open count up to `t` (bytes only once read)."""
        t = time.perf_counter() if t is None else t
        with self._lock:
            busy = self.busy_s + (t - self._busy_from if self._busy_from is not None else 0.0)
            window = self.window_busy_s + (t - self._window_busy_from if self._window_busy_from is not None else 0.0)
            return ReadTotals(self.bytes, busy, self.read_s, self.window_bytes, window)
