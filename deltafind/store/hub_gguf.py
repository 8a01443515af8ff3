"""GGUF repositories on a hub: `setup --from ORG/NAME:QUANT`, llama.cpp's `-hf` convention.

`pick_quant` chooses the quant's files from a repository's file list as llama.cpp's
common/download.cpp does: the tag matched case-insensitively, Q4_K_M then Q8_0 when none is
given, every shard of a split file; unlike llama.cpp, an ambiguous tag is refused, not guessed.
store/hub.py downloads and verifies the files and hands the first one's path to the GGUF import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from deltafind.errors import StoreError

SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})$", re.I)
TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.I)  # llama.cpp's quant tag: the last word of the name
SIDECARS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")  # GGUFs that are not the model
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")


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
            raise StoreError(f"{where}: the split file {self.prefix} has {self.count} shards but {names} is not there; "
                             "a part of a model cannot be imported (pick another quant or @REVISION; offline, unset HF_HUB_OFFLINE)")
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
        m.label = name[len(common):] or (tag[1] if tag else name)
    return found


def _common_prefix(names: list[str]) -> str:
    """The shared start of the names, cut after a `-` or `.` (`Qwen3-30B-A3B-` of `...-Q4_K_M`, `...-UD-Q2_K_XL`);
    not after `_`, which is inside quant names (`m-Q4_0`, `m-Q4_1`)."""
    lo, hi = min(names), max(names)
    n = 0
    while n < len(lo) and lo[n] == hi[n]:
        n += 1
    cut = max(lo.rfind(c, 0, n) for c in "-.")
    return lo[: cut + 1]


def pick_quant(files: Iterable[str], tag: str | None, where: str) -> list[str]:
    """The files of the quant `tag` (None: llama.cpp's default), first shard first."""
    models = gguf_models(files)
    if not models:
        raise StoreError(f"{where}: no model .gguf files in the repository; :QUANT picks a quant of a GGUF repository "
                         "(for a safetensors repository give ORG/NAME[@REVISION] without it)")
    have = ", ".join(m.label for m in models)
    for t in [tag] if tag else DEFAULT_TAGS:
        # llama.cpp: the tag followed by `.` or `-`, anywhere in the path, any case
        pattern = re.compile(re.escape(t) + r"[.-]", re.I)
        hits = [m for m in models if any(pattern.search(p) for p in m.shards.values())]
        exact = [m for m in hits if m.label.lower() == t.lower()]
        if len(hits) == 1 or len(exact) == 1:
            return (hits if len(hits) == 1 else exact)[0].files(where)
        if hits:
            raise StoreError(f"{where}: quant {t!r} matches {len(hits)} files ({', '.join(m.prefix for m in hits)}); "
                             f"give one of the repository's quants exactly: {have}")
    if tag is None and len(models) == 1:  # llama.cpp falls back to the model file when no tag is given
        return models[0].files(where)
    asked = f"quant {tag!r}" if tag else f"no quant given, and neither default ({' nor '.join(DEFAULT_TAGS)})"
    raise StoreError(f"{where}: {asked} is not in the repository; it has: {have} (give one as ORG/NAME:QUANT)")


def local_gguf(folder: Path, tag: str | None, where: str) -> Path:
    """The quant's first shard in a local snapshot of the repository (HF_HUB_OFFLINE)."""
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf")]
    names = pick_quant(files, tag, where)
    return folder / names[0]
