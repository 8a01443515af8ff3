"""The store-backed `ExpertProvider`: cache, pin tier, in-flight reads, prefetch, stats.

`fetch` yields cached and pinned experts first, then the rest in completion order as the drive pools deliver
them. `prefetch` starts reads (store/expert_reads.py) for a predicted next layer, those the gate admits
(store/prefetch_gate.py: whole records, or only their first pieces until the router confirms them); a prediction
only starts reads — what `fetch` returns never depends on it, so output is identical with prefetch on or off.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

import torch

from deltafind.errors import CorruptExpertError
from deltafind.provider import Expert
from deltafind.store.buffers import Stager, record_tensors
from deltafind.store.cache import ByteLRU, return_freed_memory
from deltafind.store.expert_reads import RECORDS_AHEAD, ExpertReads, ExpertStats
from deltafind.store.manifest import ExpertRecord, Manifest
from deltafind.store.prefetch_gate import PrefetchGate, PrefetchOptions
from deltafind.store.read_budget import ReadBudget
from deltafind.store.reader import DriveOptions, PackReader
from deltafind.store.resident import Resident
from deltafind.store.spine import SpineStreamer
from deltafind.store.trace import TraceWriter


def prefetch_options(settings: Any) -> PrefetchOptions:
    """`[prefetch]` as the gate's options: the one place they are built (at open and on reload)."""
    p = settings.prefetch
    return PrefetchOptions(p.enabled, p.max_in_flight, p.recall_threshold)


def drive_options(settings: Any) -> list[DriveOptions] | None:
    """`[[drives]]` as the reader's options (None: the drive folders the store records)."""
    return [DriveOptions(d.path, d.queue_depth, d.read_mb_s) for d in settings.drives] or None


