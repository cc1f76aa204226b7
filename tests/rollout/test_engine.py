"""Tests of the engine interface (:mod:`policygrad.rollout.engine`): ``generate`` checks and
normalises its arguments into one :class:`GenerationRequest` before the engine's ``sample`` runs,
and an engine must implement both ``sample`` and ``sync_weights``."""

from __future__ import annotations

import pytest
import torch

from policygrad.rollout.base import SamplingParams
from policygrad.rollout.engine import GenerationRequest, RolloutEngine

pytestmark = pytest.mark.unit


class Recording(RolloutEngine):
    """Keeps the requests it is asked to sample; samples nothing."""

    def __init__(self):
        self.requests: list[GenerationRequest] = []

    def sample(self, request: GenerationRequest):
        self.requests.append(request)
        return "sampled"

    def sync_weights(self, _model: torch.nn.Module) -> None:
        raise AssertionError("not called here")


def test_generate_hands_the_engine_one_normalised_request():
    engine = Recording()
    # A tensor prompt becomes a list of ints; top_k 0 and top_p 1.0 are "off" (None); the
    # temperature an int 1 becomes the float 1.0; greedy and the counts become bool and ints.
    out = engine.generate(
        [torch.tensor([5, 6]), (7,)], group_size=2, temperature=1, top_k=0, top_p=1.0, max_new_tokens=3,
        greedy=1, prompt_seeds=[11, 12], ignore_eos=True,
    )
    assert out == "sampled"
    assert engine.requests == [
        GenerationRequest(
            prompts=[[5, 6], [7]], group_size=2, sampling=SamplingParams(1.0, None, None, greedy=True),
            max_new_tokens=3, generator_seed=None, prompt_seeds=[11, 12], ignore_eos=True,
        )
    ]
    request = engine.requests[0]
    assert type(request.sampling.temperature) is float and request.sampling.greedy is True
    assert request.routing_keys is None
    engine.generate([[5], [6]], max_new_tokens=1, routing_keys=(9, 9))
    assert engine.requests[-1].routing_keys == [9, 9]
    assert not RolloutEngine.shares_policy_weights  # an engine with its own weights by default


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"generator_seed": 1.5}, TypeError, "generator_seed must be an int or None, got float"),
        ({"generator_seed": True}, TypeError, "generator_seed must be an int or None, got bool"),
        ({"group_size": 0}, ValueError, "group_size must be >= 1"),
        ({"temperature": float("inf")}, ValueError, "temperature must be a finite number > 0"),
        ({"routing_keys": [1, 2]}, ValueError, r"routing_keys must be one int per prompt \(1\), got 2"),
        ({"routing_keys": [True]}, ValueError, "routing_keys must be one int per prompt"),
    ],
)
def test_a_bad_argument_is_refused_before_the_engine_samples(kwargs, error, match):
    engine = Recording()
    with pytest.raises(error, match=match):
        engine.generate([[1, 2]], **{"max_new_tokens": 2, **kwargs})
    assert engine.requests == []


def test_an_engine_implements_sample_and_sync_weights():
    class SamplesOnly(RolloutEngine):
        def sample(self, _request):
            return None

    with pytest.raises(TypeError, match="sync_weights"):
        SamplesOnly()
