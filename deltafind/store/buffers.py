"""The host side of a read: the page-aligned buffers records land in, the pool of widened tensors,
a record's tensors as views over its buffer, and the `Stager` contract that moves them onto the
compute device and hands the buffer back. No drives, queues or checksums: store/reader.py owns those.
"""

from __future__ import annotations

import mmap
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from deltafind.store.manifest import ExpertRecord, align_up


class Stager(Protocol):
    """Moves a read record's host tensors onto the compute device (implemented in `deltafind.device.staging`)."""

    device: torch.device

    def stage(
        self, views: Mapping[str, torch.Tensor], dtype: torch.dtype, release: Callable[[], None]
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """Device tensors (floats in `dtype`) and whether they alias the buffer; else `release` is called once it is free."""

    def drain(self) -> None:
        """Wait for every copy in flight and release their buffers."""


class BufferPool:
    """Page-aligned buffers, reused by size class (O_DIRECT needs alignment): anonymous mmaps, or
    whatever a subclass's `_new` allocates (device/staging.py's pinned pool)."""

    align = mmap.PAGESIZE

    def __init__(self, max_free_bytes: int = 1 << 30) -> None:
        self._free: dict[int, list[Any]] = defaultdict(list)
        self._free_bytes = 0
        self.max_free_bytes = max_free_bytes
        self.reused = self.allocated = 0
        self.allocated_bytes = 0  # held now, in use or free
        self._lock = threading.Lock()

    def get(self, size: int) -> Any:
        size = align_up(size, self.align)
        with self._lock:
            if self._free[size]:
                self._free_bytes -= size
                self.reused += 1
                return self._free[size].pop()
            self.allocated += 1
            self.allocated_bytes += size
        return self._new(size)

    def _new(self, size: int) -> Any:
        return mmap.mmap(-1, size)

    def put(self, buf: Any) -> None:
        with self._lock:
            if self._free_bytes + len(buf) <= self.max_free_bytes:
                self._free[len(buf)].append(buf)
                self._free_bytes += len(buf)
            else:
                self.allocated_bytes -= len(buf)


class TensorPool:
    """Widened expert tensors, reused by (shape, dtype): a fresh 19 MB tensor per read cost more
    in page faults (kernel time) than the widening itself (measured: RESULTS.md)."""

    def __init__(self, max_free_bytes: int) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = defaultdict(
            list
        )
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


def record_tensors(rec: ExpertRecord, buf: object) -> dict[str, torch.Tensor]:
    """Views of the record's tensors over `buf` (no copy)."""
    out = {}
    for t in rec.tensors:
        dtype = getattr(torch, t.dtype)
        count = t.nbytes // dtype.itemsize
        out[t.name] = (
            torch.frombuffer(buf, dtype=dtype, count=count, offset=t.offset).view(t.shape)
            if count
            else torch.empty(t.shape, dtype=dtype)
        )
    return out
