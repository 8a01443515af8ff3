"""The sampler's distribution: softmax(logits / T) computed in float64 as the reference, and a
tiny but valid temperature (the daemon fuzz found 2.4e-271) stays a distribution, not NaN."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafind.engine.sampler import SamplingParams, greedy_tokens, make_sampler, sampling_probs


def test_probs_equal_a_float64_softmax() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 4
    for t in (0.1, 0.7, 1.0, 3.0, 100.0):
        ref = torch.softmax(logits.double() / t, -1).float()
        assert torch.allclose(sampling_probs(logits, SamplingParams(temperature=t)), ref, atol=1e-6)


def test_a_tiny_temperature_is_near_greedy_not_nan() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, float("-inf")])
    for t in (2.395262255090831e-271, 1e-40, 1e-8):
        p = sampling_probs(logits, SamplingParams(temperature=t, top_p=0.5, top_k=2))
        assert torch.equal(p, torch.tensor([0.0, 1.0, 0.0, 0.0])), (t, p)
        assert make_sampler(SamplingParams(temperature=t, seed=1))(logits) == 1


# Every value the request schema accepts (temperature [0, 2], top_p (0, 1]; SamplingParams allows
# temperature up to 100), subnormals included: 1e-320 and 1e-300 once gave NaN or an empty distribution.
temperatures = st.one_of(
    st.floats(0.0, 100.0, allow_subnormal=True), st.sampled_from([5e-324, 1e-320, 2.4e-271, 1e-45])
)
top_ps = st.one_of(
    st.floats(0.0, 1.0, exclude_min=True, allow_subnormal=True),
    st.sampled_from([5e-324, 1e-300, 1e-38]),
)
logit_rows = st.lists(
    st.one_of(st.floats(-1e4, 1e4), st.just(float("-inf"))), min_size=1, max_size=40
).filter(lambda xs: any(x != float("-inf") for x in xs))


@settings(max_examples=400, deadline=None)
@given(
    logits=logit_rows,
    temperature=temperatures,
    top_p=top_ps,
    top_k=st.integers(0, 50),
    seed=st.integers(0, 2**32),
)
def test_every_accepted_temperature_and_top_p_gives_a_distribution(
    logits, temperature, top_p, top_k, seed
) -> None:
    x = torch.tensor(logits, dtype=torch.float32)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    if temperature == 0.0:
        assert make_sampler(params)(x) == int(torch.argmax(x))
        return
    p = sampling_probs(x, params)
    assert torch.isfinite(p).all() and (p >= 0).all() and abs(float(p.sum()) - 1.0) < 1e-5, p
    assert float(p[int(torch.argmax(x))]) > 0  # the best token always survives top-k and top-p
    assert not (p[x == float("-inf")] > 0).any()  # a forbidden token never does
    token = make_sampler(params)(x)
    assert float(p[token]) > 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from([0.0, 1.0, 2.0, -1.0, float("inf"), float("-inf"), float("nan")]),
        min_size=1,
        max_size=40,
    ),
    st.integers(1, 3),
)
def test_greedy_tokens_pick_as_torch_argmax_does(values: list[float], rows: int) -> None:
    # few distinct values: ties, NaN and infinities everywhere; torch.argmax is the reference
    logits = torch.tensor(values * rows).reshape(rows, -1)
    assert greedy_tokens(logits) == torch.argmax(logits, dim=-1).tolist()
    assert greedy_tokens(logits[0]) == [int(torch.argmax(logits[0]))]
    assert make_sampler(SamplingParams(temperature=0.0))(logits[-1]) == int(
        torch.argmax(logits[-1])
    )
