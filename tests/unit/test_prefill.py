"""Prefill chunks: as large as memory allows, and each chunk reads each expert it needs once per layer.

Reads are counted where every read goes through (the store's pack reader) against a real store,
per (forward step, layer, expert), with the routes each step took beside them.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import wait
from pathlib import Path

import pytest

from deltafind import Model
from deltafind.engine.prefill import PrefillPlan, plan_for
from deltafind.importer.setup import setup_store
from deltafind.importer.synthetic_k3 import REAL, text_config
from deltafind.models.kimi_k3_config import ModelArgs as K3Args
from tests.conftest import make_hf_checkpoint

PROMPT = [(7 * i + 3) % 200 + 1 for i in range(40)]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prefill")
    ckpt = make_hf_checkpoint(
        "qwen3_moe",
        root / "hf",
        num_hidden_layers=3,
        mlp_only_layers=[0],
        num_experts=16,
        num_experts_per_tok=4,
    )
    setup_store(ckpt, root / "s", [root / "d0", root / "d1"], dense_slices=4, progress=False)
    return root / "s"


def _counted(m: Model) -> tuple[Counter, dict[tuple[int, int], set[int]]]:
    """Count every read of the model's store per (step, layer, expert); note each step's routed experts per layer.

    A read queued while a later layer is fetched is the next step's (the last fetch of a step
    starts the next step's layer-0 prediction), so it counts there."""
    reads: Counter = Counter()
    routes: dict[tuple[int, int], set[int]] = {}
    ex, step, fetching = m.experts, [0], [-1]
    queue, begin, observe, fetch = ex.reader._queue, ex.begin_step, ex.observe_routes, ex.fetch

    # every record read (demand, decoded or prefetch) is queued here once
    def counting_queue(rec, *args):
        reads[(step[0] + (rec.layer < fetching[0]), rec.layer, rec.expert)] += 1
        return queue(rec, *args)

    def next_step(seq_ids, positions):
        step[0], fetching[0] = step[0] + 1, -1
        begin(seq_ids, positions)

    def fetch_layer(layer_idx, expert_ids):
        fetching[0] = layer_idx
        yield from fetch(layer_idx, expert_ids)

    def seen(layer_idx, topk_idx, topk_weight):
        routes.setdefault((step[0], layer_idx), set()).update(topk_idx.flatten().tolist())
        observe(layer_idx, topk_idx, topk_weight)

    ex.reader._queue, ex.begin_step, ex.observe_routes, ex.fetch = (
        counting_queue,
        next_step,
        seen,
        fetch_layer,
    )
    return reads, routes


@pytest.mark.parametrize("prefetch", [True, False])
def test_each_prefill_chunk_reads_each_expert_once_per_layer(store, prefetch) -> None:
    whole = Model.open(store, expert_bytes=0, prefetch=False)
    try:
        expected = whole.generate(PROMPT, max_new_tokens=3)
    finally:
        whole.close()
    m = Model.open(
        store,
        expert_bytes=0,
        prefetch=prefetch,
        max_in_flight=8,
        max_prefill_tokens=16,
    )
    try:
        reads, routes = _counted(m)
        assert (
            m.generate(PROMPT, max_new_tokens=3) == expected
        )  # chunked as one pass: the same tokens
        assert max(reads.values()) == 1  # no expert read twice in one step
        steps = sorted({s for s, _ in routes})
        assert len(steps) == 3 + 2  # 40 prompt tokens in chunks of 16, 16, 8; then two decode steps
        for (s, layer), routed in routes.items():
            got = {e for (s2, lay, e), _ in reads.items() if (s2, lay) == (s, layer)}
            assert routed <= got  # every routed expert read in its step (cache 0: nothing kept)
            if not prefetch:
                assert got == routed  # and, without prediction, nothing else
        wait(
            list(m.experts._inflight.values())
        )  # the next step's predicted reads, started by the last one, land
        # the drives read whole aligned extents (O_DIRECT): each record's align_up(length), once per read counted
        aligned = {
            (lay, e): sum(x.nbytes for x in m.experts.record(lay, e).extents())
            for _, lay, e in reads
        }
        assert m.experts.reader.bytes_read == sum(
            aligned[(lay, e)] * n for (_, lay, e), n in reads.items()
        )
    finally:
        m.close()


def test_the_chunk_is_the_largest_that_fits_the_budget() -> None:
    plan = PrefillPlan(budget_bytes=10_000_000, token_bytes=20_000, score_bytes=40)
    for cached in (0, 1000, 100_000):
        t = plan.tokens(cached)
        assert t * (plan.token_bytes + plan.score_bytes * (cached + t)) <= plan.budget_bytes
        assert (t + 1) * (
            plan.token_bytes + plan.score_bytes * (cached + t + 1)
        ) > plan.budget_bytes
    assert plan.tokens(10**9) == 1  # never zero: a long context still moves
    assert PrefillPlan(10_000_000, 20_000, 40, cap=64).tokens() == 64


def test_a_k3_plan_prefills_a_512_token_prompt_in_one_chunk_with_16_gib() -> None:
    args = K3Args.from_config(text_config({**REAL, "layers": 61, "mla": [4], "experts": 896}))
    plan = plan_for(args, 16 << 30)
    assert plan.tokens(0) >= 512
    assert plan_for(args, 256 << 20).tokens(0) < 512  # a tight budget splits it


def test_a_chunk_after_a_long_context_is_as_large_as_the_first() -> None:
    """Attention is blockwise (no score matrix), so the context so far takes no chunk memory: a K3 prompt
    at 1M tokens of context still prefills in chunks that read each expert once for many tokens."""
    args = K3Args.from_config(text_config({**REAL, "layers": 61, "mla": [4], "experts": 896}))
    plan = plan_for(args, 16 << 30)
    assert plan.tokens(1 << 20) == plan.tokens(100_000) == plan.tokens(0) >= 4096
