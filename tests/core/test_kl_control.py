"""Tests of policygrad.core.kl_control: the fixed and the adaptive KL coefficient controllers
(Ziegler et al. 2019), their validation and their state for a resume."""

from __future__ import annotations

import pytest
import torch

from policygrad.core.kl import AdaptiveKLController as ReExported
from policygrad.core.kl_control import AdaptiveKLController, FixedKLController

pytestmark = pytest.mark.unit


def test_the_controllers_are_the_ones_core_kl_exports():
    assert ReExported is AdaptiveKLController


def test_case8_adaptive_controller_and_state_dict():
    # e = clip(12 / 6 - 1, -0.2, 0.2) = 0.2; beta = 0.2 * (1 + 0.2 * 1000 / 10000) = 0.2 * 1.02 = 0.204
    ctl = AdaptiveKLController(0.2, 6, 10000)
    assert ctl.update(12, 1000) == pytest.approx(0.204, abs=1e-12)
    assert ctl.value == pytest.approx(0.204, abs=1e-12)
    fresh = AdaptiveKLController(0.2, 6, 10000)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.value == pytest.approx(0.204, abs=1e-12)
    # below target: e = clip(3 / 6 - 1) = -0.2 -> 0.204 * (1 - 0.02) = 0.19992
    fresh.update(torch.tensor(3.0), 1000)
    assert fresh.value == pytest.approx(0.19992, abs=1e-12)
    # small error inside the clip: kl 6.6 -> e = 0.1 -> 0.19992 * (1 + 0.1 * 0.5) = 0.209916
    fresh.update(6.6, 5000)
    assert fresh.value == pytest.approx(0.209916, abs=1e-9)


def test_fixed_controller_unchanged():
    ctl = FixedKLController(0.05)
    assert ctl.update(100.0, 1000) == 0.05
    assert ctl.value == 0.05
    other = FixedKLController(0.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_controller_validation():
    with pytest.raises(ValueError, match="beta"):
        FixedKLController(-1.0)
    with pytest.raises(ValueError, match="init_beta"):
        AdaptiveKLController(-0.1, 6, 10000)
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, 0, 10000)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 6, 0)
    ctl = AdaptiveKLController(0.1, 6, 10000)
    with pytest.raises(ValueError, match="current_kl"):
        ctl.update(float("nan"), 10)
    with pytest.raises(ValueError, match="n_steps"):
        ctl.update(1.0, -1)
    with pytest.raises(ValueError, match="'horizon'"):
        ctl.load_state_dict({"value": 0.1, "target": 6.0})
    assert ctl.value == 0.1
