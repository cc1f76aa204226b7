"""Tests of the exact KL experiments: Schulman's (2020) Gaussian ratios, the closed forms by hand
and against Monte Carlo, and every placement's expected gradient against the reverse or forward
KL's (Tang & Munos 2025)."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.lab.kl_exact import (
    PLACEMENT_THEORY,
    gaussian_kl_table,
    gaussian_theory,
    placement_gradients,
    placement_table,
    true_kl_gradients,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def table():
    return {(r.mu, r.kind): r for r in gaussian_kl_table(n_samples=1_000_000, seed=0)}


def test_schulman_ratios_at_mu_0_1(table):
    # Schulman (2020), q = N(0,1), p = N(0.1,1), true KL = 0.005: std/KL about 20 for k1 and
    # 1.42 for k2 and k3 (his table); within 10%.
    assert table[(0.1, "k1")].true_kl == pytest.approx(0.005)
    assert table[(0.1, "k1")].std_rel == pytest.approx(20.0, rel=0.10)
    assert table[(0.1, "k3")].std_rel == pytest.approx(1.42, rel=0.10)
    assert table[(0.1, "k2")].std_rel == pytest.approx(1.42, rel=0.10)
    # Unbiased: |bias/KL| within 5 standard errors (std/KL / sqrt(N) = 0.02 for k1).
    assert abs(table[(0.1, "k1")].bias_rel) < 0.1
    assert abs(table[(0.1, "k3")].bias_rel) < 0.01


def test_schulman_ratios_at_mu_1(table):
    # Schulman, p = N(1,1), KL = 0.5: k1 std 2; k2 bias 0.25, std 1.73; k3 std 1.7.
    assert table[(1.0, "k1")].std_rel == pytest.approx(2.0, rel=0.10)
    assert table[(1.0, "k2")].bias_rel == pytest.approx(0.25, rel=0.10)
    assert table[(1.0, "k2")].std_rel == pytest.approx(1.73, rel=0.10)
    assert table[(1.0, "k3")].std_rel == pytest.approx(1.7, rel=0.10)


def test_closed_forms_by_hand():
    # k1 = mu^2/2 - mu x: std = mu, so std/KL = mu / (mu^2/2) = 2/mu = 20 at mu = 0.1.
    assert gaussian_theory(0.1, "k1") == pytest.approx((0.0, 20.0))
    # k3: Var = exp(mu^2) - 1 - mu^2 = 1.0050167 - 1.01 -> 5.01671e-5; sqrt = 7.08288e-3;
    # / 0.005 = 1.41658.
    assert gaussian_theory(0.1, "k3")[1] == pytest.approx(1.41658, abs=1e-5)
    # k2: E = (mu^4/4 + mu^2)/2, bias/KL = mu^2/4 = 1.0 at mu = 2; Var = mu^4/2 + mu^6/4 = 8 + 16
    # = 24 at mu = 2, std/KL = sqrt(24) / 2 = 2.449490.
    assert gaussian_theory(2.0, "k2") == pytest.approx((1.0, math.sqrt(24) / 2))
    with pytest.raises(ValueError, match="mu must be != 0"):
        gaussian_theory(0.0, "k1")
    with pytest.raises(ValueError, match="valid kinds: k1, k2, k3"):
        gaussian_theory(1.0, "k4")


def test_monte_carlo_matches_closed_forms(table):
    for (mu, kind), row in table.items():
        if kind == "k3" and mu >= 1.0:
            # r = exp(mu x - mu^2/2) has a heavy right tail (E r^4 = exp(6 mu^2)): the sample std
            # converges slowly (relative standard error ~3% at mu = 1, far more at mu = 2).
            tolerance = 0.1 if mu == 1.0 else 0.7
        else:
            tolerance = 0.02
        assert row.std_rel == pytest.approx(row.theory_std_rel, rel=tolerance), (mu, kind)
        if kind == "k3" and mu >= 1.0:
            continue
        assert row.bias_rel == pytest.approx(row.theory_bias_rel, abs=5 * row.theory_std_rel / 1000), (
            mu,
            kind,
        )
        if kind != "k1":
            assert row.frac_negative == 0.0  # k2, k3 >= 0


def test_placement_table_matches_theory():
    rows = placement_table(vocab_size=8, seed=0)
    assert len(rows) == 2 * len(PLACEMENT_THEORY)
    for r in rows:
        assert r.matches, (
            r.setting,
            r.placement,
            r.estimator,
            r.measured,
            r.rel_err_reverse,
            r.rel_err_forward,
        )
    # Near the reference the forward and reverse gradients agree to first order.
    near = {(r.placement, r.estimator): r for r in rows if r.setting == "near"}
    assert near[("loss", "k3")].cos_reverse > 0.99
    far = {(r.placement, r.estimator): r for r in rows if r.setting == "far"}
    assert far[("loss", "k3")].cos_reverse < 0.99


def test_k3_in_loss_gradient_by_hand():
    # pi uniform over 3 outcomes (theta = 0), ref = [1/2, 1/4, 1/4] (logits [log 2, 0, 0]).
    # Forward KL gradient: d/dtheta_j KL(ref || pi) = pi_j - ref_j = [-1/6, 1/12, 1/12].
    # Reverse: pi_j (log(pi_j/ref_j) - KL) with KL = (1/3) log(32/27):
    #   j = 0: (1/3)(log(2/3) - KL); j = 1, 2: (1/3)(log(4/3) - KL).
    theta = torch.zeros(3, dtype=torch.float64)
    ref = torch.tensor([math.log(2.0), 0.0, 0.0], dtype=torch.float64)
    grads = placement_gradients(theta, ref)
    forward = torch.tensor([-1 / 6, 1 / 12, 1 / 12], dtype=torch.float64)
    kl = math.log(32 / 27) / 3
    reverse = (
        torch.tensor([math.log(2 / 3) - kl, math.log(4 / 3) - kl, math.log(4 / 3) - kl], dtype=torch.float64)
        / 3
    )
    torch.testing.assert_close(grads[("loss", "k3")], forward, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads[("loss", "k2")], reverse, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads[("loss", "w*k3")], reverse, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads[("reward", "k1")], reverse, rtol=1e-12, atol=1e-14)
    assert grads[("loss", "k1")].abs().max() < 1e-15
    g_rev, g_fwd = true_kl_gradients(theta, ref)
    torch.testing.assert_close(g_fwd, forward, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_rev, reverse, rtol=1e-12, atol=1e-14)
