"""Tests of policygrad.config.training: the algorithm presets and the KL, loss, optimizer,
critic and dynamic-sampling sections (errors name the dotted field)."""

from __future__ import annotations

import pytest

from policygrad.config.sections import ConfigError
from policygrad.config.train import load_config
from policygrad.config.training import ALGORITHMS
from policygrad.core.advantages import list_advantage_estimators
from policygrad.core.losses import list_policy_losses
from policygrad.core.masking import AGGREGATION_MODES

pytestmark = pytest.mark.unit


def test_every_preset_names_registered_functions():
    for name, preset in ALGORITHMS.items():
        assert preset.estimator in list_advantage_estimators(), name
        assert preset.policy_loss in list_policy_losses(), name
        assert preset.loss_agg_mode in AGGREGATION_MODES, name


def test_kl_kind_defaults_by_placement():
    # k1 in the reward (unbiased KL per token), k3 in the loss (GRPO's estimator)
    assert load_config(None, ["--kl.placement=reward", "--kl.beta=0.1"]).kl.resolved_kind() == "k1"
    assert load_config(None, ["--kl.placement=loss", "--kl.beta=0.1"]).kl.resolved_kind() == "k3"
    assert (
        load_config(None, ["--kl.placement=loss", "--kl.beta=0.1", "--kl.kind=k2"]).kl.resolved_kind() == "k2"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--optim.lr=-1e-5"], "optim.lr must be > 0"),
        (
            ["--optim.schedule=step"],
            "optim.schedule='step' is not valid; choose one of ['constant', 'cosine', 'linear']",
        ),
        (["--kl.placement=loss"], "kl.placement='loss' with kl.beta=0 computes a KL that has no effect"),
        (["--kl.kind=k4"], "kl.kind='k4' is not valid; choose one of ['k1', 'k2', 'k3']"),
        (["--loss.agg_mode=mean"], "loss.agg_mode='mean' is not valid"),
    ],
)
def test_validation_errors_name_the_dotted_field(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--loss.entropy_coef=-5"], "loss.entropy_coef must be >= 0, got -5.0: it weights an entropy bonus"),
        (
            ["--algorithm=ppo", "--critic.lora.alpha=8"],
            "critic.lora.alpha=8.0 has no effect with critic.lora.rank=0",
        ),
        (
            ["--kl.controller=adaptive", "--kl.placement=none"],
            "kl.controller=adaptive with kl.placement='none': there is no KL for the controller to steer",
        ),
    ],
)
def test_settings_that_would_have_no_effect_are_refused(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


# Before: accepted, and loss.entropy_target=1e9 with a large delta let the coefficient reach 3e6;
# loss.positive_lm_coef=1e30 overflowed the gradient and the run blamed optim.lr.
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--loss.entropy_coef=1e30"], "loss.entropy_coef must be in [0, 100], got 1e+30: a bonus weighted"),
        (["--loss.entropy_coef=100.5"], "loss.entropy_coef must be in [0, 100], got 100.5"),
        (["--loss.positive_lm_coef=1e30"], "loss.positive_lm_coef must be in [0, 100], got 1e+30"),
        (
            ["--loss.entropy_target=0.2", "--loss.entropy_coef_delta=1e6"],
            "loss.entropy_coef_delta must be in (0, 1], got 1000000.0: the adaptive coefficient moves by it",
        ),
    ],
)
def test_loss_coefficients_are_bounded_above(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)
    # The largest allowed values pass.
    load_config(None, ["--loss.entropy_coef=100", "--loss.positive_lm_coef=100"])
    load_config(None, ["--loss.entropy_target=0.2", "--loss.entropy_coef_delta=1"])


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (
            ["--loss.clip_high=0.3", "--loss.options={clip_high: 0.28}"],
            ["loss.clip_high and loss.options.clip_high both set clip_high; set it in one place"],
        ),
    ],
)
def test_a_loss_option_set_in_both_places_is_refused(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            ["--drop_zero_variance_groups=true", "--dynamic_sampling.max_extra_rounds=-1"],
            "dynamic_sampling.max_extra_rounds must be >= 0, got -1",
        ),
    ],
)
def test_dynamic_sampling_validation(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert fragment in str(info.value)
