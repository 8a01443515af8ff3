"""The prefetch gate: which predicted reads to start, per layer, so prefetch never costs a drive time it needs.

A prediction is only worth a read when the drive it lands on would otherwise sit idle until
the next layer's demand reads arrive. Per drive the gate knows the bytes queued (demand and
prefetch reads not yet landed, a confirmed prefetch as demand for its whole record, and the demand
reads a fetch holds back until its earlier ones land) and its measured rate while busy. Per layer
and step width it knows the window's compute part: from the moment the last drive's demand ran out
to the next `fetch` (measured directly: the window less a drain estimated from rates was a difference
of two noisy numbers, tests/bench/RESULTS.md). The window expected now is that compute part plus the
busiest drive's demand drain now: a warm cache that hits more each token shortens it at once.
A drive's slack is the window minus its queue's drain time: a read inside the slack costs nothing
if wrong, a read past it delays the demand reads behind it by its own time. So a predicted read is
started when its expected gain (precision x bytes read in idle time) is at least its expected loss
((1 - precision) x bytes past the slack), summed over the drives the record loads, precision being
the lower of the layer's predictions' and of the reads it started (in a warm cache the predicted
experts not held miss more often).
Otherwise — or once a layer's measured precision is below `recall_threshold` — only the record's
first 1 MiB pieces that fit the slack start (piece granularity: the idle window is filled, never
overrun); the rest waits for the router (store/record_read.py). It decides which reads start,
never what `fetch` returns (store/experts.py): tokens never change.
This module knows records only as (key, [(drive, bytes)]); no reader, cache or tensor.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from deltafind.store.drive_queue import CHUNK_BYTES

PRIOR_PRECISION = 0.5  # a layer's precision before its first observation: a hit as likely as a miss
EMA = 0.3  # weight of the newest observation (precision, window): a few tokens to adapt
RATE_HALF_LIFE_S = 2.0  # busy seconds after which old rate samples count half
MAX_WINDOWS = 4096  # (layer, step width) windows remembered, oldest dropped first


@dataclass(frozen=True)
class PrefetchOptions:
    enabled: bool = True
    max_in_flight: int = 32
    recall_threshold: float = 0.3  # below this measured precision a layer stops speculating
    warmup: int = (
        4  # observations before the threshold may close a layer (a short reply must benefit too)
    )


@dataclass
class LayerRecall:
    """One layer's predictions against its routes, and what the gate did with them."""

    predicted: int = 0
    hits: int = 0
    needed: int = 0
    observations: int = 0
    ema: float = PRIOR_PRECISION  # precision of the predictions, exponentially weighted
    # precision of the predicted experts not held when predicted, read or not: what a read would fetch
    # (held ones hit more; learning it only from reads started paid for the lesson, tests/bench/RESULTS.md)
    read_ema: float | None = None
    issued: int = 0  # reads the gate started
    held: int = (
        0  # predicted reads the gate did not start (no slack, low precision, window unknown)
    )

    @property
    def recall(self) -> float:
        return self.hits / self.needed if self.needed else 0.0

    @property
    def precision(self) -> float:
        return self.hits / self.predicted if self.predicted else 0.0

    def as_dict(self, layer: int) -> dict[str, Any]:
        return {
            "layer": layer,
            "recall": round(self.recall, 4),
            "precision": round(self.precision, 4),
            "precision_ema": round(self.ema, 4),
            "read_precision_ema": None if self.read_ema is None else round(self.read_ema, 4),
            "predicted": self.predicted,
            "hits": self.hits,
            "needed": self.needed,
            "issued": self.issued,
            "held": self.held,
        }


@dataclass
class DriveLoad:
    """Bytes queued on one drive and its rate while it had work (bytes per busy second)."""

    queued_bytes: int = 0
    queued_reads: int = 0
    demand_bytes: int = 0  # of queued_bytes, the demand reads': the decoder waits for these
    held_back_bytes: int = (
        0  # demand reads of a fetch not queued yet (under a cache budget it keeps 2 ahead)
    )
    demand_done_at: float | None = (
        0.0  # when its last demand read landed (None: demand queued or held back now)
    )
    busy_since: float = 0.0
    busy_bytes: float = 0.0
    busy_s: float = 0.0

    @property
    def rate(self) -> float | None:
        return self.busy_bytes / self.busy_s if self.busy_s > 0 and self.busy_bytes > 0 else None


