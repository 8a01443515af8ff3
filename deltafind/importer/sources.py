"""Checkpoint readers for setup: a HuggingFace folder here, a GGUF file in importer/gguf_source.py.

Both present the same face: an HF-style config dict, tensor metadata (name ->
dtype, shape) without loading anything, and `load(name)` for one tensor at a
time, so setup never holds more than the group it is writing.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deltafind.errors import StoreError, UnsupportedModelError
from deltafind.store.spine import SAFETENSORS_DTYPES


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    quant: str = ""  # GGUF blocks kept as stored: "KIND/COLS", dtype uint8, shape [rows, row_bytes] (store/quant.py)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Source:
    """Base face of a checkpoint reader."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    # `load` may run on several threads at once (setup prepares records ahead of its writer)
    parallel_load: bool = False

    def load(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError

    def write_tokenizer(self, dest: Path) -> list[str]:
        raise NotImplementedError

    def begin_import(self, spine: list[str], records: list[str]) -> None:
        """Setup is about to read: `spine` are the names it writes to the spine, `records` those it
        writes into expert records (anything else it leaves out)."""

    def durable(self, names: list[str]) -> None:
        """Every expert record made from `names` is in the packs and journaled: a source may free what
        only they needed (`--delete-source`: importer/hub.py, importer/gguf_delete.py)."""

    def end_import(self) -> None:
        """Setup finished: a source may free what it fetched (importer/hub.py's --delete-source)."""


def stat_fingerprint(paths: list[Path], extra: bytes = b"") -> str:
    h = hashlib.sha256(extra)
    for p in sorted(paths):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


# Multimodal wrappers (Kimi K3) keep the text model under a prefix next to vision tensors.
LANGUAGE_PREFIX = "language_model."


def import_names(config: dict[str, Any], names: Iterable[str]) -> dict[str, str]:
    """Checkpoint tensor name -> the name setup imports it under. When config.json has a
    `text_config` and the tensors carry `language_model.`, only those, without the prefix
    (the vision tower and projector are left out)."""
    names = list(names)
    if "text_config" in config and any(n.startswith(LANGUAGE_PREFIX) for n in names):
        return {n: n[len(LANGUAGE_PREFIX) :] for n in names if n.startswith(LANGUAGE_PREFIX)}
    return {n: n for n in names}


def tensor_info(where: str, name: str, dtype_code: str, shape: tuple[int, ...]) -> TensorInfo:
    """A safetensors header entry as setup imports it."""
    dtype = SAFETENSORS_DTYPES.get(dtype_code)
    if dtype is None:
        raise UnsupportedModelError(
            f"{where}: tensor {name} has dtype {dtype_code}, which setup cannot import yet"
        )
    return TensorInfo(dtype, shape)


class HFSource(Source):
    """A HuggingFace model folder: config.json + *.safetensors (indexed or not) + tokenizer files,
    named as `import_names` says."""

    parallel_load = True  # safetensors' mapped reads

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        cfg = self.path / "config.json"
        if not cfg.exists():
            raise StoreError(
                f"{self.path}: no config.json; --from must be a HuggingFace model folder or a .gguf file"
            )
        self.config = json.loads(cfg.read_text())
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            self.files = [self.path / f for f in files]
        else:
            self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise StoreError(
                f"{self.path}: no *.safetensors files (pytorch .bin checkpoints are not supported; convert them with transformers' save_pretrained)"
            )
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, tuple[Path, str]] = {}
        self.tensors = {}
        raw: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        for f in self.files:
            if not f.exists():
                raise StoreError(f"{f}: listed in model.safetensors.index.json but missing")
            h = self._handles[f] = safe_open(str(f), "pt")
            for name in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                sl = h.get_slice(name)
                raw[name] = (f, sl.get_dtype(), tuple(sl.get_shape()))
        for orig, name in import_names(self.config, raw).items():
            f, dtype_code, shape = raw[orig]
            self.tensors[name] = tensor_info(str(f), orig, dtype_code, shape)
            self._where[name] = (f, orig)

    def load(self, name: str) -> torch.Tensor:
        f, orig = self._where[name]
        return self._handles[f].get_tensor(orig)

    def fingerprint(self) -> str:
        return stat_fingerprint(self.files, (self.path / "config.json").read_bytes())

    def write_tokenizer(self, dest: Path) -> list[str]:
        from deltafind.tokenizer import copy_tokenizer_files

        return copy_tokenizer_files(self.path, dest)
