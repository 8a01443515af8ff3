"""One drive's read queue: chunked positional reads, demand before speculation, per-drive stats.

A record read is cut into chunks of at most `chunk_bytes` (4096-aligned, so
O_DIRECT takes them) and queued in submission order; `queue_depth` threads keep
that many chunks in flight. So the drive's queue stays full while records land
one after another in the order they were asked for (whole-record reads issued
together all finished together, and the matmuls waited for the last of them:
tests/bench/RESULTS.md). Demand chunks go before speculative ones (prefetch);
a speculative read the router confirms is promoted. Knows nothing of records'
contents, checksums or tensors: `store/reader.py` owns those.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

CHUNK_BYTES = (
    1 << 20
)  # measured on this VM: 1 MiB reads at queue depth 8 reach the drive's rate (RESULTS.md)


@dataclass
class DriveStats:
    """What one drive did: reads are chunks (one preadv each)."""

    reads: int = 0
    bytes: int = 0
    busy_s: float = 0.0  # summed read latency (overlapping reads count each)
    first_t: float = 0.0
    last_t: float = 0.0
    idle_s: float = 0.0  # time between first_t and last_t with no read in flight
    idle_gaps: int = 0
    depth_s: float = 0.0  # integral of reads in flight over time: depth_s / span = mean queue depth
    max_depth: int = 0
    misaligned: int = 0  # reads whose offset, size or buffer address is not 4096-aligned
    max_read_bytes: int = 0
    _in_flight: int = 0
    _changed_t: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def span_s(self) -> float:
        return self.last_t - self.first_t

    @property
    def gb_s(self) -> float:
        return self.bytes / self.span_s / 1e9 if self.span_s > 0 else 0.0

    def begin(self, now: float) -> None:
        with self._lock:
            if not self.first_t:
                self.first_t = now
            elif self._in_flight == 0:
                self.idle_s += now - self._changed_t
                self.idle_gaps += 1
            self.depth_s += self._in_flight * (now - self._changed_t) if self._changed_t else 0.0
            self._in_flight += 1
            self._changed_t = now
            self.max_depth = max(self.max_depth, self._in_flight)

    def end(self, now: float, nbytes: int, latency_s: float) -> None:
        with self._lock:
            self.depth_s += self._in_flight * (now - self._changed_t)
            self._in_flight -= 1
            self._changed_t = now
            self.reads += 1
            self.bytes += nbytes
            self.busy_s += latency_s
            self.last_t = max(self.last_t, now)
            self.max_read_bytes = max(self.max_read_bytes, nbytes)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "reads": self.reads,
            "bytes": self.bytes,
            "gb_s": round(self.gb_s, 4),
            "mean_read_bytes": self.bytes // max(1, self.reads),
            "max_read_bytes": self.max_read_bytes,
            "mean_queue_depth": round(self.depth_s / self.span_s if self.span_s > 0 else 0.0, 2),
            "max_queue_depth": self.max_depth,
            "idle_s": round(self.idle_s, 4),
            "idle_gaps": self.idle_gaps,
            "span_s": round(self.span_s, 4),
            "misaligned_reads": self.misaligned,
        }


class TokenBucket:
    """Reserve a time slot of n/rate seconds per read; reads finish no sooner than their slot."""

    def __init__(self, mb_s: float) -> None:
        self.rate = mb_s * 1e6
        self._next = 0.0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        with self._lock:
            start = max(time.perf_counter(), self._next)
            self._next = start + nbytes / self.rate
            return self._next


class ChunkOwner(Protocol):
    def run(self, chunk: Chunk) -> None:
        """Read the chunk (on a queue thread) and account for it."""

    def abandon(self, chunk: Chunk) -> None:
        """The chunk will never run (the reader closed)."""


class Chunk:
    """One positional read: `size` bytes at `offset` of `queue`'s drive, landing at `pos` of its owner's buffer."""

    __slots__ = ("offset", "owner", "pos", "queue", "size", "speculative", "taken")

    def __init__(
        self, queue: DriveQueue, offset: int, size: int, pos: int, owner: ChunkOwner
    ) -> None:
        self.queue, self.offset, self.size, self.pos, self.owner, self.taken = (
            queue,
            offset,
            size,
            pos,
            owner,
            False,
        )
        self.speculative = False  # taken from the speculative queue (counts against its slots)


def split(offset: int, nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """(offset, size) pieces of an extent, each at most `chunk_bytes`, evenly sized (4096-multiples)."""
    pieces = max(1, -(-nbytes // chunk_bytes))
    if pieces == 1:
        return [(offset, nbytes)]
    per = -(-nbytes // pieces)  # ceil
    step = -(-per // 4096) * 4096
    return [(offset + i, min(step, nbytes - i)) for i in range(0, nbytes, step)]


class DriveQueue:
    """`queue_depth` threads reading one drive's chunks: demand first, then speculative, each FIFO."""

    def __init__(
        self, idx: int, fd: int, queue_depth: int, read_mb_s: float | None, drop_behind: bool
    ) -> None:
        self.idx, self.fd, self.drop_behind = idx, fd, drop_behind
        # Speculative chunks may hold at most a quarter of the slots, so a demand read arriving
        # behind a prefetch finds the drive's queue mostly free (it waits for at most these).
        self.speculative_slots = max(1, queue_depth // 4)
        self._speculative_running = 0
        self.bucket = TokenBucket(read_mb_s) if read_mb_s else None
        self.stats = DriveStats()
        self._demand: deque[Chunk] = deque()
        self._speculative: deque[Chunk] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"drive{idx}-{i}", daemon=True)
            for i in range(queue_depth)
        ]
        for t in self._threads:
            t.start()

    def put(self, chunks: list[Chunk], speculative: bool = False) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError(f"drive {self.idx}: reader closed")
            (self._speculative if speculative else self._demand).extend(chunks)
            self._cv.notify(len(chunks))

    def promote(self, chunks: list[Chunk]) -> None:
        """Queue not-yet-started chunks of a speculative read with the demand reads (they run once)."""
        with self._cv:
            todo = [c for c in chunks if not c.taken]
            self._demand.extend(todo)
            self._cv.notify(len(todo))

    def read_into(self, chunk: Chunk, view: memoryview) -> int:
        """The positional read itself (on a queue thread), paced by the token bucket when capped."""
        slot_end = self.bucket.reserve(chunk.size) if self.bucket else 0.0
        t0 = time.perf_counter()
        if chunk.offset % 4096 or chunk.size % 4096:
            self.stats.misaligned += 1
        self.stats.begin(t0)
        n = 0
        try:
            n = os.preadv(self.fd, [view], chunk.offset)
            if self.drop_behind:
                os.posix_fadvise(self.fd, chunk.offset, chunk.size, os.POSIX_FADV_DONTNEED)
            if slot_end:
                time.sleep(max(0.0, slot_end - time.perf_counter()))
        finally:
            t1 = time.perf_counter()
            self.stats.end(t1, n, t1 - t0)
        return n

    def _next(self) -> Chunk | None:
        with self._cv:
            while True:
                while self._demand:
                    c = self._demand.popleft()
                    if not c.taken:
                        c.taken = True
                        return c
                while self._speculative and self._speculative_running < self.speculative_slots:
                    c = self._speculative.popleft()
                    if not c.taken:
                        c.taken = c.speculative = True
                        self._speculative_running += 1
                        return c
                if self._closed:
                    return None
                self._cv.wait()

    def _work(self) -> None:
        while (chunk := self._next()) is not None:
            try:
                chunk.owner.run(chunk)
            finally:
                if chunk.speculative:
                    with self._cv:
                        self._speculative_running -= 1
                        self._cv.notify()

    def close(self) -> None:
        """Stop the threads after the reads in flight; owners of chunks never started are told."""
        with self._cv:
            left = [c for q in (self._demand, self._speculative) for c in q if not c.taken]
            for c in left:
                c.taken = True
            self._demand.clear()
            self._speculative.clear()
            self._closed = True
            self._cv.notify_all()
        for c in left:
            c.owner.abandon(c)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
