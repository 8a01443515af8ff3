"""Dense layers held whole outside the LRU (store/resident.py): which ones, what they save, what they never change."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ByteSize
from structlog.testing import capture_logs

from deltafind import Model
from deltafind.importer.setup import setup_store
from deltafind.store.resident import dense_prefix
from tests.conftest import make_hf_checkpoint

PROMPT = [11, 42, 7, 99, 3, 150, 8]


@given(
    sizes=st.lists(st.integers(1, 100), max_size=8),
    budget=st.one_of(st.none(), st.integers(0, 500)),
)
def test_dense_prefix_holds_all_that_fit_or_a_prefix_with_room_for_one_layer(sizes, budget) -> None:
    layers = list(enumerate(sizes))
    held = dense_prefix(layers, budget)
    assert held == list(range(len(held)))  # whole layers, from the first
    if budget is None or sum(sizes) <= budget:
        assert len(held) == len(sizes)
    else:
        room = max(sizes)  # a streamed layer's reads in flight still fit beside the held ones
        assert not held or sum(sizes[: len(held)]) + room <= budget
        assert budget < sum(sizes[: len(held) + 1]) + room  # one more would not fit


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("resident")
    setup_store(
        make_hf_checkpoint("llama", root / "hf", num_hidden_layers=4),
        root / "s",
        [root / "d"],
        dense_slices=2,
        progress=False,
    )
    return root / "s"


def layer_bytes(m: Model) -> list[int]:
    return [
        sum(m.experts.record(i, e).length for e in range(m.experts.num_experts(i)))
        for i in range(4)
    ]


def test_a_prefix_is_held_and_only_the_rest_is_read_each_token(llama) -> None:
    """A budget of 2 layers plus one layer's room: layers 0-1 held, 2-3 streamed. Under the LRU alone
    a 4-layer cycle through a smaller cache never hits, so every token read all four layers; held,
    a token reads exactly the two streamed ones. Tokens equal the all-resident run's."""
    everything = Model.open(llama, expert_bytes=None)
    try:
        reference = everything.generate(PROMPT, max_new_tokens=8)
        sizes = layer_bytes(everything)
        assert (
            everything.snapshot()["dense_held_layers"] == 4 and everything.experts.stats.read == 8
        )  # 4 layers x 2 slices, once
    finally:
        everything.close()
    budget = sizes[0] + sizes[1] + max(sizes)
    m = Model.open(llama, expert_bytes=budget, prefetch=False)
    try:
        assert sorted(m.experts.resident.layers) == [0, 1]
        assert m.experts.cache.budget_bytes == budget - m.experts.resident.dense_bytes
        assert m.generate(PROMPT, max_new_tokens=1) == reference[:1]  # the prompt, then one token
        before = m.experts.stats.bytes_read
        assert m.generate(PROMPT, max_new_tokens=8) == reference
        steps = 1 + 7  # the prompt's forward and 7 decode steps
        assert m.experts.stats.bytes_read - before == steps * (sizes[2] + sizes[3])
        snap = m.snapshot()
        assert (
            snap["dense_held_bytes"] == m.experts.resident.dense_bytes
            and snap["cache_budget_bytes"] <= sizes[2]
        )
    finally:
        m.close()


