"""`setup --from FILE.gguf --delete-source`: a local GGUF, whole or split, is deleted as the store takes it.

The reference is the same file imported without deleting anything (importer/setup.py from a copy): the
store made while the shards go must hold the very same spine and records. A split file's first shard
goes once layer 0's records are journaled; a setup killed right after resumes without it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deltafind.errors import StoreError
from deltafind.importer.gguf_delete import STAGING_DIR
from deltafind.importer.hub import locate_checkpoint, open_checkpoint
from deltafind.importer.setup import setup_store
from deltafind.run_cli import demo_gguf_path
from deltafind.store.manifest import Manifest
from tests.conftest import deltafind_cmd
from tests.gguf_models import EXPERTS, make_qwen3moe


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    root = tmp_path_factory.mktemp("gguf")
    (root / "whole").mkdir()
    (root / "split").mkdir()
    return {
        "whole": make_qwen3moe(seed=5).write(root / "whole" / "moe.gguf"),
        "split": make_qwen3moe(seed=5).write(root / "split" / "moe.gguf", shards=2),
    }


@pytest.fixture(scope="module")
def reference(ggufs: dict[str, list[Path]], tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    return setup_store(ggufs["split"][0], tmp_path_factory.mktemp("ref") / "s", progress=False)


def _copy(files: list[Path], dest: Path) -> list[Path]:
    dest.mkdir()
    return [Path(shutil.copy(f, dest / f.name)) for f in files]


def _same_store(store: Path, ref: Manifest) -> None:
    got = Manifest.load(store)
    assert got.spine_sha256 == ref.spine_sha256
    assert [(r.key, r.sha256) for r in got.experts] == [(r.key, r.sha256) for r in ref.experts]


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


def test_a_whole_gguf_is_deleted_once_the_store_is_written(
    ggufs: dict[str, list[Path]], reference: Manifest, tmp_path: Path
) -> None:
    (src,) = _copy(ggufs["whole"], tmp_path / "src")
    store = tmp_path / "s"
    proc = deltafind_cmd("setup", "--from", str(src), "--store", str(store), "--delete-source")
    assert proc.returncode == 0, proc.stderr
    assert "store ready" in proc.stdout
    assert not src.exists() and not (store / STAGING_DIR).exists()
    _same_store(store, reference)  # the whole file and its two shards hold the same tensors


def test_a_split_gguf_goes_shard_by_shard_and_a_killed_setup_resumes_without_them(
    ggufs: dict[str, list[Path]], reference: Manifest, tmp_path: Path
) -> None:
    first, second = _copy(ggufs["split"], tmp_path / "src")
    store = tmp_path / "s"
    source = open_checkpoint(str(first), store, delete_source=True)
    with pytest.raises(KeyboardInterrupt):  # killed once layer 0's records (all in shard 1) are in
        setup_store(source, store, progress=False, fault_after=EXPERTS)
    assert not first.exists() and second.exists()  # shard 2 still holds records to write
    assert not _mapped(first)  # unmapped too, so its disk is free now, not at exit
    kept = (store / STAGING_DIR / first.name).stat()  # its header, sparse: the size, not the disk
    assert kept.st_size == ggufs["split"][0].stat().st_size > 2 * kept.st_blocks * 512

    # A shard setup did not delete is missing: refused, naming it.
    moved = shutil.move(second, tmp_path / second.name)
    with pytest.raises(StoreError, match=rf"shard\(s\) missing: {second.name};"):
        open_checkpoint(str(first), store, delete_source=True)
    shutil.move(moved, second)

    # The same command again: shard 1 is read from its kept header and staged spine tensors.
    source = open_checkpoint(str(first), store, delete_source=True)
    setup_store(source, store, progress=False)
    _same_store(store, reference)
    assert not first.exists() and not second.exists() and not (store / STAGING_DIR).exists()
    with pytest.raises(StoreError, match="holds a finished store, and the GGUF is gone"):
        open_checkpoint(str(first), store, delete_source=True)  # the same command once more


def test_delete_source_refuses_a_local_folder(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"or a local \.gguf file .* not a local folder"):
        locate_checkpoint(str(tmp_path), tmp_path / "s", delete_source=True)


def test_delete_source_never_touches_the_bundled_demo(tmp_path: Path) -> None:
    proc = deltafind_cmd("setup", "--demo", "--store", str(tmp_path / "s"), "--delete-source")
    assert proc.returncode != 0 and "drop --delete-source" in proc.stderr
    assert demo_gguf_path().exists() and not (tmp_path / "s").exists()
