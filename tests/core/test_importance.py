"""Tests of policygrad.core.importance: truncated and masked importance weights by hand, per token
and per sequence, overflow-safe, and their errors."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.core.importance import truncated_importance_weights

pytestmark = pytest.mark.unit

NAN = float("nan")
F64 = torch.float64


def _tis_inputs():
    # Row 0 token ratios [1.8, 0.5, 3.0, pad]; row 1 [1.5, 1.5, pad, pad] (behavior log-prob -1).
    ratios = torch.tensor([[1.8, 0.5, 3.0, 1.0], [1.5, 1.5, 1.0, 1.0]], dtype=F64)
    behavior = torch.full((2, 4), -1.0, dtype=F64)
    logprobs = ratios.log() + behavior
    logprobs[0, 3] = NAN
    behavior[1, 2] = NAN
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return behavior, logprobs.requires_grad_(True), mask


def test_truncated_importance_weights_hand_example():
    # cap 2.5.
    # token/truncate: min(w, 2.5)                     -> [1.8, 0.5, 2.5, 0], [1.5, 1.5, 0, 0]
    # token/mask: 0 where w > 2.5                      -> [1.8, 0.5, 0, 0],   [1.5, 1.5, 0, 0]
    # sequence: W0 = 1.8 * 0.5 * 3 = 2.7, W1 = 1.5 * 1.5 = 2.25
    # sequence/truncate: [2.5, 2.5, 2.5, 0], [2.25, 2.25, 0, 0]
    # sequence/mask:     [0, 0, 0, 0],       [2.25, 2.25, 0, 0]
    behavior, logprobs, mask = _tis_inputs()
    expected = {
        ("token", "truncate"): [[1.8, 0.5, 2.5, 0.0], [1.5, 1.5, 0.0, 0.0]],
        ("token", "mask"): [[1.8, 0.5, 0.0, 0.0], [1.5, 1.5, 0.0, 0.0]],
        ("sequence", "truncate"): [[2.5, 2.5, 2.5, 0.0], [2.25, 2.25, 0.0, 0.0]],
        ("sequence", "mask"): [[0.0, 0.0, 0.0, 0.0], [2.25, 2.25, 0.0, 0.0]],
    }
    for (level, mode), values in expected.items():
        w = truncated_importance_weights(behavior, logprobs, mask, level=level, cap=2.5, mode=mode)
        torch.testing.assert_close(w, torch.tensor(values, dtype=F64), rtol=1e-12, atol=1e-12)
        assert not w.requires_grad


def test_truncated_importance_weights_overflow_safe():
    # 100 tokens each with log ratio 50: the sequence ratio exp(5000) overflows any float,
    # computed in log space it is exactly the cap (truncate) or 0 (mask).
    behavior = torch.zeros(1, 100)
    logprobs = torch.full((1, 100), 50.0)
    mask = torch.ones(1, 100)
    w = truncated_importance_weights(behavior, logprobs, mask, level="sequence", cap=2.0)
    torch.testing.assert_close(w, torch.full((1, 100), 2.0), rtol=0, atol=1e-6)
    w_mask = truncated_importance_weights(behavior, logprobs, mask, level="sequence", cap=2.0, mode="mask")
    assert torch.equal(w_mask, torch.zeros(1, 100))
    # and a sequence of many tiny log ratios stays accurate: 100 x log(1.005) -> 1.005^100 = 1.646668
    small = torch.full((1, 100), math.log(1.005), dtype=F64)
    w_small = truncated_importance_weights(torch.zeros(1, 100, dtype=F64), small, mask, level="sequence")
    assert w_small[0, 0].item() == pytest.approx(1.005**100, rel=1e-12)


def test_truncated_importance_weights_errors():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="token, sequence"):
        truncated_importance_weights(a, a, a, level="geometric")
    with pytest.raises(ValueError, match="truncate, mask"):
        truncated_importance_weights(a, a, a, mode="clip")
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(a, a, a, cap=0.0)
    with pytest.raises(ValueError, match="behavior_logprobs"):
        truncated_importance_weights(torch.zeros(2, 4), a, a)
    with pytest.raises(ValueError, match="response_mask"):
        truncated_importance_weights(a, a, torch.ones(3))
