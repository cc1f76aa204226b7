"""Tests of the mismatch statistics, worked by hand: per-token deltas, sequence sums and the
truncated importance weights, with padding masked out."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.lab.mismatch_stats import pair_stats

pytestmark = pytest.mark.integration


def test_pair_stats_by_hand():
    # delta = logprobs - behaviour = [[log 3, 0], [0.1, 0.2]], every token valid, cap 2.
    behaviour = torch.zeros(2, 2)
    logprobs = torch.tensor([[math.log(3.0), 0.0], [0.1, 0.2]])
    mask = torch.ones(2, 2)
    stats, valid = pair_stats("p", "b", "t", behaviour, logprobs, mask, cap=2.0)
    assert stats.n_tokens == 4 and stats.n_sequences == 2
    # Token weights exp(delta) = [3, 1, 1.105, 1.221]: only 3 > 2 -> 1 of 4 truncated.
    assert stats.token_trunc_frac == 0.25
    # Sequence log-ratios S = [log 3, 0.3]: W = [3, 1.3499]; truncated [2, 1.3499].
    assert stats.seq_trunc_frac == 0.5
    assert stats.seq_weight_max == pytest.approx(3.0, rel=1e-6)
    assert stats.seq_weight_std_truncated == pytest.approx((2.0 - math.exp(0.3)) / math.sqrt(2), rel=1e-6)
    assert stats.seq_weight_std == pytest.approx((3.0 - math.exp(0.3)) / math.sqrt(2), rel=1e-6)
    # S_1 = [log 3, 0.1]: std = (log 3 - 0.1) / sqrt(2) = 0.706166; S_2 = [log 3, 0.3]: 0.564700.
    assert stats.lengths == [1, 2]
    assert stats.cum_std == pytest.approx(
        [(math.log(3) - 0.1) / math.sqrt(2), (math.log(3) - 0.3) / math.sqrt(2)]
    )
    # sigma = sample std of the 4 deltas; sigma * sqrt(t).
    sigma = float(torch.tensor([math.log(3.0), 0.0, 0.1, 0.2], dtype=torch.float64).std())
    assert stats.std == pytest.approx(sigma)
    assert stats.sigma_sqrt_t == pytest.approx([sigma, sigma * math.sqrt(2)])
    # W_1 = [3, 1.105] truncated to [2, 1.105].
    assert stats.seq_weight_std_t_truncated[0] == pytest.approx((2 - math.exp(0.1)) / math.sqrt(2), rel=1e-6)
    assert stats.abs_max == pytest.approx(math.log(3.0), rel=1e-6)
    assert valid.numel() == 4


def test_pair_stats_masks_padding():
    # Padding holds garbage (inf): it must not reach any number.
    behaviour = torch.tensor([[0.0, float("inf")], [0.0, 0.0]])
    logprobs = torch.tensor([[0.5, float("nan")], [0.1, 0.3]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    stats, _ = pair_stats("p", "b", "t", behaviour, logprobs, mask)
    assert stats.n_tokens == 3
    assert math.isfinite(stats.std) and math.isfinite(stats.seq_weight_std)
    assert stats.lengths == [1]  # only one sequence has 2 tokens: the spread stops at t = 1
    with pytest.raises(ValueError, match="no valid token"):
        pair_stats("p", "b", "t", behaviour, logprobs, torch.zeros(2, 2))
