"""What one forward pass runs on: a flat token tensor cut into sequence segments.

Each segment is one sequence's new tokens plus that sequence's cache. Token-wise
work (norms, MLPs, experts) runs on all segments at once, so one expert read
serves every sequence in the step; attention runs per segment.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class LayerCache:
    """Growable per-layer key/value (or any per-position) cache of one sequence."""

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []
        self.length = 0

    def append(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append [n, ...] tensors along dim 0 and return views of everything so far."""
        n = tensors[0].shape[0]
        bufs = self.reserve(n, *tensors)
        for buf, t in zip(bufs, tensors, strict=True):
            buf[self.length : self.length + n] = t
        self.length += n
        return tuple(buf[: self.length] for buf in bufs)

    def reserve(self, n: int, *like: torch.Tensor) -> list[torch.Tensor]:
        """The whole buffers, grown so that n more positions fit after `length` (one per tensor of
        `like`, [*, ...] each: the per-position shape and dtype a new buffer takes). The caller writes
        rows length..length+n-1 and adds n to `length` (a fused kernel writes them in place)."""
        if not self._bufs:
            cap = max(16, n)
            self._bufs = [t.new_empty((cap, *t.shape[1:])) for t in like]
        elif self.length + n > self._bufs[0].shape[0]:
            cap = max(2 * self._bufs[0].shape[0], self.length + n)
            grown = []
            for buf in self._bufs:
                new = buf.new_empty((cap, *buf.shape[1:]))
                new[: self.length] = buf[: self.length]
                grown.append(new)
            self._bufs = grown
        return self._bufs

    def view(self) -> tuple[torch.Tensor, ...]:
        """Views of everything held, without appending."""
        return tuple(buf[: self.length] for buf in self._bufs)

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on (speculative rollback, prefix reuse)."""
        assert 0 <= length <= self.length
        self.length = length

    def copy(self) -> LayerCache:
        """An independent copy of the positions held (a prefix-cache checkpoint)."""
        new = LayerCache()
        new._bufs = [buf[: self.length].clone() for buf in self._bufs]
        new.length = self.length
        return new


class SequenceCache:
    """All layers' caches of one sequence; `length` is the number of positions seen."""

    _ids = itertools.count()

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(num_layers)]
        self.length = 0
        self.seq_id = next(SequenceCache._ids)  # names the sequence in router traces

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on, in every layer, or in none (a recurrent state's
        `check_truncate` refuses a cut it cannot restore before any layer is touched)."""
        for layer in self.layers:
            check = getattr(layer, "check_truncate", None)
            if check is not None:
                check(min(layer.length, length))
        for layer in self.layers:
            layer.truncate(min(layer.length, length))
        self.length = length

    def copy(self) -> SequenceCache:
        """An independent copy of every layer as of now (each layer's `copy`); a new seq_id."""
        new = SequenceCache(0)
        new.layers = [layer.copy() for layer in self.layers]
        new.length = self.length
        return new


@dataclass
class Segment:
    cache: SequenceCache
    num_tokens: int
    start: int = 0  # offset of this segment's first token in the flat batch


@dataclass
class Batch:
    """A forward pass's token layout. Build with `Batch.of(...)`."""

    segments: list[Segment]
    positions: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    # Speculative drafting (engine/draft): layers whose output hidden rows [T, H] the
    # forward stores in `captured`, keyed by layer index.
    capture: tuple[int, ...] = ()
    captured: dict[int, torch.Tensor] = field(default_factory=dict)
    # How many trailing rows of each segment a forward without `all_logits` returns logits
    # for (the verifier needs k+1 rows of a drafting sequence); () = one per segment.
    logit_rows: tuple[int, ...] = ()

    @classmethod
    def of(
        cls, caches_and_counts: list[tuple[SequenceCache, int]], device: torch.device | str = "cpu"
    ) -> Batch:
        segments, positions, start = [], [], 0
        for cache, n in caches_and_counts:
            segments.append(Segment(cache, n, start))
            positions.append(torch.arange(cache.length, cache.length + n))
            start += n
        return cls(segments, torch.cat(positions).to(device))

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    def last_token_index(self) -> torch.Tensor:
        """Flat indices of each segment's last token (its last `logit_rows[i]` tokens when set)."""
        if not self.logit_rows:
            return torch.tensor(
                [s.start + s.num_tokens - 1 for s in self.segments], dtype=torch.long
            )
        rows = [
            i
            for s, n in zip(self.segments, self.logit_rows, strict=True)
            for i in range(s.start + s.num_tokens - n, s.start + s.num_tokens)
        ]
        return torch.tensor(rows, dtype=torch.long)

    def token_sequences(self) -> list[int]:
        """The sequence id of each flat token."""
        return [s.cache.seq_id for s in self.segments for _ in range(s.num_tokens)]

    def advance(self) -> None:
        """Mark the segments' tokens as seen, after all layers ran."""
        for s in self.segments:
            s.cache.length += s.num_tokens


def forward_step(
    model: torch.nn.Module, cache: SequenceCache, ids: Sequence[int], all_logits: bool = False
) -> torch.Tensor:
    """Run `ids` after what `cache` holds, outside any engine core (tests, and drafts that keep their own
    caches); returns logits ([n, V] or [1, V])."""
    batch = Batch.of([(cache, len(ids))], device=model.device)
    return model(
        torch.tensor(list(ids), dtype=torch.long, device=model.device), batch, all_logits=all_logits
    )
