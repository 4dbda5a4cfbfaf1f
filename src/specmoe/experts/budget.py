"""The device-memory ledger: every byte placed on the compute device is reserved here.

Plain bookkeeping. `peak` is what `device_peak_bytes` reports; a reservation over the
limit is refused with a message that names the smallest budget that works: `minimum`,
what the whole configuration needs (the engine computes it before reserving anything),
when it is known, else what this reservation alone would have needed.
"""

from __future__ import annotations

from ..base.errors import SpecMoEError
from ..base.units import format_bytes, format_size_at_least


class DeviceBudget:
    def __init__(self, limit: int | None, minimum: int = 0):
        self.limit = limit  # None: no limit (the whole device)
        self.minimum = minimum  # the smallest limit the whole configuration runs in (0: unknown)
        self.used = 0
        self.peak = 0
        self.by_item: dict[str, int] = {}

    def limits_above_minimum(self) -> bool:
        """A limit is set, and the whole configuration runs in it (when its minimum is known)."""
        return self.limit is not None and self.limit >= self.minimum

    def available(self) -> float:
        return float("inf") if self.limit is None else self.limit - self.used

    def reserve(self, item: str, nbytes: int, hint: str = "") -> None:
        _check_size(nbytes)
        if self.limit is not None and self.used + nbytes > self.limit:
            raise SpecMoEError(
                f"device memory {format_bytes(self.limit)} is too small: {item} needs {format_bytes(nbytes)} "
                f"more ({format_bytes(self.used)} already used){hint}; raise --device-memory to at least "
                f"{self.smallest_that_works(self.used + nbytes)}"
            )
        self.used += nbytes
        self.by_item[item] = self.by_item.get(item, 0) + nbytes
        self.peak = max(self.peak, self.used)

    def smallest_that_works(self, need: int) -> str:
        """The budget an error should name: the configuration's minimum when known (and
        not below what is needed now), rounded up, never down."""
        return format_size_at_least(max(self.minimum, need))

    def release(self, item: str, nbytes: int) -> None:
        _check_size(nbytes)
        held = self.by_item.get(item, 0)
        if nbytes > held:
            raise RuntimeError(f"releasing {nbytes} bytes of {item!r} but only {held} are reserved")
        self.by_item[item] = held - nbytes
        self.used -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.used


def _check_size(nbytes: int) -> None:
    # a negative size would let one item hold more than the whole budget
    if nbytes < 0:
        raise ValueError(f"a reservation is a size in bytes >= 0, got {nbytes}")
