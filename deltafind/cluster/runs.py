"""Which layers of a family's net have routed experts, and the function that runs one of them.

The coordinator sends those layers' rows to the expert nodes; a node runs the very function the
layer's module would run on one machine (`run(rows, expert)`), taken from the same family code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deltafind.store.provider import Expert

Run = Callable[[torch.Tensor, Expert], torch.Tensor]


def routed_runs(net: nn.Module) -> dict[int, Run]:
    """layer -> run for every routed MoE layer (a router `gate` and a `run`); dense slices are not routed."""
    out: dict[int, Run] = {}
    for module in net.modules():
        if hasattr(module, "gate") and callable(getattr(module, "run", None)) and isinstance(getattr(module, "layer_idx", None), int):
            out[module.layer_idx] = module.run
    return out
