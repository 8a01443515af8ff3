"""A next-layer prefetch hint is computed only where a read could come of it (provider.wants_prefetch).

The hint is the next layer's router run on the current hidden state: on a one-token decode it cost
about as much as the route itself. Counted here by the routers' calls in one decode token of a real
store: each layer routes once, and each later layer is predicted once more only where it could be read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltafind import Model
from deltafind.importer.setup import setup_store
from deltafind.models.ops.batch import SequenceCache, forward_step
from tests.conftest import make_hf_checkpoint

LAYERS, EXPERTS = 3, 8


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hints")
    ckpt = make_hf_checkpoint("qwen3_moe", root / "hf", num_hidden_layers=LAYERS)
    setup_store(ckpt, root / "store", [root / "d0"], progress=False)
    return root / "store"


def _decode(m: Model, tokens: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """The logits of each token after the first (fed one at a time), and the router calls of each."""
    calls, logits, per_token = [0], [], []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        for layer in m.net.model.layers
    ]
    cache = SequenceCache(m.net.num_layers)
    try:
        with torch.inference_mode():
            forward_step(m.net, cache, tokens[:1])
            for t in tokens[1:]:
                calls[0] = 0
                logits.append(forward_step(m.net, cache, [t])[-1].clone())
                per_token.append(calls[0])
    finally:
        for h in hooks:
            h.remove()
    return logits, per_token


def _read_all(m: Model) -> None:
    for layer in range(LAYERS):
        assert len(list(m.experts.fetch(layer, range(EXPERTS)))) == EXPERTS


def test_no_hint_is_computed_where_no_read_can_come_of_it(store: Path) -> None:
    tokens = [11, 42, 7]
    off = Model.open(store, expert_bytes=None, prefetch=False)
    try:
        want, calls = _decode(off, tokens)
        assert calls == [LAYERS, LAYERS]  # prefetch off: the routes only
    finally:
        off.close()
    m = Model.open(store, expert_bytes=None)
    try:
        # two tokens hold at most 4 of a layer's 8 experts: layers 1 and 2 are predicted as well
        got, calls = _decode(m, tokens[:2])
        assert calls == [2 * LAYERS - 1]
        _read_all(m)  # every expert held, in a cache without a budget: no hint can start a read
        reads, issued = m.experts.stats.read, m.experts.stats.prefetch_issued
        got, calls = _decode(m, tokens)
        assert calls == [LAYERS, LAYERS]
        assert (m.experts.stats.read, m.experts.stats.prefetch_issued) == (reads, issued)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    finally:
        m.close()
    bounded = Model.open(store, expert_bytes=1 << 30)
    try:
        _read_all(bounded)
        bounded.experts.cache.pop((0, 0))
        # under a budget a read at layer 0 may evict, in the order the hints touched: layer 1 is
        # predicted though held whole, until the whole store is held again
        assert _decode(bounded, tokens)[1][0] > LAYERS
        _read_all(bounded)
        assert _decode(bounded, tokens)[1] == [LAYERS] * 2
    finally:
        bounded.close()
