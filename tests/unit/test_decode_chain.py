"""A decode token's layers in one kernel call (ops/step.py's DecodeChain): the per-layer path's numbers, bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deltafind import Model
from deltafind.importer.setup import setup_store
from deltafind.models.ops.batch import Batch, SequenceCache, forward_step
from deltafind.models.ops.cpu_kernels import CPU
from tests.conftest import make_hf_checkpoint

PROMPT = [11, 42, 7, 99, 3, 150, 8]

pytestmark = pytest.mark.skipif(
    CPU.load() is None, reason="no C++ compiler: the per-layer torch path runs instead"
)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root, out = tmp_path_factory.mktemp("chain"), {}
    # qwen3: q/k norms; a bias on q/k/v/o
    for family, extra in (
        ("llama", {}),
        ("qwen3", {"attention_bias": True}),
    ):
        ckpt = make_hf_checkpoint(
            family,
            root / f"hf-{family}",
            num_hidden_layers=4,
            dtype="bfloat16",
            intermediate_size=128,
            **extra,
        )  # the kernels take bf16 (fp32 runs torch), columns by 32
        setup_store(ckpt, root / family, [root / f"d-{family}"], dense_slices=2, progress=False)
        out[family] = root / family
    return out


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The layers each df_decode_layers call was given (a spy: the real kernel runs)."""
    lib, seen = CPU.load(), []
    real = lib.df_decode_layers

    def spy(steps: object, n: int, *args: object) -> int:
        seen.append(n)
        return real(steps, n, *args)

    monkeypatch.setattr(lib, "df_decode_layers", spy)
    yield seen


def decode_logits(m: Model, steps: int = 10) -> list[torch.Tensor]:
    """Greedy logits of the prompt and then of each token fed back, one at a time."""
    cache, out = SequenceCache(m.net.num_layers), []
    with torch.inference_mode():
        logits = forward_step(m.net, cache, PROMPT)
        for _ in range(steps):
            out.append(logits[-1].clone())
            logits = forward_step(m.net, cache, [int(logits[-1].argmax())])
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_chain_equals_the_per_layer_path_bit_for_bit(stores, calls, family) -> None:
    m = Model.open(stores[family], expert_bytes=None)
    try:
        chained = decode_logits(m)
        assert (
            calls == [4] * 10
        )  # each token fed back: all 4 layers in one call (the prompt runs per layer)
        requested = m.experts.stats.requested
        m.net._chain.off = True
        per_layer = decode_logits(m)
        assert len(calls) == 10 and all(
            torch.equal(a, b) for a, b in zip(chained, per_layer, strict=True)
        )
        assert (
            m.experts.stats.requested == 2 * requested
        )  # the chain counts each held slice's use as the layers do
    finally:
        m.close()


def test_a_kernel_that_stops_early_leaves_the_rest_to_the_per_layer_path(
    stores, monkeypatch
) -> None:
    """df_decode_layers returns how many layers it ran; from there the per-layer path goes on (and the
    chain stays off). Made to stop after 2 of 4 layers by handing the real kernel 2."""
    reference = Model.open(stores["llama"], expert_bytes=None)
    try:
        reference.net._chain.off = True
        expected = decode_logits(reference)
    finally:
        reference.close()
    lib = CPU.load()
    real = lib.df_decode_layers
    monkeypatch.setattr(lib, "df_decode_layers", lambda steps, n, *args: real(steps, 2, *args))
    m = Model.open(stores["llama"], expert_bytes=None)
    try:
        got = decode_logits(m)
        assert m.net._chain.off and all(
            torch.equal(a, b) for a, b in zip(got, expected, strict=True)
        )
    finally:
        m.close()


@pytest.mark.parametrize("case", ["trace", "streamed layers", "two sequences"])
def test_where_a_hook_has_work_the_layers_run_one_by_one(stores, calls, tmp_path, case) -> None:
    """A trace records every layer's route, a layer left to the LRU must be fetched, a batch is not one
    token: none of them chains, and the tokens are the chained ones."""
    m = Model.open(stores["llama"], expert_bytes=None)
    try:
        expected = m.generate(PROMPT, max_new_tokens=8)
        calls.clear()
    finally:
        m.close()
    options = {
        "trace": {"trace_path": tmp_path / "t.jsonl"},
        "streamed layers": {"expert_bytes": 0},
    }.get(case, {})
    m = Model.open(stores["llama"], **({"expert_bytes": None} | options))
    try:
        if case == "two sequences":  # both sequences' next token in one forward
            caches = [SequenceCache(m.net.num_layers) for _ in range(2)]
            with torch.inference_mode():
                for cache in caches:
                    forward_step(m.net, cache, PROMPT)
                logits = m.net(
                    torch.tensor([expected[0], expected[0]]), Batch.of([(c, 1) for c in caches])
                )
            assert logits.argmax(-1).tolist() == [expected[1]] * 2
        else:
            assert m.generate(PROMPT, max_new_tokens=8) == expected
        assert calls == [] and not m.net._chain.off  # never tried: nothing was refused
    finally:
        m.close()


def test_the_chain_is_planned_once_and_again_when_a_weight_is_replaced(
    stores, calls, monkeypatch
) -> None:
    """Each step checks the layers' weight objects in one pass rather than planning every layer again;
    a replaced weight (a new object, as a reloaded layer brings) is planned again and used."""
    m = Model.open(stores["llama"], expert_bytes=None)
    try:
        planned: list[int] = []
        for i, layer in enumerate(m.net.model.layers):
            real = layer.chain_parts
            monkeypatch.setattr(
                layer, "chain_parts", lambda *a, i=i, real=real: planned.append(i) or real(*a)
            )
        before = decode_logits(m)
        assert calls == [4] * 10 and planned == [0, 1, 2, 3]  # planned at the first token only
        o = m.net.model.layers[1].self_attn.o_proj
        o.weight = torch.nn.Parameter(o.weight * 0.5, requires_grad=False)
        chained = decode_logits(m)
        assert len(calls) == 20 and planned == [0, 1, 2, 3] * 2
        m.net._chain.off = True
        per_layer = decode_logits(m)
        assert all(torch.equal(a, b) for a, b in zip(chained, per_layer, strict=True))
        assert not torch.equal(before[0], chained[0])  # the new weight is the one used
    finally:
        m.close()
