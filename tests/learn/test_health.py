"""``check_finite_weights`` refuses a model with a non-finite weight, naming the first bad
parameter. (The empty-update watch: tests/run/test_health.py.)"""

from __future__ import annotations

import pytest
import torch

from policygrad.config.train import ConfigError
from policygrad.learn.health import check_finite_weights

pytestmark = pytest.mark.unit


# ----------------------------------------------------------------------------- finite weights


def test_finite_weights_pass():
    check_finite_weights(torch.nn.Linear(3, 2), "model.name='tiny'")


def test_a_non_finite_weight_names_the_parameter_and_how_many():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
        model[1].weight[1, 1] = float("-inf")
        model[1].bias[0] = float("inf")  # a later parameter: the first bad one is named
    with pytest.raises(ConfigError, match=r"model.name='tiny' has non-finite weights: 1.weight holds 2 NaN"):
        check_finite_weights(model, "model.name='tiny'")


def test_integer_tensors_are_not_checked():
    model = torch.nn.Linear(2, 2)
    model.register_parameter("steps", torch.nn.Parameter(torch.tensor([1, 2]), requires_grad=False))
    check_finite_weights(model, "m")  # an int tensor has no NaN to hold
