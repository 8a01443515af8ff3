"""Exact prefix reuse: finished sequences leave their cache keyed by the tokens it holds.

A new prompt reuses the longest run of tokens it shares with an entry, up to its own last
token (whose logits must be computed). Attention K/V is cut at any position; recurrent state
(KDA's S and conv windows) cannot be rewound, so it resumes only at the entry's end or at a
snapshot the prefill kept (`snapshot`). Entries are never consumed (a taker gets a copy),
and an entry another one extends is merged into it. Bounded in bytes and entries; LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deltafind.models.ops.batch import LayerCache, SequenceCache

States = list[Any]  # the recurrent layers' states at one position, in layer order


def _tensor_bytes(objs: Iterable[Any], seen: set[int]) -> int:
    """Bytes of the storages the objects' tensors keep alive, each once: a view (a slice of a step's
    whole batch, say) holds its whole storage, so counting its own elements would undercount."""
    total = 0
    for obj in objs:
        for value in vars(obj).values():
            items = value if isinstance(value, (list, tuple)) else (value,)
            for t in items:
                if (
                    isinstance(t, torch.Tensor)
                    and (storage := t.untyped_storage()).data_ptr() not in seen
                ):
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


def cache_nbytes(cache: SequenceCache) -> int:
    """Bytes of every tensor a sequence cache's layers hold (buffers count whole)."""
    return _tensor_bytes(cache.layers, set())


def is_recurrent(layer: Any) -> bool:
    """A layer state that cannot be cut back to an earlier position (KDA), unlike a `LayerCache`."""
    return not isinstance(layer, LayerCache)


def snapshot(cache: SequenceCache) -> States:
    """Copies of the recurrent layers' states as of now ([] for a cache that has none)."""
    return [layer.copy() for layer in cache.layers if is_recurrent(layer)]


def trim_states(states: dict[int, States], max_bytes: int) -> None:
    """Drop the earliest snapshots until the rest hold at most `max_bytes` (the latest serve retries and next turns)."""
    sizes = {p: _tensor_bytes(st, set()) for p, st in states.items()}
    while states and sum(sizes.values()) > max_bytes:
        del sizes[(p := min(states))], states[p]


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass
class Entry:
    """A cache holding exactly `tokens`, and the recurrent states at earlier positions of them."""

    tokens: np.ndarray  # int64 [n]
    cache: SequenceCache
    states: dict[int, States] = field(
        default_factory=dict
    )  # position -> states there (recurrent caches only)
    nbytes: int = 0

    @property
    def recurrent(self) -> bool:
        return any(is_recurrent(layer) for layer in self.cache.layers)

    def usable(self, shared: int) -> int:
        """The longest position <= `shared` this entry can resume at."""
        if shared >= len(self.tokens):
            return len(self.tokens)
        if not self.recurrent:
            return shared
        return max((p for p in self.states if p <= shared), default=0)

    def restore(self, n: int) -> SequenceCache:
        """An independent cache of the first `n` tokens (n a position `usable` gave)."""
        new, states = SequenceCache(0), iter(self.states.get(n, []))
        for layer in self.cache.layers:
            if not is_recurrent(layer):
                copy = LayerCache()
                if n and layer.length:
                    copy.append(*(v[:n] for v in layer.view()))
                new.layers.append(copy)
            else:
                new.layers.append((layer if n == len(self.tokens) else next(states)).copy())
        new.length = n
        return new

    def absorb(self, other: Entry) -> None:
        """Take over `other`'s positions (its tokens are a prefix of ours): its end and its snapshots."""
        if self.recurrent:
            for p, st in other.states.items():
                self.states.setdefault(p, st)
            if len(other.tokens) < len(self.tokens):
                self.states.setdefault(
                    len(other.tokens), [la for la in other.cache.layers if is_recurrent(la)]
                )
        self.count()

    def count(self) -> None:
        """Set `nbytes`: the cache's tensors and the snapshots', each buffer once."""
        seen: set[int] = set()
        self.nbytes = _tensor_bytes(self.cache.layers, seen) + sum(
            _tensor_bytes(st, seen) for st in self.states.values()
        )


