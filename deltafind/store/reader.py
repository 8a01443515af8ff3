"""Read expert records from the drives' pack files: one bounded read queue per drive.

A record (whole on one drive, or striped over several: manifest `stripes`) is
read as chunks on each drive's queue (store/drive_queue.py: queue depth from
config, demand before prefetch) into one page-aligned, reusable buffer.
`read_mode="direct"` (the default) reads with O_DIRECT; where that is refused
(macOS, tmpfs, some overlay filesystems) reads are buffered and the page cache
is dropped behind them (POSIX_FADV_DONTNEED / F_NOCACHE) — logged once per
drive, never silent. `"buffered"` reads through the page cache on purpose
([cache] read_mode, for stores that fit in RAM). An optional `read_mb_s` caps a
drive's rate with a token bucket to emulate slower drives in benchmarks and tests.

Every read is checked before it is used: `verify="fast"` (what the engine uses)
compares the record's xxh3_64 (~19 GB/s per core), or for records written
before xxh3 existed checks sha256 once and then trusts the xxh3 it computed
from those verified bytes; `"full"` (doctor, rebalance) checks sha256 and xxh3;
`"off"` only for raw-bandwidth benchmarks.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from deltafind.errors import CorruptExpertError, StoreError
from deltafind.log import get_logger
from deltafind.store.buffers import BufferPool, TensorPool, record_tensors
from deltafind.store.drive_queue import DriveQueue, DriveStats
from deltafind.store.manifest import (
    PACK_HEADER_BYTES,
    PACK_MAGIC,
    ExpertRecord,
    Manifest,
    align_up,
    pack_name,
)
from deltafind.store.record_read import ExpertRead, PieceStats, RecordRead

log = get_logger(__name__)


@dataclass(frozen=True)
class DriveOptions:
    path: Path | None = None  # None: the drive folder recorded in the store
    queue_depth: int = 8  # chunk reads in flight on this drive
    read_mb_s: float | None = None  # emulate a slower drive (benchmarks, tests)


Decoded = tuple[
    dict[str, torch.Tensor], Any, list[torch.Tensor]
]  # tensors, the buffer they view (or None), pooled widened tensors


class PackReader:
    """Open packs of one store; `submit(rec)` reads on the drives' queues, `read(rec)` waits for it.

    A record is read as 1 MiB chunks on every drive that holds a piece of it
    (store/drive_queue.py), into one buffer, then checked. A returned buffer holds
    the record payload at offset 0 (it may be longer, page-aligned). Pass it to
    `release` when its tensors are no longer used.
    """

    def __init__(
        self,
        manifest: Manifest,
        store_dir: Path,
        verify: bool | str = True,
        drives: list[DriveOptions] | None = None,
        read_mode: str = "direct",
        buffer_pool: Callable[[int], Any] | None = None,
    ) -> None:
        # verify: "full", "fast" or "off"; read_mode: [cache] read_mode, checked by the config schema
        self.verify = {True: "full", False: "off"}.get(verify, verify)  # type: ignore[call-overload]
        self.read_mode = read_mode
        self.remote: Any = None  # RemoteExperts of a streaming install (store/remote_experts.py)
        self._learned: dict[
            tuple[int, int], str
        ] = {}  # xxh3 of sha256-verified bytes, for records without one
        recorded = manifest.drive_paths(store_dir)
        opts = drives or []
        if opts and len(opts) != len(recorded):
            raise StoreError(
                f"{store_dir}: the config lists {len(opts)} drive(s) but the store was striped over {len(recorded)}: list all {len(recorded)} in [[drives]], in the store's order ({', '.join(map(str, recorded))})"
            )
        self.options = [opts[i] if i < len(opts) else DriveOptions() for i in range(len(recorded))]
        self.paths = [
            (o.path or d) / pack_name(i, manifest.pack_generation)
            for i, (o, d) in enumerate(zip(self.options, recorded, strict=True))
        ]
        # One buffer per record a drive can have in flight, reused: fresh mmaps cost their page
        # faults on every read (measured: twice the CPU per token with two spares per drive). The
        # expert cache counts these bytes against its budget (StoreExperts).
        max_record = max((align_up(r.length) for r in manifest.experts), default=0)
        self.buffers = (buffer_pool or BufferPool)(
            max_record * sum(o.queue_depth for o in self.options)
        )
        self.widened = TensorPool(
            max_record * 4 * len(self.options)
        )  # about two bf16 -> fp32 experts per drive
        self._fds: list[int] = []
        self.direct: list[bool] = []
        self.queues: list[DriveQueue] = []
        self.pieces = (
            PieceStats()
        )  # a prefetch's pieces read before the router chose: kept or dropped
        for idx, path in enumerate(self.paths):
            try:
                self._open(idx, path, manifest.store_id, read_mode)
            except BaseException:
                self.close()
                raise
        from deltafind.store.remote_experts import RemoteExperts

        if manifest.source.get("remote"):  # a streaming install: missing records come from the hub
            self.remote = RemoteExperts(Path(store_dir), manifest, self.paths, record_tensors)
        self.problems: dict[int, str] = (
            {} if self.remote is not None else self._short_packs(manifest)
        )
        self._decoder = ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="decode"
        )  # confirmed prefetches

    def _short_packs(self, manifest: Manifest) -> dict[int, str]:
        """Each drive whose pack ends before the manifest's last record on it (a copy cut short, a full disk):
        the store still serves what it can read; the drive is reported unhealthy, naming the pack."""
        ends = [0] * len(self.paths)
        for rec in manifest.experts:
            for ex in rec.extents():
                ends[ex.drive] = max(ends[ex.drive], ex.offset + ex.nbytes)
        out = {}
        for idx, (fd, path, end) in enumerate(zip(self._fds, self.paths, ends, strict=True)):
            size = os.fstat(fd).st_size
            if size < end:
                out[idx] = (
                    f"drive {idx}: {path} is truncated: {size} bytes, but the manifest places records up to byte "
                    f"{end}; records past its end cannot be read: restore the pack, or re-run setup to rewrite it"
                )
                log.error(
                    "pack_truncated", drive=idx, path=str(path), bytes=size, expected_bytes=end
                )
        return out

    def _open(self, idx: int, path: Path, store_id: str, read_mode: str) -> None:
        if not path.parent.is_dir():
            raise StoreError(
                f"drive {idx} ({path.parent}) is missing: mount it, or fix the store's drive list in [[drives]]"
            )
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise StoreError(
                f"drive {idx}: cannot open {path} ({e.strerror}); is the drive mounted and readable?"
            ) from e
        head = os.pread(fd, PACK_HEADER_BYTES, 0).rstrip(b"\0")
        try:
            meta = json.loads(head)
        except json.JSONDecodeError:
            meta = {}
        if (
            meta.get("magic") != PACK_MAGIC
            or meta.get("store_id") != store_id
            or meta.get("drive") != idx
        ):
            os.close(fd)
            raise StoreError(
                f"drive {idx}: {path} is not this store's pack (drive order changed, or a different store's drive?)"
            )
        direct = read_mode == "direct"
        use_direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                os.close(fd)
                fd, use_direct = dfd, True
            except OSError as e:
                log.warning(
                    "o_direct_unavailable",
                    drive=idx,
                    path=str(path),
                    error=e.strerror,
                    fallback="buffered+fadvise_dontneed",
                )
        elif direct and sys.platform == "darwin":
            import fcntl

            fcntl.fcntl(fd, 48, 1)  # F_NOCACHE: the macOS way to keep reads out of the cache
            log.info("o_direct_unavailable", drive=idx, path=str(path), fallback="F_NOCACHE")
        elif direct:
            log.warning("o_direct_unavailable", drive=idx, path=str(path), fallback="buffered")
        self._fds.append(fd)
        self.direct.append(use_direct)
        drop_behind = (
            direct and not use_direct and hasattr(os, "posix_fadvise")
        )  # "direct" asked: keep the page cache out
        o = self.options[idx]
        self.queues.append(DriveQueue(idx, fd, o.queue_depth, o.read_mb_s, drop_behind))

    @property
    def stats(self) -> list[DriveStats]:
        return [q.stats for q in self.queues]

    def submit(
        self, rec: ExpertRecord, speculative: bool = False, pieces: int | None = None
    ) -> Future[Any]:
        """Read `rec` (a buffer holding it at offset 0). `speculative`: a prefetch, queued behind demand
        reads; `pieces`: of a prefetch, only the first that many pieces per drive go to the drives
        until `promote` (store/record_read.py)."""
        return self._start(rec, speculative, None, pieces)

    def submit_decoded(self, rec: ExpertRecord, dtype: torch.dtype) -> Future[Decoded]:
        """Read, check and convert float tensors to `dtype` on the drive's thread (host compute).

        The widening then overlaps with the caller's compute instead of adding to it.
        Returns the tensors and the buffer they still view (None once it went back to the pool).
        """
        return self._start(rec, False, dtype)

    def promote(self, read: Future[Any]) -> None:
        """A speculative read is now needed: its chunks not yet started go with the demand reads."""
        if isinstance(read, ExpertRead) and read.record is not None:
            read.record.promote()

    def _start(
        self,
        rec: ExpertRecord,
        speculative: bool,
        dtype: torch.dtype | None,
        pieces: int | None = None,
    ) -> Future[Any]:
        fut = ExpertRead()
        remote = self.remote
        if remote is None or rec.key in remote.present:
            self._queue(
                remote.present[rec.key] if remote is not None else rec,
                fut,
                speculative,
                dtype,
                pieces,
            )
            return fut
        fetched = remote.submit([rec.key])[rec.key]  # fetched and written into its place first

        def landed(f: Future[ExpertRecord]) -> None:
            if f.exception() is not None:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(f.exception())  # type: ignore[arg-type]
                return
            try:
                self._queue(f.result(), fut, speculative, dtype, pieces)
            except BaseException as e:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(e)

        fetched.add_done_callback(landed)
        return fut

    def _queue(
        self,
        rec: ExpertRecord,
        fut: ExpertRead,
        speculative: bool,
        dtype: torch.dtype | None,
        pieces: int | None,
    ) -> None:
        extents = rec.extents()
        if any(e.drive >= len(self.queues) for e in extents):
            raise CorruptExpertError(
                f"expert {rec.expert} of layer {rec.layer}: drive {max(e.drive for e in extents)} is closed or unknown"
            )
        read = RecordRead(self, rec, fut, dtype)
        fut.record = read
        read.queue(extents, speculative, pieces)

    def decode_when_read(
        self, rec: ExpertRecord, read: Future[Any], dtype: torch.dtype
    ) -> Future[Decoded]:
        """Convert an already-submitted read (a prefetch the router confirmed) off the caller's
        thread, once it lands; no decode thread waits on a read meanwhile."""
        out: Future[Decoded] = Future()

        # `read` reaches these as an argument, never from the closure: a closure over it, held by
        # its own callbacks, was a cycle that kept its buffer mapped until the cyclic GC ran.
        def convert(done: Future[Any]) -> None:
            if not out.set_running_or_notify_cancel():  # the caller gave up on it
                if not done.cancelled() and done.exception() is None:
                    self.buffers.put(done.result())
                return
            try:
                out.set_result(self._convert(rec, done.result(), dtype))
            except BaseException as e:  # a read error or a cancelled read reaches the caller
                out.set_exception(e)

        def landed(done: Future[Any]) -> None:
            try:
                self._decoder.submit(convert, done)
            except RuntimeError:  # closing: convert here rather than leave the caller waiting
                convert(done)

        self.promote(read)
        read.add_done_callback(landed)
        return out

    def _convert(self, rec: ExpertRecord, buf: Any, dtype: torch.dtype) -> Decoded:
        """The record's tensors in `dtype` (floats; packed formats as stored), the buffer they
        still view (None: it went back to the pool), and the widened tensors, which come from
        `widened` and go back there (`put_all`) when the expert is dropped."""
        views = record_tensors(rec, buf)
        tensors, pooled = {}, []
        for n, t in views.items():
            if t.is_floating_point() and t.dtype != dtype:
                tensors[n] = self.widened.get(tuple(t.shape), dtype).copy_(t)
                pooled.append(tensors[n])
            else:
                tensors[n] = t
        if len(pooled) < len(tensors):
            return tensors, buf, pooled
        self.buffers.put(buf)
        return tensors, None, pooled

    def read(self, rec: ExpertRecord) -> Any:
        return self.submit(rec).result()

    def release(self, buf: Any) -> None:
        self.buffers.put(buf)

    def check(self, rec: ExpertRecord, buf: Any) -> None:
        """Raise CorruptExpertError unless the landed bytes are the record's."""
        if not self._intact(rec, memoryview(buf)[: rec.length]):
            drives = sorted({e.drive for e in rec.extents()})
            where = ", ".join(f"{self.paths[d]}" for d in drives)
            raise CorruptExpertError(
                f"expert {rec.expert} of layer {rec.layer}: checksum mismatch in {where} at offset {rec.offset}"
                f"{' (striped over drives ' + ', '.join(map(str, drives)) + ')' if len(drives) > 1 else ''}; "
                "the drive returned corrupt data — run `deltafind doctor` and re-import the store"
            )

    def _intact(self, rec: ExpertRecord, data: memoryview) -> bool:
        if self.verify == "off":
            return True
        fast = rec.xxh3 or self._learned.get(rec.key)
        if self.verify == "fast" and fast is not None:
            return xxhash.xxh3_64_hexdigest(data) == fast
        if hashlib.sha256(data).hexdigest() != rec.sha256:
            return False
        digest = xxhash.xxh3_64_hexdigest(data)
        if rec.xxh3 is None:
            self._learned[rec.key] = digest  # verified by sha256: later reads of it check this
            return True
        return digest == rec.xxh3

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes for s in self.stats)

    def io_stats(self) -> dict[str, Any]:
        """Per drive: reads (chunks), sizes, queue depth, idle gaps; buffer reuse; the read mode."""
        pool = self.buffers
        return {
            "read_mode": self.read_mode,
            "o_direct": self.direct,
            "drives": [s.as_dict() for s in self.stats],
            "buffers_reused": getattr(pool, "reused", None),
            "buffers_allocated": getattr(pool, "allocated", None),
            "prefetch_pieces": self.pieces.as_dict(),
        }

    def close(self) -> None:
        for q in getattr(self, "queues", []):
            q.close()
        if hasattr(self, "_decoder"):
            self._decoder.shutdown(wait=True, cancel_futures=True)
        if self.remote is not None:
            self.remote.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
