"""The rollout batch itself: its sampling params, and the operations that list its fields."""

from __future__ import annotations

import pytest

from policygrad.rollout.base import SamplingParams, check_sampling_args

pytestmark = pytest.mark.unit


def test_sampling_params_normalise_the_off_values():
    assert SamplingParams(1, 0, 1.0) == SamplingParams(1.0, None, None) == SamplingParams()
    p = SamplingParams(0.7, 5, 0.9, greedy=1)
    assert (p.temperature, p.top_k, p.top_p, p.greedy) == (0.7, 5, 0.9, True)
    assert type(p.temperature) is float and p.truncated and not SamplingParams(0.7).truncated
    assert p.tempered() == SamplingParams(0.7)  # the reference's distribution: no truncation
    assert hash(p) == hash(SamplingParams(0.7, 5, 0.9, True))
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # frozen
    # The same normalisation as the engines' argument check.
    _, temperature, top_k, top_p = check_sampling_args([[1]], 1, 0.7, 1.0, 0, 4)
    assert SamplingParams(0.7, 0, 1.0) == SamplingParams(temperature, top_k, top_p)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"temperature": 0.0}, ValueError, "temperature must be a finite number > 0"),
        ({"top_k": -1}, ValueError, "top_k must be >= 0"),
        ({"top_k": 2.0}, TypeError, "top_k must be an int or None"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
    ],
)
def test_sampling_params_reject_what_the_engines_reject(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)
