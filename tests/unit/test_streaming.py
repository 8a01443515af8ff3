"""Expert streaming: outputs never depend on cache, drives, prefetch or trace; faults stay contained."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest
import torch

from deltafind import Model
from deltafind.control.ctl import store_lines
from deltafind.errors import CorruptExpertError, StoreError
from deltafind.importer.setup import setup_store
from deltafind.store.heat import read_heat, update_heat
from deltafind.store.manifest import Manifest, pack_name
from deltafind.store.reader import DriveOptions, PackReader
from deltafind.store.trace import read_trace, summarize
from tests.conftest import make_hf_checkpoint

PROMPT = [11, 42, 7, 99, 3, 150, 8]


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[int | str, Path]:
    """1 and 3 drives with whole records (the tiny experts are under setup's stripe minimum), and
    "3s": 3 drives with every record split over all three (4096-byte minimum stripe)."""
    root = tmp_path_factory.mktemp("stream")
    ckpt = make_hf_checkpoint(
        "qwen3_moe",
        root / "hf",
        num_hidden_layers=3,
        mlp_only_layers=[0],
        num_experts=16,
        num_experts_per_tok=4,
    )
    out: dict[int | str, Path] = {}
    for n in (1, 3, "3s"):
        drives = int(str(n).rstrip("s"))
        out[n] = root / f"s{n}"
        setup_store(
            ckpt,
            out[n],
            [root / f"s{n}-d{i}" for i in range(drives)],
            dense_slices=4,
            progress=False,
            min_stripe_bytes=4096 if n == "3s" else 1 << 20,
        )
    assert (
        Manifest.load(out[3]).placement == "whole"
        and Manifest.load(out["3s"]).placement == "stripe"
    )
    return out


@pytest.fixture(scope="module")
def reference(stores: dict[int, Path]) -> tuple[torch.Tensor, list[int]]:
    m = Model.open(stores[1], expert_bytes=None, prefetch=False)
    try:
        return m.forward_logits(PROMPT), m.generate(PROMPT, max_new_tokens=12)
    finally:
        m.close()


@pytest.mark.parametrize("drives", [1, 3, "3s"])
@pytest.mark.parametrize("budget", [None, 0, 40_000])
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("trace", [True, False])
def test_output_is_bit_identical_to_all_resident(
    stores, reference, tmp_path, drives, budget, prefetch, trace
) -> None:
    m = Model.open(
        stores[drives],
        expert_bytes=budget,
        prefetch=prefetch,
        max_in_flight=6,
        trace_path=tmp_path / "t.jsonl" if trace else None,
    )
    try:
        logits, tokens = reference
        assert torch.equal(m.forward_logits(PROMPT), logits)
        assert m.generate(PROMPT, max_new_tokens=12) == tokens
        if budget is not None:
            assert m.experts.cache.used_bytes <= budget
        if prefetch and budget == 0:
            assert m.experts.stats.prefetch_used > 0  # hints turned into reads that fetch then used
    finally:
        m.close()


@pytest.mark.parametrize("read_mb_s", [None, 1.0])
def test_the_prefetch_gate_never_changes_tokens_and_reports_each_layer(
    stores, reference, read_mb_s
) -> None:
    """Uncapped the gate starts reads; on a slow drive (its queue past every window) it holds most:
    tokens stay those of the all-resident reference either way, and the snapshot's per-layer
    recall and precision are the counts the gate saw."""
    capped = {"drives": [DriveOptions(read_mb_s=read_mb_s)] * 3} if read_mb_s else {}
    m = Model.open(stores[3], expert_bytes=0, max_in_flight=6, **capped)
    try:
        assert m.generate(PROMPT, max_new_tokens=12) == reference[1]
        e, gate = m.experts.stats, m.snapshot()["prefetch_gate"]
        layers = {r["layer"]: r for r in gate["layers"]}
        assert set(layers) == {
            0,
            1,
            2,
        }  # layer 0 is a dense MLP in 4 slices: always all predicted, all needed
        assert layers[0]["recall"] == layers[0]["precision"] == 1.0
        for r in layers.values():
            assert r["needed"] > 0 and r["recall"] == round(r["hits"] / r["needed"], 4)
            assert r["precision"] == round(r["hits"] / r["predicted"], 4)
        assert sum(r["issued"] for r in layers.values()) == e.prefetch_issued
        assert "prefetch   by layer" in "\n".join(
            store_lines(m.snapshot())
        )  # what status and --stats print
        assert e.prefetch_used + e.prefetch_wasted <= e.prefetch_issued
        routed = [layers[1], layers[2]]
        if read_mb_s is None:
            assert e.prefetch_used > 0
        else:  # the drive had little slack to give: most routed predictions wait for the router
            assert sum(r["held"] for r in routed) > sum(r["issued"] for r in routed)
    finally:
        m.close()


def test_trace_summarize_and_warm_pin_the_hot_experts(stores, reference, tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    m = Model.open(stores[3], expert_bytes=0, trace_path=trace)
    m.generate(PROMPT, max_new_tokens=12)
    m.close()
    records = read_trace(trace)
    summary = summarize(records)
    expert_layers = (
        3  # MoE layers 1 and 2, and dense layer 0, whose every token takes all its slices
    )
    assert (
        summary["routes"] == (len(PROMPT) + 11) * expert_layers
    )  # prompt + 11 decode steps (the 12th token is not fed back)
    assert set(summary["reuse_by_layer"]) == {0, 1, 2} and set(
        summary["prediction_recall_by_layer"]
    ) <= {0, 1, 2}
    from deltafind.store.trace import heat_from_trace

    update_heat(stores[3], heat_from_trace(records), decay=1.0)
    hot = summary["hot_experts"][0]
    assert read_heat(stores[3])[(hot["layer"], hot["expert"])] >= hot["uses"]
    pinned = Model.open(stores[3], expert_bytes=0, pin_bytes=200_000)
    try:
        assert (
            hot["layer"],
            hot["expert"],
        ) in pinned.experts.resident.experts and pinned.experts.resident.pinned_bytes <= 200_000
        assert pinned.generate(PROMPT, max_new_tokens=12) == reference[1]
        assert pinned.experts.stats.pinned_hits > 0
    finally:
        pinned.close()


def test_corrupt_record_fails_the_request_and_the_engine_keeps_serving(
    stores, reference, tmp_path
) -> None:
    store = stores[3]
    manifest = Manifest.load(store)
    m = Model.open(store, expert_bytes=0)
    try:
        m.generate(PROMPT, max_new_tokens=2)
        used = next(k for k, n in m.experts.uses.items() if k[0] == 1)
        rec = m.experts.record(*used)
        pack = manifest.drive_paths(store)[rec.drive] / pack_name(rec.drive)
        original = pack.read_bytes()
        flipped = bytearray(original)
        flipped[rec.offset + 17] ^= 0xFF
        pack.write_bytes(bytes(flipped))
        try:
            with pytest.raises(
                CorruptExpertError, match=f"expert {used[1]} of layer 1: checksum mismatch"
            ):
                m.generate(PROMPT, max_new_tokens=12)
        finally:
            pack.write_bytes(original)
        assert m.generate(PROMPT, max_new_tokens=12) == reference[1]  # nothing poisoned
    finally:
        m.close()


def test_read_errors_name_the_expert(stores) -> None:
    store = stores[1]
    manifest = Manifest.load(store)
    reader = PackReader(manifest, store)
    try:
        last = max(manifest.experts, key=lambda r: r.offset)
        pack = manifest.drive_paths(store)[0] / pack_name(0)
        original = pack.read_bytes()
        with open(pack, "r+b") as f:
            f.truncate(last.offset + 10)
        try:
            with pytest.raises(
                CorruptExpertError, match=f"expert {last.expert} of layer {last.layer}: short read"
            ):
                reader.read(last)
        finally:
            pack.write_bytes(original)
        reader.read(last)
    finally:
        reader.close()


def test_drive_count_mismatch_is_explained(stores) -> None:
    with pytest.raises(StoreError, match=r"lists 1 drive.* striped over 3"):
        Model.open(stores[3], drives=[DriveOptions()])


def test_read_rate_cap_emulates_a_slower_drive(stores) -> None:
    store = stores[1]
    manifest = Manifest.load(store)
    reader = PackReader(manifest, store, drives=[DriveOptions(read_mb_s=2.0, queue_depth=4)])
    try:
        recs = manifest.experts[:8]
        total = sum(-(-r.length // 4096) * 4096 for r in recs)
        t0 = time.perf_counter()
        for fut in [reader.submit(r) for r in recs]:
            fut.result()
        assert time.perf_counter() - t0 >= 0.95 * total / 2e6
    finally:
        reader.close()


def _bump(store: str, n: int) -> None:
    for _ in range(n):
        update_heat(Path(store), {(1, 2): 1.0, (2, 3): 0.5}, decay=1.0)


def _crash_mid_write(store: str) -> None:
    import os

    import deltafind.store.manifest as manifest_mod

    def die(*_a, **_k):  # the new file is written, the rename never happens
        os._exit(1)

    manifest_mod.os.replace = die
    update_heat(Path(store), {(9, 9): 100.0}, decay=1.0)


def test_heat_file_survives_concurrent_writers_and_a_crash(tmp_path) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_bump, args=(str(tmp_path), 10)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert read_heat(tmp_path) == {(1, 2): 40.0, (2, 3): 20.0}  # no update lost
    crash = ctx.Process(target=_crash_mid_write, args=(str(tmp_path),))
    crash.start()
    crash.join(60)
    assert crash.exitcode == 1
    assert read_heat(tmp_path) == {(1, 2): 40.0, (2, 3): 20.0}  # the old file stands
    update_heat(tmp_path, {(1, 2): 1.0}, decay=0.5)
    assert read_heat(tmp_path) == {(1, 2): 21.0, (2, 3): 10.0}
