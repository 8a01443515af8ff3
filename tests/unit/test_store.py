"""The store: bit-exact import, checksums, resumable setup, clear refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from deltafind import Model
from deltafind.errors import CorruptExpertError, StoreError
from deltafind.importer.plan import MAX_DENSE_SLICES, Plan, dense_slices_for
from deltafind.importer.setup import setup_store
from deltafind.importer.sources import TensorInfo
from deltafind.store.buffers import record_tensors
from deltafind.store.cache import ByteLRU
from deltafind.store.doctor import check_store
from deltafind.store.manifest import ExpertRecord, Manifest, TensorEntry, pack_name
from deltafind.store.reader import PackReader
from tests.conftest import make_hf_checkpoint


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(
        "qwen3_moe",
        tmp_path_factory.mktemp("ckpt") / "hf",
        mlp_only_layers=[0],
        norm_topk_prob=True,
    )


def _source_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 (a safetensors handle, not a dict)
    return out


def test_every_tensor_is_bit_identical_to_its_source(moe_ckpt: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    manifest = setup_store(
        moe_ckpt,
        store,
        [tmp_path / "a", tmp_path / "b", tmp_path / "c"],
        dense_slices=3,
        progress=False,
    )
    src = _source_tensors(moe_ckpt)
    with safe_open(str(store / "spine.safetensors"), "pt") as h:
        spine = {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118 (safetensors handle)
    reader = PackReader(manifest, store)
    experts = {r.key: record_tensors(r, reader.read(r)) for r in manifest.experts}
    rebuilt = dict(spine)
    for (layer, e), parts in experts.items():
        if layer == 0:  # the dense layer, sliced three ways
            continue
        for part, t in parts.items():
            rebuilt[f"model.layers.{layer}.mlp.experts.{e}.{part}.weight"] = t
    for part, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        rebuilt[f"model.layers.0.mlp.{part}.weight"] = torch.cat(
            [experts[(0, i)][part] for i in range(3)], dim=dim
        )
    assert rebuilt.keys() == src.keys()
    for name, t in src.items():
        assert rebuilt[name].dtype == t.dtype and torch.equal(
            rebuilt[name].view(torch.uint8), t.view(torch.uint8)
        ), name
    # striping: round-robin over the three drives, every record 4096-aligned
    drives = [r.drive for r in sorted(manifest.experts, key=lambda r: r.key)]
    assert set(drives) == {0, 1, 2} and all(r.offset % 4096 == 0 for r in manifest.experts)


def test_flipped_byte_is_reported_by_doctor_and_by_a_read(moe_ckpt: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    manifest = setup_store(moe_ckpt, store, [tmp_path / "d0", tmp_path / "d1"], progress=False)
    assert check_store(store, progress=False).ok
    victim = next(r for r in manifest.experts if r.layer == 1 and r.expert == 5)
    pack = tmp_path / f"d{victim.drive}" / pack_name(victim.drive)
    with open(pack, "r+b") as f:
        f.seek(victim.offset + 100)
        b = f.read(1)
        f.seek(victim.offset + 100)
        f.write(bytes([b[0] ^ 0x01]))
    report = check_store(store, progress=False)
    assert len(report.problems) == 1 and "expert 5 of layer 1" in report.problems[0]
    with pytest.raises(CorruptExpertError, match="expert 5 of layer 1: checksum mismatch"):
        PackReader(manifest, store).read(victim)


def test_interrupted_setup_resumes_to_the_same_store(moe_ckpt: Path, tmp_path: Path) -> None:
    clean = setup_store(
        moe_ckpt, tmp_path / "clean", [tmp_path / "c0", tmp_path / "c1"], progress=False
    )
    store = tmp_path / "resumed"
    drives = [tmp_path / "r0", tmp_path / "r1"]
    with pytest.raises(KeyboardInterrupt):
        setup_store(moe_ckpt, store, drives, progress=False, fault_after=5)
    assert not (store / "manifest.json").exists()
    with pytest.raises(StoreError, match="setup did not finish"):
        Manifest.load(store)
    # a torn journal line, as a crash mid-write would leave
    with open(store / "setup.journal", "a") as f:
        f.write('{"kind": "exp')
    resumed = setup_store(moe_ckpt, store, drives, progress=False)
    key = lambda r: r.key  # noqa: E731
    assert [(r.key, r.drive, r.offset, r.sha256) for r in sorted(resumed.experts, key=key)] == [
        (r.key, r.drive, r.offset, r.sha256) for r in sorted(clean.experts, key=key)
    ]
    assert check_store(store, progress=False).ok
    assert not (store / "setup.journal").exists()


def test_setup_refuses_to_overwrite_a_different_store(moe_ckpt: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    setup_store(moe_ckpt, store, progress=False)
    again = setup_store(moe_ckpt, store, progress=False)  # same source and options: nothing to do
    assert again.store_id == Manifest.load(store).store_id
    other = make_hf_checkpoint("llama", tmp_path / "other")
    with pytest.raises(StoreError, match="already holds a different store"):
        setup_store(other, store, progress=False)


def test_missing_drive_is_named(moe_ckpt: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    setup_store(moe_ckpt, store, [tmp_path / "d0", tmp_path / "d1"], progress=False)
    shutil.rmtree(tmp_path / "d1")
    with pytest.raises(StoreError, match=r"drive 1 \(.*d1\) is missing"):
        Model.open(store)


def test_dense_slicing_is_lossless(tmp_path: Path) -> None:
    ckpt = make_hf_checkpoint(
        "llama", tmp_path / "hf", intermediate_size=100
    )  # 100 does not divide by 8
    ids = list(range(3, 40, 3))
    logits = []
    for n in (1, 8):
        setup_store(ckpt, tmp_path / f"s{n}", dense_slices=n, progress=False)
        logits.append(Model.open(tmp_path / f"s{n}").forward_logits(ids))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


def _dense_plan(
    inter: int, hidden: int, down_quant: str = ""
) -> tuple[dict[str, TensorInfo], Plan]:
    half = TensorInfo(torch.bfloat16, (inter, hidden))
    down = (
        TensorInfo(torch.uint8, (hidden, inter // 256 * 144), down_quant)
        if down_quant
        else TensorInfo(torch.bfloat16, (hidden, inter))
    )
    return {"g": half, "u": half, "d": down}, Plan(
        [], {}, {0: {"gate_proj": "g", "up_proj": "u", "down_proj": "d"}}
    )


def test_the_dense_slice_count_is_chosen_by_size_on_whole_blocks() -> None:
    """Unasked, slices are at least DENSE_SLICE_BYTES (8 MiB) and at most 8, cut on whole GGUF blocks."""
    demo = _dense_plan(1536, 576)  # 5.3 MB in bf16: one slice
    assert dense_slices_for(*demo, None) == 1 and dense_slices_for(*demo, 8) == 8
    assert dense_slices_for(*_dense_plan(4096, 1024), None) == 3  # 24 MiB
    assert (
        dense_slices_for(*_dense_plan(14336, 4096), None) == MAX_DENSE_SLICES
    )  # Llama-3-8B: 336 MiB
    assert dense_slices_for(*_dense_plan(2816, 8192), None) == 8
    assert (
        dense_slices_for(*_dense_plan(2816, 8192, "Q4_K/2816"), None) == 1
    )  # 11 blocks of 256 columns
    assert (
        dense_slices_for(*_dense_plan(3072, 8192, "Q4_K/3072"), None) == 6
    )  # 12 blocks: 8 does not divide them
    with pytest.raises(StoreError, match="dense slices must be >= 1"):
        dense_slices_for(*demo, 0)


def test_an_unasked_slice_count_takes_the_store_already_there(tmp_path: Path) -> None:
    """A store made with a given count is what a rerun without --dense-slices opens (stores made before the
    count was chosen by size keep working); asking for another count is refused."""
    ckpt = make_hf_checkpoint("llama", tmp_path / "hf")
    made = setup_store(ckpt, tmp_path / "s", dense_slices=4, progress=False)
    again = setup_store(ckpt, tmp_path / "s", progress=False)
    assert again.dense_slices == made.dense_slices == 4
    with pytest.raises(StoreError, match="already holds a different store"):
        setup_store(ckpt, tmp_path / "s", dense_slices=2, progress=False)


def test_zero_cache_budget_gives_identical_output(moe_ckpt: Path, tmp_path: Path) -> None:
    setup_store(moe_ckpt, tmp_path / "s", progress=False)
    outs = []
    for budget in (None, 0, 3000):
        m = Model.open(tmp_path / "s", expert_bytes=budget)
        outs.append(m.generate([5, 6, 7], max_new_tokens=8))
        assert budget is None or m.experts.cache.used_bytes <= budget
    assert outs[0] == outs[1] == outs[2]


def test_not_a_store_and_bad_sources_are_clear(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="not a deltafind store"):
        Manifest.load(tmp_path)
    with pytest.raises(StoreError, match="no such file or folder"):
        setup_store(tmp_path / "nope", tmp_path / "s", progress=False)
    (tmp_path / "x.gguf").write_bytes(b"nope" * 10)
    with pytest.raises(StoreError, match="not a GGUF file"):
        setup_store(tmp_path / "x.gguf", tmp_path / "s", progress=False)
    (tmp_path / "hf").mkdir()
    with pytest.raises(StoreError, match=r"no config\.json"):
        setup_store(tmp_path / "hf", tmp_path / "s", progress=False)


_entries = st.builds(
    TensorEntry,
    st.sampled_from(["gate_proj", "up_proj", "down_proj"]),
    st.sampled_from(["float32", "bfloat16"]),
    st.tuples(st.integers(1, 64), st.integers(1, 64)),
    st.integers(0, 2**20),
    st.integers(0, 2**20),
)
_records = st.builds(
    ExpertRecord,
    st.integers(0, 92),
    st.integers(0, 895),
    st.integers(0, 3),
    st.integers(0, 2**40).map(lambda x: x * 4096),
    st.integers(1, 2**26),
    st.text("0123456789abcdef", min_size=64, max_size=64),
    st.lists(_entries, max_size=3).map(tuple),
)


@given(st.lists(_records, max_size=20))
@settings(max_examples=50, deadline=None)
def test_manifest_round_trips(records: list[ExpertRecord]) -> None:
    m = Manifest(
        "id",
        "llama",
        {"model_type": "llama"},
        ["drive0"],
        8,
        {"source": "x"},
        "0" * 64,
        ["tokenizer.json"],
        records,
    )
    back = Manifest(**{**json.loads(json.dumps(m.to_json())), "experts": []})
    back.experts = [
        ExpertRecord.from_json(r) for r in json.loads(json.dumps(m.to_json()))["experts"]
    ]
    assert back == m


@given(
    st.integers(0, 5000),
    st.lists(st.tuples(st.integers(0, 30), st.integers(0, 3000)), max_size=200),
)
@settings(max_examples=200, deadline=None)
def test_cache_never_exceeds_its_budget(budget: int, puts: list[tuple[int, int]]) -> None:
    cache: ByteLRU[int, int] = ByteLRU(budget)
    for key, nbytes in puts:
        cache.put(key, key, nbytes)
        assert cache.used_bytes <= budget
        assert cache.used_bytes == sum(n for _, n in cache._items.values())


def test_a_store_of_an_older_format_is_refused_with_the_fix_and_the_same_setup_reimports_it(
    moe_ckpt: Path, tmp_path: Path
) -> None:
    """Format 2 keeps GGUF blocks as stored; a format-1 store (which widened them at import)
    is refused by name and version, and the message's fix (the same `deltafind setup` again) works."""
    store, drives = tmp_path / "store", [tmp_path / "a"]
    setup_store(moe_ckpt, store, drives, dense_slices=2, progress=False)
    manifest = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1}))
    with pytest.raises(
        StoreError,
        match=r"manifest\.json: store format_version 1, this deltafind reads 2; re-import the model: run the same `deltafind setup` again",
    ):
        Model.open(store)
    setup_store(moe_ckpt, store, drives, dense_slices=2, progress=False)
    assert Manifest.load(store).format_version == 2
    m = Model.open(store, expert_bytes=None)
    try:
        assert len(m.generate([11, 42, 7], max_new_tokens=3)) == 3
    finally:
        m.close()


