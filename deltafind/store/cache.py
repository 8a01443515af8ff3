"""A byte-budgeted LRU of decoded experts.

`budget_bytes=None` means unlimited; 0 caches nothing. The cache never holds
more than its budget: an item larger than the whole budget is not kept.
`reserve` counts bytes about to arrive (reads in flight) against the budget,
evicting to make room, so experts held plus reads in flight stay within it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


class ByteLRU(Generic[K, V]):
    def __init__(self, budget_bytes: int | None) -> None:
        self.budget_bytes = budget_bytes
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.used_bytes = 0
        self.reserved_bytes = 0  # reads in flight, counted against the budget before they land
        self.hits = 0
        self.misses = 0
        self.version = 0  # bumped by every put, pop and eviction: what is held may have changed
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[K]) -> list[V | None]:
        """The value of each key (None where not held, a miss), each held one marked as just used; under one
        lock for all (a layer's experts at once)."""
        with self._lock:
            out = []
            for key in keys:
                item = self._items.get(key)
                if item is None:
                    self.misses += 1
                    out.append(None)
                else:
                    self._items.move_to_end(key)
                    self.hits += 1
                    out.append(item[0])
            return out

    def touch(self, keys: list[K]) -> None:
        """Mark `keys` (those held) as just used, without counting hits: experts predicted for the next layer."""
        with self._lock:
            for key in keys:
                if key in self._items:
                    self._items.move_to_end(key)

    def put(self, key: K, value: V, nbytes: int) -> None:
        with self._lock:
            self.version += 1
            if key in self._items:
                self.used_bytes -= self._items.pop(key)[1]
            if self.budget_bytes is not None and nbytes > self.budget_bytes:
                return
            self._items[key] = (value, nbytes)
            self.used_bytes += nbytes
            self._evict()

    def pop(self, key: K) -> V | None:
        with self._lock:
            self.version += 1
            item = self._items.pop(key, None)
            if item is None:
                return None
            self.used_bytes -= item[1]
            return item[0]

    def reserve(self, nbytes: int) -> None:
        """Make room for `nbytes` on their way in (never refused: reads must happen)."""
        with self._lock:
            self.reserved_bytes += nbytes
            self._evict()

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self.reserved_bytes -= nbytes

    def resize(self, budget_bytes: int | None) -> None:
        with self._lock:
            self.budget_bytes = budget_bytes
            self._evict()

    def _evict(self) -> None:
        while (
            self.budget_bytes is not None
            and self._items
            and self.used_bytes + self.reserved_bytes > self.budget_bytes
        ):
            _, (_, n) = self._items.popitem(last=False)
            self.used_bytes -= n
            self.version += 1

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items


def return_freed_memory() -> None:
    """Fix glibc's mmap threshold at 1 MiB, so freed experts go back to the OS.

    By default the threshold grows to the size of the largest block freed (up to 32 MiB),
    after which evicted experts are carved from arenas that glibc keeps: measured 210 MB
    of resident memory nobody used after a 1 GiB-cache run (tests/bench/RESULTS.md).
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(libc).mallopt if libc else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, 1 << 20)
