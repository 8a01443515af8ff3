"""Move expert records from the drive reader's buffers onto the compute device.

CPU: the tensors stay views over the read buffer (floats take the compute dtype).
CUDA: drive reads land in page-aligned *pinned* host buffers (`PinnedBufferPool`
is the reader's pool), each record is copied with `non_blocking=True` on a
dedicated copy stream, an event orders the compute stream's first use after the
copy, and the host buffer goes back to the reader only once that event has
completed. MPS (no pinned memory): a plain blocking copy. Implements the store's
`Stager` contract (store/buffers.py); the store never imports this package.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltafind.log import get_logger
from deltafind.store.buffers import BufferPool, Stager

log = get_logger(__name__)
ALIGN = 4096  # O_DIRECT needs page-aligned buffers


@dataclass
class StagingStats:
    copies: int = 0  # records moved to the device
    bytes: int = 0
    copy_s: float = (
        0.0  # time the copies took (CUDA: event-timed on the copy stream, when timing is on)
    )


def _convert(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if t.is_floating_point() else t.dtype


class HostStager:
    """CPU compute: no copy unless the dtype changes; the tensors may be views over the read buffer."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.stats = StagingStats()

    def stage(
        self, views: Mapping[str, torch.Tensor], dtype: torch.dtype, release: Callable[[], None]
    ) -> tuple[dict[str, torch.Tensor], bool]:
        tensors = {n: t.to(dtype=_convert(t, dtype)) for n, t in views.items()}
        aliased = any(
            t.data_ptr() == v.data_ptr()
            for t, v in zip(tensors.values(), views.values(), strict=True)
        )
        if not aliased:
            release()
        return tensors, aliased

    def drain(self) -> None:
        pass


class SyncStager:
    """MPS (or any device without pinned memory): blocking copies, then the buffer is free."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stats = StagingStats()

    def stage(
        self, views: Mapping[str, torch.Tensor], dtype: torch.dtype, release: Callable[[], None]
    ) -> tuple[dict[str, torch.Tensor], bool]:
        t0 = time.perf_counter()
        # non_blocking=False: the copy no longer needs the host memory when .to returns; copy=True so
        # the result never aliases the buffer, whatever the device (the CPU too, as tests run it)
        tensors = {
            n: t.to(device=self.device, dtype=_convert(t, dtype), copy=True)
            for n, t in views.items()
        }
        self.stats.copy_s += time.perf_counter() - t0
        self.stats.copies += 1
        self.stats.bytes += sum(v.numel() * v.element_size() for v in views.values())
        release()
        return tensors, False

    def drain(self) -> None:
        pass


class CudaStager:
    """Asynchronous host-to-device copies on a dedicated stream, ordered by events.

    The compute stream waits (on the GPU, not the host) for a record's copy before
    anything queued after `stage` runs, so the copy of expert N+1 overlaps the
    compute of expert N. Device tensors are allocated on the copy stream and marked
    as used by the compute stream, so the caching allocator never reuses their
    memory while either stream still needs it.
    """

    def __init__(self, device: torch.device, timing: bool = False) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.timing = timing
        self.stats = StagingStats()
        # (start event or None, done event, release) in copy-stream order
        self._pending: deque[tuple[Any, Any, Callable[[], None]]] = deque()
        self._lock = threading.Lock()

    def stage(
        self, views: Mapping[str, torch.Tensor], dtype: torch.dtype, release: Callable[[], None]
    ) -> tuple[dict[str, torch.Tensor], bool]:
        self._reap(block=False)
        compute = torch.cuda.current_stream(self.device)
        start = torch.cuda.Event(enable_timing=True) if self.timing else None
        done = torch.cuda.Event(enable_timing=self.timing)
        out: dict[str, torch.Tensor] = {}
        try:
            with torch.cuda.stream(self.stream):
                if start is not None:
                    start.record(self.stream)
                for n, t in views.items():
                    d = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                    d.copy_(t, non_blocking=True)  # DMA from the pinned read buffer
                    if d.is_floating_point() and d.dtype != dtype:
                        d = d.to(dtype)  # widen on the device, still on the copy stream
                    out[n] = d
                done.record(self.stream)
        except BaseException:
            # (an OOM, say) copies already queued may still read the buffer: return it only after them
            try:
                done.record(self.stream)
                with self._lock:
                    self._pending.append((None, done, release))
            except RuntimeError:
                pass  # the device itself is broken: drop the buffer rather than reuse it
            raise
        compute.wait_event(done)
        for d in out.values():
            d.record_stream(compute)
        with self._lock:
            self._pending.append((start, done, release))
            self.stats.copies += 1
            self.stats.bytes += sum(v.numel() * v.element_size() for v in views.values())
        return out, False

    def _reap(self, block: bool) -> None:
        """Release the buffers of completed copies (all of them, waiting, when `block`)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                start, done, release = self._pending[0]
                if not block and not done.query():
                    return
                self._pending.popleft()
            done.synchronize()
            if start is not None:
                self.stats.copy_s += start.elapsed_time(done) / 1e3
            release()

    def drain(self) -> None:
        self._reap(block=True)


class PinnedBufferPool(BufferPool):
    """Page-aligned pinned host buffers, reused by size class: the reader's pool on CUDA.

    The reader's pool (store/buffers.py) allocating elsewhere: a buffer is a uint8 numpy
    array over pinned memory, so `preadv`, `torch.frombuffer` and sha256 read it in place,
    and the GPU copies it by DMA with no staging memcpy.
    """

    align = ALIGN

    def __init__(self, max_free_bytes: int = 1 << 30, pin: bool = True) -> None:
        super().__init__(max_free_bytes)
        self.pin = pin

    def _new(self, size: int) -> np.ndarray:
        raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=self.pin)
        skip = -raw.data_ptr() % ALIGN
        return raw.numpy()[skip : skip + size]  # keeps `raw` alive through .base


def make_stager(device: torch.device) -> Stager:
    """The stager for `device` (the store's expert reader takes it; see `read_buffer_pool`)."""
    if device.type == "cpu":
        return HostStager()
    return CudaStager(device) if device.type == "cuda" else SyncStager(device)


def read_buffer_pool(device: torch.device) -> type[PinnedBufferPool] | None:
    """The read buffers `device` wants: pinned on CUDA (its copies DMA from them); None: the reader's own."""
    if device.type != "cuda":
        return None
    log.info("pinned_read_buffers", device=str(device))
    return PinnedBufferPool