class PrefixCache:
    def __init__(self, max_bytes: int = 0, max_entries: int = 64) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: OrderedDict[int, Entry] = (
            OrderedDict()
        )  # id(entry) -> entry, least recent first
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        self.disk: Any = (
            None  # engine/prompt_disk.PromptDisk: entries written to a drive, read back on a miss
        )

    def __len__(self) -> int:
        return len(self._entries)

    def state_budget(self) -> int:
        """Bytes of snapshots a sequence may keep: what the larger of memory and the drive can hold."""
        return max(self.max_bytes, self.disk.max_bytes if self.disk is not None else 0)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def put(
        self, tokens: Sequence[int], cache: SequenceCache, states: dict[int, States] | None = None
    ) -> Entry | None:
        """Keep `cache`, which holds exactly `tokens` (and `states` at earlier positions), for later prompts
        that share a prefix with them. An entry whose tokens are a prefix of these is merged in, and
        these merge into an entry that extends them. Returns the entry that now holds them."""
        key = np.asarray(tokens, dtype=np.int64)
        if not len(key) or cache.length != len(key) or self.max_bytes <= 0:
            return None
        for layer in cache.layers:
            # an entry never rolls back (`restore` copies), so the last verify pass's rows go
            if is_recurrent(layer):
                layer.start_pass()
        new = Entry(key, cache, {p: s for p, s in (states or {}).items() if 0 < p < len(key)})
        new.count()
        held = False
        for e in self.entries():
            shared = _common(e.tokens, key)
            if shared == len(e.tokens):  # an earlier turn of this conversation
                self._drop(e)
                new.absorb(e)
            elif shared == len(key):  # already held by a longer entry: add our end there
                self.used_bytes -= e.nbytes
                e.absorb(new)
                self.used_bytes += e.nbytes
                self._entries.move_to_end(id(e))
                new, held = e, True
                break
        if self.disk is not None:  # its own budget: it may take what memory cannot
            self.disk.save(new)
        if not held:
            # snapshots over the budget: keep the latest that fit
            if new.nbytes > self.max_bytes and new.recurrent:
                trim_states(new.states, self.max_bytes - cache_nbytes(new.cache))
                new.count()
            if new.nbytes > self.max_bytes:
                return None
            self._entries[id(new)] = new
            self.used_bytes += new.nbytes
        self._evict()
        return new if id(new) in self._entries else None

    def add(self, entry: Entry) -> None:
        """Hold an entry as it is (one read back from disk), least recently used first to go."""
        if entry.nbytes > self.max_bytes:
            return
        self._entries[id(entry)] = entry
        self.used_bytes += entry.nbytes
        self._evict()

    def find(self, prompt: Sequence[int]) -> tuple[Entry | None, int]:
        """The entry the most of `prompt` can resume from, and how many tokens (< len(prompt))."""
        best, n = None, 0
        for e in self._entries.values():
            m = self._usable(e, prompt)
            if m > n:
                best, n = e, m
        return best, n

    @staticmethod
    def _usable(e: Entry, prompt: Sequence[int]) -> int:
        return e.usable(min(_common(e.tokens, np.asarray(prompt, dtype=np.int64)), len(prompt) - 1))

    def take(self, prompt: Sequence[int]) -> tuple[SequenceCache, int] | None:
        """A copy of the cache of the longest reusable prefix of `prompt`, leaving at least one token to run
        (the step needs its logits). The entry stays for the next prompt."""
        e, n = self.find(prompt)
        if self.disk is not None:  # a longer prefix on the drive (written before a restart, say)
            path, on_disk = self.disk.find(prompt)
            if on_disk > n and (loaded := self.disk.load(path)) is not None:
                self.add(loaded)
                e, n = loaded, self._usable(loaded, prompt)
        if e is None:
            self.misses += 1
            return None
        if id(e) in self._entries:  # (one read from the drive that memory cannot hold is used once)
            self._entries.move_to_end(id(e))
        self.hits += 1
        self.reused_tokens += n
        return e.restore(n), n

    def _drop(self, e: Entry) -> None:
        del self._entries[id(e)]
        self.used_bytes -= e.nbytes

    def _evict(self) -> None:
        while self._entries and (
            self.used_bytes > self.max_bytes or len(self._entries) > self.max_entries
        ):
            self._drop(next(iter(self._entries.values())))

    def resize(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._evict()

    def clear(self) -> None:
        self._entries.clear()
        self.used_bytes = 0
