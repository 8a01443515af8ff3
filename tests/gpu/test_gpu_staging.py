"""CUDA staging: pinned read buffers, copies on the dedicated stream, buffers back only after the copy."""

from __future__ import annotations

from pathlib import Path

import torch

from deltafind.device.staging import CudaStager, PinnedBufferPool, make_stager, read_buffer_pool
from deltafind.store.experts import StoreExperts
from deltafind.store.manifest import Manifest


def test_pinned_pool_buffers_are_pinned_and_aligned(cuda: torch.device) -> None:
    pool = PinnedBufferPool(1 << 24)
    buf = pool.get(10_000)
    assert buf.ctypes.data % 4096 == 0 and len(buf) == 12_288
    assert torch.frombuffer(buf, dtype=torch.uint8).is_pinned()


def test_stage_copies_on_its_own_stream_and_releases_after_the_copy(cuda: torch.device) -> None:
    stager = CudaStager(cuda, timing=True)
    assert stager.stream != torch.cuda.current_stream(cuda)
    pool = PinnedBufferPool(1 << 28)
    buf = pool.get(64 << 20)
    host = torch.frombuffer(buf, dtype=torch.uint8)
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
    released: list[int] = []
    views = {"a": host[: 32 << 20], "b": host[32 << 20 :].view(torch.float32)}
    out, aliased = stager.stage(views, torch.float32, lambda: released.append(1))
    assert not aliased and all(t.device == cuda for t in out.values())
    # the compute stream waits for the copy: this comparison is queued after it
    assert torch.equal(out["a"].cpu(), views["a"])
    assert torch.equal(
        out["b"].cpu().view(torch.uint8), views["b"].view(torch.uint8)
    )  # random bits: NaNs compare as bytes
    stager.drain()
    assert released == [1]
    assert stager.stats.copies == 1 and stager.stats.bytes == 64 << 20 and stager.stats.copy_s > 0


def test_store_experts_on_cuda_read_into_pinned_buffers(cuda: torch.device, k3_store: Path) -> None:
    experts = StoreExperts(
        Manifest.load(k3_store),
        k3_store,
        expert_bytes=0,
        stager=make_stager(cuda),
        buffer_pool=read_buffer_pool(cuda),
    )
    try:
        assert isinstance(experts.stager, CudaStager)
        assert isinstance(experts.reader.buffers, PinnedBufferPool)
        layer = next(r.layer for r in experts.manifest.experts if r.layer > 0)
        got = dict(experts.fetch(layer, [0, 1, 2]))
        ref = StoreExperts(
            Manifest.load(k3_store),
            k3_store,
            expert_bytes=0,
            stager=make_stager(torch.device("cpu")),
        )
        want = dict(ref.fetch(layer, [0, 1, 2]))
        ref.close()
        for e, ex in got.items():
            for name, t in ex.tensors.items():
                assert t.device == cuda and torch.equal(t.cpu(), want[e][name])
    finally:
        experts.close()


def test_make_stager_gives_cuda_a_pinned_reader_pool(cuda: torch.device, k3_store: Path) -> None:
    from deltafind.store.reader import PackReader

    reader = PackReader(Manifest.load(k3_store), k3_store, buffer_pool=read_buffer_pool(cuda))
    try:
        assert isinstance(make_stager(cuda), CudaStager)
        assert isinstance(reader.buffers, PinnedBufferPool)
    finally:
        reader.close()
