"""Open a checkpoint for import by what is on disk: a HuggingFace folder (importer/sources.py) or a GGUF
file or any shard of a split one (importer/gguf_source.py). The one place that tells them apart.
"""

from __future__ import annotations

from pathlib import Path

from deltafind.errors import StoreError
from deltafind.importer.gguf_source import GGUFOptions, GGUFSource
from deltafind.importer.sources import HFSource, Source


def open_source(path: Path, options: GGUFOptions | None = None) -> Source:
    """The reader for `path`: a HuggingFace folder, or a GGUF file or shard (importer/gguf_source.py;
    `options`: what a GGUF import may do beyond taking the file as it is)."""
    path = Path(path)
    if not path.exists():
        raise StoreError(
            f"{path}: no such file or folder (--from takes a HuggingFace model folder or a .gguf file)"
        )
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise StoreError(
                f"{path}: not a GGUF file (bad magic {magic!r}); --from takes a HuggingFace model folder or a .gguf file"
            )
        return GGUFSource(path, options)
    return HFSource(path)
