"""How many routed experts each routed layer of a store's model has (its net built without weights).

The coordinator sends those layers' rows to the expert nodes; a node runs the very function the
layer's module would run on one machine (`net.routed_runs()`, models/contract.py).
"""

from __future__ import annotations

import torch

from deltafind.models.registry import family_module
from deltafind.provider import ExpertProvider
from deltafind.store.manifest import Manifest


class _Counts(ExpertProvider):
    def __init__(self, counts: dict[int, int]) -> None:
        self.counts = counts

    def num_experts(self, layer_idx: int) -> int:
        return self.counts.get(layer_idx, 0)


def routed_counts(manifest: Manifest) -> dict[int, int]:
    """layer -> routed experts of a store's model (its modules built without weights)."""
    counts = manifest.expert_counts()
    family = family_module(manifest.family)
    with torch.device("meta"):
        net = family.Model(family.ModelArgs.from_config(manifest.model_config), _Counts(counts))
    return {layer: counts[layer] for layer in sorted(net.routed_runs())}
