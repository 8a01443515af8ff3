"""Per-read integrity: xxh3 on every read, sha256-once for stores without xxh3, doctor checks both."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import pytest
import torch
import xxhash

from deltafind import Model
from deltafind.errors import CorruptExpertError
from deltafind.importer.setup import setup_store
from deltafind.importer.synthetic import open_synthetic
from deltafind.store.buffers import record_tensors
from deltafind.store.doctor import check_store
from deltafind.store.manifest import MANIFEST_NAME, Manifest, pack_name
from deltafind.store.reader import PackReader

PROMPT = [11, 42, 7, 99, 3]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    out = tmp_path / "s"
    setup_store(
        open_synthetic("qwen3_moe", "tiny", seed=2),
        out,
        [tmp_path / "d0", tmp_path / "d1"],
        dense_slices=2,
        progress=False,
    )
    return out


def _flip(store: Path, rec, at: int = 33) -> bytes:
    pack = Manifest.load(store).drive_paths(store)[rec.drive] / pack_name(rec.drive)
    original = pack.read_bytes()
    damaged = bytearray(original)
    damaged[rec.offset + at] ^= 0x40
    pack.write_bytes(bytes(damaged))
    return original


def test_setup_records_both_digests_of_the_stored_bytes(store) -> None:
    manifest = Manifest.load(store)
    for rec in manifest.experts:
        path = manifest.drive_paths(store)[rec.drive] / pack_name(rec.drive)
        with open(path, "rb") as f:
            f.seek(rec.offset)
            data = f.read(rec.length)
        assert (
            hashlib.sha256(data).hexdigest() == rec.sha256
            and xxhash.xxh3_64_hexdigest(data) == rec.xxh3
        )


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_a_flipped_bit_is_caught_on_read(store, mode) -> None:
    manifest = Manifest.load(store)
    rec = manifest.experts[3]
    _flip(store, rec)
    reader = PackReader(manifest, store, verify=mode)
    try:
        with pytest.raises(
            CorruptExpertError, match=f"expert {rec.expert} of layer {rec.layer}: checksum mismatch"
        ):
            reader.read(rec)
        reader.read(manifest.experts[4])  # others still read
    finally:
        reader.close()


def test_store_without_xxh3_is_sha256_checked_once_then_by_the_learned_digest(store) -> None:
    raw = json.loads((store / MANIFEST_NAME).read_text())
    for r in raw["experts"]:
        r.pop("xxh3")  # a store written before xxh3 existed
    (store / MANIFEST_NAME).write_text(json.dumps(raw))
    manifest = Manifest.load(store)
    rec = manifest.experts[5]
    assert rec.xxh3 is None
    reader = PackReader(manifest, store, verify="fast")
    try:
        first = reader.read(rec)
        learned = reader._learned[rec.key]
        assert learned == xxhash.xxh3_64_hexdigest(memoryview(first)[: rec.length])
        reader.release(first)
        _flip(store, rec, at=rec.length - 1)
        with pytest.raises(CorruptExpertError, match="checksum mismatch"):
            reader.read(rec)
    finally:
        reader.close()


def test_doctor_catches_a_wrong_xxh3_in_the_manifest(store) -> None:
    raw = json.loads((store / MANIFEST_NAME).read_text())
    raw["experts"][2]["xxh3"] = "0" * 16
    (store / MANIFEST_NAME).write_text(json.dumps(raw))
    report = check_store(store, progress=False)
    assert len(report.problems) == 1 and "checksum mismatch" in report.problems[0]


def test_bf16_experts_are_held_as_stored_and_widened_only_by_the_oracle(store) -> None:
    """The synthetic store's experts are bf16: fp32 compute holds them as read (half the bytes of an
    fp32 copy); under `widened()` (the oracle path) the drive threads widen them exactly."""
    from deltafind.models.ops.stored import widened

    manifest = Manifest.load(store)
    for widen in (False, True):
        with widened() if widen else contextlib.nullcontext():
            m = Model.open(store, expert_bytes=None, prefetch=False, dtype="float32")
        try:
            m.generate(PROMPT, max_new_tokens=4)
            cached = dict(m.experts.cache._items)
            assert cached, "the run read experts"
            reader = PackReader(manifest, store, verify="full")
            try:
                for key, (expert, nbytes) in cached.items():
                    rec = next(r for r in manifest.experts if r.key == key)
                    buf = reader.read(rec)
                    for name, t in record_tensors(rec, buf).items():
                        assert t.dtype == torch.bfloat16 and expert[name].dtype == (
                            torch.float32 if widen else torch.bfloat16
                        )
                        assert torch.equal(expert[name], t.float() if widen else t)
                    assert (
                        nbytes == (2 if widen else 1) * rec.length
                    )  # the cache counts what it holds
            finally:
                reader.close()
        finally:
            m.close()
