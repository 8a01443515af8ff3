"""Resident weights moved into one region of transparent huge pages at open (Linux, THP not "never").

A decode token streams every resident weight once. Loaded tensor by tensor they sit in separate 4 KiB
pages, and a TLB miss every 4 KiB cost the demo ~10 % of a decode token (tests/bench/RESULTS.md). This
owns only where the bytes live: the caller says which tensors are resident; every tensor object, its
bytes, dtype, offset, size and stride stay as they were.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from deltafind.log import get_logger

log = get_logger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether the kernel gives transparent huge pages to a region advised for them."""
    try:
        return "[never]" not in THP_ENABLED.read_text()
    except OSError:  # not Linux, or no THP
        return False


def _madvise() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def move_to_huge_pages(tensors: Iterable[torch.Tensor], what: str) -> int:
    """Copy the distinct CPU storages behind `tensors` into one 2 MiB-aligned region advised for huge
    pages and point each tensor at its copy in place; an old storage is freed once its last tensor has
    moved (and nothing else holds it). Returns the bytes moved: 0 where huge pages are unavailable or
    the tensors are under one huge page. Run before anything records a tensor's address (the kernels'
    plans are made at the first forward)."""
    groups: dict[int, dict[int, torch.Tensor]] = {}  # storage -> its tensors, each once
    for t in tensors:
        if t.device.type == "cpu" and t.numel():
            groups.setdefault(t.untyped_storage().data_ptr(), {})[id(t)] = t
    sizes = {ptr: next(iter(ts.values())).untyped_storage().nbytes() for ptr, ts in groups.items()}
    total = sum(-(-n // 64) * 64 for n in sizes.values())
    if total < HUGE_PAGE or not huge_pages_available() or (madvise := _madvise()) is None:
        return 0
    t0 = time.perf_counter()
    arena = torch.empty(
        total + HUGE_PAGE, dtype=torch.uint8
    )  # not touched yet: no page is faulted in
    start = -arena.data_ptr() % HUGE_PAGE
    if madvise(arena.data_ptr() + start, total, MADV_HUGEPAGE) != 0:
        return 0
    storage, at = arena.untyped_storage(), start
    with torch.no_grad():
        for ptr, ts in groups.items():
            n = sizes[ptr]
            old = torch.empty(0, dtype=torch.uint8).set_(next(iter(ts.values())).untyped_storage())
            arena[at : at + n].copy_(old)
            del old
            for t in ts.values():  # the storage offset in elements: `at` is a multiple of 64 bytes
                size = t.element_size()
                # one made under inference mode moves in it; no_grad inside: inference_mode(False) turns
                # grad mode back on, and a Parameter that requires grad refuses set_ under it
                with torch.inference_mode(t.is_inference()), torch.no_grad():
                    t.set_(storage, at // size + t.storage_offset(), t.size(), t.stride())
            at += -(-n // 64) * 64
    log.info(
        "huge_pages",
        what=what,
        bytes=total,
        tensors=sum(map(len, groups.values())),
        seconds=round(time.perf_counter() - t0, 3),
    )
    return total
