"""Exact prefix reuse: finished sequences leave their cache keyed by the tokens it holds.

A new request whose prompt starts with a stored key takes that cache over and
prefills only the rest (a growing chat). Keys match exactly, token for token:
no truncation, so recurrent state (KDA) is as safe to reuse as attention K/V.
Bounded in bytes and entries; least recently used goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from deltafind.models.ops.batch import SequenceCache


def cache_nbytes(cache: SequenceCache) -> int:
    """Bytes of every tensor a sequence cache's layers hold (buffers count whole)."""
    total, seen = 0, set()
    for layer in cache.layers:
        for value in vars(layer).values():
            items = value if isinstance(value, (list, tuple)) else (value,)
            for t in items:
                if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


class PrefixCache:
    def __init__(self, max_bytes: int = 0, max_entries: int = 64) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: OrderedDict[tuple[int, ...], tuple[SequenceCache, int]] = OrderedDict()
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: Sequence[int], cache: SequenceCache) -> None:
        """Keep `cache`, which holds exactly `tokens`, for a later prompt that extends them."""
        key = tuple(tokens)
        if not key or cache.length != len(key) or self.max_bytes <= 0:
            return
        nbytes = cache_nbytes(cache)
        if nbytes > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= old[1]
        self._entries[key] = (cache, nbytes)
        self.used_bytes += nbytes
        while self.used_bytes > self.max_bytes or len(self._entries) > self.max_entries:
            _, (_, n) = self._entries.popitem(last=False)
            self.used_bytes -= n

    def take(self, prompt: Sequence[int]) -> tuple[SequenceCache, int] | None:
        """The cache of the longest stored key that is a proper prefix of `prompt`, removed.

        Proper: at least one prompt token is left to run, so the step has logits.
        """
        best: tuple[int, ...] | None = None
        for key in self._entries:
            n = len(key)
            if n < len(prompt) and (best is None or n > len(best)) and tuple(prompt[:n]) == key:
                best = key
        if best is None:
            self.misses += 1
            return None
        cache, nbytes = self._entries.pop(best)
        self.used_bytes -= nbytes
        self.hits += 1
        self.reused_tokens += len(best)
        return cache, len(best)

    def resize(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        while self._entries and self.used_bytes > self.max_bytes:
            _, (_, n) = self._entries.popitem(last=False)
            self.used_bytes -= n

    def clear(self) -> None:
        self._entries.clear()
        self.used_bytes = 0
