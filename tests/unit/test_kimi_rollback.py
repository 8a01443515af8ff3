"""Speculative rollback on Kimi K3: after a verify pass [pending, d1..dk] and a cut to the
accepted prefix, every layer's state (KDA S and conv windows, MLA cache) and the logits
that follow equal those of a run that never saw the rejected tokens; cuts the state did
not keep are refused before anything changes. Also the hidden-state capture DSpark reads."""

from __future__ import annotations

import pytest
import torch

from deltafind import Model
from deltafind.importer.setup import setup_store
from deltafind.importer.synthetic import open_synthetic
from deltafind.models import kimi_k3
from deltafind.models.ops.attnres import attn_res
from deltafind.models.ops.batch import Batch, LayerCache, SequenceCache, forward_step
from deltafind.models.ops.kda_layer import MAX_ROLLBACK_ROWS, KDAState, RollbackError

PROMPT = [5, 77, 300, 12, 480, 9, 101, 33, 250, 7, 64, 2]
DRAFTS = [17, 400, 3, 99, 250, 61]  # k = 6: a 7-row verify pass
NEXT = 42
# A cut state comes from a 7-row pass, the reference from an (a+1)-row one: the projections'
# matrix products may round differently with the row count, so states agree to fp32 rounding.
STATE_ATOL, LOGITS_ATOL = 1e-5, 2e-5  # the same bound as decode vs recompute in test_kimi_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("k3")
    setup_store(
        open_synthetic("kimi_k3", "tiny", seed=3),
        root / "store",
        [root / "d0"],
        dense_slices=2,
        progress=False,
        names=kimi_k3.WEIGHTS,
    )
    m = Model.open(root / "store", expert_bytes=None, prefetch=False)
    yield m
    m.close()


def _run(net: torch.nn.Module, *steps: list[int]) -> tuple[SequenceCache, list[torch.Tensor]]:
    cache = SequenceCache(net.num_layers)
    with torch.inference_mode():
        return cache, [forward_step(net, cache, ids, all_logits=True) for ids in steps]


def _assert_same_state(a: SequenceCache, b: SequenceCache) -> None:
    assert a.length == b.length
    for i, (x, y) in enumerate(zip(a.layers, b.layers, strict=True)):
        assert type(x) is type(y), i
        assert x.length == y.length == a.length, i
        if isinstance(x, KDAState):
            torch.testing.assert_close(x.recurrent, y.recurrent, atol=STATE_ATOL, rtol=0)
            for cx, cy in zip(x.conv, y.conv, strict=True):
                torch.testing.assert_close(cx, cy, atol=STATE_ATOL, rtol=0)
        else:
            assert isinstance(x, LayerCache)
            for tx, ty in zip(x.view(), y.view(), strict=True):
                torch.testing.assert_close(tx, ty, atol=STATE_ATOL, rtol=0)


@pytest.mark.parametrize("accepted", [0, 1, 3, 5, 6])
def test_cut_after_verify_equals_never_seeing_the_rejected_tokens(
    model: Model, accepted: int
) -> None:
    net = model.net
    cut, (_, verify) = _run(net, PROMPT, [1, *DRAFTS])
    cut.truncate(len(PROMPT) + 1 + accepted)  # keep the pending token and `accepted` drafts
    ref, (_, ref_verify) = _run(net, PROMPT, [1, *DRAFTS[:accepted]])
    _assert_same_state(cut, ref)
    # The rows the verifier used for its decision are those of the shorter run.
    torch.testing.assert_close(verify[: accepted + 1], ref_verify, atol=LOGITS_ATOL, rtol=0)
    with torch.inference_mode():
        after_cut, after_ref = (
            forward_step(net, cut, [NEXT, 8], all_logits=True),
            forward_step(net, ref, [NEXT, 8], all_logits=True),
        )
    torch.testing.assert_close(after_cut, after_ref, atol=LOGITS_ATOL, rtol=0)
    assert torch.equal(after_cut.argmax(-1), after_ref.argmax(-1))


def test_a_later_cut_inside_the_same_pass_and_a_reset(model: Model) -> None:
    net = model.net
    cache, _ = _run(net, PROMPT, [1, *DRAFTS])
    cache.truncate(len(PROMPT) + 5)
    cache.truncate(len(PROMPT) + 2)  # further back, still inside the pass
    ref, _ = _run(net, PROMPT, [1, *DRAFTS[:1]])
    _assert_same_state(cache, ref)
    cache.truncate(0)
    assert cache.length == 0 and all(layer.length == 0 for layer in cache.layers)
    with torch.inference_mode():
        again = forward_step(net, cache, PROMPT, all_logits=True)
    torch.testing.assert_close(again, model.forward_logits(PROMPT), atol=0, rtol=0)


