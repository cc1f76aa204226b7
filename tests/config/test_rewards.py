"""The reward sections of the config: component names, weights, the default that depends on an
environment, and the code sandbox's options."""

from __future__ import annotations

import pytest

from policygrad.config.rewards import CodeRewardConfig, RewardConfig, reward_component_names
from policygrad.config.sections import ConfigError

pytestmark = pytest.mark.unit


def test_component_names_number_repeated_entries_and_name_reward_models():
    names = reward_component_names(["a", "reward_model:/x", "a", "b", "a", "reward_model:/y"])
    assert names == ["a", "reward_model", "a#2", "b", "a#3", "reward_model#2"]
    assert reward_component_names([]) == []


def test_weights_must_match_the_functions_unless_the_functions_are_not_yet_resolved():
    RewardConfig(functions=["a", "b"], weights=[1.0, 2.0]).validate("reward")
    with pytest.raises(ConfigError, match=r"reward\.weights has 1 entries for 2 functions"):
        RewardConfig(functions=["a", "b"], weights=[1.0]).validate("reward")
    # None: resolved by TrainConfig (answer_correctness, or none with an environment).
    RewardConfig(functions=None, weights=[1.0]).validate("reward")


def test_weights_that_are_all_zero_are_refused():
    # Before: accepted; every score was 0 and the run ended saying every advantage was 0.
    with pytest.raises(ConfigError) as info:
        RewardConfig(functions=["a", "b"], weights=[0.0, 0.0]).validate("reward")
    assert str(info.value) == (
        "reward.weights=[0.0, 0.0] are all 0: every score would be 0, so no sample is told apart and nothing "
        "trains; give at least one function a non-zero weight"
    )
    RewardConfig(functions=["a", "b"], weights=[0.0, -1.0]).validate("reward")  # a penalty alone scores


def test_bad_reward_options_are_named():
    with pytest.raises(ConfigError, match=r"reward\.on_error"):
        RewardConfig(on_error="ignore").validate("reward")
    with pytest.raises(ConfigError, match=r"reward\.timeout_s"):
        RewardConfig(timeout_s=0).validate("reward")
    with pytest.raises(ConfigError, match=r"reward\.code\."):
        RewardConfig(code=CodeRewardConfig(isolation="chroot")).validate("reward")
