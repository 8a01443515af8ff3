"""Resident weights moved into transparent huge pages (store/huge_pages.py), checked against the kernel's
own account of the process's memory (/proc/self/smaps)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltafind.store.huge_pages import HUGE_PAGE, huge_pages_available, move_to_huge_pages

pytestmark = pytest.mark.skipif(
    not huge_pages_available(), reason="no transparent huge pages (not Linux, or THP is never)"
)


def _huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_tensors_move_in_place_to_huge_pages_with_their_values_views_and_dtypes() -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(1024, 1024, generator=g), requires_grad=False)
    blocks = torch.randint(0, 255, (3000, 612), dtype=torch.uint8, generator=g)
    half = torch.randn(700, 576, generator=g).to(torch.bfloat16)
    record = torch.randn(4096, generator=g)
    gate, up = record[:2048].view(32, 64), record[2048:].view(32, 64)  # two views of one storage
    tensors = [weight, blocks, half, gate, up]
    before = [t.clone() for t in tensors]
    old_ptrs = [t.data_ptr() for t in tensors]
    storages = sum(t.untyped_storage().nbytes() for t in (weight, blocks, half, record))

    moved = move_to_huge_pages([*tensors, weight], "test")  # a tensor listed twice moves once

    assert storages <= moved < storages + 4 * 64
    assert all(
        torch.equal(t, b) and t.dtype == b.dtype for t, b in zip(tensors, before, strict=True)
    )
    assert all(t.data_ptr() != p for t, p in zip(tensors, old_ptrs, strict=True))
    assert isinstance(weight, torch.nn.Parameter) and not weight.requires_grad
    assert up.data_ptr() - gate.data_ptr() == 2048 * 4  # still views of one record, side by side
    assert all(t.data_ptr() % 64 == 0 for t in (weight, blocks, half, gate))
    assert (
        _huge_kib_at(weight.data_ptr()) >= HUGE_PAGE // 1024
    )  # the kernel backs it with huge pages


def test_small_or_foreign_tensors_stay_where_they_are() -> None:
    small = torch.randn(1000)
    meta = torch.empty(4096, 1024, device="meta")
    ptr = small.data_ptr()
    assert move_to_huge_pages([small, meta], "test") == 0 and small.data_ptr() == ptr


@pytest.mark.parametrize("made_in_inference", [False, True])
@pytest.mark.parametrize("moved_in_inference", [False, True])
def test_tensors_made_or_moved_under_inference_mode_move_too(
    made_in_inference: bool, moved_in_inference: bool
) -> None:
    """Model.open may run inside torch.inference_mode (or its tensors may come from it): set_ on an
    inference tensor outside it is refused by torch, so each tensor moves in its own mode."""
    with torch.inference_mode(made_in_inference):
        t = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(1))
    norm = torch.nn.Parameter(torch.ones(1024 * 1024))  # requires grad, as an RMSNorm's weight does
    want = t.clone()
    with torch.inference_mode(moved_in_inference):
        assert move_to_huge_pages([t, norm], "test") >= t.numel() * 8
    assert torch.equal(t, want) and t.is_inference() == made_in_inference
    assert norm.requires_grad and bool((norm == 1).all())
