"""Drive scheduling and striping: output never depends on placement, stripes, drive count, read
caps, queue depth or read mode; a slow drive costs speed, a failing one a clear error."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from deltafind import Model
from deltafind.errors import CorruptExpertError
from deltafind.importer.placement import rebalance
from deltafind.importer.setup import setup_store
from deltafind.store.doctor import check_store
from deltafind.store.drive_queue import Chunk, DriveQueue, split
from deltafind.store.manifest import Manifest, pack_name
from deltafind.store.reader import DriveOptions, PackReader
from tests.conftest import deltafind_cmd, make_hf_checkpoint

PROMPT = [11, 42, 7, 99, 3, 150, 8]
TOKENS = 10


@pytest.fixture(scope="module")
def built(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Path], list[int], torch.Tensor]:
    """Whole records on 1 and 4 drives; striped over 2 and 4 (4096-byte minimum stripe); the reference."""
    root = tmp_path_factory.mktemp("drives")
    ckpt = make_hf_checkpoint(
        "qwen3_moe",
        root / "hf",
        num_hidden_layers=3,
        mlp_only_layers=[0],
        num_experts=16,
        num_experts_per_tok=4,
    )
    layouts = {
        "whole1": (1, "whole"),
        "whole4": (4, "whole"),
        "stripe2": (2, "stripe"),
        "stripe4": (4, "stripe"),
    }
    stores = {}
    for name, (n, placement) in layouts.items():
        stores[name] = root / name
        setup_store(
            ckpt,
            stores[name],
            [stores[name] / f"d{i}" for i in range(n)],
            dense_slices=3,
            progress=False,
            placement=placement,
            min_stripe_bytes=4096,
        )
    m = Model.open(stores["whole1"], expert_bytes=None, prefetch=False)
    try:
        return stores, m.generate(PROMPT, max_new_tokens=TOKENS), m.forward_logits(PROMPT)
    finally:
        m.close()


def test_striped_records_cover_every_drive_and_verify(built) -> None:
    stores, _, _ = built
    m = Manifest.load(stores["stripe4"])
    assert (
        m.placement == "stripe"
        and sum(len(r.stripes) == 4 for r in m.experts) >= len(m.experts) // 2
    )
    # as many pieces as 4096-byte minimum stripes fit; in payload order they cover the record
    for r in m.experts:
        size = -(-r.length // 4096) * 4096
        assert (
            len(r.extents()) == min(4, size // 4096) and sum(e.nbytes for e in r.extents()) == size
        )
        assert all(e.offset % 4096 == 0 and e.nbytes % 4096 == 0 for e in r.extents())
    per_drive = [
        sum(e.nbytes for r in m.experts for e in r.extents() if e.drive == d) for d in range(4)
    ]
    assert max(per_drive) - min(per_drive) <= sum(per_drive) // 10  # even bytes per drive
    assert check_store(stores["stripe4"], progress=False).ok  # doctor reads stripes too
    assert Manifest.load(stores["whole4"]).placement == "whole"
    assert (
        "placement" not in (stores["whole4"] / "manifest.json").read_text()
    )  # older deltafind still opens it


@pytest.mark.parametrize("name", ["whole4", "stripe2", "stripe4"])
@pytest.mark.parametrize("cache", [0, None])
@pytest.mark.parametrize("queue_depth", [1, 3])
@pytest.mark.parametrize("read_mode", ["direct", "buffered"])
def test_output_is_bit_identical_under_every_placement(
    built, name, cache, queue_depth, read_mode
) -> None:
    stores, tokens, logits = built
    n = len(Manifest.load(stores[name]).drives)
    caps = [None] * n
    caps[-1] = 5.0  # one slow drive (5 MB/s): costs time, never a different token
    m = Model.open(
        stores[name],
        expert_bytes=cache,
        read_mode=read_mode,
        drives=[DriveOptions(queue_depth=queue_depth, read_mb_s=c) for c in caps],
    )
    try:
        assert torch.equal(m.forward_logits(PROMPT), logits)
        assert m.generate(PROMPT, max_new_tokens=TOKENS) == tokens
        io = m.experts.reader.io_stats()
        assert io["read_mode"] == read_mode and all(not d for d in io["o_direct"]) == (
            read_mode == "buffered"
        )
        assert all(d["misaligned_reads"] == 0 for d in io["drives"])
        if name.startswith("stripe"):  # every drive did a share of the reads
            assert all(d["reads"] > 0 for d in io["drives"])
    finally:
        m.close()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_failing_drive_fails_the_request_clearly_and_never_gives_a_wrong_token(
    built, tmp_path
) -> None:
    stores, tokens, _ = built
    store = _copy(stores["stripe4"], tmp_path / "s")
    pack = store / "d2" / pack_name(2)
    original = pack.read_bytes()
    m = Model.open(store, expert_bytes=0)
    try:
        with open(
            pack, "r+b"
        ) as f:  # drive 2 loses everything past its header: every stripe on it fails
            f.truncate(4096)
        with pytest.raises(CorruptExpertError, match=r"short read on drive 2 .*truncated"):
            m.generate(PROMPT, max_new_tokens=TOKENS)
        pack.write_bytes(
            bytes(b ^ 0x5A if i >= 4096 else b for i, b in enumerate(original))
        )  # drive 2 returns garbage
        with pytest.raises(
            CorruptExpertError, match=r"checksum mismatch .*striped over drives 0, 1, 2, 3"
        ):
            m.generate(PROMPT, max_new_tokens=TOKENS)
        pack.write_bytes(original)  # the drive is back: the same engine serves the right tokens
        assert m.generate(PROMPT, max_new_tokens=TOKENS) == tokens
    finally:
        m.close()


def test_rebalance_stripe_upgrades_a_whole_store_in_place(built, tmp_path) -> None:
    stores, tokens, logits = built
    store = _copy(stores["whole4"], tmp_path / "s")

    def crash(stage: str) -> None:
        if stage == "written":
            raise RuntimeError(stage)

    # a crash after the new packs are written: the old store is intact
    with pytest.raises(RuntimeError):
        rebalance(store, {}, stripe=True, min_stripe_bytes=4096, fault=crash)
    assert Manifest.load(store).placement == "whole" and Manifest.load(store).pack_generation == 0
    before, after, moved = rebalance(
        store, {}, stripe=True, min_stripe_bytes=4096
    )  # no heat needed to stripe
    m = Manifest.load(store)
    assert moved and m.placement == "stripe" and m.pack_generation == 1
    assert sorted(p.name for p in (store / "d0").iterdir()) == [
        pack_name(0, 1)
    ]  # old generation removed
    assert (
        max(after.bytes_per_drive) - min(after.bytes_per_drive)
        < max(before.bytes_per_drive) - min(before.bytes_per_drive)
        or before == after
    )
    assert rebalance(store, {}, stripe=True, min_stripe_bytes=4096)[2] is False  # already striped
    assert (
        rebalance(store, {r.key: float(r.expert) for r in m.experts}, min_stripe_bytes=4096)[2]
        is False
    )  # heat does not unstripe it
    model = Model.open(store, expert_bytes=0)
    try:
        assert torch.equal(model.forward_logits(PROMPT), logits)
        assert model.generate(PROMPT, max_new_tokens=TOKENS) == tokens
    finally:
        model.close()


def test_a_manifest_with_an_unknown_placement_is_refused(built, tmp_path) -> None:
    store = _copy(built[0]["stripe2"], tmp_path / "s")
    path = store / "manifest.json"
    path.write_text(path.read_text().replace('"placement": "stripe"', '"placement": "mirror"'))
    with pytest.raises(Exception, match="unknown expert placement 'mirror'"):
        Manifest.load(store)


def test_split_cuts_aligned_even_chunks() -> None:
    assert split(4096, 4096) == [(4096, 4096)]
    pieces = split(8192, 9 << 20)
    assert sum(n for _, n in pieces) == 9 << 20 and all(
        n <= 1 << 20 and n % 4096 == 0 for _, n in pieces
    )
    assert [o for o, _ in pieces] == [
        8192 + sum(n for _, n in pieces[:i]) for i in range(len(pieces))
    ]


def test_demand_chunks_go_before_speculative_ones_and_promotion_moves_them(tmp_path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(64 * 4096))
    fd = os.open(path, os.O_RDONLY)
    order: list[str] = []
    gate = threading.Event()

    class Owner:
        def __init__(self, name: str) -> None:
            self.name = name

        def run(self, chunk: Chunk) -> None:
            gate.wait(5)
            order.append(self.name)

        def abandon(self, chunk: Chunk) -> None:
            order.append("abandoned " + self.name)

    q = DriveQueue(0, fd, 1, None, False)
    try:
        q.put(
            [Chunk(q, 0, 4096, 0, Owner("first"))]
        )  # occupies the one thread until the gate opens
        time.sleep(0.05)
        spec = [Chunk(q, 0, 4096, 0, Owner(f"spec{i}")) for i in range(2)]
        q.put(spec, speculative=True)
        q.put([Chunk(q, 0, 4096, 0, Owner("demand"))])
        q.promote(spec[1:])  # the router confirmed spec1: it goes with the demand reads
        gate.set()
        deadline = time.time() + 5
        while len(order) < 4 and time.time() < deadline:
            time.sleep(0.01)
        assert order == ["first", "demand", "spec1", "spec0"]
    finally:
        q.close()
        os.close(fd)


def test_reads_fill_the_queue_and_report_how(built) -> None:
    stores, _, _ = built
    manifest = Manifest.load(stores["stripe4"])
    reader = PackReader(
        manifest, stores["stripe4"], verify="fast", drives=[DriveOptions(queue_depth=4)] * 4
    )
    try:
        for fut in [reader.submit(r) for r in manifest.experts]:
            reader.release(fut.result())
        for fut in [reader.submit(r) for r in manifest.experts]:
            reader.release(fut.result())
        io = reader.io_stats()
        total = sum(d["bytes"] for d in io["drives"])
        assert total == 2 * sum(e.nbytes for r in manifest.experts for e in r.stripes)
        assert all(d["max_queue_depth"] <= 4 and d["misaligned_reads"] == 0 for d in io["drives"])
        assert io["buffers_reused"] > 0  # the second pass reused the first pass's buffers
    finally:
        reader.close()


def test_cli_rebalance_stripe_upgrades_a_store_of_real_size_records(tmp_path) -> None:
    """Records of 3 MiB (over the 1 MiB stripe minimum) set up whole, then striped by the CLI."""
    ckpt = make_hf_checkpoint(
        "qwen3_moe",
        tmp_path / "hf",
        num_hidden_layers=1,
        hidden_size=256,
        moe_intermediate_size=1024,
        num_experts=4,
        num_experts_per_tok=2,
    )
    store = tmp_path / "store"
    setup_store(ckpt, store, [store / "d0", store / "d1"], progress=False, placement="whole")
    trace = tmp_path / "t.jsonl"
    m = Model.open(store, expert_bytes=0, trace_path=trace)
    tokens = m.generate(PROMPT, max_new_tokens=4)
    m.experts.uses.clear()
    m.close()
    proc = deltafind_cmd(
        "trace", "warm", str(trace), "--store", str(store), "--rebalance", "--stripe"
    )
    assert proc.returncode == 0, proc.stderr
    assert "striped: every large record is split over all 2 drive(s)" in proc.stdout
    manifest = Manifest.load(store)
    assert manifest.placement == "stripe" and all(len(r.stripes) == 2 for r in manifest.experts)
    m = Model.open(store, expert_bytes=0)
    try:
        assert m.generate(PROMPT, max_new_tokens=4) == tokens
    finally:
        m.close()
