"""Tests of policygrad.core.entropy and the Clip-Cov / KL-Cov losses: values worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.core.entropy import AdaptiveEntropyController, covariance_selection, token_covariance
from policygrad.core.losses import get_policy_loss, ppo_loss

pytestmark = pytest.mark.unit

NAN = float("nan")
# Two rows of three valid tokens and one masked column holding NaN (it must not leak).
LP = torch.tensor([[-0.1, -2.0, -0.5, NAN], [-1.0, -0.2, -3.0, NAN]])
ADV = torch.tensor([[1.0, 1.0, 1.0, NAN], [-1.0, -1.0, -1.0, NAN]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
# mean log-prob = (-0.1 - 2 - 0.5 - 1 - 0.2 - 3) / 6 = -6.8 / 6 = -1.13333; mean advantage = 0.
# cov = (lp + 1.13333) * A:
#   row 0 (A = +1): 1.03333, -0.86667, 0.63333
#   row 1 (A = -1): -0.13333, -0.93333, 1.86667
COV = torch.tensor([[1.033333, -0.866667, 0.633333, 0.0], [-0.133333, -0.933333, 1.866667, 0.0]])


def test_token_covariance_by_hand_and_masked_nan_does_not_leak():
    cov = token_covariance(LP, ADV, MASK)
    torch.testing.assert_close(cov, COV, rtol=0, atol=1e-5)
    # its mean over the valid tokens is the batch covariance: (1.03333 - 0.86667 + 0.63333
    # - 0.13333 - 0.93333 + 1.86667) / 6 = 1.6 / 6
    assert float(cov.sum() / MASK.sum()) == pytest.approx(1.6 / 6, abs=1e-6)


def test_token_covariance_over_ranks_equals_one_process():
    # Two "ranks" holding one row each: reduce adds the other rank's (sum lp, sum A, count).
    def other_sums(row):
        m = MASK[row].bool()
        return torch.tensor([LP[row][m].sum(), ADV[row][m].sum(), m.sum()], dtype=torch.float64)

    for rank in (0, 1):
        cov = token_covariance(
            LP[rank : rank + 1],
            ADV[rank : rank + 1],
            MASK[rank : rank + 1],
            reduce=lambda t, r=rank: t + other_sums(1 - r),
        )
        torch.testing.assert_close(cov, COV[rank : rank + 1], rtol=0, atol=1e-5)


def test_kl_cov_selects_the_largest_covariances():
    # floor(0.34 x 6 valid) = 2 tokens: 1.86667 at (1, 2) and 1.03333 at (0, 0).
    selected = covariance_selection(COV, MASK, mode="kl_cov", ratio=0.34)
    assert selected.tolist() == [[True, False, False, False], [False, False, True, False]]
    # floor(0.1 x 6) = 0: nothing (the paper's ratio on a small batch selects nothing)
    assert not covariance_selection(COV, MASK, mode="kl_cov", ratio=0.1).any()


def test_clip_cov_draws_from_the_band_only_and_at_least_one():
    # Band [1, 5] holds (0, 0) = 1.033 and (1, 2) = 1.867. The paper's ratio 2e-4 x 6 tokens
    # floors to 0, and Clip-Cov clips at least one: exactly one of the two.
    one = covariance_selection(COV, MASK, mode="clip_cov", ratio=2e-4, lb=1.0, ub=5.0)
    assert int(one.sum()) == 1 and bool(one[0, 0] or one[1, 2])
    # a ratio asking for 3 tokens gets the 2 the band holds
    both = covariance_selection(COV, MASK, mode="clip_cov", ratio=0.5, lb=1.0, ub=5.0)
    assert both.tolist() == [[True, False, False, False], [False, False, True, False]]
    # band [0.5, 1.5]: (0, 0) = 1.033 and (0, 2) = 0.633; tokens PPO already clips are not eligible
    eligible = torch.ones_like(MASK, dtype=torch.bool)
    eligible[0, 0] = False
    only = covariance_selection(COV, MASK, mode="clip_cov", ratio=0.5, lb=0.5, ub=1.5, eligible=eligible)
    assert only.tolist() == [[False, False, True, False], [False, False, False, False]]
    # an empty band selects nothing, and neither does ratio 0 (Clip-Cov off)
    assert not covariance_selection(COV, MASK, mode="clip_cov", ratio=0.5, lb=2.0, ub=5.0).any()
    assert not covariance_selection(COV, MASK, mode="clip_cov", ratio=0.0).any()


def test_a_nan_covariance_is_never_selected():
    # A NaN on a valid token (e.g. a NaN advantage) would sort above every number in KL-Cov's
    # ranking and sits in no band: neither selection picks it. With (0, 0) NaN, KL-Cov's top 2 of
    # the other tokens are 1.867 at (1, 2) and 0.633 at (0, 2).
    cov = COV.clone()
    cov[0, 0] = NAN
    top = covariance_selection(cov, MASK, mode="kl_cov", ratio=0.34)
    assert top.tolist() == [[False, False, True, False], [False, False, True, False]]
    band = covariance_selection(cov, MASK, mode="clip_cov", ratio=0.5, lb=-10.0, ub=10.0)
    assert not band[0, 0] and int(band.sum()) == 3  # floor(0.5 x 6 valid) of the 5 finite ones


def test_clip_cov_draw_depends_on_the_token_not_on_the_batch_it_is_in():
    # 8 rows with the same covariance on every valid token: which 4 of them are chosen is a
    # function of (row id, position) only, so the same rows in another order, or split in two
    # halves with their row ids, choose the same tokens.
    cov = torch.full((8, 5), 2.0)
    mask = torch.ones(8, 5)
    full = covariance_selection(cov, mask, mode="clip_cov", ratio=0.1, rows=torch.arange(8))
    assert int(full.sum()) == 4  # floor(0.1 x 40)
    order = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    permuted = covariance_selection(cov, mask, mode="clip_cov", ratio=0.1, rows=order)
    assert torch.equal(permuted, full[order])
    # the draw is not constant: different tokens in different rows
    assert full.any(dim=1).sum() >= 2


def test_covariance_selection_refuses_bad_arguments():
    with pytest.raises(ValueError, match="unknown mode 'top'; valid modes: clip_cov, kl_cov"):
        covariance_selection(COV, MASK, mode="top", ratio=0.1)
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\]"):
        covariance_selection(COV, MASK, mode="kl_cov", ratio=1.5)
    with pytest.raises(ValueError, match="lb must be <= ub"):
        covariance_selection(COV, MASK, mode="clip_cov", ratio=0.1, lb=5.0, ub=1.0)


def test_clip_cov_loss_detaches_the_selected_tokens():
    # On-policy (ratio 1) the PPO loss is -A per token and its gradient -A. With the band [1, 5]
    # and ratio 0.5 the selection is (0, 0) and (1, 2) (see above): their loss and gradient are 0.
    lp = LP.clone().requires_grad_(True)
    loss, metrics = get_policy_loss("clip_cov")(lp, LP, ADV, MASK, clip_cov_ratio=0.5)
    expected = torch.tensor([[0.0, -1.0, -1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    assert torch.equal(loss.detach(), expected)
    loss.sum().backward()
    assert torch.equal(lp.grad, expected)
    assert float(metrics["cov_selected_frac"]) == pytest.approx(2 / 6)
    # everything but the selected tokens is PPO's
    ppo, _ = ppo_loss(LP, LP, ADV, MASK)
    keep = expected != 0
    assert torch.equal(loss.detach()[keep], ppo[keep])
    # the trainer's selection (a whole step's) replaces the loss's own
    chosen = torch.zeros_like(MASK, dtype=torch.bool)
    chosen[1, 0] = True
    loss, metrics = get_policy_loss("clip_cov")(LP, LP, ADV, MASK, selected=chosen)
    assert loss[1, 0] == 0 and torch.equal(loss[0, :3], torch.tensor([-1.0, -1.0, -1.0]))
    assert float(metrics["cov_selected_frac"]) == pytest.approx(1 / 6)


def test_kl_cov_loss_by_hand():
    # old = 0, ratios r = [[1.5, 1], [0.5, 1]], A = [[1, 1], [-1, -1]], tokens (0, 0) and (1, 0)
    # selected, coefficient 1:
    #   loss = -A r + |log r| on selected: (0, 0) -1.5 + log 1.5 = -1.094535; (1, 0) 0.5 + log 2 = 1.193147
    #   others -A r: (0, 1) -1, (1, 1) +1
    #   d loss / d log pi = -A r + sign(log r): (0, 0) -1.5 + 1 = -0.5; (1, 0) 0.5 - 1 = -0.5;
    #   (0, 1) -1; (1, 1) +1 (log r = 0 there, and it is not selected anyway)
    old = torch.zeros(2, 2)
    lp = torch.tensor([[math.log(1.5), 0.0], [math.log(0.5), 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    chosen = torch.tensor([[True, False], [True, False]])
    loss, metrics = get_policy_loss("kl_cov")(lp, old, adv, torch.ones(2, 2), selected=chosen)
    torch.testing.assert_close(
        loss.detach(),
        torch.tensor([[-1.5 + math.log(1.5), -1.0], [0.5 + math.log(2.0), 1.0]]),
        rtol=0,
        atol=1e-6,
    )
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5, -1.0], [-0.5, 1.0]]), rtol=0, atol=1e-6)
    assert float(metrics["cov_selected_frac"]) == 0.5 and float(metrics["clipfrac"]) == 0.0
    with pytest.raises(ValueError, match="kl_cov_coef must be a finite number >= 0"):
        get_policy_loss("kl_cov")(lp, old, adv, torch.ones(2, 2), kl_cov_coef=-1.0)


def test_adaptive_entropy_controller_by_hand():
    # Skywork-OR1's rule with start 0, target 0.2, delta 0.005.
    ctl = AdaptiveEntropyController(0.0, 0.2, 0.005)
    assert ctl.value == 0.0
    assert ctl.update(0.1) == pytest.approx(0.005)  # below target: up, applied
    assert ctl.update(0.15) == pytest.approx(0.010)
    assert ctl.update(0.3) == 0.0 and ctl.coef == pytest.approx(0.005)  # above: down, not applied
    assert ctl.update(0.3) == 0.0 and ctl.coef == 0.0
    assert ctl.update(0.3) == 0.0 and ctl.coef == 0.0  # never below 0
    assert ctl.update(0.19) == pytest.approx(0.005)
    other = AdaptiveEntropyController(1.0, 1.0, 1.0)
    other.load_state_dict(ctl.state_dict())
    assert (other.coef, other.target, other.delta, other.value) == (ctl.coef, 0.2, 0.005, ctl.value)
    with pytest.raises(ValueError, match="target must be > 0"):
        AdaptiveEntropyController(0.0, 0.0, 0.005)
    with pytest.raises(ValueError, match="needs coef, target, delta, active"):
        other.load_state_dict({"coef": 0.1})


def test_adaptive_entropy_coefficient_stops_at_its_cap():
    # Start 0.5, delta 0.25, cap 1: 0.75, 1.0, then held at 1.0 while the target is not reached
    # (before the cap, a target above ln V let it climb to 3e6); down again once it is.
    ctl = AdaptiveEntropyController(0.5, 0.2, 0.25, cap=1.0)
    assert [ctl.update(0.1) for _ in range(4)] == [0.75, 1.0, 1.0, 1.0] and ctl.capped
    assert ctl.update(0.3) == 0.0 and ctl.coef == 0.75 and not ctl.capped
    with pytest.raises(ValueError, match="cap must be >= init_coef=2.0"):
        AdaptiveEntropyController(2.0, 0.2, 0.25, cap=1.0)
