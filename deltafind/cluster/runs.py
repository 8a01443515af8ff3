"""Which layers of a family's net have routed experts, and the function that runs one of them.

The coordinator sends those layers' rows to the expert nodes; a node runs the very function the
layer's module would run on one machine (`run(rows, expert)`), taken from the same family code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deltafind.models.registry import family_module
from deltafind.store.manifest import Manifest
from deltafind.store.provider import Expert, ExpertProvider

Run = Callable[[torch.Tensor, Expert], torch.Tensor]


def routed_runs(net: nn.Module) -> dict[int, Run]:
    """layer -> run for every routed MoE layer (a router `gate` and a `run`); dense slices are not routed."""
    out: dict[int, Run] = {}
    for module in net.modules():
        if hasattr(module, "gate") and callable(getattr(module, "run", None)) and isinstance(getattr(module, "layer_idx", None), int):
            out[module.layer_idx] = module.run
    return out


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
    return {layer: counts[layer] for layer in sorted(routed_runs(net))}
