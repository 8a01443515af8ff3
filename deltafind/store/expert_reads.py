"""When expert reads start on the drives: a fetch's demand reads, paced per drive, and the
predicted next layer's prefetches that the gate admits, held back behind those demand reads.
A base of `StoreExperts` (store/experts.py), which owns the state these methods share and
consumes the reads they start; nothing here waits on a read or decodes one.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from deltafind.provider import Expert
from deltafind.store.cache import ByteLRU
from deltafind.store.manifest import ExpertRecord
from deltafind.store.prefetch_gate import LayerRecall, PrefetchGate, PrefetchOptions
from deltafind.store.read_budget import ReadBudget
from deltafind.store.reader import PackReader
from deltafind.store.resident import Resident
from deltafind.store.trace import TraceWriter

RECORDS_AHEAD = 2  # demand reads a fetch keeps unconsumed per drive under a budget: one being read (its 1 MiB chunks fill the queue), the next behind it


@dataclass
class ExpertStats:
    requested: int = 0
    cache_hits: int = 0
    pinned_hits: int = 0
    read: int = 0
    bytes_read: int = 0
    wait_s: float = 0.0  # time fetch spent blocked on reads
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    prefetch_gated: int = 0
    layers: dict[int, LayerRecall] = field(
        default_factory=lambda: defaultdict(LayerRecall)
    )  # the gate's, per layer


class ExpertReads:
    """Starts and tracks the drive reads of `StoreExperts`; the state is set by its `__init__`."""

    reader: PackReader
    cache: ByteLRU[tuple[int, int], Expert]
    resident: Resident
    budget: ReadBudget
    gate: PrefetchGate
    trace: TraceWriter | None
    stats: ExpertStats
    dtype: torch.dtype
    _decode_on_reader: bool
    _records: dict[tuple[int, int], ExpertRecord]
    _counts: dict[int, int]
    _first_layer: int
    _last_layer: int
    _inflight: dict[tuple[int, int], Future]
    _reserved: dict[tuple[int, int], int]
    _deferred: dict[int, list[int]]
    _early: list[int] | None
    _predicted: dict[int, tuple[set[int], set[int]]]
    _last_route: dict[int, list[int]]
    record: Callable[[int, int], ExpertRecord]  # StoreExperts.record: (layer, expert) -> its record

    @property
    def prefetch_options(self) -> PrefetchOptions:
        return self.gate.options

    @prefetch_options.setter
    def prefetch_options(self, options: PrefetchOptions) -> None:  # a live reload
        self.gate.options = options

    def _issue_next(self, layer_idx: int) -> None:
        """Layer `layer_idx` has its reads queued: start the prediction for the next layer held back
        until then (`prefetch`), or at the last layer the next step's layer 0."""
        self._deferred.pop(layer_idx, None)  # a prediction that never got its turn
        if (nxt := self._deferred.pop(layer_idx + 1, None)) is not None:
            self._issue(layer_idx + 1, nxt)
        elif (
            layer_idx == self._last_layer
            and self._first_layer == 0
            and self.prefetch_options.enabled
            and 0 not in self.resident.layers
        ):
            # The next step's layer 0 is predicted by this step's route there: issued now, its
            # pieces fill the drives' idle time over lm_head, sampling and layer 0's attention.
            self._early = self._predict(0, self._last_route.get(0, []))
            self._issue(0, self._early)

    def _start_demand(
        self, layer_idx: int, waiting: deque[int], pending: dict[Future, int], held: dict[int, int]
    ) -> None:
        """Start `waiting` reads (all on one drive); under a cache budget only while that drive has
        fewer than RECORDS_AHEAD of this fetch's reads unconsumed: its queue stays full, and a layer's
        reads landing faster than its experts run no longer pile up in buffers outside the budget
        (tests/bench/RESULTS.md). With no cache (0) or no limit, all start at once."""
        if not waiting:
            return
        drive = self.record(layer_idx, waiting[0]).drive
        busy = (
            sum(self.record(layer_idx, e).drive == drive for e in pending.values())
            if self.budget.bounded
            else 0
        )
        limit = RECORDS_AHEAD if self.budget.bounded else len(waiting)
        while waiting and busy < limit:
            e = waiting.popleft()
            self._hold_back(self.record(layer_idx, e), -1)
            if self._decode_on_reader:
                held[e] = self.budget.reserve(self.record(layer_idx, e))
            pending[self._demand_read(layer_idx, e)] = e
            busy += 1

    def prefetch(self, layer_idx: int, expert_ids: Sequence[int] | None) -> None:
        """Start reads for experts predicted at `layer_idx` (None: the previous token's route there)."""
        if (
            not self.prefetch_options.enabled
            or layer_idx not in self._counts
            or layer_idx in self.resident.layers
        ):
            return
        if expert_ids is None and layer_idx == 0 and self._early is not None:
            self._early = None  # issued at the end of the previous step (fetch), window and all
            return
        ids = self._predict(
            layer_idx, self._last_route.get(layer_idx, []) if expert_ids is None else expert_ids
        )
        if layer_idx - 1 in self._counts:
            # The model asks before fetching layer_idx - 1: queued now, these reads would sit ahead
            # of that layer's demand reads in the drive queues (measured: prefetch on was 0.70x of
            # off). So they start right after that fetch has queued its own reads.
            self._deferred[layer_idx] = ids
            return
        self._issue(layer_idx, ids)

    def _predict(self, layer_idx: int, expert_ids: Sequence[int]) -> list[int]:
        ids = list(dict.fromkeys(expert_ids))
        self._predicted[layer_idx] = (set(ids), set())
        if self.trace is not None:
            self.trace.write({"layer": layer_idx, "pred": ids})
        return ids

    def _fetch_missing(self, layer_idx: int, ids: list[int]) -> None:
        """A streaming install: start fetching the layer's missing experts together, so neighbours
        in a shard share one range request (store/remote_experts.py)."""
        if (remote := self.reader.remote) is not None:
            remote.submit(
                [
                    (layer_idx, e)
                    for e in ids
                    if (layer_idx, e) not in remote.present and (layer_idx, e) in self._records
                ]
            )

    def _issue(self, layer_idx: int, ids: list[int]) -> None:
        """Start the reads the gate admits among `ids` (best first) that are not held or read already."""
        self._fetch_missing(layer_idx, ids)
        keys = [(layer_idx, e) for e in ids]
        # Held predictions are the least recently used: a read reserved now evicted exactly them (tests/bench/RESULTS.md).
        self.cache.touch(keys)
        # a striped record loads each of its drives by its share: the gate weighs it on all of them
        todo = [
            (k, self._records[k].loads())
            for k in keys
            if k not in self._inflight
            and k not in self.resident.experts
            and k not in self.cache
            and k in self._records
        ]
        if (
            predicted := self._predicted.get(layer_idx)
        ) is not None:  # not held: what reads fetch (gate.observe)
            predicted[1].update(
                [k[1] for k, _ in todo] + [k[1] for k in keys if k in self._inflight]
            )
        todo = todo[: self.budget.fitting([self._records[k] for k, _ in todo])]
        gated = self.gate.gated
        share = {k: max(n for _, n in loads) for k, loads in todo}
        for key, nbytes in self.gate.admit(
            layer_idx, todo, self.prefetch_options.max_in_flight - len(self._inflight)
        ):
            rec = self._records[key]
            # only the pieces that fit the drive's idle window, the rest once the router confirms it
            pieces = None if nbytes >= share[key] else max(1, nbytes // self.gate.piece_bytes)
            self._reserved[key] = self.budget.reserve(rec)
            self._inflight[key] = self._track(
                rec, self.reader.submit(rec, speculative=True, pieces=pieces), nbytes, True
            )
            self.stats.prefetch_issued += 1
        self.stats.prefetch_gated += self.gate.gated - gated

    def _track(
        self, rec: ExpertRecord, fut: Future, share: int | None = None, speculative: bool = False
    ) -> Future:
        """Count the read on every drive it loads (a striped record: each stripe on its own drive;
        `share`: the bytes per drive a prefetch of only its first pieces queues)."""
        for drive, nbytes in rec.loads():
            self.gate.track(drive, min(share or rec.length, nbytes), fut, speculative)
        return fut

    def _hold_back(self, rec: ExpertRecord, sign: int) -> None:
        """Tell the gate of a demand read held back (1) or started (-1) on every drive it loads; the
        gate forgets what a fetch held back when the next one starts (an error or an abandoned fetch)."""
        for drive, nbytes in rec.loads():
            self.gate.hold_back(drive, sign * nbytes)

    def _observe(self, layer_idx: int, wanted: list[int]) -> None:
        self._last_route[layer_idx] = wanted
        if (predicted := self._predicted.pop(layer_idx, None)) is not None:
            self.gate.observe(layer_idx, predicted[0], wanted, predicted[1])

    def _demand_read(self, layer_idx: int, e: int) -> Future:
        rec = self.record(layer_idx, e)
        if not self._decode_on_reader:
            return self._track(rec, self.reader.submit(rec))
        return self._track(rec, self.reader.submit_decoded(rec, self.dtype))

    def _drop_inflight(self, layer_idx: int) -> None:
        for key in [k for k in self._inflight if k[0] == layer_idx]:
            fut = self._inflight.pop(key)
            self.budget.unreserve(self._reserved.pop(key, 0))
            self.stats.prefetch_wasted += 1
            if not fut.cancel():
                # Already being read: recycle its buffer. Decoding it "in case" costs CPU
                # that the real reads need (measured: it halved decode speed).
                fut.add_done_callback(self._recycle)

    def _recycle(self, fut: Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.reader.release(fut.result())
