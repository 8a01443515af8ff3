"""The per-layer step every family's forward runs: the model's whole side of the provider contract.

A family supplies each layer's attention and FFN halves; this calls the `ExpertProvider`
hooks around them in one order for all (the FFN's `moe.dispatch` reports routes and fetches).
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
    """Run `layers` from hidden state x [T, H]; `attend(i, layer, x)` gives the state layer i+1
    predicts from (`predict_experts`), `feed_forward(i, layer, state)` the output `batch.capture` keeps."""
    layers = list(layers)  # a ModuleList's `layers[i]` and `len` cost ~2 us a layer (3.6 % of a demo token's Python)
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
