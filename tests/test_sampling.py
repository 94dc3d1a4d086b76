"""The sampler on edge values a client can send."""

from __future__ import annotations

import pytest
import torch

from ragfuse.engine.config import EngineConfig
from ragfuse.engine.errors import ModelError, RequestError
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


@pytest.mark.parametrize("bad", [
    {"seed": 2**64}, {"seed": -1}, {"seed": "1"}, {"stop_token_ids": 2}, {"stop_token_ids": ["2"]},
    {"stop": 5}, {"stop": ["a", 3]}, {"top_k": 1.5}, {"top_k": "3"}, {"max_tokens": 2.0},
])
def test_values_of_the_wrong_type_or_range_are_a_request_error(bad):
    with pytest.raises(RequestError):
        SamplingParams(**bad)
    SamplingParams(seed=2**64 - 1, stop_token_ids=[2], stop="x", top_k=3)  # the edges are fine


@pytest.mark.parametrize("bad", [{"max_num_seqs": 0}, {"block_size": 0}, {"max_model_len": -5},
                                 {"max_num_batched_tokens": 0}, {"block_size": 1.5}])
def test_engine_limits_the_engine_cannot_run_with_are_a_model_error(bad):
    with pytest.raises(ModelError, match=next(iter(bad))):
        EngineConfig(device="cpu", **bad)
