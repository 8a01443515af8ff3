"""The store-backed `ExpertProvider`: manifest lookup, cache, reads, stats."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from deltafind.errors import CorruptExpertError
from deltafind.store.cache import ByteLRU
from deltafind.store.manifest import ExpertRecord, Manifest
from deltafind.store.provider import Expert
from deltafind.store.reader import PackReader, record_tensors


@dataclass
class ExpertStats:
    requested: int = 0
    read: int = 0
    bytes_read: int = 0
    read_s: float = 0.0


class StoreExperts:
    """Experts of one store, read on demand through a byte-budgeted LRU."""

    def __init__(self, manifest: Manifest, store_dir: Path, cache_bytes: int | None = None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self.manifest = manifest
        self.reader = PackReader(manifest, Path(store_dir))
        self.cache: ByteLRU[tuple[int, int], Expert] = ByteLRU(cache_bytes)
        self.dtype, self.device = dtype, torch.device(device)
        self._records: dict[tuple[int, int], ExpertRecord] = {r.key: r for r in manifest.experts}
        self._counts = manifest.expert_counts()
        self.stats = ExpertStats()

    def num_experts(self, layer_idx: int) -> int:
        return self._counts.get(layer_idx, 0)

    def fetch(self, layer_idx: int, expert_ids: Sequence[int]) -> Iterator[tuple[int, Expert]]:
        for expert_idx in dict.fromkeys(expert_ids):
            self.stats.requested += 1
            key = (layer_idx, expert_idx)
            expert = self.cache.get(key)
            if expert is None:
                expert = self._load(key)
                self.cache.put(key, expert, expert.nbytes)
            yield expert_idx, expert

    def _load(self, key: tuple[int, int]) -> Expert:
        rec = self._records.get(key)
        if rec is None:
            raise CorruptExpertError(f"expert {key[1]} of layer {key[0]} is not in this store's manifest")
        before = self.reader.read_s
        buf = self.reader.read(rec)
        self.stats.read += 1
        self.stats.bytes_read += rec.length
        self.stats.read_s += self.reader.read_s - before
        # Views over `buf` when dtype and device already match (the tensors keep it alive).
        tensors = {n: t.to(device=self.device, dtype=self.dtype) for n, t in record_tensors(rec, buf).items()}
        return Expert(tensors, sum(t.numel() * t.element_size() for t in tensors.values()))

    def close(self) -> None:
        self.reader.close()

