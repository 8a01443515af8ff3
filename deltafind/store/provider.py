"""The interface between a model and wherever its experts live.

A model asks an `ExpertProvider` for the experts its router chose at one layer
and gets tensors back; it never knows about drives, packs or caches. This
module must not import anything from the rest of `deltafind.store`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class Expert:
    """One routed expert (or one slice of a dense MLP) as tensors.

    `tensors` uses HF names without the layer prefix: `gate_proj`, `up_proj`
    (both [intermediate, hidden]) and `down_proj` ([hidden, intermediate]).
    """

    tensors: Mapping[str, torch.Tensor]
    nbytes: int
    quant: Mapping[str, str] = field(default_factory=dict)  # GGUF blocks: tensor name -> "KIND/COLS" (store/quant.py)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class ExpertProvider(Protocol):
    """Source of expert weights for a model's MoE layers."""

    def num_experts(self, layer_idx: int) -> int:
        """How many experts (or dense slices) layer `layer_idx` has; 0 if none."""
        ...

    def fetch(self, layer_idx: int, expert_ids: Sequence[int]) -> Iterator[tuple[int, Expert]]:
        """Yield `(expert_id, Expert)` once for each distinct requested id.

        Order is completion order, so a caller can compute on the first expert
        while later ones are still being read.
        """
        ...


class DictExpertProvider:
    """Experts held in memory, keyed by (layer, expert): tests and tiny models."""

    def __init__(self, experts: Mapping[tuple[int, int], Mapping[str, torch.Tensor]]) -> None:
        self._experts = {
            key: Expert(dict(t), sum(v.numel() * v.element_size() for v in t.values()))
            for key, t in experts.items()
        }
        self._counts: dict[int, int] = {}
        for layer_idx, expert_idx in self._experts:
            self._counts[layer_idx] = max(self._counts.get(layer_idx, 0), expert_idx + 1)

    def num_experts(self, layer_idx: int) -> int:
        return self._counts.get(layer_idx, 0)

    def fetch(self, layer_idx: int, expert_ids: Sequence[int]) -> Iterator[tuple[int, Expert]]:
        for expert_idx in dict.fromkeys(expert_ids):
            yield expert_idx, self._experts[(layer_idx, expert_idx)]
