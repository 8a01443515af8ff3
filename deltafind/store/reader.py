"""Read expert records from the drives' pack files: one bounded I/O pool per drive.

Each drive gets its own threads (queue depth from config) doing positional
reads with O_DIRECT into page-aligned, reusable buffers; where O_DIRECT is not
available (macOS, tmpfs, some overlay filesystems) reads are buffered and the
page cache is dropped behind them (POSIX_FADV_DONTNEED / F_NOCACHE) — logged
once per drive, never silent. An optional `read_mb_s` caps a drive's rate with
a token bucket to emulate slower drives in benchmarks and tests.

Every read is checked before it is used: `verify="fast"` (what the engine uses)
compares the record's xxh3_64 (~19 GB/s per core), or for records written
before xxh3 existed checks sha256 once and then trusts the xxh3 it computed
from those verified bytes; `"full"` (doctor, rebalance) checks sha256 and xxh3;
`"off"` only for raw-bandwidth benchmarks.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from deltafind.errors import CorruptExpertError, StoreError
from deltafind.log import get_logger
from deltafind.store.manifest import (
    PACK_HEADER_BYTES,
    PACK_MAGIC,
    ExpertRecord,
    Manifest,
    align_up,
    pack_name,
)

log = get_logger(__name__)
VERIFY_MODES = ("full", "fast", "off")


@dataclass(frozen=True)
class DriveOptions:
    path: Path | None = None  # None: the drive folder recorded in the store
    queue_depth: int = 8
    read_mb_s: float | None = None  # emulate a slower drive (benchmarks, tests)


@dataclass
class DriveStats:
    reads: int = 0
    bytes: int = 0
    busy_s: float = 0.0  # summed read latency (overlapping reads count each)
    first_t: float = 0.0
    last_t: float = 0.0

    @property
    def gb_s(self) -> float:
        span = self.last_t - self.first_t
        return self.bytes / span / 1e9 if span > 0 else 0.0


class BufferPool:
    """Page-aligned anonymous mmaps, reused by size class (O_DIRECT needs alignment)."""

    def __init__(self, max_free_bytes: int = 1 << 30) -> None:
        self._free: dict[int, list[mmap.mmap]] = defaultdict(list)
        self._free_bytes = 0
        self.max_free_bytes = max_free_bytes
        self._lock = threading.Lock()

    def get(self, size: int) -> mmap.mmap:
        size = align_up(size, mmap.PAGESIZE)
        with self._lock:
            if self._free[size]:
                self._free_bytes -= size
                return self._free[size].pop()
        return mmap.mmap(-1, size)

    def put(self, buf: mmap.mmap) -> None:
        with self._lock:
            if self._free_bytes + len(buf) <= self.max_free_bytes:
                self._free[len(buf)].append(buf)
                self._free_bytes += len(buf)


class TensorPool:
    """Widened expert tensors, reused by (shape, dtype): a fresh 19 MB tensor per read cost more
    in page faults (kernel time) than the widening itself (measured: RESULTS.md)."""

    def __init__(self, max_free_bytes: int) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self._free_bytes = 0
        self.max_free_bytes = max_free_bytes
        self._lock = threading.Lock()

    def get(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            free = self._free.get((tuple(shape), dtype))
            if free:
                t = free.pop()
                self._free_bytes -= t.numel() * t.element_size()
                return t
        return torch.empty(shape, dtype=dtype)

    def put_all(self, tensors: list[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                n = t.numel() * t.element_size()
                if self._free_bytes + n <= self.max_free_bytes:
                    self._free[(tuple(t.shape), t.dtype)].append(t)
                    self._free_bytes += n


class _TokenBucket:
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


class PackReader:
    """Open packs of one store; `submit(rec)` reads on that drive's pool, `read(rec)` waits for it.

    A returned buffer holds the record payload at offset 0 (it may be longer,
    page-aligned). Pass it to `release` when its tensors are no longer used.
    """

    def __init__(self, manifest: Manifest, store_dir: Path, verify: bool | str = True, drives: list[DriveOptions] | None = None, direct: bool = True,
                 buffer_pool: Callable[[int], Any] | None = None) -> None:
        self.verify = {True: "full", False: "off"}.get(verify, verify)  # type: ignore[call-overload]
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)} (got {verify!r})")
        self.remote: Any = None  # RemoteExperts of a streaming install (store/remote_experts.py)
        self._learned: dict[tuple[int, int], str] = {}  # xxh3 of sha256-verified bytes, for records without one
        recorded = manifest.drive_paths(store_dir)
        opts = drives or []
        if opts and len(opts) != len(recorded):
            raise StoreError(f"{store_dir}: the config lists {len(opts)} drive(s) but the store was striped over {len(recorded)}: list all {len(recorded)} in [[drives]], in the store's order ({', '.join(map(str, recorded))})")
        self.options = [opts[i] if i < len(opts) else DriveOptions() for i in range(len(recorded))]
        self.paths = [(o.path or d) / pack_name(i, manifest.pack_generation) for i, (o, d) in enumerate(zip(self.options, recorded, strict=True))]
        # One buffer per read slot, reused: fresh mmaps cost their page faults on every read
        # (measured: twice the CPU per token with two spares per drive). The expert cache
        # counts these bytes against its budget (StoreExperts).
        max_record = max((align_up(r.length) for r in manifest.experts), default=0)
        self.buffers = (buffer_pool or BufferPool)(max_record * sum(o.queue_depth for o in self.options))
        self.widened = TensorPool(max_record * 4 * len(self.options))  # about two bf16 -> fp32 experts per drive
        self.stats = [DriveStats() for _ in self.paths]
        self._fds: list[int] = []
        self.direct: list[bool] = []
        self._buckets = [_TokenBucket(o.read_mb_s) if o.read_mb_s else None for o in self.options]
        self._lock = threading.Lock()
        for idx, path in enumerate(self.paths):
            try:
                self._open(idx, path, manifest.store_id, direct)
            except BaseException:
                self.close()
                raise
        from deltafind.store.remote_experts import open_remote

        self.remote = open_remote(manifest, store_dir, self.paths, record_tensors)  # a streaming install: missing records come from the hub
        self._pools = [ThreadPoolExecutor(max_workers=o.queue_depth, thread_name_prefix=f"drive{i}") for i, o in enumerate(self.options)]
        self._decoder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="decode")  # confirmed prefetches

    def _open(self, idx: int, path: Path, store_id: str, direct: bool) -> None:
        if not path.parent.is_dir():
            raise StoreError(f"drive {idx} ({path.parent}) is missing: mount it, or fix the store's drive list in [[drives]]")
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise StoreError(f"drive {idx}: cannot open {path} ({e.strerror}); is the drive mounted and readable?") from e
        head = os.pread(fd, PACK_HEADER_BYTES, 0).rstrip(b"\0")
        try:
            meta = json.loads(head)
        except json.JSONDecodeError:
            meta = {}
        if meta.get("magic") != PACK_MAGIC or meta.get("store_id") != store_id or meta.get("drive") != idx:
            os.close(fd)
            raise StoreError(f"drive {idx}: {path} is not this store's pack (drive order changed, or a different store's drive?)")
        use_direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                os.close(fd)
                fd, use_direct = dfd, True
            except OSError as e:
                log.warning("o_direct_unavailable", drive=idx, path=str(path), error=e.strerror, fallback="buffered+fadvise_dontneed")
        elif direct and sys.platform == "darwin":
            import fcntl

            fcntl.fcntl(fd, 48, 1)  # F_NOCACHE: the macOS way to keep reads out of the cache
            log.info("o_direct_unavailable", drive=idx, path=str(path), fallback="F_NOCACHE")
        elif direct:
            log.warning("o_direct_unavailable", drive=idx, path=str(path), fallback="buffered")
        self._fds.append(fd)
        self.direct.append(use_direct)

    def submit(self, rec: ExpertRecord) -> Future[mmap.mmap]:
        return self._pools[rec.drive].submit(self._read, rec)

    def submit_decoded(self, rec: ExpertRecord, dtype: torch.dtype) -> Future[tuple[dict[str, torch.Tensor], mmap.mmap | None, list[torch.Tensor]]]:
        """Read, check and convert float tensors to `dtype` on the drive's thread (host compute).

        The widening then overlaps with the caller's compute instead of adding to it.
        Returns the tensors and the buffer they still view (None once it went back to the pool).
        """
        return self._pools[rec.drive].submit(self._read_decoded, rec, dtype)

    def decode_when_read(self, rec: ExpertRecord, read: Future[mmap.mmap], dtype: torch.dtype) -> Future[tuple[dict[str, torch.Tensor], mmap.mmap | None, list[torch.Tensor]]]:
        """Convert an already-submitted read (a prefetch the router confirmed) off the caller's
        thread, once it lands; no decode thread waits on a read meanwhile."""
        out: Future[tuple[dict[str, torch.Tensor], mmap.mmap | None, list[torch.Tensor]]] = Future()

        def convert() -> None:
            if not out.set_running_or_notify_cancel():  # the caller gave up on it
                if not read.cancelled() and read.exception() is None:
                    self.buffers.put(read.result())
                return
            try:
                out.set_result(self._convert(rec, read.result(), dtype))
            except BaseException as e:  # a read error or a cancelled read reaches the caller
                out.set_exception(e)

        def landed(_read: Future[mmap.mmap]) -> None:
            try:
                self._decoder.submit(convert)
            except RuntimeError:  # closing: convert here rather than leave the caller waiting
                convert()

        read.add_done_callback(landed)
        return out

    def _read_decoded(self, rec: ExpertRecord, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], mmap.mmap | None, list[torch.Tensor]]:
        return self._convert(rec, self._read(rec), dtype)

    def _convert(self, rec: ExpertRecord, buf: mmap.mmap, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], mmap.mmap | None, list[torch.Tensor]]:
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

    def read(self, rec: ExpertRecord) -> mmap.mmap:
        return self.submit(rec).result()

    def release(self, buf: mmap.mmap) -> None:
        self.buffers.put(buf)

    def _read(self, rec: ExpertRecord) -> mmap.mmap:
        if self.remote is not None:
            rec = self.remote.ensure(rec)  # fetched and written into its place first, if it is not there yet
        where = f"expert {rec.expert} of layer {rec.layer}"
        if rec.drive >= len(self._fds):
            raise CorruptExpertError(f"{where}: drive {rec.drive} is closed or unknown")
        size = align_up(rec.length)
        buf = self.buffers.get(size)
        bucket = self._buckets[rec.drive]
        slot_end = bucket.reserve(size) if bucket else 0.0
        t0 = time.perf_counter()
        try:
            n = os.preadv(self._fds[rec.drive], [memoryview(buf)[:size]], rec.offset)
            if not self.direct[rec.drive] and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._fds[rec.drive], rec.offset, size, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            self.buffers.put(buf)
            raise CorruptExpertError(f"{where}: read failed on drive {rec.drive} ({self.paths[rec.drive]}: {e.strerror})") from e
        if slot_end:
            time.sleep(max(0.0, slot_end - time.perf_counter()))
        t1 = time.perf_counter()
        if n < rec.length:
            self.buffers.put(buf)
            raise CorruptExpertError(f"{where}: short read on drive {rec.drive} ({n} of {rec.length} bytes); the pack {self.paths[rec.drive]} is truncated — re-run setup")
        if not self._intact(rec, memoryview(buf)[: rec.length]):
            self.buffers.put(buf)
            raise CorruptExpertError(
                f"{where}: checksum mismatch in {self.paths[rec.drive]} at offset {rec.offset}; "
                "the drive returned corrupt data — run `deltafind doctor` and re-import the store"
            )
        with self._lock:
            s = self.stats[rec.drive]
            s.reads += 1
            s.bytes += rec.length
            s.busy_s += t1 - t0
            s.first_t = s.first_t or t0
            s.last_t = t1
        return buf

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

    def close(self) -> None:
        for pool in [*getattr(self, "_pools", []), *([self._decoder] if hasattr(self, "_decoder") else [])]:
            pool.shutdown(wait=True, cancel_futures=True)
        if self.remote is not None:
            self.remote.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def record_tensors(rec: ExpertRecord, buf: object) -> dict[str, torch.Tensor]:
    """Views of the record's tensors over `buf` (no copy)."""
    out = {}
    for t in rec.tensors:
        dtype = getattr(torch, t.dtype)
        count = t.nbytes // torch.empty(0, dtype=dtype).element_size()
        out[t.name] = torch.frombuffer(buf, dtype=dtype, count=count, offset=t.offset).view(t.shape) if count else torch.empty(t.shape, dtype=dtype)
    return out