def test_a_live_budget_and_a_re_pin_leave_the_held_layers_alone(llama) -> None:
    m = Model.open(llama, expert_bytes=None)
    try:
        dense = m.experts.resident.dense_bytes
        # a reload's [cache] expert_bytes
        for budget, lru in (
            (dense + 1000, 1000),
            (dense // 2, 0),
        ):
            cache = m.settings.cache.model_copy(update={"expert_bytes": ByteSize(budget)})
            with capture_logs() as logs:
                m.apply_live(m.settings.model_copy(update={"cache": cache}), ["cache.expert_bytes"])
            assert m.experts.cache.budget_bytes == lru  # the LRU gets what the held layers leave
            assert any(e["event"] == "expert_bytes_below_dense_held" for e in logs) == (
                budget < dense
            )
        m.experts.resident.pin(
            [(3, 0), (3, 1)], 1 << 20
        )  # held already: the pin tier takes nothing for them
        assert m.experts.resident.pinned_bytes == 0
        m.experts.resident.unpin()
        assert (
            sorted(m.experts.resident.layers) == [0, 1, 2, 3]
            and m.experts.resident.dense_bytes == dense
        )
        reads = m.experts.stats.read
        m.generate(PROMPT, max_new_tokens=4)
        assert m.experts.stats.read == reads  # nothing re-read
    finally:
        m.close()


def test_after_a_held_dense_layer_the_next_layers_prediction_is_still_read(tmp_path) -> None:
    """DeepSeek-V3 with its first layer dense: the routed layer 1's prediction waits for layer 0's
    fetch to queue its reads (StoreExperts.prefetch); a held layer 0 has no fetch, so it must issue
    it itself, or layer 1 would never be prefetched. Tokens equal prefetch off's."""
    ckpt = make_hf_checkpoint("deepseek_v3", tmp_path / "hf", num_hidden_layers=2)
    setup_store(ckpt, tmp_path / "s", [tmp_path / "d"], dense_slices=2, progress=False)
    tokens = []
    for enabled in (False, True):
        m = Model.open(
            tmp_path / "s",
            expert_bytes=None,
            prefetch=enabled,
            max_in_flight=8,
        )
        try:
            budget = m.experts.resident.dense_bytes
            assert sorted(m.experts.resident.layers) == [0]
        finally:
            m.close()
        m = Model.open(
            tmp_path / "s",
            expert_bytes=budget,
            prefetch=enabled,
            max_in_flight=8,
        )
        try:
            assert sorted(m.experts.resident.layers) == [0] and m.experts.cache.budget_bytes == 0
            tokens.append(m.generate(PROMPT, max_new_tokens=12))
            if enabled:
                assert m.experts.stats.prefetch_issued > 0 and m.experts.stats.prefetch_used > 0
                assert set(m.experts.stats.layers) == {1}  # the gate sees the routed layer only
        finally:
            m.close()
    assert tokens[0] == tokens[1]


def test_pinning_on_a_reload_evicts_nothing_the_lru_holds(tmp_path) -> None:
    """A held tier's load keeps its experts outside the LRU: they never pass through it, so re-pinning
    with the LRU full (a live `[cache] pin_bytes`) leaves every entry it had. Loaded through the LRU, each
    pinned expert evicted its oldest entry before it was taken out again."""
    setup_store(
        make_hf_checkpoint("deepseek_v3", tmp_path / "hf", num_hidden_layers=2),
        tmp_path / "s",
        [tmp_path / "d"],
        dense_slices=2,
        progress=False,
    )
    m = Model.open(tmp_path / "s", expert_bytes=1 << 31, prefetch=False)
    try:  # what the budget must cover besides the LRU's entries: the held dense layer and the reader's pools
        dense, pools = m.experts.resident.dense_bytes, m.experts.cache.reserved_bytes
        m.generate(PROMPT, max_new_tokens=6)
        one = m.experts.cache.used_bytes // len(
            m.experts.cache
        )  # the routed experts are of one size
    finally:
        m.close()
    m = Model.open(tmp_path / "s", expert_bytes=dense + pools + 3 * one, prefetch=False)
    try:
        m.generate(PROMPT, max_new_tokens=6)
        lru = m.experts.cache
        held = [k for k in m.experts._records if k in lru]
        assert (
            len(held) == 3 and lru.used_bytes + lru.reserved_bytes == lru.budget_bytes
        )  # full: one more evicts
        others = [k for k in m.experts._records if k[0] == 1 and k not in lru][:2]
        assert m.experts.resident.pin(others, 1 << 30) == 2 * one
        assert [k for k in m.experts._records if k in lru] == held and lru.used_bytes == 3 * one
    finally:
        m.close()
