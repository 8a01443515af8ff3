"""A coordinator plus 2 and 3 expert nodes (real processes, gloo on loopback) against one process.

The nodes compute every routed expert; the coordinator sums their per-expert outputs in expert
order, so logits must be equal bit for bit and tokens identical: greedy, seeded sampling, and
with an n-gram draft, for qwen3_moe, deepseek_v3 and kimi_k3 stores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deltafind.api import Model
from deltafind.config import load_settings
from tests.cluster.harness import FAMILIES, cluster_settings, free_port, make_store, nodes

pytest.importorskip("transformers")

PROMPT = [11, 42, 7, 99, 42, 7, 99, 42, 7, 13, 5, 64]  # repeats, so the n-gram draft proposes


def outputs(model: Model) -> dict[str, Any]:
    return {
        "logits": model.forward_logits(PROMPT),
        "greedy": model.generate(PROMPT, max_new_tokens=10),
        "sampled": model.generate(PROMPT, max_new_tokens=10, temperature=0.9, top_p=0.95, seed=7),
        "drafted": model.generate(PROMPT, max_new_tokens=10, draft="ngram"),
    }


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    out = {}
    for family in FAMILIES:
        store = make_store(family, tmp_path_factory.mktemp(family))
        ref = Model.open(store, expert_bytes=0)
        try:
            out[family] = (store, outputs(ref))
        finally:
            ref.close()
    return out


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_cluster_matches_one_process(
    family: str, count: int, stores: dict[str, tuple[Path, dict[str, Any]]]
) -> None:
    store, want = stores[family]
    port = free_port()
    # Nodes cache nothing: every layer reads its experts on the node, with the predictions riding along.
    with nodes(store, count, port, {"DELTAFIND_CACHE__EXPERT_BYTES": "0"}) as procs:
        settings = load_settings(
            None,
            {
                "model": {"store": str(store)},
                "draft": {"mode": "off"},
                "cluster": cluster_settings(count, port),
            },
        )
        model = Model.open(store, settings=settings)
        try:
            got = outputs(model)
            status = model.snapshot()["nodes"]
            routed = sum(model.experts.num_experts(layer) for layer in model.cluster.routed)
        finally:
            model.close()
        assert [p.wait(timeout=60) for p in procs] == [0] * count  # told to stop, each exits 0
    assert torch.equal(got["logits"], want["logits"]), (got["logits"] - want["logits"]).abs().max()
    for key in ("greedy", "sampled", "drafted"):
        assert got[key] == want[key], key
    assert [n["rank"] for n in status] == list(range(1, count + 1))
    assert all(
        n["alive"] and n["layers"] > 0 and n["experts_read"] > 0 and not n["last_error"]
        for n in status
    )
    assert (
        routed and sum(n["experts"] for n in status) == routed
    )  # each routed expert placed once (no replicas asked)
