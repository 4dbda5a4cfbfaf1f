"""One-time work that can take a while on the first run (calibrating the machine,
building a checkpoint's disk-tier file or its quantized draft copies) says on stderr what
it is doing and how long it will take. Work that reports its progress prints a line once
it has run for QUIET_S, with its share done and the time left at its rate so far, then at
most one every EVERY_S, and one with the time it took; work that ends sooner prints
nothing. Work that cannot report its progress announces itself with an estimate."""

from __future__ import annotations

import sys
import time

QUIET_S = 1.0  # work that ends sooner says nothing
EVERY_S = 10.0  # at most one progress line this often


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


class OneTime:
    """`with OneTime("building X") as work: ... work.update(done, total)` (or
    `work = OneTime(...).begin()` ... `work.end()`). `estimate`: a line at once,
    "specmoe: WHAT (ESTIMATE)...", for work that reports no progress."""

    def __init__(self, what: str, estimate: str | None = None, clock=time.monotonic):
        self.what, self.estimate, self.clock = what, estimate, clock
        self.last: float | None = None  # when the last line was printed

    def _say(self, text: str) -> None:
        print(f"specmoe: {text}", file=sys.stderr, flush=True)

    def begin(self) -> OneTime:
        self.start = self.clock()
        if self.estimate:
            self._say(f"{self.what} ({self.estimate})...")
            self.last = self.start
        return self

    __enter__ = begin

    def update(self, done: float, total: float) -> None:
        now = self.clock()
        elapsed = now - self.start
        if done <= 0 or total <= 0 or elapsed < QUIET_S or (self.last is not None and now - self.last < EVERY_S):
            return
        self.last = now
        left = elapsed * (total - done) / done
        self._say(f"{self.what}: {done / total:.0%} after {duration(elapsed)}, about {duration(left)} left")

    def end(self) -> None:
        """The line with the time it took, where an earlier line said it was under way."""
        if self.last is not None:
            self._say(f"{self.what}: done in {duration(self.clock() - self.start)}")

    def __exit__(self, kind, *exc) -> None:
        if kind is None:  # one that failed ends with its error
            self.end()
