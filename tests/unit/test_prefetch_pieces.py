"""A prefetch of only a record's first pieces: the rest waits for the router; confirmed, the pieces
already read are kept and the record lands checked (xxh3 and sha256 of the store); dropped, no
other piece reaches the drive and its buffer goes back to the pool."""

from __future__ import annotations

import time

import pytest

from deltafind import Model
from deltafind.importer.setup import setup_store
from deltafind.store.drive_queue import split
from deltafind.store.manifest import Manifest
from deltafind.store.reader import DriveOptions, PackReader
from tests.conftest import make_hf_checkpoint

PROMPT = [11, 42, 7, 99, 3, 150, 8]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    """Records of 3 MiB, whole on one drive: three 1 MiB pieces each."""
    root = tmp_path_factory.mktemp("pieces")
    ckpt = make_hf_checkpoint(
        "qwen3_moe",
        root / "hf",
        num_hidden_layers=2,
        hidden_size=256,
        moe_intermediate_size=1024,
        num_experts=8,
        num_experts_per_tok=2,
    )
    setup_store(ckpt, root / "store", [root / "store" / "d0"], progress=False, placement="whole")
    return root / "store"


def _settle(reader: PackReader, nbytes: int) -> None:
    deadline = time.time() + 10
    while reader.bytes_read < nbytes and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # nothing more may arrive


def test_a_confirmed_prefetch_keeps_its_pieces_and_reads_the_rest(store) -> None:
    manifest = Manifest.load(store)
    rec = manifest.experts[0]
    pieces = split(rec.offset, rec.length)
    assert len(pieces) == 3
    reader = PackReader(manifest, store, verify="full", drives=[DriveOptions(queue_depth=4)])
    try:
        fut = reader.submit(rec, speculative=True, pieces=1)
        _settle(reader, pieces[0][1])
        assert (
            reader.bytes_read == pieces[0][1] and not fut.done()
        )  # only the admitted piece reached the drive
        reader.promote(fut)
        buf = fut.result(timeout=10)  # checked against the manifest's sha256 and xxh3 ("full")
        assert reader.bytes_read == sum(n for _, n in pieces)  # each piece read once
        assert reader.pieces.as_dict() == {
            "kept": 1,
            "dropped": 0,
            "kept_bytes": pieces[0][1],
            "dropped_bytes": 0,
        }
        reader.release(buf)
    finally:
        reader.close()


def test_a_dropped_prefetch_reads_no_more_and_recycles_its_buffer(store) -> None:
    manifest = Manifest.load(store)
    rec = manifest.experts[1]
    first = split(rec.offset, rec.length)[0][1]
    reader = PackReader(manifest, store, verify="fast", drives=[DriveOptions(queue_depth=4)])
    try:
        fut = reader.submit(rec, speculative=True, pieces=1)
        _settle(reader, first)
        assert fut.cancel()  # the router chose other experts
        time.sleep(0.1)
        assert reader.bytes_read == first
        assert reader.pieces.dropped == 1 and reader.pieces.kept == 0
        assert reader.buffers._free_bytes >= rec.length  # the buffer is back for the next read
    finally:
        reader.close()


def test_tokens_are_the_same_with_piece_prefetch_on_a_drive_with_idle_time(store) -> None:
    """A drive paced at 1 GB/s and a cold cache: the gate starts pieces and whole records; tokens never change.
    Buffered reads of a store just written come from the page cache, so the pace is the drive's rate on any
    machine, and each layer's compute (a few ms here) leaves it a few MB of slack."""
    ref = Model.open(store, expert_bytes=None, prefetch=False)
    want = ref.generate(PROMPT, max_new_tokens=12)
    ref.close()
    m = Model.open(
        store,
        expert_bytes=0,
        drives=[DriveOptions(queue_depth=4, read_mb_s=1000)],
        read_mode="buffered",
    )
    try:
        assert m.generate(PROMPT, max_new_tokens=12) == want
        assert (
            m.experts.stats.prefetch_issued > 0
        )  # prefetch ran (layer 0 from the previous step's route, layer 1 predicted)
    finally:
        m.experts.uses.clear()
        m.close()


def test_a_prediction_keeps_the_predicted_experts_it_holds_from_eviction(store) -> None:
    """The experts a layer will want were used a step ago, so they lead the LRU order: a read reserved for
    the prediction evicted exactly them before the router asked (warm cache, prefetch on lost 4-5 %).
    Predicting marks them used."""
    m = Model.open(store, expert_bytes=1 << 30)
    try:
        ex = m.experts
        list(ex.fetch(0, [0, 1]))
        list(ex.fetch(1, [2, 3]))
        assert set(list(ex.cache._items)[:2]) == {
            (0, 0),
            (0, 1),
        }  # layer 0's experts are the oldest (reads finish in any order)
        hits = ex.cache.hits
        ex.prefetch(0, [1, 0, 5])  # layer 0 has no layer before it: issued at once
        assert (
            list(ex.cache._items)[-2:] == [(0, 1), (0, 0)] and ex.cache.hits == hits
        )  # now the newest, in the order named; no hit counted
        assert next(iter(ex.cache._items)) in {
            (1, 2),
            (1, 3),
        }  # the next eviction takes one the prediction did not name
    finally:
        m.experts.uses.clear()
        m.close()


def test_a_fetch_abandoned_on_a_cached_expert_gives_back_its_reads_reservations(store) -> None:
    """A consumer that fails on the first (cached) expert closes the fetch there: the reads it had
    started are cancelled or recycled and their reservations return to the budget, or the cache
    would shrink by them for good."""
    m = Model.open(store, expert_bytes=1 << 30, prefetch=False)
    try:
        ex = m.experts
        list(ex.fetch(0, [0, 1]))
        standing = ex.cache.reserved_bytes
        gen = ex.fetch(0, [0, 1, 2, 3])  # 0 and 1 held: yielded first, while 2 and 3 are read
        assert next(gen)[0] in (0, 1)
        assert (
            ex.cache.reserved_bytes > standing
        )  # the two reads in flight count against the budget
        gen.close()  # the consumer raised on that expert
        assert ex.cache.reserved_bytes == standing
        assert (
            list(ex.fetch(0, [2, 3])) and ex.cache.reserved_bytes == standing
        )  # the next fetch reads them whole
    finally:
        m.experts.uses.clear()
        m.close()


def test_the_read_precision_learns_from_unheld_predictions_before_any_read_starts(store) -> None:
    """Warm cache: the held predicted experts hit, the ones a read would fetch miss. The gate learns that
    precision from the prediction itself (no window yet: nothing was read), so a warm layer's first
    speculative reads are not what teaches it (warm, one drive, batch 1: 3 wasted reads lost 2-4 %)."""
    m = Model.open(store, expert_bytes=1 << 30)
    try:
        ex = m.experts
        list(ex.fetch(0, [0, 1]))  # held now
        ex.prefetch(0, [0, 1, 5, 6])  # 5 and 6 are not held: what a prefetch would read
        assert ex.stats.prefetch_issued == 0  # layer 0's window was never timed: nothing starts
        list(ex.fetch(0, [0, 1]))  # the router wants the held ones only
        r = ex.gate.layers[0]
        assert (
            r.ema == 0.5 and r.read_ema == 0.0
        )  # all predictions: 2 of 4 wanted; the unheld ones: 0 of 2
    finally:
        m.experts.uses.clear()
        m.close()
