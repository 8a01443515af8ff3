"""Synthetic checkpoints: seeded random weights of a family's real layout, as a setup `Source`.

Each family (synthetic_families.py, synthetic_k3.py) has shapes that yield (config, tensor specs, tokenizer writer);
tensors are generated one at a time from a seed derived from (seed, name), so
setup streams them to disk and the same seed always gives the same store. Also
exports a source as an HF folder (sharded, indexed, optionally prefixed).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch

from deltafind.errors import StoreError
from deltafind.importer import synthetic_families, synthetic_k3
from deltafind.importer.sources import Source, TensorInfo
from deltafind.importer.synthetic_families import Family, Spec, draw, linear, norm

__all__ = [
    "FAMILIES",
    "Family",
    "Spec",
    "SyntheticSource",
    "draw",
    "linear",
    "norm",
    "open_synthetic",
    "write_hf_folder",
]

SYNTHETIC_VERSION = 1


FAMILIES: dict[str, Family] = {**synthetic_families.FAMILIES, **synthetic_k3.FAMILIES}


class SyntheticSource(Source):
    """A family's layout with seeded random weights; nothing is held beyond the tensor asked for."""

    parallel_load = True  # each tensor from its own generator

    def __init__(self, family: str, shape: str, seed: int = 0) -> None:
        if family not in FAMILIES:
            raise StoreError(
                f"no synthetic layout for family {family!r} (have: {', '.join(sorted(FAMILIES))})"
            )
        fam = FAMILIES[family]
        if shape not in fam.shapes:
            raise StoreError(
                f"synthetic {family} has no shape {shape!r} (have: {', '.join(fam.shapes)})"
            )
        self.family, self.shape, self.seed = family, shape, seed
        self.dims = fam.shapes[shape]
        self.path = Path(f"synthetic:{family}:{shape}:seed{seed}")
        self.config, self.specs = fam.build(self.dims)
        self.tensors = {n: TensorInfo(s.dtype, s.shape) for n, s in self.specs.items()}
        self._write_tokenizer = fam.write_tokenizer

    def load(self, name: str) -> torch.Tensor:
        return draw(self.specs[name], f"{self.seed}:{name}")

    def fingerprint(self) -> str:
        return hashlib.sha256(
            f"{self.path}:v{SYNTHETIC_VERSION}:{json.dumps(self.config, sort_keys=True)}".encode()
        ).hexdigest()

    def write_tokenizer(self, dest: Path) -> list[str]:
        return self._write_tokenizer(Path(dest), self.dims)


def open_synthetic(family: str, shape: str, seed: int = 0) -> SyntheticSource:
    return SyntheticSource(family, shape, seed)


def write_hf_folder(
    source: Source,
    folder: Path,
    num_shards: int = 2,
    prefix: str = "",
    extra: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `source` as an HF folder: config.json, model-*-of-*.safetensors + index, tokenizer files.

    Names get `prefix` (e.g. "language_model." for K3's layout); `extra` tensors
    (vision towers and the like) are added as given. Tensors of one layer stay in one shard.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(source.tensors, key=_layer_key)
    per = math.ceil(len(names) / num_shards)
    shards: list[list[str]] = []
    for name in names:  # start a new shard only at a layer boundary
        if not shards or (
            len(shards[-1]) >= per
            and _layer_key(name)[0] != _layer_key(shards[-1][-1])[0]
            and len(shards) < num_shards
        ):
            shards.append([])
        shards[-1].append(name)
    weight_map, total = {}, 0
    for i, group in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):06d}.safetensors"
        tensors = {prefix + n: source.load(n).contiguous() for n in group}
        if i == len(shards) and extra:
            tensors.update(extra)
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (folder / "config.json").write_text(json.dumps(source.config, indent=1))
    source.write_tokenizer(folder)
    return folder


def _layer_key(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (
        int(parts[2]) if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() else -1,
        name,
    )
