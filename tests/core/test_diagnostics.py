"""Tests of policygrad.core.diagnostics."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.core.advantages import estimate_advantages
from policygrad.core.diagnostics import (
    explained_variance,
    group_index_from_size,
    mean_value,
    std_value,
    zero_variance_group_fraction,
)

pytestmark = pytest.mark.unit

NAN = float("nan")


def test_explained_variance_hand_value_ignores_padding():
    # valid returns [1, 2, 3], values [1, 2, 2]: residual [0, 0, 1].
    # Var[returns] = 2/3; residual mean 1/3, deviations -1/3, -1/3, 2/3 -> Var = 6/9 / 3 = 2/9.
    # EV = 1 - (2/9) / (2/3) = 2/3.
    returns = torch.tensor([[1.0, 2.0, NAN], [3.0, 1e30, 5.0]], dtype=torch.float64)
    values = torch.tensor([[1.0, 2.0, 7.0], [2.0, NAN, -4.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ev = explained_variance(values, returns, mask)
    assert ev.dtype == torch.float64 and ev.dim() == 0
    assert ev.item() == pytest.approx(2 / 3, abs=1e-15)


def test_explained_variance_reference_points():
    gen = torch.Generator().manual_seed(0)
    returns = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    mask = torch.ones(4, 5)
    assert explained_variance(returns, returns, mask).item() == 1.0  # perfect critic
    mean = torch.full_like(returns, returns.mean().item())
    assert explained_variance(mean, returns, mask).item() == pytest.approx(
        0.0, abs=1e-14
    )  # predicts the mean
    # predicting -returns: residual 2 * returns, Var = 4 Var[returns] -> 1 - 4 = -3
    assert explained_variance(-returns, returns, mask).item() == pytest.approx(-3.0, abs=1e-13)


def test_explained_variance_is_nan_when_returns_do_not_vary():
    # float32 0.9 three times (mean not exactly 0.9): the variance must be exactly 0 -> NaN (documented)
    returns = torch.tensor([[0.9, 0.9, 0.9, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert math.isnan(explained_variance(torch.zeros(1, 4), returns, mask).item())
    assert math.isnan(explained_variance(torch.zeros(1, 4), returns, torch.zeros(1, 4)).item())


def test_explained_variance_of_gae_returns_with_a_perfect_td_critic():
    # With lam = 0 and values equal to the true reward-to-go (gamma 1), every TD error is 0, so
    # the returns equal the values and EV = 1.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    values = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 123.0]], dtype=torch.float64)
    _, returns = estimate_advantages(
        "gae", rewards, mask, group_index=torch.tensor([0, 1]), values=values, lam=0.0
    )
    assert explained_variance(values, returns, mask).item() == 1.0


def test_explained_variance_errors_name_the_argument():
    with pytest.raises(ValueError, match="values"):
        explained_variance(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 4))
    with pytest.raises(ValueError, match="response_mask"):
        explained_variance(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2))
    with pytest.raises(TypeError, match="returns"):
        explained_variance(torch.zeros(2), [0.0, 1.0], torch.ones(2))


def test_group_index_from_size():
    assert torch.equal(group_index_from_size(2, 3), torch.tensor([0, 0, 0, 1, 1, 1]))
    assert torch.equal(group_index_from_size(3, 1), torch.tensor([0, 1, 2]))
    assert group_index_from_size(4, 2).dtype == torch.long
    with pytest.raises(ValueError, match="group_size"):
        group_index_from_size(2, 0)
    with pytest.raises(ValueError, match="num_prompts"):
        group_index_from_size(2.0, 4)


def test_zero_variance_group_fraction():
    # groups: {1, 1} all equal, {0, 1} varied, {0.1, 0.1} all equal -> 2 of 3
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.1, 0.1])
    assert zero_variance_group_fraction(rewards, group_index_from_size(3, 2)).item() == pytest.approx(2 / 3)
    # ids in any order and not 0..K-1: the same groups give the same fraction
    shuffled = torch.tensor(
        [4, 1, 9, 4, 1, 9]
    )  # rows 1,4 -> id 1 {1, 0.1}; rows 0,3 {1, 1}; rows 2,5 {0, 0.1}
    assert zero_variance_group_fraction(rewards, shuffled).item() == pytest.approx(1 / 3)
    assert zero_variance_group_fraction(torch.tensor([0.0, 1.0]), torch.tensor([0, 0])).item() == 0.0
    with pytest.raises(ValueError, match="group_index"):
        zero_variance_group_fraction(rewards, torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="group_index"):
        zero_variance_group_fraction(rewards, torch.zeros(6))
    with pytest.raises(ValueError, match="rewards"):
        zero_variance_group_fraction(rewards[None, :], torch.zeros(1, 6, dtype=torch.long))


def test_mean_and_std_of_rewards_near_float32s_range_are_finite():
    big = torch.full((8,), 3e38)  # each finite in float32; their float32 sum is not
    assert math.isinf(big.sum().item())
    assert mean_value(big) == pytest.approx(3e38, rel=1e-7)  # float32(3e38) = 2.99999994e38
    spread = torch.tensor([3e38, -3e38])
    assert math.isinf(spread.std().item())
    # sample std of [a, -a] is a * sqrt(2) = 4.2426e38, beyond float32 but a finite Python float
    assert std_value(spread) == pytest.approx(3e38 * math.sqrt(2), rel=1e-7)
    # otherwise exactly the tensor's own values, NaN and infinity included
    small = torch.tensor([0.1, 0.2, 0.3])
    assert mean_value(small) == small.mean().item() and std_value(small) == small.std().item()
    assert math.isnan(mean_value(torch.tensor([]))) and std_value(torch.tensor([1.0])) == 0.0
    assert math.isinf(mean_value(torch.tensor([float("inf"), 1.0])))
