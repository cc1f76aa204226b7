"""Tests of policygrad.config.algorithm: the policy loss and its options, the advantage estimator,
its options and its minimum group size, checked when the config is built (errors name the field,
the loss or estimator and the fix)."""

from __future__ import annotations

import pytest
import yaml

from policygrad.config.algorithm import validate_estimator, validate_policy_loss
from policygrad.config.train import ConfigError, TrainConfig, load_config

pytestmark = pytest.mark.unit


def _yaml(tmp_path, data, name="cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


# ----------------------------------------------------------------------------- policy-loss options


def test_only_the_loss_options_the_user_set_reach_the_loss():
    cfg = load_config(None, [])
    assert (cfg.loss.clip_low, cfg.loss.clip_high, cfg.loss.dual_clip) == (None, None, None)
    assert cfg.loss_options == {}  # ppo keeps its own defaults (0.2 / 0.2, no dual clip)
    cfg = load_config(None, ["--loss.clip_high=0.28", "--loss.options={dual_clip: 3}"])
    assert cfg.loss_options == {"clip_high": 0.28, "dual_clip": 3}


def test_gspo_keeps_its_papers_defaults():
    # GSPO's sequence-ratio band (Zheng et al. 2025, section 5.1) is 3e-4 / 4e-4, not PPO's 0.2
    cfg = load_config(None, ["--loss.policy_loss=gspo", "--loss.agg_mode=seq-mean-token-mean"])
    assert cfg.loss_options == {}
    cfg = load_config(None, ["--loss.policy_loss=gspo", "--loss.options={clip_low: 2e-4}"])
    assert cfg.loss_options == {"clip_low": 2e-4}  # YAML 1.1 reads 2e-4 as a string: coerced


def test_cispo_explicit_null_means_no_upper_bound(tmp_path):
    path = _yaml(tmp_path, {"loss": {"policy_loss": "cispo", "options": {"clip_high": None}}})
    cfg = load_config(path)
    assert cfg.loss_options == {"clip_high": None}
    assert load_config(None, ["--loss.policy_loss=cispo", "--loss.options.clip_high=null"]) == cfg


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (
            ["--loss.policy_loss=gspo", "--loss.dual_clip=3"],
            [
                "loss.dual_clip: policy loss 'gspo' has no option 'dual_clip'; its options: "
                "clip_low (default 0.0003), clip_high (default 0.0004)",
                "unset loss.dual_clip",
            ],
        ),
        (
            ["--loss.policy_loss=vanilla", "--loss.options={eps: 0.1}"],
            ["loss.options.eps: policy loss 'vanilla' has no option 'eps'; its options: (none)"],
        ),
        (
            ["--loss.dual_clip=0.5"],
            [
                "loss.dual_clip=0.5 is not valid for policy loss 'ppo': "
                "dual_clip must be a finite number > 1",
                "its options: clip_low (default 0.2), clip_high (default 0.2), dual_clip (default None)",
            ],
        ),
        (
            ["--loss.options={clip_low: 1.5}"],
            [
                "loss.options.clip_low=1.5 is not valid for policy loss 'ppo'",
                "clip_low must be a finite number",
            ],
        ),
        (
            ["--loss.policy_loss=ppo", "--loss.options={clip_high: null}"],
            ["loss.options.clip_high=None is not valid for policy loss 'ppo'", "clip_high must be a number"],
        ),
        (
            ["--loss.policy_loss=trpo"],
            [
                "loss.policy_loss='trpo' is not valid; choose one of "
                "['cispo', 'clip_cov', 'gspo', 'kl_cov', 'ppo', 'vanilla']"
            ],
        ),
    ],
)
def test_loss_option_errors_name_the_field_the_loss_and_its_options(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for fragment in fragments:
        assert fragment in str(info.value)


# ----------------------------------------------------------------- estimator options and group sizes


def test_reinforce_pp_group_baseline_with_one_sample_per_prompt_is_refused():
    # REINFORCE++-baseline subtracts the group mean: with G = 1 that is the row's own reward,
    # so every advantage would be exactly 0.
    overrides = ["--algorithm=reinforce_pp", "--advantage.options={group_baseline: true}"]
    with pytest.raises(ConfigError) as info:
        load_config(None, [*overrides, "--rollout.group_size=1"])
    message = str(info.value)
    assert "algorithm='reinforce_pp' needs rollout.group_size >= 2" in message
    assert "advantage estimator 'reinforce_pp' with group_baseline=True" in message
    assert "set rollout.group_size >= 2 or change advantage.options.group_baseline" in message
    assert load_config(None, [*overrides, "--rollout.group_size=2"]).rollout.group_size == 2
    assert load_config(None, ["--algorithm=reinforce_pp", "--rollout.group_size=1"]).rollout.group_size == 1


def test_group_size_error_names_an_overriding_estimator():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--algorithm=reinforce", "--advantage.estimator=rloo", "--rollout.group_size=1"])
    message = str(info.value)
    assert "needs rollout.group_size >= 2 (advantage estimator 'rloo' compares samples" in message
    assert "got 1; set rollout.group_size >= 2" in message


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (
            ["--advantage.options={scael: none}"],
            [
                "advantage.options: advantage estimator 'grpo' has no option 'scael'; "
                "valid options: scale, eps, unbiased"
            ],
        ),
        (["--advantage.options={scale: std}"], ["advantage.options: grpo: unknown scale 'std'"]),
        (["--algorithm=ppo", "--advantage.options={lam: 1.5}"], ["advantage.options: gae: lam must be"]),
        (
            ["--algorithm=remax", "--advantage.options={baseline_rewards: 0.0}"],
            [
                "advantage.options: advantage estimator 'remax': 'baseline_rewards' is an input the trainer "
                "supplies, not an option"
            ],
        ),
        (
            ["--advantage.estimator=ppo"],
            ["advantage.estimator='ppo' is not valid; choose one of ['gae', 'grpo', "],
        ),
        (
            ["--advantage.estimator=gae"],
            ["advantage estimator 'gae' reads a critic's values, but there is no critic"],
        ),
    ],
)
def test_estimator_errors_are_caught_at_config_time(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for fragment in fragments:
        assert fragment in str(info.value)


# ----------------------------------------------------------------------------- the functions alone


def test_the_checks_run_on_a_built_config_and_raise_the_same_errors():
    # validate_* are what TrainConfig.validate calls; on a config changed after it was built
    # they raise the error building it would have raised.
    cfg = TrainConfig()
    validate_policy_loss(cfg)
    validate_estimator(cfg)
    cfg.loss.clip_low = 1.5
    with pytest.raises(ConfigError) as info:
        validate_policy_loss(cfg)
    assert str(info.value).startswith("loss.clip_low=1.5 is not valid for policy loss 'ppo': clip_low")
    cfg = TrainConfig()
    cfg.rollout.group_size = 1
    with pytest.raises(ConfigError) as info:
        validate_estimator(cfg)
    assert str(info.value) == (
        "algorithm='grpo' needs rollout.group_size >= 2 (advantage estimator 'grpo' compares samples of "
        "the same prompt), got 1; set rollout.group_size >= 2 or choose an estimator that does not "
        "compare samples of the same prompt"
    )
