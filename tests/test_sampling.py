"""The sampler on edge values a client can send."""

from __future__ import annotations

import torch

from ragfuse.engine.sampling import SamplingParams, sample


def test_a_vanishing_temperature_samples_greedily_instead_of_nan():
    logits = torch.tensor([[1.0, 30.0, 2.0], [4.0, -1.0, 3.0]])
    params = [SamplingParams(temperature=3.7e-160, seed=1), SamplingParams(temperature=1e-7, top_p=0.5)]
    assert all(p.greedy for p in params)
    assert sample(logits, params, [torch.Generator().manual_seed(1), None]) == [1, 0]
    assert not SamplingParams(temperature=0.01).greedy


def test_a_top_p_below_float32_range_keeps_the_most_likely_token():
    """top_p = 5e-324 (found by fuzzing the server) is 0 in float32: the nucleus still holds the top token."""
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    params = [SamplingParams(temperature=0.5, top_p=5e-324, seed=2)]
    assert sample(logits, params, [torch.Generator().manual_seed(2)]) == [1]