class StoreExperts(ExpertReads):
    """Experts of one store, read on demand through the drive pools and a byte-budgeted LRU."""

    @classmethod
    def from_settings(
        cls,
        settings: Any,
        manifest: Manifest,
        store_dir: Path,
        dtype: torch.dtype,
        trace: TraceWriter | None = None,
        *,
        stager: Stager,
        cache: ByteLRU[tuple[int, int], Expert] | None = None,
        buffer_pool: Callable[[int], Any] | None = None,
    ) -> StoreExperts:
        """The store's experts as `settings` ([cache], [prefetch], [[drives]]) say: the one place that reads
        those sections for a reader (Model.open, and an expert node of a cluster)."""
        c = settings.cache
        return cls(
            manifest,
            store_dir,
            None if c.expert_bytes is None else int(c.expert_bytes),
            dtype,
            drive_options(settings),
            prefetch_options(settings),
            c.read_mode,
            trace,
            stager=stager,
            cache=cache,
            buffer_pool=buffer_pool,
        )

    def __init__(
        self,
        manifest: Manifest,
        store_dir: Path,
        expert_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
        drives: list[DriveOptions] | None = None,
        prefetch: PrefetchOptions | None = None,
        read_mode: str = "direct",
        trace: TraceWriter | None = None,
        verify: str = "fast",
        *,
        stager: Stager,
        cache: ByteLRU[tuple[int, int], Expert] | None = None,
        buffer_pool: Callable[[int], Any] | None = None,
    ) -> None:
        """`stager` picks the device; `cache` defaults to `ByteLRU(expert_bytes)`, `buffer_pool` to the reader's mmaps."""
        self.manifest = manifest
        return_freed_memory()
        self.reader = PackReader(
            manifest,
            Path(store_dir),
            verify=verify,
            drives=drives,
            read_mode=read_mode,
            buffer_pool=buffer_pool,
        )
        self.cache = ByteLRU(expert_bytes) if cache is None else cache
        self._records: dict[tuple[int, int], ExpertRecord] = {r.key: r for r in manifest.experts}
        # held outside the LRU: dense layers, the pin tier
        self.resident = Resident(self._records, self._load)
        self.stager, self.dtype, self.device = stager, dtype, stager.device
        # CPU compute: demand reads are widened to the compute dtype on the drive threads, so it
        # overlaps the matmuls (measured in tests/bench/RESULTS.md); a device copies as stored.
        self._decode_on_reader = self.device.type == "cpu"
        # Host reads in flight (buffer + widened copy) count against the expert budget, so experts
        # held plus reads on their way stay within `expert_bytes` (measured peak RSS: RESULTS.md).
        self.budget = ReadBudget(
            self.cache, dtype, self._decode_on_reader and expert_bytes is not None
        )
        self._reserved: dict[tuple[int, int], int] = {}  # reservations of prefetches in flight
        self._deferred: dict[int, list[int]] = {}  # layer -> predicted experts awaiting a fetch
        self._early: list[int] | None = None  # the next step's layer 0 hint, from its last fetch
        stored = {getattr(torch, t.dtype) for r in manifest.experts for t in r.tensors}
        if not any(d.is_floating_point and d != dtype for d in stored):
            self.reader.widened.max_free_bytes = (
                0  # nothing to widen (MXFP4 packs, or stored as computed)
            )
        # the pool's free buffers count against the budget, so never more than it (at 8 records
        if self.budget.bounded:
            # per drive they were 352 MB against a K3-width store's 256 MB: RSS past the budget, RESULTS.md)
            self.reader.buffers.max_free_bytes = min(
                self.reader.buffers.max_free_bytes, self.cache.budget_bytes
            )
        # the reader's buffer pools are host memory the budget must cover too
        if self.budget.reserving:
            self.cache.reserve(
                self.reader.buffers.max_free_bytes + self.reader.widened.max_free_bytes
            )
        self.gate = PrefetchGate(prefetch or PrefetchOptions(enabled=False), len(self.reader.paths))
        self._counts = manifest.expert_counts()
        self._first_layer, self._last_layer = (
            min(self._counts, default=-1),
            max(self._counts, default=-1),
        )
        self._inflight: dict[tuple[int, int], Future] = {}
        self._last_route: dict[int, list[int]] = {}
        # layer -> (predicted, of them not held when issued)
        self._predicted: dict[int, tuple[set[int], set[int]]] = {}
        self._layer_keys: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for key in self._records:
            self._layer_keys[key[0]].append(key)
        self._held_seen: dict[int, tuple[tuple[int, int], bool]] = {}  # layer -> (stamp, all held)
        self.uses: dict[tuple[int, int], int] = defaultdict(int)  # for the heat histogram
        self.stats = ExpertStats(layers=self.gate.layers)
        self.trace = trace
        self._step: tuple[Sequence[int], Sequence[int]] = ([], [])
        self.spine: SpineStreamer | None = None  # the spine's streamed layers, when not all fit

    def num_experts(self, layer_idx: int) -> int:
        return self._counts.get(layer_idx, 0)

    def record(self, layer_idx: int, expert_idx: int) -> ExpertRecord:
        rec = self._records.get((layer_idx, expert_idx))
        if rec is None:
            raise CorruptExpertError(
                f"expert {expert_idx} of layer {layer_idx} is not in this store's manifest"
            )
        return rec

    def fetch(self, layer_idx: int, expert_ids: Sequence[int]) -> Iterable[tuple[int, Expert]]:
        """The contract's `fetch`, its reads started now: a list, in the order asked, where every expert is
        held (pinned or cached), so a model may run them in one kernel call (ops/moe.py); else the held
        ones, then each read as it lands (iterate it: that ends or cancels its reads)."""
        wanted = list(dict.fromkeys(expert_ids))
        self.gate.fetch_started(layer_idx)
        self._observe(layer_idx, wanted)
        if self.reader.remote is not None:
            self._fetch_missing(layer_idx, wanted)
        pending: dict[Future, int] = {}
        # prefetched reads: started earlier, maybe for another request
        speculative: set[Future] = set()
        held: dict[int, int] = {}  # expert -> bytes reserved in the cache for its read
        waiting: dict[int, deque[int]] = defaultdict(deque)  # drive -> demand reads not started yet
        ready: list[tuple[int, Expert]] = []
        keys = [(layer_idx, e) for e in wanted]
        self.stats.requested += len(keys)
        for key in keys:
            self.uses[key] += 1
        resident = self.resident.experts
        # one lock for the layer
        cached = iter(self.cache.get_many([k for k in keys if k not in resident]))
        for e, key in zip(wanted, keys, strict=True):
            if (expert := resident.get(key)) is not None:
                self.stats.pinned_hits += 1
                ready.append((e, expert))
            elif (expert := next(cached)) is not None:
                self.stats.cache_hits += 1
                ready.append((e, expert))
            elif (fut := self._inflight.pop(key, None)) is not None:
                self.stats.prefetch_used += 1
                held[e] = self._reserved.pop(key, 0)
                self.gate.promote(fut, self.record(layer_idx, e).loads())
                if self._decode_on_reader:
                    fut = self.reader.decode_when_read(self.record(layer_idx, e), fut, self.dtype)
                else:
                    self.reader.promote(fut)  # needed now: ahead of other speculative reads
                pending[fut] = e
                speculative.add(fut)
            else:
                waiting[self.record(layer_idx, e).drive].append(e)
                self._hold_back(self.record(layer_idx, e), 1)
        for drive in waiting:
            self._start_demand(layer_idx, waiting[drive], pending, held)
        if self._inflight:  # predictions for this layer that the router did not pick
            self._drop_inflight(layer_idx)
        self._issue_next(layer_idx)  # behind this layer's demand reads
        if not pending:
            return ready

        def arrivals() -> Iterator[tuple[int, Expert]]:
            """The held experts, then each read as it completes (reads are started as others land)."""
            try:
                # inside: a consumer that stops at a held expert still cancels the reads below
                yield from ready
                while pending:
                    t0 = time.perf_counter()
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    self.stats.wait_s += time.perf_counter() - t0
                    for fut in done:
                        e = pending.pop(fut)
                        self._start_demand(
                            layer_idx, waiting[self.record(layer_idx, e).drive], pending, held
                        )
                        if fut in speculative and fut.exception() is not None:
                            # A prefetch may have been read for an earlier, failed request (a record
                            # since repaired, a transient error): only a read made now decides.
                            speculative.discard(fut)
                            pending[self._demand_read(layer_idx, e)] = e
                            continue
                        # it lands now: the cache counts it as an entry
                        self.budget.unreserve(held.pop(e, 0))
                        rec = self.record(layer_idx, e)
                        try:
                            got = fut.result()  # a tuple: decoded on the drive thread
                            expert = (
                                self._decode(rec, got[1], got[0], got[2])
                                if isinstance(got, tuple)
                                else self._decode(rec, got)
                            )
                        except Exception as err:
                            if (failed := self._failed(rec, err)) is err:
                                raise
                            raise failed from err
                        # the held tiers' loads keep theirs outside the LRU
                        self.cache.put(rec.key, expert, expert.nbytes)
                        yield e, expert
            finally:
                # an error or an abandoned generator: reads still running are waste
                for fut in pending:
                    fut.cancel()
                for n in held.values():
                    self.budget.unreserve(n)

        return arrivals()

    def dense_held(self, layer_idx: int) -> list[Expert] | None:
        """Dense layer `layer_idx`'s slices in order when held whole (store/resident.py), counted as
        used; else None (`fetch` them). The next layer's prediction is issued as `fetch` would."""
        if (slices := self.resident.layers.get(layer_idx)) is None:
            return None
        self.stats.requested += len(slices)
        self.stats.pinned_hits += len(slices)
        if self._deferred or layer_idx == self._last_layer:
            self._issue_next(layer_idx)
        return slices

    def held_chain(self, num_layers: int) -> list[list[Expert]] | None:
        chain = self.resident.chain
        return (
            chain
            if num_layers <= len(chain) and self.spine is None and self.trace is None
            else None
        )

    def wants_prefetch(self, layer_idx: int) -> bool:
        """False where no read can come of a hint for `layer_idx`, so the model skips computing it (its
        router matmul and sort were ~0.9 ms of a Qwen3-30B-A3B-shaped token, tests/bench/RESULTS.md):
        prefetch off, no experts there or a dense layer held, or, untraced, every expert of the layer
        held, and under a budget every expert of the store (else a read elsewhere may evict, in an
        order the hint's touch would have changed)."""
        g, held = self.gate.options.enabled, self.resident.layers
        if not g or layer_idx not in self._counts or layer_idx in held:
            return False
        bounded = self.cache.budget_bytes is not None
        return (
            self.trace is not None or not self._held(layer_idx) or (bounded and not self._held(-1))
        )

    def _held(self, layer_idx: int) -> bool:
        """Whether every expert of the layer (-1: of the store) is pinned or cached; checked again only
        when what is held may have changed (an LRU put or pop, the pin tier's size)."""
        stamp = (self.cache.version, len(self.resident.experts))
        if (seen := self._held_seen.get(layer_idx)) is None or seen[0] != stamp:
            pinned, cached = self.resident.experts, self.cache
            held = (
                all(map(self._held, self._counts))
                if layer_idx < 0
                else all(k in pinned or k in cached for k in self._layer_keys[layer_idx])
            )
            seen = self._held_seen[layer_idx] = (stamp, held)
        return seen[1]

    def begin_step(self, seq_ids: Sequence[int], positions: Sequence[int]) -> None:
        self._step = (seq_ids, positions)
        self.gate.begin_step(len(positions), carried=(0,) if self._early is not None else ())

    def enter_layer(self, layer_idx: int) -> None:
        if self.spine is not None:
            self.spine.enter(layer_idx)

    def observe_routes(
        self, layer_idx: int, topk_idx: torch.Tensor, topk_weight: torch.Tensor
    ) -> None:
        if (trace := self.trace) is not None:
            trace.routes(layer_idx, *self._step, topk_idx.tolist(), topk_weight.float().tolist())

    def _failed(self, rec: ExpertRecord, err: Exception) -> CorruptExpertError:
        """The error of a read that failed, as a CorruptExpertError naming the record (pack, offset) and
        carrying `expert_key` (layer, expert): the model fails only the rows that routed that expert."""
        if not isinstance(err, CorruptExpertError):
            where = ", ".join(
                f"{self.reader.paths[x.drive]} at offset {x.offset}" for x in rec.extents()
            )
            err = CorruptExpertError(
                f"expert {rec.expert} of layer {rec.layer}: reading {where} failed: "
                f"{type(err).__name__}: {err}; run `deltafind doctor` to check the drive and the store"
            )
        err.expert_key = rec.key  # type: ignore[attr-defined]
        return err

    def _decode(
        self,
        rec: ExpertRecord,
        buf: object,
        views: dict[str, torch.Tensor] | None = None,
        pooled: list[torch.Tensor] | None = None,
    ) -> Expert:
        """`buf` holds the record (None: `views` were decoded already and no longer need it);
        `pooled` tensors of `views` go back to the reader's pool when the expert is dropped."""
        self.stats.read += 1
        self.stats.bytes_read += rec.length
        if views is None:
            views = record_tensors(rec, buf)
        # Packed formats (MXFP4 codes and scales) stay as stored; float weights take the compute dtype.
        # The stager moves them to the device and releases `buf` once no copy needs it.
        release = functools.partial(self.reader.release, buf) if buf is not None else lambda: None
        tensors, aliased = self.stager.stage(views, self.dtype, release)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        expert = Expert(tensors, nbytes, {t.name: t.quant for t in rec.tensors if t.quant})
        if pooled and all(
            any(t is p for p in pooled) for t in tensors.values() if t.is_floating_point()
        ):
            weakref.finalize(expert, self.reader.widened.put_all, pooled)
        if aliased and buf is not None:
            # tensors are views over the read buffer: recycle it once the expert is gone
            weakref.finalize(expert, self.reader.release, buf)
        return expert

    def hold_dense(self, layers: Sequence[int]) -> None:
        """Hold the dense `layers` that fit the expert budget resident (store/resident.py); the LRU keeps the rest."""
        budget = self.cache.budget_bytes
        self.resident.hold_dense(layers, budget)
        self.set_cache_budget(budget)

    def set_cache_budget(self, expert_bytes: int | None) -> None:
        """`[cache] expert_bytes`: what the held dense layers leave of it is the LRU's."""
        self.cache.resize(
            None if expert_bytes is None else max(expert_bytes - self.resident.dense_bytes, 0)
        )

    def _load(self, recs: Sequence[ExpertRecord]) -> list[Expert]:
        """`recs` read and decoded for the held tiers (outside the LRU), RECORDS_AHEAD reads a drive in flight."""
        ahead, out = RECORDS_AHEAD * len(self.reader.paths), []
        reads = [self.reader.submit(r) for r in recs[:ahead]]
        for i, rec in enumerate(recs):
            # the next one, while this decodes
            reads += [self.reader.submit(r) for r in recs[i + ahead : i + ahead + 1]]
            out.append(self._decode(rec, reads[i].result()))
            self.cache.pop(rec.key)  # an LRU copy of an expert held now
        return out

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        for fut in self._inflight.values():
            fut.cancel()
        self._inflight.clear()
        self.stager.drain()  # copies in flight still read their host buffers
        self.reader.close()
