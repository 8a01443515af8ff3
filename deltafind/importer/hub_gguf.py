"""GGUF repositories on a hub: `setup --from ORG/NAME:QUANT`, llama.cpp's `-hf` convention.

`pick_quant` chooses the quant's files from a repository's file list as llama.cpp's
common/download.cpp does: the tag matched case-insensitively, Q4_K_M then Q8_0 when none is
given, every shard of a split file; unlike llama.cpp, an ambiguous tag is refused, not guessed.
importer/hub.py downloads and verifies the files and hands the first one's path to the GGUF import;
`GGUFHubSource` reads them by range instead, for `setup --streaming`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deltafind.errors import StoreError
from deltafind.importer.gguf_source import GGUFOptions, GGUFSource
from deltafind.store.remote import RangeClient, RemoteTensor

SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})$", re.I)
TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.I)  # llama.cpp's quant tag: the last word of the name
SIDECARS = (
    "mmproj",
    "imatrix",
    "mtp-",
    "eagle3-",
    "dflash-",
    "dspark-",
)  # GGUFs that are not the model
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
HEADERS_DIR = (
    ".hub-gguf-headers"  # sparse local shards of a streaming install, gone once it is written
)
HEADER_GUESS = (
    256 << 10
)  # first prefix fetched; a large model's header (its vocabulary) takes a few MiB: 3-4 tries


@dataclass
class GGUFModel:
    """One model file, or one split file's shards (`-00001-of-00003.gguf`), in a repository."""

    prefix: str  # the path without `.gguf` and the split suffix
    count: int
    shards: dict[int, str] = field(default_factory=dict)  # shard number -> path
    label: str = ""  # what a user types after the colon

    def files(self, where: str) -> list[str]:
        missing = [n for n in range(1, self.count + 1) if n not in self.shards]
        if missing:
            names = ", ".join(f"{self.prefix}-{n:05d}-of-{self.count:05d}.gguf" for n in missing)
            raise StoreError(
                f"{where}: the split file {self.prefix} has {self.count} shards but {names} is not there; "
                "a part of a model cannot be imported (pick another quant or @REVISION; offline, unset HF_HUB_OFFLINE)"
            )
        return [self.shards[n] for n in range(1, self.count + 1)]


def is_model_gguf(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".gguf") and not any(s in name for s in SIDECARS)


def gguf_models(files: Iterable[str]) -> list[GGUFModel]:
    """The repository's model GGUFs, shards grouped, each labelled by the part of its name that differs."""
    models: dict[tuple[str, int], GGUFModel] = {}
    for path in sorted(f for f in files if is_model_gguf(f)):
        stem = path[: -len(".gguf")]
        no, count = 1, 1
        if m := SPLIT.match(stem):
            stem, no, count = m["prefix"], int(m["no"]), int(m["count"])
        models.setdefault((stem, count), GGUFModel(stem, count)).shards[no] = path
    found = list(models.values())
    names = [m.prefix.rsplit("/", 1)[-1] for m in found]
    common = _common_prefix(names) if len(names) > 1 else ""
    for m, name in zip(found, names, strict=True):
        tag = TAG.search(name)
        m.label = name[len(common) :] or (tag[1] if tag else name)
    return found


def _common_prefix(names: list[str]) -> str:
    """The shared start of the names, cut after a `-` or `.` (`Qwen3-30B-A3B-` of `...-Q4_K_M`, `...-UD-Q2_K_XL`);
    not after `_`, which is inside quant names (`m-Q4_0`, `m-Q4_1`)."""
    common = os.path.commonprefix(names)  # noqa: RUF071 - file names, compared by character
    return common[: max(common.rfind(c) for c in "-.") + 1]


def pick_quant(files: Iterable[str], tag: str | None, where: str) -> list[str]:
    """The files of the quant `tag` (None: llama.cpp's default), first shard first."""
    models = gguf_models(files)
    if not models:
        raise StoreError(
            f"{where}: no model .gguf files in the repository; :QUANT picks a quant of a GGUF repository "
            "(for a safetensors repository give ORG/NAME[@REVISION] without it)"
        )
    have = ", ".join(m.label for m in models)
    for t in [tag] if tag else DEFAULT_TAGS:
        # llama.cpp: the tag followed by `.` or `-`, anywhere in the path, any case
        pattern = re.compile(re.escape(t) + r"[.-]", re.I)
        hits = [m for m in models if any(pattern.search(p) for p in m.shards.values())]
        exact = [m for m in hits if m.label.lower() == t.lower()]
        if len(hits) == 1 or len(exact) == 1:
            return (hits if len(hits) == 1 else exact)[0].files(where)
        if hits:
            raise StoreError(
                f"{where}: quant {t!r} matches {len(hits)} files ({', '.join(m.prefix for m in hits)}); "
                f"give one of the repository's quants exactly: {have}"
            )
    # llama.cpp falls back to the model file when no tag is given
    if tag is None and len(models) == 1:
        return models[0].files(where)
    asked = (
        f"quant {tag!r}"
        if tag
        else f"no quant given, and neither default ({' nor '.join(DEFAULT_TAGS)})"
    )
    raise StoreError(
        f"{where}: {asked} is not in the repository; it has: {have} (give one as ORG/NAME:QUANT)"
    )


def local_gguf(folder: Path, tag: str | None, where: str) -> Path:
    """The quant's first shard in a local snapshot of the repository (HF_HUB_OFFLINE)."""
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf")]
    return folder / pick_quant(files, tag, where)[0]


