"""One expert record in flight: its 1 MiB pieces on their drives' queues, the buffer they fill, a countdown.

A demand read queues every piece at once. A prefetch may queue only its first pieces per
drive (`pieces`): those the prefetch gate found room for in the drive's idle window
(store/prefetch_gate.py); the rest wait here. When the router confirms the record, `promote`
sends the waiting pieces and the queued-but-unstarted ones to the demand queues, and the
pieces already read are kept for it. When it does not, the read is cancelled: pieces not yet
started are skipped, the waiting ones never go to a drive, and the pieces already read are
dropped with the buffer. `PieceStats` counts both outcomes (kept, dropped).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deltafind.errors import CorruptExpertError
from deltafind.store.drive_queue import Chunk, split
from deltafind.store.manifest import ExpertRecord, Extent, align_up

if TYPE_CHECKING:
    import torch


@dataclass
class PieceStats:
    """Pieces a prefetch read before the router chose: kept for a confirmed record, or dropped."""

    kept: int = 0
    dropped: int = 0
    kept_bytes: int = 0
    dropped_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, pieces: int, nbytes: int, kept: bool) -> None:
        with self._lock:
            if kept:
                self.kept, self.kept_bytes = self.kept + pieces, self.kept_bytes + nbytes
            else:
                self.dropped, self.dropped_bytes = (
                    self.dropped + pieces,
                    self.dropped_bytes + nbytes,
                )

    def as_dict(self) -> dict[str, int]:
        return {
            "kept": self.kept,
            "dropped": self.dropped,
            "kept_bytes": self.kept_bytes,
            "dropped_bytes": self.dropped_bytes,
        }


class ExpertRead(Future):  # type: ignore[type-arg]  # one expert record's bytes
    record: RecordRead | None = None  # its read in flight, for `promote`; None once landed


class RecordRead:
    """The thread that lands the last piece checks the bytes (and converts them, for
    `submit_decoded`) and completes the future; a cancelled read skips the pieces not yet
    started and recycles its buffer."""

    def __init__(
        self, reader: Any, rec: ExpertRecord, fut: ExpertRead, dtype: torch.dtype | None
    ) -> None:
        # reader: the PackReader (store/reader.py) that owns the queues, buffers and checks; not imported (it imports this)
        self.reader, self.rec, self.fut, self.dtype = reader, rec, fut, dtype
        self.buf: Any = None
        self.error: BaseException | None = None
        self.chunks: list[Chunk] = []
        self.waiting: dict[
            int, list[Chunk]
        ] = {}  # drive -> a prefetch's pieces past its admitted ones
        self._left = 0
        self._speculative_read = [0, 0]  # pieces read from a speculative queue: count, bytes
        self._lock = threading.Lock()

    def queue(
        self, extents: tuple[Extent, ...], speculative: bool, pieces: int | None = None
    ) -> None:
        pos, by_drive = 0, {}
        for e in extents:
            q = self.reader.queues[e.drive]
            for off, n in split(e.offset, e.nbytes):
                c = Chunk(q, off, n, pos + off - e.offset, self)
                self.chunks.append(c)
                by_drive.setdefault(e.drive, []).append(c)
            pos += e.nbytes
        self._left = len(self.chunks)
        if speculative and pieces is not None:
            for d, chunks in by_drive.items():
                if chunks[pieces:]:
                    self.waiting[d] = chunks[pieces:]
                    by_drive[d] = chunks[:pieces]
            if self.waiting:
                self.fut.add_done_callback(self._skip_waiting)
        for d, chunks in by_drive.items():
            if chunks:
                self.reader.queues[d].put(chunks, speculative)

    def promote(self) -> None:
        """The router chose this record: the rest of it is demand now."""
        with self._lock:
            waiting, self.waiting = self.waiting, {}
        by_queue: dict[int, list[Chunk]] = {}
        for c in self.chunks:
            by_queue.setdefault(c.queue.idx, []).append(c)
        for idx, chunks in by_queue.items():
            self.reader.queues[idx].promote(chunks)  # the not-yet-started queued pieces
        for idx, chunks in waiting.items():
            self.reader.queues[idx].put(chunks)

    def _skip_waiting(self, fut: Future[Any]) -> None:
        """A cancelled prefetch: its waiting pieces never go to a drive."""
        if not fut.cancelled():
            return
        with self._lock:
            waiting, self.waiting = self.waiting, {}
        for chunks in waiting.values():
            for c in chunks:
                c.taken = True
                self._landed()

    def run(self, chunk: Chunk) -> None:
        if not self.fut.cancelled() and self.error is None:
            try:
                with self._lock:
                    if self.buf is None:
                        self.buf = self.reader.buffers.get(align_up(self.rec.length))
                n = chunk.queue.read_into(
                    chunk, memoryview(self.buf)[chunk.pos : chunk.pos + chunk.size]
                )
                if chunk.speculative:
                    with self._lock:
                        self._speculative_read[0] += 1
                        self._speculative_read[1] += n
                if n < min(chunk.size, self.rec.length - chunk.pos):
                    raise CorruptExpertError(
                        f"expert {self.rec.expert} of layer {self.rec.layer}: short read on drive {chunk.queue.idx} ({n} of {chunk.size} bytes "
                        f"at offset {chunk.offset}); the pack {self.reader.paths[chunk.queue.idx]} is truncated — re-run setup"
                    )
            except OSError as e:
                self.error = CorruptExpertError(
                    f"expert {self.rec.expert} of layer {self.rec.layer}: read failed on drive {chunk.queue.idx} "
                    f"({self.reader.paths[chunk.queue.idx]}: {e.strerror})"
                )
            except BaseException as e:  # a short read (above) among them
                self.error = e
        self._landed()

    def abandon(self, chunk: Chunk) -> None:
        self.error = self.error or CorruptExpertError(
            f"expert {self.rec.expert} of layer {self.rec.layer}: the reader closed before it was read"
        )
        self._landed()

    def _landed(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left:
                return
        buf, reader, fut = self.buf, self.reader, self.fut
        # Let go of the buffer and the future holding it: a promoted prefetch's stale chunks stay in
        # the speculative deque (and future <-> read <-> chunks was a cycle), which kept landed
        # buffers mapped after their experts were gone (tests/bench/RESULTS.md).
        self.buf, self.chunks, self.fut = None, [], None
        fut.record = None
        wanted = fut.set_running_or_notify_cancel()  # False: cancelled, nobody wants the bytes
        if self._speculative_read[0]:
            reader.pieces.count(*self._speculative_read, kept=wanted)
        if not wanted:
            if buf is not None:
                reader.buffers.put(buf)
            return
        try:
            if self.error is not None:
                raise self.error
            reader.check(self.rec, buf)
            result = reader._convert(self.rec, buf, self.dtype) if self.dtype is not None else buf
        except BaseException as e:
            if buf is not None:
                reader.buffers.put(buf)
            fut.set_exception(e)
            return
        fut.set_result(result)
