"""The tolerance table of tests/trainer/tolerances.py classifies every metric a run logs, so a new
metric cannot silently inherit the plain relative bound; and its bounds by hand."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.learn.metrics import METRICS
from tests.trainer.tolerances import BOUNDS, REL, allowed_gap, assert_same_metrics, bound_of, conditioning

pytestmark = pytest.mark.unit


def test_every_metric_name_is_classified_once():
    assert set(BOUNDS) == set(METRICS) | {"step"}
    assert bound_of("reward_fn//x/rewards.py:f/mean") is BOUNDS["reward_fn/<fn>/mean"]
    assert bound_of("eval/pass@8") is BOUNDS["eval/pass@<k>"]
    assert bound_of("time/forward_s") is None  # volatile: never compared


def test_an_unclassified_metric_fails_the_comparison():
    with pytest.raises(KeyError, match="metric 'policy/new_thing' has no tolerance"):
        assert_same_metrics([{"policy/new_thing": 1.0}], [{"policy/new_thing": 1.0}], [{}])


def test_conditioning_and_the_bounds_by_hand():
    # two valid tokens: x = (-1, -3), A = (1, -1); the third is masked (its values never count).
    x = torch.tensor([[-1.0, -3.0, -50.0]])
    a = torch.tensor([[1.0, -1.0, 9.0]])
    c = conditioning(x, a, torch.tensor([[1, 1, 0]]))
    # mean x = -2, mean A = 0: |x||A - mean A| = (1, 3), |x - mean x||A| = (1, 1): cov_scale 3
    assert c == {"lp_abs": 2.0, "lp_rms": math.sqrt(5.0), "lp_max": 3.0, "adv_abs": 1.0, "cov_scale": 3.0}
    m = {"entropy/cov": 1.0, "kl/loss_term": 0.02, "kl/ref": 0.0}
    assert allowed_gap("entropy/cov", m, m, c) == pytest.approx(REL * 1.0 + 1e-7 + REL * 3.0, rel=1e-12)
    # k3: 2 REL lp_rms sqrt(2 k) = 2e-5 * sqrt(5) * 0.2
    kl = REL * 0.02 + 1e-7 + 2 * REL * math.sqrt(5.0) * 0.2
    assert allowed_gap("kl/loss_term", m, m, c) == pytest.approx(kl, rel=1e-12)
    assert allowed_gap("kl/ref", m, m, c) == pytest.approx(1e-7 + 2 * REL * 2.0, rel=1e-12)


def test_a_gap_over_the_bound_fails_and_nan_equals_nan():
    c = {"lp_abs": 2.0, "lp_rms": 2.0, "lp_max": 3.0, "adv_abs": 1.0, "cov_scale": 3.0}
    one = {"step": 1, "reward/mean": 0.5, "entropy/cov": -0.0076, "eval/turns_to_success": math.nan}
    near = {**one, "entropy/cov": -0.0076 + 2e-5}  # within REL * (0.0076 + 3) + 1e-7 = 3.0e-5
    assert_same_metrics([one], [near], [c])
    far = {**one, "entropy/cov": -0.0076 + 5e-5}
    with pytest.raises(AssertionError, match="entropy/cov"):
        assert_same_metrics([one], [far], [c])
    with pytest.raises(AssertionError, match="reward/mean"):
        assert_same_metrics([one], [{**one, "reward/mean": 0.5 * (1 + 3 * REL)}], [c])
