"""`trace warm --rebalance`: heat spread evenly over drives, output unchanged, crash-safe at every stage."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import shutil
from pathlib import Path

import pytest
import torch

from deltafind import Model
from deltafind.errors import StoreError
from deltafind.importer.placement import LOCK_NAME, rebalance
from deltafind.importer.setup import setup_store
from deltafind.store.doctor import check_store
from deltafind.store.heat import read_heat
from deltafind.store.manifest import Manifest, pack_name
from deltafind.store.trace import heat_from_trace, read_trace
from tests.conftest import deltafind_cmd, make_hf_checkpoint

PROMPT = [11, 42, 7, 99, 3, 150, 8]
DRIVES = 3


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int], torch.Tensor]:
    root = tmp_path_factory.mktemp("place")
    ckpt = make_hf_checkpoint(
        "qwen3_moe",
        root / "hf",
        num_hidden_layers=3,
        mlp_only_layers=[0],
        num_experts=16,
        num_experts_per_tok=4,
    )
    store = root / "store"
    setup_store(
        ckpt, store, [store / f"d{i}" for i in range(DRIVES)], dense_slices=3, progress=False
    )  # drives inside: copyable
    m = Model.open(store, expert_bytes=0, prefetch=False)
    try:
        return store, m.generate(PROMPT, max_new_tokens=10), m.forward_logits(PROMPT)
    finally:
        m.close()


@pytest.fixture
def store(pristine, tmp_path: Path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(pristine[0], copy)
    (copy / "heat.json").unlink(missing_ok=True)  # the reference run's uses
    return copy


def skewed_heat(store: Path) -> dict[tuple[int, int], float]:
    """Everything hot sits on drive 0 under setup's round-robin: the worst case for one drive."""
    return {
        r.key: (100.0 + r.expert if r.drive == 0 else 1.0) for r in Manifest.load(store).experts
    }


def heat_per_drive(manifest: Manifest, heat: dict, layer: int | None = None) -> list[float]:
    out = [0.0] * len(manifest.drives)
    for r in manifest.experts:
        if layer is None or r.layer == layer:
            out[r.drive] += heat.get(r.key, 0.0)
    return out


def busiest_over_mean(values: list[float]) -> float:
    return max(values) / (sum(values) / len(values))


def same_output(store: Path, pristine) -> None:
    m = Model.open(store, expert_bytes=0, prefetch=True)
    try:
        assert m.generate(PROMPT, max_new_tokens=10) == pristine[1]
        assert torch.equal(m.forward_logits(PROMPT), pristine[2])
    finally:
        m.close()


def test_rebalance_spreads_heat_and_keeps_the_output(store, pristine) -> None:
    heat = skewed_heat(store)
    old = Manifest.load(store)
    assert (
        busiest_over_mean(heat_per_drive(old, heat)) > 2.5
    )  # the setup placement really is skewed
    assert rebalance(store, heat)[2]  # moved
    new = Manifest.load(store)
    assert new.pack_generation == 1
    # measured from the new manifest itself, not from what rebalance reports
    assert busiest_over_mean(heat_per_drive(new, heat)) < 1.1
    for layer in {r.layer for r in new.experts}:
        # a layer with 5 hot experts on 3 drives cannot be even: compare with the best any split can do
        per_drive = heat_per_drive(new, heat, layer)
        best = max(
            max(heat[r.key] for r in new.experts if r.layer == layer), sum(per_drive) / DRIVES
        )
        assert max(per_drive) <= 1.25 * best
    sizes = [sum(r.length for r in new.experts if r.drive == d) for d in range(DRIVES)]
    assert max(sizes) <= 1.5 * min(sizes)  # cold experts even out the bytes
    assert {r.key: r.sha256 for r in new.experts} == {r.key: r.sha256 for r in old.experts}
    for d in range(DRIVES):
        assert (
            not (store / f"d{d}" / pack_name(d)).exists()
            and (store / f"d{d}" / pack_name(d, 1)).exists()
        )
    assert check_store(store, progress=False).ok  # every record re-verified against its sha256
    same_output(store, pristine)
    assert rebalance(store, heat)[2] is False  # already balanced: nothing rewritten


def _crash_at(store: str, heat: list, stage: str) -> None:
    def fault(name: str) -> None:
        if name == stage:
            os._exit(3)  # a crash: no cleanup, no finally blocks

    rebalance(Path(store), {tuple(k): v for k, v in heat}, fault=fault)


@pytest.mark.parametrize("stage", ["copying", "written", "committed"])
def test_a_crash_at_any_stage_leaves_a_working_store_and_a_rerun_finishes(
    store, pristine, stage
) -> None:
    heat = skewed_heat(store)
    proc = mp.get_context("spawn").Process(
        target=_crash_at, args=(str(store), list(heat.items()), stage)
    )
    proc.start()
    proc.join(120)
    assert proc.exitcode == 3
    assert Manifest.load(store).pack_generation == (1 if stage == "committed" else 0)
    same_output(store, pristine)  # old packs before the commit point, new ones after
    rebalance(store, heat)
    assert Manifest.load(store).pack_generation == 1
    leftovers = sorted(p.name for d in range(DRIVES) for p in (store / f"d{d}").iterdir())
    assert leftovers == sorted(pack_name(d, 1) for d in range(DRIVES))
    same_output(store, pristine)


def test_refuses_without_heat_or_while_another_runs(store) -> None:
    with pytest.raises(StoreError, match="no expert heat"):
        rebalance(store, {})
    fd = os.open(store / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(StoreError, match="another `trace warm --rebalance` is running"):
            rebalance(store, skewed_heat(store))
    finally:
        os.close(fd)
    assert Manifest.load(store).pack_generation == 0


def test_cli_trace_warm_rebalance(store, pristine, tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    m = Model.open(store, expert_bytes=0, trace_path=trace)
    m.experts.uses.clear()  # the heat comes from the trace only
    m.generate(PROMPT, max_new_tokens=10)
    m.experts.uses.clear()
    m.close()
    proc = deltafind_cmd("trace", "warm", str(trace), "--store", str(store), "--rebalance")
    assert proc.returncode == 0, proc.stderr
    heat = read_heat(store)
    assert heat == pytest.approx(
        {k: float(v) for k, v in heat_from_trace(read_trace(trace)).items()}
    )
    manifest = Manifest.load(store)
    if "rebalanced" in proc.stdout:
        assert manifest.pack_generation == 1
    else:
        assert "placement kept" in proc.stdout and manifest.pack_generation == 0
    assert busiest_over_mean(heat_per_drive(manifest, heat)) < 1.15
    same_output(store, pristine)
