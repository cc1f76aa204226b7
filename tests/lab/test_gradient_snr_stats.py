"""Tests of the gradient-SNR statistics: one estimator's noise, bias-corrected SNR and cosines over
its draws, worked by hand in float64."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.lab.gradient_snr_stats import Accumulator, GradientSNRResult

pytestmark = pytest.mark.unit


def _stats(draws, ref):
    acc = Accumulator(2)
    for g in draws:
        acc.add(torch.tensor(g, dtype=torch.float64), ref)
    return acc.stats("est", batch=8, ref=ref)


def test_noise_snr_and_cosines_by_hand():
    # g = [3, 4] and [3, -4] (norm 5 each), reference [1, 0]: mean m = [3, 0], ||m||^2 = 9;
    # noise = (25 + 25 - 2 * 9) / (2 - 1) = 32; signal = 9 - 32 / 2 < 0 -> 0, so snr = 0;
    # snr_raw = 9 / 32; each draw's cosine 3 / 5, the mean's cosine 3 / 3 = 1.
    s = _stats([[3.0, 4.0], [3.0, -4.0]], torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert (s.name, s.draws, s.samples_per_batch) == ("est", 2, 8)
    assert (s.noise, s.snr, s.snr_raw) == (32.0, 0.0, 9 / 32)
    assert (s.cos_ref, s.cos_mean_ref, s.grad_norm) == (0.6, 1.0, 5.0)
    # g = [2, 0] and [4, 0], reference [0, 1]: m = [3, 0]; noise = (4 + 16 - 18) / 1 = 2;
    # signal = 9 - 2 / 2 = 8: snr = 4, snr_raw = 9 / 2; both directions orthogonal to the reference.
    s = _stats([[2.0, 0.0], [4.0, 0.0]], torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert (s.noise, s.snr, s.snr_raw, s.grad_norm) == (2.0, 4.0, 4.5, 3.0)
    assert (s.cos_ref, s.cos_mean_ref) == (0.0, 0.0)
    # Identical draws have no noise: an infinite ratio; without a reference the cosines are 1.
    s = _stats([[0.0, 2.0], [0.0, 2.0]], None)  # norms exact: 2
    assert s.noise == 0.0 and s.snr == math.inf and s.snr_raw == math.inf
    assert (s.cos_ref, s.cos_mean_ref) == (1.0, 1.0)


def test_a_result_names_its_estimators():
    one = _stats([[2.0, 0.0], [4.0, 0.0]], None)
    result = GradientSNRResult([one], one, 0.5, 0.5, 0.0, 2, "last-layer", None, None, None, {}, table="t")
    assert result.stats("est") is one
    with pytest.raises(KeyError, match=r"no estimator 'grpo'; measured: \['est'\]"):
        result.stats("grpo")
    assert "table" not in result.to_dict() and result.to_dict()["reference"]["noise"] == 2.0