class GGUFHubSource(GGUFSource):
    """A quant's shards on a hub, read by range for `setup --streaming` (not downloaded whole).

    Each shard's header goes into a sparse local file of the shard's size, which gguf-py parses as it
    parses a whole file; a spine tensor's bytes are fetched into it when the import reads it. `remote`
    holds each routed expert's span: llama.cpp stacks experts in `ffn_*_exps` with the expert index
    outermost (ggml's ne[2]), so one expert is a contiguous slice, and the store keeps it byte for byte.
    Spine tensors are not in `remote`: some are changed at import (q/k rows, MLA's kv_b).
    """

    parallel_load = False  # fetches into sparse shards, one tensor at a time

    streaming = True

    def __init__(
        self,
        repo: Any,
        names: list[str],
        store_dir: Path,
        options: GGUFOptions | None = None,
    ) -> None:
        """`repo`: importer/hub_repo.py's HubRepo; `names`: the quant's shards."""
        self.repo, self.shards = repo, names
        self.client = RangeClient(repo.repo_id, repo.commit, repo.endpoint)
        self.headers = Path(store_dir) / HEADERS_DIR
        self.headers.mkdir(parents=True, exist_ok=True)
        self._file_of: dict[str, str] = {}  # GGUF tensor name -> its shard in the repository
        self._fetched: set[str] = set()
        local = [self._sparse(n) for n in names]
        super().__init__(local[0], options)
        self.path = Path(f"{repo.label}:{names[0]}")
        self.remote = {
            hf: self._span(hf, t, e)
            for hf, (t, e, *_) in self._load.items()
            if not isinstance(t, str) and e is not None
        }

    def _map_tensors(self, by_name: dict[str, Any]) -> None:
        """Refuse, before any tensor is mapped, an architecture that rewrites its experts at import."""
        if self.arch.tensors is not None:
            raise StoreError(
                f"{self.repo.label}:{self.shards[0]}: a {self.arch.family} GGUF's experts are rewritten "
                "at import (llama.cpp's MXFP4 blocks back into the release's packs), so they cannot be "
                "fetched by range as stored; drop --streaming to download the quant whole, or stream "
                "the model's HF release instead (its experts are fetched as stored)"
            )
        super()._map_tensors(by_name)

    def _sparse(self, name: str) -> Path:
        """A sparse local copy of shard `name` holding its header: a prefix fetched and parsed, four
        times longer until gguf-py's parse ends inside it (zeros past it would parse as garbage)."""
        import gguf

        size = self.repo.files[name].size
        if not size:
            raise StoreError(
                f"{self.client.url(name)}: the hub lists no size for this file, so it cannot be read by range; drop --streaming"
            )
        path = self.headers / Path(name).name
        n = min(size, HEADER_GUESS)
        while True:
            with open(path, "wb") as f:
                f.write(self.client.get(name, 0, n))
                f.truncate(size)
            try:
                if gguf.GGUFReader(str(path)).data_offset <= n:
                    return path
            except Exception as e:  # a header cut short: gguf-py raises what it meets
                if n >= size:
                    raise StoreError(
                        f"{self.client.url(name)}: not a readable GGUF file ({e})"
                    ) from e
            if n >= size:
                raise StoreError(
                    f"{self.client.url(name)}: its GGUF header runs past the end of the file; the file is truncated"
                )
            n = min(size, n * 4)

    def _open(self, path: Path) -> Any:
        reader = super()._open(path)
        name = next(n for n in self.shards if Path(n).name == path.name)
        for t in reader.tensors:
            self._file_of[t.name] = name
            if t.name == "rope_freqs.weight":  # read into the config before any load
                self._fetch(t)
        return reader

    def _fetch(self, t: Any) -> None:
        """Write tensor `t`'s bytes into its sparse shard, once."""
        if t.name in self._fetched:
            return
        name = self._file_of[t.name]
        start = int(t.data_offset)
        data = self.client.get(name, start, start + int(t.n_bytes))
        with open(self.headers / Path(name).name, "r+b") as f:
            f.seek(start)
            f.write(data)
        self._fetched.add(t.name)

    def _span(self, hf: str, t: Any, expert: int) -> RemoteTensor:
        if any(t.name == wide for wide, *_ in self._wide):
            raise StoreError(
                f"{self.path}: expert tensor {t.name} is {t.tensor_type.name}, which deltafind widens to float32 at import; "
                "a streaming install fetches experts as stored: drop --streaming to import this quant whole"
            )
        per = int(t.n_bytes) // int(t.shape[-1])
        start = int(t.data_offset) + expert * per
        return RemoteTensor(
            self._file_of[t.name],
            t.name,
            t.tensor_type.name,
            self.tensors[hf].shape,
            start,
            start + per,
        )

    def load(self, name: str) -> torch.Tensor:
        entry = self._load[name]
        for t in entry[1:3] if entry[0] == "kv_b" else entry[:1]:
            self._fetch(t)
        return super().load(name)

    def fingerprint(self) -> str:
        files = [f"{n}:{self.repo.files[n].size}:{self.repo.files[n].sha256}" for n in self.shards]
        return hashlib.sha256("\n".join([self.repo.label, *files]).encode()).hexdigest()

    def end_import(self) -> None:
        shutil.rmtree(self.headers, ignore_errors=True)