@dataclass
class PrefetchGate:
    """Per-layer precision, per-drive load and per-(layer, width) windows; `admit` picks the reads."""

    options: PrefetchOptions
    num_drives: int
    layers: dict[int, LayerRecall] = field(default_factory=lambda: defaultdict(LayerRecall))
    drives: list[DriveLoad] = field(init=False)
    gated: int = 0  # decisions that started none of a non-empty prediction
    piece_bytes: int = (
        CHUNK_BYTES  # the drives' read size: a prefetch may start only its first pieces
    )

    def __post_init__(self) -> None:
        self.drives = [DriveLoad() for _ in range(self.num_drives)]
        self._lock = threading.Lock()  # drive threads report completions
        # (layer, width) -> (average, last) of the window's compute part: from the last drive's demand running out to the fetch
        self._windows: OrderedDict[tuple[int, int], tuple[float, float]] = OrderedDict()
        self._by_width: OrderedDict[int, tuple[float, float]] = (
            OrderedDict()
        )  # width -> the window last measured at it
        self._decided_at: dict[int, float] = {}  # layer -> when the gate decided for it
        self._reads: dict[
            tuple[int, int], list[int]
        ] = {}  # (id of a read not landed, drive) -> its entry (`track`)
        self._width = 0  # tokens in this step: a prefill chunk's window is not a decode step's

    # -- what happens --------------------------------------------------------

    def begin_step(self, num_tokens: int, carried: Iterable[int] = ()) -> None:
        """A forward step of `num_tokens` begins; `carried`: layers decided at the end of the previous one."""
        self._width = num_tokens
        keep = {layer: t for layer in carried if (t := self._decided_at.get(layer)) is not None}
        self._decided_at.clear()
        self._decided_at.update(keep)

    def fetch_started(self, layer_idx: int) -> None:
        """`fetch(layer_idx)` begins: closes the window opened when the gate decided for this layer."""
        now = time.perf_counter()
        decided = self._decided_at.pop(layer_idx, None)
        if decided is not None:
            with self._lock:
                done = [d.demand_done_at for d in self.drives]
            # the compute part: since the last drive's demand ran out (the drives idle but for a prefetch)
            dt = 0.0 if None in done else min(now - decided, now - max(done))  # type: ignore[type-var]
            key = (layer_idx, self._width)
            seen = self._windows.pop(key, None)
            # (average, last): a window that shrinks at once (the cache started hitting) counts at once
            self._windows[key] = (dt, dt) if seen is None else ((1 - EMA) * seen[0] + EMA * dt, dt)
            self._by_width.pop(self._width, None)
            self._by_width[self._width] = self._windows[key]
            for kept in (self._windows, self._by_width):
                while len(kept) > MAX_WINDOWS:
                    kept.popitem(last=False)
        # written on this thread only (`hold_back`): no lock to look
        if any(d.held_back_bytes for d in self.drives):
            with self._lock:  # what the previous fetch held back is its own: done or abandoned, it is no one's now
                for d in self.drives:
                    d.held_back_bytes = 0
                    if d.demand_bytes == 0 and d.demand_done_at is None:
                        d.demand_done_at = now

    def observe(
        self,
        layer_idx: int,
        predicted: set[int],
        wanted: Sequence[int],
        read: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        """A prediction for `layer_idx` met the router's choice; `read`: the predicted experts that were not held
        (a read started for them, or would have)."""
        r = self._layer(layer_idx)
        hits = len(predicted.intersection(wanted))
        r.predicted += len(predicted)
        r.hits += hits
        r.needed += len(wanted)
        r.observations += 1
        if predicted:
            p = hits / len(predicted)
            # The first observation replaces the prior: starting from a fixed guess kept a
            # useless layer open for ~8 tokens (measured: wasted reads on short runs).
            r.ema = p if r.observations == 1 else (1 - EMA) * r.ema + EMA * p
        if read:
            q = len(read.intersection(wanted)) / len(read)
            r.read_ema = q if r.read_ema is None else (1 - EMA) * r.read_ema + EMA * q

    def track(self, drive: int, nbytes: int, fut: Future, speculative: bool = False) -> None:
        """A read of `nbytes` was queued on `drive` (demand, or a prefetch): count it until it lands."""
        if not 0 <= drive < self.num_drives:
            return
        entry = [
            nbytes,
            0 if speculative else nbytes,
        ]  # bytes queued, of them demand: `promote` may grow both
        with self._lock:
            d = self.drives[drive]
            if d.queued_reads == 0:
                d.busy_since = time.perf_counter()
            d.queued_bytes += nbytes
            d.queued_reads += 1
            d.demand_bytes += entry[1]
            if entry[1]:
                d.demand_done_at = None
            self._reads[(id(fut), drive)] = entry
        fut.add_done_callback(lambda f: self._landed(drive, entry, f))

    def promote(self, fut: Future, loads: Iterable[tuple[int, int]]) -> None:
        """The router confirmed a prefetch: its whole record, `loads` (drive, bytes), is demand now —
        the decoder waits for it, pieces not started yet included. Left counted as speculative, a
        confirmed layer's reads hid from the drain, and the next layer's slack came out negative:
        every other layer prefetched nothing (tests/bench/RESULTS.md)."""
        with self._lock:
            for drive, nbytes in loads:
                if (entry := self._reads.get((id(fut), drive))) is not None:  # None: landed already
                    d = self.drives[drive]
                    d.queued_bytes += nbytes - entry[0]
                    d.demand_bytes += nbytes - entry[1]
                    d.demand_done_at = None
                    entry[0] = entry[1] = nbytes

    def hold_back(self, drive: int, nbytes: int) -> None:
        """`nbytes` of this fetch's demand reads on `drive` wait behind the ones queued (negative: they were queued).
        Not counting them made a warm cache's slack look free while the drive still had the layer to read
        (tests/bench/RESULTS.md: prefetch on was 0.89x of off, warm, 1 drive, batch 8)."""
        if 0 <= drive < self.num_drives:
            with self._lock:
                d = self.drives[drive]
                d.held_back_bytes += nbytes
                if d.held_back_bytes:
                    d.demand_done_at = None

    def _landed(self, drive: int, entry: list[int], fut: Future) -> None:
        now = time.perf_counter()
        with self._lock:
            self._reads.pop((id(fut), drive), None)
            d = self.drives[drive]
            d.queued_bytes -= entry[0]
            d.queued_reads -= 1
            d.demand_bytes -= entry[1]
            if d.demand_bytes == 0 and d.held_back_bytes == 0 and d.demand_done_at is None:
                d.demand_done_at = now
            if not fut.cancelled():  # a cancelled read never reached the drive
                d.busy_s += now - d.busy_since
                d.busy_bytes += entry[0]
                if d.busy_s > RATE_HALF_LIFE_S:
                    d.busy_s, d.busy_bytes = d.busy_s / 2, d.busy_bytes / 2
            d.busy_since = now

    # -- the decision --------------------------------------------------------

    def admit(
        self, layer_idx: int, candidates: Iterable[tuple[Any, Sequence[tuple[int, int]]]], room: int
    ) -> list[tuple[Any, int]]:
        """The candidates (key, [(drive, bytes) it loads]), best first, whose reads should start now, each
        with the bytes per drive to read before the router confirms it (less than its share: only its
        first pieces); at most `room`. A striped record is weighed on every drive it loads."""
        self._decided_at[layer_idx] = time.perf_counter()
        cands = list(candidates)
        if not cands:
            return []
        with self._lock:
            work = [
                (d.queued_bytes + d.held_back_bytes, d.demand_bytes + d.held_back_bytes, d.rate)
                for d in self.drives
            ]
        drain = max((demand / rate for _, demand, rate in work if rate is not None), default=0.0)
        r, opts = self._layer(layer_idx), self.options
        # A layer not yet timed at this width borrows the window last measured at it: layers compute alike,
        # and keyed strictly, a step width first seen (a new batch size) had no prefetch on any layer.
        seen = self._windows.get((layer_idx, self._width)) or self._by_width.get(self._width)
        if seen is None or room <= 0:  # no window yet: this width was never timed
            return self._hold(r, len(cands))
        window = (
            min(seen) + drain
        )  # the shorter of average and last compute part: never an optimistic slack
        slack = [window * rate - n if rate is not None else 0.0 for n, _, rate in work]
        p, out = r.ema if r.read_ema is None else min(r.ema, r.read_ema), []
        # A layer whose predictions miss too often reads no whole records, only pieces inside the slack:
        # a wrong piece there costs the drive nothing it needed.
        closed = r.observations >= opts.warmup and r.ema < opts.recall_threshold
        for key, loads in cands:
            if len(out) >= room or p <= 0:
                break
            free = [max(0.0, slack[d]) if 0 <= d < len(slack) else 0.0 for d, _ in loads]
            gain = p * sum(min(n, f) for (_, n), f in zip(loads, free, strict=True))
            loss = (1 - p) * sum(max(0.0, n - f) for (_, n), f in zip(loads, free, strict=True))
            share = max(n for _, n in loads)
            # a sure hit past the slack is read anyway: it may start now
            if not closed and gain >= loss:
                take = share
            else:
                take = min(share, int(min(free) // self.piece_bytes) * self.piece_bytes)
            if take > 0:
                out.append((key, take))
                for d, n in loads:
                    if 0 <= d < len(slack):
                        slack[d] -= min(take, n)
        r.issued += len(out)
        r.held += len(cands) - len(out)
        if not out:
            self.gated += 1
        return out

    def _layer(self, layer_idx: int) -> LayerRecall:
        if (r := self.layers.get(layer_idx)) is None:
            with self._lock:  # `snapshot` may be iterating on the control thread
                r = self.layers[layer_idx] = LayerRecall()
        return r

    def _hold(self, r: LayerRecall, n: int) -> list[Any]:
        r.held += n
        self.gated += 1
        return []

    def snapshot(self) -> dict[str, Any]:
        """Per-layer recall and precision and per-drive load, JSON-ready (the store snapshot's `prefetch_gate`)."""
        with self._lock:
            drives = [
                {
                    "drive": i,
                    "queued_bytes": d.queued_bytes,
                    "held_back_bytes": d.held_back_bytes,
                    "rate_gb_s": round((d.rate or 0.0) / 1e9, 4),
                }
                for i, d in enumerate(self.drives)
            ]
            layers = sorted(self.layers.items())
        return {
            "layers": [r.as_dict(layer) for layer, r in layers],
            "drives": drives,
            "gated": self.gated,
        }
