"""Tests of policygrad.specs.losses: the built-in losses' options and the papers' defaults,
declared without torch, and the checks of option names the config runs before any torch."""

from __future__ import annotations

import pytest

from policygrad.specs import losses as spec_module
from policygrad.specs.losses import (
    BUILTIN_POLICY_LOSSES,
    check_new_policy_loss_name,
    check_policy_loss_option_names,
    declare_policy_loss,
    describe_options,
    list_policy_losses,
    policy_loss_options,
)

pytestmark = pytest.mark.unit


def test_the_builtin_declarations_and_their_defaults():
    assert list_policy_losses() == ["cispo", "clip_cov", "gspo", "kl_cov", "ppo", "vanilla"]
    # PPO 0.2 (Schulman et al. 2017); GSPO 3e-4 / 4e-4 (Zheng et al. 2025, section 5.1); CISPO no
    # lower bound and DAPO's 0.28 above; Clip-Cov 2e-4 in [1, 5], KL-Cov 2e-3 with coefficient 1.
    assert policy_loss_options("ppo") == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": None}
    assert policy_loss_options("gspo") == {"clip_low": 3e-4, "clip_high": 4e-4}
    assert policy_loss_options("cispo") == {"clip_low": None, "clip_high": 0.28}
    assert list(policy_loss_options("clip_cov")) == [
        "clip_low", "clip_high", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"
    ]  # fmt: skip
    assert policy_loss_options("kl_cov") == {"kl_cov_ratio": 2e-3, "kl_cov_coef": 1.0}
    assert policy_loss_options("vanilla") == {}
    policy_loss_options("ppo")["clip_low"] = 0.5  # a copy
    assert BUILTIN_POLICY_LOSSES["ppo"]["clip_low"] == policy_loss_options("ppo")["clip_low"] == 0.2


def test_option_names_are_checked_with_the_registry_messages():
    assert describe_options({}) == "(none)"
    assert describe_options({"a": 1, "b": None}) == "a (default 1), b (default None)"
    assert check_policy_loss_option_names("gspo", {"clip_low": 0.1}) == {"clip_low": 3e-4, "clip_high": 4e-4}
    with pytest.raises(ValueError) as info:
        check_policy_loss_option_names("gspo", {"dual_clip": 3.0})
    assert str(info.value) == (
        "policy loss 'gspo' has no option 'dual_clip'; its options: clip_low (default 0.0003), "
        "clip_high (default 0.0004)"
    )
    with pytest.raises(ValueError, match=r"has no options 'a', 'b'; its options: \(none\)$"):
        check_policy_loss_option_names("vanilla", {"a": 1, "b": 2})
    with pytest.raises(TypeError, match="^policy loss options must be a mapping of name -> value, got list$"):
        check_policy_loss_option_names("ppo", ["clip_low"])
    with pytest.raises(ValueError) as info:
        check_policy_loss_option_names("trpo", {})
    assert (
        str(info.value)
        == "unknown policy loss 'trpo'; registered: cispo, clip_cov, gspo, kl_cov, ppo, vanilla"
    )


def test_declaring_a_new_loss(monkeypatch):
    monkeypatch.setattr(spec_module, "_OPTIONS", dict(spec_module._OPTIONS))
    declare_policy_loss("test_only_loss", {"a": 1})
    assert policy_loss_options("test_only_loss") == {"a": 1}
    with pytest.raises(
        ValueError, match="^policy loss 'test_only_loss' is already registered; choose another"
    ):
        declare_policy_loss("test_only_loss", {})
    with pytest.raises(ValueError, match="^policy loss 'ppo' is already registered"):
        check_new_policy_loss_name("ppo")
