"""The per-layer step every family's forward runs: the model's whole side of the provider contract.

A family supplies its layers' two halves (attention, then the FFN that takes
experts); this calls the `ExpertProvider` hooks around them in one order for
all families: `begin_step`, then per layer `enter_layer`, attention, the next
layer's `prefetch`, the FFN (whose dispatch reports routes and fetches).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from deltafind.models.ops.batch import Batch
from deltafind.store.provider import ExpertProvider


def run_layers(
    provider: ExpertProvider,
    batch: Batch,
    layers: Sequence[Any],
    x: torch.Tensor,
    first_hint: list[int] | None,
    attend: Callable[[int, Any, torch.Tensor], torch.Tensor],
    feed_forward: Callable[[int, Any, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Run `layers` over `batch` from hidden state x [T, H]; the last layer's output.

    `attend(i, layer, x)` returns the state layer i+1's router predicts from
    (`layer.predict_experts(state)`); `feed_forward(i, layer, state)` returns the
    layer's output, which `batch.capture` keeps. `first_hint` is layer 0's prefetch.
    """
    provider.begin_step(batch.token_sequences(), batch.positions.tolist())  # traces name each token (drafts too)
    provider.prefetch(0, first_hint)
    for i, layer in enumerate(layers):
        provider.enter_layer(i)  # a layer outside the resident spine prefix is read in
        state = attend(i, layer, x)
        if i + 1 < len(layers):
            # While layer i's experts compute, layer i+1's predicted experts are read.
            provider.prefetch(i + 1, layers[i + 1].predict_experts(state))
        x = feed_forward(i, layer, state)
        if i in batch.capture:
            batch.captured[i] = x  # [T, H]; speculative drafts read it
    return x