def _records(manifest: Manifest) -> list[ExpertRecord]:
    return manifest.experts  # in store order, every field: placement, hashes, tensor layout


@pytest.mark.parametrize("threads", [1, 3])
def test_records_prepared_on_threads_are_the_serial_imports_byte_for_byte(
    moe_ckpt: Path, tmp_path: Path, threads: int
) -> None:
    """Threads load, lay out and hash records ahead of the writer: the store must not change, in
    records, order, placement or bytes (the dense layer's 4 slices share one cached load)."""
    stores = {}
    for n in (0, threads):
        drives = [tmp_path / f"{n}d0", tmp_path / f"{n}d1"]
        stores[n] = setup_store(moe_ckpt, tmp_path / f"s{n}", drives, 4, progress=False, threads=n)
    assert _records(stores[threads]) == _records(stores[0])  # the payloads' sha256 among them
    assert check_store(tmp_path / f"s{threads}", progress=False).ok  # the packs hold them


def test_a_record_that_fails_to_load_stops_the_import_and_its_threads(
    moe_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure on a preparing thread reaches the caller as itself, no preparing thread outlives the
    failed setup (none reads the source after), and the setup run again gives the clean store."""
    import threading

    from deltafind.importer.sources import HFSource

    victim, load = "model.layers.1.mlp.experts.5.up_proj.weight", HFSource.load

    def failing(self: HFSource, name: str) -> torch.Tensor:
        if name == victim:
            raise ValueError(f"{name}: corrupt tensor")
        return load(self, name)

    monkeypatch.setattr(HFSource, "load", failing)
    store, drives = tmp_path / "s", [tmp_path / "d0", tmp_path / "d1"]
    with pytest.raises(ValueError, match=f"{victim}: corrupt tensor"):
        setup_store(moe_ckpt, store, drives, 4, progress=False, threads=3)
    assert not [t for t in threading.enumerate() if t.name.startswith("setup-prepare")]
    monkeypatch.setattr(HFSource, "load", load)
    clean = setup_store(moe_ckpt, tmp_path / "c", [tmp_path / "c0", tmp_path / "c1"], 4, False)
    assert _records(setup_store(moe_ckpt, store, drives, 4, progress=False, threads=3)) == _records(
        clean
    )
