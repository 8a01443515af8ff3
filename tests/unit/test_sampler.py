"""The sampler's distribution: softmax(logits / T) computed in float64 as the reference, and a
tiny but valid temperature (the daemon fuzz found 2.4e-271) stays a distribution, not NaN."""

import torch

from deltafind.engine.sampler import SamplingParams, make_sampler, sampling_probs


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