def test_cuts_outside_the_kept_rows_are_refused_before_anything_changes(model: Model) -> None:
    net = model.net
    cache, _ = _run(net, PROMPT, [1, *DRAFTS])
    lengths = [layer.length for layer in cache.layers]
    with pytest.raises(
        RollbackError,
        match=rf"positions {len(PROMPT)}\.\.{len(PROMPT) + 7}.*asked for {len(PROMPT) - 1}",
    ):
        cache.truncate(len(PROMPT) - 1)  # into the prompt: prefill keeps no rows
    assert [layer.length for layer in cache.layers] == lengths and cache.length == len(
        PROMPT
    ) + 7  # MLA caches untouched
    with torch.inference_mode():
        forward_step(net, cache, [NEXT])  # a one-row decode step keeps nothing to roll back to
    with pytest.raises(RollbackError, match="can roll back only"):
        cache.truncate(cache.length - 1)
    prefilled, _ = _run(net, PROMPT)
    with pytest.raises(RollbackError):
        prefilled.truncate(3)


def test_prefill_and_decode_keep_no_rows(model: Model) -> None:
    net = model.net
    long_verify = list(
        range(100, 100 + MAX_ROLLBACK_ROWS + 1)
    )  # longer than a verify pass: a prefill chunk
    cache, _ = _run(net, PROMPT, [NEXT], long_verify)
    kda = [layer for layer in cache.layers if isinstance(layer, KDAState)]
    assert kda and all(not s.kept_rows and not s.kept_inputs and not s.conv_rows for s in kda)
    cache, _ = _run(net, PROMPT, [1, *DRAFTS], [NEXT])
    assert all(
        not s.kept_rows and s.kept_start is None for s in cache.layers if isinstance(s, KDAState)
    )


def test_capture_is_the_carried_partial_block_sum(model: Model) -> None:
    """batch.captured[l] is h after layer l, rebuilt here from the layers' own parts (docs/kimi-k3-format.md §4.2)."""
    net = model.net
    layers = (0, 2, 3, net.num_layers - 1)
    with torch.inference_mode():
        cache = SequenceCache(net.num_layers)
        ids = torch.tensor(PROMPT)
        batch = Batch.of([(cache, len(PROMPT))])
        batch.capture = layers
        logits = net(ids, batch, all_logits=True)
        assert torch.equal(logits, model.forward_logits(PROMPT))  # capturing changes nothing
        assert sorted(batch.captured) == sorted(layers)
        # Reference: the recurrence of docs/kimi-k3-format.md §4.2, written out with attn_res and the same sub-layers.
        m, eps, block = net.model, net.args.rms_norm_eps, net.args.attn_res_block_size
        ref_cache = SequenceCache(net.num_layers)
        rb = Batch.of([(ref_cache, len(PROMPT))])
        h, anchors, want = m.embed_tokens(ids).float(), [], {}
        for i, layer in enumerate(m.layers):
            x = (
                h
                if not anchors
                else attn_res(
                    [*anchors, h],
                    layer.self_attention_res_norm.weight,
                    layer.self_attention_res_proj.weight,
                    eps,
                )
            )
            if i % block == 0:
                anchors, partial = [*anchors, h], layer.self_attn(layer.input_layernorm(x), rb)
            else:
                partial = h + layer.self_attn(layer.input_layernorm(x), rb)
            y = attn_res(
                [*anchors, partial], layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps
            )
            h = partial + layer.ffn()(layer.post_attention_layernorm(y))
            want[i] = h
    for i in layers:
        assert batch.captured[i].shape == (len(PROMPT), net.args.hidden_size)
        torch.testing.assert_close(batch.captured[i], want[i], atol=1e-6, rtol=0)


def test_no_capture_no_captured_rows(model: Model) -> None:
    batch = Batch.of([(SequenceCache(model.net.num_layers), 3)])
    with torch.inference_mode():
        model.net(torch.tensor(PROMPT[:3]), batch)
    assert batch.captured == {}


def test_kda_state_restores_slices_of_its_kept_rows() -> None:
    """KDAState alone: the cut reruns the kept rows from the kept start; conv windows are
    slices of [previous window, raw rows]."""
    state = KDAState()
    state.recurrent, state.conv, state.length = (
        torch.zeros(1, 2, 2),
        [torch.zeros(3, 4) for _ in range(3)],
        5,
    )
    assert state.keeps_rows(2) and state.keeps_rows(MAX_ROLLBACK_ROWS) and not state.keeps_rows(1)
    assert not state.keeps_rows(MAX_ROLLBACK_ROWS + 1)
    state.start_pass()
    rows = [torch.arange(12.0).view(3, 4) + 100 * i for i in range(3)]
    state.conv_prev, state.conv_rows = [c.clone() for c in state.conv], rows
    seen = []

    def rerun(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(inputs[0].shape[0])
        return torch.empty(0), inputs[-1] + inputs[0].sum()

    state.kept_start, state.kept_rows, state.rerun = torch.ones(1, 2, 2), 3, rerun
    state.kept_inputs = [torch.tensor([1.0, 2.0, 4.0])] * 5
    state.length = 8
    state.truncate(6)
    assert seen == [1] and torch.equal(state.recurrent, torch.full((1, 2, 2), 2.0))  # start + row 0
    assert torch.equal(
        state.conv[1], torch.cat([torch.zeros(2, 4), rows[1][:1]])
    )  # last 3 raw inputs, oldest first
    assert state.rollback_range() == (5, 6)
    state.truncate(5)
    assert seen == [1] and torch.equal(
        state.recurrent, torch.ones(1, 2, 2)
    )  # the start itself, nothing rerun
