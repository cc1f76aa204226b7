"""The truncation policy (:mod:`policygrad.rewards.truncation`): ``none``, ``penalty`` and
``exclude`` by hand, and the errors of a bad mode, shape or penalty."""

from __future__ import annotations

import pytest
import torch

from policygrad.rewards.truncation import apply_truncation_policy

pytestmark = pytest.mark.unit


def test_truncation_policy_modes():
    rewards = torch.tensor([1.0, 0.0, 0.5])
    truncated = torch.tensor([False, True, True])
    r, v = apply_truncation_policy(rewards, truncated, mode="none")
    assert r.tolist() == [1.0, 0.0, 0.5] and v.tolist() == [True, True, True]
    r, v = apply_truncation_policy(rewards, truncated, mode="penalty", penalty=-1.0)
    assert r.tolist() == [1.0, -1.0, -1.0] and v.tolist() == [True, True, True]
    r, v = apply_truncation_policy(rewards, truncated, mode="exclude", valid=[False, True, True])
    assert r.tolist() == [1.0, 0.0, 0.5] and v.tolist() == [False, False, False]
    assert rewards.tolist() == [1.0, 0.0, 0.5]  # input untouched
    r, v = apply_truncation_policy([0.5], [True], mode="penalty", penalty=-0.25)
    assert r.dtype == torch.float32 and r.tolist() == [-0.25]


def test_truncation_policy_errors():
    with pytest.raises(
        ValueError, match="unknown truncation mode 'drop'; valid modes: none, penalty, exclude"
    ):
        apply_truncation_policy([1.0], [True], mode="drop")
    with pytest.raises(ValueError, match="same B"):
        apply_truncation_policy([1.0, 2.0], [True], mode="penalty")
    with pytest.raises(ValueError, match="must be 1-D"):
        apply_truncation_policy([[1.0]], [[True]], mode="penalty")
    with pytest.raises(ValueError, match="penalty must be a finite number"):
        apply_truncation_policy([1.0], [True], mode="penalty", penalty=float("inf"))
