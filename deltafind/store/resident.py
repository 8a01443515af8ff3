"""What the expert provider holds outside its LRU, never evicted: dense layers held whole, and the pin tier.

- **Dense layers** (`hold_dense`, chosen once at open): every token takes every slice of a dense MLP,
  in the same layer order every step. An LRU is the wrong policy for that cycle: when the dense
  slices outgrow the cache each one is evicted just before its turn comes round (no hits at all),
  and in a MoE model the dense layers, used first in a step, are the least recently used when that
  step's routed reads land. Held, a prefix of whole layers hits every token, as the spine's resident
  prefix does (store/spine.py), and a held layer skips the provider's per-fetch bookkeeping
  (`StoreExperts.dense_held`): the demo's tokens took 0.89 of the time at 2 threads (RESULTS.md).
  They are held within `[cache] expert_bytes`; the LRU keeps what is left.
- **The pin tier** (`pin`, `[cache] pin_bytes`): the hottest experts by heat, re-chosen on a live reload.

`experts` holds every key of both, so the provider has one lookup for "held".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from deltafind.provider import Expert
from deltafind.store.manifest import ExpertRecord

Key = tuple[int, int]


def dense_prefix(layers: Sequence[tuple[int, int]], budget_bytes: int | None) -> list[int]:
    """The dense layers to hold, from (layer, stored bytes) in layer order: all of them when they fit
    `budget_bytes` (None: no limit), else whole layers from the first while the largest one still
    fits beside them, so a streamed layer's reads in flight have room in the LRU; 0 holds none."""
    total = sum(n for _, n in layers)
    if budget_bytes is None or total <= budget_bytes:
        return [i for i, _ in layers]
    room, held, out = max(n for _, n in layers), 0, []
    for i, n in layers:
        if held + n + room > budget_bytes:
            break
        held += n
        out.append(i)
    return out


class Resident:
    """Experts held in memory outside the LRU: of the store's `records`, read and decoded by `load(records)`
    (several reads in flight: holding a large model's dense layers at open is one pass over the drives)."""

    def __init__(
        self,
        records: Mapping[Key, ExpertRecord],
        load: Callable[[Sequence[ExpertRecord]], list[Expert]],
    ) -> None:
        self._records, self._load = records, load
        self.experts: dict[Key, Expert] = {}  # every held key, both tiers
        self.layers: dict[int, list[Expert]] = {}  # dense layers held whole: their slices in order
        self.chain: list[
            list[Expert]
        ] = []  # layers 0, 1, ... while held: a model may run them in one call
        self.dense_bytes = 0
        self.pinned_bytes = 0
        self._pinned: set[Key] = set()

    def hold_dense(self, layers: Sequence[int], budget_bytes: int | None) -> int:
        """Hold the dense `layers` that `dense_prefix` picks within `budget_bytes`, each as its slices
        in expert order; returns the bytes held."""
        wanted: set[int] = set(layers)
        by_layer: dict[int, list[ExpertRecord]] = {}
        # layer order, then slice order
        for key in sorted(k for k in self._records if k[0] in wanted):
            by_layer.setdefault(key[0], []).append(self._records[key])
        chosen = [
            i
            for i in dense_prefix(
                [(i, sum(r.length for r in recs)) for i, recs in by_layer.items()], budget_bytes
            )
            if i not in self.layers
        ]
        loaded = iter(
            self._load([r for i in chosen for r in by_layer[i] if r.key not in self.experts])
        )
        for i in chosen:
            slices = [self.experts.get(r.key) or next(loaded) for r in by_layer[i]]
            for r, expert in zip(by_layer[i], slices, strict=True):
                if r.key in self._pinned:  # held here now: the pin tier's bytes go to other experts
                    self._pinned.discard(r.key)
                    self.pinned_bytes -= expert.nbytes
                self.experts[r.key] = expert
            self.layers[i] = slices
            self.dense_bytes += sum(e.nbytes for e in slices)
        while len(self.chain) in self.layers:
            self.chain.append(self.layers[len(self.chain)])
        return self.dense_bytes

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the experts held, both tiers."""
        return [t for e in self.experts.values() for t in e.tensors.values()]

    def pin(self, keys: Sequence[Key], budget_bytes: int) -> int:
        """Pin `keys` (hottest first) until `budget_bytes`; returns bytes pinned. Dense layers held
        already are skipped: they cost the pin tier nothing."""
        chosen, size = [], self.pinned_bytes
        for key in keys:
            if key in self.experts or (rec := self._records.get(key)) is None:
                continue
            if size + rec.length > budget_bytes:
                break
            chosen.append(rec)
            size += rec.length
        for rec, expert in zip(chosen, self._load(chosen), strict=True):
            self.experts[rec.key] = expert
            self._pinned.add(rec.key)
            self.pinned_bytes += expert.nbytes
        return self.pinned_bytes

    def unpin(self) -> None:
        """Empty the pin tier (a reload re-pins under a new budget); dense layers stay held."""
        for key in self._pinned:
            del self.experts[key]
        self._pinned.clear()
        self.pinned_bytes = 0
