"""The model -> store contract (deltafind/provider.py) as every family drives it (models/ops/step.py).

Router traces are written by the store from what the model reports through the
contract, so a family that skips a hook shows up here: each (token, MoE or
sliced layer) must hold exactly one route, through the real `deltafind` CLI.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from deltafind.store.manifest import Manifest
from deltafind.store.trace import read_trace
from tests.conftest import deltafind_cmd, make_hf_checkpoint

pytest.importorskip("transformers")


def _store(family: str, root: Path) -> Path:
    store = root / "store"
    if family == "deepseek_v3":  # no synthetic deepseek: a tiny transformers checkpoint
        setup = ("--from", str(make_hf_checkpoint("deepseek_v3", root / "hf", num_hidden_layers=3)))
    else:
        setup = ("--synthetic", family, "--shape", "tiny")
    proc = deltafind_cmd("setup", *setup, "--store", str(store), "--dense-slices", "2", "--quiet")
    assert proc.returncode == 0, proc.stderr
    return store


@pytest.mark.parametrize("family", ["kimi_k3", "deepseek_v3", "qwen3_moe", "demo"])
def test_trace_holds_one_route_per_token_and_expert_layer(
    family: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    store = request.getfixturevalue("demo_store") if family == "demo" else _store(family, tmp_path)
    trace = tmp_path / "t.jsonl"
    proc = deltafind_cmd(
        "run",
        "--store",
        str(store),
        "--prompt",
        "hi",
        "--max-new",
        "3",
        "--draft",
        "off",
        "--trace",
        str(trace),
    )
    assert proc.returncode == 0, proc.stderr
    routes = [r for r in read_trace(trace) if "experts" in r]
    expert_layers = set(
        Manifest.load(store).expert_counts()
    )  # MoE layers and dense (sliced) layers alike
    tokens = {(r["seq"], r["pos"]) for r in routes}
    per_key = Counter((r["seq"], r["pos"], r["layer"]) for r in routes)
    assert len(tokens) >= 3 and all(seq >= 0 and pos >= 0 for seq, pos in tokens)
    assert set(per_key.values()) == {1}, "a (token, layer) was routed more than once"
    assert len(routes) == len(tokens) * len(expert_layers)
    assert {r["layer"] for r in routes} == expert_layers
    assert all(len(r["experts"]) == len(r["weights"]) > 0 for r in routes)
    summary = deltafind_cmd("trace", "summarize", str(trace))
    assert summary.returncode == 0 and re.match(rf"{len(routes)} routes,", summary.stdout), (
        summary.stdout
    )


def test_the_prefetch_hint_lists_the_routers_best_first() -> None:
    # The gate starts reads in the hint's order while a drive has slack: by count alone, one token's
    # experts all tied and the lowest ids went first, whatever their scores (tests/bench/RESULTS.md, drives:
    # 26 of 49 reads started were wasted, 8 of 49 once ordered by the router's weights).
    from types import SimpleNamespace

    import torch

    from deltafind.models.ops.moe import predict_routed
    from deltafind.models.qwen3_moe import Router

    torch.manual_seed(0)
    router = Router(
        SimpleNamespace(hidden_size=64, num_experts=32, num_experts_per_tok=8, norm_topk_prob=True)
    )  # type: ignore[arg-type]
    torch.nn.init.normal_(router.weight)
    x = torch.randn(2, 64)
    scores = x @ router.weight.T  # the router's logits, computed here: softmax keeps their order
    for row in range(2):
        assert (
            predict_routed(router, x[row : row + 1])
            == scores[row].argsort(descending=True)[:8].tolist()
        )
    both = predict_routed(router, x)
    chosen = [set(scores[r].argsort(descending=True)[:8].tolist()) for r in range(2)]
    shared = chosen[0] & chosen[1]
    assert (
        set(both[: len(shared)]) == shared and set(both) == chosen[0] | chosen[1]
    )  # chosen by both tokens first


def test_one_token_dispatch_is_the_batched_sum_bit_for_bit() -> None:
    # A decode token takes dispatch's one-token path (the route as Python ints); a batch the general one
    # (argsort, index_add_). Each row of a batch must be what that token alone gives, to the bit, with a
    # row-wise expert so the rows' arithmetic cannot depend on the batch.
    import torch

    from deltafind.models.ops.moe import dispatch
    from deltafind.provider import DictExpertProvider

    torch.manual_seed(0)
    n, k, t, d = 16, 4, 5, 64
    provider = DictExpertProvider({(0, e): {"scale": torch.randn(d)} for e in range(n)})
    x = torch.randn(t, d)
    idx = torch.stack([torch.randperm(n)[:k] for _ in range(t)])  # [T, k], distinct per token
    weight = torch.rand(t, k).softmax(-1)

    def run(rows: torch.Tensor, expert) -> torch.Tensor:
        return torch.tanh(rows * expert["scale"]) * 3.7

    batched = dispatch(x, idx, weight, provider, 0, run)
    for row in range(t):
        alone = dispatch(
            x[row : row + 1], idx[row : row + 1], weight[row : row + 1], provider, 0, run
        )
        assert torch.equal(alone[0], batched[row]), row
