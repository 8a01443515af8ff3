"""`setup --from FILE.gguf --delete-source`: a local GGUF, whole or split, deleted shard by shard.

A shard goes once every expert record made from it is in the packs and journaled (importer/setup.py
calls `durable`) and its spine tensors are staged in `STORE/.gguf-staging`, where a copy of its
header (sparse, the size of the shard) stays: a killed setup resumes from the journal without the
shard. The other shards go after the store is written and opened (`end_import`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from deltafind.errors import StoreError
from deltafind.importer.gguf_source import GGUFOptions, GGUFSource, split_paths
from deltafind.importer.sources import stat_fingerprint
from deltafind.importer.spine_writer import stage_tensors
from deltafind.log import get_logger
from deltafind.store.manifest import MANIFEST_NAME, fsync_dir

log = get_logger(__name__)
STAGING_DIR = ".gguf-staging"
FINGERPRINT = "fingerprint"  # the shards' fingerprint while they were all there: a resume's params
KEPT_DATA = ("rope_freqs.weight",)  # tensors read into the config, kept with the header


def has_kept_copy(path: Path, store_dir: Path) -> bool:
    """Whether an interrupted `--delete-source` setup into `store_dir` deleted `path` and kept its header."""
    return (Path(store_dir) / STAGING_DIR / Path(path).name).exists()


class GGUFDeletingSource(GGUFSource):
    """A local GGUF that `--delete-source` frees as the import makes each shard redundant."""

    parallel_load = False  # shards are swapped and deleted as records become durable

    def __init__(self, path: Path, store_dir: Path, options: GGUFOptions | None = None) -> None:
        self.staging = Path(store_dir) / STAGING_DIR
        self.originals = split_paths(Path(path))
        self._file_of: dict[str, str] = {}  # GGUF tensor name -> its shard's file name
        self._staged: dict[str, Any] = {}  # imported name -> handle of its staging file
        self._pending: dict[str, set[str]] = {}  # shard -> record tensors not yet durable
        self._spine: list[str] = []
        super().__init__(path, options)

    def _find_shards(self) -> list[Path]:
        """Each shard, or the copy of its header a killed setup kept when it deleted the shard."""
        found, missing = [], []
        for p in self.originals:
            copy = self.staging / p.name
            found.append(p if p.exists() else copy)
            if not p.exists() and not copy.exists():
                missing.append(p.name)
        if missing and (self.staging.parent / MANIFEST_NAME).exists():
            raise StoreError(
                f"{self.staging.parent}: holds a finished store, and the GGUF is gone ({', '.join(missing)}): "
                "a --delete-source setup deletes it once the store is written; nothing is left to import"
            )
        if missing:
            raise StoreError(
                f"{self.originals[0].parent}: GGUF shard(s) missing: {', '.join(missing)}; --delete-source "
                f"deletes a shard only once the store holds it (keeping its header in {self.staging}), so "
                "these went some other way: put them back and run the same setup again"
            )
        return found

    def _open(self, path: Path) -> Any:
        reader = super()._open(path)
        for t in reader.tensors:
            self._file_of[t.name] = path.name
        return reader

    def fingerprint(self) -> str:
        kept = self.staging / FINGERPRINT
        return kept.read_text() if kept.exists() else stat_fingerprint(self.originals)

    def _shards_of(self, name: str) -> set[str]:
        entry = self._load[name]
        tensors = entry[1:3] if entry[0] == "kv_b" else entry[:1]
        return {self._file_of[t.name] for t in tensors}

    def begin_import(self, spine: list[str], records: list[str]) -> None:
        from safetensors import safe_open

        self.staging.mkdir(parents=True, exist_ok=True)
        if not (self.staging / FINGERPRINT).exists():
            self._write_durable(self.staging / FINGERPRINT, self.fingerprint().encode())
        for f in sorted(self.staging.glob("*.spine.safetensors")):  # from a killed setup
            h = safe_open(str(f), "pt")
            self._staged.update(dict.fromkeys(h.keys(), h))
        self._spine = list(spine)
        for name in records:
            for shard in self._shards_of(name):
                self._pending.setdefault(shard, set()).add(name)

    def _write_durable(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)

    def _keep_header(self, shard: Path) -> None:
        """A sparse copy of `shard`: its header (and the tensors the config reads), zeros elsewhere."""
        reader = self._gguf.GGUFReader(str(shard))
        tmp = self.staging / (shard.name + ".tmp")
        with open(shard, "rb") as src, open(tmp, "wb") as dst:
            dst.write(src.read(int(reader.data_offset)))
            for t in reader.tensors:
                if t.name in KEPT_DATA:
                    src.seek(int(t.data_offset))
                    dst.seek(int(t.data_offset))
                    dst.write(src.read(int(t.n_bytes)))
            dst.truncate(shard.stat().st_size)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, self.staging / shard.name)
        fsync_dir(self.staging)

    def durable(self, names: list[str]) -> None:
        for name in names:
            for shard in self._shards_of(name):
                pending = self._pending.get(shard)
                if pending:
                    pending.discard(name)
                    if not pending:
                        self._free(shard)

    def _free(self, shard: str) -> None:
        """Stage the shard's spine tensors, then delete it and read its header from the copy."""
        spine = [n for n in self._spine if n not in self._staged and shard in self._shards_of(n)]
        if spine:
            dest = self.staging / f"{shard}.spine.safetensors"
            staged = stage_tensors(dest, {n: self.tensors[n] for n in spine}, self.load)
            self._staged.update(dict.fromkeys(spine, staged))
        original = next(p for p in self.originals if p.name == shard)
        if not original.exists():
            return  # deleted by a setup that was killed after it
        self._keep_header(original)
        self._reopen(shard)  # the file's pages are mapped: its disk is freed only once unmapped
        original.unlink()
        fsync_dir(original.parent)
        log.info("gguf_shard_deleted", shard=str(original))

    def _reopen(self, shard: str) -> None:
        copy = self.staging / shard
        reader = super()._open(copy)
        kept = {t.name: t for t in reader.tensors}

        def swap(x: Any) -> Any:
            hit = isinstance(x, self._gguf.ReaderTensor) and self._file_of.get(x.name) == shard
            return kept[x.name] if hit else x

        self._load = {k: tuple(swap(x) for x in v) for k, v in self._load.items()}
        i = next(i for i, p in enumerate(self.originals) if p.name == shard)
        self.files[i] = copy
        if i == 0:
            self.reader, self.first = reader, copy

    def load(self, name: str) -> torch.Tensor:
        if name in self._staged:
            return self._staged[name].get_tensor(name)
        gone = sorted(
            s for s in self._shards_of(name) if not (self.originals[0].parent / s).exists()
        )
        if gone:
            raise StoreError(
                f"{name}: its shard {gone[0]} was deleted by --delete-source before the store held this "
                f"tensor; the store cannot be finished: delete it and {self.staging.parent}, then set up from a fresh copy"
            )
        return super().load(name)

    def end_import(self) -> None:
        """The store is written and opened: the shards left go, and the staging folder."""
        self._staged.clear()
        for p in self.originals:
            if p.exists():
                p.unlink()
                log.info("gguf_shard_deleted", shard=str(p))
        fsync_dir(self.originals[0].parent)
        shutil.rmtree(self.staging, ignore_errors=True)
