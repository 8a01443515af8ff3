"""The host memory that expert reads in flight hold, kept inside the expert cache's byte budget.

A read holds its buffer, and on the CPU the widened tensors it is decoded into, until its expert
lands in the cache. Counted against `[cache] expert_bytes` as reservations in the cache
(`ByteLRU.reserve`), experts held plus reads on their way stay within the budget (peak RSS was
1.2-1.5x the budget before: tests/bench/tests/bench/RESULTS.md). Demand reads are always reserved and
never refused; a prefetch is started only if it fits.
"""

from __future__ import annotations

from typing import Any

import torch

from deltafind.store.cache import ByteLRU
from deltafind.store.manifest import ExpertRecord, align_up


class ReadBudget:
    """`reserving`: reads are counted at all (host compute with a budget set); `bounded`: and the budget
    is nonzero, so reads are also limited by it."""

    def __init__(self, cache: ByteLRU[Any, Any], dtype: torch.dtype, reserving: bool) -> None:
        self.cache, self.dtype, self.reserving = cache, dtype, reserving

    @property
    def bounded(self) -> bool:
        return self.reserving and bool(self.cache.budget_bytes)

    def read_bytes(self, rec: ExpertRecord) -> int:
        """Host bytes a read of `rec` holds until it lands in the cache: its buffer and widened tensors."""
        n = align_up(rec.length)
        for t in rec.tensors:
            stored = getattr(torch, t.dtype)
            if stored.is_floating_point and stored != self.dtype:
                n += t.nbytes // stored.itemsize * self.dtype.itemsize
        return n

    def fitting(self, recs: list[ExpertRecord]) -> int:
        """How many of `recs` (in order) can be prefetched with the reads in flight within the budget
        (with no cache, 0, or no limit: all). A speculative read that would overrun is not started (all
        16 of a K3 layer's experts prefetched at once held 280 MB against a 256 MB budget: RESULTS.md)."""
        if not self.bounded:
            return len(recs)
        room = self.cache.budget_bytes - self.cache.reserved_bytes
        for i, rec in enumerate(recs):
            room -= self.read_bytes(rec)
            if room < 0:
                return i
        return len(recs)

    def reserve(self, rec: ExpertRecord) -> int:
        """Reserve a read's buffer and the widened tensors it will produce; returns the bytes to give back."""
        if not self.reserving or self.cache.budget_bytes is None:
            return 0
        n = self.read_bytes(rec)
        self.cache.reserve(n)
        return n

    def unreserve(self, n: int) -> None:
        if n:
            self.cache.unreserve(n)
