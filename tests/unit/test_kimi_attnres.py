"""Block AttnRes (docs/kimi-k3-format.md §4.2): anchor counts on K3's 93-layer schedule and values against
a direct transcription of the spec's recurrence, one token row at a time."""

from __future__ import annotations

import pytest
import torch

from deltafind.models.ops.attnres import AttnResStream, anchors_after, anchors_before, attn_res

H = 8


def _spec_attn_res(values: list[torch.Tensor], n: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Spec's attn_res for one row: values are [H] vectors; score = <rmsnorm(v, n), p>."""
    out = torch.zeros(H)
    scores = []
    for v in values:
        normed = n * (v * torch.rsqrt((v * v).mean() + 1e-5))
        scores.append((normed * p[0]).sum())
    a = torch.softmax(torch.stack(scores), dim=0)
    for ai, v in zip(a, values, strict=True):
        out = out + ai * v
    return out


def _spec_recurrence(h0, weights, attn_fns, mlp_fns, block, tail):
    """The spec's layer loop for one row, with A and P as Python lists."""
    h, anchors, p_sum = h0, [], None
    for l in range(len(attn_fns)):  # noqa: E741
        x = h if not anchors else _spec_attn_res([*anchors, h], *weights[l][0])
        if l % block == 0:
            anchors = [*anchors, h]
            p_sum = torch.zeros(H)
        else:
            p_sum = h
        p_sum = p_sum + attn_fns[l](x)
        y = _spec_attn_res([*anchors, p_sum], *weights[l][1])
        h = p_sum + mlp_fns[l](y)
    return _spec_attn_res([*anchors, h], *tail), len(anchors)


def test_anchor_counts_on_the_k3_schedule() -> None:
    assert [anchors_before(layer, 12) for layer in (0, 1, 12, 13, 24, 25, 92)] == [
        0,
        1,
        1,
        2,
        2,
        3,
        8,
    ]
    assert anchors_after(12, 12) == 2 and anchors_after(11, 12) == 1 and anchors_after(0, 12) == 1
    stream = AttnResStream(torch.randn(1, H), block_size=12)
    one = torch.ones(H), torch.ones(1, H)
    for layer in range(93):
        assert len(stream.anchors) == anchors_before(layer, 12)
        x = stream.attention_input(layer, *one, 1e-5)
        assert len(stream.anchors) == anchors_after(layer, 12)
        stream.add_attention(0.1 * x)
        stream.add_mlp(0.1 * stream.mlp_input(*one, 1e-5))
    assert len(stream.anchors) == 8  # embedding + sums of layers 0-11, ..., 72-83


@pytest.mark.parametrize("layers,block", [(7, 3), (13, 12), (5, 1)])
def test_values_equal_the_spec_recurrence(layers: int, block: int) -> None:
    g = torch.Generator().manual_seed(layers)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    weights = [
        ((1 + 0.1 * rnd(H), rnd(1, H)), (1 + 0.1 * rnd(H), rnd(1, H))) for _ in range(layers)
    ]
    mats = [(rnd(H, H) * 0.3, rnd(H, H) * 0.3) for _ in range(layers)]
    attn_fns = [lambda x, m=m: torch.tanh(x @ m[0]) for m in mats]
    mlp_fns = [lambda x, m=m: torch.tanh(x @ m[1]) for m in mats]
    tail = (1 + 0.1 * rnd(H), rnd(1, H))
    h0 = rnd(3, H)  # three token rows, mixed independently
    stream = AttnResStream(h0, block)
    for layer in range(layers):
        x = stream.attention_input(layer, *weights[layer][0], 1e-5)
        stream.add_attention(attn_fns[layer](x))
        stream.add_mlp(mlp_fns[layer](stream.mlp_input(*weights[layer][1], 1e-5)))
    got = stream.output(*tail, 1e-5)
    for row in range(3):
        want, num_anchors = _spec_recurrence(h0[row], weights, attn_fns, mlp_fns, block, tail)
        # fp32 summation-order noise, against the output's scale: the three rows go through each matmul
        # together here and one at a time in the spec loop, and BLAS sums a [3, H] and a [H] product in
        # different orders on some CPUs (1.9e-6 on a Xeon, with 1e-6 allowed, at atol=1e-6)
        torch.testing.assert_close(got[row], want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)
        assert num_anchors == len(stream.anchors)


def test_single_value_mixture_is_the_value() -> None:
    v = torch.randn(4, H)
    torch.testing.assert_close(attn_res([v], torch.randn(H), torch.randn(1, H)), v, atol=0, rtol=0)
