"""Tests of policygrad.core.covariance_losses: Clip-Cov and KL-Cov (Cui et al. 2025, section 5),
their defaults from the declarations, their option checks and the identities with PPO and the
unclipped surrogate when nothing is selected. (Their selections worked by hand are in
tests/core/test_entropy.py, beside the selection they use.)"""

from __future__ import annotations

import inspect

import pytest
import torch

from policygrad.core.covariance_losses import clip_cov_loss, kl_cov_loss
from policygrad.core.losses import get_policy_loss
from policygrad.core.policy_losses import ppo_loss
from policygrad.specs.losses import policy_loss_options

pytestmark = pytest.mark.unit

F64 = torch.float64


def _defaults(fn):
    params = inspect.signature(fn).parameters.values()
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and p.name != "selected"}


def test_registered_with_the_declared_defaults_and_their_selection_mode():
    assert get_policy_loss("clip_cov") is clip_cov_loss and get_policy_loss("kl_cov") is kl_cov_loss
    assert _defaults(clip_cov_loss) == policy_loss_options("clip_cov")
    assert _defaults(kl_cov_loss) == {"kl_cov_ratio": 2e-3, "kl_cov_coef": 1.0}
    assert (clip_cov_loss.token_selection, kl_cov_loss.token_selection) == ("clip_cov", "kl_cov")


def test_with_nothing_selected_they_are_ppo_and_the_unclipped_surrogate():
    # ratios 1.5 and 0.5 against advantages +1 / -1; an empty selection changes no token:
    # clip_cov is then PPO exactly, kl_cov the unclipped -A r = [-1.5, 0.5].
    old = torch.zeros(1, 2, dtype=F64)
    lp = torch.log(torch.tensor([[1.5, 0.5]], dtype=F64))
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    mask = torch.ones(1, 2)
    none = torch.zeros(1, 2, dtype=torch.bool)
    loss, metrics = clip_cov_loss(lp, old, adv, mask, selected=none)
    ppo, _ = ppo_loss(lp, old, adv, mask)
    assert torch.equal(loss, ppo) and metrics["cov_selected_frac"].item() == 0.0
    loss, metrics = kl_cov_loss(lp, old, adv, mask, selected=none)
    torch.testing.assert_close(loss, torch.tensor([[-1.5, 0.5]], dtype=F64), rtol=0, atol=1e-15)
    assert metrics["cov_selected_frac"].item() == 0.0


def test_option_errors():
    z = torch.zeros(1, 2)
    m = torch.ones(1, 2)
    with pytest.raises(ValueError, match=r"^kl_cov_coef must be a finite number >= 0, got -1.0$"):
        kl_cov_loss(z, z, z, m, kl_cov_coef=-1.0)
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\] \(a fraction of the valid tokens\)"):
        kl_cov_loss(z, z, z, m, kl_cov_ratio=2)
    with pytest.raises(ValueError, match=r"lb must be <= ub \(a covariance band\), got lb=5.0, ub=1.0"):
        clip_cov_loss(z, z, z, m, clip_cov_lb=5.0, clip_cov_ub=1.0)
